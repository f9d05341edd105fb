"""The measuring rules of a run, driven by a fake clock: no loader, no model, no device."""

from __future__ import annotations

import functools
import math
import threading

import pytest
import torch

from feedrate.config import Measure, TrainerConfig
from feedrate.drift import DriftGuard
from feedrate.meter import Meter, WarmUp


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Monitor:
    def __init__(self) -> None:
        self.windows = 0
        self.measuring = False
        self.samples: list[bool] = []  # for each full memory reading: inside the window?

    def start_cpu_window(self) -> None:
        self.windows += 1
        self.measuring = True

    def end_cpu_window(self) -> None:
        self.measuring = False

    def sample_soon(self) -> None:
        self.samples.append(self.measuring)


def trainer(**over):
    cfg = {
        "warmup_steps": 2,
        "window_steps": 4,
        "steady_state": False,
        "max_seconds": None,
        "abandon_below": None,
        "stream": False,
    }
    return TrainerConfig(**{**cfg, **over})


class Run:
    """A meter on a fake clock; each step waits ``wait`` s for its batch and computes for
    ``compute`` s; the workers have produced ``produced`` samples so far."""

    def __init__(
        self,
        total=30,
        backlog=0,
        measure=Measure.train,
        drift=None,
        window=None,
        workers=0,
        agree=None,
        **cfg,
    ) -> None:
        self.clock, self.monitor, self.syncs, self.produced = Clock(), Monitor(), 0, 0
        self.total = total

        def sync():
            self.syncs += 1

        self.meter = Meter(
            trainer(**cfg),
            total=total,
            start=0,
            backlog=backlog,
            # the caller's window (num_workers steps when more), apart from trainer.window_steps
            window_steps=window or cfg.get("window_steps", 4),
            measure=measure,
            produced=lambda: self.produced,
            monitor=self.monitor,
            sync=sync,
            clock=self.clock,
            drift=drift,
            workers=workers,
            **({"agree": agree} if agree is not None else {}),
        )
        self.step = 0
        self.meter.start(0)
        self.meter.epoch_started()

    def steps(self, n, wait=0.01, compute=0.04, batch=10, produce=10, **step_args) -> bool:
        for _ in range(n):
            self.meter.step_started()
            self.clock.now += wait
            self.meter.batch_arrived()
            self.clock.now += compute
            self.produced += produce
            self.step += 1
            if self.meter.step_done(self.step, batch, **step_args) or self.step >= self.total:
                return True
        return False


def test_windows_after_the_warm_up_and_a_device_sync_only_at_their_ends():
    run = Run(total=30)
    run.steps(30)
    times = run.meter.times
    assert len(times.wait_s) == 28, "steps 3 to 30: the clock starts after the 2-step warm-up"
    assert times.wait_s == pytest.approx([0.01] * 28)
    assert times.step_s == pytest.approx([0.05] * 28), "end to end: a step starts at the last's end"
    assert times.samples == 280 and times.elapsed_s == pytest.approx(28 * 0.05)
    assert times.window_rates == pytest.approx([200.0] * 7)
    assert run.syncs == 1 + 7, "one to start the clock, one per window: none per step"
    assert run.monitor.windows == 1
    assert run.monitor.samples == [False], "memory read once at the first batch, off the window"


def test_a_window_is_as_long_as_the_loader_asks_not_the_trainers_minimum():
    # 8 workers deliver in bursts of 8: trainer.window_steps=4 is raised to 8 by the trainer
    run = Run(total=34, window=8)
    run.steps(34)
    assert len(run.meter.times.window_rates) == 4, "32 measured steps in windows of 8"
    assert run.syncs == 1 + 4


