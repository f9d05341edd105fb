"""One run: build everything from the composed config, train, measure, write the results.

``train.py`` calls :func:`main`; notebooks and scripts call :func:`compose` and :func:`run`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import NoReturn

import psutil
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from feedrate import (
    autotune,
    checkpoint,
    distributed,
    environment,
    hardware,
    orphans,
    provenance,
    targets,
)
from feedrate import config as _config  # noqa: F401  (registers the schemas and resolvers)
from feedrate.batch import nbytes
from feedrate.checks import validate
from feedrate.config import TrainerConfig, trainer_spec
from feedrate.errors import ConfigError, FeedrateError, Interrupted
from feedrate.faults import LoaderFailure, diagnose
from feedrate.files import atomic_write_text
from feedrate.loader import skipped_samples
from feedrate.metrics import finite, format_summary, summarise
from feedrate.monitor import ResourceMonitor
from feedrate.project import (
    PROJECT_VAR,
    command,
    is_packaged,
    loader_dirs,
    packaged_config_dir,
    preset_config_dir,
    preset_file,
    project_dir,
)
from feedrate.resolvers import default_preset_name, register_resolvers
from feedrate.stream import is_resumable, is_stream, length
from feedrate.trainer import Checkpoints, TrainResult, agreed, planned_steps, train
from feedrate.tuning import TuningLoader
from feedrate.workload import (
    Kept,
    Workload,
    build,
    evaluate_held_out,
)

log = logging.getLogger("feedrate")
# the ${feedrate_...:} resolvers the configs name (conf/sweep/loader.yaml); the schemas are
# registered by importing feedrate.config: whatever composes a run's config imports this module
register_resolvers()


def default_config_dir() -> Path:
    """``$FEEDRATE_CONFIG_DIR``, or ``conf/`` here in a checkout (beside ``train.py``), or
    feedrate's packaged configs (a project's own ``conf/`` then comes first on the search
    path: :mod:`feedrate.project`)."""
    env = os.environ.get("FEEDRATE_CONFIG_DIR")
    if env:
        return Path(env).resolve()
    here = Path.cwd()
    if (here / "conf" / "train.yaml").exists() and (here / "train.py").exists():
        return here / "conf"
    return packaged_config_dir()


def compose(
    overrides: list[str] | None = None,
    config_dir: str | os.PathLike | None = None,
    config_name: str = "train",
) -> DictConfig:
    """The config ``python train.py <overrides>`` would build, for notebooks and scripts.

    >>> cfg = compose(["dataset=synthetic", "loader=notebook", "trainer.max_steps=50"])
    """
    directory = Path(config_dir).resolve() if config_dir else default_config_dir()
    if config_dir is None and is_packaged(directory) and project_dir() is None:
        os.environ[PROJECT_VAR] = os.getcwd()  # a project's conf/ first, here and in children
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(directory)):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def _hydra() -> DictConfig | None:
    return HydraConfig.get() if HydraConfig.initialized() else None


def _project_loader_dir() -> Path | None:
    """Outside a Hydra app (feedrate.run(), the doctor): the project's conf/loader/, when a
    project is named and the configs are the packaged ones."""
    project = project_dir()
    if _hydra() is None and project is not None and is_packaged(default_config_dir()):
        return project / "conf" / "loader"
    return None


def loader_preset_dirs() -> list[Path]:
    """Where this run reads loader presets from, first wins: the project's, then the run's
    conf/ (each once)."""
    return loader_dirs(_hydra(), default_config_dir(), first=_project_loader_dir())


def _preset_config_dir() -> Path:
    """The conf/ this run writes a preset into (loader=autotune): the project's."""
    outside = (_project_loader_dir() or default_config_dir() / "loader").parent
    return preset_config_dir(_hydra(), outside) or outside


def _output_dir(output_dir: str | os.PathLike | None) -> Path:
    if output_dir is not None:
        path = Path(output_dir)
    elif HydraConfig.initialized():
        path = Path(HydraConfig.get().runtime.output_dir)
    else:
        path = Path("outputs") / "api" / datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


@dataclass(frozen=True)
class Run:
    """What every stage of a run shares: its config, ranks, machine and output directory."""

    cfg: DictConfig
    ranks: distributed.Ranks
    fingerprint: hardware.Fingerprint
    hw: hardware.Hardware
    out: Path
    trainer: TrainerConfig  # cfg.trainer as plain typed values: what the loop takes

    @property
    def checkpoint(self) -> Path:
        return checkpoint.checkpoint_path(self.out, self.trainer)


