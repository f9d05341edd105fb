"""How the sweep decides: contestants re-measured in alternating rounds, those with the same
resolved settings folded into one, those shown slower dropped, and the fastest wins, or a
cheaper contestant shown within ``sweep.equivalence`` of it; the rounds stop once that is
settled (docs/design.md, "How the sweep decides")."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from feedrate import stats
from feedrate.errors import FeedrateError
from feedrate.files import atomic_write_text
from feedrate.sweep.feasibility import Budget, run_memory_mb
from feedrate.sweep.trial import TrialResult

BASELINES = ("default", "recipe")


def resolved_settings(metrics: dict, stream: bool) -> dict | None:
    """What a run's DataLoader really ran with, as far as throughput can tell (None: unknown).

    Two contestants with the same resolved settings are one configuration measured twice, not
    a comparison: ``pin_memory`` is off without CUDA, ``prefetch_factor: null`` is 2, and the
    worker-only settings mean nothing without workers; ``persistent_workers`` does nothing
    while streaming (no epoch ends).
    """
    run = (metrics or {}).get("run") or {}
    loader = run.get("loader")
    if not loader:
        return None
    out = {
        "batch_size": loader.get("batch_size"),
        "num_workers": loader.get("num_workers", 0),
        "pin_memory": bool(loader.get("pin_memory")),
        "torch_threads": run.get("torch_threads"),
        "decode": loader.get("decode", "cpu"),
    }
    if out["num_workers"]:
        out["prefetch_factor"] = loader.get("prefetch_factor") or 2
        out["multiprocessing_context"] = loader.get("multiprocessing_context")
        out["worker_threads"] = loader.get("worker_threads") or 1
        if not stream:
            out["persistent_workers"] = bool(loader.get("persistent_workers"))
    return out


@dataclass
class Contestant:
    name: str  # "recipe", "default", "trial 7", ...
    overrides: list[str]
    is_baseline: bool
    results: list[TrialResult] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)  # contestants that resolved to the same
    dropped: str = ""  # why it was not measured to the last round (shown slower)
    rounds: list[int] = field(default_factory=list)  # the final round of each result

    def add(self, result: TrialResult, round_: int) -> None:
        self.results.append(result)
        self.rounds.append(round_)

    def per_round(self) -> dict[int, float]:
        """Round -> samples/s (the median where merged contestants ran twice in one round):
        the paired figures :func:`feedrate.stats.compare` weighs."""
        by: dict[int, list[float]] = {}
        for r, res in zip(self.per_round_index(), self.results, strict=True):
            if res.ok:
                by.setdefault(r, []).append(res.value)
        return {r: statistics.median(v) for r, v in by.items()}

    @property
    def label(self) -> str:
        """``recipe = trial 3`` when several contestants are one configuration."""
        return " = ".join([self.name, *self.aliases])

    @property
    def values(self) -> list[float]:
        return [r.value for r in self.results if r.ok]

    @property
    def failures(self) -> list[str]:
        return [f"{r.status}: {r.reason}" for r in self.results if not r.ok]

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def spread(self) -> float:
        """(max - min) of the repeats, in samples/s."""
        return max(self.values) - min(self.values) if len(self.values) > 1 else 0.0

    def per_round_index(self) -> list[int]:
        return (
            self.rounds if len(self.rounds) == len(self.results) else list(range(len(self.results)))
        )

    def ok_result(self) -> TrialResult | None:
        return next((r for r in self.results if r.ok), None)

    def loader(self) -> dict:
        r = self.ok_result()
        if r is None:
            return {}
        composed = OmegaConf.load(Path(r.job_dir) / ".hydra" / "config.yaml")
        return OmegaConf.to_container(composed.loader, resolve=True)

    @property
    def peak_mb(self) -> float | None:
        """The most memory any of its runs used (:func:`run_memory_mb`), or None."""
        peaks = [run_memory_mb(r.metrics) or 0.0 for r in self.results if r.metrics]
        return max(peaks) if any(peaks) else None

    def over_budget(self, budget: Budget | None) -> str:
        if budget is None:
            return ""
        return next((why for r in self.results if (why := budget.over(r.metrics))), "")

    def cost(self) -> tuple[float, float]:
        """Cheaper first: fewer workers, then less memory (:func:`run_memory_mb`, the one
        measure of a run's memory: docs/design.md, "Memory readings")."""
        mem = [run_memory_mb(r.metrics) or 0.0 for r in self.results if r.ok]
        # the workers a rank ran (under torchrun a config may say the machine's, divided)
        first = self.ok_result()
        ran = ((first.metrics if first else {}) or {}).get("run") or {}
        ran = ran.get("loader") or {}
        workers = ran.get("num_workers", self.loader().get("num_workers", 0))
        return (workers, statistics.median(mem) if mem else 0.0)


def twins(settings: list[tuple[str, dict | None]]) -> dict[str, str]:
    """Name -> the earlier name that ran the same resolved settings (``settings``: each name
    with its :func:`resolved_settings`, in order; None: unknown, never a twin). The sweep's
    finals and the benchmark merge contestants by this one rule."""
    first: list[tuple[dict, str]] = []
    found: dict[str, str] = {}
    for name, key in settings:
        if key is None:
            continue
        twin = next((n for k, n in first if k == key), None)
        if twin is None:
            first.append((key, name))
        elif twin != name:
            found[name] = twin
    return found


def merge_identical(contestants: list[Contestant], stream: bool) -> list[Contestant]:
    """One contestant per resolved configuration: a later one that ran the same settings as an
    earlier one is folded into it (its runs count for both); the order is kept."""
    by_name = {c.name: c for c in contestants}
    settings = []
    for c in contestants:
        r = c.ok_result()
        settings.append((c.name, resolved_settings(r.metrics, stream) if r is not None else None))
    folded = twins(settings)
    for name, twin_name in folded.items():
        c, twin = by_name[name], by_name[twin_name]
        twin.aliases += [c.name, *c.aliases]
        twin.rounds = [*twin.per_round_index(), *c.per_round_index()]
        twin.results += c.results
        twin.is_baseline = twin.is_baseline or c.is_baseline
    return [c for c in contestants if c.name not in folded]


FINALIST_WITHIN = 0.10  # sweep.finalist_within


def near_twins(a: dict, b: dict) -> bool:
    """Two searched settings no final round could tell apart: the same in every parameter
    but the worker count, and worker counts within ``SAME_WORKERS`` of each other (51 and
    54 workers on 10 ms reads: five final rounds of both ended in a tie, 55 s of runs)."""
    key = "loader.num_workers"
    if {k: v for k, v in a.items() if k != key} != {k: v for k, v in b.items() if k != key}:
        return False
    wa, wb = a.get(key), b.get(key)
    if wa is None or wb is None:
        return wa == wb
    return abs(wa - wb) <= SAME_WORKERS * max(wa, wb)


def pick_finalists(
    ranked: list[tuple[str, dict, float]],
    n: int,
    within: float = FINALIST_WITHIN,
    maximize: bool = True,
) -> list[tuple[str, dict, float]]:
    """The search's trials worth re-measuring: ``ranked`` best first (name, params, value),
    at most ``n``. The best always; after it, only trials within ``within`` of its search
    figure (a second finalist guards against a lucky search run, and no search run is lucky by
    25%: webdataset's 16 workers at 0.72 of the best lost every final round), and none that is
    a near twin of one already picked, or has the same parameters. ``maximize`` False: lower
    is better, and within means at most ``1 + within`` times the best."""
    out: list[tuple[str, dict, float]] = []
    for name, params, value in ranked:
        if len(out) >= n:
            break
        best = out[0][2] if out else value
        if (value < (1 - within) * best) if maximize else (value > (1 + within) * best):
            break
        if any(params == p or near_twins(params, p) for _, p, _ in out):
            continue
        out.append((name, params, value))
    return out


CLEARLY_SLOWER = 0.5


def clearly_slower(c: Contestant, fastest: Contestant) -> str:
    """Why ``c`` is slower than ``fastest`` whatever the rounds, or empty: its best run below
    ``CLEARLY_SLOWER`` times the fastest's worst. No run-to-run noise spans a factor of two
    (PyTorch's default against 32 workers on I/O-bound data), so this needs no interval."""
    if c is fastest or not c.values or max(c.values) >= CLEARLY_SLOWER * min(fastest.values):
        return ""
    return (
        f"clearly slower: its best run, {max(c.values):,.1f} samples/s, is below half of the"
        f" worst run of {fastest.label}, {min(fastest.values):,.1f}"
    )


def drop_clearly_slower(contestants: list[Contestant]) -> list[Contestant]:
    """Mark the clearly slower contestants, so later rounds spend no time on them; returns
    them."""
    measured = [c for c in contestants if c.values and not c.failures and not c.dropped]
    if not measured:
        return []
    fastest = max(measured, key=lambda c: c.median)
    out = []
    for c in measured:
        why = clearly_slower(c, fastest)
        if why:
            c.dropped = f"{why}; not measured further"
            out.append(c)
    return out


@dataclass
class Decision:
    winner: Contestant
    fastest: Contestant
    best_baseline: Contestant | None
    reason: str
    contestants: list[Contestant] = field(default_factory=list)
    # each measured contestant against the fastest: the paired ratio and its interval
    versus_fastest: dict[str, stats.Comparison | None] = field(default_factory=dict)
    # why each contestant shown slower than the fastest is (empty for the others)
    why_slower: dict[str, str] = field(default_factory=dict)


SAME_WORKERS = 0.10  # worker counts this close are equally cheap: memory decides


def cheapest(contestants: list[Contestant]) -> Contestant:
    """Fewest workers, then least memory: 50 workers with 15 GB of batches in /dev/shm are
    not cheaper than 51 with 2 GB, so counts within ``SAME_WORKERS`` of the fewest are equal."""
    cost = {c.name: c.cost() for c in contestants}  # each reads its run's config once
    fewest = min(workers for workers, _ in cost.values())
    near = [c for c in contestants if cost[c.name][0] <= fewest * (1 + SAME_WORKERS)]
    return min(near, key=lambda c: (cost[c.name][1], cost[c.name][0], -c.median))


def simultaneous(k: int) -> float:
    """The confidence of each comparison between two of ``k`` contestants such that all
    k(k-1)/2 of them hold together at 95% (Bonferroni). Without it, "slower than the fastest"
    is tested against the very runs that made it the fastest, k - 1 times at 5% each, and calls
    one of four equal contestants slower 15% of the time (tests/test_sweep.py)."""
    return 1 - (1 - stats.CONFIDENCE) / max(1, k * (k - 1) // 2)


def slower_than_another(c: Contestant, others: list[Contestant], confidence: float) -> str:
    """Why ``c`` is significantly slower than one of ``others`` (paired rounds), or empty.
    Every other contestant is a reference, not only the fastest by median: the fastest is
    picked by the same runs, which would bias the test (multiple comparisons with the best)."""
    for d in others:
        if d is c:
            continue
        versus = stats.compare(c.per_round(), d.per_round(), confidence)
        if versus is not None and versus.verdict == stats.LOSS:
            return f"significantly slower than {d.label}: {versus.describe()}"
    return ""


def within_margin(c: Contestant, fastest: Contestant, confidence: float, margin: float) -> bool:
    """The whole interval of ``c`` against ``fastest`` lies above 1 - ``margin``: equal for
    practical purposes, whatever a significance test says."""
    versus = stats.compare(c.per_round(), fastest.per_round(), confidence)
    return versus is not None and versus.low >= 1 - margin


def drop_shown_slower(contestants: list[Contestant], margin: float) -> list[Contestant]:
    """After the minimum rounds, mark the contestants already shown slower than another, as
    :func:`decide` would show them (simultaneous intervals, outside ``margin`` of the fastest),
    so later rounds spend no time on them: more rounds only narrow their intervals. Their
    rounds so far still count (the baselines' ratios pair the rounds both ran). Returns them."""
    live = [c for c in contestants if c.values and not c.failures and not c.dropped]
    if len(live) < 2 or min(len(c.per_round()) for c in live) < stats.MIN_ROUNDS:
        return []
    fastest = stats.fastest(live, Contestant.per_round)
    confidence = simultaneous(len(live))
    out = []
    for c in live:
        why = slower_than_another(c, live, confidence) if c is not fastest else ""
        if why and not within_margin(c, fastest, confidence, margin):
            out.append((c, why))
    for c, why in out:  # judged together, against the same live set
        c.dropped = f"{why}; not measured further"
    return [c for c, _ in out]


def settled(contestants: list[Contestant], margin: float) -> bool:
    """More rounds cannot change the decision by more than ``margin``: every contestant still
    measured is significantly slower than another, or within ``margin`` of the fastest (the
    whole simultaneous interval of its ratio above 1 - margin)."""
    live = [c for c in contestants if c.values and not c.failures and not c.dropped]
    if len(live) < 2:
        return True
    if min(len(c.per_round()) for c in live) < stats.MIN_ROUNDS:
        return False
    fastest = stats.fastest(live, Contestant.per_round)
    confidence = simultaneous(len(live))
    for c in live:
        if c is fastest or slower_than_another(c, live, confidence):
            continue
        if not within_margin(c, fastest, confidence, margin):
            return False
    return True


def described(versus: stats.Comparison | None) -> str:
    return versus.describe() if versus is not None else "(no comparison)"


EQUIVALENCE = 0.05  # sweep.equivalence: ratios this close to 1 are equal for practical purposes


def decide(
    contestants: list[Contestant], budget: Budget | None = None, margin: float = EQUIVALENCE
) -> Decision:
    """The fastest, or a cheaper contestant shown equal to it.

    Equal: the whole interval of its ratio to the fastest lies above 1 - ``margin``
    (simultaneous 95% intervals over the paired rounds). That is a claim the rounds must
    show, not the absence of one: a cheaper contestant merely not shown slower (0.93x
    [0.86, 1.01] over 5 rounds of 16 against 26 workers a rank) may be 14% slower, and is
    not taken. A consistent 1% is significant over paired rounds and still equal: no reason
    to pay for three times the workers. Among the fastest and those equal to it, the
    cheapest wins: fewest workers, then least memory.

    A contestant is shown slower when another is significantly faster (:func:`slower_than_another`)
    or clearly so (a factor of two below the fastest, at any number of rounds); the others,
    neither slower nor equal, are undecided: more rounds would tell. A contestant with any
    failed final run is out, baselines included, and so is one that used more memory than
    ``budget`` in any of them.
    """
    over = {c.name: c.over_budget(budget) for c in contestants}
    eligible = [
        c for c in contestants if c.median is not None and not c.failures and not over[c.name]
    ]
    if not eligible:
        raise _nothing_to_decide(contestants, over, budget)
    live = [c for c in eligible if not c.dropped]
    fastest = stats.fastest(live or eligible, Contestant.per_round)  # by the paired rounds
    by_median = max(eligible, key=lambda c: c.median)
    confidence = simultaneous(len(live))
    versus = {
        c.name: stats.compare(c.per_round(), fastest.per_round(), confidence) for c in eligible
    }
    why_slower = {
        c.name: c.dropped or clearly_slower(c, fastest) or slower_than_another(c, live, confidence)
        for c in eligible
    }
    equal = {  # equal for practical purposes: within the margin, whatever the test
        c.name: not c.dropped and versus[c.name] is not None and versus[c.name].low >= 1 - margin
        for c in eligible
    }
    for c in eligible:
        if equal[c.name]:
            why_slower[c.name] = ""
    close = [c for c in eligible if c is fastest or equal[c.name]]
    winner = cheapest(close)
    baselines = [c for c in eligible if c.is_baseline]
    best_baseline = max(baselines, key=lambda c: c.median) if baselines else None
    slower = [c for c in eligible if why_slower[c.name] and c not in close]
    undecided = [c for c in eligible if c not in close and c not in slower]
    out = [c for c in contestants if c not in eligible]
    reason = _reason(
        winner, fastest, by_median, close, undecided, slower, versus, why_slower, margin
    )
    reason += _left_out(contestants, out, over)
    return Decision(winner, fastest, best_baseline, reason, contestants, versus, why_slower)


def _nothing_to_decide(contestants: list[Contestant], over: dict, budget: Budget | None):
    """No contestant is eligible: the error that says why each is out."""
    reasons = "; ".join(
        f"{c.label}: {over[c.name] or ', '.join(c.failures) or 'no run'}" for c in contestants
    )
    peaks = [c.peak_mb for c in contestants if c.peak_mb]
    least = (
        f"; the least any of them used was {min(peaks):,.0f} MB: raise"
        " sweep.memory_budget_gb to at least that"
        if budget and peaks
        else ""
    )
    return FeedrateError(
        "no configuration ran every final run without failing"
        + (" within the memory budget" if budget else "")
        + f", so there is nothing to decide and no preset was written ({reasons}){least}"
    )


def _reason(winner, fastest, by_median, close, undecided, slower, versus, why, margin) -> str:
    """Why ``winner`` won, and why each contestant close to it or undecided did not."""
    if winner is fastest:
        reason = f"{winner.label} is the fastest ({winner.median:,.1f} samples/s)"
        if by_median is not fastest:
            reason += (
                f", by the rounds both ran: {by_median.label}, of the higher median"
                f" ({by_median.median:,.1f}), reads {described(versus[by_median.name])} of it"
            )
        others = [c for c in close if c is not winner]
        if others:
            reason += f"; within {margin:.0%} of it but no cheaper: " + ", ".join(
                f"{c.label} {described(versus[c.name])}" for c in others
            )
    else:
        reason = (
            f"{winner.label} ({winner.cost()[0]} workers) is within {margin:.0%} of the"
            f" fastest, {fastest.label} ({fastest.cost()[0]} workers):"
            f" {described(versus[winner.name])}; the cheapest of those within {margin:.0%}"
            " wins"
        )
    if undecided:
        reason += (
            f"; neither shown slower nor within {margin:.0%} of the fastest, so not taken"
            " for being cheaper or as fast: "
            + ", ".join(f"{c.label} {described(versus[c.name])}" for c in undecided)
        )
    if slower:
        reason += "; slower: " + ", ".join(f"{c.label} ({why[c.name]})" for c in slower)
    return reason


def _left_out(contestants: list[Contestant], out: list, over: dict) -> str:
    """The contestants out of the decision: a failed final run, over the memory budget."""
    reason = ""
    failed = [c for c in out if c.failures]
    if failed:
        reason += "; out for a failed final run: " + ", ".join(c.label for c in failed)
    if any(over.values()):
        reason += "; over the memory budget: " + ", ".join(
            f"{c.label} ({over[c.name]})" for c in contestants if over[c.name]
        )
    return reason


def write_decision(
    sweep_dir: Path, decision: Decision, seconds: dict[str, float] | None = None
) -> None:
    """``final_decision.yaml`` beside Optuna's ``optimization_results.yaml``, which names the
    best *search* trial: the final decision, after re-measuring, can differ from it; with
    the seconds each phase of the sweep took."""
    winner = decision.winner
    data = {
        "winner": winner.label,
        "loader": winner.loader(),
        "median_samples_per_sec": winner.median,
        "reason": decision.reason,
        "versus_fastest": {
            c.name: {
                **(decision.versus_fastest[c.name] or stats.Comparison(1, 1, 1, (0, 0))).as_dict(),
                **(
                    {"verdict": "slower", "why": decision.why_slower[c.name]}
                    if decision.why_slower.get(c.name)
                    else {}
                ),
            }
            for c in decision.contestants
            if c.name in decision.versus_fastest
        },
        **({"seconds": seconds} if seconds else {}),
    }
    note = (
        "# The sweep's final decision, after re-measuring the finalists and the baselines in"
        " alternating rounds.\n# optimization_results.yaml beside it is Optuna's best *search*"
        " trial (one short run each), not this.\n"
    )
    atomic_write_text(sweep_dir / "final_decision.yaml", note + OmegaConf.to_yaml(data))
    optuna_file = sweep_dir / "optimization_results.yaml"
    if optuna_file.exists():
        text = optuna_file.read_text()
        pointer = (
            "# best_params: the best search trial; the sweep's choice is final_decision.yaml\n"
        )
        if not text.startswith(pointer):
            atomic_write_text(optuna_file, pointer + text)
