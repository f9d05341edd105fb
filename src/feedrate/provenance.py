"""Presets that travel: where a preset was tuned (its ``measured_on``), how this machine and
workload differ from that, and ``loader=auto``, which picks the preset that fits here
(docs/design.md, "Presets that travel")."""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf

from feedrate.config import LoaderConfig
from feedrate.errors import ConfigError
from feedrate.hardware import Fingerprint, Hardware, available_memory

log = logging.getLogger(__name__)

FALLBACK = "recipe"  # what loader=auto runs when no preset fits
RAM_TOLERANCE = 0.15  # machines whose RAM differs by less are alike (what the OS reports drifts)
_PRECISION = {"None": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
# Settings that say where the data is, not what it is
_PLACES = ("root", "photos_root", "path", "log_dir", "on_error")


def machine_facts(fp: Fingerprint) -> dict:
    return {
        "usable_cores": fp.usable_cores,
        "ram_gb": round(fp.ram_gb, 1),
        "shm_gb": None if fp.shm_gb is None else round(fp.shm_gb, 1),
        "gpu_name": fp.gpu_name if fp.gpu_count else None,
        "gpu_count": fp.gpu_count,
        "cpu_model": fp.cpu_model,
    }


def _node_facts(node: DictConfig) -> dict:
    """A dataset's or model's target and scalar settings, without where its files are."""
    data = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    facts = {"target": data.get("_target_")}  # named so: a preset holds no key Hydra calls
    for key, value in data.items():
        if key.startswith("_") or key in _PLACES:
            continue
        if value is None or isinstance(value, (str, int, float, bool)):
            facts[key] = value
    return facts


def workload_facts(cfg: DictConfig, precision: str) -> dict:
    return {
        "dataset": _node_facts(cfg.dataset),
        "model": _node_facts(cfg.model),
        "batch_size": int(cfg.loader.batch_size),
        "precision": precision,
    }


def precision(amp_dtype: torch.dtype | str | None) -> str:
    """``fp32``, ``bf16`` or ``fp16`` for the run's autocast dtype (or its ``str``)."""
    return _PRECISION.get(str(amp_dtype), str(amp_dtype))


def measured_on(cfg: DictConfig, job_dir: Path, results: list[dict], samples_per_sec: float):
    """The provenance of a preset from its winner's run: the machine and workload its
    environment.json and metrics.json recorded, and the figures of its runs (``results``:
    their metrics)."""
    environment = json.loads((job_dir / "environment.json").read_text())
    metrics = json.loads((job_dir / "metrics.json").read_text())
    composed = OmegaConf.load(job_dir / ".hydra" / "config.yaml")
    waits = [m["data_wait_frac"] for m in results if m.get("data_wait_frac") is not None]
    peaks = [m["peak_pss_mb"] for m in results if m.get("peak_pss_mb")]
    return {
        "machine": machine_facts(Fingerprint(**environment["fingerprint"])),
        "workload": workload_facts(composed, precision(metrics["run"]["amp_dtype"])),
        "samples_per_sec": round(samples_per_sec, 1),
        "data_wait_frac": round(statistics.median(waits), 3) if waits else None,
        "peak_pss_mb": round(max(peaks)) if peaks else None,
        "date": metrics["run"].get("date", ""),
        "study": cfg.hydra.sweeper.study_name,
    }


def describe_machine(m: dict) -> str:
    gpu = f"{m['gpu_count']}x {m['gpu_name']}" if m.get("gpu_count") else "no GPU"
    return f"{m['usable_cores']:g} cores, {gpu}, {m['ram_gb']:.0f} GB RAM"


def machine_differences(tuned: dict, here: dict) -> list[str]:
    """What differs between the machine a preset was tuned on and this one, as words."""
    found = []
    if not math.isclose(tuned["usable_cores"], here["usable_cores"], rel_tol=0.01):
        found.append("cores")
    if (tuned.get("gpu_name"), tuned.get("gpu_count", 0)) != (here["gpu_name"], here["gpu_count"]):
        found.append("GPU")
    if not math.isclose(tuned["ram_gb"], here["ram_gb"], rel_tol=RAM_TOLERANCE):
        found.append("RAM")
    return found


def workload_differences(tuned: dict, here: dict) -> list[str]:
    """``key tuned -> here`` for each setting of the workload that differs."""
    found = []
    for part in ("dataset", "model"):
        mine, theirs = here[part], tuned.get(part) or {}
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                found.append(f"{part}.{key} {_short(theirs.get(key))} -> {_short(mine.get(key))}")
    for key in ("batch_size", "precision"):
        if tuned.get(key) != here[key]:
            found.append(f"{key} {tuned.get(key)} -> {here[key]}")
    return found


def _short(value: Any) -> str:
    if isinstance(value, str) and "." in value and "/" not in value:
        return value.rsplit(".", 1)[1]  # a target: its name
    return "-" if value is None else str(value)


@dataclass(frozen=True)
class Here:
    """This run's machine and workload, as a preset's provenance records them."""

    machine: dict
    workload: dict

    @classmethod
    def of(cls, cfg: DictConfig, fp: Fingerprint, hw: Hardware) -> Here:
        return cls(machine_facts(fp), workload_facts(cfg, precision(hw.amp_dtype)))

    def differences(self, measured_on: dict) -> tuple[list[str], list[str]]:
        return (
            machine_differences(measured_on["machine"], self.machine),
            workload_differences(measured_on["workload"], self.workload),
        )


def travel_warning(name: str, measured_on: dict, here: Here) -> str | None:
    """One line naming how this machine and workload differ from the preset's, and the
    command that tunes for them; None when they do not."""
    machine, workload = here.differences(measured_on)
    if not machine and not workload:
        return None
    parts = []
    if machine:
        parts.append(
            f"tuned on {describe_machine(measured_on['machine'])}; this machine:"
            f" {describe_machine(here.machine)}"
        )
    if workload:
        parts.append(f"the workload differs ({', '.join(workload)})")
    return (
        f"loader={name} was measured elsewhere: {'; '.join(parts)}. Its settings may be wrong"
        f" here; tune for this machine and workload: python train.py -m sweep=loader"
        f" sweep.preset_name={name}_here <your overrides>"
    )


# ---------------------------------------------------------------------------------------------
# loader=auto


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text()) or {}
    return data if isinstance(data, dict) else {}


