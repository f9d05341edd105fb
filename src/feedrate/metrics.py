"""What the device waited for: throughput, data-wait, start-up, memory of the process tree."""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, field

import psutil

from feedrate.hardware import shm_bytes

# Metrics train.py can return to a sweeper (`objective=`); all are in metrics.json.
METRIC_NAMES = (
    "samples_per_sec",
    "consumed_samples_per_sec",
    "produced_samples_per_sec",
    "epoch_restart_s",
    "cpu_util",
    "other_cpu_frac",
    "peak_shm_mb",
    "window_spread",
    "data_wait_frac",
    "first_batch_s",
    "step_time_p50_ms",
    "step_time_p90_ms",
    "final_loss",
    "train_accuracy",
    "val_loss",
    "val_accuracy",
    "peak_pss_mb",
)

# Above this share of step time spent waiting for the next batch, the run is input-bound.
INPUT_BOUND_WAIT_FRAC = 0.10

# A measurement is flagged noisy (and a sweep trial measured again) when processes outside the
# run kept more than this share of its cores busy. The windows' spread is no such evidence by
# itself: short windows and the start-up backlog spread them on a quiet machine too. It is
# reported, and the sweep's decision asks for a margin beyond it.
NOISY_OTHER_CPU_FRAC = 0.25


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
    """Samples memory of the main process and its workers, and /dev/shm, in a thread.

    Used as a context manager around the training loop; ``peaks`` holds the maxima. PSS comes
    from each process's smaps_rollup, a walk of its page tables: about 10 ms a process for a
    torch process, 0.6 s of CPU for 64 workers, the very CPU a measurement is about. So the
    full reading happens every ``interval_s`` outside the measured window, and at its start
    and end; inside it the thread reads only the machine's available memory (cheap) and takes
    a full reading when the tree may have grown by more than ``GROWTH`` since the last one, or
    may be near the guard's limit. ``interval_s=None``: no thread at all.
    """

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

    def sample(self) -> None:
        pss, uss, count, children, main_pss = _tree_memory(self._proc)
        self._reference = (pss, psutil.virtual_memory().available)
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
        while not self._stop.wait(self.interval_s):
            if self.tripped:  # the training loop did not stop at its step's end: end workers
                self._end_workers()
            if not self._measuring:
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
        self.sample()  # workers are up by now, even in a run shorter than the interval
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
        self.sample()

    def __enter__(self) -> ResourceMonitor:
        self.sample()
        if self.interval_s is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class WarmUp:
    """When the measured window may start: the steady state, not the start-up.

    All workers start at once and are handed ``num_workers * prefetch_factor`` batches (the
    start-up backlog). Until training has consumed that many, it eats batches queued while it
    was not yet asking, and workers still starting up make the rate lower than it will be.
    So the warm-up lasts ``min_steps``, or the backlog and then windows of ``window_steps``
    until two in a row agree within ``tolerance`` (at most ``max_windows``: then measuring
    starts anyway, ``settled`` False). ``clock`` is passed in so tests can drive it.
    """

    def __init__(
        self,
        min_steps: int,
        backlog: int = 0,
        window_steps: int = 5,
        tolerance: float = 0.10,
        max_windows: int = 4,
        steady: bool = True,
        clock=time.perf_counter,
        sync=lambda: None,
    ) -> None:
        self.min_steps = min_steps
        self.backlog = backlog if steady else 0
        self.window_steps = max(1, window_steps)
        self.tolerance = tolerance
        self.max_windows = max_windows if steady else 0
        self.clock = clock
        self.sync = sync  # the device's queue drained before the clock is read (CUDA)
        self.steps = 0
        self.windows = 0
        self.settled: bool | None = False if steady else None  # None: not checked
        self.started_at = clock()
        self.seconds = 0.0
        self._window_start: float | None = None
        self._window_steps = 0
        self._last_rate: float | None = None
        self.cut = False  # the run ended before the warm-up did

    def update(self) -> bool:
        """One warm-up step done; True when the warm-up is over (measure from the next)."""
        self.steps += 1
        if self.steps < max(self.min_steps, self.backlog):
            return False
        if self.max_windows == 0:
            return self._over()
        if self._window_start is not None and self._window_steps + 1 < self.window_steps:
            self._window_steps += 1
            return False
        self.sync()
        now = self.clock()
        if self._window_start is None:
            self._window_start = now
            return False
        self._window_steps += 1
        span = now - self._window_start
        rate = self._window_steps / span if span > 0 else float("inf")
        self._window_start, self._window_steps = now, 0
        last, self._last_rate = self._last_rate, rate
        self.windows += 1
        if last is not None and abs(rate / last - 1.0) <= self.tolerance:
            self.settled = True
            return self._over()
        return self._over() if self.windows >= self.max_windows else False

    def _over(self) -> bool:
        self.seconds = self.clock() - self.started_at
        return True

    def cut_short(self) -> None:
        """The run ends before the warm-up could: measuring starts anyway, unsettled."""
        self._over()
        self.cut = True
        if self.settled is not None:
            self.settled = False

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "seconds": self.seconds,
            "backlog_batches": self.backlog,
            "settle_windows": self.windows,
            "settled": self.settled,
            "cut_short": self.cut,
        }


