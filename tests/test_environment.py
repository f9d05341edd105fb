"""The three ways to build the environment agree: pyproject.toml, environment.yml (conda),
the Dockerfile, and the lock of a tested set. No conda or Docker engine is needed to check."""

from __future__ import annotations

import re

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .conftest import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements(specs, python: str | None = None) -> dict[str, SpecifierSet]:
    """Name -> version bounds of each requirement that applies to ``python`` ("3.11.7"; None:
    the Python running the tests)."""
    env = None
    if python is not None:
        env = {"python_version": ".".join(python.split(".")[:2]), "python_full_version": python}
    out = {}
    for spec in specs:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # not for this Python (tomli on 3.10 only)
        out[req.name.lower().replace("_", "-")] = req.specifier
    return out


def _environment() -> tuple[dict, dict[str, SpecifierSet], dict[str, SpecifierSet]]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda, pip = [], []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip += dep["pip"]
        else:
            conda.append(dep)
    return (
        env,
        _requirements(d.replace("=", "==", 1) if re.match(r"^[\w-]+=\d", d) else d for d in conda),
        _requirements(pip),
    )


def test_environment_yml_has_pyprojects_packages_with_the_same_bounds():
    declared = _requirements(_pyproject()["dependencies"])
    env, conda, pip = _environment()
    assert env["channels"] == ["conda-forge"]
    assert not set(conda) & set(pip), "a package from both conda and pip"
    listed = {**conda, **pip}
    python = listed.pop("python")
    listed.pop("pip")
    assert listed == declared  # same packages, same bounds
    assert {"torch", "torchvision"} <= set(pip), "PyTorch comes from PyPI, not a conda channel"
    requires = SpecifierSet(_pyproject()["requires-python"])
    assert Version(str(python).removeprefix("==")) in requires


def test_dockerfile_builds_from_environment_yml_and_copies_what_exists():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM mambaorg/micromamba:\d", text, re.MULTILINE)
    assert "--file /tmp/environment.yml" in text
    copied = []
    for line in text.splitlines():
        if line.startswith("COPY"):
            parts = [p for p in line.split()[1:] if not p.startswith("--")]
            copied += parts[:-1]
    assert {"environment.yml", "pyproject.toml", "src", "conf", "LICENSE"} <= set(copied)
    for source in copied:
        assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which is missing"
    assert 'CMD ["feedrate", "train"]' in text
    # the environment comes from environment.yml only; feedrate installed, not editable
    assert "pip install --no-deps --no-cache-dir /tmp/feedrate" in text and " -e " not in text
    # a project mounted at /project, written by whoever runs the container (--user)
    assert "WORKDIR /project" in text and "chmod 1777 /project" in text
    assert '-v "$PWD:/project"' in text and '--user "$(id -u):$(id -g)"' in text


def test_lock_pins_every_dependency_within_its_bounds():
    lines = (ROOT / "requirements.lock").read_text().splitlines()
    pins = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = Version(version)
    # the lock is for the Python its header names, whichever runs the tests
    python = re.search(r"^# Python (\d+\.\d+\.\d+)", "\n".join(lines), re.M).group(1)
    declared = _requirements(_pyproject()["dependencies"], python)
    declared |= _requirements(_pyproject()["optional-dependencies"]["test"], python)
    for name, spec in declared.items():
        assert name in pins, f"{name} is not pinned in requirements.lock (make lock)"
        assert pins[name] in spec, f"{name}=={pins[name]} is outside {spec}"


def test_readme_shows_all_three_ways_and_why_shm_matters():
    text = (ROOT / "README.md").read_text()
    for expected in (
        "conda env create -f environment.yml",
        "docker build -t feedrate .",
        "--shm-size=8g",
        "pip install -r requirements.lock",
        "make lock",
    ):
        assert expected in text, expected
