"""loader=autotune: the loader tuned inside the run, no sample skipped or trained twice."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

import feedrate

from .conftest import CONF, run_torchrun
from .counting import recorded

N, BATCH = 960, 8  # 120 steps an epoch
# Candidates measured in a few steps each: switches come every 20-60 steps, mid-epoch.
QUICK = [
    "trainer.autotune.write_preset=false",
    "trainer.autotune.window_s=0.1",
    "trainer.autotune.warmup_steps=1",
    "trainer.autotune.window_steps=2",
    "trainer.autotune.max_workers=8",  # seeds: 2 and 8 workers (2 cores)
    "trainer.autotune.budget_s=600",  # the run ends first: it switches to its last step
]


def _counting(kind: str, *extra: str) -> list[str]:
    target = {"map": "Indexed", "stream": "IndexedStream"}[kind]
    return [
        "dataset=custom",
        f"dataset._target_=tests.counting.{target}",
        f"+dataset.n={N}",
        "+dataset.latency_ms=0.5",
        "model=tiny_cnn",
        "model._target_=tests.counting.Recorder",
        f"loader.batch_size={BATCH}",
        "trainer.max_steps=null",
        "trainer.warmup_steps=2",
        "trainer.window_steps=5",
        "trainer.checkpoint_every=null",
        "trainer.progress=false",
        *extra,
        # the run starts without workers: none of the worker-only settings
        "loader.num_workers=0",
        "loader.prefetch_factor=null",
        "loader.persistent_workers=false",
    ]


def _epochs(ids: list[int], per_epoch: int) -> list[list[int]]:
    return [ids[i : i + per_epoch] for i in range(0, len(ids), per_epoch)]


def _workers_trained(metrics: dict) -> set[int]:
    return {
        c["params"]["loader.num_workers"]
        for c in metrics["autotune"]["candidates"]
        if c["steps"] > 0
    }


def test_map_style_switches_mid_epoch_and_trains_every_sample_once_in_order(
    tmp_path, monkeypatch
):
    """0, 2 and 8 workers take turns inside each epoch; every epoch trains each sample once,
    in the very order a run with one loader trains them (the loss curve just goes on)."""
    plain, tuned = tmp_path / "plain", tmp_path / "tuned"
    for directory, loader in ((plain, []), (tuned, ["loader=autotune"])):
        directory.mkdir()
        monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(directory))
        overrides = _counting("map", "trainer.epochs=3", *loader, *QUICK)
        cfg = feedrate.compose(overrides, config_dir=CONF)
        metrics = feedrate.run(cfg, output_dir=directory / "run")
    ids = recorded(tuned)
    assert ids == recorded(plain)
    assert [sorted(e) for e in _epochs(ids, N)] == [list(range(N))] * 3
    assert {0, 2, 8} <= _workers_trained(metrics)
    candidates = metrics["autotune"]["candidates"]
    assert len(candidates) >= 4 and sum(c["steps"] for c in candidates) == 3 * N // BATCH
    # more switches than epoch ends: they came mid-epoch
    assert len(candidates) > 3


def test_a_stream_switches_at_its_epoch_ends_and_trains_every_sample_once(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("FEEDRATE_RECORD_DIR", str(tmp_path))
    overrides = _counting("stream", "loader=autotune", "trainer.epochs=4")
    cfg = feedrate.compose([*overrides, *QUICK], config_dir=CONF)
    metrics = feedrate.run(cfg, output_dir=tmp_path / "run")
    epochs = _epochs(recorded(tmp_path), N)
    assert [sorted(e) for e in epochs] == [list(range(N))] * 4
    assert {0, 2, 8} <= _workers_trained(metrics)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_two_ranks_switch_at_the_same_step_and_train_every_sample_once(tmp_path, kind):
    epochs = {"map": 3, "stream": 4}[kind]  # a stream switches at epoch ends only
    overrides = _counting(kind, "loader=autotune", f"trainer.epochs={epochs}")
    proc = run_torchrun(
        2,
        *overrides,
        *QUICK,
        "trainer.autotune.max_workers=16",  # the machine's: 8 a rank; seeds 1, 4 and 8 a rank
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"FEEDRATE_RECORD_DIR": str(tmp_path)},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    per_rank = [_epochs(recorded(tmp_path, r), N // 2) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == epochs
    for e in range(epochs):
        assert sorted(per_rank[0][e] + per_rank[1][e]) == list(range(N))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert {0, 4, 8} <= _workers_trained(metrics)
