"""The environment a run ran in: package versions, CUDA, driver, the hardware fingerprint.

Written as ``environment.json`` beside ``metrics.json`` (before training starts, so a run that
fails has it too), and summed up in one line in the header of a preset a sweep writes: a figure
is only comparable with figures from the same software on the same machine.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path

import torch

# What sets the numbers: the framework, the data stack, the sweep's own machinery.
PACKAGES = (
    "feedrate",
    "torch",
    "torchvision",
    "numpy",
    "pillow",
    "scikit-image",
    "hydra-core",
    "omegaconf",
    "hydra-optuna-sweeper",
    "optuna",
    "sqlalchemy",
    "psutil",
)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def driver_version() -> str | None:
    """The NVIDIA driver's version (NVML, else nvidia-smi); None without one."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - not installed, no driver, no GPU
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.splitlines()[0].strip() if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def git_commit() -> str | None:
    """The checkout's commit (with ``+dirty`` for local changes), if feedrate runs from one."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return None
    return f"{head}{'+dirty' if dirty else ''}" if head else None


def describe(fingerprint: dict) -> dict:
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "packages": {name: _version(name) for name in PACKAGES},
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "driver": driver_version() if cuda else None,
        "git_commit": git_commit(),
        "fingerprint": fingerprint,
    }


def short(env: dict) -> str:
    """One line: ``torch 2.14.1 (CUDA 13.0, driver 580.65), Python 3.11.7, Linux-...``."""
    cuda = (
        f" (CUDA {env['torch_cuda']}, driver {env['driver']})"
        if env.get("cuda_available")
        else " (CPU)"
    )
    return (
        f"torch {env['packages'].get('torch')}{cuda}, torchvision"
        f" {env['packages'].get('torchvision')}, Python {env['python']}, {env['platform']}"
    )
