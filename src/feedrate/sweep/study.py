"""The sweep's Optuna study on disk: one sweep at a time, and no trial left "running".

A sweep that is killed (or Ctrl-C'd) in the middle of a trial leaves that trial in the
RUNNING state in its database, for ever: Optuna cannot know that nobody is running it. The
next sweep of the same study holds the study's lock, so any RUNNING trial it finds belongs
to a sweep that is gone: it is marked failed, with the reason, and the study goes on with its
finished trials kept.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING

from feedrate.errors import ConfigError

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)

REASON_KEY = "reason"  # a trial's user attribute
REASONS_KEY = "reasons"  # the study's: trial number -> reason, for trials marked failed later


def sqlite_path(storage: str | None) -> Path | None:
    """The file of a ``sqlite:///`` storage URL; None for other storages."""
    if storage and storage.startswith("sqlite:///"):
        return Path(storage[len("sqlite:///") :])
    return None


def lock(storage: str | None, study_name: str) -> IO[str] | None:
    """Hold the study's lock for the life of this process (returned file: keep it open).

    Only for SQLite studies: a shared database (a cluster's) is used by several machines
    at once, each running its own trials.
    """
    db = sqlite_path(storage)
    if db is None:
        return None
    db.parent.mkdir(parents=True, exist_ok=True)
    fh = open(db.with_name(db.name + ".lock"), "a+")  # noqa: SIM115 - held until exit
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        owner = fh.read().strip() or "another process"
        fh.close()
        raise ConfigError(
            f"the study {study_name} ({db}) is in use by a sweep still running ({owner}):"
            " wait for it to end, or give this sweep its own sweep.preset_name"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()}\n")
    fh.flush()
    return fh


JOURNAL = "journal://"


def storage_of(url: str | None):
    """What Optuna opens for a study's storage URL: ``journal:///path`` becomes Optuna's
    journal file (for a shared filesystem without a database: appends under a file lock),
    anything else is Optuna's own (``sqlite:///``, ``postgresql+psycopg://``, ``None``:
    in memory)."""
    if url is None or not str(url).startswith(JOURNAL):
        return url
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = Path(str(url)[len(JOURNAL) :])
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path)))


def shown(url: str | None) -> str:
    """A storage URL as it may be logged: never its password."""
    if not url or str(url).startswith(("sqlite", JOURNAL)):
        return str(url)
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(str(url)).render_as_string(hide_password=True)
    except ArgumentError:
        return "(a storage URL that is not a database URL)"


def has_password(url: str | None) -> bool:
    if not url or str(url).startswith(("sqlite", JOURNAL)):
        return False
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(str(url)).password is not None
    except ArgumentError:
        return False


def open_study(study_name: str, storage: str | None, **kwargs) -> optuna.Study:
    """``optuna.create_study(..., load_if_exists=True)``, with a study written by an older
    Optuna refused in words that say what to do: its tables predate this Optuna (feedrate
    used optuna 2.10 before the Hydra 1.4 line), and ``optuna storage upgrade`` migrates
    them in place. The study is not touched."""
    import optuna

    try:
        return optuna.create_study(
            study_name=study_name, storage=storage_of(storage), load_if_exists=True, **kwargs
        )
    except RuntimeError as exc:
        if "no longer compatible with the table schema" not in str(exc):
            raise
        raise ConfigError(
            f"the study {study_name} ({shown(storage)}) was written by an older Optuna: {exc}"
            " Migrate it in place (keep a copy first: an older Optuna cannot read it after),"
            f" then run the same command again: optuna storage upgrade --storage {shown(storage)}"
            " <cfg.hydra.sweeper.storage>"
        ) from None


def fail_unfinished(study: optuna.Study, reason: str) -> list[int]:
    """Mark the study's RUNNING trials failed, ``reason`` kept for each (a study user
    attribute: a trial another process asked has no public handle to set its own); their
    numbers."""
    from optuna.trial import TrialState

    marked = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        marked.append(trial.number)
    if marked:
        reasons = dict(study.user_attrs.get(REASONS_KEY, {}))
        reasons.update({str(n): reason for n in marked})
        study.set_user_attr(REASONS_KEY, reasons)
    return marked


def reason_of(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> str:
    """Why a trial was pruned or failed, as the sweep recorded it ("" when it did not)."""
    return trial.user_attrs.get(REASON_KEY) or study.user_attrs.get(REASONS_KEY, {}).get(
        str(trial.number), ""
    )
