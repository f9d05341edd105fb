"""Eight ranks share one node's cores: the per-rank preset of a multi-rank sweep, measured
with every rank running, against a per-rank grid and what such jobs run today.

    python benchmarks/ranks_bench.py                              # synthetic, photos; 2 ranks
    python benchmarks/ranks_bench.py --workloads synthetic --ranks 2 --rounds 3

For each workload, in one run on one machine:
1. the default loader sweep for one process (``bench_<workload>``), whose preset a run under
   torchrun divides between its ranks today;
2. the same sweep with ``sweep.ranks_per_node=<ranks>`` (``bench_<workload>_<ranks>ranks``):
   every trial torchrun with that many ranks, the search per rank;
3. a per-rank grid (``num_workers`` x ``prefetch_factor``), each point once, every run
   ``torchrun --nproc_per_node=<ranks>`` with all ranks running;
4. in ``--rounds`` alternating rounds: the tuned per-rank preset, the grid's best point,
   Lightning's per-rank formula (max(1, cores // ranks - 1)), the one-process preset divided
   between the ranks, and ``recipe`` per rank.
Reported: the job's samples/s (the ranks' sum over one window), each rank's data-wait share,
and every ratio to the tuned preset with its 95% interval over the paired rounds (a win or a
loss only when the interval excludes 1.0). Target: tuned / best of the grid >= 0.9.

Writes results.json, table.md and ranks.png under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from feedrate import stats
from feedrate.environment import git_commit
from feedrate.hardware import detect, usable_cores
from feedrate.sweep.trial import Fresh, run_trial

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from loader_bench import MEASURE, WORKLOADS, grid_points, run_sweep  # noqa: E402

DEFAULT_WORKLOADS = ["synthetic", "photos"]
GRID_WORKERS = (0, 1, 2, 4, 8, 16, 32)  # each rank's
GRID_PREFETCH = (2, 8)
TARGET = 0.9  # tuned / best of the grid
# what a rank ran: two contestants that ran the same are one setting, and their ratio noise
SETTINGS = (
    "num_workers",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory",
    "multiprocessing_context",
    "main_threads",
    "worker_threads",
)
TUNED, BEST_GRID, LIGHTNING, DIVIDED, RECIPE = (
    "tuned",
    "best_grid",
    "lightning",
    "divided",
    "recipe",
)


def one_process(workload: str) -> str:
    return f"bench_{workload}"


def per_rank(workload: str, ranks: int) -> str:
    return f"bench_{workload}_{ranks}ranks"


def contestants(workload: str, ranks: int, cores: int) -> dict[str, list[str]]:
    """Each rank's settings (the runner says ``loader.per_rank=true``) but the divided one,
    and the tuned preset as it says: the sweep's winner may be the divided baseline, whose
    preset gives the node's workers (no ``per_rank``)."""
    tuned = OmegaConf.load(ROOT / "conf" / "loader" / f"{per_rank(workload, ranks)}.yaml")
    return {
        TUNED: [
            f"loader={per_rank(workload, ranks)}",
            *([] if tuned.get("per_rank") else ["loader.per_rank=false"]),
        ],
        LIGHTNING: ["loader=default", f"loader.num_workers={max(1, cores // ranks - 1)}"],
        DIVIDED: [f"loader={one_process(workload)}", "loader.per_rank=false"],
        RECIPE: ["loader=recipe"],
    }


def sweep(workload: str, name: str, out: Path, extra: list[str]) -> float:
    """loader_bench's default sweep from scratch, writing ``name``; its log and study under
    ``out``; its seconds."""
    out.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(preset_name=name, extra=[], sweep_extra=extra, fresh=False)
    return run_sweep(workload, out, args)["total"]


