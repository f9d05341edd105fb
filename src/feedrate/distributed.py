"""Data parallel training under ``torchrun --nproc_per_node=N train.py ...``.

torchrun starts one process per rank and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``. Each rank drives one device (``cuda:<local rank>``, or the CPU with the
gloo backend), reads its own shard of every epoch (``DistributedSampler``) through its own
DataLoader, and trains a ``DistributedDataParallel`` replica. ``loader.num_workers`` is the
machine's budget (what a preset tuned on the whole machine says), split between the ranks on it,
unless ``loader.per_rank`` says it is each rank's (a preset from ``sweep.ranks_per_node``).
Rank 0 writes the outputs; metrics are gathered from every rank (global samples/s is the sum).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from feedrate.errors import ConfigError
from feedrate.hardware import Hardware
from feedrate.stats import window_spread

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ranks:
    """Where this process stands among the job's: its rank, how many there are, and how many
    share its node. Under torch.distributed, rank 0 decides and every rank takes its word at
    the same step (:meth:`agree`, :meth:`share`), on the CPU: a gloo group beside NCCL, so no
    device sync is paid for the flags that steer the loop."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def current(cls) -> Ranks:
        """The process group the loop runs in (torchrun's, Lightning's, the HF Trainer's)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return cls()
        world = dist.get_world_size()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        return cls(dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", 0)), local)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def agree(self, value: bool) -> bool:
        """Rank 0's ``value`` on every rank: a one-integer broadcast on the CPU."""
        if not self.enabled:
            return value
        box = torch.tensor([1 if value else 0], dtype=torch.int32)
        dist.broadcast(box, src=0, group=_control())
        return bool(box.item())

    def every(self, value: bool) -> bool:
        """Is ``value`` true on every rank: a one-integer all-reduce (MIN) on the CPU."""
        if not self.enabled:
            return value
        box = torch.tensor([1 if value else 0], dtype=torch.int32)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=_control())
        return bool(box.item())

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object) on every rank."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=_control())
        return box[0]

    def gather(self, value: Any) -> list:
        """Every rank's ``value``, on every rank."""
        if not self.enabled:
            return [value]
        every: list = [None] * self.world_size
        dist.all_gather_object(every, value)
        return every

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


# the gloo group of the ranks' flags beside NCCL, and the default group it was made in
_CONTROL: tuple[Any, Any] = (None, None)


def _control() -> Any:
    """The group the flags travel on: the default one (None) where it is gloo; else a gloo
    group of its own, made by :func:`setup` or, in a loop of your own (its group may be
    NCCL's, which wants CUDA tensors), at the first question, which every rank asks at the
    same step; made again for a new default group."""
    global _CONTROL
    if dist.get_backend() == "gloo":
        return None
    world, group = _CONTROL
    if group is None or world is not dist.group.WORLD:
        _CONTROL = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return _CONTROL[1]


def from_env() -> Ranks:
    """The ranks torchrun set in the environment; one process when it did not."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    return Ranks(
        rank=int(os.environ["RANK"]),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
    )


def setup(ranks: Ranks, hw: Hardware) -> Hardware:
    """Join the process group; this rank's hardware (its own CUDA device).

    Measuring by time (``trainer.max_seconds``), streaming and ``trainer.abandon_below``
    work under torchrun as in one process: each rank's meter takes rank 0's word (``flag``)
    on when its warm-up ends and when measuring is over, so every rank stops at the same step
    and the job's samples/s is summed over one window."""
    if not ranks.enabled:
        return hw
    if hw.is_cuda:
        if ranks.local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {ranks.local_rank} has no GPU: {torch.cuda.device_count()} visible,"
                f" {ranks.local_world_size} processes per node; use"
                f" torchrun --nproc_per_node={torch.cuda.device_count()}"
            )
        torch.cuda.set_device(ranks.local_rank)
        hw = dataclasses.replace(hw, device=torch.device("cuda", ranks.local_rank))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if hw.is_cuda else "gloo")
    _control()  # the flags' group, made by every rank here, in this order
    log.info(
        "rank %d of %d (local %d of %d) on %s, backend %s",
        ranks.rank,
        ranks.world_size,
        ranks.local_rank,
        ranks.local_world_size,
        hw.device,
        dist.get_backend(),
    )
    return hw


def workers_per_rank(num_workers: int, ranks: Ranks, per_rank: bool = False) -> int:
    """The machine's ``num_workers`` split between the ranks on it (at least 1 if any); as
    it is where it is already each rank's (``loader.per_rank``)."""
    if not ranks.enabled or num_workers == 0 or per_rank:
        return num_workers
    return max(1, num_workers // ranks.local_world_size)


def shard(dataset, ranks: Ranks, shuffle: bool, seed: int, drop_last: bool) -> DistributedSampler:
    """This rank's share of each epoch; ``set_epoch`` reshuffles, the same way on every rank."""
    return DistributedSampler(
        dataset,
        num_replicas=ranks.world_size,
        rank=ranks.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )


def wrap(model: torch.nn.Module, ranks: Ranks, hw: Hardware) -> torch.nn.Module:
    if not ranks.enabled:
        return model
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[hw.device.index] if hw.is_cuda else None
    )


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def gather(metrics: dict, ranks: Ranks) -> dict:
    """Rank 0's metrics with the whole job's figures: samples/s (and each window's) summed over
    ranks, memory summed, data wait and step times of the slowest rank, and each rank's own
    under ``ranks``."""
    if not ranks.enabled:
        return metrics
    every: list[dict] = [{} for _ in range(ranks.world_size)]
    dist.all_gather_object(every, metrics)
    if not ranks.is_main:
        return metrics
    total = dict(metrics)
    for key in (
        "samples_per_sec",
        "consumed_samples_per_sec",
        "measured_samples",
        "trained_samples",
        "peak_pss_mb",
        "peak_uss_mb",
        "peak_processes",
    ):
        values = [m.get(key) for m in every]
        total[key] = sum(values) if all(v is not None for v in values) else None
    total["peak_shm_mb"] = shm_per_host(every)
    # the ranks' windows open and close at the same steps (Meter.agree): the job's, summed
    windows = [m.get("window_samples_per_sec") for m in every]
    if all(isinstance(w, list) for w in windows):
        total["window_samples_per_sec"] = [sum(r) for r in zip(*windows, strict=False)]
        total["window_spread"] = window_spread(total["window_samples_per_sec"])
    for key in ("data_wait_frac", "step_time_p50_ms", "step_time_p90_ms", "first_batch_s"):
        values = [m.get(key) for m in every if m.get(key) is not None]
        total[key] = max(values) if values else None
    total["world_size"] = ranks.world_size
    total["ranks"] = [
        {
            k: m.get(k)
            for k in (
                "samples_per_sec",
                "data_wait_frac",
                "measured_steps",
                "measured_samples",
                "window_samples_per_sec",
                "peak_pss_mb",
            )
        }
        for m in every
    ]
    return total


def shm_per_host(every: list[dict]) -> float | None:
    """/dev/shm peak of the job: every rank reads its whole host's, so once per host (the
    highest reading there), summed over hosts."""
    per_host: dict[str, float] = {}
    for m in every:
        value = m.get("peak_shm_mb")
        if value is None:
            return None
        host = (m.get("run") or {}).get("host", "")
        per_host[host] = max(per_host.get(host, 0.0), value)
    return sum(per_host.values())


def teardown(ranks: Ranks) -> None:
    global _CONTROL
    if ranks.enabled and dist.is_initialized():
        dist.destroy_process_group()
        _CONTROL = (None, None)
