"""Streams: datasets read in order, as large training sets on object stores are (an
``IterableDataset``: WebDataset, LitData, Mosaic Streaming, HF streaming, or your own).

A stream splits its own work: by rank and by worker (no sampler does it), shuffles in a
buffer, and ends an epoch when it runs out. ``dataset=webdataset`` is the photo set written as
tar shards and read with the ``webdataset`` package (docs/design.md, "Streams").
"""

from __future__ import annotations

import functools
import hashlib
import io
import itertools
import json
import logging
import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from feedrate.batch import tensors
from feedrate.datacache import ensure_shards
from feedrate.errors import CUDA_AFTER_FORK, ConfigError, DatasetError, SampleError

log = logging.getLogger(__name__)


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


def is_resumable(dataset: Any) -> bool:
    """A stream that can say where it is and go on from there (``state_dict`` and
    ``load_state_dict``, as torchdata's ``Stateful``): a checkpoint keeps its position."""
    return (
        is_stream(dataset)
        and callable(getattr(dataset, "state_dict", None))
        and callable(getattr(dataset, "load_state_dict", None))
    )


def length(dataset: Any) -> int | None:
    """Samples in ``dataset`` (this rank's, for a stream), or None: a stream that does not say."""
    try:
        return len(dataset)
    except TypeError:
        return None


class _Wrapper(IterableDataset):
    """A stream of the run's own around the user's: attributes and ``set_epoch`` pass through."""

    def __init__(self, dataset: IterableDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


class GuardedStream(_Wrapper):
    """The user's stream, with a failure that says which sample of which worker it was.

    A stream cannot skip a failed sample from outside (a generator that raised is over): one
    that says ``handles_errors`` is handed ``on_error`` and skips them itself.
    """

    def __new__(cls, dataset: IterableDataset | None = None, on_error: str = "raise"):
        # A resumable stream's guard says its state as its own methods: torchdata's
        # isinstance(Stateful) check looks them up statically (Python 3.12+), not through
        # __getattr__. (No arguments when unpickled in a worker: the class is chosen already.)
        if cls is GuardedStream and dataset is not None and is_resumable(dataset):
            cls = _ResumableGuardedStream
        return super().__new__(cls)

    def __init__(self, dataset: IterableDataset, on_error: str = "raise") -> None:
        super().__init__(dataset)
        if getattr(dataset, "handles_errors", False):
            dataset.on_error = on_error
        elif on_error == "skip":
            raise DatasetError(
                f"dataset.on_error=skip cannot apply to the stream {type(dataset).__qualname__}:"
                " a stream ends at its first exception. Skip failed samples inside the stream"
                " (webdataset: handler=wds.warn_and_continue), or set dataset.on_error=raise"
            )

    def __iter__(self):
        info = get_worker_info()
        where = f" (worker {info.id})" if info is not None else ""
        samples = iter(self.dataset)
        for n in itertools.count():
            try:
                sample = next(samples)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - any failure of user code is reported
                if CUDA_AFTER_FORK in str(exc):
                    raise
                raise SampleError(
                    f"sample {n} of the stream {type(self.dataset).__qualname__}{where} could"
                    f" not be loaded: {type(exc).__name__}: {exc}"
                ) from exc
            yield sample


class _ResumableGuardedStream(GuardedStream):
    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)


class Repeated(_Wrapper):
    """The stream again and again (``trainer.stream=true``: no epoch end while measuring)."""

    def __iter__(self):
        for epoch in itertools.count():
            self.set_epoch(epoch)
            empty = True
            for sample in self.dataset:
                empty = False
                yield sample
            if empty:  # this worker has no share of the stream: nothing to repeat
                return


def nothing_here(dataset: Any) -> DatasetError:
    """The error for a stream that yields nothing in this process."""
    while isinstance(dataset, _Wrapper):
        dataset = dataset.dataset
    return DatasetError(
        f"the stream {type(dataset).__qualname__} yielded nothing in this process: it has no"
        " share of the data here (fewer shards than ranks?), or it is empty, or every sample"
        " it read was skipped; give every rank a shard"
    )


