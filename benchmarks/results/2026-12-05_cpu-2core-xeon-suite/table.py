"""Writes table.md from results.json (every run, in the order run): python table.py"""

import json
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    d = json.loads((HERE / "results.json").read_text())
    out = [
        f"# The suite's time on a {d['machine']}",
        "",
        f"From results.json, every run in the order run ({d['date']}). {d['note']}",
        "",
        "CI job from a clean clone (`make test` inside):",
        "",
        "| code | in all (s) | tests (s) | install (s) | user+sys (s) | passed | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["clean_clone"]:
        row = [r["code"], f"{r['real_s']:.1f}", f"{r['tests_s']:.2f}", f"{r['install_s']:.1f}"]
        row += [f"{r['user_s'] + r['sys_s']:.1f}", str(r["passed"]), r.get("note", "")]
        out.append("| " + " | ".join(row) + " |")
    out += ["", "The suite in the checkout's `.venv`:", ""]
    out += ["| code | tests (s) | in all (s) | passed | how |", "|---|---|---|---|---|"]
    for r in d["runs"]:
        row = [r["code"], f"{r['tests_s']:.2f}", f"{r['real_s']:.1f}", str(r["passed"])]
        out.append("| " + " | ".join([*row, r["note"]]) + " |")
    out += ["", "Installing `.venv`:", ""]
    for r in d["install"]:
        out.append(f"- {r['code']}: {r['real_s']:.1f} s (`{r['command']}`)")
    out += ["", "Commands: `command.txt`."]
    (HERE / "table.md").write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
