"""Presets that travel: where a preset was tuned (its ``measured_on``), how this machine and
workload differ from that, and ``loader=auto``, which picks the preset that fits here
(docs/design.md, "Presets that travel")."""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import yaml
from omegaconf import DictConfig, OmegaConf

from feedrate import distributed
from feedrate.config import LoaderConfig
from feedrate.errors import ConfigError
from feedrate.hardware import Fingerprint, Hardware, memory_allocation
from feedrate.project import command
from feedrate.targets import own_parts

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


def workload_facts(cfg: DictConfig, precision: str, ranks_per_node: int = 1) -> dict:
    """The dataset and model, and how they are fed: the batch size, the precision, and the
    training processes on the node (each with its own loader, all on the same cores)."""
    facts = {
        "dataset": _node_facts(cfg.dataset),
        "model": _node_facts(cfg.model),
        "batch_size": int(cfg.loader.batch_size),
        "precision": precision,
        "ranks_per_node": ranks_per_node,
    }
    return {**facts, **own_parts(cfg)}


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
        "workload": workload_facts(
            composed,
            precision(metrics["run"]["amp_dtype"]),
            metrics["run"].get("ranks_per_node", 1),
        ),
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
    for key in ("step", "collate_fn"):  # the user's own; absent or null: the defaults
        if tuned.get(key) != here.get(key):
            found.append(f"{key} {_short(tuned.get(key))} -> {_short(here.get(key))}")
    ranks = (tuned.get("ranks_per_node", 1), here.get("ranks_per_node", 1))  # 1: presets before
    if ranks[0] != ranks[1]:
        found.append(f"ranks_per_node {ranks[0]} -> {ranks[1]}")
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
    command: tuple[str, ...] = ()  # the command line's overrides that make this workload

    @classmethod
    def of(cls, cfg: DictConfig, fp: Fingerprint, hw: Hardware, overrides=()) -> Here:
        # not the loader (the sweep searches it), nor how long this run trains (the sweep's
        # trials set their own), nor where it writes
        own = ("loader=", "loader.", "+loader.", "hydra.", "sweep", "trainer.", "+trainer.")
        # but the workload's own parts are: the step, the collate function and their keys
        parts = ("trainer.measure=", "trainer.step", "+trainer.step.", "loader.collate_fn")
        parts += ("+loader.collate_fn.",)
        command = tuple(o for o in overrides if not o.startswith(own) or o.startswith(parts))
        ranks = distributed.from_env().local_world_size
        workload = workload_facts(cfg, precision(hw.amp_dtype), ranks)
        return cls(machine_facts(fp), workload, command)

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
    ranks = here.workload.get("ranks_per_node", 1)
    as_run = [f"sweep.ranks_per_node={ranks}"] if ranks > 1 else []  # the job as it runs
    where = "elsewhere" if machine else "on another workload"
    return (
        f"loader={name} was measured {where}: {'; '.join(parts)}. Its settings may be wrong"
        f" here; tune for this machine and workload: {command(sweep=True)}"
        f" sweep.preset_name={name}_here {' '.join([*as_run, *here.command]) or '[your overrides]'}"
    ).rstrip()


# ---------------------------------------------------------------------------------------------
# loader=auto


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text()) or {}
    return data if isinstance(data, dict) else {}


Dirs = Path | Sequence[Path]  # a preset directory, or several: the first holding a name wins


def _dirs(directory: Dirs) -> list[Path]:
    return [directory] if isinstance(directory, Path) else list(directory)


def preset_file(directory: Dirs, name: str) -> Path:
    """``<name>.yaml`` in the first of the directories that holds it (else the first's)."""
    dirs = _dirs(directory)
    return next(
        (d / f"{name}.yaml" for d in dirs if (d / f"{name}.yaml").exists()),
        dirs[0] / f"{name}.yaml",
    )


