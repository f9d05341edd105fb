"""A warm trial host: one process runs many sweep trials, so start-up is paid once.

A fresh ``python train.py`` per trial costs about 6 s here (13-20 s with ResNet-50 on an H200)
for a 2-3 s window. A host imports torch and Hydra once, builds the dataset and the model once,
keeps the device, the CUDA context and cuDNN's autotuning, and runs each trial as Hydra runs a
job: the trial's own composed config, output directory and ``.hydra/``, a new DataLoader (new
workers), a new optimizer. Between trials it puts back everything a trial can change; the list
is in docs/design.md ("The warm trial host"), and each item has a test.

The sweep side is :class:`Host`, a trial runner like :class:`feedrate.sweep.trial.Fresh`. A
trial that fails, hangs or leaks a thread retires its host: the next trial gets a new one. So
does one whose config changes what the host built (:func:`built_key`).

A host is forked from a fork server that has imported torch, ``torch._dynamo`` (which the
first optimizer imports), Hydra and the run once for the whole sweep (multiprocessing's
``forkserver``, its modules preloaded): a new host costs a fork, not a Python start of about
4 s of CPU here. Jobs and answers are pickled over two pipes.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from feedrate.orphans import die_with_parent
from feedrate.sweep.space import ranks_per_node
from feedrate.sweep.trial import (
    FAILED,
    Fresh,
    Runner,
    TrialResult,
    conf_dir,
    descendants,
    kill_group,
    read_result,
    reap,
    reason_for,
    remove_dead_shm,
)

log = logging.getLogger(__name__)

DONE, REBUILD = "done", "rebuild"  # the host's answers besides a failure's exit status
# What the fork server imports once, so a host starts warm: the run (torch, Hydra, feedrate),
# and torch._dynamo, which the first optimizer of every run imports (1.3 s here)
PRELOAD = ["feedrate.launch", "feedrate.sweep.host", "torch._dynamo"]


def _context():
    """Hosts are forked from a server that preloaded :data:`PRELOAD` (Linux and macOS)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def built_key(cfg: DictConfig) -> str:
    """What a host builds once and keeps: a trial whose key differs gets a new host. The
    dataset, the model, the hardware profile, and the loader keys that shape them (the batch
    size sizes nothing built, but a host keeps the sample batches of one size warm; decode
    changes the dataset)."""
    loader = cfg.loader
    kept = {
        "dataset": cfg.dataset,
        "model": cfg.model,
        "hardware": cfg.hardware,
        "batch_size": loader.batch_size,
        "decode": getattr(loader.get("decode"), "value", loader.get("decode")),
        "seed": cfg.trainer.seed,
        "val_fraction": cfg.trainer.val_fraction,
    }
    return OmegaConf.to_yaml(OmegaConf.create(kept))


# -- the sweep's side ----------------------------------------------------------------------


