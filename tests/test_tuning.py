"""The tuning loader and its policy: searches driven on simulated rates in the same process,
and real DataLoaders switched mid-epoch with every sample yielded once an epoch."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import feedrate
from feedrate.errors import ConfigError
from feedrate.tuning.decide import FASTEST, HELD
from feedrate.tuning.policy import PRESET_HOLDS, Climb, Figure, Machine, Setting
from feedrate.tuning.probe import Probe
from feedrate.tuning.ties import ON_THREADS
from tests.tuning_fakes import Indices, Shards, epoch_of, tuning_loader

ROOT = Path(__file__).resolve().parents[1]


# -- the policy, on simulated rates ------------------------------------------------------------


def latency_bound(setting: Setting, cores: float = 2.0) -> tuple[float, float, float]:
    """(samples/s, data wait, cores busy) of a loader whose reads wait 20 ms each and cost
    0.5 ms of CPU, feeding a step that could take 4,000 samples/s."""
    compute, per_worker, cpu_s = 4000.0, 50.0 * (1 + 0.1 * (setting.depth > 2)), 0.0005
    rate = min(compute, max(setting.num_workers, 0.5) * per_worker, cores / cpu_s)
    return rate, 1 - rate / compute, min(1.0, rate * cpu_s / cores + 0.05)


def cpu_bound(setting: Setting, cores: float = 2.0) -> tuple[float, float, float]:
    """Decoding that takes 10 ms of CPU a sample: 200 samples/s a core, whatever the workers
    (a step of 1,000 samples/s shares the cores)."""
    rate = min(1000.0, 200.0 * min(max(setting.num_workers, 1), cores))
    return rate, 1 - rate / 1000.0, 1.0


def search(model, start: Setting, budget_s: float, window_s: float, recorded=None, engines=None):
    """Drive a climb to its end on ``model``'s rates; what it measured and chose."""
    machine = Machine(2.0, 64, *([engines] if engines else []))
    climb = Climb(start, machine, window_s=window_s, recorded=recorded)
    figures, spent, setting = [], 0.0, start
    while setting is not None:
        rate, wait, busy = model(setting)
        startup = 0.2 + 0.03 * setting.num_workers
        seconds = startup + 2 * window_s
        figures.append(Figure(setting, rate, wait, busy, seconds, startup))
        spent += seconds
        setting = climb.next(figures, budget_s - spent)
    return figures, climb.choose(figures), spent


def grid_best(model) -> float:
    return max(model(Setting(n, d))[0] for n in (1, 2, 4, 8, 16, 32, 64) for d in (2, 8))


@pytest.mark.parametrize("budget_s", [20.0, 30.0, 60.0])
def test_latency_bound_climb_reaches_the_grid_best_within_the_budget(budget_s):
    figures, choice, spent = search(latency_bound, Setting(4), budget_s, window_s=budget_s / 12)
    assert spent <= budget_s
    assert latency_bound(choice.setting)[0] >= 0.9 * grid_best(latency_bound)
    assert choice.beats_start
    # it went where the wait pointed, in steps of up to 4x, not one worker at a time
    assert [f.setting.num_workers for f in figures][:3] == [4, 16, 64]


def test_cpu_bound_keeps_the_start_and_says_why():
    figures, choice, _ = search(cpu_bound, Setting(4), 60.0, window_s=3.0)
    assert choice.setting == Setting(4) and not choice.beats_start and choice.rule == HELD
    assert max(f.setting.num_workers for f in figures) <= 6  # busy cores: no wide steps


def test_the_climb_chooses_by_the_sweeps_decision():
    """One decision (feedrate.tuning.decide) for both tuners: a setting left early is shown
    slower, one failed is out; one window a setting shows no two equal (the sweep's 5% needs
    3 paired rounds), so the fastest wins; the start stays unless another measured 10%
    faster, and a start measured twice keeps its figure that read."""
    climb = Climb(Setting(4), Machine(2.0, 64), window_s=1.0)
    figures = [
        Figure(Setting(4), 1000.0, 0.8, 0.2, 3.0, 0.5),
        Figure(Setting(16), 2000.0, 0.5, 0.5, 3.0, 0.6),
        Figure(Setting(64), 2050.0, 0.4, 0.7, 3.0, 1.5),
        Figure(Setting(64, 8), 3000.0, 0.3, 0.7, 3.0, 1.5, left_early=True),
        Figure(Setting(32), None, failed="worker killed"),
    ]
    choice = climb.choose(figures)
    assert choice.setting == Setting(64) and choice.beats_start and choice.rule == FASTEST
    close = [Figure(Setting(4), 1000.0, 0.8, 0.2, 3.0, 0.5), Figure(Setting(8), 1090.0)]
    held = climb.choose([*close, Figure(Setting(4), None, failed="worker killed")])
    assert held.setting == Setting(4) and not held.beats_start and held.rule == HELD


