"""Loader presets: the one place they are written, by the sweep, ``loader=autotune`` and
``feedrate.autotune_loader`` alike. Plain data (the DataLoader's own arguments, nothing Hydra
would import and call), a header that says how the choice was measured, ``measured_on`` (where:
feedrate.provenance reads it), written atomically, read back through the composition a run
does and put back as it was if that fails; never over a preset that feedrate did not write
(unless asked). Where presets live: :func:`feedrate.project.preset_file`."""

from __future__ import annotations

import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from feedrate.errors import ConfigError
from feedrate.files import atomic_write_text
from feedrate.project import NAME
from feedrate.tuning.policy import PROCESS, Choice, Figure, Setting

log = logging.getLogger("feedrate.tuning")

MARKER = "# feedrate-preset: written by `python train.py -m sweep=loader`"
AUTOTUNE_MARKER = "# feedrate-preset: written by `python train.py loader=autotune`"
LOADER_MARKER = "# feedrate-preset: written by feedrate.autotune_loader"
# Keys a preset may set: the DataLoader's own, as in LoaderConfig. Nothing executable.
PRESET_KEYS = (
    "batch_size",
    "num_workers",
    "engine",
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
        if not (isinstance(entry, str) and NAME.match(entry)):
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


def _composes(path: Path, values: dict[str, Any]) -> None:
    """The written preset is plain data, and composes back to ``values`` as a run's config
    does (feedrate.provenance, which reads presets as Hydra composes them)."""
    from feedrate.provenance import check_composes

    check_plain_data(path)
    check_composes(path, values)


def write_checked(
    path: Path,
    values: dict[str, Any],
    header: list[str],
    measured_on: dict | None,
    *,
    marker: str,
    overwrite: bool,
) -> None:
    """Write the preset ``values`` to ``path`` and check it composes back to them (the old file
    put back if not); ConfigError or OSError says why it was not written."""
    write_preset(
        path,
        render(values, header, measured_on, marker),
        overwrite,
        lambda: _composes(path, values),
    )


def figure_of(choice: Choice, figures: list[Figure]) -> Figure | None:
    """The best figure the chosen setting measured (a preset records what was measured)."""
    mine = [f for f in figures if f.setting == choice.setting and f.ok]
    return max(mine, key=lambda f: f.samples_per_sec, default=None)


def measured_in_run(machine: dict, workload: dict, figure: Figure, **more: Any) -> dict:
    """``measured_on`` of a choice measured inside a run: the machine, the workload, its
    figures and the date (and ``more``: where it was measured)."""
    return {
        "machine": machine,
        "workload": workload,
        "samples_per_sec": round(figure.samples_per_sec, 1),
        "data_wait_frac": round(figure.data_wait_frac, 3),
        "date": datetime.now().isoformat(timespec="seconds"),
        **more,
    }


def preset_setting(data: dict, path: Path | str) -> Setting:
    """The setting a preset records (``num_workers``, ``prefetch_factor``, ``engine``); an
    engine it cannot run on is named with the file."""
    workers = int(data.get("num_workers") or 0)
    engine = data.get("engine") or PROCESS
    depth = data.get("prefetch_factor") if workers else None
    try:
        return Setting(workers, depth, engine, data.get("main_threads") or None)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}; fix its engine: key") from exc


def setting_values(setting: Setting) -> dict[str, Any]:
    """The keys a tuning loader's choice sets: its workers, their queue depth, what runs them,
    and the training process's threads where the tuner turned them."""
    values: dict[str, Any] = {"num_workers": setting.num_workers}
    if setting.num_workers:
        values["prefetch_factor"] = setting.depth
        values["engine"] = setting.engine
    if setting.main_threads:
        values["main_threads"] = setting.main_threads
    return values


class LoaderPreset:
    """The preset ``feedrate.autotune_loader(..., preset=PATH)`` starts from and writes."""

    def __init__(self, path: str | Path, workload: dict) -> None:
        self.path, self.workload = Path(path), workload
        if self.path.suffix not in (".yaml", ".yml"):
            raise ConfigError(f"autotune_loader: preset={str(path)!r} must be a .yaml file")
        check_writable(self.path, overwrite=False, keys="autotune_loader: preset")
        self.machine = _machine()

    def start_from(self, start: Setting) -> tuple[Setting, float | None]:
        """The preset's setting and the rate it recorded, where it was measured on this
        machine and workload; else ``start`` (and the preset is searched again)."""
        if not self.path.exists():
            return start, None
        from feedrate.provenance import machine_differences

        data = yaml.safe_load(self.path.read_text()) or {}
        measured = data.get("measured_on") or {}
        tuned_on = measured.get("machine")
        machine = machine_differences(tuned_on, self.machine) if tuned_on else ["machine"]
        workload = measured.get("workload") != self.workload
        if machine or workload:
            differs = ", ".join([*machine, *(["workload"] if workload else [])])
            log.warning(
                "autotune_loader: %s was measured elsewhere (%s differ): searching from %s",
                self.path,
                differs,
                start.describe(),
            )
            return start, None
        setting = preset_setting(data, self.path)
        log.info("autotune_loader: starting from %s (%s)", self.path, setting.describe())
        return setting, measured.get("samples_per_sec")

    def write(self, choice: Choice, figures: list[Figure]) -> str | None:
        """The choice, as a preset that also composes as ``conf/loader/<name>.yaml``."""
        figure = figure_of(choice, figures)
        if figure is None:
            return None
        header = [
            f"feedrate.autotune_loader(..., preset={str(self.path)!r}) starts from it",
            f"Decision: {choice.reason}.",
        ]
        measured = measured_in_run(self.machine, self.workload, figure)
        try:
            write_checked(
                self.path,
                setting_values(choice.setting),
                header,
                measured,
                marker=LOADER_MARKER,
                overwrite=False,
            )
        except (ConfigError, OSError) as exc:
            log.warning("autotune_loader could not write %s: %s", self.path, exc)
            return None
        log.info("autotune_loader wrote %s (%s)", self.path, choice.setting.describe())
        return str(self.path)


def _machine() -> dict:
    from feedrate.hardware import detect
    from feedrate.provenance import machine_facts

    return machine_facts(detect())
