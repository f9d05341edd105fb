"""The Optuna sweeper, tolerant of a study in which no trial completed, and of Ctrl-C.

hydra-optuna-sweeper 1.3.0 ends every sweep by reading ``study.best_trial``, which raises
when every trial failed: the sweep dies with a traceback before feedrate's callback can
report why the trials failed. This subclass lets the sweep end normally; the callback then
prints the reasons and exits non-zero, leaving any existing preset untouched.

On Ctrl-C the trial launcher has already killed the running trial; here that trial is marked
failed in the study (not left "running"), and the sweep ends with status 130 and the way on.
"""

import logging
import sys

from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper

log = logging.getLogger(__name__)


class FeedrateOptunaSweeper(OptunaSweeper):
    def sweep(self, arguments: list[str]) -> None:
        try:
            return super().sweep(arguments)
        except KeyboardInterrupt:
            import optuna

            from feedrate.study import fail_unfinished

            impl = self.sweeper  # the plugin keeps its settings on its implementation
            study = optuna.load_study(study_name=impl.study_name, storage=impl.storage)
            marked = fail_unfinished(study, "interrupted (Ctrl-C) before the trial finished")
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
            return None
