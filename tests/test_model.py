"""The model of the input pipeline, on simulated costs, and the costs real loaders report:
the climb predicts from one window, verifies in a few, and lands where a grid would."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import pytest
import torch
from torch.utils.data import Dataset

import feedrate
from feedrate.costs import Costed, CostedCollate, TimedReads, split
from feedrate.tuning.model import Costs, Pipeline, depth, headroom, predict, rate
from feedrate.tuning.policy import Climb, Figure, Machine, Setting
from feedrate.tuning.ties import FEWER_THREADS, WIDER

BOTH = ("process", "thread")


def costs(
    wait_ms: float,
    cpu_ms: float,
    step_ms: float,
    step_cpu_ms: float | None = None,
    batch: int = 32,
    tail: float = 1.2,
    on: Setting | None = None,
    **more,
) -> Costs:
    """A window's costs of a batch whose samples each wait ``wait_ms`` and burn ``cpu_ms``."""
    b = batch / 1000
    return Costs(
        batch_size=batch,
        worker_s=b * (wait_ms + cpu_ms),
        worker_cpu_s=b * cpu_ms,
        queued_s=0.0,
        collate_s=b * 0.01,
        tail=tail,
        step_s=step_ms / 1000,
        step_cpu_s=(step_ms if step_cpu_ms is None else step_cpu_ms) / 1000,
        handoff_s=0.0,
        nbytes=batch * 4096,
        measured_on=on or Setting(2),
        **more,
    )


def test_littles_law_sizes_the_workers_of_latency_bound_data():
    """Reads that wait 12 ms for a step that takes 2,000 samples/s: the step needs
    2,000 x 12 ms = 24 workers busy at once, and a little more for the spread."""
    latency = costs(wait_ms=12, cpu_ms=0.2, step_ms=16)  # 32 samples in 16 ms: 2,000/s
    made = predict(latency, Pipeline(cores=2, max_workers=64))
    needed = 2000 * 0.0122
    assert needed < made.setting.num_workers <= math.ceil(1.5 * needed)
    assert made.bound == "step" and made.samples_per_sec == pytest.approx(2000, rel=0.01)
    # the same on a machine allowed 16 workers: all of them, held by the workers
    capped = predict(latency, Pipeline(cores=2, max_workers=16))
    assert capped.setting.num_workers == 16 and capped.bound == "workers"


def test_cpu_bound_data_gets_the_workers_the_cores_can_run():
    """5 ms of CPU a sample and a step of 2 ms a batch on 2 cores: no more than 2 cores'
    worth of samples, whatever the workers; more workers than that only compete."""
    cpu = costs(wait_ms=0.1, cpu_ms=5, step_ms=2)
    made = predict(cpu, Pipeline(cores=2, max_workers=64))
    cap = 2 / (0.160 + 0.002) * 32
    assert made.bound == "cores" and made.samples_per_sec == pytest.approx(cap, rel=0.02)
    assert made.setting.num_workers <= 4


def test_data_in_memory_is_read_by_the_main_process_alone():
    """A sample read in microseconds costs less than its hand-off from a worker process: the
    main process alone keeps up, and no worker starts (a sweep found it 1.7x faster)."""
    memory = costs(wait_ms=0.0, cpu_ms=0.002, step_ms=3, on=Setting(2))
    memory = Costs(**{**memory.__dict__, "nbytes": 32 * 150_000})  # 150 kB a sample
    made = predict(memory, Pipeline(cores=2, max_workers=64))
    assert made.setting == Setting(0)
    assert made.why, "the prediction says why"


@pytest.mark.parametrize(
    "wait_ms, cpu_ms, engine",
    [(20.0, 0.1, "thread"), (0.2, 3.0, "process")],
    ids=["waiting-reads-threads", "gil-bound-processes"],
)
def test_the_engine_follows_what_a_read_spends_its_time_on(wait_ms, cpu_ms, engine):
    """Reads that wait hold no GIL: threads feed the step as processes would, without a
    process each. Reads that burn Python CPU are done one thread at a time."""
    made = predict(costs(wait_ms, cpu_ms, step_ms=8), Pipeline(2, 64, BOTH))
    assert made.setting.engine == engine


