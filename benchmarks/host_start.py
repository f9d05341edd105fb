"""What a new trial host costs: one forked from the sweep's fork server against a fresh
``python train.py`` (what every host cost before it was forked), the same small trial, in
alternating rounds. Each round starts one of each and runs one trial in it: its wall seconds
from start to answer, and the trial's peak PSS (forked hosts share pages with the server).


    python benchmarks/host_start.py [--rounds 7] [--out DIR]

The server's own start is the first forked host's, and is reported apart (paid once a sweep).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

import common

from feedrate import stats
from feedrate.environment import git_commit
from feedrate.hardware import detect
from feedrate.sweep.host import Host
from feedrate.sweep.trial import Fresh, run_trial

ROOT = Path(__file__).resolve().parents[1]

TRIAL = [
    "dataset=synthetic",
    "dataset.n_samples=256",
    "dataset.image_size=32",
    "model=tiny_cnn",
    "loader.batch_size=16",
    "loader.num_workers=2",
    "trainer.max_steps=8",
    "trainer.warmup_steps=2",
    "trainer.window_steps=2",
    "trainer.steady_state=false",
    "trainer.progress=false",
    "trainer.save_checkpoint=false",
]


def one(kind: str, out: Path, name: str) -> dict:
    job = out / "jobs" / name
    t0 = time.perf_counter()
    if kind == "fresh":
        result = run_trial(Fresh(ROOT / "train.py"), TRIAL, job, 300)
    else:
        host = Host(ROOT / "conf", "train", out / "hosts" / f"{name}.log", ROOT)
        try:
            result = run_trial(host, TRIAL, job, 300)
        finally:
            host.close()
    seconds = time.perf_counter() - t0
    if not result.ok:
        raise SystemExit(f"{kind} trial failed: {result.reason} (see {job})")
    metrics = json.loads((job / "metrics.json").read_text())
    return {"kind": kind, "seconds": seconds, "peak_pss_mb": metrics["peak_pss_mb"]}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, label in zip(
        axes, ("seconds", "peak_pss_mb"), ("first trial, s", "peak PSS, MB"), strict=True
    ):
        for i, kind in enumerate(("fresh", "forked")):
            values = [r[key] for r in rows if r["kind"] == kind and r["round"] >= 0]
            ax.scatter([i] * len(values), values, alpha=0.6)
            ax.hlines(statistics.median(values), i - 0.2, i + 0.2)
        ax.set_xticks([0, 1], ["fresh python", "forked host"])
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    fig.suptitle("a new trial host: fresh process against a fork of the server")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _ratio(c: dict) -> str:
    """A ratio of seconds or MB: below 1, the forked host takes less (no win or loss word:
    those read samples/s, where higher is better)."""
    return (
        f"{c['ratio']:.2f}x [{c['low']:.2f}, {c['high']:.2f}] over {min(c['rounds'])} paired rounds"
    )


def write_table(report: dict, out: Path) -> str:
    median, rows = report["median"], report["rows"]
    n = len([r for r in rows if r["kind"] == "fresh"])
    table = (
        f"| host | first trial, s (median of {n}) | peak PSS, MB |\n|---|---|---|\n"
        + "".join(
            f"| {k} | {median[k]['seconds']:.2f} | {median[k]['peak_pss_mb']:.0f} |\n"
            for k in ("fresh", "forked")
        )
        + f"\nforked/fresh, seconds: {_ratio(report['forked/fresh seconds'])}\n"
        + f"forked/fresh, peak PSS: {_ratio(report['forked/fresh peak_pss_mb'])}\n"
        + f"the fork server's own start (the first forked host): {rows[0]['seconds']:.2f} s\n"
        + f"\n{report['command']} at {report['cwd_git']}, {report['date']}\n"
    )
    (out / "table.md").write_text(table)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None, help="only rewrite DIR/table.md")
    args = parser.parse_args()
    if args.table:
        print(write_table(json.loads((args.table / "results.json").read_text()), args.table))
        return 0
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or ROOT / "benchmarks" / "results" / f"{stamp}_host-start").resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = [{**one("forked", out, "server"), "round": -1}]  # the server's start, once
    print(f"fork server started with the first host: {rows[0]['seconds']:.2f} s", flush=True)
    for r in range(args.rounds):
        order = common.alternating(("fresh", "forked"), r)
        for kind in order:
            row = {**one(kind, out, f"r{r}_{kind}"), "round": r}
            rows.append(row)
            print(
                f"round {r + 1}/{args.rounds} {kind:>6}: {row['seconds']:.2f} s,"
                f" peak PSS {row['peak_pss_mb']:.0f} MB",
                flush=True,
            )
    by = {
        k: {r["round"]: r for r in rows if r["kind"] == k and r["round"] >= 0}
        for k in ("fresh", "forked")
    }
    seconds = stats.compare(
        {n: r["seconds"] for n, r in by["forked"].items()},
        {n: r["seconds"] for n, r in by["fresh"].items()},
    )
    memory = stats.compare(
        {n: r["peak_pss_mb"] for n, r in by["forked"].items()},
        {n: r["peak_pss_mb"] for n, r in by["fresh"].items()},
    )
    keys = ("seconds", "peak_pss_mb")
    median = {
        k: {key: statistics.median(r[key] for r in v.values()) for key in keys}
        for k, v in by.items()
    }
    report = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": detect().as_dict(),
        "host": platform.node(),
        "cwd_git": git_commit(),
        "trial": TRIAL,
        "rows": rows,
        "median": median,
        "forked/fresh seconds": seconds.as_dict(),
        "forked/fresh peak_pss_mb": memory.as_dict(),
    }
    common.write_json(out / "results.json", report)
    table = write_table(report, out)
    plot(rows, out / "host_start.png")
    print("\n" + table + f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
