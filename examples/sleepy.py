"""A dummy dataset that sleeps 10 ms per sample: your own Dataset class, run by feedrate.

    python train.py dataset=custom dataset._target_=examples.sleepy.SleepyDataset \
        +dataset.sleep_ms=10 loader=network_io

Any class works the same way: `dataset._target_` is its import path, every other key under
`dataset` is a constructor argument. It must return (image, label) and say how many classes
there are (`classes` or `num_classes`).
"""

import time

import torch
from torch.utils.data import Dataset


class SleepyDataset(Dataset):
    def __init__(self, length: int = 5000, sleep_ms: float = 10.0, image_size: int = 224) -> None:
        self.length = length
        self.sleep_s = sleep_ms / 1000
        self.image = torch.zeros(3, image_size, image_size, dtype=torch.uint8)
        self.num_classes = 2

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.sleep_s)  # stands for a read from slow storage
        return self.image, index % self.num_classes
