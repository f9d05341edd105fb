"""The real command, run as a user would, and the measurements it reports."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

import feedrate
from feedrate.loader import CountingCollate, build_loader

from . import fakes
from .conftest import PHOTOS, ROOT, run_cli, shrink


def _metrics(run_dir):
    return json.loads((run_dir / "metrics.json").read_text())


def test_train_py_runs_end_to_end_and_writes_sane_metrics(tmp_path, photos_root):
    run_dir = tmp_path / "run"
    overrides = shrink([*PHOTOS, f"dataset.root={photos_root}"])
    proc = run_cli(*overrides, "loader.num_workers=2", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = _metrics(run_dir)
    assert m["samples_per_sec"] > 0
    # the figure is the samples over the measured time, the clock's own reading
    assert m["measured_samples"] / m["samples_per_sec"] == pytest.approx(m["measured_seconds"])
    assert m["first_batch_s"] > 0
    assert m["measured_steps"] == 6 and m["steps"] == 8
    assert m["measured_samples"] == 6 * 16
    assert m["samples_per_sec"] == m["consumed_samples_per_sec"]  # epochs: what training ate
    assert m["produced_samples_per_sec"] > 0
    # steps are timed end to end: a typical step is no longer than the whole window
    assert m["step_time_p50_ms"] * m["measured_steps"] <= 2 * 1000 * m["measured_seconds"]
    assert m["peak_pss_mb"] > m["peak_main_pss_mb"] > 0
    assert m["peak_processes"] == 3, "main process plus 2 workers"
    assert 0 < m["peak_uss_mb"] < m["peak_pss_mb"], "USS leaves out shared pages, PSS splits them"
    # the others' share is a part of the cores' busy share, read from another source
    assert 0 <= m["other_cpu_frac"] <= m["cpu_util"]
    # the run's own batches in flight (2 workers x prefetch 2 x 16 x 12 KB), not all of /dev/shm
    assert m["peak_shm_mb"] < 8, "a reading of the whole /dev/shm, not what this run added"
    assert m["bound"] in ("input-bound", "compute-bound") and m["evidence"]
    assert m["run"]["loader"]["num_workers"] == 2
    assert m["run"]["fingerprint"]["logical_cores"] >= 1
    # The summary a user reads, and the checkpoint, loadable without running pickled code.
    assert "verdict" in proc.stdout and "samples/s" in proc.stdout
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["step"] == 8 and "model" in state
    # What it ran on, beside the figures
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["packages"]["torch"] == importlib.metadata.version("torch")
    assert env["python"].startswith("3.") and env["fingerprint"]["logical_cores"] >= 1
    assert env["cuda_available"] == torch.cuda.is_available()


def test_the_progress_bar_shows_live_samples_per_second_and_data_wait(tmp_path):
    proc = run_cli(
        # 10 ms a sample: steps slow enough for the bar to redraw between them
        *shrink(["trainer.max_steps=12", "trainer.window_steps=3", "dataset.io_latency_ms=10"]),
        "trainer.progress=true",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bar = [line for line in proc.stderr.replace("\r", "\n").splitlines() if "train:" in line]
    assert bar, proc.stderr[-2000:]
    assert "12/12" in bar[-1]
    assert any("warming up: unmeasured" in line for line in bar), "says why no figures yet"
    assert re.search(r"samples/s=[\d,]+, wait=\d+%", bar[-1]), bar[-1]


def test_cfg_job_and_help_work_like_any_hydra_app():
    proc = run_cli("--cfg", "job", "loader=recipe")
    assert proc.returncode == 0, proc.stderr
    assert "num_workers: 4" in proc.stdout
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    options = {
        line.split(":")[0]: line.split(": ")[1].split(", ")
        for line in proc.stdout.split("== Config ==")[0].splitlines()
        if re.match(r"^[a-z]+: ", line)
    }
    assert options["dataset"] == [
        "custom",
        "image_folder",
        "memmap",
        "photos",
        "synthetic",
        "webdataset",
    ]
    assert {"default", "recipe", "autotune"} <= set(options["loader"])
    assert set(options) == {"dataset", "hardware", "loader", "model", "sweep", "trainer"}
    assert "_schema" not in proc.stdout.split("== Config ==")[0]
    # tab completion, as the shell asks for it after eval "$(python train.py -sc install=bash)"
    line = "python train.py loader="
    proc = run_cli("-sc", "query=bash", env={"COMP_LINE": line, "COMP_POINT": str(len(line))})
    assert proc.returncode == 0, proc.stderr
    assert {"loader=default", "loader=recipe", "loader=ssd_8core"} <= set(proc.stdout.split())


def test_train_returns_the_configured_objective(compose, tmp_path, monkeypatch):
    from feedrate.launch import main

    monkeypatch.chdir(tmp_path)  # outside Hydra, outputs go under ./outputs/api/
    value = main(compose("objective=data_wait_frac"))
    (metrics_file,) = tmp_path.glob("outputs/api/*/*/metrics.json")
    assert value == json.loads(metrics_file.read_text())["data_wait_frac"]


def _run(compose, tmp_path, *overrides):
    cfg = compose(
        "dataset.io_latency_ms=15",
        "dataset.n_samples=2000",
        "model.width=4",
        "trainer.max_steps=16",
        "trainer.warmup_steps=4",
        "trainer.window_steps=4",
        *overrides,
    )
    return feedrate.run(cfg, output_dir=tmp_path)


@pytest.mark.alone
def test_sleep_bound_dataset_is_input_bound_and_workers_cut_the_wait(compose, tmp_path):
    # what this process runs already: a fork server and a resource tracker earlier tests left
    helpers = len(psutil.Process().children(recursive=True))
    alone = _run(compose, tmp_path / "w0", "loader.num_workers=0")
    assert alone["bound"] == "input-bound"
    assert alone["data_wait_frac"] > 0.5
    assert "waited for data" in alone["evidence"]
    # no worker: the run started no process; its peak is the tree's (the same readings)
    assert alone["peak_processes"] == 1 + helpers
    assert alone["peak_pss_mb"] >= alone["peak_main_pss_mb"] > 0
    # 16 workers, 2 batches each: 8 x 4 read 0.89-0.90 of its 12 measured steps waiting in
    # this short run (each worker hands over 4 batches at once, so deliveries come in bursts),
    # a margin over the alone run's 0.99 that a busy machine closed (0.79-0.86 there)
    helped = _run(compose, tmp_path / "w16", "loader.num_workers=16", "loader.prefetch_factor=2")
    assert helped["data_wait_frac"] < alone["data_wait_frac"]
    assert helped["samples_per_sec"] > alone["samples_per_sec"]


def test_persistent_workers_restart_epochs_faster(compose, tmp_path):
    common = [
        "loader.num_workers=2",
        "dataset.n_samples=64",
        "trainer.max_steps=12",
        "trainer.epochs=3",
    ]
    fresh = feedrate.run(compose(*common), output_dir=tmp_path / "a")
    kept = feedrate.run(
        compose(*common, "loader.persistent_workers=true"), output_dir=tmp_path / "b"
    )
    assert fresh["epochs_started"] == kept["epochs_started"] == 3
    assert kept["epoch_restart_s"] < fresh["epoch_restart_s"]


def test_no_worker_outlives_the_run(compose, tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    feedrate.run(
        compose("loader.num_workers=3", "loader.persistent_workers=true"), output_dir=tmp_path
    )
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after - before == set()


def test_notebook_api_runs_with_spawn_workers(tmp_path):
    script = tmp_path / "notebook.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, feedrate
            if __name__ == "__main__":
                cfg = feedrate.compose(
                    {shrink(["loader=notebook"])!r},
                    config_dir={str(ROOT / "conf")!r},
                )
                m = feedrate.run(cfg, output_dir={str(tmp_path / "out")!r})
                print(json.dumps({{"sps": m["samples_per_sec"], "ctx": m["run"]["loader"]}}))
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sps"] > 0
    assert result["ctx"]["multiprocessing_context"] == "spawn"
    assert (tmp_path / "out" / "metrics.json").exists()


def test_multirun_over_presets(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "multirun"
    args = ["loader=default,recipe,ssd_8core", *shrink([]), f"hydra.sweep.dir={sweep}"]
    proc = fakes.multirun(ROOT, *args, monkeypatch=monkeypatch, capsys=capsys)
    assert proc.returncode == 0, proc.out[-3000:]
    workers = [_metrics(sweep / str(i))["run"]["loader"]["num_workers"] for i in range(3)]
    assert workers == [0, 4, 8]


class _BackloggedLoader:
    """Like a DataLoader whose 2 workers x prefetch 8 queued 16 batches during start-up:
    those come instantly, then each batch takes 50 ms (4 samples: 80 samples/s sustained)."""

    def __init__(self):
        self.collate_fn = CountingCollate(2)
        self.collate_fn.counts[0, 0] = 16 * 4  # the backlog, produced before training started

    def __len__(self):
        return 10**6

    def __iter__(self):
        for i in range(10**6):
            if i >= 16:
                time.sleep(0.05)
                self.collate_fn.counts[i % 2, 0] += 4
            yield torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.zeros(4, dtype=torch.long)


def test_prefetched_backlog_is_not_reported_as_throughput(compose):
    from feedrate.config import trainer_spec
    from feedrate.hardware import Hardware
    from feedrate.metrics import summarise
    from feedrate.model import TinyCNN
    from feedrate.monitor import ResourceMonitor
    from feedrate.trainer import train
    from feedrate.workload import build_optimizer, make_input_transform

    cfg = compose("trainer.max_steps=40", "trainer.warmup_steps=2", "trainer.window_steps=4")
    hw = Hardware("cpu", torch.device("cpu"), None, False, False, False, False, 1)
    model = TinyCNN(2, width=4)
    with ResourceMonitor() as monitor:
        result = train(
            model=model,
            loader=_BackloggedLoader(),
            optimizer=build_optimizer(cfg.trainer, model),
            hw=hw,
            cfg=trainer_spec(cfg.trainer),
            monitor=monitor,
            normalise=make_input_transform(hw, 3),
        )
    streamed = summarise(result, monitor, device="CPU", stream=True)
    assert streamed["consumed_samples_per_sec"] > 1.5 * streamed["produced_samples_per_sec"]
    assert streamed["samples_per_sec"] < 90, "reported more than the 80 samples/s it sustains"


def test_a_memory_reading_asked_for_now_is_taken_by_the_monitors_thread():
    """The workers' first reading (their page maps: 0.6 s at 64 workers) is the monitor
    thread's to take at once, not the loop's: the loop goes on while it is taken."""
    import threading

    from feedrate.monitor import ResourceMonitor

    with ResourceMonitor(interval_s=60) as monitor:  # no reading due for a minute
        taken, real = [], monitor.sample
        done = threading.Event()

        def reading() -> None:
            real()
            taken.append(threading.current_thread().name)
            done.set()

        monitor.sample = reading
        monitor.sample_soon()
        assert done.wait(20), "the ask woke the thread"
    assert taken == ["feedrate-monitor"]


@pytest.mark.parametrize("measure", ["loader", "compute"])
def test_ceiling_modes_measure_one_side_only(compose, tmp_path, measure):
    m = feedrate.run(
        compose(f"trainer.measure={measure}", "loader.num_workers=2"), output_dir=tmp_path
    )
    assert m["samples_per_sec"] > 0
    if measure == "loader":
        assert m["final_loss"] is None  # no model ran
    else:  # one batch, resident on the device: the loader is out of the measured window
        assert m["produced_samples_per_sec"] is None and m["final_loss"] is not None
        assert m["measured_samples"] == 16 * m["measured_steps"]


def test_held_out_split_reports_validation_metrics(compose, tmp_path):
    m = feedrate.run(compose("trainer.val_fraction=0.25"), output_dir=tmp_path)
    assert m["run"]["dataset_len"] == 256 and m["val_loss"] > 0
    # over the 64 held-out samples, not an average of per-batch accuracies
    assert m["val_accuracy"] * 64 == pytest.approx(round(m["val_accuracy"] * 64))


@pytest.mark.slow
def test_basic_multirun_over_a_training_hyperparameter(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "lr"
    swept = fakes.sweep(
        ROOT,
        "trainer.lr=1e-3,1e-2",
        *shrink([]),
        f"hydra.sweep.dir={sweep}",
        runner=None,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert swept.returncode == 0, swept.out[-3000:]
    ran = [_metrics(sweep / str(i))["run"]["overrides"] for i in range(2)]
    lrs = [float(o.split("=")[1]) for r in ran for o in r if o.startswith("trainer.lr=")]
    assert lrs == [1e-3, 1e-2]


def test_a_loader_with_no_batch_is_refused(compose, tmp_path):
    from feedrate.errors import ConfigError

    cfg = compose("dataset.n_samples=10", "loader.drop_last=true")
    with pytest.raises(ConfigError, match="the loader yields no batch: 10 training samples"):
        feedrate.run(cfg, output_dir=tmp_path)


@pytest.mark.slow
@pytest.mark.alone
def test_a_cpu_hog_during_the_measurement_is_flagged(tmp_path, train_here):
    # Busy loops on every core of this machine while a run measures: its figures are noise.
    # Started by a process that exits at once, so they are not this one's children (a run
    # counts its children's CPU as its own); in a process group of their own, killed as one,
    # and each ends by itself after a minute whatever happens here.
    hog = "import time\nt = time.monotonic() + 60\nwhile time.monotonic() < t: pass"
    start = "import os, subprocess as s, sys; print(os.getpid(), flush=True); print(*[s.Popen("
    start += "[sys.executable, '-c', sys.argv[1]], stdout=s.DEVNULL, stderr=s.DEVNULL).pid"
    start += " for _ in range(int(sys.argv[2]))])"
    n = max(2, len(os.sched_getaffinity(0)))
    group = None
    try:
        started = subprocess.run(
            [sys.executable, "-c", start, hog, str(n)],
            capture_output=True,
            text=True,
            timeout=30,
            start_new_session=True,  # its pid is the hogs' process group
        )
        group, *pids = (int(pid) for pid in started.stdout.split())
        hogs = [psutil.Process(pid) for pid in pids]
        assert len(hogs) == n and all(h.ppid() != os.getpid() for h in hogs)
        time.sleep(0.5)
        proc = train_here(
            *shrink(
                ["trainer.max_steps=60", "trainer.window_steps=10", f"hydra.run.dir={tmp_path}"]
            )
        )
    finally:
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["other_cpu_frac"] > 0.25
    assert any("other processes kept" in r for r in metrics["noise"])
    assert "NOISY            other processes kept" in proc.stdout + proc.stderr


def test_a_checkpoint_pause_is_left_out_of_the_measurement(tmp_path, compose):
    # Saves at steps 10 and 20 pause training while workers refill their queues; each closes
    # the window, and measuring resumes after 2 more warm-up steps: 28 - 2 x 2 = 24 measured.
    cfg = compose(
        "trainer.max_steps=30",
        "trainer.checkpoint_every=10",
        "loader.num_workers=2",
    )
    metrics = feedrate.run(cfg, output_dir=tmp_path)
    assert metrics["measured_steps"] == 24 and metrics["steps"] == 30
    assert metrics["measured_samples"] == 24 * 16
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["step"] == 30


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_profile_drives_the_gpu_with_what_feeds_it(tmp_path, photos_root):
    proc = run_cli(
        *shrink([*PHOTOS, f"dataset.root={photos_root}"]),
        "hardware=gpu",
        "loader=ssd_8core",
        "model=resnet18",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = _metrics(tmp_path)
    run = m["run"]
    assert run["device"] == "cuda" and run["amp_dtype"] == "torch.bfloat16"
    assert run["channels_last"] and run["cudnn_benchmark"] and run["non_blocking"]
    assert run["loader"]["pin_memory"] is True, "the preset leaves pinning to the gpu profile"
    assert run["fingerprint"]["gpu_count"] >= 1 and run["fingerprint"]["gpu_memory_gb"] > 0
    assert m["samples_per_sec"] > 0
    assert m["final_loss"] is not None and math.isfinite(m["final_loss"]), "bf16 trained"


# ---------------------------------------------------------------------------------------------
# The steady-state warm-up


class _Clock:
    """A fake clock: each step advances it by the step's own duration."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _warm_up(warm, step_seconds) -> int:
    """Steps until ``warm`` says the warm-up is over, each taking ``step_seconds(i)``."""
    for i in range(1, 1000):
        warm.clock.now += step_seconds(i)
        if warm.update():
            return i
    raise AssertionError("the warm-up never ended")


