"""Predict a loader configuration's memory and shared memory before running it.

Each DataLoader worker is a process; with many workers the OOM killer, or a small ``/dev/shm``
(Docker gives 64 MB), ends the run half-way, after minutes of start-up. The guard learns the
footprint of the main process and of one worker, per start method (a forked worker shares its
parent's pages, about 17 MB here; a spawned one imports torch, about 300 MB), from the trials
that ran, and skips a configuration predicted to exceed the machine's budget, with the figures
as its reason.

A run's memory is one figure everywhere (:func:`run_memory_mb`): the peak PSS of its process
tree plus the peak of its batches in ``/dev/shm`` (docs/design.md, "Memory readings").
"""

from __future__ import annotations

import logging
import multiprocessing
from dataclasses import dataclass

from omegaconf import DictConfig

from feedrate.hardware import available_memory, memory_allocation, shm_bytes
from feedrate.sweep.space import ranks_per_node

log = logging.getLogger(__name__)
MB = 2**20


@dataclass
class Footprint:
    main_mb: float = 0.0  # main process PSS
    per_worker_mb: float = 0.0  # PSS added by one worker
    sample_bytes: int = 0  # one sample as the loader moves it


def _value(v):
    return getattr(v, "value", v)  # an Enum member, as the config says it


def predict(loader: DictConfig, fp: Footprint, ranks: int = 1) -> tuple[float, float]:
    """(memory MB, shared memory MB) that ``loader`` is predicted to need at peak: the memory
    as :func:`run_memory_mb` counts it (the processes, and the batches in /dev/shm), and
    the batches alone, which /dev/shm must also hold; for ``ranks`` on the node, each with
    ``loader`` (``fp`` is one rank's)."""
    workers = loader.num_workers
    threads = _value(loader.get("engine")) == "thread"  # one process: the batches in it
    processes = fp.main_mb + (0 if threads else workers * fp.per_worker_mb)
    if workers == 0:
        return ranks * processes, 0.0
    prefetch = loader.prefetch_factor or 2
    batch_mb = loader.batch_size * fp.sample_bytes / MB
    if threads:
        return ranks * (processes + workers * prefetch * batch_mb), 0.0
    # Batches in flight: `prefetch` per worker, each in a shared-memory segment.
    shm = workers * prefetch * batch_mb
    return ranks * (processes + shm), ranks * shm


def run_memory_mb(metrics: dict | None) -> float | None:
    """A run's memory, the one figure the budget, the guard, the decision and the report use:
    peak PSS of the process tree plus the peak of its batches in /dev/shm, which is RAM
    (tmpfs) and mostly in no process's PSS while in flight (54 workers x prefetch 7 held
    13.6 GB there beside 1.8 GB of PSS). None when the run read no memory."""
    pss = (metrics or {}).get("peak_pss_mb")
    if not pss:
        return None
    return pss + ((metrics or {}).get("peak_shm_mb") or 0.0)


HEADROOM = 0.05  # of a memory budget: runs of the same settings peak this far apart


@dataclass(frozen=True)
class Budget:
    """The peak memory a configuration may use: ``sweep.memory_budget_gb``, or the job's
    allocation (SLURM, cgroup). A configuration must keep ``HEADROOM`` of it free: the peaks
    of 5 fresh runs of one thread preset spread by 4% (1,171 to 1,216 MB, engine_bench), so a
    configuration measured just under the budget goes over it in some runs."""

    mb: float
    source: str

    def __str__(self) -> str:
        return f"{self.mb:,.0f} MB ({self.source})"

    @property
    def usable_mb(self) -> float:
        return self.mb * (1 - HEADROOM)

    def over(self, metrics: dict) -> str | None:
        """Why a run whose memory (:func:`run_memory_mb`) peaked above the budget, less its
        headroom, is over it, or None."""
        peak = run_memory_mb(metrics)
        if peak and peak > self.usable_mb:
            return (
                f"used {peak:,.0f} MB at peak (PSS of the tree and its batches in /dev/shm),"
                f" over the memory budget {self} less {HEADROOM:.0%} of headroom"
            )
        return None


def memory_budget(config: DictConfig) -> Budget | None:
    """``sweep.memory_budget_gb``, else the SLURM allocation or cgroup limit, else None."""
    asked = (config.get("sweep") or {}).get("memory_budget_gb")
    if asked is not None:
        return Budget(asked * 1024, f"sweep.memory_budget_gb={asked:g}")
    allocated = memory_allocation()
    return Budget(allocated[0] * 1024, allocated[1]) if allocated else None


def _method(cfg: DictConfig, metrics: dict) -> str:
    """The start method a run's workers used: the one it recorded, else the one asked for,
    else the platform's default."""
    ran = ((metrics.get("run") or {}).get("loader") or {}).get("multiprocessing_context")
    if ran:
        return str(ran)
    asked = cfg.loader.get("multiprocessing_context")
    return str(asked) if asked else multiprocessing.get_start_method(allow_none=False)


