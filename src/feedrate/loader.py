"""The DataLoader, built from ``cfg.loader`` (plain data under the DataLoader's own names,
and ``worker_threads``, which the workers' init function applies)."""

from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.queues
import multiprocessing.util
import os
import signal
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)
from torch.utils.data._utils import signal_handling as torch_signals
from torch.utils.data._utils.collate import default_collate
from torchdata.stateful_dataloader import StatefulDataLoader

from feedrate import targets
from feedrate.batch import describe
from feedrate.checks import check_picklable, start_method
from feedrate.config import DEFAULT_COLLATE
from feedrate.costs import CostedCollate, TimedReads, inner_collate
from feedrate.decode import is_encoded
from feedrate.distributed import shard
from feedrate.errors import CollateError
from feedrate.faults import SEND_FAILED, send_failure_exit
from feedrate.hardware import Hardware, usable_cores
from feedrate.stream import Repeated, is_resumable, is_stream
from feedrate.threads import ThreadLoader, check_engine, worker_id

log = logging.getLogger(__name__)
# trainer.stream=true: the data read again this many times, more than any run reads
PASSES = 10_000

# PyTorch warns whenever workers outnumber cores. That rule is wrong for samples that wait on
# I/O (a sleeping worker holds no core), so feedrate replaces it with a measured view.
warnings.filterwarnings(
    "ignore", message=r"This DataLoader will create \d+ worker processes", category=UserWarning
)


def loader_kwargs(cfg: DictConfig, hw: Hardware) -> dict:
    """DataLoader keyword arguments from ``cfg.loader``, resolved for this hardware."""
    pin = hw.pin_memory if cfg.pin_memory is None else bool(cfg.pin_memory)
    if pin and not hw.is_cuda:
        # Asked for explicitly (off a GPU, the profile pins only when told to): say why it is off
        key = "loader" if cfg.pin_memory else "hardware"
        log.info("pin_memory disabled: no CUDA device <cfg.%s.pin_memory>", key)
        pin = False
    elif hw.is_cuda and hw.pin_memory and not pin:
        log.info(
            "pin_memory=false: host-to-device copies come from pageable memory and do not"
            " overlap compute (loader.pin_memory=null follows the %s profile, which pins)"
            " <cfg.loader.pin_memory>",
            hw.name,
        )
    kwargs = {
        "batch_size": cfg.batch_size,
        "shuffle": cfg.shuffle,
        "num_workers": cfg.num_workers,
        "pin_memory": pin,
        "drop_last": cfg.drop_last,
        "timeout": cfg.timeout,
        "persistent_workers": cfg.persistent_workers,
    }
    named = named_collate(cfg)
    if named is not None:  # build_loader wraps it
        kwargs["collate_fn"] = named
    decode = getattr(cfg.get("decode"), "value", cfg.get("decode"))
    if decode and decode != "cpu":
        kwargs["decode"] = decode  # not the DataLoader's: the workload's (feedrate.decode)
    if cfg.num_workers > 0:
        kwargs["prefetch_factor"] = cfg.prefetch_factor  # None: PyTorch's default (2)
        kwargs["engine"] = _engine(cfg)  # not the DataLoader's: build_loader's
        processes = kwargs["engine"] == "process"  # thread workers start no process
        kwargs["multiprocessing_context"] = start_method(cfg) if processes else None
        kwargs["worker_threads"] = cfg.worker_threads if processes else None
        unused = [k for k in ("multiprocessing_context", "worker_threads") if cfg.get(k)]
        if not processes and unused:  # a process preset, run on threads: said, not refused
            log.info(
                "loader.engine=thread: %s applies to worker processes, and thread workers"
                " have none to start; left unused <cfg.loader>",
                ", ".join(f"{k}={getattr(cfg[k], 'value', cfg[k])}" for k in unused),
            )
    return kwargs


def _engine(cfg: DictConfig) -> str:
    engine = cfg.get("engine") or "process"
    return getattr(engine, "value", engine)


