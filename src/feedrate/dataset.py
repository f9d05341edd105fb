"""Datasets, built from ``cfg.dataset`` by ``hydra.utils.instantiate``.

Every dataset returns ``(image, label)`` with the image as a uint8 CHW tensor where it can:
normalisation happens on the device, so the host moves 4x fewer bytes than with float32.
Datasets expose ``classes`` so the model's head is sized from the data.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset, IterableDataset, Subset, random_split

if TYPE_CHECKING:  # torchvision takes a second to import: only the image datasets need it
    from torchvision import datasets
    from torchvision.transforms import v2

from feedrate import targets
from feedrate.config import execution_whitelist
from feedrate.datacache import PHOTOS_VERSION, build_once, ensure_photos, read_rgb, render_memmap
from feedrate.errors import CUDA_AFTER_FORK, ConfigError, DatasetError, FeedrateError, SampleError

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Datasets


def train_transform(image_size: int) -> v2.Compose:
    from torchvision.transforms import v2

    # Decoded with Pillow, cropped and flipped on the PIL image, returned as a uint8 tensor.
    return v2.Compose(
        [
            v2.RandomResizedCrop(image_size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.PILToTensor(),
        ]
    )


def build_image_folder(root: str, image_size: int = 224) -> datasets.ImageFolder:
    """Any ImageFolder directory, decoded and augmented like a training set."""
    from torchvision import datasets

    path = Path(root).expanduser()
    if not path.is_dir():
        raise DatasetError(
            f"dataset.root={root!r} is not a directory; point it at an ImageFolder tree"
            " (root/<class>/<image>), e.g. dataset.root=/data/imagenet/train"
        )
    try:
        return datasets.ImageFolder(
            str(path), transform=train_transform(image_size), loader=read_rgb
        )
    except (FileNotFoundError, RuntimeError) as exc:
        raise DatasetError(f"dataset.root={root!r} is not an ImageFolder tree: {exc}") from exc


def build_photos(
    root: str, n_images: int, image_size: int = 224, jpeg_quality: int = 90, seed: int = 0
) -> datasets.ImageFolder:
    """The real-photo JPEG dataset, built once under ``root`` and then read from disk."""
    path = ensure_photos(root, n_images, jpeg_quality, seed)
    return build_image_folder(str(path), image_size)


class SyntheticDataset(Dataset):
    """In-memory images; each sample sleeps ``io_latency_ms`` and burns ``cpu_ms`` of CPU.

    The sleep stands for storage or network latency (a waiting worker holds no core); the busy
    loop stands for decoding and augmentation (it holds one). Images are drawn from a small pool
    of distinct tensors, labelled by pool index, so a model can learn them. ``slowdown_after_s``
    seconds after the dataset is built, each sample waits ``slowdown_ms`` more: storage that
    got slower mid-run (a cold page cache, a busy filer), in every process alike.
    """

    def __init__(
        self,
        n_samples: int = 10_000,
        image_size: int = 224,
        channels: int = 3,
        num_classes: int = 10,
        io_latency_ms: float = 0.0,
        cpu_ms: float = 0.0,
        dtype: str = "uint8",
        seed: int = 0,
        pool_size: int = 64,
        slowdown_after_s: float | None = None,
        slowdown_ms: float = 0.0,
    ) -> None:
        if dtype not in ("uint8", "float32"):
            raise ConfigError(f"dataset.dtype={dtype!r} is not one of 'uint8', 'float32'")
        g = torch.Generator().manual_seed(seed)
        pool = min(pool_size, n_samples)
        shape = (pool, channels, image_size, image_size)
        if dtype == "uint8":
            self.images = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        else:
            self.images = torch.rand(shape, generator=g)
        self.n_samples = n_samples
        self.io_latency_s = io_latency_ms / 1000
        self.cpu_s = cpu_ms / 1000
        self.classes = [f"class_{i}" for i in range(num_classes)]
        # wall-clock time, which workers share (a monotonic clock's origin is per machine boot)
        self.slow_from = None if slowdown_after_s is None else time.time() + slowdown_after_s
        self.slowdown_s = slowdown_ms / 1000

    def __len__(self) -> int:
        return self.n_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        latency = self.io_latency_s
        if self.slow_from is not None and time.time() >= self.slow_from:
            latency += self.slowdown_s
        if latency:
            time.sleep(latency)
        if self.cpu_s:
            deadline = time.perf_counter() + self.cpu_s
            while time.perf_counter() < deadline:
                pass
        k = index % len(self.images)
        return self.images[k], k % len(self.classes)


class MemmapDataset(Dataset):
    """uint8 HWC images in one ``.npy`` file, memory-mapped, random-cropped and flipped.

    The file is opened lazily in each process and never pickled: ``np.memmap`` pickles as a
    full in-memory copy, which would defeat the point under ``spawn`` workers.
    """

    def __init__(self, directory: Path, image_size: int) -> None:
        manifest = json.loads((directory / "manifest.json").read_text())
        self.directory = directory
        self.root = str(directory)
        self.classes = manifest["classes"]
        self.stored_size = manifest["stored_size"]
        self.image_size = image_size
        self.labels = np.load(directory / "labels.npy")
        self._images: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_images": None}

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self._images is None:
            self._images = np.load(self.directory / "images.npy", mmap_mode="r")
        s, c = self.stored_size, self.image_size
        y, x = torch.randint(0, s - c + 1, (2,)).tolist()
        img = self._images[index, y : y + c, x : x + c]
        if torch.rand(()) < 0.5:
            img = img[:, ::-1]
        chw = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).contiguous()
        return chw, int(self.labels[index])


def build_memmap(
    path: str,
    photos_root: str,
    n_images: int = 3000,
    stored_size: int = 256,
    image_size: int = 224,
    seed: int = 0,
) -> MemmapDataset:
    if image_size > stored_size:
        raise ConfigError(
            f"dataset.image_size={image_size} is larger than dataset.stored_size={stored_size};"
            " crops are cut from the stored images: raise stored_size or lower image_size"
        )
    photos = build_photos(photos_root, n_images, stored_size, seed=seed)
    name = f"photos-v{PHOTOS_VERSION}-n{n_images}-s{seed}-{stored_size}px"
    target = Path(path).expanduser().resolve() / name
    build_once(target, lambda tmp: render_memmap(tmp, photos, stored_size), "memmap dataset")
    return MemmapDataset(target, image_size)


def known_classes(dataset: Dataset) -> int | None:
    """Classes in ``dataset``, from its ``classes`` list or ``num_classes`` attribute; None
    where it names neither."""
    n = getattr(dataset, "num_classes", None)
    if n is None and getattr(dataset, "classes", None) is not None:
        n = len(dataset.classes)
    return n if isinstance(n, int) and n >= 1 else None


def num_classes(dataset: Dataset) -> int:
    """Classes in ``dataset``, which a model that takes ``num_classes`` needs."""
    n = known_classes(dataset)
    if n is None:
        raise DatasetError(
            f"dataset {type(dataset).__qualname__} does not say how many classes it has, and"
            " the model takes num_classes: give the dataset a `classes` list or a"
            " `num_classes` int attribute, or give the model its own (+model.num_classes=N)"
        )
    return n


# ---------------------------------------------------------------------------------------------
# Building the configured dataset, and the run's own wrappers of it


def build_dataset(cfg: DictConfig):
    """Instantiate ``cfg.dataset``, turning failures into an error that names the target."""
    target = cfg.get("_target_")
    if not target or str(target) == "???":
        targets.load("dataset", target)  # says it is not set, and how to set it
    kwargs = {k: v for k, v in cfg.items() if k != "on_error"}  # feedrate's, not the class's
    try:
        return instantiate(
            OmegaConf.create(kwargs), _execution_whitelist_=execution_whitelist(target)
        )
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, FeedrateError):
            raise cause from None
        raise DatasetError(
            f"could not build the dataset dataset._target_={target}: {exc}".replace("\n", " ")
        ) from exc


def split(dataset, val_fraction: float, seed: int):
    """(train, val) subsets with ``val_fraction`` held out, or (dataset, None)."""
    if val_fraction <= 0:
        return dataset, None
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            f"trainer.val_fraction={val_fraction} cannot hold out samples of the stream"
            f" {type(dataset).__qualname__}: it has no indices to split. Set"
            " trainer.val_fraction=0, and evaluate on shards of your own"
        )
    n_val = max(1, int(len(dataset) * val_fraction))
    generator = torch.Generator().manual_seed(seed)
    train_set, val_set = random_split(dataset, [len(dataset) - n_val, n_val], generator)
    return RunSplit(dataset, train_set.indices), RunSplit(dataset, val_set.indices)


def sample_origin(dataset: Any, index: int) -> str:
    """Where sample ``index`` comes from: its file when the dataset knows it."""
    while isinstance(dataset, Subset):
        index = dataset.indices[index]
        dataset = dataset.dataset
    samples = getattr(dataset, "samples", None)
    if isinstance(samples, list) and 0 <= index < len(samples):
        entry = samples[index]
        path = entry[0] if isinstance(entry, tuple) else entry
        return f"sample {index} ({path})"
    return f"sample {index}"


class RunSplit(Subset):
    """The train or validation share the run splits off the user's dataset: a wrapper of the
    run's own, like :class:`GuardedDataset`, that messages look through (a ``Subset`` the
    user made is part of their dataset, and stays in the paths they are shown)."""


class GuardedDataset(Dataset):
    """The user's dataset, with failures that name their sample.

    ``on_error="raise"``: a failing ``__getitem__`` raises :class:`SampleError` naming the
    index and file. ``on_error="skip"``: the sample is dropped from its batch and counted
    (``feedrate.loader.CountingCollate`` keeps the count), and training goes on.
    """

    def __init__(self, dataset: Dataset, on_error: str = "raise") -> None:
        if on_error not in ("raise", "skip"):
            raise DatasetError(f"dataset.on_error={on_error!r} is not one of 'raise', 'skip'")
        self.dataset = dataset
        self.on_error = on_error

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:  # noqa: BLE001 - any failure of user code is reported
            if CUDA_AFTER_FORK in str(exc):  # every sample would fail: the start method's
                raise  # fault, named by diagnose(), not this sample's
            if self.on_error == "skip":
                return None
            raise SampleError(
                f"{sample_origin(self.dataset, index)} could not be loaded:"
                f" {type(exc).__name__}: {exc}. Fix or remove it, or set dataset.on_error=skip"
                " to skip failing samples (they are counted in metrics.json)"
            ) from exc
