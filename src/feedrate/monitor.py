"""Memory and CPU of the run's process tree, sampled in a thread while it trains, and the
memory guard that stops the run before the out-of-memory killer does."""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass

import psutil

from feedrate.hardware import shm_bytes


def _tree_memory(proc: psutil.Process) -> tuple[float, float, int, list[float], float]:
    """(PSS, USS, processes, [USS of each descendant], PSS of ``proc`` alone) of ``proc`` and its
    descendants, in bytes, from one reading of each (so the main process never exceeds the sum).

    PSS splits shared pages between the processes that map them, so the sum over the tree is
    what the tree really costs; RSS would count the parent's pages once per forked worker.
    """
    pss = uss = main_pss = 0.0
    count = 0
    children: list[float] = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        pss += getattr(info, "pss", info.rss)
        uss += getattr(info, "uss", info.rss)
        count += 1
        if p.pid != proc.pid:
            children.append(getattr(info, "uss", info.rss))
        else:
            main_pss = getattr(info, "pss", info.rss)
    return pss, uss, count, children, main_pss


def data_workers(proc: psutil.Process) -> list[psutil.Process]:
    """``proc``'s DataLoader workers, wherever they hang in its tree (forkserver workers are
    the server's children); PyTorch names each ``pt_data_worker``."""
    found = []
    for child in proc.children(recursive=True):
        try:
            if child.name() == "pt_data_worker":
                found.append(child)
        except psutil.Error:
            continue
    return found


def guard_message(
    total: float, limit: float, worker_uss: list[float], explicit: bool, start_method: str | None
) -> str:
    """The memory guard's diagnosis: how far over, and what the workers hold of it."""
    gb = 1 / 2**30
    setting = (
        "hardware.memory_limit_gb"
        if explicit
        else "90% of the memory available at the start; hardware.memory_limit_gb sets it"
    )
    text = (
        f"memory guard: the run's processes reached {total * gb:.2f} GB (PSS), over the limit"
        f" of {limit * gb:.2f} GB ({setting}); the run was stopped before the out-of-memory"
        " killer could"
    )
    if not worker_uss or sum(worker_uss) < 0.25 * total:
        return text + (
            ". Use a smaller loader.batch_size, fewer loader.num_workers, or a smaller model"
        )
    each = f"Its {len(worker_uss)} workers hold {statistics.mean(worker_uss) * gb:.2f} GB"
    if start_method == "fork":
        return text + (
            f". {each} of private memory each, though forked workers share the main process's"
            " pages until they write them: the copy-on-read pattern of a dataset held in Python"
            " objects (lists, dicts), whose pages every worker copies by merely reading them"
            " (reference counts). Hold the data in numpy arrays or tensors (or use"
            " dataset=memmap), or use fewer loader.num_workers"
        )
    return text + (
        f". {each} of their own memory each: a {start_method} worker builds its own copy of"
        " the dataset and imports torch anew. Use fewer loader.num_workers, or fork"
    )


@dataclass
class ResourcePeaks:
    pss_bytes: float = 0.0
    uss_bytes: float = 0.0
    main_pss_bytes: float = 0.0
    processes: int = 0
    shm_bytes: float = 0.0


