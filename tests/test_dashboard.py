"""The README's way to browse a loader study: optuna-dashboard 0.14 (the `dashboard` extra)
serves a study that optuna 2.10 wrote, parameters, values and failure reasons included."""

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

optuna = pytest.importorskip("optuna")
pytest.importorskip("optuna_dashboard")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - localhost only
        return response.status, json.loads(response.read())


def test_the_dashboard_serves_a_study_the_sweep_wrote(tmp_path):
    from feedrate.sweep.study import REASON_KEY

    storage = f"sqlite:///{tmp_path / 'loader-x.db'}"
    study = optuna.create_study(study_name="loader-x", storage=storage, direction="maximize")
    for value in (180.0, 1280.0, None):
        trial = study.ask()
        trial.suggest_int("loader.num_workers", 1, 64, log=True)
        trial.suggest_int("loader.prefetch_factor", 1, 8, log=True)
        if value is None:
            trial.set_user_attr(REASON_KEY, "failed: killed by SIGKILL")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, value)
    before = (tmp_path / "loader-x.db").read_bytes()
    exe = Path(sys.executable).parent / "optuna-dashboard"
    command = [str(exe) if exe.exists() else shutil.which("optuna-dashboard"), storage]
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
        assert [s["study_name"] for s in studies["study_summaries"]] == ["loader-x"]
        study_id = studies["study_summaries"][0]["study_id"]
        status, detail = _get(f"{base}/api/studies/{study_id}")
        assert status == 200
        trials = detail["trials"]
        assert [t["state"] for t in trials] == ["Complete", "Complete", "Fail"]
        assert {p["name"] for p in trials[0]["params"]} == {
            "loader.num_workers",
            "loader.prefetch_factor",
        }
        attrs = {a["key"]: a["value"] for a in trials[2]["user_attrs"]}
        assert attrs[REASON_KEY] == "failed: killed by SIGKILL"
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert (tmp_path / "loader-x.db").read_bytes() == before, "browsing changed the study"
