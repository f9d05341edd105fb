"""What the bench scripts share. A bench script describes its contestants and its tables;
these are the parts every one of them does the same way: run a sweep (:func:`sweep`),
alternate the rounds (:func:`alternating`), write a folder (:func:`provenance`,
:func:`write_json`) and draw its rounds (:func:`figure`, :func:`rounds_bar`, :func:`save`).
A single run of a configuration is :func:`feedrate.sweep.trial.run_trial`, fresh or in a
warm host, as the sweep's own trials run."""

from __future__ import annotations

import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Any


def provenance(fingerprint: Any) -> dict:
    """The head of a results.json: when, the command as run, the commit and the machine."""
    from feedrate.environment import git_commit

    return {
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(),
        "machine": fingerprint.as_dict(),
    }


def figure(**kwargs: Any) -> tuple[Any, Any]:
    """A matplotlib figure and its axes, drawn off screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(**kwargs)


def rounds_bar(ax: Any, x: float, values: list[float], width: float, color: str, label: str):
    """A bar at the median of ``values``, with each round as a dot on it."""
    ax.bar(x, statistics.median(values), width, color=color, label=label)
    ax.plot([x] * len(values), values, "k.", markersize=4)


def save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def alternating(names: Any, r: int) -> list:
    """The order of round ``r``: as given, reversed every other round, so that drift of the
    machine (its caches, its clock, other load) hits every contestant alike."""
    names = list(names)
    return names if r % 2 == 0 else names[::-1]


def sweep(root: Path, overrides: list[str], preset: str, out: Path, log: str) -> dict:
    """``python train.py -m sweep=loader`` with ``overrides``, writing ``conf/loader/<preset>``
    (a study under ``out/studies``, its folder ``out/<log>``), timed; its output in
    ``out/<log>.log``. Returns its ``seconds``, the preset's ``path`` and its ``values``;
    exits naming the log where it failed or wrote no preset."""
    import subprocess
    import time

    import yaml

    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "sweep=loader",
        *overrides,
        f"sweep.preset_name={preset}",
        f"sweep.study_dir={out / 'studies'}",
        f"hydra.sweep.dir={out / log}",
    ]
    print(f"[{log}] {' '.join(cmd[1:])}", flush=True)
    path = root / "conf" / "loader" / f"{preset}.yaml"
    before = path.stat().st_mtime if path.exists() else None
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, text=True, capture_output=True)
    seconds = time.perf_counter() - t0
    (out / f"{log}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not path.exists() or path.stat().st_mtime == before:
        raise SystemExit(f"[{log}] the sweep failed or wrote no preset; see {out / log}.log")
    return {"seconds": seconds, "path": path, "values": yaml.safe_load(path.read_text())}


def write_json(path: Path, data: Any) -> None:
    """A folder's results (``results.json``, ``bench.json``): indented, values JSON does not
    know written as text, whole or not at all (written beside, then moved into place)."""
    import json
    import os

    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
