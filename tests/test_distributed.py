"""Data parallel under torchrun: two CPU ranks with the gloo backend, as on a multi-GPU box."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
import yaml

from feedrate import hardware, provenance
from feedrate.tuning.preset import render

from .conftest import run_cli, run_torchrun, shrink


@pytest.mark.slow
def test_two_ranks_train_one_model_by_time_and_sum_their_throughput_over_one_window(
    tmp_path, compose
):
    """Streaming and stopped by the clock, as a sweep's trial measures: each rank measures the
    steps rank 0 measures, so the job's figure is a sum over one window. The preset, measured
    here for one process, says it was tuned for one rank."""
    overrides = ["trainer.stream=true", "trainer.max_steps=100000", "trainer.max_seconds=2"]
    cfg = compose(*overrides)
    fp = hardware.detect()
    here = provenance.Here.of(cfg, fp, hardware.resolve(cfg.hardware, fp))  # one process
    measured_on = {"machine": here.machine, "workload": here.workload, "samples_per_sec": 100.0}
    (tmp_path / "conf" / "loader").mkdir(parents=True)
    preset = tmp_path / "conf" / "loader" / "alone.yaml"
    preset.write_text(render({"num_workers": 2}, ["one process"], measured_on))
    run = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"hydra.run.dir={tmp_path}"]
    proc = run_torchrun(2, *shrink([*overrides, "loader=alone", *run]))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "rank 1 of 2 (local 1 of 2) on cpu, backend gloo" in out
    assert "loader.num_workers=2" in out and "1 per rank" in out, "the split, with its numbers"
    said = "loader=alone was measured on another workload: the workload differs"
    said += " (ranks_per_node 1 -> 2)"
    assert said in out and "sweep.ranks_per_node=2" in out
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["world_size"] == 2 and len(m["ranks"]) == 2
    first, second = m["ranks"]
    assert first["measured_steps"] == second["measured_steps"] > 0
    assert first["measured_samples"] == second["measured_samples"] == 16 * first["measured_steps"]
    assert m["measured_samples"] == 2 * first["measured_samples"]
    assert m["samples_per_sec"] == pytest.approx(
        first["samples_per_sec"] + second["samples_per_sec"]
    )
    windows = [
        a + b
        for a, b in zip(
            first["window_samples_per_sec"], second["window_samples_per_sec"], strict=True
        )
    ]
    assert m["window_samples_per_sec"] == pytest.approx(windows) and len(windows) >= 2
    spread = (max(windows) - min(windows)) / statistics.median(windows)  # the job's windows
    assert m["window_spread"] == pytest.approx(spread)
    # rank 0 wrote one checkpoint, of the model itself (no DistributedDataParallel wrapper)
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert state["step"] == m["steps"] and not any(k.startswith("module.") for k in state["model"])
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["environment.json", "metrics.json"]


def test_slurm_launcher_composes_for_hyperparameter_sweeps():
    proc = run_cli(
        "sweep=lr", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "--cfg", "hydra"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    launcher = yaml.safe_load(proc.stdout)["hydra"]["launcher"]
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert launcher["partition"] == "gpu" and launcher["gpus_per_node"] == 1


def test_the_loader_sweep_refuses_a_launcher_that_runs_trials_side_by_side(tmp_path):
    proc = run_cli(
        "-m",
        "sweep=loader",
        "sweep.preset_name=cluster_test",
        "hydra/launcher=slurm",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "hydra.launcher is SlurmLauncher: the loader sweep measures throughput one trial" in out
    assert "srun --exclusive python train.py -m sweep=loader" in out
    assert not (tmp_path / ".submitit").exists()


def test_forked_ranks_say_which_rank_failed_and_why(torchrun_here):
    """The forked ranks the counting tests run under (conftest.torchrun_here) fail as torchrun
    does: a rank's error ends the job with its status and its output."""
    proc = torchrun_here(2, "loader.num_wrkers=2")
    assert proc.returncode != 0
    assert proc.stdout.count("num_wrkers") >= 2, proc.stdout[-2000:]  # each rank said it
