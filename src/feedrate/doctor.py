"""``python -m feedrate.doctor [overrides] [--preset FILE]``: what this machine allows a loader.

Prints the hardware fingerprint and the limits DataLoaders run into (/dev/shm, open files,
memory, start methods), checks the configured dataset (picklable for spawn? memory per
worker, measured), says which of the configured loader's settings are unsafe here and how far
they can go, and checks loader presets for anything that is not plain data. Exit status 1 when
something is unsafe, 0 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from omegaconf import DictConfig, OmegaConf

from feedrate import hardware, provenance
from feedrate.batch import describe, nbytes
from feedrate.checks import start_method, unpicklable, validate
from feedrate.dataset import build_dataset
from feedrate.errors import ConfigError, FeedrateError
from feedrate.faults import Context, shm_needed
from feedrate.launch import compose, loader_preset_dirs
from feedrate.monitor import data_workers
from feedrate.stream import is_stream, length
from feedrate.threads import check_engine
from feedrate.tuning.preset import plain_data_problems

MB = 2**20
# The share of available memory and free /dev/shm a loader may be planned to take.
BUDGET = 0.8


class Report:
    """The doctor's findings, one line each; counts the unsafe ones for the exit status."""

    def __init__(self) -> None:
        self.unsafe = 0

    def line(self, status: str, what: str, text: str) -> None:
        tag = {"ok": "[ ok ]", "info": "[info]", "warn": "[warn]", "unsafe": "[UNSAFE]"}[status]
        self.unsafe += status == "unsafe"
        print(f"{tag:8} {what:<18} {text}")

    def section(self, title: str) -> None:
        print(f"\n{title}")

    def finish(self) -> int:
        print(
            f"\n{self.unsafe} unsafe finding(s)"
            if self.unsafe
            else "\nnothing unsafe found for this configuration"
        )
        return 1 if self.unsafe else 0


@dataclass(frozen=True)
class Machine:
    """The limits a loader runs into here."""

    fingerprint: hardware.Fingerprint
    available: float  # bytes of memory available
    shm: tuple[float, float] | None  # /dev/shm (size, used) in bytes
    open_files: int  # the soft limit
    strategy: str  # torch.multiprocessing's sharing strategy


@dataclass(frozen=True)
class Probe:
    """What the configured dataset costs a loader."""

    sample_bytes: int
    unpicklable: str | None  # what cannot be pickled, if anything
    per_worker: float  # bytes of PSS a worker reached (0: not measured)
    shards: int | None = None  # a stream's, which bound its useful workers


def _mb(n: float) -> str:
    return f"{n / MB:,.0f} MB" if n < 10 * 2**30 else f"{n / 2**30:,.1f} GB"


def _worker_memory(
    dataset, batch_size: int, method: str, collate_fn: dict | str | None = None
) -> tuple[float, float]:
    """(main PSS, the larger worker's peak PSS) in bytes, over a few batches of 2 workers."""
    from feedrate.loader import build_loader

    kwargs = {
        "batch_size": batch_size,
        "shuffle": True,
        "num_workers": 2,
        "pin_memory": False,
        "drop_last": False,
        "timeout": 120.0,
        "persistent_workers": False,
        "prefetch_factor": 2,
        "multiprocessing_context": method,
        **({"collate_fn": collate_fn} if collate_fn is not None else {}),
    }
    loader = build_loader(dataset, kwargs, seed=0)
    me = psutil.Process()
    it = iter(loader)
    peaks: dict[int, float] = {}  # each worker's peak
    for _ in range(8):
        if next(it, None) is None:
            break
        for worker in data_workers(me):
            try:
                peaks[worker.pid] = max(peaks.get(worker.pid, 0.0), worker.memory_full_info().pss)
            except psutil.Error:
                continue
    main = me.memory_full_info().pss
    del it
    return main, (max(peaks.values()) if peaks else 0.0)


