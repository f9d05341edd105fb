"""loader.decode=device: the workers read JPEG bytes, the training process decodes the batch in
one call (on the GPU when there is one) and crops and flips it there."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from feedrate.dataset import build_dataset
from feedrate.decode import BatchDecoder, bytes_only, read_bytes

from .conftest import PHOTOS, run_cli, shrink

# The largest difference, in uint8 levels, between Pillow's decode in a worker and
# torchvision's decode_jpeg of the same bytes. Both use libjpeg-turbo here, and measured 0 on
# this suite's 48 photos; the bound leaves room for another build's IDCT rounding.
CPU_DECODERS_DIFFER_BY = 2


def _photos(compose, photos_root):
    folder = build_dataset(compose(*PHOTOS, f"dataset.root={photos_root}").dataset)
    return [path for path, _ in folder.samples[:16]]


def _pillow(path) -> torch.Tensor:
    with Image.open(path) as img:
        return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)


def test_the_byte_path_decodes_the_pixels_the_workers_would(compose, photos_root):
    from torchvision.io import ImageReadMode, decode_jpeg

    paths = _photos(compose, photos_root)
    decoded = decode_jpeg([read_bytes(p) for p in paths], mode=ImageReadMode.RGB)
    for path, image in zip(paths, decoded, strict=True):
        worker = _pillow(path)
        assert image.shape == worker.shape
        assert (image.int() - worker.int()).abs().max() <= CPU_DECODERS_DIFFER_BY, path


def test_a_batch_of_bytes_becomes_a_batch_of_augmented_images(compose, photos_root):
    folder = build_dataset(compose(*PHOTOS, f"dataset.root={photos_root}").dataset)
    first, label = folder[0]
    bytes_only(folder)
    encoded, same_label = folder[0]
    assert encoded.dim() == 1 and encoded.dtype == torch.uint8 and same_label == label
    batch = BatchDecoder(torch.device("cpu"), first.shape[-1])([folder[i][0] for i in range(5)])
    assert batch.shape == (5, *first.shape) and batch.dtype == first.dtype


def test_train_py_decodes_on_the_device_or_says_it_cannot(photos_root, tmp_path, train_here):
    proc = train_here(
        *shrink(
            [
                *PHOTOS,
                f"dataset.root={photos_root}",
                "loader.decode=device",
                "loader.num_workers=2",
                "trainer.val_fraction=0.25",
                f"hydra.run.dir={tmp_path}",
            ]
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["run"]["loader"]["decode"] == "device" and m["val_accuracy"] is not None
    assert "decodes each batch on the CPU" in proc.stdout  # no CUDA here, and it says so
    # in-memory synthetic images
    refused = train_here(*shrink(["loader.decode=device", f"hydra.run.dir={tmp_path / 'no'}"]))
    assert refused.returncode == 2
    assert "which the dataset SyntheticDataset cannot hand over" in refused.stdout
    typo = run_cli(*shrink(["loader.decode=gpu"]))  # the schema's, before anything runs
    assert typo.returncode != 0 and "Invalid value 'gpu', expected one of [cpu, device]" in (
        typo.stdout + typo.stderr
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nvjpeg_decodes_what_the_workers_would(compose, photos_root):
    from torchvision.io import ImageReadMode, decode_jpeg

    paths = _photos(compose, photos_root)
    decoded = decode_jpeg([read_bytes(p) for p in paths], mode=ImageReadMode.RGB, device="cuda")
    diffs = [
        (img.cpu().int() - _pillow(p).int()).abs() for p, img in zip(paths, decoded, strict=True)
    ]
    # nvJPEG's IDCT and upsampling differ from libjpeg-turbo's: a few levels on average
    assert max(d.float().mean().item() for d in diffs) < 3.0
    batch = BatchDecoder(torch.device("cuda"), 64)([read_bytes(p) for p in paths])
    assert batch.is_cuda and batch.shape == (len(paths), 3, 64, 64)