def run(
    cfg: DictConfig, output_dir: str | os.PathLike | None = None, kept: Kept | None = None
) -> dict:
    """Build, train and measure as ``cfg`` says; write metrics.json; return the metrics.

    Under ``torchrun`` every rank runs this; rank 0 writes the outputs (see
    :mod:`feedrate.distributed`). ``kept``: a warm trial host's dataset and model.
    """
    with _opened(cfg, output_dir) as this:
        saved = _checkpoint_to_continue(this)
        work = build(cfg, this.hw, this.ranks, kept)
        epochs = not this.trainer.stream  # a stream read again and again never runs out
        if this.ranks.enabled and is_stream(work.dataset) and epochs and agreed(this.trainer):
            fix = "stream it (trainer.stream=true), or train by steps or epochs alone"
            _check_even_stream(this, work, "measuring by time under torchrun ends", fix)
        tuned = _tuning_loader(this, work, saved) if cfg.loader.autotune else None
        resume = _restore(this, work, saved)
        _write_environment(this)
        result, monitor, skipped = _train_guarded(this, work, resume, tuned)
        held_out = evaluate_held_out(work, cfg, this.hw)
        return _write_metrics(this, work, result, monitor, held_out, skipped)


def _tuning_loader(run: Run, work: Workload, saved: dict | None) -> autotune.Candidates:
    """``loader=autotune``: the run's loader becomes a tuning loader (the workload's from
    now on), which goes on where a checkpoint left it, or starts from the preset measured
    here, or searches; the preset it writes is checked writable before training."""
    cfg, state = run.cfg, (saved or {}).get("autotune")
    if is_stream(work.dataset) and run.ranks.enabled:
        what = "loader=autotune under torchrun switches every rank's loader"
        fix = "tune with one process and run the preset it writes under torchrun"
        _check_even_stream(run, work, what, fix)
    here = provenance.Here.of(cfg, run.fingerprint, run.hw, _overrides())
    at, found, path, problem = cfg.trainer.autotune, None, None, None
    if state is None and at.from_preset:
        found = provenance.measured_here(loader_preset_dirs(), here, run.hw.is_cuda)
        found = run.ranks.share(found)  # rank 0's files decide
    if at.write_preset and run.ranks.is_main:
        from feedrate.tuning.preset import check_writable

        name = at.preset_name or "auto" + default_preset_name()
        try:  # refused before training, on every rank
            path = preset_file(_preset_config_dir(), name, "trainer.autotune")
            check_writable(path, at.overwrite, "trainer.autotune")
        except ConfigError as exc:
            problem = str(exc)
    problem = run.ranks.share(problem)
    if problem:
        raise ConfigError(problem)
    preset = autotune.HydraPreset(path, found, cfg, here, run.ranks, run.out)
    work.loader, candidates = autotune.tuning_loader(work, cfg, run.hw, run.ranks, preset)
    if state is not None:
        work.loader.load_state_dict(state)  # before the stream's position (_restore_stream)
        log.info(
            "loader=autotune goes on from the checkpoint: %s",
            "tuning" if work.loader.tuning else f"the choice, {work.loader.current.describe()}",
        )
    return candidates


def _check_even_stream(run: Run, work: Workload, what: str, fix: str) -> None:
    """Every rank asks rank 0 at the same steps (whether to switch loaders, whether measuring
    is over), so every rank must reach its stream's epoch end at the same step: the same
    number of samples on every rank."""
    sizes = run.ranks.gather(length(work.dataset))
    if None in sizes or len(set(sizes)) > 1:
        raise ConfigError(
            f"{what} at the same step on every rank, and needs every rank to reach its"
            f" stream's epoch end at the same step; the ranks' shares of"
            f" {type(work.dataset).__qualname__} hold {sizes} samples. Give every rank the"
            f" same number of samples, or {fix}"
        )