def preset_node(directory: Dirs, name: str, seen: tuple[str, ...] = ()) -> dict:
    """The preset ``name`` of ``directory`` with its defaults (other presets) merged in; of
    several directories, each name from the first that holds it (a project's, then
    feedrate's packaged presets)."""
    if name in seen:
        raise ConfigError(f"loader preset {name} includes itself: {' -> '.join([*seen, name])}")
    data = _load(preset_file(directory, name))
    merged = OmegaConf.create()
    own = {k: v for k, v in data.items() if k != "defaults"}
    for entry in data.get("defaults") or ["_self_"]:
        part = own if entry == "_self_" else preset_node(directory, entry, (*seen, name))
        merged = OmegaConf.merge(merged, part)
    if "_self_" not in (data.get("defaults") or ["_self_"]):
        merged = OmegaConf.merge(merged, own)
    return OmegaConf.to_container(merged)


def check_composes(path: Path, values: dict[str, Any]) -> None:
    """The preset at ``path``, its defaults (other presets: its own folder's, then
    feedrate's) merged onto the loader's schema as a run does, composes to ``values``."""
    from feedrate.project import packaged_config_dir

    dirs = [path.parent, packaged_config_dir() / "loader"]
    composed = OmegaConf.merge(OmegaConf.structured(LoaderConfig), preset_node(dirs, path.stem))
    for key, value in values.items():
        got = composed.get(key)
        got = getattr(got, "value", got)  # an enum's value (the start method)
        if got != value:
            raise ConfigError(
                f"the written preset loader={path.stem} composes to {key}={got!r}, not {value!r}"
            )


def _distance(c: _Candidate) -> float:
    """How far a preset's machine and workload are from this one's: a factor of two in
    cores counts 1, another GPU 2, each setting of the workload that differs 1."""
    tuned, here = c.measured_on["machine"], c.here.machine
    cores = abs(math.log2(max(tuned["usable_cores"], 0.5) / max(here["usable_cores"], 0.5)))
    return cores + 2 * ("GPU" in c.machine) + len(c.workload)


def _memory_here_mb() -> float:
    """MB this machine (or the job's allocation) holds: the same on every rank of a node,
    where the memory still free is not."""
    allocated = memory_allocation()
    return allocated[0] * 1024 if allocated else psutil.virtual_memory().total / 2**20


def does_not_fit(settings: dict, measured_on: dict, has_cuda: bool, memory_mb: float) -> str | None:
    """Why a preset's settings cannot run here (``memory_mb``: :func:`_memory_here_mb`)."""
    if settings.get("decode") == "device" and not has_cuda:
        return "it decodes on the GPU, and this machine has none"
    peak = measured_on.get("peak_pss_mb")
    budget = memory_mb * 0.8
    if peak and peak > budget:
        return f"it needed {peak:,.0f} MB, and 80% of the memory here is {budget:,.0f} MB"
    method = settings.get("multiprocessing_context")
    if method:
        import multiprocessing

        if method not in multiprocessing.get_all_start_methods():
            return f"its start method {method} is not available here"
    return None


@dataclass(frozen=True)
class _Candidate:
    name: str
    measured_on: dict
    settings: dict
    here: Here  # this run as the preset would run it (with the preset's batch size)
    machine: list[str]  # what differs
    workload: list[str]


def _candidates(directory: Dirs, here: Here, batch_size_asked: bool) -> list[_Candidate]:
    """The presets of ``directory`` that say where they were measured; one that cannot be
    read is left out, with a warning naming it."""
    found = []
    names = sorted({p.stem for d in _dirs(directory) for p in d.glob("*.yaml")})
    for path in (preset_file(directory, name) for name in names):
        if path.stem == "auto":
            continue
        try:
            measured_on = _load(path).get("measured_on")
            if measured_on is None:
                continue  # written by hand
            settings = preset_node(directory, path.stem)
            mine = here
            if "batch_size" in settings and not batch_size_asked:  # it carries its own
                mine = Here(here.machine, {**here.workload, "batch_size": settings["batch_size"]})
            machine, workload = mine.differences(measured_on)
        except (
            yaml.YAMLError,
            ConfigError,
            OSError,  # unreadable, or a default it names is missing
            ValueError,  # UnicodeDecodeError
            KeyError,
            TypeError,
            AttributeError,
        ) as exc:
            log.warning(
                "loader=auto leaves out %s: its measured_on cannot be read (%s: %s)",
                path,
                type(exc).__name__,
                exc,
            )
            continue
        found.append(_Candidate(path.stem, measured_on, settings, mine, machine, workload))
    return found


