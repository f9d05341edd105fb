"""What a loader sweep leaves in its output directory: trials.csv, sweep_report.md, PNG plots."""

from __future__ import annotations

import csv
import io
import re
import statistics
from datetime import datetime
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from feedrate.files import atomic_write_text  # noqa: E402
from feedrate.sweep.feasibility import memory_budget, run_memory_mb  # noqa: E402
from feedrate.sweep.study import reason_of, shown  # noqa: E402
from feedrate.sweep.trial import OK, OVER_BUDGET, TrialResult  # noqa: E402

PARAMS = (
    "num_workers",
    "prefetch_factor",
    "persistent_workers",
    "multiprocessing_context",
    "pin_memory",
    "batch_size",
    "worker_threads",
    "main_threads",
)
COLUMNS = (
    "phase",
    "name",
    *PARAMS,
    "status",
    "samples_per_sec",
    "data_wait_frac",
    "rank_data_wait",
    "first_batch_s",
    "peak_pss_mb",
    "peak_shm_mb",
    "memory_mb",
    "duration_s",
    "reason",
)


def collect_search(sweep_dir: Path) -> list[TrialResult]:
    """This session's search trials, in launch order (job directories 0, 1, 2, ...)."""
    jobs = sorted((p for p in sweep_dir.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    return [TrialResult.load(p) for p in jobs if (p / "trial.json").exists()]


def _params(overrides: list[str], metrics: dict) -> dict:
    """Loader parameters of a trial: as run (metrics.json) when it ran, else from overrides."""
    run = metrics.get("run", {}) if metrics else {}
    ran = run.get("loader", {})
    out = {k: ran.get(k) for k in PARAMS if k in ran}
    if run.get("torch_threads") is not None:  # what the main process ran, preset or not
        out["main_threads"] = run["torch_threads"]
    for o in overrides:
        key, _, value = o.partition("=")
        if key.startswith("loader.") and key[7:] in PARAMS and key[7:] not in out:
            out[key[7:]] = value
    return out


def _row(phase: str, name: str, r: TrialResult) -> dict:
    m = r.metrics or {}
    return {
        "phase": phase,
        "name": name,
        **_params(r.overrides, m),
        "status": r.status,
        "samples_per_sec": r.value,
        "data_wait_frac": m.get("data_wait_frac"),  # under torchrun, the slowest rank's
        "rank_data_wait": _rank_waits(m),
        "first_batch_s": m.get("first_batch_s"),
        "peak_pss_mb": m.get("peak_pss_mb"),
        "peak_shm_mb": m.get("peak_shm_mb"),
        "memory_mb": run_memory_mb(m),  # the one measure of a run's memory
        "predicted_memory_mb": m.get("predicted_memory_mb"),  # skipped by the guard
        "duration_s": round(r.duration_s, 2),
        "reason": r.reason or m.get("abandoned") or "",
    }


def _rank_waits(metrics: dict) -> str:
    """Each rank's data-wait share under torchrun (``0.12 0.31``), else empty."""
    waits = [r.get("data_wait_frac") for r in metrics.get("ranks") or []]
    return " ".join("?" if w is None else f"{w:.2f}" for w in waits)


def rows(study: optuna.Study, search: list[TrialResult], contestants, n_new: int) -> list[dict]:
    """The table of the study's trials, this session's finals among them. This session's
    ``n_new`` search trials are the study's last started; a seed never asked (the search
    stopped near the ceiling first) is no trial and is left out."""
    out = []
    ran = [t for t in study.trials if t.state != optuna.trial.TrialState.WAITING]
    ran.sort(key=lambda t: (t.datetime_start or datetime.min, t.number))
    split = max(0, len(ran) - n_new)
    earlier, new = sorted(ran[:split], key=lambda t: t.number), ran[split:]
    for t in earlier:
        params = {k.split(".", 1)[1]: v for k, v in t.params.items()}
        out.append(
            {
                "phase": "earlier session",
                "name": f"trial {t.number}",
                **params,
                "status": t.state.name.lower(),
                "reason": reason_of(study, t),
                "samples_per_sec": t.value,
            }
        )
    for i, r in enumerate(search):
        out.append(_row("search", f"trial {new[i].number if i < len(new) else '?'}", r))
    for c in contestants:
        for k, r in enumerate(c.results):
            found = re.search(r"round(\d+)_", r.job_dir)
            out.append(_row(f"final {int(found[1]) + 1 if found else k + 1}", c.label, r))
    return out


def _fmt(v) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def write_csv(path: Path, table: list[dict]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, restval="", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(table)
    atomic_write_text(path, buf.getvalue())


def predictions_section(study: optuna.Study) -> list[str]:
    """The model's predictions (feedrate.sweep.climb), each beside what its trial measured."""
    from feedrate.sweep.climb import PREDICTED_KEY

    lines = []
    for t in sorted(study.trials, key=lambda t: t.number):
        made = t.user_attrs.get(PREDICTED_KEY)
        if not made:
            continue
        predicted = made["predicted_samples_per_sec"]
        got = (
            f"measured {t.value:,.1f} ({t.value / predicted - 1:+.0%})"
            if t.value is not None and predicted
            else f"not measured ({t.state.name.lower()})"
        )
        lines.append(f"| trial {t.number} | {predicted:,.1f} | {got} | {made['why']} |")
    if not lines:
        return []
    return [
        "## What the model predicted",
        "",
        'From what a sample cost in the trials before it (docs/design.md, "What a sample'
        ' costs"); its neighbours were measured after it.',
        "",
        "| trial | predicted samples/s | measured (error) | why |",
        "|---|---|---|---|",
        *lines,
        "",
    ]


def write_markdown(
    path: Path,
    config: DictConfig,
    table,
    contestants,
    decision,
    gap: dict | None = None,
    predicted: list[str] | None = None,
) -> None:
    lines = [
        "# Loader sweep",
        "",
        f"Study `{config.hydra.sweeper.study_name}`,"
        f" storage `{shown(config.hydra.sweeper.storage)}`.",
        "",
        "## Final re-measurement (alternating, same session)",
        "",
        "Contestants that resolved to the same DataLoader settings are one row (`a = b`).",
        "Against the fastest (by the rounds both ran, which a higher median alone need not be):",
        "the geometric mean of the paired rounds' ratios, its interval (95% for all the",
        "comparisons together), and the verdict (a tie when the interval includes 1.0).",
        "",
        "| configuration | median samples/s | spread | runs | against the fastest |",
        "|---|---|---|---|---|",
    ]
    for c in contestants:
        versus = decision.versus_fastest.get(c.name)
        if c is decision.fastest:
            against = "fastest"
        elif decision.why_slower.get(c.name):
            against = decision.why_slower[c.name]
        else:
            against = versus.describe() if versus is not None else ""
        lines.append(
            f"| {c.label}{' (baseline)' if c.is_baseline else ''}"
            f"{' **winner**' if c is decision.winner else ''} | {_fmt(c.median)} | {_fmt(c.spread)}"
            f" | {len(c.values)}/{len(c.results)} | {against} |"
        )
    budget = memory_budget(config)
    lines += ["", f"Decision: {decision.reason}.", ""]
    if budget is not None:
        lines += [f"Memory budget: {budget}; a run over it cannot win.", ""]
    lines += [*gap_section(gap), *(predicted or []), "## Every trial", ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for row in table:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |")
    lines += [
        "",
        "Plots: `samples_vs_workers.png`, `trials_over_time.png`, `final_comparison.png`,"
        " `memory_vs_throughput.png` (the Pareto front of memory and throughput).",
        "",
    ]
    atomic_write_text(path, "\n".join(lines))


def _finish(fig, ax, path: Path, xlabel: str, ylabel: str, title: str, legend=True) -> None:
    """Labels, grid and legend, then the PNG written and the figure closed."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(sweep_dir: Path, table: list[dict], contestants, decision, budget=None) -> None:
    _plot_workers(sweep_dir / "samples_vs_workers.png", table)
    _plot_search(sweep_dir / "trials_over_time.png", table)
    _plot_final(sweep_dir / "final_comparison.png", contestants, decision)
    _plot_memory(sweep_dir / "memory_vs_throughput.png", table, decision, budget)


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory, throughput) points no other point beats on both: less or equal memory
    and more or equal throughput, better on one. Sorted by memory."""
    front, best = [], float("-inf")
    for memory, rate in sorted(points, key=lambda p: (p[0], -p[1])):
        if rate > best:
            front.append((memory, rate))
            best = rate
    return front


def _plot_memory(path: Path, table: list[dict], decision, budget) -> None:
    """Throughput against peak memory for every run that measured both: the Pareto front,
    the memory budget and the preset chosen."""
    measured = [
        r
        for r in table
        if r.get("samples_per_sec") and r.get("memory_mb") and r["status"] in (OK, OVER_BUDGET)
    ]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for status, style in ((OK, "o"), (OVER_BUDGET, "x")):
        pts = [(r["memory_mb"], r["samples_per_sec"]) for r in measured if r["status"] == status]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, alpha=0.6, label=f"run ({status})")
    fits = [
        (r["memory_mb"], r["samples_per_sec"])
        for r in measured
        if budget is None or r["memory_mb"] <= budget.usable_mb
    ]
    front = pareto_front(fits)
    if front:
        ax.step(*zip(*front, strict=True), where="post", color="tab:orange", label="Pareto front")
    skipped = [r["predicted_memory_mb"] for r in table if r.get("predicted_memory_mb")]
    if skipped:
        ax.plot(
            skipped,
            [0] * len(skipped),
            "|",
            markersize=14,
            color="tab:red",
            label="not run: predicted over a limit",
        )
    if budget is not None:
        ax.axvline(budget.mb, color="tab:red", linestyle="--", label=f"budget {budget.mb:,.0f} MB")
    winner = decision.winner
    peaks = [run_memory_mb(r.metrics) for r in winner.results if r.ok and r.metrics]
    if winner.median and any(peaks):
        ax.plot(
            [statistics.median(p for p in peaks if p)],
            [winner.median],
            "*",
            markersize=16,
            color="tab:green",
            label=f"chosen: {winner.label} (medians of its runs)",
        )
    _finish(
        fig,
        ax,
        path,
        "peak memory, MB (PSS of the process tree + its batches in /dev/shm)",
        "samples/s",
        "Throughput against memory (every measured run)",
    )


def _plot_workers(path: Path, table: list[dict]) -> None:
    """samples/s against num_workers, one series per (persistent_workers, start method)."""
    ok = [r for r in table if r["status"] in ("ok", "complete") and r.get("samples_per_sec")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list] = {}
    for r in ok:
        if r.get("num_workers") in (None, ""):
            continue
        if int(r["num_workers"]) == 0:
            label = "no workers (main process)"
        else:
            label = f"persistent={r.get('persistent_workers')}, {r.get('multiprocessing_context')}"
        series.setdefault(label, []).append((int(r["num_workers"]), r["samples_per_sec"]))
    for label, pts in sorted(series.items()):
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, "o", label=label, alpha=0.8)
    ax.set_xscale("symlog", linthresh=1)
    ticks = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
    top = max(
        (int(r["num_workers"]) for r in ok if r.get("num_workers") not in (None, "")), default=1
    )
    ax.set_xticks([t for t in ticks if t <= max(top, 1) * 2])
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    _finish(
        fig,
        ax,
        path,
        "num_workers",
        "samples/s",
        "Throughput against workers (every measured trial)",
        legend=bool(series),
    )


def _plot_search(path: Path, table: list[dict]) -> None:
    """The search over time, with the best so far."""
    search = [r for r in table if r["phase"] in ("search", "earlier session")]
    fig, ax = plt.subplots(figsize=(7, 4))
    best, xs, ys, bests, fails = 0.0, [], [], [], []
    for i, r in enumerate(search):
        v = r.get("samples_per_sec")
        if v:
            best = max(best, v)
            xs.append(i)
            ys.append(v)
        else:
            fails.append(i)
        bests.append(best)
    ax.plot(xs, ys, "o", label="trial")
    ax.step(range(len(bests)), bests, where="post", label="best so far")
    if fails:
        ax.plot(fails, [0] * len(fails), "x", color="red", label="failed / skipped")
    _finish(fig, ax, path, "trial", "samples/s", "Search trials over time")


def _plot_final(path: Path, contestants, decision) -> None:
    """Baselines against candidates in the final rounds."""
    measured = [c for c in contestants if c.median is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [c.label for c in measured]
    meds = [c.median for c in measured]
    lo = [c.median - min(c.values) for c in measured]
    hi = [max(c.values) - c.median for c in measured]
    colors = [
        "tab:green" if c is decision.winner else ("tab:gray" if c.is_baseline else "tab:blue")
        for c in measured
    ]
    ax.bar(names, meds, yerr=[lo, hi], color=colors, capsize=4)
    for i, m in enumerate(meds):
        ax.text(i, m, f"{m:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("median samples/s (min-max)")
    ax.set_title("Final re-measurement: baselines (gray), candidates, winner (green)")
    fig.autofmt_xdate(rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gap_section(gap: dict | None) -> list[str]:
    """Where the winner's time per sample goes: the loader, the model, or their sharing."""
    if gap is None:
        return []
    if gap.get("method") == "costs":
        return [
            "## Where the gap is",
            "",
            gap["words"][0].upper() + gap["words"][1:] + ".",
            "",
            "From what the winner's batches cost in its final runs (`sweep.measure_gap=true`:"
            " its loader-only and compute-only runs measure it instead). Plot: `gap.png`.",
            "",
        ]
    c = gap["ceiling"]
    compute = f"{c['compute_only']:,.1f}" if c["compute_only"] else "n/a"
    return [
        "## Where the gap is",
        "",
        f"Ceiling ({c['kind']}): {c['value']:,.1f} samples/s: {c['why']}. Loader-only at"
        f" {c['loader_settings']}: {c['loader_only']:,.1f}; compute-only: {compute}.",
        "",
        gap["words"][0].upper() + gap["words"][1:] + ".",
        "",
        "Plot: `gap.png`.",
        "",
    ]


def plot_gap(path: Path, gap: dict) -> None:
    """End to end against loader-only, compute-only and the ceiling, and the shares of a
    sample's time."""
    if gap.get("method") == "costs":
        _plot_bounds(path, gap)
        return
    c = gap["ceiling"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = ["end to end", "loader-only", "compute-only", f"ceiling ({c['kind']})"]
    values = [gap["end_to_end"], c["loader_only"], c["compute_only"] or 0.0, c["value"]]
    colors = ["tab:green", "tab:blue", "tab:orange", "tab:red"]
    left.barh(names, values, color=colors)
    for i, v in enumerate(values):
        left.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    left.set_xlabel("samples/s")
    left.invert_yaxis()
    left.set_title("The winner against what each side allows alone")
    shares = gap["shares"]
    right.bar(list(shares), [100 * v for v in shares.values()], color="tab:gray")
    right.axhline(0, color="black", linewidth=0.8)
    right.set_ylabel("% of a sample's time")
    right.set_title("Where each sample's time goes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_bounds(path: Path, gap: dict) -> None:
    """The winner's rate against what each part of its pipeline would allow alone."""
    from feedrate.tuning.model import HELD_BY

    names = ["end to end", *(f"{HELD_BY[k].removeprefix('the ')} alone" for k in gap["bounds"])]
    values = [gap["end_to_end"], *gap["bounds"].values()]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(values) + 1.5))
    colors = ["tab:green"] + ["tab:red" if k == gap["bound"] else "tab:blue" for k in gap["bounds"]]
    ax.barh(names, values, color=colors)
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax.set_xlabel("samples/s")
    ax.invert_yaxis()
    ax.set_title(f"The winner ({gap['setting']}) against each part's bound, from its costs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(
    sweep_dir: Path, config, study, search, contestants, decision, gap: dict | None = None
) -> None:
    table = rows(study, search, contestants, n_new=len(search))
    write_csv(sweep_dir / "trials.csv", table)
    write_markdown(
        sweep_dir / "sweep_report.md",
        config,
        table,
        contestants,
        decision,
        gap,
        predictions_section(study),
    )
    plot_all(sweep_dir, table, contestants, decision, memory_budget(config))
    if gap is not None:
        plot_gap(sweep_dir / "gap.png", gap)
