"""loader=autotune in feedrate's own loop: the run's loader is a tuning loader, which the loop
only iterates; no sample skipped or trained twice, across switches, failures and resumes."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal

import psutil
import pytest
import torch
import yaml

import feedrate
import feedrate.errors
from feedrate.tuning import TuningLoader

from .conftest import CONF
from .counting import recorded

N, BATCH = 960, 8  # 120 steps an epoch
QUICK = [
    "trainer.autotune.write_preset=false",
    "trainer.autotune.max_workers=8",
    "trainer.autotune.budget_s=600",  # the run ends first, or the climb does
]


@pytest.fixture
def short_windows(monkeypatch):
    """Each setting measured over 0.15 s windows (a real run's are 1-3 s): a run of a few
    seconds switches several times, inside its epochs."""
    monkeypatch.setattr("feedrate.tuning.loader.window_seconds", lambda budget_s: 0.15)


def _counting(kind: str, *extra: str, latency_ms: float = 2.0) -> list[str]:
    target = {"map": "Indexed", "stream": "IndexedStream"}[kind]
    return [
        "dataset=custom",
        f"dataset._target_=tests.counting.{target}",
        f"+dataset.n={N}",
        f"+dataset.latency_ms={latency_ms}",
        "model=tiny_cnn",
        "model._target_=tests.counting.Recorder",
        f"loader.batch_size={BATCH}",
        "trainer.max_steps=null",
        "trainer.warmup_steps=2",
        "trainer.window_steps=5",
        "trainer.checkpoint_every=null",
        "trainer.progress=false",
        *extra,
        # the run starts without workers: the climb has somewhere to go
        "loader.num_workers=0",
        "loader.prefetch_factor=null",
        "loader.persistent_workers=false",
    ]


def _epochs(ids: list[int], per_epoch: int) -> list[list[int]]:
    return [ids[i : i + per_epoch] for i in range(0, len(ids), per_epoch)]


def _each_once(directory, epochs: int, rank: int = 0, per_epoch: int = N) -> bool:
    got = [sorted(e) for e in _epochs(recorded(directory, rank), per_epoch)]
    return got == [list(range(N))] * epochs


def _tried(metrics: dict) -> list[int]:
    return [f["setting"]["num_workers"] for f in metrics["autotune"]["tried"]]


def _own_conf(tmp_path, monkeypatch):
    """A copy of the configs for the run to write its preset into, and the samples recorded
    under ``tmp_path``."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    monkeypatch.setenv("FEEDRATE_CONFIG_DIR", str(conf))
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    return conf


def _run(tmp_path, overrides: list[str], name: str = "run") -> dict:
    cfg = feedrate.compose(overrides, config_dir=CONF)
    return feedrate.run(cfg, output_dir=tmp_path / name)


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_the_loop_trains_every_sample_once_an_epoch_while_the_loader_switches(
    tmp_path, monkeypatch, short_windows, kind
):
    """Map-style data switches inside its epochs, a stream at its epoch ends; the climb
    goes from the start's 0 workers to more, and each epoch trains each sample once."""
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    metrics = _run(tmp_path, _counting(kind, "loader=autotune", "trainer.epochs=4", *QUICK))
    assert _each_once(tmp_path, 4)
    tried = _tried(metrics)
    assert tried[0] == 0 and len(set(tried)) >= 2 and max(tried) > 0, tried
    assert metrics["autotune"]["samples_while_tuning"] > 0
    predictions, start = metrics["autotune"]["predictions"], metrics["autotune"]["tried"][0]
    if kind == "map":  # predicted from what the start's batches cost, each beside its figure
        assert start["costs"]["worker_s"] >= 0.002 * BATCH and predictions
        assert predictions[0]["from"] == start["setting"]
        assert {"predicted_samples_per_sec", "measured_samples_per_sec", "error"} <= set(
            predictions[0]
        )
    else:  # a stream reads inside its own iterator: climbed on its figures alone
        assert start["costs"] is None and not predictions


def test_on_thread_workers_it_trains_every_sample_once_and_writes_a_thread_preset(
    tmp_path, monkeypatch, short_windows
):
    """trainer.autotune.engines=[thread]: every setting with workers runs them as threads,
    switched inside the epochs as processes are, and the preset it writes says so, without
    the settings of worker processes."""
    conf = _own_conf(tmp_path, monkeypatch)
    overrides = [
        *_counting("map", "loader=autotune", "trainer.epochs=3"),
        *QUICK,
        "trainer.autotune.engines=[thread]",
        "trainer.autotune.write_preset=true",
        "trainer.autotune.preset_name=on_threads",
    ]
    # this test process's tree before the run: a forkserver or a resource tracker that an
    # earlier test in it started stays its child, and the run's readings count it too
    before = 1 + len(psutil.Process().children(recursive=True))
    metrics = feedrate.run(feedrate.compose(overrides, config_dir=conf), output_dir=tmp_path / "a")
    assert _each_once(tmp_path, 3)
    report = metrics["autotune"]
    with_workers = [f["setting"] for f in report["tried"] if f["setting"]["num_workers"]]
    assert with_workers and all(s["engine"] == "thread" for s in with_workers)
    assert metrics["peak_processes"] == before  # no worker process ever started
    assert report["chosen"]["engine"] == "thread" and report["preset"]
    preset = yaml.safe_load((conf / "loader" / "on_threads.yaml").read_text())
    assert preset["engine"] == "thread" and preset["num_workers"] > 0
    assert not {"persistent_workers", "multiprocessing_context"} & set(preset)


def test_the_drift_guard_watches_the_choice_not_the_tuning(tmp_path, monkeypatch, short_windows):
    """While the loader tunes, each window is another setting, some narrower than the one
    before: a rise in the wait there is the search, not drift (a run on catalog warned at
    the 32-worker window after 64). The guard starts with the choice."""
    import feedrate.trainer

    made, guard = [], feedrate.trainer.DriftGuard
    monkeypatch.setattr(
        "feedrate.trainer.DriftGuard", lambda *a, **k: made.append(guard(*a, **k)) or made[-1]
    )
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    metrics = _run(tmp_path, _counting("map", "loader=autotune", "trainer.epochs=3", *QUICK))
    chose = metrics["autotune"]["chosen"] is not None  # (a busy machine may end the run first)
    assert len(made) == (1 if chose else 0)  # the choice's meter's, none for the tuning's


@pytest.mark.slow
def test_two_ranks_switch_at_the_same_step_and_train_every_sample_once(tmp_path, torchrun_here):
    """Under torchrun rank 0 decides and every rank switches at the same step (a rank that
    did not would hang in the next all-reduce); together they train each sample once."""
    epochs = 6
    overrides = _counting("map", "loader=autotune", f"trainer.epochs={epochs}", latency_ms=5)
    proc = torchrun_here(
        2,
        *overrides,
        *QUICK,
        "trainer.autotune.budget_s=12",  # 1 s windows
        "trainer.autotune.max_workers=16",  # the machine's: 8 a rank
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"FEEDRATE_RECORD_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    per_rank = [_epochs(recorded(tmp_path, r), N // 2) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == epochs
    for e in range(epochs):
        assert sorted(per_rank[0][e] + per_rank[1][e]) == list(range(N))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert len(set(_tried(metrics))) >= 2


@pytest.mark.parametrize(
    "fault, reason",
    [
        (["+dataset.die_with=2"], "exited unexpectedly"),
        (["+dataset.hang_with=2", "trainer.autotune.stall_s=2"], "timed out after 2"),
    ],
    ids=["workers-die", "workers-stuck"],
)
@pytest.mark.quiet  # waits on failing workers, little CPU: runs beside an alone test
def test_a_setting_that_fails_is_dropped_and_the_run_goes_on_from_where_it_was(
    tmp_path, monkeypatch, short_windows, caplog, fault, reason
):
    """Every loader of 2 workers or more dies, or never returns a sample: the first such
    setting is recorded as failed, the start goes on where the run was, no sample is lost
    or repeated, and the choice (the start) writes no preset."""
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    monkeypatch.setenv("FEEDRATE_CONFIG_DIR", str(conf))
    overrides = [
        *_counting("map", "loader=autotune", "trainer.epochs=2", *QUICK),
        "trainer.autotune.write_preset=true",
        "trainer.autotune.preset_name=at_fault",
        "trainer.autotune.engines=[process]",  # the fault is a worker process's
        *fault,
    ]
    with caplog.at_level(logging.WARNING, logger="feedrate"):
        metrics = feedrate.run(feedrate.compose(overrides, config_dir=conf), tmp_path / "run")
    tried = metrics["autotune"]["tried"]
    failed = [f for f in tried if f["failed"]]
    assert failed and reason in failed[0]["failed"] and failed[0]["setting"]["num_workers"] >= 2
    assert failed[0]["samples_per_sec"] is None
    assert "failed: RuntimeError" in caplog.text
    assert metrics["autotune"]["chosen"]["num_workers"] == 0
    assert metrics["autotune"]["preset"] is None and not (conf / "loader/at_fault.yaml").exists()
    assert _each_once(tmp_path, 2)


def _interrupt_at_the_first_switch(monkeypatch) -> None:
    """Ctrl-C to this process once the tuning loader's second setting starts training (map
    data: mid-epoch; a stream: at its epoch's end), however fast or slow this machine is."""
    original, settings = TuningLoader._loader_for, []

    def loader_for(self, setting):
        loader = original(self, setting)
        if setting not in settings:
            settings.append(setting)
            if len(settings) == 2:
                os.kill(os.getpid(), signal.SIGINT)  # the run stops after this step
        return loader

    monkeypatch.setattr(TuningLoader, "_loader_for", loader_for)


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_a_run_stopped_while_tuning_resumes_into_the_tuning(
    tmp_path, monkeypatch, short_windows, caplog, kind
):
    """Ctrl-C mid-epoch while tuning saves the tuning with the checkpoint; the resumed run
    goes on tuning from there, and together the two runs train each sample once an epoch
    (a stream goes on from its workers' state, read by the same setting)."""
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    run = tmp_path / "run"
    overrides = [*_counting(kind, "loader=autotune", "trainer.epochs=3", latency_ms=4), *QUICK]
    cfg = feedrate.compose(overrides, config_dir=CONF)
    _interrupt_at_the_first_switch(monkeypatch)  # (a stream: in its second epoch)
    with pytest.raises(feedrate.errors.Interrupted, match="interrupted"):
        feedrate.run(cfg, output_dir=run)
    saved = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["autotune"]
    assert saved["choice"] is None and saved["figures"] and 0 < saved["batches"] < N // BATCH
    cfg = feedrate.compose([*overrides, "trainer.resume=true"], config_dir=CONF)
    with caplog.at_level(logging.INFO, logger="feedrate"):
        metrics = feedrate.run(cfg, output_dir=run)
    assert "loader=autotune goes on from the checkpoint: tuning" in caplog.text
    assert "trained twice" not in caplog.text and "starts again" not in caplog.text
    tried = metrics["autotune"]["tried"]
    assert tried[: len(saved["figures"])] == saved["figures"] and len(tried) > len(saved["figures"])
    assert _each_once(tmp_path, 3)


def test_a_run_resumed_after_tuning_goes_straight_to_the_choice(
    tmp_path, monkeypatch, short_windows
):
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    tune = [*QUICK, "trainer.autotune.budget_s=5"]
    first = _run(tmp_path, [*_counting("map", "loader=autotune", "trainer.epochs=4"), *tune])
    done = first["autotune"]
    assert done["chosen"] is not None, "the tuning ended before the run did"
    # the run's own figures are the choice's, measured anew after the tuning
    assert first["samples_per_sec"] > 0 and 0 <= first["data_wait_frac"] <= 1
    assert 0 < first["first_batch_s"] < 30, "the run's first batch, not the choice's"
    second = [*_counting("map", "loader=autotune", "trainer.epochs=5"), *tune]
    metrics = _run(tmp_path, [*second, "trainer.resume=true"])
    assert metrics["autotune"]["chosen"] == done["chosen"]
    assert metrics["autotune"]["tried"] == done["tried"]
    assert metrics["autotune"]["seconds"] == done["seconds"]  # no clock after it
    assert metrics["run"]["loader"]["num_workers"] == done["chosen"]["num_workers"]
    assert _each_once(tmp_path, 5)


@pytest.mark.alone
def test_the_preset_it_writes_is_checked_not_searched_by_the_next_run(
    tmp_path, monkeypatch, short_windows, caplog
):
    conf = _own_conf(tmp_path, monkeypatch)
    overrides = [
        *_counting("map", "loader=autotune", "trainer.epochs=4"),
        *QUICK,
        "trainer.autotune.budget_s=5",
        "trainer.autotune.write_preset=true",
        "trainer.autotune.preset_name=at_test",
    ]
    first = feedrate.run(feedrate.compose(overrides, config_dir=conf), output_dir=tmp_path / "a")
    path = conf / "loader" / "at_test.yaml"
    report = first["autotune"]
    # 2 ms a sample: a worker or more reads many times what the main process alone does
    assert report["chosen"]["num_workers"] > 0 and report["preset"] == str(path)
    preset = yaml.safe_load(path.read_text())
    assert preset["num_workers"] == report["chosen"]["num_workers"]
    figures = [f for f in report["tried"] if f["setting"] == report["chosen"] and f["failed"] == ""]
    measured = preset["measured_on"]
    assert measured["samples_per_sec"] == round(max(f["samples_per_sec"] for f in figures), 1)
    assert measured["workload"]["batch_size"] == BATCH and measured["machine"]["usable_cores"]
    # the next run starts from it and checks it: a figure far below what it records now
    # (1 sample/s) holds, and the run measures nothing else
    preset["measured_on"]["samples_per_sec"] = 1.0
    header = path.read_text().split("defaults:")[0]
    path.write_text(header + yaml.safe_dump(preset))
    again = feedrate.run(feedrate.compose(overrides, config_dir=conf), output_dir=tmp_path / "b")
    assert [f["setting"] for f in again["autotune"]["tried"]] == [report["chosen"]]
    assert again["autotune"]["rule"] == "preset-holds"
    assert again["autotune"]["preset"] is None  # the start, checked: nothing new to write
    # one that no longer holds (its figure far above what it reads now) is searched again,
    # from it (with room above it: its data still waits)
    preset["measured_on"]["samples_per_sec"] = 1e9
    path.write_text(header + yaml.safe_dump(preset))
    wider = [*overrides, "trainer.autotune.max_workers=64"]
    redo = feedrate.run(feedrate.compose(wider, config_dir=conf), output_dir=tmp_path / "c")
    assert redo["autotune"]["rule"] != "preset-holds"
    assert redo["autotune"]["tried"][0]["setting"] == report["chosen"]
    # loader=auto picks what autotune wrote (said as the run starts: one epoch will do)
    auto = [o.replace("loader=autotune", "loader=auto") for o in overrides[:-5]]
    auto = [o.replace("trainer.epochs=4", "trainer.epochs=1") for o in auto]
    with caplog.at_level(logging.INFO, logger="feedrate"):
        feedrate.run(feedrate.compose(auto, config_dir=conf), output_dir=tmp_path / "d")
    assert "loader=auto picked loader=at_test" in caplog.text


def test_auto_with_no_preset_measured_here_tunes_in_the_run_and_the_next_run_picks_it(
    tmp_path, monkeypatch, short_windows, caplog
):
    """Zero configuration: the first loader=auto run on a machine and workload has no preset
    measured there, so it tunes as it trains (one line says so) and writes its choice; the
    next loader=auto run picks that preset and tunes nothing."""
    conf = _own_conf(tmp_path, monkeypatch)
    first = [
        # reads that wait 6 ms a sample: 8 workers read twice what the start's 4 do, which a
        # window of 0.15 s shows on a busy machine (at 2 ms, one run's start held there)
        *_counting("map", "loader=auto", "trainer.epochs=3", latency_ms=6.0),
        "trainer.autotune.max_workers=8",
        "trainer.autotune.budget_s=600",
        "trainer.autotune.preset_name=first_auto",
        # the climb's settings fit in 3 epochs: the thread split has its own test (test_model)
        "trainer.autotune.split_threads=false",
    ]
    with caplog.at_level(logging.INFO, logger="feedrate"):
        metrics = feedrate.run(feedrate.compose(first, config_dir=conf), tmp_path / "a")
    assert "loader=autotune" in caplog.text, "the one line says it tunes instead"
    report = metrics["autotune"]
    assert report["chosen"]["num_workers"] > 0 and report["preset"]
    assert (conf / "loader" / "first_auto.yaml").exists() and _each_once(tmp_path, 3)
    caplog.clear()
    start = ("loader.num_workers", "loader.prefetch_factor", "loader.persistent_workers")
    then = [o.replace("trainer.epochs=3", "trainer.epochs=1") for o in first]
    then = [o for o in then if not o.startswith(start)]  # the preset's own, not the start's
    with caplog.at_level(logging.INFO, logger="feedrate"):
        again = feedrate.run(feedrate.compose(then, config_dir=conf), tmp_path / "b")
    assert "loader=first_auto" in caplog.text, "the one line names the preset it picked"
    assert (
        "autotune" not in again
        and again["run"]["loader"]["num_workers"] == (report["chosen"]["num_workers"])
    )


def test_auto_on_a_stream_without_epochs_runs_its_pick_untuned(compose):
    """trainer.stream=true cannot tune as it trains: loader=auto runs the preset it picks."""
    from feedrate import provenance

    cfg = compose("loader=auto", "trainer.stream=true")
    assert not provenance.can_tune(cfg)
    assert provenance.can_tune(compose("loader=auto"))
    assert not provenance.can_tune(compose("loader=auto", "trainer.autotune.budget_s=0"))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.stream=true"], "trainer.stream=true repeats the data without epochs"),
        (["trainer.autotune.budget_s=-1"], "trainer.autotune.budget_s=-1.0 must be at least 0"),
        (["trainer.autotune.stall_s=0"], "trainer.autotune.stall_s=0.0 must be positive, or null"),
        (
            ["trainer.autotune.write_preset=true", "trainer.autotune.preset_name=../x"],
            "trainer.autotune.preset_name='../x' is not a valid preset name",
        ),
        (["trainer.autotune.engines=[]"], "trainer.autotune.engines=[] names no engine"),
        (
            ["trainer.autotune.engines=[thread]"],  # the recipe starts on 4 worker processes
            "loader.engine=process is where the run starts, and trainer.autotune.engines=[thread]"
            " leaves it out: add it, or start on loader.engine=thread",
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


def test_a_key_of_the_old_tuner_is_named_as_unknown(compose):
    with pytest.raises(Exception, match="window_s"):
        compose("loader=autotune", "trainer.autotune.window_s=2")


@pytest.mark.slow
@pytest.mark.alone
def test_on_drift_retune_tunes_again_once_the_data_wait_rose(tmp_path, short_windows, caplog):
    """Storage 20 ms a sample slower after 6 s: the drift guard warns, and the run tunes
    again at the next epoch's start, from the setting it chose before. (The guard watches
    the choice, not the tuning, which ends in about 2 s here: the slowdown comes after.)"""
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
        "trainer.max_seconds=16",
        "trainer.window_steps=5",
        "trainer.drift_windows=3",
        "trainer.autotune.on_drift=retune",
        *QUICK,
        "trainer.autotune.budget_s=5",
    ]
    cfg = feedrate.compose(overrides, config_dir=CONF)
    with caplog.at_level(logging.WARNING, logger="feedrate"):
        metrics = feedrate.run(cfg, output_dir=tmp_path)
    assert metrics["drift_warnings"] >= 1 and "tuning again from" in caplog.text
    earlier = metrics["autotune"]["earlier"]
    assert earlier and all(phase["chosen"] is not None for phase in earlier)
    # each tuning starts from the setting the one before chose (the last may have measured
    # nothing yet when the run ended)
    phases = [*earlier, metrics["autotune"]]
    pairs = [(a, b) for a, b in zip(phases, phases[1:], strict=False) if b["tried"]]
    assert pairs, "a tuning again measured something"
    assert all(b["tried"][0]["setting"] == a["chosen"]["setting"] for a, b in pairs)


@pytest.mark.parametrize(
    ("overrides", "budget"),
    [
        (["trainer.max_seconds=180"], 36.0),  # a fifth of a 3-minute run
        (["trainer.max_seconds=3600"], 60.0),  # a long one: the default
        (["trainer.max_seconds=null"], 60.0),
        (["trainer.max_seconds=180", "trainer.autotune.budget_s=40"], 40.0),  # as asked
    ],
)
def test_the_tuning_budget_is_a_fifth_of_a_short_run_and_60_s_of_a_long_one(
    compose, overrides, budget
):
    from feedrate.autotune import budget_seconds

    assert budget_seconds(compose("loader=autotune", *overrides, tiny=False).trainer) == budget
