"""The sweep's contestants: trial results re-measured in alternating rounds, those with the
same resolved settings folded into one, the finalists picked, and the decision written. The
rules that decide are :mod:`feedrate.tuning.decide`, the one decision of every tuner
(docs/design.md, "How the sweep decides")."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from feedrate import stats
from feedrate.files import atomic_write_text
from feedrate.sweep.feasibility import Budget, run_memory_mb
from feedrate.sweep.space import WORKERS
from feedrate.sweep.trial import TrialResult
from feedrate.tuning.decide import SAME_WORKERS, Decision

BASELINES = ("default", "recipe")


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
        "decode": loader.get("decode", "cpu"),
    }
    if out["num_workers"]:
        out["prefetch_factor"] = loader.get("prefetch_factor") or 2
        out["engine"] = loader.get("engine") or "process"
        if out["engine"] == "thread":  # no processes to start, keep or give threads to
            return out
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
    dropped: str = ""  # why it was not measured to the last round (shown slower)
    rounds: list[int] = field(default_factory=list)  # the final round of each result

    def add(self, result: TrialResult, round_: int) -> None:
        self.results.append(result)
        self.rounds.append(round_)

    def per_round(self) -> dict[int, float]:
        """Round -> samples/s (the median where merged contestants ran twice in one round):
        the paired figures :func:`feedrate.stats.compare` weighs."""
        by: dict[int, list[float]] = {}
        for r, res in zip(self.per_round_index(), self.results, strict=True):
            if res.ok:
                by.setdefault(r, []).append(res.value)
        return {r: statistics.median(v) for r, v in by.items()}

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

    def per_round_index(self) -> list[int]:
        return (
            self.rounds if len(self.rounds) == len(self.results) else list(range(len(self.results)))
        )

    def ok_result(self) -> TrialResult | None:
        return next((r for r in self.results if r.ok), None)

    def loader(self) -> dict:
        r = self.ok_result()
        if r is None:
            return {}
        composed = OmegaConf.load(Path(r.job_dir) / ".hydra" / "config.yaml")
        return OmegaConf.to_container(composed.loader, resolve=True)

    @property
    def peak_mb(self) -> float | None:
        """The most memory any of its runs used (:func:`run_memory_mb`), or None."""
        peaks = [run_memory_mb(r.metrics) or 0.0 for r in self.results if r.metrics]
        return max(peaks) if any(peaks) else None

    def over_budget(self, budget: Budget | None) -> str:
        if budget is None:
            return ""
        return next((why for r in self.results if (why := budget.over(r.metrics))), "")

    def cost(self) -> tuple[float, float]:
        """Cheaper first: fewer worker processes (thread workers are none), then less memory
        (:func:`run_memory_mb`, the one measure of a run's memory: docs/design.md, "Memory
        readings")."""
        mem = [run_memory_mb(r.metrics) or 0.0 for r in self.results if r.ok]
        # the workers a rank ran (under torchrun a config may say the machine's, divided)
        first = self.ok_result()
        ran = ((first.metrics if first else {}) or {}).get("run") or {}
        ran = ran.get("loader") or {}
        workers = ran.get("num_workers", self.loader().get("num_workers", 0))
        if (ran.get("engine") or self.loader().get("engine")) == "thread":
            workers = 0  # threads of the training process: no process, no copy of the data
        return (workers, statistics.median(mem) if mem else 0.0)


def twins(settings: list[tuple[str, dict | None]]) -> dict[str, str]:
    """Name -> the earlier name that ran the same resolved settings (``settings``: each name
    with its :func:`resolved_settings`, in order; None: unknown, never a twin). The sweep's
    finals and the benchmark merge contestants by this one rule."""
    first: list[tuple[dict, str]] = []
    found: dict[str, str] = {}
    for name, key in settings:
        if key is None:
            continue
        twin = next((n for k, n in first if k == key), None)
        if twin is None:
            first.append((key, name))
        elif twin != name:
            found[name] = twin
    return found


def merge_identical(contestants: list[Contestant], stream: bool) -> list[Contestant]:
    """One contestant per resolved configuration: a later one that ran the same settings as an
    earlier one is folded into it (its runs count for both); the order is kept."""
    by_name = {c.name: c for c in contestants}
    settings = []
    for c in contestants:
        r = c.ok_result()
        settings.append((c.name, resolved_settings(r.metrics, stream) if r is not None else None))
    folded = twins(settings)
    for name, twin_name in folded.items():
        c, twin = by_name[name], by_name[twin_name]
        twin.aliases += [c.name, *c.aliases]
        twin.rounds = [*twin.per_round_index(), *c.per_round_index()]
        twin.results += c.results
        twin.is_baseline = twin.is_baseline or c.is_baseline
    return [c for c in contestants if c.name not in folded]


FINALIST_WITHIN = 0.10  # sweep.finalist_within


def same_but_workers(a: dict, b: dict) -> bool:
    """Two trials' parameters, the same in all but the worker count."""
    return {k: v for k, v in a.items() if k != WORKERS} == {
        k: v for k, v in b.items() if k != WORKERS
    }


def near_twins(a: dict, b: dict) -> bool:
    """Two searched settings no final round could tell apart: the same in every parameter
    but the worker count, and worker counts within ``SAME_WORKERS`` of each other (51 and
    54 workers on 10 ms reads: five final rounds of both ended in a tie, 55 s of runs)."""
    if not same_but_workers(a, b):
        return False
    wa, wb = a.get(WORKERS), b.get(WORKERS)
    if wa is None or wb is None:
        return wa == wb
    return abs(wa - wb) <= SAME_WORKERS * max(wa, wb)


def pick_finalists(
    ranked: list[tuple[str, dict, float]],
    n: int,
    within: float = FINALIST_WITHIN,
    maximize: bool = True,
    twins: Callable[[dict, dict], bool] = near_twins,
) -> list[tuple[str, dict, float]]:
    """The search's trials worth re-measuring: ``ranked`` best first (name, params, value),
    at most ``n``. The best always; after it, only trials within ``within`` of its search
    figure (a second finalist guards against a lucky search run, and no search run is lucky by
    25%: webdataset's 16 workers at 0.72 of the best lost every final round), and none that is
    a twin of one already picked (``twins``: :func:`near_twins`, or the model's
    :func:`feedrate.sweep.climb.fed_twins`), or has the same parameters. ``maximize`` False:
    lower is better, and within means at most ``1 + within`` times the best."""
    out: list[tuple[str, dict, float]] = []
    for name, params, value in ranked:
        if len(out) >= n:
            break
        best = out[0][2] if out else value
        if (value < (1 - within) * best) if maximize else (value > (1 + within) * best):
            break
        if any(params == p or twins(params, p) for _, p, _ in out):
            continue
        out.append((name, params, value))
    return out


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
