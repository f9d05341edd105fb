"""The training loop, and the measurement of what the device waited for."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from feedrate import distributed
from feedrate.batch import batch_len, to_device
from feedrate.checkpoint import Position
from feedrate.config import Measure, TrainerConfig
from feedrate.costs import split
from feedrate.drift import DriftGuard
from feedrate.errors import ConfigError, DatasetError, Interrupted
from feedrate.faults import LoaderFailure
from feedrate.hardware import Hardware
from feedrate.loader import loader_state, produced_samples
from feedrate.meter import Meter, RunMeter, TrainResult
from feedrate.monitor import ResourceMonitor
from feedrate.steps import Output, Step
from feedrate.stream import is_stream, nothing_here
from feedrate.tuning.setting import PROCESS, Setting
from feedrate.tuning.spent import Tally

log = logging.getLogger(__name__)

_END = object()  # the loader's iterator is exhausted


def _bar_style(cfg: TrainerConfig) -> dict:
    return {"disable": not cfg.progress, "dynamic_ncols": True}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _batches_per_epoch(loader: DataLoader) -> int | None:
    """None: a stream that does not say its length (its epochs end when it runs out)."""
    try:
        return len(loader)
    except TypeError:
        return None


def _users(dataset: Any) -> Any:
    """The user's dataset inside the run's own wrappers."""
    while isinstance(getattr(dataset, "dataset", None), Dataset):
        dataset = dataset.dataset
    return dataset


def planned_steps(cfg: TrainerConfig, loader: DataLoader) -> int:
    """Steps the run will take: ``max_steps`` or ``epochs`` worth, whichever is fewer. For a
    stream, ``epochs`` worth is its length's estimate: the run ends when the stream does."""
    per_epoch = _batches_per_epoch(loader)
    if per_epoch is None:
        if cfg.max_steps is None:
            name = type(_users(loader.dataset)).__qualname__
            raise ConfigError(
                f"the stream {name} does not say how many samples it holds (no __len__), so"
                " the run cannot be planned in epochs: set"
                " trainer.max_steps (the run also ends when trainer.epochs have streamed)"
            )
        per_epoch = cfg.max_steps
    if per_epoch == 0:
        raise ConfigError(
            f"the loader yields no batch: {len(loader.dataset)} training samples with"
            f" loader.batch_size={loader.batch_size} and loader.drop_last={loader.drop_last};"
            " lower the batch size, set loader.drop_last=false, or use more data"
        )
    limits = []
    if cfg.max_steps is not None:
        limits.append(cfg.max_steps)
    if cfg.epochs is not None:
        limits.append(cfg.epochs * per_epoch)
    steps = min(limits)
    if steps <= cfg.warmup_steps:
        raise ConfigError(
            f"trainer.warmup_steps={cfg.warmup_steps} leaves nothing to measure: the run takes"
            f" {steps} steps (trainer.max_steps={cfg.max_steps}, trainer.epochs={cfg.epochs},"
            f" {per_epoch} batches per epoch); lower warmup_steps or raise max_steps/epochs"
        )
    return steps


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


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    hw: Hardware,
    step: Step,
    batch: Any,
    normalise: Callable[..., torch.Tensor],
) -> Output:
    """One optimiser step on a device batch: the loss ``step`` makes of it, backward, update."""
    with torch.autocast(hw.device.type, dtype=hw.amp_dtype, enabled=hw.amp_dtype is not None):
        out = step(model, batch, normalise)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(out.loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return out


def _stepper(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    hw: Hardware,
    step: Step,
    normalise: Callable[..., torch.Tensor],
    measure: Measure,
) -> Callable[[Any], Output]:
    """What the loop does with a batch: one optimiser step, or nothing where only the loader
    is measured (``trainer.measure=loader``)."""
    if measure is Measure.loader:
        return lambda batch: Output(None)
    # a batch reused for every step (measure=compute) must survive its normalisation
    prepare = functools.partial(normalise, inplace=measure is not Measure.compute)
    return lambda batch: _step(model, optimizer, scaler, hw, step, batch, prepare)


def _end_now(loader: Any) -> None:
    """Training ended mid-epoch: the loader's workers end at once. The batches they still
    read are not wanted, and a worker mid-read would hold the run's end up to a batch's time
    (0.9 s a run of a held-out store; a sweep makes 20 runs)."""
    end = getattr(loader, "end_workers", None)
    if end is not None:
        end(kill=True)


def _save_if_due(
    checkpoints: Checkpoints,
    step: int,
    total: int,
    position: Callable[[], Position],
    meter: RunMeter,
    bar: tqdm,
) -> None:
    """Save every ``checkpoints.every`` steps (the meter re-warms after the pause) and at once
    on Ctrl-C, which then ends the run with the state saved."""
    interrupted = checkpoints.interrupt.is_set()
    due = checkpoints.every is not None and step % checkpoints.every == 0
    path = None
    if checkpoints.save is not None and (due or interrupted):
        path = checkpoints.save(position())
    if due:
        meter.checkpoint_paused(step)
    if interrupted:
        bar.close()
        saved = (
            f"the state after step {step} is saved in {path}; continue with:"
            f" {checkpoints.resume_hint}"
            if checkpoints.save is not None
            else "nothing was saved (trainer.save_checkpoint=false)"
        )
        raise Interrupted(f"interrupted (Ctrl-C) at step {step} of {total}: {saved}")


@dataclass
class _Where:
    """Where training is in the data: what a checkpoint's :class:`Position` records."""

    step: int
    epoch: int
    samples: int = 0  # of this epoch, handed out by the sampler (skipped batches too)
    batches: int = 0  # of this epoch, from the loader
    generator: Any = None  # the shuffle's state at the epoch's start

    def position(self, scaler: torch.amp.GradScaler, loader: Any) -> Position:
        # a loader that keeps its own place (a tuning loader) says it; else its stream's
        own = getattr(loader, "position_state", None)
        stream, state = own() if own is not None else (loader_state(loader), None)
        return Position(
            self.step, self.epoch, self.samples, self.generator, scaler.state_dict(), stream, state
        )


Batches = Iterator[Any]  # any structure the collate function makes, on the device


def _epoch_batches(
    loader: Any,
    where: _Where,
    resume: Position | None,
    hw: Hardware,
    meter: RunMeter,
    decode: Callable[[list], torch.Tensor] | None = None,
) -> Batches:
    """One epoch's batches on the device. From ``resume`` the epoch goes on with the same
    shuffle after the samples already trained (:class:`feedrate.loader.ResumableSampler`;
    a loader that orders its own epochs, a tuning loader, goes on from its own state). The
    meter's wait runs until a batch arrives; the host-to-device copy is the step's."""
    sampler = getattr(loader, "sampler", None)
    shuffling = getattr(sampler, "generator", None)
    set_epoch = getattr(loader, "set_epoch", None)
    if set_epoch is not None:
        set_epoch(where.epoch)  # where a resumed one goes on: its own position's
        shuffling = None
    elif resume is not None:
        where.samples = resume.epoch_samples
    if resume is None:
        where.samples = 0
    where.batches = 0
    if resume is not None and resume.epoch_generator is not None and shuffling is not None:
        shuffling.set_state(resume.epoch_generator)
        sampler.skip = resume.epoch_samples
    order = getattr(sampler, "order", None)
    if hasattr(order, "set_epoch"):  # a DistributedSampler: this epoch's shuffle
        order.set_epoch(where.epoch)
    if is_stream(getattr(loader, "dataset", None)):  # it shuffles its shards itself
        loader.dataset.set_epoch(where.epoch)
    where.generator = shuffling.get_state() if shuffling is not None else None
    per_batch = getattr(loader, "batch_size", None) or 0
    batches = iter(loader)  # a worker that died while they started is named here
    while True:
        meter.step_started()
        batch = next(batches, _END)
        if batch is _END:
            return
        where.batches += 1
        where.samples += per_batch
        if batch is None:  # dataset.on_error=skip dropped every sample of it
            continue
        batch, cost = split(batch)  # a loader built with costs (trainer.costs) says them
        if decode is not None:  # loader.decode=device: the input pipeline's last stage
            batch = _decoded(batch, decode)
        meter.batch_arrived()
        meter.batch_cost(cost)
        yield to_device(batch, hw.device, hw.non_blocking)


def _decoded(batch: Any, decode: Callable[[list], torch.Tensor]) -> Any:
    """A batch of JPEG bytes and labels with its images decoded (``dataset=photos``)."""
    images, labels = batch
    return decode(images), labels


def _empty_epoch(loader: DataLoader, streaming: bool) -> DatasetError:
    if streaming:
        return nothing_here(loader.dataset)
    return DatasetError(
        "an epoch yielded no batch at all (every sample failed and dataset.on_error=skip"
        " dropped it): fix the dataset, or set dataset.on_error=raise to see the first failure"
    )


def _uneven_inputs(model: nn.Module, streaming: bool) -> contextlib.AbstractContextManager:
    """Under DDP, a rank whose stream runs out first keeps joining the others' all-reduces
    until they run out too (a stream's shards need not divide evenly between ranks)."""
    if streaming and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.join()
    return contextlib.nullcontext()


def _resident(batches: Batches, meter: RunMeter) -> Batches:
    """``trainer.measure=compute``: the first batch, kept on the device and trained on again."""
    for batch in batches:
        while True:
            yield batch
            meter.step_started()
            meter.batch_arrived()


def _meter(
    cfg: TrainerConfig,
    loader: DataLoader,
    *,
    total: int,
    start: int,
    measure: Measure,
    monitor: ResourceMonitor,
    hw: Hardware,
    bar: tqdm,
    ranks: distributed.Ranks,
    drift: DriftGuard | None = None,
) -> Meter:
    """The meter of ``loader`` from step ``start`` on, measured as ``cfg`` says; under
    torchrun every rank's windows open and close at rank 0's steps."""
    workers = getattr(loader, "num_workers", 0) or 0
    return Meter(
        cfg,
        tally=_tally(loader) if cfg.costs else None,
        total=total,
        start=start,
        backlog=startup_backlog(loader) if measure is not Measure.compute else 0,
        # a window that sees every worker deliver: workers started together deliver in bursts
        window_steps=max(cfg.window_steps, workers),
        workers=workers,
        measure=measure,
        produced=lambda: produced_samples(loader),
        monitor=monitor,
        device=hw.device,
        sync=lambda: _sync(hw.device),
        bar=bar,
        drift=drift,
        **(
            {
                "agree": ranks.agree,
                "agree_all": ranks.every,
            }
            if agreed(cfg)
            else {}
        ),
    )


def _tally(loader: Any) -> Tally | None:
    """The tally of a loader whose batches say what they cost, on its setting; a loader may
    say its own (a tuning loader: None, its windows tally theirs). None for a stream: its
    batches say nothing."""
    own = getattr(loader, "tally", None)
    if own is not None:
        return own()
    if is_stream(getattr(loader, "dataset", None)):
        return None
    engine = getattr(loader, "engine", PROCESS)  # a ThreadLoader's: thread
    workers = getattr(loader, "num_workers", 0) or 0
    return Tally(Setting(workers, getattr(loader, "prefetch_factor", None), engine))


def agreed(cfg: TrainerConfig) -> bool:
    """Does measuring end by what a rank sees (its clock, its rate, a stream without end)?
    Then under torchrun every rank takes rank 0's word at the same steps (``Meter.agree``);
    by steps or epochs alone each rank knows, and asks nothing (a stream's ranks may then
    run out at different steps, which DDP's join covers)."""
    return cfg.max_seconds is not None or cfg.abandon_below is not None or bool(cfg.stream)


def _begin(resume: Position | None, loader: Any) -> _Where:
    """Where training starts: at step 0, or where ``resume`` stopped; a loader that keeps its
    own place (a tuning loader) says which epoch it goes on in, and how far in."""
    if resume is None:
        return _Where(0, 0)
    own = getattr(loader, "position", None)
    if own is not None:
        epoch, batches = own
        return _Where(resume.step, epoch, batches * loader.batch_size)
    return _Where(resume.step, resume.epoch)


def _scaler(hw: Hardware, resume: Position | None) -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler(hw.device.type, enabled=hw.amp_dtype == torch.float16)
    if resume is not None and resume.scaler:
        scaler.load_state_dict(resume.scaler)
    return scaler


def train(
    *,
    model: nn.Module,
    loader: Any,
    optimizer: torch.optim.Optimizer,
    hw: Hardware,
    cfg: TrainerConfig,
    monitor: ResourceMonitor,
    normalise: Callable[..., torch.Tensor],
    resume: Position | None = None,
    checkpoints: Checkpoints | None = None,
    decode: Callable[[list], torch.Tensor] | None = None,
    preset_wait: float | None = None,
    ranks: distributed.Ranks | None = None,
    step: Step | None = None,
) -> TrainResult:
    """Train for ``planned_steps``, timed by a :class:`~feedrate.meter.Meter`.

    From ``resume`` (a checkpoint's position) training goes on where it stopped; warm-up and
    measuring start again there. ``checkpoints`` says when to save; Ctrl-C ends the run after
    the current step, with the state saved. ``preset_wait``, the data-wait share the loader
    preset was measured with, is one reference of the drift guard (:mod:`feedrate.drift`).
    ``loader`` is any loader (a DataLoader, a thread loader, a tuning loader): the loop only
    iterates it. One that tunes itself tells the meter when its tuning ends or starts again,
    and the meter starts its figures again (:class:`~feedrate.meter.RunMeter`).
    """
    total = planned_steps(cfg, loader)
    measure = Measure(getattr(cfg.measure, "value", cfg.measure))
    where = _begin(resume, loader)
    bar = tqdm(total=total, initial=where.step, unit="step", desc="train", **_bar_style(cfg))
    ranks = ranks or distributed.Ranks()

    def figures(max_seconds: float | None, tuning: bool) -> Meter:
        """The meter of a stretch of the run from the step it is at; the drift guard watches
        where no tuning runs (its settings differ window to window, by design)."""
        drift = None
        if cfg.drift_rise is not None and measure is not Measure.compute and not tuning:
            drift = DriftGuard(cfg.drift_rise, cfg.drift_windows, preset_wait)
        stretch = dataclasses.replace(cfg, max_seconds=max_seconds)
        args = dict(total=total, measure=measure, monitor=monitor, hw=hw, bar=bar, ranks=ranks)
        return _meter(stretch, loader, drift=drift, start=where.step, **args)

    meter = RunMeter(figures, cfg.max_seconds, where.step, loader, bar)
    scaler, trained, stopped_at = _scaler(hw, resume), 0, None
    model.train()
    # A stream's epochs end when it runs out, not at its length's estimate
    streaming = is_stream(getattr(loader, "dataset", None))
    step_limit = cfg.max_steps if streaming else total

    def position() -> Position:
        return where.position(scaler, loader)

    run_step = _stepper(model, optimizer, scaler, hw, step or Step(None), normalise, measure)
    with _uneven_inputs(model, streaming):
        while stopped_at is None:
            meter.epoch_started()
            batches = _epoch_batches(loader, where, resume, hw, meter, decode)
            resumed, resume = resume is not None, None  # only the first epoch resumes part-way
            if measure is Measure.compute:
                batches = _resident(batches, meter)
            for batch in batches:
                out = run_step(batch)
                where.step += 1
                n = batch_len(batch) or getattr(loader, "batch_size", None) or 1
                trained += n
                done = meter.step_done(where.step, n, *out.parts)
                bar.update(1)
                if monitor.tripped:  # the memory guard: stop before the OOM killer does
                    raise LoaderFailure(monitor.tripped)
                if done or (step_limit is not None and where.step >= step_limit):
                    stopped_at = position()
                    _end_now(loader)
                    break
                if checkpoints is not None:
                    _save_if_due(checkpoints, where.step, total, position, meter, bar)
            if stopped_at is None and where.batches == 0 and where.samples == 0 and not resumed:
                raise _empty_epoch(loader, streaming)
            where.epoch += 1
            if stopped_at is None and cfg.epochs is not None and where.epoch >= cfg.epochs:
                stopped_at = position()  # a stream ran out in the last epoch
    bar.close()
    return TrainResult(
        **meter.finish(),
        steps=where.step,
        epochs_started=where.epoch,
        position=stopped_at,
        trained_samples=trained,
        train_seconds=time.perf_counter() - meter.began,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    hw: Hardware,
    normalise: Callable[..., torch.Tensor],
    decode: Callable[[list], torch.Tensor] | None = None,
    step: Step | None = None,
) -> tuple[float | None, float | None]:
    """(mean loss, accuracy) of ``model`` over ``loader``, in eval mode, by the training
    step; None if empty, and no accuracy where the step gives no logits and labels."""
    step = step or Step(None)
    model.eval()
    loss_sum = torch.zeros((), device=hw.device)
    correct = torch.zeros((), device=hw.device, dtype=torch.long)
    seen = scored = 0
    for batch in loader:
        if batch is None:
            continue
        batch = _decoded(batch, decode) if decode is not None else batch
        batch = to_device(batch, hw.device, hw.non_blocking)
        n = batch_len(batch) or 1
        with torch.autocast(hw.device.type, dtype=hw.amp_dtype, enabled=hw.amp_dtype is not None):
            out = step(model, batch, normalise, training=False)
        loss_sum += out.loss.detach().float() * n
        if out.scored:
            correct += (out.logits.argmax(1) == out.labels).sum()
            scored += out.labels.numel()
        seen += n
    model.train()
    if seen == 0:
        return None, None
    return loss_sum.item() / seen, correct.item() / scored if scored else None