def test_threads_measured_using_several_cores_release_the_gil():
    """A window on threads whose workers used 3 cores together: their CPU is mostly C code
    that releases the GIL (a decoder), and threads are rated by the cores, not the GIL."""
    on_threads = costs(0.2, 3.0, 8, on=Setting(8, engine="thread"), workers_cores=3.0)
    as_python = costs(0.2, 3.0, 8, on=Setting(8, engine="thread"), workers_cores=0.9)
    pipe = Pipeline(8, 64, BOTH)
    threads = Setting(32, 2, "thread")
    assert rate(on_threads, threads, pipe)[0] > 2.5 * rate(as_python, threads, pipe)[0]
    assert rate(as_python, threads, pipe)[1] == "gil"


@pytest.mark.parametrize("tail, expected", [(1.1, 2), (3.4, 4), (30.0, 8)])
def test_the_queue_is_as_deep_as_the_slowest_batches_are_long(tail, expected):
    assert depth(costs(10, 0.1, 5, tail=tail)) == expected


def test_a_device_step_is_its_wall_time_and_only_its_host_side_competes():
    """On a GPU the step's time is the device's (20 ms a batch), its host side 1 ms of CPU:
    the workers are sized for the device's rate, and their CPU competes with 1 ms, not 20
    (on 8 cores, workers that burn 4.5 ms a sample then fit beside it; a 20 ms CPU step not)."""
    device = costs(wait_ms=0.5, cpu_ms=4.5, step_ms=20, step_cpu_ms=1.0)
    pipe = Pipeline(cores=8, max_workers=128)
    made = predict(device, pipe)
    assert made.bound == "step" and made.samples_per_sec == pytest.approx(32 / 0.020, rel=0.01)
    needed = (1 / 0.020) * 32 * 0.005
    assert needed <= made.setting.num_workers <= 1.5 * needed
    # the same step, were its 20 ms all CPU: the cores would hold it lower
    host = costs(wait_ms=0.5, cpu_ms=4.5, step_ms=20, step_cpu_ms=20)
    assert rate(host, made.setting, pipe)[0] < made.samples_per_sec


# -- a climb that predicts, on simulated stores ----------------------------------------------


@dataclass
class Store:
    """A simulated pipeline on ``cores`` cores: each sample waits ``wait_ms`` and burns
    ``cpu_ms`` (under the GIL on threads), the step takes ``step_ms`` a batch of 32. Its
    truth differs from the model's: every worker process costs 0.3% of the rate, a window
    reads 3% either way, and the first window's step is 40% slower (a cold start)."""

    wait_ms: float
    cpu_ms: float
    step_ms: float
    cores: float = 2.0
    batch: int = 32
    measured: int = 0

    def truth(self, s: Setting) -> float:
        b, wait, cpu, step = self.batch, self.wait_ms / 1e3, self.cpu_ms / 1e3, self.step_ms / 1e3
        if not s.num_workers:
            return b / (step + b * (wait + cpu))
        supply = s.num_workers / (b * (wait + cpu))
        handoff = 0.0 if s.threads else 0.0002
        cap = self.cores / (b * cpu + step + handoff)
        if s.threads:
            cap = min(cap, 1 / (b * cpu))
        slower = 1 - (0.003 * s.num_workers if not s.threads else 0.0)
        return b * min(supply, cap, 1 / (step + handoff)) * slower

    def measure(self, s: Setting) -> Figure:
        self.measured += 1
        noise = 1 + 0.03 * math.sin(7 * self.measured)
        got = self.truth(s) * noise
        cold = 1.4 if self.measured == 1 else 1.0
        b = self.batch
        step_s = self.step_ms / 1e3 * cold
        busy = min(1.0, got / b * (b * self.cpu_ms / 1e3 + step_s) / self.cores)
        wait = max(0.0, 1 - got / b * step_s)
        over = max(0.0, busy * (s.num_workers + 1) / self.cores - 1)  # run-queue waits
        seen = Costs(
            batch_size=b,
            worker_s=b * (self.wait_ms + self.cpu_ms * (1 + over)) / 1e3,
            worker_cpu_s=b * self.cpu_ms / 1e3,
            queued_s=b * self.cpu_ms * over / 1e3,
            collate_s=b * 1e-5,
            tail=1.3,
            step_s=step_s,
            step_cpu_s=step_s,
            handoff_s=0.0002 if s.num_workers and not s.threads else 0.0,
            nbytes=b * 4096,
            workers_cores=min(1.0, busy * self.cores) if s.threads else busy * self.cores,
            measured_on=s,
        )
        startup = 0.3 + (0.0 if s.threads else 0.03 * s.num_workers)
        return Figure(s, got, wait, busy, startup + 2 * 2.0, startup, costs=seen)


