"""What the device waited for: a training loop timed from outside it (docs/design.md, "How a
run is measured")."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from feedrate.checkpoint import Position
from feedrate.config import Measure
from feedrate.costs import BatchCost
from feedrate.drift import DriftGuard
from feedrate.tuning.model import Costs
from feedrate.tuning.probe import LONGEST
from feedrate.tuning.spent import Tally

log = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """Per-step timings of the measured (post-warm-up) phase."""

    wait_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    window_rates: list[float] = field(default_factory=list)  # samples/s per synchronised window
    samples: int = 0  # consumed by training
    produced: int | None = None  # produced by the workers in the same time (None: no workers)
    elapsed_s: float = 0.0


class WarmUp:
    """When the measured window may start: the steady state, not the start-up.

    All workers start at once and are handed ``num_workers * prefetch_factor`` batches (the
    start-up backlog). Until training has consumed that many, it eats batches queued while it
    was not yet asking, and workers still starting up make the rate lower than it will be.
    So the warm-up lasts ``min_steps``, or the backlog and then windows of ``window_steps``
    until two in a row agree within ``tolerance`` (at most ``max_windows``: then measuring
    starts anyway, ``settled`` False). The backlog is gone before it has all been eaten when
    training had to wait for a batch after every worker delivered once (``workers`` steps):
    the queue ran dry, so batches now come at the workers' pace. Waiting out the whole backlog
    there cost 46 workers x prefetch 8 of photos 70 s a run at 650 samples/s.
    Bounded in seconds (``max_s``: a sweep's trials), it ends as a tuning loader's window
    opens: once the queue ran dry, with no windows to agree, or ``max_s`` after the first step
    once every worker delivered (``LONGEST`` times it regardless): a wide pool still starting
    is not the rate it sustains.
    ``clock`` is passed in so tests can drive it.
    """

    def __init__(
        self,
        min_steps: int,
        backlog: int = 0,
        window_steps: int = 5,
        tolerance: float = 0.10,
        max_windows: int = 4,
        steady: bool = True,
        clock=time.perf_counter,
        sync=lambda: None,
        workers: int = 0,
        max_s: float | None = None,
    ) -> None:
        self.min_steps = min_steps
        # the longest it may last from the first batch, settled or not (None: no bound)
        self.max_s = max_s
        self.backlog = backlog if steady else 0
        self.workers = workers
        self.window_steps = max(1, window_steps)
        self.tolerance = tolerance
        self.max_windows = max_windows if steady else 0
        self.clock = clock
        self.sync = sync  # the device's queue drained before the clock is read (CUDA)
        self.steps = 0
        self.windows = 0
        self.settled: bool | None = False if steady else None  # None: not checked
        self.started_at = clock()
        self.seconds = 0.0
        self._window_start: float | None = None
        self._window_steps = 0
        self._last_rate: float | None = None
        self.rates: list[float] = []  # steps/s of each settling window
        self.cut = False  # the run ended before the warm-up did
        self.ended = False  # this rank's warm-up is over
        self._first_at: float | None = None  # the first step's end

    def update(self, waited: bool = False) -> bool:
        """One warm-up step done (``waited``: mostly waiting for its batch); True when the
        warm-up is over (measure from the next), and at every step after that."""
        self.steps += 1
        if self.ended:  # under torchrun, until every rank's is over
            return True
        started = self.steps > self.workers  # every worker delivered once
        drained = waited and started  # the queue ran dry: no backlog left
        if drained:
            self.backlog = min(self.backlog, self.steps)
        if self.max_s is not None:  # settled or not, as a tuning loader's window opens: once
            now = self.clock()  # the queue ran dry, or ``max_s`` after the first step once
            if self._first_at is None:  # every worker started (``LONGEST`` x it regardless)
                self._first_at = now
            elif self.steps >= self.min_steps and (
                drained or now - self._first_at >= self.max_s * (1.0 if started else LONGEST)
            ):
                return self._over()
        if self.steps < max(self.min_steps, self.backlog):
            return False
        if self.max_windows == 0:
            return self._over()
        if self._window_start is not None and self._window_steps + 1 < self.window_steps:
            self._window_steps += 1
            return False
        self.sync()
        now = self.clock()
        if self._window_start is None:
            self._window_start = now
            return False
        self._window_steps += 1
        span = now - self._window_start
        rate = self._window_steps / span if span > 0 else float("inf")
        self._window_start, self._window_steps = now, 0
        last, self._last_rate = self._last_rate, rate
        self.rates.append(rate)
        self.windows += 1
        if last is not None and abs(rate / last - 1.0) <= self.tolerance:
            self.settled = True
            return self._over()
        return self._over() if self.windows >= self.max_windows else False

    def _over(self) -> bool:
        self.seconds = self.clock() - self.started_at
        self.ended = True
        return True

    def follow(self) -> None:
        """Under torchrun: every rank's warm-up is over, so the job's is (the ranks open and
        close their windows at the same steps); this rank's lasted until now."""
        self._over()

    def cut_short(self) -> None:
        """The run ends before the warm-up could: measuring starts anyway, unsettled."""
        self._over()
        self.cut = True
        if self.settled is not None:
            self.settled = False

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "seconds": self.seconds,
            "backlog_batches": self.backlog,
            "settle_windows": self.windows,
            "settled": self.settled,
            "cut_short": self.cut,
        }


