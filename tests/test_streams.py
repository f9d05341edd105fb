"""Streams (IterableDatasets): each sample once per epoch whatever the workers and ranks, the
photos as webdataset shards, a user's stream through train.py and torchrun, and a stream that
hands every worker the same samples refused."""

from __future__ import annotations

import collections
import functools
import itertools
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from feedrate.checkpoint import Position, Reader, save_stream, stream_state
from feedrate.errors import DatasetError
from feedrate.loader import build_loader
from feedrate.stream import (
    GuardedStream,
    ShardStream,
    _fingerprint,
    build_webdataset,
    check_split_by_worker,
)

from .conftest import run_cli, shrink

N_IMAGES = 48


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, Path]:
    """(photos root, shards root): 48 photos in 5 shards of 9-10, built once for the module."""
    root = tmp_path_factory.mktemp("streams")
    build_webdataset(str(root / "shards"), str(root / "photos"), n_images=N_IMAGES, n_shards=5)
    return root / "photos", root / "shards"


def _keyed(self, sample: dict) -> tuple[torch.Tensor, int]:
    """The sample's identity in place of its pixels: which photo of which class."""
    name, number = sample["__key__"].rsplit("-", 1)
    return torch.tensor(self.classes.index(name) * 100_000 + int(number)), int(sample["cls"])


def _stream(shards, **kwargs) -> ShardStream:
    photos, root = shards
    return build_webdataset(
        str(root), str(photos), n_images=N_IMAGES, n_shards=5, image_size=32, **kwargs
    )


def _epochs(
    dataset,
    workers: int,
    epochs: int = 2,
    first_epoch: int = 0,
    batches: int | None = None,
    state_in: dict | None = None,
    state_out: dict | None = None,
) -> list[list[int]]:
    """The samples' ids of ``epochs`` epochs (the first ``batches`` of each); the loader
    starts from ``state_in`` and leaves its state in ``state_out``."""
    kwargs = {
        "batch_size": 4,
        "num_workers": workers,
        "pin_memory": False,
        "drop_last": False,
        "timeout": 0.0,
        "persistent_workers": False,
    }
    if workers:
        kwargs |= {"prefetch_factor": 2, "multiprocessing_context": "fork", "timeout": 60.0}
    loader = build_loader(GuardedStream(dataset), kwargs, seed=0)
    if state_in is not None:
        loader.load_state_dict(state_in)
    seen = []
    for epoch in range(first_epoch, first_epoch + epochs):
        loader.dataset.set_epoch(epoch)
        read = itertools.islice(iter(loader), batches)
        seen.append([int(i) for x, _ in read for i in x])
    if state_out is not None:
        state_out.update(loader.state_dict())
    return seen


@pytest.mark.parametrize("workers", [0, 2, 4])
def test_each_sample_of_a_stream_is_seen_once_per_epoch(shards, monkeypatch, workers):
    monkeypatch.setattr(ShardStream, "_decode", _keyed)
    first, second = _epochs(_stream(shards, shuffle_buffer=8), workers)
    assert len(set(first)) == N_IMAGES and len(first) == N_IMAGES
    assert sorted(second) == sorted(first)
    assert second != first, "every epoch shuffles the shards and the buffer anew"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_goes_on_from_its_loaders_state(shards, monkeypatch, workers):
    """Five batches, the loader's state, a new loader from that state: together they read the
    epoch an uninterrupted loader reads, in the same order; the next epoch is whole."""
    monkeypatch.setattr(ShardStream, "_decode", _keyed)
    epoch = functools.partial(_epochs, workers=workers, epochs=1, first_epoch=1)
    (whole,) = epoch(_stream(shards, shuffle_buffer=8))
    state = {}
    (head,) = epoch(_stream(shards, shuffle_buffer=8), batches=5, state_out=state)
    (tail, after) = epoch(_stream(shards, shuffle_buffer=8), state_in=state, epochs=2)
    assert len(head) == 5 * 4 and head + tail == whole
    assert sorted(after) == sorted(whole) and after != whole


