"""The decision, one for every tuner: the sweep's final rounds and the tuning loader's climb
(docs/design.md, "How the sweep decides").

Contestants measured in rounds (the sweep's: alternating, paired; the climb's: one window
each) go in, and the winner comes out with the reason: the fastest, or a cheaper contestant
shown within ``margin`` of it, or the incumbent (the setting a run started with) that no
other measured ``gain`` faster. With at least :data:`feedrate.stats.MIN_ROUNDS` paired
rounds the intervals decide; with single measurements only the incumbent's ``gain`` rule and
a factor of two (:func:`clearly_slower`) can, and the reason says the rest is no claim.

A contestant is anything with the :class:`Measured` attributes: the sweep's
(:class:`feedrate.sweep.decide.Contestant`, its trial results) and the climb's
(:class:`Once`, one figure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from feedrate import stats
from feedrate.errors import FeedrateError

GAIN = 0.10  # single measurements: another than the incumbent must measure this much faster

# Which rule decided (Decision.rule, and the climb's Choice.rule): what a test checks and a
# program reads; the reason is the same in words, for people
HELD = "held"  # the incumbent, with nothing measured ``gain`` faster (single measurements)
HELD_EQUAL = "held-equal"  # the incumbent, within ``margin`` of the fastest over the rounds
FASTEST = "fastest"  # the fastest by the paired rounds
CHEAPER_EQUAL = "cheaper-equal"  # a cheaper contestant within ``margin`` of the fastest


class Measured(Protocol):
    """What the rules read of a contestant."""

    name: str
    is_baseline: bool
    dropped: str  # why it was not measured further (shown slower, left early), or empty

    @property
    def label(self) -> str: ...
    @property
    def values(self) -> list[float]: ...
    @property
    def failures(self) -> list[str]: ...
    @property
    def median(self) -> float | None: ...
    @property
    def peak_mb(self) -> float | None: ...
    def per_round(self) -> dict[int, float]: ...
    def over_budget(self, budget: Any) -> str: ...
    def cost(self) -> tuple[float, float]: ...


def _per_round(c: Measured) -> dict[int, float]:
    return c.per_round()


@dataclass
class Once:
    """A contestant measured once (a window of the climb): ``value`` None when it failed."""

    name: str
    value: float | None
    workers: int
    failed: str = ""
    dropped: str = ""
    is_baseline: bool = False
    peak_mb: float | None = None

    @property
    def label(self) -> str:
        return self.name

    @property
    def values(self) -> list[float]:
        return [self.value] if self.value is not None and not self.failed else []

    @property
    def failures(self) -> list[str]:
        return [self.failed] if self.failed else []

    @property
    def median(self) -> float | None:
        return self.values[0] if self.values else None

    def per_round(self) -> dict[int, float]:
        return {0: self.values[0]} if self.values else {}

    def over_budget(self, budget: Any) -> str:
        return ""

    def cost(self) -> tuple[float, float]:
        return (self.workers, 0.0)


CLEARLY_SLOWER = 0.5


def clearly_slower(c: Measured, fastest: Measured) -> str:
    """Why ``c`` is slower than ``fastest`` whatever the rounds, or empty: its best run below
    ``CLEARLY_SLOWER`` times the fastest's worst. No run-to-run noise spans a factor of two
    (PyTorch's default against 32 workers on I/O-bound data), so this needs no interval."""
    if c is fastest or not c.values or max(c.values) >= CLEARLY_SLOWER * min(fastest.values):
        return ""
    return (
        f"clearly slower: its best run, {max(c.values):,.1f} samples/s, is below half of the"
        f" worst run of {fastest.label}, {min(fastest.values):,.1f}"
    )


def drop_clearly_slower(contestants: list[Measured]) -> list[Measured]:
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


def behind_every_round(contestants: list[Measured], lead: float, why: str) -> list[Measured]:
    """Mark the contestants below ``1 - lead`` of the fastest (by the paired rounds) in every
    round both ran, two at least, as measured no further for ``why``; returns them. Not a
    verdict: a decision that cannot wait for the rounds an interval needs (the sweep's time
    budget) keeps measuring only those it could still choose."""
    live = [c for c in contestants if c.values and not c.failures and not c.dropped]
    if len(live) < 2:
        return []
    fastest = stats.fastest(live, _per_round)
    top = fastest.per_round()
    out = []
    for c in live:
        mine = c.per_round()
        common = [r for r in mine if r in top]
        if c is fastest or len(common) < 2:
            continue
        if all(mine[r] < (1 - lead) * top[r] for r in common):
            c.dropped = (
                f"behind {fastest.label} by more than {lead:.0%} in each of its {len(common)}"
                f" rounds; not measured further: {why}"
            )
            out.append(c)
    return out


@dataclass
class Decision:
    winner: Measured
    fastest: Measured
    best_baseline: Measured | None
    reason: str
    rule: str = FASTEST  # HELD, HELD_EQUAL, FASTEST or CHEAPER_EQUAL
    contestants: list[Measured] = field(default_factory=list)
    # each measured contestant against the fastest: the paired ratio and its interval
    versus_fastest: dict[str, stats.Comparison | None] = field(default_factory=dict)
    # why each contestant shown slower than the fastest is (empty for the others)
    why_slower: dict[str, str] = field(default_factory=dict)


SAME_WORKERS = 0.10  # worker counts this close are equally cheap: memory decides


def cheapest(contestants: list[Measured]) -> Measured:
    """Fewest workers, then least memory: 50 workers with 15 GB of batches in /dev/shm are
    not cheaper than 51 with 2 GB, so counts within ``SAME_WORKERS`` of the fewest are equal."""
    cost = {c.name: c.cost() for c in contestants}  # each reads its run's config once
    fewest = min(workers for workers, _ in cost.values())
    near = [c for c in contestants if cost[c.name][0] <= fewest * (1 + SAME_WORKERS)]
    return min(near, key=lambda c: (cost[c.name][1], cost[c.name][0], -c.median))


def slower_than_another(c: Measured, others: list[Measured], confidence: float) -> str:
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


def within_margin(c: Measured, fastest: Measured, confidence: float, margin: float) -> bool:
    """The whole interval of ``c`` against ``fastest`` lies within ``margin`` of 1 (both
    ends): equal for practical purposes, whatever a significance test says."""
    versus = stats.compare(c.per_round(), fastest.per_round(), confidence)
    return versus is not None and versus.within(margin)


def drop_shown_slower(contestants: list[Measured], margin: float, looks: int = 1) -> list[Measured]:
    """After the minimum rounds, mark the contestants already shown slower than another, as
    :func:`decide` would show them (simultaneous intervals, outside ``margin`` of the fastest),
    so later rounds spend no time on them: more rounds only narrow their intervals. Their
    rounds so far still count (the baselines' ratios pair the rounds both ran). Returns them."""
    live = [c for c in contestants if c.values and not c.failures and not c.dropped]
    if len(live) < 2 or min(len(c.per_round()) for c in live) < stats.MIN_ROUNDS:
        return []
    fastest = stats.fastest(live, _per_round)
    confidence = stats.simultaneous(len(contestants), looks)
    out = []
    for c in live:
        why = slower_than_another(c, live, confidence) if c is not fastest else ""
        if why and not within_margin(c, fastest, confidence, margin):
            out.append((c, why))
    for c, why in out:  # judged together, against the same live set
        c.dropped = f"{why}; not measured further"
    return [c for c, _ in out]


def settled(contestants: list[Measured], margin: float, looks: int = 1) -> bool:
    """More rounds cannot change the decision by more than ``margin``: every contestant still
    measured is significantly slower than another, or within ``margin`` of the fastest (the
    whole simultaneous interval of its ratio inside [1 - margin, 1 + margin]). ``looks``: how
    many times the rounds are looked at in all (:func:`feedrate.stats.simultaneous`)."""
    live = [c for c in contestants if c.values and not c.failures and not c.dropped]
    if len(live) < 2:
        return True
    if min(len(c.per_round()) for c in live) < stats.MIN_ROUNDS:
        return False
    fastest = stats.fastest(live, _per_round)
    confidence = stats.simultaneous(len(contestants), looks)
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
    contestants: list[Measured],
    budget: Any = None,
    margin: float = EQUIVALENCE,
    incumbent: str | None = None,
    gain: float = GAIN,
    looks: int = 1,
) -> Decision:
    """The fastest, or a cheaper contestant shown equal to it, or the ``incumbent`` (a name).

    Equal: the whole interval of its ratio to the fastest lies inside [1 - ``margin``,
    1 + ``margin``] (simultaneous 95% intervals over the paired rounds, corrected for every
    contestant in ``contestants``, dropped ones too, and for the ``looks`` at the rounds that
    the finals took: :func:`feedrate.stats.simultaneous`). That is a claim the rounds must
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

    The ``incumbent`` (the setting a run started with, which runs already) wins whenever it
    is close: over rounds, as any other; on single measurements (fewer than
    :data:`feedrate.stats.MIN_ROUNDS` rounds), unless the fastest measured at least ``gain``
    faster than it. A single window is no evidence of a few percent either way, and
    switching away from what runs is what needs it.
    """
    over = {c.name: c.over_budget(budget) for c in contestants}
    eligible = [
        c for c in contestants if c.median is not None and not c.failures and not over[c.name]
    ]
    if not eligible:
        raise _nothing_to_decide(contestants, over, budget)
    live = [c for c in eligible if not c.dropped]
    fastest = stats.fastest(live or eligible, _per_round)  # by the paired rounds
    by_median = max(eligible, key=lambda c: c.median)
    confidence = stats.simultaneous(len(contestants), looks)
    versus = {
        c.name: stats.compare(c.per_round(), fastest.per_round(), confidence) for c in eligible
    }
    why_slower = {
        c.name: c.dropped or clearly_slower(c, fastest) or slower_than_another(c, live, confidence)
        for c in eligible
    }
    equal = {  # equal for practical purposes: within the margin, whatever the test
        c.name: _equal(versus[c.name], margin, gain if c.name == incumbent else None)
        and not c.dropped
        for c in eligible
    }
    for c in eligible:
        if equal[c.name]:
            why_slower[c.name] = ""
    close = [c for c in eligible if c is fastest or equal[c.name]]
    held = next((c for c in close if c.name == incumbent), None)
    winner = held or cheapest(close)
    baselines = [c for c in eligible if c.is_baseline]
    best_baseline = max(baselines, key=lambda c: c.median) if baselines else None
    slower = [c for c in eligible if why_slower[c.name] and c not in close]
    undecided = [c for c in eligible if c not in close and c not in slower]
    out = [c for c in contestants if c not in eligible]
    if held is not None and (held is not fastest or len(held.values) < stats.MIN_ROUNDS):
        reason = _held(held, eligible, versus, margin, gain)
        rule = HELD if len(held.values) < stats.MIN_ROUNDS else HELD_EQUAL
    else:
        reason = _reason(
            winner, fastest, by_median, close, undecided, slower, versus, why_slower, margin
        )
        rule = FASTEST if winner is fastest else CHEAPER_EQUAL
    reason += _left_out(contestants, out, over)
    return Decision(winner, fastest, best_baseline, reason, rule, contestants, versus, why_slower)