def catalogue(directory: Dirs, here: Here, has_cuda: bool) -> list[dict]:
    """Every loader preset of ``directory`` (the first of a name), for ``feedrate presets``:
    its file, where and when it was measured and at what rate, and what it means here."""
    measured = {c.name: c for c in _candidates(directory, here, False)}
    memory_mb = _memory_here_mb()
    rows = []
    names = sorted({p.stem for d in _dirs(directory) for p in d.glob("*.yaml")})
    for name in names:
        path, c = preset_file(directory, name), measured.get(name)
        row = {"name": name, "path": str(path), "measured_on": None, "here": _said(path)}
        if c is not None:
            try:
                problem = does_not_fit(c.settings, c.measured_on, has_cuda, memory_mb)
            except (TypeError, ValueError) as exc:
                problem = f"its measured_on cannot be read ({type(exc).__name__}: {exc})"
            differs = [*c.machine, *(w.split(" ", 1)[0] for w in c.workload)]
            row["measured_on"] = c.measured_on
            row["here"] = (
                f"does not fit: {problem}"
                if problem
                else f"measured elsewhere: {', '.join(differs)} differ"
                if differs
                else "measured on this machine and workload"
            )
        rows.append(row)
    return rows


def _said(path: Path) -> str:
    """What a preset without ``measured_on`` says of itself: its header's first sentence
    (a preset feedrate wrote whose ``measured_on`` cannot be read says so)."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, ValueError) as exc:
        return f"cannot be read ({type(exc).__name__}: {exc})"
    if any(ln.startswith("# feedrate-preset:") for ln in lines[:3]):
        return "written by feedrate, and its measured_on cannot be read (see the warning)"
    words = " ".join(ln.lstrip("# ").strip() for ln in lines[1:6] if ln.startswith("#"))
    first = words.split(". ")[0].split(": ")[0].rstrip(".")
    return f"by hand: {first}" if first else "written by hand"


def pick(
    directory: Dirs, here: Here, has_cuda: bool, batch_size_asked: bool = False
) -> tuple[str, str]:
    """The preset for this machine and workload, and why: the fastest measured on both that
    fits; otherwise the closest that fits; otherwise ``recipe``."""
    name, why, _ = _pick(directory, here, has_cuda, batch_size_asked)
    return name, why


def _pick(
    directory: Dirs, here: Here, has_cuda: bool, batch_size_asked: bool
) -> tuple[str, str, bool]:
    """:func:`pick`, and whether the preset was measured on this machine and workload."""
    found = _candidates(directory, here, batch_size_asked)
    memory_mb = _memory_here_mb()
    fits = {c.name: does_not_fit(c.settings, c.measured_on, has_cuda, memory_mb) for c in found}
    best = _fastest_here(found, fits)
    if best is not None:
        rate = best.measured_on.get("samples_per_sec")
        figures = f"{rate:,.0f} samples/s, " if rate else ""
        return (
            best.name,
            f"measured on this machine and workload ({figures}{best.measured_on.get('date', '?')})",
            True,
        )
    # nearest first; at one distance, the faster
    for c in sorted(
        found, key=lambda c: (_distance(c), -(c.measured_on.get("samples_per_sec") or 0))
    ):
        if fits[c.name] is None:
            differs = ", ".join([*c.machine, *(w.split(" ", 1)[0] for w in c.workload)])
            tuned_on = describe_machine(c.measured_on["machine"])
            return (
                c.name,
                f"the closest preset that fits: tuned on {tuned_on} (differs in {differs});"
                f" tune for this machine with {command(sweep=True)}",
                False,
            )
    refused = [f"{n}: {why}" for n, why in fits.items() if why]
    none = "no preset was measured here" + (f"; {'; '.join(refused)}" if refused else "")
    return FALLBACK, f"{none}; tune for this machine with {command(sweep=True)}", False


def _fastest_here(found: list[_Candidate], fits: dict[str, str | None]) -> _Candidate | None:
    """Of the presets measured on this machine and workload that fit, the fastest (a sweep
    under a memory budget and one without: the faster that fits here)."""
    same = [c for c in found if not c.machine and not c.workload and fits[c.name] is None]
    return max(same, key=lambda c: c.measured_on.get("samples_per_sec") or 0) if same else None


def measured_here(directory: Dirs, here: Here, has_cuda: bool) -> tuple[str, dict, dict] | None:
    """The fastest preset measured on this machine and workload that fits here, as (name,
    settings, measured_on); None if there is none (``loader=autotune`` then searches)."""
    # at this run's batch size (a preset's own is not applied: the run trains with its own)
    found = _candidates(directory, here, True)
    memory_mb = _memory_here_mb()
    fits = {c.name: does_not_fit(c.settings, c.measured_on, has_cuda, memory_mb) for c in found}
    best = _fastest_here(found, fits)
    if best is None or not best.measured_on.get("samples_per_sec"):
        return None
    return best.name, best.settings, best.measured_on


def asked_loader_keys(overrides) -> set[str]:
    """The ``loader.*`` keys a command line's ``overrides`` set."""
    keys = (o.split("=", 1)[0].lstrip("+~") for o in overrides)
    return {k.split(".")[1] for k in keys if k.startswith("loader.")}