def test_a_stream_position_from_another_step_or_split_is_not_restored(tmp_path):
    last = tmp_path / "last.pt"
    saved = {"step": 40}
    reader = Reader(rank=1, world_size=2, num_workers=2)
    state, why = stream_state(saved, last, reader)
    assert state is None and why == f"{tmp_path / 'last.rank1.pt'} is missing"
    save_stream(last, reader, Position(step=40, stream={"_snapshot": {"step": 3}}))
    assert stream_state(saved, last, reader) == ({"_snapshot": {"step": 3}}, "")
    state, why = stream_state({"step": 50}, last, reader)
    assert state is None and "40" in why and "50" in why, "both steps, named"
    wider = Reader(rank=1, world_size=4, num_workers=2)
    state, why = stream_state(saved, last, wider)
    assert state is None and "world_size=2" in why and "4" in why
    save_stream(last, reader, Position(step=40, stream={"odd": np.int64(3)}))
    state, why = stream_state(saved, last, reader)
    assert state is None and "must hold plain ints" in why


def test_two_ranks_read_disjoint_shards_that_cover_the_stream(shards, monkeypatch):
    monkeypatch.setattr(ShardStream, "_decode", _keyed)
    seen = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        dataset = _stream(shards)
        (ids,) = _epochs(dataset, workers=2, epochs=1)
        assert len(ids) == len(dataset), "its length is this rank's share"
        seen.append(ids)
    assert not set(seen[0]) & set(seen[1])
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert sorted(seen[0] + seen[1]) == sorted(_epochs(_stream(shards), 0, 1)[0])
    assert len(seen[0]) != len(seen[1]), "5 shards cannot split evenly: DDP's join handles it"


def _webdataset(shards, run_dir: Path, *overrides: str) -> list[str]:
    """train.py's overrides for the module's shards, 2 workers, the run in ``run_dir``."""
    photos, root = shards
    return shrink(
        [
            "dataset=webdataset",
            f"dataset.root={root}",
            f"dataset.photos_root={photos}",
            f"dataset.n_images={N_IMAGES}",
            "dataset.n_shards=5",
            "dataset.image_size=32",
            "loader.num_workers=2",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ]
    )