def preset_node(directory: Path, name: str, seen: tuple[str, ...] = ()) -> dict:
    """The preset ``name`` of ``directory`` with its defaults (other presets) merged in."""
    if name in seen:
        raise ConfigError(f"loader preset {name} includes itself: {' -> '.join([*seen, name])}")
    data = _load(directory / f"{name}.yaml")
    merged = OmegaConf.create()
    own = {k: v for k, v in data.items() if k != "defaults"}
    for entry in data.get("defaults") or ["_self_"]:
        part = own if entry == "_self_" else preset_node(directory, entry, (*seen, name))
        merged = OmegaConf.merge(merged, part)
    if "_self_" not in (data.get("defaults") or ["_self_"]):
        merged = OmegaConf.merge(merged, own)
    return OmegaConf.to_container(merged)


def _distance(measured_on: dict, here: Here) -> float:
    """How far the preset's machine and workload are from this one's: a factor of two in
    cores counts 1, another GPU 2, each setting of the workload that differs 1."""
    tuned = measured_on["machine"]
    cores = abs(math.log2(max(tuned["usable_cores"], 0.5) / max(here.machine["usable_cores"], 0.5)))
    machine = machine_differences(tuned, here.machine)
    return (
        cores
        + 2 * ("GPU" in machine)
        + len(workload_differences(measured_on["workload"], here.workload))
    )


def does_not_fit(settings: dict, measured_on: dict, has_cuda: bool) -> str | None:
    """Why a preset's settings cannot run here, or None."""
    if settings.get("decode") == "device" and not has_cuda:
        return "it decodes on the GPU, and this machine has none"
    peak = measured_on.get("peak_pss_mb")
    budget = available_memory() / 2**20 * 0.8
    if peak and peak > budget:
        return f"it needed {peak:,.0f} MB, and 80% of the memory available here is {budget:,.0f} MB"
    method = settings.get("multiprocessing_context")
    if method:
        import multiprocessing

        if method not in multiprocessing.get_all_start_methods():
            return f"its start method {method} is not available here"
    return None


def pick(directory: Path, here: Here, has_cuda: bool) -> tuple[str, str]:
    """The preset for this machine and workload, and why: one measured on both; otherwise the
    closest that fits; otherwise ``recipe``."""
    found = []
    for path in sorted(directory.glob("*.yaml")):
        measured_on = _load(path).get("measured_on")
        if path.stem != "auto" and isinstance(measured_on, dict):
            found.append((path.stem, measured_on))
    same = [
        (n, m)
        for n, m in found
        if here.differences(m) == ([], [])
        and does_not_fit(preset_node(directory, n), m, has_cuda) is None
    ]
    if same:  # a sweep under a memory budget and one without: the faster that fits here
        name, measured_on = max(same, key=lambda f: f[1].get("samples_per_sec") or 0)
        rate = measured_on.get("samples_per_sec")
        return name, (
            f"measured on this machine and workload ({rate:,.0f} samples/s,"
            f" {measured_on.get('date', '?')})"
            if rate
            else f"measured on this machine and workload ({measured_on.get('date', '?')})"
        )
    refused = []
    # nearest first; at one distance, the faster
    nearest = sorted(
        found, key=lambda f: (_distance(f[1], here), -(f[1].get("samples_per_sec") or 0))
    )
    for name, measured_on in nearest:
        why = does_not_fit(preset_node(directory, name), measured_on, has_cuda)
        if why is None:
            machine, workload = here.differences(measured_on)
            differs = ", ".join([*machine, *(w.split(" ", 1)[0] for w in workload)])
            return name, (
                f"the closest preset that fits: tuned on {describe_machine(measured_on['machine'])}"
                f" (differs in {differs}); tune for this machine with python train.py -m"
                " sweep=loader"
            )
        refused.append(f"{name}: {why}")
    none = "no preset was measured here" + (f"; {'; '.join(refused)}" if refused else "")
    return FALLBACK, f"{none}; tune for this machine with python train.py -m sweep=loader"


def settle(cfg: DictConfig, directory: Path, here: Here, has_cuda: bool, name: str | None) -> str:
    """``loader=auto`` replaced in ``cfg`` by the preset it picks (the command line's
    ``loader.*`` keys still win), or one warning when the preset in use was measured
    elsewhere. Returns the preset's name."""
    if cfg.loader.auto:
        name, why = pick(directory, here, has_cuda)
        base = OmegaConf.merge(OmegaConf.structured(LoaderConfig), preset_node(directory, "auto"))
        asked = {k: v for k, v in cfg.loader.items() if k != "auto" and v != base.get(k)}
        picked = OmegaConf.merge(
            OmegaConf.structured(LoaderConfig), preset_node(directory, name), asked
        )
        cfg.loader = picked
        log.info("loader=auto picked loader=%s: %s", name, why)
        return name
    name = name or "<preset>"
    if cfg.loader.measured_on is not None:
        measured_on = OmegaConf.to_container(cfg.loader.measured_on, resolve=True)
        warning = travel_warning(name, measured_on, here)
        if warning:
            log.warning(warning)
    return name