STORES = {
    "object-store": Store(wait_ms=12, cpu_ms=0.3, step_ms=10),
    "decode": Store(wait_ms=0.2, cpu_ms=3.0, step_ms=12),
    "in-memory": Store(wait_ms=0.0, cpu_ms=0.01, step_ms=4),
    "cache-and-parse": Store(wait_ms=3, cpu_ms=1.0, step_ms=6),
    "slow-step": Store(wait_ms=30, cpu_ms=0.1, step_ms=80),
}


@pytest.mark.parametrize("name", list(STORES))
def test_the_climb_predicts_then_verifies_and_lands_near_the_grids_best(name):
    """From the start's one window the model predicts; a few windows verify it: the choice
    trains at least 0.95x the best of a grid over workers, depths and engines, having
    measured at most 4 settings, the start among them."""
    store = STORES[name]
    climb = Climb(Setting(2), Machine(2.0, 64, BOTH), window_s=2.0)
    figures = [store.measure(Setting(2))]
    while (nxt := climb.next(figures, 60.0)) is not None:
        figures.append(store.measure(nxt))
    choice = climb.choose(figures)
    grid = [
        Setting(n, d, e)
        for n in (0, 1, 2, 4, 8, 16, 24, 32, 48, 64)
        for d in (2, 4, 8)
        for e in BOTH
    ]
    best = max(store.truth(s) for s in grid)
    assert store.truth(choice.setting) >= 0.95 * best, (choice, [f.setting for f in figures])
    assert len(figures) <= 4  # the start, and at most three windows more
    assert climb.predictions and climb.predictions[0][0] == 1  # predicted from the first window


def test_each_prediction_is_reported_beside_what_it_measured():
    store = STORES["object-store"]
    climb = Climb(Setting(2), Machine(2.0, 64, BOTH), window_s=2.0)
    figures = [store.measure(Setting(2))]
    while (nxt := climb.next(figures, 60.0)) is not None:
        figures.append(store.measure(nxt))
    first = climb.prediction_report(figures)[0]
    measured = next(f.samples_per_sec for f in figures if f.setting.as_dict() == first["setting"])
    assert first["from"] == Setting(2).as_dict()
    assert first["measured_samples_per_sec"] == pytest.approx(measured, abs=0.1)
    expected = measured / first["predicted_samples_per_sec"] - 1
    assert first["error"] == pytest.approx(expected, abs=1e-3)


def test_without_costs_the_figures_lead_as_before():
    """A loader that does not say what its batches cost (a stream, a loader of the user's
    own) is climbed on its figures alone."""
    climb = Climb(Setting(4), Machine(2.0, 64), window_s=1.0)
    first = Figure(Setting(4), 200.0, 0.95, 0.1, 3.0, startup_s=1.0)
    assert climb.next([first], seconds_left=60.0) == Setting(16)
    assert not climb.predictions


# -- what real loaders report ---------------------------------------------------------------


class Slow(Dataset):
    """Each read waits ``wait_ms`` (off the CPU) and burns ``cpu_ms`` of this thread's CPU."""

    def __init__(self, n: int = 64, wait_ms: float = 4.0, cpu_ms: float = 1.0) -> None:
        self.n, self.wait_s, self.cpu_s = n, wait_ms / 1e3, cpu_ms / 1e3

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.wait_s)
        end = time.thread_time() + self.cpu_s
        while time.thread_time() < end:
            pass
        return torch.full((16,), float(i))


