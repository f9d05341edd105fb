"""What metrics.json holds, shaped in one place (:func:`summarise`), and its summary."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import TYPE_CHECKING

from feedrate.meter import rate_of
from feedrate.project import command
from feedrate.stats import window_spread

if TYPE_CHECKING:
    from feedrate.meter import TrainResult
    from feedrate.monitor import ResourceMonitor

# Above this share of step time spent waiting for the next batch, the run is input-bound.
INPUT_BOUND_WAIT_FRAC = 0.10

# A measurement is flagged noisy (and a sweep trial measured again) when processes outside the
# run kept more than this share of its cores busy. The windows' spread is no such evidence by
# itself: short windows and the start-up backlog spread them on a quiet machine too. It is
# reported, and the sweep's decision asks for a margin beyond it.
NOISY_OTHER_CPU_FRAC = 0.25


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
            f" ({command(sweep=True)})"
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
    result: TrainResult,
    monitor: ResourceMonitor,
    *,
    device: str,
    stream: bool = False,
    held_out: tuple[float | None, float | None] = (None, None),
    skipped: int = 0,
    run: dict | None = None,
) -> dict:
    """metrics.json of one rank: what the meter measured, what the monitor saw, the held-out
    loss and accuracy, and ``run`` (the settings and machine); ``device`` is "CPU" or "CUDA".

    Longer than most functions here on purpose: its one dict is the file's whole schema."""
    times = result.times
    total_step = sum(times.step_s)
    wait_frac = sum(times.wait_s) / total_step if total_step > 0 else float("nan")
    bound, evidence = verdict(wait_frac, monitor.cpu_util, device)
    rates = times.window_rates
    elapsed = times.elapsed_s if times.elapsed_s > 0 else float("nan")
    consumed_rate = times.samples / elapsed
    produced_rate = times.produced / elapsed if times.produced is not None else None
    # Streaming, workers never idle for lack of indices: what they produced is what they
    # sustain, and the start-up backlog cannot pass for throughput (docs/design.md).
    rate = rate_of(times, stream)
    rate = consumed_rate if rate is None else rate  # nothing measured: nan
    spread = window_spread(rates)
    restarts = result.epoch_restart_s
    mb = 1 / 2**20
    return {
        "samples_per_sec": rate,
        "consumed_samples_per_sec": consumed_rate,
        "produced_samples_per_sec": produced_rate,
        "data_wait_frac": wait_frac,
        "first_batch_s": result.first_batch_s,
        "epoch_restart_s": statistics.median(restarts) if restarts else None,
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
        "final_loss": result.final_loss,
        "train_accuracy": result.train_accuracy,
        "bound": bound,
        "evidence": evidence,
        "val_loss": held_out[0],
        "val_accuracy": held_out[1],
        "skipped_samples": skipped,
        "steps": result.steps,
        # every sample this run trained (warm-up and tuning included), in how long
        "trained_samples": result.trained_samples,
        "train_seconds": result.train_seconds,
        "warmup": result.warmup,
        "abandoned": result.abandoned or None,
        "drift_warnings": result.drift_warnings,
        "epochs_started": result.epochs_started,
        # what a measured batch cost its worker and the step (trainer.costs; the model's input)
        "costs": dataclasses.asdict(result.costs) if result.costs is not None else None,
        "run": run or {},
    }


def finite(obj):
    """JSON has no NaN: null for a figure that could not be measured."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


def _shown(value, spec: str) -> str:
    """``value`` formatted, or "n/a" for a figure nothing measured (a run that ended during
    its warm-up, or during loader=autotune's last candidate before its first window)."""
    return "n/a" if value is None else format(value, spec)


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
    val = ""
    if m.get("val_loss") is not None:
        val = f"; held out: loss {m['val_loss']:.3f}"
        if m.get("val_accuracy") is not None:
            val += f", accuracy {m['val_accuracy']:.1%}"
    return "\n".join(
        [
            f"samples/s        {_shown(m['samples_per_sec'], ',.1f')}{spread}",
            f"data wait        {_shown(m['data_wait_frac'], '.1%')} of step time",
            f"first batch      {_shown(m['first_batch_s'], '.2f')} s   (later epochs: {restart})",
            f"step time        p50 {_shown(m['step_time_p50_ms'], '.1f')} ms,"
            f" p90 {_shown(m['step_time_p90_ms'], '.1f')} ms",
            f"CPU busy         {cpu}",
            f"memory (PSS)     {m['peak_pss_mb']:,.0f} MB peak over {m['peak_processes']} processes"
            f" (main {m['peak_main_pss_mb']:,.0f} MB); /dev/shm peak {m['peak_shm_mb']:,.1f} MB",
            "loss / accuracy  " + _loss_line(m) + val,
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


def _loss_line(m: dict) -> str:
    if m.get("final_loss") is None:
        return "n/a (trainer.measure=loader: no model step)"
    if m.get("train_accuracy") is None:
        return f"{m['final_loss']:.3f} / n/a (the step gives no logits and labels)"
    return f"{m['final_loss']:.3f} / {m['train_accuracy']:.1%}"