def named_collate(cfg: DictConfig) -> dict | str | None:
    """``loader.collate_fn`` as plain data where the user named their own; None for the
    default (``default_collate``, which :class:`CountingCollate` calls itself)."""
    named = cfg.get("collate_fn")
    if targets.target_of(named) in (None, DEFAULT_COLLATE):
        return None
    return named if isinstance(named, str) else OmegaConf.to_container(named, resolve=True)


class CountingCollate:
    """``default_collate`` that counts what each worker produced (the rate workers sustain,
    not the start-up backlog training eats at compute speed) and what ``dataset.on_error=skip``
    dropped. One shared-memory row per worker and one for the main process: no locks."""

    def __init__(self, num_workers: int, encoded: bool = False, named: dict | None = None) -> None:
        self.encoded = encoded  # loader.decode=device: images are JPEG bytes of any length
        self.counts = torch.zeros(num_workers + 1, 2, dtype=torch.int64).share_memory_()
        self.named = named  # loader.collate_fn: the user's, as the config names it
        self.collate = user_collate(named) if named else None

    def __call__(self, batch: list) -> object:
        kept = [b for b in batch if b is not None]
        info = get_worker_info()
        thread = worker_id()  # loader.engine=thread: the collating thread's (0)
        row = self.counts[info.id if info is not None else -1 if thread is None else thread]
        row[1] += len(batch) - len(kept)
        if not kept:
            return None  # every sample of this batch was skipped
        if self.collate is not None:
            out = self._named(kept)
        elif self.encoded and is_encoded(kept[0][0]):  # a list: the lengths differ
            out = [x for x, _ in kept], default_collate([y for _, y in kept])
        else:
            out = default_collate(kept)
        if info is not None or thread is not None:
            row[0] += len(kept)
        return out

    def _named(self, kept: list) -> object:
        try:
            return self.collate(kept)
        except Exception as exc:  # noqa: BLE001 - the user's function: named, with its input
            target = targets.target_of(self.named)
            raise CollateError(
                f"loader.collate_fn._target_={target} failed on a batch of {len(kept)} samples"
                f" ({describe(kept[0])} each): {type(exc).__name__}: {exc}. Fix the function;"
                " try it on two samples: collate([dataset[0], dataset[1]])"
            ) from exc


def user_collate(named: dict | str) -> Callable[[list], object]:
    """The collate function ``loader.collate_fn`` names, its other keys bound by keyword (a
    class: its instance, built from them)."""
    return targets.bound("loader.collate_fn", named, call="collate_fn(samples)")


def produced_samples(loader: DataLoader) -> int | None:
    """Samples the loader's workers have produced so far (None without workers)."""
    collate = inner_collate(getattr(loader, "collate_fn", None))
    if not isinstance(collate, CountingCollate) or len(collate.counts) == 1:
        return None
    return int(collate.counts[:-1, 0].sum())


def skipped_samples(loader: DataLoader) -> int:
    collate = inner_collate(getattr(loader, "collate_fn", None))
    return int(collate.counts[:, 1].sum()) if isinstance(collate, CountingCollate) else 0


