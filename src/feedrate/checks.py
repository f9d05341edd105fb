"""Checks made before anything runs: values types cannot express, and picklable datasets.

Schemas (``feedrate.config``) already refused unknown keys and wrong types at composition.
What is left are values that are well-typed but cannot work, which PyTorch would report
late (after workers start) or not at all.
"""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig

from feedrate.config import METRIC_NAMES
from feedrate.dataset import GuardedDataset, RunSplit
from feedrate.errors import ConfigError
from feedrate.targets import own_parts

# Dataset keys that are counts or sizes, across the built-in datasets.
_POSITIVE_DATASET_KEYS = (
    "n_images",
    "n_samples",
    "image_size",
    "stored_size",
    "num_classes",
    "channels",
    "jpeg_quality",
)
_NON_NEGATIVE_DATASET_KEYS = ("io_latency_ms", "cpu_ms", "slowdown_after_s", "slowdown_ms")
_POSITIVE_MODEL_KEYS = ("width", "grid")


def _value(v: Any) -> Any:
    return getattr(v, "value", v)  # Enum members print as their config value


def start_method(loader: DictConfig) -> str:
    """The start method the DataLoader's workers will use."""
    if loader.multiprocessing_context is not None:
        return _value(loader.multiprocessing_context)
    return multiprocessing.get_start_method(allow_none=False)


def _loader_problems(loader: DictConfig) -> Iterable[str]:
    if loader.batch_size < 1:
        yield f"loader.batch_size={loader.batch_size} must be at least 1"
    if loader.num_workers < 0:
        yield (
            f"loader.num_workers={loader.num_workers} must be 0 (load in the main process) or more"
        )
    if loader.timeout < 0:
        yield f"loader.timeout={loader.timeout} must be 0 (wait forever) or positive (seconds)"
    if loader.prefetch_factor is not None and loader.prefetch_factor < 1:
        yield f"loader.prefetch_factor={loader.prefetch_factor} must be at least 1, or null"
    threads = loader.get("worker_threads")
    if loader.num_workers > 0 and threads and threads > 1 and start_method(loader) == "fork":
        # measured: a forked worker's first parallel matmul never returned (torch 2.14, Linux)
        yield (
            f"loader.worker_threads={threads} with fork workers: OpenMP's thread pool does"
            " not survive fork, so a forked worker that runs more than one thread after the"
            " main process has used its own hangs. Use loader.multiprocessing_context="
            "forkserver (or spawn), or loader.worker_threads=1"
        )
    if _value(loader.get("engine") or "process") == "thread" and loader.num_workers == 0:
        yield (
            "loader.engine=thread needs workers but loader.num_workers=0: set"
            " loader.num_workers > 0 (threads that read the samples), or drop it"
        )
    if loader.num_workers == 0:
        fix = "set loader.num_workers > 0, or drop it"
        if loader.prefetch_factor is not None:
            yield (
                f"loader.prefetch_factor={loader.prefetch_factor} needs worker processes but"
                f" loader.num_workers=0: {fix} (loader.prefetch_factor=null)"
            )
        if loader.persistent_workers:
            yield (
                "loader.persistent_workers=true needs worker processes but loader.num_workers=0:"
                f" {fix} (loader.persistent_workers=false)"
            )
        if loader.worker_threads is not None:
            yield (
                f"loader.worker_threads={loader.worker_threads} applies to worker processes but"
                f" loader.num_workers=0: {fix} (loader.worker_threads=null)"
            )
        if loader.timeout > 0:
            yield (
                f"loader.timeout={loader.timeout} applies to worker processes but"
                f" loader.num_workers=0: {fix} (loader.timeout=0)"
            )
        if loader.multiprocessing_context is not None:
            yield (
                f"loader.multiprocessing_context={_value(loader.multiprocessing_context)} needs"
                f" worker processes but loader.num_workers=0: {fix}"
                " (loader.multiprocessing_context=null)"
            )
    if loader.multiprocessing_context is not None:
        method = _value(loader.multiprocessing_context)
        available = multiprocessing.get_all_start_methods()
        if method not in available:
            yield (
                f"loader.multiprocessing_context={method} is not available on this OS;"
                f" available: {', '.join(available)}"
            )


def _dataset_problems(dataset: DictConfig) -> Iterable[str]:
    for key in _POSITIVE_DATASET_KEYS:
        v = dataset.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
            yield f"dataset.{key}={v} must be positive"
    if dataset.get("on_error", "raise") not in ("raise", "skip"):
        yield f"dataset.on_error={dataset.on_error!r} must be 'raise' or 'skip'"
    for key in _NON_NEGATIVE_DATASET_KEYS:
        v = dataset.get(key)
        if isinstance(v, (int, float)) and v < 0:
            yield f"dataset.{key}={v} must be 0 or more"


