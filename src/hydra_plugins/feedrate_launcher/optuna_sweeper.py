"""The Optuna sweeper of feedrate's sweeps: hydra-optuna-sweeper's settings and search space,
with feedrate's own ask-and-tell loop.

The plugin's loop asks for ``n_trials`` trials and tells Optuna what each returned. A loader
sweep needs three things it has no hook for: a trial the launcher's guard skips before it runs
(predicted not to fit, or past the workers the seeds bound) is told as pruned, with its reason,
and does not count against ``n_trials``; the search ends when a trial reaches the ceiling
(``sweep.stop_within``); and Ctrl-C fails this sweep's unfinished trials (never another
sweep's, on a shared storage) and exits 130. So this class runs the loop itself, through
Optuna's public ask-and-tell interface on its own study, and takes everything else from the
plugin: its configuration (``hydra/sweeper=optuna``, the samplers), the parsing of
``hydra.sweeper.params`` into distributions and the custom search space.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from contextlib import nullcontext
from typing import Any, NoReturn

import optuna
from hydra.core.utils import JobStatus
from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
from omegaconf import OmegaConf
from optuna.trial import TrialState

from feedrate.errors import FeedrateError
from feedrate.sweep.study import (
    REASON_KEY,
    Heartbeat,
    open_study,
    requeue_stale,
    shared,
    shown,
)

log = logging.getLogger(__name__)


class FeedrateOptunaSweeper(OptunaSweeper):
    def sweep(self, arguments: list[str]) -> None:
        impl = self.sweeper  # the plugin keeps its settings on its implementation
        launcher = impl.launcher
        impl._process_searchspace_config()
        space, fixed, fixed_overrides = create_params_from_overrides(
            [*impl._parse_sweeper_params_config(), *arguments]
        )
        for name in fixed:
            space.pop(name, None)
        sampler, wanted = _sampler(impl, space)
        directions = [getattr(d, "name", d) for d in _as_list(impl.direction)]
        try:
            study = open_study(
                impl.study_name, impl.storage, sampler=sampler, directions=directions
            )
        except FeedrateError as exc:  # said in words, not a traceback
            log.error("%s", exc)
            sys.exit(exc.exit_code)
        log.info("Study name: %s", study.study_name)
        log.info("Storage: %s", shown(impl.storage))
        log.info("Sampler: %s", type(sampler).__name__)
        log.info("Directions: %s", directions)
        # A trial the guard of feedrate's launcher skips measures nothing: it does not count
        # against n_trials, and at most n_trials more are asked in its place.
        skips: dict[int, str] = getattr(launcher, "skips", {})  # job index -> why
        figures: dict[int, dict] = getattr(launcher, "figures", {})  # job index -> the climb's
        # On a shared storage other sweepers run trials of the same study: each running trial
        # says it is alive, and one whose sweeper went quiet is asked again (never lost).
        stale_after = _stale_after(impl.config) if shared(impl.storage) else None
        asked: list[optuna.trial.Trial] = []
        unfinished: dict[int, optuna.trial.Trial] = {}  # told nothing yet, by trial number
        try:
            while True:
                run = len(asked) - len(skips)
                if stale_after is not None:
                    _requeue(study, stale_after)
                if getattr(launcher, "stop_reason", None):
                    break
                size = min(impl.n_jobs, wanted - run)
                if run >= wanted or len(asked) >= 2 * wanted:
                    # Done with its own trials. On a shared storage, trials asked again for a
                    # sweeper that died are run too, and the search ends when no other sweeper
                    # still runs one (the finals then run on the machine that finished last).
                    if stale_after is None:
                        break
                    waiting = _elsewhere(study, TrialState.WAITING)
                    if not waiting and not _elsewhere(study, TrialState.RUNNING):
                        break
                    if not waiting:
                        time.sleep(min(5.0, stale_after / 6))
                        continue
                    size = 1
                batch = [study.ask() for _ in range(size)]
                unfinished.update((t.number, t) for t in batch)
                asked += batch
                overrides = impl._configure_trials(batch, space, fixed, fixed_overrides)
                first = impl.job_idx
                if hasattr(launcher, "asked"):  # enqueued by name: a seed, or the climb's
                    launcher.asked |= {first + i for i in _by_name(study, batch)}
                beat = Heartbeat(batch, stale_after / 6) if stale_after else nullcontext()
                with beat:
                    returns = launcher.launch(overrides, initial_job_idx=first)
                impl.job_idx += len(returns)
                failures = 0
                for job, (trial, ret) in enumerate(zip(batch, returns, strict=True), start=first):
                    figure = figures.pop(job, None)
                    failures += _tell(study, trial, ret, skips.get(job), figure)
                    del unfinished[trial.number]
                if failures > impl.max_failure_rate * len(returns):
                    log.error(
                        "%d of %d trials failed, more than max_failure_rate=%g",
                        *(failures, len(returns), impl.max_failure_rate),
                    )
                    for ret in returns:
                        ret.return_value  # noqa: B018 - raises the first failure's exception
                more = len(asked) - len(skips) < wanted and len(asked) < 2 * wanted
                if more and len(directions) == 1 and not getattr(launcher, "stop_reason", None):
                    _climb(study, impl.config)  # asked next; never left waiting at the end
        except KeyboardInterrupt:
            _interrupted(study, unfinished, impl.study_name)
        _say_skips(len(asked) - len(skips), wanted, len(skips))
        _save_results(study, len(directions), impl.config.hydra.sweep.dir)


def _sampler(impl, space: dict) -> tuple[Any, int]:
    """The study's sampler, and the trials wanted: a grid's are at most its points."""
    sampler, wanted = impl.sampler, impl.n_trials
    if isinstance(sampler, functools.partial) and sampler.func is optuna.samplers.GridSampler:
        grid = {name: impl._to_grid_sampler_choices(d) for name, d in space.items()}
        sampler = sampler(grid)
        wanted = min(wanted, _grid_size(grid))
    return sampler, wanted


def _interrupted(study: optuna.Study, unfinished: dict, study_name: str) -> NoReturn:
    """Ctrl-C: the trials still running are marked failed (asked again when the same
    command resumes the study), and the sweep exits."""
    reason = "interrupted (Ctrl-C) before the trial finished"
    for trial in unfinished.values():
        trial.set_user_attr(REASON_KEY, reason)
        study.tell(trial, state=TrialState.FAIL)
    done = sum(t.state.is_finished() for t in study.trials) - len(unfinished)
    log.error(
        "interrupted (Ctrl-C): trial(s) %s marked failed, %d finished trials kept in"
        " study %s; no preset was written. Run the same command to resume the study",
        ", ".join(map(str, unfinished)) or "none",
        done,
        study_name,
    )
    sys.exit(130)


def _save_results(study: optuna.Study, objectives: int, sweep_dir: str) -> None:
    """optimization_results.yaml, as the Optuna sweeper writes it."""
    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not completed:
        log.error("no trial of the study completed")
        return
    if objectives > 1:
        front = [{"params": t.params, "values": t.values} for t in study.best_trials]
        results: dict[str, Any] = {"name": "optuna", "solutions": front}
    else:
        best = study.best_trial
        log.info("Best parameters: %s", best.params)
        log.info("Best value: %s", best.value)
        results = {"name": "optuna", "best_params": best.params, "best_value": best.value}
    OmegaConf.save(OmegaConf.create(results), f"{sweep_dir}/optimization_results.yaml")


def _tell(
    study: optuna.Study,
    trial: optuna.trial.Trial,
    ret,
    skipped: str | None,
    figure: dict | None = None,
) -> int:
    """Tell Optuna what one job returned; 1 when it counts as a failure, else 0. A skipped
    job is pruned: TPE learns nothing from a failed trial and proposes the same region
    again, while a pruned one without intermediate values ranks below every completed one."""
    if skipped is not None:
        trial.set_user_attr(REASON_KEY, f"skipped: {skipped}")
        study.tell(trial, state=TrialState.PRUNED)
        return 0
    if ret.status == JobStatus.COMPLETED:
        value = ret.return_value
        try:
            values = (
                [float(v) for v in value] if isinstance(value, list | tuple) else [float(value)]
            )
        except (TypeError, ValueError):
            log.warning("trial %d returned %r, not a number: failed", trial.number, value)
        else:
            if figure is not None:  # what the climb reads of it besides its value
                from feedrate.sweep.climb import FIGURE_KEY

                trial.set_user_attr(FIGURE_KEY, figure)
            study.tell(trial, values if len(values) > 1 else values[0])
            return 0
    else:
        failure = getattr(ret, "_return_value", None)
        trial.set_user_attr(REASON_KEY, str(failure) if failure is not None else "failed")
    study.tell(trial, state=TrialState.FAIL)
    return 1


def _climb(study: optuna.Study, config) -> None:
    """The climb's next trial, where it has one (:func:`feedrate.sweep.climb.next_trial`: the
    model's prediction, then the neighbours the figures leave open), asked next."""
    if not config.get("sweep"):
        return
    from feedrate.sweep.climb import PREDICTED_KEY, next_trial

    trials = study.get_trials(deepcopy=False)  # one read of a shared study's storage
    if any(t.state == TrialState.WAITING for t in trials):
        return  # asked already (by this sweeper, or another on the same study)
    step = next_trial(trials, config)
    if step is None:
        return
    params, said, predicted = step
    attrs = {PREDICTED_KEY: predicted} if predicted else None
    study.enqueue_trial(params, user_attrs=attrs, skip_if_exists=True)
    log.info("%s", said)