@dataclass
class StepTimes:
    """Per-step timings of the measured (post-warm-up) phase."""

    wait_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    window_rates: list[float] = field(default_factory=list)  # samples/s per synchronised window
    samples: int = 0  # consumed by training
    produced: int | None = None  # produced by the workers in the same time (None: no workers)
    elapsed_s: float = 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def verdict(data_wait_frac: float, cpu_util: float | None, device: str) -> tuple[str, str]:
    """('input-bound' | 'compute-bound', the evidence in one sentence)."""
    cpu = f"; CPU busy {cpu_util:.0%}" if cpu_util is not None else ""
    if data_wait_frac > INPUT_BOUND_WAIT_FRAC:
        hint = (
            "the CPU is saturated: more workers will not help, cheaper decoding/augmentation will"
            if cpu_util is not None and cpu_util > 0.9
            else "the CPU has room: more workers or deeper prefetch should help"
            " (python train.py -m sweep=loader)"
        )
        return "input-bound", (
            f"the {device} waited for data {data_wait_frac:.0%} of the time"
            f" (> {INPUT_BOUND_WAIT_FRAC:.0%}){cpu}; {hint}"
        )
    if device == "CPU" and cpu_util is not None and cpu_util > 0.9:
        return "compute-bound", (
            f"the CPU waited for data only {data_wait_frac:.0%} of the time"
            f" (<= {INPUT_BOUND_WAIT_FRAC:.0%}){cpu}; the loader keeps up, but loading and"
            " training share the same saturated cores: only less work per sample or more cores"
            " will speed this up"
        )
    return "compute-bound", (
        f"the {device} waited for data only {data_wait_frac:.0%} of the time"
        f" (<= {INPUT_BOUND_WAIT_FRAC:.0%}){cpu}; the model sets the pace, a faster loader"
        " will not speed this up"
    )


def noise(other_cpu_frac: float | None) -> list[str]:
    """Why a measurement should not be trusted as it stands; empty if it can be."""
    if other_cpu_frac is not None and other_cpu_frac > NOISY_OTHER_CPU_FRAC:
        return [
            f"other processes kept {other_cpu_frac:.0%} of this run's cores busy while it was"
            " measured"
        ]
    return []


