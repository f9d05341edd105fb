"""Spoken-word clips from a blob store, as log-mel spectrograms: your own Dataset, held out
from every tuner (written to check them, never tuned on).

    python train.py dataset=custom dataset._target_=examples.audio_store.AudioClips \
        model=tiny_cnn loader=autotune

Each read fetches one second of 16 kHz audio from a store (lognormal latency, median
`median_ms`, a wide tail), then computes a log-mel spectrogram in NumPy (framing, a real FFT,
a mel filterbank: about a millisecond of CPU, partly in C code that releases the GIL). The
clip is synthesised from the index, so two runs read the same store.
"""

import time

import numpy as np
import torch
from torch.utils.data import Dataset

RATE, FRAME, HOP, MELS = 16_000, 400, 248, 32


def _mel_bank(n_fft: int = FRAME, mels: int = MELS, rate: int = RATE) -> np.ndarray:
    """Triangular filters on the mel scale, (mels, n_fft // 2 + 1)."""
    hz = 700 * (10 ** (np.linspace(0, 2595 * np.log10(1 + rate / 2 / 700), mels + 2) / 2595) - 1)
    bins = np.floor((n_fft + 1) * hz / rate).astype(int)
    bank = np.zeros((mels, n_fft // 2 + 1), dtype=np.float32)
    for m in range(1, mels + 1):
        lo, mid, hi = bins[m - 1], bins[m], bins[m + 1]
        bank[m - 1, lo:mid] = (np.arange(lo, mid) - lo) / max(mid - lo, 1)
        bank[m - 1, mid:hi] = (hi - np.arange(mid, hi)) / max(hi - mid, 1)
    return bank


class AudioClips(Dataset):
    classes = list(range(10))  # the spoken digit

    def __init__(self, length: int = 60_000, median_ms: float = 9.0, spread: float = 0.8) -> None:
        self.length, self.median_s, self.spread = length, median_ms / 1000, spread
        self.bank = _mel_bank()
        self.window = np.hanning(FRAME).astype(np.float32)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        time.sleep(self.median_s * float(np.exp(self.spread * rng.standard_normal())))
        label = index % 10
        t = np.arange(RATE, dtype=np.float32) / RATE
        clip = np.sin(2 * np.pi * (200 + 90 * label) * t) + 0.3 * rng.standard_normal(RATE)
        frames = np.lib.stride_tricks.sliding_window_view(clip.astype(np.float32), FRAME)[::HOP]
        power = np.abs(np.fft.rfft(frames * self.window, axis=1)) ** 2
        mel = np.log(power @ self.bank.T + 1e-6)  # (frames, mels)
        image = np.resize(mel.T, (3, 32, 32)).astype(np.float32)
        return torch.from_numpy((image - image.mean()) / (image.std() + 1e-6)), label
