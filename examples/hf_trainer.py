"""A Hugging Face Trainer whose train dataloader is feedrate.autotune_loader.

    python examples/hf_trainer.py --seconds 200                  # autotune_loader
    python examples/hf_trainer.py --seconds 200 --loader recipe  # the Trainer's own DataLoader

The data and the model are examples/plain_loop.py's: a forecaster over windows of sensor
readings from a store with network latency; the model returns its own loss, as a Hugging Face
model does. The Trainer runs the loop; only get_train_dataloader() differs, and the recipe
run sets the Trainer's own DataLoader arguments to the usual advice (4 workers, pinned,
prefetch 2, persistent).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
import feedrate  # noqa: E402
from examples.plain_loop import Forecaster  # noqa: E402
from examples.sensor_store import SensorStore  # noqa: E402


class ForecastModel(nn.Module):
    """The forecaster, with the Trainer's calling convention: batch keys in, loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Forecaster()

    def forward(self, readings: torch.Tensor, target: torch.Tensor | None = None) -> dict:
        prediction = self.net(readings)
        out = {"prediction": prediction}
        if target is not None:
            out["loss"] = nn.functional.huber_loss(prediction, target, delta=0.5)
        return out


STATE_FILE = "autotune_loader.json"  # in each checkpoint folder: the tuning, to go on from


class TunedTrainer(Trainer):
    """The Trainer, with its train dataloader tuned while it trains; a checkpoint holds the
    tuning, and a resume goes on from it (what was measured, and the choice)."""

    def __init__(self, *args, budget_s: float = 60.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.budget_s = budget_s
        self.tuned: feedrate.TuningLoader | None = None
        self._checkpoint: str | bool | None = None
        self.add_callback(SaveTuning(self))

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        self._checkpoint = resume_from_checkpoint
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def get_train_dataloader(self):
        a = self.args
        loader = feedrate.autotune_loader(
            self.train_dataset,
            batch_size=a.per_device_train_batch_size,
            shuffle=True,
            collate_fn=self.data_collator,
            num_workers=a.dataloader_num_workers,
            prefetch_factor=a.dataloader_prefetch_factor,
            pin_memory=a.dataloader_pin_memory and torch.cuda.is_available(),
            persistent_workers=a.dataloader_persistent_workers,
            budget_s=self.budget_s,
            seed=a.seed,
        )
        return self.resumed(loader)

    def resumed(self, loader: feedrate.TuningLoader) -> feedrate.TuningLoader:
        """``loader``, with the tuning of the checkpoint the Trainer resumes from."""
        self.tuned = loader
        checkpoint = self._checkpoint
        if checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            checkpoint = get_last_checkpoint(self.args.output_dir)
        saved = Path(checkpoint) / STATE_FILE if checkpoint else None
        if saved is not None and saved.exists():
            loader.load_state_dict(json.loads(saved.read_text()))
        return loader

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """Resuming mid-epoch: the loader starts its pass after the batches trained (the
        Trainer's own way rebuilds a plain DataLoader from it, and would drop the tuning)."""
        dataloader.skip(num_batches)
        return dataloader


class SaveTuning(TrainerCallback):
    """Writes the tuning loader's state beside each checkpoint the Trainer saves."""

    def __init__(self, trainer: TunedTrainer) -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        if self.trainer.tuned is not None:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            (folder / STATE_FILE).write_text(json.dumps(self.trainer.tuned.state_dict()))


class Stop(TrainerCallback):
    """Ends training after ``seconds``, and counts the samples trained."""

    def __init__(self, seconds: float, batch_size: int) -> None:
        self.seconds, self.batch_size = seconds, batch_size
        self.began, self.steps = None, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        if time.perf_counter() - self.began >= self.seconds:
            control.should_training_stop = True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loader", choices=["autotune", "recipe"], default="autotune")
    parser.add_argument("--seconds", type=float, default=200.0)
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--length", type=int, default=50_000)
    parser.add_argument("--median-ms", type=float, default=12.0, help="the store's latency")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    dataset = SensorStore(length=args.length, median_ms=args.median_ms)
    stop = Stop(args.seconds, args.batch_size)
    with tempfile.TemporaryDirectory() as out_dir:
        training = TrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=args.batch_size,
            num_train_epochs=1_000,
            learning_rate=1e-3,
            dataloader_num_workers=4,
            dataloader_prefetch_factor=2,
            dataloader_persistent_workers=True,
            dataloader_pin_memory=torch.cuda.is_available(),
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            logging_strategy="no",
        )
        kind = TunedTrainer if args.loader == "autotune" else Trainer
        extra = {"budget_s": args.budget_s} if kind is TunedTrainer else {}
        trainer = kind(
            model=ForecastModel(), args=training, train_dataset=dataset, callbacks=[stop], **extra
        )
        began = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - began
    samples = stop.steps * args.batch_size
    out = {
        "loader": args.loader,
        "samples": samples,
        "seconds": round(seconds, 2),
        "samples_per_sec": round(samples / seconds, 1),
    }
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
