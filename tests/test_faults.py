"""Each DataLoader failure is injected, and named with its cause and fix."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

import feedrate
import feedrate.loader
from feedrate.dataset import ensure_photos
from feedrate.errors import SampleError
from feedrate.faults import (
    SEND_FAILED,
    Context,
    LoaderFailure,
    diagnose,
    send_failure_exit,
)
from feedrate.threads import worker_id

from .conftest import ROOT, run_cli, shrink, unshare_works


class Ragged(Dataset):
    """Samples of two sizes, like photos loaded without a fixed-size transform."""

    classes = ["a", "b"]

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        side = 8 if i % 3 else 12
        return torch.zeros(3, side, side, dtype=torch.uint8), i % 2


class Unbatchable(Ragged):
    """Samples that are not tensors (a PIL image without ToTensor)."""

    def __getitem__(self, i):
        from PIL import Image

        return Image.new("RGB", (8, 8)), i % 2


class Exploding(Dataset):
    """Sample 5 raises, like a corrupt record."""

    classes = ["a", "b"]

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if i == 5:
            raise ValueError("bad record header")
        return torch.zeros(3, 8, 8, dtype=torch.uint8), i % 2


def _worker_dies(how) -> None:
    """In worker 1, die by ``how``; worker 0 is slow, so the main process is waiting for its
    batch when worker 1 dies (PyTorch then reports the death as the cause of a generic error)."""
    info = get_worker_info()
    if info is not None and info.id == 1:
        how()
    if info is not None and info.id == 0:  # 1.6 s a batch of 16: long enough to be waiting,
        time.sleep(0.1)  # short enough that shutting it down (it ends its batch first) is quick


class KilledWorker(Exploding):
    """A worker dies by SIGKILL, as the OOM killer kills it."""

    def __getitem__(self, i):
        _worker_dies(lambda: os.kill(os.getpid(), signal.SIGKILL))
        return super().__getitem__(i % 5)


class Crashes(Exploding):
    """A worker dies by a signal: a native decoder's segfault, a scheduler's SIGTERM."""

    signal = signal.SIGSEGV

    def __getitem__(self, i):
        _worker_dies(lambda: os.kill(os.getpid(), self.signal))
        return super().__getitem__(i % 5)


class Terminated(Crashes):
    signal = signal.SIGTERM


class Exits(Exploding):
    """A worker's dataset calls exit: no signal, no error."""

    def __getitem__(self, i):
        _worker_dies(lambda: os._exit(3))
        return super().__getitem__(i % 5)


class CannotSend(Exploding):
    """Worker 1 may open ``left`` more file descriptors: enough for its batch's shared memory,
    not for all it takes to hand the batch over. Sending then fails in one of the worker's
    threads while the main process, far from its own limit, waits for that batch."""

    def __init__(self, left: int = 1) -> None:
        super().__init__()
        self.left = left

    def __getitem__(self, i):
        _worker_dies(self._few_descriptors_left)
        return super().__getitem__(i % 5)

    def _few_descriptors_left(self) -> None:
        probe = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor
        os.close(probe)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (probe + self.left, hard))


class Hangs(Exploding):
    def __getitem__(self, i):
        if get_worker_info() is not None or worker_id() is not None:  # in a worker
            time.sleep(120)
        return super().__getitem__(i % 5)


class PythonRecords(Exploding):
    """Per-sample metadata as a Python list of tuples, read by every sample: each worker that
    reads it writes its reference counts, so the pages it shared with the main process become
    its own copies (copy-on-read)."""

    def __init__(self, n: int = 64, records: int = 2_000_000) -> None:
        super().__init__(n)
        self.records = [(i, f"img_{i:08d}.jpg") for i in range(records)]

    def __getitem__(self, i):
        if get_worker_info() is not None:
            for _ in self.records[i % 7 :: 7]:  # every page of tuples, 1/7 of them
                pass
        return super().__getitem__(i % 5)


def _custom(compose, cls: str, *overrides: str):
    return compose(
        "dataset=custom",
        f"dataset._target_=tests.test_faults.{cls}",
        "trainer.max_steps=6",
        "trainer.warmup_steps=1",
        *overrides,
    )


