"""What the tuning loader tries: the engines it may search, the loader of each setting
(a DataLoader, or a :class:`feedrate.threads.ThreadLoader` for thread workers), the memory
it is measured at, and which of its failures the setting is to blame for
(docs/design.md, "The tuning loader")."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch
from torch.utils.data import Dataset

from feedrate.errors import ConfigError
from feedrate.tuning.policy import PROCESS, THREAD, Setting
from feedrate.tuning.setting import on_searched

log = logging.getLogger("feedrate.tuning")


class Refused(Exception):
    """``make_loader`` cannot build a setting here (its batches in flight would not fit in
    /dev/shm, say): the setting fails as one whose workers died does."""


def tree_pss_mb() -> float | None:
    """The memory of this process and its workers (PSS, so that pages they share count
    once), in MB: what a setting costs while it runs."""
    from feedrate.monitor import _tree_memory

    pss = _tree_memory(psutil.Process())[0]
    return pss / 2**20 if pss else None


def check_engines(names: Sequence[str], key: str) -> None:
    """Each of ``names`` (the argument ``key``'s) is an engine."""
    wrong = [e for e in names if e not in (PROCESS, THREAD)]
    if wrong:
        raise ConfigError(
            f"autotune_loader: {key}: {wrong[0]!r} is not an engine: {PROCESS!r} (worker"
            f" processes) or {THREAD!r} (threads of this process)"
        )


def preset_start(
    preset: Any, start: Setting, searched: tuple[str, ...], workload: Callable[[], dict]
) -> tuple[Any, Setting, float | None]:
    """``preset`` (a file path, or an object that starts from and writes one), where the
    tuning starts with it, and the rate it recorded there (None: searched again); on worker
    processes where the preset's engine is left out of the search here."""
    if isinstance(preset, (str, os.PathLike)):
        from feedrate.tuning.preset import LoaderPreset

        preset = LoaderPreset(preset, workload())
    if preset is None:
        return None, start, None
    start, recorded = preset.start_from(start)
    searchable = on_searched(start, searched, "the preset's")
    return preset, searchable, recorded if searchable == start else None


def searched_engines(
    dataset: Dataset, start: Setting, asked: Sequence[str] | None, worker_init_fn: Callable | None
) -> tuple[str, ...]:
    """The engines the tuning searches: ``asked`` (both by default), less threads where they
    cannot read ``dataset`` (said, or refused where the ``start`` is on them)."""
    if asked is not None and not list(asked):
        raise ConfigError("autotune_loader: engines=[] names none: 'process', 'thread' or both")
    engines = tuple(dict.fromkeys(asked or (PROCESS, THREAD)))
    check_engines(engines, "engines")
    engine = start.engine
    if start.num_workers and engine not in engines:
        raise ConfigError(
            f"autotune_loader: it starts on engine={engine!r}, which engines={list(engines)}"
            " leaves out: add it to engines, or start on one of them"
        )
    if THREAD not in engines:
        return engines
    why = ""
    if worker_init_fn is not None:
        why = "worker_init_fn runs in each worker process, and thread workers start none"
    else:
        from feedrate.threads import check_engine

        try:
            check_engine(dataset)
        except ConfigError as exc:
            why = str(exc)
    if not why:
        return engines
    if start.threads or engines == (THREAD,):
        raise ConfigError(f"autotune_loader: engine={THREAD!r}: {why}")
    log.log(
        logging.INFO if asked is None else logging.WARNING,
        "autotune_loader: thread workers left out of the search: %s",
        why,
    )
    return (PROCESS,)


def build(tl: Any, setting: Setting):
    """The loader of ``setting`` (:func:`feedrate.loader.engine_loader`, the run's factory
    too): the tuning loader's (``tl``) dataset, batches and arguments, its workers seeded by
    :meth:`TuningLoader.worker_seed`. A map-style dataset's batches come from the tuning
    loader's plan, with what they cost their worker (:mod:`feedrate.costs`)."""
    from torch.utils.data import default_collate

    from feedrate.loader import Order, engine_loader

    args = dict(tl.loader_args)
    collate = args.pop("collate_fn") or default_collate
    if tl.stream:  # it orders itself; its reads happen inside its own iterator: not timed
        order = Order(batch_size=tl.batch_size, drop_last=tl.drop_last)
    else:
        order = Order(batch_sampler=tl.batches_plan)
    processes = setting.num_workers and not setting.threads
    return engine_loader(
        tl.dataset,
        order,
        collate,
        engine=setting.engine,
        num_workers=setting.num_workers,
        prefetch_factor=setting.prefetch_factor,
        persistent_workers=bool(processes and tl.persistent),
        multiprocessing_context=tl.context if processes else None,
        generator=torch.Generator().manual_seed(tl.worker_seed()),
        costs=True,
        **(args if not setting.threads else {k: args[k] for k in ("pin_memory", "timeout")}),
    )


def end_loader_workers(loader: Any, kill: bool = False) -> list[int] | None:
    end = getattr(loader, "end_workers", None)
    return end(kill=kill) if end is not None else None


# A candidate's loader that fails in these ways is dropped and the tuning goes on; any other
# error (the dataset's own, the collate function's) is the loop's to see
_LOADER_FAILURES = ("exited unexpectedly", "killed by signal", "DataLoader timed out")


def loader_failure(exc: Exception, is_start: bool) -> str:
    """Why a setting's loader failed, where the setting is to blame; else ``exc`` again."""
    message = str(exc).strip()
    ours = isinstance(exc, RuntimeError) and any(m in message for m in _LOADER_FAILURES)
    ours = ours or (isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENOMEM))
    if not ours or is_start:
        raise exc
    first = (message.splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"
