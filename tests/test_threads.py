"""``loader.engine=thread``: the loader's workers as threads (feedrate.threads), with the
process engine's guarantees: the same order and batches, each sample once an epoch, a failing
sample named, a hung read stopped by the timeout, and datasets threads cannot share refused."""

from __future__ import annotations

import io
import subprocess
import sys
import threading

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import feedrate
from feedrate import hardware
from feedrate.errors import ConfigError
from feedrate.loader import build_loader, loader_kwargs, produced_samples
from feedrate.threads import ThreadLoader, check_engine, worker_id

from .conftest import CONF, shrink


class Indexed(Dataset):
    """Sample i is i; each read notes the thread that made it."""

    classes = ["a"]

    def __init__(self, n: int = 100) -> None:
        self.n = n
        self.readers: set[int | None] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.readers.add(worker_id())
        return torch.tensor(i)


def _loader(engine: str, dataset: Dataset, *extra: str):
    cfg = feedrate.compose(
        shrink(
            [
                f"loader.engine={engine}",
                "loader.num_workers=3",
                "loader.batch_size=8",
                "loader.drop_last=false",
                *extra,
            ]
        ),
        config_dir=CONF,
    )
    hw = hardware.resolve(cfg.hardware, hardware.detect())
    return build_loader(dataset, loader_kwargs(cfg.loader, hw), seed=3)


def _epochs(loader, n: int = 2) -> list[list[int]]:
    return [[int(x) for batch in loader for x in batch] for _ in range(n)]


def test_thread_workers_read_the_order_and_batches_the_process_engine_reads():
    dataset = Indexed(100)
    threads, processes = _loader("thread", dataset), _loader("process", Indexed(100))
    assert isinstance(threads, ThreadLoader) and not isinstance(processes, ThreadLoader)
    by_threads, by_processes = _epochs(threads), _epochs(processes)
    assert by_threads == by_processes  # the same shuffle, epoch after epoch
    for epoch in by_threads:
        assert sorted(epoch) == list(range(100))  # each sample once an epoch
    assert by_threads[0] != by_threads[1]  # reshuffled
    assert len(threads) == 13 and [len(b) for b in threads][-1] == 4  # the last, partial
    assert dataset.readers == {0, 1, 2}  # three threads read, each with its id
    assert produced_samples(threads) == 300  # counted as the workers' (the meter reads it)


def test_a_loop_that_leaves_an_epoch_early_ends_its_threads():
    loader = _loader("thread", Indexed(400), "loader.batch_size=4")
    before = threading.active_count()
    batches = iter(loader)
    next(batches)
    assert threading.active_count() > before
    loader.end_workers()
    for _ in range(50):  # torchdata's threads look at their stop every 0.1 s
        if threading.active_count() <= before:
            break
        threading.Event().wait(0.05)
    assert threading.active_count() <= before


class Slow(Indexed):
    """20 ms a read, counted."""

    def __init__(self, n: int = 2000) -> None:
        super().__init__(n)
        self.reads, self._lock = 0, threading.Lock()

    def __getitem__(self, i: int):
        threading.Event().wait(0.02)
        with self._lock:
            self.reads += 1
        return torch.tensor(i)


def test_an_ended_iteration_is_over_when_end_workers_returns():
    """Each thread leaves the batch it is reading after the read under way (a batch of 50
    reads holds one a second) and has ended when end_workers() returns: nothing of a setting
    the tuner left reads on beside the next one (a warm trial host retires when it finds
    such a thread)."""
    dataset = Slow()
    loader = _loader("thread", dataset, "loader.batch_size=50", "loader.num_workers=4")
    before = threading.active_count()
    batches = iter(loader)
    next(batches)
    stopped_at = dataset.reads
    loader.end_workers()
    ended_at = dataset.reads
    assert threading.active_count() <= before
    assert ended_at - stopped_at <= 2 * 4  # a read or so a thread, not the rest of its batch
    threading.Event().wait(0.2)
    assert dataset.reads == ended_at


class Corrupt(Indexed):
    def __getitem__(self, i: int):
        if i == 37:
            raise ValueError("sample 37 is corrupt")
        return super().__getitem__(i)


def test_a_failed_read_ends_the_pool_with_it():
    """The error the loop sees does not hold the pool's threads: they have ended when
    end_workers() returns, which a tuner calls before it tries the next setting."""
    loader = _loader("thread", Corrupt(400), "loader.batch_size=4", "loader.shuffle=false")
    before = threading.active_count()
    with pytest.raises(ValueError, match="sample 37 is corrupt"):
        for _ in loader:
            pass
    loader.end_workers()
    assert threading.active_count() <= before