@contextlib.contextmanager
def _opened(cfg: DictConfig, output_dir: str | os.PathLike | None) -> Iterator[Run]:
    """The ranks joined, the hardware resolved, one output directory, seeds and threads set;
    the ranks leave at the end."""
    ranks = distributed.from_env()
    if ranks.enabled and orphans.asked_of_a_rank():  # a sweep's torchrun trial
        orphans.die_with_parent(os.getppid())  # torchrun starts each rank in its own session
    fingerprint = hardware.detect(cfg.dataset.get("root") or cfg.dataset.get("path"))
    if ranks.is_main:
        log.info("hardware fingerprint: %s", fingerprint.short())
    resolved = hardware.resolve(cfg.hardware, fingerprint)
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    here = provenance.Here.of(cfg, fingerprint, resolved, _overrides())
    # loader=auto becomes the preset it picks before anything reads the loader
    provenance.settle(
        cfg,
        loader_preset_dirs(),
        here,
        resolved.is_cuda,
        choices.get("loader"),
        # None outside a Hydra app: then the keys that differ from auto's own
        asked=provenance.asked_loader_keys(_overrides()) if HydraConfig.initialized() else None,
        say=ranks.is_main,
    )
    validate(cfg)
    targets.check_short_forms(cfg, _overrides())
    if cfg.loader.autotune:
        autotune.check(cfg)
    hw = distributed.setup(ranks, resolved)
    try:
        # Every rank writes (if anything) where rank 0 does: ranks may start a second apart.
        out = Path(ranks.share(str(_output_dir(output_dir))))
        log.info(
            "device %s (hardware=%s): amp %s, channels_last %s, pinned %s",
            *(hw.device, hw.name, hw.amp_dtype, hw.channels_last, hw.pin_memory),
        )
        torch.manual_seed(cfg.trainer.seed)
        # The preset's share of the machine for training (split between the ranks on it, as
        # its workers are), else the hardware profile's threads
        threads = distributed.workers_per_rank(
            cfg.loader.main_threads or 0, ranks, cfg.loader.per_rank
        )
        # Always set: a warm trial host must not keep the threads of the trial before
        torch.set_num_threads(threads or cfg.hardware.torch_threads or hardware.pytorch_threads())
        torch.backends.cudnn.benchmark = hw.cudnn_benchmark
        yield Run(cfg, ranks, fingerprint, hw, out, trainer_spec(cfg.trainer))
    finally:
        distributed.teardown(ranks)


def _checkpoint_to_continue(run: Run) -> dict | None:
    """The checkpoint ``trainer.resume`` continues; a new run never overwrites one."""
    trainer = run.trainer
    saved = checkpoint.load(run.checkpoint) if trainer.resume else None
    if saved is None and trainer.save_checkpoint and run.checkpoint.exists():
        raise ConfigError(
            f"{run.checkpoint} already holds a checkpoint: continue that run with"
            " trainer.resume=true, or give this one its own hydra.run.dir (nothing was"
            " overwritten)"
        )
    run.ranks.barrier()  # every rank has checked before rank 0 writes anything
    return saved


def _restore(run: Run, work: Workload, saved: dict | None) -> checkpoint.Position | None:
    """The weights, optimizer and data position of ``saved``; the finished part's records
    are kept beside the ones this run will write."""
    if saved is None:
        return None
    total = planned_steps(run.trainer, work.loader)
    weights = distributed.unwrap(work.model)
    batch = work.loader.batch_size
    resume = checkpoint.restore(saved, run.checkpoint, weights, work.optimizer, total, batch)
    log.info("resuming from %s at step %d of %d", run.checkpoint, resume.step, total)
    if is_stream(work.dataset):
        _restore_stream(run, work, saved, resume)
    for name in ("metrics", "environment"):
        if run.ranks.is_main and (run.out / f"{name}.json").exists():
            os.replace(run.out / f"{name}.json", run.out / f"{name}_until_step_{resume.step}.json")
    return resume


def _write_environment(run: Run) -> None:
    if run.ranks.is_main:
        env = environment.describe(run.fingerprint.as_dict())
        atomic_write_text(run.out / "environment.json", json.dumps(env, indent=2) + "\n")


def _restore_stream(run: Run, work: Workload, saved: dict, resume: checkpoint.Position) -> None:
    """The stream goes on where it stopped if it can say where that was (docs/design.md,
    "Streams"); otherwise its epoch starts again, and one line says so."""
    state, why = None, f"{type(work.dataset).__qualname__} has no state_dict/load_state_dict"
    if is_resumable(work.dataset) and run.trainer.stream:
        why = "trainer.stream=true repeats the stream, which then has no position"
    elif is_resumable(work.dataset):
        state, why = checkpoint.stream_state(saved, run.checkpoint, _reader(run, work))
    if state is not None and isinstance(work.loader, TuningLoader):
        work.loader.load_stream_state(state)  # read by the setting the tuning state says
    elif state is not None:
        work.loader.load_state_dict(state)
    if state is not None:
        log.info(
            "the stream goes on from its position at step %d (epoch %d)", resume.step, resume.epoch
        )
        return
    log.warning(
        "the stream's position is not restored (%s): epoch %d starts again from its first"
        " sample, and the samples of it trained before the stop are trained on again",
        why,
        resume.epoch,
    )


