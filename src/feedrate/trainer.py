"""The training loop, and the measurement of what the device waited for."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from feedrate.checkpoint import Position
from feedrate.config import Measure, Optimizer
from feedrate.errors import ConfigError, DatasetError, Interrupted
from feedrate.faults import LoaderFailure
from feedrate.hardware import Hardware
from feedrate.loader import produced_samples
from feedrate.metrics import ResourceMonitor, StepTimes, WarmUp

log = logging.getLogger(__name__)

# Normalisation happens on the device: the loader moves uint8, 4x fewer bytes than float32.
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def build_optimizer(cfg: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    opt = cfg.optimizer if isinstance(cfg.optimizer, Optimizer) else Optimizer(cfg.optimizer)
    if opt is Optimizer.sgd:
        return torch.optim.SGD(
            model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def make_input_transform(hw: Hardware, channels: int) -> Callable[..., torch.Tensor]:
    """Batch on the device -> normalised float batch (uint8 scaled by 1/255 there).

    This is the first op of the training step, not part of loading: the loader's side ends
    with the host-to-device copy, which is what ``trainer.measure=loader`` measures.
    """
    if channels == 3:
        mean, std = _IMAGENET_MEAN, _IMAGENET_STD
    else:
        mean, std = (0.5,) * channels, (0.25,) * channels
    mean_t = torch.tensor(mean, device=hw.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=hw.device).view(1, -1, 1, 1)
    memory_format = torch.channels_last if hw.channels_last else torch.contiguous_format

    def normalise(x: torch.Tensor, inplace: bool = True) -> torch.Tensor:
        # One new float tensor, then in place: the batch is ours, and a 64x3x224x224 batch
        # makes every extra temporary cost tens of milliseconds on a CPU. A float batch that
        # must survive (measure=compute reuses it) is copied once instead.
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
        elif not inplace or x.dtype != torch.float32:
            x = x.to(torch.float32, copy=True)
        x = x.sub_(mean_t).div_(std_t)
        return x.contiguous(memory_format=memory_format)

    return normalise


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class TrainResult:
    times: StepTimes
    first_batch_s: float
    epoch_restart_s: list[float]
    steps: int
    epochs_started: int
    final_loss: float
    train_accuracy: float
    position: Position  # where training stopped: what the final checkpoint records
    warmup: dict = field(default_factory=dict)  # how the warm-up ended (WarmUp.as_dict)
    abandoned: str = ""  # why measuring stopped early, if it did


@dataclass
class Checkpoints:
    """Saving during training: every ``every`` steps, and at once when ``interrupt`` is set.

    ``save`` writes the state at a position and returns the file; None: nothing is saved
    (``trainer.save_checkpoint=false``). ``resume_hint`` is the command that continues.
    """

    save: Callable[[Position], Path] | None
    every: int | None
    interrupt: threading.Event
    resume_hint: str = ""


def planned_steps(cfg: DictConfig, loader: DataLoader) -> int:
    """Steps the run will take: ``max_steps`` or ``epochs`` worth, whichever is fewer."""
    if len(loader) == 0:
        raise ConfigError(
            f"the loader yields no batch: {len(loader.dataset)} training samples with"
            f" loader.batch_size={loader.batch_size} and loader.drop_last={loader.drop_last};"
            " lower the batch size, set loader.drop_last=false, or use more data"
        )
    limits = []
    if cfg.max_steps is not None:
        limits.append(cfg.max_steps)
    if cfg.epochs is not None:
        limits.append(cfg.epochs * len(loader))
    steps = min(limits)
    if steps <= cfg.warmup_steps:
        raise ConfigError(
            f"trainer.warmup_steps={cfg.warmup_steps} leaves nothing to measure: the run takes"
            f" {steps} steps (trainer.max_steps={cfg.max_steps}, trainer.epochs={cfg.epochs},"
            f" {len(loader)} batches per epoch); lower warmup_steps or raise max_steps/epochs"
        )
    return steps


def _clearly_below(times: StepTimes, floor: float, stream: bool) -> str:
    """Why a sweep trial can stop measuring now: after 1 s and two windows, its running rate
    is below ``floor`` (the sweep's: half its best trial). Empty while it may still catch up."""
    if times.elapsed_s < 1.0 or len(times.window_rates) < 2:
        return ""
    rate = times.samples / times.elapsed_s
    if stream and times.produced is not None:
        rate = min(rate, times.produced / times.elapsed_s)
    if rate >= floor:
        return ""
    return (
        f"ended early after {times.elapsed_s:.1f} s measured: {rate:,.1f} samples/s, below"
        f" trainer.abandon_below={floor:,.1f}"
    )


def startup_backlog(loader: DataLoader) -> int:
    """Batches to consume before the rate is the setting's, not its start-up's.

    Workers are handed ``prefetch_factor`` batches each at once, and deliver in order: until
    that many are consumed, training eats batches queued while it was not asking, and the
    pipeline has not yet reached the memory it holds in steady state. Streaming, a window
    opened after one batch per worker measured 50 workers x prefetch 8 of 38 MB batches at
    2,523 samples/s; 20 s after the whole backlog it sustained 1,548 (15 GB in /dev/shm).
    """
    workers = getattr(loader, "num_workers", 0) or 0
    return workers * (getattr(loader, "prefetch_factor", None) or 2)


def train(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    hw: Hardware,
    cfg: DictConfig,
    monitor: ResourceMonitor,
    normalise: Callable[..., torch.Tensor],
    resume: Position | None = None,
    checkpoints: Checkpoints | None = None,
) -> TrainResult:
    """Train for ``planned_steps``; time every step after warm-up.

    From ``resume`` (a checkpoint's position), training goes on where it stopped: the same
    epoch, the next sample of the same order; warm-up and measurement start again there.
    ``checkpoints`` says when to save; an interrupt (Ctrl-C) ends the run after the current
    step with the state saved.

    The device runs asynchronously, so it is synchronised only at window ends: per-step times
    are host-side, and their sum over the measured phase equals its wall time. The time spent in
    ``next(iterator)`` is the time the training loop (and so the device) waited for data.

    The warm-up lasts ``warmup_steps``, and with ``steady_state`` until the start-up backlog
    (``num_workers * prefetch_factor`` batches) is consumed and the rate has settled
    (:class:`~feedrate.metrics.WarmUp`): the window measures the setting, not its start-up.
    Streaming, samples/s is the lower of what training consumed and what the workers produced
    meanwhile (``feedrate.loader.CountingCollate``); with epochs, what training consumed
    (workers idle legitimately at an epoch's end), see ``metrics.summarise``.
    """
    total = planned_steps(cfg, loader)
    start = resume.step if resume is not None else 0
    measure = Measure(getattr(cfg.measure, "value", cfg.measure))
    # Steps before measuring: enough to rebuild the pipeline, and at least one measured step.
    warmup = min(cfg.warmup_steps, total - start - 1)
    warm = WarmUp(
        warmup,
        backlog=startup_backlog(loader) if measure is not Measure.compute else 0,
        # a window that sees every worker deliver: workers started together deliver in bursts
        window_steps=max(cfg.window_steps, getattr(loader, "num_workers", 0) or 0),
        steady=cfg.steady_state,
        sync=lambda: _sync(hw.device),
    )
    warm_end: int | None = None  # the step after which the clock runs
    resident: tuple[torch.Tensor, torch.Tensor] | None = None
    produced_at_start = None
    scaler = torch.amp.GradScaler(hw.device.type, enabled=hw.amp_dtype == torch.float16)
    if resume is not None and resume.scaler:
        scaler.load_state_dict(resume.scaler)
    times = StepTimes()
    loss_sum = torch.zeros((), device=hw.device)
    correct = torch.zeros((), device=hw.device, dtype=torch.long)
    window_seen = 0
    final_loss = train_acc = float("nan")
    first_batch_s = float("nan")
    restarts: list[float] = []
    step, epoch = start, resume.epoch if resume is not None else 0
    measure_start = window_start = 0.0
    window_samples = window_steps = 0
    window_wait = 0.0
    abandoned = ""  # why the measurement ended before its time (trainer.abandon_below)
    # A checkpoint pauses training while workers go on filling their queues: the steps after
    # it would eat that backlog at compute speed. So a save closes the window, and measuring
    # resumes after a fresh warm-up; what workers produced meanwhile is not counted.
    rewarm_until = -1
    produced_paused_at: int | None = None
    produced_gap = 0
    # Measured steps are timed end to end, so the gaps between epochs (a new iterator, workers
    # restarting) count as time spent waiting for data, and step times add up to wall time.
    t_prev_end: float | None = None
    model.train()
    bar = tqdm(
        total=total,
        initial=start,
        unit="step",
        desc="train",
        disable=not cfg.progress,
        dynamic_ncols=True,
    )
    if warmup > 0:  # the figures come per window, after the warm-up
        bar.set_postfix_str("warming up: unmeasured until the rate settles", refresh=False)
    first_epoch = True
    done = False
    per_batch = getattr(loader, "batch_size", None) or 0  # samples the sampler hands a batch
    epoch_samples = 0

    def position() -> Position:
        return Position(step, epoch, epoch_samples, epoch_generator, scaler.state_dict())

    def begin_measuring() -> float:
        """Warm-up over: the device quiet, memory sampled, then the clock starts; returns it."""
        nonlocal measure_start, produced_at_start
        _sync(hw.device)
        monitor.start_cpu_window()  # samples memory: before the clock starts
        measure_start = time.perf_counter()
        if measure is not Measure.compute:
            produced_at_start = produced_samples(loader)
        return measure_start

    if warmup == 0:  # resumed one step before the end: measure that step
        warm_end = start
        window_start = begin_measuring()
    while not done:
        # first_batch_s (and each epoch_restart_s) runs from iter(loader), where workers start
        t_iter = time.perf_counter()
        batches_this_epoch = epoch_samples = 0
        # The shuffle's source (feedrate.loader.ResumableSampler); a loader built elsewhere may
        # have none, and then no position to resume from.
        sampler = getattr(loader, "sampler", None)
        shuffling = getattr(sampler, "generator", None)
        if first_epoch and resume is not None and resume.epoch_generator is not None:
            # The same shuffle as the interrupted epoch, without the samples already trained on
            shuffling.set_state(resume.epoch_generator)
            sampler.skip = epoch_samples = resume.epoch_samples
        resumed_into = epoch_samples  # samples of this epoch trained before a resume
        order = getattr(sampler, "order", None)
        if hasattr(order, "set_epoch"):  # a DistributedSampler: this epoch's shuffle
            order.set_epoch(epoch)
        epoch_generator = shuffling.get_state() if shuffling is not None else None
        batches = iter(loader)
        first = True
        while True:
            t0 = t_prev_end if t_prev_end is not None else time.perf_counter()
            if resident is not None:  # measure=compute: the same batch, already on the device
                x, y = resident
            else:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                batches_this_epoch += 1
                epoch_samples += per_batch
                if batch is None:  # dataset.on_error=skip dropped every sample of it
                    continue
                x, y = batch
            t1 = time.perf_counter()
            if first:
                if first_epoch:
                    first_batch_s = t1 - t_iter
                else:
                    restarts.append(t1 - t_iter)
                first = False

            if resident is None:  # the loader's side ends with the host-to-device copy
                x = x.to(hw.device, non_blocking=hw.non_blocking)
                y = y.to(hw.device, non_blocking=hw.non_blocking)
                if measure is Measure.compute:
                    resident = (x, y)
            if measure is not Measure.loader:
                inputs = normalise(x, inplace=resident is None)
                with torch.autocast(
                    hw.device.type, dtype=hw.amp_dtype, enabled=hw.amp_dtype is not None
                ):
                    out = model(inputs)
                    loss = nn.functional.cross_entropy(out, y)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                loss_sum += loss.detach().float() * len(y)
                correct += (out.detach().argmax(1) == y).sum()
            window_seen += len(y)
            step += 1

            if warm_end is None and warm.update():
                warm_end = step
            elif warm_end is None and step >= total - 1:  # one step left: measure it anyway
                warm_end = step
                warm.cut_short()
                log.warning(
                    "the run ends before its warm-up (%d steps so far, a start-up backlog of %d"
                    " batches): 1 step measured, and it may include start-up. Raise"
                    " trainer.max_steps, or set trainer.steady_state=false <cfg.trainer>",
                    warm.steps,
                    warm.backlog,
                )
            measured_step = step - warm_end if warm_end is not None else -1
            restart = step == rewarm_until  # the warm-up after a checkpoint is over
            measured = measured_step > 0 and step > rewarm_until
            window_end = measured and (window_steps + 1 >= cfg.window_steps or step == total)
            if measured_step == 0 or restart:  # warm-up over: start the clock, device quiet
                if restart:
                    _sync(hw.device)
                    now_produced = produced_samples(loader)
                    if now_produced is not None and produced_paused_at is not None:
                        produced_gap += now_produced - produced_paused_at
                else:
                    begin_measuring()
                window_start = t_prev_end = time.perf_counter()
                if not times.window_rates:
                    bar.set_postfix_str("measuring: figures at each window's end")
                loss_sum.zero_()
                correct.zero_()
                window_seen = 0
            elif measured:
                t2 = time.perf_counter()
                out_of_time = cfg.max_seconds is not None and t2 - measure_start >= cfg.max_seconds
                window_end = window_end or out_of_time
                if window_end:
                    _sync(hw.device)
                    t2 = time.perf_counter()
                times.wait_s.append(t1 - t0)
                times.step_s.append(t2 - t0)
                times.samples += len(y)
                window_samples += len(y)
                window_steps += 1
                window_wait += t1 - t0
                t_prev_end = t2
                if window_end:
                    span = t2 - window_start
                    if produced_at_start is not None:
                        produced = produced_samples(loader) - produced_at_start - produced_gap
                        times.produced = produced
                    # A last window cut short by the clock or the step limit is too short to
                    # stand alone in the spread; its samples still count in the totals.
                    if window_steps >= max(2, cfg.window_steps // 2) or not times.window_rates:
                        times.window_rates.append(window_samples / span)
                    if measure is not Measure.loader:  # no model ran: no loss to report
                        final_loss = loss_sum.item() / max(window_seen, 1)
                        train_acc = correct.item() / max(window_seen, 1)
                    bar.set_postfix(
                        {
                            "samples/s": f"{window_samples / span:,.0f}",
                            "wait": f"{window_wait / span:.0%}",
                            "loss": f"{final_loss:.3f}",
                        },
                        refresh=False,
                    )
                    loss_sum.zero_()
                    correct.zero_()
                    window_seen = window_samples = window_steps = 0
                    window_wait = 0.0
                    window_start = t2
                times.elapsed_s += t2 - t0  # the measured steps' own time, pauses left out
                if window_end and cfg.abandon_below is not None:
                    abandoned = _clearly_below(times, cfg.abandon_below, cfg.stream)
                    done = done or bool(abandoned)
                if out_of_time:
                    done = True
            bar.update(1)
            if monitor.tripped:  # the memory guard: stop before the OOM killer does
                raise LoaderFailure(monitor.tripped)
            if step >= total or done:
                done = True
                stopped_at = position()
                break
            if checkpoints is not None:
                interrupted = checkpoints.interrupt.is_set()
                due = checkpoints.every is not None and step % checkpoints.every == 0
                if checkpoints.save is not None and (due or interrupted):
                    path = checkpoints.save(position())
                if due and measured:
                    # every rank pauses (under torchrun, for rank 0's save): close the window
                    if window_steps >= max(2, cfg.window_steps // 2):
                        times.window_rates.append(window_samples / (t_prev_end - window_start))
                    window_samples = window_steps = 0
                    window_wait = 0.0
                    produced_paused_at = produced_samples(loader)
                    rewarm_until = step + cfg.warmup_steps
                if interrupted:
                    bar.close()
                    saved = (
                        f"the state after step {step} is saved in {path}; continue with:"
                        f" {checkpoints.resume_hint}"
                        if checkpoints.save is not None
                        else "nothing was saved (trainer.save_checkpoint=false)"
                    )
                    raise Interrupted(f"interrupted (Ctrl-C) at step {step} of {total}: {saved}")
        if not done and batches_this_epoch == 0 and not resumed_into:
            raise DatasetError(
                "an epoch yielded no batch at all (every sample failed and"
                " dataset.on_error=skip dropped it): fix the dataset, or set"
                " dataset.on_error=raise to see the first failure"
            )
        epoch += 1
        first_epoch = False
    bar.close()
    monitor.end_cpu_window()
    return TrainResult(
        times=times,
        first_batch_s=first_batch_s,
        epoch_restart_s=restarts,
        steps=step,
        epochs_started=epoch,
        final_loss=final_loss,
        train_accuracy=train_acc,
        position=stopped_at,
        warmup=warm.as_dict(),
        abandoned=abandoned,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    hw: Hardware,
    normalise: Callable[..., torch.Tensor],
) -> tuple[float | None, float | None]:
    """(mean loss, accuracy) of ``model`` over ``loader``, in eval mode; None if empty."""
    model.eval()
    loss_sum = torch.zeros((), device=hw.device)
    correct = torch.zeros((), device=hw.device, dtype=torch.long)
    seen = 0
    for batch in loader:
        if batch is None:
            continue
        x, y = batch
        x = normalise(x.to(hw.device, non_blocking=hw.non_blocking))
        y = y.to(hw.device, non_blocking=hw.non_blocking)
        with torch.autocast(hw.device.type, dtype=hw.amp_dtype, enabled=hw.amp_dtype is not None):
            out = model(x)
            loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").float()
        correct += (out.argmax(1) == y).sum()
        seen += len(y)
    model.train()
    if seen == 0:
        return None, None
    return loss_sum.item() / seen, correct.item() / seen