def test_an_epoch_without_batches_is_empty():
    loader = ThreadLoader(Indexed(8), num_workers=2, collate_fn=list, batch_sampler=[])
    assert list(loader) == [] and len(loader) == 0


class NotThreadSafe(Indexed):
    thread_safe = False


class HoldsAFile(Indexed):
    def __init__(self) -> None:
        super().__init__()
        self.records = io.BytesIO(b"records")


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(10)


@pytest.mark.parametrize(
    ("dataset", "says"),
    [
        (NotThreadSafe(), "dataset NotThreadSafe says thread_safe = False"),
        (HoldsAFile(), "dataset HoldsAFile holds an open file in .records: threads would share"),
        (Stream(), "loader.engine=thread reads map-style datasets, and Stream is a stream"),
    ],
    ids=["says-so", "open-file", "stream"],
)
def test_a_dataset_threads_cannot_share_is_refused_before_they_start(dataset, says):
    with pytest.raises(ConfigError, match=f"^{says}"):
        check_engine(dataset)
    with pytest.raises(ConfigError, match="use loader.engine=process|Use loader.engine=process"):
        _loader("thread", dataset)


def test_a_thread_engine_run_trains_as_the_process_engine_does(tmp_path):
    """The same data in the same order: the same weights, on threads or processes."""
    run = ["dataset.io_latency_ms=1", "loader.num_workers=2", "trainer.max_steps=12"]
    states = {}
    for engine in ("process", "thread"):
        out = tmp_path / engine
        cfg = feedrate.compose(shrink([*run, f"loader.engine={engine}"]), config_dir=CONF)
        metrics = feedrate.run(cfg, out)
        assert metrics["steps"] == 12 and metrics["samples_per_sec"] > 0
        assert metrics["run"]["loader"]["engine"] == engine
        states[engine] = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    torch.testing.assert_close(states["thread"]["model"], states["process"]["model"])


def test_thread_workers_need_workers_and_leave_process_settings_unused(caplog):
    from feedrate.checks import validate

    none = feedrate.compose(
        shrink(["loader.engine=thread", "loader.num_workers=0"]), config_dir=CONF
    )
    with pytest.raises(ConfigError, match="loader.engine=thread needs workers but loader.num_wo"):
        validate(none)
    # a process preset run on threads: its start method and worker threads are said unused
    process = ["loader.multiprocessing_context=spawn", "loader.worker_threads=2"]
    overrides = ["loader.engine=thread", "loader.num_workers=2", *process]
    cfg = feedrate.compose(shrink(overrides), config_dir=CONF)
    validate(cfg)
    hw = hardware.resolve(cfg.hardware, hardware.detect())
    with caplog.at_level("INFO", logger="feedrate"):
        kwargs = loader_kwargs(cfg.loader, hw)
    assert kwargs["multiprocessing_context"] is None and kwargs["worker_threads"] is None
    assert "multiprocessing_context=spawn" in caplog.text and "worker_threads=2" in caplog.text


def test_the_doctor_says_which_engine_the_samples_call_for(capsys):
    from feedrate import doctor

    tiny = ["dataset=synthetic", "dataset.n_samples=64", "dataset.image_size=16"]
    doctor.main([*tiny, "dataset.io_latency_ms=20", "loader.num_workers=2"])
    waits = capsys.readouterr().out
    assert "loader.engine=thread" in waits, "threads, advised where reads wait"
    # beside two busy processes, so that a computing read spends time off the CPU too: it
    # waits behind them, runnable, not blocked
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        doctor.main([*tiny, "dataset.cpu_ms=20", "loader.num_workers=2"])
    finally:
        for p in busy:
            p.kill()
            p.wait()
    computes = capsys.readouterr().out
    assert "processes for Python code under the GIL" in computes
    doctor.main([*tiny, "loader.num_workers=2", "loader.engine=thread"])
    threads = capsys.readouterr().out
    assert "2 workers as threads of the training process: no worker process" in threads
    assert "/dev/shm           2 workers" not in threads  # nothing of theirs in /dev/shm


def test_a_run_that_ends_mid_epoch_leaves_no_thread_behind(tmp_path):
    """Its last step leaves the epoch's iteration unfinished: the threads end with the run
    (left running, they polled on forever in a long-lived process: a notebook, the sweep's
    warm trial host)."""
    import gc
    import time

    before = threading.active_count()
    run = ["dataset.io_latency_ms=1", "loader.num_workers=4", "loader.engine=thread"]
    cfg = feedrate.compose(shrink([*run, "trainer.max_steps=5"]), config_dir=CONF)
    assert feedrate.run(cfg, tmp_path)["steps"] == 5  # of 16 batches an epoch
    gc.collect()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]
