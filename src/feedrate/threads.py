"""``loader.engine=thread``: the loader's workers as threads of the training process.

The same dataset, sampler, batch size and collate function as the DataLoader, on
torchdata.nodes: a ``ParallelMapper(method="thread")`` of ``num_workers`` threads reads each
batch's samples (one thread a batch, as one DataLoader worker makes a batch), in order, and one
thread apart collates them, ahead of the loop. A thread that waits on storage or the network,
or decodes in C code that releases the GIL, holds no core, and nothing is copied per worker:
there is one dataset object and one process (docs/design.md, "Thread workers").
"""

from __future__ import annotations

import io
import itertools
import queue
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import torchdata.nodes as tn
from torch.utils.data import BatchSampler, Dataset, Sampler, Subset

from feedrate.costs import CostedCollate, Reads, due, reader_clock
from feedrate.errors import ConfigError
from feedrate.stream import is_stream

_END = object()
_POLL_S = 0.1  # how often a waiting thread looks whether it is to stop
_JOIN_S = 2.0  # the most an ended iteration waits for its threads to finish their reads

_current = threading.local()  # in a pool's thread: its worker id


def worker_id() -> int | None:
    """The id (0 to num_workers - 1) of the thread worker this code runs in; None outside one.
    ``torch.utils.data.get_worker_info()`` answers for worker processes only."""
    return getattr(_current, "id", None)