@pytest.mark.parametrize("engine", ["process", "thread"])
def test_failing_sample_is_named(compose, tmp_path, engine):
    cfg = _custom(compose, "Exploding", "loader.num_workers=2", f"loader.engine={engine}")
    with pytest.raises(SampleError) as info:
        feedrate.run(cfg, output_dir=tmp_path)
    message = str(info.value)
    assert message.startswith("sample 5 could not be loaded: ValueError: bad record header")
    assert "dataset.on_error=skip" in message


def test_corrupt_jpeg_is_named_by_path(compose, photos_root, tmp_path):
    built = ensure_photos(photos_root, n_images=48, jpeg_quality=90, seed=0)
    copy = tmp_path / "photos"
    shutil.copytree(built, copy)
    victim = sorted((copy / "cat").glob("*.jpg"))[0]
    victim.write_bytes(victim.read_bytes()[:200])  # truncated, like a failed download
    cfg = compose(
        "dataset=image_folder",
        f"dataset.root={copy}",
        "dataset.image_size=32",
        "loader.batch_size=48",
        "trainer.max_steps=3",
        "trainer.warmup_steps=1",
    )
    with pytest.raises(SampleError, match="could not be loaded: OSError") as info:
        feedrate.run(cfg, output_dir=tmp_path / "b")
    assert f"({victim})" in str(info.value)


def test_skip_policy_counts_and_goes_on(compose, tmp_path):
    cfg = _custom(
        compose,
        "Exploding",
        "loader.num_workers=2",
        "dataset.on_error=skip",
        "trainer.epochs=1",
        "trainer.max_steps=null",
    )
    m = feedrate.run(cfg, output_dir=tmp_path)
    assert m["skipped_samples"] == 1
    assert m["steps"] == 4  # 64 samples, batches of 16: the short batch still trains


def test_killed_worker_is_reported_as_probably_out_of_memory(compose, tmp_path):
    with pytest.raises(LoaderFailure) as info:
        feedrate.run(_custom(compose, "KilledWorker", "loader.num_workers=2"), output_dir=tmp_path)
    message = str(info.value)
    assert "worker was killed (SIGKILL), probably by the out-of-memory killer" in message
    assert "MB (PSS)" in message and "loader.num_workers" in message


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        ("Crashes", "killed by signal 'Segmentation fault' (SIGSEGV: native code"),
        ("Terminated", "killed by signal 'Terminated' (SIGTERM: something outside the run"),
        ("Exits", "exited unexpectedly with exit code 3, without an error"),
    ],
)
def test_a_worker_killed_by_another_signal_is_named_with_its_cause(
    compose, tmp_path, cls, expected
):
    with pytest.raises(LoaderFailure, match=re.escape(expected)):
        feedrate.run(_custom(compose, cls, "loader.num_workers=2"), output_dir=tmp_path)


# Where it fails moves with the count: duplicating the images' descriptor, opening the
# labels' shared memory (PyTorch's RuntimeError, its errno only in its text), or the fd
# sharer's accepting the main process's request for them. With 6 or more left, a batch can
# sometimes get through as the main process takes descriptors off the worker's hands.
@pytest.mark.parametrize("left", [1, 2, 3])
def test_a_batch_that_cannot_be_sent_ends_the_run_with_its_cause(tmp_path, left):
    # Before, the worker printed a traceback from its feeder thread and the run hung forever.
    proc = run_cli(
        *shrink(["dataset=custom", "dataset._target_=tests.test_faults.CannotSend"]),
        f"+dataset.left={left}",
        "loader.num_workers=2",
        "loader.pin_memory=false",  # on a GPU, the pinning thread's own traceback
        f"hydra.run.dir={tmp_path}",
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "too many open files (the limit is" in proc.stdout, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    worker_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("DataLoader worker")]
    assert len(worker_lines) == 1, proc.stderr[-2000:]
    assert worker_lines[0].startswith("DataLoader worker 1: ")
    assert "Too many open files" in worker_lines[0]


_NO_DESCRIPTOR_LEFT = """
import os, resource, sys
from feedrate.faults import send_failure_exit
probe = os.open(os.devnull, os.O_RDONLY)
os.close(probe)
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (probe + {left}, hard))
print(send_failure_exit(FileNotFoundError(2, "No usable temporary directory found")))
"""


