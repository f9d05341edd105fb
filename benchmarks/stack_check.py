"""One run's settings on two software stacks, in alternating rounds: did a dependency move
change the figures?

    python benchmarks/stack_check.py --old-python /path/old-venv/bin/python \
        --old-tree /path/old-checkout --out benchmarks/results/<date>_stack-check \
        -- dataset=photos model=pooled_linear loader.num_workers=3 loader.prefetch_factor=4

Each round runs ``train.py <overrides>`` once with this checkout's Python (``new``) and once
with the old checkout and its environment (``old``), the order alternating so drift hits both
alike, over a streamed window of ``--seconds``. The ratio new/old is the geometric mean of
the paired rounds' ratios with its 95% interval (feedrate.stats, as the sweep's finals): a
tie when the interval includes 1.0. Writes ``results.json`` and ``table.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import common
from tqdm import tqdm

from feedrate import stats

ROOT = Path(__file__).resolve().parents[1]


def run(python: str, tree: Path, overrides: list[str], seconds: float, out: Path) -> float | None:
    command = [
        python,
        "train.py",
        *overrides,
        "trainer.stream=true",
        f"trainer.max_seconds={seconds}",
        "trainer.save_checkpoint=false",
        "trainer.progress=false",
        f"hydra.run.dir={out}",
    ]
    proc = subprocess.run(command, cwd=tree, capture_output=True, text=True, timeout=600)
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return None
    return json.loads((out / "metrics.json").read_text())["samples_per_sec"]


def version(python: str, tree: Path) -> dict:
    code = (
        "import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in"
        " ('torch', 'hydra-core', 'omegaconf', 'optuna', 'hydra-optuna-sweeper')}))"
    )
    return json.loads(
        subprocess.run(
            [python, "-c", code], cwd=tree, capture_output=True, text=True, check=True
        ).stdout
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-python", required=True)
    parser.add_argument("--old-tree", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    sides = {"new": (sys.executable, ROOT), "old": (args.old_python, args.old_tree.resolve())}
    figures: dict[str, list[float | None]] = {"new": [], "old": []}
    bar = tqdm(total=2 * args.rounds, desc="stack check", unit="run")
    for r in range(args.rounds):
        for side in common.alternating(("new", "old"), r):
            python, tree = sides[side]
            value = run(python, tree, args.overrides, args.seconds, args.out / f"r{r}_{side}")
            figures[side].append(value)
            shown = f"{value:,.1f} samples/s" if value is not None else "failed (see its log)"
            bar.write(f"round {r + 1}/{args.rounds} {side}: {shown}")
            bar.update(1)
    bar.close()
    versus = stats.compare(figures["new"], figures["old"])
    stacks = {side: version(*sides[side]) for side in sides}
    result = {
        "overrides": args.overrides,
        "seconds": args.seconds,
        "figures": figures,
        "new/old": versus.as_dict() if versus else None,
        "stacks": stacks,
        "command": " ".join(sys.argv),
    }
    common.write_json(args.out / "results.json", result)
    lines = [
        f"`python {' '.join(sys.argv)}`",
        "",
        "| stack | " + " | ".join(stacks["new"]) + " | samples/s per round |",
        "|---|" + "---|" * (len(stacks["new"]) + 1),
    ]
    for side in ("old", "new"):
        shown = ", ".join(f"{v:,.0f}" if v else "failed" for v in figures[side])
        lines.append(f"| {side} | " + " | ".join(stacks[side].values()) + f" | {shown} |")
    lines += ["", f"new / old: {versus.describe() if versus else 'no common round'}", ""]
    (args.out / "table.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
