"""Tuning the input pipeline while a loop trains: the policy (:mod:`.policy`), the
measurement of one setting (:mod:`.probe`) and the loader that owns them (:mod:`.loader`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from feedrate.tuning.loader import TuningLoader


def __getattr__(name: str) -> Any:
    """``TuningLoader`` loads the loader (torch's DataLoader) when first used: the policy,
    the model and the decision import without it."""
    if name == "TuningLoader":
        from feedrate.tuning.loader import TuningLoader

        return TuningLoader
    raise AttributeError(f"module 'feedrate.tuning' has no attribute {name!r}")


def autotune_loader(dataset, **kwargs) -> TuningLoader:
    """A loader over ``dataset`` that tunes its workers while your loop trains.

    Takes the DataLoader's own arguments (``batch_size``, ``shuffle``, ``sampler``,
    ``batch_sampler``, ``collate_fn``, ``drop_last``, ``num_workers`` (where it starts),
    ``prefetch_factor``, ``pin_memory``, ``persistent_workers``, ``worker_init_fn``,
    ``multiprocessing_context``, ``timeout``) and ``budget_s`` (seconds of tuning),
    ``max_workers``, ``preset`` (a .yaml file it writes its choice to and starts from next
    time) and ``seed`` (the shuffle's). ``engines``: what its workers may be, ``"process"``
    (the DataLoader's) and ``"thread"`` (threads of this process, for a map-style dataset safe
    to read from several threads; left out, with a log line, where it is not), both by
    default; ``engine``: the one it starts on. ``split_threads=True``: it turns this process's
    intra-op threads too (``torch.set_num_threads``: its own, or one), where the step runs on
    the cores the workers use. ``retune_on_drift=N``: at most N times, it tunes again at an
    epoch's start where a listener (``subscribe``: feedrate's meter, or one of your own with
    ``fell_behind()``) says the pipeline fell behind. Iterate it as a DataLoader, one pass an
    epoch.
    """
    from feedrate.tuning.loader import TuningLoader

    return TuningLoader(dataset, **kwargs)


__all__ = ["TuningLoader", "autotune_loader"]
