"""Datasets and a clock for the tuning loader's tests, in process and in the processes that the
Lightning and Hugging Face tests start."""

from __future__ import annotations

import itertools
import os
import weakref

import torch
from torch.utils.data import Dataset, get_worker_info

import feedrate


class Indices(Dataset):
    """Sample i is i; a worker of a loader with ``die_from`` workers or more exits at once."""

    def __init__(self, n: int = 240, die_from: int | None = None, bad: int | None = None) -> None:
        self.n, self.die_from, self.bad = n, die_from, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        if self.die_from and info is not None and info.num_workers >= self.die_from:
            os._exit(3)
        if i == self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return torch.tensor(i)


class Stepping:
    """A clock that moves at every reading, less the more workers the loader has (more, with
    ``wider_is_slower``): each setting's window closes in a few batches, so a short epoch sees
    several switches, and a wider setting reads faster (or slower)."""

    def __init__(self, wider_is_slower: bool = False) -> None:
        self.now, self.loader, self.slower = 0.0, None, wider_is_slower

    def __call__(self) -> float:
        loader = self.loader() if self.loader is not None else None  # a weak reference
        workers = loader.current.num_workers if loader is not None else 0
        self.now += 0.06 * (1 + workers) if self.slower else 0.06 / (1 + workers)
        return self.now


class Shards(torch.utils.data.IterableDataset):
    """A stream that splits its samples between the workers itself; a worker of a loader with
    ``die_from`` workers or more exits at once."""

    def __init__(self, n: int = 200, die_from: int | None = None) -> None:
        self.n, self.die_from = n, die_from

    def __iter__(self):
        info = get_worker_info()
        k, w = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.die_from and w >= self.die_from:
            os._exit(3)
        yield from (torch.tensor(i) for i in range(k, self.n, w))


def tuning_loader(dataset, wider_is_slower: bool = False, **kwargs):
    # worker processes only, as the climb's own tests follow it: the engine's tests ask for both.
    # The figures lead, not the model: the fake clock's seconds are not the workers' own
    args = dict(
        batch_size=4,
        shuffle=True,
        num_workers=0,
        budget_s=12.0,
        max_workers=4,
        engines=["process"],
        predicts=False,
    )
    args.update(kwargs)
    clock = Stepping(wider_is_slower)
    loader = feedrate.autotune_loader(dataset, clock=clock, cpu=None, **args)
    # weakly: a loader and its clock in a cycle outlive the test, and the garbage collector
    # then ends its workers at any later moment, in a worker of another loader forked meanwhile
    clock.loader = weakref.ref(loader)
    return loader


def epoch_of(loader, stop_after: int | None = None) -> list[int]:
    seen = []
    for batch in itertools.islice(loader, stop_after):
        seen += batch.tolist()
    return seen
