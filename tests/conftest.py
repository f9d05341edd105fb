"""Shared fixtures: build the real config, then shrink it for a fast CPU run."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import feedrate

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# A tiny run: few steps, small in-memory images (unless a test picks its dataset), no progress bar.
TINY_DATA = ["dataset=synthetic", "dataset.n_samples=256", "dataset.image_size=32"]
TINY = [
    "loader.batch_size=16",
    "trainer.max_steps=8",
    "trainer.warmup_steps=2",
    "trainer.window_steps=2",
    # exact step counts; the steady-state warm-up has its own tests (test_train.py)
    "trainer.steady_state=false",
    "trainer.progress=false",
]


def pytest_configure(config):
    """Plain pytest leaves out the slow tests (addopts in pyproject.toml); a test named by its
    node id on the command line runs anyway, since that is what whoever named it meant."""
    if config.option.markexpr == "not slow" and any("::" in arg for arg in config.args):
        config.option.markexpr = ""


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the list xdist hands out
def pytest_collection_modifyitems(config, items):
    """Under ``make test`` (two at a time), the order the tests are handed out in. Work
    stealing hands each worker an equal share of this list to start with, in turn.

    - The first worker's share starts with the tests marked ``alone``: one that came later
      would wait for whatever the other worker was running (a minute for the slowest), and
      that worker would then idle while it ran.
    - The second worker's share starts with the tests marked ``quiet`` (they mostly wait: a
      hang waited out to its timeout, a loader that fails), which hold no lock: that worker
      runs them while the ``alone`` tests hold the machine, instead of waiting.
    - The rest keep file order (519 s for the suite with the first rule, against 620 s in
      file order)."""
    groups: dict[str, list] = {"alone": [], "quiet": [], "rest": []}
    for item in items:
        marked = [name for name in ("alone", "quiet") if item.get_closest_marker(name)]
        if len(marked) > 1:
            raise pytest.UsageError(
                f"{item.nodeid} is marked both alone and quiet: one or the other"
            )
        groups[marked[0] if marked else "rest"].append(item)
    if not hasattr(config, "workerinput"):  # not an xdist worker: file order
        return
    alone, quiet, rest = groups["alone"], groups["quiet"], groups["rest"]
    # the first worker's share: with -n 3, a third (then the second worker's starts)
    first = max(0, len(items) // config.workerinput["workercount"] - len(alone))
    items[:] = [*alone, *rest[:first], *quiet, *rest[first:]]


@pytest.fixture(autouse=True)
def _machine_share(request, tmp_path_factory):
    """``make test`` runs two tests at a time (pytest-xdist). Each holds a shared lock on the
    machine, and a test marked ``alone`` an exclusive one, so what it measures is not another
    test's load; one marked ``quiet`` holds none. A turnstile lock, taken first by both, lets
    a waiting ``alone`` test in before the next shared one."""
    if not hasattr(request.config, "workerinput"):  # not under xdist: nothing runs beside it
        yield
        return
    if request.node.get_closest_marker("quiet"):  # mostly waits, little CPU: beside anything
        yield
        return
    root = tmp_path_factory.getbasetemp().parent  # the same folder for every worker
    alone = request.node.get_closest_marker("alone") is not None
    with (
        open(root / "machine.turnstile", "a") as turnstile,
        open(root / "machine.lock", "a") as machine,
    ):
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        with contextlib.ExitStack() as held:
            held.callback(fcntl.flock, machine, fcntl.LOCK_UN)
            fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            if not alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
            yield


def shrink(overrides) -> list[str]:
    """The tiny settings, then ``overrides`` (which win)."""
    picks_dataset = any(o.startswith("dataset=") for o in overrides)
    return [*([] if picks_dataset else TINY_DATA), *TINY, *overrides]


@pytest.fixture
def compose():
    def _compose(*overrides: str, tiny: bool = True):
        return feedrate.compose(shrink(overrides) if tiny else list(overrides), config_dir=CONF)

    return _compose


@pytest.fixture(scope="session")
def photos_root(tmp_path_factory) -> Path:
    """A small photo set, built once for the whole session."""
    return tmp_path_factory.mktemp("photos")


PHOTOS = ["dataset=photos", "dataset.n_images=48", "dataset.image_size=64"]


def run_cli(*args: str, cwd: Path = ROOT, timeout: float = 300, env: dict | None = None):
    """Run ``python train.py ARGS`` as a user would; return the CompletedProcess."""
    full_env = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


@pytest.fixture
def train_here(monkeypatch, capsys):
    """``python train.py ARGS`` as :func:`run_cli` runs it, in this process (no interpreter
    to start): a CompletedProcess whose stdout and stderr both hold all it printed and
    logged. ``env``'s PYTHONPATH goes on sys.path, its other variables into the environment.
    For what a process shows alone (a traceback on the terminal, Hydra's own command-line
    errors, signals), :func:`run_cli`."""
    from . import fakes

    def _run(*args: str, cwd: Path = ROOT, env: dict | None = None):
        for key, value in (env or {}).items():
            if key == "PYTHONPATH":
                monkeypatch.syspath_prepend(value)
            else:
                monkeypatch.setenv(key, value)
        done = fakes.train(cwd, *args, monkeypatch=monkeypatch, capsys=capsys)
        return subprocess.CompletedProcess(list(args), done.returncode, done.out, done.out)

    return _run


def run_torchrun(ranks: int, *args: str, cwd: Path = ROOT, env: dict | None = None):
    """Run ``torchrun --standalone --nproc_per_node=RANKS train.py ARGS`` on the CPU."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            str(ROOT / "train.py"),
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", **(env or {})},
    )


