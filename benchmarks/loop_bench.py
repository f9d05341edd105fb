"""feedrate.autotune_loader in a loop of your own, against the same loop with the recipe.

    python benchmarks/loop_bench.py                               # plain loop, 3 rounds of 200 s
    python benchmarks/loop_bench.py --example lightning hf --seconds 200 --rounds 3

Each round runs the example twice, a fresh process each, in alternating order: with
`feedrate.autotune_loader` (which searches from the recipe's 4 workers, no preset) and with
the recipe's DataLoader (4 workers, pin_memory, prefetch_factor=2, persistent_workers). The
data is examples/sensor_store.py, which no heuristic of feedrate was tuned on. Reported:
samples trained over the whole run (tuning included), and autotune / recipe with the 95%
interval of the paired rounds; the target is 2.5x, met when the interval's low end reaches it.

Writes results.json (after every round: a bench cut short still counts), table.md,
loop.png and each run's log under --out; every run is a row, none replaces another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402

from feedrate import stats  # noqa: E402
from feedrate.environment import git_commit  # noqa: E402
from feedrate.hardware import detect  # noqa: E402

EXAMPLES = {
    "plain": "examples/plain_loop.py",
    "lightning": "examples/lightning_module.py",
    "hf": "examples/hf_trainer.py",
}
CONTESTANTS = ("autotune", "recipe")
TARGET = 2.5


def run_one(example: str, name: str, r: int, out: Path, args: argparse.Namespace) -> dict:
    log = out / f"{example}_round{r}_{name}.log"
    cmd = [
        sys.executable,
        EXAMPLES[example],
        "--loader",
        name,
        "--seconds",
        str(args.seconds),
        "--budget-s",
        str(args.budget_s),
        *args.extra,
    ]
    print(f"round {r}: {name} ...", flush=True)
    with log.open("w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=fh, text=True)
    fh_text = proc.stdout.strip().splitlines()
    row = {"round": r, "name": name, "ok": proc.returncode == 0, "rc": proc.returncode}
    if proc.returncode == 0 and fh_text:
        row.update(json.loads(fh_text[-1]))
    print(f"  {name}: {row.get('samples_per_sec', 'failed')} samples/s", flush=True)
    return row


def verdict(rows: list[dict]) -> dict:
    by = {n: {x["round"]: x["samples_per_sec"] for x in rows if x["name"] == n and x["ok"]}
          for n in CONTESTANTS}  # fmt: skip
    c = stats.compare(by["autotune"], by["recipe"])
    ratio = c.as_dict() if c else None
    return {
        "medians": {n: statistics.median(v.values()) if v else None for n, v in by.items()},
        "autotune_vs_recipe": ratio,
        "text": c.describe() if c else "-",
        "target": TARGET,
        "met": stats.against(ratio, TARGET),
    }


def table(results: dict, header: str) -> str:
    lines = [
        header,
        "Samples/s over each whole run (tuning included), median of the rounds; the ratio is"
        " the geometric mean of the paired rounds with its 95% interval; the target is met"
        " when the interval's low end reaches it.",
        "",
        "| example | autotune_loader | recipe | autotune / recipe | target | rounds |",
        "|---|---|---|---|---|---|",
    ]
    for example, res in results.items():
        v, m = res["verdict"], res["verdict"]["medians"]
        rounds = ", ".join(
            f"{a['samples_per_sec'] / b['samples_per_sec']:.2f}"
            for a in res["rows"]
            for b in res["rows"]
            if a["name"] == "autotune" and b["name"] == "recipe" and a["round"] == b["round"]
            and a["ok"] and b["ok"]
        )  # fmt: skip
        lines.append(
            f"| {example} | {m['autotune'] or 0:,.1f} | {m['recipe'] or 0:,.1f} | {v['text']} |"
            f" >= {TARGET}: {v['met'].upper()} | {rounds} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    fig, ax = common.figure(figsize=(6, 4))
    for j, res in enumerate(results.values()):
        for i, name in enumerate(CONTESTANTS):
            values = [x["samples_per_sec"] for x in res["rows"] if x["name"] == name and x["ok"]]
            if values:
                x = j + (i - 0.5) * 0.35
                common.rounds_bar(ax, x, values, 0.35, f"C{i}", name if j == 0 else "")
    ax.set_xticks(range(len(results)), list(results))
    ax.set_ylabel("samples/s over the whole run (tuning included)")
    ax.set_title("autotune_loader against the recipe, same loop (dots: rounds)")
    ax.legend()
    common.save(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--example", nargs="+", default=["plain"], choices=list(EXAMPLES))
    parser.add_argument("--seconds", type=float, default=200.0)
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--extra", nargs="*", default=[], help="arguments for every run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or ROOT / "benchmarks" / "results" / f"{stamp}_loop").resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/loop_bench.py " + " ".join(sys.argv[1:])
    machine = detect().short()
    (out / "command.txt").write_text(f"{command}\ncommit {git_commit()}\nmachine {machine}\n")
    print(f"machine: {machine}\noutput: {out}", flush=True)
    results: dict = {}
    for example in args.example:
        rows: list[dict] = []
        for r in range(args.rounds):
            order = common.alternating(CONTESTANTS, r)
            rows += [run_one(example, name, r, out, args) for name in order]
            results[example] = {"rows": rows, "verdict": verdict(rows)}
            common.write_json(out / "results.json", results)
    header = f"Command: `{command}`\nCommit {git_commit()}\nMachine: {machine}\n"
    (out / "table.md").write_text(table(results, header))
    plot(results, out / "loop.png")
    print((out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
