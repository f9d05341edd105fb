"""The DataLoader, built from ``cfg.loader`` (plain data under the DataLoader's own names)."""

from __future__ import annotations

import logging
import warnings

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from feedrate.checks import check_picklable, start_method
from feedrate.hardware import Hardware, usable_cores

log = logging.getLogger(__name__)

# PyTorch warns whenever workers outnumber cores. That rule is wrong for samples that wait on
# I/O (a sleeping worker holds no core), so feedrate replaces it with a measured view.
warnings.filterwarnings(
    "ignore", message=r"This DataLoader will create \d+ worker processes", category=UserWarning
)


def loader_kwargs(cfg: DictConfig, hw: Hardware) -> dict:
    """DataLoader keyword arguments from ``cfg.loader``, resolved for this hardware."""
    pin = hw.pin_memory if cfg.pin_memory is None else bool(cfg.pin_memory)
    if pin and not hw.is_cuda:
        if cfg.pin_memory:  # asked for explicitly: say why it is off
            log.info("pin_memory disabled: no CUDA device <cfg.loader.pin_memory>")
        pin = False
    kwargs = {
        "batch_size": cfg.batch_size,
        "shuffle": cfg.shuffle,
        "num_workers": cfg.num_workers,
        "pin_memory": pin,
        "drop_last": cfg.drop_last,
        "timeout": cfg.timeout,
        "persistent_workers": cfg.persistent_workers,
    }
    if cfg.num_workers > 0:
        kwargs["prefetch_factor"] = cfg.prefetch_factor  # None: PyTorch's default (2)
        kwargs["multiprocessing_context"] = start_method(cfg)
    return kwargs


class CountingCollate:
    """``default_collate`` that counts, per worker, the samples each worker has produced.

    The counts live in shared memory (one slot per worker, so no locking), and let the main
    process measure the rate at which workers *produce* batches, not only the rate at which
    training *consumes* them. The two differ while a prefetched backlog is being consumed:
    all workers start at once and queue ``num_workers * prefetch_factor`` batches, which the
    first seconds of training eat at compute speed, a rate the loader cannot sustain.
    """

    def __init__(self, num_workers: int) -> None:
        self.counts = torch.zeros(num_workers, dtype=torch.int64).share_memory_()

    def __call__(self, batch: list) -> object:
        out = default_collate(batch)
        info = get_worker_info()
        if info is not None:
            self.counts[info.id] += len(batch)
        return out


def produced_samples(loader: DataLoader) -> int | None:
    """Samples the loader's workers have produced so far (None without workers)."""
    collate = getattr(loader, "collate_fn", None)
    return int(collate.counts.sum()) if isinstance(collate, CountingCollate) else None


def build_loader(dataset: Dataset, kwargs: dict, seed: int) -> DataLoader:
    """A DataLoader over ``dataset`` with ``kwargs`` from :func:`loader_kwargs`.

    Refuses, before any worker starts, a dataset that its workers could not receive.
    """
    workers = kwargs["num_workers"]
    if workers > 0:
        check_picklable(dataset, kwargs["multiprocessing_context"])
    cores = usable_cores()
    if workers > cores:
        log.info(
            "num_workers=%d exceeds the %g usable cores <cfg.loader.num_workers>: right when"
            " samples wait on I/O, oversubscribed when decoding is CPU-bound; data_wait_frac"
            " and cpu_util in the summary tell which",
            workers,
            cores,
        )
    generator = torch.Generator().manual_seed(seed)
    collate = CountingCollate(workers) if workers > 0 else None
    return DataLoader(dataset, generator=generator, collate_fn=collate, **kwargs)