class Host:
    """The sweep's handle on one host process, started on the first trial. Call it as a
    trial runner: ``host(overrides, job_dir, timeout_s, objective) -> TrialResult``."""

    def __init__(
        self,
        config_dir: str | os.PathLike,
        config_name: str,
        log_path: Path,
        script_dir: str | os.PathLike | None = None,
    ) -> None:
        self.config_dir, self.config_name = str(config_dir), config_name
        self.log_path = Path(log_path)
        # first on the host's sys.path, as train.py's folder is for `python train.py`
        self.script_dir = str(script_dir) if script_dir is not None else None
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._jobs = self._answers = None  # the two pipes' ends on this side
        self.trials = 0  # trials this process ran
        self.started = 0  # processes started
        self.pids: set[int] = set()  # the host's and its workers', for /dev/shm clean-up

    def __call__(
        self,
        overrides: list[str],
        job_dir: str | os.PathLike,
        timeout_s: float,
        objective: str = "samples_per_sec",
    ) -> TrialResult:
        job_dir = Path(job_dir)
        job_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        try:
            answer = self._ask(overrides, job_dir, timeout_s, t0)
            if answer.get("status") == REBUILD:  # built for another workload: start afresh
                log.info("trial host: %s; starting a new one", answer["why"])
                self.close()
                answer = self._ask(overrides, job_dir, timeout_s, t0)
        except KeyboardInterrupt:
            self.close()  # the trial ends with the sweep now, not at the interpreter's exit
            raise
        duration = time.perf_counter() - t0
        if answer.get("status") == DONE:
            self.trials += 1
            result = read_result(job_dir, 0, overrides, duration, objective)
            if answer.get("leaked"):  # a trial left state the host cannot reset: retire it
                log.warning("trial host retired: %s", answer["leaked"])
                self.close()
            elif not result.ok:  # it ran, but measured nothing usable: start afresh too
                self.close()
        else:
            result = TrialResult(list(overrides), FAILED, duration_s=duration, job_dir=str(job_dir))
            result.reason = answer["reason"]
            result.save()
            self.close()  # a failed trial gets a new host: whatever broke stays with this one
        remove_dead_shm(self.pids)
        return result

    def _ask(self, overrides: list[str], job_dir: Path, timeout_s: float, t0: float) -> dict:
        """Send one job and wait for its answer; a host that dies or runs out of time is
        killed and the answer says why, as a fresh trial's would."""
        self.start()
        job = {"overrides": list(overrides), "job_dir": str(job_dir)}
        with contextlib.suppress(OSError):  # it died: its exit status below says how
            self._jobs.send(job)
        while True:
            answer = self._answer(0.5)
            if answer is not None:
                return answer
            self.pids |= descendants(self.proc.pid)
            if not self.proc.is_alive():
                returncode = self.proc.exitcode
                self.close()
                log_text = _read_text(job_dir / "trial.log")
                return {"reason": "trial host died: " + reason_for(returncode, log_text)}
            if time.perf_counter() - t0 > timeout_s:
                self.close()
                return {"reason": f"timed out after {timeout_s:g} s; trial host killed"}

    def _answer(self, wait_s: float) -> dict | None:
        """The host's answer, or None: none within ``wait_s``, or the host has closed its end
        (it is exiting)."""
        try:
            return self._answers.recv() if self._answers.poll(wait_s) else None
        except (EOFError, OSError):
            self.proc.join(wait_s)  # its exit status, for the caller
            return None

    def start(self) -> None:
        """Fork the host from the fork server, unless it is running."""
        if self.proc is not None and self.proc.is_alive():
            return
        self.close()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)  # now, not the fork server's at its start
        if self.script_dir is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [self.script_dir, env.get("PYTHONPATH")])
            )
        ctx = _context()
        jobs_in, jobs = ctx.Pipe(duplex=False)
        answers, answers_out = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_hosted,
            args=(self.config_dir, self.config_name, str(self.log_path), self.script_dir, env),
            kwargs={"jobs": jobs_in, "answers": answers_out},
            name="feedrate-trial-host",
        )
        try:
            proc.start()  # the first of a sweep waits for the server to preload (seconds)
        except BaseException:  # Ctrl-C meanwhile, or no server: nothing started to end
            for end in (jobs_in, jobs, answers, answers_out):
                end.close()
            raise
        finally:
            jobs_in.close()
            answers_out.close()
        self.proc, self._jobs, self._answers = proc, jobs, answers
        self.pids.add(proc.pid)
        self.started += 1
        self.trials = 0

    def close(self) -> None:
        """End the host and everything it started; remove the /dev/shm segments they left."""
        if self.proc is not None:
            kill_group(self.proc.pid)  # its session: the host and its workers, dead or alive
            if self.proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGKILL)  # if killed before its setsid
            self.proc.join()
            reap(self.pids)  # its workers: no longer its children, they end on their own
            self.proc.close()
            self.proc = None
        for end in (self._jobs, self._answers):
            if end is not None:
                end.close()
        self._jobs = self._answers = None
        remove_dead_shm(self.pids)


