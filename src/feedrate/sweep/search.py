"""The loader sweep's policy between trials, beside the sampler: where the search may go
and when it ends. A pure object the trial launcher asks and tells (it runs the trials):

- the worker bound the seeds set once the rate falls past the best (``sweep.bound_by_seeds``:
  :func:`~feedrate.sweep.space.worker_bound`): trials past it are skipped, not run;
- the worker bound the model sets from the fastest trial's costs (``sweep.bound_by_model``:
  :meth:`Search.past_model`): a trial twice as wide as a pool the model already rates held
  by the step or the cores is skipped, not run;
- the floor below which a trial is ended early (``sweep.abandon_below`` of the best so far);
- the stop near the ceiling (``sweep.stop_within``), once a second run agrees.
"""

from __future__ import annotations

import dataclasses
import logging

from omegaconf import DictConfig, OmegaConf

from feedrate.sweep import ceiling
from feedrate.sweep.ceiling import read_ceiling
from feedrate.sweep.climb import machine, setting_of
from feedrate.sweep.feasibility import Skip
from feedrate.sweep.space import DEPTH, ENGINE, WORKERS, max_workers, seed_workers, worker_bound
from feedrate.tuning.model import HELD_BY, Costs, past_the_workers, rate

log = logging.getLogger(__name__)


