"""The sweep's Hydra callback: before the study, the ceilings and the seeds; after it, the
final rounds, the decision, the preset and the report (``python train.py -m sweep=loader``).

Hydra's Optuna sweeper runs the study (TPE, one trial at a time, SQLite storage so a second run
resumes it); ``hydra/launcher=loader_trial`` runs each trial in a fresh process with a time
limit (:mod:`feedrate.sweep.trial`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from feedrate import environment, hardware, provenance, stats
from feedrate.errors import FeedrateError
from feedrate.files import atomic_write_text
from feedrate.project import command, loader_dirs, preset_config_dir, preset_file
from feedrate.sweep.ceiling import costs_gap, measure_ceilings, measure_gap, read_ceiling
from feedrate.sweep.climb import seeds
from feedrate.sweep.decide import (
    BASELINES,
    Contestant,
    merge_identical,
    pick_finalists,
    write_decision,
)
from feedrate.sweep.feasibility import Budget, memory_budget
from feedrate.sweep.space import (
    check_sweep,
    default_threads,
    preset_values,
    ranks_per_node,
    search_threads,
    seed_settings,
    start_methods,
)
from feedrate.sweep.study import (
    check_machine,
    claim_finals,
    fail_unfinished,
    has_password,
    open_study,
    shared,
    shown,
    storage_of,
)
from feedrate.sweep.study import lock as lock_study
from feedrate.sweep.trial import (
    TrialResult,
    base_args,
    conf_dir,
    hydra_args,
    run_trial,
)
from feedrate.tuning.decide import (
    Decision,
    behind_every_round,
    clearly_slower,
    decide,
    described,
    drop_clearly_slower,
    drop_shown_slower,
    settled,
)
from feedrate.tuning.preset import MARKER, check_writable, write_checked

if TYPE_CHECKING:  # optuna takes a second to import; trial processes load this module too
    import optuna

log = logging.getLogger(__name__)


class Phases:
    """Where the sweep's wall time went: the ceilings, the search, the final rounds, the gap."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._last = clock()

    def done(self, phase: str) -> None:
        now = self.clock()
        self.seconds[phase] = round(now - self._last, 1)
        self._last = now

    def elapsed(self) -> float:
        """Seconds since the sweep began, the phase under way included."""
        return sum(self.seconds.values()) + self.clock() - self._last

    def describe(self) -> str:
        """``312 s: ceilings 25, search 114, final 165, gap 8``"""
        parts = ", ".join(f"{k} {v:.0f}" for k, v in self.seconds.items())
        return f"{sum(self.seconds.values()):.0f} s: {parts}"


# What the sweep's command spends outside its phases, which its budget keeps for it: its
# start (Python, the imports, Hydra's composing: 2-5 s here) and, after the last round, the
# decision, the report's plots and the preset (2-4 s here)
OUTSIDE_S = 8.0


class SweepFailed(FeedrateError):
    """No configuration could be measured: nothing to decide, no preset written."""

    exit_code = 1


def _failure_summary(search: list[TrialResult]) -> str:
    reasons: dict[str, int] = {}
    for r in search:
        if not r.ok:
            reasons[f"{r.status}: {r.reason}"] = reasons.get(f"{r.status}: {r.reason}", 0) + 1
    lines = [f"  {n} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    return (
        f"every trial of the study failed ({len(search)} in this session); no preset was"
        " written and any existing one is untouched. Reasons:\n"
        + "\n".join(lines)
        + "\nEach trial's output is in <sweep dir>/<n>/trial.log"
    )


def _fail(exc: BaseException) -> None:
    """End the sweep with a message; Hydra turns a callback's exception into a mere warning."""
    if isinstance(exc, FeedrateError):
        log.error("%s", exc)
        sys.exit(exc.exit_code)
    log.exception("the loader sweep failed: %s", exc)
    sys.exit(1)


DECISION_KEY = "decision"  # the study's user attribute: the sweep's final choice