BOTH = ("process", "thread")


def on_threads_too(model):
    """``model`` on processes; on threads, the same rate where the reads wait, but a core's
    at most where they hold the GIL (``cores busy`` 1.0: CPU-bound)."""

    def rates(setting: Setting) -> tuple[float, float, float]:
        rate, wait, busy = model(setting)
        if setting.threads and busy >= 1.0:
            return model(Setting(1, setting.prefetch_factor), cores=1.0)
        return rate, wait, busy

    return rates


def test_the_climb_tries_threads_once_the_width_is_settled_and_takes_them_when_as_fast():
    figures, choice, _ = search(
        on_threads_too(latency_bound), Setting(4), 60.0, window_s=3.0, engines=BOTH
    )
    tried = [f.setting for f in figures]
    assert [s.num_workers for s in tried][:3] == [4, 16, 64] and not any(
        s.threads for s in tried[:3]
    )
    assert tried[3] == Setting(64, engine="thread")  # the width settled: the other engine
    best_process = max(f.samples_per_sec for f in figures if not f.setting.threads)
    assert choice.setting.threads and choice.beats_start
    assert on_threads_too(latency_bound)(choice.setting)[0] >= 0.95 * best_process
    assert choice.rule == ON_THREADS
    # a machine searched on processes alone never tries them
    figures, choice, _ = search(latency_bound, Setting(4), 60.0, window_s=3.0)
    assert not any(f.setting.threads for f in figures) and not choice.setting.threads


def test_threads_that_hold_the_gil_are_tried_once_and_left():
    figures, choice, _ = search(on_threads_too(cpu_bound), Setting(4), 60.0, 3.0, engines=BOTH)
    assert sum(f.setting.threads for f in figures) == 1
    assert choice.setting == Setting(4) and not choice.beats_start


def test_a_start_without_workers_is_not_traded_for_threads():
    """Threads as fast as no worker at all save no process: the start holds."""
    climb = Climb(Setting(0), Machine(2.0, 64, BOTH), window_s=1.0)
    figures = [Figure(Setting(0), 1000.0, 0.05), Figure(Setting(4, engine="thread"), 990.0)]
    choice = climb.choose(figures)
    assert choice.setting == Setting(0) and not choice.beats_start


@pytest.mark.parametrize("ratio, on_threads", [(0.96, True), (0.94, False), (1.2, True)])
def test_threads_within_5_percent_of_the_fastest_are_taken_for_their_memory(ratio, on_threads):
    climb = Climb(Setting(4), Machine(2.0, 64, BOTH), window_s=1.0)
    figures = [
        Figure(Setting(4), 1000.0, 0.8, 0.2, 3.0, 0.5),
        Figure(Setting(64), 2000.0, 0.1, 0.5, 3.0, 1.5),
        Figure(Setting(64, engine="thread"), 2000.0 * ratio, 0.1, 0.5, 3.0, 0.1),
    ]
    choice = climb.choose(figures)
    assert choice.setting == Setting(64, engine="thread" if on_threads else "process")
    assert (choice.rule == ON_THREADS) == (on_threads and ratio < 1)


def test_a_setting_on_threads_is_said_and_kept_in_its_state():
    setting = Setting(8, 4, "thread")
    assert setting.describe() == "num_workers=8, prefetch_factor=4, engine=thread"
    assert Setting(**setting.as_dict()) == setting
    assert Setting(0, None, "thread") == Setting(0)  # no workers: nothing runs them
    assert Setting(**{"num_workers": 8, "prefetch_factor": 4}).engine == "process"  # older state
    with pytest.raises(ValueError, match="'threads'"):
        Setting(8, 4, "threads")