class Meter:
    """Warm-up, windows, the re-warm after a checkpoint, produced against consumed, first-batch
    and restart times, the window's loss and accuracy, and the progress bar's figures.

    The loop calls :meth:`start`, then per epoch :meth:`epoch_started`, per step
    :meth:`step_started`, :meth:`batch_arrived` and :meth:`step_done`, and
    :meth:`checkpoint_paused` after a save. ``sync`` drains the device and is called only when
    a window opens or closes; ``clock`` and ``produced`` (samples the workers made so far, or
    None) are passed in so tests can drive the meter without a loader or a device.
    """

    def __init__(
        self,
        cfg: Any,  # the trainer's config
        *,
        total: int,
        start: int,
        backlog: int,
        window_steps: int,
        measure: Measure,
        produced: Callable[[], int | None],
        monitor: Any,  # start_cpu_window() / end_cpu_window(), as metrics.ResourceMonitor
        device: torch.device | str = "cpu",
        sync: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.perf_counter,
        bar: Any = None,  # a tqdm bar, for the figures of each window
        drift: DriftGuard | None = None,  # told each window's data-wait share
        workers: int = 0,  # the loader's: the warm-up's backlog ends once the queue runs dry
        agree: Callable[[bool], bool] = lambda mine: mine,
        agree_all: Callable[[bool], bool] = lambda mine: mine,
        tally: Tally | None = None,  # what the measured batches cost (trainer.costs)
    ) -> None:
        self.cfg, self.total, self.measure = cfg, total, measure
        # Under torchrun, rank 0's decision on every rank (feedrate.distributed.Ranks.agree): when
        # measuring is over, so every rank measures the same steps and the job's rate is a
        # sum over one window. Called at the same steps on every rank.
        self.agree = agree
        # ... and whether every rank's warm-up is over (feedrate.distributed.Ranks.every): the
        # window opens once no rank still eats its start-up backlog, not at rank 0's word
        self.agree_all = agree_all
        # A measured window is at least num_workers steps (the caller's ``window_steps``):
        # workers started together deliver in bursts, and a window must see each deliver.
        self.window_steps = max(1, window_steps)
        self.drift = drift
        self.produced, self.monitor, self.bar = produced, monitor, bar
        self.sync, self.clock = sync, clock
        # Steps before measuring: enough to rebuild the pipeline, and at least one measured step
        self.warmup = min(cfg.warmup_steps, total - start - 1)
        self.warm = WarmUp(
            self.warmup,
            backlog=backlog,
            window_steps=window_steps,
            steady=cfg.steady_state,
            clock=clock,
            sync=sync,
            workers=workers,
            max_s=cfg.warmup_max_s,
        )
        self.times = StepTimes()
        self.first_batch_s = float("nan")
        self.restarts: list[float] = []
        self.final_loss = self.train_accuracy = float("nan")
        self.abandoned = ""  # why measuring ended before its time (trainer.abandon_below)
        self.done = False  # measuring is over: out of time, or abandoned
        self._loss_sum = torch.zeros((), device=device)
        self._correct = torch.zeros((), device=device, dtype=torch.long)
        self._seen = 0  # samples behind the window's loss
        self._scored = 0  # ... and its accuracy (those whose step gave logits and labels)
        self._warm_end: int | None = None  # the step after which the clock runs
        self._measure_start = 0.0
        self._produced_at_start: int | None = None
        # A checkpoint pauses training while workers go on filling their queues: the steps
        # after it would eat that backlog at compute speed. So a save closes the window, and
        # measuring resumes after a fresh warm-up; what workers produced meanwhile is not
        # counted.
        self._rewarm_until = -1
        self._produced_paused_at: int | None = None
        self._produced_gap = 0
        self._window_start = 0.0
        self._window_samples = self._window_steps = 0
        self._window_wait = 0.0
        # Measured steps are timed end to end, so the gaps between epochs (a new iterator,
        # workers restarting) count as waiting for data, and step times add up to wall time.
        self._t_prev_end: float | None = None
        self._t0 = self._t1 = self._t_iter = 0.0
        self._first = self._first_epoch = True
        self._epochs = 0
        self._step = start  # the last step done
        self._measured = False  # the last step was measured
        self.tally = tally

    # -- the loop's calls ------------------------------------------------------------------

    def start(self, step: int) -> None:
        """Before the first step: with no warm-up (resumed one step before the end), the
        clock starts now."""
        if self.bar is not None and self.warmup > 0:  # the figures come per window
            self.bar.set_postfix_str("warming up: unmeasured until the rate settles", refresh=False)
        if self.warmup == 0:
            self._warm_end = step
            self._window_start = self._begin_measuring()

    def take_over(self, before: Meter) -> None:
        """Measuring starts anew where ``before`` measured (``loader=autotune``'s choice runs
        from here, mid-epoch): the run's first batch and its epoch restarts are what
        ``before`` saw, and an epoch's first batch still awaited is awaited here."""
        self.first_batch_s, self.restarts = before.first_batch_s, list(before.restarts)
        self._t_iter, self._epochs = before._t_iter, before._epochs
        self._first, self._first_epoch = before._first, before._first_epoch

    def epoch_started(self) -> None:
        """Before ``iter(loader)``: first_batch_s (and each restart) runs from here."""
        self._t_iter = self.clock()
        # the run's first batch: an epoch resumed at its very end (a checkpoint taken at an
        # epoch's last step) yields none, and the next epoch's first batch is it
        self._first, self._first_epoch = True, math.isnan(self.first_batch_s)
        self._epochs += 1

    def step_started(self) -> None:
        self._t0 = self._t_prev_end if self._t_prev_end is not None else self.clock()

    def batch_arrived(self) -> None:
        self._t1 = self.clock()
        if self._first:
            if self._first_epoch:
                self.first_batch_s = self._t1 - self._t_iter
                if self._warm_end is None:  # workers are up: their memory, read off the window
                    self.monitor.sample_soon()
            else:
                self.restarts.append(self._t1 - self._t_iter)
            self._first = False

    def batch_cost(self, cost: BatchCost | None) -> None:
        """What the batch that just arrived cost its worker (a loader built with costs);
        tallied where its step is measured."""
        if self.tally is not None:
            self.tally.pending = cost

    def step_done(
        self,
        step: int,
        samples: int,
        loss: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> bool:
        """Step ``step`` (counted from 1) trained ``samples``; True once measuring is over."""
        self._step = step
        if loss is not None:
            self._loss_sum += loss.detach().float() * samples
        if logits is not None and targets is not None:  # a step that gives them: accuracy
            self._correct += (logits.detach().argmax(1) == targets).sum()
            self._scored += targets.numel()  # a label a sample, or one a pixel or token
        self._seen += samples
        if self._warm_end is None:
            now = self.clock()  # did the step wait for its batch most of the time?
            waited = self._t1 - self._t0 > 0.5 * (now - self._t0)
            settled = self.warm.update(waited)
            if self.agree_all(settled):
                self._warm_end = step
                self.warm.follow()
            elif step >= self.total - 1:  # one step left: measure it anyway
                self._warm_end = step
                self.warm.cut_short()
                log.warning(
                    "the run ends before its warm-up (%d steps so far, a start-up backlog of %d"
                    " batches): 1 step measured, and it may include start-up. Raise"
                    " trainer.max_steps, or set trainer.steady_state=false <cfg.trainer>",
                    self.warm.steps,
                    self.warm.backlog,
                )
        measured_step = step - self._warm_end if self._warm_end is not None else -1
        restart = step == self._rewarm_until  # the warm-up after a checkpoint is over
        self._measured = measured_step > 0 and step > self._rewarm_until
        if measured_step == 0 or restart:  # warm-up over: start the clock, device quiet
            self._open(restart)
        elif self._measured:
            self._record(step, samples)
        if self.tally is not None:
            self.tally.step(self._measured and not restart, self._t1 - self._t0)
        return self.done

    def checkpoint_paused(self, step: int, extra: int = 0) -> None:
        """A checkpoint was saved after ``step`` (every rank pauses, under torchrun for rank
        0's save): close the window; measuring resumes after a fresh warm-up, ``extra``
        steps longer. Asked again before measuring resumed, the longer of the two holds."""
        if self._warm_end is not None and not self._measured:
            self._rewarm_until = max(self._rewarm_until, step + self.cfg.warmup_steps + extra)
            return
        if not self._measured:
            return
        if self._window_steps >= max(2, self.window_steps // 2):
            span = self._t_prev_end - self._window_start
            self.times.window_rates.append(self._window_samples / span)
        self._window_samples = self._window_steps = 0
        self._window_wait = 0.0
        self._produced_paused_at = self.produced()
        self._rewarm_until = step + self.cfg.warmup_steps + extra

    def finish(self) -> dict:
        """Measuring over: what :class:`~feedrate.trainer.TrainResult` reports of it. A window
        still open (a stream that ended before its length's estimate said) is closed."""
        if self._measured and self._window_steps > 0:
            self.sync()
            now = self.clock()
            self.times.elapsed_s += now - self._t_prev_end
            self._close(now, None)
        self.monitor.end_cpu_window()
        return {
            "costs": self._costs(),
            "times": self.times,
            "first_batch_s": self.first_batch_s,
            "epoch_restart_s": self.restarts,
            "final_loss": self.final_loss,
            "train_accuracy": self.train_accuracy,
            "warmup": self.warm.as_dict(),
            "abandoned": self.abandoned,
            "drift_warnings": self.drift.episodes if self.drift is not None else 0,
        }

    # -- inside ----------------------------------------------------------------------------

    def _begin_measuring(self) -> float:
        """Warm-up over: the device quiet, memory sampled, then the clock starts."""
        self.sync()
        self.monitor.start_cpu_window()  # samples memory: before the clock starts
        self._measure_start = self.clock()
        if self.tally is not None:
            self.tally.open()
        if self.measure is not Measure.compute:
            self._produced_at_start = self.produced()
        return self._measure_start

    def _open(self, restart: bool) -> None:
        if restart:
            self.sync()
            now_produced = self.produced()
            if now_produced is not None and self._produced_paused_at is not None:
                self._produced_gap += now_produced - self._produced_paused_at
        else:
            self._begin_measuring()
        self._window_start = self._t_prev_end = self.clock()
        if not self.times.window_rates and self.bar is not None:
            self.bar.set_postfix_str("measuring: figures at each window's end")
        self._reset_loss()

    def _record(self, step: int, samples: int) -> None:
        cfg, times = self.cfg, self.times
        t2 = self.clock()
        # Out of time ends measuring at a window's end, not at the step the clock runs out:
        # workers started together deliver in bursts, one batch each, then all wait again; a
        # step cut off there is one batch for a whole burst's wait (32 workers: 0.6 s for 64
        # samples, 0.81 of the steady rate in a 3 s trial).
        window_end = self._window_steps + 1 >= self.window_steps or step == self.total
        if window_end:
            self.sync()
            t2 = self.clock()
        out_of_time = cfg.max_seconds is not None and t2 - self._measure_start >= cfg.max_seconds
        wait = self._t1 - self._t0
        times.wait_s.append(wait)
        times.step_s.append(t2 - self._t0)
        times.samples += samples
        self._window_samples += samples
        self._window_steps += 1
        self._window_wait += wait
        self._t_prev_end = t2
        if window_end:
            self._close(t2, step)
        times.elapsed_s += t2 - self._t0  # the measured steps' own time, pauses left out
        if window_end:
            if cfg.abandon_below is not None:
                self.abandoned = clearly_below(times, cfg.abandon_below, sustained(cfg))
            self.done = self.agree(self.done or out_of_time or bool(self.abandoned))

    def _close(self, t2: float, step: int | None) -> None:
        span = t2 - self._window_start
        if self.drift is not None and step is not None and span > 0:
            steps = (step - self._window_steps + 1, step)
            warning = self.drift.window(steps, self._window_wait / span)
            if warning:
                log.warning(warning)
        produced = self.produced() if self._produced_at_start is not None else None
        if produced is not None:  # None: the loader has no workers now (a tuner switched it)
            self.times.produced = produced - self._produced_at_start - self._produced_gap
        # A last window cut short by the clock or the step limit is too short to stand alone
        # in the spread; its samples still count in the totals.
        if self._window_steps >= max(2, self.window_steps // 2) or not self.times.window_rates:
            self.times.window_rates.append(self._window_samples / span)
        if self.measure is not Measure.loader:  # no model ran: no loss to report
            self.final_loss = self._loss_sum.item() / max(self._seen, 1)
            scored = self._scored
            self.train_accuracy = self._correct.item() / scored if scored else None
        if self.bar is not None:
            self.bar.set_postfix(
                {
                    "samples/s": f"{self._window_samples / span:,.0f}",
                    "wait": f"{self._window_wait / span:.0%}",
                    "loss": f"{self.final_loss:.3f}",
                },
                refresh=False,
            )
        self._reset_loss()
        self._window_samples = self._window_steps = 0
        self._window_wait = 0.0
        self._window_start = t2

    def _costs(self) -> Costs | None:
        """What a batch cost over the measured steps, where the loader said; their time
        includes every pause a checkpoint made, so a run that saved while measuring has none."""
        if self.tally is None or self._rewarm_until >= 0:
            return None
        t = self.times
        waited, threads = sum(t.wait_s), torch.get_num_threads()
        return self.tally.costs(t.elapsed_s, waited, len(t.step_s), threads)

    def _reset_loss(self) -> None:
        self._loss_sum.zero_()
        self._correct.zero_()
        self._seen = self._scored = 0


def sustained(cfg: Any) -> bool:
    """Is the rate the lower of consumed and produced? Where the workers never idle for want
    of indices: a stream (the sweep's trials). There a queue drained during the window
    cannot pass for throughput: reads that stall one time in 40, 32 workers x 2: a 2.7 s
    window ate 2,705 samples/s from the backlog of batches in order behind a stalled one, a
    rate the setting then sustained at 1,320."""
    return bool(cfg.stream)


def rate_of(times: StepTimes, produced: bool) -> float | None:
    """Samples/s over the measured time: consumed, or with ``produced`` (:func:`sustained`)
    the lower of that and what the workers produced meanwhile. None: nothing measured."""
    if times.elapsed_s <= 0:
        return None
    rate = times.samples / times.elapsed_s
    if produced and times.produced is not None:
        rate = min(rate, times.produced / times.elapsed_s)
    return rate


def clearly_below(times: StepTimes, floor: float, produced: bool) -> str:
    """Why a sweep trial can stop measuring now: after 1 s and two windows, its running rate
    (:func:`rate_of`) is below ``floor`` (the sweep's: half its best trial). Empty while it
    may still catch up."""
    if times.elapsed_s < 1.0 or len(times.window_rates) < 2:
        return ""
    rate = rate_of(times, produced)
    if rate >= floor:
        return ""
    return (
        f"ended early after {times.elapsed_s:.1f} s measured: {rate:,.1f} samples/s,"
        f" below trainer.abandon_below={floor:,.1f}"
    )


@dataclass
class TrainResult:
    """What a training run measured (:func:`feedrate.trainer.train`)."""

    times: StepTimes
    first_batch_s: float
    epoch_restart_s: list[float]
    steps: int
    epochs_started: int
    final_loss: float
    train_accuracy: float | None  # None: the step gave no logits and labels
    position: Position  # where training stopped: what the final checkpoint records
    warmup: dict = field(default_factory=dict)  # how the warm-up ended (WarmUp.as_dict)
    abandoned: str = ""  # why measuring stopped early, if it did
    drift_warnings: int = 0  # times the input pipeline fell behind (feedrate.drift)
    trained_samples: int = 0  # by this process, warm-up (and tuning) included
    train_seconds: float = 0.0  # from the first step's start to the last one's end
    costs: Costs | None = None  # what a measured batch cost its worker (trainer.costs)


class RunMeter:
    """The run's meter: the one object the loop tells of its epochs and steps.

    Where the loader tunes itself (:class:`feedrate.tuning.TuningLoader`), the meter listens
    to it (``loader.subscribe``): when the tuning ends, or starts again, the meter starts its
    figures again, at the end of the step it heard it in (between steps, at once), so that
    the run's figures are the choice's; the first batch, the epoch restarts and the drift
    warnings carry over. Listening, ``trainer.max_seconds`` is the whole run's, and the drift
    guard watches only while no tuning runs (its settings differ window to window, by design).
    ``figures(max_seconds, tuning)`` builds the :class:`Meter` of a stretch.
    """

    def __init__(
        self,
        figures: Callable[[float | None, bool], Meter],
        max_seconds: float | None,
        start: int,
        loader: Any = None,
        bar: Any = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.figures, self.max_seconds, self.bar, self.clock = figures, max_seconds, bar, clock
        self.began = clock()
        self._step = start
        self._in_step = self._pending = False
        self._drift_before = 0
        subscribe = getattr(loader, "subscribe", None)
        self.listening = subscribe is not None
        self.tuning = bool(subscribe(self)) if subscribe is not None else False
        self.now = self._new()

    # -- what the loader says --------------------------------------------------------------

    def tuning_started(self) -> None:
        self.tuning = True
        self._restart()

    def tuning_ended(self) -> None:
        self.tuning = False
        self._restart()

    def fell_behind(self) -> bool:
        """Did the drift guard warn since the figures started (the loader asks, to tune
        again)?"""
        return bool(self.now.drift is not None and self.now.drift.episodes)

    # -- what the loop says ----------------------------------------------------------------

    def epoch_started(self) -> None:
        """No step is under way (the last one of an epoch found no batch): figures due to
        start again start with the epoch."""
        self._in_step = False
        if self._pending:
            self._renew()
        self.now.epoch_started()

    def step_started(self) -> None:
        self._in_step = True
        self.now.step_started()

    def batch_arrived(self) -> None:
        self.now.batch_arrived()

    def batch_cost(self, cost: BatchCost | None) -> None:
        self.now.batch_cost(cost)

    def step_done(self, step: int, samples: int, *parts: Any) -> bool:
        """True once measuring is over; not where the figures start again after this step
        (the tuning's end is not the run's)."""
        done = self.now.step_done(step, samples, *parts)
        self._step, self._in_step = step, False
        if self._pending:
            self._renew()
            return False
        return done

    def checkpoint_paused(self, step: int, extra: int = 0) -> None:
        self.now.checkpoint_paused(step, extra)

    def finish(self) -> dict:
        finished = self.now.finish()
        finished["drift_warnings"] += self._drift_before
        return finished

    # -- inside ----------------------------------------------------------------------------

    def _restart(self) -> None:
        if self._in_step:  # mid-step: after it
            self._pending = True
        else:
            self._renew()

    def _new(self, before: Meter | None = None) -> Meter:
        left = self.max_seconds
        if self.listening and left is not None:  # the whole run's time
            left = max(self.began + left - self.clock(), 0.0)
        if self.bar is not None:
            self.bar.set_description("train [autotune]" if self.tuning else "train")
        fresh = self.figures(left, self.tuning)
        if before is not None:
            fresh.take_over(before)
        fresh.start(self._step)
        return fresh

    def _renew(self) -> None:
        self._pending = False
        self._drift_before += self.now.finish()["drift_warnings"]
        self.now = self._new(self.now)