class ThreadLoader:
    """A DataLoader's interface over thread workers: iterate it once an epoch for its batches.

    ``num_workers * prefetch_factor`` batches are read ahead at most, as a DataLoader's workers
    read ahead (torchdata lets at most two per thread be in flight; the rest wait collated).
    ``timeout``: seconds the loop waits for a batch before it raises, as the DataLoader does.
    ``persistent_workers`` changes nothing: threads start in microseconds.
    """

    multiprocessing_context = None  # no worker processes to start
    engine = "thread"  # loader.engine's word for it (a DataLoader's workers: "process")

    def __init__(
        self,
        dataset: Dataset,
        *,
        num_workers: int,
        collate_fn,
        batch_size: int | None = 1,
        sampler: Sampler | None = None,
        batch_sampler: Sampler | None = None,
        drop_last: bool = False,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        timeout: float = 0.0,
        persistent_workers: bool = False,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: thread workers need at least one")
        if batch_sampler is None and sampler is None:
            raise ValueError("a sampler or a batch_sampler is needed")
        self.dataset = dataset
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.sampler = sampler
        self.batch_size = batch_size if batch_sampler is None else None
        self.drop_last = drop_last
        if batch_sampler is None:
            batch_sampler = BatchSampler(sampler, batch_size or 1, drop_last)
        self.batch_sampler = batch_sampler
        self.prefetch_factor = prefetch_factor or 2
        self.pin_memory = pin_memory
        self.timeout = timeout
        self.persistent_workers = persistent_workers
        self._latest: _Batches | None = None
        # A loop that leaves an epoch early (a run's last step) drops the loader, not the
        # iteration, whose threads hold it: it ends with the loader, or its threads read on
        self._live: list[_Batches] = []
        weakref.finalize(self, _close_all, self._live)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        self.end_workers()  # one iteration at a time: the last one's threads end first
        self._latest = _Batches(self)
        self._live.append(self._latest)
        return self._latest

    def end_workers(self, kill: bool = False) -> list[int]:
        """End the latest iteration's threads (a thread stuck in a read is left to end with
        the process: Python cannot stop it). No exit codes: there are no processes."""
        if self._latest is not None:
            self._latest.close()
            self._latest = None
        self._live.clear()
        return []


def _close_all(live: list[_Batches]) -> None:
    for batches in live:
        batches.close()


class _Batches(Iterator[Any]):
    """One epoch's batches: the pool reads, the collating thread collates into ``ready``."""

    def __init__(self, loader: ThreadLoader) -> None:
        self.timeout = loader.timeout or None
        workers, ahead = loader.num_workers, loader.prefetch_factor
        ids, dataset, make = itertools.count(), loader.dataset, loader.collate_fn
        stop = self._stop = threading.Event()
        pool = self._pool = []  # this pool's threads, as each starts reading

        timed = isinstance(make, CostedCollate)  # its reads timed too, in the reading thread

        def read(indices: list[int]) -> list[Any] | None:
            if worker_id() is None:
                _current.id = next(ids)  # each thread of this pool: its id, on its first batch
                pool.append(threading.current_thread())
            timing = timed and due()
            samples = Reads() if timing else []
            if timing:
                samples.began = reader_clock()
            for i in indices:
                if stop.is_set():  # ended: nobody takes this batch, its other reads are left
                    return None
                samples.append(dataset[i])
            if timing:
                samples.ended = reader_clock()
            return samples

        def collate(samples: list[Any] | None) -> Any:
            return None if samples is None else make(samples)

        # torchdata keeps 2 batches a thread in flight (at most 1 where asked)
        fewer = {"max_concurrent": workers} if ahead < 2 else {}
        node: tn.BaseNode = tn.IterableWrapper(loader.batch_sampler)
        node = tn.ParallelMapper(node, read, workers, in_order=True, method="thread", **fewer)
        node = tn.Mapper(node, collate)
        if loader.pin_memory:
            node = tn.PinMemory(node)
        self._node: tn.BaseNode | None = node
        self.ready: queue.Queue = queue.Queue(maxsize=max(1, (ahead - 2) * workers))
        self._thread = threading.Thread(target=self._collate, name="feedrate-collate", daemon=True)
        self._thread.start()

    def _collate(self) -> None:
        node = self._node
        _current.id = 0  # what it collates counts as the workers' (CountingCollate)
        try:
            node.reset()
            for batch in node:
                if not self._put(batch):
                    return
            self._put(_END)
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which raises it
            # The error's frames hold the pool's iterator (torchdata's, and this one's
            # ``node``): let it go, so that its threads end now, not when the loop drops the error
            node = None
            traceback.clear_frames(exc.__traceback__)
            self._put(_Failed(exc))

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self.ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> Any:
        if self._node is None:
            raise StopIteration
        try:
            item = self.ready.get(timeout=self.timeout)
        except queue.Empty:
            self.close()
            raise RuntimeError(
                f"DataLoader timed out after {self.timeout} seconds (thread workers)"
            ) from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failed):
            self.close()
            raise item.exc
        return item

    def close(self) -> None:
        """Stop reading, and wait (up to ``_JOIN_S``) for the pool's threads to end: each
        leaves its batch after the read under way, and torchdata ends them when its iterator
        goes. A thread stuck in a read is left to end with the process. Once is enough."""
        if self._stop.is_set():
            return
        self._stop.set()
        node, self._node = self._node, None
        while True:  # free what waits, so that the collating thread sees the stop
            try:
                self.ready.get_nowait()
            except queue.Empty:
                break
        del node  # the pool's iterator with it, once the collating thread lets it go
        deadline = time.monotonic() + _JOIN_S
        for thread in [self._thread, *self._pool]:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def check_thread_safe(dataset: Dataset) -> None:
    """Refuse, before any thread starts, a dataset that says it is not thread-safe
    (``thread_safe = False``) or holds an open file (threads would share its position)."""
    for part in _parts(dataset):
        name = type(part).__qualname__
        if getattr(part, "thread_safe", True) is False:
            raise ConfigError(
                f"dataset {name} says thread_safe = False: its samples cannot be read by"
                " threads of one process. Use loader.engine=process (worker processes, each"
                " with its own copy)"
            )
        for attr, value in vars(part).items() if hasattr(part, "__dict__") else ():
            if isinstance(value, io.IOBase) and not value.closed:
                raise ConfigError(
                    f"dataset {name} holds an open file in .{attr}: threads would share its"
                    " position. Open it per read (or per thread: feedrate.threads.worker_id()),"
                    " or use loader.engine=process"
                )


def _parts(dataset: Any) -> Iterator[Any]:
    """The dataset and the datasets it wraps (feedrate's guards, Subset)."""
    seen = set()
    while dataset is not None and id(dataset) not in seen:
        seen.add(id(dataset))
        yield dataset
        dataset = getattr(dataset, "dataset", None) if _wraps(dataset) else None


def _wraps(dataset: Any) -> bool:
    return isinstance(dataset, Subset) or type(dataset).__module__.startswith("feedrate.")


def check_engine(dataset: Dataset) -> None:
    """What ``loader.engine=thread`` cannot read, named before the run."""
    if is_stream(dataset):
        raise ConfigError(
            f"loader.engine=thread reads map-style datasets, and {type(dataset).__qualname__}"
            " is a stream (an IterableDataset), whose workers split it with"
            " torch.utils.data.get_worker_info(), which answers for worker processes only."
            " Use loader.engine=process"
        )
    check_thread_safe(dataset)
