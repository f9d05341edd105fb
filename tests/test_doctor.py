"""``python -m feedrate.doctor``: the machine's limits, the dataset, what is unsafe here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import ROOT, TINY_DATA, unshare_works


def _doctor(*args: str, setup: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "feedrate.doctor", *args]
    if setup:  # in a private mount namespace, after a shell command sets up the machine
        cmd = ["unshare", "-m", "sh", "-c", f"{setup} && {' '.join(cmd)}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_safe_configuration_gets_the_machine_and_the_dataset_described():
    proc = _doctor(*TINY_DATA, "loader.num_workers=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for expected in (
        "fingerprint",
        "/dev/shm",
        "open files         limit",
        "start methods",
        "256 samples of (3, 32, 32) torch.uint8",
        "picklable          yes",
        "a fork worker",
        "workers fit in 80% of the memory available",
        "recipe.yaml        plain data",
        "nothing unsafe found",
    ):
        assert expected in out, expected


@pytest.mark.skipif(not unshare_works(), reason="needs root to mount a small /dev/shm")
def test_a_loader_too_big_for_shared_memory_is_unsafe():
    proc = _doctor(
        *TINY_DATA,
        "dataset.image_size=224",
        "loader.num_workers=8",
        "loader.prefetch_factor=4",
        "--no-measure",
        setup="mount -t tmpfs -o size=4m tmpfs /dev/shm",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[UNSAFE] /dev/shm           8 workers x prefetch 4 x 9 MB need about 294 MB" in (
        proc.stdout
    )
    assert "--shm-size=8g" in proc.stdout


def test_a_dataset_spawn_cannot_receive_is_unsafe_under_spawn():
    proc = _doctor(
        "dataset=custom",
        "dataset._target_=tests.test_sweep.HoldsLock",
        "loader.num_workers=2",
        "loader.multiprocessing_context=spawn",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "picklable          no: dataset.index['lock']: _thread.lock cannot be pickled"
        in proc.stdout
    )
    assert "[UNSAFE] start method       spawn cannot receive this dataset" in proc.stdout


def test_a_preset_that_can_run_code_is_named(tmp_path):
    evil = tmp_path / "shared.yaml"
    evil.write_text(
        "# @package _global_\nhydra:\n  callbacks:\n    x:\n      _target_: os.getcwd\n"
    )
    fine = tmp_path / "fine.yaml"
    fine.write_text("defaults:\n  - default\n  - _self_\nnum_workers: 6\n")
    proc = _doctor(*TINY_DATA, "--no-measure", "--preset", str(evil), "--preset", str(fine))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[UNSAFE] shared.yaml        not plain data: a '# @package' directive" in proc.stdout
    assert "the key hydra.callbacks.x._target_ (Hydra imports and calls it)" in proc.stdout
    assert "[ ok ]   fine.yaml          plain data" in proc.stdout


def test_a_per_rank_preset_is_checked_for_every_rank_on_the_node(capsys, monkeypatch):
    """A preset of sweep.ranks_per_node=2 says each rank's workers: the node runs twice as
    many, and its /dev/shm, memory and cores are checked for all of them."""
    from omegaconf import OmegaConf

    from feedrate import doctor, hardware

    monkeypatch.setattr("feedrate.hardware.usable_cores", lambda: 2.0)
    machine = doctor.Machine(hardware.detect(), 8 * 2**30, (2**30, 0.0), 1024, "file_system")
    probe = doctor.Probe(sample_bytes=2**20, unpicklable=None, per_worker=100 * 2**20)

    def checked(**loader) -> str:
        base = {"num_workers": 3, "prefetch_factor": 2, "batch_size": 64, "timeout": 0.0}
        cfg = OmegaConf.create({**base, "multiprocessing_context": "fork", **loader})
        doctor._check_loader(doctor.Report(), cfg, machine, probe)
        return capsys.readouterr().out

    per_rank = checked(per_rank=True, measured_on={"workload": {"ranks_per_node": 2}})
    assert "2 ranks x 3 workers x prefetch 2 x 64 MB need about" in per_rank
    assert "2 ranks x 3 workers x 100 MB = 600 MB of" in per_rank
    assert "2 ranks x 3 workers on 2 cores" in per_rank
    alone = checked()  # the node's workers, as every preset without per_rank
    assert "3 workers x prefetch 2 x 64 MB" in alone and "3 workers x 100 MB = 300 MB" in alone
