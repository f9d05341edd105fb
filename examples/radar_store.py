"""Weather-radar frames from a chunked array store behind a cache: your own Dataset, held out
from every tuner (written to check them, never tuned on).

    python train.py dataset=custom dataset._target_=examples.radar_store.RadarFrames \
        model=tiny_cnn loader=autotune

A read asks a cache first: ``hit_rate`` of the reads come back in ``hit_ms``; the others go
to the store behind it (lognormal, median ``miss_ms``). Either way a zlib-compressed chunk
comes back (one frame, 3 x 160 x 160 float32), which the reader decompresses, scales to 32 x 32
(a mean over 5 x 5 blocks), and turns from reflectivity into rain rate (a power law, then a
log): a few milliseconds of CPU, mostly in zlib and NumPy. The store holds ``distinct``
chunks, made once when the dataset is built; each sample adds its own noise from its index, so
two runs read the same store. The label is the frame's rain class (10 bins of its mean rate).
"""

import time
import zlib

import numpy as np
import torch
from torch.utils.data import Dataset

SIDE, OUT = 160, 32


def _chunks(distinct: int, seed: int = 7) -> list[bytes]:
    """The store's chunks: smooth fields of reflectivity (dBZ), compressed as a store keeps them."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:SIDE, 0:SIDE] / SIDE
    chunks = []
    for _ in range(distinct):
        cx, cy, width = rng.uniform(0.2, 0.8, 2).tolist() + [rng.uniform(0.1, 0.4)]
        cell = 55 * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * width**2))
        frame = np.stack([cell * rng.uniform(0.6, 1.0) for _ in range(3)]).astype(np.float32)
        chunks.append(zlib.compress(np.round(frame, 1).tobytes(), level=6))
    return chunks


class RadarFrames(Dataset):
    classes = list(range(10))  # rain classes

    def __init__(
        self,
        length: int = 60_000,
        hit_rate: float = 0.7,
        hit_ms: float = 1.0,
        miss_ms: float = 22.0,
        spread: float = 0.6,
        distinct: int = 48,
    ) -> None:
        if not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"hit_rate={hit_rate}: a fraction of the reads, from 0 to 1")
        self.length, self.hit_rate = length, hit_rate
        self.hit_s, self.miss_s, self.spread = hit_ms / 1000, miss_ms / 1000, spread
        self.chunks = _chunks(distinct)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        if rng.random() < self.hit_rate:
            time.sleep(self.hit_s)
        else:
            time.sleep(self.miss_s * float(np.exp(self.spread * rng.standard_normal())))
        raw = zlib.decompress(self.chunks[index % len(self.chunks)])
        dbz = np.frombuffer(raw, dtype=np.float32).reshape(3, SIDE, SIDE)
        dbz = dbz + rng.normal(0.0, 2.0, dbz.shape).astype(np.float32)
        block = SIDE // OUT
        dbz = dbz.reshape(3, OUT, block, OUT, block).mean(axis=(2, 4))
        rain = (10 ** (np.clip(dbz, 0, None) / 10) / 200) ** (1 / 1.6)  # Marshall-Palmer, mm/h
        image = np.log1p(rain).astype(np.float32)
        label = min(9, int(float(rain.mean()) * 2))
        return torch.from_numpy((image - image.mean()) / (image.std() + 1e-6)), label
