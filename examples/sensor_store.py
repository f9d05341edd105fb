"""Windows of sensor readings from a time-series store over the network: your own Dataset,
for a loop of your own (examples/plain_loop.py).

Each read is a request with a latency of `median_ms` and a long tail (lognormal, `spread`),
then `parse_ms` of CPU to turn the reply into tensors. A worker waiting on a reply holds no
core, so the store is fed only by many more workers than cores. Latencies are fixed by the
index, so two runs read the same store.
"""

import time

import numpy as np
import torch
from torch.utils.data import Dataset


class SensorStore(Dataset):
    def __init__(
        self,
        length: int = 50_000,
        median_ms: float = 12.0,
        spread: float = 0.6,
        parse_ms: float = 0.2,
        window: int = 128,
        channels: int = 8,
    ) -> None:
        self.length, self.median_s, self.spread = length, median_ms / 1000, spread
        self.parse_s, self.window, self.channels = parse_ms / 1000, window, channels

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng(index)
        time.sleep(self.median_s * float(np.exp(self.spread * rng.standard_normal())))
        end = time.thread_time() + self.parse_s  # parsing the reply: CPU, not waiting
        readings = rng.standard_normal((self.channels, self.window)).astype(np.float32)
        while time.thread_time() < end:
            pass
        # the target: the next reading of the first channel, a trend plus noise
        target = np.float32(readings[0, -8:].mean() + 0.1 * rng.standard_normal())
        return {"readings": torch.from_numpy(readings), "target": torch.tensor(target)}


class SensorEvents(SensorStore):
    """The same store for a classifier, as feedrate's own loop trains ``(image, label)``
    pairs (``python train.py dataset=custom
    dataset._target_=examples.sensor_store.SensorEvents model=tiny_cnn``): three channels of
    256 readings each, laid out as a 3x16x16 image, labelled by whether the next reading is
    above zero."""

    classes = [0, 1]

    def __init__(self, length: int = 50_000, median_ms: float = 12.0, **kwargs) -> None:
        super().__init__(length, median_ms, channels=3, window=256, **kwargs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        sample = super().__getitem__(index)
        return sample["readings"].view(3, 16, 16), int(sample["target"] > 0)
