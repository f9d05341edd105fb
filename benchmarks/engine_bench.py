"""Thread workers against worker processes, each at its best as the sweep finds it, side by side.

    python benchmarks/engine_bench.py --out benchmarks/results/<folder>
    python benchmarks/engine_bench.py --workloads catalog --repeats 5 --out ...

For each workload, in one run on one machine:
1. loader sweeps from scratch (fresh studies, as a user runs them): on worker processes alone
   (``sweep.engines=[process]``), on threads alone (``[thread]``) and on both (the default).
   With ``--budget-share`` (the latency-bound workload), a fourth on both engines under
   ``sweep.memory_budget_gb``: that share (0.75) of the memory the process winner's preset
   records;
2. their presets in ``--repeats`` rounds, the order alternating (reversed every other round),
   each run a fresh ``python train.py``: samples/s over a ``--seconds`` window after the
   warm-up, and the peak PSS of the run's process tree. Presets that resolve to the same
   settings are one row, measured once a round from the second on. A row without workers
   (``no_workers``: the training process alone) is the memory floor every engine starts from;
3. ratios over the paired rounds with their 95% intervals (``feedrate.stats``), judged on the
   interval as every benchmark here is: ``thread/process`` (samples/s and peak PSS),
   ``both/process``, ``budget/both``; the targets of ``TARGETS``, and for the workloads
   without one a verdict (win, loss or tie);
4. ``runs.jsonl`` as each run lands, then ``results.json``, ``tables.md`` and ``engines.png``
   under ``--out``; the presets the sweeps wrote are copied there.

Workloads: ``catalog`` (examples/catalog_store.py: a million-record catalog in memory, reads
that wait on an object store's latency, tiny_cnn end to end) and ``photos`` (JPEG decode and
augmentation, pooled_linear).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402
from loader_bench import MEASURE  # noqa: E402

from feedrate import stats  # noqa: E402
from feedrate.environment import git_commit  # noqa: E402
from feedrate.sweep.decide import resolved_settings, twins  # noqa: E402
from feedrate.sweep.trial import Fresh, run_trial  # noqa: E402

WORKLOADS = {
    "catalog": [
        "dataset=custom",
        "dataset._target_=examples.catalog_store.CatalogStore",
        "model=tiny_cnn",
    ],
    "photos": ["dataset=photos", "model=pooled_linear"],
}
FLOOR = "no_workers"  # a row beside the presets: the training process alone, no worker
SWEEPS = {  # row -> sweep.engines
    "process": "[process]",
    "thread": "[thread]",
    "both": "[process,thread]",
    "budget": "[process,thread]",
}
TARGETS = {  # ratio -> (low end at least, high end at most), on the interval
    "catalog": {
        "thread/process samples/s": (0.95, None),
        "thread/process peak PSS": (None, 1 / 3),
        "thread/process workers' PSS": (None, 1 / 3),
        "budget/both samples/s": (0.90, None),
    },
}


def sweep(workload: str, row: str, out: Path, args, budget_gb: float | None) -> dict:
    """One sweep from scratch; its preset (copied under ``out``), wall time and decision."""
    name = f"bench_engine_{workload}_{row}"
    overrides = [
        *WORKLOADS[workload],
        *args.extra,
        *args.sweep_extra,
        f"sweep.engines={SWEEPS[row]}",
        *([f"sweep.memory_budget_gb={budget_gb:.3f}"] if budget_gb else []),
        "sweep.overwrite=true",
    ]
    ran = common.sweep(ROOT, overrides, name, out, f"sweep_{workload}_{row}")
    shutil.copy(ran["path"], out / f"{name}.yaml")
    values = ran["values"]
    print(
        f"[{workload}] sweep {row}: {ran['seconds']:.0f} s, preset {_settings(values)}", flush=True
    )
    return {"preset": name, "seconds": ran["seconds"], "values": values, "budget_gb": budget_gb}


def _settings(values: dict) -> str:
    keys = ("num_workers", "prefetch_factor", "engine", "multiprocessing_context")
    return ", ".join(f"{k}={values[k]}" for k in keys if k in values)


def measure(workload: str, presets: dict, out: Path, args) -> list[dict]:
    """The presets in alternating rounds, each run a fresh process; the rows, as recorded."""
    base = [*WORKLOADS[workload], *args.extra, *MEASURE, f"trainer.max_seconds={args.seconds}"]
    runner, rows = Fresh(ROOT / "train.py"), []
    live = {row: [f"loader={p['preset']}"] for row, p in presets.items()}
    live[FLOOR] = ["loader=default", "loader.num_workers=0"]  # one process: the memory floor
    for r in range(args.repeats):
        order = common.alternating(live, r)
        for row in order:
            res = run_trial(runner, [*base, *live[row]], out / workload / f"r{r}_{row}", 600)
            m = res.metrics if res.ok else {}
            line = {
                "workload": workload,
                "round": r,
                "name": row,
                "samples_per_sec": res.value,
                "peak_pss_mb": m.get("peak_pss_mb"),
                "peak_processes": m.get("peak_processes"),
                "data_wait_frac": m.get("data_wait_frac"),
                "settings": resolved_settings(m, stream=True) if m else None,
                "status": res.status,
                "reason": res.reason,
            }
            rows.append(line)
            with open(out / "runs.jsonl", "a") as fh:
                fh.write(json.dumps(line) + "\n")
            shown = f"{res.value:,.1f} samples/s" if res.ok else f"FAILED {res.reason}"
            memory = f", {line['peak_pss_mb']:,.0f} MB" if line["peak_pss_mb"] else ""
            print(
                f"[{workload}] round {r + 1}/{args.repeats} {row:>8}: {shown}{memory}", flush=True
            )
        if r == 0:  # one row per resolved setting from here on
            alias = twins([(x["name"], x["settings"]) for x in rows if x["status"] == "ok"])
            for row, same in alias.items():
                print(f"[{workload}] {row} = {same}: the same settings, measured as one")
                live.pop(row, None)
    return rows


def compare(workload: str, rows: list[dict], presets: dict) -> dict:
    """Medians, paired ratios with intervals, and the targets met or not."""
    ok = [r for r in rows if r["status"] == "ok"]
    alias = twins([(r["name"], r["settings"]) for r in ok if r["round"] == 0])
    per = {"samples/s": {}, "peak PSS": {}, "workers' PSS": {}}
    for r in ok:
        name = alias.get(r["name"], r["name"])
        per["samples/s"].setdefault(name, {})[r["round"]] = r["samples_per_sec"]
        if r["peak_pss_mb"]:
            per["peak PSS"].setdefault(name, {})[r["round"]] = r["peak_pss_mb"]
    floor = per["peak PSS"].get(FLOOR, {})
    for name, by in per["peak PSS"].items():  # what the workers add to the training process
        above = {k: v - floor[k] for k, v in by.items() if k in floor and v > floor[k]}
        if name != FLOOR and above:
            per["workers' PSS"][name] = above
    medians = {
        what: {n: statistics.median(v.values()) for n, v in by.items()} for what, by in per.items()
    }
    ratios, targets = {}, {}
    for a, b in [("thread", "process"), ("both", "process"), ("budget", "both"),
                 ("budget", "process")]:  # fmt: skip
        a, b = alias.get(a, a), alias.get(b, b)
        for what, by in per.items():
            if a == b or a not in by or b not in by:
                continue
            versus = stats.compare(by[a], by[b])
            if versus is not None:
                ratios[f"{a}/{b} {what}"] = versus.as_dict()
    for key, (low, high) in TARGETS.get(workload, {}).items():
        a_b, what = key.split(" ", 1)
        a, b = (alias.get(x, x) for x in a_b.split("/"))
        ratio = ratios.get(f"{a}/{b} {what}")
        targets[key] = _judge(ratio, low, high) if a != b else "same settings: 1.00x"
    budget = presets.get("budget")
    if budget:
        peaks = per["peak PSS"].get(alias.get("budget", "budget"), {}).values()
        limit = budget["budget_gb"] * 1024
        targets["budget preset on threads"] = (
            "met" if budget["values"].get("engine") == "thread" else "missed"
        )
        targets["budget preset within the budget, every round"] = (
            "met" if peaks and max(peaks) <= limit else "missed"
        )
    return {
        "alias": alias,
        "medians": medians,
        "rounds": {w: {n: v for n, v in by.items()} for w, by in per.items()},
        "ratios": ratios,
        "targets": targets,
    }


def _judge(ratio: dict | None, low: float | None, high: float | None) -> str:
    """A target on the interval: its low end at or above ``low``, or its high end at or below
    ``high``; else missed where the other end is past it, not shown where it straddles."""
    if ratio is None:
        return stats.NO_FIGURE
    if min(ratio["rounds"]) < stats.MIN_ROUNDS:
        return stats.NOT_SHOWN
    if low is not None:
        return stats.against(ratio, low)
    if ratio["high"] <= high:
        return stats.MET
    return stats.MISSED if ratio["low"] > high else stats.NOT_SHOWN


def describe(ratio: dict, memory: bool = False) -> str:
    """A ratio and its interval; for memory, less or more (a win or a loss reads backwards)."""
    versus = stats.Comparison(
        ratio["ratio"], ratio["low"], ratio["high"], tuple(ratio["rounds"]), ratio["p_value"]
    )
    if not memory or versus.verdict == stats.TIE:
        return versus.describe()
    word = "less memory" if versus.verdict == stats.LOSS else "more memory"
    return f"{versus.ratio:.2f}x [{versus.low:.2f}, {versus.high:.2f}] {word}"


def tables(results: dict) -> str:
    lines = []
    for workload, res in results["workloads"].items():
        header = "| row | preset | samples/s (median) | peak PSS MB (median) |"
        lines += [f"## {workload}", "", header, "|---|---|---|---|"]
        floor = {FLOOR: {"values": {"num_workers": 0}}}
        for row, p in {**res["presets"], **floor}.items():
            name = res["compare"]["alias"].get(row, row)
            rate = res["compare"]["medians"]["samples/s"].get(name)
            pss = res["compare"]["medians"]["peak PSS"].get(name)
            shown = f"{rate:,.1f}" if rate else "-"
            same = f" (= {name})" if name != row else ""
            budget = f", memory_budget_gb={p['budget_gb']:.2f}" if p.get("budget_gb") else ""
            preset = _settings(p["values"]) + budget
            lines.append(f"| {row}{same} | {preset} | {shown} | {pss or 0:,.0f} |")
        lines += ["", "| ratio | over the paired rounds |", "|---|---|"]
        ratios = res["compare"]["ratios"].items()
        lines += [f"| {k} | {describe(v, k.endswith('PSS'))} |" for k, v in ratios]
        if res["compare"]["targets"]:
            lines += ["", "| target | result |", "|---|---|"]
            lines += [f"| {k} | {v} |" for k, v in res["compare"]["targets"].items()]
        swept = ", ".join(f"{k} {v['seconds']:.0f}" for k, v in res["presets"].items())
        lines += ["", f"Sweeps (s): {swept}", ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Samples/s and peak PSS of each row, every round a dot, per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    kinds = ("samples/s", "peak PSS", "workers' PSS")
    fig, axes = plt.subplots(3, len(names), figsize=(5 * len(names), 10), squeeze=False)
    for col, workload in enumerate(names):
        rounds = results["workloads"][workload]["compare"]["rounds"]
        for row, what in enumerate(kinds):
            ax, by = axes[row][col], rounds[what]
            for i, values in enumerate(by.values()):
                ys = list(values.values())
                ax.bar(i, statistics.median(ys), color="#9ab", width=0.6)
                ax.plot([i] * len(ys), ys, "k.", ms=4)
            ax.set_xticks(range(len(by)), list(by), fontsize=8)
            unit = {"peak PSS": " (MB)", "workers' PSS": " above no_workers' (MB)"}.get(what, "")
            ax.set_title(f"{workload}: {what}{unit}", fontsize=10)
            budget = results["workloads"][workload]["presets"].get("budget")
            if what == "peak PSS" and budget:
                ax.axhline(budget["budget_gb"] * 1024, color="#c44", ls="--", lw=1)
                ax.text(0, budget["budget_gb"] * 1024, " memory budget", color="#c44", fontsize=8)
    commit = (results["commit"] or "")[:8]
    fig.suptitle(f"the swept best on each engine, every round a dot ({commit})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarise(out: Path) -> int:
    """The comparisons again from what a run recorded (its runs.jsonl and its presets), with
    this script's compare: every figure from the runs, none measured again."""
    results = json.loads((out / "results.json").read_text())
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    for workload, res in results["workloads"].items():
        rows = [r for r in runs if r["workload"] == workload]
        res["compare"] = compare(workload, rows, res["presets"])
    results["summarised"] = {"by": "engine_bench.py --summarise", "commit": git_commit()}
    common.write_json(out / "results.json", results)
    (out / "tables.md").write_text(tables(results))
    plot(results, out / "engines.png")
    print(tables(results))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--repeats", type=int, default=5, help="rounds")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured window per run")
    parser.add_argument(
        "--budget-share",
        type=float,
        default=0.75,
        help="of the process winner's recorded memory: the budgeted sweep's (catalog only)",
    )
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for every run")
    parser.add_argument("--sweep-extra", nargs="*", default=[], help="for the sweeps only")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=list(SWEEPS),
        choices=list(SWEEPS),
        help="which sweeps (each a row): process and thread at least (make bench: those two)",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--summarise",
        action="store_true",
        help="recompute results.json, tables.md and engines.png from --out's runs.jsonl",
    )
    args = parser.parse_args()
    if not {"process", "thread"} <= set(args.rows):
        parser.error(f"--rows {' '.join(args.rows)}: process and thread are the comparison")
    if args.summarise:
        return summarise(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "command": " ".join(sys.argv),
        "commit": git_commit(),
        "date": datetime.now().isoformat(timespec="seconds"),
        "workloads": {},
    }
    for workload in args.workloads:
        presets = {}
        for row in ("process", "thread", "both"):
            if row in args.rows:
                presets[row] = sweep(workload, row, args.out, args, None)
        if workload == "catalog" and args.budget_share and "budget" in args.rows:
            need = presets["process"]["values"]["measured_on"].get("peak_pss_mb")
            budget_gb = args.budget_share * need / 1024
            print(f"[{workload}] the process winner needs {need:,.0f} MB: budget {budget_gb:.2f}")
            presets["budget"] = sweep(workload, "budget", args.out, args, budget_gb)
        rows = measure(workload, presets, args.out, args)
        results["workloads"][workload] = {
            "presets": presets,
            "compare": compare(workload, rows, presets),
        }
        common.write_json(args.out / "results.json", results)
    (args.out / "tables.md").write_text(tables(results))
    plot(results, args.out / "engines.png")
    print(tables(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
