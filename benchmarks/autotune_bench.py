"""loader=autotune against the sweep's tuned preset and the recipe: fixed-length runs.

    python benchmarks/autotune_bench.py                          # synthetic, photos, tiles
    python benchmarks/autotune_bench.py --workloads synthetic --seconds 120 --rounds 2
    python benchmarks/autotune_bench.py --skip-sweep --rounds 5 --contestants autotune tuned

For each workload: the default loader sweep writes its preset (bench_<workload>); then, in
alternating rounds, three runs of the same length (`--seconds` of training, by
`trainer.max_seconds`): `loader=autotune` searching from scratch (it does not start from the
preset: `trainer.autotune.from_preset=false`), the sweep's preset, and `loader=recipe`. Each run
is a fresh `python train.py`. Reported, with paired intervals over the rounds:

- samples trained per second of the whole run, tuning included (autotune / tuned >= 0.9:
  tuning costs at most 10%; autotune / recipe significantly above 1 where tuned / recipe is);
- the tuning phase's seconds (<= 60 here) and the chosen setting's steady rate against the
  tuned preset's (>= 0.9).

A round with a run that other processes slowed (the run's own `metrics.noise`: they kept more
than a quarter of its cores busy) is run again, once, as the sweep measures a noisy trial
again; the second round counts, flagged if it is noisy too, and the first stays in
results.json as `replaced`.

Writes results.json (after every round), table.md and autotune.png under --out.
`--summarise OUT` redoes OUT's tables; `--pool OUT1 OUT2 --out OUT` gives the verdicts over
the rounds of benches that ran the same code and presets (each round stays a side-by-side
pair; more of them narrow the interval).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from feedrate import stats
from feedrate.environment import git_commit
from feedrate.hardware import detect

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from loader_bench import WORKLOADS, preset_name, run_sweep  # noqa: E402

DEFAULT_WORKLOADS = ["synthetic", "photos", "tiles"]
CONTESTANTS = ("autotune", "tuned", "recipe")
TUNING_COST = 0.9  # autotune / tuned, samples of the whole run
CHOICE = 0.9  # the chosen setting's steady rate / the tuned preset's
TUNING_SECONDS = 60.0


def loader_args(name: str, workload: str, args: argparse.Namespace) -> list[str]:
    if name == "autotune":
        return [
            "loader=autotune",
            "trainer.autotune.from_preset=false",
            "trainer.autotune.write_preset=false",
        ]
    if name == "tuned":
        return [f"loader={preset_name(workload, args)}"]
    return ["loader=recipe"]


def run_one(
    name: str, workload: str, r: int, out: Path, args: argparse.Namespace, again: bool = False
) -> dict:
    run_dir = out / workload / f"round{r}_{name}{'_again' if again else ''}"
    cmd = [
        sys.executable,
        "train.py",
        *WORKLOADS[workload],
        *loader_args(name, workload, args),
        "trainer.max_steps=null",
        "trainer.epochs=100000",
        f"trainer.max_seconds={args.seconds}",
        "trainer.save_checkpoint=false",
        "trainer.progress=false",
        *args.extra,
        f"hydra.run.dir={run_dir}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
    wall = time.perf_counter() - t0
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(f"[{workload}] {name} failed: see {run_dir / 'log.txt'}", flush=True)
        return {"name": name, "round": r, "ok": False, "wall_s": wall}
    m = json.loads((run_dir / "metrics.json").read_text())
    tuning = m.get("autotune") or {}
    row = {
        "name": name,
        "round": r,
        "ok": True,
        "command": " ".join(cmd[1:]),
        "wall_s": wall,
        "trained_samples": m["trained_samples"],
        "train_seconds": m["train_seconds"],
        "whole_run": m["trained_samples"] / m["train_seconds"],
        "steady": m["samples_per_sec"],
        "data_wait_frac": m["data_wait_frac"],
        "loader": m["run"]["loader"],
        "tuning_s": tuning.get("seconds"),
        "tuning_samples": tuning.get("samples_while_tuning"),
        "chosen": tuning.get("chosen"),
        "tried": [
            {**f["setting"], "samples_per_sec": f["samples_per_sec"], "failed": f["failed"]}
            for f in tuning.get("tried") or []
        ],
        "reason": tuning.get("reason"),
        "noise": m.get("noise") or [],
    }
    shown = f"{row['whole_run']:,.1f} samples/s over the run, steady {row['steady']:,.1f}"
    if tuning:
        shown += f"; tuned in {row['tuning_s']:.0f} s, chose {row['chosen']}"
    if row["noise"]:
        shown += f"; NOISY: {'; '.join(row['noise'])}"
    print(f"[{workload}] round {r + 1} {name}: {shown}", flush=True)
    return row


def counted(x: dict) -> bool:
    """A run that counts: it ran, and its round was not run again for noise."""
    return x["ok"] and not x.get("replaced")


def run_round(r: int, workload: str, out: Path, args: argparse.Namespace) -> list[dict]:
    """Round ``r``'s runs (the order alternates between rounds); run again, once, where other
    processes slowed one of them (the first runs kept, ``replaced``)."""
    chosen = [n for n in CONTESTANTS if n in args.contestants]
    order = common.alternating(chosen, r)
    rows = [run_one(name, workload, r, out, args) for name in order]
    noisy = [x["name"] for x in rows if x.get("noise")]
    if not noisy:
        return rows
    print(f"[{workload}] round {r + 1}: {', '.join(noisy)} noisy: the round runs again", flush=True)
    for x in rows:
        x["replaced"] = True
    return rows + [run_one(name, workload, r, out, args, again=True) for name in order]


def compare(rows: list[dict], a: str, b: str, key: str) -> dict | None:
    def rounds(name: str) -> dict[int, float]:
        return {x["round"]: x[key] for x in rows if x["name"] == name and counted(x)}

    c = stats.compare(rounds(a), rounds(b))
    return c.as_dict() | {"text": c.describe()} if c is not None else None


def verdicts(
    rows: list[dict],
    recipe_target: float = 1.0,
    cost_target: float = TUNING_COST,
    tuning_seconds: float = TUNING_SECONDS,
) -> dict:
    """The ratios of the rounds, and the targets judged on their intervals; autotune /
    recipe against ``recipe_target`` (--recipe-target), autotune / tuned against
    ``cost_target`` (--cost-target), the tuning's seconds against ``tuning_seconds``."""

    def median(name: str, key: str) -> float | None:
        values = [x[key] for x in rows if x["name"] == name and counted(x) and x[key] is not None]
        return statistics.median(values) if values else None

    cost = compare(rows, "autotune", "tuned", "whole_run")
    versus_recipe = compare(rows, "autotune", "recipe", "whole_run")
    tuned_recipe = compare(rows, "tuned", "recipe", "whole_run")
    choice = compare(rows, "autotune", "tuned", "steady")
    tuning_s = [x["tuning_s"] for x in rows if x["name"] == "autotune" and counted(x)]
    # What the tuning phase cost: the seconds it would have taken the tuned preset (its
    # steady rate that round) to train what the phase trained, against the phase's seconds
    steady = {x["round"]: x["steady"] for x in rows if x["name"] == "tuned" and counted(x)}
    lost = [
        x["tuning_s"] - x["tuning_samples"] / steady[x["round"]]
        for x in rows
        if x["name"] == "autotune" and counted(x) and x["round"] in steady and x["tuning_s"]
    ]
    ran_recipe = any(x["name"] == "recipe" for x in rows)
    return {
        "rerun": sorted({x["round"] + 1 for x in rows if x.get("replaced")}),
        "noisy": sorted({x["round"] + 1 for x in rows if counted(x) and x.get("noise")}),
        "lost_s": lost,
        "medians": {n: median(n, "whole_run") for n in CONTESTANTS},
        "autotune_vs_tuned": cost,
        "autotune_vs_recipe": versus_recipe,
        "tuned_vs_recipe": tuned_recipe,
        "choice_vs_tuned": choice,
        "tuning_s": tuning_s,
        "pass": {
            "cost": stats.against(cost, cost_target),  # by the interval, as every bench
            # None: the recipe was not among this run's contestants (--contestants)
            "ahead_of_recipe": stats.against(versus_recipe, recipe_target) if ran_recipe else None,
            "tuning_seconds": bool(tuning_s) and max(tuning_s) <= tuning_seconds,
            "choice": stats.against(choice, CHOICE),
        },
    }


