"""What the batches of one measured window said they cost (:mod:`feedrate.costs`), and what
they add up to: the :class:`~feedrate.tuning.model.Costs` the model predicts from. The tuning
loader's probe and a run's meter (``trainer.costs``, a sweep's trials) tally the same way."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from feedrate.costs import BatchCost, thread_clock
from feedrate.tuning.model import Costs
from feedrate.tuning.setting import Setting

STARVED = 0.3  # of the window: a loop that waited this much had no batch ready when it asked


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@dataclass
class Spent:
    """What a window's batches cost their workers, and the main process's CPU over it."""

    worker_s: list[float] = field(default_factory=list)  # each batch's time in its worker
    samples: int = 0
    worker_cpu_s: float = 0.0
    queued_s: float = 0.0
    collate_s: float = 0.0
    nbytes: int = 0
    waits: list[float] = field(default_factory=list)  # each batch's wait inside __next__
    main_cpu_s: float = 0.0  # the main process's, over the window
    main_queued_s: float = 0.0  # the loop's thread, ready to run but waiting for a core

    def add(self, cost: BatchCost, waited: float) -> None:
        self.worker_s.append(cost.read_s + cost.collate_s)
        self.samples += cost.samples
        self.worker_cpu_s += cost.read_cpu_s + cost.collate_cpu_s
        self.queued_s += cost.read_queued_s
        self.collate_s += cost.collate_s
        self.nbytes += cost.nbytes
        self.waits.append(waited)

    def costs(
        self, setting: Setting, seconds: float, waited: float, batches: int, step_threads: int = 0
    ) -> Costs | None:
        """A batch's costs over a window of ``seconds``, ``batches`` taken by the loop, which
        waited ``waited`` of it inside ``__next__``, its step on ``step_threads`` intra-op
        threads (None: no batch said what it cost)."""
        n = len(self.worker_s)
        if not n or not batches or seconds <= 0 or not self.samples:
            return None
        mean = sum(self.worker_s) / n
        in_process = setting.threads or not setting.num_workers
        # the main process's CPU is the step's, less the reads it did itself (threads, none)
        main_cpu = self.main_cpu_s - (self.worker_cpu_s * batches / n if in_process else 0.0)
        workers = setting.num_workers and not setting.threads
        stepping = max(0.0, seconds - waited)
        return Costs(
            batch_size=self.samples / n,
            worker_s=mean,
            worker_cpu_s=self.worker_cpu_s / n,
            queued_s=self.queued_s / n,
            collate_s=self.collate_s / n,
            tail=quantile(self.worker_s, 0.95) / mean if mean > 0 else 1.0,
            step_s=stepping / batches,
            step_cpu_s=max(0.0, main_cpu) / batches,
            step_queued_s=min(self.main_queued_s, stepping) / batches,
            # a loop that mostly waits has no batch ready when it asks: its waits are not
            # hand-offs
            handoff_s=(
                quantile(self.waits, 0.25) if workers and waited < STARVED * seconds else 0.0
            ),
            nbytes=self.nbytes / n,
            workers_cores=self.worker_cpu_s / seconds,
            measured_on=setting,
            batches=n,
            step_threads=step_threads,
        )


class Tally:
    """A run's costs over its measured steps (the meter's, ``trainer.costs``): the batch of
    the step under way, tallied once the meter measures that step, and the main process's
    CPU from the window's opening."""

    def __init__(
        self,
        setting: Setting,
        main_cpu: Callable[[], float] = time.process_time,
        loop_clock: Callable[[], tuple[float, float, float]] = thread_clock,
    ) -> None:
        self.setting, self.main_cpu, self.loop_clock = setting, main_cpu, loop_clock
        self.spent = Spent()
        self.pending: BatchCost | None = None  # the batch of the step under way's
        self.opened: tuple[float, float] | None = None  # main CPU, loop queued, at the opening

    def open(self) -> None:
        self.opened = (self.main_cpu(), self.loop_clock()[2])

    def step(self, measured: bool, waited: float) -> None:
        """The step under way is done; ``measured``: the meter counted it."""
        if measured and self.pending is not None:
            self.spent.add(self.pending, waited)
        self.pending = None

    def costs(self, seconds: float, waited: float, batches: int, threads: int) -> Costs | None:
        if self.opened is None:
            return None
        cpu, queued = self.opened
        self.spent.main_cpu_s = self.main_cpu() - cpu
        self.spent.main_queued_s = self.loop_clock()[2] - queued
        return self.spent.costs(self.setting, seconds, waited, batches, threads)