def build_loader(
    dataset: Dataset,
    kwargs: dict,
    seed: int,
    stream: bool = False,
    ranks=None,
    worker_seed: int | None = None,
    batch_sampler: Sampler | None = None,
    costs: bool = False,
) -> DataLoader | ThreadLoader:
    """A DataLoader over ``dataset`` with ``kwargs`` from :func:`loader_kwargs`; under torchrun
    (``ranks``), over this rank's shard. ``seed`` orders the samples; ``worker_seed`` (``seed``
    if None) seeds the workers' random augmentations. ``batch_sampler``: the batches come
    from it (a tuning loader's plan), not from a sampler of the loader's own. ``costs``: a
    map-style dataset's batches come with what they cost their worker (:mod:`feedrate.costs`).

    Refuses, before any worker starts, a dataset that its workers could not receive.
    """
    kwargs = dict(kwargs)
    threads = kwargs.pop("worker_threads", None)
    encoded = kwargs.pop("decode", None) == "device"
    named = kwargs.pop("collate_fn", None)  # the user's, counted as the default is
    workers = kwargs["num_workers"]
    engine = kwargs.pop("engine", "process")
    collate = CountingCollate(workers, encoded, named)
    if engine == "thread":
        check_engine(dataset)
    elif workers > 0:
        check_picklable(dataset, kwargs["multiprocessing_context"])
    cores = usable_cores()
    if engine != "thread" and workers > cores:
        log.info(
            "num_workers=%d exceeds the %g usable cores <cfg.loader.num_workers>: right when"
            " samples wait on I/O, oversubscribed when decoding is CPU-bound; data_wait_frac"
            " and cpu_util in the summary tell which",
            workers,
            cores,
        )
    size, drop = kwargs.pop("batch_size"), kwargs.pop("drop_last", False)
    shuffle = kwargs.pop("shuffle", False)  # a stream's kwargs have none
    if batch_sampler is not None:
        order = Order(batch_sampler=batch_sampler)
    elif is_stream(dataset):  # it orders, shuffles and splits itself: no sampler, no shuffle
        order = Order(batch_size=size, drop_last=drop)
        dataset = Repeated(dataset) if stream else dataset
    else:
        sampler = _sampler(dataset, shuffle, drop, seed, stream, ranks)
        order = Order(sampler=sampler, batch_size=size, drop_last=drop)
    return engine_loader(
        dataset,
        order,
        collate,
        engine=engine,
        generator=torch.Generator().manual_seed(seed if worker_seed is None else worker_seed),
        worker_init_fn=functools.partial(_init_worker, threads=threads) if workers else None,
        costs=costs,
        stateful=is_resumable(dataset) and not stream,
        **kwargs,
    )


@dataclasses.dataclass(frozen=True)
class Order:
    """The batches a loader yields: a batch sampler's (a tuning loader's plan), a sampler's in
    batches of ``batch_size``, or, with neither, a stream's own in batches of ``batch_size``."""

    batch_sampler: Sampler | None = None
    sampler: Sampler | None = None
    batch_size: int | None = 1
    drop_last: bool = False

    def args(self) -> dict:
        if self.batch_sampler is not None:
            return {"batch_sampler": self.batch_sampler}
        return {"sampler": self.sampler, "batch_size": self.batch_size, "drop_last": self.drop_last}


def engine_loader(
    dataset: Dataset,
    order: Order,
    collate: Callable[[list], object],
    *,
    engine: str = "process",
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    pin_memory: bool = False,
    timeout: float = 0.0,
    persistent_workers: bool = False,
    multiprocessing_context: Any = None,
    worker_init_fn: Callable[[int], None] | None = None,
    generator: torch.Generator | None = None,
    costs: bool = False,
    stateful: bool = False,
) -> DataLoader | ThreadLoader:
    """The loader of one setting on its engine, the one factory of the run
    (:func:`build_loader`) and of the tuning loader (each setting it tries): worker processes
    (a DataLoader whose workers are born deaf to Ctrl-C; ``stateful``: torchdata's, which
    keeps a stream's position) or thread workers (:class:`~feedrate.threads.ThreadLoader`,
    which start no process: no start method, init function or generator), over the batches
    ``order`` says. ``costs``: a map-style dataset's batches come with what they cost their
    worker (:mod:`feedrate.costs`); a stream reads inside its own iterator, untimed."""
    costs = costs and not is_stream(dataset)
    collate = CostedCollate(collate) if costs else collate
    common = {
        "num_workers": num_workers,
        "collate_fn": collate,
        "pin_memory": pin_memory,
        "timeout": timeout,
        "persistent_workers": persistent_workers,
    }
    if engine == "thread":  # the reading thread times its reads itself
        return ThreadLoader(dataset, prefetch_factor=prefetch_factor, **common, **order.args())
    if num_workers > 0:  # a DataLoader refuses these without workers
        common |= {
            "prefetch_factor": prefetch_factor,
            "multiprocessing_context": multiprocessing_context,
        }
    kind = _StatefulLoader if stateful and order.batch_sampler is None else _Loader
    return kind(
        TimedReads(dataset) if costs else dataset,
        worker_init_fn=worker_init_fn,
        generator=generator,
        **common,
        **order.args(),
    )


