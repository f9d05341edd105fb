"""``hydra/launcher=feedrate_trial``: the sweep's jobs one at a time, in a warm trial host.

Hydra's basic launcher runs jobs inside the sweep's process: one hang stalls the sweep, one
crash ends it, and each job inherits what the jobs before it left (threads, RNGs, leaked
workers). This launcher runs them in a separate warm host (:mod:`feedrate.sweep.host`) that
pays start-up once and puts back what a trial changed; a trial that fails or hangs gets the
host killed with its whole process group, and the next trial a new one
(``hydra.launcher.warm=false``: ``python train.py <overrides>`` afresh for each). It skips jobs
predicted not to fit in memory, and reports each as completed (the objective from its
metrics.json) or failed (with the reason), so a sweeper such as Optuna records it and goes on.
"""

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class FeedrateTrialLauncherConf:
    _target_: str = "hydra_plugins.feedrate_launcher.trial_launcher.FeedrateTrialLauncher"
    # Hard limit per trial, start-up included; a trial past it is killed and recorded as failed.
    timeout_s: float = 120.0
    # Share of available RAM and free /dev/shm a trial may be predicted to use.
    memory_budget_frac: float = 0.8
    # Trials in a warm host that pays start-up once; false: each in a fresh process.
    warm: bool = True


ConfigStore.instance().store(
    group="hydra/launcher", name="feedrate_trial", node=FeedrateTrialLauncherConf
)


class _TrialReturn(JobReturn):
    """A trial's return. Reading a failed or skipped trial's value raises, as Hydra's does,
    without Hydra's "Error executing job" line on stderr for each: the launcher has logged
    why already, and a trial the guard skips is not an error."""

    @property
    def return_value(self) -> Any:
        if self.status == JobStatus.FAILED:
            raise self._return_value
        return JobReturn.return_value.fget(self)

    @return_value.setter
    def return_value(self, value: Any) -> None:
        self._return_value = value