def _record_in_study(study: optuna.Study, decision: Decision, config: DictConfig) -> None:
    """The decision where a study browser shows it: a user attribute of the study, and the
    study's note on optuna-dashboard's study page when the dashboard is installed. The search's
    best trial is not the choice: the finals re-measured it against the others."""
    winner = decision.winner
    name = config.sweep.preset_name
    study.set_user_attr(
        DECISION_KEY,
        {
            "winner": winner.label,
            "loader": winner.loader(),
            "median_samples_per_sec": winner.median,
            "reason": decision.reason,
            "preset": name if config.sweep.write_preset else None,
        },
    )
    try:
        import optuna_dashboard
    except ImportError:
        return
    use = f"\n\nThe preset: `{command()} loader={name}`" if config.sweep.write_preset else ""
    optuna_dashboard.save_note(
        study,
        f"## The sweep's decision: {winner.label}, {winner.median:,.1f} samples/s (median"
        f" of its final rounds)\n\n{decision.reason}{use}\n\nThe study's best trial is the"
        " best *search* run (one short run each); the decision re-measured the finalists and"
        " the baselines in alternating rounds (final_decision.yaml in the sweep's directory).",
    )


@dataclass
class _Rounds:
    """The final rounds' limits and their progress bar: what decides, after each round, what
    is measured further and whether the rounds stop."""

    rounds: int  # sweep.final_rounds: the most
    budget: float | None  # sweep.budget_s
    equivalence: float  # sweep.equivalence
    looks: int  # the looks the intervals are corrected for (feedrate.stats.simultaneous)
    bar: Any

    def after(
        self, contestants: list[Contestant], r: int, last_round_s: float, elapsed_s: float
    ) -> bool:
        """After round ``r`` (from 0), ``last_round_s`` long, the sweep at ``elapsed_s``:
        drop the contestants the rounds show slower; True where the rounds stop (settled,
        one contestant left, or the budget reached)."""
        bar, left = self.bar, self.rounds - r - 1
        # below half the fastest, which no run's noise spans: one round shows it (a
        # contestant measured further only adds 8-13 s a run to the sweep)
        for c in drop_clearly_slower(contestants):
            self._drop(c, left)
        for c in drop_shown_slower(contestants, self.equivalence, self.looks):
            self._drop(c, left)
        short = stats.MIN_ROUNDS - (r + 1)  # the rounds an interval still needs
        ends = elapsed_s + OUTSIDE_S  # the command's, were the rounds to stop now
        if self.budget is not None and short > 0 and ends + short * last_round_s > self.budget:
            why = (
                f"{short} more round(s) ({short * last_round_s:.0f} s) would end the sweep"
                f" past sweep.budget_s={self.budget:g} s (at {elapsed_s:.0f} s now)"
            )
            for c in behind_every_round(contestants, 2 * self.equivalence, why):
                self._drop(c, left)
            if sum(not c.dropped for c in contestants) == 1:
                bar.write(f"after {r + 1} rounds one contestant is left: the rest were behind")
                bar.total = bar.n
                return True
        if left and settled(contestants, self.equivalence, self.looks):
            bar.write(
                f"settled after {r + 1} rounds: every contestant is significantly slower"
                f" than another or within {self.equivalence:.0%} of the fastest"
            )
            return True
        if (
            self.budget is not None
            and left
            and r + 1 >= stats.MIN_ROUNDS
            and ends + last_round_s > self.budget
        ):
            log.info(
                "final rounds: stopped after %d, unsettled: one more (%.0f s) would end the"
                " sweep past sweep.budget_s=%g s (at %.0f s now); the fastest by the paired"
                " rounds wins where the rest is a tie not yet shown",
                r + 1,
                last_round_s,
                self.budget,
                elapsed_s,
            )
            bar.total = bar.n
            return True
        return False

    def _drop(self, c: Contestant, left: int) -> None:
        self.bar.write(f"{c.label}: {c.dropped}")
        self.bar.total -= left


