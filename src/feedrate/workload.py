"""What a run trains and measures, built from the config: dataset, split, model, optimizer
and loader, the normalisation on the device, and the held-out evaluation."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from feedrate import checkpoint, distributed
from feedrate.batch import describe, nbytes
from feedrate.config import Optimizer
from feedrate.dataset import GuardedDataset, build_dataset, known_classes, num_classes, split
from feedrate.decode import BatchDecoder, bytes_only
from feedrate.distributed import Ranks
from feedrate.errors import ConfigError
from feedrate.faults import Context, check_shm, unbatchable_sample
from feedrate.hardware import Hardware
from feedrate.loader import build_loader, loader_kwargs, named_collate, user_collate
from feedrate.model import build_model, check_model
from feedrate.steps import Step
from feedrate.stream import (
    GuardedStream,
    check_split_by_worker,
    is_stream,
    length,
    nothing_here,
)
from feedrate.trainer import evaluate

log = logging.getLogger("feedrate")


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
    memory_format = torch.channels_last if hw.channels_last else torch.contiguous_format
    spreads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def spread(c: int) -> tuple[torch.Tensor, torch.Tensor]:
        if c not in spreads:
            mean, std = (_IMAGENET_MEAN, _IMAGENET_STD) if c == 3 else ((0.5,) * c, (0.25,) * c)
            shape = (1, -1, 1, 1)
            spreads[c] = tuple(torch.tensor(v, device=hw.device).view(shape) for v in (mean, std))
        return spreads[c]

    spread(channels)

    def normalise(x: torch.Tensor, inplace: bool = True) -> torch.Tensor:
        # One new float tensor, then in place: the batch is ours, and a 64x3x224x224 batch
        # makes every extra temporary cost tens of milliseconds on a CPU. A float batch that
        # must survive (measure=compute reuses it) is copied once instead.
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
        elif not inplace or x.dtype != torch.float32:
            x = x.to(torch.float32, copy=True)
        if x.dim() != 4:  # not a batch of images (N, C, H, W): scaled only
            return x
        mean_t, std_t = spread(x.shape[1])
        x = x.sub_(mean_t).div_(std_t)
        return x.contiguous(memory_format=memory_format)

    return normalise


@dataclass
class Workload:
    """What the run trains and measures, built from the config. ``loader=autotune`` replaces
    the loader with a tuning loader (:mod:`feedrate.autotune`), which builds each setting's
    DataLoader with :func:`candidate_loader`."""

    dataset: Dataset
    train_set: GuardedDataset
    val_set: Dataset | None
    sample: Any  # the first one, as the dataset returns it: sizes the loader's memory
    num_classes: int | None  # None: the dataset names no classes (and the model takes none)
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    loader_args: dict
    normalise: Callable[..., torch.Tensor]
    step: Step  # trainer.step: what turns a batch into a loss
    context: Context  # what a failure's diagnosis reads
    decode: Callable[[list], torch.Tensor] | None = None  # loader.decode=device: a batch's JPEGs
    split_checked: bool = False  # a stream was checked to split its work between workers


@dataclass
class Built:
    """What building costs, kept by a warm trial host between trials (:class:`Kept`)."""

    dataset: Dataset
    classes: int | None
    sample: Any
    model: nn.Module
    weights: dict[str, torch.Tensor]  # the model as built: parameters and buffers (BN's)
    rng: dict  # every random generator, as building left them


class Kept:
    """A warm trial host's dataset and model (:mod:`feedrate.sweep.host`). Each trial gets
    them back as a fresh process would have built them: the weights and buffers as built, no
    gradients, and the random generators as building left them."""

    def __init__(self) -> None:
        self.built: Built | None = None

    def keep(self, built: Built) -> None:
        self.built = built

    def restore(self) -> Built | None:
        built = self.built
        if built is None:
            return None
        built.model.load_state_dict(built.weights)
        for p in built.model.parameters():
            p.grad = None
        built.model.train()
        checkpoint.set_rng_state(built.rng)
        return built


def _build_parts(cfg: DictConfig, hw: Hardware, kept: Kept | None) -> Built:
    """The dataset and the model, or a warm host's, restored."""
    built = kept.restore() if kept is not None else None
    if built is not None:
        return built
    dataset = build_dataset(cfg.dataset)
    sample = _first_sample(dataset)
    if getattr(cfg.loader.decode, "value", cfg.loader.decode) == "device":
        bytes_only(dataset)  # after the first sample, which sizes the model decoded
    model = build_model(cfg.model, lambda: num_classes(dataset)).to(hw.device)
    classes = known_classes(dataset)
    if hw.channels_last:
        model = model.to(memory_format=torch.channels_last)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    built = Built(dataset, classes, sample, model, weights, checkpoint.rng_state())
    if kept is not None:
        kept.keep(built)
    return built


