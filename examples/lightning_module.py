"""A LightningModule whose train_dataloader() is feedrate.autotune_loader.

    python examples/lightning_module.py --seconds 200                  # 1 process
    python examples/lightning_module.py --seconds 200 --devices 2      # 2 processes (DDP)
    python examples/lightning_module.py --seconds 200 --loader recipe  # a fixed recipe

The data and the model are examples/plain_loop.py's: a forecaster over windows of sensor
readings from a store with network latency, trained with a Huber loss. Lightning runs the
loop; the loader tunes itself inside it. Under DDP each process builds its own loader, which
shards the data itself (Lightning puts a DistributedSampler only into a DataLoader), and rank 0
decides for all of them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
import feedrate  # noqa: E402
from examples.plain_loop import Forecaster  # noqa: E402
from examples.sensor_store import SensorStore  # noqa: E402


class Forecast(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args, self.model = args, Forecaster()
        self.samples = 0

    def train_dataloader(self):
        args = self.args
        dataset = SensorStore(length=args.length, median_ms=args.median_ms)
        common = dict(batch_size=args.batch_size, shuffle=True, pin_memory=args.pin_memory)
        if args.loader == "recipe":
            return DataLoader(
                dataset, num_workers=4, prefetch_factor=2, persistent_workers=True, **common
            )
        return feedrate.autotune_loader(
            dataset, num_workers=4, persistent_workers=True, budget_s=args.budget_s, **common
        )

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.huber_loss(self.model(batch["readings"]), batch["target"], delta=0.5)
        self.samples += len(batch["target"])
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loader", choices=["autotune", "recipe"], default="autotune")
    parser.add_argument("--seconds", type=float, default=200.0)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--length", type=int, default=50_000)
    parser.add_argument("--median-ms", type=float, default=12.0, help="the store's latency")
    args = parser.parse_args(argv)
    args.pin_memory = torch.cuda.is_available()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    module = Forecast(args)
    trainer = L.Trainer(
        accelerator="auto",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_time={"seconds": args.seconds},
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    began = time.perf_counter()
    trainer.fit(module)
    seconds = time.perf_counter() - began
    samples = module.samples * trainer.world_size  # every rank trains its share alike
    out = {
        "loader": args.loader,
        "samples": samples,
        "seconds": round(seconds, 2),
        "samples_per_sec": round(samples / seconds, 1),
    }
    loader = trainer.train_dataloader
    if isinstance(loader, feedrate.TuningLoader):
        out["autotune"] = loader.report()
    if trainer.is_global_zero:
        print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
