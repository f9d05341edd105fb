"""The sentences people read, checked word for word in this one place: the reasons the tuners
give for a choice. Every other test checks the decision, its rule and its numbers
(``Choice.rule``, ``Decision.rule``), so rewording a message changes this file alone."""

from __future__ import annotations

from feedrate import stats
from feedrate.tuning.decide import FASTEST, HELD, decide
from feedrate.tuning.policy import (
    PRESET_HOLDS,
    Climb,
    Figure,
    Machine,
    Setting,
)
from feedrate.tuning.ties import ON_THREADS

from . import fakes

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


# The sweep's final decision (final_decision.yaml, the preset's header, the log)


_contestant = fakes.contestant


def test_the_decision_names_the_slower_with_its_ratio_and_interval():
    base = _contestant("recipe", [1500, 1520, 1510, 1505, 1515], True, workers=4)
    cand = _contestant("trial 3", [2100, 2200, 2150, 2120, 2180], False, workers=32)
    d = decide([base, cand])
    assert "slower: recipe (significantly slower than trial 3: 0.70x [" in d.reason
    assert "] loss)" in d.reason


def test_a_cheaper_contestant_not_shown_equal_is_said_not_taken():
    noisy = _contestant("recipe", [350, 450, 400, 420, 380], True, workers=4)
    fast = _contestant("trial 3", [420, 430, 410, 425, 415], False, workers=32)
    d = decide([noisy, fast])
    assert "neither shown slower nor within 5% of the fastest, so not taken" in d.reason
    assert "for being cheaper or as fast: recipe 0." in d.reason
    tight = _contestant("recipe", [405, 415, 395, 410, 400], True, workers=4)
    assert "the cheapest of those within 5% wins" in decide([tight, fast]).reason


def test_the_fastest_by_the_paired_rounds_says_it_beat_the_higher_median():
    wide = _contestant("trial 4", [1000, 1000, 1200, 2000, 2000], False, workers=46)
    lean = _contestant("trial 2", [1030, 1030, 1150, 2060, 2060], False, workers=32)
    d = decide([wide, lean])
    assert "trial 2 is the fastest (1,150.0 samples/s), by the rounds both ran: trial 4" in d.reason


def test_fewer_than_three_rounds_say_they_claim_nothing():
    said = stats.compare([1100, 1150], [900, 950]).describe()
    assert "no claim (2 rounds, 3 needed)" in said