def diagnose_machine(overrides: list[str], presets: list[Path], measure: bool = True) -> int:
    """Print the machine's limits, the dataset's costs, the configured loader's risks and the
    presets' form; 1 when something is unsafe."""
    report = Report()
    cfg = compose(overrides)
    try:
        validate(cfg)
    except FeedrateError as exc:
        report.line("unsafe", "config", str(exc))
    machine = _check_machine(report, cfg)
    _check_travel(report, cfg, machine.fingerprint, overrides)
    probe = _check_dataset(report, cfg, machine, measure)
    if probe is not None:
        _check_loader(report, cfg.loader, machine, probe)
    _check_presets(report, presets)
    return report.finish()


def _check_machine(report: Report, cfg: DictConfig) -> Machine:
    report.section("Machine")
    fp = hardware.detect(cfg.dataset.get("root") or cfg.dataset.get("path"))
    report.line("info", "fingerprint", fp.short())
    available = hardware.available_memory()
    report.line("info", "memory", f"{_mb(available)} available of {fp.ram_gb:.1f} GB")
    shm = hardware.shm_bytes()
    if shm is None:
        report.line("warn", "/dev/shm", "not found: workers cannot pass batches through it")
    else:
        small = shm[0] < 1 * 2**30
        fix = " (Docker's default is 64 MB: run with --shm-size=8g or --ipc=host)" if small else ""
        free = f"{_mb(shm[0])}, {_mb(shm[0] - shm[1])} free{fix}"
        report.line("warn" if small else "ok", "/dev/shm", free)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    strategy = torch.multiprocessing.get_sharing_strategy()
    report.line(
        "warn" if soft < 4096 and strategy == "file_descriptor" else "ok",
        "open files",
        f"limit {soft} (hard {hard}); sharing strategy {strategy}: every tensor in flight"
        " holds a descriptor" + (" (ulimit -n 65536 raises it)" if soft < 4096 else ""),
    )
    methods = ", ".join(multiprocessing.get_all_start_methods())
    default = multiprocessing.get_start_method()
    report.line("info", "start methods", f"{methods}; default {default}")
    if torch.cuda.is_available():
        report.line(
            "info",
            "CUDA",
            "initialised in the main process before workers fork: a dataset that touches"
            " CUDA needs loader.multiprocessing_context=spawn",
        )
    return Machine(fp, available, shm, soft, strategy)