def _reader(run: Run, work: Workload) -> checkpoint.Reader:
    ranks, loader = run.ranks, work.loader
    workers = loader.num_workers if isinstance(loader, TuningLoader) else None
    workers = work.loader_args["num_workers"] if workers is None else workers
    return checkpoint.Reader(ranks.rank, ranks.world_size, workers)


def _train_guarded(
    run: Run,
    work: Workload,
    resume: checkpoint.Position | None,
    tuned: autotune.Candidates | None = None,
) -> tuple[TrainResult, ResourceMonitor, int]:
    """Train under the memory guard and the Ctrl-C handler; a failure is diagnosed and named.
    The trained state is saved before evaluation can fail."""
    cfg, ranks = run.cfg, run.ranks
    checkpoints = _checkpoints(run, work)
    limit_gb = cfg.hardware.memory_limit_gb
    machine_limit = limit_gb * 2**30 if limit_gb is not None else _default_memory_limit()
    with (
        ResourceMonitor(
            interval_s=run.trainer.memory_sample_s,
            # the machine's memory, shared by the ranks on it
            limit_bytes=machine_limit / ranks.local_world_size,
            explicit_limit=limit_gb is not None,
            start_method=work.loader_args.get("multiprocessing_context"),
            cpu_root=os.getppid() if ranks.enabled else None,
        ) as monitor,
        # Ctrl-C under torchrun reaches every rank at its own step: no clean stop there.
        contextlib.nullcontext() if ranks.enabled else _interrupts_set(checkpoints.interrupt),
    ):
        try:
            result = train(
                model=work.model,
                loader=work.loader,
                optimizer=work.optimizer,
                hw=run.hw,
                cfg=run.trainer,
                monitor=monitor,
                normalise=work.normalise,
                resume=resume,
                checkpoints=checkpoints,
                decode=work.decode,
                preset_wait=provenance.preset_wait(
                    cfg, provenance.Here.of(cfg, run.fingerprint, run.hw)
                ),
                ranks=run.ranks,
                step=work.step,
            )
        except Exception as exc:
            _raise_named(exc, work, monitor)
        except KeyboardInterrupt:  # a second Ctrl-C stops at once, but leaves no worker behind
            work.loader.end_workers()
            raise
        skipped = tuned.skipped() if tuned is not None else skipped_samples(work.loader)
        # persistent ones too, inside the monitored window; at once: the batches they are
        # still reading are not wanted, and a worker mid-read would hold the run up to a
        # batch's time (0.9 s a run of a held-out store, 20 runs a sweep)
        work.loader.end_workers(kill=True)
    if skipped:
        log.warning("%d samples failed to load and were skipped <cfg.dataset.on_error>", skipped)
    if checkpoints.save is not None:
        checkpoints.save(result.position)
    return result, monitor, skipped


def _checkpoints(run: Run, work: Workload) -> Checkpoints:
    trainer = run.trainer
    batch_size = work.loader.batch_size
    resume = f"{command()} {' '.join(_overrides(run.out))} trainer.resume=true"

    def save(position: checkpoint.Position) -> Path:
        # each rank its stream's place (if it can say it); rank 0 the checkpoint
        checkpoint.save_stream(run.checkpoint, _reader(run, work), position)
        if not run.ranks.is_main:
            return run.checkpoint
        weights = distributed.unwrap(work.model)
        return checkpoint.save(
            run.checkpoint, weights, work.optimizer, position, run.cfg, batch_size, resume
        )

    return Checkpoints(
        save=save if trainer.save_checkpoint else None,
        # on every rank: each pauses (and re-warms) while rank 0 saves
        every=trainer.checkpoint_every if trainer.save_checkpoint else None,
        interrupt=threading.Event(),
        resume_hint=resume,
    )