def test_a_step_that_does_not_fit_the_time_left_ends_the_search():
    climb = Climb(Setting(4), Machine(2.0, 64), window_s=1.0)
    first = Figure(Setting(4), 200.0, 0.95, 0.1, 3.0, startup_s=1.0)
    assert climb.next([first], seconds_left=60.0) == Setting(16)
    assert climb.next([first], seconds_left=2.5) is None


def test_a_wider_setting_measured_slower_is_bisected_then_deepened():
    climb = Climb(Setting(4), Machine(2.0, 64), window_s=1.0)
    figures = [
        Figure(Setting(4), 200.0, 0.95, 0.1, 3.0, 0.5),
        Figure(Setting(16), 150.0, 0.97, 0.3, 3.0, 0.8, left_early=True),
    ]
    assert climb.next(figures, 60.0) == Setting(8)
    figures.append(Figure(Setting(8), 190.0, 0.95, 0.2, 3.0, 0.6))
    assert climb.next(figures, 60.0) == Setting(4, 8)


def test_a_preset_that_still_holds_is_checked_not_searched():
    figures, choice, _ = search(latency_bound, Setting(64, 8), 60.0, 3.0, recorded=3900.0)
    assert len(figures) == 1 and choice.setting == Setting(64, 8) and not choice.beats_start
    assert choice.rule == PRESET_HOLDS
    figures, choice, _ = search(latency_bound, Setting(4), 60.0, 3.0, recorded=3900.0)
    assert len(figures) > 1  # it no longer reads what it recorded: searched again


# -- one setting's measurement, on a fake clock ----------------------------------------------


class Ticks:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Cores:
    """The machine's (busy, total) core seconds, moved only when told."""

    def __init__(self) -> None:
        self.busy = self.total = 0.0

    def run(self, seconds: float, busy: float) -> None:
        self.busy, self.total = self.busy + busy * seconds, self.total + seconds

    def __call__(self) -> tuple[float, float]:
        return self.busy, self.total


def test_a_window_is_bounded_in_seconds_not_steps():
    clock = Ticks()
    probe = Probe(Setting(8, 8), window_s=2.0, best=None, clock=clock)
    clock.now = 1.0
    probe.took(1.0, 64)  # the first batch: start-up
    steps = 0
    while not probe.done:  # a slow setting: a batch every 0.5 s, all of it waited for
        clock.now += 0.5
        probe.took(0.5, 64)
        steps += 1
    figure = probe.figure(seconds=clock.now)
    # warm-up ended at the first real wait after each of the 8 workers delivered once
    assert clock.now <= 1.0 + 8 * 0.5 + 2.0 + 0.5
    assert figure.samples_per_sec == pytest.approx(128.0)
    assert figure.data_wait_frac == pytest.approx(1.0)
    assert figure.startup_s == 1.0 and steps < 8 * 8  # not the backlog of 64 batches


def test_a_setting_measured_slower_than_the_best_is_left_at_once():
    clock = Ticks()
    probe = Probe(Setting(2), window_s=4.0, best=1000.0, clock=clock)
    probe.took(0.0, 10)
    while not probe.done:
        clock.now += 0.1
        probe.took(0.09, 10)  # 100 samples/s
    assert probe.left_early and clock.now <= 2.5  # half a window, not the whole
    assert probe.figure(seconds=clock.now).left_early


def test_a_setting_its_loader_holds_back_is_left_half_a_window_after_its_first_wait():
    """64 workers with deep queues whose consumer waits for them: they deliver a tenth of the
    best rate. The first wait after every worker delivered once opens the window (nothing is
    queued), and half a window of it leaves the setting, with the cores that window saw."""
    clock, cpu = Ticks(), Cores()
    probe = Probe(Setting(64, 8), window_s=3.0, best=2800.0, clock=clock, cpu=cpu)
    clock.now = 1.5
    probe.took(1.5, 32)  # start-up: 64 workers forked
    while not probe.done:
        clock.now += 0.1
        cpu.run(0.1, busy=0.6)
        probe.took(0.08, 30)  # 300 samples/s, most of it waited for: the loader holds it back
    figure = probe.figure(seconds=clock.now)
    assert figure.left_early and clock.now <= 1.5 + 64 * 0.1 + 1.5 + 0.11
    assert figure.samples_per_sec == pytest.approx(300.0)
    assert figure.data_wait_frac == pytest.approx(0.8)
    assert figure.cpu_busy_frac == pytest.approx(0.6)
    assert Climb.best([figure]) is None  # not a candidate for the choice


