"""The target column of a loader_bench ``tables.md`` judged again by the one rule
(docs/benchmarks.md, "One rule for every verdict"), from the ratio and interval each row
prints: met when the low end reaches the target, missed when the high end is below it, not
shown otherwise, and not shown on fewer than 3 rounds ("no claim"); "not significantly
worse" is met unless the row is a loss.

    python benchmarks/rejudge_tables.py benchmarks/results/<folder>/tables.md [...]

For tables written before the rule whose raw runs are archived (autotune_bench.py and
sweep_time.py redo theirs with ``--summarise``). Only the target column changes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROW = re.compile(
    r"^\| (?P<w>[^|]+) \| (?P<name>[^|]+) \| (?P<r>[\d.]+)x \[(?P<lo>[\d.]+), (?P<hi>[\d.]+)\]"
    r" (?P<verdict>[^|]*?) \| (?P<target>>= [\d.]+|not significantly worse)"
    r" (?P<said>PASS|MISS|NOT SHOWN[^|]*?) \|$"
)


def judged(m: re.Match) -> str:
    lo, hi, verdict = float(m["lo"]), float(m["hi"]), m["verdict"]
    if "no claim" in verdict:
        return "not shown"
    if m["target"] == "not significantly worse":
        return "missed" if verdict.startswith("loss") else "met"
    target = float(m["target"][3:])
    return "met" if lo >= target else "missed" if hi < target else "not shown"


def rejudge(text: str) -> tuple[str, int]:
    out, n = [], 0
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            line, n = line[: m.start("said")] + judged(m) + " |", n + 1
        out.append(line)
    return "\n".join(out) + "\n", n


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for path in map(Path, argv):
        text, n = rejudge(path.read_text())
        path.write_text(text)
        print(f"{path}: {n} rows judged again", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
