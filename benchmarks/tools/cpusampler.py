"""Each test's CPU on the whole machine, while the suite runs beside it:

    python3 benchmarks/tools/cpusampler.py STOPFILE OUT.json   # until STOPFILE exists

Every 0.5 s it reads each process's CPU (utime + stime, /proc/PID/stat) and adds what it used
since the last reading to the test that started it: PYTEST_CURRENT_TEST in the process's
environment as it was exec'd (a test's subprocesses inherit it; what they fork shares it).
The xdist workers themselves, and what they fork (the in-process tests' workers), have none:
they count as "other", with this sampler and the machine's other processes. A helper that
outlives the test that started it (a fork server and what it forks later, the PostgreSQL
server) counts for that test. Processes running before it starts count only from then on;
a process's last half second, and one that lives less, is missed: the figures are close, not
exact."""

from __future__ import annotations

import collections
import json
import os
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def describe(pid: int) -> tuple[str, str] | None:
    """(the test that started it, or "other"; its command line), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")[:150].decode(errors="replace")
    except OSError:
        return None
    for entry in env:
        if entry.startswith(b"PYTEST_CURRENT_TEST="):
            return entry.split(b"=", 1)[1].decode().rsplit(" ", 1)[0], cmd  # less "(call)"
    return "other", cmd


def unreadable(pid: int) -> tuple[str, str]:
    return "other", f"pid {pid}"


def cpu_of(pid: int) -> tuple[tuple[int, str], float] | None:
    """((pid, start time): one process, whatever reuses its pid later; its CPU seconds)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (pid, fields[19]), (int(fields[11]) + int(fields[12])) / TICK


def main(stop: str, out: str) -> None:
    seen: dict[tuple[int, str], float] = {}
    named: dict[tuple[int, str], tuple[str, str]] = {}
    by_test: collections.Counter[str] = collections.Counter()
    by_process: collections.Counter[tuple[str, int, str]] = collections.Counter()
    for entry in filter(str.isdigit, os.listdir("/proc")):  # what ran before: from now on
        reading = cpu_of(int(entry))
        if reading is not None:
            seen[reading[0]] = reading[1]
    while not os.path.exists(stop):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            reading = cpu_of(int(entry))
            if reading is None:
                continue
            key, cpu = reading
            if key not in named:
                named[key] = describe(key[0]) or unreadable(key[0])
            used = cpu - seen.get(key, 0.0)
            seen[key] = cpu
            if used > 0:
                test, cmd = named[key]
                by_test[test] += used
                by_process[(test, key[0], cmd)] += used
        time.sleep(0.5)
    result = {
        "bytest": by_test.most_common(),
        "perproc": [[*k, v] for k, v in by_process.most_common()],
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=0)


if __name__ == "__main__":
    main(*sys.argv[1:3])
