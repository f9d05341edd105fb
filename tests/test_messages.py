"""The sentences people read, checked word for word in this one place: the reasons the tuners
give for a choice. Every other test checks the decision, its rule and its numbers
(``Choice.rule``, ``Decision.rule``), so rewording a message changes this file alone."""

from __future__ import annotations

from feedrate.tuning.decide import FASTEST, HELD
from feedrate.tuning.policy import (
    ON_THREADS,
    PRESET_HOLDS,
    Climb,
    Figure,
    Machine,
    Setting,
)

BOTH = ("process", "thread")


def test_the_start_that_holds_says_so_with_the_best_others_ratio():
    climb = Climb(Setting(4), Machine(2.0, 64), window_s=1.0)
    choice = climb.choose([Figure(Setting(4), 1000.0, 0.8), Figure(Setting(8), 1090.0)])
    assert choice.rule == HELD
    assert choice.reason == (
        "num_workers=4, prefetch_factor=2 (the start) holds: no setting measured 10% faster;"
        " best num_workers=8, prefetch_factor=2, 1.09x of it"
    )


def test_the_fastest_says_its_rate():
    climb = Climb(Setting(4), Machine(2.0, 64), window_s=1.0)
    choice = climb.choose([Figure(Setting(4), 1000.0, 0.8), Figure(Setting(16), 2000.0, 0.5)])
    assert choice.rule == FASTEST
    assert choice.reason.startswith(
        "num_workers=16, prefetch_factor=2 is the fastest (2,000.0 samples/s)"
    )


def test_threads_taken_for_their_memory_say_so():
    climb = Climb(Setting(4), Machine(2.0, 64, BOTH), window_s=1.0)
    figures = [
        Figure(Setting(4), 1000.0, 0.8),
        Figure(Setting(64), 2000.0, 0.1),
        Figure(Setting(64, engine="thread"), 1960.0, 0.1),
    ]
    choice = climb.choose(figures)
    assert choice.rule == ON_THREADS
    assert choice.reason.endswith(
        "; num_workers=64, prefetch_factor=2, engine=thread measured 1,960.0 samples/s,"
        " within 5% of it (one window each), without a worker process and its memory a"
        " worker: taken for that"
    )


def test_a_preset_that_holds_says_its_figure_against_the_one_it_records():
    climb = Climb(Setting(64, 8), Machine(2.0, 64), window_s=1.0, recorded=3900.0)
    choice = climb.choose([Figure(Setting(64, 8), 3800.0, 0.2)])
    assert choice.rule == PRESET_HOLDS
    assert choice.reason == (
        "the preset holds: 3,800.0 samples/s, within 10% of the 3,900.0 it records"
    )