def test_a_consumer_that_hardly_waited_is_not_left_half_way():
    """24 workers starting on 2 busy cores (examples/doc_store.py, a 300 s bench): while they
    fill 48 queued batches, the training step shares the cores with them and runs at half
    the best rate, waiting for data 11% of the time. Its loader did not hold it back, so the
    slow start is no bound on the steady rate: the setting is measured over its window, and
    there reads what it makes once its queues are full."""
    clock, cpu = Ticks(), Cores()
    probe = Probe(Setting(24), window_s=3.0, best=1088.0, clock=clock, cpu=cpu)
    clock.now = 0.8
    probe.took(0.8, 64)  # start-up
    rate = 539.0  # while the workers fill their queues
    while not probe.done:
        step = 64 / rate
        clock.now += step
        cpu.run(step, busy=1.0)
        probe.took(0.11 * step, 64)
        if clock.now > 0.8 + 3.0 + 1.6:  # half the window on, the queues are full
            rate = 1600.0
    figure = probe.figure(seconds=clock.now)
    assert not figure.left_early and figure.ok  # slow for half its window, still measured
    assert figure.samples_per_sec > 1.5 * 539.0  # the window's rate, the full queues' in it
    assert figure.cpu_busy_frac == pytest.approx(1.0)


def test_a_window_that_waited_on_its_loader_is_left_half_way():
    clock = Ticks()
    probe = Probe(Setting(24), window_s=3.0, best=1088.0, clock=clock)
    probe.took(0.0, 64)
    for _ in range(23):  # the other workers' first batches
        probe.took(0.0, 64)
    probe.took(0.5, 64)  # nothing queued: the window opens
    while not probe.done:
        clock.now += 0.1
        probe.took(0.07, 50)  # 500 samples/s, 70% of it waiting for data
    assert probe.left_early and clock.now <= 1.5 + 0.11


def test_a_wide_pool_is_read_once_every_worker_delivered_not_while_it_starts():
    """34 processes on 2 cores (held-out audio): the first batch came 1.7 s after the loader
    was built, and the consumer then waits on the last workers' first batches (34 of them in
    2 s, a start-up). A window opened at that first wait read 0.86x of 28 workers; opened
    after every worker delivered once, it reads what the pool sustains."""
    clock = Ticks()
    probe = Probe(Setting(34, 2), window_s=1.8, best=1951.0, clock=clock)
    clock.now = 1.7
    probe.took(1.7, 64)  # the first worker's first batch
    for _ in range(33):  # the others', while they start: waited for
        clock.now += 2.0 / 33
        probe.took(0.05, 64)
    assert probe.window_from is None, "still starting: no window yet"
    steady = 2300.0
    while not probe.done:
        clock.now += 64 / steady
        probe.took(0.25 * 64 / steady, 64)
    figure = probe.figure(seconds=clock.now)
    assert not figure.left_early
    assert figure.samples_per_sec == pytest.approx(steady, rel=0.01)


def test_a_warm_up_at_the_best_rate_goes_on_to_its_window():
    clock = Ticks()
    probe = Probe(Setting(8), window_s=2.0, best=1000.0, clock=clock)
    probe.took(0.0, 10)
    for _ in range(15):  # 1.5 s of warm-up at 1,000 samples/s: not left
        clock.now += 0.1
        probe.took(0.0, 100)
    assert not probe.done and probe.window_from is None


def test_a_probe_on_a_running_pool_opens_its_window_at_its_first_batch():
    """A split of threads on the workers running already: nothing starts, so no start-up is
    measured (the line through start-ups leaves it out) and no warm-up is waited out; after
    an epoch's end its next loader warms up as any other."""
    clock = Ticks()
    probe = Probe(Setting(16), window_s=1.0, best=None, clock=clock)
    probe.keep_running()
    clock.now = 0.05
    probe.took(0.05, 64)
    assert probe.window_from == 0.05 and probe.startup_s == 0.0
    probe.pause()
    probe.took(0.5, 64)
    assert probe.window_from is None, "a new epoch's pool warms up again"


