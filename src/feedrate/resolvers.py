"""OmegaConf resolvers that conf/sweep/loader.yaml uses: names derived from the machine and
the workload, so the same command resumes the same study."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from feedrate import hardware
from feedrate.targets import own_parts


def default_preset_name(ranks_per_node: int = 1) -> str:
    """``tuned_<cores>core_<cpu|gpu model>``, e.g. ``tuned_2core_cpu``, ``tuned_16core_h200``;
    ``_<N>ranks`` after it for a sweep of ``sweep.ranks_per_node`` N, whose preset is each
    rank's (the one-process preset of the same machine is another, and stays)."""
    fp = hardware.detect()
    cores = int(fp.usable_cores)
    ranks = f"_{ranks_per_node}ranks" if ranks_per_node > 1 else ""
    if fp.gpu_name:
        words = [w for w in fp.gpu_name.lower().replace("-", " ").split() if w != "nvidia"]
        numbered = [w for w in words if any(c.isdigit() for c in w)]
        model = (numbered or words or ["gpu"])[0]
        return f"tuned_{cores}core_{model}{ranks}"
    return f"tuned_{cores}core_cpu{ranks}"


def workload_key(root: DictConfig) -> str:
    """A short hash of the workload and how it is measured: dataset, model, hardware, batch
    size, trainer settings and objective.

    Part of the study name, so the same command resumes its study and a different workload
    (another dataset, another latency) starts a new one.
    """
    parts = {
        "dataset": OmegaConf.to_container(root.dataset, resolve=True, enum_to_str=True),
        "model": OmegaConf.to_container(root.model, resolve=True, enum_to_str=True),
        "hardware": OmegaConf.to_container(root.hardware, resolve=True, enum_to_str=True),
        "batch_size": root.loader.batch_size,
        "tune_batch_size": bool(root.sweep and root.sweep.tune_batch_size),
        # How trials are measured and what they return: results under other settings differ.
        "trainer": OmegaConf.to_container(root.trainer, resolve=True, enum_to_str=True),
        "objective": root.objective,
    }
    # the step and collate function: only the user's own, so a study of before keeps its name
    parts["trainer"].pop("step", None)
    parts.update(own_parts(root))
    ranks = int((root.get("sweep") or {}).get("ranks_per_node") or 1)
    if ranks > 1:  # per-rank trials are another study (one-process studies keep their names)
        parts["ranks_per_node"] = ranks
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:8]


def preset_name(*, _root_: DictConfig) -> str:
    return default_preset_name(int((_root_.get("sweep") or {}).get("ranks_per_node") or 1))


def workload(*, _root_: DictConfig) -> str:
    return workload_key(_root_)


def abspath(path: str) -> str:
    """``path`` made absolute (and created), so a SQLite URL does not depend on the cwd."""
    directory = Path(path).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    return str(directory)


def study_name(*, _root_: DictConfig) -> str:
    return f"loader-{_root_.sweep.preset_name}-{workload_key(_root_)}"


def study_storage(*, _root_: DictConfig) -> str:
    """``sweep.storage`` when set (a shared database or journal file), else a SQLite file
    under ``sweep.study_dir`` named after the study."""
    if _root_.sweep.get("storage"):
        return str(_root_.sweep.storage)
    return f"sqlite:///{abspath(_root_.sweep.study_dir)}/{study_name(_root_=_root_)}.db"


def config_groups() -> str:
    """The groups and their options, as ``python train.py --help`` lists them: Hydra's list
    without the schemas (``*_schema`` check an option's keys; they are not options)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    if not GlobalHydra.instance().is_initialized():
        return ""
    loader = GlobalHydra.instance().config_loader()
    lines = []
    for group in sorted(loader.list_groups("")):
        options = loader.get_group_options(group, ObjectType.CONFIG)
        options = [o for o in options if not o.endswith("_schema")]
        if group != "hydra" and options:
            lines.append(f"{group}: {', '.join(options)}")
    return "\n".join(lines)


def register_resolvers() -> None:
    for name, fn, cache in [
        ("feedrate_config_groups", config_groups, False),
        ("feedrate_preset_name", preset_name, False),
        ("feedrate_study_name", study_name, False),
        ("feedrate_study_storage", study_storage, False),
        ("feedrate_workload", workload, False),
        ("feedrate_abspath", abspath, False),
    ]:
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_resolver(name, fn, use_cache=cache)
