"""The README's way to browse a loader study: optuna-dashboard (the `dashboard` extra) serves
the study a sweep wrote, its trials, parameters, values, skip reasons and the sweep's decision,
through the same HTTP API its pages read."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from . import fakes
from .conftest import ROOT

optuna = pytest.importorskip("optuna")
pytest.importorskip("optuna_dashboard")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - localhost only
        return response.status, json.loads(response.read())


def _swept_study(tmp_path: Path, monkeypatch, capsys) -> Path:
    """A loader sweep's study, as ``python train.py -m sweep=loader`` leaves it (its trials
    simulated); the 4-worker seed goes over the memory budget: a failed trial and its reason."""
    shutil.copy(ROOT / "train.py", tmp_path / "train.py")
    shutil.copytree(ROOT / "conf", tmp_path / "conf")
    swept = fakes.sweep(
        tmp_path,
        "sweep=loader",
        "dataset=synthetic",
        "dataset.io_latency_ms=4",
        "model=pooled_linear",
        "sweep.preset_name=browsed",
        "sweep.max_workers=4",
        "sweep.finalists=1",
        "sweep.final_rounds=3",
        "sweep.measure_ceilings=false",
        "hydra.sweeper.n_trials=2",
        "sweep.memory_budget_gb=0.68",  # 2 fork workers fit (640 MB simulated), 4 do not (681)
        f"hydra.sweep.dir={tmp_path}/multirun",
        runner=fakes.Simulated(),
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert swept.returncode == 0, swept.out[-3000:]
    (db,) = (tmp_path / "outputs" / "sweeps").glob("loader-browsed-*.db")
    return db


def test_the_dashboard_serves_a_study_the_sweep_wrote(tmp_path, monkeypatch, capsys):
    from feedrate.sweep.study import REASON_KEY

    db = _swept_study(tmp_path, monkeypatch, capsys)
    before = db.read_bytes()
    exe = Path(sys.executable).parent / "optuna-dashboard"
    command = [str(exe) if exe.exists() else shutil.which("optuna-dashboard"), f"sqlite:///{db}"]
    port = _free_port()
    server = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                status, studies = _get(f"{base}/api/studies")
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.5)
        assert status == 200
        (summary,) = studies["study_summaries"]
        assert summary["study_name"] == db.stem
        status, detail = _get(f"{base}/api/studies/{summary['study_id']}")
        assert status == 200
        trials = detail["trials"]
        states = [t["state"] for t in trials]
        assert states == ["Complete", "Fail"], states
        done = trials[0]
        assert {p["name"] for p in done["params"]} >= {
            "loader.num_workers",
            "loader.prefetch_factor",
        }
        assert done["values"][0] > 0
        reason = {a["key"]: a["value"] for a in trials[1]["user_attrs"]}[REASON_KEY]
        assert reason.startswith("over budget: used") and "sweep.memory_budget_gb=0.68" in reason
        assert detail["objective_names"] == ["samples_per_sec"]
        # the decision, not the best search run: a study attribute and the study page's note
        attrs = {a["key"]: a["value"] for a in detail["user_attrs"]}
        decision = json.loads(attrs["decision"])
        assert decision["winner"] == "trial 0" and decision["preset"] == "browsed"
        assert decision["loader"]["num_workers"] == 2 and decision["median_samples_per_sec"] > 0
        assert "python train.py loader=browsed" in detail["note"]["body"]
        assert "The sweep's decision:" in detail["note"]["body"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert db.read_bytes() == before, "browsing changed the study"
