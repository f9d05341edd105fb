"""The preset a tuning loader writes and starts from next time: the settings it chose, and
where they were measured (``measured_on``). Written only when the choice measured faster than
the start; never over a file feedrate did not write."""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path

import yaml

from feedrate.errors import ConfigError
from feedrate.tuning.policy import Choice, Figure, Setting

log = logging.getLogger("feedrate.tuning")

MARKER = "# feedrate-preset: written by feedrate.autotune_loader"


class LoaderPreset:
    def __init__(self, path: str | Path, workload: dict) -> None:
        from feedrate.sweep.preset import check_writable

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
        workers = int(data.get("num_workers") or 0)
        setting = Setting(workers, data.get("prefetch_factor") if workers else None)
        log.info("autotune_loader: starting from %s (%s)", self.path, setting.describe())
        return setting, measured.get("samples_per_sec")

    def write(self, choice: Choice, figures: list[Figure]) -> str | None:
        """The choice, as a preset that also composes as ``conf/loader/<name>.yaml``."""
        from feedrate.sweep.preset import render, write_preset

        mine = [f for f in figures if f.setting == choice.setting and f.ok]
        if not mine:
            return None
        figure = max(mine, key=lambda f: f.samples_per_sec)
        values = {"num_workers": choice.setting.num_workers}
        if choice.setting.num_workers:
            values["prefetch_factor"] = choice.setting.depth
        measured = {
            "machine": self.machine,
            "workload": self.workload,
            "samples_per_sec": round(figure.samples_per_sec, 1),
            "data_wait_frac": round(figure.data_wait_frac, 3),
            "date": datetime.now().isoformat(timespec="seconds"),
        }
        header = [
            f"feedrate.autotune_loader(..., preset={str(self.path)!r}) starts from it",
            MARKER[2:],
            f"Decision: {choice.reason}.",
        ]
        text = render(values, header, measured, marker=MARKER)
        text = text.replace(f"{MARKER}\n{MARKER}\n", f"{MARKER}\n")

        def verify() -> None:
            back = yaml.safe_load(self.path.read_text())
            if any(back.get(k) != v for k, v in values.items()):
                raise ConfigError(f"{self.path} does not read back as {values}")

        try:
            write_preset(self.path, text, overwrite=False, verify=verify)
        except (ConfigError, OSError) as exc:
            log.warning("autotune_loader could not write %s: %s", self.path, exc)
            return None
        log.info("autotune_loader wrote %s (%s)", self.path, choice.setting.describe())
        return str(self.path)


def _machine() -> dict:
    from feedrate.hardware import detect
    from feedrate.provenance import machine_facts

    return machine_facts(detect())
