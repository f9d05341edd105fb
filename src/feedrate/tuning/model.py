"""A model of the input pipeline: from what a sample costs, the setting that feeds the step
(docs/design.md, "The tuning loader", "What a sample costs").

A pure function, as the policy is: the costs one setting measured (a batch's time in its
worker, its CPU, its bytes, the step's own time and CPU), the cores and the engines in; a
predicted rate for any setting, and the setting predicted best, out. Four rules:

- **Little's law.** ``N`` workers that each take ``T`` seconds a batch make ``N / T`` batches
  a second: the step, which takes ``1 / step`` a second, needs ``rate x T`` workers, with
  headroom for the spread of batch times.
- **The CPU cap.** No setting passes ``cores / (CPU of a batch + the step's CPU a batch)``:
  past it, workers only compete with the step.
- **The engine.** Threads share one interpreter: the CPU a read holds the GIL for is done one
  thread at a time. A batch's CPU against its wall time in a worker says how much that is.
- **The depth.** A batch that takes ``k`` times the mean stalls the queue for ``k`` batches'
  time: the other workers keep working if each may hold ``k`` batches.
- **The step's threads.** Where the step runs on the cores the workers use, its intra-op
  threads take CPU the workers need: on one thread it is slower, but spends only its work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from feedrate.tuning.setting import PROCESS, THREAD, Setting

DEEPEST = 8  # the deepest queue a worker gets (prefetch_factor)
HANDOFF_S = 50e-6  # a batch's hand-off from a worker process, before its bytes: pickling, a queue
HANDOFF_BYTES_S = 2e9  # bytes a second the main process receives from worker processes at
EQUAL = 0.05  # predicted rates this close are one: the cheaper setting (no process) is taken
# A cap on the cores is read from one window's CPU a batch, which three first windows of one
# held-out store put at 23, 28 and 46 ms: where the reads mostly wait, the pool is sized for
# this much more than the cap, as workers past it only wait, and one short of it loses the rate
CAP_SPREAD = 0.25


@dataclass(frozen=True)
class Costs:
    """What one setting's window measured of a batch, in seconds (of ``samples`` samples)."""

    batch_size: float  # samples a batch, on average
    worker_s: float  # a batch's time in its worker (its reads and its collate), mean
    worker_cpu_s: float  # of which on a core
    queued_s: float  # of which ready to run, waiting for a core (busy cores: not the data's)
    collate_s: float  # the collate's part of ``worker_s``
    tail: float  # the slow batches' time in a worker (95th percentile) over the mean
    step_s: float  # the loop's time a batch outside ``__next__``: its step
    step_cpu_s: float  # the main process's CPU a batch, the workers' own left out
    handoff_s: float  # a batch's time inside ``__next__`` when one is ready (0: not measured)
    nbytes: float  # a batch's bytes
    workers_cores: float = 0.0  # cores the workers used together over the window
    step_queued_s: float = 0.0  # of ``step_s``, the loop's thread waiting for a core
    measured_on: Setting | None = None
    batches: int = 0  # batches reported in the window
    step_threads: int = 0  # the training process's intra-op threads over the window (0: unsaid)

    @property
    def blocked_s(self) -> float:
        """A batch's time in its worker off the CPU and not waiting for one: storage, the
        network, a lock (on threads, the GIL too)."""
        return max(0.0, self.worker_s - self.worker_cpu_s - self.queued_s)

    @property
    def waits_mostly(self) -> bool:
        """A batch spends half its time in a worker or more off the CPU (latency-bound):
        workers past the cores' need only wait, where on reads that burn the cores they
        compete with the step."""
        return self.blocked_s >= 0.5 * self.alone_s

    @property
    def alone_s(self) -> float:
        """A batch's time in a worker with a core of its own."""
        return self.blocked_s + self.worker_cpu_s

    @property
    def step_alone_s(self) -> float:
        """The step's time a batch with the cores to itself: the workers' competition is the
        CPU cap's to count, not the step's."""
        return max(0.0, self.step_s - self.step_queued_s)

    @property
    def gil_share(self) -> float:
        """The share of a worker's CPU that holds the GIL: all of it, unless thread workers
        were measured using more than one core together (C code that releases it)."""
        on_threads = self.measured_on is not None and self.measured_on.threads
        if on_threads and self.workers_cores > 1.05:
            return 1 / self.workers_cores
        return 1.0

    @classmethod
    def from_dict(cls, data: dict) -> Costs:
        on = data.get("measured_on")
        return cls(**{**data, "measured_on": Setting(**on) if on else None})