@pytest.mark.parametrize("workers", [0, 2])
def test_each_batch_carries_its_reads_and_collates_cost_and_the_loop_sees_the_batch(workers):
    loader = torch.utils.data.DataLoader(
        TimedReads(Slow()),
        batch_size=8,
        num_workers=workers,
        collate_fn=CostedCollate(torch.utils.data.default_collate),
    )
    seen = []
    for item in loader:
        assert isinstance(item, Costed)
        batch, cost = split(item)
        seen += batch[:, 0].int().tolist()
        assert cost.samples == 8 and cost.nbytes == 8 * 16 * 4
        assert cost.read_s >= 8 * 0.005 * 0.95  # 4 ms waiting and 1 ms of CPU, 8 times
        assert 8 * 0.001 * 0.9 <= cost.read_cpu_s < cost.read_s
        assert cost.read_queued_s >= 0 and cost.collate_s >= cost.collate_cpu_s * 0.5
    assert sorted(seen) == list(range(64))
    plain = torch.ones(2)
    assert split(plain)[0] is plain and split(plain)[1] is None  # a loader without costs


def test_the_tuning_loader_measures_costs_on_both_engines_and_predicts(caplog):
    """A real search on processes and threads: each setting's figure holds what a batch cost
    its worker, the loop gets plain batches, every sample once, and the predictions are in
    the report beside what they measured."""
    loader = feedrate.autotune_loader(
        Slow(n=480, wait_ms=3.0, cpu_ms=0.2), batch_size=8, budget_s=6.0, num_workers=1
    )
    seen = []
    with caplog.at_level("INFO", logger="feedrate.tuning"):
        for _ in range(3):
            for batch in loader:
                assert isinstance(batch, torch.Tensor)
                seen += batch[:, 0].int().tolist()
    loader.close()
    assert sorted(seen) == sorted(list(range(480)) * 3)
    report = loader.report()
    measured = [f for f in report["tried"] if f["costs"] is not None]
    assert measured, report["tried"]
    first = measured[0]["costs"]
    assert first["worker_s"] >= 8 * 0.003 and first["batch_size"] == pytest.approx(8)
    assert report["predictions"] and "autotune_loader predicts" in caplog.text


def test_a_reading_thread_times_at_most_one_batch_every_20_ms():
    """Batches read from memory in microseconds: a few are timed, the rest go as they are,
    so that reporting costs a bounded share of a core however fast the batches come."""
    data = torch.arange(4096).view(-1, 1)
    loader = torch.utils.data.DataLoader(
        TimedReads(data), batch_size=4, collate_fn=CostedCollate(torch.utils.data.default_collate)
    )
    began = time.perf_counter()
    items = list(loader)
    seconds = time.perf_counter() - began
    timed = [i for i in items if isinstance(i, Costed)]
    assert 1 <= len(timed) <= seconds / 0.02 + 1 < len(items)
    assert sorted(int(x) for i in items for x in split(i)[0].flatten()) == list(range(4096))


def test_a_device_step_is_read_as_its_wall_time_and_its_host_cpu_apart():
    """A simulated device step: 10 ms a batch off the CPU (a host blocked on the device), as
    a GPU run's loop shows it. The tuning loader's costs read the step at 10 ms a batch, and
    the host's CPU a batch as a small part of that: the loader competes with the host only."""
    loader = feedrate.autotune_loader(
        Slow(n=400, wait_ms=1.0, cpu_ms=0.05),
        batch_size=4,
        budget_s=5.0,
        num_workers=2,
        engines=["process"],
    )
    for _ in loader:
        time.sleep(0.010)  # the device's time: the host waits, holding no core
    loader.close()
    measured = [f for f in loader.figures if f.costs is not None]
    assert measured, loader.report()["tried"]
    costs = measured[0].costs
    assert 0.009 <= costs.step_s <= 0.030
    assert costs.step_cpu_s < 0.5 * costs.step_s


def test_a_cap_on_the_cores_is_verified_wider_where_the_loop_still_waits():
    """Held out (audio, 2 cores): the model said 18 workers were held by the cores, the loop
    still waited 10% of the time, and 32 workers trained 1.27x faster. A loop that waits is
    checked one step wider, whatever the model's cap; one that does not, on busy cores, one
    step narrower."""
    cpu = costs(wait_ms=13, cpu_ms=1.2, step_ms=10, on=Setting(18))
    climb = Climb(Setting(4), Machine(2.0, 64), window_s=2.0)
    start = Figure(Setting(4), 270.0, 0.94, 0.24, 3.6, 0.8, costs=costs(13, 1.2, 10))
    made = climb.next([start], 60.0)
    waited = Figure(made, 1260.0, 0.10, 0.98, 4.2, 2.2, costs=cpu)
    wider = climb.next([start, waited], 60.0)
    assert wider is not None and wider.num_workers >= 1.5 * made.num_workers - 1
    busy = Figure(made, 1260.0, 0.01, 0.98, 4.2, 2.2, costs=cpu)
    narrower = Climb(Setting(4), Machine(2.0, 64), window_s=2.0)
    narrower.next([start], 60.0)
    assert narrower.next([start, busy], 60.0).num_workers < made.num_workers


