"""Side-by-side loader benchmark: feedrate's tuned preset against the usual recipes.

    python benchmarks/loader_bench.py                 # the CPU workloads (make bench)
    python benchmarks/loader_bench.py --workloads synthetic_loader --repeats 5

For each workload, in one run on one machine:
1. runs the default loader sweep from scratch (`python train.py -m sweep=loader`, a fresh study)
   and times it;
2. measures, in `--repeats` alternating rounds: PyTorch's `default`, the `recipe` preset, the
   configuration a CPU-capped tuner picks (`num_workers` = cores, persistent workers), the tuned
   preset and a `num_workers` grid. After the first round, contestants whose resolved DataLoader
   settings are identical are one row (`tuned = cpu_capped`), measured once from then on;
3. measures the two ceilings in the same rounds, each alone with all cores: loader-only
   (`trainer.measure=loader`, the best of the grid and the tuned preset picked on the first
   round, then that one every round; the ceiling is its later rounds, not the run that won
   the pick) and compute-only (`trainer.measure=compute`), and applies the one that fits where the
   model runs: on a GPU, min(loader, compute); on the CPU the loader uses, the shared-core rate
   1/(1/L + 1/C);
4. checks that the sweep's short trials measured steady state: for every finalist and three
   other trials, the trial's figure beside a `--steady-seconds` run of the same settings;
5. checks that reading memory does not cost the measurement: the tuned preset with
   `trainer.memory_sample_s=null`, alternating with it;
6. prints every ratio with its 95% interval over the paired rounds (`feedrate.stats`, as the
   sweep decides: a win or a loss only when the interval excludes 1.0, else a tie), checks the
   targets on the interval (met when its low end is at or above the target), and writes
   `bench.json`, `tables.md` and `bench.png` under `--out`.

Every measurement runs in the sweep's own trial runner: a warm host per row, as the sweep's
final rounds have one per contestant, each run a new DataLoader (`--fresh`: a fresh
`python train.py` process each, and the sweep's trials too). The model is `pooled_linear` (almost no
compute), so samples/s is what the input pipeline feeds into a real training step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import common
from omegaconf import OmegaConf

from feedrate import stats
from feedrate.environment import git_commit
from feedrate.hardware import detect, usable_cores
from feedrate.sweep import ceiling
from feedrate.sweep.decide import resolved_settings, twins
from feedrate.sweep.host import Host
from feedrate.sweep.trial import Fresh, Runner, TrialResult, run_trial

ROOT = Path(__file__).resolve().parents[1]

SYNTHETIC = ["dataset=synthetic", "dataset.io_latency_ms=10", "dataset.dtype=float32"]
WORKLOADS = {
    # The classic dummy dataset (3x224x224 float32, 10 ms of I/O latency per sample) as a GPU
    # host sees it: the model takes no CPU, so the loader has the cores to itself.
    "synthetic_loader": [*SYNTHETIC, "model=pooled_linear", "trainer.measure=loader"],
    # The same data end to end, the training step on the CPU the workers use.
    "synthetic": [*SYNTHETIC, "model=pooled_linear"],
    # An I/O-bound dataset the sweep was never tuned on: a user's own Dataset class sleeping
    # 25 ms a sample (slow storage), uint8 images, and a small CNN that trains.
    "unseen": [
        "dataset=custom",
        "dataset._target_=examples.sleepy.SleepyDataset",
        "+dataset.sleep_ms=25",
        "+dataset.length=20000",
        "model=tiny_cnn",
    ],
    # Another user's dataset: a remote object store, lognormal latency (median 15 ms) and 1 ms
    # of CPU decode a sample (examples/remote_store.py), tiny_cnn end to end.
    "remote": [
        "dataset=custom",
        "dataset._target_=examples.remote_store.RemoteStoreDataset",
        "model=tiny_cnn",
    ],
    # A third user's dataset, never tuned on before loader=autotune: a network filesystem whose
    # reads take 4 ms and stall 150 ms one time in 40, then 0.5 ms of CPU (examples/stalls.py).
    "stalls": [
        "dataset=custom",
        "dataset._target_=examples.stalls.StallingDataset",
        "model=tiny_cnn",
    ],
    # The held-out store of examples/sensor_store.py (lognormal latency, median 12 ms, 0.2 ms
    # of CPU a read) as feedrate's own loop trains it: a classifier of its readings.
    "sensors": [
        "dataset=custom",
        "dataset._target_=examples.sensor_store.SensorEvents",
        "model=tiny_cnn",
    ],
    # A fourth user's data, new with the benches at the code that judges them: documents from
    # a key-value store (8 ms median latency, a heavy tail), parsed and tokenized in Python,
    # about 0.8 ms of CPU a read (examples/doc_store.py): waiting and parsing both count.
    "docs": [
        "dataset=custom",
        "dataset._target_=examples.doc_store.DocumentStore",
        "model=tiny_cnn",
    ],
    # A fifth user's data, new with the fix to the tuner's early leave and held out from it:
    # map tiles from a tile server (20 ms median latency, a wide tail, congestion in runs of
    # keys), PNG-decoded with Pillow, cropped and flipped, about 1.4 ms of CPU a read
    # (examples/tile_server.py), tiny_cnn end to end.
    "tiles": [
        "dataset=custom",
        "dataset._target_=examples.tile_server.TileServer",
        "model=tiny_cnn",
    ],
    # Two datasets written to judge the tuners that predict from what a sample costs, and
    # never tuned on: spoken-word clips from a blob store (9 ms median latency, a wide tail)
    # turned into log-mel spectrograms in NumPy (examples/audio_store.py), and support
    # tickets from a key-value store (5 ms, a stall one read in 50) tokenized in pure Python
    # against a vocabulary each process builds once (examples/vocab_store.py).
    "audio": [
        "dataset=custom",
        "dataset._target_=examples.audio_store.AudioClips",
        "model=tiny_cnn",
    ],
    "tickets": [
        "dataset=custom",
        "dataset._target_=examples.vocab_store.Tickets",
        "model=tiny_cnn",
    ],
    # A third, written after rules had come from the first two: weather-radar frames from a
    # chunked store behind a cache (7 reads in 10 hit in 1 ms, the rest wait 22 ms, lognormal),
    # then decompressed and scaled in zlib and NumPy, a few ms of CPU a sample
    # (examples/radar_store.py).
    "radar": [
        "dataset=custom",
        "dataset._target_=examples.radar_store.RadarFrames",
        "model=tiny_cnn",
    ],
    # Real JPEGs read, decoded and augmented from disk.
    "photos": ["dataset=photos", "model=pooled_linear"],
    # A stream of tar shards (webdataset), decoded in the workers, training tiny_cnn.
    "webdataset": ["dataset=webdataset"],
    # Photos at 224 px for a model that trains (benchmarks/gpu_check.sh adds model=resnet50
    # hardware=h200 through --extra: ResNet-50 in bf16).
    "gpu": ["dataset=photos", "dataset.image_size=224"],
    # Photos for ResNet-18, which trains faster than 16 cores decode JPEGs on an H200: where
    # decode placement (loader.decode, searched with a GPU) matters.
    "gpu_decode": ["dataset=photos", "dataset.image_size=224", "model=resnet18"],
}
GRID = (0, 2, 4, 8, 16, 32, 64)  # num_workers of the grid
PREFETCH = (2, 4, 8)  # prefetch_factor of the grid (every worker count above 0)
# The sweep's own measurement: streaming (no epoch ends), so every configuration is judged on
# sustained throughput, min(consumed, produced), after the steady-state warm-up.
MEASURE = [
    "trainer.stream=true",
    "trainer.max_steps=100000",
    "trainer.warmup_steps=3",
    "trainer.window_steps=5",
    "trainer.save_checkpoint=false",
    "trainer.progress=false",
]
# Rows that are not contestants: the ceilings, and the tuned preset with memory reads off.
CEILING = "ceiling_"
MEMORY_OFF = "tuned_memory_off"
NO_MEMORY_READS = "trainer.memory_sample_s=null"
BEST_GRID = "best_grid"  # the grid's best point, measured in the rounds beside the others
# The tuned preset with other thread counts: PyTorch's where the sweep tuned them, else two
# threads a worker (does the sweep's "one a worker, not searched" hold there?)
THREADS = "tuned_threads_"
DECODE = "tuned_decode_"  # the tuned preset with JPEGs decoded on the other side


def preset_name(workload: str, args: argparse.Namespace) -> str:
    return args.preset_name or f"bench_{workload}"


def grid_points(workers=GRID, prefetch=PREFETCH) -> dict[str, list[str]]:
    """The plain grid: ``grid_0`` (no workers), ``grid_16x4`` (16 workers, prefetch 4), ..."""
    out = {}
    for n in workers:
        for p in prefetch if n else [None]:
            name = f"grid_{n}" if p is None else f"grid_{n}x{p}"
            out[name] = ["loader=default", f"loader.num_workers={n}"]
            if p is not None:
                out[name].append(f"loader.prefetch_factor={p}")
    return out


def threads_variant(preset: dict) -> tuple[str, list[str]] | None:
    """The tuned preset with other thread counts (a row that is not a contestant)."""
    if preset.get("worker_threads") or preset.get("main_threads"):
        return f"{THREADS}default", ["loader.worker_threads=null", "loader.main_threads=null"]
    if preset.get("num_workers"):
        method = preset.get("multiprocessing_context") or multiprocessing.get_start_method()
        if method == "fork":  # forked workers hang on two threads: forkserver, which only
            # changes the start-up the warm-up leaves out
            return f"{THREADS}2_per_worker_forkserver", [
                "loader.multiprocessing_context=forkserver",
                "loader.worker_threads=2",
            ]
        return f"{THREADS}2_per_worker", ["loader.worker_threads=2"]
    return None


def decode_variant(preset: dict, workload: str) -> tuple[str, list[str]] | None:
    """The tuned preset with the other decode placement (a row that is not a contestant)."""
    if workload != "gpu_decode":
        return None
    other = "cpu" if preset.get("decode") == "device" else "device"
    return f"{DECODE}{other}", [f"loader.decode={other}"]


BASELINES = ("default", "recipe", "cpu_capped")


def contestants(preset: str, cores: int) -> dict[str, list[str]]:
    """Name -> overrides, in the order that names a merged row (``tuned = cpu_capped``)."""
    out = {
        "tuned": [f"loader={preset}"],
        "default": ["loader=default"],
        "recipe": ["loader=recipe"],
        "cpu_capped": [
            "loader=default",
            f"loader.num_workers={cores}",
            "loader.persistent_workers=true",
        ],
    }
    return out


def run_sweep(workload: str, out: Path, args: argparse.Namespace) -> dict:
    """The default loader sweep from scratch; returns its wall time in seconds, ``total``,
    and the seconds of each of its phases, as the sweep recorded them."""
    overrides = [
        *WORKLOADS[workload],
        *args.extra,
        *args.sweep_extra,
        *(["hydra.launcher.warm=false"] if args.fresh else []),
    ]
    ran = common.sweep(
        ROOT, overrides, preset_name(workload, args), out, sweep_dir(out, workload).name
    )
    decided = OmegaConf.load(sweep_dir(out, workload) / "final_decision.yaml")
    phases = OmegaConf.to_container(decided.seconds) if decided.get("seconds") else {}
    seconds = {"total": ran["seconds"], **phases}
    print(f"[{workload}] sweep finished in {_sweep_time(seconds)}", flush=True)
    return seconds


def sweep_dir(out: Path, workload: str) -> Path:
    return out / f"sweep_{workload}"


def is_loader_only(workload: str, extra: list[str]) -> bool:
    return "trainer.measure=loader" in [*WORKLOADS[workload], *extra]


class Budget:
    """``--budget``: no round starts that the seconds left cannot finish, so a machine lent for
    a fixed time still ends with tables (fewer rounds, said so) rather than being cut off."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.start = seconds, time.monotonic()
        self.longest = 0.0  # the longest run so far, the estimate of the next ones

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def fits(self, runs: int) -> bool:
        return self.longest * runs <= self.left()


