"""Under torch.distributed, rank 0 decides and every rank takes its word at the same step."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    _group: Any = field(default=None, repr=False)

    @classmethod
    def current(cls) -> Ranks:
        """The process group the loop runs in (Lightning's, the HF Trainer's, torchrun's)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return cls()
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(dist.get_rank(), world, local)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _control(self):
        """A gloo group of its own, made at the first question (every rank asks it at the
        same step): the loop's group may be NCCL's, which wants CUDA tensors."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def agree(self, value: bool) -> bool:
        """Rank 0's ``value`` on every rank."""
        if not self.enabled:
            return value
        box = torch.tensor([int(bool(value))], dtype=torch.int32)
        dist.broadcast(box, src=0, group=self._control())
        return bool(box.item())

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object) on every rank."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._control())
        return box[0]