def test_a_step_wider_that_gained_less_than_the_gain_ends_the_widening():
    """Held out (tickets, 2 cores): 21 workers read 2,167 samples/s, one step wider (32)
    2,233 (+3%, within one window's noise), the loop waiting 31% on busy cores. Another step
    (48) is not worth its start-up and window; where the last step gained 10% or more, it is."""
    cpu = costs(wait_ms=15, cpu_ms=0.6, step_ms=5, on=Setting(21))

    def after(wider_rate: float) -> Setting | None:
        climb = Climb(Setting(4), Machine(2.0, 256), window_s=2.0)
        start = Figure(Setting(4), 406.0, 0.95, 0.26, 2.9, 0.5, costs=cpu)
        made = climb.next([start], 60.0)
        first = Figure(made, 2167.0, 0.59, 0.87, 3.8, 1.0, costs=cpu)
        step = climb.next([start, first], 60.0)
        assert step is not None and step.num_workers >= 1.5 * made.num_workers - 1
        wider = Figure(step, wider_rate, 0.31, 1.0, 3.9, 1.2, costs=cpu)
        return climb.next([start, first, wider], 60.0), step

    stopped, step = after(2233.0)
    assert stopped is None or stopped.num_workers <= step.num_workers
    went_on, step = after(2500.0)
    assert went_on is not None and went_on.num_workers > step.num_workers


LATENT_RUN = (  # 15 ms of latency a sample, two workers: a run of a few seconds
    "dataset.io_latency_ms=15",
    "dataset.n_samples=2000",
    "loader.batch_size=8",
    "loader.num_workers=2",
    "trainer.max_steps=30",
    "trainer.warmup_steps=4",
    "trainer.window_steps=4",
)


@pytest.mark.parametrize("engine", ["process", "thread"])
def test_a_run_with_trainer_costs_reports_what_a_measured_batch_cost(compose, tmp_path, engine):
    """``trainer.costs=true`` (what a sweep's trials run): metrics.json ``costs`` sums up the
    measured batches' costs, on the setting the run's loader had. Most of a batch's time in
    its worker is off the CPU, and the model widens past the cores. Off by default: a run's
    batches then carry nothing."""
    on = compose(*LATENT_RUN, f"loader.engine={engine}", "trainer.costs=true")
    said = feedrate.run(on, output_dir=tmp_path / "on")["costs"]
    assert said is not None, "a batch a worker reads every 20 ms at most says its cost"
    costs = Costs.from_dict(said)
    assert costs.measured_on == Setting(2, 2, engine)
    assert costs.batch_size == 8 and costs.batches >= 2
    assert costs.worker_s >= 8 * 0.015 * 0.9, "the reads' latency is the worker's time"
    assert costs.worker_cpu_s < 0.5 * costs.worker_s, "mostly waiting, not on a core"
    assert costs.step_s > 0 and costs.nbytes > 0
    assert predict(costs, Pipeline(2.0, 64)).setting.num_workers > 2
    off = compose(*LATENT_RUN, f"loader.engine={engine}")
    assert feedrate.run(off, output_dir=tmp_path / "off")["costs"] is None


def test_one_main_thread_where_the_steps_pool_spins_beside_busy_workers():
    """The held-out store on 2 cores: a batch waits 500 ms and burns 30 ms in its worker; the
    step takes 5 ms on 2 threads and its process 20 ms of CPU (an intra-op pool spinning
    between steps). On one thread the step takes at most twice as long and spends only
    that: the workers get the cores, and the model predicts it, with more workers. Where
    the tuner does not turn the threads (a GPU's host), it never says any."""
    spinning = costs(15.0, 1.0, 5.0, 20.0, step_threads=2)
    turned = predict(spinning, Pipeline(2.0, 64, main_threads=2))
    kept = Setting(turned.setting.num_workers, turned.setting.depth, main_threads=2)
    assert turned.setting.main_threads == 1
    assert turned.samples_per_sec > 1.2 * rate(spinning, kept, Pipeline(2.0, 64))[0]
    assert predict(spinning, Pipeline(2.0, 64)).setting.main_threads is None
    # a step that is the bound and spends what it takes: its threads are worth keeping
    busy_step = costs(1.0, 0.2, 40.0, 80.0, step_threads=2)
    assert predict(busy_step, Pipeline(2.0, 64, main_threads=2)).setting.main_threads == 2


