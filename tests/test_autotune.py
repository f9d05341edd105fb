"""loader=autotune: the loader tuned inside the run, no sample skipped or trained twice."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import signal
import statistics
import threading
import time

import pytest
import torch
import yaml

import feedrate
import feedrate.errors
from feedrate.hardware import usable_cores

from .conftest import CONF, run_torchrun
from .counting import recorded

N, BATCH = 960, 8  # 120 steps an epoch
# Candidates measured in a few steps each: switches come every 20-60 steps, mid-epoch.
QUICK = [
    "trainer.autotune.write_preset=false",
    "trainer.autotune.window_s=0.1",
    # windows of a few steps, not whole epochs: candidates switch inside the counted epochs
    "trainer.autotune.whole_epochs_s=0",
    "trainer.autotune.warmup_steps=1",
    "trainer.autotune.window_steps=2",
    "trainer.autotune.max_workers=8",  # seeds: 2 and 8 workers (2 cores)
    "trainer.autotune.budget_s=600",  # the run ends first: it switches to its last step
]


def _counting(kind: str, *extra: str) -> list[str]:
    target = {"map": "Indexed", "stream": "IndexedStream"}[kind]
    return [
        "dataset=custom",
        f"dataset._target_=tests.counting.{target}",
        f"+dataset.n={N}",
        "+dataset.latency_ms=0.5",
        "model=tiny_cnn",
        "model._target_=tests.counting.Recorder",
        f"loader.batch_size={BATCH}",
        "trainer.max_steps=null",
        "trainer.warmup_steps=2",
        "trainer.window_steps=5",
        "trainer.checkpoint_every=null",
        "trainer.progress=false",
        *extra,
        # the run starts without workers: none of the worker-only settings
        "loader.num_workers=0",
        "loader.prefetch_factor=null",
        "loader.persistent_workers=false",
    ]


def _epochs(ids: list[int], per_epoch: int) -> list[list[int]]:
    return [ids[i : i + per_epoch] for i in range(0, len(ids), per_epoch)]


def _workers_trained(metrics: dict) -> set[int]:
    return {
        c["params"]["loader.num_workers"]
        for c in metrics["autotune"]["candidates"]
        if c["steps"] > 0
    }


def _seeds(machine_max: int, ranks: int = 1) -> set[int]:
    """The seeds' worker counts a rank runs (the sweep's: 1, 4 and 16 times the cores)."""
    cores = int(usable_cores())
    per_rank = machine_max // ranks
    return {min(per_rank, max(1, k * cores // ranks)) for k in (1, 4, 16)}


def _epoch_steps(directory, rank: int = 0, per_epoch: int = N) -> list[int]:
    """The steps of each epoch, from the batches the model recorded."""
    lines = [len(line.split()) for line in (directory / f"rank{rank}.txt").read_text().splitlines()]
    steps, seen, count = [], 0, 0
    for size in lines:
        seen, count = seen + size, count + 1
        if seen % per_epoch == 0:
            steps.append(count)
            count = 0
    return steps


def _switch_steps(metrics: dict) -> list[int]:
    """The steps at which the run switched loaders."""
    steps = [c["steps"] for c in metrics["autotune"]["candidates"]]
    return list(itertools.accumulate(steps))[:-1]


def _plain_and_tuned(tmp_path, monkeypatch, over=None):
    """Three epochs of map-style data with one loader, then with loader=autotune (``over``:
    when a candidate's measurement ends): the two record dirs and the tuned run's metrics."""
    from feedrate.autotune import Tuner

    plain, tuned = tmp_path / "plain", tmp_path / "tuned"
    for directory, loader in ((plain, []), (tuned, ["loader=autotune"])):
        directory.mkdir()
        monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(directory))
        overrides = _counting("map", "trainer.epochs=3", *loader, *QUICK)
        cfg = feedrate.compose(overrides, config_dir=CONF)
        if loader and over is not None:
            monkeypatch.setattr(Tuner, "over", over)
        metrics = feedrate.run(cfg, output_dir=directory / "run")
    return plain, tuned, metrics


def test_map_style_switches_mid_epoch_and_trains_every_sample_once_in_order(tmp_path, monkeypatch):
    """0, 2 and 8 workers take turns inside each epoch; every epoch trains each sample once,
    in the very order a run with one loader trains them (the loss curve just goes on)."""
    plain, tuned, metrics = _plain_and_tuned(tmp_path, monkeypatch)
    ids = recorded(tuned)
    assert ids == recorded(plain)
    assert [sorted(e) for e in _epochs(ids, N)] == [list(range(N))] * 3
    assert {0} | _seeds(8) <= _workers_trained(metrics)
    candidates = metrics["autotune"]["candidates"]
    assert sum(c["steps"] for c in candidates) == 3 * N // BATCH
    assert any(step % (N // BATCH) for step in _switch_steps(metrics)), "none mid-epoch"


def test_switches_on_an_epochs_last_batch_shuffle_the_next_epoch_as_one_loader_would(
    tmp_path, monkeypatch
):
    """Each candidate's measurement ends on an epoch's last batch: the next loader, built
    fresh, shuffles the next epoch as the one loader of a plain run does, not as its first."""

    at_ends = lambda self, done: self.steps % (N // BATCH) == 0  # noqa: E731
    plain, tuned, metrics = _plain_and_tuned(tmp_path, monkeypatch, over=at_ends)
    assert _switch_steps(metrics) == [N // BATCH, 2 * N // BATCH], "at the epochs' ends"
    assert recorded(tuned) == recorded(plain)


def test_where_epochs_are_short_a_candidate_measures_a_whole_one_and_no_sample_is_lost(
    tmp_path, monkeypatch, caplog
):
    """The default ``whole_epochs_s`` (a twelfth of the budget, 50 s here): 120 steps an
    epoch fit in it, so each candidate's figure covers a whole epoch, its end and restart
    included, before the next one starts where it stopped; every epoch still trains each
    sample once."""
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    quick = [o for o in QUICK if not o.startswith("trainer.autotune.whole_epochs_s")]
    cfg = feedrate.compose(
        _counting("map", "loader=autotune", "trainer.epochs=6", *quick), config_dir=CONF
    )
    assert cfg.trainer.autotune.whole_epochs_s is None
    with caplog.at_level(logging.INFO, logger="feedrate"):
        metrics = feedrate.run(cfg, output_dir=tmp_path / "run")
    assert [sorted(e) for e in _epochs(recorded(tmp_path), N)] == [list(range(N))] * 6
    candidates = metrics["autotune"]["candidates"]
    measured = [c for c in candidates[:-1] if not c["failed"]]  # the last: cut by the run's end
    assert len(measured) >= 2 and "samples/s over whole epochs" in caplog.text
    assert all(c["steps"] >= N // BATCH for c in measured), "its warm-up, then a whole epoch"


def test_a_stream_switches_mid_epoch_and_trains_every_sample_once(tmp_path, monkeypatch):
    """A resumable stream is read as fixed shares: 0, 2 and 8 workers go on from the shares'
    positions inside each epoch."""
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    overrides = _counting("stream", "loader=autotune", "trainer.epochs=3")
    cfg = feedrate.compose([*overrides, *QUICK], config_dir=CONF)
    metrics = feedrate.run(cfg, output_dir=tmp_path / "run")
    epochs = _epochs(recorded(tmp_path), N)
    assert [sorted(e) for e in epochs] == [list(range(N))] * 3
    assert {0} | _seeds(8) <= _workers_trained(metrics)
    # (a worker's last batch of a pass may be short: more steps than N // BATCH an epoch)
    epoch_ends = list(itertools.accumulate(_epoch_steps(tmp_path)))
    assert set(_switch_steps(metrics)) - set(epoch_ends), "none mid-epoch"


@pytest.mark.parametrize("stream", ["PositionlessStream", "LockedStream"])
def test_a_stream_without_a_position_or_a_copy_switches_at_its_epoch_ends(
    tmp_path, monkeypatch, stream
):
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    overrides = _counting("stream", "loader=autotune", "trainer.epochs=4")
    overrides[1] = f"dataset._target_=tests.counting.{stream}"
    cfg = feedrate.compose([*overrides, *QUICK], config_dir=CONF)
    metrics = feedrate.run(cfg, output_dir=tmp_path / "run")
    epochs = _epochs(recorded(tmp_path), N)
    assert [sorted(e) for e in epochs] == [list(range(N))] * 4
    assert {0} | _seeds(8) <= _workers_trained(metrics)
    assert all(step % (N // BATCH) == 0 for step in _switch_steps(metrics))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_two_ranks_switch_at_the_same_step_and_train_every_sample_once(tmp_path, kind):
    epochs = 3
    overrides = _counting(kind, "loader=autotune", f"trainer.epochs={epochs}")
    proc = run_torchrun(
        2,
        *overrides,
        *QUICK,
        "trainer.autotune.max_workers=16",  # the machine's: 8 a rank; seeds 1, 4 and 8 a rank
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"FEEDRATE_RECORD_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    per_rank = [_epochs(recorded(tmp_path, r), N // 2) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == epochs
    for e in range(epochs):
        assert sorted(per_rank[0][e] + per_rank[1][e]) == list(range(N))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert {0} | _seeds(16, ranks=2) <= _workers_trained(metrics)
    epoch_ends = list(itertools.accumulate(_epoch_steps(tmp_path, per_epoch=N // 2)))
    assert set(_switch_steps(metrics)) - set(epoch_ends), "none mid-epoch"


@pytest.mark.parametrize(
    "fault, reason",
    [
        (["+dataset.die_with=8"], "exited unexpectedly"),
        (
            ["+dataset.hang_with=8", "trainer.autotune.stall_s=2"],
            "timed out after 2.0 seconds (trainer.autotune.stall_s=2: a worker stuck)",
        ),
    ],
    ids=["workers-die", "workers-stuck"],
)
def test_a_candidate_that_fails_is_dropped_and_the_run_goes_on(
    tmp_path, monkeypatch, caplog, fault, reason
):
    """The 8-worker seed's workers die, or never return a sample: it is recorded as failed,
    the next candidate goes on from where the run was, and no sample is lost or repeated."""
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    overrides = [*_counting("map", "loader=autotune", "trainer.epochs=2"), *QUICK]
    cfg = feedrate.compose([*overrides, *fault], config_dir=CONF)
    with caplog.at_level(logging.WARNING, logger="feedrate"):
        metrics = feedrate.run(cfg, output_dir=tmp_path / "run")
    # failed for the fault; others may fail otherwise (cut by the run's end, abandoned)
    failed = [c for c in metrics["autotune"]["candidates"] if reason in (c["failed"] or "")]
    assert failed and {c["params"]["loader.num_workers"] for c in failed} == {8}
    assert all(c["search"] is None for c in failed)
    assert "loader=autotune: trial" in caplog.text and "failed: RuntimeError" in caplog.text
    assert metrics["autotune"]["chosen"]["params"]["loader.num_workers"] != 8
    candidates = metrics["autotune"]["candidates"]
    assert sum(c["steps"] for c in candidates) == 2 * N // BATCH
    assert [sorted(e) for e in _epochs(recorded(tmp_path), N)] == [list(range(N))] * 2


def _interrupt_after(directory, batches: int) -> threading.Thread:
    """Ctrl-C to this process once the model has recorded ``batches`` batches."""

    def watch() -> None:
        path = directory / "rank0.txt"
        while not path.exists() or len(path.read_text().splitlines()) < batches:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_a_run_stopped_while_tuning_resumes_into_the_tuning(tmp_path, monkeypatch, caplog, kind):
    """Ctrl-C mid-search saves the tuning with the checkpoint; the resumed run goes on tuning
    from there, and together the two runs train each sample once an epoch."""
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    run = tmp_path / "run"
    overrides = [*_counting(kind, "loader=autotune", "trainer.epochs=2"), *QUICK]
    cfg = feedrate.compose(overrides, config_dir=CONF)
    _interrupt_after(tmp_path, 70)
    with pytest.raises(feedrate.errors.Interrupted, match="interrupted"):
        feedrate.run(cfg, output_dir=run)
    saved = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["autotune"]
    assert saved["phase"] == "search" and len(saved["candidates"]) >= 2
    cfg = feedrate.compose([*overrides, "trainer.resume=true"], config_dir=CONF)
    with caplog.at_level(logging.INFO, logger="feedrate"):
        metrics = feedrate.run(cfg, output_dir=run)
    assert "loader=autotune goes on tuning from" in caplog.text
    names = [c["name"] for c in metrics["autotune"]["candidates"]]
    assert names[: len(saved["candidates"])] == [c["name"] for c in saved["candidates"]]
    assert len(names) > len(saved["candidates"])
    ids = recorded(tmp_path)
    assert [sorted(e) for e in _epochs(ids, N)] == [list(range(N))] * 2


def test_a_run_resumed_after_tuning_goes_straight_to_the_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    run = tmp_path / "run"
    tune = [*QUICK, "trainer.autotune.budget_s=1", "dataset.latency_ms=2"]
    first = [*_counting("map", "loader=autotune", "trainer.epochs=2"), *tune]
    done = feedrate.run(feedrate.compose(first, config_dir=CONF), output_dir=run)
    # the phase ended by its budget, before the run did
    assert not done["autotune"]["reason"].startswith("the run ended")
    assert done["autotune"]["rate_after"] == done["samples_per_sec"] > 0
    chosen = done["autotune"]["chosen"]
    second = [*_counting("map", "loader=autotune", "trainer.epochs=3"), *tune]
    cfg = feedrate.compose([*second, "trainer.resume=true"], config_dir=CONF)
    metrics = feedrate.run(cfg, output_dir=run)
    assert metrics["autotune"]["chosen"]["name"] == chosen["name"]
    assert len(metrics["autotune"]["candidates"]) == len(done["autotune"]["candidates"])
    assert metrics["run"]["loader"]["num_workers"] == chosen["params"]["loader.num_workers"]
    assert metrics["autotune"]["seconds"] == done["autotune"]["seconds"]  # no clock after it
    assert [sorted(e) for e in _epochs(recorded(tmp_path), N)] == [list(range(N))] * 3


def test_the_preset_it_writes_is_checked_not_searched_by_the_next_run(
    tmp_path, monkeypatch, caplog
):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    monkeypatch.setenv("FEEDRATE_CONFIG_DIR", str(conf))
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    overrides = [
        # 720 steps: the 2 s phase ends first even where a candidate reads 300 steps/s
        *_counting("map", "loader=autotune", "trainer.epochs=6"),
        *QUICK,
        "trainer.autotune.budget_s=2",
        "trainer.autotune.write_preset=true",
        "trainer.autotune.preset_name=at_test",
    ]
    first = feedrate.run(feedrate.compose(overrides, config_dir=conf), output_dir=tmp_path / "a")
    path = conf / "loader" / "at_test.yaml"
    assert first["autotune"]["preset"] == str(path)
    preset = yaml.safe_load(path.read_text())
    chosen = first["autotune"]["chosen"]
    assert preset["num_workers"] == chosen["params"]["loader.num_workers"]
    measured = preset["measured_on"]
    assert measured["samples_per_sec"] == pytest.approx(
        statistics.median([chosen["search"], *chosen["rounds"].values()]), abs=0.05
    )
    assert measured["workload"]["batch_size"] == BATCH and measured["machine"]["usable_cores"]
    # the next run checks it, once; any figure above 1% of the recorded one keeps it
    keep = [*overrides, "trainer.autotune.confirm_within=0.99"]
    again = feedrate.run(feedrate.compose(keep, config_dir=conf), output_dir=tmp_path / "b")
    assert again["autotune"]["confirmed"] == "at_test"
    assert [c["name"] for c in again["autotune"]["candidates"]] == ["preset at_test"]
    # a preset that no longer holds (its figure far above what it reads now) is searched again
    preset["measured_on"]["samples_per_sec"] *= 100
    path.write_text(path.read_text().split("defaults:")[0] + yaml.safe_dump(preset))
    with caplog.at_level(logging.WARNING, logger="feedrate"):
        # (with time to search after the check: 8 workers start slowly on a busy machine)
        more = [*overrides, "trainer.autotune.budget_s=4"]
        redo = feedrate.run(feedrate.compose(more, config_dir=conf), output_dir=tmp_path / "c")
    assert "below 85% of the" in caplog.text and "searching" in caplog.text
    assert redo["autotune"]["confirmed"] is None and len(redo["autotune"]["candidates"]) > 1
    # loader=auto picks what autotune wrote
    auto = [o.replace("loader=autotune", "loader=auto") for o in overrides[:-5]]
    with caplog.at_level(logging.INFO, logger="feedrate"):
        feedrate.run(feedrate.compose(auto, config_dir=conf), output_dir=tmp_path / "d")
    assert "loader=auto picked loader=at_test" in caplog.text


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.stream=true"], "trainer.stream=true repeats the data without epochs"),
        (["trainer.autotune.budget_s=-1"], "trainer.autotune.budget_s=-1.0 must be positive"),
        (["trainer.autotune.window_s=0"], "trainer.autotune.window_s=0.0 must be positive"),
        (["trainer.autotune.stall_s=0"], "trainer.autotune.stall_s=0.0 must be positive, or null"),
        (
            ["trainer.autotune.write_preset=true", "trainer.autotune.preset_name=../x"],
            "trainer.autotune.preset_name='../x' is not a valid preset name",
        ),
    ],
)
def test_settings_it_cannot_tune_under_are_refused_before_training(
    compose, tmp_path, overrides, expected
):
    cfg = compose("loader=autotune", "trainer.autotune.write_preset=false", *overrides)
    with pytest.raises(feedrate.errors.ConfigError, match=re.escape(expected)):
        feedrate.run(cfg, output_dir=tmp_path)
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.slow
def test_on_drift_retune_tunes_again_once_the_data_wait_rose(tmp_path, caplog):
    """Storage 20 ms a sample slower after 6 s: the drift guard warns, and the run tunes
    again at the next epoch's start, from the setting it chose before."""
    overrides = [
        "dataset=synthetic",
        "dataset.n_samples=640",
        "dataset.image_size=32",
        "dataset.io_latency_ms=1",
        "dataset.slowdown_after_s=6",
        "dataset.slowdown_ms=20",
        "loader=autotune",
        "loader.batch_size=16",
        "trainer.max_steps=null",
        "trainer.epochs=1000",
        "trainer.max_seconds=25",
        "trainer.window_steps=5",
        "trainer.drift_windows=3",
        "trainer.autotune.on_drift=retune",
        *QUICK,
        "trainer.autotune.budget_s=3",
    ]
    cfg = feedrate.compose(overrides, config_dir=CONF)
    with caplog.at_level(logging.WARNING, logger="feedrate"):
        metrics = feedrate.run(cfg, output_dir=tmp_path)
    assert "the input pipeline fell behind" in caplog.text
    assert "tuning again, from" in caplog.text
    earlier = metrics["autotune"]["earlier"]
    assert earlier and all(phase["chosen"] is not None for phase in earlier)
    # The guard may warn again later in the run; each phase starts from the one before.
    phases = [*earlier, metrics["autotune"]]
    for before, after in zip(phases[:-1], phases[1:], strict=True):
        assert after["candidates"][0]["name"] == "current"
        assert after["candidates"][0]["params"] == before["chosen"]["params"]


class _Planned:
    """A tuner driven with made-up figures: the plan alone, no loader built."""

    def __init__(self, compose, *overrides: str) -> None:
        from feedrate import distributed
        from feedrate.autotune import Tuner

        cfg = compose("loader=autotune", "trainer.autotune.write_preset=false", *overrides)
        self.tuner = Tuner(cfg, distributed.Ranks(), lambda loader, seed: None, None)

    def measure(self, rate_of, seconds: float = 2.0, other_cpu: float | None = None) -> None:
        """The current candidate measured (``rate_of(workers)`` samples/s, or no window
        when None), ``seconds`` of the budget spent on it, ``other_cpu`` of the cores busy
        with other processes meanwhile."""
        from types import SimpleNamespace

        from feedrate.meter import StepTimes

        rate = rate_of(self.tuner.candidate.workers)
        times = StepTimes(samples=int(rate or 0), elapsed_s=1.0 if rate else 0.0)
        self.tuner.spent += seconds
        monitor = SimpleNamespace(other_cpu_frac=other_cpu)
        self.tuner.measured({"times": times, "abandoned": None}, monitor, 10, seconds)

    def until_done(self, rate_of, seconds) -> None:
        """Every candidate measured, ``seconds()`` of the budget each, to the phase's end."""
        self.measure(rate_of, seconds())
        while self.tuner.advance():
            self.measure(rate_of, seconds())

    def workers_tried(
        self, rate_of, count: int, seconds: float = 2.0, build: bool = False
    ) -> list[int]:
        """``count`` candidates measured; with ``build``, each one's loader built as the run
        builds it, which sets its threads (patch ``torch.set_num_threads``)."""
        self.tuner.start()
        for _ in range(count):
            self.measure(rate_of, seconds)
            if not self.tuner.advance():
                break
            if build:
                self.tuner.build()
        return [c.workers for c in self.tuner.candidates]


def _threads(monkeypatch, count: int) -> dict:
    """PyTorch's main-process threads made ``count``, and what candidates set kept here."""
    threads = {"count": count}
    monkeypatch.setattr("feedrate.hardware.pytorch_threads", lambda: count)
    monkeypatch.setattr("torch.get_num_threads", lambda: threads["count"])
    monkeypatch.setattr("torch.set_num_threads", lambda n: threads.update(count=n))
    return threads


def test_the_wide_seeds_run_half_the_threads_the_fastest_is_deepened_given_them_back_then_climbed(
    compose, monkeypatch
):
    """Reads that stall scale past the top seed, and a main process with a thread a core
    competes with the workers once they fill the cores: the seeds (all at least the cores
    wide) run half PyTorch's main threads. The fastest is then tried once with a deeper
    queue, once with PyTorch's threads back (at the depth that won; PyTorch's as the run
    started, not the last candidate's), then with twice its workers (at the depth and threads
    that won), and so on up to the search's bound (64 on 2 cores); data that peaks early is
    not climbed, only deepened and given the threads back."""
    monkeypatch.setattr("feedrate.hardware.usable_cores", lambda: 2.0)  # seeds 2, 8, 32
    seeds = [2, 8, 32]
    in_order = seeds[::-1]  # the most workers first
    main, thin = 4, 2  # PyTorch's, the seeds'
    budget = ["trainer.autotune.budget_s=600", "trainer.autotune.max_workers=64"]
    shallow = ["loader.num_workers=0", "loader.prefetch_factor=null"]

    def tried(planned: _Planned) -> list[tuple]:
        return [
            (c.workers, c.params.get("loader.prefetch_factor"), c.params.get("loader.main_threads"))
            for c in planned.tuner.candidates
        ][1:]  # after the run's own loader

    def planned(fewer: float, deeper: float) -> _Planned:
        _threads(monkeypatch, main)
        out = _Planned(compose, *shallow, *budget)

        def rates(workers: int) -> float:
            params = out.tuner.candidate.params
            deep = deeper if params.get("loader.prefetch_factor") == 8 else 1
            thinner = fewer if params.get("loader.main_threads") == thin else 1
            return 100.0 * (1 + workers) * deep * thinner

        out.workers_tried(rates, 1 + len(seeds) + 4, build=True)
        return out

    seeded = [(w, 2, thin) for w in in_order]
    # the deeper queue and fewer threads win: the climb keeps both
    assert tried(planned(fewer=1.5, deeper=2))[: len(seeds) + 3] == [
        *seeded,
        (seeds[-1], 8, thin),
        (seeds[-1], 8, main),
        (64, 8, thin),
    ]
    # a model heavy on the CPU: the threads given back win, and the climb keeps them
    heavy = tried(planned(fewer=0.5, deeper=1))[: len(seeds) + 3]
    assert heavy == [*seeded, (seeds[-1], 8, thin), (seeds[-1], 2, main), (64, 2, main)]
    # neither wins: the climb goes on from the seed
    assert tried(planned(fewer=1, deeper=1))[: len(seeds) + 3] == [
        *seeded,
        (seeds[-1], 8, thin),
        (seeds[-1], 2, main),
        (64, 2, thin),
    ]
    _threads(monkeypatch, main)
    peaked = _Planned(compose, *shallow, *budget)
    workers = peaked.workers_tried(lambda w: 1000.0 - abs(w - seeds[0]), 1 + len(seeds) + 3)
    assert tried(peaked)[: len(seeds) + 2] == [*seeded, (seeds[0], 8, thin), (seeds[0], 2, main)]
    assert workers[-1] not in (seeds[0], 2 * seeds[-1])  # then Optuna's suggestion
    # from the run's own loader, whose thread counts are unset (not values the search takes)
    wide = _Planned(compose, "loader.num_workers=48", *budget)
    workers = wide.workers_tried(lambda w: 100.0 * (1 + w), 1 + len(seeds) + 2)
    assert workers[: 3 + len(seeds)] == [48, *in_order, 48, 64]


def test_a_candidate_reads_what_its_workers_sustain_and_one_stopped_warming_up_is_out(compose):
    """A window that ate a queue faster than the workers refilled it reads the workers' rate
    (reads that stall: 2,705 consumed, 1,320 produced); a seed the meter stopped in its
    warm-up, clearly below the best, is no finalist and is not counted as unmeasured."""
    from feedrate.meter import StepTimes

    planned = _Planned(compose, "loader.num_workers=0", "loader.prefetch_factor=null")
    tuner = planned.tuner
    tuner.start()
    drained = StepTimes(samples=2705, produced=1320, elapsed_s=1.0)
    tuner.measured({"times": drained, "abandoned": ""}, None, 40, 3.0)
    assert tuner.candidate.search == 1320
    assert tuner.advance()
    seed = tuner.candidate
    why = "ended early in its warm-up after 1.4 s: 224.0 samples/s at most in its last two"
    tuner.measured({"times": StepTimes(), "abandoned": why}, None, 8, 1.5)
    assert seed.failed == why and seed.search is None
    assert tuner._study.trials[seed.trial].state.name == "PRUNED"


def test_over_whole_epochs_a_candidate_reads_them_and_one_cut_inside_its_first_has_no_figure(
    compose,
):
    """Short epochs (``whole_epochs_s``): a candidate's figure is its whole epochs', restart
    included, not the windows' around them; one the budget cut inside its first whole epoch
    has none (its figure would leave the epoch's end out), and is no finalist."""
    from feedrate.meter import StepTimes

    planned = _Planned(compose, "loader.num_workers=0", "loader.prefetch_factor=null")
    tuner = planned.tuner
    tuner.start()
    # photos, 32 x 2: 847.6 samples/s in windows, 628.6 over its epochs
    epochs = StepTimes(samples=4238, elapsed_s=5.0, by_epochs=True, epochs_measured=(3143, 5.0))
    tuner.measured({"times": epochs, "abandoned": ""}, None, 66, 9.0)
    assert tuner.candidate.search == pytest.approx(628.6)
    assert tuner.advance()
    cut = tuner.candidate
    tuner.spent = tuner.budget
    assert tuner.over(False), "the budget is spent"
    inside = StepTimes(samples=2000, elapsed_s=2.0, by_epochs=True)
    tuner.measured({"times": inside, "abandoned": ""}, None, 31, 4.0)
    assert cut.search is None and cut.failed.startswith("cut: the tuning budget ran out")
    assert tuner._study.trials[cut.trial].state.name == "PRUNED"


def test_a_phase_measures_every_candidate_the_way_its_first_whole_epoch_one_was(compose):
    """Figures over whole epochs (restart in) and in windows (restart out) do not compare:
    once a candidate of the search is measured over whole epochs, so is every later one and
    every final round, whatever its own rate; a search with none so has its rounds in
    windows; the check of a preset is in windows, as the preset was measured. The way holds
    across a checkpoint, and a tuning again decides it afresh."""
    from feedrate import distributed
    from feedrate.autotune import Tuner
    from feedrate.meter import StepTimes

    def whole(tuner) -> bool | None:
        return tuner.meter_config()["whole_epochs"]

    planned = _Planned(compose, "loader.num_workers=0", "loader.prefetch_factor=null")
    tuner = planned.tuner
    tuner.start()
    assert whole(tuner) is None, "undecided: the candidate's own epoch length says"
    planned.measure(lambda w: 600.0)  # in windows: its epoch was long at its rate
    assert tuner.advance() and whole(tuner) is None
    epochs = StepTimes(samples=4238, elapsed_s=5.0, by_epochs=True, epochs_measured=(3143, 5.0))
    tuner.measured({"times": epochs, "abandoned": ""}, None, 66, 9.0)
    assert tuner.advance() and whole(tuner) is True
    while tuner.phase == "search":
        planned.measure(lambda w: 500.0 + w)
        assert tuner.advance()
    assert tuner.phase == "final" and whole(tuner) is True
    state = tuner.state()
    again = Tuner(tuner.cfg, distributed.Ranks(), lambda loader, seed: None, None, state=state)
    assert again.by_epochs is True, "kept in the checkpoint"
    tuner.chosen = tuner.candidate
    tuner.retune({"times": StepTimes(samples=100, elapsed_s=1.0)})
    assert whole(tuner) is None

    windows = _Planned(compose, "loader.num_workers=0", "loader.prefetch_factor=null").tuner
    windows.start()
    windows._start_finals()
    assert whole(windows) is False, "finals without a whole-epoch candidate: windows"

    here = ("at_test", {}, {"samples_per_sec": 600.0})
    make = lambda loader, seed: None  # noqa: E731
    check = Tuner(tuner.cfg, distributed.Ranks(), make, None, measured_here=here)
    assert check.phase == "confirm" and whole(check) is False


def test_a_final_round_starts_only_where_its_finalists_own_measurements_fit(compose):
    """10 ms synthetic data over whole epochs: two finalists of 11.5 and 11.7 s a measurement,
    three candidates abandoned in their warm-up or measured in 5.6 s. A round needs 23.2 s,
    not twice the median (12.4 s), so with 15 s left none starts, and the phase ends within
    its budget."""
    from feedrate.autotune import Candidate

    tuner = _Planned(compose, "trainer.autotune.budget_s=60").tuner
    tuner.start()

    def workers(n: int) -> dict:
        return {"loader.num_workers": n, "loader.prefetch_factor": 2}

    tuner.candidates = [
        Candidate("start", workers(4), search=354.8, seconds=5.6),
        Candidate("trial 1", workers(32), search=1741.8, seconds=11.5),
        Candidate("trial 2", workers(8), failed="ended early in its warm-up", seconds=2.9),
        Candidate("trial 3", workers(2), failed="ended early in its warm-up", seconds=4.8),
        Candidate(
            "trial 4", {**workers(32), "loader.main_threads": 1}, search=1636.2, seconds=11.7
        ),
    ]
    tuner.spent = 45.0
    tuner._start_finals()
    assert [tuner.candidates[i].name for i in tuner.finalists] == ["trial 1", "trial 4"]
    assert tuner.order == [] and tuner._next_final() is None, "23.2 s do not fit in 15"
    tuner.spent = 36.0
    tuner._start_finals()
    assert tuner.order == tuner.finalists, "24 s left: a round fits"


def test_a_windowed_figure_above_the_whole_epoch_ones_is_measured_again_or_left_out(compose):
    """Reads that stall, 312 batches an epoch: 32 x 2 read 2,202.3 in windows (restart out),
    then 32 x 8 2,096.0 over whole epochs (restart in), and no final round fitted. The
    windowed one is measured again over whole epochs where that fits, and the choice is
    made on figures taken one way; where it does not fit, it is left out of the choice."""
    from feedrate.autotune import Candidate, summary
    from feedrate.meter import StepTimes

    def phase(spent: float):
        tuner = _Planned(compose, "trainer.autotune.budget_s=60").tuner
        tuner.start()
        threads = {"loader.prefetch_factor": 2, "loader.main_threads": 1}
        tuner.candidates = [
            Candidate("start", {"loader.num_workers": 4}, search=430.8, seconds=4.9),
            Candidate("trial 4", {"loader.num_workers": 32, **threads}, search=2202.3, seconds=8.5),
            Candidate(
                "trial 5",
                {"loader.num_workers": 32, **threads, "loader.prefetch_factor": 8},
                search=2096.0,
                epochs=True,
                seconds=13.6,
            ),
        ]
        tuner.by_epochs, tuner.spent = True, spent
        return tuner

    tuner = phase(40.0)  # 20 s left: a round of both (22.1 s) does not fit, 13.6 s do
    again = tuner._measure_again(20.0)
    assert tuner.candidates[again].name == "trial 4" and tuner.candidate.search is None
    assert tuner.meter_config()["whole_epochs"] is True
    epochs = StepTimes(samples=31000, elapsed_s=15.0, by_epochs=True, epochs_measured=(20000, 10.0))
    tuner.spent += 13.0
    tuner.measured({"times": epochs, "abandoned": ""}, None, 500, 13.0)
    measured = tuner.candidate
    assert (measured.search, measured.epochs, measured.windowed) == (2000.0, True, 2202.3)
    tuner._finish()
    assert tuner.chosen.name == "trial 5", "2,096.0 against 2,000.0, both over whole epochs"
    assert "2,000.0 (windows: 2,202.3)" in summary(tuner.report(None))

    tuner = phase(40.0)  # its trial told the windowed figure; measured again, and it fails
    study = tuner._open_study()
    trial = study.ask()
    study.tell(trial, 2202.3)
    tuner.candidates[1].trial = trial.number
    tuner.current = tuner._measure_again(20.0)
    tuner.failed("its workers died")  # the trial is not told again
    assert tuner.candidate.failed and tuner._measure_again(20.0) is None

    tuner = phase(52.0)  # no round fits; measured again, but in windows (a stream): once only
    tuner.current = tuner._measure_again(20.0)
    tuner.measured({"times": StepTimes(samples=2150, elapsed_s=1.0), "abandoned": ""}, None, 9, 2)
    assert tuner.candidate.search == 2150.0 and not tuner.candidate.epochs
    assert tuner._measure_again(20.0) is None, "measured again once"

    tuner = phase(50.0)  # 10 s left: no whole epoch of it fits
    assert tuner._measure_again(10.0) is None
    tuner._finish()
    assert tuner.chosen.name == "trial 5" and "2 measured only in windows left out" in tuner.reason

    tuner = phase(10.0)  # 50 s left: the final rounds measure both over whole epochs
    assert tuner._measure_again(50.0) is None
    tuner.by_epochs, tuner.candidates[2].epochs = False, False  # all in windows: as they are
    tuner._finish()
    assert tuner.chosen.name == "trial 4"


def test_the_budget_ends_a_measurement_and_starts_no_candidate_that_cannot_fit(compose):
    def planned(budget: int) -> _Planned:
        return _Planned(
            compose,
            "loader.num_workers=0",
            "loader.prefetch_factor=null",
            f"trainer.autotune.budget_s={budget}",
            "trainer.autotune.max_workers=64",
        )

    cut = planned(10)
    tuner = cut.tuner
    tuner.start()
    cut.measure(lambda w: 195.0, seconds=4.0)
    assert tuner.advance() and tuner.candidate.workers > 0  # a seed: 6 s left, 4 needed
    assert not tuner.over(False)
    tuner.spent += 7.0
    assert tuner.over(False)  # the budget is spent: the measurement ends now
    cut.measure(lambda w: None, seconds=0.0)  # cut in its start-up: no window
    assert tuner.candidate.failed.startswith("cut: the tuning budget ran out")
    assert not tuner.advance() and tuner.chosen.name == "start"
    assert not tuner.over(False)  # after the phase, the budget ends nothing (the drift check)

    short = planned(10)
    short.tuner.start()
    short.measure(lambda w: 195.0, seconds=4.0)
    assert short.tuner.advance()
    short.measure(lambda w: 200.0, seconds=4.0)
    # 2 s left, a measurement takes 4: neither the next seed nor a final round starts
    assert not short.tuner.advance() and len(short.tuner.candidates) == 2
    assert short.tuner.chosen.search == 200.0

    final = planned(30)
    tried = final.workers_tried(lambda w: 200.0 - w, 4, seconds=4.0)  # start, 3 seeds: 16 s
    assert final.tuner.phase == "final" and len(final.tuner.finalists) == 2
    final.measure(lambda w: 200.0 - w, seconds=4.0)  # round 1, the first finalist
    assert final.tuner.advance()
    second = final.tuner.candidate
    final.tuner.spent += 30.0
    assert final.tuner.over(False)
    final.measure(lambda w: None, seconds=0.0)  # the second finalist's round, cut
    assert not second.failed and not second.rounds  # measured before: still a finalist
    assert not final.tuner.advance() and tried[:4] == [0, 32, 8, 2]  # most workers first


def test_shares_say_where_they_stand_and_go_on_from_there():
    """A stream read as shares: its state is each share's place; a copy loaded with it reads
    exactly the rest, and says the loaded place until it reads (a stream may not before)."""
    from feedrate.stream import Shares

    from .counting import IndexedStream

    def index(sample) -> int:
        return int(sample[0][0, 0, 0])

    shares = Shares(IndexedStream(n=40), parts=4)
    shares.set_epoch(0)
    samples = iter(shares)
    first = [index(next(samples)) for _ in range(10)]
    assert first[:4] == [0, 1, 2, 3]  # a sample from each share in turn
    state = shares.state_dict()["shares"]
    assert state == {p: {"epoch": 0, "read": 3 if p < 2 else 2} for p in range(4)}
    again = Shares(IndexedStream(n=40), parts=4)
    again.set_epoch(0)
    again.go_on(state, epoch=0)
    samples = iter(again)
    assert again.state_dict()["shares"] == state
    assert sorted(first + [index(s) for s in samples]) == list(range(40))
    again.set_epoch(1)  # a new epoch: from its start
    assert sorted(index(s) for s in again) == list(range(40))
    # a persistent worker's next pass: its shares start the epoch again, and say nothing
    # read until they read (not the end of the pass before)
    samples = iter(again)
    assert again.state_dict()["shares"] == {}
    assert sorted(index(s) for s in samples) == list(range(40))
    with pytest.raises(feedrate.errors.DatasetError, match="saved in 4 shares.* reads it in 8"):
        Shares(IndexedStream(n=40), parts=8).load_state_dict(again.state_dict())


def test_a_stream_that_does_not_split_by_worker_is_refused_even_without_workers(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    overrides = _counting("stream", "loader=autotune", "trainer.epochs=1", *QUICK)
    overrides[1] = "dataset._target_=tests.counting.UnsplitStream"
    cfg = feedrate.compose(overrides, config_dir=CONF)
    with pytest.raises(feedrate.errors.DatasetError, match="loader=autotune tries several worker"):
        feedrate.run(cfg, output_dir=tmp_path)


def test_a_candidates_memory_is_the_peak_of_its_own_readings(monkeypatch):
    """Each candidate's ``peak_mb`` is the highest reading since it started, not the last
    one, nor an earlier candidate's."""
    from feedrate import monitor as monitor_module

    readings = iter([300, 500, 200, 100])
    monkeypatch.setattr(
        monitor_module,
        "_tree_memory",
        lambda proc: (next(readings) * 2**20, 0.0, 1, [], 0.0),
    )
    monitor = monitor_module.ResourceMonitor(interval_s=None)
    monitor.sample()
    monitor.sample()
    assert monitor.peak_since_mark == 500 * 2**20
    monitor.mark()  # the next candidate
    monitor.sample()
    monitor.sample()
    assert monitor.peak_since_mark == 200 * 2**20


@pytest.mark.parametrize(("budget", "wider"), [(90, True), (75, False)])
def test_a_wider_loader_is_tried_only_when_it_would_start_in_time(
    compose, monkeypatch, budget, wider
):
    """Start-up grows with the workers: the top seed (32 workers on 2 cores) took 15 s, so
    twice as many are predicted at 28 s (2 s of window, 13 s of start-up twice over). After
    the seeds, the fewer threads and the deeper queue (58 s), with 32 s left they are tried;
    with 17 s they are not, nor any setting of the search that would not start in time."""
    from feedrate.sweep.space import default_threads

    monkeypatch.setattr("feedrate.hardware.usable_cores", lambda: 2.0)
    seeds = [2, 8, 32]
    thread_step = default_threads()["loader.main_threads"] > 1
    planned = _Planned(
        compose,
        "loader.num_workers=0",
        "loader.prefetch_factor=null",
        f"trainer.autotune.budget_s={budget - (0 if thread_step else 15)}",
        f"trainer.autotune.max_workers={2 * seeds[-1]}",
        "trainer.autotune.window_s=2",
    )
    tuner = planned.tuner
    tuner.start()
    seconds = dict(zip([0, *seeds], [3.0, 4.0, 6.0, 15.0], strict=True))

    def rate(workers: int) -> float:
        deep = tuner.candidate.params.get("loader.prefetch_factor") == 8
        return 100.0 + 40 * workers + (50 if deep else 0)

    # the start, the three seeds, the top seed with fewer threads, and deepened
    for i in range(5 + thread_step):
        planned.measure(rate, seconds=seconds[tuner.candidate.workers])
        advanced = tuner.advance()
        assert advanced or (not wider and i == 4 + thread_step)
    if wider:
        nxt = tuner.candidate.params
        assert (nxt["loader.num_workers"], nxt["loader.prefetch_factor"]) == (2 * seeds[-1], 8)
    else:
        while advanced:
            assert tuner.candidate.workers <= seeds[-1] or tuner.candidate.name == "start"
            planned.measure(rate, seconds=2.0 + 13.0 * tuner.candidate.workers / seeds[-1])
            advanced = tuner.advance()
        assert (tuner.chosen.workers, tuner.chosen.params["loader.prefetch_factor"]) == (
            seeds[-1],
            8,
        )


def test_the_search_ends_where_the_climbs_next_step_does_not_fit(compose, monkeypatch, caplog):
    """Reads that stall: the 32-worker seed took 19.4 s to start and measure; after the
    seeds and the deeper queue, 16 s are left, and the fastest with PyTorch's threads back
    would take 19. The search ends there: no suggestion of Optuna's trains slower settings in
    the last seconds (2 x 8 did, 5.1 s at 199 samples/s against the 1,656 of the fastest)."""
    monkeypatch.setattr("feedrate.hardware.usable_cores", lambda: 2.0)  # seeds 32, 8, 2
    _threads(monkeypatch, 2)
    planned = _Planned(
        compose, "trainer.autotune.budget_s=60", "trainer.autotune.window_s=2", "loader=recipe"
    )
    tuner = planned.tuner
    tuner.start()
    seen32 = []

    def seconds() -> float:
        c = tuner.candidate
        if c.workers == 32:
            seen32.append(c)
            return 19.4 if len(seen32) == 1 else 11.2
        return {4: 4.9, 8: 3.9, 2: 4.4}.get(c.workers, 4.0)

    def rate(workers: int) -> float:
        deep = tuner.candidate.params.get("loader.prefetch_factor") == 8
        return {4: 428.0, 8: 760.0, 2: 300.0}.get(workers, 1431.0 + (225 if deep else 0))

    with caplog.at_level("INFO", logger="feedrate.autotune"):
        planned.until_done(rate, seconds)
    tried = [(c.workers, c.params.get("loader.prefetch_factor")) for c in tuner.candidates]
    assert tried == [(4, 2), (32, 2), (8, 2), (2, 2), (32, 8)]  # the last deepened
    step = "num_workers=32, prefetch_factor=8, multiprocessing_context=fork, main_threads=2"
    assert f"the climb's next step ({step})" in caplog.text  # the threads given back
    assert tuner.elapsed() <= 60


def test_seeds_narrower_than_the_cores_and_a_main_process_of_one_thread_keep_pytorchs(
    compose, monkeypatch
):
    """Half the main process's threads only where the workers are at least a rank's cores
    (on 8 cores with at most 4 workers the seed keeps PyTorch's), and where there are two to
    halve: one thread stays one, and the climb has none to give back."""
    main = 4
    _threads(monkeypatch, main)
    monkeypatch.setattr("feedrate.hardware.usable_cores", lambda: 8.0)
    narrow = _Planned(compose, "trainer.autotune.budget_s=600", "trainer.autotune.max_workers=4")
    narrow.workers_tried(lambda w: 100.0 * (1 + w), 2)
    seed = narrow.tuner.candidates[1]
    assert (seed.workers, seed.params["loader.main_threads"]) == (4, main)

    monkeypatch.setattr("feedrate.hardware.usable_cores", lambda: 2.0)  # seeds 32, 8, 2
    _threads(monkeypatch, 1)
    single = _Planned(compose, "trainer.autotune.budget_s=600", "trainer.autotune.max_workers=64")
    single.workers_tried(lambda w: 100.0 * (1 + w), 6)
    tried = [
        (c.workers, c.params.get("loader.prefetch_factor"), c.params.get("loader.main_threads"))
        for c in single.tuner.candidates[1:6]
    ]
    assert tried == [(32, 2, 1), (8, 2, 1), (2, 2, 1), (32, 8, 1), (64, 2, 1)]


@pytest.mark.parametrize("noisy_read", [390.0, 1100.0])
def test_a_seed_measured_while_other_processes_ran_is_measured_again_if_below_the_fastest(
    compose, monkeypatch, caplog, noisy_read
):
    """Reads that stall: the 32-worker seed read 390.6 samples/s once, with other processes
    busy (1,059-1,475 in six other runs), so the climb went up from 8 workers and the run
    trained 0.46x of the preset. Once the seeds are measured, a noisy figure below the
    fastest is measured again; the fastest stands as it is (noise only slows a run), and the
    climb goes on from it."""
    from feedrate.autotune import summary

    monkeypatch.setattr("feedrate.hardware.usable_cores", lambda: 2.0)  # seeds 32, 8, 2
    planned = _Planned(
        compose, "trainer.autotune.budget_s=120", "trainer.autotune.window_s=2", "loader=recipe"
    )
    tuner = planned.tuner
    tuner.start()
    measured: list[tuple[int, float | None]] = []  # (candidate, other processes' share)

    def rate(workers: int) -> float:
        if tuner.current == 1 and (1, 0.3) not in measured:  # the 32-worker seed, first
            return noisy_read
        return {4: 383.0, 8: 686.0, 2: 293.0}.get(workers, 1300.0)

    def measure() -> None:
        noisy = 0.3 if tuner.current == 1 and (1, 0.3) not in measured else None
        planned.measure(rate, 6.0, other_cpu=noisy)
        measured.append((tuner.current, noisy))

    with caplog.at_level("INFO", logger="feedrate.autotune"):
        measure()
        while tuner.advance():
            measure()
    first = tuner.candidates[1]
    assert first.workers == 32 and "other processes kept 30%" in caplog.text
    assert tuner.chosen.workers == 32
    if noisy_read < 686.0:  # below the 8-worker seed: measured again, quiet this time
        assert measured[:5] == [(0, None), (1, 0.3), (2, None), (3, None), (1, None)]
        assert first.search == 1300.0 and first.noisy_figure == noisy_read
        assert "measured again: the first figure (390.0) was noisy" in first.noisy
        assert "(noisy: 390.0)" in summary(tuner.report(None))
    else:  # the fastest anyway: it stands
        assert measured[4][0] != 1  # the climb goes on from it
        assert first.search >= noisy_read


def test_a_noisy_figure_measured_again_and_cut_by_the_budget_stands(compose, monkeypatch):
    """The second measurement of a noisy figure is cut before its window: the first figure
    stands, flagged, and the candidate is not dropped as if it had never been measured."""
    monkeypatch.setattr("feedrate.hardware.usable_cores", lambda: 2.0)  # seeds 32, 8, 2
    planned = _Planned(
        compose, "trainer.autotune.budget_s=120", "trainer.autotune.window_s=2", "loader=recipe"
    )
    tuner = planned.tuner
    tuner.start()
    seen: list[int] = []

    def rate(workers: int) -> float | None:
        if tuner.current == 1:
            return 390.0 if seen.count(1) == 0 else None  # noisy, then cut
        return {4: 383.0, 8: 686.0, 2: 293.0}.get(workers, 1300.0)

    while True:
        again = tuner.current == 1 and 1 in seen
        tuner._budget_cut = again  # the budget ran out in its warm-up
        planned.measure(rate, 6.0, other_cpu=0.3 if tuner.current == 1 else None)
        seen.append(tuner.current)
        if again or not tuner.advance():
            break
    first = tuner.candidates[1]
    assert seen == [0, 1, 2, 3, 1]
    assert first.search == 390.0 and not first.failed
    assert "other processes kept 30%" in first.noisy


def test_the_phase_keeps_back_the_switch_it_saw_and_ends_within_its_budget(compose):
    """Ending a candidate (its batches closed, its workers ended) takes time that the budget
    check, made between steps, did not see: stalls tuned for 60.5 s of a 60 s budget, the
    last 0.25 s after the cut in ending 32 workers. The longest switch seen is kept back,
    twice over: a switch varies with the load (stalls: 0.7 s after 0.47 s, 60.2 s of 60)."""
    planned = _Planned(compose, "trainer.autotune.budget_s=60", "loader=recipe")
    tuner = planned.tuner
    tuner.start()
    switch, step = 0.4, 0.05

    def rate(workers: int) -> float:
        return 100.0 * (workers + 1)

    tuner.spent = 10.0
    assert tuner.over(True)  # the first candidate's measurement is over
    time.sleep(switch)
    planned.measure(rate, 0.0)
    assert tuner.advance()
    tuner.spent = 60.0 - 2.0  # its next candidate trains until the budget cuts it
    while not tuner.over(False):
        tuner.spent += step
    assert tuner.elapsed() < 60.0 - 2 * switch + step, "cut before the budget, by the switch"
    time.sleep(1.5 * switch)  # the last one slower
    planned.measure(rate, 0.0)
    assert not tuner.advance()
    assert tuner.elapsed() <= 60.0 + step


def test_the_choice_is_the_fastest_or_a_cheaper_finalist_shown_within_the_margin():
    """The sweep's rule: a cheaper finalist merely not shown slower is not taken."""
    from feedrate.autotune import Candidate, decide

    def finalist(name, workers, rounds):
        return Candidate(name, {"loader.num_workers": workers}, rounds=dict(enumerate(rounds)))

    fast = finalist("32 workers", 32, [2100, 2200, 2150])
    noisy = finalist("16 workers", 16, [1700, 2250, 2000])  # 0.93x, wide
    winner, why = decide([noisy, fast], 0.05)
    assert winner is fast and "no other finalist shown within 5% of it" in why
    tight = finalist("16 workers", 16, [2080, 2180, 2120])  # 0.99x, each round alike
    winner, why = decide([tight, fast], 0.05)
    assert winner is tight and "the cheapest of those within 5% of the fastest" in why
    assert decide([noisy, fast], 0.5)[0] is noisy, "trainer.autotune.equivalence=0.5"
    # fewer than 3 rounds: the fastest measured, no claim
    winner, why = decide([finalist("8", 8, [2140, 2145]), finalist("32", 32, [2150, 2160])], 0.5)
    assert winner.name == "32" and "no claim" in why


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_switched_in_at_an_epoch_end_shuffles_the_next_epoch_as_one_loader_would(workers):
    """A fresh loader starts its shuffle from the seed: switched in at an epoch's end, it
    trained the first epoch's order again. Nor is the state of the loader before it enough:
    stopped at its last batch, its sampler had not drawn what it draws at its end."""
    from feedrate.loader import build_loader, shuffle_after_pass

    from .counting import Indexed

    kwargs = {
        **dict(batch_size=8, shuffle=True, num_workers=workers, pin_memory=False),
        **dict(drop_last=False, timeout=0.0, persistent_workers=False),
        **dict(prefetch_factor=2 if workers else None, multiprocessing_context=None),
    }

    def order(batches) -> list[int]:
        return [int(i) for x, _ in batches for i in x[:, 0, 0, 0]]

    one = build_loader(Indexed(n=64), kwargs, seed=0)
    first, second = order(one), order(one)
    assert first != second, "each epoch its own shuffle"
    before = build_loader(Indexed(n=64), kwargs, seed=0)
    start = before.sampler.generator.get_state()
    assert order(itertools.islice(before, len(before))) == first  # stopped at the last batch
    other = 2 - workers  # the next candidate: the other worker count
    switched = {**kwargs, "num_workers": other, "prefetch_factor": 2 if other else None}
    after = build_loader(Indexed(n=64), switched, seed=0, worker_seed=7)
    shuffle_after_pass(after, start)
    assert order(after) == second


def test_an_epochs_tail_and_the_next_backlog_are_not_part_of_a_candidates_rate(
    tmp_path, monkeypatch
):
    """Each epoch's last num_workers x prefetch_factor batches, and as many after the next
    epoch starts, are held out of the candidate's windows, where an epoch is at least 4 such
    backlogs long (120 batches: 2 workers x 2, 8 x 2, 2 x 8; not 8 x 8)."""
    from feedrate import trainer
    from feedrate.meter import Meter

    holds, backlogs = [], {}  # (step, extra) held; step -> the training loader's backlog
    real_hold, real_tail = Meter.checkpoint_paused, trainer.in_tail

    def recorded_hold(self, step, extra=0):
        holds.append((step, extra))
        real_hold(self, step, extra)

    def recorded_tail(loader, where):
        backlogs[where.step] = trainer.unsteady(loader)
        return real_tail(loader, where)

    monkeypatch.setattr(Meter, "checkpoint_paused", recorded_hold)
    monkeypatch.setattr(trainer, "in_tail", recorded_tail)
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    overrides = _counting("map", "loader=autotune", "trainer.epochs=3", *QUICK)
    cfg = feedrate.compose([*overrides, "trainer.checkpoint_every=null"], config_dir=CONF)
    feedrate.run(cfg, output_dir=tmp_path / "run")
    per_epoch = N // BATCH

    def backlog(step: int) -> int:  # the last asked: a tail held is not asked again
        return backlogs[max(s for s in backlogs if s <= step)]

    tails = [(s, e) for s, e in holds if s % per_epoch]
    ends = [(s, e) for s, e in holds if not s % per_epoch]
    assert tails, "a tail held"
    for s, extra in tails:  # in the tail (from its start, or a loader's switched in there):
        left = per_epoch - s % per_epoch  # the epoch's rest and the next backlog
        assert 0 < left <= backlog(s) and extra == left + backlog(s)
    assert any(per_epoch - s % per_epoch == backlog(s) > 0 for s, _ in tails), "at its start"
    assert all(e == backlog(s) for s, e in ends), "the epoch's end: the next backlog"
