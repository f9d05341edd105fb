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
        from feedrate.sweep.search import Search

        self.search = Search()  # where the search may go, and when it ends: asked and told
        # job index -> why the guard skipped it: the sweeper asks for another trial instead
        self.skips: dict[int, str] = {}
        # job index -> what a completed trial measured besides its value: the sweeper keeps
        # it on the trial, where the climb reads it (feedrate.sweep.climb)
        self.figures: dict[int, dict] = {}
        # job indices the sweeper asked by name (the seeds, the climb's settings), not the
        # sampler: the model's bound does not skip them (the climb already chose them)
        self.asked: set[int] = set()

    @property
    def stop_reason(self) -> str | None:
        """Why the search ends before ``n_trials`` (near the ceiling), or None."""
        return self.search.stop_reason

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
        from feedrate.sweep.climb import figure_attrs
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
            skip = (
                self.guard.check(sweep_config)
                or self.search.past_bound(sweep_config)
                or (idx not in self.asked and self.search.past_model(sweep_config))
            )
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
                command = [*overrides, *self.search.abandon(sweep_config, objective)]
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
                self.figures[idx] = figure_attrs(result.metrics)
                self.search.took(result.value)
                self.search.learn_costs(idx, result.value, result.metrics)
                self._log_trial(idx, shown, objective, result)
                self.search.learn_bound(sweep_config, result.value)
                confirm = functools.partial(
                    run_trial, runner, command, job_dir / "confirm", self.timeout_s, objective
                )
                recheck = functools.partial(self._loader_only_again, runner, job_dir)
                self.search.check_ceiling(sweep_config, idx, result.value, confirm, recheck)
            else:
                ret.status = JobStatus.FAILED
                ret._return_value = TrialFailed(f"{result.status}: {result.reason}")
                log.warning("trial #%d %s -> %s: %s", idx, shown, result.status, result.reason)
            returns.append(ret)
        return returns

    def _log_trial(self, idx: int, shown: str, objective: str, result) -> None:
        """One line per trial, with the best so far; and why it was re-measured or cut short."""
        wait = result.metrics.get("data_wait_frac")
        log.info(
            "trial #%d %s -> %s %.1f, data wait %s (best so far %.1f)",
            *(idx, shown, objective, result.value),
            f"{wait:.0%}" if isinstance(wait, float) else "?",
            self.search.best,
        )
        if result.reason:  # measured again, or doubtful: say so beside the figure
            log.warning("trial #%d: %s", idx, result.reason)
        if result.metrics.get("abandoned"):
            log.info("trial #%d %s (half the best so far)", idx, result.metrics["abandoned"])

    def _loader_only_again(self, runner, job_dir: Path):
        """The ceiling's loader-only run once more, beside the trial that came near it (None
        when the ceiling does not say at how many workers it ran)."""
        from feedrate.sweep.ceiling import loader_only_run
        from feedrate.sweep.trial import run_trial

        ceiling = self.search.measured_ceiling
        assert self.config is not None and ceiling is not None
        if ceiling.loader_workers is None:
            return None
        overrides = loader_only_run(self.config, ceiling.loader_workers)
        return run_trial(runner, overrides, job_dir / "ceiling_again", self.timeout_s)
