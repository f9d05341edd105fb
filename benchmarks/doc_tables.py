"""The results tables in the README and docs/benchmarks.md, written from the results they cite.

    python benchmarks/doc_tables.py --write   # write every generated block from its results
    python benchmarks/doc_tables.py           # check: exit 1, naming each block that differs

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- /generated -->`` in a
Markdown file; :data:`TABLES` says how each is written. Every block cites its folders under
``benchmarks/results/``, with the machine and the commit each was measured at, and says
"stale since <commit>: <file> changed" where a file its figures depend on changed after that
commit (:func:`depends_on`: the paths ``benchmarks/depends.py`` names for its bench, and its
workloads' own files): the figure is of older code, until it is measured again. Nothing in a
block is typed by hand; ``tests/test_results.py`` runs the check.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

from depends import DEPENDS_ON, SUITE
from loader_bench import TARGETS, WORKLOADS

ROOT = Path(__file__).resolve().parents[1]
HASH = re.compile(r"\b[0-9a-f]{7,40}(?:\+dirty)?\b")
# The code a result depends on where its bench names none (a folder of a bench that is gone,
# or with no command.txt): what measures and decides, the workloads, the entry point
MEASURED = ("src", "conf", "examples", "train.py")
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(
    r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.S
)


@functools.cache
def provenance(folder: str) -> tuple[str, str]:
    """(commit, machine) a folder's results were measured at: its command.txt's ``commit``
    and ``machine`` lines, else its bench.json's, else the first run's environment.json in
    its archive (a table.md's ``Machine:`` line first). A commit measured on a tree with
    uncommitted changes ends in ``+dirty``."""
    commit, machine = _provenance(folder)
    return commit, machine.replace("(R)", "").replace(" Processor", "").strip()


def _provenance(folder: str) -> tuple[str, str]:
    path = RESULTS / folder
    command = path / "command.txt"
    lines = command.read_text().splitlines()[1:3] if command.exists() else []
    said = dict(line.split(" ", 1) for line in lines if line.startswith(("commit ", "machine ")))
    if "commit" in said:  # a hash, or several (a pooled bench), with words after them
        said["commit"] = ", ".join(HASH.findall(said["commit"])) or "?"
    if "commit" in said and "machine" in said:
        return said["commit"], said["machine"].split(" | ")[0]
    if (path / "bench.json").exists():
        bench = json.loads((path / "bench.json").read_text())
        machine = bench["machine"]
        return bench["cwd_git"], f"{machine['cpu_model']}, {machine['usable_cores']} cores"
    results = path / "results.json"
    report = json.loads(results.read_text()) if results.exists() else {}
    commit = report.get("commit") or report.get("cwd_git")  # sweep_time.py's, host_start.py's
    if isinstance(report.get("machine"), str):  # a summary's words: "2-core AMD EPYC VM, ..."
        named = re.search(r"(AMD EPYC|Intel Xeon|H200|H100)", report["machine"])
        return commit or said.get("commit", "?"), named[1] if named else report["machine"]
    if isinstance(report.get("machine"), dict) and commit:
        return commit, report["machine"].get("cpu_model") or report["machine"].get("cpu", "?")
    table = path / "table.md"
    lines = table.read_text().splitlines() if table.exists() else []
    machine = [line for line in lines if line.startswith("Machine: ")]
    if "commit" in said and machine:  # autotune_bench.py's tables name it
        return said["commit"], machine[0].removeprefix("Machine: ").split(" | ")[0]
    env = {}
    if (path / "raw.tar.gz").exists():
        with tarfile.open(path / "raw.tar.gz") as archive:
            envs = [m for m in archive.getmembers() if m.name.endswith("environment.json")]
            env = json.load(archive.extractfile(envs[0])) if envs else {}
    if env:
        return said.get("commit", env.get("git_commit") or "?"), env["fingerprint"]["cpu_model"]
    readme = (path / "README.md").read_text().splitlines()  # the first benches: its words
    named = [line.removeprefix("Machine: ") for line in readme if line.startswith("Machine: ")]
    return said.get("commit", "?"), named[0].split(",")[0] if named else "not recorded"


# A measured figure, as prose types one: a ratio (0.91x, 16x), an interval ([0.88, 1.19]), a
# rate (1,234 samples/s), a range of ratios (0.90-0.95), a duration (435 s, 18 minutes, 2-3 h).
FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?x\b"
    r"|\[\d+(?:\.\d+)?, \d+(?:\.\d+)?\]"
    r"|\b\d[\d,]*(?:\.\d+)? samples/s"
    r"|\b\d+\.\d+-\d+\.\d+\b"
    r"|\b\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)? ?(?:s|min|minutes|h|hours?|seconds)\b"
)


def typed_figures(text: str) -> list[str]:
    """The lines of a Markdown text that type a measured figure by hand: outside the
    generated blocks, code (a value in code is a setting: `sweep.budget_s=120`) and link
    targets."""
    text = re.sub(r"<!-- generated:.*?<!-- /generated -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"\b\d{4}-\d\d-\d\d_[\w.-]+", "", text)  # a result folder's name
    return [line for line in text.splitlines() if FIGURE.search(line)]


def span(seconds: list[float]) -> str:
    """``6-8`` for the least and the most of ``seconds``, ``6`` where they round alike, ``-``
    for none."""
    if not seconds:
        return "-"
    low, high = f"{min(seconds):.0f}", f"{max(seconds):.0f}"
    return low if low == high else f"{low}-{high}"


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def short(commit: str) -> str:
    """``29bad68`` or ``29bad68 (dirty tree)`` (each, for a pooled bench's several);
    ``commit not recorded`` where the folder recorded none."""
    if commit == "?":
        return "commit not recorded"
    shown = []
    for one in commit.split(", "):
        sha, dirty = one.removesuffix("+dirty"), one.endswith("+dirty")
        shown.append(sha[:7] + (" (dirty tree)" if dirty else ""))
    return ", ".join(shown)


def workload_files(overrides: list[str]) -> list[str]:
    """The files a workload's overrides name: its dataset's and model's config (and the
    built-in dataset or model code they build), or the example module of its own dataset."""
    files = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key in ("dataset", "model"):
            files.append(f"conf/{key}/{value}.yaml")
            if value != "custom":
                files.append(f"src/feedrate/{key}.py")
        elif key.endswith("._target_") and value.startswith("examples."):
            files.append(value.rsplit(".", 1)[0].replace(".", "/") + ".py")
    return files


@functools.cache
def depends_on(folder: str) -> tuple[str, ...]:
    """The paths a folder's figures depend on: those ``benchmarks/depends.py`` names for the
    script its command.txt ran, and its workloads' own files (``--workloads``; every workload
    of ``benchmarks/loader_bench.py`` where it names none). :data:`MEASURED`, all the code,
    where no bench named its paths."""
    command = RESULTS / folder / "command.txt"
    words = command.read_text().splitlines()[0].split() if command.exists() else []
    script = next((Path(w).name for w in words if w.startswith("benchmarks/")), None)
    named = DEPENDS_ON.get(script) if script else None
    if named is None:
        return MEASURED
    if "--workloads" in words:
        at = words.index("--workloads") + 1
        ran = [w for w in words[at:] if not w.startswith("-")]
        ran = ran[: next((i for i, w in enumerate(ran) if w not in WORKLOADS), len(ran))]
    else:
        ran = list(WORKLOADS)
    files = [f for w in ran for f in workload_files(WORKLOADS[w])]
    return tuple(dict.fromkeys([*named, *files]))


def _under(file: str, path: str) -> bool:
    return file == path or file.startswith(path.rstrip("/") + "/")


@functools.cache
def staleness(commit: str, paths: tuple[str, ...] = MEASURED) -> str:
    """Empty when ``paths``, the code a result depends on, are in this tree as they were at
    ``commit`` (at each, for a pooled bench's several); else which file changed since. A tree
    measured with uncommitted changes is compared with its commit. The tree, not HEAD: tables
    written beside a change to src/ say so before it is committed, as a clean clone will."""
    if commit == "?":
        return ""
    for one in commit.split(", "):
        sha = one.removesuffix("+dirty")
        if git("cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
            return f"; its commit {sha[:7]} is not in this clone"
        changed = git("diff", "--name-only", sha, "--", *paths).stdout.split()
        if changed:  # named in the order of ``paths``: the bench's own first
            changed.sort(key=lambda f: next(i for i, p in enumerate(paths) if _under(f, p)))
            more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
            return f"; **stale since {sha[:7]}**: {changed[0]}{more} changed after it"
    return ""


def cite(folders: list[str], doc: Path, each_run: bool = False) -> str:
    """Where the figures come from, each folder linked from ``doc``, with its machine, its
    commit and whether the code changed since; ``each_run``: the rows name their own."""
    up = os.path.relpath(ROOT, doc.parent).replace(os.sep, "/") + "/"
    up = "" if up == "./" else up
    parts = []
    for folder in folders:
        link = f"[{folder}]({up}benchmarks/results/{folder}/)"
        if each_run:
            parts.append(link)
            continue
        commit, machine = provenance(folder)
        parts.append(f"{link} ({machine}, {short(commit)}{staleness(commit, depends_on(folder))})")
    return "Results: " + "; ".join(parts) + "."


def cited(rows: list[str], folders: list[str], doc: Path, each_run: bool = False) -> str:
    """A table's rows, then where its figures come from (:func:`cite`)."""
    return "\n".join(rows) + "\n\n" + cite(folders, doc, each_run) + "\n"


def number(x: float | None, digits: int = 0) -> str:
    return f"{x:,.{digits}f}" if x else "-"


def label(folder: str) -> str:
    """A folder as a row names it: its date and what it ran (``2026-12-02 2ranks-paired``)."""
    return folder.replace("_cpu-2core-", " ").replace("_cpu-2core", "")


def ratio(r: dict | float | None, digits: int = 2) -> str:
    """A ratio as every table shows one: ``1.23x [1.10, 1.31] win`` (the one rule's words)."""
    if r is None:
        return "-"
    if isinstance(r, str):  # what a row compared, said instead of a ratio
        return r
    if isinstance(r, (int, float)):  # the first benches kept a ratio of medians alone
        return f"{r:.2f}x (medians: no interval, no claim)"
    if r.get("verdict") == "same settings":  # one contestant under two names
        return "same settings"
    verdict = r["verdict"] if min(r["rounds"]) >= 3 else f"no claim ({min(r['rounds'])} rounds)"
    return f"{r['ratio']:.{digits}f}x [{r['low']:.{digits}f}, {r['high']:.{digits}f}] {verdict}"


def target(r: dict | None, goal: float) -> str:
    from feedrate import stats

    return f"{ratio(r)}, target {goal:g}: {stats.against(r, goal)}"


LOADER_BENCH = [  # (folder, its figures): every run of loader_bench.py, in the order run
    ("2026-11-30_cpu-2core", "bench.json"),
    ("2026-11-30_cpu-2core-b", "summary.json"),
    ("2026-11-30_cpu-2core-c", "bench.json"),
    ("2026-11-30_cpu-2core-d", "bench.json"),
    ("2026-11-30_cpu-2core-e", "bench.json"),
    ("2026-11-30_h200-16core", "summary.json"),
    ("2026-12-01_cpu-2core-photos-bounded", "bench.json"),
    ("2026-12-01_cpu-2core-remote", "bench.json"),
    ("2026-12-05_cpu-2core-xeon-loader-bench-synthetic_loader", "bench.json"),
    ("2026-12-05_cpu-2core-xeon-loader-bench-photos", "bench.json"),
    ("2026-12-05_cpu-2core-xeon-loader-bench-unseen", "bench.json"),
    ("2026-12-06_cpu-2core-xeon-loader-bench-synthetic", "bench.json"),
]


def bare(r: dict) -> str:
    """A ratio of seconds or megabytes, with its interval: no win or loss word (less is
    better there, and the words are for rates)."""
    return f"{r['ratio']:.2f}x [{r['low']:.2f}, {r['high']:.2f}]"


def judged(r: dict | float | None, goal: float | None) -> str:
    """A ratio against its target where it has one and an interval; as it is otherwise."""
    has_interval = isinstance(r, dict) and "rounds" in r
    return target(r, goal) if goal is not None and has_interval else ratio(r)


RETIRED = "(bootstrap of medians, the retired estimator: not the one rule)"


def rule_ratios(res: dict) -> dict:
    """A loader_bench workload's ratios under the one rule: those the first benches kept as a
    bootstrap of medians (no ``confidence``) are judged again from their rounds
    (``values``) where both sides kept them, and marked otherwise; a ceiling that is the
    preset itself (the loader-only ceiling is the tuned preset's run) is said so, not
    compared."""
    from feedrate import stats

    values, out = res.get("values") or {}, {}
    for key, r in (res.get("ratios") or {}).items():
        other = key.split("/", 1)[1]
        if (
            key == "tuned/ceiling"
            and res.get("best_loader_only") == "tuned"
            and (res.get("ceiling_kind") == "loader")
        ):
            out[key] = "the ceiling is this preset's own run"
        elif isinstance(r, dict) and "confidence" not in r and r.get("verdict") != "same settings":
            pair = values.get("tuned"), values.get(other)
            versus = stats.compare(*pair) if all(pair) else None
            out[key] = versus.as_dict() if versus else f"{ratio(r)} {RETIRED}"
        else:
            out[key] = r
    return out


def readme_results(doc: Path) -> str:
    """Every run of the loader benchmark, a row per workload: tuned against the baselines,
    the grid's best point and the ceiling."""
    rows = [
        "| run | machine | commit | workload | `default` | `recipe` | tuned | tuned / `recipe` |"
        " tuned / CPU-capped | tuned / the grid's best | tuned / the ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for folder, name in LOADER_BENCH:
        figures = json.loads((RESULTS / folder / name).read_text())
        commit, machine = provenance(folder)
        for workload, res in figures.get("results", figures).items():
            m, r = res["median"], rule_ratios(res)
            rows.append(
                f"| {label(folder)} | {machine} |"
                f" {short(commit)} | {workload} | {m.get('default', 0):,.0f} |"
                f" {m.get('recipe', 0):,.0f} | **{m['tuned']:,.0f}** |"
                f" {ratio(r.get('tuned/recipe'))} | {ratio(r.get('tuned/cpu_capped'))} |"
                f" {ratio(r.get('tuned/best_grid'))} | {ratio(r.get('tuned/ceiling'))} |"
            )
    return cited(rows, [f for f, _ in LOADER_BENCH], doc)


def loader_bench_detail(doc: Path) -> str:
    """Every loader_bench run with a bench.json, a row per workload: the medians, the
    ceilings, the thread side row and the sweep's wall time; each workload's targets
    (``loader_bench.TARGETS``) by the one rule."""
    rows = [
        "| run | workload | tuned (settings) | best of the grid | loader-only | compute-only |"
        " ceiling | tuned / the grid's best | tuned / ceiling |"
        " threads: tuned / other | sweep s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    folders = [f for f, name in LOADER_BENCH if name == "bench.json"]
    for folder in folders:
        bench = json.loads((RESULTS / folder / "bench.json").read_text())
        for workload, res in bench["results"].items():
            m, r = res["median"], rule_ratios(res)
            t = res.get("settings", {}).get("tuned") or res.get("tuned_preset") or {}
            setting = f"{t.get('num_workers', '?')} x {t.get('prefetch_factor') or 2}"
            goals = TARGETS.get(workload, {})
            sweep = (bench.get("sweep_seconds") or {}).get(workload) or 0.0
            sweep = sweep.get("total", 0.0) if isinstance(sweep, dict) else sweep

            versus_grid = judged(r.get("tuned/best_grid"), goals.get("tuned/best_grid"))
            versus_ceiling = judged(r.get("tuned/ceiling"), goals.get("tuned/ceiling"))
            rows.append(
                f"| {label(folder)} | {workload} |"
                f" **{m['tuned']:,.0f}** ({setting}) | {number(m.get('best_grid'))} |"
                f" {number(res.get('loader_only'))} | {number(res.get('compute_only'))} |"
                f" {number(res.get('ceiling'))} {res.get('ceiling_kind') or ''} | {versus_grid} |"
                f" {versus_ceiling} | {ratio(res.get('threads'))} |"
                f" {number(sweep)} |"
            )
    return cited(rows, folders, doc)


SENSORS = [  # (data, the run, its folder): autotune against recipe and the sweep's preset
    ("sensors", "150 s (30 s)", "2026-12-05_cpu-2core-loop-autotune-sensors-150s"),
    ("sensors", "60 s (12 s)", "2026-12-05_cpu-2core-loop-autotune-sensors-60s"),
    ("sensors", "300 s (60 s)", "2026-12-05_cpu-2core-loop-autotune-sensors-300s"),
    ("sensors", "300 s (60 s)", "2026-12-05_cpu-2core-loop-autotune-sensors-300s-b"),
    ("sensors", "300 s (60 s)", "2026-12-05_cpu-2core-loop-autotune-sensors-300s-c"),
]
RECIPE_TARGET = {"150 s": 3.0, "60 s": 0.95}  # autotune / recipe, by run length (issue 39)


def autotune_runs(doc: Path, runs: list[tuple[str, str, str]]) -> str:
    """Benches of loader=autotune: the medians, autotune against recipe and the sweep's
    preset, the tuning's seconds and each round's choice."""
    rows = [
        "| data | run (budget) | commit | autotune | recipe | sweep's preset |"
        " autotune / recipe | autotune / preset (target 0.9) | choice / preset, steady |"
        " tuning s | chosen, each round | sweep s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, run, folder in runs:
        res = json.loads((RESULTS / folder / "results.json").read_text())[workload]
        v, m = res["verdicts"], res["verdicts"]["medians"]
        chosen = [
            f"{x['loader']['num_workers']} x {x['loader'].get('prefetch_factor') or 2}"
            for x in res["rows"]
            if x["name"] == "autotune" and x.get("ok") and not x.get("replaced")
        ]
        goal = RECIPE_TARGET.get(run.split(" (")[0])
        versus = v["autotune_vs_recipe"]
        recipe = target(versus, goal) if goal and versus else ratio(versus)

        rows.append(
            f"| {workload} | {run} | {short(provenance(folder)[0])} |"
            f" {number(m.get('autotune'), 1)} | {number(m.get('recipe'), 1)} |"
            f" {number(m.get('tuned'), 1)} | {recipe} |"
            f" {judged(v['autotune_vs_tuned'], 0.9)} | {ratio(v['choice_vs_tuned'])} |"
            f" {', '.join(f'{s:.0f}' for s in v['tuning_s'])} | {', '.join(chosen)} |"
            f" {number(res.get('sweep_s'))} |"
        )
    return cited(rows, list(dict.fromkeys(f for _, _, f in runs)), doc)


PHOTOS = [
    ("photos", "300 s (60 s)", "2026-12-05_cpu-2core-loop-autotune-photos-300s"),
    ("photos", "300 s (60 s)", "2026-12-05_cpu-2core-loop-autotune-photos-300s-c"),
]


DOCUMENTS = [("docs", "300 s (60 s)", "2026-12-05_cpu-2core-xeon-autotune-docs-300s")]


# autotune_bench's default workloads at the code whose early leave waits for the loader to
# hold the consumer back (c776d0f): tiles is held out from that change
LEAVE_FIX = [
    ("tiles", "300 s (60 s)", "2026-12-05_cpu-2core-xeon-autotune-tiles-300s"),
    ("synthetic", "300 s (60 s)", "2026-12-05_cpu-2core-xeon-autotune-synthetic-300s"),
    ("photos", "300 s (60 s)", "2026-12-05_cpu-2core-xeon-autotune-photos-300s"),
]


LOOPS = [  # (the example, its folder, its key in results.json)
    ("plain loop", "2026-12-04_cpu-2core-loop-plain-200s", "plain"),
    ("Lightning, 1 process", "2026-12-04_cpu-2core-loop-lightning-hf-200s", "lightning"),
    ("Hugging Face Trainer", "2026-12-04_cpu-2core-loop-lightning-hf-200s", "hf"),
]


def loop_examples(doc: Path) -> str:
    rows = [
        "| example | machine | commit | autotune_loader | recipe |"
        " autotune / recipe (target 2.5) |",
        "|---|---|---|---|---|---|",
    ]
    for name, folder, key in LOOPS:
        v = json.loads((RESULTS / folder / "results.json").read_text())[key]["verdict"]
        commit, machine = provenance(folder)
        rows.append(
            f"| {name} | {machine}, 2 cores, no GPU | {short(commit)} |"
            f" {v['medians']['autotune']:,.1f} | {v['medians']['recipe']:,.1f} |"
            f" **{target(v['autotune_vs_recipe'], 2.5)}** |"
        )
    folders = list(dict.fromkeys(f for _, f, _ in LOOPS))
    return cited(rows, folders, doc)


AUTOTUNE = [  # (workload, run, folder): autotune in feedrate's loop, every bench of it
    ("sensors", "150 s", "2026-12-05_cpu-2core-loop-autotune-sensors-150s"),
    ("sensors", "60 s", "2026-12-05_cpu-2core-loop-autotune-sensors-60s"),
    ("sensors", "300 s", "2026-12-05_cpu-2core-loop-autotune-sensors-300s"),
    ("sensors", "300 s", "2026-12-05_cpu-2core-loop-autotune-sensors-300s-b"),
    ("sensors", "300 s", "2026-12-05_cpu-2core-loop-autotune-sensors-300s-c"),
    ("photos", "300 s", "2026-12-05_cpu-2core-loop-autotune-photos-300s"),
    ("photos", "300 s", "2026-12-05_cpu-2core-loop-autotune-photos-300s-c"),
    ("docs", "300 s", "2026-12-05_cpu-2core-xeon-autotune-docs-300s"),
    *((data, run.removesuffix(" (60 s)"), folder) for data, run, folder in LEAVE_FIX),
]


def readme_autotune(doc: Path) -> str:
    """Every bench of loader=autotune in feedrate's loop: against recipe and the preset."""
    rows = [
        "| data | run | commit | rounds | autotune / `recipe` | autotune / the sweep's preset |",
        "|---|---|---|---|---|---|",
    ]
    for workload, run, folder in AUTOTUNE:
        v = json.loads((RESULTS / folder / "results.json").read_text())[workload]["verdicts"]
        goal = RECIPE_TARGET.get(run) if workload == "sensors" else None
        versus = v["autotune_vs_recipe"]
        preset = v["autotune_vs_tuned"]
        rounds = max(min(x["rounds"]) for x in (versus, preset) if x)
        rows.append(
            f"| {workload} | {run} | {short(provenance(folder)[0])} | {rounds} |"
            f" {target(versus, goal) if goal and versus else ratio(versus)} |"
            f" {target(preset, 0.9) if preset else '-'} |"
        )
    folders = [f for _, _, f in AUTOTUNE]
    return cited(rows, folders, doc)


RANKS = [  # every ranks_bench run: the per-rank preset against the best per-rank grid point
    "2026-12-02_cpu-2core-2ranks",
    "2026-12-02_cpu-2core-2ranks-climb",
    "2026-12-02_cpu-2core-2ranks-equivalence",
    "2026-12-02_cpu-2core-2ranks-equivalence-b",
    "2026-12-02_cpu-2core-2ranks-paired",
    "2026-12-02_cpu-2core-2ranks-synthetic-5rounds",
    "2026-12-02_cpu-2core-2ranks-paired-photos",
]


def swept(seconds: dict) -> str:
    """A ranks bench's two sweeps' seconds; '-' where it reused presets (--skip-sweep)."""
    if not seconds:
        return "- (presets reused)"
    return f"{seconds['one_process']:.0f}, {seconds['per_rank']:.0f}"


def ranks_detail(doc: Path) -> str:
    """Every run of the 2-rank bench, every column: the per-rank preset against the grid's
    best point (target 0.9), Lightning's formula, the one-process preset divided, recipe."""
    rows = [
        "| run | commit | data | rounds | per-rank preset | grid's best | preset / grid"
        " (target 0.9) | / Lightning | / divided | / recipe | sweeps s: one process, per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for folder in RANKS:
        commit = short(provenance(folder)[0])
        for workload, res in json.loads((RESULTS / folder / "results.json").read_text()).items():
            v, m, sweep = res["verdicts"]["versus"], res["verdicts"]["medians"], res["sweep_s"]
            grid = res["best_grid"].removeprefix("grid_").replace("x", " x ")
            rows.append(
                f"| {label(folder)} | {commit} | {workload} |"
                f" {min(v['best_grid']['rounds'])} | {m['tuned']:,.0f}"
                f" ({res['tuned_settings']}) | {m['best_grid']:,.0f} ({grid} a rank) |"
                f" {judged(v['best_grid'], 0.9)} | {ratio(v.get('lightning'))} |"
                f" {ratio(v.get('divided'))} | {ratio(v.get('recipe'))} |"
                f" {swept(sweep)} |"
            )
    return cited(rows, RANKS, doc)


def _same_as_preset(res: dict, name: str | None) -> bool:
    """The grid point ``name`` ran the per-rank preset's own settings (a tie of one setting
    with itself, which says nothing of the tuning)."""
    keys = ("num_workers", "prefetch_factor", "main_threads", "worker_threads")
    runs = {r["name"]: r for r in res.get("rows", []) if r.get("ok")}
    preset = next((r for n, r in runs.items() if n in ("tuned", "preset")), None)
    point = runs.get(name) if name else None
    return bool(preset and point) and all(preset.get(k) == point.get(k) for k in keys)


def readme_ranks(doc: Path) -> str:
    """Every run of the 2-rank bench, each workload's preset / grid and / Lightning's."""
    rows = [
        "| run | commit | data | rounds | per-rank preset / best grid point |"
        " / Lightning's formula |",
        "|---|---|---|---|---|---|",
    ]
    for folder in RANKS:
        for workload, res in json.loads((RESULTS / folder / "results.json").read_text()).items():
            versus = res["verdicts"]["versus"]
            best, lightning = versus.get("best_grid"), versus.get("lightning")
            rounds = min(best["rounds"]) if best else "-"
            if best and _same_as_preset(res, "best_grid"):
                best = f"same settings ({res['tuned_settings']}): {ratio(best)}, noise alone"
            rows.append(
                f"| {label(folder)} | {short(provenance(folder)[0])}"
                f" | {workload} | {rounds} | {ratio(best)} | {ratio(lightning)} |"
            )
    return cited(rows, RANKS, doc)


FIRST_AUTOTUNE = [  # (data, folder): the benches of the first loader=autotune, in the order run
    ("photos", "2026-12-03_cpu-2core-autotune-300s-photos-3rounds"),
    ("stalls", "2026-12-03_cpu-2core-autotune-300s-stalls-synthetic-oneway"),
    ("synthetic", "2026-12-03_cpu-2core-autotune-300s-stalls-synthetic-oneway"),
    ("photos", "2026-12-04_cpu-2core-autotune-300s-photos-3rounds-c"),
    ("synthetic", "2026-12-04_cpu-2core-autotune-300s-synthetic-3rounds"),
    ("stalls", "2026-12-04_cpu-2core-autotune-300s-stalls-8rounds"),
    ("photos", "2026-12-04_cpu-2core-autotune-300s-photos-3rounds-amd"),
]


def first_autotune(doc: Path) -> str:
    """Each bench a row of its own: its machine, its commit, its rounds; no row mixes two."""
    rows = [
        "| data | machine | commit | rounds | autotune / preset, whole run | tuning s |"
        " choice / preset, steady | autotune / `recipe` |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload, folder in FIRST_AUTOTUNE:
        v = json.loads((RESULTS / folder / "results.json").read_text())[workload]["verdicts"]
        commit, machine = provenance(folder)
        tuned, choice = v["autotune_vs_tuned"], v["choice_vs_tuned"]
        rounds = max(min(x["rounds"]) for x in (tuned, choice, v["autotune_vs_recipe"]) if x)
        seconds = span(v["tuning_s"])
        rows.append(
            f"| {workload} | {machine} | {short(commit)} | {rounds} |"
            f" {target(tuned, 0.9) if tuned else '-'} | {seconds} |"
            f" {target(choice, 0.9) if choice else '-'} | {ratio(v['autotune_vs_recipe'])} |"
        )
    folders = list(dict.fromkeys(f for _, f in FIRST_AUTOTUNE))
    return cited(rows, folders, doc)


def added_at(folder: str) -> int:
    """When ``folder`` was committed (seconds since the epoch; the newest where not yet):
    the order benches ran in, as their folder names do not always say."""
    path = f"benchmarks/results/{folder}"
    out = git("log", "--diff-filter=A", "--no-renames", "--format=%at", "--", path).stdout.split()
    return int(out[-1]) if out else 2**62  # not committed yet: the newest


def autotune_benches() -> list[str]:
    """Every folder autotune_bench.py wrote (its command.txt says so) that the tree holds (not
    one a bench is writing now), in the order committed."""
    tracked = git("ls-files", "benchmarks/results/*/command.txt").stdout.split()
    found = [
        Path(path).parent.name
        for path in tracked
        if (ROOT / path).read_text().startswith("python benchmarks/autotune_bench.py")
        and (ROOT / path).with_name("results.json").exists()
    ]
    return sorted(found, key=lambda f: (added_at(f), f))


def autotune_history(doc: Path) -> str:
    """Every bench of autotune_bench.py, a row per workload, in the order committed."""
    rows = [
        "| run | machine | commit | data | run s | rounds | autotune / preset (target 0.9) |"
        " autotune / `recipe` | tuning s | choice / preset, steady |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    folders = autotune_benches()
    for folder in folders:
        commit, machine = provenance(folder)
        first = (RESULTS / folder / "command.txt").read_text().split()
        seconds = first[first.index("--seconds") + 1] if "--seconds" in first else "300"
        for workload, res in json.loads((RESULTS / folder / "results.json").read_text()).items():
            v = res["verdicts"]
            kept = [x for x in (v["autotune_vs_tuned"], v["autotune_vs_recipe"]) if x]
            rounds = max((min(x["rounds"]) for x in kept), default="-")
            tuning = v["tuning_s"]
            rows.append(
                f"| {label(folder)} | {machine} | {short(commit)} |"
                f" {workload} | {float(seconds):.0f} | {rounds} |"
                f" {judged(v['autotune_vs_tuned'], 0.9)} | {ratio(v['autotune_vs_recipe'])} |"
                f" {span(tuning)} |"
                f" {ratio(v['choice_vs_tuned'])} |"
            )
    return cited(rows, folders, doc)


def warm_vs_fresh(doc: Path) -> str:
    """A warm host's figure against a fresh process's, by worker count, and equal within 5%
    judged by the one rule (the whole interval inside [0.95, 1.05])."""
    from feedrate import stats

    folder = "2026-12-01_cpu-2core-warm-vs-fresh"
    report = json.loads((RESULTS / folder / "results.json").read_text())
    rows = [
        "| workers | warm samples/s | fresh samples/s | warm / fresh | equal within 5% |"
        " wall s a run: warm / fresh |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["summary"]:
        versus = r["warm/fresh"]
        rows.append(
            f"| {r['num_workers']} | {r['warm_median']:,.0f} | {r['fresh_median']:,.0f} |"
            f" {ratio(versus)} | {'yes' if stats.equal_within(versus, 0.05) else 'not shown'} |"
            f" {r['wall_s']['warm']:.1f} / {r['wall_s']['fresh']:.1f} |"
        )
    return cited(rows, [folder], doc)


def host_start(doc: Path) -> str:
    """A forked trial host against a fresh process: the first trial's seconds and its PSS."""
    folder = "2026-12-05_cpu-2core-host-start"
    report = json.loads((RESULTS / folder / "results.json").read_text())
    m, rounds = report["median"], max(r["round"] for r in report["rows"]) + 1
    rows = [
        f"| host | first trial, s (median of {rounds}) | peak PSS of the trial, MB |",
        "|---|---|---|",
        f"| fresh `python train.py` | {m['fresh']['seconds']:.2f} |"
        f" {m['fresh']['peak_pss_mb']:,.0f} |",
        f"| forked from the server | {m['forked']['seconds']:.2f} |"
        f" {m['forked']['peak_pss_mb']:,.0f} |",
        "",
        f"Forked / fresh: {bare(report['forked/fresh seconds'])} the seconds,"
        f" {report['forked/fresh peak_pss_mb']['ratio']:.2f}x the PSS. The server's own start,"
        f" once a sweep: {report['rows'][0]['seconds']:.2f} s.",
    ]
    return cited(rows, [folder], doc)


SWEEPS = [  # every timed sweep from scratch (benchmarks/sweep_time.py), in the order run
    "2026-12-01_cpu-2core-sweep-time",
    "2026-12-01_cpu-2core-sweep-time-b",
    "2026-12-01_cpu-2core-sweep-time-c",
    "2026-12-01_cpu-2core-sweep-time-d",
    "2026-12-01_cpu-2core-sweep-time-e",
    "2026-12-05_cpu-2core-sweep-time-photos",
    "2026-12-07_cpu-2core-epyc-sweep-time",
]


def sweep_time(doc: Path) -> str:
    """Every timed sweep: its wall time and phases, the preset it chose."""
    from sweep_time import DEFAULT_TARGET_S, TARGET_S

    rows = [
        "| run | commit | workload | sweep | goal | of which | final rounds | preset chosen |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for folder in SWEEPS:
        report = json.loads((RESULTS / folder / "results.json").read_text())
        for r in report["rows"]:
            t, loader = r["seconds"], r["decision"]["loader"]
            phases = ", ".join(f"{k} {v:.0f}" for k, v in t.items() if k != "total")
            picked = f"{loader['num_workers']} x {loader.get('prefetch_factor') or 2}"
            goal = TARGET_S.get(r["workload"], DEFAULT_TARGET_S)  # one sweep: its time, no interval
            met = "met" if t["total"] <= goal else "missed"
            rows.append(
                f"| {label(folder)} | {short(provenance(folder)[0])} |"
                f" {r['workload']} | {t['total']:.0f} s | {goal:.0f} s {met} | {phases} |"
                f" {r['rounds']} |"
                f" {picked}, {r['decision']['median_samples_per_sec']:,.0f} samples/s |"
            )
    return cited(rows, SWEEPS, doc)


SUITE_FOLDER = re.compile(r"^\d{4}-\d{2}-\d{2}_.*-suite(-[b-z])?$")  # suite_time.py's


def suites() -> list[str]:
    """The folders of the CI job's time (make test from a clean clone), oldest first: the
    tree's, by name (benchmarks/suite_time.py writes each run's)."""
    tracked = git("ls-files", "benchmarks/results/*/results.json").stdout.split()
    return sorted(
        {Path(p).parent.name for p in tracked if SUITE_FOLDER.match(Path(p).parent.name)},
        key=lambda name: (name[:10], len(name), name),
    )


def _clean_clones() -> list[tuple[str, str, dict]]:
    """(folder, machine, run) for every clean-clone run of the CI job, in the order run."""
    out = []
    for folder in suites():
        report = json.loads((RESULTS / folder / "results.json").read_text())
        said = report["machine"]
        machine = said.split(",")[0].split(" (")[0]
        if " | " in said:  # suite_time.py records the fingerprint: "AMD EPYC | 2 physical ..."
            named = re.search(r"(AMD EPYC|Intel Xeon)", said)
            cores = re.search(r"\(([\d.]+) usable\)", said)
            cpu = named[1] if named else said.split(" | ")[0]
            machine = f"{cores[1] if cores else '?'}-core {cpu} VM"
        out += [(folder, machine, run) for run in report["clean_clone"]]
    return out


def suite_summary(doc: Path) -> str:
    """The newest clean-clone run of the CI job on each machine, a line each, stale where the
    code, the tests or their set-up changed after it (depends.py's SUITE)."""
    newest: dict[str, tuple[str, dict]] = {}
    for folder, machine, run in _clean_clones():
        newest[machine] = (folder, run)
    lines = [
        f"- {machine}: **{run['real_s']:.1f} s** in all, {run['tests_s']:.1f} s of tests"
        f" ({run['passed']} passed{failed(run)}), at {run['code'][:7]}"
        f"{staleness(run['code'], SUITE)}"
        for machine, (_, run) in newest.items()
    ]
    folders = list(dict.fromkeys(f for f, _ in newest.values()))
    return cited(lines, folders, doc, each_run=True)


def failed(run: dict) -> str:
    """``, 1 failed`` where a run of the CI job failed tests (suite_time.py records it)."""
    said = run.get("failed") or 0
    count = len(said) if isinstance(said, list) else said  # earlier rows name the tests
    return f", {count} failed" if count else ""


def suite_time(doc: Path) -> str:
    """Every clean-clone run of the CI job (creating .venv, installing, make test)."""
    rows = [
        "| machine | code | in all (s) | tests (s) | install (s) | passed | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for _, machine, run in _clean_clones():
        rows.append(
            f"| {machine} | {run['code'][:7]} | {run['real_s']:.1f} | {run['tests_s']:.1f} |"
            f" {run['install_s']:.1f} | {run['passed']}{failed(run)} | {run.get('note', '')} |"
        )
    return cited(rows, suites(), doc, each_run=True)


FIRST_RUN = "2026-12-05_cpu-2core-xeon-first-run"  # `python train.py`, the default job


def readme_sample(doc: Path) -> str:
    """The summary the default job printed, as its folder keeps it (summary.txt)."""
    summary = (RESULTS / FIRST_RUN / "summary.txt").read_text().rstrip("\n")
    return "```\n" + summary + "\n```\n\n" + cite([FIRST_RUN], doc) + "\n"


def newest_bench(stage: str) -> str | None:
    """The newest folder ``make bench``'s ``stage`` wrote (``<date>_<machine>-bench-<stage>``,
    ``-b``...) that the tree holds, by when it was committed; None before the first."""
    tracked = git("ls-files", "benchmarks/results/*/README.md").stdout.split()
    found = [
        Path(path).parent.name
        for path in tracked
        if re.search(rf"-bench-{stage}(-[a-z])?$", Path(path).parent.name)
    ]
    return max(found, key=lambda f: (added_at(f), f), default=None)


def _no_bench(stage: str) -> str:
    return f"No `make bench` has measured the {stage} stage yet: run `make bench`.\n"


def headline_sweep(doc: Path) -> str:
    """make bench's loader stage: the default sweep's time against its goal, and its preset
    against PyTorch's defaults, the recipe and the grid's best, by the one rule."""
    from sweep_time import DEFAULT_TARGET_S

    from feedrate import stats

    folder = newest_bench("loader")
    if folder is None:
        return _no_bench("loader")
    bench = json.loads((RESULTS / folder / "bench.json").read_text())
    rows = [
        "| workload | sweep (goal) | tuned, samples/s | tuned / `default` | tuned / `recipe` |"
        " tuned / the grid's best |",
        "|---|---|---|---|---|---|",
    ]
    for workload, res in bench["results"].items():
        m, r = res["median"], res["ratios"]
        sweep = (bench.get("sweep_seconds") or {}).get(workload) or {}
        total = sweep.get("total") if isinstance(sweep, dict) else sweep
        met = "met" if total and total <= DEFAULT_TARGET_S else "missed"
        took = f"{total:.0f} s ({DEFAULT_TARGET_S:.0f} s: {met})" if total else "-"
        goal = TARGETS.get(workload, {}).get("tuned/best_grid")
        grid = r.get("tuned/best_grid")
        versus_grid = (
            f"{ratio(grid)}, target {goal:g}: {stats.against(grid, goal)}"
            if goal and isinstance(grid, dict)
            else ratio(grid)
        )
        rows.append(
            f"| {workload} | {took} | **{m['tuned']:,.0f}** | {ratio(r.get('tuned/default'))} |"
            f" {ratio(r.get('tuned/recipe'))} | {versus_grid} |"
        )
    return cited(rows, [folder], doc)


def headline_autotune(doc: Path) -> str:
    """make bench's autotune stage: loader=autotune from scratch against the sweep's preset
    and the recipe, whole runs, by the one rule."""
    folder = newest_bench("autotune")
    if folder is None:
        return _no_bench("autotune")
    first = (RESULTS / folder / "command.txt").read_text().split()
    seconds = float(first[first.index("--seconds") + 1])
    rows = [
        f"| workload | rounds of {seconds:.0f} s | autotune / `recipe` |"
        " autotune / the sweep's preset (target 0.95) | tuning s | choice / preset, steady |",
        "|---|---|---|---|---|---|",
    ]
    for workload, res in json.loads((RESULTS / folder / "results.json").read_text()).items():
        v = res["verdicts"]
        kept = [x for x in (v["autotune_vs_tuned"], v["autotune_vs_recipe"]) if x]
        tuning = v["tuning_s"]
        rows.append(
            f"| {workload} | {max((min(x['rounds']) for x in kept), default='-')} |"
            f" {ratio(v['autotune_vs_recipe'])} | {judged(v['autotune_vs_tuned'], 0.95)} |"
            f" {span(tuning)} |"
            f" {ratio(v['choice_vs_tuned'])} |"
        )
    return cited(rows, [folder], doc)


def headline_engine(doc: Path) -> str:
    """make bench's engine stage: thread workers against worker processes, each swept."""
    folder = newest_bench("engine")
    if folder is None:
        return _no_bench("engine")
    report = json.loads((RESULTS / folder / "results.json").read_text())
    rows = [
        "| workload | processes (swept) | threads (swept) | threads / processes, samples/s |"
        " threads / processes, peak PSS |",
        "|---|---|---|---|---|",
    ]
    for workload, res in report["workloads"].items():
        c = res["compare"]
        shown = {}
        for row in ("process", "thread"):
            v, rate = res["presets"][row]["values"], c["medians"]["samples/s"].get(row, 0)
            shown[row] = f"{v['num_workers']} x {v.get('prefetch_factor') or 2}: {rate:,.0f}/s"
        memory = c["ratios"].get("thread/process peak PSS")
        rows.append(
            f"| {workload} | {shown['process']} | {shown['thread']} |"
            f" {ratio(c['ratios'].get('thread/process samples/s'))} |"
            f" {bare(memory) if memory else '-'} |"
        )
    return cited(rows, [folder], doc)


WORKED = (  # the tuning loader's worked example in docs/design.md: a run of a held-out bench
    "2026-12-06_cpu-2core-epyc-autotune-audio-180s",
    "audio/round0_autotune/metrics.json",
)


def _setting(s: dict) -> str:
    threads = f", {s['main_threads']} main thread(s)" if s.get("main_threads") else ""
    engine = "threads" if s.get("engine") == "thread" else "processes"
    return f"{s['num_workers']} {engine} x {s.get('prefetch_factor') or 2}{threads}"


def worked_example(doc: Path) -> str:
    """One run's tuning, window by window: what each setting measured and cost, what the
    model predicted from it, and what the prediction measured (its metrics.json's
    ``autotune``, from the folder's archive)."""
    folder, member = WORKED
    with tarfile.open(RESULTS / folder / "raw.tar.gz") as archive:
        at = json.load(archive.extractfile(member))["autotune"]
    rows = [
        "| window | setting | samples/s | data wait | a batch in a worker: wall / CPU |"
        " the step a batch | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, t in enumerate(at["tried"], 1):
        c = t.get("costs") or {}
        cost = f"{c['worker_s'] * 1000:,.0f} / {c['worker_cpu_s'] * 1000:,.0f} ms" if c else "-"
        step = f"{c['step_s'] * 1000:,.1f} ms" if c else "-"
        rate = f"{t['samples_per_sec']:,.0f}" if t.get("samples_per_sec") else "failed"
        rows.append(
            f"| {i} | {_setting(t['setting'])} | {rate} | {t['data_wait_frac']:.0%} |"
            f" {cost} | {step} | {t['seconds']:.1f} |"
        )
    rows += [
        "",
        "| predicted from | the prediction | bound by | predicted samples/s | measured | error |",
        "|---|---|---|---|---|---|",
    ]
    for p in at["predictions"]:
        measured = p.get("measured_samples_per_sec")
        error = f"{p['error']:+.0%}" if p.get("error") is not None else "-"
        rows.append(
            f"| {_setting(p['from'])} | {_setting(p['setting'])} | {p['bound']} |"
            f" {p['predicted_samples_per_sec']:,.0f} | {number(measured)} | {error} |"
        )
    rows += [
        "",
        f"Chosen: {_setting(at['chosen'])}, after {at['seconds']:.0f} s of tuning"
        f" (a budget of {at['budget_s']:.0f} s).",
    ]
    return cited(rows, [folder], doc)


TABLES: dict[str, Callable[[Path], str]] = {
    "worked-example": worked_example,
    "headline-sweep": headline_sweep,
    "headline-autotune": headline_autotune,
    "headline-engine": headline_engine,
    "readme-results": readme_results,
    "loader-bench-detail": loader_bench_detail,
    "autotune-sensors": functools.partial(autotune_runs, runs=SENSORS),
    "autotune-photos": functools.partial(autotune_runs, runs=PHOTOS),
    "autotune-docs": functools.partial(autotune_runs, runs=DOCUMENTS),
    "autotune-leave-fix": functools.partial(autotune_runs, runs=LEAVE_FIX),
    "loop-examples": loop_examples,
    "readme-autotune": readme_autotune,
    "readme-ranks": readme_ranks,
    "ranks-detail": ranks_detail,
    "sweep-time": sweep_time,
    "warm-vs-fresh": warm_vs_fresh,
    "host-start": host_start,
    "first-autotune": first_autotune,
    "suite-summary": suite_summary,
    "readme-sample": readme_sample,
    "suite-time": suite_time,
    "autotune-history": autotune_history,
}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def render(doc: Path) -> tuple[str, list[str]]:
    """``doc`` with every generated block written from its results; the names of the blocks
    whose text that changes."""
    text, names = doc.read_text(), []

    def fill(m: re.Match) -> str:
        name = m["name"]
        if name not in TABLES:
            raise SystemExit(f"{doc}: no table named {name!r}; known: {', '.join(TABLES)}")
        body = TABLES[name](doc)
        if body != m["body"]:
            names.append(name)
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(fill, text), names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the blocks (else check)")
    args = parser.parse_args(argv)
    differ = []
    for doc in DOCS:
        new, names = render(doc)
        if new != doc.read_text():
            if args.write:
                doc.write_text(new)
                print(f"wrote {', '.join(names)} in {doc.name}", file=sys.stderr)
            else:
                differ.append(f"{doc.name} ({', '.join(names)})")
    if differ:
        print(
            "generated tables differ from their results: "
            + "; ".join(differ)
            + ". Run: python benchmarks/doc_tables.py --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
