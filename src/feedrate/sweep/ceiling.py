"""What this machine allows a workload: the ceiling that applies, and where a run's gap to it is.

Two figures, each measured alone with all the cores: loader-only (``trainer.measure=loader``,
batches delivered to the device, no model) and compute-only (``trainer.measure=compute``, the
model on one device-resident batch). Which ceiling they make depends on where the model runs:

- on a GPU, the model's compute does not use the host's cores: min(loader-only, compute-only);
- on the CPU the loader uses, the two share the cores: a sample costs the loader's time plus
  the model's, so the ceiling is 1 / (1/loader-only + 1/compute-only);
- with no model (``trainer.measure=loader``), the loader alone: loader-only.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from feedrate.files import atomic_write_text
from feedrate.sweep.space import FALLING, seed_workers
from feedrate.sweep.trial import Runner, TrialResult, base_args, run_trial

if TYPE_CHECKING:
    from feedrate.sweep.decide import Contestant

log = logging.getLogger(__name__)

GPU, SHARED, LOADER = "gpu", "shared", "loader"

WHY = {
    GPU: "the model runs on the GPU, so the loader and the model do not share cores:"
    " min(loader-only, compute-only)",
    SHARED: "the model runs on the CPU the workers use, so the two share the cores: the"
    " shared-core rate 1/(1/loader-only + 1/compute-only), each measured alone with all cores",
    LOADER: "no model runs (trainer.measure=loader): the loader alone is the limit",
}


STOP, BEYOND = "stop", "beyond"


def near(value: float, limit: float, within: float) -> str | None:
    """``STOP`` when ``value`` is within ``within`` of ``limit``; ``BEYOND`` when it is above
    by more: the limit does not hold for this workload (on a shared CPU, workers waiting on
    I/O leave cores the step uses), so it cannot say when to stop searching; else None."""
    if value > limit * (1 + within):
        return BEYOND
    return STOP if value >= limit * (1 - within) else None


def kind_of(device: str, measure: str) -> str:
    """Which ceiling applies to a run on ``device`` (``cuda:0``, ``cpu``) measuring ``measure``."""
    if measure == "loader":
        return LOADER
    return GPU if str(device).startswith("cuda") else SHARED


def combine(kind: str, loader_only: float, compute_only: float | None) -> float:
    if kind == LOADER or compute_only is None:
        return loader_only
    if kind == GPU:
        return min(loader_only, compute_only)
    return 1.0 / (1.0 / loader_only + 1.0 / compute_only)


@dataclass
class Ceiling:
    kind: str
    loader_only: float
    compute_only: float | None
    loader_settings: str = ""  # what the loader-only figure ran with (``48 workers``)
    loader_workers: int | None = None  # its worker count, to measure it again
    # loader-only at each worker count measured (ascending; none past where it fell)
    loader_at: dict[int, float] = field(default_factory=dict)

    @property
    def loader_falls_at(self) -> int | None:
        """The first worker count past the loader-only peak measured clearly below it (the
        loader alone gets slower with more workers from there), or None."""
        if not self.loader_at:
            return None
        peak = max(self.loader_at, key=lambda n: self.loader_at[n])
        past = [n for n in sorted(self.loader_at) if n > peak]
        falling = [n for n in past if self.loader_at[n] < FALLING * self.loader_at[peak]]
        return falling[0] if falling else None

    @property
    def value(self) -> float:
        return combine(self.kind, self.loader_only, self.compute_only)

    @property
    def why(self) -> str:
        return WHY[self.kind]

    def describe(self) -> str:
        compute = f"{self.compute_only:,.0f}" if self.compute_only is not None else "n/a"
        at = f" ({self.loader_settings})" if self.loader_settings else ""
        return (
            f"{self.value:,.0f} samples/s ({self.kind}: {self.why}; loader-only"
            f" {self.loader_only:,.0f}{at}, compute-only {compute})"
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "value": self.value, "why": self.why}

    @classmethod
    def from_dict(cls, data: dict) -> Ceiling:
        """Back from ``as_dict`` (``ceilings.json``); the derived keys are recomputed."""
        return cls(
            data["kind"],
            data["loader_only"],
            data["compute_only"],
            data["loader_settings"],
            data.get("loader_workers"),
            {int(n): v for n, v in data.get("loader_at", {}).items()},
        )

    def write(self, sweep_dir: str | Path) -> None:
        atomic_write_text(Path(sweep_dir) / CEILINGS_FILE, json.dumps(self.as_dict(), indent=2))


def loader_only_run(config: DictConfig, workers: int) -> list[str]:
    """The overrides of a loader-only ceiling run at ``workers``: the sweep's own command line
    (``sweep=loader`` among it: the trials' measurement), no model."""
    return [*base_args(config), "trainer.measure=loader", f"loader.num_workers={workers}"]


def gap(end_to_end: float, ceiling: Ceiling) -> tuple[str, dict[str, float]]:
    """Where the time per sample goes, by the differential method: end-to-end against
    loader-only and compute-only. Returns a sentence and the shares of a sample's time."""
    t_e = 1.0 / end_to_end
    t_l = 1.0 / ceiling.loader_only
    t_c = 1.0 / ceiling.compute_only if ceiling.compute_only else 0.0
    reach = end_to_end / ceiling.value
    head = f"end to end {end_to_end:,.0f} samples/s is {reach:.2f} of the ceiling ({ceiling.kind})"
    if ceiling.kind == SHARED:
        # a sample costs the loader's time plus the model's; the rest is their sharing
        shares = {"loader": t_l / t_e, "model": t_c / t_e, "sharing": 1.0 - (t_l + t_c) / t_e}
        side = "the loader" if t_l >= t_c else "the model"
        if shares["sharing"] < 0:
            rest = (
                f"; they overlap by {-shares['sharing']:.0%} of a sample's time (workers waiting"
                " on I/O leave cores the step uses), which the shared-core model does not count"
            )
        else:
            rest = f"; {shares['sharing']:.0%} is lost to their sharing of the CPU"
        words = (
            f"{head}: of each sample's time, the loader's own work is {shares['loader']:.0%}"
            f" and the model's {shares['model']:.0%}, so {side} is where the time goes{rest}"
        )
        return words, shares
    bound = "loader" if ceiling.kind == LOADER or t_l >= t_c else "model"
    lost = max(0.0, 1.0 - reach)
    shares = {bound: reach, "overlap lost": lost}
    words = (
        f"{head}: the {bound} sets the pace (loader-only {ceiling.loader_only:,.0f},"
        f" compute-only {ceiling.compute_only or float('nan'):,.0f}); {lost:.0%} is lost to"
        " running them together (waits, copies, synchronisation)"
    )
    return words, shares


CEILINGS_FILE = "ceilings.json"


def measure_ceilings(config: DictConfig, runner: Runner) -> Ceiling | None:
    """Loader-only at the seeds' worker counts, ascending (CPU-bound decoding peaks near the
    cores, latency-bound reads far past them; the best is kept), until one is clearly below
    the best (``sweep.bound_by_seeds``: photos' 32-worker run cost 23 s to read 739 after 804
    at 2 workers and 748 at 8), and compute-only, a few seconds each
    in the search's warm host, before the search: the applicable ceiling goes to
    ``<sweep dir>/ceilings.json``, where the trial launcher reads it to stop the search near
    it. None when it does not apply."""
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
    out = Path(config.hydra.sweep.dir) / "ceilings"
    timeout = config.hydra.launcher.timeout_s
    at: dict[int, TrialResult] = {}
    for n in sorted(set(seed_workers(config))):
        at[n] = run_trial(runner, loader_only_run(config, n), out / f"loader_{n}", timeout)
        figures = {k: r.value for k, r in at.items() if r.ok}
        best = max(figures, key=figures.get, default=None)
        if config.sweep.bound_by_seeds and n in figures and figures[n] < FALLING * figures[best]:
            log.info(
                "loader-only falls past %d workers (%s), so no more workers are measured for"
                " the ceiling (sweep.bound_by_seeds=false measures every seed)",
                best,
                ", ".join(f"{k} workers {v:,.0f}" for k, v in sorted(figures.items())),
            )
            break
    measured = {n: r for n, r in at.items() if r.ok}
    workers = max(measured, key=lambda n: measured[n].value) if measured else max(at)
    loader = at[workers]
    compute = run_trial(
        runner, [*base_args(config), "trainer.measure=compute"], out / "compute", timeout
    )
    (Path(config.hydra.sweep.dir) / CEILINGS_FILE).unlink(missing_ok=True)
    if not (loader.ok and compute.ok):
        failed = loader if not loader.ok else compute
        log.warning(
            "the ceilings could not be measured (%s), so the search runs every trial: %s",
            Path(failed.job_dir).name,
            failed.reason,
        )
        return None
    limit = Ceiling(
        kind_of(compute.metrics["run"]["device"], "train"),
        loader.value,
        compute.value,
        f"{workers} workers",
        workers,
        {n: r.value for n, r in measured.items()},
    )
    limit.write(config.hydra.sweep.dir)
    log.info(
        "ceiling: %s; the search stops when a trial reaches %.2f of it",
        limit.describe(),
        1 - config.sweep.stop_within,
    )
    return limit


def _compute_only(config: DictConfig, sweep_dir: Path, runner: Runner) -> tuple | None:
    """The compute-only side of the gap, measured after the search: (the ceiling's kind, its
    samples/s), or None (it does not apply, or failed)."""
    measure = getattr(config.trainer.measure, "value", config.trainer.measure)
    if measure != "train" or config.objective != "samples_per_sec":
        return None
    compute = run_trial(
        runner,
        [*base_args(config), "trainer.measure=compute"],
        sweep_dir / "ceilings" / "compute",
        config.hydra.launcher.timeout_s,
    )
    if not compute.ok:
        log.warning("the compute-only run failed (%s): no gap analysis", compute.reason)
        return None
    return kind_of(compute.metrics["run"]["device"], "train"), compute.value


def read_ceiling(sweep_dir: str | Path) -> Ceiling | None:
    path = Path(sweep_dir) / CEILINGS_FILE
    if not path.exists():
        return None
    return Ceiling.from_dict(json.loads(path.read_text()))


def costs_gap(config: DictConfig, winner: Contestant) -> dict | None:
    """Where the winner's time per sample goes, from what its final runs' batches cost
    (``trainer.costs``) and no run more: the rate each part of the pipeline would let its
    settings reach alone (:func:`feedrate.tuning.model.bounds`), against the rate it trained
    at. None where its runs reported no costs (``trainer.costs=false``)."""
    from feedrate.sweep.climb import machine
    from feedrate.tuning.model import HELD_BY, Costs, bounds

    if winner.median is None:
        return None
    ran = [r for r in winner.results if r.ok and r.value and (r.metrics or {}).get("costs")]
    if not ran:
        log.info("%s's runs reported no costs: no account of where its time goes", winner.label)
        return None
    median = min(ran, key=lambda r: abs(r.value - winner.median))  # its typical run
    costs = Costs.from_dict(median.metrics["costs"])
    pipe = machine(config).pipeline()
    setting = costs.measured_on
    if setting is None:
        return None
    each = bounds(costs, setting, pipe)
    bound = min(each, key=each.get)
    ms = 1000
    parts = ", ".join(f"{HELD_BY[k].removeprefix('the ')} {v:,.0f}" for k, v in each.items())
    words = (
        f"end to end {winner.median:,.0f} samples/s at {setting.describe()}, where a batch of"
        f" {costs.batch_size:.0f} took {costs.alone_s * ms:,.1f} ms in a worker"
        f" ({costs.worker_cpu_s * ms:,.1f} ms on a core) and the step"
        f" {costs.step_alone_s * ms:,.1f} ms: each part alone would allow ({parts} samples/s),"
        f" so {HELD_BY[bound]} set the pace, reached at {winner.median / each[bound]:.2f}"
    )
    log.info("where the time goes: %s", words)
    return {
        "method": "costs",
        "end_to_end": winner.median,
        "setting": setting.describe(),
        "bounds": each,
        "bound": bound,
        "words": words,
    }


def measure_gap(
    config: DictConfig, winner: Contestant, sweep_dir: Path, runner: Runner
) -> dict | None:
    """The differential method at the winner's settings: its end-to-end figure against its
    own loader-only run and the compute-only one measured before the search (or now, where
    no ceiling was: ``sweep.measure_ceilings=false``)."""
    if winner.median is None:
        return None
    limit = read_ceiling(sweep_dir)
    measured = (
        (limit.kind, limit.compute_only) if limit else _compute_only(config, sweep_dir, runner)
    )
    if measured is None:
        return None
    res = run_trial(
        runner,
        [
            *winner.overrides,
            f"trainer.max_seconds={config.sweep.final_seconds}",
            "trainer.measure=loader",
        ],
        sweep_dir / "ceilings" / "loader_winner",
        config.hydra.launcher.timeout_s,
    )
    if not res.ok or not res.value:  # nothing measured (a run too short to leave its warm-up)
        why = res.reason if not res.ok else "it measured no samples"
        log.warning("the winner's loader-only run failed (%s): no gap analysis", why)
        return None
    at_winner = Ceiling(measured[0], res.value, measured[1], f"{winner.label}'s settings")
    words, shares = gap(winner.median, at_winner)
    log.info("where the time goes: %s", words)
    return {
        "ceiling": at_winner.as_dict(),
        "end_to_end": winner.median,
        "words": words,
        "shares": shares,
    }
