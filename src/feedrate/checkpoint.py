"""Training state on disk, written atomically, read back to resume from the next batch in
the same order (docs/design.md, "Checkpoints"). Files are read with
``torch.load(weights_only=True)``: no pickled code runs, whoever wrote them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from feedrate.config import TrainerConfig
from feedrate.errors import ConfigError
from feedrate.files import save_checkpoint

FORMAT = 1
FILENAME = "last.pt"


@dataclass
class Position:
    """Where training stands: after ``step`` steps, ``epoch_samples`` into ``epoch``."""

    step: int = 0
    epoch: int = 0
    epoch_samples: int = 0
    # State of the loader's generator when this epoch's iterator was created.
    epoch_generator: torch.Tensor | None = None
    scaler: dict | None = None
    stream: dict | None = None  # a resumable stream's loader state (this rank's)
    autotune: dict | None = None  # loader=autotune's tuning, while or after it ran


def checkpoint_path(out_dir: Path, trainer: TrainerConfig) -> Path:
    """``<run dir>/<trainer.checkpoint_dir>/last.pt``, refused if it leaves the run dir."""
    out_dir = out_dir.resolve()
    path = (out_dir / trainer.checkpoint_dir / FILENAME).resolve()
    if not path.is_relative_to(out_dir):
        raise ConfigError(
            f"trainer.checkpoint_dir={trainer.checkpoint_dir} resolves to {path.parent}, outside"
            f" the run's output dir {out_dir}: feedrate writes only under the output dir. Use a"
            " relative path, or set hydra.run.dir to put the whole run where you want it"
        )
    return path


def rng_state() -> dict:
    numpy = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "python": random.getstate(),
        # weights_only loading accepts tensors and plain containers, not numpy arrays
        "numpy": [numpy[0], torch.from_numpy(numpy[1].astype(np.int64)), *numpy[2:]],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))


def save(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    position: Position,
    cfg: DictConfig,
    batch_size: int,
    resume: str = "",
) -> Path:
    """Write the whole training state to ``path`` atomically (the old file stays intact).
    ``resume``: the command that continues the run, which a resume that does not fit names."""
    return save_checkpoint(
        path,
        {
            "format": FORMAT,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": position.scaler,
            "step": position.step,
            "epoch": position.epoch,
            "epoch_samples": position.epoch_samples,
            "epoch_generator": position.epoch_generator,
            "autotune": position.autotune,
            "batch_size": batch_size,
            "rng": rng_state(),
            "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
            "resume": resume,
        },
    )


def _made_by(state: dict) -> str:
    """The command that continues the run which saved ``state`` (its model, dataset and
    step where an older checkpoint did not record it)."""
    if state.get("resume"):
        return f": {state['resume']}"
    cfg = state.get("config") or {}
    parts = [
        f"{key}._target_={(cfg.get(key) or {}).get('_target_')}"
        for key in ("model", "dataset")
        if isinstance(cfg.get(key), dict) and (cfg.get(key) or {}).get("_target_")
    ]
    return f" ({', '.join(parts)})" if parts else ""


def rank_path(path: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its stream's position, beside the checkpoint ``path``: a
    file of its own, so that a state the stream made cannot spoil the weights' file."""
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


@dataclass(frozen=True)
class Reader:
    """Who reads a stream: this rank, of how many, with how many workers (a position is
    per worker and per rank's share of the shards)."""

    rank: int
    world_size: int
    num_workers: int


def save_stream(path: Path, reader: Reader, position: Position) -> None:
    """This rank's stream position, with the step it belongs to and who read it."""
    if position.stream is not None:
        state = {
            "format": FORMAT,
            "step": position.step,
            "world_size": reader.world_size,
            "num_workers": reader.num_workers,
            "stream": position.stream,
        }
        save_checkpoint(rank_path(path, reader.rank), state)


def stream_state(saved: dict, path: Path, reader: Reader) -> tuple[dict | None, str]:
    """This rank's stream position at the checkpoint's step, or None and the reason."""
    own = rank_path(path, reader.rank)
    try:
        mine = torch.load(own, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None, f"{own} is missing"
    except Exception as exc:  # noqa: BLE001 - torn, foreign, or a state of non-plain types
        return None, (
            f"{own} cannot be read ({type(exc).__name__}; a stream's state_dict must hold"
            " plain ints, floats, strings, lists, dicts or tensors)"
        )
    if mine.get("step") != saved["step"]:
        return None, f"{own} is at step {mine.get('step')}, the checkpoint at {saved['step']}"
    for key in ("world_size", "num_workers"):
        if mine.get(key) != getattr(reader, key):
            return None, (
                f"{own} was read by {key}={mine.get(key)}, this run has {getattr(reader, key)}:"
                " the stream's shares differ"
            )
    return mine["stream"], ""


def load(path: Path) -> dict:
    """The checkpoint at ``path``, read without running pickled code."""
    if not path.exists():
        # Runs under Hydra's default output root that hold a checkpoint, the latest last
        found = sorted(
            Path("outputs").glob(f"*/*/{path.parent.name}/{FILENAME}"),
            key=lambda p: p.stat().st_mtime,
        )[-3:]
        hint = "; recent ones: " + ", ".join(str(p.parents[1]) for p in found) if found else ""
        raise ConfigError(
            f"trainer.resume=true but there is no checkpoint at {path}: point hydra.run.dir at"
            f" the run to continue (python train.py hydra.run.dir=<that run's dir>"
            f" trainer.resume=true){hint}"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, foreign, or holding pickled code
        raise ConfigError(
            f"cannot resume from {path}: {type(exc).__name__}: {str(exc).splitlines()[0]}."
            " feedrate reads checkpoints with torch.load(weights_only=True), which refuses"
            " pickled code; a file feedrate wrote always loads"
        ) from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(
            f"cannot resume from {path}: it is not a feedrate training checkpoint"
            f" (format {FORMAT}); it may hold only model weights"
        )
    return state


def restore(
    state: dict,
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    total_steps: int | None,
    batch_size: int,
) -> Position:
    """Load ``state`` into ``model`` and ``optimizer``; the position to continue from."""
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(
            f"the checkpoint {path} does not fit this run's model or optimizer ({first}):"
            f" resume with the overrides the run started with{_made_by(state)}"
        ) from exc
    if total_steps is not None and state["step"] >= total_steps:
        raise ConfigError(
            f"the checkpoint {path} is at step {state['step']}, and this run stops at step"
            f" {total_steps}: it is complete. Raise trainer.max_steps (or trainer.epochs) to"
            " train further"
        )
    if state["batch_size"] != batch_size:
        raise ConfigError(
            f"the checkpoint {path} was trained with loader.batch_size={state['batch_size']},"
            f" not {batch_size}: resume with the same batch size (the loader's position is"
            " counted in its batches)"
        )
    set_rng_state(state["rng"])
    return Position(
        step=state["step"],
        epoch=state["epoch"],
        epoch_samples=state["epoch_samples"],
        epoch_generator=state["epoch_generator"],
        scaler=state["scaler"],
        autotune=state.get("autotune"),
    )