def test_webdataset_trains_from_the_command_line(shards, tmp_path):
    proc = run_cli(
        *_webdataset(
            shards,
            tmp_path,
            "dataset.shard_latency_ms=20",
            "dataset.sample_latency_ms=1",
            "trainer.max_steps=null",
            "trainer.epochs=2",
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["epochs_started"] == 2 and m["epoch_restart_s"] is not None
    # two workers, 2-3 shards each, batches of 16: the epochs end with the stream, past the
    # length's estimate (ceil(48 / 16) = 3 batches)
    assert m["steps"] == 2 * 4
    assert m["run"]["dataset_len"] == N_IMAGES and "shuffle" not in m["run"]["loader"]
    assert "48 samples (a stream)" in proc.stdout


@pytest.mark.slow
def test_a_resumed_webdataset_goes_on_from_where_it_stopped(shards, tmp_path, train_here):
    """An epoch stopped at step 5 and resumed ends at the step an unbroken epoch ends at."""
    common = ["loader.batch_size=4", "trainer.save_checkpoint=true", "trainer.epochs=1"]
    common += ["model=pooled_linear"]  # a worker's last batch may hold one sample: no batch norm
    whole = train_here(*_webdataset(shards, tmp_path / "whole", *common, "trainer.max_steps=null"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    steps = json.loads((tmp_path / "whole" / "metrics.json").read_text())["steps"]
    first = train_here(*_webdataset(shards, tmp_path, *common, "trainer.max_steps=5"))
    assert first.returncode == 0, first.stderr[-3000:]
    again = train_here(
        *_webdataset(shards, tmp_path, *common, "trainer.max_steps=null", "trainer.resume=true")
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step 5 (epoch 0)" in again.stdout, "where the stream goes on from"
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == steps > 5


# A user's stream, split by rank and by worker as the README shows, that writes down what each
# worker yields (only workers: the main process peeks at one sample to size the model)
NUMBERS = """
import os
import torch
from torch.utils.data import IterableDataset, get_worker_info


class Numbers(IterableDataset):
    classes = ["even", "odd"]

    done = skip = 0  # samples this worker has read of its pass; to read again unseen

    def __init__(self, n, n_shards, log_dir, split=True):
        self.n, self.n_shards, self.log_dir, self.split = n, n_shards, log_dir, split
        self.num_shards = n_shards
        self.splits_by_worker = split  # said: feedrate's probe of the workers is skipped

    def __iter__(self):
        shards = range(self.n_shards)
        info = get_worker_info()
        if self.split:
            rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
            shards = shards[rank::world]
            if info is not None:
                shards = shards[info.id :: info.num_workers]
        self.done, skip, self.skip = 0, self.skip, 0
        for shard in shards:
            for k in range(shard, self.n, self.n_shards):
                self.done += 1
                if self.done <= skip:
                    continue
                if info is not None:
                    name = f"{os.environ.get('RANK', 0)}-{info.id}-{os.getpid()}"
                    with open(os.path.join(self.log_dir, name), "a") as fh:
                        fh.write(f"{k}\\n")
                yield torch.full((3, 8, 8), k % 251, dtype=torch.uint8), k % 2


class Resumable(Numbers):  # says where each worker is: a checkpoint keeps it

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.skip = state["done"]
"""


def _numbers(tmp_path: Path, *overrides: str) -> list[str]:
    (tmp_path / "user_stream.py").write_text(NUMBERS)  # not numbers.py: the stdlib has one
    (tmp_path / "seen").mkdir()
    return shrink(
        [
            "dataset=custom",
            "dataset._target_=user_stream.Numbers",
            "+dataset.n=101",
            "+dataset.n_shards=5",
            f"+dataset.log_dir={tmp_path / 'seen'}",
            "loader.batch_size=8",
            # each worker's last batch is partial, down to one sample: no batch norm
            "model=pooled_linear",
            "trainer.max_steps=1000",  # no __len__: a bound, though the epoch ends first
            "trainer.epochs=1",
            "trainer.warmup_steps=1",
            f"hydra.run.dir={tmp_path / 'run'}",
            *overrides,
        ]
    )


@pytest.mark.slow
def test_a_users_stream_under_torchrun_is_trained_on_once_per_epoch(tmp_path, torchrun_here):
    overrides = _numbers(tmp_path, "loader.num_workers=4")  # 2 a rank
    proc = torchrun_here(2, *overrides, cwd=tmp_path, env={"PYTHONPATH": "."})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    seen = collections.Counter(
        int(k) for f in (tmp_path / "seen").iterdir() for k in f.read_text().split()
    )
    assert sorted(seen) == list(range(101)) and set(seen.values()) == {1}
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["world_size"] == 2 and m["epochs_started"] == 1


@pytest.mark.slow
def test_a_users_stream_resumes_on_each_rank_from_its_own_position(tmp_path, torchrun_here):
    """Stopped at step 3 (3 full batches of 8 on each of 2 ranks: 48 samples trained), resumed:
    the ranks' workers read the 101 - 48 samples not trained yet, each once."""
    resumable = ("dataset._target_=user_stream.Resumable", "trainer.save_checkpoint=true")
    first = _numbers(tmp_path, "loader.num_workers=4", *resumable, "trainer.max_steps=3")
    proc = torchrun_here(2, *first, cwd=tmp_path, env={"PYTHONPATH": "."})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert {p.name for p in (tmp_path / "run" / "checkpoints").iterdir()} >= {
        "last.pt",
        "last.rank0.pt",
        "last.rank1.pt",
    }
    shutil.rmtree(tmp_path / "seen")
    again = _numbers(tmp_path, "loader.num_workers=4", *resumable, "trainer.resume=true")
    proc = torchrun_here(2, *again, cwd=tmp_path, env={"PYTHONPATH": "."})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "step 3 (epoch 0)" in out, "where the stream goes on from"
    seen = collections.Counter(
        int(k) for f in (tmp_path / "seen").iterdir() for k in f.read_text().split()
    )
    assert sum(seen.values()) == 101 - 48 and set(seen.values()) == {1}


def test_a_stream_without_a_state_restarts_its_epoch_and_says_so(tmp_path, train_here):
    env = {"PYTHONPATH": str(tmp_path)}
    first = train_here(
        *_numbers(tmp_path, "trainer.save_checkpoint=true", "trainer.max_steps=3"), env=env
    )
    assert first.returncode == 0, first.stdout[-3000:]
    (tmp_path / "seen").rmdir()  # no workers: nothing written there
    again = train_here(*_numbers(tmp_path, "trainer.resume=true"), env=env)
    assert again.returncode == 0, again.stdout[-3000:]
    assert (
        "the stream's position is not restored (Numbers has no state_dict/load_state_dict):"
        " epoch 0 starts again" in again.stdout
    )
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 3 + 13  # 101 samples in batches of 8: the whole epoch again


def test_the_probe_tells_a_stream_that_splits_from_one_that_does_not(tmp_path):
    (tmp_path / "user_stream.py").write_text(NUMBERS)
    sys.path.insert(0, str(tmp_path))
    try:
        from user_stream import Numbers
    finally:
        sys.path.remove(str(tmp_path))
    splits = Numbers(101, 5, str(tmp_path))
    splits.splits_by_worker = False  # not said: probed
    check_split_by_worker(splits, "fork")
    whole = Numbers(101, 5, str(tmp_path), split=False)
    with pytest.raises(DatasetError, match="every DataLoader worker reads the same samples"):
        check_split_by_worker(whole, "fork")


def test_a_stream_every_worker_reads_whole_is_refused(tmp_path, train_here):
    overrides = _numbers(tmp_path, "+dataset.split=false", "loader.num_workers=2")
    proc = train_here(*overrides, env={"PYTHONPATH": str(tmp_path)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert "every DataLoader worker reads the same samples of the stream Numbers" in out
    assert "get_worker_info()" in out and "Traceback" not in out


def test_a_stream_is_refused_a_val_split_a_skip_from_outside_and_emptiness(tmp_path, train_here):
    env = {"PYTHONPATH": str(tmp_path)}
    held_out = train_here(*_numbers(tmp_path, "trainer.val_fraction=0.2"), env=env)
    assert held_out.returncode == 2, held_out.stdout[-2000:]
    assert "cannot hold out samples of the stream Numbers" in held_out.stdout
    (tmp_path / "seen").rmdir()
    skipping = train_here(*_numbers(tmp_path, "dataset.on_error=skip"), env=env)
    assert skipping.returncode == 2, skipping.stdout[-2000:]
    assert "a stream ends at its first exception" in skipping.stdout
    (tmp_path / "seen").rmdir()
    empty = train_here(*_numbers(tmp_path, "dataset.n=0"), env=env)
    assert empty.returncode == 2, empty.stdout[-2000:]
    assert "the stream Numbers yielded nothing in this process" in empty.stdout


def test_the_probe_tells_samples_apart_by_every_byte_of_any_structure():
    image = torch.zeros(3, 64, 64, dtype=torch.uint8)
    other = image.clone()
    other[1, 32, 32] = 1  # inside what a tensor's repr leaves out
    sample = {"image": image, "boxes": [torch.ones(2, 4)], "id": "a"}
    assert _fingerprint(sample) != _fingerprint({**sample, "image": other})
    assert _fingerprint(sample) != _fingerprint({**sample, "id": "b"})
    assert _fingerprint(sample) == _fingerprint({**sample, "image": image.clone()})
    # a dtype numpy lacks, a tensor that needs a gradient, a view out of order: read too
    half = torch.arange(6.0).reshape(2, 3)
    for odd in (half.bfloat16(), half.requires_grad_(), half.t()):
        assert _fingerprint((odd, 1)) != _fingerprint((odd + 1, 1))