def _trainer_problems(trainer: DictConfig) -> Iterable[str]:
    if trainer.max_steps is None and trainer.epochs is None:
        yield "trainer.max_steps and trainer.epochs are both null: set at least one"
    for key in ("max_steps", "epochs", "window_steps", "checkpoint_every", "drift_windows"):
        v = trainer[key]
        if v is not None and v < 1:
            yield f"trainer.{key}={v} must be at least 1"
    if trainer.warmup_steps < 1:
        yield (
            f"trainer.warmup_steps={trainer.warmup_steps} must be at least 1: the first step"
            " pays for start-up (workers, allocator, autotuning) and is never measured"
        )
    if trainer.stream and trainer.epochs is not None:
        yield (
            "trainer.stream=true has no epochs to count: use trainer.max_steps or"
            " trainer.max_seconds, and trainer.epochs=null"
        )
    if trainer.max_seconds is not None and trainer.max_seconds <= 0:
        yield f"trainer.max_seconds={trainer.max_seconds} must be positive, or null"
    if trainer.resume and not trainer.save_checkpoint:
        yield (
            "trainer.resume=true with trainer.save_checkpoint=false would continue a run and"
            " then drop its state: set trainer.save_checkpoint=true"
        )
    if trainer.drift_rise is not None and not 0 < trainer.drift_rise < 1:
        yield (
            f"trainer.drift_rise={trainer.drift_rise} must be a share of step time in (0, 1),"
            " or null (no drift guard)"
        )
    if trainer.lr <= 0:
        yield f"trainer.lr={trainer.lr} must be positive"
    if not 0 <= trainer.val_fraction < 1:
        yield f"trainer.val_fraction={trainer.val_fraction} must be in [0, 1)"


def _model_problems(model: DictConfig) -> Iterable[str]:
    """Sizes of the built-in models (a user's model class checks its own arguments)."""
    for key in _POSITIVE_MODEL_KEYS:
        v = model.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            yield f"model.{key}={v} must be at least 1"


def validate(cfg: DictConfig) -> None:
    """Raise one ConfigError listing every value in ``cfg`` that cannot work."""
    problems = [
        *_loader_problems(cfg.loader),
        *_dataset_problems(cfg.dataset),
        *_trainer_problems(cfg.trainer),
        *_model_problems(cfg.model),
    ]
    for key, value in (
        ("hardware.torch_threads", cfg.hardware.torch_threads),
        ("loader.worker_threads", cfg.loader.worker_threads),
        ("loader.main_threads", cfg.loader.main_threads),
    ):
        if value is not None and value < 1:
            problems.append(f"{key}={value} must be at least 1, or null (the default)")
    decode = getattr(cfg.loader.get("decode"), "value", cfg.loader.get("decode"))
    if decode == "device" and own_parts(cfg).get("collate_fn"):
        problems.append(
            "loader.decode=device hands your collate function JPEG bytes, and decodes the"
            " batch it makes as (images, labels): use loader.decode=cpu with"
            f" loader.collate_fn._target_={own_parts(cfg)['collate_fn']}"
        )
    every = cfg.trainer.get("memory_sample_s")
    if every is not None and every <= 0:
        problems.append(
            f"trainer.memory_sample_s={every} must be positive, or null (memory read only"
            " before and after the measured window)"
        )
    limit = cfg.hardware.memory_limit_gb
    if limit is not None and limit <= 0:
        problems.append(
            f"hardware.memory_limit_gb={limit} must be positive, or null (90% of the memory"
            " available at the start)"
        )
    if cfg.objective not in METRIC_NAMES:
        problems.append(
            f"objective={cfg.objective!r} is not a metric; choose one of {', '.join(METRIC_NAMES)}"
        )
    elif cfg.objective.startswith("val_") and cfg.trainer.val_fraction <= 0:
        problems.append(
            f"objective={cfg.objective} needs a held-out split: set trainer.val_fraction (e.g. 0.1)"
        )
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))


# ---------------------------------------------------------------------------------------------
# Picklability: spawn and forkserver workers receive the dataset by pickling it.


def _children(obj: Any, path: str) -> Iterable[tuple[str, Any]]:
    if isinstance(obj, dict):
        return ((f"{path}[{k!r}]", v) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    attrs = dict(getattr(obj, "__dict__", {}))
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            attrs[slot] = getattr(obj, slot)
    return ((f"{path}.{k}", v) for k, v in attrs.items())


def find_unpicklable(obj: Any, path: str = "dataset", depth: int = 0) -> tuple[str, Any] | None:
    """The deepest attribute path under ``obj`` that fails to pickle, and its value.

    Returns None when ``obj`` pickles. Walks attributes, dict values and sequence items, and
    stops at the first failing leaf, so the message can name ``dataset.index.lock``.
    """
    try:
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return None
    except Exception:  # noqa: BLE001 - any pickling failure is what we are looking for
        pass
    if depth < 12:
        for child_path, child in _children(obj, path):
            found = find_unpicklable(child, child_path, depth + 1)
            if found is not None:
                return found
    return path, obj


def type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def unpicklable(dataset: Any) -> str | None:
    """What keeps ``dataset`` from pickling, as ``dataset.index.lock: _thread.lock``; None when
    it pickles. The wrappers a run adds (the sample-error guard, the train/validation subset)
    are looked through, so the path starts at the user's own object."""
    while isinstance(dataset, (GuardedDataset, RunSplit)):
        dataset = dataset.dataset
    found = find_unpicklable(dataset)
    if found is None:
        return None
    path, value = found
    return f"{path}: {type_name(value)}"


def check_picklable(dataset: Any, method: str) -> None:
    """Refuse, before spawning, a dataset that ``spawn``/``forkserver`` workers cannot receive."""
    if method == "fork":
        return
    found = unpicklable(dataset)
    if found is None:
        return
    raise ConfigError(
        f"dataset is not picklable for start method '{method}': {found} cannot be pickled."
        f" Workers started with '{method}' receive the dataset by pickling."
        " Open such handles lazily in the worker (in __getitem__ or a worker_init_fn) and drop"
        " them in __getstate__, or use loader.multiprocessing_context=fork where the OS allows it"
    )
