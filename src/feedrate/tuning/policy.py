"""Where to go next: a pure function of what was measured (docs/design.md, "The tuning loader").

Figures, seconds left and the machine go in; the next setting comes out. Nothing here reads
a clock, the cores or a loader, so a test drives a whole search on simulated rates.

The climb follows the figures. A loader whose consumer waits for data is too narrow: the
next setting has the workers the wait points at (the compute-bound rate over the measured
one, ``1 / (1 - data_wait_frac)``), at most ``MAX_STEP`` times as many, fewer where the cores
are already busy. A wider setting measured slower ends the widening; the climb then tries
between the two, and a deeper queue. A loader whose consumer barely waits is wide enough:
where the cores are busy, half its workers is tried, as workers and the training step then
compete for the cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from feedrate.tuning.decide import EQUIVALENCE, GAIN, Once, decide
from feedrate.tuning.model import Costs, Pipeline, Prediction, predict, rate
from feedrate.tuning.setting import PROCESS, THREAD, Setting, same_pool
from feedrate.tuning.ties import STILL_WAITS, family, ties

MAX_STEP = 4.0  # the most a step multiplies the workers by
DEEPEST_PREFETCH = 8
WAIT_HIGH = 0.10  # above: the consumer waits for data (input-bound)
BUSY = 0.90  # of the cores: no room for more workers doing CPU work
PER_WORKER_S = 0.02  # start-up a worker adds, at least (a fork, and its first batch queued)
CLOSE = 1.2  # workers this close (as a ratio) are one setting to a single window


def worker_bound(cores: float) -> int:
    """The most workers a setting may have: not the core count. A worker blocked on storage
    or network latency holds no core, so latency-bound data scales far past the cores."""
    return int(min(256, max(64, 8 * cores)))


def wider(workers: int, cap: int, data_wait: float | None = None, cpu_busy: float = 0.0) -> int:
    """The workers of the next wider setting, the one step of every climb (the tuning
    loader's, and the sweep's past its seeds): the workers the wait points at, enough to feed
    the consumer at its compute-bound rate, a step of 2 to ``MAX_STEP`` (1.5 where the cores
    are busy), within ``cap``. Where the wait is not known (the sweep's trials report only
    their rate), twice."""
    here = max(workers, 1)
    if data_wait is None:
        step = 2.0
    elif cpu_busy >= BUSY:
        step = 1.5
    else:
        step = min(MAX_STEP, max(2.0, 1 / max(1 - data_wait, 1e-3)))
    if not workers:  # from the main process to workers
        step = max(step, 2.0)
    return min(cap, max(here + 1, math.ceil(here * step)))


@dataclass(frozen=True)
class Figure:
    """What measuring one setting gave."""

    setting: Setting
    samples_per_sec: float | None  # None: nothing measured (it failed, or the time ran out)
    data_wait_frac: float = 0.0  # of its window, spent waiting inside __next__
    cpu_busy_frac: float = 0.0  # of the machine's cores, busy over its window
    seconds: float = 0.0  # what measuring it took, its start-up included
    startup_s: float = 0.0  # from building its loader to its first batch
    left_early: bool = False  # measured slower than the best and left at once
    failed: str = ""
    pss_mb: float | None = None  # the process tree's memory (PSS) at its window's end
    costs: Costs | None = None  # what a batch cost, where its loader said (feedrate.costs)

    @property
    def ok(self) -> bool:
        return self.samples_per_sec is not None and not self.failed

    def describe(self) -> str:
        if self.failed:
            return f"{self.setting.describe()} failed: {self.failed}"
        rate = "no figure" if self.samples_per_sec is None else f"{self.samples_per_sec:,.1f}"
        left = "; left: slower than the best" if self.left_early else ""
        memory = f", {self.pss_mb:,.0f} MB PSS" if self.pss_mb else ""
        return (
            f"{self.setting.describe()} -> {rate} samples/s, data wait {self.data_wait_frac:.0%},"
            f" cores busy {self.cpu_busy_frac:.0%}{memory} ({self.seconds:.1f} s){left}"
        )

    @classmethod
    def from_dict(cls, data: dict) -> Figure:
        """A figure from :func:`dataclasses.asdict` (a checkpoint's plain data)."""
        costs = data.get("costs")
        costs = Costs.from_dict(costs) if isinstance(costs, dict) else costs
        return cls(**{**data, "setting": Setting(**data["setting"]), "costs": costs})


@dataclass(frozen=True)
class Machine:
    """What the policy knows of the machine: its cores, the most workers a setting may
    have (the memory, shared memory and descriptors a wider loader would need), and the
    engines the dataset can be read with (threads: a map-style dataset safe to share)."""

    cores: float
    max_workers: int
    engines: tuple[str, ...] = (PROCESS,)
    # the training process's intra-op threads, which the climb may lower to one (the step
    # shares the cores with the workers); 0: the climb does not turn them
    main_threads: int = 0

    def pipeline(self) -> Pipeline:
        """The machine as the model predicts for it."""
        return Pipeline(self.cores, self.max_workers, self.engines, main_threads=self.main_threads)


# The climb's own rules, beside the decision's (feedrate.tuning.decide: HELD, FASTEST...)
PRESET_HOLDS = "preset-holds"  # the start, a preset measured here, still reads its figure
NOTHING_MEASURED = "nothing-measured"  # every setting failed: the start runs on
UNTUNED = "untuned"  # a budget too small to measure anything: the start runs


@dataclass(frozen=True)
class Choice:
    setting: Setting
    reason: str  # in words, for people
    # measured at least GAIN faster than the start, or its workers on threads as fast
    # (within EQUIVALENCE) as the setting chosen on processes: worth a preset
    beats_start: bool
    rule: str = ""  # which rule decided: decide.HELD, FASTEST..., or one of the climb's above

    @classmethod
    def from_dict(cls, data: dict) -> Choice:
        return cls(
            Setting(**data["setting"]),
            data["reason"],
            data["beats_start"],
            data.get("rule", ""),  # a checkpoint from before rules were kept
        )


def on_threads(costs: Costs, figures: list[Figure], setting: Setting) -> Costs:
    """``costs`` as ``setting``'s main threads could spend them at best. On more threads than
    ``costs`` were measured on: where a figure measured the training process there, its CPU a
    batch there, the least such (an intra-op pool spins on its cores between steps, CPU the
    model cannot derive from one thread's: a held-out store on 2 cores spent 16-26 ms a batch
    on 2 threads against 7 on one, and each of three windows on 2 threads read 0.61-0.79x one
    thread's). On fewer: where a figure measured the step there, the fastest such step and its
    CPU; until one did, the step no slower and its CPU no more than its time on each thread,
    as one thread count tells nothing of what the others add (a small step on 2 cores beside
    busy workers gains nothing from its second thread, and :func:`~feedrate.tuning.model.predict`
    counts the most it could)."""
    t = setting.main_threads
    if not t or not costs.step_threads or t == costs.step_threads:
        return costs
    seen = [f.costs for f in figures if f.ok and f.costs is not None and f.costs.step_threads == t]
    if t < costs.step_threads:
        if seen:
            fastest = min(seen, key=lambda c: c.step_alone_s)
            return replace(
                costs,
                step_threads=t,
                step_s=fastest.step_s,
                step_queued_s=fastest.step_queued_s,
                step_cpu_s=fastest.step_cpu_s,
            )
        return replace(
            costs, step_threads=t, step_cpu_s=min(costs.step_cpu_s, t * costs.step_alone_s)
        )
    if not seen:
        return costs
    return replace(costs, step_cpu_s=max(costs.step_cpu_s, min(c.step_cpu_s for c in seen)))


class Climb:
    """The search: :meth:`next` after each figure, :meth:`choose` at the end."""

    def __init__(
        self,
        start: Setting,
        machine: Machine,
        *,
        window_s: float,
        wait_high: float = WAIT_HIGH,
        gain: float = GAIN,
        recorded: float | None = None,
        predicts: bool = True,
    ) -> None:
        if machine.main_threads and start.main_threads is None:  # the run's own, said
            start = replace(start, main_threads=machine.main_threads)
        self.start, self.machine, self.window_s = start, machine, window_s
        self.wait_high, self.gain = wait_high, gain
        # the start is a preset measured here at this rate: checked, not searched again
        self.recorded = recorded
        # from what a sample costs, where the figures say (else the figures alone lead)
        self.predicts = predicts
        self.predictions: list[tuple[int, Prediction]] = []  # (after how many figures, what)

    def next(self, figures: list[Figure], seconds_left: float) -> Setting | None:
        """The next setting to measure, or None: the search is over."""
        best = self.best(figures)
        if best is None or self._confirmed(figures):
            return None
        tried = {f.setting for f in figures}
        costs = self._costs(figures) if self.predicts else None
        moves = self._verify(best, figures, costs) if costs else self._moves(best, figures)
        for setting in moves:
            if setting in tried:
                continue
            if self.predicted_seconds(setting, figures) > seconds_left:
                return None  # a step that would not finish trains slower settings for nothing
            return setting
        return None

    def _moves(self, best: Figure, figures: list[Figure]) -> list[Setting]:
        """Where the figures point, in order; those tried already are passed over."""
        here, cap = best.setting, self.machine.max_workers
        if best.data_wait_frac < self.wait_high:
            narrower = replace(here, num_workers=here.num_workers // 2)
            if here.num_workers >= 2 and best.cpu_busy_frac >= BUSY:
                return [self._valid(narrower), *self._other_engine(here)]
            return self._other_engine(here)
        tried_wider = [
            f.setting
            for f in figures
            if f.setting.num_workers > here.num_workers
            and f.setting.depth == here.depth
            and f.setting.engine == here.engine
        ]
        moves = []
        if not tried_wider and here.num_workers < cap:
            step = wider(here.num_workers, cap, best.data_wait_frac, best.cpu_busy_frac)
            moves.append(replace(here, num_workers=step))
        elif tried_wider:  # the widening measured slower: between the two, while far apart
            above = min(s.num_workers for s in tried_wider)
            mid = round(math.sqrt(max(here.num_workers, 1) * above))
            if here.num_workers < mid < above and above >= 3 * max(here.num_workers, 1):
                moves.append(replace(here, num_workers=mid))
        moves += self._other_engine(here)
        if here.num_workers and here.depth < DEEPEST_PREFETCH:
            deeper = min(DEEPEST_PREFETCH, 4 * here.depth)
            moves.append(replace(here, prefetch_factor=deeper))
        return [self._valid(m) for m in moves]

    # -- predict, then verify (docs/design.md, "What a sample costs") --------------------------

    @property
    def pipeline(self) -> Pipeline:
        return self.machine.pipeline()

    @staticmethod
    def _costs(figures: list[Figure]) -> Costs | None:
        """What a sample costs, as the fastest setting that said measured it: the load it
        runs at is the one a prediction is made for. A slower setting's costs are another
        load's (thread workers that slowed the step by holding the GIL: a step of 26 ms
        against 5 ms on processes, and a wrong prediction made from it)."""
        said = [f for f in figures if f.ok and f.costs is not None and not f.left_early]
        best = max(said, key=lambda f: f.samples_per_sec, default=None)
        return best.costs if best is not None else None

    def _predicted(self, figures: list[Figure], costs: Costs) -> Prediction:
        """The model's setting from the latest costs, recorded where it is a new one."""
        made = predict(costs, self.pipeline)
        made = replace(made, setting=self._valid(made.setting))
        if all(p.setting != made.setting for _, p in self.predictions):
            self.predictions.append((len(figures), made))
        return made

    def _verify(self, best: Figure, figures: list[Figure], costs: Costs) -> list[Setting]:
        """The prediction first, predicted again from the latest costs (a prediction measured
        has costs of its own, at the load it puts on the cores), at most three, each measured
        unless a setting within ``CLOSE`` of it was; then the best setting on fewer main
        threads, where it could be near it (:func:`on_threads` gives fewer threads the benefit
        of the doubt until one is measured: what one thread count costs says little of
        another's, and on photos the model rated one thread slower where it trained faster);
        then its neighbours, one on each side its figures leave open: wider where the loop
        still waits and the last step wider paid (:meth:`_widening_paid`; a cap on the cores
        is a prediction too: more workers beside a busy step were faster than the model said
        on held-out data), else narrower where the cores are busy (workers compete with the
        step); then the other engine, the best on more main threads and no workers, where
        the model rates them near it."""
        moves = []
        if len(self.predictions) < 3:
            predicted = self._predicted(figures, costs).setting
            if not self._close_to_tried(predicted, figures):
                moves.append(predicted)
        here, pipe = best.setting, self.pipeline
        near = (1 - 2 * EQUIVALENCE) * best.samples_per_sec
        if here.num_workers:
            split = self._other_threads(here)
            if (
                split is None
                or self._close_to_tried(split, figures)
                or rate(on_threads(costs, figures, split), split, pipe)[0] < near
            ):
                split = None
            elif split.main_threads < (here.main_threads or self.machine.main_threads):
                moves.append(split)  # fewer threads: next, on the benefit of the doubt
                split = None
            n, side = here.num_workers, None
            widen = best.data_wait_frac >= STILL_WAITS and n < pipe.max_workers
            if widen and self._widening_paid(best, figures):
                side = replace(here, num_workers=min(pipe.max_workers, math.ceil(n * 1.5)))
            elif best.cpu_busy_frac >= BUSY and n >= 2 and not self._narrower_read(best, figures):
                side = replace(here, num_workers=max(1, math.floor(n / 1.5)))
            if side is not None and not self._close_to_tried(side, figures):
                moves.append(side)
            moves += [
                s
                for s in self._other_engine(here)
                if rate(costs, s, pipe)[0] >= near and not self._close_to_tried(s, figures)
            ]
            if split is not None:  # more threads: once the neighbours are measured
                moves.append(split)
            if rate(costs, Setting(0), pipe)[0] >= near:
                moves.append(Setting(0))
        return [self._valid(m) for m in moves]

    def _widening_paid(self, best: Figure, figures: list[Figure]) -> bool:
        """Is one step wider still worth a window? Not where the best got there by a step
        wider that gained less than ``gain`` over the next narrower setting measured (on its
        engine, depth and threads): one window shows no such gain, and each step of a pool
        of processes costs its start-up. A held-out store on 2 cores climbed 21, 32, 48 and
        64 workers, +3%, +8% and -10% a step, the loop waiting 17-31% on busy cores, and
        spent 28 s of a 36 s budget doing it."""
        here = best.setting
        same = family(here)
        below = [
            f
            for f in figures
            if f.ok and family(f.setting) == same and 0 < f.setting.num_workers < here.num_workers
        ]
        if not below:
            return True
        nearest = max(below, key=lambda f: f.setting.num_workers)
        return best.samples_per_sec >= (1 + self.gain) * nearest.samples_per_sec

    @staticmethod
    def _narrower_read(best: Figure, figures: list[Figure]) -> bool:
        """A narrower pool of the best's settings, within a step (/1.5) of it, was measured
        already: the figures show that side, and a window more on it tells nothing new (the
        held-out audio store climbed 28 then 35 workers, +2%, and spent 3.6 s on 23)."""
        here = best.setting
        same = family(here)
        return any(
            f.ok
            and family(f.setting) == same
            and here.num_workers / 1.5 <= f.setting.num_workers < here.num_workers
            for f in figures
        )

    def _other_threads(self, here: Setting) -> Setting | None:
        """``here`` on the other split of the cores between the step and the workers: one
        main thread, or the run's own (None: the climb does not turn them)."""
        own = self.machine.main_threads
        if own <= 1:
            return None
        return replace(here, main_threads=own if (here.main_threads or own) == 1 else 1)

    @staticmethod
    def _close_to_tried(setting: Setting, figures: list[Figure]) -> bool:
        """A setting on the same engine, depth and main threads, its workers within ``CLOSE``,
        was measured: one window tells no such two apart."""
        for f in figures:
            s = f.setting
            if (s.engine, s.depth, bool(s.num_workers), s.main_threads) != (
                setting.engine,
                setting.depth,
                bool(setting.num_workers),
                setting.main_threads,
            ):
                continue
            if s.num_workers and max(s.num_workers, setting.num_workers) <= CLOSE * min(
                s.num_workers, setting.num_workers
            ):
                return True
        return False

    def prediction_report(self, figures: list[Figure]) -> list[dict]:
        """Each prediction beside what its setting measured: plain data for metrics.json."""
        measured = {f.setting: f.samples_per_sec for f in figures if f.ok}
        out = []
        for after, made in self.predictions:
            got = measured.get(made.setting)
            out.append(
                {
                    "after_figures": after,
                    "setting": made.setting.as_dict(),
                    "from": made.measured_from.as_dict() if made.measured_from else None,
                    "predicted_samples_per_sec": round(made.samples_per_sec, 1),
                    "bound": made.bound,
                    "why": made.why,
                    "measured_samples_per_sec": None if got is None else round(got, 1),
                    "error": None if not got else round(got / made.samples_per_sec - 1, 3),
                }
            )
        return out

    def _valid(self, setting: Setting) -> Setting:
        """No prefetch without workers (the DataLoader refuses one); workers on an engine
        searched (from none, the first of them)."""
        threads = self.machine.main_threads or None
        if threads is None or setting.main_threads is None:
            setting = replace(setting, main_threads=threads)
        if not setting.num_workers:
            return Setting(0, None, main_threads=setting.main_threads)
        if setting.engine not in self.machine.engines:
            return replace(setting, engine=self.machine.engines[0])
        return setting

    def _other_engine(self, here: Setting) -> list[Setting]:
        """The same workers on the other engine, once the width is settled: threads read
        latency-bound data as fast as processes at a fraction of their memory, and lose to
        them on Python code that holds the GIL; a window tells which."""
        if not here.num_workers or len(self.machine.engines) < 2:
            return []
        return [replace(here, engine=PROCESS if here.threads else THREAD)]

    def predicted_seconds(self, setting: Setting, figures: list[Figure]) -> float:
        """What measuring ``setting`` would take: its window, its warm-up (at most a window)
        and its start-up, a line through the start-ups measured on its engine (a fixed part,
        the first batch's own time among it, and a part that grows with the workers). Threads
        start in microseconds: before any is measured, the least start-up measured. A split of
        threads on the pool running now starts nothing: its window alone."""
        if figures and figures[-1].ok and same_pool(figures[-1].setting, setting):
            return self.window_s
        started = [f for f in figures if f.startup_s > 0]
        mine = [f for f in started if f.setting.engine == setting.engine]
        if setting.threads and not mine:  # threads start in microseconds: the fixed part
            return 2 * self.window_s + min((f.startup_s for f in started), default=0.0)
        known = [(f.setting.num_workers, f.startup_s) for f in mine]
        slope = PER_WORKER_S
        if len({n for n, _ in known}) >= 2:
            mean_n = sum(n for n, _ in known) / len(known)
            mean_s = sum(s for _, s in known) / len(known)
            spread = sum((n - mean_n) ** 2 for n, _ in known)
            slope = max(slope, sum((n - mean_n) * (s - mean_s) for n, s in known) / spread)
        fixed = min((s - slope * n for n, s in known), default=0.0)
        return 2 * self.window_s + max(fixed, 0.0) + slope * setting.num_workers

    def _confirmed(self, figures: list[Figure]) -> bool:
        """The start is a preset measured here, and it still reads within ``gain`` of that."""
        first = figures[0] if figures else None
        return bool(
            self.recorded
            and first is not None
            and first.setting == self.start
            and first.ok
            and first.samples_per_sec >= (1 - self.gain) * self.recorded
        )

    @staticmethod
    def best(figures: list[Figure]) -> Figure | None:
        measured = [f for f in figures if f.ok and not f.left_early]
        return max(measured, key=lambda f: f.samples_per_sec, default=None)

    def choose(self, figures: list[Figure]) -> Choice:
        """The one decision (:func:`feedrate.tuning.decide.decide`) over the figures, a window
        each, the start the incumbent: the fastest measured unless the start is within
        ``gain`` of it; a setting left early is shown slower. A preset that still reads what
        it records is kept without deciding."""
        best = self.best(figures)
        if best is None:
            failed = "; ".join(f"{f.setting.describe()}: {f.failed}" for f in figures if f.failed)
            reason = f"nothing measured ({failed or 'no figure'})"
            return Choice(self.start, reason, False, NOTHING_MEASURED)
        if self._confirmed(figures):
            start = figures[0]
            return Choice(
                self.start,
                f"the preset holds: {start.samples_per_sec:,.1f} samples/s, within"
                f" {self.gain:.0%} of the {self.recorded:,.1f} it records",
                False,
                PRESET_HOLDS,
            )
        once = {}
        for f in figures:  # a setting measured twice (a resume): its last figure that read
            if f.setting in once and not f.ok:
                continue
            once[f.setting] = Once(
                f.setting.describe(),
                f.samples_per_sec if f.ok else None,
                0 if f.setting.threads else f.setting.num_workers,  # worker processes
                failed=f.failed or ("" if f.ok else "no figure"),
                dropped="left early: slower than the best" if f.left_early else "",
            )
        measured = [c for c in once.values() if not c.failures]
        start = once.get(self.start)
        incumbent = start.name if start is not None and not start.failures else None
        decision = decide(measured, incumbent=incumbent, gain=self.gain)
        chosen = next(s for s, c in once.items() if c is decision.winner)
        reason, rule = decision.reason, decision.rule

        for tie in ties(chosen, figures):
            chosen, rule = tie.figure.setting, tie.rule
            reason += (
                f"; {chosen.describe()} measured {tie.figure.samples_per_sec:,.1f} samples/s,"
                f" within {tie.within:.0%} of it {tie.why}"
            )
        if incumbent is None:
            return Choice(chosen, f"{reason} (the start has no figure)", True, rule)
        return Choice(chosen, reason, chosen != self.start, rule)
