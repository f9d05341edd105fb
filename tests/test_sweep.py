"""The loader sweep: decisions, presets, trials in their own processes, and the real command."""

from __future__ import annotations

import csv
import functools
import importlib.metadata
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import optuna
import psutil
import pytest
import torch
import yaml
from omegaconf import OmegaConf

import feedrate
from feedrate import hardware, stats
from feedrate.config import Measure
from feedrate.errors import ConfigError
from feedrate.project import preset_file
from feedrate.resolvers import workload_key
from feedrate.sweep import ceiling, host
from feedrate.sweep.decide import Contestant, merge_identical, pick_finalists
from feedrate.sweep.feasibility import Budget, FeasibilityGuard, Footprint, memory_budget, predict
from feedrate.sweep.report import pareto_front
from feedrate.sweep.report import rows as report_rows
from feedrate.sweep.search import Search
from feedrate.sweep.space import (
    check_sweep,
    default_threads,
    engines,
    loader_search_space,
    max_threads,
    max_workers,
    preset_values,
    search_threads,
    seed_settings,
    seed_workers,
    worker_bound,
)
from feedrate.sweep.trial import Fresh, TrialResult, run_trial
from feedrate.tuning.decide import (
    CHEAPER_EQUAL,
    FASTEST,
    decide,
    drop_clearly_slower,
    drop_shown_slower,
    settled,
)
from feedrate.tuning.preset import AUTOTUNE_MARKER, MARKER, check_writable, render, write_checked

from . import fakes
from .conftest import ROOT

# ---------------------------------------------------------------------------------------------
# The decision


_contestant = fakes.contestant


def test_a_significantly_faster_candidate_wins():
    base = _contestant("recipe", [1500, 1520, 1510, 1505, 1515], True, workers=4)
    cand = _contestant("trial 3", [2100, 2200, 2150, 2120, 2180], False, workers=32)
    d = decide([base, cand])
    assert d.winner is cand and d.fastest is cand and d.rule == FASTEST
    assert d.why_slower["recipe"], "shown slower, and why"
    assert d.versus_fastest["recipe"].ratio == pytest.approx(0.70, abs=0.005)
    assert d.versus_fastest["recipe"].verdict == stats.LOSS


def test_a_cheaper_configuration_wins_only_when_shown_within_the_margin():
    # Not shown slower is not shown equal: over 5 rounds of 2 ranks on 2 cores, 16 workers a
    # rank read 0.93x [0.86, 1.01] of 26, and the grid's best was 7% ahead of it.
    noisy = _contestant("recipe", [350, 450, 400, 420, 380], True, workers=4)
    fast = _contestant("trial 3", [420, 430, 410, 425, 415], False, workers=32)
    d = decide([noisy, fast])
    assert d.versus_fastest["recipe"].verdict == stats.TIE, "not shown slower"
    assert d.winner is fast and not d.why_slower["recipe"], "nor shown equal: the fastest wins"
    assert d.rule == FASTEST, "not taken for being cheaper"
    # the same medians, measured tight: shown within 5%, the cheaper wins
    tight = _contestant("recipe", [405, 415, 395, 410, 400], True, workers=4)
    d = decide([tight, fast])
    assert d.winner is tight and d.rule == CHEAPER_EQUAL
    assert decide([noisy, fast], margin=0.25).winner is noisy, "sweep.equivalence=0.25"


def test_the_fastest_is_the_fastest_over_the_rounds_both_ran_not_by_median():
    """On a plateau two settings' medians differ by the luck of the rounds: here the wide one
    has the higher median, yet the lean one read 3% more in four of five paired rounds."""
    wide = _contestant("trial 4", [1000, 1000, 1200, 2000, 2000], False, workers=46)
    lean = _contestant("trial 2", [1030, 1030, 1150, 2060, 2060], False, workers=32)
    assert wide.median > lean.median and stats.compare(lean.values, wide.values).ratio > 1
    d = decide([wide, lean])
    assert d.fastest is lean and d.winner is lean and d.rule == FASTEST
    assert d.versus_fastest["trial 4"].ratio < 1 and d.versus_fastest["trial 4"].rounds == (5, 5)


def test_every_finalist_is_weighed_not_only_the_best():
    base = _contestant("recipe", [350, 360, 355, 352, 358], True, workers=4)
    fast = _contestant("trial 3", [2100, 2200, 2150, 2120, 2180], False, workers=48)
    lean = _contestant("trial 5", [2080, 2190, 2140, 2100, 2170], False, workers=16)
    d = decide([base, fast, lean])
    assert d.fastest is fast and d.winner is lean, "as fast within noise, and a third the workers"


def test_fewer_than_three_rounds_claim_nothing_but_a_factor_of_two():
    base = _contestant("default", [900, 950], True, workers=0)
    cand = _contestant("trial 1", [1100, 1150], False, workers=32)
    assert stats.compare(cand.values, base.values).verdict == stats.TIE
    assert stats.compare(cand.values, base.values).rounds == (2, 2), "fewer than MIN_ROUNDS"
    assert decide([base, cand]).winner is cand, "nothing shown equal: the fastest"
    # a factor of two needs no interval: PyTorch's default is not chosen over 20x its speed
    slow = _contestant("default", [80], True, workers=0)
    fast = _contestant("trial 1", [2100], False, workers=32)
    d = decide([slow, fast])
    assert d.winner is fast and "80.0" in d.why_slower["default"], "slower, by its best run"


def test_a_target_is_met_only_when_the_whole_interval_clears_it():
    """As every benchmark judges its targets (autotune / tuned >= 0.9 and the rest): by the
    interval of the paired rounds, not the point ratio."""

    def ratio(a: list[float], b: list[float]) -> dict:
        return stats.compare(a, b).as_dict()

    tuned = [1000.0, 1010.0, 990.0, 1005.0]
    assert stats.against(ratio([950, 965, 940, 958], tuned), 0.9) == stats.MET
    assert stats.against(ratio([800, 820, 790, 805], tuned), 0.9) == stats.MISSED
    wide = ratio([800, 1100, 850, 1050], tuned)
    assert wide["ratio"] >= 0.9 > wide["low"], "the point ratio clears it, the interval not"
    assert stats.against(wide, 0.9) == stats.NOT_SHOWN
    assert stats.against(ratio([990, 1000], tuned[:2]), 0.9) == stats.NOT_SHOWN, "2 rounds"
    assert stats.against(None, 0.9) == stats.NO_FIGURE


def test_one_rule_a_low_end_short_of_the_target_misses_it():
    """0.92x [0.89, 0.96] against a target of 0.9: the point ratio clears it, the low end
    does not, so the target is not shown (the rule of every bench, the sweep and autotune)."""
    ratio = {"ratio": 0.92, "low": 0.89, "high": 0.96, "rounds": [3, 3]}
    assert stats.against(ratio, 0.9) == stats.NOT_SHOWN
    assert stats.against({**ratio, "low": 0.90}, 0.9) == stats.MET


def test_one_rule_equal_means_the_whole_interval_inside_the_margin():
    """Equal within 5% needs both ends inside [0.95, 1.05]: a low end at 0.97 with a high
    end at 1.19 may be 19% faster, and is no equal."""
    one_sided = {"ratio": 1.00, "low": 0.97, "high": 1.19, "rounds": [5, 5]}
    assert not stats.equal_within(one_sided, 0.05)
    assert stats.equal_within({**one_sided, "high": 1.04}, 0.05)
    assert not stats.equal_within({**one_sided, "high": 1.04, "rounds": [2, 2]}, 0.05)
    # the decision's "equal to the fastest", and so its "settled", by the same rule
    from feedrate.tuning import decide as decision

    assert not decision._equal(stats.Comparison(1.0, 0.97, 1.19, (5, 5)), 0.05, None)
    assert decision._equal(stats.Comparison(1.0, 0.97, 1.04, (5, 5)), 0.05, None)


def test_one_rule_the_correction_counts_every_contestant_that_entered_and_every_look():
    """A contestant dropped after round 3 still counts in the correction: k is 4, not the 3
    still measured, or the intervals would narrow as contestants drop. So does every look at
    the rounds: a stop after round 3 or 4 of 5 is three looks."""
    values = [[2100, 2150, 2120, 2130, 2110], [2000, 2050, 2040, 2020, 2030]]
    cs = [_contestant(f"trial {i}", v, False, workers=4 * (i + 1)) for i, v in enumerate(values)]
    cs += [_contestant("recipe", [1500, 1510, 1490], True), _contestant("default", [90] * 3, True)]
    cs[3].dropped = "clearly slower: not measured further"
    d = decide(cs)
    assert d.versus_fastest["trial 1"].confidence == stats.simultaneous(4) == 1 - 0.05 / 6
    assert decide(cs, looks=3).versus_fastest["trial 1"].confidence == 1 - 0.05 / 18
    assert stats.looks(5) == 3 and stats.looks(3) == 1 and stats.looks(1) == 1
    with_3 = decide(cs[:3]).versus_fastest["trial 1"]
    assert with_3.confidence < d.versus_fastest["trial 1"].confidence
    assert (
        with_3.high - with_3.low
        < d.versus_fastest["trial 1"].high - d.versus_fastest["trial 1"].low
    )


def test_a_faster_baseline_is_never_replaced():
    base = _contestant("recipe", [400, 410, 405, 402, 408], True)
    cand = _contestant("trial 1", [300, 310, 305, 302, 308], False, workers=2)
    assert decide([base, cand]).winner is base


@pytest.mark.parametrize("who", ["candidate", "baseline"])
def test_a_contestant_that_failed_a_final_run_is_out(who):
    base = _contestant("default", [80, 82, 81, 80, 83], True, workers=0)
    cand = _contestant("trial 2", [900, 910, 905, 902, 908], False)
    loser = cand if who == "candidate" else base
    loser.results.append(TrialResult([], "failed", reason="killed by SIGKILL"))
    d = decide([base, cand])
    assert d.winner is not loser and loser.failures == ["failed: killed by SIGKILL"]
    assert loser.name in d.reason, "the contestant out is named"


def _trial(workers, prefetch=7, **more):
    return {"loader.num_workers": workers, "loader.prefetch_factor": prefetch, **more}


def test_finalists_differ_in_more_than_a_few_workers_and_stay_near_the_best():
    """What the search on 10 ms reads and on webdataset ranked: a near twin of the best (51
    against 54 workers, same prefetch) tells nothing new, and a trial at 0.72 of the best is no
    lucky-run contender; the next distinct setting within 10% is."""
    ranked = [
        ("trial 6", _trial(51), 3799.0),
        ("trial 5", _trial(54), 3600.0),
        ("trial 7", _trial(51, 4), 3500.0),
        ("trial 2", _trial(32, 2), 2846.0),
    ]
    assert [n for n, _, _ in pick_finalists(ranked, 2)] == ["trial 6", "trial 7"]
    assert [n for n, _, _ in pick_finalists(ranked, 3)] == ["trial 6", "trial 7"]
    far = [("trial 3", _trial(3, 4), 411.0), ("trial 2", _trial(16, 2), 297.0)]
    assert [n for n, _, _ in pick_finalists(far, 2)] == ["trial 3"]
    assert len(pick_finalists(far, 2, within=0.3)) == 2, "within is the user's to widen"
    # few workers: one more is a real difference (7 against 8: 1 is over 10% of 8)
    small = [("a", _trial(7), 640.0), ("b", _trial(8), 635.0), ("c", _trial(2), 630.0)]
    assert [n for n, _, _ in pick_finalists(small, 2)] == ["a", "b"]
    # another parameter differs: not twins, whatever the workers
    threads = [("a", _trial(51, main_threads=1), 10.0), ("b", _trial(54, main_threads=2), 9.9)]
    assert len(pick_finalists(threads, 2)) == 2
    # lower is better (a time objective): within means at most 10% above the best
    lower = [("a", _trial(2), 10.0), ("b", _trial(8), 10.5), ("c", _trial(32), 12.0)]
    assert [n for n, _, _ in pick_finalists(lower, 3, maximize=False)] == ["a", "b"]


def test_finalists_the_model_rates_past_their_workers_are_re_measured_as_one(compose, monkeypatch):
    """The held-out ticket store's finals ran 42 and 63 workers of the same settings, tied
    in all 5 rounds: from the fastest trial's costs, the cores hold 42 even with a quarter
    fewer workers, so 63 only adds workers that wait, and one of them is re-measured. A
    pool the model rates held by its workers (20) is a finalist of its own."""
    from dataclasses import asdict

    from optuna.distributions import CategoricalDistribution
    from optuna.trial import create_trial

    from feedrate.sweep.climb import FIGURE_KEY, fed_twins
    from feedrate.tuning.model import Costs

    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 2.0)
    cfg = compose("sweep=loader", "sweep.preset_name=x", "sweep.engines=[process]")
    costs = Costs(64, 0.58, 0.028, 0.084, 0.005, 1.3, 0.012, 0.006, 0.0, 197120.0)

    def trial(workers: int, value: float) -> tuple[str, dict, float]:
        params = {"loader.num_workers": workers, "loader.prefetch_factor": 2}
        kept = {"data_wait_frac": 0.35, "cpu_busy_frac": 0.97, "costs": asdict(costs)}
        return create_trial(
            params=params,
            distributions={k: CategoricalDistribution([v]) for k, v in params.items()},
            value=value,
            user_attrs={FIGURE_KEY: kept},
        )

    trials = [trial(42, 3090.0), trial(63, 2892.0), trial(20, 2880.0)]
    twins = fed_twins(trials, cfg)
    ranked = [(f"trial {i}", t.params, t.value) for i, t in enumerate(trials)]
    picked = pick_finalists(ranked, 2, twins=twins)
    assert [n for n, _, _ in picked] == ["trial 0", "trial 2"]
    assert [n for n, _, _ in pick_finalists(ranked, 2)] == ["trial 0", "trial 1"]
    assert not fed_twins([], cfg)(trials[0].params, trials[1].params), "no costs: no model"


