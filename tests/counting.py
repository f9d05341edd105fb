"""A dataset and a stream whose samples say their index, and a model that records which
samples it trained on: what the exactly-once tests of loader=autotune count.

A sample is a 1x2x2 float image filled with its index (normalised to 4 * index - 2, exactly,
for one channel). The model writes the indices of each training batch to
``$FEEDRATE_RECORD_DIR/rank<RANK>.txt``, one line per batch.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def _sample(index: int, latency_s: float) -> tuple[torch.Tensor, int]:
    if latency_s:
        time.sleep(latency_s)
    return torch.full((1, 2, 2), float(index)), index % 2


class Indexed(Dataset):
    """``die_with``: a worker of a loader with that many workers or more exits at once (a
    setting that cannot run here, as one that runs out of memory). ``hang_with``: such a
    worker never returns its sample (a worker stuck: a deadlock, a read that hangs)."""

    classes = [0, 1]

    def __init__(
        self, n: int = 512, latency_ms: float = 0.0, die_with: int = 0, hang_with: int = 0
    ) -> None:
        self.n, self.latency_s = n, latency_ms / 1e3
        self.die_with, self.hang_with = die_with, hang_with

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        info = get_worker_info()
        if self.die_with and info is not None and info.num_workers >= self.die_with:
            os._exit(1)
        if self.hang_with and info is not None and info.num_workers >= self.hang_with:
            parent = os.getppid()
            while os.getppid() == parent:  # stuck for as long as the run lives: a test
                time.sleep(0.2)  # that fails leaves none behind, holding its output open
            os._exit(1)
        return _sample(index, self.latency_s)


class IndexedStream(IterableDataset):
    """``range(n)``, each rank and worker reading every (ranks x workers)-th index, in order;
    resumable (its state: the epoch and the indices this worker has read of it)."""

    classes = [0, 1]
    splits_by_worker = True

    def __init__(self, n: int = 512, latency_ms: float = 0.0) -> None:
        self.n, self.latency_s = n, latency_ms / 1e3
        self.epoch, self._read, self._skip = 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._read, self._skip = epoch, 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "read": self._read}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._skip = state["epoch"], state["read"]

    def _share(self) -> tuple[int, int]:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return rank * workers + worker, world * workers

    def __len__(self) -> int:
        world = int(os.environ.get("WORLD_SIZE", 1))
        return len(range(int(os.environ.get("RANK", 0)), self.n, world))

    def __iter__(self):
        first, step = self._share()
        skip, self._read, self._skip = self._skip, 0, 0
        for index in range(first, self.n, step):
            self._read += 1
            if self._read > skip:
                yield _sample(index, self.latency_s)


class PositionlessStream(IndexedStream):
    """The same stream, without a state to go on from."""

    state_dict = load_state_dict = None


class LockedStream(IndexedStream):
    """The same stream, holding a lock: fine for forked workers, and it cannot be copied."""

    def __init__(self, n: int = 512, latency_ms: float = 0.0) -> None:
        super().__init__(n, latency_ms)
        self.lock = threading.Lock()


class UnsplitStream(IndexedStream):
    """The same stream, read whole by every worker: it does not split its work."""

    splits_by_worker = False

    def _share(self) -> tuple[int, int]:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        return rank, world


class Recorder(nn.Module):
    """A linear model that records the index of every sample it trains on."""

    def __init__(self, num_classes: int, **_: object) -> None:
        super().__init__()
        self.head = nn.Linear(4, num_classes)
        directory = Path(os.environ["FEEDRATE_RECORD_DIR"])
        self.path = directory / f"rank{os.environ.get('RANK', '0')}.txt"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            ids = ((x[:, 0, 0, 0] + 2) / 4).round().long().tolist()
            with self.path.open("a") as f:
                f.write(" ".join(map(str, ids)) + "\n")
        return self.head(x.flatten(1))


def recorded(directory: Path, rank: int = 0) -> list[int]:
    path = directory / f"rank{rank}.txt"
    return [int(i) for line in path.read_text().splitlines() for i in line.split()]
