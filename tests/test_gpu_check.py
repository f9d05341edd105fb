"""benchmarks/gpu_check.sh, the one call a GPU machine gets, works end to end before one is at
hand: its smoke mode runs every stage shrunk to a CPU."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys

import pytest

from .conftest import ROOT


@pytest.mark.slow
@pytest.mark.timeout(1500)  # its script's own limit (1200 s), and the checks after it
def test_the_gpu_check_runs_every_stage_in_smoke_mode(tmp_path):
    project = tmp_path / "project"  # a copy: the sweep writes its preset into conf/loader/
    project.mkdir()
    shutil.copy(ROOT / "train.py", project)
    for tree in ("conf", "benchmarks", "tests", "examples"):
        shutil.copytree(ROOT / tree, project / tree, ignore=shutil.ignore_patterns("results"))
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh"],
        cwd=project,
        env={
            **os.environ,
            "FEEDRATE_GPU_CHECK": "smoke",
            "PYTHON": sys.executable,
            "OUT": str(out),
        },
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in ("1/4 driver and environment", "2/4 GPU tests", "3/4 a plain loop", "4/4 loader"):
        assert stage in proc.stdout
    loop = json.loads((out / "plain_loop.json").read_text().splitlines()[-1])
    assert loop["samples"] > 0 and loop["autotune"]["tried"]
    bench = json.loads((out / "bench.json").read_text())
    gpu = bench["results"]["gpu"]
    assert gpu["median"]["tuned"] > 0 and gpu["ceiling"] > 0
    assert {"tuned/recipe", "tuned/ceiling"} <= set(gpu["ratios"])
    # as on the GPU: no side rows (memory reads off, the other threads), no steady-state runs
    assert gpu["threads"] is None and gpu["memory_off/on"] is None
    assert "steady-state" not in (out / "tables.md").read_text()
    assert bench["extra"][:2] == ["model=pooled_linear", "hardware=cpu"]
    assert (out / "bench.png").stat().st_size > 0
    env = json.loads((out / "environment.json").read_text())
    assert env["packages"]["torch"] and "fingerprint" in env
    preset = (out / "gpu_check_smoke.yaml").read_text()
    assert "python train.py loader=gpu_check_smoke" in preset
    assert (project / "conf" / "loader" / "gpu_check_smoke.yaml").exists()


def _row(workload, name, r, value, **extra):
    return {
        "workload": workload,
        "round": r,
        "name": name,
        "samples_per_sec": value,
        "status": "ok" if value is not None else "failed",
        "reason": "" if value is not None else "killed",
        "device": "cpu",
        **extra,
    }


def test_a_benchmark_cut_short_is_summarised_with_intervals_and_the_shared_core_ceiling(tmp_path):
    rows = []
    two = {"num_workers": 2, "prefetch_factor": 2, "batch_size": 64}
    for name, values in {
        "grid_0": [92],
        "grid_16x2": [1275],
        "grid_16x4": [1310],
        "tuned": [1300, 1310, 1290, 1305, 1295],
        "default": [90, 94, 92, 91, 93],
        "recipe": [350, 352, 349, 351, 353],
        "best_grid": [1270, 1330, 1280, 1320, 1300],
        "ceiling_loader_grid_48x2": [2370, 2380, 2360, 2375, 2365],
        "ceiling_loader_tuned": [1350],
        "ceiling_compute": [2600, 2620, 2610, 2590, 2605],
        # the tuned preset with PyTorch's threads: a row beside it, not a contestant
        "tuned_threads_default": [1180, 1175, 1190, 1185, 1170],
    }.items():
        rows += [_row("synthetic", name, r, v) for r, v in enumerate(values)]
    # the CPU-capped pick ran the tuned preset's settings: one row, not a comparison
    tuned_row = next(r for r in rows if r["name"] == "tuned")
    tuned_row["settings"] = two
    rows.append(_row("synthetic", "cpu_capped", 0, 1280, settings=two))
    # a grid point with the same settings is a grid point, not a contestant to merge
    rows.append(_row("synthetic", "grid_2x2", 0, 200, settings=two))
    rows.append(_row("synthetic", "recipe", 5, None))
    # A second workload cut short before its ceilings: compared without them, no verdict there
    for name, value in {"recipe": 400.0, "tuned": 500.0, "grid_2x2": 480.0}.items():
        rows.append(_row("photos", name, 0, value))
    rows.append(_row("photos", "ceiling_compute", 0, None))
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run(
        [sys.executable, "benchmarks/loader_bench.py", "--summarise", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())["synthetic"]
    assert summary["aliases"] == {"cpu_capped": "tuned"}
    assert "tuned_threads_default" not in summary["median"]
    threads = summary["threads"]
    assert threads["versus"] == "default" and threads["verdict"] == "win"
    assert "tuned threads / PyTorch's threads = 1.10x [" in proc.stdout
    assert summary["ratios"]["tuned/cpu_capped"]["verdict"] == "same settings"
    assert "tuned = cpu_capped" in proc.stdout
    assert summary["best_grid"] == "grid_16x4" and summary["grid"]["grid_2x2"] == 200
    assert summary["ceiling_kind"] == "shared"
    assert summary["ceiling"] == pytest.approx(1 / (1 / 2370 + 1 / 2605), rel=0.01)
    recipe = summary["ratios"]["tuned/recipe"]
    # paired by round; the CPU-capped run is a run of the tuned settings, in round 0 with it
    tuned = [statistics.median([1300, 1280]), 1310, 1290, 1305, 1295]
    paired = [t / r for t, r in zip(tuned, [350, 352, 349, 351, 353], strict=True)]
    assert recipe["ratio"] == pytest.approx(math.exp(statistics.mean(map(math.log, paired))))
    assert recipe["verdict"] == "win" and recipe["rounds"] == [5, 5], "round 5 failed: unpaired"
    assert recipe["low"] > 1.0 and "(target >= 5.0) missed" not in proc.stdout, "no target here"
    grid = summary["ratios"]["tuned/best_grid"]
    assert grid["low"] < 1.0 < grid["high"] and grid["verdict"] == "tie"
    assert "tie within noise (target >= 0.9) met" in proc.stdout
    photos = json.loads((tmp_path / "summary.json").read_text())["photos"]
    assert photos["ceiling"] is None and photos["ratios"]["tuned/ceiling"] is None
    assert photos["ratios"]["tuned/recipe"]["ratio"] == pytest.approx(1.25)
    assert "no claim (1 rounds, 3 needed)" in photos["ratios"]["tuned/recipe"]["shown"]
    assert photos["failures"] == {"ceiling_compute": ["killed"]}
    assert "tuned/ceiling = n/a (target >= 0.9) NOT MEASURED" in proc.stdout
    assert "| synthetic | tuned/recipe | 3.70x [" in (tmp_path / "tables.md").read_text()
    assert (tmp_path / "bench.png").stat().st_size > 0
