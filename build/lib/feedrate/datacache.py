"""Datasets written to disk once and reused: the photo set (JPEGs cut from photographs that
ship with scikit-image) and its memory-mapped copy. Each is built under a lock into a temporary
directory that is renamed into place, so a build that dies leaves nothing half-written."""

from __future__ import annotations

import fcntl
import io
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image
from tqdm import tqdm

from feedrate.errors import ConfigError
from feedrate.hardware import usable_cores

if TYPE_CHECKING:
    from torchvision import datasets

log = logging.getLogger(__name__)

PHOTOS_VERSION = 1


def _photo_sources() -> dict[str, Callable[[], np.ndarray]]:
    """Colour photographs that ship inside scikit-image (no download), one class each."""
    from skimage import data

    return {
        "astronaut": data.astronaut,
        "cat": data.chelsea,
        "coffee": data.coffee,
        "galaxy": data.hubble_deep_field,
        "motorcycle": lambda: data.stereo_motorcycle()[0],
        "retina": data.retina,
        "rocket": data.rocket,
        "tissue": data.immunohistochemistry,
    }


# ---------------------------------------------------------------------------------------------
# Building cached datasets: once, under a lock, into a temporary directory renamed into place.


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Serialise builders of ``target`` across processes (ranks, parallel jobs)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_once(target: Path, build: Callable[[Path], None], what: str) -> Path:
    """Run ``build(tmp_dir)`` unless ``target`` is complete, then rename it into place.

    A build that dies half-way leaves only a ``.tmp-*`` directory, which the next build removes;
    ``target`` exists only when complete (``manifest.json`` is written last, inside it).
    """
    if (target / "manifest.json").exists():
        return target
    with _build_lock(target):
        if (target / "manifest.json").exists():  # another process built it while we waited
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # incomplete, from a version that did not build atomically
            shutil.rmtree(target)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        tmp.mkdir()
        log.info("building %s in %s (once; reused afterwards)", what, target)
        t0 = time.perf_counter()
        try:
            build(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("built %s in %.1f s", what, time.perf_counter() - t0)
    return target


def _render_photo(job: tuple[int, int, int, str, int]) -> tuple[str, int, int]:
    """One random crop of a source photo, rescaled to an ImageNet-like size, saved as JPEG."""
    index, seed, quality, out_dir, class_idx = job
    sources = _photo_sources()
    name = sorted(sources)[class_idx]
    src = _source_cache.get(name)
    if src is None:
        src = _source_cache[name] = sources[name]()
    rng = np.random.default_rng([seed, index])
    h, w = src.shape[:2]
    area = rng.uniform(0.2, 1.0) * h * w
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    ch = int(min(h, round(np.sqrt(area / aspect))))
    cw = int(min(w, round(np.sqrt(area * aspect))))
    y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
    crop = Image.fromarray(src[y : y + ch, x : x + cw])
    # ImageNet's photos are mostly 500 px on the long side, the rest spread from ~300 to ~800.
    long_side = 500 if rng.random() < 0.6 else int(rng.integers(300, 801))
    scale = long_side / max(ch, cw)
    size = (max(1, round(cw * scale)), max(1, round(ch * scale)))
    img = crop.resize(size, Image.BICUBIC)
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    path = Path(out_dir) / name / f"{index:06d}.jpg"
    img.save(path, quality=quality)
    return name, size[0], size[1]


_source_cache: dict[str, np.ndarray] = {}


def _render_photos(tmp: Path, n_images: int, seed: int, quality: int) -> None:
    names = sorted(_photo_sources())
    for name in names:
        (tmp / name).mkdir()
    jobs = [(i, seed, quality, str(tmp), i % len(names)) for i in range(n_images)]
    processes = max(1, min(int(usable_cores()), 8))
    sizes = []
    with get_context("fork").Pool(processes) as pool:
        results = pool.imap_unordered(_render_photo, jobs, chunksize=16)
        for _, w, h in tqdm(results, total=n_images, desc="building photos", unit="img"):
            sizes.append((w, h))
    manifest = {
        "version": PHOTOS_VERSION,
        "n_images": n_images,
        "seed": seed,
        "jpeg_quality": quality,
        "classes": names,
        "mean_size": [float(np.mean([s[0] for s in sizes])), float(np.mean([s[1] for s in sizes]))],
        "bytes": sum(f.stat().st_size for f in tmp.rglob("*.jpg")),
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))