def test_the_steady_state_warm_up_outlasts_the_start_up_backlog():
    # 12 batches queued at start arrive at once; then the workers' real pace (50 ms a batch)
    run = Run(total=80, backlog=12, steady_state=True)
    run.steps(12, wait=0.0)
    assert run.meter.times.wait_s == [], "the backlog is not measured"
    run.steps(68, wait=0.05)
    warm = run.meter.finish()["warmup"]
    assert warm["steps"] >= 12 and warm["settled"] is True
    assert run.meter.times.wait_s == pytest.approx([0.05] * len(run.meter.times.wait_s))
    assert max(run.meter.times.window_rates) == pytest.approx(10 / 0.09)


def test_the_backlog_is_over_once_the_queue_runs_dry_after_every_worker_delivered():
    # 4 workers x prefetch 10: a backlog of 40 batches; but training is faster than the
    # workers, so after the 4 first batches it waits for each one: nothing is queued any more
    run = Run(total=200, backlog=40, steady_state=True, window=4, workers=4)
    run.steps(4, wait=0.3)  # the workers start: their first batches
    run.steps(196, wait=0.05)
    warm = run.meter.finish()["warmup"]
    assert warm["settled"] is True and warm["steps"] < 20, "not the 40 steps of a backlog"
    # a queue that never runs dry is eaten to its end before measuring
    full = Run(total=200, backlog=40, steady_state=True, window=4, workers=4)
    full.steps(200, wait=0.0)
    assert full.meter.finish()["warmup"]["steps"] >= 40


def test_an_epochs_tail_and_the_next_backlog_are_held_out_of_the_window():
    """loader=autotune: an epoch's last batches are eaten at compute speed once the sampler
    has run out, and so are those made while the next epoch restarted. Held from the tail's
    start until the next epoch's backlog is eaten; the epoch's end, asked meanwhile, keeps the
    longer hold."""
    run = Run(total=60)
    run.steps(10)
    run.meter.checkpoint_paused(10, extra=4 + 4)  # the tail: 4 batches left, a backlog of 4 ...
    run.steps(4, wait=0.0, compute=0.01)  # ... eaten at compute speed: not measured
    run.meter.checkpoint_paused(14)  # the epoch's end: a shorter hold
    run.meter.epoch_started()
    run.clock.now += 3.0  # the restart
    run.steps(4 + 2, wait=0.0, compute=0.01)  # its backlog and a warm-up: not measured either
    held = len(run.meter.times.wait_s)
    assert held == 8, "steps 3-10 only"
    run.steps(20)
    times = run.meter.times
    assert len(times.wait_s) == 8 + 20 and times.samples == 280
    assert times.elapsed_s == pytest.approx(28 * 0.05), "only the steady steps"
    assert times.window_rates == pytest.approx([200.0] * len(times.window_rates))
    # a longer hold asked during a shorter one extends it
    longer = Run(total=60)
    longer.steps(10)
    longer.meter.checkpoint_paused(10)  # until step 12
    longer.steps(1, wait=0.0, compute=0.01)
    longer.meter.checkpoint_paused(11, extra=6)  # until step 19
    longer.steps(8, wait=0.0, compute=0.01)
    assert len(longer.meter.times.wait_s) == 8, "none of steps 11-19 measured"


def test_samples_produced_meanwhile_are_counted_to_take_the_lower_of_the_two():
    # training eats 10 a step while the workers make only 4: a queue drains
    run = Run(total=30)
    run.steps(30, produce=4)
    assert run.meter.times.samples == 280
    assert run.meter.times.produced == 28 * 4


def test_where_workers_never_idle_a_queue_drained_in_the_window_is_not_throughput():
    """Streams (the sweep's trials): the rate is the lower of consumed and produced. Training
    eats 200 samples/s from a queue the workers refill at 80
    (a backlog behind a stalled batch): 80 is what the setting sustains."""
    from feedrate.meter import rate_of

    drained = Run(total=10_000, abandon_below=150.0, stream=True)
    assert drained.steps(10_000, produce=4) is True
    assert "below trainer.abandon_below=150.0" in drained.meter.abandoned
    assert rate_of(drained.meter.times, produced=True) == pytest.approx(80.0)
    plain = Run(total=200, abandon_below=150.0)  # epochs: workers idle at each epoch's end
    plain.steps(200, produce=4)
    assert plain.meter.abandoned == ""
    assert rate_of(plain.meter.times, produced=False) == pytest.approx(200.0)


