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
import socket
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from feedrate.errors import ConfigError

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)

REASON_KEY = "reason"  # a trial's user attribute
REASONS_KEY = "reasons"  # the study's: trial number -> reason, for trials marked failed later
NODE_KEY = "node"  # a trial's: the machine (host:pid) that measured it
ALIVE_KEY = "alive_at"  # a trial's: when its sweeper last said it was running it (epoch s)
RETRY_KEY = "retry_of"  # a trial's: the stale trial whose parameters it runs again
MACHINE_KEY = "machine"  # the study's: the machine type its trials are measured on


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


def shared(storage: str | None) -> bool:
    """A storage several sweepers may use at once (a database server, a journal file): no
    lock, and a running trial may be another machine's."""
    return bool(storage) and not str(storage).startswith("sqlite")


def node_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Heartbeat:
    """While trials run: each says which node runs it, and every ``interval`` seconds that
    the node is still at it (``ALIVE_KEY``), so that another sweeper on a shared storage can
    tell a trial whose sweeper died from one still running (:func:`requeue_stale`)."""

    def __init__(self, trials: list, interval: float) -> None:
        self.trials, self.interval = trials, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="feedrate-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        for trial in self.trials:
            trial.set_user_attr(NODE_KEY, node_name())
            trial.set_user_attr(ALIVE_KEY, time.time())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            for trial in self.trials:
                try:
                    trial.set_user_attr(ALIVE_KEY, time.time())
                except Exception as exc:  # noqa: BLE001 - a lost beat: the next one may land
                    log.debug("heartbeat of trial %d not recorded: %s", trial.number, exc)


def requeue_stale(study: optuna.Study, stale_after: float, now=time.time) -> list[int]:
    """Trials RUNNING whose sweeper has not said it is alive for ``stale_after`` seconds (it
    was killed, or its node went away): each is marked failed, with the reason, and its
    parameters are asked again as a new trial. Exactly once: marking a finished trial
    raises, so of two sweepers that find the same stale trial only one requeues it. The
    numbers of the trials requeued."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    requeued = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        alive = trial.user_attrs.get(ALIVE_KEY)
        if alive is None and trial.datetime_start is not None:
            alive = trial.datetime_start.timestamp()
        if alive is None or now() - alive < stale_after:
            continue
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except (ValueError, UpdateFinishedTrialError):
            continue  # another sweeper marked it first, and requeues it
        study.enqueue_trial(trial.params, user_attrs={RETRY_KEY: trial.number})
        requeued.append(trial.number)
    if requeued:
        reasons = dict(study.user_attrs.get(REASONS_KEY, {}))
        for n in requeued:
            reasons[str(n)] = (
                f"stale: its sweeper stopped saying it was running it for {stale_after:g} s"
                " (killed, or its node lost); its parameters were asked again"
            )
        study.set_user_attr(REASONS_KEY, reasons)
    return requeued


def machine_type() -> dict:
    """What makes two machines the same for a loader study: the CPU, the cores this process
    may use, the GPUs, and the memory (to the GB)."""
    from feedrate import hardware

    fp = hardware.detect()
    return {
        "cpu_model": fp.cpu_model,
        "usable_cores": fp.usable_cores,
        "gpu": f"{fp.gpu_count}x {fp.gpu_name}" if fp.gpu_count else "none",
        "ram_gb": round(fp.ram_gb),
    }


def check_machine(study: optuna.Study) -> None:
    """A study holds one machine type: the first sweeper records it (``MACHINE_KEY``), and a
    sweeper on another type is refused before any trial, since its figures would be
    compared with the others' as if measured on the same machine."""
    here, known = machine_type(), study.user_attrs.get(MACHINE_KEY)
    if known is None:
        study.set_user_attr(MACHINE_KEY, here)
        return
    differs = {k: (known.get(k), v) for k, v in here.items() if known.get(k) != v}
    if differs:
        shown_diff = "; ".join(f"{k}: {a} there, {b} here" for k, (a, b) in differs.items())
        raise ConfigError(
            f"the study {study.study_name} was measured on another machine type ({shown_diff}):"
            " a study holds one, so that its figures compare. Sweep this machine type with"
            " its own sweep.preset_name (or its own study) <cfg.sweep.preset_name>"
        )


def claim_finals(study: optuna.Study, storage: str) -> bool:
    """On a shared storage, whether this sweeper runs the finals: the first of the sweepers
    that finish the same search to create the claim (a study named after this one and its
    number of finished trials: creating a study whose name exists fails, atomically, in a
    database and in a journal file)."""
    import optuna
    from optuna.exceptions import DuplicatedStudyError
    from optuna.trial import TrialState

    done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    try:
        claim = optuna.create_study(
            study_name=f"{study.study_name}:finals:{done}", storage=storage_of(storage)
        )
    except DuplicatedStudyError:
        return False
    claim.set_user_attr(NODE_KEY, node_name())
    return True
