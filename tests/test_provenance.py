"""Presets that travel: a preset says where it was measured, a run elsewhere says how this
machine and workload differ, and loader=auto picks the preset that fits here."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from feedrate import hardware, provenance
from feedrate.tuning.preset import MARKER, plain_data_problems, render

from .conftest import ROOT, shrink

# Machines no test runs on (not the CI's, nor a GPU host's)
GPU_NODE = {"usable_cores": 24.0, "gpu_name": "Example GPU X1", "gpu_count": 3, "ram_gb": 96.0}
BIG_CPU = {"usable_cores": 96.0, "gpu_name": None, "gpu_count": 0, "ram_gb": 768.0}


@pytest.fixture
def here(compose) -> provenance.Here:
    """This machine and the suite's tiny workload, as a preset's provenance records them."""
    cfg = compose()
    fp = hardware.detect()
    return provenance.Here.of(cfg, fp, hardware.resolve(cfg.hardware, fp))


def _measured_on(here: provenance.Here, **machine) -> dict:
    """Provenance of a preset measured on this workload, on this machine changed by ``machine``."""
    return {
        "machine": {**copy.deepcopy(here.machine), **machine},
        "workload": copy.deepcopy(here.workload),
        "samples_per_sec": 1000.0,
        "data_wait_frac": 0.1,
        "peak_pss_mb": 900.0,
        "date": "2026-12-01T00:00:00",
        "study": "loader-test",
    }


def _write(directory: Path, name: str, values: dict, measured_on: dict | None) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(render(values, [f"python train.py loader={name}"], measured_on))
    assert plain_data_problems(path) == [], "provenance is plain loader data"
    return path


def test_the_warning_names_what_differs(here):
    moved = _measured_on(here, **GPU_NODE)
    moved["workload"]["model"] = {"target": "torchvision.models.resnet18"}
    warning = provenance.travel_warning("tuned_2core", moved, here)
    this = provenance.describe_machine(here.machine)
    assert all(f in warning for f in ("24 cores", "3x Example GPU X1", "96 GB", this))
    assert "model.target resnet18 -> TinyCNN" in warning
    assert "python train.py -m sweep=loader sweep.preset_name=tuned_2core_here [your" in warning
    named = provenance.Here(here.machine, here.workload, ("dataset=photos", "model=resnet18"))
    assert provenance.travel_warning("tuned_2core", moved, named).endswith(
        "sweep.preset_name=tuned_2core_here dataset=photos model=resnet18"
    )
    assert provenance.travel_warning("tuned_2core", _measured_on(here), here) is None


def test_a_preset_of_another_workload_here_names_the_command_that_makes_this_one(compose):
    """The same machine, another workload: said so, and the command that tunes for this one
    keeps the workload's own parts (step, collate function, their keys) and nothing the
    sweep sets itself."""
    given = (
        "dataset=custom",
        "model=custom",
        "+model.hidden=8",
        "trainer.step._target_=examples.detection.detection_step",
        "+trainer.step.box_weight=2",
        "loader.collate_fn._target_=examples.detection.collate",
        "+loader.collate_fn.pad=4",
    )
    cfg = compose()
    fp = hardware.detect()
    here = provenance.Here.of(
        cfg,
        fp,
        hardware.resolve(cfg.hardware, fp),
        ["loader=recipe", "loader.num_workers=2", "trainer.max_steps=9", "hydra.run.dir=x", *given],
    )
    assert here.command == given
    other = _measured_on(here)
    other["workload"]["model"] = {"target": "torchvision.models.resnet18"}
    warning = provenance.travel_warning("mine", other, here)
    assert warning.startswith("loader=mine was measured on another workload: the workload differs")
    assert warning.endswith(f"sweep.preset_name=mine_here {' '.join(given)}")


def test_a_preset_tuned_for_another_number_of_ranks_says_what_it_was_tuned_for(here, tmp_path):
    """Ranks on one node share its cores: a one-process preset under torchrun with 2 ranks
    is another workload (warned, and not loader=auto's pick), and the command says how to
    tune the job as it runs."""
    one = _measured_on(here)
    two_ranks = provenance.Here(here.machine, {**here.workload, "ranks_per_node": 2})
    warning = provenance.travel_warning("tuned_2core", one, two_ranks)
    assert "the workload differs (ranks_per_node 1 -> 2)" in warning
    assert "sweep.preset_name=tuned_2core_here sweep.ranks_per_node=2" in warning
    before = {k: v for k, v in one["workload"].items() if k != "ranks_per_node"}
    assert provenance.travel_warning("old", {**one, "workload": before}, here) is None
    (tmp_path / "default.yaml").write_text("num_workers: 0\n")
    _write(tmp_path, "one_process", {"num_workers": 8}, one)
    assert provenance.measured_here(tmp_path, here, False)[0] == "one_process"
    assert provenance.measured_here(tmp_path, two_ranks, False) is None


def test_auto_picks_the_preset_of_this_machine_then_the_closest_that_fits(tmp_path, here):
    (tmp_path / "default.yaml").write_text("num_workers: 0\n")
    _write(tmp_path, "gpu", {"num_workers": 14, "decode": "device"}, _measured_on(here, **GPU_NODE))
    _write(tmp_path, "big_cpu", {"num_workers": 48}, _measured_on(here, **BIG_CPU))
    _write(tmp_path, "mine", {"num_workers": 3}, _measured_on(here))
    name, why = provenance.pick(tmp_path, here, has_cuda=False)
    assert name == "mine" and why.startswith("measured on this machine and workload (1,000")
    # Three machines, three presets: each picks its own
    for machine, own in ((GPU_NODE, "gpu"), (BIG_CPU, "big_cpu"), ({}, "mine")):
        there = provenance.Here({**here.machine, **machine}, here.workload)
        assert provenance.pick(tmp_path, there, has_cuda=bool(machine.get("gpu_count")))[0] == own
    # Another workload here: the presets of this workload on other machines are nearer
    (tmp_path / "mine.yaml").unlink()
    name, why = provenance.pick(tmp_path, here, has_cuda=False)
    assert name == "big_cpu", "the GPU node's decodes on a GPU, which this machine lacks"
    assert "96 cores" in why, "the machine it was tuned on"
    # A preset that needed more memory than this machine has does not fit either
    huge = _measured_on(here, **BIG_CPU) | {"peak_pss_mb": 10**9}
    _write(tmp_path, "big_cpu", {"num_workers": 48}, huge)
    name, why = provenance.pick(tmp_path, here, has_cuda=False)
    assert name == "recipe"
    assert "gpu:" in why and "big_cpu:" in why and "1,000,000,000 MB" in why, "each, and why"
    name, _ = provenance.pick(tmp_path, here, has_cuda=True)
    assert name == "gpu"


@pytest.fixture
def project(tmp_path) -> Path:
    """train.py and a copy of conf/, where the test writes presets."""
    shutil.copy(ROOT / "train.py", tmp_path / "train.py")
    shutil.copytree(ROOT / "conf", tmp_path / "conf")
    return tmp_path


def test_a_preset_moved_to_another_machine_warns_and_auto_picks_this_ones(
    project, here, train_here
):
    loader = project / "conf" / "loader"
    _write(loader, "moved", {"num_workers": 1}, _measured_on(here, **GPU_NODE))
    _write(loader, "mine", {"num_workers": 2, "prefetch_factor": 3}, _measured_on(here))
    moved = train_here(*shrink(["loader=moved", f"hydra.run.dir={project}/moved"]), cwd=project)
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert moved.stdout.count("loader=moved was measured elsewhere: tuned on 24 cores") == 1
    mine = train_here(*shrink(["loader=mine", f"hydra.run.dir={project}/mine"]), cwd=project)
    assert mine.returncode == 0 and "measured elsewhere" not in mine.stdout
    doctor = subprocess.run(
        [sys.executable, "-m", "feedrate.doctor", "--no-measure", *shrink(["loader=moved"])],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next(ln for ln in doctor.stdout.splitlines() if "measured elsewhere" in ln)
    assert line.startswith("[warn]") and "loader=moved" in line and "24" in line
    auto = train_here(
        *shrink(["loader=auto", "loader.timeout=30", f"hydra.run.dir={project}/auto"]),
        cwd=project,
    )
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert "loader=mine" in auto.stdout, "the one line names the preset picked"
    ran = json.loads((project / "auto" / "metrics.json").read_text())["run"]["loader"]
    assert ran["num_workers"] == 2 and ran["prefetch_factor"] == 3
    assert ran["timeout"] == 30, "the command line's loader keys apply on top of the pick"


def test_a_sweep_written_preset_records_where_it_was_measured(tmp_path, here):
    """The provenance a sweep writes from its winner's run files, read back as a preset."""
    job = tmp_path / "job"
    (job / ".hydra").mkdir(parents=True)
    fp = hardware.detect()
    (job / "environment.json").write_text(json.dumps({"fingerprint": fp.as_dict()}))
    (job / "metrics.json").write_text(
        json.dumps({"run": {"amp_dtype": "None", "date": "2026-12-01T10:00:00"}})
    )
    (job / ".hydra" / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "dataset": {"_target_": here.workload["dataset"]["target"], "root": "/x"},
                "model": {"_target_": "feedrate.model.TinyCNN", "width": 16},
                "loader": {"batch_size": 16},
            }
        )
    )
    config = {"hydra": {"sweeper": {"study_name": "loader-x"}}}
    from omegaconf import OmegaConf

    results = [{"data_wait_frac": 0.2, "peak_pss_mb": 800.0}, {"data_wait_frac": 0.4}]
    measured = provenance.measured_on(OmegaConf.create(config), job, results, 1234.56)
    assert measured["machine"] == provenance.machine_facts(fp)
    assert measured["workload"]["dataset"] == {"target": here.workload["dataset"]["target"]}
    assert measured["workload"]["precision"] == "fp32"
    assert (measured["samples_per_sec"], measured["peak_pss_mb"]) == (1234.6, 800)
    assert measured["data_wait_frac"] == pytest.approx(0.3)
    path = _write(tmp_path, "swept", {"num_workers": 2}, measured)
    assert path.read_text().splitlines()[1] == MARKER