def test_a_checkpoint_closes_the_window_and_measuring_resumes_after_a_fresh_warm_up():
    run = Run(total=40)
    run.steps(10)
    measured = len(run.meter.times.wait_s)
    run.meter.checkpoint_paused(10)
    run.clock.now += 5.0  # the save: workers fill their queues meanwhile
    run.produced += 500
    run.steps(2, wait=0.0)  # the queued batches, eaten during the re-warm: not measured
    assert len(run.meter.times.wait_s) == measured
    run.steps(28)
    times = run.meter.times
    assert times.elapsed_s == pytest.approx(len(times.step_s) * 0.05), "the pause is left out"
    assert times.produced == 10 * len(times.step_s), "what was made during the pause is not"
    assert all(r == pytest.approx(200.0) for r in times.window_rates)


def test_measuring_ends_at_the_first_window_end_past_max_seconds():
    run = Run(total=10_000, max_seconds=1.0)
    assert run.steps(10_000) is True
    times = run.meter.times
    assert 1.0 <= times.elapsed_s + 1e-9 <= 1.2 + 1e-9, "at most one window (4 x 0.05 s) more"
    assert len(times.step_s) % 4 == 0 and run.step < 100


class _Collective:
    """Two ranks' calls at the same steps, each rank in its own thread, as gloo pairs them:
    ``flag`` gives rank 0's value to both (Ranks.agree), ``every`` whether both hold
    (Ranks.every)."""

    def __init__(self) -> None:
        # a rank's thread may wait seconds for a core while the suite runs beside it (10 s
        # broke the barrier once under make test's load): a minute still ends a real deadlock
        self.barrier, self.values = threading.Barrier(2, timeout=60), [False, False]

    def _exchange(self, rank: int, mine: bool) -> list[bool]:
        self.values[rank] = mine
        self.barrier.wait()
        seen = list(self.values)
        self.barrier.wait()  # both read before either writes again
        return seen

    def flag(self, rank: int, mine: bool) -> bool:
        return self._exchange(rank, mine)[0]

    def every(self, rank: int, mine: bool) -> bool:
        return all(self._exchange(rank, mine))


def test_under_torchrun_every_rank_measures_the_same_steps_from_the_last_warm_up():
    """Rank 1 steps twice as fast and has a longer start-up backlog: on its own it would
    measure from another step, and run out of time at another. The window opens once every
    rank's warm-up is over (Ranks.every; rank 0's alone would have measured rank 1
    still eating its backlog), and ends at rank 0's word (Ranks.agree): both ranks
    measure the same steps."""
    both = _Collective()
    ranks = [
        Run(total=10_000, max_seconds=0.99, agree=functools.partial(both.flag, 0)),
        Run(
            total=10_000,
            max_seconds=0.99,
            backlog=12,
            steady_state=True,
            agree=functools.partial(both.flag, 1),
        ),
    ]
    for rank, run in enumerate(ranks):
        run.meter.agree_all = functools.partial(both.every, rank)
    alone = [
        Run(total=10_000, max_seconds=0.99),
        Run(total=10_000, max_seconds=0.99, backlog=12, steady_state=True),
    ]
    alone[0].steps(10_000)
    alone[1].steps(10_000, compute=0.02)
    ended: list[list[bool]] = [[], []]

    def rank(r: int) -> None:
        while not ended[r] or not ended[r][-1]:
            ended[r].append(ranks[r].steps(1, compute=0.04 if r == 0 else 0.02))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert ended[0] == ended[1], "the ranks ended at different steps"
    first, second = (r.meter for r in ranks)
    assert alone[0].meter._warm_end == 2 < alone[1].meter._warm_end  # rank 1's is longer
    assert first._warm_end == second._warm_end == alone[1].meter._warm_end
    assert len(first.times.step_s) == len(second.times.step_s)
    assert len(first.times.window_rates) == len(second.times.window_rates)
    assert second.times.elapsed_s < 0.7  # its own clock: 0.03 s a step, rank 0's 0.05
    assert (alone[1].meter._warm_end, alone[1].step) != (second._warm_end, ranks[1].step)


