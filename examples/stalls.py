"""Samples from a shared network filesystem that stalls now and then: your own Dataset class,
tuned while it trains.

    python train.py loader=autotune dataset=custom dataset._target_=examples.stalls.StallingDataset

Most reads take `read_ms`; one in `stall_every` waits `stall_ms` more (a metadata server
under load, a cold cache line on NFS). Each sample then costs `decode_ms` of CPU. A worker
stuck in a stall holds no core, so the stalls are hidden only by many more workers than cores.
Which samples stall is fixed by their index, so two runs read the same filesystem.
"""

import time

import numpy as np
import torch
from torch.utils.data import Dataset


class StallingDataset(Dataset):
    num_classes = 10

    def __init__(
        self,
        length: int = 20000,
        read_ms: float = 4.0,
        stall_ms: float = 150.0,
        stall_every: int = 40,
        decode_ms: float = 0.5,
        image_size: int = 64,
    ) -> None:
        self.length, self.read_s = length, read_ms / 1000
        self.stall_s, self.stall_every = stall_ms / 1000, stall_every
        self.decode_s, self.image_size = decode_ms / 1000, image_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        stalled = rng.integers(self.stall_every) == 0
        time.sleep(self.read_s + (self.stall_s if stalled else 0.0))
        end = time.thread_time() + self.decode_s  # decoding: CPU time, not waiting
        image = rng.integers(0, 256, (3, self.image_size, self.image_size), dtype=np.uint8)
        while time.thread_time() < end:
            pass
        return torch.from_numpy(image), int(index % self.num_classes)