def test_a_send_failure_exits_with_the_code_of_its_cause():
    assert send_failure_exit(OSError(errno.EMFILE, "Too many open files")) == errno.EMFILE
    text = "unable to open shared memory object </torch_1>: Too many open files (24)"
    assert send_failure_exit(RuntimeError(text)) == errno.EMFILE
    assert (
        send_failure_exit(
            RuntimeError("unable to write to file </torch_9>: No space left on device (28)")
        )
        == errno.ENOSPC
    )
    hidden = FileNotFoundError(errno.ENOENT, "No usable temporary directory found")
    assert send_failure_exit(hidden) == SEND_FAILED  # this process has descriptors to spare
    # ... but a process with none left names that, whatever the error said
    for left in (0, 2):  # none left, or two freed again by the failed send: the same cause
        out = subprocess.run(
            [sys.executable, "-c", _NO_DESCRIPTOR_LEFT.format(left=left)],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == str(errno.EMFILE), left
    codes = {
        errno.EMFILE: "too many open files",
        errno.ENOSPC: "insufficient shared memory",
        SEND_FAILED: "could not send a batch",
    }
    ctx = Context(num_workers=2, prefetch_factor=2, batch_bytes=1, peak_pss_mb=1.0, timeout_s=0)
    gone = RuntimeError("DataLoader worker (pid(s) 123) exited unexpectedly")
    for code, message in codes.items():
        ctx.worker_exit_codes = [0, code]
        assert message in str(diagnose(gone, ctx))
    ctx.worker_exit_codes = [0, -15]
    assert "exited unexpectedly, without an error" in str(diagnose(gone, ctx))


@pytest.mark.quiet  # waits out a hang: runs beside an alone test
@pytest.mark.parametrize("engine", ["process", "thread"])
def test_hung_worker_is_stopped_by_the_timeout(compose, tmp_path, engine):
    t0 = time.monotonic()
    with pytest.raises(LoaderFailure, match="no batch arrived within loader.timeout=2"):
        hangs = ["loader.num_workers=1", "loader.timeout=2", f"loader.engine={engine}"]
        feedrate.run(_custom(compose, "Hangs", *hangs), output_dir=tmp_path)
    assert time.monotonic() - t0 < 60


class DiesAtOnce(Exploding):
    """A worker exits on its first sample (as one the OOM killer ends as it starts)."""

    def __getitem__(self, i):
        if get_worker_info() is not None:
            os._exit(1)
        return super().__getitem__(i)


class SlowOrder(torch.utils.data.Sampler):
    """An order slow to draw: the loader's start, which draws its first batches, takes a while."""

    def __iter__(self):
        for i in range(8):
            yield i
            time.sleep(0.3)

    def __len__(self):
        return 8


def _two_workers(dataset, **kwargs) -> feedrate.loader._Loader:
    return feedrate.loader._Loader(
        dataset, batch_size=1, num_workers=2, multiprocessing_context="fork", **kwargs
    )


def test_a_worker_dead_while_they_start_is_named_once_they_have():
    """PyTorch raises "exited unexpectedly" wherever the main thread is: inside its start of
    the workers, it left that half made (a lock taken stays taken, and the end of the
    workers waits for it forever). Raised once they have started, the failure can end them."""
    loader = _two_workers(DiesAtOnce(), sampler=SlowOrder())
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        iter(loader)  # the first worker died while the loader drew its next batches
    assert 1 in loader.end_workers(kill=True), "the iteration was made: its workers end"


def test_a_failed_loaders_workers_are_killed_though_a_lock_they_share_is_left_taken():
    """A worker killed as it checked its iteration's done event leaves that event's lock
    taken; PyTorch's end of the iteration sets the event first and would wait forever."""
    loader = _two_workers(Exploding())
    batches = iter(loader)
    next(batches)
    lock = batches._workers_done_event._cond  # as a worker killed holding it leaves it
    lock.acquire()
    ended: list[list[int]] = []
    end = threading.Thread(target=lambda: ended.append(loader.end_workers(kill=True)))
    end.daemon = True
    end.start()
    end.join(timeout=60)
    lock.release()
    assert ended == [[-signal.SIGKILL] * 2], "it waited on the lock"


class StallsAfterTwo(Dataset):
    """Two quick samples, then reads that take a minute: workers caught mid-read."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i >= 2:
            time.sleep(60)
        return torch.tensor(i)


def test_training_over_ends_workers_mid_read_at_once():
    """The run's last step taken, the batches the workers still read are not wanted: they
    end at once, where PyTorch's own end waits up to 5 s for each (a sweep's run waited up to
    a batch's time, 0.9 s on a held-out store, 20 runs a sweep)."""
    from feedrate.trainer import _end_now

    loader = _two_workers(StallsAfterTwo())
    batches = iter(loader)
    assert [int(next(batches)) for _ in range(2)] == [0, 1]  # the workers now sit in a read
    began = time.monotonic()
    _end_now(loader)
    assert time.monotonic() - began < 5, "it waited for the reads"
    assert [w.exitcode for w in batches._workers] == [-signal.SIGKILL] * 2
    _end_now(loader)  # twice, or after PyTorch's own end: nothing left to end
    del batches


def test_cli_names_the_sample_and_exits_2_without_a_traceback(tmp_path):
    proc = run_cli(
        *shrink(["dataset=custom", "dataset._target_=tests.test_faults.Exploding"]),
        "loader.num_workers=2",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "sample 5" in out and "ValueError: bad record header" in out, "which, and its error"
    assert "Traceback" not in out


@pytest.mark.skipif(
    not unshare_works(),
    reason="needs root to mount a small /dev/shm in a private mount namespace",
)
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # 2 workers x prefetch 2 x 16 x 150 KB = 9.6 MB: refused before any worker starts
        (
            ["dataset.image_size=224", "loader.num_workers=2"],
            "insufficient shared memory (predicted before starting any worker",
        ),
        # 1 worker x prefetch 1 x 48 x 49 KB = 2.4 MB predicted fits the 4 MB, but the batch the
        # main process holds and the one it receives are both in /dev/shm at that moment
        # (4.7 MB): the bus error or "No space left on device" from inside PyTorch is named all
        # the same
        (
            [
                "dataset.image_size=128",
                "loader.num_workers=1",
                "loader.prefetch_factor=1",
                "loader.batch_size=48",
            ],
            "insufficient shared memory (workers pass batches through /dev/shm, 4 MB",
        ),
    ],
)
def test_small_shared_memory_is_named(tmp_path, overrides, expected):
    # Docker's default /dev/shm is 64 MB; here 4 MB.
    args = " ".join(shrink([*overrides, f"hydra.run.dir={tmp_path}"]))
    proc = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=4m tmpfs /dev/shm && {sys.executable} train.py {args}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert expected in out
    assert "--shm-size" in out and "Traceback" not in out


