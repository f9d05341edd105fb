"""Map tiles from a tile server over HTTP: your own Dataset, where a slow network, PNG decoding
and augmentation all count.

Each read is a request to the server: a latency of `median_ms`, lognormal with a wide
`spread`, and now and then congestion (each run of `congestion_every` keys has its first
`congested` keys wait `congestion_factor` times longer). The reply is a PNG tile of
`tile` x `tile` pixels, decoded with Pillow, then cropped at random to `crop` pixels and
flipped (the augmentation a land-cover classifier trains with). The label is the tile's land
cover (10 classes, one colour scheme each). Replies and crops are fixed by the key, so two
runs read the same server.

    python train.py dataset=custom dataset._target_=examples.tile_server.TileServer model=tiny_cnn
"""

import io
import time

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

CLASSES = 10
DISTINCT = 32  # tiles the server holds per class (a reply is one of them, by the key)


def _tile(label: int, variant: int, size: int) -> bytes:
    """What the server sends: a PNG of a land-cover class (a base colour, texture, roads)."""
    rng = np.random.default_rng(label * DISTINCT + variant)
    base = np.array([(label * 53) % 256, (label * 97) % 256, (label * 151) % 256], np.float32)
    texture = rng.normal(0, 24, (size, size, 1)).astype(np.float32)
    pixels = np.clip(base + texture, 0, 255).astype(np.uint8)
    for _ in range(int(rng.integers(0, 4))):  # a road across the tile
        pixels[int(rng.integers(0, size)), :, :] = 200
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class TileServer(Dataset):
    """Land-cover tiles as uint8 images (3 x crop x crop), labelled by class."""

    classes = list(range(CLASSES))

    def __init__(
        self,
        length: int = 30_000,
        median_ms: float = 20.0,
        spread: float = 0.7,
        congestion_every: int = 500,
        congested: int = 40,
        congestion_factor: float = 4.0,
        tile: int = 128,
        crop: int = 32,
    ) -> None:
        self.length, self.median_s, self.spread = length, median_ms / 1000, spread
        self.congestion_every, self.congested = congestion_every, congested
        self.congestion_factor, self.tile, self.crop = congestion_factor, tile, crop
        # what the server holds, made once here (workers share it)
        self._replies = [[_tile(c, v, tile) for v in range(DISTINCT)] for c in range(CLASSES)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        wait = self.median_s * float(np.exp(self.spread * rng.standard_normal()))
        if index % self.congestion_every < self.congested:
            wait *= self.congestion_factor
        time.sleep(wait)
        label = index % CLASSES
        png = self._replies[label][int(rng.integers(0, DISTINCT))]
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))  # decoding: CPU
        top, left = (int(v) for v in rng.integers(0, self.tile - self.crop + 1, 2))
        crop = pixels[top : top + self.crop, left : left + self.crop]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        image = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1).contiguous()
        return image, label