@pytest.fixture
def torchrun_here(tmp_path):
    """``torchrun --standalone --nproc_per_node=RANKS train.py ARGS`` as :func:`run_torchrun`
    runs it, its ranks forked from the fork server a sweep's warm hosts come from (torch,
    Hydra and feedrate imported: no 4 s of CPU a rank to start). Each rank gets the variables
    torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), one intra-op thread (torchrun's ``OMP_NUM_THREADS=1``),
    and runs train.py as ``@hydra.main`` does. Not forked from the test's own process: one
    that has run OpenMP regions hangs its children in their first op. A CompletedProcess: the
    first failing rank's status, every rank's output in ``stdout``. What only torchrun shows
    (its own processes, a signal to them), :func:`run_torchrun`."""
    return functools.partial(_fork_ranks, tmp_path / "ranks")


def _fork_ranks(logs: Path, ranks: int, *args: str, cwd: Path = ROOT, env: dict | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:  # fmt: skip
    import multiprocessing
    import signal
    import time
    from multiprocessing.connection import wait

    from feedrate.sweep import host

    logs = logs / f"call{len(list(logs.glob('call*'))) if logs.exists() else 0}"  # each its own
    logs.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(host.PRELOAD)  # the sweep's server, if it runs already
    here = {**os.environ, **{k: v for k, v in (env or {}).items() if k != "PYTHONPATH"}}
    paths = (env or {}).get("PYTHONPATH")
    procs = [
        ctx.Process(
            target=_rank_main, args=(logs / f"rank{r}.log", r, ranks, port, args, cwd, here, paths)
        )  # fmt: skip
        for r in range(ranks)
    ]
    try:
        for proc in procs:
            proc.start()
        deadline, running = time.monotonic() + timeout, list(procs)
        while running and time.monotonic() < deadline:  # a hang fails its test, not the suite
            wait([p.sentinel for p in running], timeout=max(0.0, deadline - time.monotonic()))
            running = [p for p in procs if p.exitcode is None]
            if any(p.exitcode for p in procs):  # as torchrun: one rank fails, the job ends
                break
    finally:
        for proc in procs:  # each rank leads a process group: its workers go with it
            if proc.pid is not None and proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()  # one killed before its setpgrp leads no group yet
            if proc.pid is not None:
                proc.join()
    out = "".join((logs / f"rank{r}.log").read_text() for r in range(ranks) if
                  (logs / f"rank{r}.log").exists())  # fmt: skip
    failed = [p.exitcode for p in procs if p.exitcode] + [0]
    return subprocess.CompletedProcess(["torchrun", *args], failed[0], out, "")


def _rank_main(log: Path, rank: int, ranks: int, port: int, args, cwd: Path, env: dict,
               paths: str | None) -> None:  # fmt: skip
    """One forked rank, the leader of a process group (its workers with it): its output to
    ``log``, the caller's environment and torchrun's variables, train.py's main; it exits with
    the status train.py would."""
    code = 1
    try:
        os.setpgrp()
        os.environ.clear()
        os.environ.update(env)  # the caller's now, not the fork server's at its start
        if paths:
            sys.path[:0] = [str(Path(cwd, p)) for p in paths.split(os.pathsep)]
        code = _run_rank(log, rank, ranks, port, args, cwd)
    except BaseException:
        import traceback

        with open(log, "a") as out:  # an error before train.py ran: said, not lost
            traceback.print_exc(file=out)
    finally:
        os._exit(code)


def _run_rank(log: Path, rank: int, ranks: int, port: int, args, cwd: Path) -> int:
    import multiprocessing
    import traceback

    import torch
    from hydra._internal.hydra import Hydra
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import execution_whitelist

    import feedrate.launch
    from feedrate.config import TRUSTED_TARGETS

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1), os.dup2(fd, 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(
        {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0",
        }
    )  # fmt: skip
    torch.set_num_threads(1)
    # a torchrun rank's default start method (Linux's): a child of the fork server would
    # start its workers through a fork server of its own, each importing torch
    multiprocessing.set_start_method("fork", force=True)
    os.chdir(cwd)
    sys.argv = [str(ROOT / "train.py"), *args]
    GlobalHydra.instance().clear()
    try:
        with execution_whitelist(TRUSTED_TARGETS):  # as train.py's @hydra.main
            done = Hydra.create_main_hydra_file_or_module(
                calling_file=str(ROOT / "train.py"), calling_module=None,
                config_path="conf", job_name="train",
            ).run(
                config_name="train", task_function=feedrate.launch.main,
                overrides=list(args), with_log_configuration=True,
            )  # fmt: skip
            done.return_value  # noqa: B018 - raises what the run raised
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()


@functools.lru_cache(maxsize=1)
def unshare_works() -> bool:
    """Can this host mount a small tmpfs in a private mount namespace (root, ``unshare``)?
    False, never an error, on a host without ``unshare``: tests ask at collection."""
    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


PG_BIN = Path(os.environ.get("FEEDRATE_PG_BIN", "/usr/lib/postgresql/15/bin"))


@pytest.fixture(scope="session")
def postgresql_url():
    """A real PostgreSQL server, started from the installed binaries (Debian's
    postgresql-15: ``FEEDRATE_PG_BIN`` names another bin folder) for the session, with an
    empty database ``studies``; its SQLAlchemy URL, with no password (trust on localhost).
    PostgreSQL refuses to run as root, so as root the server runs as ``nobody``."""
    import tempfile

    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"no PostgreSQL binaries in {PG_BIN} (set FEEDRATE_PG_BIN)")
    as_user: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="feedrate-pg-"))
    if os.geteuid() == 0:
        as_user = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        shutil.chown(base, "nobody", "nogroup")
    data, log = base / "data", base / "server.log"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def pg(tool: str, *args: str) -> None:
        subprocess.run([*as_user, str(PG_BIN / tool), *args], check=True, capture_output=True)

    pg("initdb", "-D", str(data), "-U", "feedrate", "--auth=trust", "-E", "UTF8")
    options = f"-p {port} -k {base} -c listen_addresses=127.0.0.1"
    pg("pg_ctl", "-D", str(data), "-o", options, "-l", str(log), "-w", "start")
    try:
        pg("createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "feedrate", "studies")
        yield f"postgresql+psycopg://feedrate@127.0.0.1:{port}/studies"
    finally:
        pg("pg_ctl", "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)
