"""A plain PyTorch loop whose DataLoader tunes itself while it trains.

    python examples/plain_loop.py --seconds 200                  # feedrate.autotune_loader
    python examples/plain_loop.py --seconds 200 --loader recipe  # the same loop, a fixed recipe

The data is a network store of sensor readings (examples/sensor_store.py); the model predicts
the next reading from a window of them, with a loss of its own. The only line that differs
between the two runs is the one that builds the loader. It prints one JSON line: the samples
trained, the seconds, and (autotune) what the loader tried and chose.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
import feedrate  # noqa: E402
from examples.sensor_store import SensorStore  # noqa: E402


class Forecaster(nn.Module):
    """A small 1-D convolution over the window, then the next reading."""

    def __init__(self, channels: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(channels, hidden, 5, padding=2),
            nn.GELU(),
            nn.Conv1d(hidden, hidden, 5, stride=2, padding=2),
            nn.GELU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
            nn.Linear(hidden, 1),
        )

    def forward(self, readings: torch.Tensor) -> torch.Tensor:
        return self.body(readings).squeeze(1)


def build_loader(args: argparse.Namespace, dataset: SensorStore):
    common = dict(batch_size=args.batch_size, shuffle=True, pin_memory=torch.cuda.is_available())
    if args.loader == "recipe":  # 4 workers, pinned, prefetch 2, persistent: the usual advice
        return DataLoader(
            dataset, num_workers=4, prefetch_factor=2, persistent_workers=True, **common
        )
    return feedrate.autotune_loader(
        dataset, num_workers=4, persistent_workers=True, budget_s=args.budget_s,
        preset=args.preset, **common,
    )  # fmt: skip


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dataset = SensorStore(length=args.length, median_ms=args.median_ms)
    loader = build_loader(args, dataset)
    model = Forecaster().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    began, samples, epochs, loss = time.perf_counter(), 0, 0, None
    while time.perf_counter() - began < args.seconds and epochs < args.epochs:
        for batch in loader:
            x = batch["readings"].to(device, non_blocking=True)
            y = batch["target"].to(device, non_blocking=True)
            loss = nn.functional.huber_loss(model(x), y, delta=0.5)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            samples += len(y)
            if time.perf_counter() - began >= args.seconds:
                break
        epochs += 1
    seconds = time.perf_counter() - began
    out = {
        "loader": args.loader,
        "samples": samples,
        "seconds": round(seconds, 2),
        "samples_per_sec": round(samples / seconds, 1),
        "loss": None if loss is None else round(loss.item(), 4),
    }
    if isinstance(loader, feedrate.TuningLoader):
        out["autotune"] = loader.report()
        loader.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loader", choices=["autotune", "recipe"], default="autotune")
    parser.add_argument("--seconds", type=float, default=200.0)
    parser.add_argument("--epochs", type=int, default=1_000)
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--length", type=int, default=50_000)
    parser.add_argument("--median-ms", type=float, default=12.0, help="the store's latency")
    parser.add_argument("--preset", default=None, help="a .yaml the choice is written to")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = train(args)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
