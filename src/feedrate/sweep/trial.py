"""One sweep trial, run by a trial runner: a warm host (:mod:`feedrate.sweep.host`, the
default) or ``python train.py <overrides>`` in a fresh process (:class:`Fresh`), with a hard
time limit.

A trial that crashes, hangs or is killed (the OOM killer sends SIGKILL) becomes a failed
``TrialResult`` with its reason; it never stops the sweep. A trial's processes run in their own
session, so the whole group (main process and DataLoader workers) is killed at the end, and
the shared-memory segments they left in ``/dev/shm`` are removed once their owners are gone.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import psutil
from omegaconf import DictConfig

from feedrate.errors import ConfigError
from feedrate.files import atomic_write_text
from feedrate.orphans import DIE_WITH_PARENT, die_with_parent
from feedrate.project import primary_config_dir

OK, FAILED, SKIPPED = "ok", "failed", "skipped"
OVER_BUDGET = "over budget"  # it ran, and used more memory than sweep.memory_budget_gb
# Objectives a busy CPU distorts: a noisy measurement of one is taken again.
THROUGHPUT = ("samples_per_sec", "consumed_samples_per_sec", "produced_samples_per_sec")


@dataclass
class TrialResult:
    overrides: list[str]
    status: str  # ok | failed | skipped
    reason: str = ""
    value: float | None = None
    metrics: dict = field(default_factory=dict)
    duration_s: float = 0.0
    job_dir: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK

    def save(self, where: str | os.PathLike | None = None) -> None:
        """Write trial.json into ``where`` (default: the run's own ``job_dir``)."""
        target = Path(where if where is not None else self.job_dir) / "trial.json"
        atomic_write_text(target, json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, job_dir: str | os.PathLike) -> TrialResult:
        return cls(**json.loads((Path(job_dir) / "trial.json").read_text()))


class TrialFailed(Exception):
    """A trial that produced no usable measurement; the message is the reason."""


_SHM = Path("/dev/shm")


def _shm_names() -> set[str]:
    try:
        return {p.name for p in _SHM.iterdir()}
    except OSError:
        return set()


def descendants(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def remove_dead_shm(pids: set[int]) -> None:
    """Remove the /dev/shm segments PyTorch created for these processes (``torch_<pid>_*``)
    once their owner has ended, and only those: a live trial host keeps the segments its
    batches are in, and other jobs on the machine keep theirs. The ended pids are forgotten."""
    dead = {pid for pid in pids if not psutil.pid_exists(pid) or _zombie(pid)}
    prefixes = tuple(f"torch_{pid}_" for pid in dead)
    if prefixes:
        for name in _shm_names():
            if name.startswith(prefixes):
                (_SHM / name).unlink(missing_ok=True)
    pids -= dead


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_groups(pids: set[int]) -> None:
    """Kill the process groups these trial processes lead: torchrun starts each rank in a
    session of its own (with its DataLoader workers), which killing torchrun's group misses.
    Only groups led by one of ``pids``, so nothing outside the trial is touched."""
    for pid in pids:
        try:
            group = os.getpgid(pid)
        except (ProcessLookupError, PermissionError):
            continue
        if group in pids:
            kill_group(group)


def reap(pids: set[int], timeout: float = 2.0) -> None:
    """Wait, up to ``timeout`` in all, for these killed processes to be gone, so that nothing
    of a trial is left when its runner returns and their /dev/shm segments can be removed."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    psutil.wait_procs(procs, timeout=timeout)


def _error_line(log_text: str) -> str:
    """The most telling line of a failed run's output."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "[ERROR]" in ln:
            return ln.split("] - ", 1)[-1]
    for ln in reversed(lines):
        if re.match(r"^\w*(Error|Exception)\b", ln):
            return ln
    return lines[-1] if lines else "no output"


def reason_for(returncode: int, log_text: str) -> str:
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:  # a real-time signal has no name
            sig = f"signal {-returncode}"
        hint = " (the OOM killer sends SIGKILL: out of memory?)" if sig == "SIGKILL" else ""
        return f"killed by {sig}{hint}"
    return f"exit status {returncode}: {_error_line(log_text)}"


class Runner(Protocol):
    """Runs one trial: ``runner(overrides, job_dir, timeout_s, objective) -> TrialResult``.
    :class:`Fresh` and :class:`feedrate.sweep.host.Host` are the two; tests pass fakes."""

    def __call__(
        self, overrides: list[str], job_dir: str | os.PathLike, timeout_s: float, objective: str
    ) -> TrialResult: ...


def run_trial(
    runner: Runner,
    overrides: list[str],
    job_dir: str | os.PathLike,
    timeout_s: float,
    objective: str = "samples_per_sec",
) -> TrialResult:
    """Run one trial with ``runner``, output in ``job_dir``; a failing trial never raises.

    A throughput flagged noisy (other processes kept the run's cores busy) is not trusted as
    it stands: the trial runs once more, the first run's files set aside in
    ``job_dir/noisy_run``. If the second is noisy too, or fails, the better-founded result is
    kept with the reason, so the report shows which figures are doubtful. Objectives that are
    not throughput (``val_accuracy``) do not depend on a busy CPU and are not repeated.
    """
    result = runner(overrides, job_dir, timeout_s, objective)
    first_noise = result.metrics.get("noise") if result.ok else None
    if not first_noise or objective not in THROUGHPUT:
        return result
    job_dir = Path(job_dir)
    aside = job_dir / "noisy_run"
    aside.mkdir(exist_ok=True)
    for entry in list(job_dir.iterdir()):
        if entry != aside:
            os.replace(entry, aside / entry.name)
    result.job_dir = str(aside)
    again = runner(overrides, job_dir, timeout_s, objective)
    if not again.ok:  # the noisy figure is still a figure: keep it, flagged
        result.reason = (
            f"noisy ({'; '.join(first_noise)}), and measuring it again failed: {again.reason}"
        )
        # job_dir now holds the failed run: the figure's files (config, metrics) stay aside,
        # and job_dir/trial.json, which the report reads, points there
        result.save()
        result.save(job_dir)
        return result
    noise = again.metrics.get("noise")
    again.reason = (
        f"noisy twice: {'; '.join(noise)}"
        if noise
        else f"measured again: the first run was noisy ({'; '.join(first_noise)})"
    )
    again.save()
    return again


class Fresh:
    """Each trial as ``python script <overrides>`` in a fresh process: what a user's own run
    is, start-up included (``hydra.launcher.warm=false``). With ``ranks`` above 1, the job
    as it will run: ``torchrun --standalone --nproc_per_node=<ranks>``, its loader settings
    each rank's (``loader.per_rank=true``, which a contestant's own overrides may undo)."""

    def __init__(self, script: str | os.PathLike, ranks: int = 1) -> None:
        self.script = Path(script)
        self.ranks = ranks

    def job_overrides(self, overrides: list[str]) -> list[str]:
        """``overrides`` as the job runs them: under torchrun, loader settings each rank's."""
        return ["loader.per_rank=true", *overrides] if self.ranks > 1 else list(overrides)

    def command(self, overrides: list[str], job_dir: Path) -> list[str]:
        job = [str(self.script), *self.job_overrides(overrides), f"hydra.run.dir={job_dir}"]
        if self.ranks == 1:
            return [sys.executable, *job]
        torchrun = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            f"--nproc_per_node={self.ranks}",
        ]
        return [*torchrun, *job]

    def __call__(
        self,
        overrides: list[str],
        job_dir: str | os.PathLike,
        timeout_s: float,
        objective: str = "samples_per_sec",
    ) -> TrialResult:
        job_dir = Path(job_dir)
        job_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command(list(overrides), job_dir)
        t0 = time.perf_counter()
        pids: set[int] = set()
        with open(job_dir / "trial.log", "wb") as log_file:
            proc = subprocess.Popen(
                cmd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
                env={**os.environ, DIE_WITH_PARENT: "1"} if self.ranks > 1 else None,
            )
            pids.add(proc.pid)
            timed_out = False
            try:
                while True:  # poll, to learn the pids of the trial's workers while they live
                    try:
                        returncode = proc.wait(timeout=0.5)
                        break
                    except subprocess.TimeoutExpired:
                        pids |= descendants(proc.pid)
                        if time.perf_counter() - t0 > timeout_s:
                            kill_group(proc.pid)
                            returncode = proc.wait()
                            timed_out = True
                            break
            finally:  # also on Ctrl-C in the sweep: nothing of the trial outlives it
                kill_group(proc.pid)  # workers orphaned by a crashed main process
                pids |= descendants(proc.pid)
                kill_groups(pids)  # torchrun's ranks, each in a session of its own
                reap(pids)  # what the kill ended, so it counts as gone
                remove_dead_shm(pids)
        duration = time.perf_counter() - t0
        if timed_out:
            result = TrialResult(list(overrides), FAILED, duration_s=duration, job_dir=str(job_dir))
            result.reason = f"timed out after {timeout_s:g} s; process group killed"
            result.save()
            return result
        return read_result(job_dir, returncode, overrides, duration, objective)


def read_result(
    job_dir: Path, returncode: int, overrides: list[str], duration: float, objective: str
) -> TrialResult:
    """The trial's result from what its run left in ``job_dir`` (metrics.json, trial.log),
    written to ``job_dir/trial.json``."""
    result = TrialResult(list(overrides), FAILED, duration_s=duration, job_dir=str(job_dir))
    metrics_file = job_dir / "metrics.json"
    if returncode != 0:
        log_text = (job_dir / "trial.log").read_text(errors="replace")
        result.reason = reason_for(returncode, log_text)
    elif not metrics_file.exists():
        result.reason = "finished without writing metrics.json"
    else:
        result.metrics = json.loads(metrics_file.read_text())
        value = result.metrics.get(objective)
        samples = result.metrics.get("measured_samples") or 0
        if not isinstance(value, (int, float)) or not math.isfinite(value) or samples <= 0:
            result.reason = f"no usable measurement: {objective}={value!r}, {samples} samples"
        else:
            result.status, result.value = OK, float(value)
    result.save()
    return result


def conf_dir(config: DictConfig) -> Path:
    """The conf/ the sweep composes from (its trial hosts compose from it too)."""
    found = primary_config_dir(config.hydra)
    if found is None:
        raise ConfigError("cannot find the config directory the sweep composed from")
    return found


def base_args(config: DictConfig) -> list[str]:
    """The command line's overrides, which every trial repeats."""
    return list(config.hydra.overrides.task)


def hydra_args(config: DictConfig) -> list[str]:
    """The command line's ``hydra.*`` overrides that shape the sweep (trials, launcher)."""
    own = ("hydra.mode", "hydra.sweep.dir", "hydra.run.dir", "hydra.sweeper.study_name")
    return [a for a in config.hydra.overrides.hydra if not a.startswith(own)]
