"""``loader=autotune`` in feedrate's own loop: the run's loader is a tuning loader
(:class:`feedrate.tuning.TuningLoader`, docs/design.md "The tuning loader") over the run's
training set, as in any other loop. This module is what the launcher adds to it: the config's
checks and budget, each setting's DataLoader built as the run builds its own (the memory
guard's /dev/shm check, the workers' threads, ``dataset.on_error``), and the preset it reads
and writes as ``conf/loader/<name>.yaml``, which ``loader=auto`` picks next time.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from feedrate import distributed, provenance
from feedrate.errors import ConfigError
from feedrate.hardware import Hardware
from feedrate.loader import skipped_samples
from feedrate.project import command
from feedrate.tuning import TuningLoader
from feedrate.tuning.candidates import Refused
from feedrate.tuning.policy import PROCESS, THREAD, Choice, Figure, Setting
from feedrate.tuning.preset import preset_setting
from feedrate.workload import Workload, candidate_loader

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 60.0
MAX_BUDGET_S = 120.0
BUDGET_SHARE = 0.2  # of trainer.max_seconds, at most: 36 s of a 3-minute run


def budget_seconds(trainer: DictConfig) -> float:
    """``trainer.autotune.budget_s``, or 60 s, at most a fifth of ``trainer.max_seconds``, at
    most 120 s. A budget's windows are a twentieth of it (:func:`~feedrate.tuning.loader.
    window_seconds`): a twelfth of a 3-minute run (15 s, 1 s windows) chose 13 workers on the
    held-out docs store where the preset had 30, after 21 workers' start-up filled their
    window (benchmarks/results/2026-12-07_cpu-2core-epyc-autotune-docs-180s-d)."""
    asked = trainer.autotune.budget_s
    if asked is not None:
        return float(asked)
    budget = DEFAULT_BUDGET_S
    if trainer.max_seconds is not None:
        budget = min(budget, BUDGET_SHARE * trainer.max_seconds)
    return min(budget, MAX_BUDGET_S)


def check(cfg: DictConfig) -> None:
    """Refuse settings under which the run cannot tune, before anything is built."""
    at, problems = cfg.trainer.autotune, []
    if cfg.trainer.stream:
        problems.append(
            "trainer.stream=true repeats the data without epochs: loader=autotune tunes a"
            " training run, set trainer.stream=false"
        )
    if cfg.loader.auto:
        problems.append("loader=auto and loader.autotune=true: choose one")
    if at.budget_s is not None and at.budget_s < 0:
        problems.append(
            f"trainer.autotune.budget_s={at.budget_s} must be at least 0 (0: no tuning), or null"
        )
    if at.max_workers is not None and at.max_workers < 1:
        problems.append(f"trainer.autotune.max_workers={at.max_workers} must be at least 1")
    if at.stall_s is not None and at.stall_s <= 0:
        problems.append(f"trainer.autotune.stall_s={at.stall_s} must be positive, or null")
    if at.max_retunes < 0:
        problems.append(f"trainer.autotune.max_retunes={at.max_retunes} must be at least 0")
    engines = [getattr(e, "value", e) for e in at.engines]
    engine = getattr(cfg.loader.get("engine"), "value", cfg.loader.get("engine")) or PROCESS
    if not engines:
        problems.append("trainer.autotune.engines=[] names no engine: [process, thread], or one")
    elif cfg.loader.num_workers and engine not in engines:
        problems.append(
            f"loader.engine={engine} is where the run starts, and trainer.autotune.engines="
            f"[{', '.join(engines)}] leaves it out: add it, or start on loader.engine={engines[0]}"
        )
    if problems:
        raise ConfigError("invalid loader=autotune:\n  - " + "\n  - ".join(problems))


class Candidates:
    """The DataLoader of each setting the tuning loader tries, built as the run builds its
    own; a setting whose batches in flight would not fit in /dev/shm is refused. A stuck
    setting fails after ``stall_s`` where a failed one can be dropped (one process,
    map-style data). Counts the samples ``dataset.on_error=skip`` dropped in each."""

    def __init__(self, work: Workload, cfg: DictConfig, hw: Hardware, droppable: bool) -> None:
        self.work, self.cfg, self.hw, self.droppable = work, cfg, hw, droppable
        self.skipped_before = 0
        self._latest = None

    def __call__(self, tl: TuningLoader, setting: Setting):
        values: dict[str, Any] = {
            "num_workers": setting.num_workers,
            "prefetch_factor": setting.prefetch_factor,
            "engine": setting.engine,
        }
        if not setting.num_workers:
            values["persistent_workers"] = False
        if setting.threads:  # a process preset's own settings: no process to apply them to
            values |= {"multiprocessing_context": None, "worker_threads": None}
        stall = self.cfg.trainer.autotune.stall_s
        if tl.tuning and self.droppable and stall and setting.num_workers:
            if not self.cfg.loader.timeout:  # a stuck setting fails instead of waiting forever
                values["timeout"] = float(stall)
        loader_cfg = OmegaConf.merge(self.cfg.loader, values)
        if self._latest is not None:
            self.skipped_before += skipped_samples(self._latest)
        try:
            self._latest = candidate_loader(
                self.work,
                loader_cfg,
                self.cfg,
                self.hw,
                tl.worker_seed(),
                tl.batches_plan,
                costs=True,
            )
        except ConfigError as exc:  # its batches in flight would not fit in /dev/shm
            raise Refused(str(exc)) from exc
        return self._latest

    def skipped(self) -> int:
        latest = skipped_samples(self._latest) if self._latest is not None else 0
        return self.skipped_before + latest


class HydraPreset:
    """The preset ``loader=autotune`` reads and writes: ``conf/loader/<name>.yaml`` with
    where it was measured (``measured_on``). ``found`` (provenance.measured_here): the preset
    measured on this machine and workload, which the run starts from and only checks."""

    def __init__(
        self,
        path: Path | None,
        found: tuple[str, dict, dict] | None,
        cfg: DictConfig,
        here: provenance.Here,
        ranks: distributed.Ranks,
        out_dir: Path,
    ) -> None:
        self.path, self.found, self.cfg, self.here = path, found, cfg, here
        self.ranks, self.out_dir = ranks, out_dir

    def start_from(self, start: Setting) -> tuple[Setting, float | None]:
        if self.found is None:
            return start, None
        name, settings, measured_on = self.found
        workers = distributed.workers_per_rank(
            int(settings.get("num_workers") or 0), self.ranks, bool(settings.get("per_rank"))
        )
        setting = preset_setting({**settings, "num_workers": workers}, f"conf/loader/{name}.yaml")
        log.info(
            "loader=autotune starts from loader=%s, measured here (%s): checked, not searched"
            " again, while it reads within 10%% of its %s samples/s",
            name,
            setting.describe(),
            f"{measured_on['samples_per_sec']:,.1f}",
        )
        return setting, measured_on["samples_per_sec"]

    def write(self, choice: Choice, figures: list[Figure]) -> str | None:
        """The choice as a preset; an older preset written here is replaced, one a person
        wrote is kept (checked before the run started)."""
        from feedrate.tuning.preset import (
            AUTOTUNE_MARKER,
            figure_of,
            measured_in_run,
            setting_values,
            write_checked,
        )

        figure = figure_of(choice, figures)
        if self.path is None or figure is None:
            return None
        setting, path, name = choice.setting, self.path, self.path.stem
        values: dict[str, Any] = setting_values(setting)
        values["num_workers"] *= self._ranks_here()
        for key in () if setting.threads else ("persistent_workers", "multiprocessing_context"):
            value = self.cfg.loader.get(key)
            values[key] = getattr(value, "value", value)
        if not setting.num_workers:
            values["persistent_workers"] = False
        study = f"autotune {self.out_dir}"
        measured = measured_in_run(self.here.machine, self.here.workload, figure, study=study)
        header = [
            f"{command()} loader={name}",
            f"Measured {measured['date']} by loader=autotune inside the run {self.out_dir}.",
            f"Choice: {setting.describe()}, {figure.samples_per_sec:,.1f} samples/s.",
            f"Decision: {choice.reason}.",
            "Plain data: the DataLoader's own arguments on top of loader/default.yaml;"
            " measured_on is where it was measured, which loader=auto and loader=autotune read.",
        ]
        try:
            write_checked(
                path,
                values,
                header,
                measured,
                marker=AUTOTUNE_MARKER,
                overwrite=self.cfg.trainer.autotune.overwrite,
            )
        except (ConfigError, OSError) as exc:
            log.warning("loader=autotune could not write %s: %s", path, exc)
            return None
        log.info("wrote %s; the next run's loader=auto starts from it (loader=%s)", path, name)
        return str(path)

    def _ranks_here(self) -> int:
        """Presets say the machine's workers: this rank's times the ranks on the machine."""
        return 1 if self.cfg.loader.per_rank else self.ranks.local_world_size


def tuning_loader(
    work: Workload,
    cfg: DictConfig,
    hw: Hardware,
    ranks: distributed.Ranks,
    preset: HydraPreset,
) -> tuple[TuningLoader, Candidates]:
    """The run's loader under ``loader=autotune``: its start is the run's own loader (this
    rank's workers), or the preset measured here."""
    at, args = cfg.trainer.autotune, work.loader_args
    candidates = Candidates(work, cfg, hw, droppable=not ranks.enabled)
    max_workers = None
    if at.max_workers is not None:  # the machine's
        max_workers = max(1, at.max_workers // ranks.local_world_size)
    loader = TuningLoader(
        work.train_set,
        batch_size=args["batch_size"],
        shuffle=bool(args.get("shuffle")),
        drop_last=bool(args["drop_last"]),
        num_workers=args["num_workers"],
        prefetch_factor=args.get("prefetch_factor"),
        persistent_workers=bool(args["persistent_workers"]),
        budget_s=budget_seconds(cfg.trainer),
        max_workers=max_workers,
        preset=preset,
        seed=cfg.trainer.seed,
        make_loader=candidates,
        engine=args.get("engine") or PROCESS,
        engines=_engines(at),
        split_threads=split_threads(cfg, hw),
        # trainer.autotune.on_drift=retune: tune again where the run's meter says it fell behind
        retune_on_drift=at.max_retunes
        if getattr(at.on_drift, "value", at.on_drift) == "retune"
        else 0,
    )
    return loader, candidates


def split_threads(cfg: DictConfig, hw: Hardware) -> bool:
    """Does the tuning loader turn the training process's threads
    (``trainer.autotune.split_threads``)? By default where the model trains on the CPU the
    workers use, the run's threads not fixed by ``loader.main_threads``."""
    wanted = cfg.trainer.autotune.get("split_threads")
    if wanted is not None:
        return bool(wanted)
    measure = getattr(cfg.trainer.measure, "value", cfg.trainer.measure)
    return hw.device.type == "cpu" and measure == "train" and not cfg.loader.get("main_threads")


def _engines(at: DictConfig) -> list[str] | None:
    """``trainer.autotune.engines``; None for both, the default (threads then left out with
    an info line, not a warning, for data they cannot read)."""
    engines = [getattr(e, "value", e) for e in at.engines]
    return None if set(engines) == {PROCESS, THREAD} else engines


def summary(report: dict) -> str:
    """The log's account of the tuning: what it cost, each setting's figure, the choice."""
    lines = [
        f"loader=autotune: {report['seconds']:.1f} s of tuning (budget {report['budget_s']:.0f}"
        f" s), {report['samples_while_tuning']:,} samples trained meanwhile"
    ]
    lines += [f"  {Figure.from_dict(f).describe()}" for f in report["tried"]]
    chosen = report["chosen"]
    if chosen is not None:
        lines.append(f"  chosen: {Setting(**chosen).describe()}: {report['reason']}")
    if report["preset"]:
        lines.append(f"  written: {report['preset']}")
    return "\n".join(lines)