def build(cfg: DictConfig, hw: Hardware, ranks: Ranks, kept: Kept | None = None) -> Workload:
    """Dataset, split, model (DDP under torchrun), optimizer and loader; with ``kept`` (a
    warm trial host's), the dataset and model it built before."""
    step = Step(cfg.trainer.step, cfg.objective)  # the user's targets checked before any data
    check_model(cfg.model)
    if named_collate(cfg.loader) is not None:
        user_collate(named_collate(cfg.loader))
    parts = _build_parts(cfg, hw, kept)
    dataset, classes, sample = parts.dataset, parts.classes, parts.sample
    image = images_of(sample, step, cfg.loader)
    train_set, val_set = split(dataset, cfg.trainer.val_fraction, cfg.trainer.seed)
    on_error = cfg.dataset.get("on_error", "raise")
    streaming = is_stream(dataset)
    train_set = (GuardedStream if streaming else GuardedDataset)(train_set, on_error)
    decoder = None
    if getattr(cfg.loader.decode, "value", cfg.loader.decode) == "device":
        decoder = BatchDecoder(hw.device, image.shape[-1])
    model = distributed.wrap(parts.model, ranks, hw)
    args = _loader_args(cfg.loader, hw, ranks)
    if streaming:  # it shuffles itself, in a buffer
        del args["shuffle"]
    # a stream on thread workers is refused when the loader is built (feedrate.threads)
    checked = streaming and args["num_workers"] > 1 and args.get("engine") != "thread"
    if checked:
        check_split_by_worker(train_set.dataset, args["multiprocessing_context"])
    size = length(dataset)
    log.info(
        "dataset %s: %s samples%s, %s classes, sample %s; loader %s",
        *(type(dataset).__name__, "?" if size is None else size, " (a stream)" * streaming),
        *("no" if classes is None else classes, _shown(sample, image), args),
    )
    context = Context(
        num_workers=args["num_workers"],
        prefetch_factor=cfg.loader.prefetch_factor,
        batch_bytes=cfg.loader.batch_size * nbytes(sample),
        peak_pss_mb=0.0,
        timeout_s=cfg.loader.timeout,
        engine=args.get("engine", "process"),
    )
    check_shm(context)
    return Workload(
        dataset=dataset,
        train_set=train_set,
        val_set=val_set,
        sample=sample,
        num_classes=classes,
        model=model,
        optimizer=build_optimizer(cfg.trainer, model),
        loader=build_loader(
            train_set,
            args,
            cfg.trainer.seed,
            cfg.trainer.stream,
            ranks,
            costs=bool(cfg.trainer.get("costs")),
        ),
        loader_args=args,
        normalise=make_input_transform(hw, image.shape[0] if image is not None else 3),
        step=step,
        context=context,
        decode=decoder,
        split_checked=checked,
    )


