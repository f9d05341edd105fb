"""Loader presets written by a sweep: plain data, a header that says how they were measured,
written atomically, never over a preset that feedrate did not write (unless asked)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from feedrate.errors import ConfigError
from feedrate.files import atomic_write_text
from feedrate.sweep.space import default_threads

MARKER = "# feedrate-preset: written by `python train.py -m sweep=loader`"
AUTOTUNE_MARKER = "# feedrate-preset: written by `python train.py loader=autotune`"
LOADER_MARKER = "# feedrate-preset: written by feedrate.autotune_loader"
# Keys a preset may set: the DataLoader's own, as in LoaderConfig. Nothing executable.
PRESET_KEYS = (
    "batch_size",
    "num_workers",
    "pin_memory",
    "prefetch_factor",
    "persistent_workers",
    "multiprocessing_context",
    "timeout",
    "worker_threads",
    "main_threads",
    "decode",
    "per_rank",
)
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def preset_path(conf_dir: str | Path, name: str, keys: str = "sweep") -> Path:
    """``conf/loader/<name>.yaml``, refusing names that would leave that directory (named
    as ``<keys>.preset_name``)."""
    if not _NAME.match(name) or name.endswith(".yaml"):
        raise ConfigError(
            f"{keys}.preset_name={name!r} is not a valid preset name; use letters, digits, '_',"
            f" '-' and '.', e.g. {keys}.preset_name=tuned_8core_nvme"
        )
    return Path(conf_dir) / "loader" / f"{name}.yaml"


# Keys through which Hydra imports and calls code.
CODE_KEYS = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")


def _code_keys(node, path: str = "") -> list[str]:
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key in CODE_KEYS:
                found.append(where)
            found += _code_keys(value, where)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _code_keys(value, f"{path}[{i}]")
    return found


def plain_data_problems(path: Path) -> list[str]:
    """Why the loader preset at ``path`` is not plain loader data; empty if it is.

    Any file under conf/ can make Hydra run code: a ``_target_`` is imported and called, and a
    ``# @package _global_`` directive lets a loader file set ``hydra.callbacks``. A preset is
    data only when it has neither, and only loader keys.
    """
    from feedrate.config import LoaderConfig

    text = path.read_text()
    problems = []
    if re.search(r"^\s*#\s*@package", text, re.MULTILINE):
        problems.append(
            "a '# @package' directive (it can set keys outside loader, hydra.callbacks included)"
        )
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return [*problems, f"it is not valid YAML ({str(exc).splitlines()[0]})"]
    if data is None:
        return problems
    if not isinstance(data, dict):
        return [*problems, "it is not a mapping of loader keys"]
    problems += [f"the key {k} (Hydra imports and calls it)" for k in _code_keys(data)]
    allowed = set(LoaderConfig.__dataclass_fields__) | {"defaults"}
    extra = sorted(str(k) for k in data if k not in allowed and k not in CODE_KEYS)
    if extra:
        problems.append(f"keys that are not loader settings: {', '.join(extra)}")
    for entry in data.get("defaults") or []:
        if not (isinstance(entry, str) and _NAME.match(entry)):
            problems.append(f"the defaults entry {entry!r} (only loader presets belong there)")
    return problems


def check_plain_data(path: Path) -> None:
    problems = plain_data_problems(path)
    if problems:
        raise ConfigError(
            f"{path} is not a plain-data loader preset: it has {'; '.join(problems)}. Presets"
            " are data; remove those, or treat the file as code and review it"
        )


def check_writable(path: Path, overwrite: bool, keys: str = "sweep") -> None:
    """Refuse, before a sweep (or ``loader=autotune``: ``keys="trainer.autotune"``) starts,
    to replace a preset feedrate did not write."""
    if not path.exists() or overwrite:
        return
    if not {MARKER, AUTOTUNE_MARKER, LOADER_MARKER} & set(path.read_text().splitlines()[:2]):
        raise ConfigError(
            f"{path} exists and was not written by feedrate: it is kept. Choose another"
            f" name ({keys}.preset_name=...) or replace it with {keys}.overwrite=true"
        )


def render(
    values: dict, header_lines: list[str], measured_on: dict | None = None, marker: str = MARKER
) -> str:
    """The preset's text: usage line, marker, header, ``defaults: [default]``, the keys, and
    where it was measured (``measured_on``, which feedrate reads: feedrate.provenance)."""
    unknown = set(values) - set(PRESET_KEYS)
    if unknown:
        raise ValueError(f"not loader preset keys: {sorted(unknown)}")
    data = {"defaults": ["default", "_self_"], **values}
    if measured_on is not None:
        data["measured_on"] = measured_on
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    usage, *rest = header_lines or [""]
    header = "\n".join(f"# {line}".rstrip() for line in rest)
    return f"# {usage}\n{marker}\n{header}\n{body}"


def write_preset(path: Path, text: str, overwrite: bool, verify) -> None:
    """Write ``text`` to ``path`` atomically; if ``verify()`` fails, put the old file back."""
    check_writable(path, overwrite)
    old = path.read_text() if path.exists() else None
    atomic_write_text(path, text)
    try:
        verify()
    except Exception:
        if old is None:
            path.unlink(missing_ok=True)
        else:
            atomic_write_text(path, old)
        raise


def compose_back(script: str | Path, name: str, extra: list[str]) -> dict:
    """Compose ``loader=<name>`` as a user would, in a fresh process; return the loader node."""
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            f"loader={name}",
            *extra,
            "--cfg",
            "job",
            "--package",
            "loader",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise ConfigError(f"the written preset loader={name} does not compose: {proc.stderr}")
    node = yaml.safe_load(proc.stdout)
    return node.get("loader", node) if isinstance(node, dict) else {}


def preset_values(loader: dict, with_batch_size: bool) -> dict:
    """The keys a preset records: the worker settings (and batch size if it was tuned)."""
    keys = [k for k in PRESET_KEYS if k != "batch_size" or with_batch_size]
    # PyTorch's own thread counts go unsaid: a preset moved to a bigger machine gets its default
    values = {k: loader[k] for k in keys if k in loader and not _default_threads(k, loader[k])}
    if not values.get("per_rank"):  # unsaid: the machine's workers, as every preset before it
        values.pop("per_rank", None)
    return values


def _default_threads(key: str, value: Any) -> bool:
    if key not in ("worker_threads", "main_threads"):
        return False
    return value is None or value == default_threads()[f"loader.{key}"]
