"""The tuning loader's session: the tuning itself. The climb (the policy) and the probe of the
setting measured now, what each setting measured, the choice and the seconds tuning took;
the clock, the cores' CPU, the memory and the ranks are passed in. Rank 0 decides; every rank
takes its decisions at the same step. Its ``state_dict`` is what a checkpoint keeps of it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch

from feedrate.distributed import Ranks
from feedrate.tuning.policy import UNTUNED, Choice, Climb, Figure, Setting
from feedrate.tuning.probe import Probe
from feedrate.tuning.setting import on_searched

log = logging.getLogger("feedrate.tuning")

MIN_BUDGET_S = 5.0  # less than this measures nothing worth choosing by


class TuningSession:
    """What the tuning measured and chose, and the setting that runs now (``current``).
    ``tell(event)`` hears ``"tuning_ended"`` and ``"tuning_started"``."""

    def __init__(
        self,
        climb: Climb,
        *,
        budget_s: float,
        window_s: float,
        ranks: Ranks,
        clock: Callable[[], float],
        cpu: Callable[[], tuple[float, float]] | None,
        memory: Callable[[], float | None] | None,
        preset: Any,
        tell: Callable[[str], None],
    ) -> None:
        self.climb, self.window_s, self.ranks = climb, window_s, ranks
        self.clock, self.cpu, self.memory, self.preset, self._tell = (
            clock,
            cpu,
            memory,
            preset,
            tell,
        )
        self.budget_s = self.budget_asked = float(budget_s)
        self.figures: list[Figure] = []
        self.current = climb.start
        self.choice: Choice | None = None
        self.tuning = self.budget_s >= MIN_BUDGET_S
        if not self.tuning:  # the start runs, untuned
            reason = f"budget_s={budget_s:g} below {MIN_BUDGET_S:g} s"
            self.choice = Choice(self.current, reason, False, UNTUNED)
        self.spent_s = 0.0  # tuning seconds so far (in earlier processes too, after a resume)
        self.samples_tuning = 0
        self.written: str | None = None
        self.earlier: list[dict] = []  # tunings before this one (retune)
        self.probe: Probe | None = None
        self._since = 0.0  # when the current setting's measurement began
        self._pass_from = 0.0  # when the loop's pass (an epoch) began

    # -- the clock of the tuning -----------------------------------------------------------

    def pass_started(self, now: float) -> None:
        """A pass began at ``now``: the time between passes (validation, say) is not
        measured."""
        self._pass_from = now
        if self.probe is not None:
            self.probe.go_on()

    def pass_ended(self, last_out: float, across: bool) -> None:
        """A pass ended with its last batch out at ``last_out``; ``across``: the window goes
        on across the epoch's end (short epochs), else it leaves the end and restart out."""
        if not self.tuning:
            return
        self.spent_s += last_out - self._pass_from  # what the loop did after is not tuning
        if self.probe is not None and not across:
            self.probe.pause()
        elif self.probe is not None:
            self.probe.hold(last_out)

    def spent_now(self) -> float:
        """Tuning seconds so far: the passes before, and this one up to now."""
        return self.spent_s + self.clock() - self._pass_from

    # -- measuring a setting ---------------------------------------------------------------

    def start_probe(self, setting: Setting) -> None:
        best = Climb.best(self.figures)
        if setting.main_threads:  # the step's share of the cores, as the setting says
            torch.set_num_threads(setting.main_threads)
        self.probe = Probe(
            setting,
            window_s=self.window_s,
            best=best.samples_per_sec / self.ranks.world_size if best else None,  # a rank's
            clock=self.clock,
            cpu=self.cpu,
            step_threads=torch.get_num_threads(),
        )
        self._since = self.clock()
        if not self.figures and self.ranks.is_main:
            log.info(
                "autotune_loader: tuning for up to %.0f s while training; %s first",
                self.budget_s - self.spent_s,
                setting.describe(),
            )

    def keep_pool(self) -> None:
        """The setting now differs from the last only in the step's threads: the last one's
        workers go on (nothing starts), the step takes its new threads."""
        if self.current.main_threads:
            torch.set_num_threads(self.current.main_threads)
        if self.probe is not None:
            self.probe.keep_running()

    def took(self, waited: float, samples: int, cost: Any, in_tail: bool) -> None:
        """The loop took a batch of ``samples`` after waiting ``waited`` s for it."""
        if not self.tuning:
            return
        self.samples_tuning += samples * self.ranks.world_size
        if self.probe is not None and in_tail:
            self.probe.pause()  # measured again after the next epoch's warm-up
        elif self.probe is not None:
            self.probe.took(waited, samples, cost)

    def measured(self) -> bool:
        """The current setting's measurement is over: its probe says so, or the budget is
        spent (what it measured so far is its figure)."""
        if self.probe is None:
            return False
        if not self.probe.done and self.spent_now() >= self.budget_s:
            self.probe.end()
        return self.probe.done

    # -- the decisions (rank 0's; every rank takes them at the same step) ------------------

    def next_setting(self) -> bool:
        """The current setting's measurement is over: record it and pick the next. True:
        another setting's loader takes over from here."""
        probe, self.probe = self.probe, None
        figure = probe.figure(self.clock() - self._since)
        if self.memory is not None:  # the whole tree's, its workers' with it
            figure = replace(figure, pss_mb=self.memory())
        if figure.samples_per_sec is not None:  # every rank's, as rank 0 runs in step with them
            figure = replace(figure, samples_per_sec=figure.samples_per_sec * self.ranks.world_size)
        return self._after(figure)

    def failed(self, reason: str) -> None:
        """The current setting's loader failed: recorded, and the next one picked."""
        figure = Figure(self.current, None, seconds=self.clock() - self._since, failed=reason)
        self.probe = None
        if self.ranks.is_main:
            log.warning("autotune_loader: %s failed: %s", self.current.describe(), reason)
        if not self.tuning:
            raise RuntimeError(f"the loader failed after tuning: {reason}")
        self._after(figure)

    def _after(self, figure: Figure) -> bool:
        figure = Figure.from_dict(self.ranks.share(asdict(figure)))  # rank 0's, on every rank
        self.figures.append(figure)
        if self.ranks.is_main:
            log.info("autotune_loader: %s", figure.describe())
        left = self.budget_s - self.spent_now()
        made = len(self.climb.predictions)
        nxt = self.climb.next(self.figures, left) if self.ranks.is_main else None
        _say_predictions(self.climb.predictions[made:])
        decision = self.ranks.share(None if nxt is None else nxt.as_dict())
        if decision is not None:
            self.current = Setting(**decision)
            self.start_probe(self.current)
            return True
        choice = self.climb.choose(self.figures) if self.ranks.is_main else None
        self.choice = Choice.from_dict(self.ranks.share(None if choice is None else asdict(choice)))
        self.spent_s, self.tuning = self.spent_now(), False
        self._tell("tuning_ended")
        if self.ranks.is_main:
            log.info(
                "autotune_loader chose %s: %s", self.choice.setting.describe(), self.choice.reason
            )
            if self.preset is not None and self._worth_a_preset():
                self.written = self.preset.write(self.choice, self.figures)
        switch = self.choice.setting != self.current
        self.current = self.choice.setting
        return switch

    def _worth_a_preset(self) -> bool:
        """The choice beats the start; or the start held, measured here for the first time
        (no preset recorded its rate) beside settings that all ran: written, so the next run
        checks it rather than tuning again. A start that held only because the others failed
        is no measurement of the data, and writes nothing."""
        assert self.choice is not None
        if self.choice.beats_start:
            return True
        return self.climb.recorded is None and not any(f.failed for f in self.figures)

    def retune(self, budget_s: float | None = None) -> bool:
        """Tune again from the setting now running, for up to ``budget_s`` more seconds (the
        first tuning's budget if None). What was measured before is kept in the report's
        ``earlier``. False: it does not (it is tuning already, or the budget is below
        ``MIN_BUDGET_S``)."""
        budget_s = self.budget_asked if budget_s is None else budget_s
        if self.tuning or budget_s < MIN_BUDGET_S:
            return False
        self.earlier.append(
            {"tried": [asdict(f) for f in self.figures], "chosen": asdict(self.choice)}
        )
        self.figures, self.choice, self.tuning = [], None, True
        self.budget_s = self.spent_s + budget_s
        self.climb = Climb(
            self.current, self.climb.machine, window_s=self.window_s, predicts=self.climb.predicts
        )
        self.probe = None
        self._tell("tuning_started")
        return True

    # -- what it says, and what a checkpoint keeps -----------------------------------------

    def report(self) -> dict:
        """What it tried, what each measured, and what it chose."""
        return {
            "budget_s": self.budget_s,
            "seconds": round(self.spent_s, 2),
            "samples_while_tuning": self.samples_tuning,
            "start": self.climb.start.as_dict(),
            "tried": [asdict(f) for f in self.figures],
            "chosen": self.choice.setting.as_dict() if self.choice else None,
            "reason": self.choice.reason if self.choice else "still tuning",
            "rule": self.choice.rule if self.choice else "",
            "preset": self.written,
            "earlier": self.earlier,
            "predictions": self.climb.prediction_report(self.figures),
        }

    def state_dict(self, in_pass: bool) -> dict:
        """What the tuning found, plain data; ``in_pass``: a pass is under way (its seconds
        so far count)."""
        return {
            "figures": [asdict(f) for f in self.figures],
            "current": self.current.as_dict(),
            "choice": None if self.choice is None else asdict(self.choice),
            "spent_s": self.spent_now() if in_pass and self.tuning else self.spent_s,
            "samples_while_tuning": self.samples_tuning,
            "written": self.written,
            "budget_s": self.budget_s,
            "earlier": self.earlier,
        }

    def load_state_dict(self, state: dict) -> None:
        self.probe = None
        self.figures = [Figure.from_dict(f) for f in state["figures"]]
        searched = self.climb.machine.engines  # the state's own may be left out now
        self.current = on_searched(Setting(**state["current"]), searched, "the state's")
        self.choice = Choice.from_dict(state["choice"]) if state["choice"] else None
        if self.choice is not None:
            chosen = on_searched(self.choice.setting, searched, "the state's choice")
            self.choice = replace(self.choice, setting=chosen)
        self.tuning = self.choice is None
        self.spent_s = float(state["spent_s"])
        self.samples_tuning = int(state["samples_while_tuning"])
        self.written = state.get("written")
        self.budget_s = float(state.get("budget_s", self.budget_s))
        self.earlier = list(state.get("earlier") or [])


def _say_predictions(made: list) -> None:
    """The log's line for each new prediction of the model (metrics.json holds them all)."""
    for _, prediction in made:
        log.info(
            "autotune_loader predicts %s: %s samples/s (%s)",
            prediction.setting.describe(),
            f"{prediction.samples_per_sec:,.1f}",
            prediction.why,
        )