def summarise(
    times: StepTimes,
    first_batch_s: float,
    epoch_restart_s: list[float],
    monitor: ResourceMonitor,
    device: str,
    final_loss: float,
    train_accuracy: float,
    stream: bool = False,
) -> dict:
    """The metrics written to metrics.json."""
    total_step = sum(times.step_s)
    wait_frac = sum(times.wait_s) / total_step if total_step > 0 else float("nan")
    bound, evidence = verdict(wait_frac, monitor.cpu_util, device)
    rates = times.window_rates
    elapsed = times.elapsed_s if times.elapsed_s > 0 else float("nan")
    consumed_rate = times.samples / elapsed
    produced_rate = times.produced / elapsed if times.produced is not None else None
    # Streaming (no epoch ends), workers never idle for lack of indices, so what they produced
    # is what they sustain, and the backlog queued at start-up cannot pass for throughput.
    # With epochs, workers legitimately idle at each epoch's end: use what training consumed.
    use_produced = stream and produced_rate is not None
    rate = min(consumed_rate, produced_rate) if use_produced else consumed_rate
    median = statistics.median(rates) if rates else 0.0
    spread = (max(rates) - min(rates)) / median if len(rates) > 1 and median > 0 else None
    mb = 1 / 2**20
    return {
        "samples_per_sec": rate,
        "consumed_samples_per_sec": consumed_rate,
        "produced_samples_per_sec": produced_rate,
        "data_wait_frac": wait_frac,
        "first_batch_s": first_batch_s,
        "epoch_restart_s": statistics.median(epoch_restart_s) if epoch_restart_s else None,
        "step_time_p50_ms": percentile(times.step_s, 0.5) * 1e3,
        "step_time_p90_ms": percentile(times.step_s, 0.9) * 1e3,
        "window_samples_per_sec": rates,
        "window_spread": spread,
        "measured_steps": len(times.step_s),
        "measured_samples": times.samples,
        "measured_seconds": times.elapsed_s,
        "cpu_util": monitor.cpu_util,
        "other_cpu_frac": monitor.other_cpu_frac,
        "noise": noise(monitor.other_cpu_frac),
        "peak_pss_mb": monitor.peaks.pss_bytes * mb,
        "peak_uss_mb": monitor.peaks.uss_bytes * mb,
        "peak_main_pss_mb": monitor.peaks.main_pss_bytes * mb,
        "peak_processes": monitor.peaks.processes,
        "peak_shm_mb": monitor.peaks.shm_bytes * mb,
        "memory_samples_while_measuring": monitor.full_samples,
        "final_loss": final_loss,
        "train_accuracy": train_accuracy,
        "bound": bound,
        "evidence": evidence,
    }


def format_summary(m: dict) -> str:
    restart = (
        f"{m['epoch_restart_s']:.2f} s" if m.get("epoch_restart_s") is not None else "n/a (1 epoch)"
    )
    spread = (
        f" (window spread {m['window_spread']:.0%})" if m.get("window_spread") is not None else ""
    )
    cpu = f"{m['cpu_util']:.0%}" if m.get("cpu_util") is not None else "?"
    if m.get("other_cpu_frac") is not None:
        cpu += f" ({m['other_cpu_frac']:.0%} by other processes)"
    val = (
        f"; held out: loss {m['val_loss']:.3f}, accuracy {m['val_accuracy']:.1%}"
        if m.get("val_accuracy") is not None
        else ""
    )
    return "\n".join(
        [
            f"samples/s        {m['samples_per_sec']:,.1f}{spread}",
            f"data wait        {m['data_wait_frac']:.1%} of step time",
            f"first batch      {m['first_batch_s']:.2f} s   (later epochs: {restart})",
            f"step time        p50 {m['step_time_p50_ms']:.1f} ms,"
            f" p90 {m['step_time_p90_ms']:.1f} ms",
            f"CPU busy         {cpu}",
            f"memory (PSS)     {m['peak_pss_mb']:,.0f} MB peak over {m['peak_processes']} processes"
            f" (main {m['peak_main_pss_mb']:,.0f} MB); /dev/shm peak {m['peak_shm_mb']:,.1f} MB",
            "loss / accuracy  "
            + (
                f"{m['final_loss']:.3f} / {m['train_accuracy']:.1%}"
                if m.get("final_loss") is not None
                else "n/a (trainer.measure=loader: no model step)"
            )
            + val,
            f"verdict          {m['bound'].upper()}: {m['evidence']}",
            *(
                [
                    f"NOISY            {'; '.join(m['noise'])}: compare figures only from a"
                    " quiet machine, or take the median of several runs"
                ]
                if m.get("noise")
                else []
            ),
        ]
    )
