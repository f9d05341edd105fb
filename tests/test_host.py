"""The warm trial host: many trials in one process, each seeing what a fresh run would.

Each item of the reset list (docs/design.md, "The warm trial host") has a test here: most run
the host's side in this process (no start-up to pay), a few start a real host process for what
only a process can show (a hang, a crash, /dev/shm left by the dead).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.utils.data._utils.signal_handling as torch_signals
import yaml
from hydra.core.hydra_config import HydraConfig

from feedrate.sweep.host import DONE, REBUILD, Host, TrialHost
from feedrate.sweep.trial import Fresh, remove_dead_shm, run_trial

from .conftest import CONF, ROOT, shrink
from .counting import Indexed

# Enough steps that the weights move: a reset that missed them shows in the loss
TRAIN = ["trainer.max_steps=10", "trainer.save_checkpoint=false", "model=tiny_cnn"]


@pytest.fixture
def host():
    h = TrialHost(str(CONF), "train")
    yield h
    h.close()


def _metrics(job_dir: Path) -> dict:
    return json.loads((job_dir / "metrics.json").read_text())


def test_a_trial_after_others_trains_exactly_as_the_first(host, tmp_path):
    """Weights and BatchNorm buffers from the snapshot, no stale gradients, a new optimizer,
    every RNG put back, the threads of the trial before undone: the same trial run again in
    the same host gives the very same loss."""
    first = shrink([*TRAIN, "loader.num_workers=0"])
    other = shrink([*TRAIN, "loader.num_workers=2", "loader.main_threads=1", "trainer.lr=0.5"])
    for i, overrides in enumerate([first, other, first]):
        assert host.run(overrides, str(tmp_path / str(i)))["status"] == DONE
    a, b, again = (_metrics(tmp_path / str(i)) for i in range(3))
    assert a["final_loss"] != b["final_loss"], "the trial between them trained differently"
    assert again["final_loss"] == a["final_loss"] and again["train_accuracy"] == a["train_accuracy"]
    assert b["run"]["torch_threads"] == 1
    assert again["run"]["torch_threads"] == a["run"]["torch_threads"] > 1, "threads put back"


@pytest.mark.slow
def test_a_warm_trial_trains_as_a_fresh_process_does(host, tmp_path):
    overrides = shrink([*TRAIN, "loader.num_workers=0"])
    host.run(shrink([*TRAIN, "loader.num_workers=2", "trainer.lr=0.5"]), str(tmp_path / "before"))
    assert host.run(overrides, str(tmp_path / "warm"))["status"] == DONE
    fresh = run_trial(Fresh(ROOT / "train.py"), overrides, tmp_path / "fresh", 120)
    assert fresh.ok, fresh.reason
    assert _metrics(tmp_path / "warm")["final_loss"] == fresh.metrics["final_loss"]


def test_each_trial_has_its_own_hydra_job_and_output(host, tmp_path):
    for n in (0, 2):
        host.run(shrink([f"loader.num_workers={n}"]), str(tmp_path / str(n)))
        job = tmp_path / str(n)
        composed = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        assert composed["loader"]["num_workers"] == n, ".hydra/config.yaml is decide.py's input"
        assert f"loader.num_workers={n}" in (job / ".hydra" / "overrides.yaml").read_text()
        assert _metrics(job)["run"]["overrides"][-1] == f"loader.num_workers={n}"
        assert "loader" in (job / "trial.log").read_text(), "the trial's own output"
    assert not HydraConfig.initialized(), "the job's Hydra config is not left behind"


def test_signal_handlers_and_pytorchs_sigchld_are_put_back(host, tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}
    host.run(shrink(["loader.num_workers=2"]), str(tmp_path / "job"))
    after = {s: signal.getsignal(s) for s in before}
    assert after == before
    assert torch_signals._SIGCHLD_handler_set is False, "the next loader installs its own"


def test_a_trial_that_changes_what_the_host_built_asks_for_a_new_host(host, tmp_path):
    assert host.run(shrink([]), str(tmp_path / "a"))["status"] == DONE
    answer = host.run(shrink(["loader.batch_size=8"]), str(tmp_path / "b"))
    assert answer["status"] == REBUILD and "batch_size" in answer["why"]
    answer = host.run(shrink(["dataset.image_size=16"]), str(tmp_path / "c"))
    assert answer["status"] == REBUILD and "dataset" in answer["why"]


def test_a_thread_left_running_is_named(host):
    assert host.leaked() == ""
    stop = threading.Event()
    left = threading.Thread(target=stop.wait, name="left-behind")
    left.start()
    try:
        assert host.leaked() == "threads left running: left-behind"
    finally:
        stop.set()
        left.join()


def test_a_failed_trial_is_named_and_the_next_gets_a_new_host(tmp_path):
    runner = Host(CONF, "train", tmp_path / "host.log")
    try:
        bad = run_trial(runner, shrink(["dataset.n_samples=0"]), tmp_path / "bad", 120)
        assert not bad.ok and bad.reason.startswith("exit status 2:"), bad.reason
        assert runner.proc is None, "the host that failed is gone"
        good = run_trial(runner, shrink([]), tmp_path / "good", 120)
        assert good.ok and runner.started == 2, "the next trial ran in a new host"
    finally:
        runner.close()


class Reports(Indexed):
    """Indexed samples, built in a process that writes to ``out`` what it runs with."""

    def __init__(self, out: str, n: int = 64) -> None:
        super().__init__(n)
        Path(out).write_text(
            json.dumps(
                {
                    "start_method": multiprocessing.get_start_method(),
                    "mark": os.environ.get("FEEDRATE_TEST_MARK"),
                    "own_session": os.getsid(0) == os.getpid(),
                    "preloaded": "torch._dynamo" in sys.modules,
                }
            )
        )


def test_a_host_is_forked_warm_and_runs_as_a_fresh_process_would(tmp_path, monkeypatch):
    """Forked from the fork server with torch._dynamo imported already, and set as a fresh
    ``python train.py`` is: the sweep's environment of the moment it starts, the platform's
    default start method for its DataLoaders (not the server's), a session of its own."""
    # One fork server a process: one an earlier test here started (a DataLoader's forkserver
    # workers) did not preload, and a sweep's process starts none before its hosts
    multiprocessing.forkserver._forkserver._stop()
    runner = Host(CONF, "train", tmp_path / "host.log")
    reports = ["dataset=custom", "dataset._target_=tests.test_host.Reports", "model=tiny_cnn"]
    reports += ["model._target_=tests.counting.Recorder", "loader.num_workers=2"]
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))  # the Recorder's batches
    try:
        for mark in ("first", "second"):
            monkeypatch.setenv("FEEDRATE_TEST_MARK", mark)
            out = tmp_path / f"{mark}.json"
            overrides = shrink([*reports, f"+dataset.out={out}"])
            result = run_trial(runner, overrides, tmp_path / mark, 120)
            assert result.ok, result.reason
            assert json.loads(out.read_text()) == {
                "start_method": multiprocessing.get_start_method(),
                "mark": mark,
                "own_session": True,
                "preloaded": True,
            }
            runner.close()  # the next trial gets a new host
        assert runner.started == 2
    finally:
        runner.close()


