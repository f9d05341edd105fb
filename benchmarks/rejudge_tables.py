"""The target column of a loader_bench ``tables.md`` judged again by the one rule
(docs/benchmarks.md, "One rule for every verdict"), from the ratio and interval each row
prints: met when the low end reaches the target, missed when the high end is below it, not
shown otherwise, and not shown on fewer than 3 rounds ("no claim"); "not significantly
worse" is met unless the row is a loss.

    python benchmarks/rejudge_tables.py benchmarks/results/<folder>/tables.md [...]

The interval's ends come from the folder's bench.json (or summary.json) where it holds the
row's ratio: the table prints two decimals, and 0.947 prints as 0.95. For tables written
before the rule whose raw runs are archived (autotune_bench.py and
sweep_time.py redo theirs with ``--summarise``). Only the target column changes.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from feedrate import stats

ROW = re.compile(
    r"^\| (?P<w>[^|]+) \| (?P<name>[^|]+) \| (?P<r>[\d.]+)x \[(?P<lo>[\d.]+), (?P<hi>[\d.]+)\]"
    r" (?P<verdict>[^|]*?) \| (?P<target>>= [\d.]+|not significantly worse)"
    r" (?P<said>PASS|MISS|NOT SHOWN[^|]*?|met|missed|not shown) \|$"
)


def judged(m: re.Match, figures: dict | None = None) -> str:
    """The row's target judged; from the folder's own figures (its bench.json or
    summary.json) where they hold the row's ratio, else from the row's printed two decimals."""
    lo, hi, verdict = float(m["lo"]), float(m["hi"]), m["verdict"]
    exact = ((figures or {}).get(m["w"].strip()) or {}).get("ratios", {}).get(m["name"].strip())
    if isinstance(exact, dict) and "low" in exact:
        lo, hi = exact["low"], exact["high"]
    if m["target"] == "not significantly worse":
        return "missed" if verdict.startswith("loss") else "met"
    rounds = 1 if "no claim" in verdict else stats.MIN_ROUNDS  # the row says which
    return stats.against({"low": lo, "high": hi, "rounds": [rounds]}, float(m["target"][3:]))


def rejudge(text: str, figures: dict | None = None) -> tuple[str, int]:
    out, n = [], 0
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            line, n = line[: m.start("said")] + judged(m, figures) + " |", n + 1
        out.append(line)
    return "\n".join(out) + "\n", n


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for path in map(Path, argv):
        figures = None
        for name in ("bench.json", "summary.json"):
            if (path.parent / name).exists():
                loaded = json.loads((path.parent / name).read_text())
                figures = loaded.get("results", loaded)
                break
        text, n = rejudge(path.read_text(), figures)
        path.write_text(text)
        print(f"{path}: {n} rows judged again", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
