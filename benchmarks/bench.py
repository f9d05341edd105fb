"""``make bench``: the headline figures of the code as it is, in about 33 minutes on 2 cores.

    python benchmarks/bench.py              # make bench: the headline, three folders
    python benchmarks/bench.py --full       # make bench-full: every workload, hours
    python benchmarks/bench.py --dry-run    # the commands, nothing run

Each stage is one bench script with its arguments, and writes one folder under
``benchmarks/results/`` named ``<date>_<machine>-bench-<stage>`` (``-b``, ``-c``... where that
name is taken: a bench run again is a new row, never a replacement):

- ``loader``: the default loader sweep from scratch, timed, on a latency-bound workload
  (``synthetic_loader``: 10 ms of I/O a sample, loader only) and a decode-bound one (``photos``:
  JPEG decoding on the cores the step uses), then its preset against PyTorch's defaults, the
  usual recipe and a small grid in alternating rounds (``loader_bench.py``);
- ``autotune``: ``loader=autotune`` from scratch against the sweep's preset and the recipe,
  whole runs, on ``photos`` (the loader stage's preset) and ``docs`` (held out from every
  rule of the tuners; its own sweep first) (``autotune_bench.py``);
- ``engine``: thread workers against worker processes, each at its best as the sweep finds
  it, on an in-memory catalog (``engine_bench.py``).

After each stage the presets its sweeps wrote move from ``conf/loader/`` into its folder, the
folder gets a README (the command, the machine, the commit, the dates) and its raw runs go
into ``raw.tar.gz``; at the end the README's and docs' generated tables are written again
from the results. Commit the folders and the tables together.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))


@dataclass(frozen=True)
class Stage:
    name: str
    script: str
    args: tuple[str, ...]
    what: str  # one line of the folder's README

    @property
    def workloads(self) -> list[str]:
        if "--workloads" not in self.args:
            return []
        after = self.args[self.args.index("--workloads") + 1 :]
        return list(
            after[: next((i for i, a in enumerate(after) if a.startswith("-")), len(after))]
        )

    def command(self, out: Path) -> list[str]:
        return [f"benchmarks/{self.script}", *self.args, "--out", str(out.relative_to(ROOT))]


HEADLINE = (
    Stage(
        "loader",
        "loader_bench.py",
        tuple(
            "--workloads synthetic_loader photos --repeats 3 --seconds 3 --grid 8 32"
            " --prefetch 2 --grid-seconds 3 --steady-seconds 0 --no-side-rows --no-ceilings"
            " --baselines default recipe".split()
        ),
        "the default loader sweep, timed, on a latency-bound workload (synthetic_loader) and a"
        " decode-bound one (photos), then its preset against `default`, `recipe` and a grid"
        " of 8 and 32 workers in 3 alternating rounds (no ceilings, no `cpu_capped`)",
    ),
    Stage(
        "autotune",
        "autotune_bench.py",
        tuple(
            "--workloads photos docs --reuse-presets --contestants autotune tuned recipe"
            " --rounds 3 --seconds 40 --recipe-target 0.95 --cost-target 0.95"
            " --tuning-seconds 15 --extra trainer.steady_state=false trainer.warmup_steps=5"
            " trainer.window_steps=5".split()
        ),
        "`loader=autotune` from scratch against the sweep's preset and `recipe`, 40 s runs"
        " in 3 alternating rounds, on photos (the loader stage's preset) and docs (held out;"
        " its own sweep first); each run's warm-up its first 5 steps, its windows 5 steps or"
        " a step a worker (every contestant alike: the whole run counts every sample)",
    ),
    Stage(
        "engine",
        "engine_bench.py",
        tuple("--workloads catalog --rows process thread --repeats 3 --seconds 2".split()),
        "thread workers against worker processes, each at its best as its own sweep finds it"
        " (sweep.engines=[process], then [thread]), on the in-memory catalog, in 3 alternating"
        " rounds",
    ),
)

FULL = (
    Stage("loader-full", "loader_bench.py", (), "every CPU workload of loader_bench.py"),
    Stage("autotune-full", "autotune_bench.py", (), "autotune_bench.py's default workloads"),
    Stage("engine-full", "engine_bench.py", (), "engine_bench.py's default workloads"),
)


def machine_slug() -> str:
    """``cpu-2core-epyc``, ``h200-16core``: the folder names' machine."""
    from feedrate.hardware import detect

    fp = detect()
    words = fp.cpu_model.lower().replace("(r)", "").split()
    family = next((w for w in words if w in ("epyc", "xeon", "ryzen", "core", "neoverse")), "")
    family = family or (words[1] if len(words) > 1 else "cpu")
    device = fp.gpu_name.split()[-1].lower() if fp.gpu_count and fp.gpu_name else "cpu"
    return (
        f"{device}-{fp.usable_cores:g}core-{family}"
        if device == "cpu"
        else f"{device}-{fp.usable_cores:g}core"
    )


