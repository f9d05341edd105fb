"""A pytest plugin: each test's wall time and the whole machine's CPU seconds meanwhile (from
/proc/stat, so a test's subprocesses and their workers count), one JSON line per test.
Meaningful one test at a time (no -n):

    PYTHONPATH=benchmarks/tools pytest -m "" -p cpuprof -q -p no:cacheprovider
"""

import json
import os
import time

import pytest


def _cpu() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")  # user nice sys irq


_out = open(os.environ.get("CPUPROF_OUT", "per_test_cpu.jsonl"), "a")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    c0, t0 = _cpu(), time.monotonic()
    yield
    row = {"test": item.nodeid, "wall": time.monotonic() - t0, "cpu": _cpu() - c0}
    _out.write(json.dumps(row) + "\n")
    _out.flush()