def test_the_tuning_loader_that_splits_threads_runs_its_choices_threads(monkeypatch):
    """``split_threads=True``: each setting runs the step on its own threads
    (``torch.set_num_threads``), and the choice's stay once tuning is over."""
    asked = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: asked.append(n))
    monkeypatch.setattr(torch, "get_num_threads", lambda: asked[-1] if asked else 2)
    loader = feedrate.autotune_loader(
        Slow(n=480, wait_ms=3.0, cpu_ms=0.2),
        batch_size=8,
        budget_s=4.0,
        num_workers=1,
        split_threads=True,
        engines=["process"],
    )
    for _ in range(3):
        for _batch in loader:
            pass
    loader.close()
    assert loader.climb.machine.main_threads == 2 and loader.climb.start.main_threads == 2
    tried = {f.setting.main_threads for f in loader.figures}
    assert tried <= {1, 2} and asked and asked[-1] == loader.choice.setting.main_threads


def test_costs_measured_on_one_main_thread_predict_one_thread_again():
    """More threads than measured are not rated faster (the model knows nothing of their
    pool's spin): the thread count measured is kept, and the climb verifies the other."""
    one = costs(15.0, 1.0, 2.0, 2.0, step_threads=1, on=Setting(25, 2, main_threads=1))
    assert predict(one, Pipeline(2.0, 64, main_threads=2)).setting.main_threads == 1


def test_the_other_threads_are_verified_only_where_their_measured_spin_leaves_them_near():
    """The held-out store: the first window ran the step on the run's 2 threads, whose pool
    spent 20 ms of CPU a batch on a 5 ms step; the prediction, on one thread, spent 7. On 2
    cores the 2 threads' CPU caps the rate at about 0.75x one thread's (three windows read
    0.61-0.79x): the climb leaves that neighbour out. Where no window measured 2 threads'
    CPU, the model knows nothing of it, and the climb verifies them."""
    machine = Machine(2.0, 64, main_threads=2)
    two, one = Setting(4, 2, main_threads=2), Setting(33, 2, main_threads=1)
    seen_two = costs(8.0, 0.45, 5.0, 20.0, batch=64, on=two, step_threads=2)
    seen_one = costs(8.0, 0.45, 12.0, 7.0, batch=64, on=one, step_threads=1)
    seed = Figure(two, 420.0, 0.97, 0.16, 2.8, 0.6, costs=seen_two)
    best = Figure(one, 3460.0, 0.02, 0.98, 4.1, 1.9, costs=seen_one)

    def asked(figures: list[Figure]) -> list[Setting]:
        """What the climb measures after ``figures``, each other setting reading 0.9x."""
        climb, figures, out = Climb(figures[0].setting, machine, window_s=2.0), [*figures], []
        while (nxt := climb.next(figures, 30.0)) is not None and len(out) < 8:
            out.append(nxt)
            figures.append(Figure(nxt, 3110.0, 0.05, 0.98, 4.0, 1.9, costs=seen_one))
        return out

    assert replace(one, main_threads=2) not in asked([seed, best])
    assert replace(one, main_threads=2) in asked([best])