class HostPool:
    """The sweep's hosts by name (``search``, one per final contestant), ended at exit."""

    def __init__(self) -> None:
        self.hosts: dict[str, Host] = {}
        atexit.register(self.close_all)

    def get(self, name: str, config_dir: str | os.PathLike, config_name: str, logs: Path) -> Host:
        if name not in self.hosts:
            script = Path(sys.argv[0]).resolve()
            # train.py's folder, as for `python train.py` (the feedrate command's bin/ is not a
            # project: its project reaches the hosts through PYTHONPATH already)
            script_dir = (
                script.parent if script.suffix == ".py" and script.stem != "__main__" else None
            )
            log_path = logs / f"host_{name}.log"
            self.hosts[name] = Host(config_dir, config_name, log_path, script_dir)
        return self.hosts[name]

    def rename(self, old: str, new: str) -> None:
        """Hand a warm host on (the search's to the first final contestant)."""
        if old in self.hosts and new not in self.hosts:
            self.hosts[new] = self.hosts.pop(old)

    def close_all(self, but: str | None = None) -> None:
        """End every host, or every one but ``but``: each, whatever ending another raised
        (a host left running would hold the sweep at its exit)."""
        failed = None
        for name in [n for n in self.hosts if n != but]:
            try:
                self.hosts.pop(name).close()
            except BaseException as exc:  # noqa: BLE001 - the others are ended first
                failed = failed or exc
        if failed is not None:
            raise failed


POOL = HostPool()


def runner_for(config: DictConfig, name: str) -> Runner:
    """The trial runner for the sweep's ``name`` (``search``, or a final contestant's): its
    warm host, or with ``hydra.launcher.warm=false`` a fresh process per trial; with
    ``sweep.ranks_per_node`` above 1, a fresh torchrun job per trial (a warm host is one
    process)."""
    ranks = ranks_per_node(config) if config.get("sweep") is not None else 1
    if ranks > 1 or not config.hydra.launcher.get("warm", True):
        return Fresh(Path(sys.argv[0]).resolve(), ranks)
    logs = Path(config.hydra.sweep.dir) / "hosts"
    return POOL.get(name, conf_dir(config), config.hydra.job.config_name, logs)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# -- the host's side -----------------------------------------------------------------------


class TrialHost:
    """Runs trials in this process, one after another, each as a fresh ``python train.py``
    would, and puts back what a trial changed (docs/design.md, "The warm trial host")."""

    def __init__(self, config_dir: str, config_name: str) -> None:
        from hydra import initialize_config_dir

        import feedrate.launch  # noqa: F401 - torch, and the config schemas Hydra composes with
        from feedrate.workload import Kept

        self.config_name = config_name
        # Hydra's compose API, as train.py's @hydra.main would compose: once per process
        self._hydra = initialize_config_dir(config_dir, job_name="train")
        self._hydra.__enter__()
        self.kept = Kept()
        self.key: str | None = None
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        self.signals[signal.SIGCHLD] = signal.getsignal(signal.SIGCHLD)
        self.threads = {t.ident for t in threading.enumerate()}

    def close(self) -> None:
        self._hydra.__exit__(None, None, None)

    def run(self, overrides: list[str], job_dir: str) -> dict:
        """One trial; the answer: ``done``, ``rebuild`` (another workload) or a failure."""
        from hydra import compose
        from hydra.core.utils import JobStatus, run_job
        from hydra.types import HydraContext

        config = compose(
            self.config_name,
            [*overrides, f"hydra.run.dir={job_dir}"],
            return_hydra_config=True,
        )
        key = built_key(config)
        if self.key is not None and key != self.key:
            return {"status": REBUILD, "why": _key_change(self.key, key)}
        self.key = key
        outcome: dict = {}
        with _output_to(Path(job_dir) / "trial.log"):
            ret = run_job(
                task_function=functools.partial(self._task, outcome=outcome),
                config=config,
                job_dir_key="hydra.run.dir",
                job_subdir_key=None,
                hydra_context=HydraContext(config_loader=None, callbacks=_callbacks(config)),
            )
            if ret.status == JobStatus.FAILED:  # raised past the task: a fresh run would die
                outcome.setdefault("returncode", 1)
                logging.getLogger("feedrate").error("%r", ret._return_value)
        self.reset()
        if outcome.get("returncode", 1) != 0:
            log_text = _read_text(Path(job_dir) / "trial.log")
            return {"reason": reason_for(outcome.get("returncode", 1), log_text)}
        return {"status": DONE, "leaked": self.leaked()}

    def _task(self, cfg: DictConfig, outcome: dict) -> None:
        """What ``feedrate.launch.main`` does in a fresh process; the exit status is recorded."""
        from feedrate import launch

        try:
            launch.main(cfg, kept=self.kept)
            outcome["returncode"] = 0
        except SystemExit as exc:  # launch.main ends a named failure with its exit status
            outcome["returncode"] = exc.code if isinstance(exc.code, int) else 1

    def reset(self) -> None:
        """Put back what the trial may have changed that the next trial's own start does not
        set again (docs/design.md, "The warm trial host")."""
        import torch
        import torch.utils.data._utils.signal_handling as torch_signals

        for sig, handler in self.signals.items():
            signal.signal(sig, handler)
        # PyTorch installs its SIGCHLD handler once per process: again for the next trial
        torch_signals._SIGCHLD_handler_set = False
        gc.collect()  # the trial's loader, optimizer and batches
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            torch._C._host_emptyCache()  # the pinned-memory cache

    def leaked(self) -> str:
        """Threads the trial started and left running: state no reset undoes. tqdm's monitor
        is one per process by design (it watches every bar), as in any run with a bar."""
        from tqdm import TMonitor

        def left() -> list[str]:
            return [
                t.name
                for t in threading.enumerate()
                if t.ident not in self.threads and not isinstance(t, TMonitor)
            ]

        deadline = time.monotonic() + 2.0
        while left() and time.monotonic() < deadline:  # a monitor thread may still be ending
            time.sleep(0.05)
        return f"threads left running: {', '.join(left())}" if left() else ""


