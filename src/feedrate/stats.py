"""When is one configuration faster than another? Only when the interval of the ratio says so.

Two runs of the same settings differ by several percent on a shared machine, so a ratio of two
figures is no verdict by itself. A comparison takes alternating rounds of both sides, and the
rounds are paired: both sides of one round ran minutes apart on the same machine, so what
disturbed one round (a neighbour, the page cache) disturbed both. The per-round log-ratios
carry the evidence; their mean gives the ratio (a geometric mean of the rounds' ratios) and a
Student t interval (docs/design.md, "When one configuration is faster than another"). A win or
a loss needs at least ``MIN_ROUNDS`` paired rounds and an interval that excludes 1.0; anything
else is a tie. When several contestants are compared at once, or the rounds are looked at
more than once (a stop after round 3 or 4), the caller widens the interval: see
:func:`simultaneous`.

One rule for every verdict, in the sweep, autotune and the benches:

- a win or a loss: the interval excludes 1.0 (:attr:`Comparison.verdict`);
- a target met: the interval's low end reaches it (:func:`against`);
- equal within x: the whole interval lies inside [1 - x, 1 + x] (:meth:`Comparison.within`,
  :func:`equal_within`);
- otherwise a tie, or "not shown".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

MIN_ROUNDS = 3  # fewer paired rounds than this: no claim either way
CONFIDENCE = 0.95
WIN, LOSS, TIE = "win", "loss", "tie"
MET, MISSED, NOT_SHOWN, NO_FIGURE = "met", "missed", "not shown", "no figure"  # a target

Rounds = Mapping[int, float] | Sequence[float | None]
T = TypeVar("T")


@dataclass(frozen=True)
class Comparison:
    """``a`` against ``b``: the ratio (geometric mean of the paired rounds') and its interval."""

    ratio: float
    low: float
    high: float
    rounds: tuple[int, int]  # paired rounds (the same count for both sides)
    p_value: float = 1.0  # paired t test on the log-ratios, two-sided
    confidence: float = CONFIDENCE

    @property
    def verdict(self) -> str:
        if min(self.rounds) < MIN_ROUNDS:
            return TIE
        if self.low > 1.0:
            return WIN
        if self.high < 1.0:
            return LOSS
        return TIE

    def describe(self) -> str:
        """``1.23x [1.10, 1.31] win`` or ``0.98x [0.91, 1.06] tie within noise``."""
        text = f"{self.ratio:.2f}x [{self.low:.2f}, {self.high:.2f}]"
        if self.verdict != TIE:
            return f"{text} {self.verdict}"
        if min(self.rounds) < MIN_ROUNDS:
            return f"{text} no claim ({min(self.rounds)} rounds, {MIN_ROUNDS} needed)"
        return f"{text} tie within noise"

    def within(self, margin: float) -> bool:
        """The whole interval lies within ``margin`` of 1: equal for practical purposes."""
        return equal_within(self.as_dict(), margin)

    def as_dict(self) -> dict:
        return {
            "ratio": self.ratio,
            "low": self.low,
            "high": self.high,
            "rounds": list(self.rounds),
            "p_value": self.p_value,
            "confidence": self.confidence,
            "verdict": self.verdict,
        }


def simultaneous(contestants: int, looks: int = 1) -> float:
    """The confidence of each comparison such that every comparison between two of
    ``contestants``, at every one of ``looks`` at the rounds, holds together at 95%
    (Bonferroni: a union bound, valid whenever the rounds are looked at, and so under optional
    stopping). ``contestants`` counts every one that entered, dropped ones too: counting only
    those still measured would loosen the correction as they drop. Without it, "slower than
    the fastest" is tested against the very runs that made it the fastest, k - 1 times at 5%
    each, and calls one of four equal contestants slower 15% of the time
    (tests/test_sweep.py)."""
    pairs = max(1, contestants * (contestants - 1) // 2)
    return 1 - (1 - CONFIDENCE) / (pairs * max(1, looks))


def looks(rounds: int) -> int:
    """How many times up to ``rounds`` paired rounds are looked at when each from the
    ``MIN_ROUNDS``-th on may stop them (a contestant dropped, the finals settled): 3 for 5."""
    return max(1, rounds - MIN_ROUNDS + 1)


def equal_within(ratio: Mapping | None, margin: float) -> bool:
    """A ratio (a :meth:`Comparison.as_dict`) equal to 1 within ``margin``: the whole interval
    inside [1 - margin, 1 + margin], over ``MIN_ROUNDS`` rounds or more. A low end above
    1 - margin alone is not equal: 1.00x [0.96, 1.30] may be 30% faster."""
    return (
        ratio is not None
        and min(ratio["rounds"]) >= MIN_ROUNDS
        and ratio["low"] >= 1 - margin
        and ratio["high"] <= 1 + margin
    )


def against(ratio: Mapping | None, target: float) -> str:
    """A target on a ratio (a :meth:`Comparison.as_dict`), judged by its interval as every
    benchmark judges one: ``MET`` when the low end reaches it, ``MISSED`` when the high end is
    below it, else ``NOT_SHOWN`` either way (so too with fewer than ``MIN_ROUNDS`` rounds: a
    point ratio above the target is no evidence); ``NO_FIGURE`` without a ratio."""
    if ratio is None:
        return NO_FIGURE
    if min(ratio["rounds"]) < MIN_ROUNDS:
        return NOT_SHOWN
    if ratio["low"] >= target:
        return MET
    if ratio["high"] < target:
        return MISSED
    return NOT_SHOWN


def _by_round(values: Rounds) -> dict[int, float]:
    if isinstance(values, Mapping):
        return {int(k): float(v) for k, v in values.items() if v is not None}
    return {i: float(v) for i, v in enumerate(values) if v is not None}


def fastest(contestants: Sequence[T], rounds: Callable[[T], Rounds]) -> T:
    """The fastest by the paired rounds, the estimator every ratio reports: the one whose
    ratio (:func:`compare`) against the fastest by median is the highest, that one's own being
    1.0. By median alone, one setting can be "the fastest" while another reads 1.03x of it
    over the same rounds: on a plateau the medians of two settings differ by the luck of the
    rounds, and every claim the decision then makes is about the paired ratio. A contestant
    sharing fewer than ``MIN_ROUNDS`` rounds with it (where it has that many) is not weighed."""

    def median(c: T) -> float:
        values = list(_by_round(rounds(c)).values())
        return float(np.median(values)) if values else 0.0

    top = max(contestants, key=median)
    needed = min(MIN_ROUNDS, len(_by_round(rounds(top))))

    def paired(c: T) -> float:
        if c is top:
            return 1.0
        versus = compare(rounds(c), rounds(top))
        return versus.ratio if versus is not None and min(versus.rounds) >= needed else 0.0

    return max(contestants, key=lambda c: (paired(c), median(c)))


def compare(a: Rounds, b: Rounds, confidence: float = CONFIDENCE) -> Comparison | None:
    """``a`` against ``b``, samples/s per round: a mapping round -> figure, or a list whose
    index is the round (None where that side has no figure). Only rounds with a figure on
    both sides count. None when there is no such round."""
    mine, theirs = _by_round(a), _by_round(b)
    common = sorted(r for r in mine if r in theirs and mine[r] > 0 and theirs[r] > 0)
    if not common:
        return None
    logs = np.log([mine[r] / theirs[r] for r in common])
    n, mean = len(logs), float(np.mean(logs))
    ratio = math.exp(mean)
    if n < 2:
        return Comparison(ratio, ratio, ratio, (n, n), 1.0, confidence)
    se = float(np.std(logs, ddof=1)) / math.sqrt(n)
    if se == 0.0:  # every round gave the same ratio: the interval is that ratio
        return Comparison(ratio, ratio, ratio, (n, n), 0.0 if mean else 1.0, confidence)
    from scipy import stats  # 0.9 s to import: only where an interval is computed

    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * se
    p = 2.0 * float(stats.t.sf(abs(mean) / se, n - 1))
    return Comparison(ratio, math.exp(mean - half), math.exp(mean + half), (n, n), p, confidence)


def window_spread(rates: Sequence[float]) -> float | None:
    """(max - min) / median of the measured windows' samples/s; None with fewer than two."""
    median = float(np.median(rates)) if len(rates) else 0.0
    return (max(rates) - min(rates)) / median if len(rates) > 1 and median > 0 else None