def _check_dataset(
    report: Report, cfg: DictConfig, machine: Machine, measure: bool
) -> Probe | None:
    """Build the dataset, check it pickles, and measure what a worker holds; None: no build."""
    report.section(f"Dataset ({cfg.dataset.get('_target_')})")
    t0 = time.perf_counter()
    try:
        dataset = build_dataset(cfg.dataset)
        sample = next(iter(dataset)) if is_stream(dataset) else dataset[0]
    except Exception as exc:  # noqa: BLE001 - the doctor reports, it does not stop
        report.line("unsafe", "build", f"{type(exc).__name__}: {exc}")
        return None
    sample_bytes = nbytes(sample)
    image = sample[0] if isinstance(sample, (tuple, list)) and len(sample) == 2 else None
    shown = f"{tuple(image.shape)} {image.dtype}" if hasattr(image, "shape") else describe(sample)
    batch = cfg.loader.batch_size
    report.line(
        "ok",
        "build",
        f"{length(dataset) or 'a stream of ?'} samples of {shown}"
        f" ({_mb(sample_bytes * batch)} a batch of {batch}),"
        f" built in {time.perf_counter() - t0:.1f} s",
    )
    found = unpicklable(dataset)
    if found is None:
        report.line("ok", "picklable", "yes: any start method can receive it")
    else:
        report.line(
            "warn",
            "picklable",
            f"no: {found} cannot be pickled; fork works, spawn and forkserver cannot receive it"
            " (open such handles lazily in the worker)",
        )
    per_worker = 0.0
    if measure:
        method = start_method(cfg.loader) if found is None else "fork"
        from feedrate.loader import named_collate

        main, per_worker = _worker_memory(dataset, batch, method, named_collate(cfg.loader))
        fits = int(max(0.0, machine.available * BUDGET - main) // per_worker) if per_worker else 0
        report.line(
            "info",
            "memory",
            f"main process {_mb(main)}; a {method} worker {_mb(per_worker)} (PSS, measured"
            f" over a few batches): about {fits} workers fit in {BUDGET:.0%} of the memory"
            " available",
        )
    _check_engine(report, dataset, measure)
    return Probe(sample_bytes, found, per_worker, getattr(dataset, "num_shards", None))


WAITS = 0.5  # of a read's time spent waiting (not on this thread's CPU): threads can hide it


def _check_engine(report: Report, dataset, measure: bool) -> None:
    """Which engine the samples call for (loader.engine): a read that mostly waits (storage,
    the network) is for threads; one that mostly computes, under the GIL in Python, for
    processes; C code that releases the GIL, measured (the sweep searches both)."""
    try:
        check_engine(dataset)
    except ConfigError as exc:
        report.line("info", "engine", f"processes: {str(exc).split('. ')[0]}")
        return
    if not measure:
        return
    wall, cpu, blocked = _read_times(dataset, reads=8)
    # of the time off the CPU, the share spent blocked (on a sleep, the disk, the network),
    # not runnable behind other processes: a busy machine does not make a computing read wait
    waits = (1 - cpu / wall) * blocked if wall > 0 else 0.0
    if waits >= WAITS:
        text = (
            f"a read waits {waits:.0%} of its {wall / 8 * 1000:.1f} ms: thread workers"
            " (loader.engine=thread) hide the wait at the memory of one process"
        )
    else:
        text = (
            f"a read computes {1 - waits:.0%} of its {wall / 8 * 1000:.1f} ms: processes for"
            " Python code under the GIL; threads where C code releases it. The sweep measures"
            " both (sweep.engines)"
        )
    report.line("info", "engine", text)


def _read_times(dataset, reads: int) -> tuple[float, float, float]:
    """(wall, CPU) seconds of ``reads`` samples read in turn, the CPU of every thread of this
    process (a transform may compute on torch's own threads), and the share of the context
    switches meanwhile that were voluntary: a thread that blocks gives the CPU up, one that
    waits behind other processes has it taken (involuntary)."""
    switches = resource.getrusage(resource.RUSAGE_SELF)
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(reads):
        dataset[i % len(dataset)]
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_SELF)
    gave = after.ru_nvcsw - switches.ru_nvcsw
    taken = after.ru_nivcsw - switches.ru_nivcsw
    return wall, cpu, gave / (gave + taken) if gave + taken else 0.0