def folder_for(name: str, day: str, machine: str) -> Path:
    """A new folder's path, ``<day>_<machine>-<name>``: ``-b``, ``-c``... after a name
    already taken (a run again is a new row)."""
    base = RESULTS / f"{day}_{machine}-{name}"
    path, suffix = base, "b"
    while path.exists():
        path = base.with_name(f"{base.name}-{suffix}")
        suffix = chr(ord(suffix) + 1)
    return path


def readme(stage: Stage, out: Path, began: datetime, ended: datetime) -> str:
    from feedrate.environment import git_commit
    from feedrate.hardware import detect

    command = " ".join(["python", *stage.command(out)])
    minutes = (ended - began).total_seconds() / 60
    return (
        f"# make bench, {stage.name} stage, at {git_commit()[:8]}\n\n"
        f"What: {stage.what} (`benchmarks/bench.py`, `make bench`).\n\n"
        f"Command: `{command}` (`command.txt`).\n\n"
        f"Machine: {detect().short()}.\n\n"
        f"Commit: {git_commit()}.\n\n"
        f"Date: {began:%Y-%m-%d %H:%M} to {ended:%H:%M} UTC ({minutes:.1f} min).\n\n"
        "The figures: the tables beside this file, and the generated tables of the README and"
        " docs/benchmarks.md, written from `results.json` (or `bench.json`); every run's"
        " folder in `raw.tar.gz`.\n"
    )


def command_txt(stage: Stage, out: Path) -> str:
    from feedrate.environment import git_commit
    from feedrate.hardware import detect

    command = " ".join(["python", *stage.command(out)])
    return f"{command}\ncommit {git_commit()}\nmachine {detect().short()}\n"


def presets_written(before: set[Path]) -> list[Path]:
    return sorted(set((ROOT / "conf" / "loader").glob("bench_*.yaml")) - before)


def run(stages: tuple[Stage, ...], dry_run: bool) -> int:
    import pack_results

    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    machine = machine_slug()
    started = time.monotonic()
    keep = set((ROOT / "conf" / "loader").glob("bench_*.yaml"))  # a user's, left alone
    for i, stage in enumerate(stages, 1):
        out = folder_for(f"bench-{stage.name}", day, machine)
        command = [sys.executable, *stage.command(out)]
        print(f"\n== make bench {i}/{len(stages)}: {stage.name} -> {out.relative_to(ROOT)}")
        print("   " + " ".join(["python", *stage.command(out)]), flush=True)
        if dry_run:
            continue
        began = datetime.now(timezone.utc)
        status = subprocess.run(command, cwd=ROOT).returncode
        ended = datetime.now(timezone.utc)
        out.mkdir(parents=True, exist_ok=True)
        if not (out / "command.txt").exists():  # what every folder says first (doc_tables)
            (out / "command.txt").write_text(command_txt(stage, out))
        for preset in presets_written(keep):  # the presets it measured stay with it
            if any(
                preset.stem.endswith(f"_{w}") or f"_{w}_" in preset.stem for w in stage.workloads
            ):
                shutil.copy(preset, out / preset.name)
        (out / "README.md").write_text(readme(stage, out, began, ended))
        pack_results.pack(out)
        took = (ended - began).total_seconds() / 60
        print(f"== {stage.name}: {took:.1f} min, exit {status}", flush=True)
        if status != 0:
            print(f"make bench: {stage.script} failed (exit {status}); {out} keeps what it"
                  " measured", file=sys.stderr)  # fmt: skip
            return status
    for preset in presets_written(keep):  # conf/loader/ as it was before the bench
        preset.unlink()
    if dry_run:
        return 0
    print(f"\nmake bench: {(time.monotonic() - started) / 60:.1f} min in all", flush=True)
    import doc_tables

    doc_tables.main(["--write"])
    print("commit benchmarks/results/ and the tables: git add benchmarks/results README.md docs")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every workload (make bench-full)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    return run(FULL if args.full else HEADLINE, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