@dataclass(frozen=True)
class Prediction:
    setting: Setting
    samples_per_sec: float
    bound: str  # what holds it there: "step", "workers", "cores", "gil", "collate"
    measured_from: Setting | None  # the setting whose costs it read
    why: str


@dataclass(frozen=True)
class Pipeline:
    """The machine the model predicts for."""

    cores: float
    max_workers: int
    engines: tuple[str, ...] = (PROCESS,)
    memory_mb: float | None = None  # what the loader may add (None: not limited here)
    worker_mb: float = 0.0  # a worker process's own memory
    # the training process's intra-op threads, which the tuner may lower to one where the
    # step shares the cores with the workers (0: it does not turn them)
    main_threads: int = 0


def handoff_s(costs: Costs, setting: Setting) -> float:
    """The main process's time to take a batch from ``setting``'s workers: measured where the
    costs were measured on worker processes, else a queue's overhead and the bytes' copy."""
    if not setting.num_workers or setting.threads:
        return 0.0
    on = costs.measured_on
    if on is not None and on.num_workers and not on.threads and costs.handoff_s > 0:
        return costs.handoff_s
    return HANDOFF_S + costs.nbytes / HANDOFF_BYTES_S


def step_costs(costs: Costs, setting: Setting) -> tuple[float, float]:
    """The step's time a batch with the cores to itself, and the training process's CPU a
    batch, on ``setting``'s main threads. On fewer threads than it was measured on, the step
    takes at most as many times longer (its work, spread over its threads), and its CPU is
    that work alone: an intra-op pool spins on its cores between steps, which the workers
    beside it would use (a held-out store on 2 cores: the main process spent 3x the step's
    time on CPU with 2 threads, and 1 thread trained 1.2x the samples at 24 workers)."""
    alone, cpu = costs.step_alone_s, costs.step_cpu_s
    t0, t = costs.step_threads, setting.main_threads
    if t and t0 and t < t0:
        alone = costs.step_alone_s * t0 / t
        cpu = min(cpu, t0 * costs.step_alone_s)
    return alone, cpu


def bounds(costs: Costs, setting: Setting, pipe: Pipeline) -> dict[str, float]:
    """The samples a second each part of the pipeline lets ``setting`` reach alone: the
    step, the workers, the cores (and on threads the GIL and the collating thread); without
    workers, the main process reading and stepping in turn ("step")."""
    b = max(costs.batch_size, 1e-9)
    step_alone, step_cpu = step_costs(costs, setting)
    if not setting.num_workers:  # the main process reads, collates and steps in turn
        return {"step": b / max(step_alone + costs.alone_s, 1e-9)}
    take = handoff_s(costs, setting)
    step_cpu += take
    per_batch = {
        "step": 1 / max(step_alone + take, 1e-9),
        "workers": setting.num_workers / max(costs.alone_s, 1e-9),
        "cores": pipe.cores / max(costs.worker_cpu_s + step_cpu, 1e-9),
    }
    if setting.threads:
        gil = costs.worker_cpu_s * costs.gil_share
        per_batch["gil"] = 1 / max(gil, 1e-9)
        per_batch["collate"] = 1 / max(costs.collate_s, 1e-9)  # one thread collates
    return {part: b * batches for part, batches in per_batch.items()}