def test_too_many_open_files_is_named_with_the_limit(tmp_path):
    import resource

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            *shrink(
                [
                    "dataset.n_samples=2048",
                    "dataset.image_size=16",
                    "loader.batch_size=4",
                    "trainer.max_steps=200",
                    "loader.num_workers=8",
                    "loader.prefetch_factor=8",
                ]
            ),
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=low_limit,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "open files" in proc.stdout and "48" in proc.stdout, "the limit, with its number"
    assert "ulimit -n" in proc.stdout
    # The workers say it once each, in one line, not a traceback per failed send
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("DataLoader worker")]
    assert len(lines) == len({ln.split(":")[0] for ln in lines}) <= 8


@pytest.mark.slow
def test_copy_on_read_growth_is_stopped_by_the_memory_guard(tmp_path):
    args = [
        "dataset=custom",
        "dataset._target_=tests.test_faults.PythonRecords",
        "trainer.max_steps=400",
        "trainer.warmup_steps=1",
    ]
    # What the run holds with no workers: the main process and its list.
    alone = run_cli(*shrink([*args, "trainer.max_steps=10", f"hydra.run.dir={tmp_path / 'a'}"]))
    assert alone.returncode == 0, alone.stderr[-2000:]
    base_gb = json.loads((tmp_path / "a" / "metrics.json").read_text())["peak_pss_mb"] / 1024
    # 4 workers each copy the list's pages (~130 MB) as they read: far past base + 0.3 GB.
    limit = round(base_gb + 0.3, 2)
    proc = run_cli(
        *shrink(
            [
                *args,
                "loader.num_workers=4",
                f"hardware.memory_limit_gb={limit}",
                f"hydra.run.dir={tmp_path / 'b'}",
            ]
        )
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert f"{limit:.2f} GB" in out and "hardware.memory_limit_gb" in out, "the limit and its key"
    assert "Its 4 workers hold" in out and "copy-on-read pattern" in out
    assert "Traceback" not in out and not (tmp_path / "b" / "metrics.json").exists()


class TouchesCuda(Exploding):
    """Puts each sample on the GPU inside the worker: what a forked worker cannot do."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i % 5)
        return x.cuda(), y


def test_cuda_in_a_forked_worker_is_named_with_the_fix():
    # The error PyTorch raises in the main process when a forked worker touches CUDA.
    from torch.utils.data._utils import ExceptionWrapper

    try:
        raise RuntimeError(
            "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing,"
            " you must use the 'spawn' start method"
        )
    except RuntimeError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(RuntimeError) as info:
        wrapped.reraise()
    named = diagnose(info.value, Context(2, 2, 1, 0.0, 0.0))
    assert isinstance(named, LoaderFailure)
    assert "CUDA was initialised before the DataLoader forked its workers" in str(named)
    assert "loader.multiprocessing_context=spawn" in str(named)


class CudaAfterFork(Exploding):
    """Every sample fails in a worker as a forked worker that touches CUDA does (PyTorch's own
    words); the main process, where CUDA works, reads them."""

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is None:
            return super().__getitem__(i % 5)
        raise RuntimeError(
            "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing,"
            " you must use the 'spawn' start method"
        )


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_cuda_in_a_forked_worker_is_not_blamed_on_a_sample_nor_skipped(
    tmp_path, on_error, train_here
):
    # Seen on an H200: the sample guard wrapped this error as "sample 0 could not be loaded",
    # hiding the start method behind it; with on_error=skip every sample would be dropped.
    proc = train_here(
        *shrink(["dataset=custom", "dataset._target_=tests.test_faults.CudaAfterFork"]),
        "loader.num_workers=2",
        f"dataset.on_error={on_error}",
        f"hydra.run.dir={tmp_path}",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert "CUDA was initialised before the DataLoader forked its workers" in out
    assert "could not be loaded" not in out and "Traceback" not in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_before_fork_is_named_on_a_gpu(tmp_path):
    proc = run_cli(
        *shrink(
            [
                "dataset=custom",
                "dataset._target_=tests.test_faults.TouchesCuda",
                "hardware=gpu",
                "loader.num_workers=2",
                "loader.multiprocessing_context=fork",
                f"hydra.run.dir={tmp_path}",
            ]
        )
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert "CUDA was initialised before the DataLoader forked its workers" in out


@pytest.mark.parametrize(
    ("cls", "workers", "expected"),
    [
        ("Ragged", 0, "the samples of one batch differ in shape: [3, "),
        ("Ragged", 2, "the samples of one batch differ in shape: [3, "),
        ("Unbatchable", 2, "a sample holds a <class 'PIL.Image.Image'>"),
    ],
)
def test_samples_the_collate_cannot_batch_are_named(tmp_path, cls, workers, expected, train_here):
    proc = train_here(
        *shrink(["dataset=custom", f"dataset._target_=tests.test_faults.{cls}"]),
        f"loader.num_workers={workers}",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert expected in out and "loader.collate_fn._target_=" in out, out[-2000:]
    assert "Traceback" not in out


def test_a_worker_at_its_descriptor_limit_leaves_its_temp_dir_without_a_traceback():
    """Seen once in a full run: a worker that shared batches by descriptor could not list its
    temporary directory at exit (EMFILE) and multiprocessing printed a traceback. Only that
    cause is passed over; any other error still raises."""
    code = """
import errno, multiprocessing.util
from feedrate.loader import _init_worker
_init_worker(0)
def out_of_descriptors(path):
    raise OSError(errno.EMFILE, "Too many open files", path)
def gone(path):
    raise OSError(errno.EACCES, "Permission denied", path)
multiprocessing.util._remove_temp_dir(out_of_descriptors, "/tmp/pymp-x")
try:
    multiprocessing.util._remove_temp_dir(gone, "/tmp/pymp-y")
except PermissionError:
    print("raised")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "raised", proc.stderr[-2000:]