def ensure_photos(root: str | os.PathLike, n_images: int, jpeg_quality: int, seed: int) -> Path:
    """The photo set's directory under ``root``, built on first use."""
    if n_images < len(_photo_sources()):
        raise ConfigError(
            f"dataset.n_images={n_images} is smaller than the number of classes"
            f" ({len(_photo_sources())}); use at least that many"
        )
    name = f"v{PHOTOS_VERSION}-n{n_images}-q{jpeg_quality}-s{seed}"
    target = Path(root).expanduser().resolve() / name
    return build_once(
        target, lambda tmp: _render_photos(tmp, n_images, seed, jpeg_quality), "photo dataset"
    )


def read_rgb(path: str) -> Image.Image:
    """An image file as RGB, read and closed (torchvision's default leaves PIL's file lazy)."""
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


def render_memmap(tmp: Path, photos: datasets.ImageFolder, size: int) -> None:
    from torchvision.transforms import v2

    n = len(photos.samples)
    images = np.lib.format.open_memmap(
        tmp / "images.npy", mode="w+", dtype=np.uint8, shape=(n, size, size, 3)
    )
    resize = v2.Compose([v2.Resize(size, antialias=True), v2.CenterCrop(size)])
    for i, (path, _) in enumerate(tqdm(photos.samples, desc="building memmap", unit="img")):
        images[i] = np.asarray(resize(read_rgb(path)))
    images.flush()
    del images
    np.save(tmp / "labels.npy", np.asarray(photos.targets, dtype=np.int64))
    manifest = {"n_images": n, "stored_size": size, "classes": photos.classes}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))


def ensure_shards(
    root: str | os.PathLike, photos: Path, n_shards: int, seed: int
) -> tuple[Path, dict]:
    """The photo set written as ``n_shards`` tar shards (WebDataset layout: ``<key>.jpg`` and
    ``<key>.cls`` per sample, samples dealt out in a seeded random order so every shard holds
    every class) under ``root``, built on first use; with its manifest."""
    manifest = json.loads((photos / "manifest.json").read_text())
    n_images = manifest["n_images"]
    if not 1 <= n_shards <= n_images:
        raise ConfigError(
            f"dataset.n_shards={n_shards} must be between 1 and the {n_images} images"
            " (dataset.n_images)"
        )
    name = f"{photos.name}-shards{n_shards}-s{seed}"
    target = Path(root).expanduser().resolve() / name
    build_once(target, lambda tmp: _write_shards(tmp, photos, manifest, n_shards, seed), "shards")
    return target, json.loads((target / "manifest.json").read_text())


def _write_shards(tmp: Path, photos: Path, manifest: dict, n_shards: int, seed: int) -> None:
    import tarfile

    classes = manifest["classes"]
    files = sorted(photos.glob("*/*.jpg"))
    order = np.random.default_rng(seed).permutation(len(files))
    counts = []
    for shard, chunk in enumerate(np.array_split(order, n_shards)):
        with tarfile.open(tmp / f"shard-{shard:05d}.tar", "w") as tar:
            for i in tqdm(chunk, desc=f"shard {shard + 1}/{n_shards}", unit="img", leave=False):
                path = files[i]
                key = f"{path.parent.name}-{path.stem}"
                label = str(classes.index(path.parent.name)).encode()
                tar.add(path, arcname=f"{key}.jpg")
                info = tarfile.TarInfo(f"{key}.cls")
                info.size = len(label)
                tar.addfile(info, io.BytesIO(label))
        counts.append(len(chunk))
    out = {"n_samples": len(files), "classes": classes, "shard_samples": counts}
    (tmp / "manifest.json").write_text(json.dumps(out, indent=2))