def rate(costs: Costs, setting: Setting, pipe: Pipeline) -> tuple[float, str]:
    """The samples a second ``setting`` is predicted to train at, and what bounds it."""
    each = bounds(costs, setting, pipe)
    bound = min(each, key=each.get)
    return each[bound], bound


def past_the_workers(costs: Costs, setting: Setting, pipe: Pipeline) -> bool:
    """``setting``'s rate is held by something other than its workers, even with a quarter
    fewer of them (``CAP_SPREAD``): in the model, more workers change nothing, and a wider
    pool of the same setting trains as fast."""
    if not setting.num_workers:
        return False
    fewer = max(1, math.floor(setting.num_workers / (1 + CAP_SPREAD)))
    return rate(costs, replace(setting, num_workers=fewer), pipe)[1] != "workers"


def headroom(costs: Costs) -> float:
    """Workers beyond Little's law, for the spread of batch times: 10% to 50%."""
    return min(1.5, max(1.1, 1 + 0.25 * (costs.tail - 1)))


def depth(costs: Costs) -> int:
    """The queue a worker keeps (``prefetch_factor``): its slow batches' time in batches."""
    return int(min(DEEPEST, max(2, math.ceil(costs.tail))))


def width(costs: Costs, engine: str, pipe: Pipeline, main_threads: int | None = None) -> int:
    """The workers that feed the step on ``engine`` (Little's law, with headroom), where the
    cores and the GIL let the rate go, within the machine's most workers and its memory. Where
    the cores hold the rate and a read mostly waits, for ``CAP_SPREAD`` past their cap: a pool
    that falls short of the cores leaves them idle, while its extra workers only wait."""
    probe = Setting(pipe.max_workers, 2, engine, main_threads)
    ceiling, bound = rate(costs, probe, pipe)  # every bound but the workers'
    target = ceiling / max(costs.batch_size, 1e-9)  # batches a second
    if bound == "cores" and costs.waits_mostly:
        target *= 1 + CAP_SPREAD
    n = math.ceil(target * costs.alone_s * headroom(costs))
    most = pipe.max_workers
    if pipe.memory_mb is not None and engine == PROCESS and pipe.worker_mb > 0:
        most = min(most, int(pipe.memory_mb // pipe.worker_mb))
    return max(1, min(most, n))


def predict(costs: Costs, pipe: Pipeline) -> Prediction:
    """The setting predicted to train fastest, the cheapest of those within ``EQUAL`` of it:
    no workers before threads, threads before worker processes."""
    own = pipe.main_threads or None
    options = [Setting(0, main_threads=own)]
    splits = [own]
    if pipe.main_threads > 1 and costs.step_threads:  # the threads measured first: the
        splits = [1, own] if costs.step_threads == 1 else [own, 1]  # others are a guess
    for threads in splits:
        for engine in sorted(pipe.engines, key=lambda e: e != THREAD):  # the cheaper first
            width_ = width(costs, engine, pipe, threads)
            options.append(Setting(width_, depth(costs), engine, threads))
    rated = [(s, *rate(costs, s, pipe)) for s in options]
    best = max(r for _, r, _ in rated)
    setting, samples, bound = next(x for x in rated if x[1] >= (1 - EQUAL) * best)
    return Prediction(setting, samples, bound, costs.measured_on, explain(costs, setting, bound))


def explain(costs: Costs, setting: Setting, bound: str) -> str:
    """The prediction in words: what a batch costs, and why this setting."""
    ms = 1000
    said = (
        f"a batch of {costs.batch_size:.0f} takes {costs.alone_s * ms:.1f} ms in a worker"
        f" ({costs.worker_cpu_s * ms:.1f} ms on a core), the step {costs.step_alone_s * ms:.1f} ms"
    )
    if not setting.num_workers:
        return f"{said}: the main process alone keeps up"
    return f"{said}: {setting.describe()} feeds it, held by {HELD_BY[bound]}"


HELD_BY = {
    "step": "the step",
    "workers": "the workers",
    "cores": "the cores",
    "gil": "the GIL",
    "collate": "the collating thread",
}