class Runners:
    """A warm host per row (as the sweep's final rounds have one per contestant), one for the
    grid's single runs; ``--fresh``: every run a fresh process."""

    def __init__(self, out: Path, fresh: bool) -> None:
        self.out, self.fresh, self.hosts = out, fresh, {}

    def __call__(self, name: str) -> Runner:
        if self.fresh:
            return Fresh(ROOT / "train.py")
        if name not in self.hosts:
            log = self.out / "hosts" / f"{name}.log"
            self.hosts[name] = Host(ROOT / "conf", "train", log, ROOT)
        return self.hosts[name]

    def close(self) -> None:
        for host in self.hosts.values():
            host.close()
        self.hosts.clear()


def measure_all(
    workload: str, out: Path, args: argparse.Namespace, cores: int, budget: Budget
) -> dict:
    base = [*WORKLOADS[workload], *MEASURE, *args.extra]
    runs = contestants(preset_name(workload, args), cores)
    runs = {k: v for k, v in runs.items() if k == "tuned" or k in args.baselines}
    grid = grid_points(args.grid, args.prefetch)
    runners = Runners(out / workload, args.fresh)
    rows: list[dict] = []
    loader_only = is_loader_only(workload, args.extra)

    def measure(round_: int, name: str, overrides: list[str], seconds: float = args.seconds):
        t0 = time.monotonic()
        res = run_trial(
            runners("grid" if name.startswith("grid_") else name),
            [*base, f"trainer.max_seconds={seconds}", *overrides],
            out / workload / f"r{round_}_{name}",
            300,
        )
        wall = time.monotonic() - t0
        budget.longest = max(budget.longest, wall)
        rows.append(_record(out, workload, round_, name, res, wall))
        shown = f"{res.value:,.1f}" if res.ok else f"FAILED {res.reason}"
        print(
            f"[{workload}] round {round_ + 1}/{args.repeats} {name:>22}: {shown} ({wall:.0f} s)",
            flush=True,
        )

    # The plain grid, each point once in a long steady-state window; its best point then
    # runs in the rounds beside the others
    for name, overrides in grid.items():
        measure(0, name, overrides, args.grid_seconds)
    measured = [r for r in rows if r["status"] == "ok"]
    if measured:
        best = max(measured, key=lambda r: r["samples_per_sec"])["name"]
        runs[BEST_GRID] = grid[best]
        print(f"[{workload}] best of the grid: {best}", flush=True)
    # Reading memory must not cost the measurement: the tuned preset with it off, beside it;
    # and the threads the sweep tuned (or left alone) against the other choice. The decode
    # placement's other side is measured whatever --no-side-rows says: gpu_decode is about it.
    tuned = runs["tuned"]
    preset = read_preset(ROOT / "conf" / "loader" / f"{preset_name(workload, args)}.yaml")
    side = {}
    if args.side_rows:
        side[MEMORY_OFF] = [*tuned, NO_MEMORY_READS]
        variant = threads_variant(preset)
        if variant:
            side[variant[0]] = [*tuned, *variant[1]]
    decode = decode_variant(preset, workload)
    if decode:
        side[decode[0]] = [*tuned, *decode[1]]
    runs = {"tuned": tuned, **side, **runs}
    # Round 1: everyone; then one row per resolved configuration.
    for name, overrides in runs.items():
        measure(0, name, overrides)
    alias = merge_rows(rows)
    for name, twin in alias.items():
        print(f"[{workload}] {twin} = {name}: same settings, measured as one from now on")
    live = {n: runs[n] for n in runs if n not in alias}
    # The ceilings, each alone with all the cores, in the same rounds as the contestants
    if not loader_only and getattr(args, "ceilings", True):
        live |= first_ceilings(rows, {**grid, **runs}, measure)
    for r in range(1, args.repeats):
        if not budget.fits(len(live)):
            print(
                f"[{workload}] stopped after {r} rounds: {budget.left():.0f} s of the budget"
                f" left, a round takes up to {budget.longest * len(live):.0f} s",
                flush=True,
            )
            break
        for name in common.alternating(live, r):
            measure(r, name, live[name])
    runners.close()

    res = compare(rows)
    if res is None:
        failed = [f"{r['name']}: {r['reason']}" for r in rows if r["status"] != "ok"]
        raise SystemExit(f"[{workload}] too many failed runs to compare: {failed}")
    res["tuned_preset"] = read_preset(
        ROOT / "conf" / "loader" / f"{preset_name(workload, args)}.yaml"
    )
    return res