def test_contestants_with_the_same_resolved_settings_are_one():
    cpu_run = {
        "loader": {"batch_size": 64, "num_workers": 2, "pin_memory": False},
        "torch_threads": 2,
    }
    recipe = _contestant("recipe", [500], True, run=cpu_run)
    # prefetch_factor null is PyTorch's 2; persistent_workers means nothing while streaming
    same = {**cpu_run, "loader": {**cpu_run["loader"], "prefetch_factor": 2}}
    same["loader"]["persistent_workers"] = True
    trial = _contestant("trial 4", [530], False, run=same)
    other = _contestant("trial 6", [520], False, run={**cpu_run, "torch_threads": 1})
    merged = merge_identical([recipe, trial, other], stream=True)
    assert merged == [recipe, other] and recipe.label == "recipe = trial 4"
    assert recipe.values == [500, 530], "both runs are runs of the one configuration"
    with_epochs = [_contestant("a", [1], True, run=cpu_run), _contestant("b", [1], False, run=same)]
    assert len(merge_identical(with_epochs, stream=False)) == 2, "persistence matters with epochs"
    # thread workers are not processes; a start method or persistence means nothing to them
    threads = {**cpu_run, "loader": {**cpu_run["loader"], "engine": "thread"}}
    started = {"multiprocessing_context": "spawn", "persistent_workers": True}
    forked = {**threads, "loader": {**threads["loader"], **started}}
    engines = [_contestant(n, [1], n == "p", run=r) for n, r in [("p", cpu_run), ("t", threads)]]
    engines.append(_contestant("t2", [1], False, run=forked))
    assert [c.name for c in merge_identical(engines, stream=False)] == ["p", "t"]


def test_a_clearly_slower_contestant_stops_early_and_loses():
    default = _contestant("default", [80, 83], True, workers=0)
    cand = _contestant("trial 1", [2100, 1900, 2150, 2120, 2180], False, workers=32)
    assert drop_clearly_slower([default, cand]) == [default]
    d = decide([default, cand])
    assert d.winner is cand and "clearly slower" in d.reason


def test_a_contestant_shown_slower_after_three_rounds_is_not_measured_further():
    """Photos on 2 cores: recipe at 0.83 of the finalists every round, the two finalists
    within 1% of each other. Looked at once, three rounds show recipe slower; the finals look
    three times (after rounds 3, 4 and 5), and the correction for it needs more rounds."""
    recipe = _contestant("recipe", [580, 574, 554], True, workers=4)
    wide = _contestant("trial 6", [688, 688, 696], False, workers=46)
    narrow = _contestant("trial 3", [683, 694, 702], False, workers=7)
    two_rounds = [_contestant(c.name, c.values[:2], c.is_baseline) for c in (recipe, wide)]
    assert drop_shown_slower(two_rounds, 0.03) == [], "fewer than 3 rounds show nothing"
    assert drop_shown_slower([recipe, wide, narrow], 0.03, looks=3) == []
    assert not settled([recipe, wide, narrow], 0.03, looks=3)
    for c, more in ((recipe, [570, 565]), (wide, [690, 692]), (narrow, [689, 693])):
        c.results += [TrialResult([], "ok", value=v, metrics=c.results[0].metrics) for v in more]
    assert settled([recipe, wide, narrow], 0.03, looks=3), "5 rounds: within 3% of each other"
    d = decide([recipe, wide, narrow], margin=0.03, looks=3)
    assert d.winner is narrow and d.why_slower["recipe"]
    assert d.versus_fastest["recipe"].rounds == (5, 5)
    # looked at once, after three rounds, recipe is shown slower and measured no further
    three = [_contestant(c.name, c.values[:3], c.is_baseline) for c in (recipe, wide, narrow)]
    assert drop_shown_slower(three, 0.03) == [three[0]]
    assert "significantly slower than" in three[0].dropped and not three[1].dropped


def test_when_the_budget_leaves_no_third_round_only_those_behind_in_both_stop():
    """Photos on 2 cores, the first two final rounds: three of four contestants at 0.65-0.85
    of trial 3 in both; the sweep's budget left no room for a third round of all four."""
    from feedrate.tuning.decide import behind_every_round

    default = _contestant("default", [311, 347], True, workers=0)
    recipe = _contestant("recipe", [387, 431], True, workers=4)
    other = _contestant("trial 5", [379, 409], False, workers=5)
    best = _contestant("trial 3", [477, 506], False, workers=5)
    one = [_contestant(c.name, c.values[:1], c.is_baseline) for c in (default, best)]
    assert behind_every_round(one, 0.10, "budget") == [], "one round is no pattern"
    behind = behind_every_round([default, recipe, other, best], 0.10, "budget")
    assert behind == [default, recipe, other] and not best.dropped
    assert recipe.dropped.startswith("behind trial 3 by more than 10% in each of its 2 rounds")
    d = decide([default, recipe, other, best])
    assert d.winner is best and d.why_slower["recipe"] == recipe.dropped
    close = _contestant("trial 1", [470, 455], False, workers=3)  # 0.99x, then 0.90x
    fast = _contestant("trial 3", [477, 506], False, workers=5)
    assert behind_every_round([close, fast], 0.10, "budget") == [], "within 10% once"


def test_a_contestant_within_the_margin_of_the_fastest_is_not_dropped():
    # significantly slower over the paired rounds, by 1%: equal for practical purposes
    fast = _contestant("trial 2", [1000, 1010, 990, 1005], False, workers=8)
    close = _contestant("trial 1", [990, 1000, 980, 995], False, workers=4)
    assert drop_shown_slower([fast, close], 0.03) == []
    assert decide([fast, close]).winner is close


def test_noise_between_identical_settings_is_a_tie():
    rng = random.Random(0)
    a = [1000 * rng.uniform(0.93, 1.07) for _ in range(5)]
    b = [1000 * rng.uniform(0.93, 1.07) for _ in range(5)]
    c = stats.compare(a, b)
    assert c.low < 1.0 < c.high and c.verdict == stats.TIE
    assert "tie within noise" in c.describe()
    assert stats.compare([1200 * x / 1000 for x in a], b).verdict == stats.WIN


def test_alternating_rounds_are_compared_as_pairs():
    # The machine's speed drifts from round to round, and both sides drift together: each
    # round, a is 5% faster than b. Unpaired, the drift drowns that; paired, it is clear.
    drift = [1000, 1400, 800, 1200, 1600]
    a = [x * 1.05 for x in drift]
    b = [x * (1 + e) for x, e in zip(drift, [0.0, 0.004, -0.003, 0.002, -0.002], strict=True)]
    c = stats.compare(a, b)
    assert c.verdict == stats.WIN and 1.04 < c.low and c.high < 1.06
    # a round with no figure on one side leaves only the rounds both sides ran
    assert stats.compare({0: 10.0, 1: 20.0, 3: 30.0}, {0: 5.0, 2: 7.0, 3: 15.0}).rounds == (2, 2)


def test_a_constant_ratio_without_spread_is_a_verdict_not_a_tie():
    assert stats.compare([100.0] * 5, [50.0] * 5).verdict == stats.WIN
    assert stats.compare([50.0] * 5, [100.0] * 5).describe() == "0.50x [0.50, 0.50] loss"
    assert stats.compare([70.0] * 5, [70.0] * 5).verdict == stats.TIE


def _equal_contestants(rng, k=4, rounds=5):
    """``k`` contestants of the same speed: a shared drift per round, 4% noise per run."""
    drift = rng.normal(0, 0.05, rounds)
    out = []
    for i in range(k):
        c = Contestant(f"c{i}", [], False)
        for r in range(rounds):
            value = float(1000 * np.exp(drift[r] + rng.normal(0, 0.04)))
            c.add(TrialResult([], "ok", value=value, metrics={"peak_pss_mb": 100.0}), r)
        c.loader = lambda i=i: {"num_workers": i + 1}
        out.append(c)
    return out


def test_equal_contestants_are_called_slower_at_most_five_percent_of_the_time():
    # Picking the fastest from the same runs and testing the others against it, each at 5%,
    # calls one of four equal contestants slower about 15% of the time, and so leans towards
    # dropping the cheaper ones. The decision's simultaneous intervals hold the 5%.
    rng = np.random.default_rng(1)
    trials, corrected, naive = 600, 0, 0
    for _ in range(trials):
        cs = _equal_contestants(rng)
        corrected += any(decide(cs).why_slower.values())
        fastest = max(cs, key=lambda c: c.median)
        naive += any(
            stats.compare(c.per_round(), fastest.per_round()).verdict == stats.LOSS
            for c in cs
            if c is not fastest
        )
    assert corrected / trials <= 0.07 and naive / trials >= 0.10, (corrected, naive)


def test_the_final_rounds_stop_once_the_decision_is_settled():
    rng = np.random.default_rng(0)
    fast = _contestant("trial 3", [2100, 2150, 2120], False, workers=32)
    slow = _contestant("recipe", [1500, 1510, 1490], True, workers=4)
    assert settled([fast, slow], 0.03), "significantly slower after 3 rounds: nothing to add"
    assert not settled([fast, _contestant("r", [1500, 1510], True)], 0.03), "3 rounds at least"
    twin = _contestant("trial 5", [2102, 2149, 2121], False, workers=16)
    assert settled([fast, twin], 0.03), "within 3% of the fastest, whatever more rounds say"
    unsure = _contestant("trial 5", [1800, 2400, 2000], False, workers=16)
    assert not settled([fast, unsure], 0.03), "could be 10% slower or faster: measure more"
    assert settled(_equal_contestants(rng, k=1), 0.03), "one contestant has no rival"


# ---------------------------------------------------------------------------------------------
# Presets


def test_preset_is_plain_data_with_a_header():
    text = render({"num_workers": 24, "prefetch_factor": 4}, ["python train.py loader=x", "ok"])
    assert text.splitlines()[:2] == ["# python train.py loader=x", MARKER]
    data = OmegaConf.create(text)
    assert data.defaults == ["default", "_self_"] and data.num_workers == 24
    assert "_target_" not in text
    with pytest.raises(ValueError, match="_target_"):
        render({"_target_": "os.system"}, [])


def test_hand_written_preset_is_protected(tmp_path):
    path = tmp_path / "loader" / "mine.yaml"
    path.parent.mkdir()
    path.write_text("num_workers: 3\n")
    with pytest.raises(ConfigError, match=r"was not written by feedrate.*sweep.preset_name"):
        check_writable(path, overwrite=False)
    with pytest.raises(ConfigError, match=r"trainer.autotune.overwrite=true"):
        check_writable(path, overwrite=False, keys="trainer.autotune")
    check_writable(path, overwrite=True)
    path.write_text(render({"num_workers": 5}, ["x"]))
    check_writable(path, overwrite=False)  # feedrate's own preset may be refreshed
    path.write_text(render({"num_workers": 5}, ["x"], marker=AUTOTUNE_MARKER))
    check_writable(path, overwrite=False)  # loader=autotune's too


def test_a_preset_that_does_not_compose_back_is_not_left_written(tmp_path):
    """The one writer reads the file back as a run composes it (defaults merged onto the
    loader's schema); one that composes to other values is taken back, the old file kept."""
    path = tmp_path / "loader" / "x.yaml"
    path.parent.mkdir()
    old = render({"num_workers": 5}, ["python train.py loader=x", "old"])
    path.write_text(old)
    with pytest.raises(ConfigError, match="composes to prefetch_factor=4, not '4'"):
        write_checked(path, {"num_workers": 2, "prefetch_factor": "4"}, ["x"], None,
                      marker=MARKER, overwrite=False)  # fmt: skip
    assert path.read_text() == old
    write_checked(path, {"num_workers": 2, "prefetch_factor": 4}, ["x"], None,
                  marker=MARKER, overwrite=False)  # fmt: skip
    assert OmegaConf.load(path).num_workers == 2


@pytest.mark.parametrize("name", ["../evil", "a/b", "", "x.yaml"])
def test_preset_names_cannot_leave_the_loader_directory(tmp_path, name):
    with pytest.raises(ConfigError, match="not a valid preset name"):
        preset_file(tmp_path, name, "sweep")


# ---------------------------------------------------------------------------------------------
# Search bounds and the memory guard


def test_the_seeds_share_the_starting_loader_and_the_profiles_pinning(compose, monkeypatch):
    cfg = compose("sweep=loader", "sweep.preset_name=x")
    assert seed_settings(cfg) == {
        "loader.prefetch_factor": 2,  # PyTorch's, where the loader sets none
        "loader.engine": "process",  # the DataLoader's; one seed more runs threads
        "loader.multiprocessing_context": multiprocessing.get_start_method(),
    }, "streaming: persistent_workers is not searched; no CUDA: nor is pinning"
    cfg = compose("sweep=loader", "sweep.preset_name=x", "loader=recipe", "trainer.stream=false")
    assert seed_settings(cfg)["loader.persistent_workers"] is True
    monkeypatch.setattr("feedrate.sweep.space.torch.cuda.is_available", lambda: True)
    cfg = compose("sweep=loader", "sweep.preset_name=x", "hardware=h200")
    assert seed_settings(cfg)["loader.pin_memory"] is True, "the gpu profile pins"
    cfg = compose(
        "sweep=loader", "sweep.preset_name=x", "hardware=h200", "hardware.pin_memory=false"
    )
    assert seed_settings(cfg)["loader.pin_memory"] is False


def test_worker_bound_is_far_past_the_core_count(monkeypatch):
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 2.0)
    cfg = OmegaConf.create({"sweep": {"max_workers": None}})
    assert max_workers(cfg) >= 64
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 16.0)
    assert max_workers(cfg) >= 8 * 16


