"""Training state survives: a run killed or interrupted goes on from its last checkpoint, and
ends where the uninterrupted run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

import feedrate

from .conftest import CONF, ROOT, shrink

# 60 steps of ~30 ms (16 samples x 4 ms simulated I/O over 2 workers): slow enough to stop
# half-way, with a checkpoint every 5 steps. Samples are the same for the same index, so the
# weights after 60 steps depend only on the order of samples and the steps taken.
RUN = [
    "dataset.io_latency_ms=4",
    "loader.num_workers=2",
    "trainer.max_steps=60",
    "trainer.checkpoint_every=5",
]


def _state(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final state of the run never stopped, for each loader setting (computed once)."""
    states = {}

    def state(extra: tuple[str, ...]) -> dict:
        if extra not in states:
            run_dir = tmp_path_factory.mktemp("uninterrupted")
            feedrate.run(feedrate.compose(shrink([*RUN, *extra]), config_dir=CONF), run_dir)
            states[extra] = _state(run_dir)
        return states[extra]

    return state


def _signal_when(overrides, ready, sig, wait_s: float = 120):
    """Run ``python train.py OVERRIDES`` in a session of its own, and send ``sig`` to its
    process group, as a terminal or the OOM killer would, once ``ready(pid)`` holds. Returns
    the finished process (stdout and stderr together in ``stdout``) and its pid."""
    proc = subprocess.Popen(
        [sys.executable, "train.py", *shrink(overrides)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        if ready(proc.pid):
            os.killpg(proc.pid, sig)
            break
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), proc.pid


def _stop_after_a_checkpoint(run_dir, sig, extra=()) -> tuple[subprocess.CompletedProcess, int]:
    """Stop the run with ``sig`` once a checkpoint from step 20 on exists, inside the second
    epoch (16 batches an epoch): resuming then needs that epoch's shuffle and its position."""
    ckpt = run_dir / "checkpoints" / "last.pt"

    def ready(_pid: int) -> bool:
        return ckpt.exists() and torch.load(ckpt, weights_only=True)["step"] >= 20

    return _signal_when([*RUN, *extra, f"hydra.run.dir={run_dir}"], ready, sig)


def _session_processes(sid: int) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter():
        try:
            # dead but not yet reaped (zombies) hold nothing
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "extra"),
    [
        (signal.SIGKILL, ()),
        (signal.SIGINT, ()),
        # persistent workers keep one iterator for every epoch: the order must not depend on it
        (signal.SIGKILL, ("loader.persistent_workers=true",)),
        (signal.SIGKILL, ("loader.engine=thread",)),
        (signal.SIGINT, ("loader.engine=thread",)),
    ],
    ids=["killed", "ctrl-c", "killed-persistent-workers", "killed-threads", "ctrl-c-threads"],
)
def test_a_stopped_run_resumes_to_the_same_weights(tmp_path, uninterrupted, sig, extra, train_here):
    stopped, sid = _stop_after_a_checkpoint(tmp_path, sig, extra)
    assert stopped.returncode in (-signal.SIGKILL, 130), stopped.stdout[-2000:]
    assert not (tmp_path / "metrics.json").exists()  # the run never finished
    at = _state(tmp_path)["step"]
    assert 20 <= at < 60
    if sig == signal.SIGINT:
        # Ctrl-C: the step in progress finishes, the state is saved, the way on is printed
        assert stopped.returncode == 130, stopped.stdout[-2000:]
        assert f"interrupted (Ctrl-C) at step {at} of 60" in stopped.stdout
        assert "trainer.resume=true" in stopped.stdout and "Traceback" not in stopped.stdout
    time.sleep(0.5)
    assert not _session_processes(sid), "workers outlived the run"

    resumed = train_here(
        *shrink([*RUN, *extra, f"hydra.run.dir={tmp_path}", "trainer.resume=true"])
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {tmp_path / 'checkpoints' / 'last.pt'} at step {at} of 60" in (
        resumed.stderr + resumed.stdout
    )
    final = _state(tmp_path)
    assert final["step"] == 60
    # No step lost or repeated, samples in the same order: the same weights and momentum.
    reference = uninterrupted(extra)
    torch.testing.assert_close(final["model"], reference["model"])
    torch.testing.assert_close(final["optimizer"], reference["optimizer"])


def test_a_run_never_overwrites_another_runs_checkpoint(tmp_path, train_here):
    first = train_here(*shrink([f"hydra.run.dir={tmp_path}"]))
    assert first.returncode == 0, first.stderr[-2000:]
    before = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    again = train_here(*shrink([f"hydra.run.dir={tmp_path}"]))
    assert again.returncode == 2
    assert "already holds a checkpoint: continue that run with trainer.resume=true" in (
        again.stderr + again.stdout
    )
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == before


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["trainer.resume=true"], "trainer.resume=true but there is no checkpoint at"),
        (
            ["trainer.checkpoint_dir=../elsewhere"],
            "outside the run's output dir",
        ),
    ],
)
def test_resume_and_checkpoint_paths_are_checked(tmp_path, overrides, expected, train_here):
    proc = train_here(*shrink([f"hydra.run.dir={tmp_path / 'run'}", *overrides]))
    assert proc.returncode == 2
    assert expected in proc.stderr + proc.stdout
    assert not (tmp_path / "elsewhere").exists()


