"""A Lightning run over indices with the tuning loader, as a user's script: each rank writes
which samples it trained, per epoch. Run by tests/test_integrations.py, on 1 or 2 processes
(Lightning's DDP starts this script again for each rank).

    python tests/lightning_counting.py OUT --devices 2 --stop-at 37   # saves OUT/stop.ckpt
    python tests/lightning_counting.py OUT --devices 2 --resume       # goes on from it
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import lightning as L
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.tuning_fakes import Indices, tuning_loader  # noqa: E402


class Seen(L.LightningModule):
    def __init__(self, out: Path, samples: int) -> None:
        super().__init__()
        self.out, self.samples = out, samples
        self.layer = nn.Linear(1, 1)
        self.seen: dict[int, list[int]] = defaultdict(list)

    def train_dataloader(self):
        return tuning_loader(Indices(self.samples), multiprocessing_context="fork")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen[self.current_epoch] += batch.tolist()
        return self.layer(batch.float()[:, None]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)

    def on_train_end(self) -> None:
        part = "resumed" if self.trainer.ckpt_path else "first"
        path = self.out / f"{part}_rank{self.global_rank}.json"
        loader = self.trainer.train_dataloader
        path.write_text(json.dumps({"seen": self.seen, "report": loader.report()}))


class StopAt(L.Callback):
    """Saves a checkpoint after ``step`` steps, mid-epoch, and ends the run there."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=240)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    checkpoint = args.out / "stop.ckpt"
    callbacks = [StopAt(args.stop_at, checkpoint)] if args.stop_at else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        # the second process forked from this one, not a fresh interpreter: what is counted
        # is the same (examples/lightning_module.py runs Lightning's default "ddp")
        strategy="ddp_fork" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    module = Seen(args.out, args.samples)
    trainer.fit(module, ckpt_path=checkpoint if args.resume else None)


if __name__ == "__main__":
    main()
