"""feedrate installed (not editable) and run from a project of the user's own: its configs
ship in the package, and the project keeps its presets, configs and dataset classes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from .conftest import ROOT, TINY
from .test_sweep import TINY_SWEEP

# A dataset class of the user's own, in the project directory
DOTS = """
import time

import torch
from torch.utils.data import Dataset


class Dots(Dataset):
    classes = ["even", "odd"]

    def __init__(self, n: int = 512, latency_ms: float = 2.0):
        self.n, self.latency_s = n, latency_ms / 1e3

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.latency_s)
        return torch.full((3, 16, 16), i % 251, dtype=torch.uint8), i % 2
"""

DATA = ["dataset=custom", "dataset._target_=dots.Dots", "+dataset.n=512"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``pip install <checkout>`` (not editable) into a folder of its own. From a copy of the
    checkout's sources: pip builds in the tree it installs, and leaves a build/ there."""
    source, target = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("site")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "conf", source / "conf")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", source / "src", symlinks=True, ignore=ignore)
    # the build needs setuptools >= 77: this environment's if it has it, else pip fetches it
    isolation = [] if Version(version("setuptools")) < Version("77") else ["--no-build-isolation"]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *isolation]
        + ["--target", target, source],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return target


def _env(installed: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEEDRATE_")}
    env["PYTHONPATH"] = str(installed)  # the installed copy first, before the checkout's
    return env


def _python(installed: Path, project: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=project,
        capture_output=True,
        text=True,
        env=_env(installed),
    )


def _feedrate(installed: Path, project: Path, *args: str) -> subprocess.CompletedProcess:
    env = _env(installed)
    return subprocess.run(
        [sys.executable, str(installed / "bin" / "feedrate"), *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


@pytest.mark.slow
def test_an_installed_feedrate_trains_sweeps_and_lists_presets_in_a_project_of_its_own(
    installed, tmp_path
):
    project = tmp_path / "project"
    project.mkdir()
    (project / "dots.py").write_text(textwrap.dedent(DOTS))
    packaged = installed / "feedrate" / "conf"
    assert (packaged / "train.yaml").is_file() and (packaged / "hydra" / "launcher").is_dir()
    assert not (packaged / "train.yaml").is_symlink(), "the files themselves, not the link"
    # what runs is the installed copy, not the checkout (which the test's Python also sees)
    imports = "import feedrate, hydra_plugins.feedrate_launcher.project_config as p;"
    proc = _python(installed, project, imports + "print(feedrate.__file__); print(p.__file__)")
    assert all(Path(f).is_relative_to(installed) for f in proc.stdout.split()), proc.stdout

    proc = _feedrate(installed, project, "train", *DATA, *TINY, "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    env = yaml.safe_load((project / "run" / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert env["job"]["name"] == "train"
    sources = {s["provider"]: s["path"] for s in env["runtime"]["config_sources"]}
    assert Path(sources["main"]).resolve() == packaged.resolve()
    assert Path(sources["feedrate-project"]).resolve() == (project / "conf").resolve()
    assert (project / "run" / "metrics.json").is_file() and (
        project / "run" / "train.log"
    ).is_file()
    ran = (project / "run" / "train.log").read_text()
    assert "dataset Dots" in ran

    sweep = [s for s in TINY_SWEEP if not s.startswith("loader.")]
    proc = _feedrate(
        installed,
        project,
        "sweep",
        *DATA,
        *sweep,
        "loader.batch_size=16",
        "sweep.preset_name=mine",
        "hydra.sweeper.n_trials=1",
        "sweep.final_rounds=1",
        "hydra.sweep.dir=sweep",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    preset = project / "conf" / "loader" / "mine.yaml"
    assert preset.is_file(), "the preset goes into the project's conf/loader/"
    assert not (packaged / "loader" / "mine.yaml").exists(), "never into the package"
    assert yaml.safe_load(preset.read_text())["measured_on"]["samples_per_sec"] > 0
    assert preset.read_text().startswith("# feedrate train loader=mine\n")  # as it was run

    workload = [*DATA, "model=pooled_linear", "loader.batch_size=16"]  # the sweep's
    proc = _feedrate(installed, project, "presets", *workload)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("mine ")]
    assert "samples/s" in line and "measured on this machine and workload" in line
    assert str(preset) in proc.stdout and "recipe" in proc.stdout

    proc = _feedrate(installed, project, "loader=mine", "--cfg", "job", "--package", "loader")
    assert proc.returncode == 0, proc.stderr[-2000:]
    num_workers = yaml.safe_load(preset.read_text())["num_workers"]
    assert f"num_workers: {num_workers}" in proc.stdout