def test_ctrl_c_while_a_host_starts_leaves_nothing_to_end(tmp_path, monkeypatch):
    """Ctrl-C while the first host waits for the fork server (seconds of preload): the host
    is not kept, so ending it, and every other, raises nothing and waits for nothing."""

    def interrupted(self):
        raise KeyboardInterrupt

    runner = Host(CONF, "train", tmp_path / "host.log")
    monkeypatch.setattr(multiprocessing.get_context("forkserver").Process, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.start()
    assert runner.proc is None and runner._jobs is None and runner.started == 0
    runner.close()


def _children_of(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


@pytest.mark.quiet  # waits out a hang: runs beside an alone test
def test_a_hanging_trial_kills_the_host_and_its_workers(tmp_path):
    runner = Host(CONF, "train", tmp_path / "host.log")
    hangs = ["dataset=custom", "dataset._target_=tests.test_faults.Hangs", "loader.num_workers=2"]
    seen: list[int] = []

    def watch():  # the host's workers, while they live
        while runner.proc is None:
            time.sleep(0.1)
        while runner.proc is not None:
            seen.extend(_children_of(runner.proc.pid))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        t0 = time.monotonic()
        # the host's start (its preload) counts: room for a busy machine (quiet: it runs
        # beside the alone tests)
        result = run_trial(runner, shrink(hangs), tmp_path / "hang", 20)
        assert time.monotonic() - t0 < 60
        assert not result.ok and "timed out after 20 s; trial host killed" in result.reason
        assert seen, "it had started its workers"
        alive = [
            p for p in set(seen) if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
        ]
        assert alive == []
    finally:
        runner.close()


def test_shared_memory_is_removed_only_once_its_owner_has_ended(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live, gone = Path(f"/dev/shm/torch_{os.getpid()}_test"), Path(f"/dev/shm/torch_{dead.pid}_x")
    live.write_bytes(b"batch")
    gone.write_bytes(b"batch")
    pids = {os.getpid(), dead.pid}
    try:
        remove_dead_shm(pids)
        assert live.exists(), "a live host keeps the segments its batches are in"
        assert not gone.exists()
        assert pids == {os.getpid()}, "the dead are forgotten"
    finally:
        live.unlink(missing_ok=True)
        gone.unlink(missing_ok=True)


def test_the_cuda_and_pinned_caches_are_emptied_between_trials(host, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda name=name: calls.append(name))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("pinned"))
    host.reset()
    assert calls == ["synchronize", "empty_cache", "reset_peak_memory_stats", "pinned"]
