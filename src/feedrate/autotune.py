"""``loader=autotune``: the loader tuned inside the real run (docs/design.md, "Tuning inside
the run").

The run trains from its first step. During the tuning phase (``trainer.autotune.budget_s``)
each candidate setting is a new DataLoader that goes on where the one before stopped in the
epoch: the resumable sampler starts its pass after the samples already trained, with the
epoch's shuffle, so no sample is skipped and none is trained twice, and every step is a real
training step. A resumable stream is read as fixed shares (:class:`feedrate.stream.Shares`),
which any worker count goes on from mid-epoch; a stream without a state switches at its
epoch ends.

The candidates and the decision follow the sweep's rules: first the run's own loader (what it
would have trained with), then seeds that differ in the worker count alone, then Optuna's
suggestions in the sweep's search space; each measured after its start-up backlog, in
steady-state windows. The best candidates are then re-measured in alternating rounds, and
among those no other is significantly faster than, the cheapest wins. A preset measured on
this machine and workload is only checked, not searched again. The winner runs to the end and
is written as a preset with ``measured_on``, which the next run's ``loader=auto`` picks.

Under torchrun rank 0 decides: it says at every step of the phase whether the candidate's
measurement is over, so every rank switches at the same step; the figure is rank 0's rate
times the ranks (DDP keeps them in step), measured with every rank's workers running.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from feedrate import distributed, provenance, stats
from feedrate.errors import ConfigError
from feedrate.meter import rate_of
from feedrate.metrics import noise
from feedrate.project import command

log = logging.getLogger(__name__)

# What a candidate sets, and what the sweep's search space suggests (its ``loader.`` keys)
# (not decode placement: it is built into the workload, not the loader)
TUNED = ("num_workers", "prefetch_factor", "pin_memory", "main_threads", "worker_threads")
# What a preset checked in the run brings along with them
CHECKED = (*TUNED, "persistent_workers", "multiprocessing_context")
PER_RANK = ("loader.num_workers", "loader.main_threads")  # presets say the machine's
DEFAULT_BUDGET_S = 60.0
MAX_BUDGET_S = 120.0
BUDGET_SHARE = 0.2  # of trainer.max_seconds, at most
SEARCH_SHARE = 0.6  # of the budget, at most, before the finalists' rounds
DEEPEST_PREFETCH = 8  # the search space's
# The switch kept back from the budget: twice the longest seen (stalls: 0.7 s after the cut,
# against 0.47 s the longest before it, and the phase ended at 60.2 s of 60)
SWITCH_MARGIN = 2.0


def _depth(params: dict) -> int:
    return int(params.get("loader.prefetch_factor") or 2)


def budget_seconds(trainer: DictConfig) -> float:
    """``trainer.autotune.budget_s``, or 60 s, at most a fifth of ``trainer.max_seconds``,
    at most 120 s."""
    asked = trainer.autotune.budget_s
    if asked is not None:
        return float(asked)
    budget = DEFAULT_BUDGET_S
    if trainer.max_seconds is not None:
        budget = min(budget, BUDGET_SHARE * trainer.max_seconds)
    return min(budget, MAX_BUDGET_S)


def check(cfg: DictConfig) -> None:
    """Refuse settings under which the run cannot tune, before anything is built."""
    at, problems = cfg.trainer.autotune, []
    if cfg.trainer.stream:
        problems.append(
            "trainer.stream=true repeats the data without epochs: loader=autotune tunes a"
            " training run, set trainer.stream=false"
        )
    if cfg.loader.auto:
        problems.append("loader=auto and loader.autotune=true: choose one")
    if at.budget_s is not None and at.budget_s <= 0:
        problems.append(f"trainer.autotune.budget_s={at.budget_s} must be positive, or null")
    if at.window_s <= 0:
        problems.append(f"trainer.autotune.window_s={at.window_s} must be positive")
    if at.whole_epochs_s is not None and at.whole_epochs_s < 0:
        problems.append(
            f"trainer.autotune.whole_epochs_s={at.whole_epochs_s} must be at least 0 (0: never),"
            " or null (a twelfth of the budget)"
        )
    if at.finalists < 1 or at.rounds < 0:
        problems.append(
            f"trainer.autotune.finalists={at.finalists} must be at least 1 and"
            f" trainer.autotune.rounds={at.rounds} at least 0"
        )
    if not 0 <= at.finalist_within < 1 or not 0 <= at.confirm_within < 1:
        problems.append("trainer.autotune.finalist_within and confirm_within must be in [0, 1)")
    if not 0 < at.equivalence < 1:
        problems.append(f"trainer.autotune.equivalence={at.equivalence} must be between 0 and 1")
    if at.max_workers is not None and at.max_workers < 1:
        problems.append(f"trainer.autotune.max_workers={at.max_workers} must be at least 1")
    if at.stall_s is not None and at.stall_s <= 0:
        problems.append(f"trainer.autotune.stall_s={at.stall_s} must be positive, or null")
    if problems:
        raise ConfigError("invalid loader=autotune:\n  - " + "\n  - ".join(problems))


@dataclass
class Candidate:
    """One loader setting: its ``loader.<key>`` values, and what measuring it gave."""

    name: str
    params: dict[str, Any]
    trial: int | None = None  # its Optuna trial, if the search suggested it
    search: float | None = None  # its first measurement, samples/s (the job's)
    rounds: dict[int, float] = field(default_factory=dict)  # final round -> samples/s
    waits: list[float] = field(default_factory=list)  # data-wait share of each measurement
    peak_mb: float | None = None
    failed: str = ""
    seconds: float = 0.0  # spent on it, start-up and warm-up included
    steps: int = 0
    epochs: bool = False  # its search figure was taken over whole epochs (restarts in)
    windowed: float | None = None  # its figure in windows, where measured again over epochs
    # Other processes kept the cores busy while it was measured (metrics.noise): why, and
    # its first figure once it is measured again
    noisy: str = ""
    noisy_figure: float | None = None

    @property
    def workers(self) -> int:
        return int(self.params.get("loader.num_workers") or 0)

    @property
    def figures(self) -> list[float]:
        return [v for v in [self.search, *self.rounds.values()] if v is not None]

    @property
    def median(self) -> float | None:
        return statistics.median(self.figures) if self.figures else None

    @property
    def seconds_each(self) -> float:
        """Its seconds a measurement so far (start-up and warm-up included; a windowed one it
        was measured again after counts)."""
        again = (self.windowed is not None) + (self.noisy_figure is not None)
        return self.seconds / max(1, len(self.figures) + again)

    def comparable(self, by_epochs: bool | None) -> list[float]:
        """Its figures taken the phase's way: over whole epochs (``by_epochs``), a search
        figure in windows is left out; the final rounds are all taken the phase's way."""
        search = [self.search] if self.search is not None and (self.epochs or not by_epochs) else []
        return [*search, *self.rounds.values()]

    def describe(self) -> str:
        shown = ", ".join(
            f"{k.split('.', 1)[1]}={v}" for k, v in self.params.items() if v is not None
        )
        return f"{self.name} ({shown})"

    def as_dict(self) -> dict:
        out = asdict(self)
        out["rounds"] = {str(k): v for k, v in self.rounds.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Candidate:
        data = dict(data)
        data["rounds"] = {int(k): v for k, v in (data.get("rounds") or {}).items()}
        return cls(**data)


def params_of(
    loader: DictConfig | dict, ranks: distributed.Ranks, keys: tuple[str, ...] = TUNED
) -> dict[str, Any]:
    """The tuned keys of a loader config, as ``loader.<key>`` parameters, for one rank (a
    config's ``num_workers`` and ``main_threads`` are the machine's, split between ranks,
    unless ``per_rank`` says they are each rank's)."""
    values = loader
    if isinstance(loader, DictConfig):
        values = OmegaConf.to_container(loader, resolve=True, enum_to_str=True)
    params = {f"loader.{k}": values.get(k) for k in keys if k in values}
    for key in PER_RANK:
        if params.get(key):
            split = distributed.workers_per_rank(params[key], ranks, bool(values.get("per_rank")))
            params[key] = split
    return params


def loader_config(base: DictConfig, params: dict[str, Any]) -> DictConfig:
    """``base`` (the run's loader) with a candidate's values on top; without workers, none
    of the worker-only settings."""
    merged = OmegaConf.merge(base, {k.split(".", 1)[1]: v for k, v in params.items()})
    if not merged.num_workers:
        merged.prefetch_factor, merged.persistent_workers = None, False
    return merged


def decide(
    candidates: list[Candidate], margin: float, by_epochs: bool | None = None
) -> tuple[Candidate, str]:
    """The winner and why, by the sweep's rule (:func:`feedrate.sweep.decide.decide`). With
    at least ``stats.MIN_ROUNDS`` paired final rounds of two or more finalists: the fastest,
    or a cheaper finalist (fewer workers, then less memory) whose whole simultaneous interval
    against it lies within ``margin``. Otherwise the fastest measured, with no claim made;
    where the phase was measured over whole epochs (``by_epochs``), by the figures taken so
    (:meth:`Candidate.comparable`): a window leaves the epoch's end and restart out."""
    from feedrate.sweep.decide import simultaneous

    ok = [c for c in candidates if not c.failed and c.figures]
    if not ok:
        raise ConfigError(
            "loader=autotune measured no candidate: every one failed ("
            + "; ".join(f"{c.name}: {c.failed}" for c in candidates)
            + "); see the log, or start from a loader that runs (loader=default)"
        )
    finals = [c for c in ok if len(c.rounds) >= stats.MIN_ROUNDS]
    if len(finals) >= 2:
        fastest = stats.fastest(finals, lambda c: c.rounds)  # by the paired rounds
        confidence = simultaneous(len(finals))  # as the sweep widens its intervals
        kept = [fastest]
        for c in finals:
            versus = stats.compare(c.rounds, fastest.rounds, confidence)
            if c is not fastest and versus is not None and versus.low >= 1 - margin:
                kept.append(c)
        # fewer workers, then less memory (unknown memory counts as the most)
        winner = min(kept, key=lambda c: (c.workers, c.peak_mb or float("inf")))
        others = [c.name for c in kept if c is not winner]
        rounds = len(fastest.rounds)
        if winner is not fastest:
            why = (
                f"the cheapest of those within {margin:.0%} of the fastest"
                f" ({', '.join([winner.name, *others])}; {rounds} paired rounds)"
            )
        elif others:
            why = (
                f"the fastest; within {margin:.0%} of it but no cheaper: {', '.join(others)}"
                f" ({rounds} paired rounds)"
            )
        else:
            why = (
                f"the fastest; no other finalist shown within {margin:.0%} of it"
                f" ({rounds} paired rounds)"
            )
        return winner, why
    alike = [c for c in ok if c.comparable(by_epochs)]
    pool = alike or ok  # every whole-epoch candidate failed: the windows are all there is
    winner = max(pool, key=lambda c: statistics.median(c.comparable(by_epochs) or c.figures))
    left_out = len(ok) - len(pool)
    return winner, (
        f"the fastest measured; no claim (fewer than {stats.MIN_ROUNDS} paired rounds of two"
        " finalists fitted the budget"
        + (
            f"; {left_out} measured only in windows left out, the rest over whole epochs)"
            if left_out
            else ")"
        )
    )


class Tuner:
    """The tuning phase of one run: which candidate trains now, when its measurement is
    over, what comes next, and the decision. Every rank holds one; rank 0's decides
    (:meth:`over`, :meth:`advance`) and the others follow it."""

    def __init__(
        self,
        cfg: DictConfig,
        ranks: distributed.Ranks,
        make_loader: Callable[[DictConfig], Any],
        preset_dir: Path | None,
        here: provenance.Here | None = None,
        measured_here: tuple[str, dict, dict] | None = None,
        state: dict | None = None,
        out_dir: Path | None = None,
        droppable: bool = False,
    ) -> None:
        self.cfg, self.at, self.ranks = cfg, cfg.trainer.autotune, ranks
        # a failed candidate is dropped and the run goes on (one process, map-style data)
        self.droppable = droppable
        self.make_loader = make_loader  # (loader config, seed) -> DataLoader
        self.threads = torch.get_num_threads()  # the run's own, where a candidate sets none
        self.here, self.out_dir = here, out_dir
        self.budget = budget_seconds(cfg.trainer)
        self.base_loader = cfg.loader
        self.preset_path: Path | None = None
        problem = None
        if preset_dir is not None and self.at.write_preset and ranks.is_main:
            from feedrate.sweep.preset import check_writable, preset_path

            try:  # refused before training, on every rank
                self.preset_path = preset_path(
                    preset_dir.parent, self._preset_name(), "trainer.autotune"
                )
                check_writable(self.preset_path, self.at.overwrite, "trainer.autotune")
            except ConfigError as exc:
                problem = str(exc)
        problem = distributed.broadcast(problem, ranks)
        if problem:
            raise ConfigError(problem)
        self.candidates: list[Candidate] = []
        self.phase = "search"
        self.round = 0
        self.order: list[int] = []  # the final round's remaining candidates (indices)
        self.spent = 0.0  # seconds of tuning before this process (a resumed run)
        self.samples = 0
        self.steps = 0
        self.chosen: Candidate | None = None
        self.reason = ""
        self.confirming: dict | None = None  # the preset measured here, while it is checked
        self.confirmed: str | None = None  # its name, once its check held
        self.cut = False  # the run ended during the phase: nothing written
        self.retunes = 0
        self.written: str | None = None
        self.history: list[dict] = []  # the phases before, when the run tuned again
        # Whether this phase's candidates are measured over whole epochs (whole_epochs_s):
        # None until one is, then True for the rest of the search and the finals; windows
        # (False) for finals that start with none so. Figures taken both ways do not compare.
        self.by_epochs: bool | None = None
        self._clock_start: float | None = None
        self._clock_end: float | None = None
        self._budget_cut = False  # the current measurement ended at the budget
        # The switch after a measurement (its batches closed, its workers ended): twice the
        # longest seen is kept back from the budget, so that the phase ends within it
        self._ended_at: float | None = None
        self._ending_s = 0.0
        self._shares: int | None = None
        self._study = None
        self._space_cfg = self._search_config()
        self.finalists: list[int] = []
        self.current: int | None = 0
        if state is not None:
            self._restore(state)
        elif measured_here is not None:
            name, settings, measured_on = measured_here
            self.phase = "confirm"
            self.confirming = {"preset": name, "samples_per_sec": measured_on["samples_per_sec"]}
            params = params_of(settings, ranks, CHECKED)
            self.candidates.append(Candidate(f"preset {name}", params))
        else:
            self.candidates.append(Candidate("start", params_of(cfg.loader, ranks)))

    # -- what the run asks ---------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.phase != "done"

    @property
    def candidate(self) -> Candidate:
        return self.candidates[self.current]

    def _left(self) -> float:
        """Seconds of the budget left for measuring: the switch at the phase's end (twice
        the longest seen, at most a tenth of the budget) is kept back."""
        return self.budget - self.elapsed() - self._ending_s

    def elapsed(self) -> float:
        """Seconds of tuning so far (this process's and a checkpoint's before it)."""
        if self._clock_start is None:
            return self.spent
        end = self._clock_end if self._clock_end is not None else time.perf_counter()
        return self.spent + end - self._clock_start

    def start(self) -> None:
        """The phase's clock starts with the first candidate's first step."""
        if not self.active:  # resumed after the phase: its seconds are the checkpoint's
            return
        self._clock_start = time.perf_counter()
        if self.ranks.is_main:
            log.info(
                "loader=autotune: tuning for up to %.0f s while training; %s first",
                self.budget - self.spent,
                self.candidate.describe(),
            )

    @property
    def workers_bound(self) -> int:
        """The most workers a candidate of this rank may have (the search's bound)."""
        return int(self._space_cfg.sweep.max_workers)

    @property
    def shares(self) -> int:
        """The shares a resumable stream is read as (:class:`feedrate.stream.Shares`): as many
        as the most workers a candidate may have, so that none sits idle; a checkpoint's, when
        the run resumed (its stream's position is in that many shares)."""
        if self._shares is None:
            self._shares = max(self.workers_bound, *(c.workers for c in self.candidates))
        return self._shares

    def loader_cfg(self, candidate: Candidate | None = None) -> DictConfig:
        return loader_config(self.base_loader, (candidate or self.candidate).params)

    def build(self, step: int = 0):
        """The current candidate's DataLoader (or the choice's), and its threads set. Its
        workers' seeds come from ``step``: a loader built mid-run does not draw the first
        one's augmentations again."""
        loader_cfg = self.loader_cfg()
        torch.set_num_threads(int(loader_cfg.main_threads or self.threads))
        if self.active and self.droppable and self.at.stall_s and loader_cfg.num_workers:
            if not loader_cfg.timeout:  # a stuck candidate fails instead of waiting forever
                loader_cfg = OmegaConf.merge(loader_cfg, {"timeout": float(self.at.stall_s)})
        return self.make_loader(loader_cfg, self.cfg.trainer.seed + step)

    def meter_config(self) -> DictConfig:
        """How a candidate is measured: the sweep's trial settings, in the run."""
        at = self.at
        best = max((c.search or 0.0 for c in self.candidates if not c.failed), default=0.0)
        searching = self.phase == "search" and best > 0
        return OmegaConf.create(
            {
                "warmup_steps": at.warmup_steps,
                "window_steps": at.window_steps,
                "steady_state": True,
                "max_seconds": at.window_s,
                # short epochs: over a whole one, its restart included; the phase's way once
                # decided, and the preset's check as the preset was measured (in windows)
                "whole_epochs_s": self.whole_epochs_s,
                "whole_epochs": False if self.phase == "confirm" else self.by_epochs,
                # a rank-0 figure, in this rank's samples/s
                "abandon_below": (
                    at.abandon_below * best / self.ranks.world_size if searching else None
                ),
                "stream": False,
                # the epochs' tails are left out: the lower of consumed and produced (over
                # whole epochs, what training consumed)
                "sustained": True,
                "abandon_warming": True,  # its warm-up trains the run too
            }
        )

    @property
    def whole_epochs_s(self) -> float:
        """Epochs that take at most this long are measured whole (0: never): a twelfth of the
        budget where ``whole_epochs_s`` is null, so that the phase still fits about a dozen
        measurements (seeds, the climb, the rounds) where each takes an epoch."""
        at = self.at
        return float(at.whole_epochs_s if at.whole_epochs_s is not None else self.budget / 12)

    def over(self, done: bool) -> bool:
        """Rank 0's ``done`` (its meter's measurement is over, or the budget is spent), on
        every rank."""
        if self.ranks.is_main and not done and self.phase in ("search", "final"):
            done = self._budget_cut = self._left() <= 0
        done = distributed.flag(done, self.ranks)
        if done and self.ranks.is_main and self.phase in ("search", "final"):
            self._ended_at = time.perf_counter()
        return done

    def measured(self, finished: dict, monitor: Any, steps: int, seconds: float) -> None:
        """The current candidate's measurement (a meter's ``finish()``) is over."""
        times = finished["times"]
        rate = rate_of(times, produced=True)  # what it sustains, not a queue drained
        c = self.candidate
        c.steps += steps
        c.seconds += seconds
        cut, self._budget_cut = self._budget_cut, False
        if cut and times.by_epochs and times.epochs_measured is None:
            rate = None  # cut inside its first whole epoch: windows would leave its end out
        if times.by_epochs and self.phase == "search":
            self.by_epochs = True  # the rest of the phase is measured so too
        if finished.get("abandoned"):
            c.failed = finished["abandoned"]  # clearly slower: not a finalist
        if rate is None and c.search is None and c.noisy_figure is not None:
            c.search = c.noisy_figure  # measured again for noise, cut: the first figure stands
        if rate is None and cut and c.figures:
            pass  # measured before; a round cut short pairs nothing
        elif rate is None and cut:
            first = "whole epoch's end" if times.by_epochs else "window"
            c.failed = c.failed or f"cut: the tuning budget ran out before its first {first}"
        elif rate is None:
            c.failed = c.failed or "nothing measured (the run's steps ran out first)"
        elif cut and self.phase == "final":
            pass  # a round cut short pairs nothing
        else:
            rate *= self.ranks.world_size
            if self.phase == "final":
                c.rounds[self.round] = rate
            elif c.search is None:
                c.search, c.epochs = rate, bool(times.by_epochs)
                self._note_noise(c, noise(getattr(monitor, "other_cpu_frac", None)))
            wait = sum(times.wait_s) / times.elapsed_s if times.elapsed_s > 0 else None
            if wait is not None:
                c.waits.append(wait)
        pss = getattr(monitor, "peak_since_mark", None)  # its own peak (trainer marks)
        if pss:
            c.peak_mb = max(c.peak_mb or 0.0, pss / 2**20)
        if self.ranks.is_main:
            shown = f"{rate:,.1f} samples/s" if rate is not None else "no figure"
            if rate is not None and times.epochs_measured is not None:
                shown += " over whole epochs"
            phase = f"round {self.round + 1}" if self.phase == "final" else self.phase
            searched = self.phase != "final"  # a final round's line: its figure alone
            log.info(
                "loader=autotune %s: %s -> %s%s (%.1f s)",
                phase,
                c.describe(),
                shown,
                f"; {c.failed}" if c.failed else f"; {c.noisy}" if c.noisy and searched else "",
                seconds,
            )
        if self._untold(c):
            from optuna.trial import TrialState

            if c.search is not None and not c.failed:
                self._study.tell(c.trial, c.search)
            else:
                self._study.tell(c.trial, state=TrialState.PRUNED)

    def failed(self, reason: str, steps: int = 0, seconds: float = 0.0) -> None:
        """The current candidate could not run (its workers died, memory ran out)."""
        c = self.candidate
        if "DataLoader timed out" in reason and not self.base_loader.timeout:
            reason += f" (trainer.autotune.stall_s={self.at.stall_s:g}: a worker stuck)"
        c.failed, c.steps, c.seconds = reason, c.steps + steps, c.seconds + seconds
        if self.ranks.is_main:
            log.warning("loader=autotune: %s failed: %s", c.describe(), reason)
        if self._untold(c):
            from optuna.trial import TrialState

            self._study.tell(c.trial, state=TrialState.FAIL)

    def _note_noise(self, c: Candidate, reasons: list[str]) -> None:
        """Its search figure was just taken: flag it if other processes kept the cores busy
        meanwhile. A second figure, taken because the first was so flagged, stands, flagged
        again if it is noisy too (the sweep's rule, ``sweep.trial.run_trial``)."""
        if c.noisy_figure is None:
            c.noisy = "; ".join(reasons)
        elif reasons:
            c.noisy = f"noisy twice: {'; '.join(reasons)}"
        else:
            c.noisy = f"measured again: the first figure ({c.noisy_figure:,.1f}) was noisy"

    def _untold(self, c: Candidate) -> bool:
        """Does ``c``'s measurement still owe its Optuna trial a figure? Not one measured
        again (its trial was told the first figure), nor a final round's."""
        searching = self._study is not None and self.phase == "search"
        measured_again = c.windowed is not None or c.noisy_figure is not None
        return searching and c.trial is not None and not measured_again

    def advance(self) -> bool:
        """Choose the next candidate (rank 0; the others receive it). False: the phase is
        over and ``chosen`` trains from now on."""
        if self.ranks.is_main:
            if self._ended_at is not None:  # what the switch took, up to here
                ending = time.perf_counter() - self._ended_at
                kept = SWITCH_MARGIN * ending
                self._ending_s = min(max(self._ending_s, kept), self.budget / 10)
                self._ended_at = None
            nxt = self._next()
            if nxt is None:
                self._finish()
            message = {
                "current": self.current,
                "candidates": [c.as_dict() for c in self.candidates],
                "phase": self.phase,
                "round": self.round,
                "chosen": self.chosen.name if self.chosen else None,
                "by_epochs": self.by_epochs,
            }
        else:
            message = None
        message = distributed.broadcast(message, self.ranks)
        if not self.ranks.is_main:
            self.candidates = [Candidate.from_dict(c) for c in message["candidates"]]
            self.current, self.phase, self.round = (
                message["current"],
                message["phase"],
                message["round"],
            )
            self.by_epochs = message["by_epochs"]
            self.chosen = next((c for c in self.candidates if c.name == message["chosen"]), None)
            if not self.active:
                self._clock_end = time.perf_counter()
        return self.active

    def drifted(self, meter: Any) -> bool:
        """``on_drift=retune``: the drift guard of the run's meter has warned (rank 0's
        guard, on every rank). Asked at epoch ends, after the phase."""
        if getattr(self.at.on_drift, "value", self.at.on_drift) != "retune":
            return False
        if self.retunes >= self.at.max_retunes:
            return False
        return self.over(bool(meter.drift is not None and meter.drift.episodes))

    def retune(self, finished: dict) -> None:
        """Tune again, from the setting chosen before; what the phase before found and what
        the run's meter measured since are kept in ``history``."""
        times = finished["times"]
        rate = times.samples / times.elapsed_s if times.elapsed_s > 0 else None
        self.history.append(
            {
                "candidates": [c.as_dict() for c in self.candidates],
                "chosen": self.chosen.as_dict() if self.chosen else None,
                "reason": self.reason,
                "seconds": round(self.elapsed(), 2),
                "rate_after": rate * self.ranks.world_size if rate else None,
            }
        )
        before = self.chosen or self.candidate
        self.retunes += 1
        self.candidates = [Candidate("current", dict(before.params))]
        self.phase, self.round, self.order, self.finalists = "search", 0, [], []
        self.chosen, self.reason, self.current = None, "", 0
        self.confirming = self.confirmed = None
        self.by_epochs = None
        self._study = None
        self.spent, self._clock_start, self._clock_end = 0.0, time.perf_counter(), None
        if self.ranks.is_main:
            log.warning(
                "loader=autotune: the input pipeline fell behind (the drift guard warned);"
                " tuning again, from %s (trainer.autotune.on_drift=retune)",
                before.describe(),
            )

    def conclude(self) -> None:
        """The run ended during the phase: decide on what was measured (on rank 0)."""
        if self.active and self.ranks.is_main:
            self.cut = True
            winner, why = decide(self.candidates, self.at.equivalence, self.by_epochs)
            self.reason = f"the run ended during the tuning phase: {why.split(' (')[0]}"
            self.chosen = winner
            self._finish()
        self.phase = "done"
        if self._clock_end is None:
            self._clock_end = time.perf_counter()

    # -- the plan ------------------------------------------------------------------------

    def _next(self) -> int | None:
        left = self._left()
        if self.phase == "confirm":
            c = self.candidate
            figure = self.confirming["samples_per_sec"]
            if (
                c.search is not None
                and not c.failed
                and c.search >= (1 - self.at.confirm_within) * (figure or 0)
            ):
                self.confirmed = self.confirming["preset"]
                self.reason = (
                    f"confirmed: {c.search:,.1f} samples/s, within"
                    f" {self.at.confirm_within:.0%} of the {figure:,.1f} it records"
                )
                return None
            shown = "failed" if c.failed or c.search is None else f"read {c.search:,.1f}"
            log.warning(
                "loader=autotune: %s %s, below %.0f%% of the %s samples/s it records: searching",
                c.name,
                shown,
                100 * (1 - self.at.confirm_within),
                f"{figure:,.1f}",
            )
            self.phase = "search"
        if left <= 0:
            return None
        if self.phase == "search":
            again = self._noisy_again(left)
            if again is not None:
                return again
            per = self._seconds_per_measurement()
            finals_cost = per * self.at.rounds * max(1, self.at.finalists)
            blocked = self._climb(left)  # its next step does not fit: the search ends
            searching = not blocked and (
                self._seeds_pending()
                or (self.elapsed() < SEARCH_SHARE * self.budget and left > finals_cost)
            )
            if searching and left >= per:  # a measurement still fits
                found = self._ask(left)
                if found is not None:
                    return found
            again = self._measure_again(left)
            if again is not None:
                return again
            self._start_finals()
        if self.phase == "final":
            return self._next_final()
        return None

    def _round_seconds(self, indices: list[int]) -> float:
        """What a final round of these candidates takes: each one's own seconds a
        measurement so far, not the median of every candidate's, which those abandoned in
        their warm-up pull down (10 ms synthetic data over whole epochs: finalists of 11.5
        and 11.7 s against a median of 6.2, so a round was started that the budget cut)."""
        return sum(self.candidates[i].seconds_each for i in indices)

    def _seconds_per_measurement(self) -> float:
        spent = [c.seconds for c in self.candidates if c.seconds > 0]
        return statistics.median(spent) if spent else self.at.window_s * 3

    def _climb(self, left: float) -> bool:
        """Latency-bound data scales past the top seed (reads that stall: 51 workers x
        prefetch 8 beat 32 x 2). After the seeds, once, the fastest with a deeper queue
        (prefetch x4, up to the search's 8): the seeds all prefetch 2, a queue that shallow
        does not ride out a worker's stall. Then, where threads are searched and the fastest
        runs the seeds' half of PyTorch's main threads (:meth:`_seed_threads`), once, it with
        PyTorch's own: a model heavy enough on the CPU may want them back. Then, while the
        fastest setting has the most workers tried yet, the next one tried is it with twice
        the workers (and the depth and threads that won), up to the search's bound. Each costs
        only that setting's own start-up. True where the next step would not be measured in
        the ``left`` seconds (a wide loader's start-up grows with its workers): the search
        ends there, since a suggestion of its own then mostly trains slower settings in the
        budget's last seconds (reads that stall: with 32 x 8 not fitting in 15 s, Optuna's
        2 x 8 trained 5.1 s at 199 samples/s against the 1,656 of the fastest)."""
        from feedrate.sweep.space import next_rung

        measured = [c for c in self.candidates if c.search is not None and not c.failed]
        if not measured or self._seeds_pending():
            return False
        best = max(measured, key=lambda c: c.search)
        if best.workers == 0:
            return False
        tried = [c.params for c in self.candidates]
        searched = [c.params for c in self.candidates if c.trial is not None]
        deeper = {
            **best.params,
            "loader.prefetch_factor": min(4 * _depth(best.params), DEEPEST_PREFETCH),
        }
        deepened = len({_depth(p) for p in searched}) > 1  # the seeds share the run's depth
        threads, own = best.params.get("loader.main_threads"), self._main_threads()
        thicker = {**best.params, "loader.main_threads": own}
        threaded = len({p.get("loader.main_threads") for p in searched}) > 1
        if not deepened and not self._tried(deeper, tried):
            params = deeper
        elif threads and own and threads < own and not threaded and not self._tried(thicker, tried):
            params = thicker
        else:
            widest = max(c.workers for c in self.candidates)  # failed ones count
            rung = next_rung(best.workers, widest, self.workers_bound)
            if rung is None:
                return False  # the climb is over: the search's own suggestions go on
            params = {**best.params, "loader.num_workers": rung}
        if self._tried(params, tried):
            return False
        need = self._predicted_seconds(params)
        if need > left:
            log.info(
                "loader=autotune: the climb's next step (%s) would take about %.0f s, more"
                " than the %.0f s left: the search ends there",
                ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in params.items()),
                need,
                left,
            )
            return True
        self._study.enqueue_trial(self._in_space(params))
        return False

    def _main_threads(self) -> int | None:
        """The run's own main-process threads for a rank (PyTorch's, unless the run set
        them), where the search has threads. Read when the run started: each candidate's
        loader sets its own (:meth:`build`), so the seeds' half would read as PyTorch's."""
        from feedrate.sweep.space import search_threads

        if not search_threads(self._space_cfg):
            return None
        return max(1, self.threads // self.ranks.local_world_size)

    def _seed_threads(self, workers: int) -> dict[str, int]:
        """The thread counts a seed with ``workers`` runs, where threads are searched:
        PyTorch's (a thread a core in the main process, one a worker), with half the main
        process's where the workers are at least a rank's cores, as they then compete with
        those threads for the cores. Every preset the sweep tuned on 2 cores has 1 main
        thread (stalls and synthetic 51 x 8, photos 8 x 1); on the stalling reads 32 x 2
        trained 1,526 samples/s with 2 and 1,999 with 1. Tried only after the seeds, that
        thinner step went unmeasured on slow days (photos: 4 seeds over whole epochs took
        50 s of 60, and 2 threads stayed at a data wait of 56%)."""
        from feedrate.sweep.space import default_threads, rank_cores

        own = self._main_threads()
        if own is None:
            return {}
        wide = workers >= rank_cores(self.ranks.local_world_size)  # as the seeds divide them
        return {**default_threads(), "loader.main_threads": max(1, own // 2) if wide else own}

    def _tried(self, params: dict, tried: list[dict]) -> bool:
        return any(self._same(t, params) for t in tried)

    def _predicted_seconds(self, params: dict) -> float:
        """What measuring ``params`` would take: its window, and a start-up that grows with
        the workers (each one starts and fills its queue), scaled from the widest setting
        measured with no more workers; else the median measurement's."""
        workers = int(params.get("loader.num_workers") or 0)
        known = [c for c in self.candidates if c.seconds > 0 and 0 < c.workers <= workers]
        if not known:
            return self._seconds_per_measurement()
        ref = max(known, key=lambda c: c.workers)
        window = self.at.window_s
        return window + max(ref.seconds - window, 0.0) * workers / ref.workers

    def _in_space(self, params: dict) -> dict:
        """``params`` a trial of the search can take (:func:`feedrate.sweep.space.in_space`)."""
        from feedrate.sweep.space import in_space

        space = {}
        for trial in self._study.get_trials(deepcopy=False):
            space.update(trial.distributions)
        return in_space(params, space)

    def _seeds_pending(self) -> bool:
        study = self._open_study()
        from optuna.trial import TrialState

        return bool(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def _ask(self, left: float) -> int | None:
        """The next suggestion of the search, new settings only (a suggestion measured
        already is told its figure again, at no cost) that can be measured in the ``left``
        seconds (one that cannot is pruned); None when it keeps repeating."""
        study = self._open_study()
        from optuna.trial import TrialState

        from feedrate.sweep.space import loader_search_space

        for _ in range(20):
            trial = study.ask()
            loader_search_space(self._space_cfg, trial)
            params = {k: v for k, v in trial.params.items()}
            twin = next((c for c in self.candidates if self._same(c.params, params)), None)
            if twin is None and self._predicted_seconds(params) > left:
                study.tell(trial, state=TrialState.PRUNED)  # its start-up would not fit
                continue
            if twin is None:
                name = f"trial {sum(c.trial is not None for c in self.candidates) + 1}"
                self.candidates.append(Candidate(name, params, trial=trial.number))
                self.current = len(self.candidates) - 1
                return self.current
            if twin.search is not None and not twin.failed:
                study.tell(trial, twin.search)
            else:
                study.tell(trial, state=TrialState.PRUNED)
        return None

    def _same(self, a: dict, b: dict) -> bool:
        full = params_of(self.base_loader, self.ranks)
        return {**full, **a} == {**full, **b}

    def _finalists(self) -> list[int]:
        """The candidates the final rounds would re-measure (indices): the fastest searched
        and those within ``finalist_within`` of it (the sweep's ``pick_finalists``)."""
        from feedrate.sweep.decide import pick_finalists

        ranked = sorted(
            (c for c in self.candidates if c.search is not None and not c.failed),
            key=lambda c: -c.search,
        )
        picked = pick_finalists(
            [(c.name, c.params, c.search) for c in ranked],
            self.at.finalists,
            self.at.finalist_within,
        )
        names = {name for name, _, _ in picked}
        return [i for i, c in enumerate(self.candidates) if c.name in names]

    def _rounds_run(self, finalists: list[int]) -> bool:
        """Final rounds are asked for, there are two finalists to pair, and a round fits."""
        if len(finalists) < 2 or not self.at.rounds:
            return False
        return self._left() >= self._round_seconds(finalists)

    def _noisy_again(self, left: float) -> int | None:
        """A search figure taken while other processes kept the cores busy (the sweep's
        ``noise`` rule) is measured again, once, where it matters and fits: after the seeds,
        when it reads below the fastest (noise only slows a run, so the fastest stands as it
        is) and its measurement fits in the ``left`` seconds. Reads that stall: the 32-worker
        seed read 390.6 samples/s once (1,059-1,475 in six other runs, other processes at
        30% of the cores over that run), so the climb went up from 8 workers and the run
        trained at 0.46x of the preset."""
        if self._seeds_pending():
            return None
        measured = [c for c in self.candidates if c.search is not None and not c.failed]
        if not measured:
            return None
        best = max(c.search for c in measured)
        doubtful = [c for c in measured if c.noisy and c.noisy_figure is None and c.search < best]
        for c in sorted(doubtful, key=lambda c: -c.search):
            if c.seconds_each > left:
                continue
            log.info(
                "loader=autotune: %s read %s samples/s, below the fastest, and %s: measured again",
                c.describe(),
                f"{c.search:,.1f}",
                c.noisy,
            )
            c.noisy_figure, c.search = c.search, None  # its way (epochs) is the new one's
            self.current = self.candidates.index(c)
            return self.current
        return None

    def _measure_again(self, left: float) -> int | None:
        """Figures over whole epochs and in windows do not compare: a window leaves the
        epoch's end and restart out. Where the phase went over to whole epochs after some
        candidates were measured in windows, and no final rounds will re-measure them all one
        way, the one that reads above every whole-epoch figure is measured again over whole
        epochs if that fits in the ``left`` seconds; if not, the choice leaves it out
        (:func:`decide`). Reads that stall, 312 batches an epoch: 32 x 2 read 2,202.3 in
        windows, 32 x 8 then 2,096.0 over whole epochs, and no round fitted to compare them."""
        if self.by_epochs is not True:
            return None
        finalists = self._finalists()
        if self._rounds_run(finalists):
            return None  # the rounds measure every finalist over whole epochs
        ok = [c for c in self.candidates if c.search is not None and not c.failed]
        whole = [c for c in ok if c.epochs]
        if not whole:
            return None
        bar = max(c.search for c in whole)
        above = [c for c in ok if not c.epochs and c.windowed is None and c.search > bar]
        if not above:
            return None
        c = max(above, key=lambda c: c.search)
        need = max(c.seconds_each, *(w.seconds_each for w in whole))  # an epoch at its pace
        if need > left:
            log.info(
                "loader=autotune: %s read %s samples/s in windows, above every figure over"
                " whole epochs; measuring it so (about %.0f s) does not fit the %.0f s left:"
                " the choice is made over whole epochs",
                c.describe(),
                f"{c.search:,.1f}",
                need,
                left,
            )
            return None
        log.info(
            "loader=autotune: %s read %s samples/s in windows, above every figure over whole"
            " epochs: measured again over whole epochs, as the others",
            c.describe(),
            f"{c.search:,.1f}",
        )
        c.windowed, c.search, c.epochs = c.search, None, False
        self.current = self.candidates.index(c)
        return self.current

    def _start_finals(self) -> None:
        self.finalists = self._finalists()
        names = [self.candidates[i].name for i in self.finalists]
        self.phase = "final"
        if self.by_epochs is None:
            self.by_epochs = False  # no candidate was measured whole: nor are the rounds
        self.round = 0
        rounds = self._rounds_run(self.finalists)
        self.order = list(self.finalists) if rounds else []
        if not rounds:
            self.round = self.at.rounds  # a round cut short pairs nothing: none starts
        if self.ranks.is_main and self.order:
            log.info(
                "loader=autotune: %d finalists (%s), re-measured in up to %d alternating rounds",
                len(self.finalists),
                ", ".join(names),
                self.at.rounds,
            )

    def _next_final(self) -> int | None:
        if not self.order:
            if len(self.finalists) < 2:
                return None
            self.round += 1
            if self.round >= self.at.rounds:
                return None
            # alternate, and reverse every other round, so drift hits everyone alike
            self.order = list(self.finalists if self.round % 2 == 0 else self.finalists[::-1])
            if self._left() < self._round_seconds(self.order):
                return None  # a round cut short pairs nothing
        self.current = self.order.pop(0)
        return self.current

    def _finish(self) -> None:
        self._clock_end = time.perf_counter()
        if self.chosen is None:
            self.chosen, why = decide(self.candidates, self.at.equivalence, self.by_epochs)
            self.reason = self.reason or why
        self.current = self.candidates.index(self.chosen)
        self.phase = "done"
        log.info(
            "loader=autotune chose %s after %.1f s (%d samples trained meanwhile): %s",
            self.chosen.describe(),
            self.elapsed(),
            self.samples,
            self.reason,
        )
        if self.cut:
            log.warning(
                "loader=autotune: the run ended during its tuning phase (%.0f s of a %.0f s"
                " budget): no preset written; give the run more steps or"
                " trainer.autotune.budget_s less",
                self.elapsed(),
                self.budget,
            )
        elif self.confirmed is None and self.preset_path is not None:
            self._write_preset()

    # -- the search's study --------------------------------------------------------------

    def _search_config(self) -> DictConfig:
        """The sweep's search space, as this run sees it: the candidates are measured between
        epoch ends (as the sweep streams), so persistence stays the run's; per rank."""
        from feedrate.sweep.space import max_workers, seed_workers

        cfg, at = self.cfg, self.at
        node = OmegaConf.create(
            {
                "sweep": {
                    "max_workers": at.max_workers,
                    "start_methods": [],
                    "tune_batch_size": False,
                    "batch_sizes": [],
                    "search_threads": at.search_threads,
                    "search_decode": False,
                },
                "trainer": {"stream": True, "measure": "train"},
            }
        )
        node.hardware, node.dataset, node.loader = cfg.hardware, cfg.dataset, cfg.loader
        local = self.ranks.local_world_size
        per_rank = max(1, max_workers(node) // local)
        # the sweep's seeds are the machine's worker counts: each rank runs its share
        self.seeds = sorted({min(per_rank, max(1, n // local)) for n in seed_workers(node)})
        node.sweep.max_workers = per_rank
        node.sweep.ranks_per_node = local  # from here on, the threads searched are a rank's
        return node

    def _open_study(self):
        if self._study is not None:
            return self._study
        import optuna

        from feedrate.sweep.space import loader_search_space, seed_settings

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        node, seeds = self._space_cfg, self.seeds
        sampler = optuna.samplers.TPESampler(seed=self.at.seed, n_startup_trials=len(seeds))
        self._study = optuna.create_study(direction="maximize", sampler=sampler)
        # A resumed run: the suggestions measured before, told again (their trial numbers
        # are this study's from now on), before the seeds still to come
        for c in (c for c in self.candidates if c.trial is not None):
            self._study.enqueue_trial(c.params)
            trial = self._study.ask()
            loader_search_space(node, trial)
            c.trial = trial.number
            # measured again: its first figure
            figure = next((f for f in (c.search, c.windowed, c.noisy_figure) if f), None)
            if figure is not None and not c.failed:
                self._study.tell(trial, figure)
            else:
                self._study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        same = seed_settings(node)
        # The most workers first: where they win (reads that wait), the best figure is then
        # known early, and the seeds far below it stop in their warm-up instead of training
        # the run at a fraction of its rate for a whole measurement (abandon_below)
        for workers in sorted(seeds, reverse=True):
            params = {"loader.num_workers": workers, **same, **self._seed_threads(workers)}
            if not any(self._same(c.params, params) for c in self.candidates):
                self._study.enqueue_trial(params)
        return self._study

    # -- the preset ----------------------------------------------------------------------

    def _preset_name(self) -> str:
        from feedrate.resolvers import default_preset_name

        return self.at.preset_name or "auto" + default_preset_name()

    def _write_preset(self) -> None:
        """The winner as a preset with where it was measured (``measured_on``); an older
        preset written here is replaced, one a person wrote is kept (checked at start)."""
        from feedrate.config import LoaderConfig
        from feedrate.project import packaged_config_dir
        from feedrate.sweep.preset import (
            AUTOTUNE_MARKER,
            check_plain_data,
            preset_values,
            render,
            write_preset,
        )

        winner, path = self.chosen, self.preset_path
        loader = OmegaConf.to_container(self.loader_cfg(winner), resolve=True, enum_to_str=True)
        local = self.ranks.local_world_size
        for key in ("num_workers", "main_threads"):  # the machine's, as presets say
            if loader.get(key) and not loader.get("per_rank"):
                loader[key] = loader[key] * local
        values = preset_values(loader, with_batch_size=False)
        for key in ("persistent_workers", "multiprocessing_context"):
            values.setdefault(key, loader.get(key))
        waits = winner.waits
        measured = {
            "machine": self.here.machine if self.here else {},
            "workload": self.here.workload if self.here else {},
            "samples_per_sec": round(winner.median, 1),
            "data_wait_frac": round(statistics.median(waits), 3) if waits else None,
            "peak_pss_mb": round(winner.peak_mb) if winner.peak_mb else None,
            "date": datetime.now().isoformat(timespec="seconds"),
            "study": f"autotune {self.out_dir}" if self.out_dir else "autotune",
        }
        name = path.stem
        header = [
            f"{command()} loader={name}",
            f"Measured {measured['date']} by loader=autotune inside the run {self.out_dir}.",
            f"Winner: {winner.describe()}, median {winner.median:,.1f} samples/s.",
            f"Decision: {self.reason}.",
            "Plain data: the DataLoader's own arguments on top of loader/default.yaml;"
            " measured_on is where it was measured, which loader=auto and loader=autotune read.",
        ]
        text = render(values, header, measured, marker=AUTOTUNE_MARKER)

        def verify() -> None:
            check_plain_data(path)
            dirs = [path.parent, packaged_config_dir() / "loader"]  # its defaults: feedrate's
            composed = OmegaConf.merge(
                OmegaConf.structured(LoaderConfig), provenance.preset_node(dirs, name)
            )
            for key, value in values.items():
                got = composed.get(key)
                got = getattr(got, "value", got)
                if got != value:
                    raise ConfigError(
                        f"the written preset loader={name} composes to {key}={got!r}, not {value!r}"
                    )

        try:
            write_preset(path, text, self.at.overwrite, verify)
        except (ConfigError, OSError) as exc:
            log.warning("loader=autotune could not write %s: %s", path, exc)
            return
        self.written = str(path)
        log.info("wrote %s; the next run's loader=auto starts from it (loader=%s)", path, name)

    # -- checkpoints and the report ------------------------------------------------------

    def state(self) -> dict:
        """What a checkpoint keeps: enough to go on tuning, or to run the choice."""
        return {
            "phase": self.phase,
            "round": self.round,
            "current": self.current,
            "candidates": [c.as_dict() for c in self.candidates],
            "finalists": list(self.finalists),
            "order": list(self.order),
            "chosen": self.chosen.name if self.chosen else None,
            "reason": self.reason,
            "spent_s": self.elapsed(),
            "samples": self.samples,
            "steps": self.steps,
            "confirming": self.confirming,
            "confirmed": self.confirmed,
            "written": self.written,
            "history": self.history,
            "cut": self.cut,
            "retunes": self.retunes,
            "shares": self._shares,
            "by_epochs": self.by_epochs,
        }

    def _restore(self, state: dict) -> None:
        self.candidates = [Candidate.from_dict(c) for c in state["candidates"]]
        self.phase, self.round = state["phase"], state["round"]
        self.finalists, self.order = list(state["finalists"]), list(state["order"])
        self.reason, self.confirming = state["reason"], state["confirming"]
        self.confirmed = state.get("confirmed")
        self.spent, self.samples, self.steps = state["spent_s"], state["samples"], state["steps"]
        self.written = state.get("written")
        self.history = list(state.get("history") or [])
        self.cut, self.retunes = bool(state.get("cut")), int(state.get("retunes") or 0)
        self._shares = state.get("shares")
        self.by_epochs = state.get("by_epochs")
        self.chosen = next((c for c in self.candidates if c.name == state["chosen"]), None)
        self.current = state["current"]
        if self.active and self.current is not None:
            c = self.candidates[self.current]  # its measurement was cut: measured again
            if self.phase == "final":
                c.rounds.pop(self.round, None)
                self.order.insert(0, self.current)
                self.current = self.order.pop(0)
            log.info("loader=autotune goes on tuning from %s (%.0f s spent)", c.name, self.spent)

    def report(self, rate_after: float | None) -> dict:
        """metrics.json's ``autotune``: what tuning cost and gave."""
        start = self.candidates[0]
        return {
            "budget_s": self.budget,
            "seconds": round(self.elapsed(), 2),
            "samples": self.samples,
            "steps": self.steps,
            "phase": self.phase,
            "candidates": [c.as_dict() for c in self.candidates],
            "chosen": self.chosen.as_dict() if self.chosen else None,
            "reason": self.reason,
            "confirmed": self.confirmed,  # the preset measured here, which still holds
            "first": start.name,
            "rate_before": start.median,
            # the run's figure after the phase; none when the run ended during it
            "rate_after": None if self.cut else rate_after,
            "retunes": self.retunes,
            "preset": self.written,
            "earlier": self.history,  # phases before this one (on_drift=retune)
        }


def summary(report: dict) -> str:
    """The log's account of the tuning: what it cost, each candidate's figure, the choice,
    and the rate before and after."""
    lines = [
        f"loader=autotune: {report['seconds']:.1f} s of tuning (budget {report['budget_s']:.0f} s),"
        f" {report['samples']:,} samples trained meanwhile, {report['steps']:,} steps"
    ]
    for c in report["candidates"]:
        figures = [c["search"], *c["rounds"].values()]
        shown = ", ".join(f"{v:,.1f}" for v in figures if v is not None) or "-"
        if c.get("windowed") is not None:  # measured again over whole epochs
            shown = f"{shown} (windows: {c['windowed']:,.1f})"
        if c.get("noisy_figure") is not None:  # measured again: the first was noisy
            shown = f"{shown} (noisy: {c['noisy_figure']:,.1f})"
        params = " ".join(
            f"{k.split('.', 1)[1]}={v}" for k, v in c["params"].items() if v is not None
        )
        failed = f"  ({c['failed']})" if c["failed"] else ""
        lines.append(f"  {c['name']:>10}: {shown:<28} samples/s  {params}{failed}")
    chosen = report["chosen"]
    if chosen is not None:
        lines.append(f"  chosen: {chosen['name']}: {report['reason']}")
    before, after = report["rate_before"], report["rate_after"]
    if before and after:
        lines.append(
            f"  samples/s with {report['first']}: {before:,.1f}; after the choice: {after:,.1f}"
            f" ({after / before:.2f}x, single measurements)"
        )
    if report["preset"]:
        lines.append(f"  written: {report['preset']}")
    return "\n".join(lines)
