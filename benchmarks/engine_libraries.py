"""Which library runs a loader's workers as threads: torchdata.nodes or SPDL, measured.

Each contestant reads the same dataset, in the same shuffled order, into batches of the same
size made by the same collate function, with the same number of workers; nothing trains (the
loader alone is measured). A run is a fresh process, so memory is the contestant's own: peak
PSS of the process and its children, read every 0.2 s. Rounds alternate the contestants, and
reverse every other round, so drift hits all alike; ratios are over the paired rounds.

    python benchmarks/engine_libraries.py --out benchmarks/results/<folder>

Contestants (N workers each):
  process            torch's DataLoader, N worker processes (fork), prefetch 2 batches each
  nodes_batch        torchdata.nodes: ParallelMapper(method="thread") over batches of indices,
                     a thread loads a whole batch, as a DataLoader worker does
  nodes_batch_collate_apart
                     torchdata.nodes: as nodes_batch, but a thread reads the batch's samples
                     and one thread apart collates them, ahead of the loop
  nodes_sample       torchdata.nodes: ParallelMapper over indices, then Batcher and the collate
  spdl_sample        SPDL: PipelineBuilder.pipe over indices (N threads), aggregate, collate
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import common
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

EPOCHS_OF = 4000  # batches: the order is at least this long
CONTESTANTS = ("process", "nodes_batch", "nodes_batch_collate_apart", "nodes_sample", "spdl_sample")
WORKLOADS = {
    # 10 ms of latency a sample (storage, network): waiting holds no core
    "latency": {"overrides": ["dataset=synthetic", "dataset.io_latency_ms=10"], "workers": 32},
    # JPEG decode and augmentation (PIL and torchvision: C code that may release the GIL)
    "photos": {"overrides": ["dataset=photos"], "workers": 4},
}


def build(workload: str):
    import feedrate
    from feedrate.dataset import build_dataset

    cfg = feedrate.compose(WORKLOADS[workload]["overrides"], config_dir=str(ROOT / "conf"))
    return build_dataset(cfg.dataset), cfg.loader.batch_size


def batches(kind: str, dataset, batch_size: int, workers: int, seed: int = 0):
    import torch
    from torch.utils.data import DataLoader, RandomSampler
    from torch.utils.data._utils.collate import default_collate

    # epochs one after another, reshuffled, longer than any run reads: no epoch end measured
    shuffle = torch.Generator().manual_seed(seed)
    order = []
    while len(order) < EPOCHS_OF * batch_size:
        order += list(RandomSampler(dataset, generator=shuffle))
    if kind == "process":
        return iter(
            DataLoader(
                dataset,
                batch_size=batch_size,
                sampler=order,
                num_workers=workers,
                prefetch_factor=2,
                multiprocessing_context="fork",
                collate_fn=default_collate,
            )
        )
    plan = [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]

    def load_batch(indices):
        return default_collate([dataset[i] for i in indices])

    if kind.startswith("nodes"):
        import torchdata.nodes as tn

        if kind == "nodes_batch":
            node = tn.ParallelMapper(
                tn.IterableWrapper(plan), load_batch, num_workers=workers, method="thread"
            )
        elif kind == "nodes_batch_collate_apart":
            samples = tn.ParallelMapper(
                tn.IterableWrapper(plan),
                lambda indices: [dataset[i] for i in indices],
                num_workers=workers,
                method="thread",
            )
            node = tn.Mapper(samples, default_collate)
        else:
            samples = tn.ParallelMapper(
                tn.IterableWrapper(order), dataset.__getitem__, num_workers=workers, method="thread"
            )
            node = tn.Mapper(tn.Batcher(samples, batch_size, drop_last=True), default_collate)
        return iter(tn.Loader(tn.Prefetcher(node, prefetch_factor=2 * workers)))
    from spdl.pipeline import PipelineBuilder

    pipeline = (
        PipelineBuilder()
        .add_source(order)
        .pipe(dataset.__getitem__, concurrency=workers)
        .aggregate(batch_size, drop_last=True)
        .pipe(default_collate)
        .add_sink(2 * workers)
        .build(num_threads=workers)
    )
    return _spdl(pipeline)


def _spdl(pipeline):
    with pipeline.auto_stop():
        yield from pipeline.get_iterator()


def one(kind: str, workload: str, seconds: float, warmup_s: float) -> dict:
    """Run in this process: the samples per second after ``warmup_s`` of reading (the
    workers started and their queues filled)."""
    dataset, batch_size = build(workload)
    workers = WORKLOADS[workload]["workers"]
    it = batches(kind, dataset, batch_size, workers)
    started = time.perf_counter()
    next(it)
    first = time.perf_counter() - started
    while time.perf_counter() - started < warmup_s:
        next(it)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        batch = next(it)
        n += len(batch[0])
    elapsed = time.perf_counter() - t0
    # end the workers before the interpreter does: a thread killed at exit inside C++ code
    # (a JPEG decode) aborts the process ("terminate called without an active exception")
    del it
    gc.collect()
    return {"samples_per_sec": n / elapsed, "samples": n, "first_batch_s": first}


def measure(kind: str, workload: str, seconds: float, warmup_s: float) -> dict:
    """One fresh process for one run; its tree's peak PSS read beside it."""
    cmd = [sys.executable, __file__, "--one", kind, "--workload", workload]
    cmd += ["--seconds", str(seconds), "--warmup-seconds", str(warmup_s)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0.0]

    def watch() -> None:
        from feedrate.monitor import _tree_memory

        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                peak[0] = max(peak[0], _tree_memory(root)[0])
            except psutil.Error:
                pass
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = proc.communicate(timeout=600)
    watcher.join()
    if proc.returncode != 0:
        return {"error": err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"}
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_pss_mb"] = peak[0] / 2**20
    return result


def plot(folder: Path) -> Path:
    """``engines.png`` beside ``results.json``: each contestant's samples/s and peak PSS per
    round, a panel per workload and figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((folder / "results.json").read_text())
    runs = [r for r in data["runs"] if "error" not in r]
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    kinds = [k for k in CONTESTANTS if any(r["contestant"] == k for r in runs)]
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7), squeeze=False)
    for col, workload in enumerate(workloads):
        for row, (key, label) in enumerate(
            [("samples_per_sec", "samples/s"), ("peak_pss_mb", "peak PSS (MB)")]
        ):
            ax = axes[row][col]
            for i, kind in enumerate(kinds):
                values = [
                    r[key] for r in runs if r["workload"] == workload and r["contestant"] == kind
                ]
                ax.scatter([i] * len(values), values, s=25)
            ax.set_xticks(range(len(kinds)), kinds, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{workload}: {label}, every round", fontsize=9)
    fig.suptitle(f"loader alone, {data['machine'].split(' |')[0]}, commit {data['commit'][:7]}")
    fig.tight_layout()
    out = folder / "engines.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=CONTESTANTS, help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=list(WORKLOADS))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path, help="draw engines.png from a folder's results.json")
    args = parser.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    if args.one:
        print(json.dumps(one(args.one, args.workload, args.seconds, args.warmup_seconds)))
        return 0
    from feedrate import stats
    from feedrate.environment import git_commit
    from feedrate.hardware import detect

    def ratio(rows: list[dict], kind: str, key: str) -> str:
        """A rate's ratio with its verdict; megabytes' bare (less is better there, and the
        verdict words are for rates)."""
        side = {x["round"]: x[key] for x in rows if x["contestant"] == kind}
        base = {x["round"]: x[key] for x in rows if x["contestant"] == "process"}
        c = stats.compare(side, base)
        if c is None:
            return "no paired rounds"
        if key == "samples_per_sec":
            return c.describe()
        return f"{c.ratio:.2f}x [{c.low:.2f}, {c.high:.2f}] ({min(c.rounds)} rounds)"

    runs = []
    machine = detect().short()
    print(f"machine: {machine}", flush=True)
    for workload in args.workloads:
        for r in range(args.rounds):
            order = common.alternating(CONTESTANTS, r)
            for kind in order:
                res = measure(kind, workload, args.seconds, args.warmup_seconds)
                runs.append({"workload": workload, "round": r, "contestant": kind, **res})
                shown = (
                    f"{res['samples_per_sec']:,.0f} samples/s,"
                    f" peak PSS {res['peak_pss_mb']:,.0f} MB"
                    if "error" not in res
                    else f"failed: {res['error']}"
                )
                print(f"[{workload}] round {r + 1}/{args.rounds} {kind:>13}: {shown}", flush=True)
    summary = {}
    for workload in args.workloads:
        rows = [x for x in runs if x["workload"] == workload and "error" not in x]
        summary[workload] = {
            kind: {
                "samples_per_sec_vs_process": ratio(rows, kind, "samples_per_sec"),
                "peak_pss_vs_process": ratio(rows, kind, "peak_pss_mb"),
            }
            for kind in CONTESTANTS
            if kind != "process"
        }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        data = {"command": " ".join(sys.argv), "commit": git_commit(), "machine": machine}
        data["runs"] = runs
        common.write_json(args.out / "results.json", {**data, "summary": summary})
        plot(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
