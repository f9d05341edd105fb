"""Side-by-side loader benchmark: feedrate's tuned preset against the usual recipes.

    python benchmarks/loader_bench.py                 # both workloads (make bench)
    python benchmarks/loader_bench.py --workloads synthetic --repeats 3

For each workload, in one run on one machine:
1. runs the default loader sweep from scratch (`python train.py -m sweep=loader`, a fresh study)
   and times it;
2. measures, alternately and `--repeats` times each: PyTorch's `default`, the `recipe` preset,
   the configuration a CPU-capped tuner picks (`num_workers` = cores, persistent workers), the
   tuned preset, an exhaustive grid over `num_workers`, and the ceiling: the lower of the
   loader-only throughput (`trainer.measure=loader`: the tuned preset, and every grid point
   once; the best of them) and the compute-only throughput on a device-resident batch
   (`trainer.measure=compute`);
3. prints medians, spreads and ratios, checks the targets, and writes `<out>/bench.json` and
   `<out>/bench.png`.

Every measurement is a fresh `python train.py` process (the sweep's own trial runner), so the
numbers are what a user gets from the command line. The model is `pooled_linear` (almost no
compute), so samples/s is what the input pipeline feeds into a real training step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from feedrate.environment import git_commit
from feedrate.hardware import detect, usable_cores
from feedrate.trial import run_trial

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = {
    # The classic dummy dataset: 3x224x224 float32 images, 10 ms of I/O latency per sample.
    "synthetic": [
        "dataset=synthetic",
        "dataset.io_latency_ms=10",
        "dataset.dtype=float32",
        "model=pooled_linear",
    ],
    # Real JPEGs read, decoded and augmented from disk.
    "photos": ["dataset=photos", "model=pooled_linear"],
    # Photos at 224 px for a model that trains (benchmarks/gpu_check.sh adds model=resnet50
    # hardware=h200 through --extra: ResNet-50 in bf16).
    "gpu": ["dataset=photos", "dataset.image_size=224"],
}
GRID = (0, 1, 2, 4, 8, 16, 24, 32, 48)
# The sweep's own measurement: streaming (no epoch ends), so every configuration is judged on
# sustained throughput, min(consumed, produced), the start-up backlog excluded.
MEASURE = [
    "trainer.stream=true",
    "trainer.max_steps=100000",
    "trainer.warmup_steps=3",
    "trainer.window_steps=5",
    "trainer.save_checkpoint=false",
    "trainer.progress=false",
]


def preset_name(workload: str, args: argparse.Namespace) -> str:
    return args.preset_name or f"bench_{workload}"


def contestants(workload: str, preset: str, cores: int, grid=GRID) -> dict[str, list[str]]:
    out = {
        "default": ["loader=default"],
        "recipe": ["loader=recipe"],
        "cpu_capped": [
            "loader=default",
            f"loader.num_workers={cores}",
            "loader.persistent_workers=true",
        ],
        "tuned": [f"loader={preset}"],
    }
    for n in grid:
        out[f"grid_{n}"] = ["loader=default", f"loader.num_workers={n}"]
    return out


def run_sweep(workload: str, out: Path, args: argparse.Namespace) -> float:
    """The default loader sweep from scratch; returns its wall time in seconds."""
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "sweep=loader",
        *WORKLOADS[workload],
        *args.extra,
        *args.sweep_extra,
        f"sweep.preset_name={preset_name(workload, args)}",
        f"sweep.study_dir={out / 'studies'}",
        f"hydra.sweep.dir={out / f'sweep_{workload}'}",
    ]
    print(f"[{workload}] sweep: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    preset = ROOT / "conf" / "loader" / f"{preset_name(workload, args)}.yaml"
    before = preset.stat().st_mtime if preset.exists() else None
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
    seconds = time.perf_counter() - t0
    (out / f"sweep_{workload}.log").write_text(proc.stdout + proc.stderr)
    written = preset.exists() and preset.stat().st_mtime != before
    if proc.returncode != 0 or not written:
        raise SystemExit(f"[{workload}] the sweep failed; see {out / f'sweep_{workload}.log'}")
    print(f"[{workload}] sweep finished in {seconds:.0f} s", flush=True)
    return seconds


def measure_all(workload: str, out: Path, args: argparse.Namespace, cores: int) -> dict:
    base = [*WORKLOADS[workload], *MEASURE, f"trainer.max_seconds={args.seconds}", *args.extra]
    runs = dict(contestants(workload, preset_name(workload, args), cores, args.grid))
    script = ROOT / "train.py"
    rows: list[dict] = []

    def measure(round_: int, name: str, overrides: list[str], label: str) -> None:
        res = run_trial(script, [*base, *overrides], out / workload / f"r{round_}_{name}", 300)
        rows.append(_record(out, workload, round_, name, res))
        shown = f"{res.value:,.1f}" if res.ok else f"FAILED {res.reason}"
        print(f"[{workload}] {label}: {shown}", flush=True)

    for r in range(args.repeats):
        names = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in names:
            measure(r, name, runs[name], f"round {r + 1}/{args.repeats} {name:>12}")
    # Ceilings: what the loader alone delivers to the device (at its best: the tuned preset,
    # and once each at every grid point, since the best worker count without a model to feed
    # can be far past the best with one), and what the model alone consumes.
    for r in range(args.repeats):
        measure(
            r,
            "ceiling_loader_tuned",
            [*runs["tuned"], "trainer.measure=loader"],
            f"ceiling {'loader_tuned':>16}",
        )
        measure(
            r,
            "ceiling_compute",
            ["loader=default", "trainer.measure=compute"],
            f"ceiling {'compute':>16}",
        )
    for n in args.grid:
        name = f"loader_grid_{n}"
        measure(
            0,
            f"ceiling_{name}",
            [*runs[f"grid_{n}"], "trainer.measure=loader"],
            f"ceiling {name:>16}",
        )

    res = compare(rows)
    if res is None:
        failed = [f"{r['name']}: {r['reason']}" for r in rows if r["status"] != "ok"]
        raise SystemExit(f"[{workload}] too many failed runs to compare: {failed}")
    res["tuned_preset"] = read_preset(
        ROOT / "conf" / "loader" / f"{preset_name(workload, args)}.yaml"
    )
    return res


def compare(rows: list[dict]) -> dict | None:
    """Medians, spreads, ceilings and ratios of one workload's runs (runs.jsonl records), or
    None when the tuned preset or the whole grid failed. A figure that failed is None, and so
    is every ratio to it. A full benchmark and ``--summarise`` both use it."""
    values: dict[str, list[float]] = {}
    waits: dict[str, list[float]] = {}
    verdicts: list[str] = []  # the tuned runs' own: input-bound or compute-bound
    failures: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] != "ok":
            failures.setdefault(r["name"], []).append(r["reason"])
            continue
        values.setdefault(r["name"], []).append(r["samples_per_sec"])
        if r.get("data_wait_frac") is not None:
            waits.setdefault(r["name"], []).append(r["data_wait_frac"])
        if r["name"] == "tuned" and r.get("bound"):
            verdicts.append(r["bound"])
    med = {k: statistics.median(v) for k, v in values.items()}
    grid = [k for k in med if k.startswith("grid_")]
    if "tuned" not in med or not grid:
        return None
    best_grid = max(grid, key=med.get)
    loader_only = max((v for k, v in med.items() if k.startswith("ceiling_loader")), default=None)
    compute_only = med.get("ceiling_compute")
    # the lower of the two; unknown while either is
    ceiling = None if None in (loader_only, compute_only) else min(loader_only, compute_only)

    def spread(v: list[float]) -> float:
        return (max(v) - min(v)) / statistics.median(v) if len(v) > 1 else 0.0

    tuned = med["tuned"]

    def ratio(to: float | None) -> float | None:
        return tuned / to if to else None

    contestants = [k for k in values if not k.startswith("ceiling_")]
    return {
        "values": {k: values[k] for k in contestants},
        "failures": failures,
        "median": {k: med[k] for k in contestants},
        "data_wait": {k: statistics.median(v) for k, v in waits.items()},
        "spread": {k: spread(values[k]) for k in contestants},
        "best_grid": best_grid,
        "bound": max(set(verdicts), key=verdicts.count) if verdicts else None,  # the majority
        "ceilings": {k: v for k, v in values.items() if k.startswith("ceiling_")},
        "loader_only": loader_only,
        "compute_only": compute_only,
        "ceiling": ceiling,
        "ratios": {
            "tuned/default": ratio(med.get("default")),
            "tuned/recipe": ratio(med.get("recipe")),
            "tuned/cpu_capped": ratio(med.get("cpu_capped")),
            "tuned/best_grid": ratio(med[best_grid]),
            "tuned/ceiling": ratio(ceiling),
        },
    }


def show(workload: str, res: dict) -> list[tuple[str, float, float]]:
    """Print one workload's medians and ratios against its targets; the checks made."""
    print(f"\n{workload}:")
    names = ["default", "recipe", "cpu_capped", "tuned"]
    names += sorted((k for k in res["median"] if k.startswith("grid_")), key=lambda g: int(g[5:]))
    for name in names:
        if name in res["median"]:
            print(
                f"  {name:>12}: {res['median'][name]:>9,.1f}  spread {res['spread'][name]:.0%}"
                f"  ({len(res['values'][name])} runs)"
            )

    def fig(v: float | None) -> str:
        return "failed" if v is None else f"{v:,.1f}"

    print(
        f"  {'ceiling':>12}: {fig(res['ceiling']):>9}  (the lower of loader-only"
        f" {fig(res['loader_only'])} at its best and compute-only {fig(res['compute_only'])})"
    )
    checks = []
    for ratio, value in res["ratios"].items():
        target = TARGETS.get(workload, {}).get(ratio)
        shown = ratio.replace("best_grid", res["best_grid"])
        if value is None:  # a figure it needs failed: no verdict either way
            goal = "" if target is None else f" (target >= {target}) NOT MEASURED"
            print(f"  {shown:>18} = n/a{goal}")
            continue
        if target is None:
            print(f"  {shown:>18} = {value:.2f}")
            continue
        verdict = "PASS" if value >= target else "MISS"
        print(f"  {shown:>18} = {value:.2f} (target >= {target}) {verdict}")
        checks.append((f"{workload} {ratio}", value, target))
    wait = res["data_wait"].get("tuned")
    if workload in DATA_WAIT_TARGET and wait is not None:
        limit = DATA_WAIT_TARGET[workload]
        if res.get("bound") == "compute-bound":
            ok = wait <= limit
            print(
                f"  tuned data wait = {wait:.1%} (target <= {limit:.0%}) {'PASS' if ok else 'MISS'}"
            )
            checks.append((f"{workload} tuned data headroom", 1 - wait, 1 - limit))
        else:
            print(f"  tuned data wait = {wait:.1%} (the target is for compute-bound runs)")
    return checks


