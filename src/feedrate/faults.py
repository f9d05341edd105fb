"""DataLoader failures, named: each cryptic symptom becomes a cause and a fix.

PyTorch reports a dead worker as "DataLoader worker (pid 1234) is killed by signal: Killed",
a full ``/dev/shm`` as a bus error, and a broken sample as a traceback from inside a worker.
:func:`diagnose` turns those into :class:`FeedrateError`s that say what happened, with the
figures feedrate measured, and what to do (:class:`feedrate.dataset.GuardedDataset` makes a
failing sample name itself).
"""

from __future__ import annotations

import errno
import os
import re
import resource
from dataclasses import dataclass, field

import psutil

from feedrate.errors import (
    CUDA_AFTER_FORK,
    CollateError,
    DatasetError,
    FeedrateError,
    SampleError,
)
from feedrate.hardware import shm_bytes


class LoaderFailure(FeedrateError):
    """The DataLoader's workers failed for a reason of the machine, not of the config."""


@dataclass
class Context:
    """What the run knew when the loader failed, for the message."""

    num_workers: int
    prefetch_factor: int | None
    batch_bytes: int
    peak_pss_mb: float
    timeout_s: float
    worker_exit_codes: list[int] = field(default_factory=list)  # of the workers that ended
    engine: str = "process"  # loader.engine: thread workers share the process's memory


# A worker that cannot send a batch exits with the error's errno when it names a cause below,
# else with this (EX_SOFTWARE): the main process only sees the worker gone.
SEND_FAILED = 70
_SEND_CAUSES = (errno.EMFILE, errno.ENFILE, errno.ENOSPC)


def send_failure_exit(exc: BaseException) -> int:
    """The exit code of a worker whose batch ``exc`` kept from being sent.

    PyTorch's own errors carry the errno in their text ("... Too many open files (24)"), and
    some errors hide it: with no descriptor left, ``tempfile`` says "No usable temporary
    directory found". So when ``exc`` names no cause, this process tries to open a file.
    """
    code = getattr(exc, "errno", None)
    if code is None:
        found = re.search(r"\((\d+)\)$", str(exc).strip())
        code = int(found.group(1)) if found else None
    if code not in _SEND_CAUSES:
        try:
            os.close(os.open(os.devnull, os.O_RDONLY))
        except OSError as probe:
            code = probe.errno
        else:  # the failed send may have freed a descriptor or two since: count what is left
            code = errno.EMFILE if _descriptors_left() <= DESCRIPTOR_MARGIN else code
    return code if code in _SEND_CAUSES else SEND_FAILED


# Sending a batch takes a few descriptors at once (shared memory, the fd sharer's socket):
# a process this close to its limit ran out of them, whatever its error said.
DESCRIPTOR_MARGIN = 4