@dataclass(frozen=True)
class Skip:
    """Why a configuration should not run, and the memory it was predicted to need (None
    when the reason is not memory: a stream's shard bound)."""

    reason: str
    predicted_mb: float | None = None  # the PSS it would peak at, as a budget compares


class FeasibilityGuard:
    def __init__(self, budget_frac: float = 0.8, budget: Budget | None = None) -> None:
        self.budget_frac = budget_frac
        self.budget = budget
        self.main_mb = 0.0  # the main process's PSS, the same whatever the start method
        self.per_worker_mb: dict[str, float] = {}  # start method -> PSS one worker adds
        self.sample_bytes = 0
        self.learned = False
        self.ram_budget_mb = available_memory() / MB * budget_frac  # within a cgroup limit
        shm = shm_bytes()
        self.shm_budget_mb = (shm[0] - shm[1]) / MB * budget_frac if shm else float("inf")

    def learn(self, cfg: DictConfig, result) -> None:
        """Update the footprint of ``cfg``'s start method from a finished trial's metrics
        (peaks only ever grow, within a start method)."""
        m = result.metrics
        if not m or not m.get("peak_pss_mb"):
            return
        workers = cfg.loader.num_workers
        ranks = ranks_per_node(cfg)  # the job's peak is its ranks' summed: one rank's here
        self.sample_bytes = max(self.sample_bytes, m.get("run", {}).get("sample_bytes", 0))
        if workers > 0 and _value(cfg.loader.get("engine")) == "thread":
            # the training process holds the threads' batches: not what a process run's does
            ahead = workers * (cfg.loader.prefetch_factor or 2) * cfg.loader.batch_size
            own = m["peak_main_pss_mb"] - ahead * self.sample_bytes / MB
            self.main_mb = self.main_mb or max(0.0, own)
            self.learned = True
            return
        self.main_mb = max(self.main_mb, m["peak_main_pss_mb"])
        if workers > 0:
            method = _method(cfg, m)
            per = (m["peak_pss_mb"] / ranks - m["peak_main_pss_mb"]) / workers
            self.per_worker_mb[method] = max(self.per_worker_mb.get(method, 0.0), per)
        self.learned = True

    def footprint_of(self, cfg: DictConfig) -> Footprint | None:
        """The footprint ``cfg`` is predicted with; None when its start method never ran."""
        threads = _value(cfg.loader.get("engine")) == "thread"
        if cfg.loader.num_workers == 0 or threads:  # no worker process to predict
            return Footprint(self.main_mb, 0.0, self.sample_bytes)
        per = self.per_worker_mb.get(_method(cfg, {}))
        return None if per is None else Footprint(self.main_mb, per, self.sample_bytes)

    def check(self, cfg: DictConfig) -> Skip | None:
        """Why ``cfg`` should not run (None when it fits, or nothing is known yet)."""
        shards = (cfg.get("dataset") or {}).get("n_shards")
        if shards and cfg.loader.num_workers > shards:
            return Skip(
                f"{cfg.loader.num_workers} workers for a stream of {shards} shards: it splits by"
                f" shard, so {cfg.loader.num_workers - shards} workers would read nothing and"
                " only cost memory and start-up"
            )
        fp = self.footprint_of(cfg) if self.learned else None
        if fp is None:
            return None
        ranks = ranks_per_node(cfg)
        memory, shm = predict(cfg.loader, fp, ranks)
        processes = (
            f"main {fp.main_mb:,.0f} MB + {cfg.loader.num_workers} workers x"
            f" {fp.per_worker_mb:,.0f} MB ({_method(cfg, {})})"
        )
        if ranks > 1:
            processes = f"{ranks} ranks x ({processes})"
        parts = f"{processes} + {shm:,.0f} MB of batches in /dev/shm, which is RAM"
        if self.budget is not None and memory > self.budget.usable_mb:
            return Skip(
                f"predicted memory {memory:,.0f} MB ({parts}) exceeds the memory budget"
                f" {self.budget} less {HEADROOM:.0%} of headroom",
                memory,
            )
        if memory > self.ram_budget_mb:
            return Skip(
                f"predicted memory {memory:,.0f} MB ({parts}) exceeds the budget"
                f" {self.ram_budget_mb:,.0f} MB ({self.budget_frac:.0%} of available RAM)",
                memory,
            )
        if shm > self.shm_budget_mb:
            return Skip(
                f"predicted shared memory {shm:,.0f} MB ({cfg.loader.num_workers} workers x"
                f" prefetch {cfg.loader.prefetch_factor or 2} x batch of {cfg.loader.batch_size}"
                f"{f' x {ranks} ranks' if ranks > 1 else ''})"
                f" exceeds the budget {self.shm_budget_mb:,.0f} MB"
                f" ({self.budget_frac:.0%} of free /dev/shm; raise it with docker --shm-size)",
                memory,
            )
        return None