def _by_name(study: optuna.Study, batch: list[optuna.trial.Trial]) -> list[int]:
    """The places in ``batch`` of trials asked by name (``study.enqueue_trial``: a seed, or
    the climb's setting), not proposed by the sampler."""
    numbers = {t.number for t in batch}
    named = {
        t.number
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if t.number in numbers and "fixed_params" in t.system_attrs
    }
    return [i for i, t in enumerate(batch) if t.number in named]


def _say_skips(ran: int, wanted: int, skipped: int) -> None:
    if skipped:
        log.info(
            "%d of %d trials run; %d more were skipped before running (predicted not to fit,"
            " or past the workers the seeds or the model bound; each reason in trials.csv;"
            " pruned for Optuna) and did not count against hydra.sweeper.n_trials",
            *(ran, wanted, skipped),
        )


def _requeue(study: optuna.Study, stale_after: float) -> None:
    requeued = requeue_stale(study, stale_after)
    if requeued:
        log.warning(
            "trial(s) %s of the study had no sign of life for %g s (their sweeper was killed,"
            " or its node lost): marked failed, and their parameters asked again",
            ", ".join(map(str, requeued)),
            stale_after,
        )


def _elsewhere(study: optuna.Study, state: TrialState) -> int:
    """Trials of the study in ``state``: on a shared storage, other sweepers' (RUNNING) or
    asked again for a sweeper that died (WAITING)."""
    return len(study.get_trials(deepcopy=False, states=(state,)))


STALE_AFTER_S = 120.0  # sweep.stale_after_s where a sweep config does not say


def _stale_after(config) -> float:
    sweep = config.get("sweep")
    value = sweep.get("stale_after_s") if sweep is not None else None
    return float(value) if value else STALE_AFTER_S


def _grid_size(grid: dict[str, list]) -> int:
    size = 1
    for choices in grid.values():
        size *= len(choices)
    return size


def _as_list(direction) -> list:
    return (
        list(direction)
        if isinstance(direction, list | tuple) or OmegaConf.is_list(direction)
        else [direction]
    )