def _sampler(
    dataset: Dataset, shuffle: bool, drop_last: bool, seed: int, stream: bool, ranks
) -> ResumableSampler:
    """The order the samples are read in: shuffled (or not), this rank's share, resumable."""
    # The shuffle's, apart: with persistent workers the loader draws a base seed once, without
    # them at every epoch; the order must not depend on which, or a resumed run drifts.
    shuffling = torch.Generator().manual_seed(seed)
    if ranks is not None and ranks.enabled:
        order = shard(dataset, ranks, shuffle, seed, drop_last)
        if stream:  # each rank its share of one epoch after another
            order = EpochAfterEpoch(order)
    elif stream:  # reshuffle forever: no epoch end while measuring (trainer.stream)
        order = RandomSampler(dataset, num_samples=len(dataset) * PASSES, generator=shuffling)
    elif shuffle:
        order = RandomSampler(dataset, generator=shuffling)
    else:
        order = SequentialSampler(dataset)
    return ResumableSampler(order, shuffling)


class _Loader(DataLoader):
    """A DataLoader whose workers are born deaf to Ctrl-C, so that a terminal's Ctrl-C, which
    reaches them too, does not kill one that is starting (docs/troubleshooting.md, "Ctrl-C
    and the workers"). A ``spawn`` or ``forkserver`` worker must be born ignoring SIGINT, as
    it imports torch for seconds before any code of ours runs in it: SIGINT is ignored while
    they start, and a Ctrl-C then is dropped. A forked worker runs our init function (which
    ignores it) at once: while they start, a Ctrl-C is held and handed on afterwards."""

    _latest: weakref.ref | None = None  # the latest iteration, while it lives
    _failed = None  # one whose start failed, until its workers end

    def __iter__(self):
        restarting = self.persistent_workers and self._iterator is not None
        if (
            self.num_workers == 0
            or restarting  # persistent workers are already running: none to start
            or threading.current_thread() is not threading.main_thread()  # no say over signals
            or signal.getsignal(signal.SIGINT) is None  # a handler Python cannot put back
        ):
            return self._remember(super().__iter__())
        held: list[int] = []
        forked = self._start_method() == "fork"
        _QuietWhileStarting.install()
        previous = signal.signal(
            signal.SIGINT, (lambda signum, frame: held.append(signum)) if forked else signal.SIG_IGN
        )
        try:
            _QuietWhileStarting.starting = True
            iterator = self._remember(super().__iter__())
        finally:
            signal.signal(signal.SIGINT, previous)
            _QuietWhileStarting.starting = False
            if held:
                signal.raise_signal(signal.SIGINT)  # to the handler it was meant for
        try:
            torch_signals._error_if_any_worker_fails()  # one that died as they started
        except RuntimeError:
            self._failed = iterator  # held for end_workers, which names how they ended
            raise
        return iterator

    def _start_method(self) -> str:
        context = self.multiprocessing_context
        if context is None:
            return multiprocessing.get_start_method(allow_none=False)
        return context.get_start_method()

    def _remember(self, iterator):
        self._latest = weakref.ref(iterator)
        if self.persistent_workers:  # ended before the loader is collected (``_end_held``)
            held = self.__dict__.get("_held")
            if held is None:
                held = self._held = []
                weakref.finalize(self, _end_held, held)
            held[:] = [iterator]
        return iterator

    def end_workers(self, kill: bool = False) -> list[int]:
        """Stop the latest iteration's workers and return the exit codes of those that ended
        (how a worker died can name the cause). PyTorch's SIGCHLD handler is silenced meanwhile:
        a dead worker would otherwise raise "exited unexpectedly" inside the
        failure's handling. ``kill``: the iteration failed, its workers are killed at once
        (``_kill_workers``)."""
        iterator = self._latest() if self._latest is not None else None
        self._failed = None
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is None:
            return []
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL) if in_main else None
        try:
            if kill:
                _kill_workers(iterator)
            else:
                shutdown()  # joins each worker (PyTorch's own end of an iteration)
        finally:
            if previous is not None:
                signal.signal(signal.SIGCHLD, previous)
        return [w.exitcode for w in iterator._workers if w.exitcode is not None]