def test_a_split_of_threads_on_the_running_pool_is_predicted_to_cost_its_window():
    """What the climb expects a measurement to take decides whether it fits the budget: a
    split of threads on the pool that runs now starts nothing, another width starts a pool."""
    climb = Climb(Setting(4), Machine(2.0, 64), window_s=1.5)
    ran = Figure(Setting(24, main_threads=2), 900.0, 0.4, seconds=6.0, startup_s=3.0)
    assert climb.predicted_seconds(Setting(24, main_threads=1), [ran]) == 1.5
    assert climb.predicted_seconds(Setting(16, main_threads=2), [ran]) > 2 * 1.5


# -- the loader, with real DataLoaders ---------------------------------------------------------


def test_a_split_of_threads_goes_on_with_the_same_workers(monkeypatch):
    """The climb asks the setting it runs on another count of the step's threads: the workers
    go on (no loader is built for it, and every sample is still read once), the step takes
    the threads, and the split's figure has no start-up."""
    import torch

    loader = tuning_loader(Indices(240), num_workers=2)
    built = []
    make = loader.make_loader
    monkeypatch.setattr(loader, "make_loader", lambda tl, s: built.append(s) or make(tl, s))
    asked = []

    def split(figures, seconds_left):
        if asked:
            return None
        asked.append(Setting(2, 2, main_threads=1 if figures[0].setting.main_threads != 1 else 2))
        return asked[0]

    monkeypatch.setattr(loader.climb, "next", split)
    threads = torch.get_num_threads()
    try:
        assert sorted(epoch_of(loader)) == list(range(240))
        assert [s.main_threads for s in built][:1] != [asked[0].main_threads]
        assert len(built) == 1, "one pool, kept for the split"
        tried = loader.figures
        assert tried[1].setting == asked[0] and tried[1].startup_s == 0.0
        assert tried[1].ok and tried[0].startup_s > 0
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("persistent", [False, True])
def test_every_sample_once_an_epoch_across_switches(persistent):
    loader = tuning_loader(Indices(240), persistent_workers=persistent)
    first, second = epoch_of(loader), epoch_of(loader)
    assert sorted(first) == sorted(second) == list(range(240))
    assert first != second  # each epoch its own shuffle
    tried = [f["setting"]["num_workers"] for f in loader.report()["tried"]]
    assert len(tried) >= 3 and tried[:3] == [0, 2, 4]  # switched mid-epoch, wider each time
    assert loader.report()["chosen"] is not None


def test_a_loader_with_persistent_workers_collected_in_a_cycle_ends_them_at_once():
    """A tuning loader and what refers back to it (a clock of its own, say) are collected
    together: its persistent workers end by PyTorch's own shutdown while the queues still work,
    not after PyTorch's join timeout for each worker in turn (5 s each, 20 s for these 4)."""
    import gc
    import time

    from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL

    loader = tuning_loader(Indices(240), persistent_workers=True)
    loader.cycle = loader  # what a loop's objects may well do
    epoch_of(loader), epoch_of(loader)
    workers = loader._loader._iterator._workers
    assert len(workers) >= 2 and all(w.is_alive() for w in workers)
    del loader
    t0 = time.monotonic()
    gc.collect()
    assert time.monotonic() - t0 < MP_STATUS_CHECK_INTERVAL, "no worker waited out its join"
    assert not any(w.is_alive() for w in workers)


def test_a_setting_left_mid_epoch_has_its_workers_killed_not_waited_for(monkeypatch):
    """The batches its workers still read are not wanted (the next setting goes on from the
    last batch taken), and PyTorch's end of them waits for each read: about a second a
    switch on a held-out store. Every sample is still trained once."""
    import signal

    import feedrate.loader

    pools, remember = [], feedrate.loader._Loader._remember

    def kept(self, iterator):
        pools.append(list(getattr(iterator, "_workers", [])))
        return remember(self, iterator)

    monkeypatch.setattr(feedrate.loader._Loader, "_remember", kept)
    loader = tuning_loader(Indices(240))
    assert sorted(epoch_of(loader)) == list(range(240))
    left = [pool for pool in pools if pool][:-1]  # with workers, but the epoch's last
    assert left, "it switched mid-epoch from a setting with workers"
    assert [w.exitcode for pool in left for w in pool] == [-signal.SIGKILL] * sum(map(len, left))


