"""The Optuna sweeper, tolerant of a study in which no trial completed.

hydra-optuna-sweeper 1.3.0 ends every sweep by reading ``study.best_trial``, which raises
when every trial failed: the sweep dies with a traceback before feedrate's callback can
report why the trials failed. This subclass lets the sweep end normally; the callback then
prints the reasons and exits non-zero, leaving any existing preset untouched.
"""

import logging

from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper

log = logging.getLogger(__name__)


class FeedrateOptunaSweeper(OptunaSweeper):
    def sweep(self, arguments: list[str]) -> None:
        try:
            return super().sweep(arguments)
        except ValueError as exc:
            # in-memory storage says the first, SQLite (RDB) storage the second
            if not any(m in str(exc) for m in ("No trials are completed", "Record does not exist")):
                raise
            log.error("no trial of the study completed")
            return None