def measure(
    runner: Fresh, workload: str, name: str, overrides: list[str], r: int, out: Path, seconds
) -> dict:
    t0 = time.monotonic()
    res = run_trial(
        runner,
        [*WORKLOADS[workload], *MEASURE, f"trainer.max_seconds={seconds}", *overrides],
        out / workload / f"r{r}_{name}",
        300,
    )
    wall = time.monotonic() - t0
    m = res.metrics or {}
    row = {
        "name": name,
        "round": r,
        "ok": res.ok,
        "reason": res.reason,
        "samples_per_sec": res.value,
        "ranks": [
            {k: x.get(k) for k in ("samples_per_sec", "data_wait_frac", "measured_steps")}
            for x in m.get("ranks") or []
        ],
        **{k: ((m.get("run") or {}).get("loader") or {}).get(k) for k in SETTINGS},
        "wall_s": wall,
    }
    shown = f"{res.value:,.1f}" if res.ok else f"FAILED {res.reason}"
    when = f"round {r}" if r else "grid"  # round 0 is the grid's single pass
    print(f"[{workload}] {when:>7} {name:>14}: {shown} ({wall:.0f} s)", flush=True)
    return row


def verdicts(rows: list[dict]) -> dict:
    by: dict[str, dict[int, float]] = {}
    for x in rows:
        if x["ok"] and x["round"] >= 1:  # the rounds; round 0 is the grid's single pass
            by.setdefault(x["name"], {})[x["round"]] = x["samples_per_sec"]
    medians = {n: statistics.median(v.values()) for n, v in by.items()}
    versus = {}
    for name in (BEST_GRID, LIGHTNING, DIVIDED, RECIPE):
        if TUNED in by and name in by:
            c = stats.compare(by[TUNED], by[name])
            if c is None:
                versus[name] = None
            elif same_settings(rows, TUNED, name):  # a ratio between runs of one setting
                versus[name] = {
                    **c.as_dict(),
                    "verdict": stats.TIE,
                    "same_settings": True,
                    "text": f"same settings: {c.describe().split(' ')[0]}"
                    f" {' '.join(c.describe().split(' ')[1:3])} is noise, a tie",
                }
            else:
                versus[name] = {**c.as_dict(), "text": c.describe()}
    waits = {
        n: [r["data_wait_frac"] for x in rows if x["name"] == n and x["ok"] for r in x["ranks"]]
        for n in by
    }
    return {
        "medians": medians,
        "versus": versus,
        "data_wait": {n: statistics.median(w) for n, w in waits.items() if w},
        "target": outcome(versus.get(BEST_GRID)),
    }


def same_settings(rows: list[dict], a: str, b: str) -> bool:
    """Did ``a`` and ``b`` run the same settings on every rank, in every run (each row's
    ``SETTINGS`` that an older results.json holds)?"""

    def ran(name: str) -> set[tuple]:
        return {
            tuple(x.get(k) for k in SETTINGS if k in x)
            for x in rows
            if x["name"] == name and x["ok"]
        }

    return len(ran(a)) == 1 and ran(a) == ran(b)


def outcome(ratio: dict | None) -> str:
    """The target on the interval, as loader_bench checks its own: met when its low end is at
    or above it, missed when its high end is below, else not shown either way."""
    said = {stats.MET: "met", stats.MISSED: "missed", stats.NO_FIGURE: "no figure"}
    return said.get(stats.against(ratio, TARGET), f"not shown (the interval spans {TARGET})")


