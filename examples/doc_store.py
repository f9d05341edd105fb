"""Documents from a key-value store over the network: your own Dataset, where waiting and
parsing both count.

Each read is a request to the store: a latency of `median_ms` with a heavy tail (one read in
`tail_every` waits `tail_ms`), then the reply, a JSON document of `words` words, is parsed and
tokenized in Python (`json.loads`, a regular expression, hashing each token into a bucket):
about a millisecond of CPU under the GIL, which only worker processes spread over the cores.
Too few workers leave the loop waiting on the store; too many fight over the cores for the
parsing. Replies are fixed by the key, so two runs read the same store.

    python train.py dataset=custom dataset._target_=examples.doc_store.DocumentStore model=tiny_cnn
"""

import json
import re
import time
import zlib

import numpy as np
import torch
from torch.utils.data import Dataset

TOKEN = re.compile(r"[a-z]+")
VOCABULARY = [f"w{a}{b}" for a in "abcdefghijklmnop" for b in "abcdefghijklmnop"]


class DocumentStore(Dataset):
    """A document classifier's data: the token histogram of each document as a 3x16x16 image
    (768 hash buckets), labelled by the document's topic (4 topics)."""

    classes = [0, 1, 2, 3]

    def __init__(
        self,
        length: int = 40_000,
        median_ms: float = 8.0,
        tail_every: int = 50,
        tail_ms: float = 80.0,
        words: int = 1600,
    ) -> None:
        self.length, self.median_s = length, median_ms / 1000
        self.tail_every, self.tail_s, self.words = tail_every, tail_ms / 1000, words

    def __len__(self) -> int:
        return self.length

    def _reply(self, index: int, rng: np.random.Generator) -> str:
        """The store's reply for a key: a JSON document (made here, as the server would)."""
        topic = index % 4
        picks = rng.integers(topic * 64, topic * 64 + 96, self.words) % len(VOCABULARY)
        body = " ".join(VOCABULARY[i].replace("w", "") for i in picks)
        return json.dumps({"key": index, "topic": topic, "meta": {"n": self.words}, "body": body})

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        wait = self.tail_s if index % self.tail_every == 0 else self.median_s
        time.sleep(wait * float(np.exp(0.3 * rng.standard_normal())))
        doc = json.loads(self._reply(index, rng))  # parsing the reply: CPU, not waiting
        counts = np.zeros(768, dtype=np.float32)
        for token in TOKEN.findall(doc["body"]):
            counts[zlib.crc32(token.encode()) % 768] += 1.0
        image = torch.from_numpy(counts / max(1.0, counts.max())).view(3, 16, 16)
        return image, int(doc["topic"])
