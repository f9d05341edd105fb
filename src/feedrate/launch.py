"""One run: build everything from the composed config, train, measure, write the results.

``train.py`` calls :func:`main`; notebooks and scripts call :func:`compose` and :func:`run`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import traceback
from datetime import datetime
from pathlib import Path

import numpy as np
import psutil
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from feedrate import checkpoint, distributed, environment, hardware
from feedrate.checks import validate
from feedrate.dataset import GuardedDataset, build_dataset, num_classes, split
from feedrate.errors import ConfigError, FeedrateError, Interrupted
from feedrate.faults import (
    Context,
    LoaderFailure,
    check_shm,
    diagnose,
    unbatchable_sample,
)
from feedrate.files import atomic_write_text
from feedrate.loader import build_loader, loader_kwargs, skipped_samples
from feedrate.metrics import ResourceMonitor, format_summary, summarise
from feedrate.model import build_model
from feedrate.trainer import (
    Checkpoints,
    build_optimizer,
    evaluate,
    make_input_transform,
    planned_steps,
    train,
)

log = logging.getLogger("feedrate")


def default_config_dir() -> Path:
    """``conf/`` beside ``train.py``: the project checkout, or ``$FEEDRATE_CONFIG_DIR``."""
    env = os.environ.get("FEEDRATE_CONFIG_DIR")
    if env:
        return Path(env).resolve()
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (base / "conf" / "train.yaml").exists():
            return base / "conf"
    raise FileNotFoundError(
        "no conf/train.yaml in the current directory or the feedrate checkout;"
        " run from the project root or set FEEDRATE_CONFIG_DIR"
    )


def compose(
    overrides: list[str] | None = None,
    config_dir: str | os.PathLike | None = None,
    config_name: str = "train",
) -> DictConfig:
    """The config ``python train.py <overrides>`` would build, for notebooks and scripts.

    >>> cfg = compose(["dataset=synthetic", "loader=notebook", "trainer.max_steps=50"])
    """
    directory = Path(config_dir).resolve() if config_dir else default_config_dir()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def _output_dir(output_dir: str | os.PathLike | None) -> Path:
    if output_dir is not None:
        path = Path(output_dir)
    elif HydraConfig.initialized():
        path = Path(HydraConfig.get().runtime.output_dir)
    else:
        path = Path("outputs") / "api" / datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f")
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def run(cfg: DictConfig, output_dir: str | os.PathLike | None = None) -> dict:
    """Build, train and measure as ``cfg`` says; write metrics.json; return the metrics.

    Under ``torchrun`` every rank runs this; rank 0 writes the outputs (see
    :mod:`feedrate.distributed`).
    """
    validate(cfg)
    ranks = distributed.from_env()
    data_path = cfg.dataset.get("root") or cfg.dataset.get("path")
    fingerprint = hardware.detect(data_path)
    if ranks.is_main:
        log.info("hardware fingerprint: %s", fingerprint.short())
    hw = hardware.resolve(cfg.hardware, fingerprint)
    hw = distributed.setup(ranks, hw, cfg.trainer)
    try:
        return _run(cfg, output_dir, ranks, fingerprint, hw)
    finally:
        distributed.teardown(ranks)


def _run(
    cfg: DictConfig,
    output_dir: str | os.PathLike | None,
    ranks: distributed.Ranks,
    fingerprint: hardware.Fingerprint,
    hw: hardware.Hardware,
) -> dict:
    # Every rank writes (if anything) where rank 0 does: ranks may start a second apart.
    out = Path(distributed.broadcast(str(_output_dir(output_dir)), ranks))
    ckpt_path = checkpoint.checkpoint_path(out, cfg.trainer)
    saved = checkpoint.load(ckpt_path) if cfg.trainer.resume else None
    if saved is None and cfg.trainer.save_checkpoint and ckpt_path.exists():
        raise ConfigError(
            f"{ckpt_path} already holds a checkpoint: continue that run with"
            " trainer.resume=true, or give this one its own hydra.run.dir (nothing was"
            " overwritten)"
        )
    distributed.barrier(ranks)  # every rank has checked before rank 0 writes anything
    log.info(
        "device %s (hardware=%s): amp %s, channels_last %s, pinned %s",
        hw.device,
        hw.name,
        hw.amp_dtype,
        hw.channels_last,
        hw.pin_memory,
    )
    torch.manual_seed(cfg.trainer.seed)
    # The preset's share of the machine for training (split between the ranks on it, as its
    # workers are), else the hardware profile's threads
    threads = distributed.workers_per_rank(cfg.loader.main_threads or 0, ranks)
    threads = threads or cfg.hardware.torch_threads
    if threads:
        torch.set_num_threads(threads)
    torch.backends.cudnn.benchmark = hw.cudnn_benchmark

    dataset = build_dataset(cfg.dataset)
    n_classes = num_classes(dataset)
    train_set, val_set = split(dataset, cfg.trainer.val_fraction, cfg.trainer.seed)
    on_error = cfg.dataset.get("on_error", "raise")
    train_set = GuardedDataset(train_set, on_error)
    sample, _ = GuardedDataset(dataset, "raise")[0]
    if isinstance(sample, np.ndarray):  # the default collate batches it as a tensor
        sample = torch.as_tensor(sample)
    if not isinstance(sample, torch.Tensor):  # the model and the loader's sizing need one
        raise unbatchable_sample(repr(type(sample)))
    model = build_model(cfg.model, n_classes).to(hw.device)
    if hw.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = distributed.wrap(model, ranks, hw)
    optimizer = build_optimizer(cfg.trainer, model)
    loader_args = loader_kwargs(cfg.loader, hw)
    per_rank = distributed.workers_per_rank(cfg.loader.num_workers, ranks)
    if per_rank != cfg.loader.num_workers:
        log.info(
            "loader.num_workers=%d is the machine's: %d per rank for %d ranks on it",
            cfg.loader.num_workers,
            per_rank,
            ranks.local_world_size,
        )
        loader_args["num_workers"] = per_rank
    log.info(
        "dataset %s: %d samples, %d classes, sample %s %s; loader %s",
        type(dataset).__name__,
        len(dataset),
        n_classes,
        tuple(sample.shape),
        sample.dtype,
        loader_args,
    )
    context = Context(
        num_workers=loader_args["num_workers"],
        prefetch_factor=cfg.loader.prefetch_factor,
        batch_bytes=cfg.loader.batch_size * sample.element_size() * sample.nelement(),
        peak_pss_mb=0.0,
        timeout_s=cfg.loader.timeout,
    )
    check_shm(context)
    loader = build_loader(train_set, loader_args, cfg.trainer.seed, cfg.trainer.stream, ranks)
    resume = None
    if saved is not None:
        total = planned_steps(cfg.trainer, loader)
        resume = checkpoint.restore(
            saved, ckpt_path, distributed.unwrap(model), optimizer, total, loader.batch_size
        )
        log.info("resuming from %s at step %d of %d", ckpt_path, resume.step, total)
        for name in ("metrics", "environment"):
            if ranks.is_main and (out / f"{name}.json").exists():
                # The finished part's records stay beside the ones this run will write.
                os.replace(out / f"{name}.json", out / f"{name}_until_step_{resume.step}.json")

    if ranks.is_main:
        env = environment.describe(fingerprint.as_dict())
        atomic_write_text(out / "environment.json", json.dumps(env, indent=2) + "\n")
    batch_size = loader.batch_size

    def save(position: checkpoint.Position) -> Path:
        weights = distributed.unwrap(model)
        return checkpoint.save(ckpt_path, weights, optimizer, position, cfg, batch_size)

    checkpoints = Checkpoints(
        save=save if cfg.trainer.save_checkpoint and ranks.is_main else None,
        # on every rank: each pauses (and re-warms) while rank 0 saves
        every=cfg.trainer.checkpoint_every if cfg.trainer.save_checkpoint else None,
        interrupt=threading.Event(),
        resume_hint=f"python train.py {' '.join(_overrides(out))} trainer.resume=true",
    )
    limit_gb = cfg.hardware.memory_limit_gb
    machine_limit = limit_gb * 2**30 if limit_gb is not None else _default_memory_limit()
    with (
        ResourceMonitor(
            interval_s=cfg.trainer.memory_sample_s,
            # the machine's memory, shared by the ranks on it
            limit_bytes=machine_limit / ranks.local_world_size,
            explicit_limit=limit_gb is not None,
            start_method=loader_args.get("multiprocessing_context"),
            cpu_root=os.getppid() if ranks.enabled else None,
        ) as monitor,
        # Ctrl-C under torchrun reaches every rank at its own step: no clean stop there.
        contextlib.nullcontext() if ranks.enabled else _interrupts_set(checkpoints.interrupt),
    ):
        normalise = make_input_transform(hw, sample.shape[0])
        try:
            result = train(
                model=model,
                loader=loader,
                optimizer=optimizer,
                hw=hw,
                cfg=cfg.trainer,
                monitor=monitor,
                normalise=normalise,
                resume=resume,
                checkpoints=checkpoints,
            )
        except (Interrupted, LoaderFailure) as exc:  # they name their cause already
            traceback.clear_frames(exc.__traceback__)  # frames hold the workers' iterator
            raise
        except Exception as exc:
            # The workers end first: a dead one's SIGCHLD would raise again inside this handler
            context.worker_exit_codes = loader.end_workers()
            if monitor.tripped:  # the guard ended the workers: that is the cause
                raise LoaderFailure(monitor.tripped) from exc
            monitor.sample()
            context.peak_pss_mb = monitor.peaks.pss_bytes / 2**20
            named = diagnose(exc, context)
            if named is None:
                raise
            raise named from exc
        skipped = skipped_samples(loader)
        del loader  # ends persistent workers inside the monitored window
    if cfg.trainer.save_checkpoint and ranks.is_main:
        save(result.position)  # the trained state first, before evaluation can fail
    val_loss = val_accuracy = None
    if val_set is not None:
        eval_args = {
            **loader_args,
            "shuffle": False,
            "drop_last": False,
            "persistent_workers": False,
        }
        val_loader = build_loader(GuardedDataset(val_set, on_error), eval_args, cfg.trainer.seed)
        val_loss, val_accuracy = evaluate(model, val_loader, hw, normalise)
        del val_loader
    metrics = summarise(
        result.times,
        result.first_batch_s,
        result.epoch_restart_s,
        monitor,
        str(hw.device.type).upper(),
        result.final_loss,
        result.train_accuracy,
        stream=cfg.trainer.stream,
    )
    metrics["val_loss"], metrics["val_accuracy"] = val_loss, val_accuracy
    metrics["skipped_samples"] = skipped
    if skipped:
        log.warning("%d samples failed to load and were skipped <cfg.dataset.on_error>", skipped)
    metrics["steps"] = result.steps
    metrics["warmup"] = result.warmup
    metrics["abandoned"] = result.abandoned or None
    metrics["epochs_started"] = result.epochs_started
    metrics["run"] = {
        "fingerprint": fingerprint.as_dict(),
        "host": socket.gethostname(),
        "device": str(hw.device),
        "amp_dtype": str(hw.amp_dtype),
        "channels_last": hw.channels_last,
        "cudnn_benchmark": hw.cudnn_benchmark,
        "non_blocking": hw.non_blocking,
        "loader": loader_args,
        "torch_threads": torch.get_num_threads(),
        "dataset_len": len(dataset),
        "sample_bytes": sample.element_size() * sample.nelement(),
        "num_classes": n_classes,
        "torch": torch.__version__,
        "date": datetime.now().isoformat(timespec="seconds"),
        "overrides": _overrides(),
    }
    metrics = _finite(distributed.gather(metrics, ranks))
    if ranks.is_main:
        atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
        log.info("summary (%s)\n%s", out / "metrics.json", format_summary(metrics))
    distributed.barrier(ranks)
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


def _finite(obj):
    """JSON has no NaN: write null for a metric that could not be measured."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def main(cfg: DictConfig) -> float:
    """Entry point for ``train.py``: run, and return ``cfg.objective`` to a sweeper.

    Errors a user can fix are printed as one message and exit with status 2, no traceback.
    """
    try:
        metrics = run(cfg)
    except FeedrateError as exc:
        log.error("%s", exc)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        log.error(
            "interrupted (Ctrl-C): stopped at once; checkpoints written before (every"
            " trainer.checkpoint_every steps) are kept, and trainer.resume=true continues from"
            " the last one"
        )
        sys.exit(130)
    return metrics[cfg.objective]