def table(results: dict, ranks: int) -> str:
    lines = [
        f"{ranks} ranks on this node, every run torchrun with all of them; samples/s of the job"
        " (the ranks' sum over one window), median of the rounds; ratios tuned / other are"
        " geometric means of the paired rounds with 95% intervals.",
        "",
        "| workload | tuned (per rank) | best of the grid | tuned / grid (>= 0.9) |"
        " tuned / lightning | tuned / divided one-process preset | tuned / recipe per rank |"
        " data wait (tuned, ranks' median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload, res in results.items():
        v = res["verdicts"]
        m, vs = v["medians"], v["versus"]

        def text(key: str, vs: dict = vs) -> str:
            return vs[key]["text"] if vs.get(key) else "-"

        wait = v["data_wait"].get(TUNED)
        lines.append(
            f"| {workload} | {m.get(TUNED, 0):,.0f} ({res['tuned_settings']}) |"
            f" {m.get(BEST_GRID, 0):,.0f} ({res['best_grid']}) |"
            f" {text(BEST_GRID)}: {v['target']} | {text(LIGHTNING)} |"
            f" {text(DIVIDED)} | {text(RECIPE)} | {'-' if wait is None else f'{wait:.2f}'} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    fig, axes = common.figure(ncols=len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (workload, res) in zip(axes[0], results.items(), strict=True):
        m = res["verdicts"]["medians"]
        names = [n for n in (TUNED, BEST_GRID, LIGHTNING, DIVIDED, RECIPE) if n in m]
        ax.bar(names, [m[n] for n in names], color=["C2", "C0", "C1", "C3", "C7"][: len(names)])
        ax.set_title(f"{workload}: {res['ranks']} ranks, job samples/s")
        ax.set_ylabel("samples/s (sum over ranks)")
        ax.tick_params(axis="x", rotation=20)
    common.save(fig, path)


def settings_of(path: Path) -> str:
    preset = OmegaConf.load(path)
    rank = "per rank" if preset.get("per_rank") else "the machine's"
    return f"{preset.get('num_workers')} workers x prefetch {preset.get('prefetch_factor')}, {rank}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="each run's window")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-sweeps", action="store_true", help="reuse conf/loader/bench_*")
    parser.add_argument(
        "--summarise", type=Path, default=None, metavar="OUT", help="only redo OUT's tables"
    )
    args = parser.parse_args()
    if args.summarise is not None:
        results = json.loads((args.summarise / "results.json").read_text())
        for res in results.values():
            res["verdicts"] = verdicts(res["rows"])
        common.write_json(args.summarise / "results.json", results)
        text = table(results, next(iter(results.values()))["ranks"])
        (args.summarise / "table.md").write_text(text)
        plot(results, args.summarise / "ranks.png")
        print(text, end="")
        return 0
    fp = detect()
    cores = max(1, int(usable_cores()))
    out = args.out or ROOT / "benchmarks" / "results" / (
        f"{datetime.now():%Y-%m-%d}_cpu-{cores}core-{args.ranks}ranks"
    )
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {fp.short()}\noutput: {out}", flush=True)
    runner = Fresh(ROOT / "train.py", args.ranks)
    results = {}
    for workload in args.workloads:
        sweeps = {}
        if not args.skip_sweeps:
            alone = one_process(workload)
            sweeps["one_process"] = sweep(workload, alone, out / "one_process", [])
            ranked = [f"sweep.ranks_per_node={args.ranks}", f"sweep.divided={alone}"]
            name = per_rank(workload, args.ranks)
            sweeps["per_rank"] = sweep(workload, name, out / "per_rank", ranked)
        rows = []
        points = grid_points(GRID_WORKERS, GRID_PREFETCH)
        for name, overrides in points.items():
            rows.append(measure(runner, workload, name, overrides, 0, out, args.seconds))
        ok = [x for x in rows if x["ok"]]
        best = max(ok, key=lambda x: x["samples_per_sec"])["name"]
        print(f"[{workload}] best of the grid: {best}", flush=True)
        runs = {**contestants(workload, args.ranks, cores), BEST_GRID: points[best]}
        for r in range(1, args.rounds + 1):
            order = common.alternating(runs, r - 1)  # rounds count from 1
            rows += [measure(runner, workload, n, runs[n], r, out, args.seconds) for n in order]
        results[workload] = {
            "ranks": args.ranks,
            "sweep_s": sweeps,
            "best_grid": best,
            "tuned_settings": settings_of(
                ROOT / "conf" / "loader" / f"{per_rank(workload, args.ranks)}.yaml"
            ),
            "rows": rows,
            "verdicts": verdicts(rows),
        }
        common.write_json(out / "results.json", results)
    text = table(results, args.ranks)
    (out / "table.md").write_text(text)
    (out / "command.txt").write_text(f"python {' '.join(sys.argv)}\ncommit {git_commit() or '?'}\n")
    plot(results, out / "ranks.png")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