def projected(lost_s: list[float], seconds: float, minutes: float = 5.0) -> str:
    """autotune / tuned for a run of ``minutes``, if the tuning phase loses what it lost here
    (the phase's cost is fixed; the rest of the run trains at the choice's rate)."""
    if not lost_s:
        return "-"
    lost = statistics.median(lost_s)
    return f"{lost:.0f} s; {1 - lost / (60 * minutes):.2f} for a {minutes:.0f}-minute run"


def mark(passed: bool | str | None) -> str:
    """A target's outcome in the table: by the interval (:func:`feedrate.stats.against`) for
    a ratio, else met or not; None where its contestant did not run."""
    said = {stats.MET: "met", stats.MISSED: "missed", stats.NOT_SHOWN: "not shown"}
    if isinstance(passed, str):
        return said.get(passed, passed)
    return "not run" if passed is None else "met" if passed else "missed"


def table(
    results: dict,
    seconds: float,
    recipe_target: float = 1.0,
    cost_target: float = TUNING_COST,
    tuning_seconds: float = TUNING_SECONDS,
) -> str:
    lines = [
        f"Runs of {seconds:.0f} s of training each (trainer.max_seconds), fresh processes;"
        " samples/s of the whole run (tuning included), median of the rounds; ratios are"
        " geometric means of the paired rounds with 95% intervals. A target on a ratio is met"
        " when the interval's low end reaches it, missed when its high end is below it, and"
        " not shown either way between (docs/benchmarks.md, one rule for every verdict).",
        "",
        f"| workload | autotune | tuned preset | recipe | autotune / tuned (>= {cost_target:g}) |"
        f" autotune / recipe (>= {recipe_target:g}) | tuned / recipe |"
        f" tuning s (<= {tuning_seconds:g}) |"
        " choice / tuned, steady"
        " (>= 0.9) | lost to tuning (tuned-preset seconds) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, res in results.items():
        v = res["verdicts"]

        def text(key: str, v: dict = v) -> str:
            return v[key]["text"] if v[key] else "-"

        ok = {k: mark(p) for k, p in v["pass"].items()}

        def median(name: str, m: dict = v["medians"]) -> str:
            return f"{m[name]:,.1f}" if m.get(name) is not None else "-"

        tuning = ", ".join(f"{s:.0f}" for s in v["tuning_s"] if s is not None) or "-"
        lines.append(
            f"| {workload} | {median('autotune')} | {median('tuned')} |"
            f" {median('recipe')} | {text('autotune_vs_tuned')} {ok['cost']} |"
            f" {text('autotune_vs_recipe')} {ok['ahead_of_recipe']} | {text('tuned_vs_recipe')} |"
            f" {tuning} {ok['tuning_seconds']} | {text('choice_vs_tuned')} {ok['choice']} |"
            f" {projected(v.get('lost_s') or [], seconds)} |"
        )
    notes = []
    for workload, res in results.items():
        for key, what in (
            ("rerun", "rounds run again, other processes having slowed a run of the first:"),
            ("noisy", "rounds counted though other processes slowed a run of them:"),
        ):
            if res["verdicts"].get(key):
                notes.append(f"- {workload}: {what} {', '.join(map(str, res['verdicts'][key]))}")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def plot(results: dict, path: Path) -> None:
    fig, ax = common.figure(figsize=(8, 4.5))
    width = 0.25
    names = list(results)
    for i, name in enumerate(CONTESTANTS):
        for j, workload in enumerate(names):
            rows = results[workload]["rows"]
            values = [x["whole_run"] for x in rows if x["name"] == name and counted(x)]
            if not values:
                continue
            x = j + (i - 1) * width
            common.rounds_bar(ax, x, values, width, f"C{i}", name if j == 0 else "")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("samples/s over the whole run (tuning included)")
    ax.set_title("loader=autotune against the sweep's preset and the recipe (dots: rounds)")
    ax.legend()
    common.save(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--seconds", type=float, default=300.0, help="training time of a run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--contestants",
        nargs="+",
        default=list(CONTESTANTS),
        choices=CONTESTANTS,
        help="which runs each round holds (autotune and tuned at least: more rounds in the"
        " same time where autotune / recipe is already settled)",
    )
    parser.add_argument(
        "--recipe-target",
        type=float,
        default=1.0,
        help="autotune / recipe must reach this over the interval (3 for 150 s runs on"
        " latency-bound data, 0.95 for 60 s ones)",
    )
    parser.add_argument(
        "--cost-target",
        type=float,
        default=TUNING_COST,
        help="autotune / tuned, samples of the whole run, must reach this (0.95 for the tuner"
        " that predicts from what a sample costs)",
    )
    parser.add_argument(
        "--tuning-seconds",
        type=float,
        default=TUNING_SECONDS,
        help="the tuning must choose within this many seconds (15 for the tuner that predicts)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--skip-sweep", action="store_true", help="reuse conf/loader/bench_*")
    parser.add_argument(
        "--reuse-presets",
        action="store_true",
        help="sweep only the workloads with no conf/loader/bench_<workload>.yaml (make bench:"
        " the loader stage's, at the same commit)",
    )
    parser.add_argument(
        "--extra", nargs="*", default=[], help="overrides for every contestant's run, not the sweep"
    )
    parser.add_argument("--sweep-extra", nargs="*", default=[], help="overrides for the sweep")
    parser.add_argument(
        "--summarise", type=Path, default=None, metavar="OUT", help="only redo OUT's tables"
    )
    parser.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        default=None,
        metavar="OUT",
        help="the verdicts over the rounds of several benches of the same code and presets,"
        " written to --out",
    )
    args = parser.parse_args()
    if "autotune" not in args.contestants or len(set(args.contestants)) < 2:
        named = " ".join(args.contestants)
        parser.error(f"--contestants {named}: autotune and another are needed")
    if args.summarise:
        return summarise(args.summarise.resolve(), args)
    if args.pool:
        if args.out is None:
            parser.error("--pool: name the folder for the pooled tables with --out")
        try:
            return pool([p.resolve() for p in args.pool], args.out.resolve(), args)
        except ValueError as e:
            parser.error(f"--pool: {e}")
    args.fresh, args.preset_name = False, None  # what loader_bench.run_sweep reads

    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or ROOT / "benchmarks" / "results" / f"{stamp}_autotune").resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/autotune_bench.py " + " ".join(sys.argv[1:])
    machine = detect().short()
    (out / "command.txt").write_text(f"{command}\ncommit {git_commit()}\nmachine {machine}\n")
    print(f"machine: {machine}\noutput: {out}", flush=True)
    results = {}
    for workload in args.workloads:
        preset = ROOT / "conf" / "loader" / f"bench_{workload}.yaml"
        reused = args.skip_sweep or (args.reuse_presets and preset.exists())
        if reused:
            print(f"[{workload}] no sweep: {preset.relative_to(ROOT)} as it is", flush=True)
        # the default sweep: --extra is the contestants' runs', --sweep-extra the sweep's
        sweeping = argparse.Namespace(**{**vars(args), "extra": []})
        sweep_s = None if reused else run_sweep(workload, out, sweeping)["total"]
        rows: list[dict] = []
        for r in range(args.rounds):  # saved after every round: a cut-short bench still counts
            rows += run_round(r, workload, out, args)
            results[workload] = {
                "sweep_s": sweep_s,
                "rows": rows,
                "verdicts": verdicts(
                    rows, args.recipe_target, args.cost_target, args.tuning_seconds
                ),
            }
            common.write_json(out / "results.json", results)
    return summarise(out, args)


