"""The loader sweep's next trial, from the model of the pipeline: the same
:class:`~feedrate.tuning.policy.Climb` that the tuning loader follows (docs/design.md, "What a
sample costs: predict, then verify").

The first trial measures what a sample costs (``trainer.costs``: its metrics.json
``costs``). Each completed trial is a :class:`~feedrate.tuning.policy.Figure` of the climb;
the climb's next setting (the model's prediction, then the neighbours its figures leave
open) is asked next through ``study.enqueue_trial``, with the fastest trial's other
parameters (its start method, its threads). Once the climb has nothing to verify, the
sampler (TPE) searches around what it measured. A trial keeps what it measured, and an asked
trial its prediction, in its user attributes: a resumed or shared study climbs on from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from feedrate.sweep.space import DEPTH, ENGINE, WORKERS
from feedrate.tuning.model import Costs, Prediction, past_the_workers
from feedrate.tuning.policy import Climb, Figure, Machine
from feedrate.tuning.setting import PROCESS, THREAD, Setting

FIGURE_KEY = "feedrate.figure"  # a trial's user attribute: what it measured besides its value
PREDICTED_KEY = "feedrate.predicted"  # an asked trial's: the model's prediction it verifies
THREADS = "loader.main_threads"
PROCESS_ONLY = ("multiprocessing_context", "worker_threads", "persistent_workers")


def figure_attrs(metrics: dict) -> dict:
    """What a completed trial keeps of its metrics.json for the climb: plain data."""
    return {
        "data_wait_frac": _number(metrics.get("data_wait_frac")),
        "cpu_busy_frac": _number(metrics.get("cpu_util")),
        "startup_s": _number(metrics.get("first_batch_s")),
        "costs": metrics.get("costs"),
    }


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else 0.0


def setting_of(params: dict) -> Setting | None:
    """The loader setting of a trial's parameters (None: they name no worker count)."""
    workers = params.get(WORKERS)
    if workers is None:
        return None
    engine = params.get(ENGINE) or PROCESS
    engine = str(getattr(engine, "value", engine))  # an Engine of a composed config
    return Setting(int(workers), params.get(DEPTH), engine, params.get(THREADS) or None)


def figure_of(trial: Any) -> Figure | None:
    """A trial as the climb's figure: a completed one's rate and what it kept of its
    metrics; one that failed, was skipped or waits to run is tried, with no figure."""
    from optuna.trial import TrialState

    setting = setting_of(_params(trial))
    if setting is None:
        return None
    if trial.state != TrialState.COMPLETE or trial.value is None:
        failed = trial.state.name.lower()
        return Figure(setting, None, failed=failed)
    kept = dict(trial.user_attrs.get(FIGURE_KEY) or {})
    costs = kept.pop("costs", None)
    return Figure(
        setting,
        float(trial.value),
        costs=Costs.from_dict(costs) if isinstance(costs, dict) else None,
        **{k: v for k, v in kept.items() if k in ("data_wait_frac", "cpu_busy_frac", "startup_s")},
    )


def _params(trial: Any) -> dict:
    """What a trial ran, or what it is asked to run."""
    return {**trial.system_attrs.get("fixed_params", {}), **trial.params}


def machine(config: DictConfig) -> Machine:
    """What the climb knows of the machine: a rank's cores and bounds, the engines searched,
    and the training process's threads where the sweep searches them."""
    from feedrate.sweep.space import (
        default_threads,
        engines,
        max_workers,
        rank_cores,
        ranks_per_node,
        search_threads,
    )

    ranks = ranks_per_node(config)
    threads = default_threads(ranks)[THREADS] if search_threads(config) else 0
    return Machine(float(rank_cores(ranks)), max_workers(config), tuple(engines(config)), threads)


def climb_of(trials: list, config: DictConfig) -> tuple[Climb, list[Figure]] | None:
    """The climb over a study's trials, in the order they were asked, and its figures; None
    before any trial completed."""
    figures = [f for f in (figure_of(t) for t in sorted(trials, key=lambda t: t.number)) if f]
    measured = [f for f in figures if f.ok]
    if not measured:
        return None
    window = float(config.trainer.get("max_seconds") or 3.0)
    climb = Climb(measured[0].setting, machine(config), window_s=window, predicts=True)
    for trial in trials:  # the predictions asked before: at most three in all
        made = trial.user_attrs.get(PREDICTED_KEY)
        if made:
            climb.predictions.append((made["after_figures"], _prediction(made)))
    return climb, figures


