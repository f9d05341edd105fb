"""What reporting a batch's costs costs: a loader built with costs (feedrate/costs.py) against
the same loader without, in alternating rounds, on data read from memory (where the reports'
few microseconds a batch weigh most) with and without a training step; and what timing one
batch adds, the least of several repeats (which a busy machine cannot make smaller).

    python benchmarks/costs_overhead.py --out benchmarks/results/<folder>

Each round runs every setting both ways over the same batches, in one process; the verdict
is the paired ratio of samples/s (with costs / without) by the one rule (feedrate.stats).
Writes results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import time
import timeit
from datetime import datetime
from pathlib import Path

import common
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from feedrate import costs as costs_module
from feedrate import stats
from feedrate.costs import CostedCollate, TimedReads, split
from feedrate.environment import git_commit
from feedrate.hardware import detect
from feedrate.threads import ThreadLoader

TARGET = 0.99  # with costs / without: at most 1% of the rate
WINDOW_S = 2.0


class InMemory(Dataset):
    """Samples already in memory: a 3x32x32 image and its label, read in microseconds."""

    def __init__(self, n: int = 1_000_000, distinct: int = 4096) -> None:
        self.n = n
        self.images = torch.randint(0, 255, (distinct, 3, 32, 32), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.images[i % len(self.images)], i % 10


def loader(setting: str, costs: bool, batch_size: int):
    data = InMemory()
    collate = CostedCollate(default_collate) if costs else default_collate
    if setting.startswith("threads"):
        sampler = torch.utils.data.SequentialSampler(data)
        return ThreadLoader(
            data, num_workers=4, collate_fn=collate, sampler=sampler, batch_size=batch_size
        )
    workers = 2 if setting.startswith("processes") else 0
    read = TimedReads(data) if costs else data
    return DataLoader(read, batch_size=batch_size, num_workers=workers, collate_fn=collate)


def measure(setting: str, costs: bool, step: torch.nn.Module | None, batch_size: int) -> float:
    """Samples a second over ``WINDOW_S``, after the first 8 batches (the workers' start)."""
    n, began = 0, None
    batches = loader(setting, costs, batch_size)  # held: a thread loader ends with its object
    for i, item in enumerate(batches):
        if i == 8:
            n, began = 0, time.perf_counter()
        batch, _ = split(item)
        if step is not None:
            step(batch[0].float()).sum().backward()
        n += len(batch[1])
        if began is not None and time.perf_counter() - began >= WINDOW_S:
            break
    seconds = time.perf_counter() - began
    if hasattr(batches, "end_workers"):
        batches.end_workers()
    return n / seconds


def per_batch_us(timed: bool, repeats: int = 7, number: int = 2000) -> float:
    """A batch of 64 samples read from memory and collated, in microseconds (the least of
    ``repeats``, which a busy machine cannot make smaller): timed, or as a plain DataLoader
    worker reads it."""
    data, indices = InMemory(), list(range(64))
    if timed:
        read, collate = TimedReads(data), CostedCollate(default_collate)

        def one():
            costs_module._own.next_at = 0.0  # due: every batch timed
            return collate(read.__getitems__(indices))
    else:

        def one():
            return default_collate([data[i] for i in indices])

    return min(timeit.repeat(one, repeat=repeats, number=number)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 64))
    cases = {
        "main process, no step": ("main", None, 64),
        "2 processes, no step": ("processes", None, 64),
        "4 threads, no step": ("threads", None, 64),
        "main process, a linear step": ("main", net, 64),
        "2 processes, a linear step": ("processes", net, 64),
        "4 threads, a linear step": ("threads", net, 64),
    }
    rounds: dict[str, dict[str, list[float]]] = {c: {"with": [], "without": []} for c in cases}
    for r in range(args.rounds):
        for case, (setting, step, batch) in cases.items():
            order = common.alternating(("with", "without"), r)
            for side in order:
                rounds[case][side].append(measure(setting, side == "with", step, batch))
            print(
                f"round {r + 1} {case}: {rounds[case]['with'][-1]:,.0f} with costs,"
                f" {rounds[case]['without'][-1]:,.0f} without",
                flush=True,
            )
    plain_us, timed_us = per_batch_us(False), per_batch_us(True)
    extra_us = timed_us - plain_us
    bound = extra_us * 1e-6 / costs_module.REPORT_EVERY_S  # of a reading thread's time
    print(
        f"a batch: {plain_us:.1f} us, timed {timed_us:.1f} us (+{extra_us:.1f} us, once"
        f" every {costs_module.REPORT_EVERY_S * 1000:.0f} ms a thread: {bound:.3%} of it)"
    )
    hw = detect()
    results = {
        "command": f"python benchmarks/costs_overhead.py --rounds {args.rounds} --out {args.out}",
        "commit": git_commit(),
        "date": datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": hw.cpu_model, "cores": hw.logical_cores},
        "rounds": rounds,
        "per_batch_us": {"plain": plain_us, "timed": timed_us, "extra": extra_us},
        "report_every_s": costs_module.REPORT_EVERY_S,
        "bound_share_of_a_thread": bound,
    }
    lines = [
        "| case | with costs / without | target >= 0.99 |",
        "|---|---|---|",
    ]
    for case, sides in rounds.items():
        c = stats.compare(sides["with"], sides["without"]).as_dict()
        verdict = stats.against(c, TARGET)
        lines.append(
            f"| {case} | {c['ratio']:.3f}x [{c['low']:.3f}, {c['high']:.3f}] | {verdict} |"
        )
        results.setdefault("ratios", {})[case] = {**c, "verdict": verdict}
    lines += [
        "",
        f"A batch of 64 read from memory and collated: {plain_us:.1f} us; timed: {timed_us:.1f} us"
        f" (+{extra_us:.1f} us, the least of 7 repeats). A reading thread times one batch every"
        f" {costs_module.REPORT_EVERY_S * 1000:.0f} ms at most: at most {bound:.3%} of its time.",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / "results.json", results)
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