class LoaderSweep(Callback):
    """Hydra callback for ``sweep=loader``: checks and seeding before, decision after."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            self._start(config)
        except Exception as exc:  # noqa: BLE001 - see _fail
            _fail(exc)

    def _start(self, config: DictConfig) -> None:
        self._phases = Phases()
        name = config.sweep.preset_name
        path = preset_file(preset_config_dir(config.hydra), name, "sweep")
        check_writable(path, config.sweep.overwrite)
        check_sweep(config)
        start_methods(config)  # says now, before any trial, if the dataset rules some out
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # feedrate logs what matters
        sweeper = config.hydra.sweeper
        direction = getattr(sweeper.direction, "name", sweeper.direction)
        if has_password(sweeper.storage):
            log.warning(
                "the study's storage URL holds a password: feedrate never logs it, but Hydra"
                " writes the command line into <sweep dir>/.hydra/overrides.yaml. Leave it out"
                " of the URL and give it in PGPASSWORD or ~/.pgpass (PostgreSQL reads both)"
            )
        self._lock = lock_study(sweeper.storage, sweeper.study_name)  # held until exit
        study = open_study(sweeper.study_name, sweeper.storage, direction=str(direction))
        check_machine(study)
        with warnings.catch_warnings():  # experimental in name since optuna 3.2, and kept
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([str(config.objective)])  # what a study browser shows
        if self._lock is not None:  # we own the study: a running trial is a dead sweep's
            stale = fail_unfinished(
                study, "interrupted: the sweep running it stopped before the trial finished"
            )
            if stale:
                log.warning(
                    "trial(s) %s of study %s were left running by a sweep that stopped: marked"
                    " failed; its finished trials are kept",
                    ", ".join(map(str, stale)),
                    sweeper.study_name,
                )
        earlier = len(study.trials)
        if earlier == 0:
            # the seeds run PyTorch's thread counts; the search moves them from there
            threads = {}  # the seeds run PyTorch's thread counts
            if search_threads(config):
                threads = default_threads(ranks_per_node(config))
                if "fork" in start_methods(config):  # searched only for other start methods
                    del threads["loader.worker_threads"]
            same = seed_settings(config)
            for workers in seeds(config):
                study.enqueue_trial({"loader.num_workers": workers, **same, **threads})
        from feedrate.sweep.host import runner_for

        measure_ceilings(config, runner_for(config, "search"))
        self._phases.done("ceilings")
        log.info(
            "loader sweep: study %s (%s), %d earlier trials; up to %d new trials, one at a time,"
            " in %s (limit %g s; one the guard skips is replaced); then up to %d finalists"
            " (within %.0f%% of the best) and the baselines measured in up to %d rounds;"
            " preset -> %s",
            sweeper.study_name,
            shown(sweeper.storage),
            earlier,
            sweeper.n_trials,
            (
                f"a fresh torchrun job of {ranks_per_node(config)} ranks each"
                if ranks_per_node(config) > 1
                else "a warm trial host"
                if config.hydra.launcher.get("warm", True)
                else "fresh processes"
            ),
            config.hydra.launcher.timeout_s,
            config.sweep.finalists,
            100 * config.sweep.finalist_within,
            config.sweep.final_rounds,
            path,
        )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra 1.4 calls this from a `finally`: also when the start or the search ended the
        # sweep (a refused setting, Ctrl-C, every trial failing to launch). Then there is
        # nothing to decide, and that exception says why.
        if sys.exc_info()[0] is not None:
            return
        try:
            self._finish(config)
        except KeyboardInterrupt:
            log.error(
                "interrupted (Ctrl-C) during the final re-measurement: the study's trials are"
                " kept and no preset was written. Run the same command with"
                " hydra.sweeper.n_trials=0 to redo only the final phase"
            )
            sys.exit(130)
        except Exception as exc:  # noqa: BLE001 - see _fail
            _fail(exc)

    def _finish(self, config: DictConfig) -> None:
        import optuna

        from feedrate.sweep import report

        sweep_dir = Path(config.hydra.sweep.dir)
        sweeper = config.hydra.sweeper
        phases = getattr(self, "_phases", None) or Phases()
        phases.done("search")
        study = optuna.load_study(
            study_name=sweeper.study_name, storage=storage_of(sweeper.storage)
        )
        if shared(sweeper.storage) and not claim_finals(study, sweeper.storage):
            log.info(
                "another sweeper of study %s finished the search last and runs the finals on"
                " its machine (a ratio between two machines' figures is machine noise, not a"
                " win): this one writes no preset",
                sweeper.study_name,
            )
            return
        search = report.collect_search(sweep_dir)
        contestants = self._contestants(config, study, search)
        contestants = self._remeasure(config, contestants, sweep_dir / "final", phases)
        phases.done("final")
        budget = memory_budget(config)
        looks = stats.looks(config.sweep.final_rounds)
        decision = decide(contestants, budget, config.sweep.equivalence, looks=looks)
        log.info("decision: %s", decision.reason)
        write_decision(sweep_dir, decision)  # kept if the gap's run is interrupted
        from feedrate.sweep.host import POOL, runner_for

        POOL.close_all(but=_slug(decision.winner))
        if config.sweep.get("measure_gap") or read_ceiling(sweep_dir) is not None:
            runner = runner_for(config, _slug(decision.winner))
            gap = measure_gap(config, decision.winner, sweep_dir, runner)
        else:  # from what its runs' batches cost: no run more
            gap = costs_gap(config, decision.winner)
        POOL.close_all()
        phases.done("gap")
        log.info("the sweep's phases took %s", phases.describe())
        write_decision(sweep_dir, decision, phases.seconds)
        _record_in_study(study, decision, config)

        name = config.sweep.preset_name
        path = preset_file(preset_config_dir(config.hydra), name, "sweep")
        winner_result = next(r for r in decision.winner.results if r.ok)
        atomic_write_text(
            sweep_dir / "best_config.yaml",
            (Path(winner_result.job_dir) / ".hydra" / "config.yaml").read_text(),
        )
        report.write_all(sweep_dir, config, study, search, contestants, decision, gap)
        if config.sweep.write_preset:
            self._write_preset(config, path, decision, study)
        log.info("sweep report: %s", sweep_dir / "sweep_report.md")

    def _contestants(
        self, config: DictConfig, study: optuna.Study, search: list[TrialResult]
    ) -> list[Contestant]:
        args = base_args(config)
        without_loader = [a for a in args if not a.startswith("loader=")]
        selected = config.hydra.runtime.choices.get("loader", "default")
        contestants = [
            Contestant(b, [*without_loader, f"loader={b}"], True)
            for b in dict.fromkeys([*BASELINES, selected])
        ]
        ranks = ranks_per_node(config)
        if ranks > 1:  # what such jobs run today (recipe, above, is each rank's)
            contestants += [
                Contestant(name, [*without_loader, *extra], True)
                for name, extra in _rank_baselines(config, ranks)
            ]
        from optuna.trial import TrialState

        done = [t for t in study.trials if t.state == TrialState.COMPLETE]
        if not done:
            raise SweepFailed(_failure_summary(search))
        maximize = study.direction.name == "MAXIMIZE"
        ranked = sorted(done, key=lambda t: t.value, reverse=maximize)
        from feedrate.sweep.climb import fed_twins

        picked = pick_finalists(
            [(f"trial {t.number}", t.params, t.value) for t in ranked],
            config.sweep.finalists,
            config.sweep.finalist_within,
            maximize,
            twins=fed_twins(study.trials, config),
        )
        for name, params, _ in picked:
            values = [f"{k}={v}" for k, v in params.items()]
            contestants.append(Contestant(name, [*args, *values], False))
        return contestants

    def _remeasure(
        self, config: DictConfig, contestants: list[Contestant], out: Path, phases: Phases
    ) -> list[Contestant]:
        """Alternating rounds of every contestant, each in its own warm host (a new DataLoader
        each round); after the first, contestants that ran the same resolved settings are one
        (measured once from then on). From the third round on, the rounds stop once the
        decision is settled (:func:`~feedrate.tuning.decide.settled`); ``sweep.final_rounds``
        is the most, and past the third no round starts that would end after
        ``sweep.budget_s`` of the sweep (as long as the last round took): a tie the rounds
        have not settled by then goes to the fastest by the paired rounds, as any undecided
        contestant does. Where even the third would end past it, a contestant behind the
        fastest by more than twice ``sweep.equivalence`` in each of the first two rounds is
        measured no further (:func:`~feedrate.tuning.decide.behind_every_round`; photos on 2
        cores: three of four contestants at 0.65-0.85 of the fastest in both, 6 s a run). A
        finalist's search run is not one of them: chosen for being high, it
        is biased high. Returns those left."""
        from tqdm import tqdm

        from feedrate.sweep.host import POOL, runner_for

        rounds = config.sweep.final_rounds
        timeout = config.hydra.launcher.timeout_s
        # The decision rests on these runs: longer windows than the search's, less noise.
        longer = [f"trainer.max_seconds={config.sweep.final_seconds}"]
        POOL.rename("search", _slug(contestants[0]))  # the search's host is warm already
        runners = {c.name: runner_for(config, _slug(c)) for c in contestants}
        for runner in runners.values():  # forked together, before the first round
            getattr(runner, "start", lambda: None)()
        # the rounds are looked at after each from the MIN_ROUNDS-th on (a drop, a stop): the
        # intervals are corrected for every look (feedrate.stats.simultaneous)
        bar = tqdm(total=rounds * len(contestants), desc="final re-measurement", unit="run")
        limits = _Rounds(
            rounds, config.sweep.get("budget_s"), config.sweep.equivalence, stats.looks(rounds), bar
        )
        for r in range(rounds):
            began = time.monotonic()
            # Alternate, and reverse every other round, so drift hits everyone alike.
            live = [c for c in contestants if not c.dropped]
            for c in live if r % 2 == 0 else live[::-1]:
                job_dir = out / f"round{r}_{_slug(c)}"
                res = run_trial(runners[c.name], [*c.overrides, *longer], job_dir, timeout)
                c.add(res, r)
                shown = f"{res.value:,.1f} samples/s" if res.ok else f"{res.status}: {res.reason}"
                bar.write(f"final round {r + 1}/{rounds}: {c.name:>12} -> {shown}")
                bar.update(1)
            if r == 0:
                merged = merge_identical(contestants, bool(config.trainer.stream))
                for c in merged:
                    if c.aliases:
                        bar.write(f"{c.label}: same settings, measured as one from now on")
                bar.total -= (rounds - 1) * (len(contestants) - len(merged))
                contestants = merged
            if limits.after(contestants, r, time.monotonic() - began, phases.elapsed()):
                break
        bar.close()
        return contestants

    def _write_preset(
        self, config: DictConfig, path: Path, decision: Decision, study: optuna.Study
    ) -> None:
        name = path.stem
        tuned = preset_values(decision.winner.loader(), config.sweep.tune_batch_size)
        processes = tuned.get("engine", "process") == "process"
        streamed = config.trainer.stream and tuned.get("num_workers", 0) > 0 and processes
        if streamed:  # measured without epoch ends; persistence only saves restarts
            tuned["persistent_workers"] = True
        winner = decision.winner
        measured = provenance.measured_on(
            config,
            Path(winner.ok_result().job_dir),
            [r.metrics for r in winner.results if r.ok],
            winner.median,
        )
        header = _preset_header(config, decision, study, name, streamed, measured)
        write_checked(
            path, tuned, header, measured, marker=MARKER, overwrite=config.sweep.overwrite
        )
        log.info("wrote %s; use it with: %s loader=%s", path, command(), name)


LIGHTNING = "lightning"  # its suggestion per rank: max(1, cpus // local ranks - 1)


def _rank_baselines(config: DictConfig, ranks: int) -> list[tuple[str, list[str]]]:
    """The baselines of a sweep with ``sweep.ranks_per_node``, as (name, overrides):
    Lightning's per-rank worker count (Lightning#18737: its warning's formula), and a
    one-process preset with its workers divided between the ranks, as a run under torchrun
    divides a preset that does not say ``per_rank`` (``sweep.divided``, else the one
    ``loader=auto`` picks for one process here; none where there is none)."""
    cores = max(1, int(hardware.usable_cores()))
    found = [(LIGHTNING, ["loader=default", f"loader.num_workers={max(1, cores // ranks - 1)}"])]
    single = config.sweep.get("divided") or _one_process_preset(config)
    if single is None:
        log.info(
            "no preset measured here for one process: the divided baseline is not run (tune"
            " one with sweep.ranks_per_node=1, or name one with sweep.divided=NAME)"
        )
    else:
        found.append((f"{single} divided", [f"loader={single}", "loader.per_rank=false"]))
    return found


def _one_process_preset(config: DictConfig) -> str | None:
    """The preset ``loader=auto`` picks for one process on this machine and workload."""
    fp = hardware.detect(config.dataset.get("root") or config.dataset.get("path"))
    hw = hardware.resolve(config.hardware, fp)
    here = provenance.Here.of(config, fp, hw, base_args(config))  # not under torchrun: 1 rank
    dirs = loader_dirs(config.hydra, conf_dir(config))
    found = provenance.measured_here(dirs, here, hw.is_cuda)
    return found[0] if found else None


def _launched(ranks: int) -> str:
    """The command that runs this program with ``ranks`` on the node: ``python train.py``
    (``feedrate train``), under ``torchrun --nproc_per_node=<ranks>`` when more than one."""
    run = command()
    if ranks == 1:
        return run
    script = run.removeprefix("python ")
    plain = "--no-python " if script == run else ""  # the feedrate command: no script
    return f"torchrun --nproc_per_node={ranks} {plain}{script}"


def _slug(c: Contestant) -> str:
    return c.name.replace(" ", "_")


def _preset_header(
    config: DictConfig,
    decision: Decision,
    study: optuna.Study,
    name: str,
    streamed: bool,
    measured: dict,
) -> list[str]:
    """The preset's header: how it was measured, against what, on which machine, and the
    commands that measure it again."""
    winner = decision.winner
    # What the winner was measured on, as its own run recorded it
    measured_on = json.loads(
        (Path(next(r for r in winner.results if r.ok).job_dir) / "environment.json").read_text()
    )
    base = decision.best_baseline
    afresh = [a for a in base_args(config) if not a.startswith("sweep.study_dir=")]
    fresh = f"{config.sweep.study_dir}/{datetime.now():%Y-%m-%d_%H-%M-%S}"
    ranks = ranks_per_node(config)
    each = "each rank's (per_rank: true)" if winner.loader().get("per_rank") else "the node's"
    lines = [
        f"{_launched(ranks)} loader={name}",
        *([f"Measured with {ranks} ranks on one node; its workers are {each}."] * (ranks > 1)),
        f"Measured {datetime.now().isoformat(timespec='seconds')} by a loader sweep, study"
        f" {study.study_name}.",
        f"Winner: {winner.name}, median {winner.median:,.1f} samples/s"
        f" (spread {winner.spread:,.1f}).",
    ]
    # the decision's own intervals: corrected for every contestant and every look
    confidence = stats.simultaneous(
        len(decision.contestants), stats.looks(config.sweep.final_rounds)
    )
    for c in decision.contestants:
        if c is winner or c.median is None:
            continue
        versus = stats.compare(winner.per_round(), c.per_round(), confidence)
        paired = versus.rounds[0] if versus is not None else 0
        against = (  # the ratio where the rounds both ran can show one; else why it stopped
            described(versus)
            if paired >= stats.MIN_ROUNDS
            else c.dropped or clearly_slower(c, winner) or described(versus)
        )
        lines.append(
            f"  vs {c.label}: {c.median:,.1f} samples/s; {winner.name} / it = {against}"
            f" (95% interval, {paired} paired rounds)"
        )
    lines += [
        f"Decision: {decision.reason}.",
        f"Best baseline: {base.label if base else 'none measured'}.",
        f"Workload: dataset={config.hydra.runtime.choices.get('dataset')}"
        f" model={config.hydra.runtime.choices.get('model')}"
        f" batch_size={config.loader.batch_size}.",
        f"Hardware: {hardware.Fingerprint(**measured_on['fingerprint']).short()}.",
        _memory_line(measured, memory_budget(config)),
        f"Software: {environment.short(measured_on)}.",
        # a final run's own command line, the final window included
        f"Re-measure the winner as the sweep did: {_launched(ranks)} "
        + " ".join([*(["loader.per_rank=true"] * (ranks > 1)), *winner.ok_result().overrides]),
        f"Re-run the sweep afresh (a new study): {command()} -m "
        + " ".join([*afresh, *hydra_args(config), f"sweep.study_dir={fresh}"]),
        "Plain data: the DataLoader's own arguments (and thread counts) on top of"
        " loader/default.yaml; measured_on is where it was measured, which a run elsewhere"
        " and loader=auto read.",
        *(
            [
                "persistent_workers: true, measured streaming (no epoch ends): keeping"
                " workers saves their restart at every epoch."
            ]
            if streamed
            else []
        ),
    ]
    return lines


def _memory_line(measured: dict, budget: Budget | None) -> str:
    peak = measured.get("peak_pss_mb")
    within = f"; the sweep's budget was {budget}" if budget is not None else ""
    if not peak:
        return f"Memory: not measured{within}."
    return (
        f"Memory: needs {peak:,.0f} MB at peak (PSS of the training process and its workers,"
        f" the most any of its runs used){within}."
    )
