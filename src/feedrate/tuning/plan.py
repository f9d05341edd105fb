"""The tuning loader's batch plan: an epoch's batches of indices, and where the loop is in
them. Every DataLoader the tuning loader tries shares it as its batch sampler, so the next
one goes on where the one before stopped, and each sample is yielded once an epoch."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, Dataset, Sampler

from feedrate.distributed import Ranks
from feedrate.errors import ConfigError


class BatchPlan(Sampler[list[int]]):
    """An epoch's batches of indices, from the position on. They are the same in every
    process and after a resume: the user's batch sampler or sampler after its ``set_epoch``,
    a ``DistributedSampler`` under several ranks, or ``seed + epoch``'s shuffle. It holds the
    epoch and the batches of it already yielded (:meth:`snapshot`)."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        shuffle: bool,
        drop_last: bool,
        sampler: Sampler | None,
        batch_sampler: Sampler | None,
        seed: int,
        ranks: Ranks,
    ) -> None:
        self.dataset, self.ranks, self.seed = dataset, ranks, seed
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.sampler, self.batch_sampler = sampler, batch_sampler
        if sampler is None and batch_sampler is None and ranks.enabled:
            from torch.utils.data import DistributedSampler

            self.sampler = DistributedSampler(
                dataset, shuffle=shuffle, seed=seed, drop_last=drop_last
            )
        self.batches: list[list[int]] = []
        self.epoch, self.pos = 0, 0  # the epoch, and its batches already yielded
        self.resuming = False  # a position was set: the next pass goes on from it
        self.start = 0  # where the DataLoader built last began reading

    # -- the batch sampler a DataLoader reads ---------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches[self.start :])

    def __len__(self) -> int:
        return len(self.batches) - self.start

    def from_here(self) -> None:
        """The next DataLoader built reads from the position on."""
        self.start = self.pos

    # -- the epoch -------------------------------------------------------------------------

    def draw(self) -> None:
        """The batches of the current epoch."""
        epoch = self.epoch
        if self.batch_sampler is not None:
            _set_epoch(self.batch_sampler, epoch)
            self.batches = [list(b) for b in self.batch_sampler]
            return
        if self.sampler is not None:
            _set_epoch(self.sampler, epoch)
            indices = list(self.sampler)
        elif self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            indices = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            indices = list(range(len(self.dataset)))
        self.batches = [list(b) for b in BatchSampler(indices, self.batch_size, self.drop_last)]

    def epoch_batches(self) -> int:
        """Batches an epoch, before any is drawn."""
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        n = len(self.sampler) if self.sampler is not None else len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass is; a position set by :meth:`skip` holds in it."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.pos = self.pos if self.resuming else 0

    def skip(self, batches: int) -> None:
        """The next pass starts ``batches`` into its epoch."""
        if batches < 0:
            raise ValueError(f"skip({batches}): a number of batches, at least 0")
        self.pos, self.resuming = batches, batches > 0

    def begin(self, stream: bool) -> None:
        """A pass starts: the epoch's batches drawn (a stream orders itself), from the position
        a resume set, else from the first."""
        if not stream:
            self.draw()
        if not self.resuming:
            self.pos = 0
        self.resuming = False

    def took(self) -> None:
        """The loop took one more batch."""
        self.pos += 1

    def finished(self) -> bool:
        """Every batch of the epoch was yielded."""
        return self.pos >= len(self.batches)

    def end(self) -> None:
        """The pass ended: the next is the next epoch."""
        self.epoch, self.pos = self.epoch + 1, 0

    def worker_seed(self) -> int:
        """The seed of a DataLoader built now: it differs by where it starts, so one built
        mid-epoch does not draw the first one's augmentations again."""
        spot = self.seed * 1_000_003 + self.epoch * 10_007 + self.pos + self.ranks.rank * 7_919
        return spot % 2**63

    # -- a checkpoint ----------------------------------------------------------------------

    def snapshot(self, in_pass: bool, stream: bool) -> dict:
        """Its part of the tuning loader's ``state_dict`` (not named so: torchdata's nodes
        take a sampler with a ``state_dict`` for a stateful one): the epoch and its batches
        already yielded (the next epoch's first, where a pass is
        under way and its last batch is out), and the seed its shuffle depends on."""
        epoch, batches = self.epoch, self.pos
        if not stream and in_pass and batches >= len(self.batches):
            epoch, batches = epoch + 1, 0
        return {"epoch": epoch, "batches": batches, "seed": self.seed}

    def restore(self, state: dict) -> None:
        """Goes on from a :meth:`snapshot`; refuses one of another seed."""
        if state.get("seed", self.seed) != self.seed:
            raise ConfigError(
                f"the state was saved with seed={state['seed']}, this loader has"
                f" seed={self.seed}: its epochs would be shuffled otherwise;"
                f" pass seed={state['seed']}"
            )
        self.epoch, self.pos = int(state["epoch"]), int(state["batches"])
        self.resuming = True


def _set_epoch(sampler: Any, epoch: int) -> None:
    for s in (sampler, getattr(sampler, "sampler", None)):
        if hasattr(s, "set_epoch"):
            s.set_epoch(epoch)