def test_the_first_trials_climb_a_ladder_of_worker_counts(monkeypatch):
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 2.0)
    cfg = OmegaConf.create({"sweep": {"max_workers": None}})
    assert seed_workers(cfg) == [2, 8, 32], "the 10 ms dataset peaks near 32 workers on 2 cores"
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 16.0)
    assert seed_workers(cfg) == [16, 64, max_workers(cfg)]
    cfg.sweep.max_workers = 4
    assert seed_workers(cfg) == [4], "sweep.max_workers bounds the seeds"
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 2.0)
    assert seed_workers(cfg) == [2, 4]


def test_with_ranks_on_the_node_the_search_is_each_ranks_share(compose, monkeypatch):
    """Eight ranks on a 16-core node: each rank's seeds, bound and threads are its share of
    the node's, and the sweep refuses a rank count that cannot run."""
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 16.0)
    monkeypatch.setattr("feedrate.hardware.pytorch_threads", lambda: 16)
    node = OmegaConf.create({"sweep": {"max_workers": None}})
    ranks = OmegaConf.create({"sweep": {"max_workers": None, "ranks_per_node": 8}})
    assert max_workers(ranks) == max_workers(node) // 8
    assert seed_workers(ranks) == [2, 8, 16]
    assert max_threads(8) == 2 and default_threads(8)["loader.main_threads"] == 2
    monkeypatch.undo()

    def checked(*overrides: str) -> None:
        cfg = compose("sweep=loader", *overrides)
        OmegaConf.set_struct(cfg, False)  # the launch's own node, as the sweep sees it
        launcher = "hydra_plugins.feedrate_launcher.launcher.FeedrateTrialLauncher"
        cfg.hydra = {"launcher": {"_target_": launcher}, "overrides": {"task": list(overrides)}}
        check_sweep(cfg)

    checked("sweep.ranks_per_node=2")
    with pytest.raises(ConfigError, match=r"sweep.ranks_per_node=0 must be at least 1"):
        checked("sweep.ranks_per_node=0")
    # a trial's early stop compares a rank's rate: the floor is a rank's share of the job's
    search = Search()
    search.took(1000.0)
    floor = search.abandon(compose("sweep=loader", "sweep.ranks_per_node=2"), "samples_per_sec")
    assert floor == ["trainer.abandon_below=250.0"]
    # another study and another preset than the one-process sweep's, which stays
    one, two = compose("sweep=loader"), compose("sweep=loader", "sweep.ranks_per_node=2")
    assert two.sweep.preset_name == f"{one.sweep.preset_name}_2ranks"
    assert workload_key(one) != workload_key(two)
    assert workload_key(one) == workload_key(compose("sweep=loader", "sweep.ranks_per_node=1"))
    monkeypatch.setattr("feedrate.sweep.space.torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("feedrate.sweep.space.torch.cuda.device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"ranks_per_node=2 but 1 GPU\(s\) here"):
        checked("sweep.ranks_per_node=2")
    checked("sweep.ranks_per_node=2", "hardware=cpu")  # gloo on the CPU: any number


def test_the_seeds_bound_the_workers_searched_once_the_rate_falls_past_the_best():
    seeds = [2, 8, 32]
    # photos on 2 cores, as measured: the rate falls past 2 workers
    assert worker_bound(seeds, {2: 644.0, 8: 570.0}) is None, "32 has not run yet"
    limit, why = worker_bound(seeds, {2: 644.0, 8: 570.0, 32: 567.0})
    assert limit == 8 and "8 workers 570, 32 workers 567" in why
    # a later trial at 7 workers is the best: the seeds past it still fall, the bound holds
    assert worker_bound(seeds, {2: 644.0, 8: 570.0, 32: 567.0, 7: 681.0})[0] == 8
    # latency-bound data: the top seed is the best, nothing is bounded
    assert worker_bound(seeds, {2: 191.0, 8: 724.0, 32: 2651.0}) is None
    # within noise of the best is not falling
    assert worker_bound(seeds, {2: 644.0, 8: 630.0, 32: 500.0}) is None
    # the loader alone fell at 8 too (the ceiling's runs): two measurements, 32 is not run
    limit, why = worker_bound(seeds, {2: 644.0, 8: 570.0}, loader_falls_at=8)
    assert limit == 8 and "570" in why, "the rate that fell, named"
    assert worker_bound(seeds, {2: 644.0, 8: 570.0}, loader_falls_at=32) is None
    assert worker_bound(seeds, {2: 644.0, 8: 630.0}, loader_falls_at=8) is None, "noise at 8"


def test_the_ceiling_says_where_the_loader_alone_falls():
    limit = ceiling.Ceiling(ceiling.SHARED, 804.0, 3737.0, "2 workers", 2, {2: 804.0, 8: 748.0})
    assert limit.loader_falls_at == 8
    assert ceiling.Ceiling.from_dict(limit.as_dict()) == limit, "through ceilings.json"
    rising = ceiling.Ceiling(ceiling.SHARED, 2651.0, None, "", 32, {2: 191.0, 8: 724.0, 32: 2651.0})
    assert rising.loader_falls_at is None
    flat = ceiling.Ceiling(ceiling.SHARED, 804.0, None, "", 2, {2: 804.0, 8: 790.0})
    assert flat.loader_falls_at is None, "within noise of the peak"


def test_trials_past_the_seeds_bound_are_skipped_not_run(compose, monkeypatch):
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 2.0)
    base = ["sweep=loader", "sweep.max_workers=32"]
    search = Search()
    for workers, value in ((2, 644.0), (8, 570.0), (32, 567.0)):
        search.learn_bound(compose(*base, f"loader.num_workers={workers}"), value)
    skip = search.past_bound(compose(*base, "loader.num_workers=12"))
    assert skip is not None and skip.reason.startswith("12 workers: the seeds past 2")
    assert search.past_bound(compose(*base, "loader.num_workers=8")) is None
    off = Search()
    for workers, value in ((2, 644.0), (8, 570.0), (32, 567.0)):
        cfg = compose(*base, "sweep.bound_by_seeds=false", f"loader.num_workers={workers}")
        off.learn_bound(cfg, value)
    assert off.past_bound(compose(*base, "loader.num_workers=12")) is None
    top = Search()  # seeds 2 and 8 under sweep.max_workers=8
    for workers, value in ((2, 644.0), (8, 570.0)):
        top.learn_bound(
            compose("sweep=loader", "sweep.max_workers=8", f"loader.num_workers={workers}"), value
        )
    assert top.bound is None, "a bound at the top seed bounds nothing"


# What trial 1 of a photos sweep on 2 cores measured a batch of 64 cost (3 workers, 387
# samples/s): 0.2 s of a core in a worker, so the cores hold any pool past 2 workers.
PHOTOS_COSTS = {
    "batch_size": 64.0,
    "worker_s": 0.425,
    "worker_cpu_s": 0.198,
    "queued_s": 0.214,
    "collate_s": 0.028,
    "tail": 1.19,
    "step_s": 0.112,
    "step_cpu_s": 0.092,
    "handoff_s": 0.0003,
    "nbytes": 9634304.0,
    "measured_on": {"num_workers": 3, "prefetch_factor": 2, "engine": "process"},
}


def test_trials_twice_as_wide_as_a_pool_the_cores_hold_are_skipped_not_run(compose, monkeypatch):
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 2.0)
    base = ["sweep=loader", "sweep.max_workers=64"]
    search = Search()
    wide = compose(*base, "loader.num_workers=48", "loader.prefetch_factor=8")
    assert search.past_model(wide) is None, "no costs measured yet: nothing to predict from"
    search.learn_costs(3, 250.0, {"costs": PHOTOS_COSTS, "abandoned": "below half the best"})
    assert search.past_model(wide) is None, "a trial that stopped early ran at another load"
    search.learn_costs(1, 387.0, {"costs": PHOTOS_COSTS})
    search.learn_costs(0, 341.0, {"costs": {**PHOTOS_COSTS, "worker_cpu_s": 0.02}})
    assert search.costs is not None and search.costs[2] == 1, "the fastest trial's costs"
    skip = search.past_model(wide)
    assert skip is not None and skip.reason.startswith("48 workers: from trial 1's costs")
    assert "24" in skip.reason, "what the cores hold"
    assert search.past_model(compose(*base, "loader.num_workers=5")) is None, "2 would not be"
    assert search.past_model(compose(*base, "loader.num_workers=6")) is not None
    off = compose(*base, "sweep.bound_by_model=false", "loader.num_workers=48")
    assert search.past_model(off) is None
    slow_reads = Search()  # a read that waits 60 ms a sample: the workers hold 24 of them
    slow_reads.learn_costs(1, 387.0, {"costs": {**PHOTOS_COSTS, "worker_s": 3.9}})
    assert slow_reads.past_model(wide) is None


def test_the_model_bounds_the_samplers_trials_not_those_asked_by_name():
    from hydra_plugins.feedrate_launcher.optuna_sweeper import _by_name

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(0))
    study.enqueue_trial({"loader.num_workers": 8})  # the climb's wider step
    batch = [study.ask(), study.ask()]
    assert _by_name(study, batch) == [0], "the first was asked by name, the second sampled"


def test_threads_are_searched_where_the_model_shares_the_cpu(compose, monkeypatch):
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 2.0)
    monkeypatch.setattr("feedrate.hardware.pytorch_threads", lambda: 4)
    assert max_threads() == 4, "PyTorch's default counts the machine, not the job's share"
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 6.0)
    assert max_threads() == 6
    monkeypatch.undo()
    cfg = compose("sweep=loader", "model=pooled_linear", "hardware=cpu")
    assert search_threads(cfg), "the model trains on the CPU the workers use"
    cfg.trainer.measure = Measure.loader
    assert not search_threads(cfg), "no model step: nothing to share the cores with"
    cfg = compose("sweep=loader", "model=pooled_linear", "sweep.search_threads=false")
    assert not search_threads(cfg)
    monkeypatch.setattr("feedrate.sweep.space.torch.cuda.is_available", lambda: True)
    assert not search_threads(compose("sweep=loader", "model=pooled_linear")), "model on a GPU"


def test_decode_placement_is_searched_with_a_gpu_for_jpeg_datasets(compose, monkeypatch):
    class Trial:  # records what the search space asks for
        def __init__(self):
            self.asked = {}

        def suggest_int(self, name, low, high, log=False):
            self.asked[name] = low
            return low

        def suggest_categorical(self, name, choices):
            self.asked[name] = choices
            return choices[0]

    def asked(*overrides):
        trial = Trial()
        loader_search_space(compose("sweep=loader", *overrides), trial)
        return trial.asked

    assert "loader.decode" not in asked("dataset=photos"), "no GPU to decode on"
    monkeypatch.setattr("feedrate.sweep.space.torch.cuda.is_available", lambda: True)
    assert asked("dataset=photos")["loader.decode"] == ["cpu", "device"]
    assert asked("dataset=webdataset")["loader.decode"] == ["cpu", "device"]
    assert "loader.decode" not in asked("dataset=synthetic"), "no JPEG bytes to hand over"


def test_the_engine_is_searched_and_thread_workers_are_asked_no_process_settings(compose):
    class Trial:  # answers each question with the choice it is given
        def __init__(self, engine):
            self.engine, self.asked = engine, {}

        def suggest_int(self, name, low, high, log=False):
            self.asked[name] = low
            return low

        def suggest_categorical(self, name, choices):
            self.asked[name] = choices
            return self.engine if name == "loader.engine" else choices[0]

    cfg = compose("sweep=loader", "trainer.stream=false")
    on_processes, on_threads = Trial("process"), Trial("thread")
    loader_search_space(cfg, on_processes)
    loader_search_space(cfg, on_threads)
    assert on_processes.asked["loader.engine"] == ["process", "thread"]
    process_only = {"loader.multiprocessing_context", "loader.persistent_workers"}
    assert process_only <= set(on_processes.asked)
    assert not (process_only | {"loader.worker_threads"}) & set(on_threads.asked)
    assert {"loader.num_workers", "loader.prefetch_factor"} <= set(on_threads.asked)
    alone = compose("sweep=loader", "sweep.engines=[thread]")
    assert seed_settings(alone)["loader.engine"] == "thread"
    only = Trial("process")
    loader_search_space(compose("sweep=loader", "sweep.engines=[process]"), only)
    assert "loader.engine" not in only.asked, "one engine: no question asked"
    # a thread winner's preset records its engine, and no setting of worker processes
    won = {"num_workers": 64, "engine": "thread", "prefetch_factor": 2, "batch_size": 64}
    won |= {"multiprocessing_context": "fork", "persistent_workers": True}
    assert preset_values(won, False) == {
        "num_workers": 64,
        "engine": "thread",
        "prefetch_factor": 2,
    }


def test_a_dataset_threads_cannot_read_is_searched_on_processes_only(compose, caplog):
    cfg = compose("sweep=loader", "dataset=webdataset")  # a stream: it splits by process
    from feedrate.sweep import space

    space._warn_once.cache_clear()  # said once a process: an earlier test may have seen it
    with caplog.at_level("WARNING", logger="feedrate.sweep"):
        assert engines(cfg) == ["process"]
    said = caplog.text
    assert "is a stream (an IterableDataset)" in said and "leaves thread workers out" in said