def test_it_switches_to_threads_mid_epoch_and_every_sample_is_still_read_once(tmp_path):
    """Both engines: the clock reads a setting's rate from its workers alone, so threads read
    at least as fast as processes at the same width and are chosen; they go on where the
    processes stopped in the epoch, each figure says the tree's memory, and the preset
    records them."""
    preset = tmp_path / "threads.yaml"
    loader = tuning_loader(Indices(240), engines=list(BOTH), preset=str(preset))
    for _ in range(10):
        assert sorted(epoch_of(loader)) == list(range(240))
        if loader.report()["chosen"] is not None:
            break
    report = loader.report()
    engines = [f["setting"]["engine"] for f in report["tried"]]
    assert "thread" in engines and engines[0] == "process"
    assert report["chosen"]["engine"] == "thread"
    assert all(f["pss_mb"] > 0 for f in report["tried"])
    assert sorted(epoch_of(loader)) == list(range(240))  # on the threads chosen
    text = preset.read_text()
    assert "engine: thread" in text and "persistent_workers" not in text
    again = tuning_loader(Indices(240), engines=list(BOTH), preset=str(preset))
    assert again.climb.start.threads and again.climb.start.as_dict() == report["chosen"]


def test_a_state_on_an_engine_left_out_now_goes_on_on_one_searched(caplog):
    """A checkpoint taken on threads, resumed where threads are left out (the data changed,
    or the engines asked): the run goes on on processes, said, never on the threads."""
    loader = tuning_loader(Indices(240), engines=list(BOTH), num_workers=2, engine="thread")
    batches = iter(loader)
    first = [i for _ in range(3) for i in next(batches).tolist()]
    state = loader.state_dict()  # taken as the loop runs
    del batches
    assert state["current"]["engine"] == "thread"
    again = tuning_loader(Indices(240), engines=["process"], num_workers=2)
    with caplog.at_level(logging.WARNING, logger="feedrate.tuning"):
        again.load_state_dict(state)
    assert again.current == Setting(2, 2, "process")
    assert "the state's num_workers=2, prefetch_factor=2, engine=thread" in caplog.text
    assert sorted(first + epoch_of(again)) == list(range(240))  # it went on mid-epoch


class Unsafe(Indices):
    thread_safe = False


@pytest.mark.parametrize(
    "dataset, kwargs, said",
    [
        (Shards(40), {}, "is a stream"),
        (Unsafe(40), {"engines": list(BOTH)}, "thread_safe = False"),
        (Indices(40), {"worker_init_fn": print}, "worker_init_fn runs in each worker process"),
    ],
    ids=["stream", "not-thread-safe", "worker-init"],
)
def test_data_threads_cannot_read_is_searched_on_processes_and_said(dataset, kwargs, said, caplog):
    with caplog.at_level(logging.INFO, logger="feedrate.tuning"):
        loader = tuning_loader(dataset, **{"engines": None, **kwargs})
    assert loader.climb.machine.engines == ("process",)
    assert "thread workers left out of the search" in caplog.text and said in caplog.text
    with pytest.raises(ConfigError, match=said):  # asked to start on threads: refused
        tuning_loader(dataset, **{**kwargs, "engine": "thread", "num_workers": 2, "engines": None})


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"engines": ["threads"]}, "engines: 'threads' is not an engine"),
        ({"engine": "thread", "engines": ["process"], "num_workers": 2}, "on engine='thread'"),
        ({"engine": "threads"}, "engine: 'threads' is not an engine"),
    ],
)
def test_engines_it_cannot_search_are_named(kwargs, problem):
    with pytest.raises(ConfigError, match=problem):
        tuning_loader(Indices(8), **kwargs)