def test_a_checkpoint_holding_code_is_refused(tmp_path, train_here):
    # torch.load(weights_only=True) refuses pickled objects: a checkpoint is data.
    ckpt = tmp_path / "checkpoints" / "last.pt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"format": 1, "model": psutil.Process}, ckpt)
    proc = train_here(*shrink([f"hydra.run.dir={tmp_path}", "trainer.resume=true"]))
    assert proc.returncode == 2
    assert f"cannot resume from {ckpt}: UnpicklingError" in proc.stderr + proc.stdout


def _spawned_workers(pid: int) -> int:
    count = 0
    for child in psutil.Process(pid).children():
        try:  # short-lived children (git, for environment.json) may be gone already
            count += "spawn_main" in " ".join(child.cmdline())
        except psutil.Error:
            pass
    return count


@pytest.mark.slow
def test_ctrl_c_while_spawn_workers_start_stops_like_any_ctrl_c(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group, workers that are still starting
    included: a spawned worker imports torch for seconds before any code of ours runs in it."""

    def ready(pid: int) -> bool:
        if _spawned_workers(pid) < 2:
            return False
        # Both workers are started, and import torch for a second or more before any code of
        # ours runs in them. (A Ctrl-C while the main process starts spawn workers is dropped:
        # see feedrate.loader._Loader.)
        time.sleep(0.3)
        return True

    stopped, sid = _signal_when(
        ["loader=notebook", "trainer.max_steps=200", f"hydra.run.dir={tmp_path}"],
        ready,
        signal.SIGINT,
        wait_s=60,
    )
    out = stopped.stdout
    assert stopped.returncode == 130, out[-3000:]
    assert "interrupted (Ctrl-C) at step" in out
    assert "KeyboardInterrupt" not in out and "Traceback" not in out, out[-3000:]
    time.sleep(0.5)
    assert not _session_processes(sid), "workers outlived the run"


def test_a_ctrl_c_while_forked_workers_start_is_held_then_stops_the_run(tmp_path, monkeypatch):
    """A Ctrl-C that comes while the main process forks its workers is handed on once they
    have started: the run stops after its first step, saved, as after any first Ctrl-C."""
    start = _MultiProcessingDataLoaderIter.__init__
    sent = []

    def starting(self, loader):
        if not sent:  # the first loader's start, before its first worker is forked
            sent.append(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        start(self, loader)

    monkeypatch.setattr(_MultiProcessingDataLoaderIter, "__init__", starting)
    cfg = feedrate.compose(shrink([*RUN, "loader.multiprocessing_context=fork"]), config_dir=CONF)
    with pytest.raises(feedrate.errors.Interrupted, match=r"interrupted \(Ctrl-C\) at step 1 of"):
        feedrate.run(cfg, output_dir=tmp_path)
    assert sent and _state(tmp_path)["step"] == 1


def test_a_resume_that_does_not_fit_names_the_command_that_continues_the_run(tmp_path, compose):
    """A resume whose overrides differ from the run's (a model of the user's, left out of the
    resume's command line) is told the command that run saved, not to guess it."""
    from feedrate import checkpoint
    from feedrate.errors import ConfigError

    cfg = compose()
    theirs, mine = torch.nn.Linear(4, 2), torch.nn.Linear(3, 2)
    again = "python train.py hydra.run.dir=runs/a model=custom model._target_=pkg.Net"
    again += " trainer.resume=true"
    optimizer = torch.optim.SGD(theirs.parameters(), lr=0.1)
    saved = checkpoint.save(
        tmp_path / "last.pt", theirs, optimizer, checkpoint.Position(3), cfg, 8, again
    )
    state = checkpoint.load(saved)
    with pytest.raises(
        ConfigError, match=f"resume with the overrides the run started with: {again}$"
    ):
        checkpoint.restore(state, saved, mine, torch.optim.SGD(mine.parameters()), 10, 8)
    del state["resume"]  # a checkpoint from before the command was kept: what it trained
    with pytest.raises(ConfigError, match=r"started with \(model._target_=feedrate.model.TinyCNN"):
        checkpoint.restore(state, saved, mine, torch.optim.SGD(mine.parameters()), 10, 8)


def test_a_finished_run_trains_further_only_when_told_and_keeps_its_figures(tmp_path, compose):
    from feedrate.errors import ConfigError

    feedrate.run(compose("trainer.max_steps=6"), tmp_path)
    with pytest.raises(ConfigError, match="is at step 6, and this run stops at step 6: it is com"):
        feedrate.run(compose("trainer.max_steps=6", "trainer.resume=true"), tmp_path)
    further = feedrate.run(compose("trainer.max_steps=10", "trainer.resume=true"), tmp_path)
    assert further["steps"] == 10
    before = json.loads((tmp_path / "metrics_until_step_6.json").read_text())
    assert before["steps"] == 6 and (tmp_path / "environment_until_step_6.json").exists()