def _equal(versus: stats.Comparison | None, margin: float, gain: float | None) -> bool:
    """Within ``margin`` of the fastest: the whole interval inside [1 - ``margin``,
    1 + ``margin``], over :data:`feedrate.stats.MIN_ROUNDS` paired rounds or more. On fewer,
    no contestant is shown equal but the incumbent (``gain`` given), while the fastest
    measured less than ``gain`` faster than it."""
    if versus is None:
        return False
    if min(versus.rounds) < stats.MIN_ROUNDS:  # no claim of equal, but the incumbent's
        return gain is not None and versus.ratio * (1 + gain) > 1
    return versus.within(margin)


def _held(held: Measured, eligible: list, versus: dict, margin: float, gain: float) -> str:
    """Why the incumbent stays: nothing measured ``gain`` faster (single measurements), or
    it is within ``margin`` of the fastest over the rounds."""
    others = [c for c in eligible if c is not held]
    if len(held.values) < stats.MIN_ROUNDS:
        best = max(others, key=lambda c: c.median, default=None)
        ratio = f"; best {best.label}, {best.median / held.median:.2f}x of it" if best else ""
        return f"{held.label} (the start) holds: no setting measured {gain:.0%} faster{ratio}"
    fastest = max(others, key=lambda c: c.median)
    return (
        f"{held.label} (the start) holds: within {margin:.0%} of the fastest, {fastest.label}:"
        f" {described(versus[held.name])}"
    )


def _nothing_to_decide(contestants: list[Measured], over: dict, budget: Any):
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


def _left_out(contestants: list[Measured], out: list, over: dict) -> str:
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