def _fingerprint(sample: Any) -> bytes:
    """A sample's identity: the bytes of its tensors at any depth (a pair, a dict of an image
    and its boxes; any dtype, on any device), and its layout with its other fields."""
    digest = hashlib.blake2b(digest_size=16)
    for part in tensors(sample):
        digest.update(part.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    digest.update(_layout(sample).encode())
    return digest.digest()


def _layout(sample: Any) -> str:
    """The structure of a sample: its tensors as dtype and shape, other values as written."""
    if isinstance(sample, torch.Tensor):
        return f"{sample.dtype}{tuple(sample.shape)}"
    if isinstance(sample, Mapping):
        return "{" + ", ".join(f"{k!r}: {_layout(v)}" for k, v in sample.items()) + "}"
    if isinstance(sample, (list, tuple)):
        return "[" + ", ".join(_layout(v) for v in sample) + "]"
    return repr(sample)


def _same_seed(worker_id: int) -> None:
    """Every probe worker draws the same random numbers: a stream that does not split its
    work then yields the same samples, augmented alike, in every worker."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def check_split_by_worker(dataset: IterableDataset, method: str, probe: int = 8) -> None:
    """Refuse a stream whose workers would all read the same samples: two workers, the same
    seeds, ``probe`` samples each; a stream may skip this by saying ``splits_by_worker``."""
    if getattr(dataset, "splits_by_worker", False):
        return
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=2,
        multiprocessing_context=method,
        worker_init_fn=_same_seed,
    )
    seen: tuple[list[bytes], list[bytes]] = ([], [])
    for i, sample in enumerate(itertools.islice(loader, 2 * probe)):
        seen[i % 2].append(_fingerprint(sample))  # batches come from the workers in turn
    del loader
    shared = len(set(seen[0]) & set(seen[1]))
    if seen[1] and shared >= max(1, len(seen[1]) // 2):
        raise DatasetError(
            f"every DataLoader worker reads the same samples of the stream"
            f" {type(dataset).__qualname__} ({shared} of the {len(seen[1])} samples a second"
            " worker yielded, the first one yielded too): with N workers each sample would be"
            " trained on N times. Split the work in __iter__ with"
            " torch.utils.data.get_worker_info() (webdataset: wds.split_by_worker), then give"
            " the dataset `splits_by_worker = True`; or use loader.num_workers=0"
        )


# ---------------------------------------------------------------------------------------------
# dataset=webdataset


class ShardStream(IterableDataset):
    """The photo set's tar shards, streamed with ``webdataset``: shards shuffled per epoch and
    split by rank and worker, samples shuffled in a buffer, then decoded and augmented as
    ``dataset=photos`` does. ``shard_latency_ms`` and ``sample_latency_ms`` simulate an
    object store (opening a shard, reading a sample)."""

    splits_by_worker = True
    handles_errors = True  # on_error=skip: a sample that fails to read or decode is dropped
    on_error = "raise"
    raw = False  # loader.decode=device: hand over the JPEG bytes (feedrate.decode.bytes_only)

    def __init__(
        self,
        directory: Path,
        image_size: int,
        shuffle_buffer: int,
        shard_latency_ms: float,
        sample_latency_ms: float,
        seed: int,
    ) -> None:
        manifest = json.loads((directory / "manifest.json").read_text())
        self.shards = sorted(str(p) for p in directory.glob("shard-*.tar"))
        self.shard_samples = manifest["shard_samples"]
        self.classes = manifest["classes"]
        self.num_shards = len(self.shards)
        self.image_size = image_size
        self.shuffle_buffer = shuffle_buffer
        self.shard_latency_s = shard_latency_ms / 1e3
        self.sample_latency_s = sample_latency_ms / 1e3
        self.seed = seed
        self._transform = None
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._pass, self._read, self._skip = epoch, 0, 0

    def state_dict(self) -> dict:
        """This worker's place: its pass (an epoch) and the samples it has read of it."""
        return {"epoch": self._pass, "read": self._read}

    def load_state_dict(self, state: dict) -> None:
        """Go on from ``state``: the next pass is that epoch's, and it reads again (without
        decoding) the samples read before, in the same seeded order, to skip them."""
        self.set_epoch(state["epoch"])
        self._skip = state["read"]

    def _rank(self) -> tuple[int, int]:
        from webdataset.utils import pytorch_worker_info

        rank, world, _, _ = pytorch_worker_info()
        return rank, world

    def _my_shards(self) -> list[int]:
        """This rank's shards this epoch: all ranks shuffle alike, then take every world-th."""
        order = list(range(self.num_shards))
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        rank, world = self._rank()
        return order[rank::world]

    def __len__(self) -> int:
        return sum(self.shard_samples[i] for i in self._my_shards())

    def __iter__(self):
        import webdataset as wds

        handler = wds.warn_and_continue if self.on_error == "skip" else wds.reraise_exception
        urls = [self.shards[i] for i in self._my_shards()]
        info = get_worker_info()
        rank, _ = self._rank()
        rng = random.Random(f"{self.seed}-{self.epoch}-{rank}-{info.id if info else 0}")
        self._pass, self._read, skip, self._skip = self.epoch, 0, self._skip, 0
        self.epoch += 1  # persistent workers: the next pass reshuffles without being told
        stages = [
            wds.SimpleShardList(urls),
            wds.split_by_worker,
            self._open_shards,
            wds.tarfile_to_samples(handler=handler),
        ]
        if self.shuffle_buffer > 1:
            stages.append(wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng))
        stages.append(functools.partial(self._counted, skip=skip))
        stages.append(wds.map(self._decode, handler=handler))
        return iter(wds.DataPipeline(*stages))

    def _counted(self, samples, skip: int):
        """The samples after the first ``skip``, counted (the position ``state_dict`` says)."""
        for sample in samples:
            self._read += 1
            if self._read > skip:
                yield sample

    def _open_shards(self, urls):
        for url in urls:
            if self.shard_latency_s:
                time.sleep(self.shard_latency_s)  # the object store's time to first byte
            yield url

    def _decode(self, sample: dict) -> tuple[torch.Tensor, int]:
        if self.sample_latency_s:
            time.sleep(self.sample_latency_s)
        if self.raw:
            return torch.frombuffer(bytearray(sample["jpg"]), dtype=torch.uint8), int(sample["cls"])
        if self._transform is None:
            from feedrate.dataset import train_transform

            self._transform = train_transform(self.image_size)
        with Image.open(io.BytesIO(sample["jpg"])) as img:
            image = self._transform(img.convert("RGB"))
        return image, int(sample["cls"])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_transform": None}


def build_webdataset(
    root: str,
    photos_root: str,
    n_images: int = 3000,
    n_shards: int = 16,
    image_size: int = 224,
    shuffle_buffer: int = 256,
    shard_latency_ms: float = 0.0,
    sample_latency_ms: float = 0.0,
    seed: int = 0,
) -> Dataset:
    from feedrate.datacache import ensure_photos

    if shuffle_buffer < 0 or shard_latency_ms < 0 or sample_latency_ms < 0:
        raise ConfigError(
            "dataset.shuffle_buffer, dataset.shard_latency_ms and dataset.sample_latency_ms"
            " cannot be negative"
        )
    photos = ensure_photos(photos_root, n_images, 90, seed)
    directory, _ = ensure_shards(root, photos, n_shards, seed)
    return ShardStream(
        directory,
        image_size,
        shuffle_buffer,
        shard_latency_ms,
        sample_latency_ms,
        seed,
    )
