"""Every config composes and validates; bad input fails early with the key's name."""

from __future__ import annotations

import logging
import multiprocessing

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from feedrate.checks import validate
from feedrate.errors import ConfigError
from feedrate.hardware import Fingerprint, resolve
from feedrate.loader import loader_kwargs

from .conftest import CONF, run_cli

# Options that need a value only the user can give.
REQUIRED = {
    ("dataset", "image_folder"): ["dataset.root=/data/train"],
    ("dataset", "custom"): ["dataset._target_=examples.sleepy.SleepyDataset"],
}


def all_options():
    for group_dir in sorted(p for p in CONF.iterdir() if p.is_dir()):
        for yaml in sorted(group_dir.glob("*.yaml")):
            yield group_dir.name, yaml.stem


@pytest.mark.parametrize(("group", "option"), list(all_options()))
def test_every_yaml_composes_and_validates(compose, group, option):
    cfg = compose(f"{group}={option}", *REQUIRED.get((group, option), []), tiny=False)
    validate(cfg)
    container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    if group == "sweep":  # a global package: it sets keys across the tree
        assert container["objective"] and container["trainer"]["progress"] is False
    else:
        assert container[group], f"{group}={option} composed to an empty node"


def test_groups_exist_with_their_presets():
    options = set(all_options())
    for expected in [
        ("dataset", "photos"),
        ("dataset", "synthetic"),
        ("dataset", "memmap"),
        ("dataset", "image_folder"),
        ("dataset", "custom"),
        ("loader", "default"),
        ("loader", "recipe"),
        ("loader", "ssd_8core"),
        ("loader", "hdd_4core"),
        ("model", "tiny_cnn"),
        ("model", "resnet18"),
        ("model", "resnet50"),
        ("hardware", "auto"),
        ("hardware", "cpu"),
        ("hardware", "gpu"),
        ("hardware", "h200"),
    ]:
        assert expected in options


def test_loader_presets_say_when_to_pick_them():
    for yaml in (CONF / "loader").glob("*.yaml"):
        text = yaml.read_text()
        assert text.startswith(f"# python train.py loader={yaml.stem}"), yaml
        assert "_target_" not in text, f"{yaml} must be plain data"


def test_recipe_is_the_widely_copied_recipe(compose):
    loader = compose("loader=recipe", tiny=False).loader
    assert (loader.num_workers, loader.pin_memory, loader.prefetch_factor) == (4, True, 2)
    assert loader.persistent_workers is True


def test_default_is_pytorch_default(compose):
    loader = compose(tiny=False).loader
    assert loader.num_workers == 0 and loader.pin_memory is False
    assert loader.prefetch_factor is None and loader.persistent_workers is False


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("loader.num_wokers=8", "num_wokers"),
        ("loader.batch_size=big", "batch_size"),
        ("trainer.lr=fast", "lr"),
        ("loader.multiprocessing_context=spwan", "multiprocessing_context"),
        ("hardware.device=tpu", "device"),
        ("dataset.io_latency_ms=slow", "io_latency_ms"),
        ("model.widht=8", "widht"),
    ],
)
def test_typos_and_wrong_types_fail_at_composition(compose, override, key):
    with pytest.raises(ConfigCompositionException) as info:
        compose(override)
    assert key in str(info.value) or key in str(info.value.__cause__)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loader.batch_size=0"], "loader.batch_size=0 must be at least 1"),
        (["loader.num_workers=-1"], "loader.num_workers=-1"),
        (["dataset.n_samples=0"], "dataset.n_samples=0 must be positive"),
        (["dataset.image_size=-3"], "dataset.image_size=-3 must be positive"),
        (["trainer.max_steps=0"], "trainer.max_steps=0 must be at least 1"),
        (["trainer.warmup_steps=0"], "trainer.warmup_steps=0 must be at least 1"),
        (["trainer.stream=true", "trainer.epochs=2"], "trainer.stream=true has no epochs"),
        (["objective=val_accuracy"], "objective=val_accuracy needs a held-out split"),
        (["loader.prefetch_factor=2"], "loader.prefetch_factor=2 needs worker processes"),
        (["loader.persistent_workers=true"], "loader.persistent_workers=true needs worker"),
        (["loader.timeout=5"], "loader.timeout=5.0 applies to worker processes"),
        (["loader.num_workers=2", "loader.prefetch_factor=0"], "loader.prefetch_factor=0"),
        (["objective=speed"], "objective='speed' is not a metric"),
    ],
)
def test_bad_values_are_refused_before_anything_runs(compose, overrides, message):
    with pytest.raises(ConfigError, match="invalid config") as info:
        validate(compose(*overrides))
    assert message in str(info.value)


def test_all_problems_are_reported_at_once(compose):
    with pytest.raises(ConfigError) as info:
        validate(compose("loader.batch_size=0", "loader.persistent_workers=true"))
    assert "loader.batch_size" in str(info.value)
    assert "loader.persistent_workers" in str(info.value)


def test_start_method_the_os_lacks(compose, monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    cfg = compose("loader.num_workers=2", "loader.multiprocessing_context=fork")
    with pytest.raises(ConfigError, match="multiprocessing_context=fork is not available"):
        validate(cfg)


def _cpu_fingerprint() -> Fingerprint:
    return Fingerprint("cpu", 2, 2, 2.0, 8.0, 1.0, None, 0, None, None, "Linux", "3.11", "2")


def test_pin_memory_without_cuda_is_switched_off_with_a_log_line(compose, caplog):
    cfg = compose("loader=recipe")
    hw = resolve(cfg.hardware, _cpu_fingerprint())
    with caplog.at_level(logging.INFO, logger="feedrate"):
        kwargs = loader_kwargs(cfg.loader, hw)
    assert kwargs["pin_memory"] is False
    lines = [r.getMessage() for r in caplog.records if "pin_memory" in r.getMessage()]
    assert lines == ["pin_memory disabled: no CUDA device <cfg.loader.pin_memory>"]


def test_gpu_profile_without_a_gpu_is_refused(compose):
    cfg = compose("hardware=gpu")
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        resolve(cfg.hardware, _cpu_fingerprint())


def test_auto_profile_resolves_to_cpu_settings_without_a_gpu(compose):
    hw = resolve(compose().hardware, _cpu_fingerprint())
    assert hw.device == torch.device("cpu")
    assert (hw.amp_dtype, hw.channels_last, hw.pin_memory, hw.non_blocking) == (
        None,
        False,
        False,
        False,
    )


def test_cli_typo_names_the_key_without_a_traceback():
    proc = run_cli("loader.num_wokers=8")
    assert proc.returncode != 0
    assert "num_wokers" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_bad_value_exits_2_with_one_message(tmp_path):
    proc = run_cli("loader.persistent_workers=true", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    out = proc.stdout + proc.stderr
    assert "loader.persistent_workers=true needs worker processes" in out
    assert "Traceback" not in out
    assert not (tmp_path / "metrics.json").exists()
