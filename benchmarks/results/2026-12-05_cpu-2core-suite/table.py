"""Writes table.md from results.json (every run, in the order run): python table.py"""

import json
from pathlib import Path

HERE = Path(__file__).parent


def cpu(r: dict) -> str:
    """user+sys of what `time` waited for; the whole machine's (/proc/stat) where measured:
    `time` misses processes it did not wait for (fork servers, torchrun's ranks)."""
    parts = [f"{r['user_s'] + r['sys_s']:.1f}"] if "user_s" in r else []
    if "machine_cpu_s" in r:
        parts.append(f"{r['machine_cpu_s']:.1f} (whole machine)")
    elif "cpu_s_all_tests" in r:
        parts.append(f"{r['cpu_s_all_tests']:.1f} (whole machine)")
    return "; ".join(parts) or "-"


def main() -> None:
    d = json.loads((HERE / "results.json").read_text())
    out = [
        f"# The suite's time on a {d['machine']} (from results.json; every run, in the order run)",
        "",
        "| tests run | code | tests (s) | CPU, user+sys (s) | failed |",
        "|---|---|---|---|---|",
    ]
    for r in d["runs"]:
        failed = ", ".join(f.split("::")[-1] for f in r["failed"]) or "-"
        row = [r["workers"], r["code"], f"{r['tests_s']:.1f}", cpu(r), failed]
        out.append("| " + " | ".join(row) + " |")
    out += ["", "CI job from a clean clone, each as its command (`make test` inside):", ""]
    out += ["| code | in all (s) | tests (s) | install (s) | CPU (s) | passed | note |"]
    out += ["|---|---|---|---|---|---|---|"]
    for r in d["clean_clone"]:
        row = [r["code"], f"{r['real_s']:.1f}", f"{r['tests_s']:.1f}", f"{r['install_s']:.1f}"]
        row += [cpu(r), str(r["passed"]), r.get("note", "")]
        out.append("| " + " | ".join(row) + " |")
    out += ["", f"Command: `{d['clean_clone'][0]['command']}`", "", "Installing `.venv`:", ""]
    for r in d.get("install", []):
        out.append(f"- {r['code']}: {r['real_s']:.1f} s (`{r['command']}`)")
        if "compileall_real_s" in r:
            out[-1] += f", then compileall {r['compileall_real_s']:.1f} s"
        if "machine_cpu_s" in r:
            out[-1] += f", {r['machine_cpu_s']:.1f} s of the machine's CPU"
        if "note" in r:
            out[-1] += f": {r['note']}"
    f = d["test_fast"]
    failed = ", ".join(f["failed"]) or "none"
    out += ["", f"make test-fast at {f['code']}: {f['tests_s']:.1f} s of tests, failed: {failed}."]
    (HERE / "table.md").write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