def test_a_rank_whose_warm_up_is_over_stays_over_while_the_others_finish_theirs():
    """Once two windows agreed, the warm-up is over at every later step too: the window opens
    when the last rank's is, and an unsteady window meanwhile does not reopen this one's."""
    clock = Clock()
    warm = WarmUp(2, window_steps=2, clock=clock)
    over = []
    for seconds in [0.1] * 7 + [0.5, 0.01, 0.9]:  # steady, then anything but
        clock.now += seconds
        over.append(warm.update())
    first = over.index(True)
    assert warm.settled and all(over[first:]) and first < 7


def test_a_warm_up_bounded_in_seconds_ends_there_settled_or_not():
    """``trainer.warmup_max_s`` (a sweep's trials): a start-up backlog of 64 batches and
    windows that never agree end the warm-up once ``max_s`` has passed since the first step,
    as a tuning loader's window opens; unbounded, the same steps go on warming up."""

    def steps(max_s):
        clock = Clock()
        warm = WarmUp(2, backlog=64, window_steps=2, clock=clock, max_s=max_s)
        for n, seconds in enumerate([0.3, 0.1, 0.5, 0.1, 0.5, 0.1, 0.5, 0.1, 0.5], start=1):
            clock.now += seconds
            if warm.update():
                return n, warm
        return None, warm

    ended, warm = steps(1.0)
    assert ended == 5 and warm.settled is False and warm.as_dict()["seconds"] > 0
    assert steps(None)[0] is None, "unbounded: the backlog is not eaten yet"


def test_a_warm_up_bounded_in_seconds_ends_once_the_queue_ran_dry():
    """A sweep's trial costs what a tuning loader's setting costs: its window opens at the
    first wait after every worker delivered once (the start-up backlog is eaten), without
    windows that agree; a wait while the workers still deliver their first batches does not
    open it, and unbounded, the same steps settle first."""

    def steps(max_s, waits):
        clock = Clock()
        warm = WarmUp(2, backlog=16, window_steps=2, clock=clock, max_s=max_s, workers=4)
        for n, waited in enumerate(waits, start=1):
            clock.now += 0.1
            if warm.update(waited):
                return n
        return None

    waits = [True, False, True, False, False, True, False, False, False, False]
    assert steps(5.0, waits) == 6, "the wait at step 3 came before every worker delivered"
    assert steps(None, waits) == 10, "unbounded: two windows must agree after the backlog"


def test_a_warm_up_bounded_in_seconds_waits_for_every_workers_first_batch():
    """A sweep's trial on 16 processes whose first batches take a second to come (they
    start on 2 cores): ``max_s`` after the first step does not end the warm-up while the
    last workers still start; the first step after every worker delivered does. A pool
    that never delivers around still ends it ``LONGEST`` times ``max_s`` on."""

    def ended(workers, step_s):
        clock = Clock()
        warm = WarmUp(2, backlog=32, window_steps=2, clock=clock, max_s=0.5, workers=workers)
        for n in range(1, 200):
            clock.now += step_s
            if warm.update(False):
                return n, clock.now
        return None, clock.now

    assert ended(16, 0.07)[0] == 17, "max_s (0.5 s) passed at step 9: the pool still started"
    assert ended(0, 0.07)[0] == 9, "no workers: max_s after the first step"
    steps, at = ended(100, 0.07)
    assert steps is not None and at == pytest.approx(0.07 + 3 * 0.5, abs=0.071)


