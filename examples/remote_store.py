"""Samples read from a remote object store: your own Dataset class, tuned by feedrate.

    python train.py -m sweep=loader dataset=custom \
        dataset._target_=examples.remote_store.RemoteStoreDataset

Each read waits a round trip whose latency varies as object stores' do (lognormal: median
`latency_ms`, a tail several times longer), then decodes the object, which costs a little CPU
(`decode_ms`). The latency of sample i is fixed by i, so two runs read the same store.
"""

import time

import numpy as np
import torch
from torch.utils.data import Dataset


class RemoteStoreDataset(Dataset):
    num_classes = 10

    def __init__(
        self,
        length: int = 20000,
        latency_ms: float = 15.0,
        spread: float = 0.6,
        decode_ms: float = 1.0,
        image_size: int = 96,
    ) -> None:
        self.length = length
        self.latency_s, self.spread = latency_ms / 1000, spread
        self.decode_s, self.image_size = decode_ms / 1000, image_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        time.sleep(self.latency_s * rng.lognormal(0.0, self.spread))  # the round trip
        end = time.thread_time() + self.decode_s  # decoding: CPU time, not waiting
        image = rng.integers(0, 256, (3, self.image_size, self.image_size), dtype=np.uint8)
        while time.thread_time() < end:
            image = np.roll(image, 1, axis=-1)
        return torch.from_numpy(image), index % self.num_classes