class _QuietWhileStarting:
    """PyTorch's SIGCHLD handler, quiet while a loader starts its workers.

    PyTorch raises "exited unexpectedly" in the main thread, wherever that is, at the SIGCHLD
    of a dead worker. One that dies as they start (the OOM killer, a candidate of
    ``loader=autotune`` that cannot run) raised it inside PyTorch's start of the iteration,
    which was left half made: where the raise came as a lock was taken, that lock stayed
    taken and the end of the workers waited for it forever. ``_Loader.__iter__`` asks
    PyTorch's check once they have started instead."""

    starting = False

    def __init__(self, handler) -> None:
        self.handler = handler

    def __call__(self, signum, frame) -> None:
        if not _QuietWhileStarting.starting:
            self.handler(signum, frame)

    @staticmethod
    def install() -> None:
        """PyTorch's handler (it installs it once a process, with the first workers), wrapped."""
        torch_signals._set_SIGCHLD_handler()
        current = signal.getsignal(signal.SIGCHLD)
        if getattr(current, "__module__", None) == torch_signals.__name__:
            signal.signal(signal.SIGCHLD, _QuietWhileStarting(current))


def _end_held(held: list) -> None:
    """A loader with persistent workers is being collected: its iteration's workers end now,
    by PyTorch's own shutdown, while its queues still work. Collected in a reference cycle
    (a loader that refers to what refers to it), the iteration's own end ran after the
    queues' and waited out PyTorch's join timeout for each worker: 20 s for 4 workers."""
    iterator = held.pop() if held else None
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None and not getattr(iterator, "_shutdown", False):
        shutdown()


def _kill_workers(iterator) -> None:
    """End a failed iteration's workers at once, and its queues, without PyTorch's shutdown.

    That shutdown first sets the iteration's done event, whose lock the workers share: one
    killed while it checked the event holds that lock forever, and the main process then
    waits for it with no timeout (PyTorch's own note: "hanging in ``Event.set()``"; a failing
    candidate of ``loader=autotune`` hung so). Nothing here takes a lock a worker may hold,
    and no stuck worker holds the end up for PyTorch's join timeout, each in turn."""
    if iterator._shutdown:
        return
    iterator._shutdown = True  # its own shutdown, at its end or in __del__, is not run
    wait = torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL
    try:
        if hasattr(iterator, "_pin_memory_thread"):  # first, as PyTorch does: a killed
            iterator._pin_memory_thread_done_event.set()  # worker may leave half a batch
            iterator._worker_result_queue.put((None, None))  # where it reads: wake it
            iterator._pin_memory_thread.join(timeout=2 * wait)  # it polls its event so often
    finally:
        if iterator._worker_pids_set:  # first: PyTorch's SIGCHLD handler is not to see the kill
            torch_signals._remove_worker_pids(id(iterator))
            iterator._worker_pids_set = False
        for worker in iterator._workers:
            if worker.is_alive():
                worker.kill()
        for worker in iterator._workers:
            worker.join(timeout=wait)
        for queue in (*iterator._index_queues, iterator._worker_result_queue):
            queue.cancel_join_thread()  # its feeder thread may wait on a dead worker's lock
            if queue._notempty.acquire(timeout=wait):  # not left taken by a raise from PyTorch's
                queue._notempty.release()  # SIGCHLD handler (its own end would wait forever)
                queue.close()


