"""The Optuna sweeper, tolerant of a study in which no trial completed, of a search that
stops near the ceiling, and of Ctrl-C (unfinished trials marked failed, exit 130).

hydra-optuna-sweeper 1.3.0 reads ``study.best_trial`` at the end, which raises when every
trial failed, before feedrate's callback can say why (docs/design.md, "Where the code is").
"""

import logging
import sys

from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper

log = logging.getLogger(__name__)


class _SearchDone(Exception):
    """The search reached the ceiling before its trial budget (sweep.stop_within)."""


def _write_results(impl) -> None:
    """What the plugin writes at the end of a full search: the best search trial."""
    import optuna
    from omegaconf import OmegaConf

    study = optuna.load_study(study_name=impl.study_name, storage=impl.storage)
    best = study.best_trial
    OmegaConf.save(
        OmegaConf.create({"name": "optuna", "best_params": best.params, "best_value": best.value}),
        f"{impl.config.hydra.sweep.dir}/optimization_results.yaml",
    )


class FeedrateOptunaSweeper(OptunaSweeper):
    def sweep(self, arguments: list[str]) -> None:
        import optuna

        impl = self.sweeper  # the plugin keeps its settings on its implementation
        # A trial the launcher's guard skips (predicted not to fit) measures nothing: it does
        # not count against n_trials. The plugin's loop counts asks, so it may ask up to twice
        # as many, and the search ends once n_trials were run.
        wanted = impl.n_trials
        impl.n_trials = 2 * wanted
        # The trials this sweep asks for, so Ctrl-C fails its own and never another sweep's
        # on a shared storage.
        asked: set[int] = set()
        ask = optuna.study.Study.ask

        def ask_and_remember(study, *args, **kwargs):
            launcher = impl.launcher
            reason = getattr(launcher, "stop_reason", None)
            if reason:  # a trial reached the ceiling: no more trials (see the launcher)
                raise _SearchDone(reason)
            if len(asked) - getattr(launcher, "skipped", 0) >= wanted:
                raise _SearchDone(None)
            trial = ask(study, *args, **kwargs)
            asked.add(trial._trial_id)
            return trial

        optuna.study.Study.ask = ask_and_remember
        try:
            super().sweep(arguments)
        except _SearchDone:
            try:
                _write_results(impl)
            except ValueError:  # no trial of the study completed
                log.error("no trial of the study completed")
        except KeyboardInterrupt:
            from feedrate.sweep.study import fail_unfinished

            study = optuna.load_study(study_name=impl.study_name, storage=impl.storage)
            marked = fail_unfinished(
                study, "interrupted (Ctrl-C) before the trial finished", only=asked
            )
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
            optuna.study.Study.ask = ask
            impl.n_trials = wanted
        skipped = getattr(impl.launcher, "skipped", 0)
        if skipped:
            log.info(
                "%d of %d trials run; %d more were skipped by the feasibility guard (predicted"
                " not to fit) and did not count against hydra.sweeper.n_trials",
                len(asked) - skipped,
                wanted,
                skipped,
            )