def _record(out: Path, workload: str, round_: int, name: str, res) -> dict:
    """Append a run's figure to runs.jsonl as it lands, and return it: a benchmark cut short by
    a time limit still leaves every figure it measured."""
    line = {
        "workload": workload,
        "round": round_,
        "name": name,
        "samples_per_sec": res.value,
        "data_wait_frac": res.metrics.get("data_wait_frac") if res.ok else None,
        "bound": res.metrics.get("bound") if res.ok else None,
        "status": res.status,
        "reason": res.reason,
    }
    with open(out / "runs.jsonl", "a") as fh:
        fh.write(json.dumps(line) + "\n")
    return line


def read_preset(path: Path) -> dict:
    node = OmegaConf.load(path)
    return {k: v for k, v in OmegaConf.to_container(node).items() if k != "defaults"}


TARGETS = {
    "synthetic": {
        "tuned/recipe": 5.0,
        "tuned/cpu_capped": 10.0,
        "tuned/best_grid": 0.9,
        "tuned/ceiling": 0.9,
    },
    "photos": {
        "tuned/recipe": 1.0,
        "tuned/default": 1.5,
        "tuned/best_grid": 0.95,
        "tuned/ceiling": 0.9,
    },
    "gpu": {
        "tuned/recipe": 1.3,
        "tuned/ceiling": 0.9,
    },
}
# With the model setting the pace, the device should hardly ever wait for data.
DATA_WAIT_TARGET = {"gpu": 0.05}
SWEEP_SECONDS_TARGET = 180.0


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.8), squeeze=False)
    for ax, (workload, res) in zip(axes[0], results.items(), strict=True):
        order = ["default", "recipe", "cpu_capped", res["best_grid"], "tuned"]
        names = [n for n in order if n in res["median"]]
        meds = [res["median"][n] for n in names]
        errs = [
            [m - min(res["values"][n]) for n, m in zip(names, meds, strict=True)],
            [max(res["values"][n]) - m for n, m in zip(names, meds, strict=True)],
        ]
        colors = ["tab:gray"] * (len(names) - 1) + ["tab:green"]
        ax.bar(names, meds, yerr=errs, color=colors, capsize=4)
        if res["ceiling"] is not None:
            ax.axhline(res["ceiling"], color="tab:red", linestyle="--", label="ceiling")
            ax.legend()
        for i, m in enumerate(meds):
            ax.text(i, m, f"{m:,.0f}", ha="center", va="bottom", fontsize=9)
        ax.set_title(f"{workload}: median samples/s (min-max), {len(res['values']['tuned'])} runs")
        ax.set_ylabel("samples/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarise_runs(out: Path) -> dict:
    """The comparison of a full run, from ``out/runs.jsonl`` (what a benchmark cut short still
    has): prints it, writes ``out/summary.json`` and draws ``out/bench.png``."""
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines() if line]
    results = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        res = compare([r for r in rows if r["workload"] == workload])
        if res is None:
            print(f"{workload}: not enough runs to compare")
            continue
        results[workload] = res
        show(workload, res)
    (out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    wrote = [out / "summary.json"]
    if results:
        plot(results, out / "bench.png")
        wrote.append(out / "bench.png")
    print(f"\nwrote {' and '.join(map(str, wrote))}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["synthetic", "photos"],  # the CPU ones; gpu_check.sh runs "gpu"
        choices=WORKLOADS,
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window per run")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-sweep", action="store_true", help="reuse conf/loader/bench_*")
    parser.add_argument(
        "--grid", nargs="+", type=int, default=list(GRID), help="num_workers of the grid"
    )
    parser.add_argument(
        "--extra", nargs="*", default=[], help="overrides for every run, the sweep's included"
    )
    parser.add_argument("--sweep-extra", nargs="*", default=[], help="overrides for the sweep only")
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

    results, sweep_seconds = {}, {}
    for workload in args.workloads:
        if not args.skip_sweep:
            sweep_seconds[workload] = run_sweep(workload, out, args)
        results[workload] = measure_all(workload, out, args, cores)

    print("\n== results (median samples/s, spread = (max-min)/median) ==")
    checks = []
    for workload, res in results.items():
        checks += show(workload, res)
        if workload in sweep_seconds:
            s = sweep_seconds[workload]
            print(
                f"  sweep wall time = {s:.0f} s (target < {SWEEP_SECONDS_TARGET:.0f} s)"
                f" {'PASS' if s < SWEEP_SECONDS_TARGET else 'MISS'}"
            )

    report = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": fp.as_dict(),
        "cwd_git": git_commit(),
        "repeats": args.repeats,
        "grid": args.grid,
        "extra": args.extra,
        "seconds_per_run": args.seconds,
        "sweep_seconds": sweep_seconds,
        "results": results,
        "targets": TARGETS,
        "checks": [{"check": c, "value": v, "target": t, "pass": v >= t} for c, v, t in checks],
    }
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    plot(results, out / "bench.png")
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
