"""Datasets build from their configs, cache what they build, and refuse what cannot work."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from torch.utils.data import Subset

from feedrate import datacache
from feedrate import dataset as ds
from feedrate.checks import check_picklable, find_unpicklable
from feedrate.dataset import GuardedDataset, RunSplit, build_dataset
from feedrate.errors import ConfigError, DatasetError

from .conftest import PHOTOS, TINY


def test_photos_build_once_then_reuse(compose, photos_root, caplog, monkeypatch):
    cfg = compose(*PHOTOS, f"dataset.root={photos_root}")
    first = build_dataset(cfg.dataset)
    assert len(first) == 48 and len(first.classes) == 8
    image, label = first[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 64, 64)
    assert 0 <= label < 8
    built = list(photos_root.iterdir())
    assert [p.name for p in built if not p.name.startswith(".")] == ["v1-n48-q90-s0"]
    assert not list(photos_root.glob(".*tmp*")), "a temporary build directory was left behind"

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the photo set was rebuilt instead of reused")

    monkeypatch.setattr(datacache, "_render_photos", no_rebuild)
    again = build_dataset(cfg.dataset)
    assert again.samples == first.samples


def test_photos_are_real_jpegs_at_imagenet_like_sizes(compose, photos_root):
    from PIL import Image

    folder = build_dataset(compose(*PHOTOS, f"dataset.root={photos_root}").dataset)
    sizes = []
    for path, _ in folder.samples[:16]:
        with Image.open(path) as img:
            assert img.format == "JPEG"
            sizes.append(max(img.size))
    assert 300 <= min(sizes) and max(sizes) <= 800


def test_a_failed_build_leaves_nothing_half_written(tmp_path, monkeypatch):
    def broken(tmp, *args):
        (tmp / "astronaut").mkdir()
        (tmp / "astronaut" / "000000.jpg").write_bytes(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(datacache, "_render_photos", broken)
    with pytest.raises(OSError, match="No space left"):
        datacache.ensure_photos(tmp_path, 16, 90, 0)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_synthetic_returns_uint8_by_default_and_float32_on_request(compose):
    image, label = build_dataset(compose().dataset)[3]
    assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
    image, _ = build_dataset(compose("dataset.dtype=float32").dataset)[3]
    assert image.dtype == torch.float32
    with pytest.raises(ConfigError, match="dataset.dtype='float16'"):
        build_dataset(compose("dataset.dtype=float16").dataset)


def test_memmap_builds_from_photos_and_pickles_without_its_data(compose, photos_root, tmp_path):
    cfg = compose(
        "dataset=memmap",
        f"dataset.path={tmp_path}",
        f"dataset.photos_root={photos_root}",
        "dataset.n_images=48",
        "dataset.stored_size=64",
        "dataset.image_size=56",
    )
    data = build_dataset(cfg.dataset)
    image, label = data[5]
    assert image.dtype == torch.uint8 and image.shape == (3, 56, 56)
    assert len(data) == 48 and len(data.classes) == 8
    assert len(pickle.dumps(data)) < 10_000, "the memory map was pickled with its data"


def test_image_folder_names_a_missing_root(compose, tmp_path):
    cfg = compose("dataset=image_folder", f"dataset.root={tmp_path}/nope")
    with pytest.raises(DatasetError, match="dataset.root=.*is not a directory"):
        build_dataset(cfg.dataset)


def test_custom_dataset_by_import_path_with_command_line_kwargs(compose):
    cfg = compose(
        "dataset=custom",
        "dataset._target_=examples.sleepy.SleepyDataset",
        "+dataset.sleep_ms=0",
        "+dataset.length=7",
    )
    data = build_dataset(cfg.dataset)
    assert len(data) == 7 and ds.num_classes(data) == 2


def test_custom_dataset_with_a_wrong_import_path_names_it(compose):
    cfg = compose("dataset=custom", "dataset._target_=nowhere.Missing")
    with pytest.raises(DatasetError, match="dataset._target_=nowhere.Missing"):
        build_dataset(cfg.dataset)


class _Index:
    def __init__(self) -> None:
        self.entries = [1, 2, 3]
        self.lock = threading.Lock()


class _LockedDataset(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.index = _Index()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i):
        return torch.zeros(3, 8, 8, dtype=torch.uint8), 0


def test_unpicklable_attribute_is_found_by_path():
    path, value = find_unpicklable(_LockedDataset())
    assert path == "dataset.index.lock"
    assert type(value).__name__ == "lock"
    assert find_unpicklable(ds.SyntheticDataset(n_samples=4, image_size=8)) is None


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_unpicklable_dataset_is_refused_for_spawn_and_forkserver(method):
    with pytest.raises(ConfigError) as info:
        check_picklable(_LockedDataset(), method)
    message = str(info.value)
    assert f"not picklable for start method '{method}'" in message
    assert "dataset.index.lock: _thread.lock cannot be pickled" in message
    assert "__getstate__" in message  # says what to do


def test_the_path_starts_at_the_users_dataset_through_the_runs_wrappers():
    # A run wraps the dataset in its sample-error guard, and splits it with a validation share
    wrapped = GuardedDataset(RunSplit(_LockedDataset(), [0, 1, 2]))
    with pytest.raises(ConfigError, match=r"method 'spawn': dataset\.index\.lock: _thread"):
        check_picklable(wrapped, "spawn")
    # a Subset of the user's own is part of their dataset, and of the path
    theirs = GuardedDataset(Subset(_LockedDataset(), [0, 1, 2]))
    with pytest.raises(ConfigError, match=r"'spawn': dataset\.dataset\.index\.lock: _thread"):
        check_picklable(theirs, "spawn")


def test_cli_refuses_an_unpicklable_dataset_before_spawning(tmp_path, train_here):
    proc = train_here(
        "dataset=custom",
        "dataset._target_=tests.test_sweep.HoldsLock",
        "loader=notebook",  # spawn workers
        "trainer.val_fraction=0.25",
        *TINY,
        f"hydra.run.dir={tmp_path}",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert (
        "dataset is not picklable for start method 'spawn':"
        " dataset.index['lock']: _thread.lock cannot be pickled" in out
    )
    assert "Traceback" not in out
    assert not (tmp_path / "metrics.json").exists()


def test_fork_does_not_need_a_picklable_dataset():
    check_picklable(_LockedDataset(), "fork")


def test_the_held_out_radar_store_reads_the_same_frames_twice_and_labels_them():
    """examples/radar_store.py, a store written to judge the tuners: a sample is made from its
    index (two runs read the same store), sized as tiny_cnn takes it, with one of its classes;
    a cache that misses more reads waits longer; a hit rate that is no fraction is named."""
    import time

    from examples.radar_store import RadarFrames

    store = RadarFrames(length=64, hit_rate=1.0, hit_ms=0.0)
    image, label = store[5]
    again, same = RadarFrames(length=64, hit_rate=1.0, hit_ms=0.0)[5]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert torch.equal(image, again) and label == same
    assert {store[i][1] for i in range(64)} <= set(store.classes)
    assert len({store[i][1] for i in range(64)}) > 2, "the classes are not one"
    slow = RadarFrames(length=8, hit_rate=0.0, miss_ms=20.0, spread=0.0)
    t0 = time.perf_counter()
    slow[0], slow[1]
    assert time.perf_counter() - t0 >= 0.04, "every read missed the cache"
    with pytest.raises(ValueError, match="hit_rate=1.5"):
        RadarFrames(hit_rate=1.5)
