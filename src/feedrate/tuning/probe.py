"""Measuring one setting from what the consumer pulls: the rate at which batches are taken and
the time spent waiting inside ``__next__``. Its clock is passed in (docs/design.md, "The
tuning loader").

A new loader first delivers what its workers queued while they started, at compute speed: the
window opens once that backlog is eaten, which the first real wait shows (a consumer that
waits has nothing queued), or after ``workers x prefetch_factor`` batches, or after a
window's length, whichever comes first. The wait and the length count only once every worker
delivered a batch (batches come in order, one a worker a round): while a wide pool still
starts, the consumer waits on its last workers' first batches, and a window opened there
reads the start-up, not the rate (docs/design.md, "A warm-up that ends when the backlog
does"). A window opens regardless ``LONGEST`` window lengths after the first batch. The window
is bounded in seconds, not steps, so a slow setting costs no more time than a fast one, and
one clearly slower than the best so far is left after half a window.

"Clearly slower" means slower *because of its loader*: the consumer waited for data at least
``HELD_BACK`` of the time. A consumer that hardly waited ran at its own speed, and on cores it
shares with the workers that speed drops while they start and fill their queues (``workers x
prefetch_factor`` batches made at once): a start-up cost, not the setting's steady rate. Such
a setting is measured over its whole window, never left half-way, and never in its warm-up,
whose rate bounds the steady one from above only where the loader, not the consumer, set it
(and that consumer's first wait opens the window).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from feedrate.costs import BatchCost, thread_clock
from feedrate.tuning.model import Costs
from feedrate.tuning.policy import Figure, Setting
from feedrate.tuning.spent import Spent

LEAVE_BELOW = 0.8  # of the best rate: a setting this much slower is left
HELD_BACK = 0.5  # of its time: a consumer that waited this much was held back by its loader
MIN_BATCHES = 4  # a window holds at least this many, if its time allows
LONGEST = 3.0  # a window that has not seen MIN_BATCHES ends at this many of its lengths


@dataclass
class _Tally:
    seconds: float = 0.0
    samples: int = 0
    batches: int = 0
    waited: float = 0.0


class Probe:
    """One setting's measurement: :meth:`took` after every batch; :attr:`done` when over."""

    def __init__(
        self,
        setting: Setting,
        *,
        window_s: float,
        best: float | None,
        clock: Callable[[], float],
        cpu: Callable[[], tuple[float, float]] | None = None,
        main_cpu: Callable[[], float] | None = time.process_time,
        loop_clock: Callable[[], tuple[float, float, float]] | None = thread_clock,
        step_threads: int = 0,
    ) -> None:
        self.setting, self.window_s, self.best = setting, window_s, best
        self.clock, self.cpu, self.main_cpu, self.loop_clock = clock, cpu, main_cpu, loop_clock
        self.spent = Spent()  # what the window's batches cost (loaders built with costs)
        self.step_threads = step_threads  # the training process's intra-op threads
        self.main_cpu_at: float | None = None
        self.loop_queued_at: float | None = None
        self.began = clock()
        self.startup_s: float | None = None  # building its loader to its first batch
        self.warm_from: float | None = None  # the first batch of this loader
        self.warm_batches = 0
        # its workers already run (:meth:`keep_running`): no start-up to measure or wait out
        self.running = False
        self.window_from: float | None = None  # the window's opening (this epoch's part)
        self.open = _Tally()  # the window's part in this epoch
        self.held = _Tally()  # its parts in epochs before (it pauses at each epoch end)
        self.cpu_at: tuple[float, float] | None = None
        self.cpu_busy = 0.0
        self.done = False
        self.left_early = False
        self._held_at: float | None = None  # the pass ended here (hold)

    @property
    def backlog(self) -> int:
        return self.setting.num_workers * self.setting.depth

    def took(self, waited: float, samples: int, cost: BatchCost | None = None) -> None:
        """A batch of ``samples`` arrived after the consumer waited ``waited`` seconds for it;
        ``cost``: what it cost its worker, where the loader says."""
        if self.done:
            return
        now = self.clock()
        if self.warm_from is None:
            if self.startup_s is None:
                self.startup_s = now - self.began
            self.warm_from = now
            if self.running:  # its queues are in their steady state already
                self._open(now)
            return
        if self.window_from is None:
            self._warming(now, waited, samples)
            return
        w = self.open
        w.samples, w.batches, w.waited = w.samples + samples, w.batches + 1, w.waited + waited
        w.seconds = now - self.window_from
        if cost is not None and cost.samples:
            self.spent.add(cost, waited)
        self._check(now)

    def _warming(self, now: float, waited: float, samples: int) -> None:
        mean = (now - self.warm_from) / self.warm_batches if self.warm_batches else 0.0
        waits = self.warm_batches >= 1 and waited > 0.25 * max(mean, 1e-3)
        self.warm_batches += 1
        # batches come in order, one a worker a round: this one is a second round's, so every
        # worker delivered once (started) and a wait now means nothing is queued
        started = self.warm_batches >= self.setting.num_workers
        warm_s = now - self.warm_from
        if (
            (started and (waits or warm_s >= self.window_s))
            or self.warm_batches >= self.backlog
            or warm_s >= LONGEST * self.window_s
        ):
            self._open(now)

    def _open(self, now: float) -> None:
        self.window_from = now
        self.cpu_at = self.cpu() if self.cpu is not None else None
        self.main_cpu_at = self.main_cpu() if self.main_cpu is not None else None
        self.loop_queued_at = self.loop_clock()[2] if self.loop_clock is not None else None

    def _slower(self, t: _Tally) -> bool:
        """Shown slower than the best: below ``LEAVE_BELOW`` of it, with the consumer held
        back by this loader (it waited ``HELD_BACK`` of the time or more). A consumer that
        hardly waited was slowed by something else: the cores the workers took."""
        if not self.best or t.seconds <= 0:
            return False
        held_back = t.waited >= HELD_BACK * t.seconds
        return held_back and t.samples / t.seconds < LEAVE_BELOW * self.best

    def _check(self, now: float) -> None:
        total = self._total()
        enough = total.batches >= MIN_BATCHES
        if (total.seconds >= self.window_s and enough) or total.seconds >= LONGEST * self.window_s:
            self.end()
        elif total.seconds >= self.window_s / 2 and enough and self._slower(total):
            self.end(left_early=True)

    def _total(self) -> _Tally:
        h, w = self.held, self.open
        return _Tally(
            h.seconds + w.seconds, h.samples + w.samples, h.batches + w.batches, h.waited + w.waited
        )

    def hold(self, at: float) -> None:
        """The pass ended at ``at``: its clock stops there until :meth:`go_on` (a short epoch
        is measured across its restart, not across what the loop does between passes)."""
        self._held_at = at

    def go_on(self) -> None:
        """The next pass began: the time since :meth:`hold` is left out."""
        held, self._held_at = self._held_at, None
        if held is None:
            return
        gap = max(0.0, self.clock() - held)
        self.began += gap
        if self.warm_from is not None:
            self.warm_from += gap
        if self.window_from is not None:
            self.window_from += gap

    def keep_running(self) -> None:
        """Its loader is the last setting's, its workers running (a split of threads on the
        same pool): nothing starts, so its window opens at its first batch."""
        self.running, self.startup_s = True, 0.0

    def pause(self) -> None:
        """The epoch ended: the window so far is held, and the next loader warms up again
        (an epoch's end and its restart are not the setting's steady state)."""
        self.running = False
        if self.window_from is not None:
            self.held = self._total()
            self._busy()
        self.open = _Tally()
        self.window_from = self.warm_from = None
        self.warm_batches = 0
        self.began = self.clock()

    def _busy(self) -> None:
        if self.main_cpu is not None and self.main_cpu_at is not None:
            self.spent.main_cpu_s += self.main_cpu() - self.main_cpu_at
            self.main_cpu_at = None
        if self.loop_clock is not None and self.loop_queued_at is not None:
            self.spent.main_queued_s += self.loop_clock()[2] - self.loop_queued_at
            self.loop_queued_at = None
        if self.cpu is not None and self.cpu_at is not None:
            busy, total = (b - a for a, b in zip(self.cpu_at, self.cpu(), strict=True))
            self.cpu_busy = max(self.cpu_busy, busy / total if total > 0 else 0.0)
            self.cpu_at = None

    def end(self, left_early: bool = False) -> None:
        """The measurement is over (its window, or the budget, ran out): what it saw stands."""
        self.pause()
        self.done, self.left_early = True, left_early

    def figure(self, seconds: float, failed: str = "") -> Figure:
        """What was measured; ``seconds``: what the setting cost, its start-up included."""
        if not self.done:
            self.pause()  # cut: what its window saw so far
        t = self.held
        rate = t.samples / t.seconds if t.seconds > 0 and t.samples else None
        return Figure(
            setting=self.setting,
            samples_per_sec=None if failed else rate,
            data_wait_frac=t.waited / t.seconds if t.seconds > 0 else 0.0,
            cpu_busy_frac=self.cpu_busy,
            seconds=seconds,
            startup_s=self.startup_s or 0.0,
            left_early=self.left_early,
            failed=failed,
            costs=None if failed else self.costs(),
        )

    def costs(self) -> Costs | None:
        """What a batch cost over the window, where its batches said (None: they did not)."""
        t = self.held
        return self.spent.costs(self.setting, t.seconds, t.waited, t.batches, self.step_threads)