class ResourceMonitor:
    """Memory (PSS) of the main process and its workers, and /dev/shm, sampled in a thread
    around the training loop; ``peaks`` holds the maxima. Full readings cost CPU, so inside the
    measured window only when the tree may have grown (docs/design.md, "Memory readings")."""

    GROWTH = 0.05

    def __init__(
        self,
        interval_s: float | None = 2.0,
        limit_bytes: float | None = None,
        explicit_limit: bool = False,
        start_method: str | None = None,
        cpu_root: int | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.peaks = ResourcePeaks()
        self.full_samples = 0  # full readings taken while measuring (the bench reports them)
        self._measuring = False
        self._reference: tuple[float, float] = (0.0, 0.0)  # (tree PSS, available) at a reading
        self._peak_since = 0.0
        # The memory guard: past ``limit_bytes`` (PSS of the tree), ``tripped`` says why and
        # the training loop stops after its step; if it is stuck, workers are killed.
        self.limit_bytes = limit_bytes
        self.explicit_limit = explicit_limit
        self.start_method = start_method
        self.tripped: str | None = None
        self._proc = psutil.Process(os.getpid())
        # Whose CPU is the run's own: this process's tree, or under torchrun the launcher's
        # (every rank of the machine and their workers), so sibling ranks are not "noise".
        self._cpu_root = psutil.Process(cpu_root) if cpu_root else self._proc
        self._stop = threading.Event()
        self._wake = threading.Event()  # the stop, or a reading asked for now
        self._soon = False
        self._thread = threading.Thread(target=self._run, name="feedrate-monitor", daemon=True)
        shm = shm_bytes()
        self._shm_base = shm[1] if shm else 0
        self.cpu_util: float | None = None
        # Busy share of the run's cores spent by other processes (noise while measuring).
        self.other_cpu_frac: float | None = None
        try:
            self._cpus = sorted(self._proc.cpu_affinity())
        except (AttributeError, psutil.Error):  # no affinity on macOS
            self._cpus = list(range(psutil.cpu_count() or 1))
        self._cpu_start: tuple[float, float, float] | None = None

    def mark(self) -> None:
        """From now on :attr:`peak_since_mark` is the highest reading (a candidate's own)."""
        self._peak_since = 0.0

    @property
    def peak_since_mark(self) -> float:
        """The tree's highest PSS at a reading since :meth:`mark` (or the start)."""
        return self._peak_since

    def sample(self) -> None:
        pss, uss, count, children, main_pss = _tree_memory(self._proc)
        self._reference = (pss, psutil.virtual_memory().available)
        self._peak_since = max(self._peak_since, pss)
        if self.limit_bytes is not None and pss > self.limit_bytes and self.tripped is None:
            self.tripped = guard_message(
                pss,
                self.limit_bytes,
                children,
                self.explicit_limit,
                self.start_method,
            )
        shm = shm_bytes()
        p = self.peaks
        p.pss_bytes = max(p.pss_bytes, pss)
        p.uss_bytes = max(p.uss_bytes, uss)
        p.main_pss_bytes = max(p.main_pss_bytes, main_pss)
        p.processes = max(p.processes, count)
        if shm:
            p.shm_bytes = max(p.shm_bytes, shm[1] - self._shm_base)

    def sample_soon(self) -> None:
        """A full reading, taken by the monitor's thread at once (the caller goes on: a walk of
        64 workers' page maps takes 0.6 s), or here where no thread runs."""
        if not self._thread.is_alive():
            self.sample()
            return
        self._soon = True
        self._wake.set()

    def _end_workers(self) -> None:
        """SIGKILL the DataLoader workers: memory comes back now, and a main process stuck
        waiting on them fails at once instead of at the OOM killer's hand."""
        for worker in data_workers(self._proc):
            try:
                worker.kill()
            except psutil.Error:
                continue

    def _may_have_grown(self) -> bool:
        """While measuring: could the tree have passed its peak by GROWTH, or the limit? The
        machine's available memory tells, for the price of reading /proc/meminfo."""
        pss, available = self._reference
        estimate = pss + max(0.0, available - psutil.virtual_memory().available)
        near_limit = self.limit_bytes is not None and estimate > 0.9 * self.limit_bytes
        return near_limit or estimate > (1 + self.GROWTH) * max(self.peaks.pss_bytes, pss)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            soon, self._soon = self._soon, False
            if self.tripped:  # the training loop did not stop at its step's end: end workers
                self._end_workers()
            if soon or not self._measuring:
                self.sample()
            elif self._may_have_grown():
                self.full_samples += 1
                self.sample()

    def _cpu_clock(self) -> tuple[float, float, float]:
        """(now, busy CPU-seconds of the run's cores, CPU-seconds of the run's processes)."""
        per_cpu = psutil.cpu_times(percpu=True)
        busy = 0.0
        for i in self._cpus:
            if i < len(per_cpu):
                t = per_cpu[i]
                busy += sum(t) - t.idle - getattr(t, "iowait", 0.0)
                busy -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)  # in user
        ours = 0.0
        try:
            t = self._cpu_root.cpu_times()
            ours = t.user + t.system + t.children_user + t.children_system  # + reaped workers
            for child in self._cpu_root.children(recursive=True):
                try:
                    c = child.cpu_times()
                    ours += c.user + c.system
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        return time.perf_counter(), busy, ours

    def start_cpu_window(self) -> None:
        # No full reading here: a walk of every worker's page map (0.6 s of CPU at 64 workers)
        # would land on the window's first steps. The meter reads at the first batch instead.
        self._measuring = True
        self._cpu_start = self._cpu_clock()

    def end_cpu_window(self) -> None:
        self._measuring = False
        if self._cpu_start is not None:
            t1, busy1, ours1 = self._cpu_clock()
            t0, busy0, ours0 = self._cpu_start
            capacity = (t1 - t0) * len(self._cpus)
            if capacity > 0:
                busy = busy1 - busy0
                self.cpu_util = min(1.0, busy / capacity)
                self.other_cpu_frac = min(1.0, max(0.0, busy - (ours1 - ours0)) / capacity)
        if self._may_have_grown():  # else the readings so far hold its peak (0.6 s saved)
            self.sample()

    def __enter__(self) -> ResourceMonitor:
        self.sample()
        if self.interval_s is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
