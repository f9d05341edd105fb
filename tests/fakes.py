"""A sweep run in the test's own process, its trials answered by a simulated runner.

The sweep's orchestration (seeds, the guard's skips, ceilings, failures, finals, the preset
and report it writes) does not depend on how a trial is measured, only on what the trial
leaves in its directory. :class:`Simulated` is a trial runner (``feedrate.sweep.trial.Runner``)
that composes each trial's config as ``python train.py`` would and writes the files a run of it
writes (``.hydra/config.yaml``, ``environment.json``, ``metrics.json``, ``trial.log``), with
figures from a model of the loader: a trial takes milliseconds, not a process start-up and a
measuring window. The runners themselves (warm host, fresh process) have their own tests
(test_host.py), and one real sweep runs end to end (test_sweep.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch
from hydra import compose
from hydra._internal.hydra import Hydra  # what @hydra.main runs; Hydra's own tests use it
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import execution_whitelist
from omegaconf import DictConfig, OmegaConf

import feedrate.launch
from feedrate import distributed, environment, hardware
from feedrate.config import TRUSTED_TARGETS
from feedrate.sweep import space
from feedrate.sweep.trial import Fresh, TrialResult, read_result

MAIN_MB = 600.0  # the training process
WORKER_MB = {"fork": 20.0, "forkserver": 300.0, "spawn": 300.0}  # each worker, by start method
COMPUTE_S = 0.0004  # the model's time per sample
DECODE_S = 0.0005  # a worker's time per sample besides the dataset's own latency


def loader_rate(workers: int, latency_s: float, prefetch: int) -> float:
    """Samples/s the loader delivers: workers overlap the latency, and past a few per core
    they contend (the rate peaks, then falls), a deeper prefetch helps a little."""
    if workers == 0:
        return 1.0 / latency_s
    contention = 1.0 + 0.02 * max(0, workers - 8) ** 1.5 / 8
    return workers / latency_s / contention * (1.0 + 0.02 * math.log2(prefetch))


@dataclass
class Simulated:
    """A trial runner whose trials are a model of the loader (see the module's docstring).

    ``fail``: the reason a trial of this config fails, or None; the trial then exits 2 with
    that ``[ERROR]`` line, as a run with a fault does. ``seconds``: how long each trial takes.
    ``speed``: a factor on the modelled rate, from the trial's overrides (a contestant made
    slower). ``ran``: each trial's overrides, in order.
    """

    fail: Callable[[DictConfig], str | None] = lambda cfg: None
    seconds: float = 0.0
    speed: Callable[[list[str]], float] = lambda overrides: 1.0
    ran: list[list[str]] = field(default_factory=list)

    def __call__(
        self, overrides: list[str], job_dir, timeout_s: float, objective: str = "samples_per_sec"
    ) -> TrialResult:
        started = time.perf_counter()
        self.ran.append(list(overrides))
        job_dir = Path(job_dir)
        (job_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        cfg = compose("train", list(overrides))
        ranks = space.ranks_per_node(cfg)
        if ranks > 1:  # as Fresh runs it under torchrun
            cfg = compose("train", Fresh("train.py", ranks).job_overrides(list(overrides)))
        (job_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        time.sleep(self.seconds)
        reason = self.fail(cfg)
        if reason:
            (job_dir / "trial.log").write_text(f"[{datetime.now()}][feedrate][ERROR] - {reason}\n")
            return read_result(job_dir, 2, overrides, time.perf_counter() - started, objective)
        (job_dir / "environment.json").write_text(json.dumps(_environment()))
        metrics = simulate(cfg, overrides, len(self.ran), self.speed(list(overrides)))
        (job_dir / "metrics.json").write_text(json.dumps(metrics))
        (job_dir / "trial.log").write_text(f"samples/s {metrics['samples_per_sec']:.1f}\n")
        return read_result(job_dir, 0, overrides, time.perf_counter() - started, objective)


@functools.cache
def _environment() -> dict:
    """This machine, as a run's environment.json records it (once: it asks git)."""
    return environment.describe(dataclasses.asdict(hardware.detect()))