def test_one_main_thread_is_measured_next_where_it_could_be_near_though_rated_slower():
    """Photos on 2 cores: a batch of 64 burns 128 ms decoding in its worker, and the step
    takes 100 ms on the run's 2 threads, its process spending 150 ms of CPU. The model counts
    one thread at twice the step's time, 0.73x the rate measured; but one thread count says
    little of another's (one main thread trained 518 samples/s there, two 423 and 452). The
    climb measures it next, before any neighbour on two threads; where the tuner does not
    turn the threads, never."""
    two = Setting(4, 2, main_threads=2)
    seen = costs(0.2, 2.0, 100.0, 150.0, batch=64, on=two, step_threads=2)
    pipe = Pipeline(2.0, 64, main_threads=2)
    one = replace(two, main_threads=1)
    assert rate(seen, one, pipe)[0] < 0.8 * 436.0, "the model alone rates it out"

    def asked(machine: Machine) -> list[Setting]:
        """What the climb measures after the start, each other setting reading 0.9x."""
        figures = [Figure(two, 436.0, 0.05, 0.99, 1.0, 0.5, costs=seen)]
        climb, out = Climb(two, machine, window_s=1.0), []
        while (nxt := climb.next(figures, 30.0)) is not None and len(out) < 8:
            out.append(nxt)
            figures.append(Figure(nxt, 392.0, 0.05, 0.99, 1.0, 0.5, costs=seen))
        return out

    turned = asked(Machine(2.0, 64, main_threads=2))
    assert one in turned and turned.index(one) == 1, turned  # the prediction, then it
    assert all(s.main_threads in (None, 2) for s in asked(Machine(2.0, 64)))
    # one thread measured, its step twice as long: the next best on two threads is not split
    # again on the benefit of the doubt, but rated with the step one thread measured
    slow = costs(0.2, 2.0, 200.0, 200.0, batch=64, on=one, step_threads=1)
    measured = [
        Figure(two, 436.0, 0.05, 0.99, 1.0, 0.5, costs=seen),
        Figure(one, 300.0, 0.05, 0.99, 1.0, 0.5, costs=slow),
        Figure(replace(two, num_workers=9), 480.0, 0.05, 0.99, 1.0, 0.5, costs=seen),
    ]
    climb = Climb(two, Machine(2.0, 64, main_threads=2), window_s=1.0)
    later = []
    while (nxt := climb.next(measured, 30.0)) is not None and len(later) < 8:
        later.append(nxt)
        measured.append(Figure(nxt, 400.0, 0.05, 0.99, 1.0, 0.5, costs=seen))
    assert all(s.main_threads != 1 for s in later), later


@pytest.mark.parametrize("one_read, expected", [(2006.0, 1), (1900.0, 2)])
def test_the_same_workers_within_5_percent_on_fewer_main_threads_are_taken(one_read, expected):
    """Held-out tickets: 23 workers read 2,094 samples/s on 2 main threads and 2,006 on one,
    a window each: no 5% either way, and one thread is taken (its pool does not spin on the
    workers' cores). Clearly slower on one thread, the two are kept."""
    start = Setting(4, 2, main_threads=2)
    two, one = Setting(23, 2, main_threads=2), Setting(23, 2, main_threads=1)
    figures = [
        Figure(start, 402.0, 0.94, 0.27, 2.9, 0.6),
        Figure(one, one_read, 0.40, 0.98, 3.1, 1.0),
        Figure(two, 2094.0, 0.12, 0.99, 4.8, 1.6),
    ]
    choice = Climb(start, Machine(2.0, 64, main_threads=2), window_s=1.0).choose(figures)
    assert choice.setting.main_threads == expected
    assert (choice.rule == FEWER_THREADS) == (expected == 1)
    assert choice.beats_start


def test_a_pool_the_cores_hold_is_sized_past_their_cap_where_reads_mostly_wait():
    """The held-out store's first window: a batch of 64 waits 512 ms and burns 29 ms. The
    cores cap the rate, at a figure one window's CPU a batch sets (23-46 ms over three such
    windows): the pool is sized for a quarter more, as its extra workers only wait. Data
    that burns its time on the cores gets no such margin: more workers would compete."""
    waits = costs(8.0, 0.45, 5.0, 20.0, batch=64, step_threads=2, on=Setting(4, 2, main_threads=2))
    made = predict(waits, Pipeline(2.0, 128, main_threads=2))
    little = made.samples_per_sec / 64 * waits.alone_s * headroom(waits)
    assert made.bound == "cores" and made.setting.num_workers >= 1.2 * little
    burns = costs(0.5, 5.0, 2.0)
    cpu = predict(burns, Pipeline(2.0, 128))
    assert cpu.setting.num_workers <= math.ceil(cpu.samples_per_sec / 32 * burns.alone_s * 1.5)