class _StatefulLoader(_Loader, StatefulDataLoader):
    """``_Loader`` over torchdata's ``StatefulDataLoader``: its ``state_dict`` holds each
    worker's stream position, which a checkpoint keeps (docs/design.md, "Streams")."""

    def __init__(self, *args, **kwargs) -> None:
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated
            warnings.filterwarnings("ignore", message=".*set_vital", category=UserWarning)
            super().__init__(*args, **kwargs)


def loader_state(loader: DataLoader) -> dict | None:
    """Where a resumable stream's loader stands (its workers' positions), or None."""
    return loader.state_dict() if hasattr(loader, "load_state_dict") else None


class EpochAfterEpoch(Sampler[int]):
    """A DistributedSampler's epochs, reshuffled one after another (``trainer.stream=true``
    under torchrun: no epoch end while measuring, and each rank reads only its share)."""

    def __init__(self, order: DistributedSampler) -> None:
        self.order = order

    def __iter__(self) -> Iterator[int]:
        for epoch in range(PASSES):
            self.order.set_epoch(epoch)
            yield from self.order

    def __len__(self) -> int:
        return len(self.order) * PASSES


class ResumableSampler(Sampler[int]):
    """``order``, whose next pass can start ``skip`` indices in (to resume mid-epoch).

    The indices skipped are never loaded: the pass draws the same order (from ``generator``,
    whose state the caller restores) and drops its head.
    """

    def __init__(self, order: Sampler[int], generator: torch.Generator) -> None:
        self.order = order
        self.generator = generator
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.order), skip, None)

    def __len__(self) -> int:
        assert isinstance(self.order, Sized)
        return len(self.order)


def _init_worker(worker_id: int, threads: int | None = None) -> None:
    """In each worker: its intra-op threads (``loader.worker_threads``; PyTorch's 1 if None),
    Ctrl-C ignored, and an exit with a code naming the cause when a batch cannot be sent,
    which plain PyTorch would wait for forever (docs/design.md, "When a worker cannot send")."""
    if threads:
        torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # born so (_Loader); a foreign start may not be
    reporting = threading.Lock()

    def fail(exc: BaseException) -> None:
        reporting.acquire()  # the other thread, failing too, waits here for the exit
        code = SEND_FAILED
        try:
            code = send_failure_exit(exc)
            cause = os.strerror(code) if code != SEND_FAILED else ""
            line = f"{type(exc).__name__}: {exc}"
            line += f" ({cause})" if cause and cause not in line else ""
            os.write(2, f"DataLoader worker {worker_id}: {line}\n".encode())
        except BaseException:  # stderr gone, say: exit all the same
            pass
        finally:
            os._exit(code)  # whatever happened above: a worker left alive hangs the run

    queue_error = multiprocessing.queues.Queue._on_queue_feeder_error

    def feeder_error(exc: BaseException, obj: object) -> None:
        if isinstance(obj, tuple) and len(obj) == 2:  # (index, batch): the loader's own queue
            fail(exc)
        queue_error(exc, obj)  # a queue of the dataset's own: as before

    multiprocessing.queues.Queue._on_queue_feeder_error = staticmethod(feeder_error)
    sys.excepthook = lambda kind, exc, tb: fail(exc)  # multiprocessing's fd-sharing thread
    # A worker that shares batches by descriptor makes a temporary directory for the sharer's
    # socket, removed at its exit. A worker at its descriptor limit (the run already said so,
    # once) cannot list it to remove it: multiprocessing would print a traceback per worker.
    remove_temp_dir = multiprocessing.util._remove_temp_dir

    def remove_or_leave(rmtree, tempdir):
        try:
            remove_temp_dir(rmtree, tempdir)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise

    multiprocessing.util._remove_temp_dir = remove_or_leave