def test_ranks_ask_rank_0_only_when_measuring_ends_by_what_a_rank_sees():
    """By steps or epochs each rank knows when it is done, and asks nothing (a stream's ranks
    may run out at different steps, which DDP's join covers; a broadcast would hang there);
    by a clock, a rate or a stream without end, rank 0 decides for all."""
    from feedrate.trainer import agreed

    assert not agreed(trainer())
    assert agreed(trainer(max_seconds=3.0))
    assert agreed(trainer(abandon_below=100.0))
    assert agreed(trainer(stream=True))


def test_workers_delivering_in_bursts_are_measured_over_whole_bursts():
    # 4 workers started together: each burst is 4 batches after a 0.6 s wait for all of them.
    # Cut at the step the clock ran out, a trial ends on one batch for a whole burst's wait.
    run = Run(total=10_000, max_seconds=2.0, window=4)
    for i in range(10_000):
        if run.steps(1, wait=0.6 if i % 4 == 0 else 0.0, compute=0.01):
            break
    times = run.meter.times
    rate = times.samples / times.elapsed_s
    assert rate == pytest.approx(40 / 0.64), "4 batches of 10 per 0.6 s wait and 4 steps"


def test_a_trial_clearly_below_the_floor_is_abandoned_after_a_second_and_two_windows():
    run = Run(total=10_000, abandon_below=500.0)  # it runs 200 samples/s
    assert run.steps(10_000) is True
    assert "below trainer.abandon_below=500.0" in run.meter.abandoned
    assert 1.0 <= run.meter.times.elapsed_s < 1.3
    fast = Run(total=60, abandon_below=100.0)
    fast.steps(60)
    assert fast.meter.abandoned == ""


def test_first_batch_and_epoch_restarts_run_from_the_iterators_start():
    run = Run(total=100)
    run.clock.now += 0.3  # workers starting: the first batch of the first epoch
    run.steps(5)
    run.meter.epoch_started()
    run.clock.now += 0.2
    run.steps(5)
    result = run.meter.finish()
    assert result["first_batch_s"] == pytest.approx(0.31)
    assert result["epoch_restart_s"] == pytest.approx([0.21])


def test_a_run_shorter_than_its_warm_up_measures_its_last_step_and_says_so(caplog):
    run = Run(total=6, backlog=50, steady_state=True)
    run.steps(6)
    assert len(run.meter.times.step_s) == 1
    assert run.meter.finish()["warmup"]["cut_short"] is True
    assert "the run ends before its warm-up" in caplog.text


def test_loss_and_accuracy_are_the_last_windows():
    run = Run(total=10, window_steps=2)
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    targets = torch.tensor([0, 0])  # one right of two
    for loss in (9.0, 9.0, 9.0, 1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 1.0):
        run.steps(1, batch=2, loss=torch.tensor(loss), logits=logits, targets=targets)
    result = run.meter.finish()
    assert result["final_loss"] == pytest.approx(2.0), "the warm-up's losses are not in it"
    assert result["train_accuracy"] == pytest.approx(0.5)


def test_loader_only_reports_no_loss():
    run = Run(total=20, measure=Measure.loader)
    run.steps(20)
    assert math.isnan(run.meter.finish()["final_loss"])
    assert run.meter.times.window_rates


def test_a_pipeline_that_falls_behind_is_said_once_per_episode(caplog):
    """Windows of 4 steps: 20% waiting, then 80% (storage slowed), then 20% again, then 80%."""
    guard = DriftGuard(rise=0.25, windows=3)
    run = Run(total=1000, drift=guard)
    run.steps(2 + 5 * 4, wait=0.01, compute=0.04)  # warm-up, then 5 windows at 20%
    assert guard.episodes == 0
    run.steps(6 * 4, wait=0.04, compute=0.01)  # 6 windows at 80%: one warning
    assert guard.episodes == 1 and run.meter.finish()["drift_warnings"] == 1
    warnings = [r.getMessage() for r in caplog.records if "fell behind" in r.getMessage()]
    assert len(warnings) == 1
    # 2 of 3 behind: the waits, then and now, and the steps each was measured over
    assert all(f in warnings[0] for f in ("80%", "19-30", "20%", "3-14"))
    run.steps(4 * 4, wait=0.01, compute=0.04)  # recovered
    run.steps(4 * 4, wait=0.04, compute=0.01)  # behind again: a second episode
    assert guard.episodes == 2