def _key_change(old: str, new: str) -> str:
    before = OmegaConf.to_container(OmegaConf.create(old))
    after = OmegaConf.to_container(OmegaConf.create(new))
    changed = [k for k in after if before.get(k) != after[k]]
    return f"this trial changes {', '.join(changed)}, which the host built"


def _callbacks(config: DictConfig):
    """Hydra's callbacks of the run, as ``python train.py`` would call them per job."""
    from hydra._internal.callbacks import Callbacks  # what run_job expects; no public one

    return Callbacks(config)


class _output_to:
    """Point this process's stdout and stderr (and so its workers') at ``path`` for a trial:
    the trial's log is what a fresh process would have printed. Python's own ``sys.stdout``
    and ``sys.stderr`` too, which the job's logging binds to, wherever they pointed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = os.dup(1), os.dup(2)
        self.streams = sys.stdout, sys.stderr
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(os.dup(1), "w", buffering=1)  # noqa: SIM115 - closed on exit
        sys.stderr = open(os.dup(2), "w", buffering=1)  # noqa: SIM115

    def __exit__(self, *exc: object) -> None:
        sys.stdout.close()
        sys.stderr.close()
        sys.stdout, sys.stderr = self.streams
        for target, fd in zip((1, 2), self.saved, strict=True):
            os.dup2(fd, target)
            os.close(fd)


def _end_with_the_sweep(jobs: int) -> None:
    """A thread of the host: once the sweep's end of the jobs pipe is closed (the sweep died,
    even mid-trial), kill this host's group, its workers with it. The fork server would end
    too, and the host with it, but only after the server's interpreter has shut down."""
    poller = select.poll()
    poller.register(jobs, 0)  # a hang-up is always reported; the jobs themselves are not
    while True:
        if any(event & (select.POLLHUP | select.POLLERR) for _, event in poller.poll()):
            os.killpg(0, signal.SIGKILL)


def _hosted(
    config_dir: str,
    config_name: str,
    log_path: str,
    script_dir: str | None,
    env: dict,
    *,
    jobs,
    answers,
) -> None:
    """The host process, forked from the fork server: a session of its own (its workers
    too: killed as one group), killed with the server (which ends with the sweep), the
    sweep's environment of now, the platform's default start method for its DataLoaders (as
    a fresh ``python train.py`` has; multiprocessing made it the server's), its output
    appended to ``log_path``; then :func:`serve`."""
    os.setsid()
    die_with_parent(os.getppid())
    threading.Thread(target=_end_with_the_sweep, args=(jobs.fileno(),), daemon=True).start()
    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(env)
    if script_dir is not None and script_dir not in sys.path:
        sys.path.insert(0, script_dir)  # train.py's folder, as for `python train.py`
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    serve(config_dir, config_name, jobs, answers)


def serve(config_dir: str, config_name: str, jobs, answers) -> None:
    """The host's loop: a job from ``jobs``, its answer to ``answers``, until the sweep's end
    of ``jobs`` closes."""
    host = TrialHost(config_dir, config_name)
    while True:
        try:
            job = jobs.recv()
        except EOFError:
            return
        answers.send(host.run(job["overrides"], job["job_dir"]))
