"""The tie-breaks of a choice (docs/design.md, "The tuning loader"): one window each shows no
``EQUIVALENCE`` either way, so where the decision's winner has a setting as fast beside it that
costs less, or that its windows read low, that setting is taken, and the reason says why.
Pure functions of the figures, as the climb is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from feedrate.tuning.decide import EQUIVALENCE
from feedrate.tuning.setting import Setting

if TYPE_CHECKING:
    from feedrate.tuning.policy import Figure

STILL_WAITS = 0.05  # of its window: a loop that waited this much might take more workers

ON_THREADS = "on-threads"  # threads as fast as the processes chosen, without their memory
WIDER = "wider"  # a wider pool as fast, where the loop still waited and reads mostly wait
FEWER_THREADS = "fewer-threads"  # as fast on fewer main threads: their pool's spin left out


def family(setting: Setting) -> tuple:
    """What two settings that differ only in their workers share: the engine, the depth and
    the main threads."""
    return (setting.engine, setting.depth, setting.main_threads)


@dataclass(frozen=True)
class Tie:
    """A setting taken over the decision's winner: its figure, the rule, how near it read."""

    figure: Figure
    rule: str
    within: float
    why: str


def ties(chosen: Setting, figures: list[Figure]) -> list[Tie]:
    """The tie-breaks ``chosen`` gives way to, in order: its workers on fewer main threads;
    then threads for its processes, or else a wider pool of it."""
    taken = []
    fewer = as_fast_on_fewer_threads(chosen, figures)
    if fewer is not None:
        chosen = fewer.setting
        taken.append(
            Tie(
                fewer,
                FEWER_THREADS,
                EQUIVALENCE,
                "(one window each), on fewer main threads: taken, as their intra-op pool"
                " spins on the cores the workers use",
            )
        )
    threads = as_fast_on_threads(chosen, figures)
    if threads is not None:
        taken.append(
            Tie(
                threads,
                ON_THREADS,
                EQUIVALENCE,
                "(one window each), without a worker process and its memory a worker:"
                " taken for that",
            )
        )
        return taken
    wider = wider_as_fast(chosen, figures)
    if wider is not None:
        taken.append(
            Tie(
                wider,
                WIDER,
                2 * EQUIVALENCE,
                "in a window its start-up shares, where the loop still waited: taken, as its"
                " extra workers only wait",
            )
        )
    return taken


def wider_as_fast(chosen: Setting, figures: list[Figure]) -> Figure | None:
    """The widest pool of ``chosen`` (its engine, depth and threads) that read within
    ``2 x EQUIVALENCE`` of it, where the loop still waited ``STILL_WAITS`` at ``chosen``
    and its reads mostly wait (off the CPU half their time, as its costs say).
    A window reads a wider pool low: its workers start inside it, on the cores the
    others use (64 processes on 2 cores started for 4.5 s of a 6.6 s window). Where the
    loop waits, the extra workers only wait once started, and a pool short of the data's
    need loses the rate by the shortfall: held-out sensors chose 46-52 workers over 64
    read 0.91x and 0.99x in one window each, and trained 0.85x the sweep's 57 in steady
    state."""
    if not chosen.num_workers:
        return None
    mine = [f for f in figures if f.ok and f.setting == chosen]
    here = max(mine, key=lambda f: f.samples_per_sec, default=None)
    if here is None or here.data_wait_frac < STILL_WAITS or here.costs is None:
        return None
    if not here.costs.waits_mostly:  # reads that burn the cores: workers compete
        return None
    same = family(chosen)
    wider = [
        f
        for f in figures
        if f.ok
        and not f.left_early
        and family(f.setting) == same
        and f.setting.num_workers > chosen.num_workers
        and f.samples_per_sec >= (1 - 2 * EQUIVALENCE) * here.samples_per_sec
    ]
    return max(wider, key=lambda f: f.setting.num_workers, default=None)


def as_fast_on_fewer_threads(chosen: Setting, figures: list[Figure]) -> Figure | None:
    """``chosen``'s workers on fewer main threads, where they measured within
    ``EQUIVALENCE`` of it: one window each shows no 5% either way, and the threads' pool
    spins between steps on the cores the workers use, which a window's start shows less
    than a run does (held-out tickets on 2 cores: 23 workers read 2,094 samples/s on 2
    threads and 2,006 on one in a window each; the run on 2 threads then trained 1,920
    in steady state, against 2,827 for the sweep's preset on one)."""
    if not chosen.num_workers or not chosen.main_threads:
        return None
    rate = max(f.samples_per_sec for f in figures if f.ok and f.setting == chosen)
    fewer = [
        f
        for f in figures
        if f.ok
        and not f.left_early
        and f.setting.main_threads
        and f.setting.main_threads < chosen.main_threads
        and replace(f.setting, main_threads=chosen.main_threads) == chosen
        and f.samples_per_sec >= (1 - EQUIVALENCE) * rate
    ]
    return max(fewer, key=lambda f: f.samples_per_sec, default=None)


def as_fast_on_threads(chosen: Setting, figures: list[Figure]) -> Figure | None:
    """The fastest thread setting, where it measured within ``EQUIVALENCE`` of ``chosen``,
    a setting on worker processes: as fast, at the memory of one process. One window each
    shows no 5% either way, so the cheaper engine is given the benefit of the doubt, as
    the start is given ``gain``."""
    if chosen.threads or not chosen.num_workers:  # no worker process to save
        return None
    rate = max(f.samples_per_sec for f in figures if f.ok and f.setting == chosen)
    threads = [f for f in figures if f.ok and not f.left_early and f.setting.threads]
    best = max(threads, key=lambda f: f.samples_per_sec, default=None)
    if best is None or best.samples_per_sec < (1 - EQUIVALENCE) * rate:
        return None
    return best