def _descriptors_left() -> int:
    """Descriptors this process may still open under its soft limit (large if unknown)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # less the one listing them
    except OSError:
        return 2**31
    return 2**31 if soft == resource.RLIM_INFINITY else soft - used


def _mb(x: float) -> str:
    return f"{x / 2**20:,.0f} MB"


COLLATE_FIX = "loader.collate_fn._target_=my_pkg.data.collate, docs/custom.md"
_UNEQUAL = re.compile(
    r"stack expects each tensor to be equal size, but got (\[[^\]]*\]) at entry (\d+)"
    r" and (\[[^\]]*\]) at entry (\d+)"
)
_UNBATCHABLE = re.compile(r"default_collate: batch must contain (.+?); found (<class '[^']+'>|\S+)")


def _collate_problem(text: str) -> DatasetError | None:
    """Samples the default collate cannot stack into one batch, named with what differed."""
    unequal = _UNEQUAL.search(text)
    if unequal:
        first, i, other, j = unequal.groups()
        return DatasetError(
            f"the samples of one batch differ in shape: {first} (entry {i} of the batch) and"
            f" {other} (entry {j}); the DataLoader's default collate stacks a batch into one"
            " tensor, so every sample must have one shape. Give the dataset a fixed-size"
            " transform (Resize + CenterCrop, or RandomResizedCrop, to dataset.image_size), or"
            " name a collate function that pads them or keeps them as a list"
            f" ({COLLATE_FIX}); loader.batch_size=1 runs it as it is"
        )
    unbatchable = _UNBATCHABLE.search(text)
    if unbatchable:
        kinds, found = unbatchable.groups()
        return unbatchable_sample(found, kinds)
    return None


def unbatchable_sample(found: str, kinds: str = "tensors, numpy arrays, numbers") -> DatasetError:
    return DatasetError(
        f"a sample holds a {found}, which the DataLoader's default collate cannot batch (it"
        f" takes {kinds}): convert it in the dataset (for an image, torchvision's"
        f" transforms.v2.PILToTensor or ToImage), or name a collate function for it"
        f" ({COLLATE_FIX})"
    )


def diagnose(exc: BaseException, ctx: Context) -> FeedrateError | None:
    """A named cause and fix for a failure raised out of the training loop, or None.

    Reads the whole chain, innermost first: when a worker dies while the main process waits
    for a batch, PyTorch raises a generic "exited unexpectedly" from the specific cause
    ("is killed by signal: Killed", "... exit code 3").
    """
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    text = "\n".join(f"{type(e).__name__}: {e}" for e in reversed(chain))
    if CUDA_AFTER_FORK in text:
        return LoaderFailure(
            "CUDA was initialised before the DataLoader forked its workers, and a worker"
            " touched CUDA: keep dataset tensors on the CPU (move batches to the device in the"
            " training loop, as feedrate does), or use loader.multiprocessing_context=spawn"
        )
    if isinstance(exc, CollateError) or "CollateError: " in text:
        lines = [ln for ln in text.splitlines() if "CollateError: " in ln]
        return CollateError(lines[-1].split("CollateError: ", 1)[-1] if lines else str(exc))
    if isinstance(exc, SampleError) or "SampleError" in text:
        lines = [ln for ln in str(exc).splitlines() if "could not be loaded" in ln]
        message = lines[-1].split("SampleError: ", 1)[-1] if lines else str(exc)
        return SampleError(message)
    # Exit codes of ended workers: one that could not send a batch names the cause by its code
    codes = {*ctx.worker_exit_codes, *map(int, re.findall(r"with exit code (\d+)", text))}
    return (
        _collate_problem(text)
        or _out_of_resources(text, codes, ctx)
        or _worker_ended(text, codes, ctx)
    )


def _out_of_resources(text: str, codes: set[int], ctx: Context) -> LoaderFailure | None:
    """Memory (the OOM killer), /dev/shm or file descriptors ran out."""
    if re.search(r"DataLoader worker \(pid.*\) is killed by signal: Killed", text):
        vm = psutil.virtual_memory()
        return LoaderFailure(
            "a DataLoader worker was killed (SIGKILL), probably by the out-of-memory killer:"
            f" the main process and {ctx.num_workers} workers peaked at"
            f" {ctx.peak_pss_mb:,.0f} MB (PSS) with {_mb(vm.available)} of {_mb(vm.total)}"
            " available now. Use fewer workers (loader.num_workers), a smaller"
            " loader.prefetch_factor or loader.batch_size, or a dataset whose workers share"
            " memory (dataset=memmap; numpy arrays instead of Python lists)"
        )
    if errno.ENOSPC in codes or (
        re.search(r"Bus error|insufficient shared memory|No space left on device", text)
        and ("shm" in text or "shared memory" in text or "Bus error" in text)
    ):
        return LoaderFailure(shm_message(ctx))
    if (
        "Too many open files" in text
        or "received 0 items of ancdata" in text
        or codes & {errno.EMFILE, errno.ENFILE}
    ):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return LoaderFailure(
            f"too many open files (the limit is {soft}): under PyTorch's file_descriptor"
            " sharing strategy every batch in flight holds file descriptors. Raise the limit"
            " (ulimit -n 65536) or"
            " lower loader.num_workers / loader.prefetch_factor"
        )
    return None


def _worker_ended(text: str, codes: set[int], ctx: Context) -> LoaderFailure | None:
    """A worker hung, could not send a batch, was killed by a signal or exited."""
    if re.search(r"DataLoader timed out after", text):
        return LoaderFailure(
            f"no batch arrived within loader.timeout={ctx.timeout_s:g} s: a worker is stuck in"
            " the dataset's __getitem__ (slow or hung storage, a lock, a deadlock after fork)."
            " The run was stopped and its workers ended; check the storage, or raise"
            " loader.timeout if samples are legitimately that slow"
        )
    if SEND_FAILED in codes:
        return LoaderFailure(
            "a DataLoader worker could not send a batch to the main process and ended (exit"
            f" code {SEND_FAILED}): its error is the 'DataLoader worker N: ...' line above."
            " Run with loader.num_workers=0 to load in the main process"
        )
    killed = re.search(r"DataLoader worker \(pid[^)]*\) is killed by signal: ([^.]+)", text)
    if killed:
        return LoaderFailure(_killed_message(killed.group(1).strip()))
    gone = re.search(
        r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) exited unexpectedly"
        r"(?: with exit code (-?\d+))?",
        text,
    )
    if gone:
        code = f" with exit code {gone.group(2)}" if gone.group(2) else ""
        return LoaderFailure(
            f"DataLoader worker(s) {gone.group(1)} exited unexpectedly{code}, without an error"
            " (something in the dataset called exit, or the process was ended from outside)."
            " Run with loader.num_workers=0 to load in the main process, where the cause"
            " shows in full"
        )
    return None


# What ends a worker, by the signal's description (strsignal, as PyTorch reports it)
_SIGNAL_CAUSES = {
    "Segmentation fault": (
        "SIGSEGV: native code the dataset calls crashed (an image decoder, a C extension),"
        " often a library that is not safe to use after fork. Try"
        " loader.multiprocessing_context=spawn, or loader.num_workers=0 to find the sample"
    ),
    "Aborted": (
        "SIGABRT: a library the dataset calls aborted (a failed assertion in native code)."
        " Its message is in the output above; loader.num_workers=0 shows it in the main process"
    ),
    "Terminated": (
        "SIGTERM: something outside the run ended it (a job scheduler, a process manager,"
        " kill). Check what else manages this machine's processes"
    ),
}


def _killed_message(description: str) -> str:
    cause = _SIGNAL_CAUSES.get(
        description, "a signal from outside the run or a crash in native code"
    )
    return f"a DataLoader worker was killed by signal '{description}' ({cause})"


def shm_needed(ctx: Context) -> int:
    """Bytes of /dev/shm the batches in flight take: workers x prefetch x batch."""
    return ctx.num_workers * (ctx.prefetch_factor or 2) * ctx.batch_bytes if ctx.num_workers else 0


def shm_message(ctx: Context, predicted: bool = False) -> str:
    shm = shm_bytes()
    size = f"{_mb(shm[0])}, {_mb(shm[0] - shm[1])} free" if shm else "unknown size"
    when = "predicted before starting any worker: " if predicted else ""
    return (
        f"insufficient shared memory ({when}workers pass batches through /dev/shm, {size}):"
        f" {ctx.num_workers} workers x prefetch {ctx.prefetch_factor or 2} x"
        f" {_mb(ctx.batch_bytes)} per batch need about {_mb(shm_needed(ctx))}. In Docker, run"
        " with --shm-size=8g or --ipc=host; or lower loader.num_workers, loader.prefetch_factor"
        " or loader.batch_size"
    )


def check_shm(ctx: Context) -> None:
    """Refuse a loader whose batches in flight cannot fit in the free /dev/shm."""
    shm = shm_bytes()
    if not ctx.num_workers or shm is None or ctx.engine == "thread":  # threads share memory
        return
    if shm_needed(ctx) > shm[0] - shm[1]:
        raise LoaderFailure(shm_message(ctx, predicted=True))
