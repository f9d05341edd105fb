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
    ("model", "custom"): ["model._target_=examples.detection.TinyDetector"],
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
        (["model.width=0"], "model.width=0 must be at least 1"),
        (["model=pooled_linear", "model.grid=-2"], "model.grid=-2 must be at least 1"),
        (["hardware.memory_limit_gb=0"], "hardware.memory_limit_gb=0.0 must be positive"),
        (["loader.worker_threads=2"], "loader.worker_threads=2 applies to worker processes"),
        (["loader.num_workers=2", "loader.worker_threads=0"], "loader.worker_threads=0 must be"),
        (["loader.main_threads=0"], "loader.main_threads=0 must be at least 1"),
        (["trainer.drift_windows=0"], "trainer.drift_windows=0 must be at least 1"),
        (["trainer.drift_rise=0"], "trainer.drift_rise=0.0 must be a share of step time"),
        (["dataset.slowdown_ms=-5"], "dataset.slowdown_ms=-5.0 must be 0 or more"),
        (
            [
                "loader.num_workers=2",
                "loader.multiprocessing_context=fork",
                "loader.worker_threads=2",
            ],
            "loader.worker_threads=2 with fork workers: OpenMP's thread pool does not survive",
        ),
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


def test_hardware_pinning_asked_for_on_a_cpu_is_switched_off_with_a_log_line(compose, caplog):
    cfg = compose("hardware.pin_memory=true", "loader=ssd_8core")  # pins as the profile says
    assert cfg.loader.pin_memory is None
    hw = resolve(cfg.hardware, _cpu_fingerprint())
    with caplog.at_level(logging.INFO, logger="feedrate"):
        assert loader_kwargs(cfg.loader, hw)["pin_memory"] is False
    lines = [r.getMessage() for r in caplog.records if "pin_memory" in r.getMessage()]
    assert lines == ["pin_memory disabled: no CUDA device <cfg.hardware.pin_memory>"]


def _gpu_fingerprint() -> Fingerprint:
    return Fingerprint(
        "cpu", 16, 32, 16.0, 128.0, 64.0, "NVIDIA H200", 1, 141.0, False, "Linux", "3.11", "2"
    )


@pytest.mark.parametrize("profile", ["auto", "gpu", "h200"])
def test_on_a_gpu_the_profile_turns_on_what_feeds_it(compose, profile, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    hw = resolve(compose(f"hardware={profile}").hardware, _gpu_fingerprint())
    assert hw.device == torch.device("cuda")
    assert hw.amp_dtype is torch.bfloat16
    assert (hw.channels_last, hw.cudnn_benchmark, hw.non_blocking, hw.pin_memory) == (
        True,
        True,
        True,
        True,
    )


def test_on_a_gpu_presets_pin_and_pytorchs_default_says_it_does_not(compose, caplog):
    hw = resolve(compose("hardware=gpu").hardware, _gpu_fingerprint())
    assert loader_kwargs(compose("loader=ssd_8core").loader, hw)["pin_memory"] is True
    with caplog.at_level(logging.INFO, logger="feedrate"):
        assert loader_kwargs(compose("loader=default").loader, hw)["pin_memory"] is False
    assert "pin_memory=false" in caplog.text, "the setting it takes, said"


def test_the_fingerprint_names_what_loaders_depend_on(tmp_path):
    import shutil

    import psutil

    from feedrate.hardware import detect

    fp = detect(tmp_path)
    assert fp.cpu_model and fp.logical_cores == psutil.cpu_count(logical=True)
    assert fp.physical_cores in (None, psutil.cpu_count(logical=False))
    assert 0 < fp.usable_cores <= fp.logical_cores
    assert fp.ram_gb == pytest.approx(psutil.virtual_memory().total / 1e9)
    assert fp.shm_gb == pytest.approx(shutil.disk_usage("/dev/shm").total / 1e9)
    assert fp.data_disk_rotational in (True, False, None)
    assert fp.gpu_count == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    line = fp.short()
    for part in (fp.cpu_model, f"{fp.logical_cores} logical", "RAM", "/dev/shm", "data on"):
        assert part in line
    gpu = _gpu_fingerprint().short()
    assert "1x NVIDIA H200 (141 GB)" in gpu and "data on SSD" in gpu


def test_every_launcher_config_composes_to_a_launcher_hydra_can_import():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import get_class

    names = sorted(p.stem for p in (CONF / "hydra" / "launcher").glob("*.yaml"))
    assert names == ["loader_trial", "lr_trial", "slurm"]
    for name in names:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF)):
            cfg = hydra_compose(
                "train", overrides=[f"hydra/launcher={name}"], return_hydra_config=True
            )
        launcher = get_class(cfg.hydra.launcher._target_)
        assert launcher.__name__ in ("FeedrateTrialLauncher", "SlurmLauncher"), name
    GlobalHydra.instance().clear()


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


def test_cli_bad_value_exits_2_with_one_message(tmp_path, train_here):
    proc = train_here("loader.persistent_workers=true", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    out = proc.stdout + proc.stderr
    assert "loader.persistent_workers=true" in out and "num_workers" in out, "both keys named"
    assert "Traceback" not in out
    assert not (tmp_path / "metrics.json").exists()
