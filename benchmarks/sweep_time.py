"""What a default loader sweep costs, and whether its short trials measured steady state.

    python benchmarks/sweep_time.py                        # synthetic_loader, photos, webdataset
    python benchmarks/sweep_time.py --workloads photos --fresh   # trials as fresh processes

For each workload: the default sweep from scratch (`python train.py -m sweep=loader`, a fresh
study), timed, with the seconds of its phases as the sweep recorded them; then every finalist
and three other trials (the widest) re-run over `--steady-seconds` beside their trial figures
(`loader_bench.measure_fidelity`). Writes `results.json`, `table.md` and `sweep_time.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

from feedrate.hardware import detect

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from loader_bench import (  # noqa: E402 - the bench's own sweep and fidelity runs
    FIDELITY,
    WORKLOADS,
    measure_fidelity,
    run_sweep,
    sweep_dir,
)

TARGET_S = {"webdataset": 150.0}  # the others: 120 s
DEFAULT_TARGET_S = 120.0


def decision(out: Path, workload: str) -> dict:
    decided = OmegaConf.load(sweep_dir(out, workload) / "final_decision.yaml")
    return {
        "winner": str(decided.winner),
        "loader": OmegaConf.to_container(decided.loader),
        "median_samples_per_sec": float(decided.median_samples_per_sec),
    }


def table(rows: list[dict], steady: float) -> str:
    lines = [
        "| workload | sweep wall time | target | of which | preset | final rounds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        phases = ", ".join(f"{k} {v:.0f}" for k, v in r["seconds"].items() if k != "total")
        target = TARGET_S.get(r["workload"], DEFAULT_TARGET_S)
        ok = "met" if r["seconds"]["total"] <= target else "missed"
        loader = r["decision"]["loader"]
        picked = f"{loader.get('num_workers')} x {loader.get('prefetch_factor') or 2}"
        lines.append(
            f"| {r['workload']} | {r['seconds']['total']:.0f} s | <= {target:.0f} s {ok} |"
            f" {phases} | {picked}, {r['decision']['median_samples_per_sec']:,.0f} samples/s |"
            f" {r['rounds']} |"
        )
    if not any(r["fidelity"] for r in rows):
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"| workload | trial | workers x prefetch | trial samples/s | {steady:g} s steady state |"
        " trial / steady |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for f in r["fidelity"]:
            ratio = f["ratio"]
            verdict = (
                "cut short (below half the best)"
                if f.get("abandoned")
                # one run each: a point ratio, no interval, so no claim of equal
                else (
                    f"within {FIDELITY:.0%}, one run each: no claim"
                    if ratio is not None and abs(ratio - 1) <= FIDELITY
                    else f"outside {FIDELITY:.0%}, one run each"
                )
            )
            shown = f"{ratio:.2f} {verdict}" if ratio is not None else "failed"
            lines.append(
                f"| {r['workload']} | {f['trial']}{' (finalist)' if f['finalist'] else ''} |"
                f" {f['num_workers']} x {f['prefetch_factor'] or 2} | {f['trial_value']:,.0f} |"
                f" {f['steady_value'] or 0:,.0f} | {shown} |"
            )
    return "\n".join(lines) + "\n"


def summarise(out: Path, steady: float | None = None) -> int:
    """OUT's table.md again from its results.json (the verdicts by today's words). The steady
    runs' length is the one the bench ran with (its recorded ``--steady-seconds``)."""
    report = json.loads((out / "results.json").read_text())
    if steady is None:
        said = report.get("command", "").split()
        ran = said[said.index("--steady-seconds") + 1] if "--steady-seconds" in said else "20"
        steady = report.get("steady_seconds", float(ran))
    old = (out / "table.md").read_text().splitlines() if (out / "table.md").exists() else []
    machine = report.get("machine", {}).get("cpu_model", "?")
    header = old[0] if old else f"`{report.get('command', '?')}` ({machine})"  # as first written
    text = table(report["rows"], steady)
    (out / "table.md").write_text(f"{header}\n\n{text}")
    print(text)
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    phases = ["ceilings", "search", "final", "gap"]
    left = [0.0] * len(rows)
    names = [r["workload"] for r in rows]
    for phase in phases:
        widths = [r["seconds"].get(phase, 0.0) for r in rows]
        ax.barh(names, widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    rest = [r["seconds"]["total"] - lf for r, lf in zip(rows, left, strict=True)]
    ax.barh(names, rest, left=left, label="start-up and reports", color="lightgray")
    for i, r in enumerate(rows):
        ax.axvline(TARGET_S.get(r["workload"], DEFAULT_TARGET_S), color="tab:red", ls="--", lw=1)
        ax.text(r["seconds"]["total"], i, f" {r['seconds']['total']:.0f} s", va="center")
    ax.set_xlabel("seconds (dashed: target)")
    ax.set_title("default loader sweep, from scratch")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workloads", nargs="+", default=["synthetic_loader", "photos", "webdataset"]
    )
    parser.add_argument("--steady-seconds", type=float, default=20.0)
    parser.add_argument("--fresh", action="store_true", help="trials as fresh processes")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--summarise", type=Path, default=None, metavar="OUT", help="only redo OUT's table.md"
    )
    args = parser.parse_args()
    if args.summarise:
        return summarise(args.summarise)
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or ROOT / "benchmarks" / "results" / f"{stamp}_sweep_time").resolve()
    out.mkdir(parents=True, exist_ok=True)
    fp = detect()
    print(f"machine: {fp.short()}\noutput: {out}", flush=True)
    bench_args = argparse.Namespace(
        extra=[],
        sweep_extra=[],
        fresh=args.fresh,
        preset_name=None,
        steady_seconds=args.steady_seconds,
    )
    rows = []
    for workload in args.workloads:
        seconds = run_sweep(workload, out, bench_args)
        rounds = len({p.name.split("_")[0] for p in (sweep_dir(out, workload) / "final").iterdir()})
        fidelity = measure_fidelity(workload, out, bench_args) if args.steady_seconds else []
        rows.append(
            {
                "workload": workload,
                "overrides": WORKLOADS[workload],
                "seconds": seconds,
                "rounds": rounds,
                "decision": decision(out, workload),
                "fidelity": fidelity,
            }
        )
    text = table(rows, args.steady_seconds)
    print("\n" + text)
    report = {
        **common.provenance(fp),
        "trials": "fresh processes" if args.fresh else "warm trial hosts",
        "steady_seconds": args.steady_seconds,
        "rows": rows,
    }
    common.write_json(out / "results.json", report)
    (out / "table.md").write_text(f"`{report['command']}` ({fp.short()})\n\n{text}")
    plot(rows, out / "sweep_time.png")
    print(f"wrote {out / 'results.json'}, {out / 'table.md'}, {out / 'sweep_time.png'}")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