def first_ceilings(rows: list[dict], runs: dict, measure) -> dict[str, list[str]]:
    """Loader-only at the tuned preset and at the grid's worker counts (each at its best
    prefetch), and compute-only, once; returns the runs that measure the best loader-only and
    compute-only in every later round."""
    per_workers: dict[int, dict] = {}
    for r in rows:
        if r["name"].startswith("grid_") and r["status"] == "ok" and r.get("settings"):
            n = r["settings"]["num_workers"]
            if n and r["samples_per_sec"] > per_workers.get(n, {}).get("samples_per_sec", 0):
                per_workers[n] = r
    loader = {
        f"{CEILING}loader_{name}": [*runs[name], "trainer.measure=loader"]
        for name in ["tuned", *(r["name"] for r in per_workers.values())]
    }
    for name, overrides in loader.items():
        measure(0, name, overrides)
    compute = ["loader=default", "trainer.measure=compute"]
    measure(0, f"{CEILING}compute", compute)
    firsts = [r for r in rows if r["name"] in loader and r["status"] == "ok"]
    best = {}
    if firsts:
        name = max(firsts, key=lambda r: r["samples_per_sec"])["name"]
        best = {name: loader[name]}
    return {**best, f"{CEILING}compute": compute}


def merge_rows(rows: list[dict]) -> dict[str, str]:
    """Name -> the earlier contestant it resolved to the same settings as (the grid, the
    ceilings and the memory check are not contestants)."""
    # the tuned preset names its row whatever ran first (its own first run may have failed)
    ran = sorted(rows, key=lambda r: r["name"] != "tuned")
    return twins(
        [
            (r["name"], r.get("settings"))
            for r in ran
            if r["status"] == "ok" and _is_contestant(r["name"])
        ]
    )


