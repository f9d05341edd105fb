"""The DataLoader, built from ``cfg.loader`` (plain data under the DataLoader's own names)."""

from __future__ import annotations

import logging
import warnings

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

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
    return DataLoader(dataset, generator=generator, **kwargs)
