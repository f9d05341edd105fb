"""The CI job's time from a clean clone: this checkout's HEAD cloned into a temporary folder,
and ``.ci/run`` run there (creating .venv, installing, ``make test``), timed.

    python benchmarks/suite_time.py                  # one run: about 11 minutes on 2 cores
    python benchmarks/suite_time.py --note "after moving the slow tests apart"

Each run is a new folder ``<date>_<machine>-suite`` (``-b``, ``-c``... where that name is
taken: every run counts) with ``results.json``, ``command.txt``, a README and the job's whole
output (``log.txt``, packed into ``raw.tar.gz``). The install's seconds run from the start
to pytest's first line; the tests' are pytest's own figure. The README's and
docs/install.md's suite tables are generated from these folders (``python
benchmarks/doc_tables.py --write``); a run is stale
once the code, the tests or the set-up changed after its commit (benchmarks/depends.py).
Run it on a quiet machine: a job beside it shares the cores with the suite.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402

SUMMARY = re.compile(r"^=+ (?P<counts>.*?) in (?P<seconds>[\d.]+)s\b.*=+$")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|error|errors|xfailed|xpassed)")


def pytest_summary(lines: list[str]) -> dict:
    """pytest's last line, as numbers: the tests' seconds and each outcome's count."""
    for line in reversed(lines):
        found = SUMMARY.match(line.strip())
        if found:
            counts = {word: int(n) for n, word in COUNT.findall(found["counts"])}
            return {
                "tests_s": float(found["seconds"]),
                "passed": counts.get("passed", 0),
                "failed": counts.get("failed", 0)
                + counts.get("error", 0)
                + counts.get("errors", 0),
                "skipped": counts.get("skipped", 0),
            }
    return {"tests_s": None, "passed": 0, "failed": None, "skipped": 0}


def run_job(clone: Path, log: Path) -> dict:
    """``bash .ci/run`` in ``clone``, its output kept in ``log``: the seconds in all, to
    pytest's first line, and pytest's summary."""
    t0 = time.monotonic()
    pytest_at = None
    lines = []
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", ".ci/run"],
            cwd=clone,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            lines.append(line.rstrip("\n"))
            if pytest_at is None and "test session starts" in line:
                pytest_at = time.monotonic() - t0
                print(f"  pytest starts after {pytest_at:.0f} s of set-up", flush=True)
        code = proc.wait()
    real = time.monotonic() - t0
    return {
        "exit": code,
        "real_s": round(real, 1),
        "install_s": round(pytest_at, 1) if pytest_at is not None else None,
        **pytest_summary(lines),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--note", default="", help="a word on the run, kept in its row")
    parser.add_argument("--out", type=Path, default=None, help="default: a new dated folder")
    args = parser.parse_args()

    from bench import folder_for, machine_slug

    from feedrate.environment import git_commit
    from feedrate.hardware import detect

    commit = git_commit()
    if commit.endswith("+dirty"):
        print(
            "suite_time.py clones HEAD: commit the changes first, or the figure would name a"
            f" commit that does not hold them ({commit})",
            file=sys.stderr,
        )
        return 2
    began = datetime.now(timezone.utc)
    out = args.out or folder_for("suite", began.strftime("%Y-%m-%d"), machine_slug())
    out.mkdir(parents=True)
    machine = detect().short()
    command = "python benchmarks/suite_time.py" + (f" --note {args.note!r}" if args.note else "")
    (out / "command.txt").write_text(f"{command}\ncommit {commit}\nmachine {machine}\n")
    print(f"suite_time: the CI job at {commit[:8]} from a clean clone -> {out}", flush=True)
    with tempfile.TemporaryDirectory(prefix="feedrate-suite-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        run = run_job(clone, out / "log.txt")
    ended = datetime.now(timezone.utc)
    run = {"code": commit, "date": began.isoformat(timespec="seconds"), **run, "note": args.note}
    report = {
        "machine": machine,
        "command": command,
        "job": "git clone (HEAD) && bash .ci/run: creating .venv, installing, make test",
        "clean_clone": [run],
    }
    common.write_json(out / "results.json", report)
    shown = (
        f"{run['real_s']:.1f} s in all, {run['tests_s']:.1f} s of tests"
        if run["tests_s"] is not None
        else f"{run['real_s']:.1f} s, no pytest summary (see log.txt)"
    )
    (out / "README.md").write_text(
        f"# The CI job's time from a clean clone, at {commit[:8]}\n\n"
        f"Command: `{command}` (`command.txt`): the checkout's HEAD cloned, then `bash .ci/run`"
        " (creating `.venv`, installing, `make test`).\n\n"
        f"Machine: {machine}.\n\n"
        f"Commit: {commit}.\n\n"
        f"Date: {began:%Y-%m-%d %H:%M} to {ended:%H:%M} UTC.\n\n"
        f"Result: {shown}; {run['passed']} passed, {run['failed']} failed,"
        f" {run['skipped']} skipped; exit {run['exit']}. The job's output: `log.txt` in"
        " `raw.tar.gz`.\n"
    )
    import pack_results

    pack_results.pack(out)  # log.txt into raw.tar.gz, as every folder keeps its raw output
    print(f"suite_time: {shown} (exit {run['exit']}) -> {out}", flush=True)
    return 0 if run["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