def _is_contestant(name: str) -> bool:
    return not name.startswith((CEILING, "grid_", THREADS, DECODE)) and name != MEMORY_OFF


def applicable_ceiling(rows: list[dict]) -> str:
    """``loader`` when no model ran, ``gpu`` when the model ran on a GPU (its compute does not
    use the host's cores), ``shared`` when it ran on the CPU the loader uses."""
    ok = [r for r in rows if r["status"] == "ok" and _is_contestant(r["name"])]
    if any(r.get("measure") == "loader" for r in ok):
        return ceiling.LOADER
    devices = [str(r.get("device") or "cpu") for r in ok]
    return ceiling.kind_of(next((d for d in devices if d.startswith("cuda")), "cpu"), "train")


def compare(rows: list[dict]) -> dict | None:
    """Medians, spreads, ceilings and ratios with intervals of one workload's runs (runs.jsonl
    records), or None when the tuned preset or the whole grid failed. A figure that failed is
    None, and so is every ratio to it. A full benchmark and ``--summarise`` both use it."""
    alias = merge_rows(rows)
    values: dict[str, list[float]] = {}
    rounds: dict[str, dict[int, list[float]]] = {}  # name -> round -> figures (paired)
    waits: dict[str, list[float]] = {}
    verdicts: list[str] = []  # the tuned runs' own: input-bound or compute-bound
    failures: dict[str, list[str]] = {}
    settings: dict[str, dict] = {}
    for r in rows:
        name = alias.get(r["name"], r["name"])
        if r["status"] != "ok":
            failures.setdefault(name, []).append(r["reason"])
            continue
        values.setdefault(name, []).append(r["samples_per_sec"])
        rounds.setdefault(name, {}).setdefault(r["round"], []).append(r["samples_per_sec"])
        settings.setdefault(name, r.get("settings") or {})
        if r.get("data_wait_frac") is not None:
            waits.setdefault(name, []).append(r["data_wait_frac"])
        if name == "tuned" and r.get("bound"):
            verdicts.append(r["bound"])
    med = {k: statistics.median(v) for k, v in values.items()}
    grid = {k: med[k] for k in med if k.startswith("grid_")}
    if "tuned" not in med or not grid:
        return None
    kind = applicable_ceiling(rows)
    contestants = [k for k in values if _is_contestant(k)]
    best_point = max(grid, key=grid.get)
    paired = {k: {r: statistics.median(v) for r, v in by.items()} for k, by in rounds.items()}
    first = {k: by[min(by)] for k, by in paired.items()}  # each row's first round
    if kind == ceiling.LOADER:  # every contestant is a loader-only figure: the best of them
        best_loader = max(contestants, key=first.get)
    else:
        loaders = [k for k in med if k.startswith(f"{CEILING}loader_")]
        best_loader = max(loaders, key=lambda k: (len(values[k]), first[k])) if loaders else None
    # The best loader-only run is picked on its first round; the ceiling is its later rounds,
    # not the run that won the pick (the winner's curse). With one round there is no other.
    picked = paired.get(best_loader, {})
    loader_rounds = {r: v for r, v in picked.items() if r > min(picked)} or picked
    loader_values = list(loader_rounds.values())
    compute_rounds = paired.get(f"{CEILING}compute", {})
    compute_values = values.get(f"{CEILING}compute", [])
    ceiling_rounds = {  # per round: loader-only and compute-only of the same round combined
        r: ceiling.combine(kind, v, compute_rounds.get(r))
        for r, v in loader_rounds.items()
        if kind == ceiling.LOADER or r in compute_rounds
    }
    ceiling_values = list(ceiling_rounds.values())

    def spread(v: list[float]) -> float:
        return (max(v) - min(v)) / statistics.median(v) if len(v) > 1 else 0.0

    def versus(other: str | None, other_rounds: dict | None = None) -> dict | None:
        """tuned against ``other``, paired by round (feedrate.stats, as the sweep decides)."""
        if other is not None and alias.get(other, other) == "tuned":
            return {"ratio": 1.0, "low": 1.0, "high": 1.0, "verdict": "same settings"}
        name = alias.get(other, other) if other else ""
        theirs = other_rounds if other_rounds is not None else paired.get(name, {})
        c = stats.compare(paired["tuned"], theirs)
        return c.as_dict() | {"shown": c.describe()} if c is not None else None

    ratios = {
        "tuned/default": versus("default"),
        "tuned/recipe": versus("recipe"),
        "tuned/cpu_capped": versus("cpu_capped"),
        "tuned/best_grid": versus(BEST_GRID)
        if BEST_GRID in values or BEST_GRID in alias
        # a benchmark cut short before its rounds: the grid's own long-window figure
        else versus(None, paired[best_point]),
        "tuned/ceiling": versus(None, ceiling_rounds) if ceiling_rounds else None,
    }
    memory = stats.compare(paired.get(MEMORY_OFF, {}), paired["tuned"])
    variant = next((k for k in values if k.startswith(THREADS)), None)
    threads = stats.compare(paired["tuned"], paired[variant]) if variant else None
    placed = next((k for k in values if k.startswith(DECODE)), None)
    decode = stats.compare(paired["tuned"], paired[placed]) if placed else None
    contestants += [n for n, twin in alias.items() if twin in values]  # each name, its twin's runs
    return {
        "values": {k: values[alias.get(k, k)] for k in contestants},
        "aliases": alias,
        "failures": failures,
        "median": {k: med[alias.get(k, k)] for k in contestants},
        "settings": {k: settings.get(alias.get(k, k)) for k in contestants},
        "data_wait": {k: statistics.median(v) for k, v in waits.items()},
        "spread": {k: spread(values[alias.get(k, k)]) for k in contestants},
        "grid": grid,
        "best_grid": best_point,
        "bound": max(set(verdicts), key=verdicts.count) if verdicts else None,  # the majority
        "ceiling_kind": kind,
        "ceiling_why": ceiling.WHY[kind],
        "ceilings": {k: v for k, v in values.items() if k.startswith(CEILING)},
        "best_loader_only": best_loader,
        "loader_only": statistics.median(loader_values) if loader_values else None,
        "compute_only": statistics.median(compute_values) if compute_values else None,
        "ceiling": statistics.median(ceiling_values) if ceiling_values else None,
        "ratios": ratios,
        "memory_off/on": memory.as_dict() | {"shown": memory.describe()} if memory else None,
        "threads": (
            threads.as_dict()
            | {"shown": threads.describe(), "versus": variant.removeprefix(THREADS)}
            if threads
            else None
        ),
        "decode": (
            decode.as_dict() | {"shown": decode.describe(), "versus": placed.removeprefix(DECODE)}
            if decode
            else None
        ),
    }