def _raise_named(exc: Exception, work: Workload, monitor: ResourceMonitor) -> NoReturn:
    """Raise ``exc`` as the failure it is (a worker killed, out of memory, /dev/shm full...)
    when the diagnosis can name one."""
    # The workers end first: a dead one's SIGCHLD would raise again inside this handler, and a
    # live one left to the interpreter's exit would be terminated there, under PyTorch's SIGCHLD
    # handler, which then prints a traceback (persistent workers outlive the iteration).
    context = work.context
    context.worker_exit_codes = work.loader.end_workers()
    if isinstance(exc, (Interrupted, LoaderFailure)):  # they name their cause already
        traceback.clear_frames(exc.__traceback__)  # frames hold the workers' iterator
        raise exc
    if monitor.tripped:  # the guard ended the workers: that is the cause
        raise LoaderFailure(monitor.tripped) from exc
    monitor.sample()
    context.peak_pss_mb = monitor.peaks.pss_bytes / 2**20
    named = diagnose(exc, context)
    if named is None:
        raise exc
    raise named from exc


def _write_metrics(
    run: Run,
    work: Workload,
    result: TrainResult,
    monitor: ResourceMonitor,
    held_out: tuple[float | None, float | None],
    skipped: int,
) -> dict:
    """metrics.json: this rank's figures, gathered over the ranks, written by rank 0."""
    hw, sample = run.hw, work.sample
    record = {
        "fingerprint": run.fingerprint.as_dict(),
        "host": socket.gethostname(),
        "device": str(hw.device),
        "amp_dtype": str(hw.amp_dtype),
        "ranks_per_node": run.ranks.local_world_size,
        "channels_last": hw.channels_last,
        "cudnn_benchmark": hw.cudnn_benchmark,
        "non_blocking": hw.non_blocking,
        "loader": work.loader_args,
        "torch_threads": torch.get_num_threads(),
        "dataset_len": length(work.dataset),
        "sample_bytes": nbytes(sample),
        "num_classes": work.num_classes,
        "torch": torch.__version__,
        "date": datetime.now().isoformat(timespec="seconds"),
        "overrides": _overrides(),
    }
    mine = summarise(
        result,
        monitor,
        device=str(hw.device.type).upper(),
        stream=run.trainer.stream,
        held_out=held_out,
        skipped=skipped,
        run=record,
    )
    metrics = finite(distributed.gather(mine, run.ranks))
    if isinstance(work.loader, TuningLoader) and run.ranks.is_main:
        metrics["autotune"] = finite(work.loader.report())
        log.info("%s", autotune.summary(metrics["autotune"]))
    if run.ranks.is_main:
        path = run.out / "metrics.json"
        atomic_write_text(path, json.dumps(metrics, indent=2) + "\n")
        log.info("summary (%s)\n%s", path, format_summary(metrics))
    run.ranks.barrier()
    return metrics


def _default_memory_limit() -> float:
    """90% of what the run may use: memory still available, plus what it already holds."""
    held = psutil.Process().memory_full_info()
    return 0.9 * (hardware.available_memory() + getattr(held, "pss", held.rss))


def _overrides(out: Path | None = None) -> list[str]:
    """The command line's overrides; with ``out``, also the run dir that resuming needs."""
    found = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    if out is not None:
        found = [o for o in found if not o.startswith(("hydra.run.dir=", "trainer.resume="))]
        found.insert(0, f"hydra.run.dir={out}")
    return found


@contextlib.contextmanager
def _interrupts_set(event: threading.Event):
    """While training, the first Ctrl-C sets ``event`` (the loop saves and stops after the
    step it is in); a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread; Ctrl-C then acts as usual
        return

    def handler(signum, frame):
        event.set()
        log.warning("Ctrl-C: stopping after this step (press it again to stop at once)")
        signal.signal(signal.SIGINT, previous)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def main(cfg: DictConfig, kept: Kept | None = None) -> float:
    """Entry point for ``train.py``: run, and return ``cfg.objective`` to a sweeper.

    Errors a user can fix are printed as one message and exit with status 2, no traceback.
    """
    try:
        metrics = run(cfg, kept=kept)
    except FeedrateError as exc:
        log.error("%s", exc)
        code = exc.exit_code
    except KeyboardInterrupt:
        log.error(
            "interrupted (Ctrl-C): stopped at once; checkpoints written before (every"
            " trainer.checkpoint_every steps) are kept, and trainer.resume=true continues from"
            " the last one"
        )
        code = 130
    else:
        return metrics[cfg.objective]
    # Out of the except block, the failure's frames (its loader, workers and batches) are
    # released before the exit: batches shared by file descriptor hold one open each, and
    # Python's exit-time clean-up (multiprocessing's temporary directory) needs one free.
    gc.collect()
    sys.exit(code)