def test_a_wider_pool_read_within_a_tenth_is_chosen_where_the_loop_waits_on_reads():
    """Held-out sensors, round 1: 52 workers read 3,330 samples/s in one window, the loop
    still waiting 44%; 64 read 3,299 in a window that their start-up (4.5 s of 6.6) shared.
    Reads that mostly wait: 64 is taken, as its extra workers only wait. The same figures
    from reads that burn their time on the cores keep 52: there workers compete."""
    waits = costs(16.0, 0.5, 10.7, 7.0, batch=64, on=Setting(52, 2, main_threads=1))
    burns = costs(0.2, 16.0, 10.7, 7.0, batch=64, on=Setting(52, 2, main_threads=1))
    machine = Machine(2.0, 64, main_threads=2)
    start = Setting(4, 2, main_threads=2)
    for seen, expected in ((waits, 64), (burns, 52)):
        figures = [
            Figure(start, 283.0, 0.95, 0.14, 3.8, 1.0, costs=seen),
            Figure(Setting(52, 2, main_threads=1), 3330.0, 0.44, 0.93, 5.5, 3.3, costs=seen),
            Figure(Setting(64, 2, main_threads=1), 3299.0, 0.28, 0.98, 6.6, 4.5, costs=seen),
        ]
        choice = Climb(start, machine, window_s=2.0).choose(figures)
        assert choice.setting.num_workers == expected, choice.reason
        assert (choice.rule == WIDER) == (expected == 64)


def test_a_narrower_step_already_measured_is_not_measured_again():
    """Held-out audio: the climb measured 28 workers, then 35 (+2%), the cores busy. The
    step narrower from 35 is 23, but 28 already read that side: no window goes to 23. Where
    the pool measured narrower is more than a step away (15), the step narrower is verified."""
    machine = Machine(2.0, 64, main_threads=2)
    start = Setting(4, 2, main_threads=2)
    seen = costs(13.0, 1.0, 9.0, 7.0, batch=64, on=Setting(35, 2, main_threads=1), step_threads=1)

    def asked(figures: list[Figure]) -> list[int]:
        climb, figures, out = Climb(start, machine, window_s=2.0), [*figures], []
        while (nxt := climb.next(figures, 30.0)) is not None and len(out) < 8:
            out.append(nxt.num_workers)
            figures.append(Figure(nxt, 1700.0, 0.3, 0.97, 4.0, 2.0, costs=seen))
        return out

    first = Figure(start, 270.0, 0.95, 0.15, 3.5, 0.8, costs=seen)
    wide = Figure(Setting(35, 2, main_threads=1), 1983.0, 0.30, 0.97, 4.8, 2.3, costs=seen)
    narrow = Figure(Setting(28, 2, main_threads=1), 1940.0, 0.35, 0.96, 4.6, 2.5, costs=seen)
    assert 23 not in asked([first, narrow, wide])
    further = Figure(Setting(15, 2, main_threads=1), 1900.0, 0.40, 0.95, 4.2, 2.0, costs=seen)
    assert 23 in asked([first, further, wide]), "15 is more than a step narrower than 35"


def test_more_main_threads_are_measured_only_after_the_best_ones_neighbours():
    """Held-out tickets: the prediction, 23 workers on one main thread, read 2,006 samples/s,
    the loop still waiting 40%. The climb measures one step wider on that thread first; 23 on
    the run's 2 threads (no spin measured there to rate them out) only after it."""
    start, one = Setting(4, 2, main_threads=2), Setting(23, 2, main_threads=1)
    seen_two = costs(8.0, 0.9, 9.3, 9.3, batch=64, on=start, step_threads=2)
    seen_one = costs(8.0, 0.7, 19.2, 15.7, batch=64, on=one, step_threads=1)
    figures = [
        Figure(start, 402.0, 0.94, 0.27, 2.9, 0.6, costs=seen_two),
        Figure(one, 2006.0, 0.40, 0.98, 3.1, 1.0, costs=seen_one),
    ]
    climb, asked = Climb(start, Machine(2.0, 64, main_threads=2), window_s=1.0), []
    while (nxt := climb.next(figures, 30.0)) is not None and len(asked) < 8:
        asked.append(nxt)
        figures.append(Figure(nxt, 1800.0, 0.30, 0.98, 3.5, 1.2, costs=seen_one))
    two = replace(one, main_threads=2)
    wider = [s for s in asked if s.main_threads == 1 and s.num_workers > one.num_workers]
    assert two in asked and wider, asked
    assert asked.index(wider[0]) < asked.index(two), asked
