"""The tuning loader: an iterable that owns the DataLoaders it tries, for any training loop
(docs/design.md, "The tuning loader").

    loader = feedrate.autotune_loader(dataset, batch_size=64, shuffle=True, budget_s=60)
    for epoch in range(epochs):
        for batch in loader:
            ...

Each setting it tries is a DataLoader over the same dataset, collate function and batches;
it goes on where the one before stopped in the epoch, so every sample is yielded exactly once
an epoch. What it measures is what the loop pulls: the rate at which batches are taken and
the time spent waiting inside ``__next__``. ``state_dict()`` / ``load_state_dict()`` resume
it mid-epoch, as torchdata's ``StatefulDataLoader`` does.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psutil
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler

from feedrate.batch import batch_len
from feedrate.costs import inner_collate, split
from feedrate.distributed import Ranks
from feedrate.errors import ConfigError
from feedrate.tuning.candidates import (
    Refused,
    build,
    check_engines,
    end_loader_workers,
    loader_failure,
    preset_start,
    searched_engines,
    tree_pss_mb,
)
from feedrate.tuning.plan import BatchPlan
from feedrate.tuning.policy import (
    PROCESS,
    Choice,
    Climb,
    Figure,
    Machine,
    Setting,
    worker_bound,
)
from feedrate.tuning.session import MIN_BUDGET_S, TuningSession
from feedrate.tuning.setting import same_pool

log = logging.getLogger("feedrate.tuning")


def _cpu_times() -> tuple[float, float]:
    """(busy, total) seconds of every core so far: the machine's, other processes too."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(t)
    return total - idle, total


def window_seconds(budget_s: float) -> float:
    """A setting's window: a twentieth of the budget, between 1 and 2 s (a prediction is
    verified in a few windows: the choice comes within 15 s)."""
    return min(2.0, max(1.0, budget_s / 20))


