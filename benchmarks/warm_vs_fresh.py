"""Does a warm trial host measure what a fresh process measures? Side by side, in rounds.

    python benchmarks/warm_vs_fresh.py                       # synthetic_loader, 0/4/32 workers
    python benchmarks/warm_vs_fresh.py --workload photos --workers 0 2 8 --rounds 5

For each worker count: a warm host of its own (`feedrate.sweep.host`, each round a new
DataLoader, as in the sweep's final rounds) and a fresh `python train.py` process per round,
alternating (which goes first flips every round). Prints warm / fresh for each worker count as
the geometric mean of the paired rounds' ratios with its 95% interval (`feedrate.stats`: a tie
when it includes 1.0), and what each side's run cost in wall time; writes `results.json`,
`table.md` and `warm_vs_fresh.png` under `--out`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from tqdm import tqdm

from feedrate import stats
from feedrate.hardware import detect
from feedrate.sweep.host import Host
from feedrate.sweep.trial import Fresh, run_trial

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from loader_bench import MEASURE, WORKLOADS  # noqa: E402 - the bench's workloads, as they are


def measure(args: argparse.Namespace, out: Path) -> list[dict]:
    base = [*WORKLOADS[args.workload], *MEASURE, f"trainer.max_seconds={args.seconds}"]
    fresh = Fresh(ROOT / "train.py")
    hosts = {
        n: Host(ROOT / "conf", "train", out / "hosts" / f"{n}.log", ROOT) for n in args.workers
    }
    rows = []
    bar = tqdm(total=2 * len(args.workers) * args.rounds, desc="warm vs fresh", unit="run")
    try:
        for r in range(args.rounds):
            for n in args.workers:
                sides = {"warm": hosts[n], "fresh": fresh}
                order = common.alternating(sides, r)
                for side in order:
                    t0 = time.monotonic()
                    res = run_trial(
                        sides[side],
                        [*base, "loader=default", f"loader.num_workers={n}"],
                        out / "runs" / f"r{r}_{n}_{side}",
                        300,
                    )
                    rows.append(
                        {
                            "round": r,
                            "num_workers": n,
                            "side": side,
                            "samples_per_sec": res.value,
                            "wall_s": time.monotonic() - t0,
                            "status": res.status,
                            "reason": res.reason,
                        }
                    )
                    shown = f"{res.value:,.1f}" if res.ok else f"{res.status}: {res.reason}"
                    bar.write(f"round {r + 1}/{args.rounds} {n:>3} workers {side:>5}: {shown}")
                    bar.update(1)
    finally:
        bar.close()
        for host in hosts.values():
            host.close()
    return rows


def summarise(rows: list[dict], workers: list[int]) -> list[dict]:
    out = []
    for n in workers:
        mine = [r for r in rows if r["num_workers"] == n and r["status"] == "ok"]
        by = {
            s: {r["round"]: r["samples_per_sec"] for r in mine if r["side"] == s}
            for s in ("warm", "fresh")
        }
        wall = {
            s: statistics.median(
                [r["wall_s"] for r in rows if r["num_workers"] == n and r["side"] == s]
            )
            for s in ("warm", "fresh")
        }
        c = stats.compare(by["warm"], by["fresh"])
        out.append(
            {
                "num_workers": n,
                "warm_median": statistics.median(by["warm"].values()) if by["warm"] else None,
                "fresh_median": statistics.median(by["fresh"].values()) if by["fresh"] else None,
                "warm/fresh": c.as_dict() | {"shown": c.describe()} if c else None,
                "wall_s": wall,
            }
        )
    return out


def table(summary: list[dict]) -> str:
    lines = [
        "| workers | warm samples/s | fresh samples/s | warm / fresh [95% interval] |"
        " wall s a run: warm / fresh |",
        "|---|---|---|---|---|",
    ]
    for s in summary:
        ratio = s["warm/fresh"]["shown"] if s["warm/fresh"] else "n/a"
        lines.append(
            f"| {s['num_workers']} | {s['warm_median'] or 0:,.0f} | {s['fresh_median'] or 0:,.0f} |"
            f" {ratio} | {s['wall_s']['warm']:.1f} / {s['wall_s']['fresh']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    measured = [s for s in summary if s["warm/fresh"]]
    xs = [str(s["num_workers"]) for s in measured]
    ratio = [s["warm/fresh"]["ratio"] for s in measured]
    lo = [r - s["warm/fresh"]["low"] for r, s in zip(ratio, measured, strict=True)]
    hi = [s["warm/fresh"]["high"] - r for r, s in zip(ratio, measured, strict=True)]
    ax.errorbar(xs, ratio, yerr=[lo, hi], fmt="o", capsize=6, color="tab:blue")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("num_workers")
    ax.set_ylabel("warm host / fresh process (95% interval)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="synthetic_loader", choices=WORKLOADS)
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 4, 32])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured window per run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or ROOT / "benchmarks" / "results" / f"{stamp}_warm_vs_fresh").resolve()
    out.mkdir(parents=True, exist_ok=True)
    fp = detect()
    print(f"machine: {fp.short()}\noutput: {out}", flush=True)
    rows = measure(args, out)
    summary = summarise(rows, args.workers)
    text = table(summary)
    print("\n" + text)
    report = {
        **common.provenance(fp),
        "workload": args.workload,
        "overrides": WORKLOADS[args.workload],
        "rounds": args.rounds,
        "seconds_per_run": args.seconds,
        "summary": summary,
        "runs": rows,
    }
    common.write_json(out / "results.json", report)
    (out / "table.md").write_text(
        f"`{report['command']}` ({args.workload}, {fp.short()})\n\n{text}"
    )
    plot(summary, out / "warm_vs_fresh.png", f"{args.workload}: {args.rounds} paired rounds")
    print(f"wrote {out / 'results.json'}, {out / 'table.md'}, {out / 'warm_vs_fresh.png'}")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