def test_warm_up_outlasts_the_start_up_backlog_then_waits_for_a_steady_rate():
    from feedrate.meter import WarmUp

    # steady from the start: the backlog (8), a window's start, then two windows of 4 agree
    warm = WarmUp(3, backlog=8, window_steps=4, clock=_Clock())
    assert _warm_up(warm, lambda i: 0.1) == 16 and warm.settled is True
    # the rate still climbing past the backlog (steps from 0.5 s down to 0.1 s by step 27):
    # the window starts once it has stopped climbing
    warm = WarmUp(3, backlog=8, window_steps=4, max_windows=8, clock=_Clock())
    step_s = [max(0.1, 0.5 - 0.015 * i) for i in range(1000)]
    steps = _warm_up(warm, lambda i: step_s[i])
    assert steps >= 27 + 4 and warm.settled is True
    assert warm.as_dict()["seconds"] == pytest.approx(sum(step_s[1 : steps + 1]))


def test_warm_up_that_never_settles_ends_after_its_windows_and_says_so():
    from feedrate.meter import WarmUp

    warm = WarmUp(2, backlog=0, window_steps=2, max_windows=4, clock=_Clock())
    steps = _warm_up(warm, lambda i: 0.1 if ((i - 1) // 2) % 2 else 0.3)  # windows 3x apart
    assert warm.settled is False and warm.windows == 4 and steps == 2 + 4 * 2
    fixed = WarmUp(5, backlog=64, window_steps=2, steady=False, clock=_Clock())
    assert _warm_up(fixed, lambda i: 0.1) == 5 and fixed.settled is None, "exactly warmup_steps"


class ThreadCount(torch.utils.data.Dataset):
    """Each sample: the intra-op threads of the process that loaded it."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.tensor(torch.get_num_threads())


@pytest.mark.parametrize(
    ("threads", "context", "expected"), [(None, "fork", 1), (2, "forkserver", 2)]
)
def test_workers_run_the_threads_the_loader_asks_for(threads, context, expected):
    kwargs = {
        **dict(batch_size=4, shuffle=False, num_workers=2, pin_memory=False, drop_last=False),
        **dict(timeout=0.0, persistent_workers=False, prefetch_factor=2),
        **dict(multiprocessing_context=context, worker_threads=threads),
    }
    seen = torch.cat(list(build_loader(ThreadCount(), kwargs, seed=0)))
    assert seen.tolist() == [expected] * 8, "PyTorch's default is one thread a worker"


def test_the_main_process_runs_the_threads_the_preset_asks_for(compose, tmp_path):
    before = torch.get_num_threads()
    asked = 1 if before != 1 else 2  # not what it runs anyway
    try:
        m = feedrate.run(
            compose(
                "loader.num_workers=1",
                "loader.multiprocessing_context=forkserver",  # fork workers keep one thread
                "loader.worker_threads=2",
                f"loader.main_threads={asked}",
            ),
            output_dir=tmp_path,
        )
    finally:
        torch.set_num_threads(before)
    assert m["run"]["torch_threads"] == asked
    assert m["run"]["loader"]["worker_threads"] == 2


def test_a_run_measures_after_the_backlog_and_records_its_warm_up(compose, tmp_path):
    m = feedrate.run(
        compose(
            "trainer.steady_state=true",
            "trainer.max_steps=60",
            "loader.num_workers=2",
            "loader.prefetch_factor=4",
        ),
        output_dir=tmp_path,
    )
    w = m["warmup"]
    # 2 workers x prefetch 4: a backlog of 8 batches, over sooner only when training had to
    # wait for a batch after each worker delivered one (the queue ran dry: test_meter.py)
    assert 2 < w["backlog_batches"] <= 8, w
    assert w["steps"] >= w["backlog_batches"] + 2 * 2 and m["measured_steps"] == 60 - w["steps"]
    assert w["seconds"] > 0 and isinstance(w["settled"], bool)


@pytest.mark.slow
@pytest.mark.alone
def test_a_run_whose_storage_slows_down_half_way_warns_once(tmp_path, compose, caplog):
    """3 s after the dataset is built each sample waits 10 ms more: 4 workers then deliver a
    batch of 32 in 80 ms, against a few ms of compute. The guard says so once."""
    cfg = compose(
        "dataset.slowdown_after_s=3",
        "dataset.slowdown_ms=10",
        "model=tiny_cnn",
        "loader=recipe",
        "loader.batch_size=32",
        "trainer.max_steps=100000",
        "trainer.max_seconds=9",
        "trainer.window_steps=10",
        "trainer.drift_windows=3",
    )
    with caplog.at_level("WARNING", logger="feedrate"):
        metrics = feedrate.run(cfg, output_dir=tmp_path)
    assert caplog.text.count("the input pipeline fell behind") == 1, caplog.text[-3000:]
    assert metrics["drift_warnings"] == 1
