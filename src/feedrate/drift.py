"""The drift guard: in a long run, one warning when the input pipeline falls behind what it
did early in the run, or when the preset was measured (docs/design.md, "Drift")."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from feedrate.project import command


@dataclass
class DriftGuard:
    """Watches each measured window's data-wait share (the time the step waited for a batch,
    over the window's time). Once the median of the last ``windows`` windows is ``rise`` or
    more above the reference, :meth:`window` returns one warning; it warns again only after
    the share has come back below half that rise (an episode). The reference is the lower of
    the run's first ``windows`` windows and ``preset_wait``, what the preset measured."""

    rise: float
    windows: int = 5
    preset_wait: float | None = None
    episodes: int = 0
    _early: list[tuple[tuple[int, int], float]] = field(default_factory=list)
    _recent: deque = field(default_factory=deque)
    _behind: bool = False

    def window(self, steps: tuple[int, int], share: float) -> str | None:
        """A window of ``steps`` (first, last) spent ``share`` of its time waiting for data."""
        if len(self._early) < self.windows:
            self._early.append((steps, share))
        self._recent.append((steps, share))
        if len(self._recent) > self.windows:
            self._recent.popleft()
        references = self._references()
        if len(self._recent) < self.windows or not references:
            return None
        now = statistics.median(s for _, s in self._recent)
        reference, where = min(references)
        if self._behind:
            self._behind = now - reference >= self.rise / 2
            return None
        if now - reference < self.rise:
            return None
        self._behind = True
        self.episodes += 1
        first, last = self._recent[0][0][0], self._recent[-1][0][1]
        return (
            f"the input pipeline fell behind: the device waited for data {now:.0%} of the time"
            f" in steps {first}-{last} (median of {self.windows} windows), against"
            f" {reference:.0%} {where}. A cold page cache, a slower node or disk, or a noisy"
            " neighbour? cpu_util and the disk tell which; more workers or a deeper prefetch"
            f" may help, and {command(sweep=True)} re-tunes. Said once until it"
            " recovers <cfg.trainer.drift_rise>"
        )

    def _references(self) -> list[tuple[float, str]]:
        found = []
        if len(self._early) == self.windows:
            early = statistics.median(s for _, s in self._early)
            steps = f"{self._early[0][0][0]}-{self._early[-1][0][1]}"
            found.append((early, f"early in this run (steps {steps})"))
        if self.preset_wait is not None:
            found.append((self.preset_wait, "when the preset was measured"))
        return found
