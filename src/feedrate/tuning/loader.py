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
from dataclasses import asdict, replace
from typing import Any

import psutil
import torch
from torch.utils.data import BatchSampler, Dataset, IterableDataset, Sampler

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
from feedrate.tuning.policy import (
    PROCESS,
    UNTUNED,
    Choice,
    Climb,
    Figure,
    Machine,
    Setting,
    worker_bound,
)
from feedrate.tuning.probe import Probe
from feedrate.tuning.state import Saved

log = logging.getLogger("feedrate.tuning")

MIN_BUDGET_S = 5.0  # less than this measures nothing worth choosing by


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


class _Plan(Sampler[list[int]]):
    """An epoch's batches of indices, from ``start`` on: the batch sampler every DataLoader
    tried shares, so that the next one goes on where the one before stopped. They are the same
    in every process and after a resume: the user's batch sampler or sampler after its
    ``set_epoch``, a ``DistributedSampler`` under several ranks, or ``seed + epoch``'s shuffle."""

    def __init__(self, tl: TuningLoader, ranks: Ranks) -> None:
        self.dataset, self.ranks = tl.dataset, ranks
        self.batch_size, self.shuffle, self.drop_last = tl.batch_size, tl.shuffle, tl.drop_last
        self.sampler, self.batch_sampler, self.seed = tl.sampler, tl.batch_sampler, tl.seed
        if self.sampler is None and self.batch_sampler is None and ranks.enabled:
            from torch.utils.data import DistributedSampler

            self.sampler = DistributedSampler(
                tl.dataset, shuffle=tl.shuffle, seed=tl.seed, drop_last=tl.drop_last
            )
        self.batches: list[list[int]] = []
        self.start = 0

    def draw(self, epoch: int) -> None:
        """The batches of ``epoch``."""
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

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches[self.start :])

    def __len__(self) -> int:
        return len(self.batches) - self.start