def test_thread_workers_cost_no_process_and_no_shared_memory():
    fp = Footprint(600.0, 100.0, 150528)
    processes = OmegaConf.create(
        {"num_workers": 8, "prefetch_factor": 2, "batch_size": 64, "engine": "process"}
    )
    threads = OmegaConf.create({**processes, "engine": "thread"})
    batches = 8 * 2 * 64 * 150528 / 2**20  # in flight: in shared memory, or in the process
    assert predict(processes, fp) == pytest.approx((600 + 800 + batches, batches))
    assert predict(threads, fp) == pytest.approx((600 + batches, 0.0))
    run = {"loader": {"num_workers": 64, "engine": "thread"}}
    wide_threads = _contestant("t", [500], False, run=run)
    narrow = _contestant("p", [500], False, run={"loader": {"num_workers": 8}})
    assert wide_threads.cost()[0] == 0 < narrow.cost()[0], "threads are no worker processes"
    # the guard learns a thread run without taking its batches for the training process's own
    guard, sample = FeasibilityGuard(), {"run": {"sample_bytes": 150528}}
    on_processes = OmegaConf.create({"loader": {**processes, "num_workers": 4}})
    on_threads = OmegaConf.create({"loader": {**threads, "num_workers": 64}})
    ran = {"peak_pss_mb": 1000.0, "peak_main_pss_mb": 600.0, **sample}
    guard.learn(on_processes, TrialResult([], "ok", metrics=ran))
    ran = {"peak_pss_mb": 2500.0, "peak_main_pss_mb": 2500.0, **sample}
    guard.learn(on_threads, TrialResult([], "ok", metrics=ran))
    assert guard.footprint_of(on_processes) == Footprint(600.0, 100.0, 150528)
    assert guard.footprint_of(on_threads) == Footprint(600.0, 0.0, 150528)


def test_guard_skips_what_would_not_fit():
    guard = FeasibilityGuard()
    guard.ram_budget_mb, guard.shm_budget_mb = 4000.0, 64.0
    cfg = OmegaConf.create({"loader": {"num_workers": 4, "prefetch_factor": 2, "batch_size": 64}})
    assert guard.check(cfg) is None, "nothing measured yet: run it"
    result = TrialResult(
        [],
        "ok",
        metrics={"peak_pss_mb": 1000.0, "peak_main_pss_mb": 600.0, "run": {"sample_bytes": 150528}},
    )
    guard.learn(cfg, result)
    assert guard.footprint_of(cfg) == Footprint(600.0, 100.0, 150528)
    # the processes' PSS, and the batches in /dev/shm beside it (RAM too)
    assert predict(cfg.loader, guard.footprint_of(cfg)) == pytest.approx((1073.5, 73.5))
    skip = guard.check(cfg)
    assert "74 MB" in skip.reason and "--shm-size" in skip.reason, "the figure, and the fix"
    assert skip.predicted_mb == pytest.approx(1073.5), "drawn at the memory it would use"
    big = OmegaConf.create(
        {"loader": {"num_workers": 48, "prefetch_factor": None, "batch_size": 1}}
    )
    assert "predicted memory 5,414 MB" in guard.check(big).reason
    # two ranks on the node: their peaks summed (two trees of 600 + 4 x 100), one rank's
    # footprint learned, and a setting predicted for both
    ranks = OmegaConf.merge(cfg, {"sweep": {"ranks_per_node": 2}})
    pair = FeasibilityGuard()
    pair.ram_budget_mb = pair.shm_budget_mb = 1e9
    metrics = {"peak_pss_mb": 2000.0, "peak_main_pss_mb": 600.0, "run": {"sample_bytes": 150528}}
    pair.learn(ranks, TrialResult([], "ok", metrics=metrics))
    assert pair.footprint_of(ranks) == Footprint(600.0, 100.0, 150528)
    both = predict(ranks.loader, pair.footprint_of(ranks), 2)
    assert both == pytest.approx((2 * 1073.5, 2 * 73.5))
    pair.ram_budget_mb = 2000.0
    reason = pair.check(ranks).reason
    assert "2,147 MB" in reason and "2 ranks" in reason and "600 MB" in reason, "both ranks'"


def test_a_stream_bounds_the_workers_by_its_shards(monkeypatch):
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 16.0)
    stream = {"_target_": "feedrate.stream.build_webdataset", "n_shards": 12}
    assert max_workers(OmegaConf.create({"sweep": {"max_workers": None}, "dataset": stream})) == 12
    in_memory = {"_target_": "feedrate.dataset.SyntheticDataset", "n_samples": 8, "image_size": 8}
    assert max_workers(OmegaConf.create({"sweep": {"max_workers": 40}, "dataset": in_memory})) == 40
    wide = OmegaConf.create(
        {"dataset": stream, "loader": {"num_workers": 16, "prefetch_factor": 2, "batch_size": 8}}
    )
    skip = FeasibilityGuard().check(wide)
    assert (
        skip.reason.startswith("16 workers for a stream of 12 shards")
        and "4 workers would read" in skip.reason
    )
    assert skip.predicted_mb is None, "not a memory reason: the report draws no point for it"


def _learned(guard, main_mb, per_worker, sample_bytes):
    guard.main_mb, guard.per_worker_mb, guard.sample_bytes = main_mb, per_worker, sample_bytes
    guard.learned = True
    return guard


def _trial_of(method, workers, pss, main=600.0):
    cfg = OmegaConf.create(
        {
            "loader": {
                "num_workers": workers,
                "prefetch_factor": 2,
                "batch_size": 8,
                "multiprocessing_context": method,
            }
        }
    )
    run = {"sample_bytes": 1024, "loader": {"multiprocessing_context": method}}
    metrics = {"peak_pss_mb": pss, "peak_main_pss_mb": main, "run": run}
    return cfg, TrialResult([], "ok", metrics=metrics)


def test_memory_per_worker_is_learned_per_start_method():
    # One spawn trial (a worker imports torch: ~300 MB) must not make fork workers (sharing
    # their parent's pages: ~17 MB) look 18x bigger and get skipped.
    guard = FeasibilityGuard()
    guard.ram_budget_mb, guard.shm_budget_mb = 4000.0, 10_000.0
    guard.learn(*_trial_of("fork", 4, 600.0 + 4 * 17))
    guard.learn(*_trial_of("spawn", 2, 600.0 + 2 * 300))
    fork, _ = _trial_of("fork", 64, 0)
    spawn, _ = _trial_of("spawn", 64, 0)
    assert guard.footprint_of(fork).per_worker_mb == pytest.approx(17.0)
    assert guard.check(fork) is None, "64 fork workers: 600 + 64 x 17 MB fits in 4,000 MB"
    skip = guard.check(spawn)
    assert "predicted memory 19,801 MB" in skip.reason and "x 300 MB (spawn)" in skip.reason
    never, _ = _trial_of("forkserver", 64, 0)
    assert guard.check(never) is None, "a start method never measured is not guessed at"


def test_a_memory_budget_comes_from_the_sweep_or_the_allocation(monkeypatch):
    monkeypatch.delenv("SLURM_MEM_PER_NODE", raising=False)
    monkeypatch.setenv("SLURM_MEM_PER_CPU", "2048")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "4")
    from_slurm = memory_budget(OmegaConf.create({"sweep": {"memory_budget_gb": None}}))
    assert from_slurm.mb == 8192 and "SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE" in from_slurm.source
    asked = memory_budget(OmegaConf.create({"sweep": {"memory_budget_gb": 1.5}}))
    assert str(asked) == "1,536 MB (sweep.memory_budget_gb=1.5)", "asked beats the allocation"
    assert asked.over({"peak_pss_mb": 1450.0}) is None
    assert "1,600 MB" in asked.over({"peak_pss_mb": 1600.0})
    # within 5% of it is over too: runs of the same settings peak that far apart
    assert "used 1,500 MB at peak" in asked.over({"peak_pss_mb": 1500.0})
    assert "less 5% of headroom" in asked.over({"peak_pss_mb": 1500.0})


def test_guard_skips_what_is_predicted_over_the_memory_budget():
    guard = FeasibilityGuard(budget=Budget(1000.0, "sweep.memory_budget_gb=0.98"))
    _learned(guard, 600.0, {"fork": 100.0}, 1024)
    fits = OmegaConf.create({"loader": {"num_workers": 3, "prefetch_factor": 2, "batch_size": 8}})
    assert guard.check(fits) is None
    over = OmegaConf.create({"loader": {"num_workers": 5, "prefetch_factor": 2, "batch_size": 8}})
    skip = guard.check(over)
    assert "predicted memory 1,100 MB" in skip.reason
    assert skip.predicted_mb == pytest.approx(1100.0, abs=0.1)
    assert "1,000 MB" in skip.reason and "sweep.memory_budget_gb=0.98" in skip.reason


def test_the_fastest_over_the_memory_budget_cannot_win():
    fast = _contestant("trial 1", [300, 310, 305, 299, 302], False, workers=8)
    for r in fast.results:
        r.metrics = {**r.metrics, "peak_pss_mb": 2000.0}
    slow = _contestant("trial 2", [200, 210, 205, 199, 202], False, workers=2)
    base = _contestant("default", [100, 101, 99, 100, 102], True, workers=0)
    unbounded = decide([base, fast, slow])
    assert unbounded.winner is fast
    bounded = decide([base, fast, slow], Budget(1000.0, "sweep.memory_budget_gb=0.98"))
    assert bounded.winner is slow and bounded.fastest is slow
    assert "trial 1" in bounded.reason and "2,000 MB" in bounded.reason, "out, and its peak"


def test_when_nothing_fits_the_budget_the_error_says_how_much_would():
    fast = _contestant("trial 1", [300, 310], False, workers=8)  # 100 MB each run
    base = _contestant("default", [100, 101], True, workers=0)
    with pytest.raises(feedrate.errors.FeedrateError) as info:
        decide([base, fast], Budget(50.0, "sweep.memory_budget_gb=0.05"))
    assert "within the memory budget" in str(info.value)
    assert "the least any of them used was 100 MB" in str(info.value)


def test_the_report_names_each_trial_by_its_study_number_and_leaves_out_seeds_never_run():
    """A search stopped near the ceiling after its first seed leaves the other seeds waiting
    in the study; a later session's trials follow the earlier ones'."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    for workers in (2, 8, 32):
        study.enqueue_trial({"loader.num_workers": workers})
    study.tell(study.ask(), 620.0)  # session 1 ran the first seed, then stopped
    ran = TrialResult(["loader.num_workers=2"], "ok", value=620.0, metrics={}, job_dir="/s1/0")
    table = report_rows(study, [ran], [], n_new=1)
    assert [(r["phase"], r["name"]) for r in table] == [("search", "trial 0")]
    study.tell(study.ask(), 700.0)  # session 2 runs the next waiting seed (trial 1)
    again = TrialResult(["loader.num_workers=8"], "ok", value=700.0, metrics={}, job_dir="/s2/0")
    table = report_rows(study, [again], [], n_new=1)
    assert [(r["phase"], r["name"]) for r in table] == [
        ("earlier session", "trial 0"),
        ("search", "trial 1"),
    ]


def test_the_pareto_front_keeps_what_nothing_beats_on_both():
    points = [(500, 100), (600, 90), (700, 150), (800, 150), (900, 200), (650, 120)]
    assert pareto_front(points) == [(500, 100), (650, 120), (700, 150), (900, 200)]


# ---------------------------------------------------------------------------------------------
# A trial in its own process


@pytest.mark.quiet  # waits out a hang: runs beside an alone test
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_hanging_trial_is_killed_with_its_workers(tmp_path, ranks):
    """A trial past its time limit is killed with every process it started: under torchrun
    (``sweep.ranks_per_node``) each rank too, which torchrun starts in a session of its own."""
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, subprocess, sys, time
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            rank = os.environ.get("RANK", "0")
            open(os.path.join({str(tmp_path)!r}, f"pids.{{rank}}"), "w").write(
                f"{{os.getpid()}} {{child.pid}}"
            )
            time.sleep(600)
            """
        )
    )
    # torchrun imports torch before it starts the ranks; room for a busy machine (it runs
    # beside the alone tests, marked quiet), at no cost: the time is spent waiting anyway
    limit = 6 if ranks == 1 else 25
    t0 = time.monotonic()
    result = run_trial(Fresh(script, ranks), [], tmp_path / "job", timeout_s=limit)
    assert time.monotonic() - t0 < limit + 30
    assert result.status == "failed" and f"timed out after {limit} s" in result.reason
    started = [int(p) for f in sorted(tmp_path.glob("pids.*")) for p in f.read_text().split()]
    assert len(started) == 2 * ranks, "every rank started, and its child"
    for pid in started:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", pid
    assert TrialResult.load(tmp_path / "job").reason == result.reason


def test_a_killed_trial_names_the_signal(tmp_path):
    script = tmp_path / "oom.py"
    script.write_text("import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n")
    result = run_trial(Fresh(script), [], tmp_path / "job", timeout_s=30)
    assert result.status == "failed"
    assert "killed by SIGKILL" in result.reason and "out of memory" in result.reason


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        ('{"samples_per_sec": NaN, "measured_samples": 64}', "samples_per_sec=nan"),
        ('{"samples_per_sec": 512.0, "measured_samples": 0}', "0 samples"),
        ('{"samples_per_sec": "fast", "measured_samples": 64}', "samples_per_sec='fast'"),
        ('{"measured_samples": 64}', "samples_per_sec=None"),
    ],
)
def test_a_trial_that_measured_nothing_is_failed_never_a_value(tmp_path, metrics, expected):
    script = tmp_path / "measures_nothing.py"
    script.write_text(
        "import sys, pathlib\n"
        "out = pathlib.Path(sys.argv[-1].split('=', 1)[1])\n"
        f"(out / 'metrics.json').write_text({metrics!r})\n"
    )
    result = run_trial(Fresh(script), [], tmp_path / "job", timeout_s=30)
    assert result.status == "failed" and result.value is None
    assert result.reason.startswith("no usable measurement") and expected in result.reason


# ---------------------------------------------------------------------------------------------
# The sweep: one real command end to end, the rest in process with simulated trials

TINY_SWEEP = [
    "model=pooled_linear",
    "loader.batch_size=16",
    "trainer.max_seconds=0.6",
    "trainer.warmup_steps=1",
    "trainer.window_steps=2",
    "sweep.max_workers=4",
    "sweep.finalists=1",
    "sweep.final_seconds=1",  # the decision's rules have their own tests; here, that it runs
    "hydra.launcher.timeout_s=90",
    "sweep.measure_ceilings=false",  # every trial runs: the stop near the ceiling has its test
]