def candidate_loader(
    work: Workload,
    loader: DictConfig,
    cfg: DictConfig,
    hw: Hardware,
    worker_seed: int,
    batch_sampler: Sampler | None = None,
    costs: bool = False,
) -> DataLoader:
    """A DataLoader over the same training set, from ``loader`` (this rank's settings: its
    ``num_workers`` is not split again), its workers seeded with ``worker_seed``, its batches
    from ``batch_sampler`` (map-style data). Refused (ConfigError) when its batches in flight
    cannot fit in /dev/shm; ``costs``: its batches say what they cost (a tuning loader's).
    The lines every loader's build logs (pinning off the GPU, workers
    past the cores) were said for the run's first one. The workload's ``loader_args`` and
    ``context`` become its own."""
    quiet = logging.getLogger("feedrate.loader")
    level, quiet.level = quiet.level, logging.WARNING
    try:
        args = loader_kwargs(loader, hw)
        context = dataclasses.replace(
            work.context,
            num_workers=args["num_workers"],
            prefetch_factor=loader.prefetch_factor,
            engine=args.get("engine", "process"),
        )
        check_shm(context)
        if is_stream(work.dataset):
            del args["shuffle"]
            threads = args.get("engine") == "thread"  # refused by build_loader
            if args["num_workers"] > 1 and not work.split_checked and not threads:
                check_split_by_worker(work.train_set.dataset, args["multiprocessing_context"])
                work.split_checked = True
        built = build_loader(
            work.train_set,
            args,
            seed=cfg.trainer.seed,
            worker_seed=worker_seed,
            batch_sampler=None if is_stream(work.dataset) else batch_sampler,
            costs=costs,
        )
    finally:
        quiet.level = level
    work.loader_args, work.context = args, context
    return built


def _first_sample(dataset: Dataset) -> Any:
    """The dataset's first sample, as it returns it."""
    if is_stream(dataset):
        first = next(iter(GuardedStream(dataset, "raise")), None)
        if first is None:
            raise nothing_here(dataset)
        return first
    return GuardedDataset(dataset, "raise")[0]


def images_of(sample: Any, step: Step, loader: DictConfig) -> torch.Tensor | None:
    """The image of an ``(image, label)`` sample, which shapes the normalisation; None for
    a sample of another structure, which only a step of the user's own can train."""
    pair = isinstance(sample, (tuple, list)) and len(sample) == 2
    image = sample[0] if pair else None
    if isinstance(image, np.ndarray):  # the default collate batches it as a tensor
        image = torch.as_tensor(image)
    if isinstance(image, torch.Tensor):
        return image
    if named_collate(loader) is not None:  # the user's collate makes the batch: not checked
        return None
    if pair:  # the default collate cannot batch it (a PIL image, say)
        raise unbatchable_sample(repr(type(image)))
    if step.classifies:
        raise ConfigError(
            f"the training step trainer.step._target_={step.target} trains (image, label)"
            f" samples, and the dataset's first sample is {describe(sample)}: name a step of"
            " your own that turns such a batch into a loss (trainer.step._target_="
            "my_pkg.steps.my_step, docs/custom.md)"
        )
    return None


def _shown(sample: Any, image: torch.Tensor | None) -> str:
    return f"{tuple(image.shape)} {image.dtype}" if image is not None else describe(sample)


def _loader_args(loader: DictConfig, hw: Hardware, ranks: Ranks) -> dict:
    """The DataLoader's arguments; ``loader.num_workers`` is the machine's, split by rank
    (each rank's with ``loader.per_rank``)."""
    args = loader_kwargs(loader, hw)
    per_rank = distributed.workers_per_rank(loader.num_workers, ranks, loader.per_rank)
    if per_rank != loader.num_workers:
        log.info(
            "loader.num_workers=%d is the machine's: %d per rank for %d ranks on it",
            *(loader.num_workers, per_rank, ranks.local_world_size),
        )
        args["num_workers"] = per_rank
    return args


def evaluate_held_out(
    work: Workload, cfg: DictConfig, hw: Hardware
) -> tuple[float | None, float | None]:
    """Loss and accuracy on the held-out split (trainer.val_fraction), with the same loader."""
    if work.val_set is None:
        return None, None
    args = {**work.loader_args, "drop_last": False, "persistent_workers": False, "shuffle": False}
    on_error = cfg.dataset.get("on_error", "raise")
    loader = build_loader(GuardedDataset(work.val_set, on_error), args, cfg.trainer.seed)
    return evaluate(work.model, loader, hw, work.normalise, work.decode, work.step)