def _threads_text(variant: str) -> str:
    return {
        "default": "PyTorch's threads",
        "2_per_worker": "2 threads a worker",
        "2_per_worker_forkserver": "2 threads a forkserver worker",
    }.get(variant, variant)


def _label(res: dict, name: str) -> str:
    twins = [n for n, t in res["aliases"].items() if t == name]
    return " = ".join([name, *twins])


def _passes(target, ratio: dict) -> bool:
    """Met when the interval says so: its low end at or above the target (a point ratio
    above it with an interval reaching below is not shown)."""
    if target == NOT_WORSE:
        return ratio["verdict"] != stats.LOSS
    return ratio["low"] >= target


def _outcome(target, ratio: dict) -> str:
    if _passes(target, ratio):
        return "met"
    if target != NOT_WORSE and ratio["high"] >= target:
        return "not shown (the interval reaches below the target)"
    return "missed"


def show(workload: str, res: dict) -> list[tuple[str, float, object, bool]]:
    """Print one workload's medians and ratios against its targets; the checks made."""
    print(f"\n{workload}:")
    grid = "  ".join(f"{k[5:]} {v:,.0f}" for k, v in res["grid"].items())
    print(f"  grid (workers x prefetch, one long window each): {grid}")
    print(f"  best of the grid: {res['best_grid']}, in the rounds as {BEST_GRID}")
    names = ["tuned", "default", "recipe", "cpu_capped", BEST_GRID]
    for name in names:
        if name in res["median"] and name not in res["aliases"]:
            print(
                f"  {_label(res, name):>24}: {res['median'][name]:>9,.1f}"
                f"  spread {res['spread'][name]:.0%}  ({len(res['values'][name])} runs)"
            )

    def fig(v: float | None) -> str:
        return "failed" if v is None else f"{v:,.1f}"

    print(f"  ceiling ({res['ceiling_kind']}): {fig(res['ceiling'])}: {res['ceiling_why']}")
    compute = (
        "n/a (no model)" if res["ceiling_kind"] == ceiling.LOADER else fig(res["compute_only"])
    )
    print(
        f"    loader-only {fig(res['loader_only'])} ({res['best_loader_only']}),"
        f" compute-only {compute}"
    )
    checks = []
    for key, ratio in res["ratios"].items():
        target = TARGETS.get(workload, {}).get(key)
        shown = key
        goal = "" if target is None else f" (target {_target_text(target)})"
        if ratio is None:  # a figure it needs failed: no verdict either way
            print(f"  {shown:>18} = n/a{goal}{' NOT MEASURED' if goal else ''}")
            continue
        text = ratio.get("shown") or ratio["verdict"]
        if target is None:
            print(f"  {shown:>18} = {text}")
            continue
        ok = _passes(target, ratio)
        print(f"  {shown:>18} = {text}{goal} {_outcome(target, ratio)}")
        checks.append((f"{workload} {key}", ratio["ratio"], _target_text(target), ok))
    if (
        res["ceiling"] is not None
        and res["ratios"]["tuned/ceiling"]
        and res["ratios"]["tuned/ceiling"]["verdict"] == stats.WIN
    ):
        print(
            "  tuned beats the ceiling by more than noise: the shared-core model assumes the"
            " step and the workers never overlap, but workers waiting on I/O leave cores idle"
            " that the step uses"
        )
    if res.get("memory_off/on"):
        print(f"  memory reads off / on = {res['memory_off/on']['shown']}")
    if res.get("threads"):
        t = res["threads"]
        print(f"  tuned threads / {_threads_text(t['versus'])} = {t['shown']}")
    if res.get("decode"):
        d = res["decode"]
        print(f"  tuned / decode={d['versus']} = {d['shown']}")
    wait = res["data_wait"].get("tuned")
    if workload in DATA_WAIT_TARGET and wait is not None:
        limit = DATA_WAIT_TARGET[workload]
        if res.get("bound") == "compute-bound":
            ok = wait <= limit
            print(
                f"  tuned data wait = {wait:.1%} (target <= {limit:.0%})"
                f" {'met' if ok else 'missed'}"
            )
            checks.append((f"{workload} tuned data wait", wait, f"<= {limit}", ok))
        else:
            print(f"  tuned data wait = {wait:.1%} (the target is for compute-bound runs)")
    return checks


