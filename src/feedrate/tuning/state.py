"""What a checkpoint holds of a tuning loader, and how it goes on from one: where the epoch
is, what the tuning measured and chose (plain data, as ``StatefulDataLoader.state_dict``), and a
stream's position inside its epoch. The base of :class:`feedrate.tuning.TuningLoader`."""

from __future__ import annotations

import logging
from dataclasses import asdict, replace

from feedrate.errors import ConfigError
from feedrate.tuning.policy import Choice, Figure, Setting

log = logging.getLogger("feedrate.tuning")


class Saved:
    """``state_dict`` / ``load_state_dict``, ``stream_state`` / ``load_stream_state`` and
    ``report`` of a :class:`~feedrate.tuning.TuningLoader` (whose attributes they read)."""

    def stream_state(self) -> dict | None:
        """A stream's position inside its epoch: the running DataLoader's state, where it
        keeps one (a ``StatefulDataLoader`` over a stream with ``state_dict``); else None."""
        if not self.stream or not self._in_pass or not hasattr(self._loader, "state_dict"):
            return None
        return self._loader.state_dict()

    def load_stream_state(self, state: dict) -> None:
        """The next pass goes on from a :meth:`stream_state` (after :meth:`load_state_dict`,
        which says the setting it was taken with: the same workers read the rest)."""
        self._stream_state = state

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

    def state_dict(self) -> dict:
        """Where the epoch is and what the tuning found: plain data, for a checkpoint."""
        epoch, batches = self.epoch, self._pos
        if not self.stream and self._in_pass and batches >= len(self._plan.batches):
            epoch, batches = epoch + 1, 0  # its last batch is out: the next pass is the next epoch
        return {
            "epoch": epoch,
            "batches": batches,
            "seed": self.seed,
            "figures": [asdict(f) for f in self.figures],
            "current": self.current.as_dict(),
            "choice": None if self.choice is None else asdict(self.choice),
            "spent_s": self._spent_now() if self._in_pass and self.tuning else self.spent_s,
            "samples_while_tuning": self.samples_tuning,
            "written": self.written,
            "budget_s": self.budget_s,
            "earlier": self.earlier,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ConfigError(
                f"the state was saved with seed={state['seed']}, this loader has"
                f" seed={self.seed}: its epochs would be shuffled otherwise;"
                f" pass seed={state['seed']}"
            )
        self.close()
        self._probe = None
        self.epoch, self._pos = int(state["epoch"]), int(state["batches"])
        self._resuming = True
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


def on_searched(setting: Setting, searched: tuple[str, ...], whose: str) -> Setting:
    """``setting``, on the first engine searched where its own is left out here (threads, for
    data they cannot read, or not asked for), said."""
    if not setting.num_workers or setting.engine in searched:
        return setting
    log.warning(
        "autotune_loader: %s %s runs on an engine left out of the search here (engines: %s):"
        " it runs on %s instead",
        whose,
        setting.describe(),
        ", ".join(searched),
        searched[0],
    )
    return replace(setting, engine=searched[0])
