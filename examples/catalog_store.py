"""Product photos behind an object store, listed by a catalog: your own Dataset class.

    python train.py -m sweep=loader dataset=custom \
        dataset._target_=examples.catalog_store.CatalogStore

The catalog is what such datasets hold in memory: one record per item (its object key, its
category, a few attributes), here a million of them as Python tuples and strings, as a file
list or a parsed manifest is. Each read looks its record up, waits a round trip to the store
(lognormal: median ``latency_ms``, a tail several times longer), and decodes a thumbnail with
numpy (about ``decode_ms`` of CPU). The record, the latency and the pixels of item i are fixed
by i, so two runs read the same store. Nothing in it is shared between reads but the catalog,
which is only read: threads of one process can read it (``loader.engine=thread``).
"""

import time

import numpy as np
import torch
from torch.utils.data import Dataset

CATEGORIES = ("shoes", "bags", "shirts", "watches", "lamps", "chairs", "mugs", "hats")


class CatalogStore(Dataset):
    classes = CATEGORIES

    def __init__(
        self,
        items: int = 1_000_000,
        length: int = 50_000,
        latency_ms: float = 12.0,
        spread: float = 0.5,
        decode_ms: float = 0.3,
        image_size: int = 64,
        seed: int = 0,
    ) -> None:
        rng = np.random.default_rng(seed)
        category = rng.integers(0, len(CATEGORIES), items).tolist()
        sku = rng.integers(10**9, 10**10, items).tolist()
        # the manifest as it is usually parsed: a list of records, one tuple and string each
        self.catalog = [
            (f"s3://catalog/{CATEGORIES[c]}/{s}.jpg", c, {"sku": s, "in_stock": s % 7 != 0})
            for c, s in zip(category, sku, strict=True)
        ]
        # the items trained on: a sample of the catalog, fixed by the seed
        self.items = rng.choice(items, size=min(length, items), replace=False).tolist()
        self.latency_s, self.spread = latency_ms / 1000, spread
        self.decode_s, self.image_size = decode_ms / 1000, image_size

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        _key, category, attributes = self.catalog[self.items[index]]
        rng = np.random.default_rng(attributes["sku"])
        time.sleep(self.latency_s * rng.lognormal(0.0, self.spread))  # the round trip
        end = time.thread_time() + self.decode_s  # decoding: CPU time, not waiting
        size = self.image_size
        image = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        while time.thread_time() < end:
            image = np.ascontiguousarray(image[::-1].transpose(1, 0, 2))
        return torch.from_numpy(image.transpose(2, 0, 1).copy()), category