def _costs(cfg: DictConfig, loader: dict, workers: int, latency_s: float) -> dict | None:
    """What a batch costs in the simulation (trainer.costs): a worker waits the dataset's
    latency a sample and decodes for ``DECODE_S`` on a core, the step takes ``COMPUTE_S`` a
    sample; its contention past a few workers a core is the model's to find out, by measuring."""
    if not cfg.trainer.get("costs"):
        return None
    batch = int(loader["batch_size"])
    engine = str(loader.get("engine") or "process")
    return {
        "batch_size": float(batch),
        "worker_s": batch * latency_s,
        "worker_cpu_s": batch * DECODE_S,
        "queued_s": 0.0,
        "collate_s": 0.0,
        "tail": 1.2,
        "step_s": batch * COMPUTE_S,
        "step_cpu_s": batch * COMPUTE_S,
        "handoff_s": 0.0,
        "nbytes": 1e5 * batch,
        "measured_on": {
            "num_workers": workers,
            "prefetch_factor": loader.get("prefetch_factor") if workers else None,
            "engine": engine if workers else "process",
        },
        "batches": 10,
    }


def simulate(cfg: DictConfig, overrides: list[str], nth: int, speed: float = 1.0) -> dict:
    """The metrics.json a run of ``cfg`` would write, from :func:`loader_rate`; a jitter of
    +-0.5% that differs from trial to trial (``nth``) stands for the machine's noise."""
    loader = OmegaConf.to_container(cfg.loader, resolve=True, enum_to_str=True)
    # sweep.ranks_per_node: torchrun's ranks, each with the node's workers divided between
    # them unless loader.per_rank (as launch.py does), the job's rate their sum
    ranks = space.ranks_per_node(cfg)
    local = distributed.Ranks(world_size=ranks, local_world_size=ranks)
    workers = distributed.workers_per_rank(int(loader["num_workers"]), local, loader["per_rank"])
    method = loader.get("multiprocessing_context") or "fork"
    latency = float(cfg.dataset.get("io_latency_ms") or 0) / 1000 + DECODE_S
    delivered = loader_rate(workers, latency, int(loader.get("prefetch_factor") or 2))
    measure = str(getattr(cfg.trainer.measure, "value", cfg.trainer.measure))
    if measure == "loader":
        rate = delivered
    elif measure == "compute":
        rate = 1.0 / COMPUTE_S
    elif workers == 0:  # loading and training take turns
        rate = 1.0 / (latency + COMPUTE_S)
    else:
        rate = min(delivered, 1.0 / COMPUTE_S)
    rate *= ranks
    digest = hashlib.sha256(f"{sorted(overrides)}{nth}".encode()).digest()
    rate *= speed * (1.0 + (digest[0] / 255.0 - 0.5) / 100.0)
    wait = max(0.0, 1.0 - rate * COMPUTE_S) if measure == "train" else 0.0
    workers_mb = workers * WORKER_MB.get(method, 300.0)
    seconds = float(cfg.trainer.get("max_seconds") or 1.0)
    samples = max(1, round(rate * seconds))
    batch = int(loader["batch_size"])
    threads = loader.get("main_threads") or torch.get_num_threads()
    threads = distributed.workers_per_rank(threads, local, loader["per_rank"])  # as launch.py
    return {
        "samples_per_sec": rate,
        "consumed_samples_per_sec": rate,
        "produced_samples_per_sec": rate,
        "data_wait_frac": wait,
        "first_batch_s": 0.05 + 0.01 * workers,
        "epoch_restart_s": None,
        "step_time_p50_ms": 1000.0 * batch / rate,
        "step_time_p90_ms": 1100.0 * batch / rate,
        "window_samples_per_sec": [rate] * 3,
        "window_spread": 0.01,
        "measured_steps": max(1, samples // batch),
        "measured_samples": samples,
        "measured_seconds": seconds,
        "cpu_util": 0.5,
        "other_cpu_frac": 0.0,
        "noise": [],
        # every rank's, summed (distributed.py); the main process's is one rank's
        "peak_pss_mb": ranks * (MAIN_MB + workers_mb),
        "peak_uss_mb": ranks * (MAIN_MB / 2 + workers_mb),
        "peak_main_pss_mb": MAIN_MB,
        "peak_processes": ranks * (1 + workers),
        "peak_shm_mb": 0.1 * workers * int(loader.get("prefetch_factor") or 2),
        "memory_samples_while_measuring": 3,
        "final_loss": 0.5,
        "train_accuracy": 0.9,
        "bound": "input-bound" if wait > 0.1 else "compute-bound",
        "evidence": "simulated",
        # held-out accuracy peaks at a learning rate of 0.01 (sweep=lr)
        "val_loss": 0.5,
        "val_accuracy": 1.0 / (1.0 + abs(math.log10(float(cfg.trainer.lr)) + 2.0)),
        "skipped_samples": 0,
        "steps": samples // batch + 5,
        "warmup": {"steps": 5, "seconds": 0.1, "backlog_batches": 4, "settled": True},
        "abandoned": None,
        "drift_warnings": 0,
        "epochs_started": 1,
        "costs": _costs(cfg, loader, workers, latency) if measure == "train" else None,
        "run": {
            "fingerprint": _environment()["fingerprint"],
            "host": "simulated",
            "device": "cpu",
            "amp_dtype": "None",
            "channels_last": False,
            "cudnn_benchmark": False,
            "non_blocking": False,
            "loader": {**loader, "num_workers": workers, "pin_memory": False},
            "ranks_per_node": ranks,
            "torch_threads": threads,
            "dataset_len": int(cfg.dataset.get("n_samples") or 1000),
            "sample_bytes": 3072,
            "num_classes": 10,
            "torch": torch.__version__,
            "date": datetime.now().isoformat(timespec="seconds"),
            "overrides": list(overrides),
        },
    }


@dataclass
class Swept:
    returncode: int
    out: str  # what the sweep printed and logged


def sweep(project: Path, *args: str, runner, monkeypatch, capsys) -> Swept:
    """``python train.py -m ARGS`` in ``project`` (its train.py and conf/), in this process,
    every trial run by ``runner``. Hydra composes and runs it as ``@hydra.main`` does; the
    sweep's exit status is its ``sys.exit`` (0 when it returns)."""
    monkeypatch.setattr("feedrate.sweep.host.runner_for", lambda config, name: runner)
    return multirun(project, *args, monkeypatch=monkeypatch, capsys=capsys)


def multirun(project: Path, *args: str, monkeypatch, capsys) -> Swept:
    """``python train.py -m ARGS`` in ``project``, in this process: Hydra's own launcher runs
    each job here, as it would in that process."""
    return _as_hydra_main(project, args, True, monkeypatch, capsys)


def train(project: Path, *args: str, monkeypatch, capsys) -> Swept:
    """``python train.py ARGS`` in ``project`` (its train.py and conf/), in this process, as
    ``@hydra.main`` runs it: its exit status is its ``sys.exit`` (0 when it returns), its
    output what it printed and logged. An error that escapes feedrate raises here, as it
    would end the process with a traceback."""
    return _as_hydra_main(project, args, False, monkeypatch, capsys)


def _as_hydra_main(project: Path, args, multirun: bool, monkeypatch, capsys) -> Swept:
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))  # a dataset class of the project's own
    monkeypatch.setattr(sys, "argv", [str(project / "train.py"), *(["-m"] * multirun), *args])
    capsys.readouterr()
    GlobalHydra.instance().clear()
    with _logging_kept(), execution_whitelist(TRUSTED_TARGETS):  # as train.py's @hydra.main
        try:
            app = Hydra.create_main_hydra_file_or_module(
                calling_file=str(project / "train.py"),
                calling_module=None,
                config_path="conf",
                job_name="train",
            )
            run = app.multirun if multirun else app.run
            done = run(
                config_name="train",
                task_function=feedrate.launch.main,
                overrides=list(args),
                with_log_configuration=True,
            )
            if not multirun:
                done.return_value  # noqa: B018 - raises what the run raised
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            GlobalHydra.instance().clear()
    captured = capsys.readouterr()
    return Swept(code, captured.out + captured.err)


@contextlib.contextmanager
def _logging_kept():
    """Hydra configures logging for its run (handlers on this test's captured streams): put
    back what was there, so later tests do not log to closed streams."""
    loggers = [logging.root, *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in loggers]
    kept = {id(h) for _, handlers, *_ in saved for h in handlers}
    try:
        yield
    finally:
        for lg in [logging.root, *logging.root.manager.loggerDict.values()]:
            for handler in getattr(lg, "handlers", []):
                if id(handler) not in kept:  # the sweep's own, its log file among them
                    handler.close()
            if isinstance(lg, logging.Logger) and lg not in loggers:
                lg.handlers.clear()
        for lg, handlers, level, propagate, disabled in saved:
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled


def contestant(name, values, baseline, workers=4, run=None):
    """A final-round contestant of the sweep whose runs read ``values`` samples/s, in order,
    each at 100 MB of peak memory, on ``workers`` workers."""
    from feedrate.sweep.decide import Contestant

    c = Contestant(name, [], baseline)
    metrics = {"peak_pss_mb": 100.0, "run": run or {}}
    c.results = [TrialResult([], "ok", value=v, metrics=metrics) for v in values]
    c.loader = lambda: {"num_workers": workers}
    return c