class TuningLoader(Saved):
    """An iterable over batches that tunes ``num_workers``, ``prefetch_factor`` and the engine
    (worker processes or threads, among ``engines``) while the loop trains; built by
    :func:`feedrate.autotune_loader`."""

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
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.sampler, self.batch_sampler = sampler, batch_sampler
        self.stream = isinstance(dataset, IterableDataset)
        self.loader_args = {"collate_fn": collate_fn, "pin_memory": pin_memory}
        self.loader_args |= {"worker_init_fn": worker_init_fn, "timeout": timeout}
        self.persistent = persistent_workers
        self.context = multiprocessing_context
        self.seed, self.clock, self.cpu, self.memory = seed, clock, cpu, memory
        self.budget_s = self.budget_asked = float(budget_s)
        self.window_s = window_seconds(self.budget_s)
        self.ranks = Ranks.current()
        cores = _usable_cores() / self.ranks.local_world_size
        cap = max_workers or worker_bound(cores)
        workers = cores_start(cores) if num_workers is None else num_workers
        start = Setting(workers, prefetch_factor if workers else None, engine)
        searched = searched_engines(dataset, start, engines, worker_init_fn)
        workload = functools.partial(_workload, dataset, batch_size, self.ranks)
        self.preset, start, recorded = preset_start(preset, start, searched, workload)
        # the step's intra-op threads, turned where it shares the cores with the workers
        machine = Machine(cores, cap, searched, torch.get_num_threads() if split_threads else 0)
        self.climb = Climb(
            start, machine, window_s=self.window_s, recorded=recorded, predicts=predicts
        )
        self.make_loader = make_loader or build
        self._plan = _Plan(self, self.ranks)
        self.epoch, self._pos = 0, 0  # the epoch, and its batches already yielded
        self.figures: list[Figure] = []
        self.current = self.climb.start
        self.choice: Choice | None = None
        self.tuning = self.budget_s >= MIN_BUDGET_S
        if not self.tuning:  # the start runs, untuned
            self.choice = Choice(
                self.current, f"budget_s={budget_s:g} below {MIN_BUDGET_S:g} s", False, UNTUNED
            )
        self.spent_s = 0.0  # tuning seconds so far (in earlier processes too, after a resume)
        self.samples_tuning = 0
        self.written: str | None = None
        self._probe: Probe | None = None
        self._loader = None  # the DataLoader of ``current``, while it lives
        self._since = 0.0  # when the current setting's measurement began
        self._loader_setting: Setting | None = None
        self._epoch_from = 0.0  # when this epoch's pass began
        self._resuming = False  # a state was loaded: the next pass goes on mid-epoch
        self._in_pass = False  # a pass is under way (its generator lives)
        self._last_out = 0.0  # when the latest batch was handed out
        self.earlier: list[dict] = []  # tunings before this one (retune)
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
        return self._plan.epoch_batches()

    @property
    def batches_plan(self) -> Sampler | None:
        """The batch sampler every map-style DataLoader it builds shares (None: a stream)."""
        return None if self.stream else self._plan

    def __iter__(self) -> Iterator[Any]:
        return self._epoch()

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass is (its shuffle); each pass moves on one by itself. A
        position set by :meth:`skip` holds in the epoch set. Where a listener says the
        pipeline fell behind, it tunes again (``retune_on_drift``)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._pos = self._pos if self._resuming else 0
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
        if self.budget_asked < MIN_BUDGET_S:
            log.warning(
                "autotune_loader: the input pipeline fell behind (the drift guard warned), but"
                " its budget_s=%g (trainer.autotune.budget_s) is below the %g s a tuning"
                " needs: not tuned again",
                self.budget_asked,
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
        if batches < 0:
            raise ValueError(f"skip({batches}): a number of batches, at least 0")
        self._pos, self._resuming = batches, batches > 0

    def _stream_restarts(self, batches: int) -> None:
        """A stream's position belongs to its workers: without their state it cannot go on
        mid-epoch."""
        log.warning(
            "autotune_loader: a stream (%s) cannot go on %d batches into its epoch: the epoch"
            " starts again from its first sample, and those batches are trained twice",
            type(self.dataset).__name__,
            batches,
        )
        self._pos = 0

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
        state = self.state_dict()
        return state["epoch"], state["batches"]

    def worker_seed(self) -> int:
        """The seed of a DataLoader built now: it differs by where it starts, so one built
        mid-epoch does not draw the first one's augmentations again."""
        spot = self.seed * 1_000_003 + self.epoch * 10_007 + self._pos + self.ranks.rank * 7_919
        return spot % 2**63

    def retune(self, budget_s: float | None = None) -> bool:
        """Tune again from the setting now running, for up to ``budget_s`` more seconds (the
        first tuning's budget if None): the data wait rose, the storage or the machine
        changed. What was measured before is kept in the report's ``earlier``. False: it
        does not (it is tuning already, or the budget is below ``MIN_BUDGET_S``)."""
        budget_s = self.budget_asked if budget_s is None else budget_s
        if self.tuning or budget_s < MIN_BUDGET_S:
            return False
        self.earlier.append(
            {"tried": [asdict(f) for f in self.figures], "chosen": asdict(self.choice)}
        )
        self.figures, self.choice, self.tuning = [], None, True
        self.budget_s = self.spent_s + budget_s
        self.climb = Climb(
            self.current,
            self.climb.machine,
            window_s=self.window_s,
            predicts=self.climb.predicts,
        )
        self._probe = None
        self._tell("tuning_started")
        return True

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
        self._epoch_from = self._last_out = self.clock()
        if not self.stream:
            self._plan.draw(self.epoch)
        if self.stream and self._resuming and self._pos and self._stream_state is None:
            self._stream_restarts(self._pos)
        if not self._resuming:
            self._pos = 0
        self._resuming, self._in_pass = False, True
        if self._probe is not None:
            self._probe.go_on()  # the time between passes (validation, say) is not measured
        try:
            while True:
                switched = yield from self._run(self.current)
                if not switched or (not self.stream and self._pos >= len(self._plan.batches)):
                    break
            if self.stream and self.tuning and self.ranks.agree(self._measured()):
                self._next_setting()  # a stream switches at its epoch's end
        finally:  # the epoch ended, or the loop left it (a new pass starts the next one)
            self._in_pass = False
            if self.tuning:  # up to its last batch: what the loop did after is not tuning
                self.spent_s += self._last_out - self._epoch_from
                if self._probe is not None and not self._short_epochs():
                    self._probe.pause()  # the epoch's end and restart are not measured
                elif self._probe is not None:
                    self._probe.hold(self._last_out)  # measured across the restart, not the gap
            if not self.persistent or self._pos < len(self._plan.batches):
                self.close()
            self.epoch, self._pos = self.epoch + 1, 0

    def _run(self, setting: Setting) -> Iterator[Any]:
        """Batches from ``setting``'s loader until the epoch ends (False) or the tuning
        switches to another setting (True)."""
        self._plan.start = self._pos
        failure = None
        try:
            loader = self._loader_for(setting)
        except Refused as exc:
            if setting == self.climb.start or not self.tuning:
                raise ConfigError(str(exc)) from exc
            self._failed(f"refused: {exc}")
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
            waited = self._last_out - asked
            batch, cost = split(batch)  # what it cost its worker, where the loader says
            samples = self._samples(batch)
            self._pos += 1
            if self.tuning:
                self.samples_tuning += samples * self.ranks.world_size
                if self._probe is not None and self._in_tail():
                    self._probe.pause()  # measured again after the next epoch's warm-up
                elif self._probe is not None:
                    self._probe.took(waited, samples, cost)
            yield batch
            if self.tuning and not self.stream and self.ranks.agree(self._measured()):
                if self._next_setting():
                    # at once: the batches its workers still read are not wanted (the next
                    # setting goes on from the last one taken), and the iteration's own end
                    # would wait for each read, up to a batch's time
                    self.end_workers(kill=True)
                    return True
        self._loader = None
        self._failed(failure)
        return True

    def _failure(self, exc: Exception, loader: Any, setting: Setting) -> str:
        """Why ``setting``'s loader failed, its workers killed; raised again where the run
        cannot go on without it: the start, a stream (its position is its workers'), several
        ranks (the others are already in the next step)."""
        end_loader_workers(loader, kill=True)
        self._loader = None
        return loader_failure(exc, setting == self.climb.start or self.stream or self.ranks.enabled)

    def _measured(self) -> bool:
        """The current setting's measurement is over: its probe says so, or the budget is
        spent (what it measured so far is its figure)."""
        if self._probe is None:
            return False
        if not self._probe.done and self._spent_now() >= self.budget_s:
            self._probe.end()
        return self._probe.done

    def _short_epochs(self) -> bool:
        """Epochs shorter than four of the setting's queues: there the ends and restarts are
        much of what the loop pays, and a window goes on across them; longer ones leave their
        ends out (their restart is a small share of an epoch)."""
        backlog = self._probe.backlog if self._probe is not None else 0
        return not self.stream and len(self._plan.batches) < 4 * backlog

    def _in_tail(self) -> bool:
        """The epoch's last ``num_workers x prefetch_factor`` batches: the sampler has run
        out, and what the workers hold is eaten faster than they sustain."""
        if self.stream or self._short_epochs():
            return False
        return len(self._plan.batches) - self._pos < self._probe.backlog

    def _loader_for(self, setting: Setting):
        if self.tuning and self._probe is None:  # (a persistent loader tuned again too)
            self._start_probe(setting)
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

    def _start_probe(self, setting: Setting) -> None:
        best = Climb.best(self.figures)
        if setting.main_threads:  # the step's share of the cores, as the setting says
            torch.set_num_threads(setting.main_threads)
        self._probe = Probe(
            setting,
            window_s=self.window_s,
            best=best.samples_per_sec / self.ranks.world_size if best else None,  # a rank's
            clock=self.clock,
            cpu=self.cpu,
            step_threads=torch.get_num_threads(),
        )
        self._since = self.clock()
        if not self.figures and self.ranks.is_main:
            log.info(
                "autotune_loader: tuning for up to %.0f s while training; %s first",
                self.budget_s - self.spent_s,
                setting.describe(),
            )

    # -- the decisions (rank 0's; every rank takes them at the same step) ------------------

    def _next_setting(self) -> bool:
        """The current setting's measurement is over: record it and pick the next. True:
        another setting's loader takes over from here."""
        probe, self._probe = self._probe, None
        figure = probe.figure(self.clock() - self._since)
        if self.memory is not None:  # the whole tree's, its workers' with it
            figure = replace(figure, pss_mb=self.memory())
        if figure.samples_per_sec is not None:  # every rank's, as rank 0 runs in step with them
            figure = replace(figure, samples_per_sec=figure.samples_per_sec * self.ranks.world_size)
        return self._after(figure)

    def _failed(self, reason: str) -> None:
        figure = Figure(self.current, None, seconds=self.clock() - self._since, failed=reason)
        self._probe = None
        if self.ranks.is_main:
            log.warning("autotune_loader: %s failed: %s", self.current.describe(), reason)
        if not self.tuning:
            raise RuntimeError(f"the loader failed after tuning: {reason}")
        self._after(figure)

    def _after(self, figure: Figure) -> bool:
        figure = Figure.from_dict(self.ranks.share(asdict(figure)))  # rank 0's, on every rank
        self.figures.append(figure)
        if self.ranks.is_main:
            log.info("autotune_loader: %s", figure.describe())
        left = self.budget_s - self._spent_now()
        made = len(self.climb.predictions)
        nxt = self.climb.next(self.figures, left) if self.ranks.is_main else None
        _say_predictions(self.climb.predictions[made:])
        decision = self.ranks.share(None if nxt is None else nxt.as_dict())
        if decision is not None:
            self.current = Setting(**decision)
            self._start_probe(self.current)
            return True
        choice = self.climb.choose(self.figures) if self.ranks.is_main else None
        self.choice = Choice.from_dict(self.ranks.share(None if choice is None else asdict(choice)))
        self.spent_s, self.tuning = self._spent_now(), False
        self._tell("tuning_ended")
        if self.ranks.is_main:
            log.info(
                "autotune_loader chose %s: %s", self.choice.setting.describe(), self.choice.reason
            )
            if self.preset is not None and self._worth_a_preset():
                self.written = self.preset.write(self.choice, self.figures)
        switch = self.choice.setting != self.current
        self.current = self.choice.setting
        return switch

    def _worth_a_preset(self) -> bool:
        """The choice beats the start; or the start held, measured here for the first time
        (no preset recorded its rate) beside settings that all ran: written, so the next run
        checks it rather than tuning again. A start that held only because the others failed
        is no measurement of the data, and writes nothing."""
        assert self.choice is not None
        if self.choice.beats_start:
            return True
        return self.climb.recorded is None and not any(f.failed for f in self.figures)

    def _spent_now(self) -> float:
        """Tuning seconds so far: the epochs before, and this one up to now."""
        return self.spent_s + self.clock() - self._epoch_from

    # -- the batches ---------------------------------------------------------------------

    def _samples(self, batch: Any) -> int:
        if not self.stream:
            return len(self._plan.batches[self._pos])
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


def _say_predictions(made: list) -> None:
    """The log's line for each new prediction of the model (metrics.json holds them all)."""
    for _, prediction in made:
        log.info(
            "autotune_loader predicts %s: %s samples/s (%s)",
            prediction.setting.describe(),
            f"{prediction.samples_per_sec:,.1f}",
            prediction.why,
        )


def cores_start(cores: float) -> int:
    """The workers a loader starts from when it is given none: one a core."""
    return max(1, int(cores))


def _usable_cores() -> float:
    from feedrate.hardware import usable_cores

    return usable_cores()


def _set_epoch(sampler: Any, epoch: int) -> None:
    for s in (sampler, getattr(sampler, "sampler", None)):
        if hasattr(s, "set_epoch"):
            s.set_epoch(epoch)


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