def test_auto_keeps_every_loader_key_the_command_line_set(tmp_path, here, compose):
    """Even one equal to auto's own (num_workers=0 is loader/default's), and a preset that
    tuned its batch size is this workload's when the command line did not set one."""
    (tmp_path / "default.yaml").write_text("num_workers: 0\n")
    (tmp_path / "auto.yaml").write_text("defaults: [default, _self_]\nauto: true\n")
    tuned = _measured_on(here)
    tuned["workload"]["batch_size"] = 128
    _write(tmp_path, "mine", {"num_workers": 3, "prefetch_factor": 4, "batch_size": 128}, tuned)
    cfg = compose("loader=auto", "loader.num_workers=0")
    name, line = provenance.settle(cfg, tmp_path, here, False, None, {"num_workers"}, say=False)
    assert name == "mine" and "measured on this machine and workload" in line
    assert (cfg.loader.num_workers, cfg.loader.prefetch_factor) == (0, 4)
    assert cfg.loader.batch_size == 128 and cfg.loader.auto is False
    cfg = compose("loader=auto", "loader.batch_size=16")
    name, line = provenance.settle(cfg, tmp_path, here, False, None, {"batch_size"}, say=False)
    assert "differs in batch_size" in line and cfg.loader.batch_size == 16


def test_a_preset_that_cannot_be_read_is_left_out_and_named(tmp_path, here, caplog):
    (tmp_path / "default.yaml").write_text("num_workers: 0\n")
    broken = _measured_on(here)
    del broken["machine"]
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump({"measured_on": broken}))
    assert provenance.pick(tmp_path, here, has_cuda=False)[0] == "recipe"
    assert f"loader=auto leaves out {tmp_path / 'broken.yaml'}" in caplog.text