class TuningLoader:
    """An iterable over batches that tunes ``num_workers``, ``prefetch_factor`` and the engine
    (worker processes or threads, among ``engines``) while the loop trains; built by
    :func:`feedrate.autotune_loader`. Three parts, each with its own state: the batch plan
    (:class:`~feedrate.tuning.plan.BatchPlan`: the epoch's batches and the position), the
    session (:class:`~feedrate.tuning.session.TuningSession`: the climb, the probe, what was
    measured and chosen) and the engine factory (``make_loader``: a setting's loader,
    :func:`feedrate.tuning.candidates.build` by default). This class runs the loaders."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int = 1,
        shuffle: bool = False,
        sampler: Sampler | None = None,
        batch_sampler: Sampler | None = None,
        collate_fn: Callable | None = None,
        drop_last: bool = False,
        num_workers: int | None = None,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        worker_init_fn: Callable | None = None,
        multiprocessing_context: Any = None,
        timeout: float = 0,
        budget_s: float = 60.0,
        max_workers: int | None = None,
        preset: Any = None,
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        cpu: Callable[[], tuple[float, float]] | None = _cpu_times,
        make_loader: Callable[..., Any] | None = None,
        engine: str = PROCESS,
        engines: Sequence[str] | None = None,
        memory: Callable[[], float | None] | None = tree_pss_mb,
        predicts: bool = True,
        split_threads: bool = False,
        retune_on_drift: int = 0,
    ) -> None:
        _check_args(batch_size, shuffle, sampler, batch_sampler, drop_last, budget_s, max_workers)
        check_engines([engine], "engine")
        self.dataset = dataset
        self.batch_size, self.drop_last = batch_size, drop_last
        self.stream = isinstance(dataset, IterableDataset)
        self.loader_args = {"collate_fn": collate_fn, "pin_memory": pin_memory}
        self.loader_args |= {"worker_init_fn": worker_init_fn, "timeout": timeout}
        self.persistent = persistent_workers
        self.context = multiprocessing_context
        self.seed, self.clock = seed, clock
        self.ranks = Ranks.current()
        cores = _usable_cores() / self.ranks.local_world_size
        cap = max_workers or worker_bound(cores)
        workers = cores_start(cores) if num_workers is None else num_workers
        start = Setting(workers, prefetch_factor if workers else None, engine)
        searched = searched_engines(dataset, start, engines, worker_init_fn)
        workload = functools.partial(_workload, dataset, batch_size, self.ranks)
        preset, start, recorded = preset_start(preset, start, searched, workload)
        # the step's intra-op threads, turned where it shares the cores with the workers
        machine = Machine(cores, cap, searched, torch.get_num_threads() if split_threads else 0)
        window_s = window_seconds(float(budget_s))
        climb = Climb(start, machine, window_s=window_s, recorded=recorded, predicts=predicts)
        self.plan = BatchPlan(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            sampler=sampler,
            batch_sampler=batch_sampler,
            seed=seed,
            ranks=self.ranks,
        )
        self.session = TuningSession(
            climb,
            budget_s=budget_s,
            window_s=window_s,
            ranks=self.ranks,
            clock=clock,
            cpu=cpu,
            memory=memory,
            preset=preset,
            tell=self._tell,
        )
        self.make_loader = make_loader or build
        self._loader = None  # the DataLoader of the current setting, while it lives
        self._loader_setting: Setting | None = None
        self._in_pass = False  # a pass is under way (its generator lives)
        self._last_out = 0.0  # when the latest batch was handed out
        self._stream_state: dict | None = None  # a stream's position, to go on from
        # who hears when the tuning ends or starts again (the run's meter), and is asked at
        # each epoch's start whether the pipeline fell behind: then it tunes again, at most
        # ``retune_on_drift`` times
        self._listeners: list[Any] = []
        self.retunes_left = int(retune_on_drift)

    # -- what a loop uses ----------------------------------------------------------------

    def __len__(self) -> int:
        """Batches an epoch, as the DataLoader says it (a stream without ``__len__`` has
        none: TypeError, as there)."""
        if self.stream:
            n = len(self.dataset)
            return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
        return self.plan.epoch_batches()

    @property
    def batches_plan(self) -> Sampler | None:
        """The batch sampler every map-style DataLoader it builds shares (None: a stream)."""
        return None if self.stream else self.plan

    def __iter__(self) -> Iterator[Any]:
        return self._epoch()

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass is (its shuffle); each pass moves on one by itself. A
        position set by :meth:`skip` holds in the epoch set. Where a listener says the
        pipeline fell behind, it tunes again (``retune_on_drift``)."""
        self.plan.set_epoch(epoch)
        if self.retunes_left and self._listeners and not self.tuning:
            self._retune_if_behind()

    def subscribe(self, listener: Any) -> bool:
        """``listener`` hears ``tuning_started()`` and ``tuning_ended()``, and is asked
        ``fell_behind()`` at each epoch's start; returns whether a tuning runs now."""
        self._listeners.append(listener)
        return self.tuning

    def _tell(self, event: str) -> None:
        for listener in self._listeners:
            getattr(listener, event)()

    def _retune_if_behind(self) -> None:
        """A listener's drift guard warned (rank 0's word, on every rank, at the same epoch
        start): tune again from the setting now running."""
        behind = any(listener.fell_behind() for listener in self._listeners)
        if not self.ranks.agree(behind):
            return
        asked = self.session.budget_asked
        if asked < MIN_BUDGET_S:
            log.warning(
                "autotune_loader: the input pipeline fell behind (the drift guard warned), but"
                " its budget_s=%g (trainer.autotune.budget_s) is below the %g s a tuning"
                " needs: not tuned again",
                asked,
                MIN_BUDGET_S,
            )
            self.retunes_left = 0
            return
        log.warning(
            "autotune_loader: the input pipeline fell behind (the drift guard warned); tuning"
            " again from %s (trainer.autotune.on_drift=retune)",
            self.current.describe(),
        )
        self.retunes_left -= 1
        self.retune()

    def skip(self, batches: int) -> None:
        """The next pass starts ``batches`` into its epoch, none of them loaded: a loop that
        resumes by counting the batches it trained (the Hugging Face ``Trainer``'s
        ``get_resumed_dataloader``) instead of by :meth:`load_state_dict`."""
        self.plan.skip(batches)

    @property
    def tuning(self) -> bool:
        """It is tuning now."""
        return self.session.tuning

    @property
    def current(self) -> Setting:
        """The setting that runs now."""
        return self.session.current

    @property
    def choice(self) -> Choice | None:
        return self.session.choice

    @property
    def figures(self) -> list[Figure]:
        """What each setting tried so far measured."""
        return self.session.figures

    @property
    def climb(self) -> Climb:
        return self.session.climb

    @property
    def num_workers(self) -> int:
        return self.current.num_workers

    @property
    def prefetch_factor(self) -> int | None:
        return self.current.prefetch_factor

    @property
    def collate_fn(self) -> Callable | None:
        """The collate function of the DataLoader now running (None between them)."""
        return inner_collate(getattr(self._loader, "collate_fn", None))

    def position_state(self) -> tuple[dict | None, dict]:
        """What a checkpoint records of it: a stream's position (its workers'), and its own
        state (the tuning, the epoch, the batches yielded)."""
        return self.stream_state(), self.state_dict()

    def tally(self) -> None:
        """None: its own windows tally what its batches cost, setting by setting."""
        return None

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, batches of it already yielded) that the next pass goes on from, as
        :meth:`state_dict` records it."""
        state = self.plan.snapshot(self._in_pass, self.stream)
        return state["epoch"], state["batches"]

    def worker_seed(self) -> int:
        """The seed of a DataLoader built now (:meth:`BatchPlan.worker_seed`)."""
        return self.plan.worker_seed()

    def retune(self, budget_s: float | None = None) -> bool:
        """Tune again from the setting now running, for up to ``budget_s`` more seconds (the
        first tuning's budget if None): the data wait rose, the storage or the machine
        changed (:meth:`TuningSession.retune`)."""
        return self.session.retune(budget_s)

    def report(self) -> dict:
        """What it tried, what each measured, and what it chose."""
        return self.session.report()

    # -- a checkpoint ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the epoch is and what the tuning found: plain data, for a checkpoint."""
        return {
            **self.plan.snapshot(self._in_pass, self.stream),
            **self.session.state_dict(self._in_pass),
        }

    def load_state_dict(self, state: dict) -> None:
        self.plan.restore(state)  # refuses another seed before anything changes
        self.close()
        self.session.load_state_dict(state)

    def stream_state(self) -> dict | None:
        """A stream's position inside its epoch: the running DataLoader's state, where it
        keeps one (a ``StatefulDataLoader`` over a stream with ``state_dict``); else None."""
        if not self.stream or not self._in_pass or not hasattr(self._loader, "state_dict"):
            return None
        return self._loader.state_dict()

    def load_stream_state(self, state: dict) -> None:
        """The next pass goes on from a :meth:`stream_state` (after :meth:`load_state_dict`,
        which says the setting it was taken with: the same workers read the rest)."""
        self._stream_state = state

    def close(self) -> None:
        """End the workers now (they also end with the loader)."""
        self.end_workers()

    def end_workers(self, kill: bool = False) -> list[int]:
        """End the running DataLoader's workers (``kill``: at once); their exit codes."""
        codes = []
        if self._loader is not None:
            codes = end_loader_workers(self._loader, kill) or []
            self._loader = None
        return codes

    # -- an epoch ------------------------------------------------------------------------

    def _epoch(self) -> Iterator[Any]:
        now = self._last_out = self.clock()
        plan, session = self.plan, self.session
        if self.stream and plan.resuming and plan.pos and self._stream_state is None:
            self._stream_restarts(plan.pos)
        plan.begin(self.stream)
        self._in_pass = True
        session.pass_started(now)
        try:
            while True:
                switched = yield from self._run(self.current)
                if not switched or (not self.stream and plan.finished()):
                    break
            if self.stream and self.tuning and self.ranks.agree(session.measured()):
                session.next_setting()  # a stream switches at its epoch's end
        finally:  # the epoch ended, or the loop left it (a new pass starts the next one)
            self._in_pass = False
            session.pass_ended(self._last_out, across=self._short_epochs())
            if not self.persistent or not plan.finished():
                self.close()
            plan.end()

    def _stream_restarts(self, batches: int) -> None:
        """A stream's position belongs to its workers: without their state it cannot go on
        mid-epoch."""
        log.warning(
            "autotune_loader: a stream (%s) cannot go on %d batches into its epoch: the epoch"
            " starts again from its first sample, and those batches are trained twice",
            type(self.dataset).__name__,
            batches,
        )
        self.plan.skip(0)
        self.plan.resuming = False

    def _run(self, setting: Setting) -> Iterator[Any]:
        """Batches from ``setting``'s loader until the epoch ends (False) or the tuning
        switches to another setting (True)."""
        session = self.session
        self.plan.from_here()
        failure = None
        try:
            loader = self._loader_for(setting)
        except Refused as exc:
            if setting == self.climb.start or not self.tuning:
                raise ConfigError(str(exc)) from exc
            session.failed(f"refused: {exc}")
            return True
        try:
            batches = iter(loader)
        except Exception as exc:  # noqa: BLE001 - named by loader_failure, else raised
            failure = self._failure(exc, loader, setting)
        while failure is None:
            asked = self.clock()
            try:
                batch = next(batches)
            except StopIteration:
                return False
            except Exception as exc:  # noqa: BLE001 - as above
                failure = self._failure(exc, loader, setting)
                break
            self._last_out = self.clock()
            batch, cost = split(batch)  # what it cost its worker, where the loader says
            samples = self._samples(batch)
            self.plan.took()
            session.took(self._last_out - asked, samples, cost, self._in_tail())
            yield batch
            if self.tuning and not self.stream and self.ranks.agree(session.measured()):
                if session.next_setting():
                    if same_pool(setting, self.current):  # the step's threads alone: the
                        session.keep_pool()  # workers go on, and nothing starts
                        self._loader_setting = setting = self.current
                        continue
                    # at once: the batches its workers still read are not wanted (the next
                    # setting goes on from the last one taken), and the iteration's own end
                    # would wait for each read, up to a batch's time
                    self.end_workers(kill=True)
                    return True
        self._loader = None
        session.failed(failure)
        return True

    def _failure(self, exc: Exception, loader: Any, setting: Setting) -> str:
        """Why ``setting``'s loader failed, its workers killed; raised again where the run
        cannot go on without it: the start, a stream (its position is its workers'), several
        ranks (the others are already in the next step)."""
        end_loader_workers(loader, kill=True)
        self._loader = None
        return loader_failure(exc, setting == self.climb.start or self.stream or self.ranks.enabled)

    def _short_epochs(self) -> bool:
        """Epochs shorter than four of the setting's queues: there the ends and restarts are
        much of what the loop pays, and a window goes on across them; longer ones leave their
        ends out (their restart is a small share of an epoch)."""
        probe = self.session.probe
        backlog = probe.backlog if probe is not None else 0
        return not self.stream and len(self.plan.batches) < 4 * backlog

    def _in_tail(self) -> bool:
        """The epoch's last ``num_workers x prefetch_factor`` batches: the sampler has run
        out, and what the workers hold is eaten faster than they sustain."""
        probe = self.session.probe
        if probe is None or self.stream or self._short_epochs():
            return False
        return len(self.plan.batches) - self.plan.pos < probe.backlog

    def _loader_for(self, setting: Setting):
        if self.tuning and self.session.probe is None:  # (a persistent loader tuned again too)
            self.session.start_probe(setting)
        if self._loader is not None and self._loader_setting == setting:
            return self._loader
        self.close()
        if setting.main_threads:  # the step's share of the cores, as the setting says
            torch.set_num_threads(setting.main_threads)
        self._loader = self.make_loader(self, setting)
        self._loader_setting = setting
        if self._stream_state is not None:  # a stream goes on where a checkpoint left it
            self._loader.load_state_dict(self._stream_state)
            self._stream_state = None
        return self._loader

    # -- the batches ---------------------------------------------------------------------

    def _samples(self, batch: Any) -> int:
        if not self.stream:
            return len(self.plan.batches[self.plan.pos])
        return batch_len(batch) or self.batch_size


# -- helpers -------------------------------------------------------------------------------


def _workload(dataset: Dataset, batch_size: int, ranks: Ranks) -> dict:
    """What a preset records of the data it was measured on."""
    kind = type(dataset)
    try:
        length = len(dataset)
    except TypeError:
        length = None
    return {
        "dataset": {"target": f"{kind.__module__}.{kind.__qualname__}", "length": length},
        "batch_size": batch_size,
        "ranks_per_node": ranks.local_world_size,
    }


def cores_start(cores: float) -> int:
    """The workers a loader starts from when it is given none: one a core."""
    return max(1, int(cores))


def _usable_cores() -> float:
    from feedrate.hardware import usable_cores

    return usable_cores()


def _check_args(batch_size, shuffle, sampler, batch_sampler, drop_last, budget_s, max_workers):
    problems = []
    if batch_sampler is not None and (batch_size != 1 or shuffle or sampler or drop_last):
        problems.append(
            "batch_sampler is mutually exclusive with batch_size, shuffle, sampler and"
            " drop_last (as in the DataLoader)"
        )
    if sampler is not None and shuffle:
        problems.append("sampler and shuffle=True: the sampler orders the samples, pass one")
    if not isinstance(batch_size, int) or batch_size < 1:
        problems.append(f"batch_size={batch_size!r} must be a positive integer")
    if budget_s is None or budget_s < 0:
        problems.append(f"budget_s={budget_s!r} must be at least 0 (0: no tuning)")
    if max_workers is not None and max_workers < 1:
        problems.append(f"max_workers={max_workers!r} must be at least 1, or None")
    if problems:
        raise ConfigError("autotune_loader: " + "; ".join(problems))
