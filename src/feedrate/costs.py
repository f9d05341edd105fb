"""What each batch costs the worker that made it, sent with the batch (docs/design.md, "The
tuning loader", "What a sample costs").

A loader built with costs reads through :class:`TimedReads` and collates through
:class:`CostedCollate`: a batch leaves its worker (a process, a thread, or the main process)
as ``Costed(batch, BatchCost)``, and whoever iterates the loader takes the cost off. The
times are the reading thread's own: its wall time, its CPU time, and (on Linux) the time it
was ready to run but waited for a core, so that a read slowed by busy cores is not taken for
one that waits on storage. Each reading thread times at most one batch every
``REPORT_EVERY_S`` (the first it starts after that), so that reporting costs a bounded share
of a core however fast batches come; the others go as they are. Nothing is profiled apart.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, NamedTuple

import torch

_SCHEDSTAT = "/proc/thread-self/schedstat"  # CPU ns, run-queue wait ns, time slices
REPORT_EVERY_S = 0.02  # a reading thread times a batch at most this often (about 10 us each)
_own = threading.local()  # each thread's open schedstat, and the process it was opened in


class _Schedstat:
    """A thread's schedstat, kept open while the thread lives (closed with its locals)."""

    def __init__(self) -> None:
        self.pid, self.fd = os.getpid(), os.open(_SCHEDSTAT, os.O_RDONLY)

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def _read_schedstat() -> tuple[float, float] | None:
    """This thread's (CPU, waiting for a core) seconds, from a file it keeps open (a read of
    it costs a microsecond; opening it, ten). A forked worker opens its own."""
    try:
        own = getattr(_own, "stat", None)
        if own is None or own.pid != os.getpid():
            own = _own.stat = _Schedstat()
        cpu, waited = os.pread(own.fd, 64, 0).split()[:2]
        return int(cpu) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return None


_HAS_SCHEDSTAT = _read_schedstat() is not None


def thread_clock() -> tuple[float, float, float]:
    """(wall, CPU, waiting for a core) seconds of the calling thread so far; the last is 0
    where the kernel does not say (outside Linux)."""
    wall = time.perf_counter()
    if _HAS_SCHEDSTAT:
        read = _read_schedstat()
        if read is not None:
            return wall, read[0], read[1]
    return wall, time.thread_time(), 0.0


def reader_clock(queued: bool = True) -> tuple[float, float, float]:
    """:func:`thread_clock` of the thread that reads, but in a worker process the CPU of the
    whole process: it reads one batch at a time, and the threads its reads start (a BLAS
    pool under NumPy, a decoder's) burn cores for that batch too. ``queued=False``: no
    run-queue wait (0), for a third of what a reading costs."""
    if queued:
        wall, cpu, waited = thread_clock()
    else:
        wall, cpu, waited = time.perf_counter(), time.thread_time(), 0.0
    if torch.utils.data.get_worker_info() is not None:
        cpu = time.process_time()
    return wall, cpu, waited


def due() -> bool:
    """This thread times the batch it starts now: ``REPORT_EVERY_S`` have passed since the
    last one it timed."""
    now = time.perf_counter()
    if now < getattr(_own, "next_at", 0.0):
        return False
    _own.next_at = now + REPORT_EVERY_S
    return True


class BatchCost(NamedTuple):
    """One batch's cost in its worker, in seconds and bytes."""

    samples: int
    read_s: float  # wall time of the batch's reads
    read_cpu_s: float  # CPU time of those reads (the reading thread's)
    read_queued_s: float  # of ``read_s``, ready to run but waiting for a core
    collate_s: float
    collate_cpu_s: float
    nbytes: int  # the collated batch's tensors, arrays and bytes


class Costed(NamedTuple):
    """A batch and its cost. A named tuple: ``pin_memory`` pins the batch inside it."""

    batch: Any
    cost: BatchCost


class Reads(list):
    """A batch's samples, with the reading thread's clocks (:func:`reader_clock`) when its
    reads began and ended."""

    began: tuple[float, float, float] | None = None
    ended: tuple[float, float, float] | None = None


def timed_reads(read_batch, indices) -> list:
    """``read_batch(indices)``, timed in the thread that reads where it is :func:`due`."""
    if not due():
        return read_batch(indices)
    began = reader_clock()
    samples = Reads(read_batch(indices))
    samples.began, samples.ended = began, reader_clock()
    return samples


class TimedReads(torch.utils.data.Dataset):
    """A map-style dataset whose batches of reads are timed where they run (a DataLoader
    reads a batch through ``__getitems__``). Everything else is the wrapped dataset's."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices) -> list:
        own = getattr(self.dataset, "__getitems__", None)
        read = own if own else (lambda ix: [self.dataset[i] for i in ix])
        return timed_reads(read, indices)


class CostedCollate:
    """``collate``, timed where its samples' reads were (:class:`Reads`): that batch is sent
    as ``Costed`` with what its reads and its collate took; the others as they are."""

    def __init__(self, collate) -> None:
        self.collate = collate

    def __call__(self, samples: list) -> Any:
        if not isinstance(samples, Reads) or samples.began is None:
            return self.collate(samples)
        # the reads' clocks are the reading thread's; on thread workers another thread
        # collates, so the collate is timed on its own clocks
        began, ended = samples.began, samples.ended
        start = reader_clock(queued=False)
        batch = self.collate(list(samples))
        end = reader_clock(queued=False)
        read = tuple(e - b for b, e in zip(began, ended))  # noqa: B905
        took = (end[0] - start[0], end[1] - start[1])
        return Costed(batch, BatchCost(len(samples), *read, *took, nbytes(batch)))


def inner_collate(collate):
    """The collate function a :class:`CostedCollate` times (``collate`` itself otherwise)."""
    return collate.collate if isinstance(collate, CostedCollate) else collate


def nbytes(batch: Any, depth: int = 0) -> int:
    """The bytes of a batch's tensors, arrays and byte strings (nested four deep at most)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, (bytes, bytearray, memoryview)):
        return len(batch)
    size = getattr(batch, "nbytes", None)  # a numpy array
    if isinstance(size, int):
        return size
    if depth >= 4:
        return 0
    if isinstance(batch, dict):
        return sum(nbytes(v, depth + 1) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(nbytes(v, depth + 1) for v in batch)
    return 0


def split(item: Any) -> tuple[Any, BatchCost | None]:
    """(the batch, its cost) of what a loader built with costs yielded; (item, None) else."""
    if isinstance(item, Costed):
        return item.batch, item.cost
    return item, None
