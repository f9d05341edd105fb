"""Where JPEGs are decoded (``loader.decode``): ``cpu``, in the workers, per sample, with
Pillow; or ``device``: the workers only read the file bytes, and the training process decodes
each batch in one call on the device (``torchvision.io.decode_jpeg``, nvJPEG on CUDA), then
crops and flips it there (docs/design.md, "Decode placement")."""

from __future__ import annotations

import logging

import torch
from torch.utils.data import Dataset

from feedrate.errors import ConfigError

log = logging.getLogger(__name__)


def read_bytes(path: str) -> torch.Tensor:
    """The file as a 1-D uint8 tensor: what a worker hands over with ``loader.decode=device``.
    (Not ``torchvision.io.read_file``: its tensors cannot be shared with the main process.)"""
    with open(path, "rb") as fh:
        return torch.frombuffer(bytearray(fh.read()), dtype=torch.uint8)


def bytes_only(dataset: Dataset) -> None:
    """Make ``dataset``'s workers read the encoded bytes only: photos, image_folder (any
    torchvision ``DatasetFolder`` of JPEGs) and webdataset know how."""
    from torchvision.datasets import DatasetFolder

    from feedrate.stream import ShardStream

    if isinstance(dataset, ShardStream):
        dataset.raw = True
    elif isinstance(dataset, DatasetFolder):
        dataset.loader = read_bytes
        dataset.transform = None
    else:
        raise ConfigError(
            f"loader.decode=device has the workers read JPEG bytes, which the dataset"
            f" {type(dataset).__qualname__} cannot hand over: use it with dataset=photos,"
            " image_folder or webdataset, or set loader.decode=cpu"
        )


def is_encoded(sample: object) -> bool:
    """A sample's image still encoded: a 1-D uint8 tensor of file bytes."""
    return isinstance(sample, torch.Tensor) and sample.dim() == 1 and sample.dtype == torch.uint8


class BatchDecoder:
    """A batch of JPEG bytes -> uint8 images on ``device``, randomly resized-cropped to
    ``image_size`` and flipped, as the workers' Pillow path does per sample."""

    def __init__(self, device: torch.device, image_size: int) -> None:
        from torchvision.transforms import v2

        self.device = device
        self.augment = v2.Compose(
            [v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()]
        )
        if device.type != "cuda":
            log.info(
                "loader.decode=device on a host without CUDA: the training process decodes"
                " each batch on the CPU (correct, and slower than workers decoding in parallel)"
            )

    def __call__(self, encoded: list[torch.Tensor]) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg

        device = self.device if self.device.type == "cuda" else "cpu"
        images = decode_jpeg(list(encoded), mode=ImageReadMode.RGB, device=device)
        return torch.stack([self.augment(image) for image in images])