def _check_loader(report: Report, loader: DictConfig, machine: Machine, probe: Probe) -> None:
    """The configured loader against the machine: start method, /dev/shm, descriptors,
    memory and cores."""
    report.section("Loader (the configured one)")
    workers, prefetch = loader.num_workers, loader.prefetch_factor or 2
    if workers == 0:
        report.line("info", "workers", "none: samples load in the training loop's process")
        return
    # a per-rank preset's workers are each rank's: the node runs them once a rank
    ranks = 1
    if loader.get("per_rank"):
        ranks = int(OmegaConf.select(loader, "measured_on.workload.ranks_per_node") or 1)
    node = workers * ranks
    each = f"{ranks} ranks x {workers} workers" if ranks > 1 else f"{workers} workers"
    if getattr(loader.get("engine"), "value", loader.get("engine")) == "thread":
        report.line(
            "info",
            "engine",
            f"{each} as threads of the training process: no worker process, no /dev/shm,"
            " one copy of the dataset",
        )
        return
    if probe.unpicklable is not None and start_method(loader) != "fork":
        report.line(
            "unsafe",
            "start method",
            f"{start_method(loader)} cannot receive this dataset: use"
            " loader.multiprocessing_context=fork, or make the dataset picklable",
        )
    if machine.shm is not None:
        batch_bytes = loader.batch_size * probe.sample_bytes
        ctx = Context(node, loader.prefetch_factor, batch_bytes, 0.0, loader.timeout)
        need, free = shm_needed(ctx), machine.shm[0] - machine.shm[1]
        report.line(
            _status(need, free),
            "/dev/shm",
            f"{each} x prefetch {prefetch} x {_mb(batch_bytes)} need about"
            f" {_mb(need)} of {_mb(free)} free",
        )
    if machine.strategy == "file_descriptor":
        # two tensors per batch in flight, and a pipe pair and more per worker
        fds = workers * (prefetch * 2 + 8)
        limit = machine.open_files
        report.line(
            _status(fds, limit),
            "open files",
            f"about {fds} descriptors in flight of the limit {limit}"
            + (" (a process's: each rank's)" if ranks > 1 else ""),
        )
    if probe.per_worker:
        need = node * probe.per_worker
        report.line(
            _status(need, machine.available),
            "memory",
            f"{each} x {_mb(probe.per_worker)} = {_mb(need)} of {_mb(machine.available)} available",
        )
    if probe.shards is not None and workers > probe.shards:
        report.line(
            "warn",
            "shards",
            f"{workers} workers for a stream of {probe.shards} shards: it splits by shard, so"
            f" {workers - probe.shards} workers read nothing",
        )
    cores = hardware.usable_cores()
    if node > cores:
        report.line(
            "info",
            "cores",
            f"{each} on {cores:g} cores: right for samples that wait"
            " on I/O, oversubscribed for CPU-bound decoding (the sweep measures which)",
        )


def _status(need: float, have: float) -> str:
    return "unsafe" if need > have else "warn" if need > BUDGET * have else "ok"


def _check_travel(
    report: Report, cfg: DictConfig, fp: hardware.Fingerprint, overrides: list[str]
) -> None:
    """Which preset loader=auto picks here, or how this machine and workload differ from
    where the chosen preset was measured."""
    report.section("Loader preset")
    name = next((o.split("=", 1)[1] for o in overrides if o.startswith("loader=")), "default")
    try:
        hw = hardware.resolve(cfg.hardware, fp)
    except FeedrateError as exc:
        report.line("unsafe", "hardware", str(exc))
        return
    here = provenance.Here.of(cfg, fp, hw, overrides)
    if cfg.loader.measured_on is None and not cfg.loader.auto:
        report.line(
            "info", f"loader={name}", "written by hand (no measured_on): nothing to compare"
        )
        return
    asked = provenance.asked_loader_keys(overrides)
    auto = bool(cfg.loader.auto)  # then the picked preset is what the later checks look at
    dirs = loader_preset_dirs()
    picked, line = provenance.settle(cfg, dirs, here, hw.is_cuda, name, asked, say=False)
    if auto:
        report.line("info", "loader=auto", line.replace("loader=auto picked", "picks"))
    else:
        text = line or "measured on this machine and workload"
        report.line("warn" if line else "ok", f"loader={picked}", text)


def _check_presets(report: Report, presets: list[Path]) -> None:
    report.section("Loader presets")
    for path in presets:
        problems = plain_data_problems(path)
        if problems:
            report.line("unsafe", path.name, f"not plain data: {'; '.join(problems)}")
        else:
            report.line("ok", path.name, "plain data")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m feedrate.doctor",
        description="What this machine allows a DataLoader, and which settings are unsafe here.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    parser.add_argument(
        "--preset",
        action="append",
        type=Path,
        default=None,
        help="a loader preset file to check is plain data (default: every loader preset found)",
    )
    parser.add_argument(
        "--no-measure", action="store_true", help="skip measuring a worker's memory"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    presets = args.preset or sorted(p for d in loader_preset_dirs() for p in d.glob("*.yaml"))
    for path in presets:
        if not path.is_file():
            parser.error(f"--preset {path}: no such file")
    try:
        return diagnose_machine(args.overrides, presets, measure=not args.no_measure)
    except FeedrateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