RAN = ("src", "conf", "train.py")  # what a bench's runs are made of


def source_tree(commit: str) -> str:
    """The trees of ``RAN`` at ``commit``: benches of commits that differ in results, docs or
    the bench itself alone ran the same code."""
    return subprocess.run(
        ["git", "rev-parse", *(f"{commit}:{path}" for path in RAN)],
        cwd=ROOT,
        text=True,
        capture_output=True,
    ).stdout.strip()


def pool(outs: list[Path], out: Path, args: argparse.Namespace) -> int:
    """One results.json in ``out`` from the rounds of ``outs``, renumbered in turn, then its
    tables: each round stays a side-by-side pair, so more of them narrow the interval. Refused
    unless every bench ran the same code (src/, conf/ and train.py at its commit) and, per
    workload, the same preset (its bench_<workload>.yaml, where the folders keep one)."""
    commits, trees, machines, pooled = [], set(), [], {}
    for folder in outs:
        ran = folder / "command.txt"
        if not (folder / "results.json").exists() or not ran.exists():
            raise ValueError(f"{folder} has no results.json and command.txt: not a bench's output")
        commit = ran.read_text().splitlines()[1].removeprefix("commit ").strip()
        commits.append(commit)
        machines.append(ran_on(folder))
        trees.add(source_tree(commit) or f"unknown ({commit})")
    if len(trees) > 1:
        raise ValueError(
            f"the benches ran different code (commits {', '.join(commits)}): pool only benches"
            f" whose {', '.join(RAN)} are the same"
        )
    for folder in outs:
        for workload, res in json.loads((folder / "results.json").read_text()).items():
            rows = pooled.setdefault(workload, {"sweep_s": None, "rows": []})["rows"]
            offset = 1 + max((x["round"] for x in rows), default=-1)
            rows += [{**x, "round": x["round"] + offset, "from": folder.name} for x in res["rows"]]
    for workload, res in pooled.items():
        kept = [
            f / f"bench_{workload}.yaml" for f in outs if (f / f"bench_{workload}.yaml").exists()
        ]
        if len({p.read_text() for p in kept}) > 1:
            raise ValueError(f"{workload}: the tuned presets differ ({', '.join(map(str, kept))})")
        res["verdicts"] = verdicts(
            res["rows"], args.recipe_target, args.cost_target, args.tuning_seconds
        )
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "results.json", pooled)
    command = "python benchmarks/autotune_bench.py " + " ".join(sys.argv[1:])
    machine = " + ".join(dict.fromkeys(machines))  # each round's pair ran on one of them
    (out / "command.txt").write_text(f"{command}\ncommit {', '.join(commits)}\nmachine {machine}\n")
    return summarise(out, args)