# Small images that wait 4 ms each on "storage": workers pay off, as on real data
SLEEPY_SYNTHETIC = (
    "dataset=synthetic",
    "dataset.n_samples=2000",
    "dataset.image_size=32",
    "dataset.io_latency_ms=4",
)


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of train.py and conf/, so the sweep writes its preset there, not in the repo."""
    shutil.copy(ROOT / "train.py", tmp_path / "train.py")
    shutil.copytree(ROOT / "conf", tmp_path / "conf")
    return tmp_path


def _sweep(project: Path, *args: str, name: str = "tiny", n_trials: int = 3, rounds: int = 1):
    return subprocess.run(
        [
            sys.executable,
            "train.py",
            "-m",
            "sweep=loader",
            *TINY_SWEEP,
            f"sweep.preset_name={name}",
            f"hydra.sweeper.n_trials={n_trials}",
            f"sweep.final_rounds={rounds}",
            f"hydra.sweep.dir={project}/multirun/{len(list(project.glob('multirun/*')))}",
            *args,
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _rows(sweep_dir: Path) -> list[dict]:
    with open(sweep_dir / "trials.csv") as fh:
        return list(csv.DictReader(fh))


def _hosts_of(pid: int) -> list[psutil.Process]:
    """The warm trial hosts the sweep ``pid`` started: the children of its fork server."""
    found = []
    for p in psutil.Process(pid).children():
        try:
            if "multiprocessing.forkserver" in " ".join(p.cmdline()):
                found += p.children()
        except psutil.Error:  # ended meanwhile
            continue
    return found


def _our_processes(project: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(project) in part for part in p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
def test_tiny_sweep_writes_a_preset_that_composes_back(project):
    proc = _sweep(
        project,
        *SLEEPY_SYNTHETIC,
        "hardware=cpu",  # the model trains on the CPU the workers use: threads are searched
        rounds=3,  # the fewest that can show a winner: fewer claim nothing, the cheapest wins
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sweep_dir = project / "multirun" / "0"
    preset = project / "conf" / "loader" / "tiny.yaml"
    text = preset.read_text()
    assert text.splitlines()[:2] == ["# python train.py loader=tiny", MARKER]
    assert "samples/s" in text and "vs default" in text and "95% interval" in text
    again = next(ln for ln in text.splitlines() if "Re-measure the winner as the sweep did" in ln)
    again = again.split("python train.py ", 1)[1].split()
    afresh = next(ln for ln in text.splitlines() if "Re-run the sweep afresh" in ln)
    assert " -m sweep=loader " in afresh and "hydra.sweeper.n_trials=3" in afresh
    assert afresh.count("sweep.study_dir=") == 1, "a new study, not the one just written"
    assert (
        f"# Software: torch {importlib.metadata.version('torch')}" in text and "Python 3." in text
    )
    assert "_target_" not in text
    written = OmegaConf.load(preset)
    loaded = feedrate.compose(["loader=tiny"], config_dir=project / "conf")  # as Hydra does
    assert loaded.loader.num_workers == written.num_workers
    # the re-measure line runs the winner's settings again, as one plain run
    remeasured = subprocess.run(
        [sys.executable, "train.py", *again, f"hydra.run.dir={project}/again"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert remeasured.returncode == 0, remeasured.stderr[-2000:]
    ran = json.loads((project / "again" / "metrics.json").read_text())["run"]["loader"]
    assert ran["num_workers"] == written.num_workers
    decided = OmegaConf.load(sweep_dir / "final_decision.yaml")
    assert decided.loader.num_workers == written.num_workers and decided.reason
    assert list(decided.seconds) == ["ceilings", "search", "final", "gap"]
    assert decided.seconds.search > 0 and decided.seconds.final > 0
    took = r"the sweep's phases took \d+ s: ceilings \d+, search \d+, final \d+, gap \d+"
    assert re.search(took, proc.stdout)
    optuna_file = (sweep_dir / "optimization_results.yaml").read_text()
    assert optuna_file.startswith("# best_params: the best search trial")
    for name in (
        "best_config.yaml",
        "final_decision.yaml",
        "sweep_report.md",
        "samples_vs_workers.png",
        "trials_over_time.png",
        "final_comparison.png",
    ):
        assert (sweep_dir / name).stat().st_size > 0, name
    rows = _rows(sweep_dir)
    assert [r["phase"] for r in rows].count("search") == 3
    # the model trains on the CPU the workers use: the main process's threads are searched,
    # from PyTorch's default; fork workers keep their one thread (more would hang them)
    search = [r for r in rows if r["phase"] == "search"]
    assert search[0]["main_threads"] == str(hardware.pytorch_threads())
    # the one seed (its batches say what they cost): one worker a core, prefetch 2, fork
    seed = search[0]
    assert (seed["prefetch_factor"], seed["multiprocessing_context"]) == ("2", "fork")
    assert int(seed["num_workers"]) == min(4, int(hardware.usable_cores()))
    assert all(1 <= int(r["main_threads"]) <= max_threads() for r in search)
    assert {r["worker_threads"] for r in search} == {""}, "not searched, not set"
    # (a seed with recipe's settings is one row with it: "recipe = trial 1")
    named = {n for r in rows if r["phase"] == "final 1" for n in r["name"].split(" = ")}
    assert named >= {"default", "recipe"}
    assert all(float(r["samples_per_sec"]) > 0 for r in rows if r["status"] == "ok")
    assert "trial #" in proc.stdout and "best so far" in proc.stdout  # a line per trial
    assert list((project / "outputs" / "sweeps").glob("loader-tiny-*.db"))
    assert _our_processes(project) == [], "a trial process outlived the sweep"


@pytest.mark.slow
def test_a_two_rank_trial_is_torchrun_measured_on_both_ranks(project, monkeypatch):
    """sweep.ranks_per_node=2: each trial is torchrun with 2 ranks (as the job will run),
    measured over one window on both, their rates summed; nothing of it outlives the trial.
    (The sweep around it, its finals and its preset: the simulated test below.)"""
    monkeypatch.setattr(sys, "argv", [str(project / "train.py"), "-m"])
    sweep = OmegaConf.create({"sweep": {"ranks_per_node": 2}, "hydra": {"launcher": {}}})
    runner = host.runner_for(sweep, "search")
    assert isinstance(runner, Fresh) and runner.ranks == 2  # a warm host is one process
    monkeypatch.chdir(project)
    overrides = ["sweep=loader", *TINY_SWEEP, *SLEEPY_SYNTHETIC, "sweep.ranks_per_node=2"]
    trial = ["loader.num_workers=2", "loader.prefetch_factor=2"]
    result = run_trial(runner, [*overrides, *trial], project / "job", timeout_s=120)
    assert result.status == "ok", result.reason + (project / "job" / "trial.log").read_text()
    m = result.metrics
    first, second = m["ranks"]
    assert m["world_size"] == 2 and m["run"]["ranks_per_node"] == 2
    assert first["measured_steps"] == second["measured_steps"] > 0
    assert m["samples_per_sec"] == pytest.approx(
        first["samples_per_sec"] + second["samples_per_sec"]
    )
    assert m["run"]["loader"]["num_workers"] == 2, "each rank's (loader.per_rank=true)"
    (row,) = report_rows(optuna.create_study(), [result], [], 0)
    assert len(row["rank_data_wait"].split()) == 2, "each rank's wait"
    assert _our_processes(project) == [], "a rank outlived the trial"


def _simulated(project, monkeypatch, capsys, *args, name="tiny", n_trials=3, rounds=1, **kw):
    """:func:`_sweep`'s sweep, in this process, its trials simulated (tests/fakes.py)."""
    runner = fakes.Simulated(**kw)
    swept = fakes.sweep(
        project,
        "sweep=loader",
        *TINY_SWEEP,
        f"sweep.preset_name={name}",
        f"hydra.sweeper.n_trials={n_trials}",
        f"sweep.final_rounds={rounds}",
        f"hydra.sweep.dir={project}/multirun/{len(list(project.glob('multirun/*')))}",
        *args,
        runner=runner,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    return swept, runner


def test_a_two_rank_sweep_adds_each_ranks_baselines_and_writes_a_per_rank_preset(
    project, monkeypatch, capsys
):
    """sweep.ranks_per_node=2, its torchrun trials simulated (one runs for real below): the
    finals add Lightning's formula and the one-process preset divided, each rank's settings
    as torchrun runs them; the preset is each rank's, or divided, and says so."""
    swept, _ = _simulated(
        project,
        monkeypatch,
        capsys,
        *SLEEPY_SYNTHETIC,
        "sweep.ranks_per_node=2",
        "sweep.divided=recipe",
        name="ranks",
        n_trials=2,
    )
    assert swept.returncode == 0, swept.out[-3000:]
    sweep_dir = project / "multirun" / "0"
    named = {n for r in _rows(sweep_dir) if r["phase"] == "final 1" for n in r["name"].split(" = ")}
    assert named >= {"default", "recipe", "lightning", "recipe divided"}
    loaders = {
        j.parent.name: json.loads(j.read_text())["run"]["loader"]["num_workers"]
        for j in sweep_dir.glob("final/round0_*/metrics.json")
    }
    lightning = max(1, int(hardware.usable_cores()) // 2 - 1)  # its formula, each rank's
    assert loaders["round0_lightning"] == lightning
    assert loaders["round0_recipe"] == 4  # recipe's 4 workers, each rank's
    assert loaders["round0_recipe_divided"] == 2  # recipe's 4, divided as torchrun runs it
    text = (project / "conf" / "loader" / "ranks.yaml").read_text()
    assert text.startswith("# torchrun --nproc_per_node=2 train.py loader=ranks\n")
    again = "# Re-measure the winner as the sweep did: torchrun --nproc_per_node=2 train.py"
    assert f"{again} loader.per_rank=true " in text and "# Measured with 2 ranks" in text
    preset = OmegaConf.load(project / "conf" / "loader" / "ranks.yaml")
    assert preset.measured_on.workload.ranks_per_node == 2
    decided = OmegaConf.load(sweep_dir / "final_decision.yaml")
    divided = decided.winner.startswith("recipe divided")  # the machine's workers, split
    assert preset.get("per_rank", False) is not divided, decided.winner


def test_final_rounds_past_the_third_stop_at_the_sweeps_budget(project, monkeypatch, capsys):
    """Contestants that tie within 30% noise are not settled by three rounds: without a bound
    the rounds go on to sweep.final_rounds; with sweep.budget_s spent, no round starts past
    the third, and the decision is taken on what was measured."""
    rounds_run = {}
    for budget in ("null", "0.001"):
        rng = random.Random(0)
        swept, _ = _simulated(
            project,
            monkeypatch,
            capsys,
            *SLEEPY_SYNTHETIC,
            f"sweep.budget_s={budget}",
            name=f"budget_{budget.replace('.', '_')}",
            rounds=5,
            speed=lambda overrides, rng=rng: rng.uniform(0.7, 1.3),
        )
        assert swept.returncode == 0, swept.out[-3000:]
        sweep_dir = sorted((project / "multirun").glob("*"), key=lambda d: int(d.name))[-1]
        rounds_run[budget] = 1 + max(
            int(d.name[len("round") :].split("_")[0]) for d in (sweep_dir / "final").glob("round*")
        )
        assert (sweep_dir / "final_decision.yaml").exists()
    assert rounds_run == {"null": 5, "0.001": 3}, rounds_run
    assert "stopped after 3, unsettled" in swept.out and "sweep.budget_s=0.001" in swept.out


def test_a_sweep_within_a_memory_budget_returns_a_preset_under_it(project, monkeypatch, capsys):
    """Spawned workers each import torch again (about 300 MB, beside 600 MB for the training
    process: the simulated runner's figures, as measured here): a 1.4 GB budget admits two."""
    swept, _ = _simulated(
        project,
        monkeypatch,
        capsys,
        *SLEEPY_SYNTHETIC,
        "sweep.start_methods=[spawn]",
        "sweep.memory_budget_gb=1.4",
        name="budget",
        n_trials=4,  # the seed, the prediction, one main thread, then the wider spawn
    )
    assert swept.returncode == 0, swept.out[-3000:]
    sweep_dir = project / "multirun" / "0"
    rows = _rows(sweep_dir)
    over = [r for r in rows if r["status"] == "over budget" or "memory budget" in r["reason"]]
    assert over, "the trials with more spawned workers go over the budget"
    assert all(float(r["peak_pss_mb"]) > 1.4 * 1024 for r in over if r["peak_pss_mb"])
    text = (project / "conf" / "loader" / "budget.yaml").read_text()
    assert "1,434 MB" in text and "sweep.memory_budget_gb=1.4" in text, "the budget, said"
    preset = yaml.safe_load(text)
    assert preset["measured_on"]["peak_pss_mb"] <= 1.4 * 1024
    spawned = [
        int(r["num_workers"])
        for r in rows
        if r["status"] == "ok" and r["multiprocessing_context"] == "spawn"
    ]
    assert spawned and max(spawned) == 2, "the most spawned workers that fit"
    decision = yaml.safe_load((sweep_dir / "final_decision.yaml").read_text())
    assert decision["winner"] == "recipe", "its 4 forked workers fit, twice trial 2's rate"
    assert preset["num_workers"] == 4 and preset.get("multiprocessing_context") != "spawn"
    assert (sweep_dir / "memory_vs_throughput.png").stat().st_size > 0
    assert "Memory budget: 1,434 MB" in (sweep_dir / "sweep_report.md").read_text()


# A user's stream of 3 shards, split by rank and by worker, each sample 4 ms of "storage"
SHARDED = """
import os
import time
import torch
from torch.utils.data import IterableDataset, get_worker_info


class Sharded(IterableDataset):
    classes = ["a", "b"]
    num_shards = 3

    def __iter__(self):
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        shards = range(self.num_shards)[rank::world]
        info = get_worker_info()
        if info is not None:
            shards = shards[info.id :: info.num_workers]
        for shard in shards:
            for k in range(200):
                time.sleep(0.004)
                yield torch.full((3, 16, 16), k % 251, dtype=torch.uint8), k % 2
"""


def test_a_sweep_over_a_users_stream_searches_workers_up_to_its_shards(
    project, monkeypatch, capsys
):
    (project / "sharded_stream.py").write_text(SHARDED)
    proc, _ = _simulated(
        project,
        monkeypatch,
        capsys,
        "dataset=custom",
        "dataset._target_=sharded_stream.Sharded",
        name="sharded",
    )
    assert proc.returncode == 0, proc.out[-3000:]
    assert "num_workers" in proc.out and "up to 3" in proc.out, "the bound, said"
    rows = _rows(project / "multirun" / "0")
    assert all(int(r["num_workers"]) <= 3 for r in rows if r["phase"] == "search")
    assert all(float(r["samples_per_sec"]) > 0 for r in rows if r["status"] == "ok")
    assert OmegaConf.load(project / "conf" / "loader" / "sharded.yaml").num_workers <= 3


def test_a_sweep_measures_its_ceiling_first_and_says_where_the_gap_is(project, monkeypatch, capsys):
    proc, runner = _simulated(
        project,
        monkeypatch,
        capsys,
        *SLEEPY_SYNTHETIC,
        "sweep.measure_ceilings=true",
        name="near",
        n_trials=2,
    )
    assert proc.returncode == 0, proc.out[-3000:]
    out = proc.out
    first = [o for o in runner.ran[:3] if "trainer.measure=loader" in o]
    assert len(first) == 2 and "trainer.measure=compute" in runner.ran[2], "before any trial"
    assert "ceiling: " in out and "shared-core rate" in out, "measured and named first"
    sweep_dir = project / "multirun" / "0"
    limit = json.loads((sweep_dir / "ceilings.json").read_text())
    assert limit["kind"] == "shared" and limit["loader_only"] > 0 and limit["compute_only"] > 0
    report = (sweep_dir / "sweep_report.md").read_text()
    assert "## Where the gap is" in report and "of each sample's time" in report
    assert (sweep_dir / "gap.png").stat().st_size > 0
    assert (sweep_dir / "optimization_results.yaml").exists()
    assert (project / "conf" / "loader" / "near.yaml").exists()


def test_a_default_sweep_says_where_the_gap_is_from_the_costs_without_a_run_more(
    project, monkeypatch, capsys
):
    """The winner's loader-only and compute-only runs cost a sweep 15 s: by default its final
    runs' costs say where its time goes, each part's bound against its rate; measure_gap=true
    runs them."""
    proc, runner = _simulated(project, monkeypatch, capsys, *SLEEPY_SYNTHETIC, name="costs")
    assert proc.returncode == 0, proc.out[-3000:]
    assert not [o for o in runner.ran if any(a.startswith("trainer.measure=") for a in o)]
    sweep_dir = project / "multirun" / "0"
    report = (sweep_dir / "sweep_report.md").read_text()
    section = report.split("## Where the gap is")[1].split("##")[0]
    assert "each part alone would allow (" in section and "set the pace, reached at" in section
    assert "workers " in section and "cores " in section, "the bounds, each named"
    assert (sweep_dir / "gap.png").stat().st_size > 0

    again, runner = _simulated(
        project, monkeypatch, capsys, *SLEEPY_SYNTHETIC, "sweep.measure_gap=true", name="runs"
    )
    assert again.returncode == 0, again.out[-3000:]
    assert [o for o in runner.ran if "trainer.measure=compute" in o], "the differential runs"
    assert "of each sample's time" in (project / "multirun" / "1" / "sweep_report.md").read_text()


def _workers(overrides: list[str]) -> int | None:
    return next((int(o.split("=")[1]) for o in overrides if "num_workers=" in o), None)


def test_where_the_loader_alone_and_the_seeds_fall_no_more_workers_are_run(
    project, monkeypatch, capsys
):
    """Photos on 2 cores: loader-only 804 at 2 workers, 748 at 8; end to end 640, 591. Neither
    the ceiling's nor the search's 32-worker run (23 s and 25 s there) is needed."""
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 2.0)
    proc, runner = _simulated(
        project,
        monkeypatch,
        capsys,
        *SLEEPY_SYNTHETIC,
        "sweep.measure_ceilings=true",
        "sweep.max_workers=32",
        name="falls",
        n_trials=4,
        speed=lambda o: (2 / max(2, _workers(o) or 2)) ** 2,
    )
    assert proc.returncode == 0, proc.out[-3000:]
    loader_only = [_workers(o) for o in runner.ran if "trainer.measure=loader" in o]
    assert loader_only[:2] == [2, 8], "the ceiling: ascending, and no 32 after 8 fell"
    assert "loader-only" in proc.out and "2 workers" in proc.out, "where the ceiling fell"
    limit = json.loads((project / "multirun" / "0" / "ceilings.json").read_text())
    assert sorted(limit["loader_at"]) == ["2", "8"]
    searched = [_workers(o) for o in runner.ran if "trainer.measure" not in " ".join(o)]
    assert 32 not in searched, "no search trial past where the rate fell"
    assert "Error executing job" not in proc.out, "a skip is not an error"


def _without_workers(overrides: list[str]) -> list[str]:
    """A trial's settings but its workers (and the launcher's cut-off, from the best so far)."""
    return sorted(
        o for o in overrides if not o.startswith(("loader.num_workers=", "trainer.abandon"))
    )


def _study_trials(out: str) -> list:
    """The trials of the study a sweep's output names."""
    storage = re.search(r"Storage: (\S+)", out).group(1)
    study = optuna.load_study(study_name=_study_name(out), storage=storage)
    return sorted(study.trials, key=lambda t: t.number)


def _one_core_sweep(project, monkeypatch, capsys, *args, n_trials=4, **kw):
    """A simulated sweep on one core of latency-bound data (4 ms a sample), up to 64 workers:
    the sweep's output, the search's trials' overrides, and the study's trials."""
    monkeypatch.setattr("feedrate.sweep.space.hardware.usable_cores", lambda: 1.0)
    name = kw.pop("name", "model")
    proc, runner = _simulated(
        project,
        monkeypatch,
        capsys,
        *SLEEPY_SYNTHETIC,
        "sweep.max_workers=64",
        *args,
        name=name,
        n_trials=n_trials,
        **kw,
    )
    assert proc.returncode == 0, proc.out[-3000:]
    searched = [o for o in runner.ran if "trainer.measure" not in " ".join(o)]
    searched = [o for o in searched if _workers(o) is not None]  # not the baselines
    return proc, searched, _study_trials(proc.out)


def test_the_first_trial_measures_costs_and_the_next_is_the_models_prediction(
    project, monkeypatch, capsys
):
    """One seed, one worker a core, whose batches say what they cost; then the model's
    prediction from those costs, asked through Optuna with the prediction kept on the trial
    (a resumed study climbs on from it); then its neighbours, then the sampler."""
    from feedrate.sweep.climb import FIGURE_KEY, PREDICTED_KEY
    from feedrate.tuning.model import Costs, Pipeline, predict

    proc, searched, trials = _one_core_sweep(
        project, monkeypatch, capsys, "sweep.engines=[process]"
    )
    assert _workers(searched[0]) == 1, "the seed: one worker a core"
    kept = trials[0].user_attrs[FIGURE_KEY]
    costs = Costs.from_dict(kept["costs"])
    assert costs.measured_on.num_workers == 1 and costs.worker_s > costs.worker_cpu_s > 0
    expected = predict(costs, Pipeline(1.0, 64)).setting
    assert expected.num_workers > 1, "latency-bound: the model widens past the cores"
    assert _workers(searched[1]) == expected.num_workers, [_workers(o) for o in searched]
    made = trials[1].user_attrs[PREDICTED_KEY]
    assert made["setting"]["num_workers"] == expected.num_workers and made["bound"]
    assert f"the model predicts {expected.describe()} at" in proc.out
    assert len(re.findall(r"\] trial #\d", proc.out)) == 4, "the climb's count in n_trials"
    report = (project / "multirun" / "0" / "sweep_report.md").read_text()
    assert "## What the model predicted" in report
    assert f"| trial 1 | {made['predicted_samples_per_sec']:,.1f} | measured" in report
    assert not any(PREDICTED_KEY in t.user_attrs for t in trials[2:]), "one prediction held"


def test_a_wider_neighbour_is_asked_where_the_loop_still_waits(project, monkeypatch, capsys):
    """The prediction measured, its loop still waiting 5% or more: one step wider (x1.5) is
    measured, the prediction's other settings kept. Where that reads slower (the rate falls
    past 8 workers here), the search does not widen further."""
    falls = lambda o: 1.0 if (_workers(o) or 1) <= 8 else 0.5  # noqa: E731
    proc, searched, trials = _one_core_sweep(
        project, monkeypatch, capsys, "sweep.engines=[process]", n_trials=5, speed=falls
    )
    predicted = _workers(searched[1])
    assert _workers(searched[2]) == math.ceil(1.5 * predicted), [_workers(o) for o in searched]
    assert "wider, as its loop still waits for data" in proc.out
    assert _without_workers(searched[2]) == _without_workers(searched[1])


@pytest.mark.parametrize("engines", ["[process,thread]", "[process]"])
def test_threads_are_asked_where_the_model_rates_them_near(project, monkeypatch, capsys, engines):
    """Thread workers cost the memory of one process: the model takes them where it rates
    them within 5% of processes (a read that mostly waits), and never where the sweep
    searches processes alone. A thread trial carries no settings of worker processes."""
    proc, searched, _ = _one_core_sweep(
        project, monkeypatch, capsys, f"sweep.engines={engines}", name="threads"
    )
    threads = [o for o in searched if "loader.engine=thread" in o]
    if engines == "[process]":
        assert not threads
        return
    assert "loader.engine=thread" in searched[1], "the prediction: as fast, on threads"
    assert not any(o.startswith("loader.multiprocessing_context=") for o in searched[1])


def _fails_past_two_workers(cfg) -> str | None:
    """A corrupt file that only a third worker reaches (test_host.py runs a real one)."""
    workers = cfg.loader.num_workers
    return f"corrupt sample 1234 (worker 2 of {workers})" if workers > 2 else None


def test_failing_trials_are_recorded_and_the_sweep_finishes(project, monkeypatch, capsys):
    proc, _ = _simulated(
        project, monkeypatch, capsys, *SLEEPY_SYNTHETIC, name="faulty", fail=_fails_past_two_workers
    )
    assert proc.returncode == 0, proc.out[-3000:]
    rows = _rows(project / "multirun" / "0")
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed, "the 4-worker seed trial and recipe should fail"
    assert all("exit status 2: corrupt sample 1234" in r["reason"] for r in failed), failed
    assert {r["phase"] for r in failed} >= {"search", "final 1"}, "in the search and the finals"
    preset = OmegaConf.load(project / "conf" / "loader" / "faulty.yaml")
    assert preset.num_workers <= 2, "a configuration that failed became the preset"


def test_finals_go_on_without_a_baseline_shown_slower_and_the_preset_says_by_how_much(
    project, monkeypatch, capsys
):
    """recipe runs at 0.85 of the finalist every round: shown slower after three rounds, it
    is not measured further, and the preset's header gives its ratio over those rounds."""
    proc, runner = _simulated(
        project,
        monkeypatch,
        capsys,
        *SLEEPY_SYNTHETIC,
        name="five",
        rounds=5,
        speed=lambda overrides: 0.85 if "loader=recipe" in overrides else 1.0,
    )
    assert proc.returncode == 0, proc.out[-3000:]
    assert any("recipe:" in ln and "slower" in ln for ln in proc.out.splitlines()), "shown slower"
    recipe_runs = [o for o in runner.ran if "loader=recipe" in o]
    assert len(recipe_runs) == 3, "not measured after the third round"
    header = (project / "conf" / "loader" / "five.yaml").read_text()
    line = next(ln for ln in header.splitlines() if ln.startswith("#   vs recipe:"))
    assert re.search(r"/ it = 1\.1\dx \[[\d.]+, [\d.]+\] win \(95% interval, 3 paired", line), line
    assert "clearly slower" in next(ln for ln in header.splitlines() if "vs default" in ln)


def test_hand_written_preset_stops_the_sweep_before_any_trial(project, monkeypatch, capsys):
    before = (project / "conf" / "loader" / "recipe.yaml").read_text()
    proc, runner = _simulated(project, monkeypatch, capsys, "dataset=synthetic", name="recipe")
    assert proc.returncode == 2
    assert "was not written by feedrate: it is kept" in proc.out
    assert runner.ran == []
    assert (project / "conf" / "loader" / "recipe.yaml").read_text() == before
    assert not list((project / "multirun" / "0").glob("[0-9]*")), "a trial ran"


SHRUNK_LR_SWEEP = (
    "dataset=synthetic",
    "dataset.n_samples=400",
    "dataset.image_size=16",
    "model.width=4",
    "loader.batch_size=16",
    "trainer.max_steps=12",
    "trainer.warmup_steps=2",
    "trainer.window_steps=2",
)


def _lr_sweep(project: Path, monkeypatch, capsys, *args: str) -> str:
    """``train.py -m sweep=lr`` over the shrunk workload in ``project/lr``, in this process,
    its trials simulated (held-out accuracy peaks at lr 0.01); its output."""
    swept = fakes.sweep(
        project,
        "sweep=lr",
        *SHRUNK_LR_SWEEP,
        *args,
        f"hydra.sweep.dir={project}/lr",
        runner=fakes.Simulated(),
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert swept.returncode == 0, swept.out[-3000:]
    return swept.out


def _trial_statuses(sweep_dir: Path) -> list[str]:
    """Each job's status (trial.json), in job order."""
    jobs = sorted(sweep_dir.glob("*/trial.json"), key=lambda f: int(f.parent.name))
    return [json.loads(f.read_text())["status"] for f in jobs]


@pytest.mark.parametrize(
    "setting",
    [
        ["hydra.sweeper.n_trials=2"],
        # batches of two asked at once, the last one short; a study held in memory only
        ["hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2", "hydra.sweeper.storage=null"],
    ],
    ids=["sqlite", "in-memory-in-batches"],
)
def test_optuna_sweep_of_the_learning_rate_against_held_out_accuracy(
    project, monkeypatch, capsys, setting
):
    out = _lr_sweep(project, monkeypatch, capsys, *setting)
    best = OmegaConf.load(project / "lr" / "optimization_results.yaml")
    accuracies = [
        json.loads(f.read_text())["val_accuracy"] for f in (project / "lr").glob("*/metrics.json")
    ]
    assert best.best_value == max(accuracies) and "trainer.lr" in best.best_params
    assert f"Best value: {best.best_value}" in out
    n_trials = int(setting[0].split("=")[1])
    assert _trial_statuses(project / "lr") == ["ok"] * n_trials, "every trial asked ran"
    assert not list((project / "conf" / "loader").glob("tuned_*")), "sweep=lr wrote a preset"


def test_a_database_password_is_never_logged():
    from feedrate.sweep.study import has_password, shown

    url = "postgresql+psycopg://sweeper:s3cret@db.cluster:5432/studies"
    assert "s3cret" not in shown(url) and shown(url).startswith("postgresql+psycopg://sweeper:***@")
    assert has_password(url) and not has_password("postgresql+psycopg://sweeper@db/studies")
    assert shown("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    assert shown("journal:///shared/x.log") == "journal:///shared/x.log"


def test_trials_the_guard_skips_do_not_count_against_n_trials(project, monkeypatch, capsys):
    """A skipped trial measures nothing, so the sweeper asks for another; at most n_trials
    more, for a guard that skips everything."""
    out = _lr_sweep(
        project,
        monkeypatch,
        capsys,
        "hydra.sweeper.n_trials=2",
        # nothing fits once the first trial taught the guard the footprint
        "hydra.launcher.memory_budget_frac=1e-6",
    )
    statuses = _trial_statuses(project / "lr")
    assert statuses == ["ok", "skipped", "skipped", "skipped"], out[-3000:]
    assert "1 of 2 trials run" in out and "3 more were skipped" in out, "counted, and said"
    # pruned, not failed: TPE ranks a pruned trial below every completed one and moves away
    (db,) = (project / "outputs" / "sweeps").glob("lr-*.db")
    with sqlite3.connect(db) as con:
        states = con.execute("select state from trials order by number").fetchall()
        reasons = con.execute(
            "select value_json from trial_user_attributes where key = 'reason'"
        ).fetchall()
    assert [s for (s,) in states] == ["COMPLETE", "PRUNED", "PRUNED", "PRUNED"]
    assert len(reasons) == 3 and all("skipped: predicted memory" in r for (r,) in reasons)


def test_fixing_a_searched_key_is_refused_before_any_trial(project, monkeypatch, capsys):
    proc, runner = _simulated(
        project,
        monkeypatch,
        capsys,
        "dataset=synthetic",
        "hardware=cpu",
        "loader.num_workers=4",
        "hardware.torch_threads=1",
        name="fixed",
    )
    assert proc.returncode == 2 and runner.ran == []
    assert "loader.num_workers=4" in proc.out and "hardware.torch_threads=1" in proc.out
    assert "sweep.search_threads=false" in proc.out, "how to keep the threads as they are"
    assert not list((project / "multirun" / "0").glob("[0-9]*")), "a trial ran"


def test_every_trial_failing_exits_nonzero_and_keeps_the_preset(project, monkeypatch, capsys):
    preset = project / "conf" / "loader" / "doomed.yaml"
    preset.write_text(render({"num_workers": 3}, ["python train.py loader=doomed", "old"]))
    before = preset.read_text()
    proc, _ = _simulated(
        project,
        monkeypatch,
        capsys,
        "dataset=synthetic",
        name="doomed",
        n_trials=2,
        fail=lambda cfg: "sample 7 could not be read: unreadable sample 7",
    )
    assert proc.returncode == 1, proc.out[-2000:]
    assert "2 x failed: exit status 2: sample 7" in proc.out  # the reasons, counted
    assert preset.read_text() == before


def _trial_states(project: Path, name: str) -> list[tuple[int, str]]:
    (db,) = (project / "outputs" / "sweeps").glob(f"loader-{name}-*.db")
    with sqlite3.connect(db) as con:
        return con.execute("select number, state from trials order by number").fetchall()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["killed", "ctrl-c"])
def test_a_sweep_stopped_mid_trial_resumes_its_study(project, monkeypatch, capsys, sig):
    """Stopped mid-trial, then the same command again: the study goes on, its earlier trials
    kept and reported."""
    args = [
        "dataset=synthetic",
        "dataset.n_samples=500",
        "dataset.image_size=16",
        "dataset.io_latency_ms=4",
        "sweep.write_preset=false",
        "trainer.max_seconds=2",  # a trial lives 4 s or more: long enough to outlive the sweep
    ]
    sweep = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            "-m",
            "sweep=loader",
            *TINY_SWEEP,
            *args,
            "sweep.preset_name=stopped",
            "hydra.sweeper.n_trials=3",
            f"hydra.sweep.dir={project}/multirun/0",
        ],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # as a terminal's foreground job: a shell that runs the suite in the background (`&`)
        # passes SIGINT on ignored, and the sweep would never see the Ctrl-C
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL),
    )
    # Once trial 0 has finished and trial 1 has started in the warm trial host, stop the sweep:
    # SIGKILL to the sweep alone (its host runs in its own session), or Ctrl-C as a terminal
    # sends it.
    lines = []
    for line in sweep.stdout:
        lines.append(line)
        if "trial #0 " in line:
            break
    deadline = time.monotonic() + 60
    while not ((project / "multirun" / "0" / "1").exists() and (trial := _hosts_of(sweep.pid))):
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)
    if sig == signal.SIGKILL:
        sweep.kill()
    else:
        os.killpg(sweep.pid, signal.SIGINT)
    # The trial's main process ends with the sweep, not when its run would end (4 s or more
    # after it started; under CI's load the sweep's own handler has taken over a second)
    gone, alive = psutil.wait_procs(trial, timeout=2.5)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "the trial outlived it"
    rest, _ = sweep.communicate(timeout=120)
    out = "".join(lines) + rest
    deadline = time.monotonic() + 15  # its DataLoader workers notice their parent is gone
    while [p for p in _our_processes(project) if p.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, "a trial outlived the sweep that started it"
        time.sleep(0.2)
    if sig == signal.SIGINT:
        assert sweep.returncode == 130, out[-3000:]
        assert "interrupted (Ctrl-C): trial(s) 1 marked failed, 1 finished trials kept" in out
        assert "Traceback" not in out
        assert _trial_states(project, "stopped") == [(0, "COMPLETE"), (1, "FAIL")]
    else:
        assert _trial_states(project, "stopped") == [(0, "COMPLETE"), (1, "RUNNING")]

    # the same command again (its trials simulated: what is tested is the study it resumes)
    again, _ = _simulated(project, monkeypatch, capsys, *args, name="stopped", n_trials=1)
    assert again.returncode == 0, again.out[-3000:]
    assert "2 earlier trials" in again.out
    if sig == signal.SIGKILL:
        assert "trial(s) 1 of study" in again.out and "left running" in again.out
    assert _trial_states(project, "stopped") == [(0, "COMPLETE"), (1, "FAIL"), (2, "COMPLETE")]
    # the second session's report shows the first's trials beside its own
    rows = _rows(project / "multirun" / "1")
    phases = [r["phase"] for r in rows]
    assert phases.count("earlier session") == 2 and phases.count("search") == 1
    (interrupted,) = [r for r in rows if r["name"] == "trial 1"]
    assert interrupted["status"] == "fail" and "interrupted" in interrupted["reason"]


def test_a_study_optuna_2_wrote_is_refused_with_the_migration_then_resumes(
    project, monkeypatch, capsys
):
    """tests/data/optuna2_study.db: a 3-trial loader sweep as feedrate wrote it with optuna
    2.10 (the Hydra 1.3 line). Refused in words, untouched; after the command the message
    gives, the same sweep resumes it."""
    db = project / "old.db"
    shutil.copy(ROOT / "tests" / "data" / "optuna2_study.db", db)
    storage = f"sqlite:///{db}"
    args = (
        *SLEEPY_SYNTHETIC,
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=loader-old-d9d2907e",
    )
    before = db.read_bytes()
    refused, runner = _simulated(project, monkeypatch, capsys, *args, name="old", n_trials=1)
    assert refused.returncode == 2, refused.out[-3000:]
    assert "was written by an older Optuna" in refused.out
    assert f"optuna storage upgrade --storage {storage}" in refused.out
    assert "Traceback" not in refused.out and runner.ran == []
    assert db.read_bytes() == before, "the old study was changed"
    optuna_cli = Path(sys.executable).parent / "optuna"
    upgrade = subprocess.run(
        [str(optuna_cli), "storage", "upgrade", "--storage", storage],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert upgrade.returncode == 0, upgrade.stderr[-2000:]
    again, _ = _simulated(project, monkeypatch, capsys, *args, name="old", n_trials=1)
    assert again.returncode == 0, again.out[-3000:]
    assert "3 earlier trials" in again.out
    rows = _rows(max((project / "multirun").iterdir()))
    assert [r["phase"] for r in rows].count("earlier session") == 3
    assert (project / "conf" / "loader" / "old.yaml").exists()


def _shared_storage_sweep(project, monkeypatch, capsys, storage: str):
    """A sweep whose study lives in ``storage``, twice: the second resumes it."""
    args = (*SLEEPY_SYNTHETIC, f"sweep.storage={storage}")
    first, _ = _simulated(project, monkeypatch, capsys, *args, name="shared", n_trials=2)
    assert first.returncode == 0, first.out[-3000:]
    again, _ = _simulated(project, monkeypatch, capsys, *args, name="shared", n_trials=1)
    assert again.returncode == 0, again.out[-3000:]
    assert "2 earlier trials" in again.out, "resumed from the shared storage"
    assert not list((project / "outputs").glob("sweeps/*.db")), "a SQLite study was made"
    assert (project / "conf" / "loader" / "shared.yaml").exists()
    return first.out + again.out


@pytest.mark.slow
def test_a_sweeps_study_in_a_real_postgresql_server(project, monkeypatch, capsys, postgresql_url):
    out = _shared_storage_sweep(project, monkeypatch, capsys, postgresql_url)
    study = optuna.load_study(study_name=_study_name(out), storage=postgresql_url)
    states = [t.state.name for t in study.trials]
    assert states.count("COMPLETE") == 3, states
    assert study.user_attrs["decision"]["preset"] == "shared"


def test_a_sweeps_study_in_a_journal_file(project, monkeypatch, capsys):
    journal = project / "shared-fs" / "studies.log"
    out = _shared_storage_sweep(project, monkeypatch, capsys, f"journal://{journal}")
    assert journal.stat().st_size > 0
    from feedrate.sweep.study import storage_of

    study = optuna.load_study(
        study_name=_study_name(out), storage=storage_of(f"journal://{journal}")
    )
    assert [t.state.name for t in study.trials].count("COMPLETE") == 3


def _node(project: Path, name: str, storage: str, n_trials: int, seconds: float):
    """One machine's sweep of the shared study, as its own process (tests/sweeper_node.py)."""
    overrides = [
        "sweep=loader",
        *TINY_SWEEP,
        *SLEEPY_SYNTHETIC,
        "sweep.preset_name=cluster",
        f"sweep.storage={storage}",
        "sweep.stale_after_s=3",
        f"hydra.sweeper.n_trials={n_trials}",
        "sweep.final_rounds=1",
        f"hydra.sweep.dir={project}/multirun/{name}",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.sweeper_node", str(project), str(seconds), *overrides],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _ok_jobs(sweep_dir: Path) -> int:
    return sum(
        json.loads(f.read_text())["status"] == "ok" for f in sweep_dir.glob("[0-9]*/trial.json")
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgresql", "journal"])
def test_two_sweepers_share_one_study_and_lose_nothing_when_one_is_killed(
    project, backend, request
):
    """Two identical nodes sweep one study at once. Node b is killed in the middle of a
    trial: node a finds it stale, asks its parameters again and runs it; every trial ran
    exactly once; the finals ran on one machine (node a), which wrote the preset."""
    from feedrate.sweep.study import NODE_KEY, RETRY_KEY, storage_of

    if backend == "postgresql":
        url = request.getfixturevalue("postgresql_url")
        storage = url.rsplit("/", 1)[0] + "/" + _fresh_database(url, "two_sweepers")
    else:
        storage = f"journal://{project}/shared-fs/studies.log"
    a = _node(project, "a", storage, n_trials=3, seconds=1.0)
    b = _node(project, "b", storage, n_trials=3, seconds=1.0)
    study = None
    deadline = time.monotonic() + 90
    while True:  # b's first trial running: kill b (and its trial) mid-trial
        assert time.monotonic() < deadline and b.poll() is None, "node b never ran a trial"
        try:
            if study is None:
                name = optuna.get_all_study_names(storage=storage_of(storage))
                study = optuna.load_study(study_name=name[0], storage=storage_of(storage))
            running = study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
            killed = [t for t in running if t.user_attrs.get(NODE_KEY, "").endswith(f":{b.pid}")]
        except (IndexError, KeyError):
            killed = []
        if killed:
            os.killpg(b.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    b.wait(timeout=30)
    out, _ = a.communicate(timeout=240)
    assert a.returncode == 0, out[-3000:]
    assert f"trial(s) {killed[0].number} of the study had no sign of life for 3 s" in out, out[
        -3000:
    ]
    trials = study.get_trials()
    states = [t.state.name for t in trials]
    assert "RUNNING" not in states and "WAITING" not in states, states
    assert trials[killed[0].number].state.name == "FAIL"
    retried = [t for t in trials if t.user_attrs.get(RETRY_KEY) == killed[0].number]
    assert len(retried) == 1 and retried[0].state.name == "COMPLETE", "asked again once"
    # its parameters as stored when b was killed (the test's snapshot may predate the last
    # one suggested); one b never stored is suggested afresh
    stored = trials[killed[0].number].params
    assert stored.items() <= retried[0].params.items() and len(stored) >= 3, (stored, retried)
    # each completed trial is one job that ran, on one node or the other
    jobs = _ok_jobs(project / "multirun" / "a") + _ok_jobs(project / "multirun" / "b")
    assert states.count("COMPLETE") == jobs
    assert (project / "multirun" / "a" / "final").is_dir(), "the finals ran on node a"
    assert not (project / "multirun" / "b" / "final").exists()
    assert (project / "conf" / "loader" / "cluster.yaml").exists()


@pytest.mark.slow
def test_of_two_sweepers_that_finish_together_one_runs_the_finals(project):
    storage = f"journal://{project}/shared-fs/studies.log"
    nodes = {n: _node(project, n, storage, n_trials=2, seconds=0.5) for n in ("a", "b")}
    outs = {n: p.communicate(timeout=240)[0] for n, p in nodes.items()}
    assert all(p.returncode == 0 for p in nodes.values()), outs
    finals = [n for n in nodes if (project / "multirun" / n / "final").is_dir()]
    assert len(finals) == 1, "the finals ran on both machines, or on none"
    (other,) = set(nodes) - set(finals)
    assert "finished the search last and runs the finals on its machine" in outs[other]


def test_a_study_refuses_a_machine_of_another_type():
    from feedrate.sweep.study import MACHINE_KEY, check_machine, machine_type

    study = optuna.create_study(study_name="mixed")
    check_machine(study)
    assert study.user_attrs[MACHINE_KEY] == machine_type(), "the first sweeper records it"
    check_machine(study)  # the same type again: fine
    here = machine_type()
    study.set_user_attr(MACHINE_KEY, {**here, "gpu": "8x Another GPU", "ram_gb": 2015})
    with pytest.raises(ConfigError) as refused:
        check_machine(study)
    shown = f"another machine type (gpu: 8x Another GPU there, {here['gpu']} here;"
    assert shown in str(refused.value)
    assert "ram_gb: 2015 there" in str(refused.value)


def _fresh_database(url: str, name: str) -> str:
    """An empty database on the test's server, so each test has a study of its own."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sqlalchemy.text(f"DROP DATABASE IF EXISTS {name}"))
        conn.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    engine.dispose()
    return name


def _study_name(out: str) -> str:
    return re.search(r"Study name: (\S+)", out).group(1)


def test_one_study_runs_one_sweep_at_a_time(tmp_path):
    from feedrate.sweep.study import lock

    url = f"sqlite:///{tmp_path / 'study.db'}"
    held = lock(url, "s")
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from feedrate.sweep.study import lock; lock({url!r}, 's')",
        ],
        capture_output=True,
        text=True,
    )
    assert probe.returncode != 0
    assert f"the study s ({tmp_path / 'study.db'}) is in use by a sweep still running" in (
        probe.stderr
    )
    assert f"pid {os.getpid()}" in probe.stderr
    held.close()


@pytest.mark.parametrize(
    ("second", "expected_value", "expected"),
    [
        ((400.0, []), 400.0, "measured again: the first run was noisy (other processes kept 60%"),
        (
            (400.0, ["other processes kept 40% of this run's cores busy while it was measured"]),
            400.0,
            "noisy twice: other processes kept 40%",
        ),
        # the second run failing leaves the first figure, flagged, not a failed trial
        ((None, []), 900.0, "noisy (other processes kept 60%"),
    ],
    ids=["quiet-again", "noisy-twice", "second-failed"],
)
def test_a_noisy_trial_is_measured_again(tmp_path, second, expected_value, expected):
    runs = iter(
        [
            (900.0, ["other processes kept 60% of this run's cores busy while it was measured"]),
            second,
        ]
    )

    def fake_runner(overrides, job_dir, timeout_s, objective):
        value, noise = next(runs)
        (Path(job_dir) / "trial.log").write_text(f"run at {value}\n")
        status = "ok" if value is not None else "failed"
        result = TrialResult(
            overrides, status, value=value, metrics={"noise": noise}, job_dir=str(job_dir)
        )
        result.reason = "" if value is not None else "killed by SIGKILL"
        result.save()
        return result

    result = run_trial(fake_runner, ["loader.num_workers=4"], tmp_path, 60)
    assert result.ok and result.value == expected_value and expected in result.reason
    assert TrialResult.load(tmp_path).reason == result.reason
    assert (tmp_path / "noisy_run" / "trial.log").read_text() == "run at 900.0\n"


def test_a_noisy_accuracy_is_not_measured_again(tmp_path):
    calls = []

    def fake_runner(overrides, job_dir, timeout_s, objective):
        calls.append(objective)
        return TrialResult(overrides, "ok", value=0.9, metrics={"noise": ["busy"]})

    assert run_trial(fake_runner, [], tmp_path, 60, objective="val_accuracy").value == 0.9
    assert calls == ["val_accuracy"]


class HoldsLock(torch.utils.data.Dataset):
    """An index guarded by a lock: fine for fork, unpicklable for spawn and forkserver."""

    classes = ["a", "b"]

    def __init__(self, n: int = 32) -> None:
        self.n = n
        self.index = {"lock": threading.Lock()}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.zeros(3, 8, 8, dtype=torch.uint8), i % 2


def test_a_dataset_spawn_cannot_pickle_drops_spawn_from_the_search(compose, caplog):
    from feedrate.sweep.space import start_methods

    cfg = compose(
        "dataset=custom",
        "dataset._target_=tests.test_sweep.HoldsLock",
        "sweep=loader",
        "sweep.start_methods=[fork,spawn,forkserver]",
        "sweep.preset_name=locked",
    )
    with caplog.at_level("WARNING", logger="feedrate.sweep"):
        assert start_methods(cfg) == ["fork"]
    assert (
        "dataset is not picklable (dataset.index['lock']: _thread.lock cannot be pickled):"
        " spawn, forkserver workers could not receive it" in caplog.text
    )
    picklable = compose(
        "sweep=loader", "sweep.start_methods=[fork,spawn]", "sweep.preset_name=fine"
    )
    assert start_methods(picklable) == ["fork", "spawn"]


# ---------------------------------------------------------------------------------------------
# The ceiling, and where the gap is


def _confirmed_at(value: float, calls: list):
    def confirm():
        calls.append(value)
        return TrialResult([], "ok", value=value)

    return confirm


def test_the_search_stops_near_the_ceiling_only_when_a_second_run_agrees():
    search = Search(ceiling.Ceiling(ceiling.LOADER, 1000.0, None, "32 workers"))
    config = OmegaConf.create({"sweep": {"stop_within": 0.03}})
    calls: list[float] = []
    search.check_ceiling(config, 3, 900.0, _confirmed_at(990.0, calls))
    assert calls == [] and search.stop_reason is None, "0.90 of it: not near, nothing rerun"
    search.check_ceiling(config, 4, 985.0, _confirmed_at(900.0, calls))
    assert calls == [900.0] and search.stop_reason is None, "lucky once: the search goes on"
    search.check_ceiling(config, 5, 985.0, _confirmed_at(975.0, calls))
    assert search.stop_reason.startswith("trial 5 reaches 0.98 of what this machine allows")
    assert "0.97" in search.stop_reason, "the second run's figure"


def test_a_ceiling_measured_higher_the_second_time_keeps_the_search_going(tmp_path):
    """One short loader-only run can be unlucky: photos on 2 cores read 770 and 903 samples/s
    at the same 2 workers in two sweeps. Before stopping, the ceiling is measured again and
    the higher figure kept."""
    search = Search(ceiling.Ceiling(ceiling.LOADER, 1000.0, None, "2 workers", 2))
    config = OmegaConf.create(
        {"sweep": {"stop_within": 0.03}, "hydra": {"sweep": {"dir": str(tmp_path)}}}
    )
    calls: list[float] = []
    search.check_ceiling(
        config, 4, 985.0, _confirmed_at(980.0, calls), _confirmed_at(1100.0, calls)
    )
    assert calls == [1100.0] and search.stop_reason is None, "measured again, no confirm"
    assert ceiling.read_ceiling(tmp_path).loader_only == 1100.0, "the report shows it too"
    # measured twice already: a trial near the higher figure is confirmed, not re-measured
    search.check_ceiling(
        config, 5, 1080.0, _confirmed_at(1075.0, calls), _confirmed_at(1200.0, calls)
    )
    assert calls == [1100.0, 1075.0] and search.measured_ceiling.loader_only == 1100.0
    assert search.stop_reason.startswith("trial 5 reaches 0.98 of what this machine allows")
    # lower the second time: the first figure stands
    lower = Search(search.measured_ceiling)
    lower.check_ceiling(config, 6, 1080.0, _confirmed_at(1075.0, []), _confirmed_at(900.0, []))
    assert lower.measured_ceiling.loader_only == 1100.0 and lower.stop_reason is not None


def test_the_ceiling_that_applies_depends_on_where_the_model_runs():
    assert ceiling.kind_of("cuda:0", "train") == ceiling.GPU
    assert ceiling.kind_of("cpu", "train") == ceiling.SHARED
    assert ceiling.kind_of("cuda:0", "loader") == ceiling.LOADER
    gpu = ceiling.Ceiling(ceiling.GPU, 2373.0, 2609.0)
    shared = ceiling.Ceiling(ceiling.SHARED, 2373.0, 2609.0)
    assert gpu.value == 2373.0, "min(loader-only, compute-only)"
    assert shared.value == pytest.approx(1243, abs=1), "the cores are shared: 1/(1/L + 1/C)"
    assert "shared-core rate" in shared.describe() and "1,243 samples/s" in shared.describe()


def test_only_a_trial_near_the_ceiling_stops_the_search_not_one_far_above_it():
    assert ceiling.near(980, 1000, 0.03) == ceiling.STOP
    assert ceiling.near(1025, 1000, 0.03) == ceiling.STOP, "above by noise: as good as it gets"
    assert ceiling.near(900, 1000, 0.03) is None
    # measured: 32 sleeping workers ran 609 samples/s end to end under a shared ceiling of 499
    assert ceiling.near(609, 499, 0.03) == ceiling.BEYOND


def test_the_gap_names_the_side_where_the_time_goes():
    shared = ceiling.Ceiling(ceiling.SHARED, 742.0, 2393.0)
    words, shares = ceiling.gap(515.0, shared)
    assert shares["loader"] == pytest.approx(515 / 742) and shares["model"] > 0
    assert shares["loader"] > shares["model"] and "0.91" in words
    assert shares["sharing"] == pytest.approx(1 - 515 / 742 - 515 / 2393)
    # faster than the additive model: the overlap is named, not hidden
    words, shares = ceiling.gap(1304.0, ceiling.Ceiling(ceiling.SHARED, 2373.0, 2609.0))
    assert shares["sharing"] < 0 and "overlap" in words
    words, _ = ceiling.gap(900.0, ceiling.Ceiling(ceiling.GPU, 1000.0, 3000.0))
    assert "10%" in words, "what is lost to the loader"


def test_a_loader_only_run_that_measured_nothing_leaves_the_gap_out(tmp_path, monkeypatch, caplog):
    """Seen in a full suite, on a busy machine: the winner's loader-only run left no measured
    window (0 samples/s), and the gap's division ended the sweep before its preset."""
    ceiling.Ceiling(ceiling.SHARED, 742.0, 2393.0).write(tmp_path)
    nothing = TrialResult([], "ok", value=0.0, metrics={})
    monkeypatch.setattr(ceiling, "run_trial", lambda *args, **kwargs: nothing)
    timeout = {"launcher": {"timeout_s": 9}}
    config = OmegaConf.create({"sweep": {"final_seconds": 3}, "hydra": timeout})
    winner = _contestant("trial 1", [500.0], False)
    assert ceiling.measure_gap(config, winner, tmp_path, runner=None) is None
    assert "no gap analysis" in caplog.text and "it measured no samples" in caplog.text


def test_a_trial_clearly_below_the_best_stops_measuring_early(compose, tmp_path):
    m = feedrate.run(
        compose(
            "trainer.stream=true",
            "trainer.max_steps=100000",
            "trainer.max_seconds=30",
            "trainer.abandon_below=1e9",
            "loader.num_workers=1",
        ),
        output_dir=tmp_path,
    )
    assert re.match(r"ended early after \d+\.\d s measured", m["abandoned"]), m["abandoned"]
    assert "below trainer.abandon_below=1,000,000,000.0" in m["abandoned"]
    assert m["measured_seconds"] < 5, "not the 30 s asked for"


def test_between_near_worker_counts_memory_decides():
    deep = _contestant("trial 5", [2290, 2300, 2310, 2295, 2305], False, workers=50)
    for r in deep.results:
        r.metrics["peak_shm_mb"] = 14_700.0  # 50 workers x prefetch 8 of 38 MB batches
    shallow = _contestant("trial 6", [2280, 2290, 2300, 2285, 2295], False, workers=51)
    d = decide([deep, shallow])
    assert d.fastest is deep and d.winner is shallow, "1 worker more, 14 GB less"
    few = _contestant("trial 7", [2270, 2290, 2300, 2280, 2310], False, workers=16)
    assert decide([deep, shallow, few]).winner is few, "a third the workers wins outright"
