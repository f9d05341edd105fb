"""Support tickets from a key-value store, tokenized with a vocabulary each process loads
once: your own Dataset, held out from every tuner (written to check them, never tuned on).

    python train.py dataset=custom dataset._target_=examples.vocab_store.Tickets \
        model=tiny_cnn loader=autotune

A read waits on the store (median `median_ms`; one read in `stall_every` stalls `stall_ms`),
then tokenizes the ticket in pure Python against a vocabulary (the GIL held throughout). The
vocabulary is built on first use in each process (`vocab_size` entries: about a second of
CPU), as a tokenizer is loaded in each DataLoader worker: a worker process pays it at its
start, threads share the one the process built. Tickets are made from the index.
"""

import time

import numpy as np
import torch
from torch.utils.data import Dataset

_VOCAB: dict[str, int] | None = None  # this process's, built on first use


def _vocabulary(size: int) -> dict[str, int]:
    global _VOCAB
    if _VOCAB is None or len(_VOCAB) != size:
        letters = "abcdefghijklmnopqrstuvwxyz"
        _VOCAB = {}
        for i in range(size):
            word, n = [], i
            while True:
                word.append(letters[n % 26])
                n //= 26
                if not n:
                    break
            _VOCAB["".join(word)] = i
    return _VOCAB


class Tickets(Dataset):
    classes = [0, 1, 2, 3]  # the ticket's queue

    def __init__(
        self,
        length: int = 80_000,
        median_ms: float = 5.0,
        stall_every: int = 50,
        stall_ms: float = 80.0,
        words: int = 120,
        vocab_size: int = 600_000,
    ) -> None:
        self.length, self.median_s = length, median_ms / 1000
        self.stall_every, self.stall_s = stall_every, stall_ms / 1000
        self.words, self.vocab_size = words, vocab_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        vocab = _vocabulary(self.vocab_size)
        rng = np.random.default_rng(index)
        stall = self.stall_s if index % self.stall_every == 0 else 0.0
        time.sleep(self.median_s * float(np.exp(0.5 * rng.standard_normal())) + stall)
        ids = rng.integers(0, 26**3, self.words).tolist()
        text = " ".join(_spell(i) for i in ids)
        tokens = [vocab.get(w, 0) for w in text.split()]
        counts = [0] * 768
        for t in tokens:
            counts[t % 768] += 1
        image = torch.tensor(counts, dtype=torch.float32).view(3, 16, 16)
        return image / self.words, int(sum(tokens) % 4)


def _spell(n: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = []
    while True:
        out.append(letters[n % 26])
        n //= 26
        if not n:
            return "".join(out)
