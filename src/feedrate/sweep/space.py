"""What the loader sweep searches: bounds from the hardware fingerprint (not capped at the
core count: a worker waiting on I/O holds no core), the seeds tried first, conditional
parameters, and the checks a sweep's command line gets before anything runs."""

from __future__ import annotations

import functools
import logging
import multiprocessing
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf

from feedrate import hardware, stats
from feedrate.checks import unpicklable
from feedrate.dataset import build_dataset
from feedrate.errors import ConfigError
from feedrate.tuning.policy import worker_bound as machine_worker_bound

# the search's parameters that the climb steps and the decision compares
WORKERS, DEPTH, ENGINE = "loader.num_workers", "loader.prefetch_factor", "loader.engine"

if TYPE_CHECKING:  # optuna takes a second to import; trial processes load this module too
    import optuna

log = logging.getLogger(__name__)


def ranks_per_node(cfg: DictConfig) -> int:
    """The training processes a trial runs on this node (``sweep.ranks_per_node``): the
    search is per rank, each rank's share of the node's bounds."""
    return max(1, int((cfg.get("sweep") or {}).get("ranks_per_node") or 1))


def max_workers(cfg: DictConfig) -> int:
    """Upper bound for ``num_workers`` (each rank's, with ``sweep.ranks_per_node``): not
    the core count.

    A worker blocked on storage or network latency holds no core, so latency-bound data keeps
    scaling far past the cores (the sleep-10-ms dataset on 2 cores peaks at 32+ workers). The
    memory guard, not this bound, keeps a large count from running the machine out of memory.
    """
    ranks = ranks_per_node(cfg)
    node = machine_worker_bound(hardware.usable_cores())
    bound = cfg.sweep.max_workers or max(1, node // ranks)
    shards = shard_count(cfg)
    if shards is not None and ranks > 1:
        shards = max(1, shards // ranks)  # the ranks split the shards first
    if shards is not None and shards < bound:
        _warn_once(
            f"num_workers searched up to {shards}, the stream's shard count (a rank's): a"
            f" stream splits by shard, so a worker past the {shards}th has none to read"
            " <cfg.dataset>"
        )
        return shards
    return bound


def shard_count(cfg: DictConfig) -> int | None:
    """The shards a stream splits its work by (``dataset.n_shards``, or the built dataset's
    ``num_shards``), or None: no such bound."""
    dataset = cfg.get("dataset")
    if not dataset or "_target_" not in dataset:
        return None
    if dataset.get("n_shards"):
        return int(dataset.n_shards)
    if str(dataset._target_).startswith("feedrate."):  # its shards, if any, are in the config
        return None
    return _shards(OmegaConf.to_yaml(dataset))  # a user's dataset may say num_shards


@functools.lru_cache(maxsize=8)
def _shards(dataset_yaml: str) -> int | None:
    shards = getattr(_built(dataset_yaml), "num_shards", None)
    return shards if isinstance(shards, int) and shards > 0 else None


SEED_LADDER = (1, 4, 16)  # the first trials' num_workers, in multiples of the cores


def seed_workers(cfg: DictConfig) -> list[int]:
    """The worker counts a new study tries first: the core count (what CPU-capped tuners
    pick) and rungs far past it, where latency-bound data peaks (32 workers on 2 cores for the
    10 ms dataset); ``sweep.max_workers`` bounds them too. With ``sweep.ranks_per_node``,
    a rank's share of the cores."""
    cores = rank_cores(ranks_per_node(cfg))
    top = max_workers(cfg)
    return sorted({min(top, k * cores) for k in SEED_LADDER})


def rank_cores(ranks: int = 1) -> int:
    """A rank's share of the usable cores with ``ranks`` on the node, at least one."""
    return max(1, int(hardware.usable_cores()) // ranks)


def in_space(params: dict[str, Any], space: dict[str, Any]) -> dict[str, Any]:
    """Those of ``params`` a trial of the search ``space`` (name -> Optuna distribution) can
    take: its keys, within its ranges. A setting a run started with may leave a key unset or
    hold a value the search does not have, and a resumed study's trials may come from a
    wider space than this sweep's; Optuna refuses such a fixed value when the trial is asked."""
    kept = {}
    for key, value in params.items():
        if key not in space or value is None:
            continue
        try:
            if space[key]._contains(space[key].to_internal_repr(value)):
                kept[key] = value
        except (ValueError, TypeError):
            pass
    return kept


FALLING = 0.95  # a seed below this share of the best is clearly slower, not noise


def worker_bound(
    seeds: list[int], best_at: dict[int, float], loader_falls_at: int | None = None
) -> tuple[int, str] | None:
    """The most workers still worth searching, and why; None while the seeds do not show it.

    ``best_at``: the best figure measured at each worker count so far. When every seed above
    the best trial's worker count ran and is clearly slower than it (below ``FALLING``), the
    rate falls past them: decoding that competes for the cores (photos on 2 cores: 644
    samples/s at 2 workers, 570 at 8, 567 at 32, a 46-worker trial no better than 7 workers
    and 50 s of start-up a run). Counts past the first such seed are then not searched.
    The first seed above the best is enough when the loader alone fell there too
    (``loader_falls_at``, from the ceiling's loader-only runs): two measurements, not one
    noisy run, say the rate falls, and the seeds past it are not run (photos: 25 s)."""
    if not best_at:
        return None
    best_workers = max(best_at, key=lambda n: best_at[n])
    best = best_at[best_workers]
    above = [n for n in sorted(set(seeds)) if n > best_workers]
    falling = [n for n in above if n in best_at and best_at[n] < FALLING * best]
    if not above or above[0] not in falling:
        return None
    if len(falling) < len(above) and (loader_falls_at is None or loader_falls_at > above[0]):
        return None
    shown = ", ".join(f"{n} workers {best_at[n]:,.0f}" for n in falling)
    also = " and so is the loader alone" if len(falling) < len(above) else ""
    return above[0], (
        f"the seeds past {best_workers} workers ({best:,.0f} samples/s) are clearly slower"
        f" ({shown}){also}, so no more than {above[0]} workers are searched"
    )


def seed_settings(cfg: DictConfig) -> dict[str, Any]:
    """What the seeds share, so they differ in the worker count alone: the loader the sweep
    started from (prefetch 2 where it sets none) and its start method, pinned as the hardware
    profile says. Left to chance, one seed ran unpinned on an H200 and won a noisy search run."""
    loader, methods = cfg.loader, start_methods(cfg)
    out: dict[str, Any] = {"loader.prefetch_factor": min(8, loader.prefetch_factor or 2)}
    if "process" not in engines(cfg):  # sweep.engines=[thread]: the seeds are threads
        out["loader.engine"] = "thread"
        if torch.cuda.is_available():
            out["loader.pin_memory"] = bool(cfg.hardware.pin_memory)
        return out
    out["loader.engine"] = "process"  # the DataLoader's; the search tries threads
    if not cfg.trainer.stream:
        out["loader.persistent_workers"] = bool(loader.persistent_workers)
    context = loader.multiprocessing_context
    out["loader.multiprocessing_context"] = context if context in methods else methods[0]
    if torch.cuda.is_available():
        out["loader.pin_memory"] = bool(cfg.hardware.pin_memory)
    return out


def start_methods(cfg: DictConfig) -> list[str]:
    """The start methods to search: those in ``sweep.start_methods`` that this OS has.

    The start method changes start-up cost (a spawned worker imports torch and unpickles the
    dataset), not steady-state throughput, so by default only the platform's own is searched;
    ``sweep.start_methods=[fork,forkserver,spawn]`` adds the others.
    """
    available = multiprocessing.get_all_start_methods()
    wanted = list(cfg.sweep.start_methods) or [multiprocessing.get_start_method()]
    methods = [m for m in wanted if m in available]
    if "fork" in available and any(m != "fork" for m in methods):
        found = _unpicklable(OmegaConf.to_yaml(cfg.dataset))
        if found is not None:
            dropped = [m for m in methods if m != "fork"]
            methods = ["fork"]
            _warn_once(
                f"dataset is not picklable ({found} cannot be pickled):"
                f" {', '.join(dropped)} workers could not receive it, so the search drops"
                " those start methods and runs fork trials only <cfg.sweep.start_methods>"
            )
    return methods or [multiprocessing.get_start_method()]


def engines(cfg: DictConfig) -> list[str]:
    """The engines to search (``sweep.engines``): thread workers only where the dataset can be
    read by threads (:func:`feedrate.threads.check_engine`), said once where not."""
    wanted = [str(getattr(e, "value", e)) for e in (cfg.sweep.get("engines") or ["process"])]
    if "thread" in wanted:
        why = _thread_refusal(OmegaConf.to_yaml(cfg.dataset))
        if why is not None:
            wanted = [e for e in wanted if e != "thread"]
            _warn_once(f"{why}: the search leaves thread workers out <cfg.sweep.engines>")
    return wanted or ["process"]


def streamed(cfg: DictConfig) -> bool:
    """Is the sweep's dataset a stream (an iterable dataset: its batches say no costs)?"""
    from feedrate.stream import is_stream

    dataset = cfg.get("dataset")
    if not dataset or "_target_" not in dataset:
        return False
    return is_stream(_built(OmegaConf.to_yaml(dataset)))


@functools.lru_cache(maxsize=2)
def _built(dataset_yaml: str) -> Any:
    """The dataset a sweep's config names, built once for every question the search space asks
    of it (its shards, whether it pickles, whether threads can read it)."""
    return build_dataset(OmegaConf.create(dataset_yaml))


@functools.lru_cache(maxsize=8)
def _thread_refusal(dataset_yaml: str) -> str | None:
    from feedrate.threads import check_engine

    try:
        check_engine(_built(dataset_yaml))
    except ConfigError as exc:
        return str(exc).split(". ")[0]
    return None


@functools.lru_cache(maxsize=8)
def _unpicklable(dataset_yaml: str) -> str | None:
    """What keeps the dataset from pickling (``dataset.index.lock: _thread.lock``), or None;
    once per dataset config, since the search space asks at every trial."""
    return unpicklable(_built(dataset_yaml))


@functools.lru_cache(maxsize=32)
def _warn_once(message: str) -> None:
    log.warning("%s", message)


def loader_search_space(cfg: DictConfig, trial: optuna.trial.Trial) -> None:
    """Suggest the loader's parameters for one trial (``hydra.sweeper.custom_search_space``).

    ``num_workers`` is log-uniform from 1 to :func:`max_workers`; the worker-only parameters are
    always suggested with it, so every trial states them all and none is inherited from the
    preset the sweep started from (the thread counts, when not searched, are). The engine
    (:func:`engines`) comes first: a start method and persistence are suggested for worker
    processes only. ``num_workers=0``
    is PyTorch's default, measured as a baseline. ``pin_memory`` is searched only when there is
    a CUDA device to pin for; the threads only where :func:`search_threads` says.
    """
    trial.suggest_int("loader.num_workers", 1, max_workers(cfg), log=True)
    trial.suggest_int("loader.prefetch_factor", 1, 8, log=True)
    # asked only where there is a choice (or threads alone): else the loader's own, processes
    choices = engines(cfg)
    processes = choices == ["process"]
    if not processes:
        processes = trial.suggest_categorical("loader.engine", choices) == "process"
    # streaming has no epoch ends, where persistence pays off; threads start in microseconds
    if not cfg.trainer.stream and processes:
        trial.suggest_categorical("loader.persistent_workers", [True, False])
    context = None  # thread workers: no process to start
    if processes:
        context = trial.suggest_categorical("loader.multiprocessing_context", start_methods(cfg))
    if torch.cuda.is_available():
        trial.suggest_categorical("loader.pin_memory", [True, False])
    # decode placement is built into the workload: a trial's, not a running loader's
    if cfg.sweep.get("search_decode", True) and search_decode(cfg):
        trial.suggest_categorical("loader.decode", ["cpu", "device"])
    if cfg.sweep.tune_batch_size:
        trial.suggest_categorical("loader.batch_size", list(cfg.sweep.batch_sizes))
    if search_threads(cfg):
        threads = max_threads(ranks_per_node(cfg))
        trial.suggest_int("loader.main_threads", 1, threads, log=True)
        if context not in (None, "fork"):  # forked workers hang on more than one: checks.py
            trial.suggest_int("loader.worker_threads", 1, threads, log=True)


# Datasets whose workers can hand over JPEG bytes (feedrate.decode.bytes_only)
BYTES_DATASETS = (
    "feedrate.dataset.build_photos",
    "feedrate.dataset.build_image_folder",
    "feedrate.stream.build_webdataset",
)


def search_decode(cfg: DictConfig) -> bool:
    """Search where JPEGs are decoded? With a GPU to decode them on, for datasets of JPEGs."""
    dataset = cfg.get("dataset") or {}
    return torch.cuda.is_available() and dataset.get("_target_") in BYTES_DATASETS


def max_threads(ranks: int = 1) -> int:
    """Upper bound of the thread counts searched: the usable cores, or PyTorch's own default
    where that is more (it counts the machine's cores, not this job's share); a rank's share
    of that with ``ranks`` on the node."""
    return max(1, max(int(hardware.usable_cores()), hardware.pytorch_threads()) // ranks)


def default_threads(ranks: int = 1) -> dict[str, int]:
    """PyTorch's thread counts: one a worker, its default in the main process
    (``OMP_NUM_THREADS`` if set), a rank's share of it with ``ranks`` on the node."""
    main = max(1, hardware.pytorch_threads() // ranks)
    return {"loader.worker_threads": 1, "loader.main_threads": main}


def on_gpu(cfg: DictConfig) -> bool:
    """Does the model train on a GPU (a CUDA device here, and the hardware profile's)?"""
    device = str(getattr(cfg.hardware.device, "value", cfg.hardware.device))
    return device != "cpu" and torch.cuda.is_available()


def search_threads(cfg: DictConfig) -> bool:
    """Search the workers' and the main process's threads? Where the model trains on the
    CPU the workers use (``sweep.search_threads: null``), as they split the cores between
    them; not on a GPU, where the main process only feeds the device, nor with
    ``trainer.measure=loader``, nor on one core."""
    wanted = cfg.sweep.get("search_threads")
    if wanted is not None:
        return bool(wanted)
    measure = getattr(cfg.trainer.measure, "value", cfg.trainer.measure)
    return not on_gpu(cfg) and measure == "train" and hardware.usable_cores() >= 2


SEARCHED = (
    "loader.num_workers",
    "loader.engine",
    "loader.prefetch_factor",
    "loader.persistent_workers",
    "loader.multiprocessing_context",
    "loader.pin_memory",
)


THREADS = ("loader.worker_threads", "loader.main_threads", "hardware.torch_threads")
# settings of worker processes, which a preset of thread workers leaves out
PROCESS_ONLY = ("multiprocessing_context", "worker_threads", "persistent_workers")


def check_sweep(config: DictConfig) -> None:
    """Refuse sweep settings that cannot work, before any trial runs."""
    s = config.sweep
    problems = []
    for key in ("finalists", "final_rounds"):
        if s[key] < 1:
            problems.append(f"sweep.{key}={s[key]} must be at least 1")
    if 1 <= s.final_rounds < stats.MIN_ROUNDS:
        log.warning(
            "sweep.final_rounds=%d: with fewer than %d rounds no contestant can be shown faster"
            " than another, so the cheapest one measured wins <cfg.sweep.final_rounds>",
            s.final_rounds,
            stats.MIN_ROUNDS,
        )
    if not 0 <= s.finalist_within < 1:
        problems.append(f"sweep.finalist_within={s.finalist_within} must be between 0 and 1")
    if not 0 < s.equivalence < 1:
        problems.append(f"sweep.equivalence={s.equivalence} must be between 0 and 1")
    if s.final_seconds <= 0:
        problems.append(f"sweep.final_seconds={s.final_seconds} must be positive")
    if s.get("budget_s") is not None and s.budget_s <= 0:
        problems.append(f"sweep.budget_s={s.budget_s} must be positive, or null (no bound)")
    if s.memory_budget_gb is not None and s.memory_budget_gb <= 0:
        problems.append(f"sweep.memory_budget_gb={s.memory_budget_gb} must be positive, or null")
    if s.max_workers is not None and s.max_workers < 1:
        problems.append(f"sweep.max_workers={s.max_workers} must be at least 1, or null (auto)")
    ranks = s.get("ranks_per_node", 1)
    if ranks < 1:
        problems.append(f"sweep.ranks_per_node={ranks} must be at least 1")
    elif ranks > 1 and on_gpu(config) and ranks > torch.cuda.device_count():
        problems.append(
            f"sweep.ranks_per_node={ranks} but {torch.cuda.device_count()} GPU(s) here: each"
            " rank drives its own GPU (NCCL refuses two ranks on one); set it to at most"
            f" {torch.cuda.device_count()}, or tune on the CPU with hardware=cpu"
        )
    if (
        ranks > 1
        and config.loader.get("per_rank") is False
        and any(a.startswith("loader.per_rank=") for a in config.hydra.overrides.task)
    ):
        problems.append(
            f"loader.per_rank=false with sweep.ranks_per_node={ranks}: the search is each"
            " rank's settings (every trial runs loader.per_rank=true); leave it out"
        )
    unknown = [m for m in s.start_methods if m not in ("fork", "forkserver", "spawn")]
    if unknown:
        problems.append(f"sweep.start_methods has {unknown}: choose from fork, forkserver, spawn")
    if any(b < 1 for b in s.batch_sizes):
        problems.append(f"sweep.batch_sizes={list(s.batch_sizes)} must all be at least 1")
    launcher = str(config.hydra.launcher.get("_target_", ""))
    if not launcher.endswith("FeedrateTrialLauncher"):
        problems.append(
            f"hydra.launcher is {launcher.rsplit('.', 1)[-1]}: the loader sweep measures"
            " throughput one trial at a time on the machine it runs on (trials sharing a host"
            " corrupt each other's figures), so it needs hydra/launcher=feedrate_trial. On a"
            " cluster, run the whole sweep inside one allocation per machine type:"
            " srun --exclusive python train.py -m sweep=loader"
        )
    if config.loader.auto:
        problems.append(
            "loader=auto picks a preset when a run starts, and the sweep searches the loader"
            " itself: start the sweep from loader=default or a named preset"
        )
    searched = [*SEARCHED, *(["loader.batch_size"] if s.tune_batch_size else [])]
    searched += THREADS if search_threads(config) else ()
    searched += ["loader.decode"] if search_decode(config) else []
    for arg in config.hydra.overrides.task:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in searched:
            problems.append(
                f"{arg} fixes a key the loader sweep searches: drop it from the command line"
                " (to start from a preset, select it with loader=<name>"
                + (
                    "; to keep the threads as they are, sweep.search_threads=false)"
                    if key in THREADS
                    else ")"
                )
            )
    if problems:
        raise ConfigError("invalid sweep:\n  - " + "\n  - ".join(problems))


def preset_values(loader: dict, with_batch_size: bool) -> dict:
    """The keys a sweep's preset records of its winner's loader: the worker settings (and the
    batch size if it was tuned)."""
    from feedrate.tuning.preset import PRESET_KEYS

    keys = [k for k in PRESET_KEYS if k != "batch_size" or with_batch_size]
    # PyTorch's own thread counts go unsaid: a preset moved to a bigger machine gets its default
    values = {k: loader[k] for k in keys if k in loader and not _default_threads(k, loader[k])}
    if getattr(values.get("engine"), "value", values.get("engine")) == "thread":
        for key in PROCESS_ONLY:  # threads have no process to start, keep or thread
            values.pop(key, None)
    if not values.get("per_rank"):  # unsaid: the machine's workers, as every preset before it
        values.pop("per_rank", None)
    return values


def _default_threads(key: str, value: Any) -> bool:
    if key not in ("worker_threads", "main_threads"):
        return False
    return value is None or value == default_threads()[f"loader.{key}"]