class FeedrateTrialLauncher(Launcher):
    def __init__(
        self, timeout_s: float = 120.0, memory_budget_frac: float = 0.8, warm: bool = True
    ) -> None:
        self.timeout_s = timeout_s
        self.warm = warm
        self.memory_budget_frac = memory_budget_frac
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.guard = None
        self.best: float | None = None
        # Set when a trial comes within sweep.stop_within of the ceiling (sweep=loader):
        # the sweeper then asks for no more trials.
        self.stop_reason: str | None = None
        self._ceiling = None
        self._ceiling_read = False
        self._falls_at: int | None = None
        self._rechecked = False  # the ceiling's loader-only run measured a second time
        # job index -> why the guard skipped it: the sweeper asks for another trial instead
        self.skips: dict[int, str] = {}
        # the best figure at each worker count (sweep.bound_by_seeds), and the bound they set
        self.best_at: dict[int, float] = {}
        self.bound: tuple[int, str] | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        from feedrate.sweep.feasibility import FeasibilityGuard, memory_budget

        self.config = config
        self.hydra_context = hydra_context
        self.guard = FeasibilityGuard(self.memory_budget_frac, memory_budget(config))

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from feedrate.sweep.host import runner_for
        from feedrate.sweep.trial import (
            OK,
            OVER_BUDGET,
            SKIPPED,
            TrialFailed,
            TrialResult,
            run_trial,
        )

        assert self.config is not None and self.hydra_context is not None
        runner = runner_for(self.config, "search")
        objective = self.config.get("objective", "samples_per_sec")
        returns = []
        for offset, overrides in enumerate(job_overrides):
            idx = initial_job_idx + offset
            sweep_config = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides)
            )
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = str(idx)
                sweep_config.hydra.job.num = idx
            job_dir = Path(sweep_config.hydra.sweep.dir) / str(sweep_config.hydra.sweep.subdir)
            fixed = set(self.config.hydra.overrides.task)
            shown = " ".join(o for o in filter_overrides(overrides) if o not in fixed)
            skip = self.guard.check(sweep_config) or self._past_bound(sweep_config)
            if skip:
                self.skips[idx] = skip.reason
                predicted = (  # the report draws it at the memory it would have used
                    {"predicted_memory_mb": skip.predicted_mb} if skip.predicted_mb else {}
                )
                result = TrialResult(
                    list(overrides),
                    SKIPPED,
                    reason=skip.reason,
                    metrics=predicted,
                    job_dir=str(job_dir),
                )
                job_dir.mkdir(parents=True, exist_ok=True)
                result.save()
            else:
                command = [*overrides, *self._abandon(sweep_config, objective)]
                result = run_trial(runner, command, job_dir, self.timeout_s, objective)
                self.guard.learn(sweep_config, result)
                over = self.guard.budget.over(result.metrics) if self.guard.budget else None
                if over and result.status == OK:  # measured, and kept for the report
                    result.status, result.reason = OVER_BUDGET, over
                    result.save()
            ret = _TrialReturn(
                overrides=list(overrides),
                cfg=sweep_config,
                hydra_cfg=OmegaConf.create({"hydra": sweep_config.hydra}),
                working_dir=str(job_dir),
                task_name=sweep_config.hydra.job.name,
            )
            if result.status == OK:
                ret.status = JobStatus.COMPLETED
                ret.return_value = result.value
                self._log_trial(idx, shown, objective, result)
                self._learn_bound(sweep_config, result.value)
                confirm = functools.partial(
                    run_trial, runner, command, job_dir / "confirm", self.timeout_s, objective
                )
                recheck = functools.partial(self._loader_only_again, runner, job_dir)
                self._check_ceiling(sweep_config, idx, result.value, confirm, recheck)
            else:
                ret.status = JobStatus.FAILED
                ret._return_value = TrialFailed(f"{result.status}: {result.reason}")
                log.warning("trial #%d %s -> %s: %s", idx, shown, result.status, result.reason)
            returns.append(ret)
        return returns

    def _learn_bound(self, config: DictConfig, value: float) -> None:
        """Track the best figure per worker count; once the seeds show the rate falling past
        the best trial's workers, bound the search there (``sweep.bound_by_seeds``)."""
        sweep = config.get("sweep")
        if not sweep or not sweep.get("bound_by_seeds") or "num_workers" not in config.loader:
            return
        from feedrate.sweep.space import max_workers, seed_workers, worker_bound

        workers = int(config.loader.num_workers)
        self.best_at[workers] = max(value, self.best_at.get(workers, 0.0))
        self._read_ceiling(config)
        bound = worker_bound(seed_workers(config), self.best_at, self._falls_at)
        if bound is not None and bound[0] >= max_workers(config):
            bound = None  # the top seed: nothing past it is searched anyway
        if bound is not None and (self.bound is None or bound[0] != self.bound[0]):
            log.info("%s (sweep.bound_by_seeds=false searches them all)", bound[1])
        self.bound = bound

    def _read_ceiling(self, config: DictConfig) -> None:
        """``ceilings.json``, once: the ceiling the search stops near, and the worker count
        where its loader-only runs fell (kept if the ceiling is later set aside)."""
        from feedrate.sweep.ceiling import read_ceiling

        if not self._ceiling_read:
            sweep_dir = OmegaConf.select(config, "hydra.sweep.dir")
            self._ceiling = read_ceiling(sweep_dir) if sweep_dir else None
            self._ceiling_read = True
            self._falls_at = self._ceiling.loader_falls_at if self._ceiling else None

    def _past_bound(self, config: DictConfig):
        """A skip for a trial past the worker bound the seeds set, else None."""
        from feedrate.sweep.feasibility import Skip

        if self.bound is None or not config.get("sweep"):
            return None
        limit, why = self.bound
        workers = int(config.loader.num_workers)
        return Skip(f"{workers} workers: {why}") if workers > limit else None

    def _raise_ceiling(self, config: DictConfig, again) -> None:
        """Keep the higher of the ceiling's two loader-only figures (``ceilings.json`` too)."""
        if again is None or not again.ok or again.value <= self._ceiling.loader_only:
            return
        import dataclasses

        self._ceiling = dataclasses.replace(self._ceiling, loader_only=again.value)
        self._ceiling.write(config.hydra.sweep.dir)
        log.info("the ceiling's loader-only run, measured again: %s", self._ceiling.describe())

    def _log_trial(self, idx: int, shown: str, objective: str, result) -> None:
        """One line per trial, with the best so far; and why it was re-measured or cut short."""
        if self.best is None or result.value > self.best:
            self.best = result.value
        wait = result.metrics.get("data_wait_frac")
        log.info(
            "trial #%d %s -> %s %.1f, data wait %s (best so far %.1f)",
            *(idx, shown, objective, result.value),
            f"{wait:.0%}" if isinstance(wait, float) else "?",
            self.best,
        )
        if result.reason:  # measured again, or doubtful: say so beside the figure
            log.warning("trial #%d: %s", idx, result.reason)
        if result.metrics.get("abandoned"):
            log.info("trial #%d %s (half the best so far)", idx, result.metrics["abandoned"])

    def _abandon(self, config: DictConfig, objective: str) -> list[str]:
        """The override that ends a clearly worse trial early: below a share of the best. A
        meter compares it with its own rank's samples/s, so under ``sweep.ranks_per_node``
        it is a rank's share of the job's floor."""
        sweep = config.get("sweep") or {}
        share, ranks = sweep.get("abandon_below"), max(1, int(sweep.get("ranks_per_node") or 1))
        if not share or self.best is None or objective != "samples_per_sec":
            return []
        return [f"trainer.abandon_below={share * self.best / ranks:.1f}"]

    def _loader_only_again(self, runner, job_dir: Path):
        """The ceiling's loader-only run once more, beside the trial that came near it (None
        when the ceiling does not say at how many workers it ran)."""
        from feedrate.sweep.ceiling import loader_only_run
        from feedrate.sweep.trial import run_trial

        assert self.config is not None and self._ceiling is not None
        if self._ceiling.loader_workers is None:
            return None
        overrides = loader_only_run(self.config, self._ceiling.loader_workers)
        return run_trial(runner, overrides, job_dir / "ceiling_again", self.timeout_s)

    def _check_ceiling(
        self, config: DictConfig, idx: int, value: float, confirm, recheck=None
    ) -> None:
        """Stop the search once a trial is within ``sweep.stop_within`` of the ceiling that
        the loader sweep measured before searching (``ceilings.json`` in the sweep dir), and
        a second run of it (``confirm()``) is too: one short run can be lucky. The ceiling's
        loader-only run is measured again first (``recheck()``, once a sweep) and the higher
        figure kept: one short run can be unlucky too, and a ceiling too low stops the search early
        (photos on 2 cores: loader-only at 2 workers read 770 and 903 samples/s in two
        sweeps, and the lower one stopped the search at 0.92 of the best it found before)."""
        if not config.get("sweep"):
            return
        self._read_ceiling(config)
        if self._ceiling is None or self.stop_reason:
            return
        from feedrate.sweep import ceiling

        reach = value / self._ceiling.value
        within = config.sweep.stop_within
        verdict = ceiling.near(value, self._ceiling.value, within)
        if verdict == ceiling.BEYOND:
            log.info(
                "trial %d reaches %.2f of the ceiling (%s): the ceiling does not hold for this"
                " workload (the workers and the step overlap), so it cannot end the search;"
                " hydra.sweeper.n_trials does",
                idx,
                reach,
                self._ceiling.describe(),
            )
            self._ceiling = None
        elif verdict == ceiling.STOP:
            if recheck is not None and not self._rechecked:
                self._rechecked = True  # twice is enough: later near trials keep the higher
                self._raise_ceiling(config, recheck())
                if ceiling.near(value, self._ceiling.value, within) is None:
                    log.info(
                        "trial %d reached %.2f of the ceiling, but the ceiling measured again"
                        " is higher (%s): the search goes on",
                        *(idx, reach, self._ceiling.describe()),
                    )
                    return
            again = confirm()
            if not again.ok or ceiling.near(again.value, self._ceiling.value, within) is None:
                shown = f"{again.value:,.1f}" if again.ok else again.reason
                log.info(
                    "trial %d reached %.2f of the ceiling, but its second run did not (%s):"
                    " the search goes on",
                    *(idx, reach, shown),
                )
                return
            self.stop_reason = (
                f"trial {idx} reaches {reach:.2f} of what this machine allows, and"
                f" {again.value / self._ceiling.value:.2f} in a second run"
                f" ({self._ceiling.describe()}); stopping the search"
            )
            log.info("%s", self.stop_reason)