def ran_on(out: Path) -> str:
    """The machine OUT's runs ran on: command.txt's, else (a bench from before it kept one)
    the one its table.md names, else this one."""
    for name, prefix in (("command.txt", "machine "), ("table.md", "Machine: ")):
        lines = (out / name).read_text().splitlines() if (out / name).exists() else []
        found = [line.removeprefix(prefix) for line in lines if line.startswith(prefix)]
        if found:
            return found[0]
    return detect().short()


def summarise(out: Path, args: argparse.Namespace) -> int:
    """table.md and autotune.png from OUT/results.json (the verdicts computed again)."""
    results = json.loads((out / "results.json").read_text())
    for workload, res in results.items():
        for x in res["rows"]:  # results from before runs recorded their noise
            metrics = out / workload / f"round{x['round']}_{x['name']}" / "metrics.json"
            if "noise" not in x and x["ok"] and metrics.exists():
                x["noise"] = json.loads(metrics.read_text()).get("noise") or []
        res["verdicts"] = verdicts(
            res["rows"], args.recipe_target, args.cost_target, args.tuning_seconds
        )
    common.write_json(out / "results.json", results)
    ran = (out / "command.txt").read_text().splitlines() if (out / "command.txt").exists() else []
    command, commit = (ran + ["?", "commit ?"])[:2]
    header = f"Command: `{command}`\n{commit.capitalize()}\nMachine: {ran_on(out)}\n\n"
    text = table(results, args.seconds, args.recipe_target, args.cost_target, args.tuning_seconds)
    (out / "table.md").write_text(header + text)
    plot(results, out / "autotune.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