def test_tuned_again_it_measures_again_from_its_choice_with_persistent_workers_too():
    """retune() (the drift guard's on_drift=retune): the next epoch measures the setting it
    runs, whose persistent workers go on, and climbs from there; every sample still once."""
    loader = tuning_loader(Indices(240), persistent_workers=True)
    while loader.tuning:
        assert sorted(epoch_of(loader)) == list(range(240))
    chosen = loader.current
    loader.retune(budget_s=12.0)
    earlier = loader.report()["earlier"][0]["chosen"]["setting"]
    assert loader.tuning and Setting(**earlier) == chosen and chosen.engine == "process"
    assert sorted(epoch_of(loader)) == list(range(240))
    assert loader.figures and loader.figures[0].setting == chosen


def test_a_resumed_loader_goes_on_mid_epoch_with_its_tuning():
    loader = tuning_loader(Indices(240))
    batches = iter(loader)
    head = [i for _ in range(25) for i in next(batches).tolist()]
    state = loader.state_dict()  # a checkpoint after 25 batches, taken as the loop runs
    del batches  # the run ends there
    assert state["batches"] == 25 and state["figures"]
    again = tuning_loader(Indices(240))
    again.load_state_dict(json.loads(json.dumps(state)))  # a checkpoint holds plain data
    tail = epoch_of(again)
    assert sorted(head + tail) == list(range(240))
    assert again.report()["tried"][: len(state["figures"])] == state["figures"]
    assert sorted(epoch_of(again)) == list(range(240))  # and the next epoch is whole


def test_a_setting_whose_workers_die_is_dropped_and_nothing_is_lost(caplog):
    loader = tuning_loader(Indices(240, die_from=4))
    assert sorted(epoch_of(loader)) == list(range(240))
    failed = [f for f in loader.report()["tried"] if f["failed"]]
    assert failed and failed[0]["setting"]["num_workers"] == 4
    assert "exited unexpectedly" in failed[0]["failed"]
    assert loader.report()["chosen"]["num_workers"] < 4


def test_the_datasets_own_error_reaches_the_loop():
    loader = tuning_loader(Indices(240, bad=150))
    with pytest.raises(ValueError, match="sample 150 is corrupt"):
        epoch_of(loader)


def test_a_stream_switches_at_its_epochs_ends():
    loader = tuning_loader(Shards(200), shuffle=False)
    epochs = [epoch_of(loader) for _ in range(4)]
    assert all(sorted(e) == list(range(200)) for e in epochs)
    assert len(loader.report()["tried"]) >= 2


def test_the_preset_records_a_choice_that_beats_the_start(tmp_path):
    preset = tmp_path / "sensor.yaml"
    loader = tuning_loader(Indices(240), preset=str(preset))
    for _ in range(10):  # epochs, until it chooses
        if loader.report()["chosen"] is not None:
            break
        epoch_of(loader)
    report = loader.report()
    chosen, start = report["chosen"], report["start"]
    assert chosen != start  # the clock reads wider settings faster
    assert report["preset"] == str(preset)
    text = preset.read_text()
    assert "measured_on" in text and f"num_workers: {chosen['num_workers']}" in text
    # the next run starts from it; on threads where they alone are searched, and searches
    again = tuning_loader(Indices(240), preset=str(preset))
    assert again.climb.start == Setting(chosen["num_workers"], chosen["prefetch_factor"])
    threads = tuning_loader(Indices(240), preset=str(preset), engines=["thread"])
    on_threads = Setting(chosen["num_workers"], chosen["prefetch_factor"], "thread")
    assert threads.climb.start == on_threads
    assert threads.climb.recorded is None
    # a preset an engine cannot run is named with its file
    preset.write_text(preset.read_text().replace("engine: process", "engine: threads"))
    with pytest.raises(ConfigError, match=f"{preset}: engine='threads'"):
        tuning_loader(Indices(240), preset=str(preset))


