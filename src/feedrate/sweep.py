"""``python train.py -m sweep=loader``: tune the DataLoader by measuring, then write a preset.

Hydra's Optuna sweeper runs the study (TPE, one trial at a time, SQLite storage so a second
run resumes it); ``hydra/launcher=feedrate_trial`` runs each trial in a fresh process with a
time limit. This module adds what a throughput study needs around that:

- the search space, with bounds from the hardware fingerprint and not capped at the core count
  (a worker waiting on I/O holds no core), and conditional parameters (``loader_search_space``);
- a callback that measures the ceilings and seeds the study before it (the trial launcher
  stops the search near the ceiling); after it, re-measures the best candidates and the
  baselines (PyTorch's default, ``recipe``, the preset the user selected) in alternating
  rounds, folds contestants with the same resolved settings into one, lets the cheapest of
  those not significantly slower than the fastest win (``decide``, :mod:`feedrate.stats`),
  says where the winner's gap to the ceiling is, and writes the preset, ``best_config.yaml``,
  ``final_decision.yaml``, ``trials.csv``, ``sweep_report.md`` and plots (``LoaderSweep``).
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from feedrate import ceiling, environment, hardware, stats
from feedrate.checks import unpicklable
from feedrate.dataset import build_dataset
from feedrate.errors import ConfigError, FeedrateError
from feedrate.files import atomic_write_text
from feedrate.preset import (
    PRESET_KEYS,
    check_plain_data,
    check_writable,
    compose_back,
    preset_path,
    render,
)
from feedrate.preset import write_preset as write_preset_file
from feedrate.study import fail_unfinished
from feedrate.study import lock as lock_study
from feedrate.trial import TrialResult, run_trial

if TYPE_CHECKING:  # optuna takes a second to import; trial processes load this module too
    import optuna

log = logging.getLogger("feedrate.sweep")

# enqueue_trial and friends are "experimental" in optuna 2.x, and IntLogUniformDistribution
# warns about its `step`; neither is actionable for a user of the sweep.
warnings.filterwarnings("ignore", message=r".* is experimental \(supported from")
warnings.filterwarnings("ignore", message="Samplers and other components in Optuna")

BASELINES = ("default", "recipe")


# ---------------------------------------------------------------------------------------------
# Bounds from the fingerprint


def max_workers(cfg: DictConfig) -> int:
    """Upper bound for ``num_workers``: not the core count.

    A worker blocked on storage or network latency holds no core, so latency-bound data keeps
    scaling far past the cores (the sleep-10-ms dataset on 2 cores peaks at 32+ workers). The
    memory guard, not this bound, keeps a large count from running the machine out of memory.
    """
    if cfg.sweep.max_workers:
        return cfg.sweep.max_workers
    return int(min(256, max(64, 8 * hardware.usable_cores())))


SEED_LADDER = (1, 4, 16)  # the first trials' num_workers, in multiples of the cores


def seed_workers(cfg: DictConfig) -> list[int]:
    """The worker counts a new study tries first: the core count (what CPU-capped tuners
    pick) and rungs far past it, where latency-bound data peaks (32 workers on 2 cores for the
    10 ms dataset); ``sweep.max_workers`` bounds them too."""
    cores = max(1, int(hardware.usable_cores()))
    top = max_workers(cfg)
    return sorted({min(top, k * cores) for k in SEED_LADDER})


def seed_settings(cfg: DictConfig) -> dict[str, Any]:
    """What the seeds share, so they differ in the worker count alone: the loader the sweep
    started from (prefetch 2 where it sets none) and its start method, pinned as the hardware
    profile says. Left to chance, one seed ran unpinned on an H200 and won a noisy search run."""
    loader, methods = cfg.loader, start_methods(cfg)
    out: dict[str, Any] = {"loader.prefetch_factor": min(8, loader.prefetch_factor or 2)}
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


@functools.lru_cache(maxsize=8)
def _unpicklable(dataset_yaml: str) -> str | None:
    """What keeps the dataset from pickling (``dataset.index.lock: _thread.lock``), or None;
    once per dataset config, since the search space asks at every trial."""
    return unpicklable(build_dataset(OmegaConf.create(dataset_yaml)))


@functools.lru_cache(maxsize=32)
def _warn_once(message: str) -> None:
    log.warning("%s", message)


def loader_search_space(cfg: DictConfig, trial: optuna.trial.Trial) -> None:
    """Suggest the loader's parameters for one trial (``hydra.sweeper.custom_search_space``).

    ``num_workers`` is log-uniform from 1 to :func:`max_workers`; the worker-only parameters are
    always suggested with it, so every trial states them all and none is inherited from the
    preset the sweep started from (the thread counts, when not searched, are). ``num_workers=0``
    is PyTorch's default, measured as a baseline. ``pin_memory`` is searched only when there is
    a CUDA device to pin for; the threads only where :func:`search_threads` says.
    """
    trial.suggest_int("loader.num_workers", 1, max_workers(cfg), log=True)
    trial.suggest_int("loader.prefetch_factor", 1, 8, log=True)
    if not cfg.trainer.stream:  # streaming has no epoch ends, where persistence pays off
        trial.suggest_categorical("loader.persistent_workers", [True, False])
    context = trial.suggest_categorical("loader.multiprocessing_context", start_methods(cfg))
    if torch.cuda.is_available():
        trial.suggest_categorical("loader.pin_memory", [True, False])
    if cfg.sweep.tune_batch_size:
        trial.suggest_categorical("loader.batch_size", list(cfg.sweep.batch_sizes))
    if search_threads(cfg):
        trial.suggest_int("loader.main_threads", 1, max_threads(), log=True)
        if context != "fork":  # forked workers hang on more than one thread: checks.py
            trial.suggest_int("loader.worker_threads", 1, max_threads(), log=True)


def max_threads() -> int:
    """Upper bound of the thread counts searched: the usable cores, or PyTorch's own default
    where that is more (it counts the machine's cores, not this job's share)."""
    return max(1, int(hardware.usable_cores()), torch.get_num_threads())


def default_threads() -> dict[str, int]:
    """PyTorch's thread counts: one a worker, its default in the main process
    (``OMP_NUM_THREADS`` if set)."""
    return {"loader.worker_threads": 1, "loader.main_threads": torch.get_num_threads()}


def search_threads(cfg: DictConfig) -> bool:
    """Search the workers' and the main process's threads? Where the model trains on the
    CPU the workers use (``sweep.search_threads: null``), as they split the cores between
    them; not on a GPU, where the main process only feeds the device, nor with
    ``trainer.measure=loader``, nor on one core."""
    wanted = cfg.sweep.get("search_threads")
    if wanted is not None:
        return bool(wanted)
    device = str(getattr(cfg.hardware.device, "value", cfg.hardware.device))
    on_cpu = device == "cpu" or not torch.cuda.is_available()
    measure = getattr(cfg.trainer.measure, "value", cfg.trainer.measure)
    return on_cpu and measure == "train" and hardware.usable_cores() >= 2


# ---------------------------------------------------------------------------------------------
# The final re-measurement and the decision


def resolved_settings(metrics: dict, stream: bool) -> dict | None:
    """What a run's DataLoader really ran with, as far as throughput can tell (None: unknown).

    Two contestants with the same resolved settings are one configuration measured twice, not
    a comparison: ``pin_memory`` is off without CUDA, ``prefetch_factor: null`` is 2, and the
    worker-only settings mean nothing without workers; ``persistent_workers`` does nothing
    while streaming (no epoch ends).
    """
    run = (metrics or {}).get("run") or {}
    loader = run.get("loader")
    if not loader:
        return None
    out = {
        "batch_size": loader.get("batch_size"),
        "num_workers": loader.get("num_workers", 0),
        "pin_memory": bool(loader.get("pin_memory")),
        "torch_threads": run.get("torch_threads"),
    }
    if out["num_workers"]:
        out["prefetch_factor"] = loader.get("prefetch_factor") or 2
        out["multiprocessing_context"] = loader.get("multiprocessing_context")
        out["worker_threads"] = loader.get("worker_threads") or 1
        if not stream:
            out["persistent_workers"] = bool(loader.get("persistent_workers"))
    return out


@dataclass
class Contestant:
    name: str  # "recipe", "default", "trial 7", ...
    overrides: list[str]
    is_baseline: bool
    results: list[TrialResult] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)  # contestants that resolved to the same
    dropped: str = ""  # why it was not measured to the last round (clearly slower)

    @property
    def label(self) -> str:
        """``recipe = trial 3`` when several contestants are one configuration."""
        return " = ".join([self.name, *self.aliases])

    @property
    def values(self) -> list[float]:
        return [r.value for r in self.results if r.ok]

    @property
    def failures(self) -> list[str]:
        return [f"{r.status}: {r.reason}" for r in self.results if not r.ok]

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def spread(self) -> float:
        """(max - min) of the repeats, in samples/s."""
        return max(self.values) - min(self.values) if len(self.values) > 1 else 0.0

    def ok_result(self) -> TrialResult | None:
        return next((r for r in self.results if r.ok), None)

    def loader(self) -> dict:
        r = self.ok_result()
        if r is None:
            return {}
        composed = OmegaConf.load(Path(r.job_dir) / ".hydra" / "config.yaml")
        return OmegaConf.to_container(composed.loader, resolve=True)

    def cost(self) -> tuple[float, float]:
        """Cheaper first: fewer workers, then less memory (PSS of the processes, and the
        batches in /dev/shm, which is RAM too)."""
        mem = [
            (r.metrics.get("peak_pss_mb") or 0.0) + (r.metrics.get("peak_shm_mb") or 0.0)
            for r in self.results
            if r.ok
        ]
        return (self.loader().get("num_workers", 0), statistics.median(mem) if mem else 0.0)


def merge_identical(contestants: list[Contestant], stream: bool) -> list[Contestant]:
    """One contestant per resolved configuration: a later one that ran the same settings as an
    earlier one is folded into it (its runs count for both); the order is kept."""
    kept: list[tuple[dict | None, Contestant]] = []
    for c in contestants:
        r = c.ok_result()
        key = resolved_settings(r.metrics, stream) if r is not None else None
        twin = next((k for s, k in kept if key is not None and s == key), None)
        if twin is None:
            kept.append((key, c))
            continue
        twin.aliases += [c.name, *c.aliases]
        twin.results += c.results
        twin.is_baseline = twin.is_baseline or c.is_baseline
    return [c for _, c in kept]


CLEARLY_SLOWER = 0.5


def clearly_slower(c: Contestant, fastest: Contestant) -> str:
    """Why ``c`` is slower than ``fastest`` whatever the rounds, or empty: its best run below
    ``CLEARLY_SLOWER`` times the fastest's worst. No run-to-run noise spans a factor of two
    (PyTorch's default against 32 workers on I/O-bound data), so this needs no interval."""
    if c is fastest or not c.values or max(c.values) >= CLEARLY_SLOWER * min(fastest.values):
        return ""
    return (
        f"clearly slower: its best run, {max(c.values):,.1f} samples/s, is below half of the"
        f" worst run of {fastest.label}, {min(fastest.values):,.1f}"
    )


def drop_clearly_slower(contestants: list[Contestant]) -> list[Contestant]:
    """Mark the clearly slower contestants, so later rounds spend no time on them; returns
    them."""
    measured = [c for c in contestants if c.values and not c.failures and not c.dropped]
    if not measured:
        return []
    fastest = max(measured, key=lambda c: c.median)
    out = []
    for c in measured:
        why = clearly_slower(c, fastest)
        if why:
            c.dropped = f"{why}; not measured further"
            out.append(c)
    return out


@dataclass
class Decision:
    winner: Contestant
    fastest: Contestant
    best_baseline: Contestant | None
    reason: str
    contestants: list[Contestant] = field(default_factory=list)
    # each measured contestant against the fastest: the ratio of medians and its interval
    versus_fastest: dict[str, stats.Comparison | None] = field(default_factory=dict)
    # why each contestant shown slower than the fastest is (empty for the others)
    why_slower: dict[str, str] = field(default_factory=dict)


SAME_WORKERS = 0.10  # worker counts this close are equally cheap: memory decides


def cheapest(contestants: list[Contestant]) -> Contestant:
    """Fewest workers, then least memory: 50 workers with 15 GB of batches in /dev/shm are
    not cheaper than 51 with 2 GB, so counts within ``SAME_WORKERS`` of the fewest are equal."""
    cost = {c.name: c.cost() for c in contestants}  # each reads its run's config once
    fewest = min(workers for workers, _ in cost.values())
    near = [c for c in contestants if cost[c.name][0] <= fewest * (1 + SAME_WORKERS)]
    return min(near, key=lambda c: (cost[c.name][1], cost[c.name][0], -c.median))


def _significantly(versus: stats.Comparison | None) -> str:
    if versus is None or versus.verdict != stats.LOSS:
        return ""
    return f"significantly: {versus.describe()}"


def _described(versus: stats.Comparison | None) -> str:
    return versus.describe() if versus is not None else "(no comparison)"


def decide(contestants: list[Contestant]) -> Decision:
    """Among the contestants not shown slower than the fastest, the cheapest wins.

    Every finalist and every baseline is weighed against the fastest: shown slower when
    significantly so (:mod:`feedrate.stats`: 5 rounds, the interval and a rank test) or
    clearly so (a factor of two, at any number of rounds). A contestant with any failed final
    run is out, baselines included. Cheapest: fewest workers, then least memory.
    """
    eligible = [c for c in contestants if c.median is not None and not c.failures]
    if not eligible:
        reasons = "; ".join(f"{c.label}: {', '.join(c.failures) or 'no run'}" for c in contestants)
        raise FeedrateError(
            "no configuration ran every final run without failing, so there is nothing to"
            f" decide and no preset was written ({reasons})"
        )
    fastest = max(eligible, key=lambda c: c.median)
    versus = {c.name: stats.compare(c.values, fastest.values) for c in eligible}
    why_slower = {
        c.name: c.dropped or clearly_slower(c, fastest) or _significantly(versus[c.name])
        for c in eligible
    }
    close = [c for c in eligible if c is fastest or not why_slower[c.name]]
    winner = cheapest(close)
    baselines = [c for c in eligible if c.is_baseline]
    best_baseline = max(baselines, key=lambda c: c.median) if baselines else None
    slower = [c for c in eligible if c not in close]
    out = [c for c in contestants if c not in eligible]
    if winner is fastest:
        reason = f"{winner.label} is the fastest ({winner.median:,.1f} samples/s)"
        others = [c for c in close if c is not winner]
        if others:
            reason += "; within noise of it but no cheaper: " + ", ".join(
                f"{c.label} {_described(versus[c.name])}" for c in others
            )
    else:
        reason = (
            f"{winner.label} ({winner.cost()[0]} workers) is not significantly slower than the"
            f" fastest, {fastest.label} ({fastest.cost()[0]} workers):"
            f" {_described(versus[winner.name])}; the cheapest of those within noise wins"
        )
    if slower:
        reason += "; slower: " + ", ".join(f"{c.label} ({why_slower[c.name]})" for c in slower)
    if out:
        reason += "; out for a failed final run: " + ", ".join(c.label for c in out)
    return Decision(winner, fastest, best_baseline, reason, contestants, versus, why_slower)


# ---------------------------------------------------------------------------------------------
# The callback


def _conf_dir(config: DictConfig) -> Path:
    for source in config.hydra.runtime.config_sources:
        if source.provider == "main" and source.schema == "file":
            return Path(source.path)
    raise ConfigError("cannot find the config directory to write the preset into")


def _base_args(config: DictConfig) -> list[str]:
    """The command line's overrides, which every trial repeats."""
    return list(config.hydra.overrides.task)


def _hydra_args(config: DictConfig) -> list[str]:
    """The command line's ``hydra.*`` overrides that shape the sweep (trials, launcher)."""
    own = ("hydra.mode", "hydra.sweep.dir", "hydra.run.dir", "hydra.sweeper.study_name")
    return [a for a in config.hydra.overrides.hydra if not a.startswith(own)]


CEILINGS_FILE = "ceilings.json"


def measure_ceilings(config: DictConfig) -> ceiling.Ceiling | None:
    """Loader-only (the better of the lowest and the highest seed: CPU-bound decoding peaks
    near the cores, latency-bound reads far past them) and compute-only, a few seconds each,
    before the search: the applicable ceiling goes to ``<sweep dir>/ceilings.json``, where the
    trial launcher reads it to stop the search near it. None when it does not apply."""
    measure = getattr(config.trainer.measure, "value", config.trainer.measure)
    if not config.sweep.measure_ceilings or config.objective != "samples_per_sec":
        return None
    if measure != "train":
        log.info(
            "no ceiling measured before the search: with trainer.measure=%s the trials measure"
            " that side alone already",
            measure,
        )
        return None
    script = Path(sys.argv[0]).resolve()
    out = Path(config.hydra.sweep.dir) / "ceilings"
    timeout = config.hydra.launcher.timeout_s
    base = _base_args(config)  # sweep=loader among them: the trials' own measurement
    seeds = seed_workers(config)
    at = {
        n: run_trial(
            script,
            [*base, "trainer.measure=loader", f"loader.num_workers={n}"],
            out / f"loader_{n}",
            timeout,
        )
        for n in sorted({seeds[0], seeds[-1]})
    }
    measured = {n: r for n, r in at.items() if r.ok}
    workers = max(measured, key=lambda n: measured[n].value) if measured else seeds[-1]
    loader = at[workers]
    compute = run_trial(script, [*base, "trainer.measure=compute"], out / "compute", timeout)
    (Path(config.hydra.sweep.dir) / CEILINGS_FILE).unlink(missing_ok=True)
    if not (loader.ok and compute.ok):
        failed = loader if not loader.ok else compute
        log.warning(
            "the ceilings could not be measured (%s), so the search runs every trial: %s",
            Path(failed.job_dir).name,
            failed.reason,
        )
        return None
    limit = ceiling.Ceiling(
        ceiling.kind_of(compute.metrics["run"]["device"], "train"),
        loader.value,
        compute.value,
        f"{workers} workers",
    )
    atomic_write_text(
        Path(config.hydra.sweep.dir) / CEILINGS_FILE, json.dumps(limit.as_dict(), indent=2)
    )
    log.info(
        "ceiling: %s; the search stops when a trial reaches %.2f of it",
        limit.describe(),
        1 - config.sweep.stop_within,
    )
    return limit


def read_ceiling(sweep_dir: str | Path) -> ceiling.Ceiling | None:
    path = Path(sweep_dir) / CEILINGS_FILE
    if not path.exists():
        return None
    return ceiling.Ceiling.from_dict(json.loads(path.read_text()))


def measure_gap(config: DictConfig, winner: Contestant, sweep_dir: Path) -> dict | None:
    """The differential method at the winner's settings: its end-to-end figure against its
    own loader-only run and the compute-only one measured before the search."""
    limit = read_ceiling(sweep_dir)
    if limit is None or winner.median is None:
        return None
    script = Path(sys.argv[0]).resolve()
    res = run_trial(
        script,
        [
            *winner.overrides,
            f"trainer.max_seconds={config.sweep.final_seconds}",
            "trainer.measure=loader",
        ],
        sweep_dir / "ceilings" / "loader_winner",
        config.hydra.launcher.timeout_s,
    )
    if not res.ok:
        log.warning("the winner's loader-only run failed (%s): no gap analysis", res.reason)
        return None
    at_winner = ceiling.Ceiling(
        limit.kind, res.value, limit.compute_only, f"{winner.label}'s settings"
    )
    words, shares = ceiling.gap(winner.median, at_winner)
    log.info("where the time goes: %s", words)
    return {
        "ceiling": at_winner.as_dict(),
        "end_to_end": winner.median,
        "words": words,
        "shares": shares,
    }


class Phases:
    """Where the sweep's wall time went: the ceilings, the search, the final rounds, the gap."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._last = clock()

    def done(self, phase: str) -> None:
        now = self.clock()
        self.seconds[phase] = round(now - self._last, 1)
        self._last = now

    def describe(self) -> str:
        """``312 s: ceilings 25, search 114, final 165, gap 8``"""
        parts = ", ".join(f"{k} {v:.0f}" for k, v in self.seconds.items())
        return f"{sum(self.seconds.values()):.0f} s: {parts}"


def write_decision(
    sweep_dir: Path, decision: Decision, seconds: dict[str, float] | None = None
) -> None:
    """``final_decision.yaml`` beside Optuna's ``optimization_results.yaml``, which names the
    best *search* trial: the final decision, after re-measuring, can differ from it; with
    the seconds each phase of the sweep took."""
    winner = decision.winner
    data = {
        "winner": winner.label,
        "loader": winner.loader(),
        "median_samples_per_sec": winner.median,
        "reason": decision.reason,
        "versus_fastest": {
            c.name: {
                **(decision.versus_fastest[c.name] or stats.Comparison(1, 1, 1, (0, 0))).as_dict(),
                **(
                    {"verdict": "slower", "why": decision.why_slower[c.name]}
                    if decision.why_slower.get(c.name)
                    else {}
                ),
            }
            for c in decision.contestants
            if c.name in decision.versus_fastest
        },
        **({"seconds": seconds} if seconds else {}),
    }
    note = (
        "# The sweep's final decision, after re-measuring the finalists and the baselines in"
        " alternating rounds.\n# optimization_results.yaml beside it is Optuna's best *search*"
        " trial (one short run each), not this.\n"
    )
    atomic_write_text(sweep_dir / "final_decision.yaml", note + OmegaConf.to_yaml(data))
    optuna_file = sweep_dir / "optimization_results.yaml"
    if optuna_file.exists():
        text = optuna_file.read_text()
        pointer = (
            "# best_params: the best search trial; the sweep's choice is final_decision.yaml\n"
        )
        if not text.startswith(pointer):
            atomic_write_text(optuna_file, pointer + text)


class SweepFailed(FeedrateError):
    """No configuration could be measured: nothing to decide, no preset written."""

    exit_code = 1


def _failure_summary(search: list[TrialResult]) -> str:
    reasons: dict[str, int] = {}
    for r in search:
        if not r.ok:
            reasons[f"{r.status}: {r.reason}"] = reasons.get(f"{r.status}: {r.reason}", 0) + 1
    lines = [f"  {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    return (
        f"every trial of the study failed ({len(search)} in this session); no preset was"
        " written and any existing one is untouched. Reasons:\n"
        + "\n".join(lines)
        + "\nEach trial's output is in <sweep dir>/<n>/trial.log"
    )


SEARCHED = (
    "loader.num_workers",
    "loader.prefetch_factor",
    "loader.persistent_workers",
    "loader.multiprocessing_context",
    "loader.pin_memory",
)
THREADS = ("loader.worker_threads", "loader.main_threads", "hardware.torch_threads")


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
    if s.final_seconds <= 0:
        problems.append(f"sweep.final_seconds={s.final_seconds} must be positive")
    if s.max_workers is not None and s.max_workers < 1:
        problems.append(f"sweep.max_workers={s.max_workers} must be at least 1, or null (auto)")
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
    searched = [*SEARCHED, *(["loader.batch_size"] if s.tune_batch_size else [])]
    searched += THREADS if search_threads(config) else ()
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


def _fail(exc: BaseException) -> None:
    """End the sweep with a message; Hydra turns a callback's exception into a mere warning."""
    if isinstance(exc, FeedrateError):
        log.error("%s", exc)
        sys.exit(exc.exit_code)
    log.exception("the loader sweep failed: %s", exc)
    sys.exit(1)


class LoaderSweep(Callback):
    """Hydra callback for ``sweep=loader``: checks and seeding before, decision after."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            self._start(config)
        except Exception as exc:  # noqa: BLE001 - see _fail
            _fail(exc)

    def _start(self, config: DictConfig) -> None:
        self._phases = Phases()
        name = config.sweep.preset_name
        path = preset_path(_conf_dir(config), name)
        check_writable(path, config.sweep.overwrite)
        check_sweep(config)
        start_methods(config)  # says now, before any trial, if the dataset rules some out
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # feedrate logs what matters
        sweeper = config.hydra.sweeper
        direction = getattr(sweeper.direction, "name", sweeper.direction)
        self._lock = lock_study(sweeper.storage, sweeper.study_name)  # held until exit
        study = optuna.create_study(
            study_name=sweeper.study_name,
            storage=sweeper.storage,
            direction=str(direction),
            load_if_exists=True,
        )
        if self._lock is not None:  # we own the study: a running trial is a dead sweep's
            stale = fail_unfinished(
                study, "interrupted: the sweep running it stopped before the trial finished"
            )
            if stale:
                log.warning(
                    "trial(s) %s of study %s were left running by a sweep that stopped: marked"
                    " failed; its finished trials are kept",
                    ", ".join(map(str, stale)),
                    sweeper.study_name,
                )
        earlier = len(study.trials)
        if earlier == 0:
            # the seeds run PyTorch's thread counts; the search moves them from there
            threads = {}  # the seeds run PyTorch's thread counts
            if search_threads(config):
                threads = default_threads()
                if "fork" in start_methods(config):  # searched only for other start methods
                    del threads["loader.worker_threads"]
            same = seed_settings(config)
            for workers in seed_workers(config):
                study.enqueue_trial({"loader.num_workers": workers, **same, **threads})
        measure_ceilings(config)
        self._phases.done("ceilings")
        log.info(
            "loader sweep: study %s (%s), %d earlier trials; up to %d new trials, one at a time,"
            " each in a fresh process (limit %g s); then %d finalists and the baselines measured"
            " %d times; preset -> %s",
            sweeper.study_name,
            sweeper.storage,
            earlier,
            sweeper.n_trials,
            config.hydra.launcher.timeout_s,
            config.sweep.finalists,
            config.sweep.final_rounds,
            path,
        )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            self._finish(config)
        except KeyboardInterrupt:
            log.error(
                "interrupted (Ctrl-C) during the final re-measurement: the study's trials are"
                " kept and no preset was written. Run the same command with"
                " hydra.sweeper.n_trials=0 to redo only the final phase"
            )
            sys.exit(130)
        except Exception as exc:  # noqa: BLE001 - see _fail
            _fail(exc)

    def _finish(self, config: DictConfig) -> None:
        import optuna

        from feedrate import report

        sweep_dir = Path(config.hydra.sweep.dir)
        sweeper = config.hydra.sweeper
        phases = getattr(self, "_phases", None) or Phases()
        phases.done("search")
        study = optuna.load_study(study_name=sweeper.study_name, storage=sweeper.storage)
        search = report.collect_search(sweep_dir)
        contestants = self._contestants(config, study, search)
        contestants = self._remeasure(config, contestants, sweep_dir / "final")
        phases.done("final")
        decision = decide(contestants)
        log.info("decision: %s", decision.reason)
        write_decision(sweep_dir, decision)  # kept if the gap's run is interrupted
        gap = measure_gap(config, decision.winner, sweep_dir)
        phases.done("gap")
        log.info("the sweep's phases took %s", phases.describe())
        write_decision(sweep_dir, decision, phases.seconds)

        name = config.sweep.preset_name
        path = preset_path(_conf_dir(config), name)
        winner_result = next(r for r in decision.winner.results if r.ok)
        atomic_write_text(
            sweep_dir / "best_config.yaml",
            (Path(winner_result.job_dir) / ".hydra" / "config.yaml").read_text(),
        )
        report.write_all(sweep_dir, config, study, search, contestants, decision, gap)
        if config.sweep.write_preset:
            self._write_preset(config, path, decision, study)
        log.info("sweep report: %s", sweep_dir / "sweep_report.md")

    def _contestants(
        self, config: DictConfig, study: optuna.Study, search: list[TrialResult]
    ) -> list[Contestant]:
        args = _base_args(config)
        without_loader = [a for a in args if not a.startswith("loader=")]
        selected = config.hydra.runtime.choices.get("loader", "default")
        contestants = [
            Contestant(b, [*without_loader, f"loader={b}"], True)
            for b in dict.fromkeys([*BASELINES, selected])
        ]
        from optuna.trial import TrialState

        done = [t for t in study.trials if t.state == TrialState.COMPLETE]
        if not done:
            raise SweepFailed(_failure_summary(search))
        seen: set[tuple] = set()
        maximize = study.direction.name == "MAXIMIZE"
        for t in sorted(done, key=lambda t: t.value, reverse=maximize):
            key = tuple(sorted(t.params.items()))
            if key in seen:
                continue
            seen.add(key)
            params = [f"{k}={v}" for k, v in t.params.items()]
            contestants.append(Contestant(f"trial {t.number}", [*args, *params], False))
            if len(seen) >= config.sweep.finalists:
                break
        return contestants

    def _remeasure(
        self, config: DictConfig, contestants: list[Contestant], out: Path
    ) -> list[Contestant]:
        """Alternating rounds of every contestant; after the first, contestants that ran the
        same resolved settings are one (measured once from then on). A finalist's search run
        is not one of them: chosen for being high, it is biased high. Returns those left."""
        from tqdm import tqdm

        script = Path(sys.argv[0]).resolve()
        rounds = config.sweep.final_rounds
        timeout = config.hydra.launcher.timeout_s
        # The decision rests on these runs: longer windows than the search's, less noise.
        longer = [f"trainer.max_seconds={config.sweep.final_seconds}"]
        bar = tqdm(total=rounds * len(contestants), desc="final re-measurement", unit="run")
        for r in range(rounds):
            # Alternate, and reverse every other round, so drift hits everyone alike.
            live = [c for c in contestants if not c.dropped]
            for c in live if r % 2 == 0 else live[::-1]:
                slug = c.name.replace(" ", "_")
                res = run_trial(script, [*c.overrides, *longer], out / f"round{r}_{slug}", timeout)
                c.results.append(res)
                shown = f"{res.value:,.1f} samples/s" if res.ok else f"{res.status}: {res.reason}"
                bar.write(f"final round {r + 1}/{rounds}: {c.name:>12} -> {shown}")
                bar.update(1)
            if r == 0:
                merged = merge_identical(contestants, bool(config.trainer.stream))
                for c in merged:
                    if c.aliases:
                        bar.write(f"{c.label}: same settings, measured as one from now on")
                bar.total -= (rounds - 1) * (len(contestants) - len(merged))
                contestants = merged
            if r == 1:
                for c in drop_clearly_slower(contestants):
                    bar.write(f"{c.label}: {c.dropped}")
                    bar.total -= rounds - 2
        bar.close()
        return contestants

    def _write_preset(
        self, config: DictConfig, path: Path, decision: Decision, study: optuna.Study
    ) -> None:
        winner = decision.winner
        loader = winner.loader()
        tuned = preset_values(loader, config.sweep.tune_batch_size)
        streamed = config.trainer.stream and tuned.get("num_workers", 0) > 0
        if streamed:  # measured without epoch ends; persistence only saves restarts
            tuned["persistent_workers"] = True
        # What the winner was measured on, as its own run recorded it
        measured_on = json.loads(
            (Path(next(r for r in winner.results if r.ok).job_dir) / "environment.json").read_text()
        )
        base = decision.best_baseline
        name = path.stem
        afresh = [a for a in _base_args(config) if not a.startswith("sweep.study_dir=")]
        fresh = f"{config.sweep.study_dir}/{datetime.now():%Y-%m-%d_%H-%M-%S}"
        lines = [
            f"python train.py loader={name}",
            f"Measured {datetime.now().isoformat(timespec='seconds')} by a loader sweep, study"
            f" {study.study_name}.",
            f"Winner: {winner.name}, median {winner.median:,.1f} samples/s"
            f" (spread {winner.spread:,.1f}).",
        ]
        for c in decision.contestants:
            if c is winner or c.median is None:
                continue
            versus = stats.compare(winner.values, c.values)
            against = c.dropped or clearly_slower(c, winner) or _described(versus)
            lines.append(
                f"  vs {c.label}: {c.median:,.1f} samples/s; {winner.name} / it = {against}"
                f" (95% interval, {len(c.values)} runs)"
            )
        lines += [
            f"Decision: {decision.reason}.",
            f"Best baseline: {base.label if base else 'none measured'}.",
            f"Workload: dataset={config.hydra.runtime.choices.get('dataset')}"
            f" model={config.hydra.runtime.choices.get('model')}"
            f" batch_size={config.loader.batch_size}.",
            f"Hardware: {hardware.Fingerprint(**measured_on['fingerprint']).short()}.",
            f"Software: {environment.short(measured_on)}.",
            # a final run's own command line, the final window included
            "Re-measure the winner as the sweep did: python train.py "
            + " ".join(winner.ok_result().overrides),
            "Re-run the sweep afresh (a new study): python train.py -m "
            + " ".join([*afresh, *_hydra_args(config), f"sweep.study_dir={fresh}"]),
            "Plain data: the DataLoader's own arguments (and thread counts) on top of"
            " loader/default.yaml.",
            *(
                [
                    "persistent_workers: true, measured streaming (no epoch ends): keeping"
                    " workers saves their restart at every epoch."
                ]
                if streamed
                else []
            ),
        ]
        text = render(tuned, lines)
        script = Path(sys.argv[0]).resolve()

        def verify() -> None:
            check_plain_data(path)  # what feedrate reads back never runs code
            composed = compose_back(script, name, [])
            for key, value in tuned.items():
                if composed.get(key) != value:
                    raise ConfigError(
                        f"the written preset loader={name} composes to {key}={composed.get(key)!r}"
                        f" instead of {value!r}"
                    )

        write_preset_file(path, text, config.sweep.overwrite, verify)
        log.info("wrote %s; use it with: python train.py loader=%s", path, name)


def preset_values(loader: dict, with_batch_size: bool) -> dict:
    """The keys a preset records: the worker settings (and batch size if it was tuned)."""
    keys = [k for k in PRESET_KEYS if k != "batch_size" or with_batch_size]
    # PyTorch's own thread counts go unsaid: a preset moved to a bigger machine gets its default
    return {k: loader[k] for k in keys if k in loader and not _default_threads(k, loader[k])}


def _default_threads(key: str, value: Any) -> bool:
    if key not in ("worker_threads", "main_threads"):
        return False
    return value is None or value == default_threads()[f"loader.{key}"]
