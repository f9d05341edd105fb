"""benchmarks/gpu_check.sh, the one call a GPU machine gets, works end to end before one is at
hand: its smoke mode runs every stage shrunk to a CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT


@pytest.mark.slow
def test_the_gpu_check_runs_every_stage_in_smoke_mode(tmp_path):
    project = tmp_path / "project"  # a copy: the sweep writes its preset into conf/loader/
    project.mkdir()
    shutil.copy(ROOT / "train.py", project)
    for tree in ("conf", "benchmarks", "tests"):
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
    for stage in ("1/3 driver and environment", "2/3 GPU tests", "3/3 loader benchmark"):
        assert stage in proc.stdout
    bench = json.loads((out / "bench.json").read_text())
    gpu = bench["results"]["gpu"]
    assert gpu["median"]["tuned"] > 0 and gpu["ceiling"] > 0
    assert {"tuned/recipe", "tuned/ceiling"} <= set(gpu["ratios"])
    assert bench["extra"][:2] == ["model=pooled_linear", "hardware=cpu"]
    assert (out / "bench.png").stat().st_size > 0
    env = json.loads((out / "environment.json").read_text())
    assert env["packages"]["torch"] and "fingerprint" in env
    preset = (out / "gpu_check_smoke.yaml").read_text()
    assert "python train.py loader=gpu_check_smoke" in preset
    assert (project / "conf" / "loader" / "gpu_check_smoke.yaml").exists()


def test_a_benchmark_cut_short_is_summarised_from_its_runs(tmp_path):
    rows = []
    for name, values in {
        "default": [90, 94],
        "recipe": [350, 352],
        "cpu_capped": [176, 178],
        "tuned": [1300, 1310],
        "grid_0": [92, 92],
        "grid_16": [1270, 1280],
        "ceiling_loader_tuned": [1350, 1360],
        "ceiling_loader_grid_48": [2370],
        "ceiling_compute": [2600, 2620],
    }.items():
        for r, v in enumerate(values):
            rows.append(
                {
                    "workload": "synthetic",
                    "round": r,
                    "name": name,
                    "samples_per_sec": v,
                    "status": "ok",
                    "reason": "",
                }
            )
    rows.append(
        {
            "workload": "synthetic",
            "round": 1,
            "name": "grid_0",
            "samples_per_sec": None,
            "status": "failed",
            "reason": "killed",
        }
    )
    # A second workload cut short before its ceilings: compared without them, no verdict there
    for name, value in {"recipe": 400.0, "tuned": 500.0, "grid_2": 480.0}.items():
        rows.append(
            {
                "workload": "photos",
                "round": 0,
                "name": name,
                "samples_per_sec": value,
                "status": "ok",
                "reason": "",
            }
        )
    rows.append(
        {
            "workload": "photos",
            "round": 0,
            "name": "ceiling_compute",
            "samples_per_sec": None,
            "status": "failed",
            "reason": "timed out",
        }
    )
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
    assert summary["best_grid"] == "grid_16"
    assert summary["ceiling"] == 2370  # the best loader-only figure, below compute-only
    assert summary["ratios"]["tuned/recipe"] == pytest.approx(1305 / 351)
    assert summary["ratios"]["tuned/ceiling"] == pytest.approx(1305 / 2370)
    assert "tuned/recipe = 3.72 (target >= 5.0) MISS" in proc.stdout
    photos = json.loads((tmp_path / "summary.json").read_text())["photos"]
    assert photos["ceiling"] is None and photos["ratios"]["tuned/ceiling"] is None
    assert photos["ratios"]["tuned/recipe"] == pytest.approx(1.25)
    assert photos["failures"] == {"ceiling_compute": ["timed out"]}
    assert "tuned/ceiling = n/a (target >= 0.9) NOT MEASURED" in proc.stdout
    assert (tmp_path / "bench.png").stat().st_size > 0