def _target_text(target) -> str:
    return "not significantly worse" if target == NOT_WORSE else f">= {target}"


def _record(
    out: Path, workload: str, round_: int, name: str, res: TrialResult, wall: float | None = None
) -> dict:
    """Append a run's figure to runs.jsonl as it lands, and return it: a benchmark cut short by
    a time limit still leaves every figure it measured."""
    m = res.metrics if res.ok else {}
    run = m.get("run") or {}
    line = {
        "workload": workload,
        "round": round_,
        "name": name,
        "samples_per_sec": res.value,
        "data_wait_frac": m.get("data_wait_frac"),
        "bound": m.get("bound"),
        "device": run.get("device"),
        "measure": "loader" if m and m.get("final_loss") is None else None,
        "settings": resolved_settings(m, stream=True) if m else None,
        "warmup": m.get("warmup"),
        "wall_s": wall,  # the whole process: start-up, warm-up, window, teardown
        "status": res.status,
        "reason": res.reason,
    }
    with open(out / "runs.jsonl", "a") as fh:
        fh.write(json.dumps(line) + "\n")
    return line


def read_preset(path: Path) -> dict:
    node = OmegaConf.load(path)
    return {k: v for k, v in OmegaConf.to_container(node).items() if k != "defaults"}


NOT_WORSE = "not significantly worse"
TARGETS = {
    "synthetic_loader": {
        "tuned/recipe": 5.0,
        "tuned/cpu_capped": 10.0,
        "tuned/best_grid": 0.9,
        "tuned/ceiling": 0.9,
    },
    "synthetic": {"tuned/best_grid": 0.9, "tuned/ceiling": 0.9},
    "unseen": {"tuned/best_grid": 0.9, "tuned/ceiling": 0.9},
    "remote": {"tuned/best_grid": 0.9},
    "photos": {
        "tuned/recipe": NOT_WORSE,
        "tuned/default": NOT_WORSE,
        "tuned/best_grid": 0.95,
        "tuned/ceiling": 0.9,
    },
    "gpu": {"tuned/recipe": 1.3, "tuned/ceiling": 0.9},
    # when the CPU decode is the limit, the placement the sweep picks must pay off
    "gpu_decode": {"tuned/recipe": 1.5, "tuned/ceiling": 0.9},
}
# With the model setting the pace, the device should hardly ever wait for data.
DATA_WAIT_TARGET = {"gpu": 0.05, "gpu_decode": 0.05}
SWEEP_SECONDS_TARGET = 120.0
FIDELITY = 0.10  # a trial's figure within 10% of the same settings' steady state