def test_the_catalogue_reads_a_project_first_and_survives_presets_it_cannot_read(tmp_path, here):
    """``feedrate presets``: a project's preset of a packaged name wins; one whose
    measured_on is odd, or that is not a file at all, is shown as such, not a traceback."""
    project, packaged = tmp_path / "project", ROOT / "conf" / "loader"
    project.mkdir()
    _write(project, "recipe", {"num_workers": 6}, _measured_on(here))
    odd = _measured_on(here)
    odd["peak_pss_mb"] = "a lot"
    _write(project, "odd", {"num_workers": 2}, odd)
    (project / "folder.yaml").mkdir()
    rows = {r["name"]: r for r in provenance.catalogue([project, packaged], here, False)}
    assert rows["recipe"]["path"] == str(project / "recipe.yaml")
    assert rows["recipe"]["here"] == "measured on this machine and workload"
    assert rows["default"]["here"].startswith("by hand: PyTorch's own DataLoader defaults")
    assert "cannot be read" in rows["odd"]["here"]
    assert rows["folder"]["here"].startswith("cannot be read (IsADirectoryError")


def test_the_feedrate_command_says_what_it_cannot_do(capsys):
    from feedrate import cli

    assert cli.main(["swep", "loader=recipe"]) == 2
    assert "unknown command 'swep'" in capsys.readouterr().err
    assert cli.main([]) == 2 and "feedrate sweep [overrides]" in capsys.readouterr().out
    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.startswith("feedrate 0.")