def fed_twins(trials: list, config: DictConfig) -> Callable[[dict, dict], bool]:
    """Two searched settings the finals would only tell apart by noise: near twins
    (:func:`~feedrate.sweep.decide.near_twins`), or the same in every parameter but the
    worker count where the model, from the fastest trial's costs, rates the narrower held by
    the cores or the step even with a quarter fewer workers: the wider only adds workers
    that wait. Two such finalists tied in every final round of two held-out stores (42 and
    63 workers, 0.98x [0.74, 1.29] over 5 rounds; 47 and 57, 0.93x [0.75, 1.17]), at 11 s a
    run."""
    from feedrate.sweep.decide import near_twins, same_but_workers

    got = climb_of(trials, config)
    costs = Climb._costs(got[1]) if got is not None else None
    pipe = got[0].pipeline if got is not None else None

    def twins(a: dict, b: dict) -> bool:
        if near_twins(a, b):
            return True
        if costs is None or not same_but_workers(a, b):
            return False
        narrower = setting_of(min((a, b), key=lambda p: p.get(WORKERS) or 0))
        return narrower is not None and past_the_workers(costs, narrower, pipe)

    return twins


def _prediction(made: dict) -> Prediction:
    came = made.get("from")
    return Prediction(
        Setting(**made["setting"]),
        made["predicted_samples_per_sec"],
        made["bound"],
        Setting(**came) if came else None,
        made["why"],
    )


def next_trial(trials: list, config: DictConfig) -> tuple[dict, str, dict | None] | None:
    """The next trial's parameters, the line that says why, and the prediction it verifies
    (plain data, or None for a neighbour); None: the climb has nothing left to measure
    (the sampler goes on). ``trials``: the study's, in any state."""
    from feedrate.sweep.space import in_space

    got = climb_of(trials, config)
    if got is None:
        return None
    climb, figures = got
    before = len(climb.predictions)
    setting = climb.next(figures, seconds_left=math.inf)
    if setting is None or not setting.num_workers:
        return None  # no workers: the final rounds measure them as the `default` baseline
    best = max(
        (t for t in trials if t.value is not None and setting_of(_params(t)) is not None),
        key=lambda t: t.value,
    )
    params = _with_setting(dict(best.params), setting, config)
    latest = max((t for t in trials if t.distributions), key=lambda t: t.number).distributions
    if in_space(params, latest) != {k: v for k, v in params.items() if k in latest}:
        return None  # a value this sweep does not search (a resumed study's wider space)
    new = climb.predictions[before:]
    if new and new[-1][1].setting == setting:
        prediction = new[-1][1]
        report = climb.prediction_report(figures)[-1]
        said = (
            f"the model predicts {setting.describe()} at"
            f" {prediction.samples_per_sec:,.1f} samples/s ({prediction.why}): asked next"
        )
        return params, said, report
    best_figure = Climb.best(figures)
    said = (
        f"{setting.describe()} is asked next, beside the fastest so far"
        f" ({best_figure.setting.describe()}, {best_figure.samples_per_sec:,.1f} samples/s,"
        f" data wait {best_figure.data_wait_frac:.0%}, cores busy"
        f" {best_figure.cpu_busy_frac:.0%}): {_side(best_figure.setting, setting)}"
    )
    return params, said, None


def _side(best: Setting, setting: Setting) -> str:
    if setting.main_threads != best.main_threads:
        return "the other split of the cores between the step and the workers"
    if setting.engine != best.engine:
        return "the other engine, which the model rates near it"
    if setting.num_workers > best.num_workers:
        return "wider, as its loop still waits for data"
    if setting.num_workers < best.num_workers:
        return "narrower, as its workers share busy cores with the step"
    return "deeper"


def _with_setting(params: dict, setting: Setting, config: DictConfig) -> dict:
    """``params`` (a trial's) on ``setting``: its workers, depth and engine; the settings of
    worker processes dropped for threads, and the seeds' added for processes."""
    from feedrate.sweep.space import engines, seed_settings

    params = {**params, WORKERS: setting.num_workers, DEPTH: setting.depth}
    if len(engines(config)) > 1:
        params[ENGINE] = setting.engine
    if setting.main_threads and THREADS in params:  # searched (sweep.search_threads)
        params[THREADS] = setting.main_threads
    if setting.engine == THREAD:
        return {k: v for k, v in params.items() if k.removeprefix("loader.") not in PROCESS_ONLY}
    seeds = seed_settings(config)
    for key in ("loader.multiprocessing_context", "loader.persistent_workers"):
        if key in seeds and key not in params:
            params[key] = seeds[key]
    return params


def seeds(config: DictConfig) -> list[int]:
    """The first trials' workers. One a core (a rank's share of them), where its batches
    say what they cost (``trainer.costs``): the model predicts from it. Else the seed ladder
    (:func:`feedrate.sweep.space.seed_workers`: a stream's batches say nothing), and the
    climb follows their figures alone."""
    from feedrate.sweep.space import seed_workers, streamed

    if config.trainer.get("costs") and not streamed(config):
        return [cores_seed(config)]
    return seed_workers(config)


def cores_seed(config: DictConfig) -> int:
    """The first trial's workers, which measures what a sample costs: one a core (a rank's
    share of them), within the search's bound."""
    from feedrate.sweep.space import max_workers, rank_cores, ranks_per_node

    return max(1, min(max_workers(config), rank_cores(ranks_per_node(config))))