def measure_fidelity(workload: str, out: Path, args: argparse.Namespace) -> list[dict]:
    """The sweep's trials against a long steady-state run of the same settings: every finalist
    and the three other completed trials with the most workers (the ones start-up hurts)."""
    sweep = sweep_dir(out, workload)
    final = sweep / "final"
    finalists = sorted(
        {int(p.name.split("_trial_")[1]) for p in final.glob("round0_trial_*")}
        if final.exists()
        else set()
    )
    trials = {}
    for job in sweep.iterdir():
        if job.name.isdigit() and (job / "trial.json").exists():
            t = TrialResult.load(job)
            if t.ok:
                trials[int(job.name)] = t
    others = sorted(
        (n for n in trials if n not in finalists),
        key=lambda n: -trials[n].metrics.get("run", {}).get("loader", {}).get("num_workers", 0),
    )[:3]
    runner = Runners(out / "fidelity" / workload, args.fresh)("steady")
    rows = []
    for n in [*(f for f in finalists if f in trials), *others]:
        t = trials[n]
        # the trial's own command, minus the sweep's early stop, with a long window
        same = [o for o in t.overrides if not o.startswith("trainer.abandon_below=")]
        steady = run_trial(
            runner,
            [*same, f"trainer.max_seconds={args.steady_seconds}"],
            out / "fidelity" / workload / f"trial_{n}",
            300,
        )
        row = {
            "workload": workload,
            "trial": n,
            "finalist": n in finalists,
            "num_workers": t.metrics["run"]["loader"]["num_workers"],
            "prefetch_factor": t.metrics["run"]["loader"].get("prefetch_factor"),
            "trial_value": t.value,
            "trial_seconds": t.metrics.get("measured_seconds"),
            # cut short on purpose (below half the best so far): a rough figure by design
            "abandoned": bool(t.metrics.get("abandoned")),
            "steady_value": steady.value,
            "steady_seconds": steady.metrics.get("measured_seconds") if steady.ok else None,
            "ratio": t.value / steady.value if steady.ok and steady.value else None,
        }
        rows.append(row)
        shown = f"{row['ratio']:.2f}" if row["ratio"] is not None else f"failed: {steady.reason}"
        print(
            f"[{workload}] fidelity trial {n} ({row['num_workers']} workers): trial"
            f" {t.value:,.1f}, steady {steady.value or 0:,.1f}: {shown}",
            flush=True,
        )
    getattr(runner, "close", lambda: None)()
    with open(out / "fidelity.jsonl", "a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def show_fidelity(workload: str, rows: list[dict], seconds: float) -> list[tuple]:
    checks = []
    print(f"  trial vs {seconds:g} s steady state (target: within {FIDELITY:.0%}):")
    for r in rows:
        ok = r["ratio"] is not None and abs(r["ratio"] - 1) <= FIDELITY
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "n/a"
        if r.get("abandoned"):  # not a measurement of the setting: no verdict
            print(
                f"    trial {r['trial']:>3} {r['num_workers']:>3} workers: cut short at"
                f" {r['trial_seconds']:.1f} s (below half the best), {r['trial_value']:,.1f}"
                f" vs {r['steady_value'] or 0:,.1f} = {ratio}, not a full measurement"
            )
            continue
        print(
            f"    trial {r['trial']:>3}{' (finalist)' if r['finalist'] else '':<11}"
            f" {r['num_workers']:>3} workers, prefetch {r['prefetch_factor']}:"
            f" {r['trial_value']:>8,.1f} vs {r['steady_value'] or 0:>8,.1f} = {ratio}"
            f" {'met' if ok else 'missed'}"
        )
        checks.append((f"{workload} trial {r['trial']} fidelity", r["ratio"], "within 10%", ok))
    return checks


def _sweep_time(seconds: dict | None) -> str:
    """``312 s (of which ceilings 25, search 114, final 165, gap 8)``: the rest is Hydra's
    start-up and the reports"""
    if not seconds:
        return "n/a"
    parts = ", ".join(f"{k} {v:.0f}" for k, v in seconds.items() if k != "total")
    return f"{seconds['total']:.0f} s" + (f" (of which {parts})" if parts else "")


def tables(results: dict, sweep_seconds: dict, fidelity: dict) -> str:
    """The README's tables, in Markdown."""

    def num(v):
        return "failed" if v is None else f"{v:,.0f}"

    lines = [
        "| workload | default | recipe | CPU-capped | best grid | tuned | loader-only |"
        " compute-only | ceiling (kind) | sweep |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, res in results.items():
        m = res["median"]
        compute = "n/a" if res["ceiling_kind"] == ceiling.LOADER else num(res["compute_only"])
        lines.append(
            f"| {w} | {num(m.get('default'))} | {num(m.get('recipe'))} |"
            f" {num(m.get('cpu_capped'))} | {num(m.get(BEST_GRID))} ({res['best_grid']}) |"
            f" **{num(m['tuned'])}** ({_label(res, 'tuned')}) | {num(res['loader_only'])} |"
            f" {compute} | {num(res['ceiling'])} ({res['ceiling_kind']}) |"
            f" {_sweep_time(sweep_seconds.get(w))} |"
        )
    lines += [
        "",
        "| workload | ratio | median ratio [95% interval] verdict | target |",
        "|---|---|---|---|",
    ]
    for w, res in results.items():
        for key, ratio in res["ratios"].items():
            target = TARGETS.get(w, {}).get(key)
            goal = ""
            if target is not None and ratio is not None:
                goal = f"{_target_text(target)} {_outcome(target, ratio)}"
            shown = (ratio.get("shown") or ratio["verdict"]) if ratio else "not measured"
            lines.append(f"| {w} | {key} | {shown} | {goal} |")
        if res.get("memory_off/on"):
            lines.append(f"| {w} | memory reads off / on | {res['memory_off/on']['shown']} | tie |")
        if res.get("threads"):
            t = res["threads"]
            lines.append(f"| {w} | tuned threads / {_threads_text(t['versus'])} | {t['shown']} | |")
        if res.get("decode"):
            d = res["decode"]
            lines.append(f"| {w} | tuned / decode={d['versus']} | {d['shown']} | |")
    if any(fidelity.values()):
        lines += [
            "",
            "| workload | trial | workers | prefetch | trial samples/s | steady-state | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for w, rows in fidelity.items():
            for r in rows:
                ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "n/a"
                cut = " (cut short)" if r.get("abandoned") else ""
                lines.append(
                    f"| {w} | {r['trial']}{' (finalist)' if r['finalist'] else ''}{cut} |"
                    f" {r['num_workers']} | {r['prefetch_factor']} | {r['trial_value']:,.0f} |"
                    f" {num(r['steady_value'])} | {ratio} |"
                )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.8), squeeze=False)
    for ax, (workload, res) in zip(axes[0], results.items(), strict=True):
        order = ["default", "recipe", "cpu_capped", BEST_GRID, "tuned"]
        names = [n for n in dict.fromkeys(order) if n in res["median"]]
        names = [n for n in names if n not in res["aliases"]]
        meds = [res["median"][n] for n in names]
        errs = [
            [m - min(res["values"][n]) for n, m in zip(names, meds, strict=True)],
            [max(res["values"][n]) - m for n, m in zip(names, meds, strict=True)],
        ]
        colors = ["tab:green" if n == "tuned" else "tab:gray" for n in names]
        ax.bar([_label(res, n) for n in names], meds, yerr=errs, color=colors, capsize=4)
        if res["ceiling"] is not None:
            ax.axhline(
                res["ceiling"],
                color="tab:red",
                linestyle="--",
                label=f"ceiling ({res['ceiling_kind']})",
            )
            ax.legend()
        for i, m in enumerate(meds):
            ax.text(i, m, f"{m:,.0f}", ha="center", va="bottom", fontsize=9)
        ax.set_title(f"{workload}: median samples/s (min-max), {len(res['values']['tuned'])} runs")
        ax.set_ylabel("samples/s")
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarise_runs(out: Path) -> dict:
    """The comparison of a full run, from ``out/runs.jsonl`` (what a benchmark cut short still
    has): prints it, writes ``out/summary.json`` and ``out/tables.md``, draws ``out/bench.png``."""
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines() if line]
    results = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        res = compare([r for r in rows if r["workload"] == workload])
        if res is None:
            print(f"{workload}: not enough runs to compare")
            continue
        results[workload] = res
        show(workload, res)
    fidelity: dict[str, list] = {}
    if (out / "fidelity.jsonl").exists():
        for line in (out / "fidelity.jsonl").read_text().splitlines():
            if line:
                r = json.loads(line)
                fidelity.setdefault(r["workload"], []).append(r)
    common.write_json(out / "summary.json", results)
    (out / "tables.md").write_text(tables(results, {}, fidelity))
    wrote = [out / "summary.json", out / "tables.md"]
    if results:
        plot(results, out / "bench.png")
        wrote.append(out / "bench.png")
    print(f"\nwrote {', '.join(map(str, wrote))}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["synthetic_loader", "photos", "unseen", "synthetic"],  # gpu_check.sh: "gpu"
        choices=WORKLOADS,
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured window per run")
    parser.add_argument(
        "--steady-seconds",
        type=float,
        default=20.0,
        help="window of the steady-state runs that check the sweep's trials (0: skip)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-sweep", action="store_true", help="reuse conf/loader/bench_*")
    parser.add_argument(
        "--grid", nargs="+", type=int, default=list(GRID), help="num_workers of the grid"
    )
    parser.add_argument(
        "--prefetch", nargs="+", type=int, default=list(PREFETCH), help="prefetch of the grid"
    )
    parser.add_argument(
        "--grid-seconds", type=float, default=10.0, help="window of each grid point (once)"
    )
    parser.add_argument(
        "--extra", nargs="*", default=[], help="overrides for every run, the sweep's included"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no round that would end past this many seconds (a machine lent for a"
        " fixed time): fewer rounds, said so, rather than no tables",
    )
    parser.add_argument(
        "--no-side-rows",
        dest="side_rows",
        action="store_false",
        help="leave out the rows that are not contestants (memory reads off, other threads)",
    )
    parser.add_argument(
        "--no-ceilings",
        dest="ceilings",
        action="store_false",
        help="leave out the loader-only and compute-only runs (make bench: its headline has none)",
    )
    parser.add_argument(
        "--baselines",
        nargs="+",
        default=list(BASELINES),
        choices=list(BASELINES),
        help="what the tuned preset runs against in the rounds, beside the grid's best"
        " (make bench: default recipe, the ones its headline shows)",
    )
    parser.add_argument("--sweep-extra", nargs="*", default=[], help="overrides for the sweep only")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="every run a fresh process (and the sweep's trials: hydra.launcher.warm=false)",
    )
    parser.add_argument(
        "--preset-name", default=None, help="the preset the sweep writes (default bench_<workload>)"
    )
    parser.add_argument(
        "--summarise",
        type=Path,
        default=None,
        metavar="OUT",
        help="only summarise OUT/runs.jsonl of an earlier (or cut short) run",
    )
    args = parser.parse_args()
    if args.summarise:
        return 0 if summarise_runs(args.summarise.resolve()) else 1

    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or ROOT / "benchmarks" / "results" / f"{stamp}_{platform.node()}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    cores = max(1, int(usable_cores()))
    fp = detect()
    print(f"machine: {fp.short()}\noutput: {out}", flush=True)

    results, sweep_seconds, fidelity = {}, {}, {}
    budget = Budget(args.budget)
    for workload in args.workloads:
        if not args.skip_sweep:
            sweep_seconds[workload] = run_sweep(workload, out, args)
            if args.steady_seconds > 0:
                fidelity[workload] = measure_fidelity(workload, out, args)
        results[workload] = measure_all(workload, out, args, cores, budget)

    print(
        "\n== results (median samples/s over the rounds; ratios: geometric mean of the paired"
        " rounds' ratios [95% interval], a win or loss only when the interval excludes 1.0) =="
    )
    checks = []
    for workload, res in results.items():
        checks += show(workload, res)
        if workload in fidelity:
            checks += show_fidelity(workload, fidelity[workload], args.steady_seconds)
        if workload in sweep_seconds:
            s = sweep_seconds[workload]["total"]
            ok = s <= SWEEP_SECONDS_TARGET
            print(
                f"  sweep wall time = {_sweep_time(sweep_seconds[workload])}"
                f" (target <= {SWEEP_SECONDS_TARGET:.0f} s) {'met' if ok else 'missed'}"
            )
            checks.append((f"{workload} sweep seconds", s, f"<= {SWEEP_SECONDS_TARGET}", ok))

    report = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": fp.as_dict(),
        "cwd_git": git_commit(),
        "repeats": args.repeats,
        "grid": {"num_workers": args.grid, "prefetch_factor": args.prefetch},
        "grid_seconds": args.grid_seconds,
        "extra": args.extra,
        "baselines": args.baselines,
        "seconds_per_run": args.seconds,
        "steady_seconds": args.steady_seconds,
        "budget_seconds": args.budget,
        "sweep_seconds": sweep_seconds,
        "results": results,
        "fidelity": fidelity,
        "targets": TARGETS,
        "checks": [{"check": c, "value": v, "target": t, "pass": ok} for c, v, t, ok in checks],
    }
    common.write_json(out / "bench.json", report)
    (out / "tables.md").write_text(tables(results, sweep_seconds, fidelity))
    plot(results, out / "bench.png")
    print(f"\nwrote {out / 'bench.json'}, {out / 'tables.md'} and {out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