def test_a_start_that_holds_is_written_so_the_next_run_checks_it_rather_than_searching(
    tmp_path,
):
    """The start, measured here for the first time, beat every setting tried: the run writes
    it with its figure, and the next run starts from it with that figure to check against
    (loader=auto's first run leaves a preset whatever it chose)."""
    preset = tmp_path / "kept.yaml"
    loader = tuning_loader(Indices(240), preset=str(preset), wider_is_slower=True)
    for _ in range(10):
        assert sorted(epoch_of(loader)) == list(range(240))
        if loader.report()["chosen"] is not None:
            break
    report = loader.report()
    assert len(report["tried"]) >= 2  # it searched, and the wider settings read slower
    assert report["chosen"] == report["start"] and report["rule"] == HELD
    assert report["preset"] == str(preset)
    again = tuning_loader(Indices(240), preset=str(preset))
    start = report["start"]
    assert again.climb.start == Setting(start["num_workers"], start["prefetch_factor"])
    measured = max(f.samples_per_sec for f in loader.figures if f.setting == loader.climb.start)
    assert again.climb.recorded == pytest.approx(measured, abs=0.05)


def test_a_checkpoint_after_an_epochs_last_batch_resumes_into_the_next_epoch():
    loader = tuning_loader(Indices(240))
    batches = iter(loader)
    first = [i for _ in range(60) for i in next(batches).tolist()]  # the whole epoch, 60 batches
    state = loader.state_dict()  # the pass has not ended yet: the loop did not ask again
    assert (state["epoch"], state["batches"]) == (1, 0)
    again = tuning_loader(Indices(240))
    again.load_state_dict(state)
    second = epoch_of(again)
    assert sorted(first) == sorted(second) == list(range(240)) and first != second


def test_a_stream_whose_setting_fails_stops_the_run_rather_than_read_it_twice():
    loader = tuning_loader(Shards(200, die_from=2), shuffle=False)
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        for _ in range(6):
            epoch_of(loader)


def test_a_file_feedrate_did_not_write_is_never_replaced(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("num_workers: 3\n")
    with pytest.raises(ConfigError, match="was not written by feedrate"):
        tuning_loader(Indices(240), preset=str(mine))
    assert mine.read_text() == "num_workers: 3\n"


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"budget_s": -1}, "budget_s=-1"),
        ({"sampler": [0, 1], "shuffle": True}, "sampler and shuffle=True"),
        ({"max_workers": 0}, "max_workers=0"),
    ],
)
def test_bad_arguments_are_named(kwargs, problem):
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(")):
        tuning_loader(Indices(8), **kwargs)


# -- the example, as a user runs it ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.alone
def test_the_plain_loop_example_runs_and_tunes():
    proc = subprocess.run(
        [sys.executable, "examples/plain_loop.py", "--seconds", "8", "--budget-s", "7",
         "--length", "3000", "--median-ms", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["samples"] > 0 and out["autotune"]["chosen"] is not None
    assert len(out["autotune"]["tried"]) >= 2
    assert "autotune_loader chose" in proc.stderr


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # a spawned process spawns its workers too (each imports torch): fork them here
        loader = tuning_loader(Indices(240), multiprocessing_context="fork")
        epochs = [epoch_of(loader) for _ in range(3)]
        report = loader.report()
        Path(out, f"rank{rank}.json").write_text(json.dumps({"epochs": epochs, **report}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_take_rank_0s_word_and_share_each_epoch(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2, join=False)
    for _ in range(120):  # a deadlock between the ranks fails the test, not the suite
        if ranks.join(timeout=1):
            break
    else:
        for process in ranks.processes:
            process.kill()
        pytest.fail("the two ranks did not finish in 120 s: a collective one of them skipped?")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for epoch in range(3):
        a, b = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert not set(a) & set(b) and sorted(a + b) == list(range(240))
    assert ranks[0]["tried"] == ranks[1]["tried"] and len(ranks[0]["tried"]) >= 2
    assert ranks[0]["chosen"] == ranks[1]["chosen"]


def test_the_budget_ends_a_measurement_that_would_overrun_it():
    class Slow:  # every reading of the clock moves 2 s: steps far longer than the budget
        now = 0.0

        def __call__(self) -> float:
            self.now += 2.0
            return self.now

    loader = feedrate.autotune_loader(
        Indices(240), batch_size=4, num_workers=0, budget_s=5.0, clock=Slow(), cpu=None
    )
    assert sorted(epoch_of(loader)) == list(range(240))
    report = loader.report()
    assert report["chosen"] == report["start"] and len(report["tried"]) == 1
    # cut at the first step past the budget (20 s on this clock), not at its window's end (30 s)
    assert report["seconds"] < 25.0