class Search:
    def __init__(self, known: ceiling.Ceiling | None = None) -> None:
        """``known``: the ceiling to stop near, measured already (else ``ceilings.json`` is
        read at the first trial)."""
        self.best: float | None = None  # the best objective so far
        # Set when a trial comes within sweep.stop_within of the ceiling: the sweeper then
        # asks for no more trials.
        self.stop_reason: str | None = None
        self._ceiling = known
        self._ceiling_read = known is not None
        self._falls_at: int | None = None
        self._rechecked = False  # the ceiling's loader-only run measured a second time
        # the best figure at each worker count (sweep.bound_by_seeds), and the bound they set
        self.best_at: dict[int, float] = {}
        self.bound: tuple[int, str] | None = None
        # the fastest trial that said what its batches cost: its figure, its costs, its name
        self.costs: tuple[float, Costs, int] | None = None

    def took(self, value: float) -> None:
        """A trial measured ``value``: the best so far."""
        if self.best is None or value > self.best:
            self.best = value

    def learn_bound(self, config: DictConfig, value: float) -> None:
        """Track the best figure per worker count; once the seeds show the rate falling past
        the best trial's workers, bound the search there (``sweep.bound_by_seeds``)."""
        sweep = config.get("sweep")
        if not sweep or not sweep.get("bound_by_seeds") or "num_workers" not in config.loader:
            return
        workers = int(config.loader.num_workers)
        self.best_at[workers] = max(value, self.best_at.get(workers, 0.0))
        self._read_ceiling(config)
        bound = worker_bound(seed_workers(config), self.best_at, self._falls_at)
        if bound is not None and bound[0] >= max_workers(config):
            bound = None  # the top seed: nothing past it is searched anyway
        if bound is not None and (self.bound is None or bound[0] != self.bound[0]):
            log.info("%s (sweep.bound_by_seeds=false searches them all)", bound[1])
        self.bound = bound

    def learn_costs(self, idx: int, value: float, metrics: dict) -> None:
        """Keep the costs (metrics.json ``costs``) of the fastest trial that measured them
        over its whole window: the load a prediction is made for (a trial that stopped
        early was measured at another)."""
        costs = metrics.get("costs")
        if not isinstance(costs, dict) or metrics.get("abandoned"):
            return
        if self.costs is None or value > self.costs[0]:
            self.costs = (value, Costs.from_dict(costs), idx)

    def past_model(self, config: DictConfig) -> Skip | None:
        """A skip for a trial of ``n`` workers where the model, from the fastest trial's
        costs, rates a pool of ``n / 2`` of the same setting held by something other than its
        workers (the step, the cores, the GIL), even a quarter narrower
        (:func:`~feedrate.tuning.model.past_the_workers`): the other half would only wait, and
        pays its start-up in the trial's window (photos on 2 cores: a sampled 48 workers took
        28 s to read 233 samples/s, where the model had the cores hold 3 workers at 611). Only
        the sampler's trials are bounded: the seeds and the climb's settings are asked by name
        (``sweep.bound_by_model=false`` searches them all)."""
        sweep = config.get("sweep")
        if self.costs is None or not sweep or not sweep.get("bound_by_model"):
            return None
        loader = config.loader
        params = {
            WORKERS: loader.get("num_workers"),
            DEPTH: loader.get("prefetch_factor"),
            ENGINE: loader.get("engine"),
            "loader.main_threads": loader.get("main_threads"),
        }
        setting = setting_of(params)
        if setting is None or setting.num_workers < 2:
            return None
        _, costs, idx = self.costs
        half = dataclasses.replace(setting, num_workers=setting.num_workers // 2)
        pipe = machine(config).pipeline()
        if not past_the_workers(costs, half, pipe):
            return None
        predicted, bound = rate(costs, half, pipe)
        return Skip(
            f"{setting.num_workers} workers: from trial {idx}'s costs the model rates"
            f" {half.num_workers} of them held by {HELD_BY[bound]} at {predicted:,.0f}"
            f" samples/s; the rest would only wait (sweep.bound_by_model=false runs it)"
        )

    def _read_ceiling(self, config: DictConfig) -> None:
        """``ceilings.json``, once: the ceiling the search stops near, and the worker count
        where its loader-only runs fell (kept if the ceiling is later set aside)."""
        if not self._ceiling_read:
            sweep_dir = OmegaConf.select(config, "hydra.sweep.dir")
            self._ceiling = read_ceiling(sweep_dir) if sweep_dir else None
            self._ceiling_read = True
            self._falls_at = self._ceiling.loader_falls_at if self._ceiling else None

    def past_bound(self, config: DictConfig):
        """A skip for a trial past the worker bound the seeds set, else None."""
        if self.bound is None or not config.get("sweep"):
            return None
        limit, why = self.bound
        workers = int(config.loader.num_workers)
        return Skip(f"{workers} workers: {why}") if workers > limit else None

    def _raise_ceiling(self, config: DictConfig, again) -> None:
        """Keep the higher of the ceiling's two loader-only figures (``ceilings.json`` too)."""
        if again is None or not again.ok or again.value <= self._ceiling.loader_only:
            return
        self._ceiling = dataclasses.replace(self._ceiling, loader_only=again.value)
        self._ceiling.write(config.hydra.sweep.dir)
        log.info("the ceiling's loader-only run, measured again: %s", self._ceiling.describe())

    def abandon(self, config: DictConfig, objective: str) -> list[str]:
        """The override that ends a clearly worse trial early: below a share of the best. A
        meter compares it with its own rank's samples/s, so under ``sweep.ranks_per_node``
        it is a rank's share of the job's floor."""
        sweep = config.get("sweep") or {}
        share, ranks = sweep.get("abandon_below"), max(1, int(sweep.get("ranks_per_node") or 1))
        if not share or self.best is None or objective != "samples_per_sec":
            return []
        return [f"trainer.abandon_below={share * self.best / ranks:.1f}"]

    def check_ceiling(
        self, config: DictConfig, idx: int, value: float, confirm, recheck=None
    ) -> None:
        """Stop the search once a trial is within ``sweep.stop_within`` of the ceiling that
        the loader sweep measured before searching (``ceilings.json`` in the sweep dir), and
        a second run of it (``confirm()``) is too: one short run can be lucky. The ceiling's
        loader-only run is measured again first (``recheck()``, once a sweep) and the higher
        figure kept: one short run can be unlucky too, and a ceiling too low stops the search early
        (photos on 2 cores: loader-only at 2 workers read 770 and 903 samples/s in two
        sweeps, and the lower one stopped the search at 0.92 of the best it found before)."""
        if not config.get("sweep"):
            return
        self._read_ceiling(config)
        if self._ceiling is None or self.stop_reason:
            return
        reach = value / self._ceiling.value
        within = config.sweep.stop_within
        verdict = ceiling.near(value, self._ceiling.value, within)
        if verdict == ceiling.BEYOND:
            log.info(
                "trial %d reaches %.2f of the ceiling (%s): the ceiling does not hold for this"
                " workload (the workers and the step overlap), so it cannot end the search;"
                " hydra.sweeper.n_trials does",
                idx,
                reach,
                self._ceiling.describe(),
            )
            self._ceiling = None
        elif verdict == ceiling.STOP:
            if recheck is not None and not self._rechecked:
                self._rechecked = True  # twice is enough: later near trials keep the higher
                self._raise_ceiling(config, recheck())
                if ceiling.near(value, self._ceiling.value, within) is None:
                    log.info(
                        "trial %d reached %.2f of the ceiling, but the ceiling measured again"
                        " is higher (%s): the search goes on",
                        *(idx, reach, self._ceiling.describe()),
                    )
                    return
            again = confirm()
            if not again.ok or ceiling.near(again.value, self._ceiling.value, within) is None:
                shown = f"{again.value:,.1f}" if again.ok else again.reason
                log.info(
                    "trial %d reached %.2f of the ceiling, but its second run did not (%s):"
                    " the search goes on",
                    *(idx, reach, shown),
                )
                return
            self.stop_reason = (
                f"trial {idx} reaches {reach:.2f} of what this machine allows, and"
                f" {again.value / self._ceiling.value:.2f} in a second run"
                f" ({self._ceiling.describe()}); stopping the search"
            )
            log.info("%s", self.stop_reason)

    @property
    def measured_ceiling(self):
        """The ceiling the search stops near (``ceilings.json``), once read; None: none."""
        return self._ceiling