def settle(
    cfg: DictConfig,
    directory: Dirs,
    here: Here,
    has_cuda: bool,
    name: str | None,
    asked: set[str] | None = None,
    say: bool = True,
) -> tuple[str, str]:
    """``loader=auto`` replaced in ``cfg`` by the preset it picks, with the ``loader.*`` keys
    the command line ``asked`` for on top (None: those that differ from auto's own); or a
    warning when the preset in use was measured elsewhere. Returns the preset's name and
    that line (logged when ``say``); the line is empty when there is nothing to say."""
    if cfg.loader.auto:
        if asked is None:
            base = OmegaConf.merge(
                OmegaConf.structured(LoaderConfig), preset_node(directory, "auto")
            )
            asked = {k for k, v in cfg.loader.items() if v != base.get(k)}
        keys = {k: cfg.loader[k] for k in asked if k in cfg.loader and k != "auto"}
        name, why, measured = _pick(directory, here, has_cuda, "batch_size" in keys)
        tune = {} if measured or not can_tune(cfg) else {"autotune": True}
        cfg.loader = OmegaConf.merge(
            OmegaConf.structured(LoaderConfig), preset_node(directory, name), tune, keys
        )
        line = f"loader=auto picked loader={name}: {why}"
        if tune:  # every first run is tuned, and its choice is the preset the next one picks
            start = why.split("; tune for this machine")[0]
            line = (
                f"loader=auto: no preset was measured on this machine and workload, so this run"
                f" tunes its loader as it trains (loader=autotune), from loader={name}"
                f" ({start}); its choice is written as the preset the next loader=auto picks"
            )
        if say:
            log.info(line)
        return name, line
    name = name or "<preset>"
    line = ""
    if cfg.loader.measured_on is not None:
        measured_on = OmegaConf.to_container(cfg.loader.measured_on, resolve=True)
        line = travel_warning(name, measured_on, here) or ""
        if line and say:
            log.warning(line)
    return name, line


def can_tune(cfg: DictConfig) -> bool:
    """The run can tune its loader as it trains (``loader=autotune``): not a stream repeated
    without epochs (``trainer.stream``), and not with the tuning switched off."""
    trainer = cfg.get("trainer")
    if trainer is None or trainer.get("stream"):
        return False
    budget = (trainer.get("autotune") or {}).get("budget_s")
    return budget is None or budget > 0


def preset_wait(cfg: DictConfig, here: Here) -> float | None:
    """The data-wait share the loader preset was measured with, when it was measured on this
    machine and workload (a reference of the drift guard); else None."""
    if cfg.loader.measured_on is None:
        return None
    measured_on = OmegaConf.to_container(cfg.loader.measured_on, resolve=True)
    return measured_on.get("data_wait_frac") if here.differences(measured_on) == ([], []) else None