def test_the_preset_measured_figure_is_a_reference_too():
    """A run that starts behind (a cold cache from the first step) is compared with what the
    preset measured; one that stays as it started is not."""
    guard = DriftGuard(rise=0.25, windows=3, preset_wait=0.1)
    for k in range(3):
        message = guard.window((4 * k + 1, 4 * k + 4), 0.7)
    assert guard.episodes == 1 and "10%" in message and "preset" in message
    steady = DriftGuard(rise=0.25, windows=3)
    assert all(steady.window((k, k), 0.7) is None for k in range(10))
    noisy = DriftGuard(rise=0.25, windows=3)
    shares = [0.2, 0.5, 0.2, 0.2, 0.6, 0.1, 0.2, 0.5, 0.3]  # single windows spike: the median
    assert all(noisy.window((k, k), s) is None for k, s in enumerate(shares))


def test_the_summary_says_n_a_for_figures_nothing_measured():
    """A run that ended before its first window (loader=autotune's last candidate, say)
    prints its summary all the same."""
    from feedrate.metrics import format_summary

    text = format_summary(
        {
            "samples_per_sec": None,
            "data_wait_frac": None,
            "first_batch_s": None,
            "step_time_p50_ms": None,
            "step_time_p90_ms": None,
            "epoch_restart_s": None,
            "cpu_util": None,
            "peak_pss_mb": 812.0,
            "peak_processes": 3,
            "peak_main_pss_mb": 700.0,
            "peak_shm_mb": 0.0,
            "final_loss": None,
            "bound": "compute-bound",
            "evidence": "nothing measured",
        }
    )
    assert "samples/s        n/a" in text and "data wait        n/a of step time" in text
    assert "memory (PSS)     812 MB peak over 3 processes" in text


def test_the_run_meter_starts_its_figures_again_when_its_loader_says_the_tuning_ended():
    """A loader that tunes itself says when its tuning ends or starts again; the run's meter
    starts its figures again after the step it heard it in (between steps, at once), with
    the whole run's time left, and the first batch carried over. A plain loader says
    nothing: one stretch, measured for ``max_seconds`` after its warm-up."""
    from feedrate.meter import RunMeter

    clock, made = Clock(), []

    class Tuning:
        def subscribe(self, listener) -> bool:
            self.listener = listener
            return True  # tuning now

    def figures(max_seconds, tuning):
        made.append((max_seconds, tuning))
        return Meter(
            trainer(max_seconds=max_seconds),
            total=100,
            start=0,
            backlog=0,
            window_steps=4,
            measure=Measure.train,
            produced=lambda: None,
            monitor=Monitor(),
            clock=clock,
        )

    loader = Tuning()
    meter = RunMeter(figures, 10.0, 0, loader, clock=clock)
    assert made == [(10.0, True)]
    meter.epoch_started()
    meter.step_started()
    clock.now += 1.0
    loader.listener.tuning_ended()  # inside the step (its batch's __next__): after it
    assert len(made) == 1
    meter.batch_arrived()
    assert meter.step_done(1, 8) is False
    assert made[1] == (pytest.approx(9.0), False)  # the whole run's 10 s, less the 1 s gone
    loader.listener.tuning_started()  # between steps: at once
    assert made[2][1] is True and meter.now.first_batch_s == pytest.approx(1.0)
    made.clear()
    RunMeter(figures, 10.0, 0, object(), clock=clock)
    assert made == [(10.0, False)]
