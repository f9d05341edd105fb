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
