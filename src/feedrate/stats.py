"""When is one configuration faster than another? Only when the interval of the ratio says so.

Two runs of the same settings differ by several percent on a shared machine, so a ratio of two
medians is no verdict by itself. A comparison here takes alternating rounds of both sides,
bootstraps the ratio of their medians over the rounds (scipy's percentile bootstrap), and calls
a win or a loss only when at least ``MIN_ROUNDS`` rounds of each side were measured, the 95%
interval excludes 1.0, and a rank test (Mann-Whitney U) agrees at the 5% level: with
five runs a side the percentile bootstrap alone is too eager. Anything else is a tie.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np
from scipy import stats

MIN_ROUNDS = 5  # fewer runs of a side than this: no claim either way
CONFIDENCE = 0.95
WIN, LOSS, TIE = "win", "loss", "tie"


@dataclass(frozen=True)
class Comparison:
    """``a`` against ``b``: the ratio of their medians and its interval."""

    ratio: float
    low: float
    high: float
    rounds: tuple[int, int]  # runs of a and of b
    p_value: float = 1.0  # Mann-Whitney U, two-sided

    @property
    def verdict(self) -> str:
        if min(self.rounds) < MIN_ROUNDS or self.p_value >= 1 - CONFIDENCE:
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
            return f"{text} no claim ({min(self.rounds)} runs, {MIN_ROUNDS} needed)"
        return f"{text} tie within noise"

    def as_dict(self) -> dict:
        return {
            "ratio": self.ratio,
            "low": self.low,
            "high": self.high,
            "rounds": list(self.rounds),
            "p_value": self.p_value,
            "verdict": self.verdict,
        }


def _median_ratio(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(a, axis=axis) / np.median(b, axis=axis)


def compare(a: list[float], b: list[float], seed: int = 0) -> Comparison | None:
    """``a`` against ``b`` (samples/s of each round); None if either side has no figure.

    The two sides are resampled independently: a failed run on one side leaves the other's
    rounds usable. The seed makes a report reproducible from its own figures.
    """
    if not a or not b or min(b) <= 0:
        return None
    ratio = statistics.median(a) / statistics.median(b)
    if len(a) < 2 or len(b) < 2:
        return Comparison(ratio, ratio, ratio, (len(a), len(b)))
    if max(a) == min(a) and max(b) == min(b):  # nothing to resample: no spread at all
        return Comparison(ratio, ratio, ratio, (len(a), len(b)))
    res = stats.bootstrap(
        (np.asarray(a, dtype=float), np.asarray(b, dtype=float)),
        _median_ratio,
        vectorized=True,
        paired=False,
        confidence_level=CONFIDENCE,
        method="percentile",
        n_resamples=4999,
        rng=np.random.default_rng(seed),
    )
    ci = res.confidence_interval
    rank = stats.mannwhitneyu(a, b, alternative="two-sided", method="auto")
    return Comparison(ratio, float(ci.low), float(ci.high), (len(a), len(b)), float(rank.pvalue))
