"""The Optuna sweeper, tolerant of a study in which no trial completed, of a search that
stops near the ceiling, of trials the launcher's guard skips, and of Ctrl-C (unfinished trials
marked failed, exit 130).

hydra-optuna-sweeper 1.3.0 reads ``study.best_trial`` at the end, which raises when every
trial failed, before feedrate's callback can say why (docs/design.md, "Where the code is").
"""

import logging
import sys

from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper

log = logging.getLogger(__name__)


class _SearchDone(Exception):
    """The search ends before the plugin's loop does: a trial reached the ceiling
    (sweep.stop_within), or n_trials trials ran besides those the guard skipped."""


def _write_results(impl, study) -> None:
    """What the plugin writes and says at the end of a full search: the best search trial."""
    from omegaconf import OmegaConf

    best = study.best_trial
    log.info("Best parameters: %s", best.params)
    log.info("Best value: %s", best.value)
    OmegaConf.save(
        OmegaConf.create({"name": "optuna", "best_params": best.params, "best_value": best.value}),
        f"{impl.config.hydra.sweep.dir}/optimization_results.yaml",
    )


class FeedrateOptunaSweeper(OptunaSweeper):
    def sweep(self, arguments: list[str]) -> None:
        import optuna
        from optuna.trial import TrialState

        from feedrate.sweep.study import REASON_KEY, fail_unfinished

        impl = self.sweeper  # the plugin keeps its settings on its implementation
        wanted = impl.n_trials
        # A trial the guard of feedrate's launcher skips (predicted not to fit) measures
        # nothing: it does not count against n_trials. The plugin's loop counts asks, so it may
        # ask up to twice as many, one at a time, and the search ends once n_trials ran. (A
        # grid is visited whole either way; with n_jobs > 1 a batch must not end half-asked.)
        replaces = (
            hasattr(impl.launcher, "skips")
            and impl.n_jobs == 1
            and not isinstance(impl.sampler, optuna.samplers.GridSampler)
        )
        if replaces:
            impl.n_trials = 2 * wanted
        # The trials this sweep asks for (trial id -> job index), so Ctrl-C fails its own and
        # never another sweep's on a shared storage, and a skipped job's trial is known.
        asked: dict[int, int] = {}
        seen: dict[str, optuna.Study] = {}  # the plugin's study (in-memory storage too)
        ask, tell = optuna.study.Study.ask, optuna.study.Study.tell

        def skips() -> dict[int, str]:
            return getattr(impl.launcher, "skips", {})  # job index -> the guard's reason

        def ask_and_remember(study, *args, **kwargs):
            seen["study"] = study
            reason = getattr(impl.launcher, "stop_reason", None)
            if reason:  # a trial reached the ceiling: no more trials (see the launcher)
                raise _SearchDone(reason)
            if replaces and len(asked) - len(skips()) >= wanted:
                raise _SearchDone(None)
            trial = ask(study, *args, **kwargs)
            # jobs are numbered from impl.job_idx on, in the order their trials were asked
            start = impl.job_idx
            asked[trial._trial_id] = start + sum(job >= start for job in asked.values())
            return trial

        def tell_skipped_as_pruned(study, trial, values=None, state=TrialState.COMPLETE):
            # TPE learns nothing from a failed trial and proposes the same region again; a
            # pruned one without intermediate values ranks below every completed one.
            if isinstance(trial, optuna.trial.Trial) and state == TrialState.FAIL:
                reason = skips().get(asked.get(trial._trial_id, -1))
                if reason is not None:
                    trial.set_user_attr(REASON_KEY, f"skipped: {reason}")
                    state = TrialState.PRUNED
            return tell(study, trial, values=values, state=state)

        optuna.study.Study.ask = ask_and_remember
        optuna.study.Study.tell = tell_skipped_as_pruned
        try:
            try:
                super().sweep(arguments)
            except _SearchDone:  # raised by ask_and_remember, which saw the study
                _write_results(impl, seen["study"])
        except KeyboardInterrupt:
            study = seen.get("study")  # None: stopped before the first trial was asked
            reason = "interrupted (Ctrl-C) before the trial finished"
            marked, done = [], 0
            if study is not None:
                marked = fail_unfinished(study, reason, only=asked)
                done = sum(t.state.is_finished() for t in study.trials) - len(marked)
            log.error(
                "interrupted (Ctrl-C): trial(s) %s marked failed, %d finished trials kept in"
                " study %s; no preset was written. Run the same command to resume the study",
                ", ".join(map(str, marked)) or "none",
                done,
                impl.study_name,
            )
            sys.exit(130)
        except ValueError as exc:
            # in-memory storage says the first, SQLite (RDB) storage the second
            if not any(m in str(exc) for m in ("No trials are completed", "Record does not exist")):
                raise
            log.error("no trial of the study completed")
        finally:
            optuna.study.Study.ask, optuna.study.Study.tell = ask, tell
            impl.n_trials = wanted
        skipped = len(skips())
        if skipped and replaces:
            log.info(
                "%d of %d trials run; %d more were skipped before running (predicted not to"
                " fit, or past the workers the seeds bound; each reason in trials.csv; pruned"
                " for Optuna) and did not count against hydra.sweeper.n_trials",
                len(asked) - skipped,
                wanted,
                skipped,
            )
        elif skipped:
            log.info(
                "%d trials run; %d skipped before running (predicted not to fit, or past the"
                " workers the seeds bound; each reason in trials.csv; pruned for Optuna)",
                len(asked) - skipped,
                skipped,
            )
