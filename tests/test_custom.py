"""Your own model, training step and collate function in the launcher (docs/custom.md), with
examples/detection.py as a user would bring them: dict samples holding a varying number of
boxes, a step with a loss of its own, a collate function that keeps the boxes as lists."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

import feedrate
from examples.detection import Shapes, TinyDetector, collate, detection_step
from feedrate.errors import ConfigError, DatasetError
from feedrate.loader import user_collate
from feedrate.model import build_model
from feedrate.steps import Step
from feedrate.tuning.preset import plain_data_problems

from .conftest import CONF, ROOT, shrink
from .test_resume import _signal_when, _state

DETECTION = [
    "dataset=custom",
    "dataset._target_=examples.detection.Shapes",
    "+dataset.length=256",
    "+dataset.size=32",
    "+dataset.sleep_ms=0",
    "model=custom",
    "model._target_=examples.detection.TinyDetector",
    "+model.hidden=8",
    "trainer.step._target_=examples.detection.detection_step",
    "loader.collate_fn._target_=examples.detection.collate",
]


MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)  # the loop's normalisation
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def _loss(model: torch.nn.Module, batch: dict) -> float:
    model.eval()
    with torch.no_grad():
        out = detection_step(model, batch, lambda x: (x.float() / 255 - MEAN) / STD)
    return float(out["loss"])


def test_a_model_step_and_collate_of_your_own_train(tmp_path):
    cfg = feedrate.compose(
        shrink([*DETECTION, "trainer.max_steps=60", "trainer.val_fraction=0.25"]),
        config_dir=CONF,
    )
    metrics = feedrate.run(cfg, tmp_path)
    assert metrics["steps"] == 60 and metrics["samples_per_sec"] > 0
    # the step gives no logits and labels: a loss, no accuracy, in training and held out
    assert metrics["final_loss"] > 0 and metrics["train_accuracy"] is None
    assert metrics["val_loss"] > 0 and metrics["val_accuracy"] is None
    assert metrics["run"]["loader"]["collate_fn"] == {"_target_": "examples.detection.collate"}
    # it learned: on a batch of its data the trained model's loss is well below the untrained
    batch = collate([Shapes(size=32, sleep_ms=0)[i] for i in range(64)])
    torch.manual_seed(0)
    trained, fresh = TinyDetector(3, hidden=8), TinyDetector(3, hidden=8)
    trained.load_state_dict(_state(tmp_path)["model"])
    assert _loss(trained, batch) < 0.7 * _loss(fresh, batch)


def test_num_classes_is_passed_only_where_the_model_takes_it():
    def no_classes():
        raise AssertionError("asked the dataset for its classes")

    own = OmegaConf.create({"_target_": "tests.custom_parts.NoClasses", "hidden": 4})
    assert isinstance(build_model(own, no_classes), TinyDetector)
    takes = OmegaConf.create({"_target_": "examples.detection.TinyDetector"})
    assert build_model(takes, lambda: 5).num_classes == 5

    class Unlabelled(torch.utils.data.Dataset):
        pass

    from feedrate.dataset import num_classes

    with pytest.raises(DatasetError, match=r"the model takes num_classes.*\+model.num_classes=N"):
        build_model(takes, lambda: num_classes(Unlabelled()))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model._target_=nowhere.Net"],
            "model._target_=nowhere.Net cannot be imported (ModuleNotFoundError: no module"
            " named 'nowhere'): check the spelling",
        ),
        (
            ["+model.hiden=3"],
            "model.hiden is not an argument of examples.detection.TinyDetector, which takes:"
            " num_classes, hidden. Fix the key, or drop it ('~model.hiden' on the command line)",
        ),
        (
            ["model=custom", "model._target_=tests.custom_parts.NeedsDepth"],
            "model._target_=tests.custom_parts.NeedsDepth needs depth, which the config does"
            " not give: add it with +model.depth=<value>",
        ),
        (
            # a built-in model's config for a class of your own: its keys are not the class's
            ["model=resnet18", "model._target_=examples.detection.TinyDetector"],
            "model.weights is not an argument of examples.detection.TinyDetector, which takes:"
            " num_classes, hidden. Fix the key, or drop it ('~model.weights' on the command"
            " line); for a model of your own: model=custom model._target_=",
        ),
        (
            ["trainer.step._target_=tests.custom_parts.no_loss_step"],
            "trainer.step._target_=tests.custom_parts.no_loss_step returned a dict with logits,"
            " corners, not a loss: return the loss",
        ),
        (
            ["loader.collate_fn._target_=tests.custom_parts.broken_collate"],
            "loader.collate_fn._target_=tests.custom_parts.broken_collate failed on a batch of"
            " 16 samples (a dict with image, boxes, labels each): KeyError: 'img'. Fix the"
            " function",
        ),
        (
            ["+trainer.step.box_wieght=2"],
            "trainer.step.box_wieght is not an argument of examples.detection.detection_step,"
            " which takes: model, batch, normalise, box_weight",
        ),
        (
            ["objective=val_accuracy", "trainer.val_fraction=0.25"],
            "objective=val_accuracy is an accuracy, and trainer.step._target_="
            "examples.detection.detection_step returns no logits and labels to score",
        ),
        (
            ["model=custom", "~model._target_"],
            "model._target_ is not set: name your class or function by its import path",
        ),
        (
            ["loader.num_workers=0", "loader.collate_fn=tests.custom_parts.broken_collate"],
            "loader.collate_fn._target_=tests.custom_parts.broken_collate failed on a batch of"
            " 16 samples",
        ),
        (
            ["loader.collate_fn._target_=tests.custom_parts.SizedCollate"],
            "loader.collate_fn._target_=tests.custom_parts.SizedCollate needs size, which the"
            " config does not give: add it with +loader.collate_fn.size=<value>",
        ),
        (
            # Hydra keeps the last: the short form replaced the key given before it
            ["+trainer.step.box_weight=2", "trainer.step=examples.detection.detection_step"],
            "trainer.step is given keys (box_weight) and the short form"
            " trainer.step=examples.detection.detection_step: with keys, name the function or"
            " class as trainer.step._target_=my_pkg.module.name",
        ),
        (
            ["trainer.step._target_=feedrate.steps.classify"],
            "the training step trainer.step._target_=feedrate.steps.classify trains (images,"
            " labels) batches, and the batch is a dict with images, boxes, labels: name a step"
            " of your own",
        ),
    ],
    ids=[
        "model-target",
        "model-key",
        "model-missing-key",
        "builtin-schema",
        "no-loss",
        "collate-fails",
        "step-key",
        "accuracy-objective",
        "model-unset",
        "collate-fails-in-process",
        "collate-class-key",
        "short-form-after-its-key",
        "default-step-dict-samples",
    ],
)
def test_what_is_wrong_with_your_own_parts_is_one_line_that_names_the_key(
    tmp_path, overrides, expected, train_here
):
    base = DETECTION
    if any(o.startswith("model=") for o in overrides):  # a model config of its own
        base = [o for o in DETECTION if not o.startswith(("model", "+model"))]
    proc = train_here(
        *shrink([*base, "loader.num_workers=2", *overrides, f"hydra.run.dir={tmp_path}"])
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert expected in out, out[-3000:]
    assert "Traceback" not in out
    assert not (tmp_path / "metrics.json").exists()


def test_a_key_beside_a_part_named_in_short_is_refused_in_either_order(compose):
    from feedrate import targets

    short = "trainer.step=examples.detection.detection_step"
    keys_then = compose(*DETECTION, short, "+trainer.step.box_weight=2")  # the keys replace it
    with pytest.raises(ConfigError, match=r"trainer.step is given keys \(box_weight\) and no _"):
        Step(keys_then.trainer.step)
    then_keys = ["+trainer.step.box_weight=2", short]  # it replaces the keys
    with pytest.raises(ConfigError, match=r"and the short form trainer.step=examples.detec"):
        targets.check_short_forms(compose(*DETECTION, *then_keys), then_keys)
    named = [
        "trainer.step._target_=examples.detection.detection_step",
        "+trainer.step.box_weight=2",
    ]
    targets.check_short_forms(compose(*DETECTION, *named), named)  # the way to give keys
    assert Step(compose(*DETECTION, *named).trainer.step) is not None


def test_a_key_your_model_does_not_take_says_model_custom_only_under_a_builtin_config():
    from feedrate.model import check_model

    under_custom = {"_target_": "examples.detection.TinyDetector", "_partial_": True, "hiden": 3}
    with pytest.raises(ConfigError) as typo:
        check_model(OmegaConf.create(under_custom))
    assert str(typo.value).endswith("('~model.hiden' on the command line)")
    under_builtin = {"_target_": "examples.detection.TinyDetector", "_partial_": True, "width": 16}
    with pytest.raises(ConfigError, match=r"for a model of your own: model=custom model._target_="):
        check_model(OmegaConf.create(under_builtin))


def test_what_a_step_returns_is_checked():
    step = Step({"_target_": "examples.detection.detection_step"})
    assert step.takes_normalise and not step.classifies
    loss = torch.tensor(1.0, requires_grad=True)
    assert step.checked(loss).loss is loss and not step.checked(loss).scored
    for wrong, says in [
        (None, "returned None, not a loss"),
        ({"loss": torch.ones(3)}, "returned a loss that is a tensor of shape (3,), not one"),
        (torch.tensor(1.0), "returned a loss that does not depend on the model's parameters"),
    ]:
        with pytest.raises(ConfigError, match=rf"detection_step {re.escape(says)}"):
            step.checked(wrong)
    assert step.checked(torch.tensor(1.0), training=False).loss == 1.0  # evaluation: no grad


@pytest.mark.parametrize(
    ("target", "says"),
    [
        (
            "unpacked_step",
            "takes (model, images, labels), and the loop calls it as step(model, batch):"
            " missing a required argument: 'labels'. Give it with +trainer.step.labels=<value>,"
            " or take the batch as one argument and read its parts inside",
        ),
        (
            "batch_only_step",
            "takes (batch), and the loop calls it as step(model, batch): too many positional"
            " arguments. Make its first arguments (model, batch)",
        ),
        (  # normalise, passed by keyword, is taken for the batch's place
            "no_model_step",
            "takes (batch, normalise), and the loop calls it as step(model, batch): multiple"
            " values for argument 'normalise'. Make its first arguments (model, batch)",
        ),
        (
            "StepHolder.step",  # a method named through its class: self is not given
            "takes (self, model, batch), and the loop calls it as step(model, batch): missing"
            " a required argument: 'batch'. Make its first arguments (model, batch)",
        ),
        (
            "weighted_step",
            "takes (model, batch, *, weight), and the loop calls it as step(model, batch):"
            " missing a required argument: 'weight'. Give it with +trainer.step.weight=<value>",
        ),
        (
            "NotCallable",
            "is a class whose instances cannot be called: give it a __call__ that takes what"
            " step(model, batch) passes",
        ),
    ],
)
def test_a_step_the_loop_cannot_call_is_named_before_the_run(target, says):
    with pytest.raises(ConfigError) as caught:
        Step({"_target_": f"tests.custom_parts.{target}"})
    assert str(caught.value).startswith(f"trainer.step._target_=tests.custom_parts.{target} {says}")


@pytest.mark.parametrize(
    "node",
    [
        {"_target_": "tests.custom_parts.keyword_step"},  # normalise by keyword only
        {"_target_": "tests.custom_parts.any_step"},  # *args, **kwargs
        {"_target_": "tests.custom_parts.CallableStep", "scale": 2.0},  # an instance
        {"_target_": "tests.custom_parts.weighted_step", "weight": 0.5},
        {"_target_": "examples.detection.detection_step"},
    ],
    ids=lambda node: node["_target_"].rsplit(".", 1)[1],
)
def test_steps_the_loop_can_call_are_taken(node):
    step = Step(node)
    model = TinyDetector(3, hidden=4)
    batch = collate([Shapes(size=32, sleep_ms=0)[i] for i in range(2)])
    assert step(model, batch, lambda x: x.float() / 255).loss.requires_grad


def test_a_collate_function_with_a_setting_of_its_own_is_told_where_to_give_it():
    with pytest.raises(ConfigError) as caught:
        user_collate("tests.custom_parts.padded_collate")
    assert str(caught.value) == (
        "loader.collate_fn._target_=tests.custom_parts.padded_collate takes (samples, pad_to),"
        " and the loop calls it as collate_fn(samples): missing a required argument:"
        " 'pad_to'. Give it with +loader.collate_fn.pad_to=<value>, or take the samples as one"
        " argument and read its parts inside (docs/custom.md)"
    )
    padded = user_collate({"_target_": "tests.custom_parts.padded_collate", "pad_to": 4})
    samples = [Shapes(size=32, sleep_ms=0)[i] for i in range(3)]
    assert [len(b) for b in padded(samples)["boxes"]] == [4, 4, 4]


def test_a_stream_of_dict_samples_trains_and_its_split_is_checked(tmp_path):
    stream = [*DETECTION, "dataset._target_=tests.custom_parts.ShapeStream"]
    stream += ["loader.num_workers=2", "trainer.max_steps=20"]
    metrics = feedrate.run(feedrate.compose(shrink(stream), config_dir=CONF), tmp_path / "split")
    assert metrics["steps"] == 20 and metrics["final_loss"] > 0
    unsplit = [*stream, "dataset._target_=tests.custom_parts.UnsplitShapeStream"]
    with pytest.raises(DatasetError, match="every DataLoader worker reads the same samples"):
        feedrate.run(feedrate.compose(shrink(unsplit), config_dir=CONF), tmp_path / "unsplit")


def test_loader_autotune_tunes_a_loader_of_your_own_collate(tmp_path, monkeypatch):
    monkeypatch.setattr("feedrate.tuning.loader.window_seconds", lambda budget_s: 0.15)
    cfg = feedrate.compose(
        shrink(
            [
                *DETECTION,
                "dataset.sleep_ms=2",
                "loader=autotune",
                "loader.num_workers=0",
                "loader.prefetch_factor=null",
                "loader.persistent_workers=false",
                "trainer.max_steps=120",
                "trainer.autotune.write_preset=false",
                "trainer.autotune.max_workers=8",
                "trainer.autotune.budget_s=600",
            ]
        ),
        config_dir=CONF,
    )
    metrics = feedrate.run(cfg, tmp_path)
    tried = metrics["autotune"]["tried"]
    assert len(tried) >= 2, tried  # it switched loaders, each with the user's collate
    assert metrics["steps"] == 120 and metrics["train_accuracy"] is None


@pytest.mark.slow
def test_a_sweep_of_your_own_parts_writes_a_preset_of_loader_settings_only(tmp_path):
    """The sweep measures the user's real step; its preset holds loader settings, not the
    collate function (code), which the next run names beside it."""
    shutil.copy(ROOT / "train.py", tmp_path / "train.py")  # a project: its preset lands here
    shutil.copytree(ROOT / "conf", tmp_path / "conf")
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "-m",
            "sweep=loader",
            *shrink([*DETECTION, "dataset.sleep_ms=2"]),
            "sweep.preset_name=mine",
            "sweep.max_workers=4",
            "hydra.sweeper.n_trials=2",
            "sweep.final_rounds=1",
            f"hydra.sweep.dir={tmp_path}/multirun",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    preset = tmp_path / "conf" / "loader" / "mine.yaml"
    assert plain_data_problems(preset) == []  # data: no _target_, nothing Hydra would call
    written = OmegaConf.to_container(OmegaConf.load(preset))
    assert "collate_fn" not in written
    assert written["measured_on"]["workload"]["collate_fn"] == "examples.detection.collate"
    loaded = feedrate.compose(shrink([*DETECTION, "loader=mine"]), config_dir=tmp_path / "conf")
    assert loaded.loader.collate_fn._target_ == "examples.detection.collate"
    assert loaded.loader.num_workers == OmegaConf.load(preset).num_workers


@pytest.mark.slow
def test_a_run_of_your_own_parts_resumes_to_the_same_weights(tmp_path):
    run = [*DETECTION, "dataset.sleep_ms=4", "loader.num_workers=2", "trainer.max_steps=60"]
    run += ["trainer.checkpoint_every=5"]
    reference = tmp_path / "reference"
    feedrate.run(feedrate.compose(shrink(run), config_dir=CONF), reference)
    stopped_dir = tmp_path / "stopped"
    ckpt = stopped_dir / "checkpoints" / "last.pt"

    def ready(_pid: int) -> bool:
        return ckpt.exists() and torch.load(ckpt, weights_only=True)["step"] >= 20

    stopped, _ = _signal_when([*run, f"hydra.run.dir={stopped_dir}"], ready, signal.SIGKILL)
    assert stopped.returncode == -signal.SIGKILL, stopped.stdout[-2000:]
    assert 20 <= _state(stopped_dir)["step"] < 60
    resumed = subprocess.run(
        [sys.executable, "train.py", *shrink(run), f"hydra.run.dir={stopped_dir}"]
        + ["trainer.resume=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final, expected = _state(stopped_dir), _state(reference)
    assert final["step"] == 60
    torch.testing.assert_close(final["model"], expected["model"])
    torch.testing.assert_close(final["optimizer"], expected["optimizer"])
    metrics = json.loads((stopped_dir / "metrics.json").read_text())
    assert metrics["train_accuracy"] is None


@pytest.mark.slow
def test_two_ranks_train_your_own_parts(tmp_path, torchrun_here):
    """Under torchrun each rank moves its dict batches to its device and runs the user's
    step through DDP; rank 0 writes the metrics of both."""
    proc = torchrun_here(
        2,
        *shrink([*DETECTION, "loader.num_workers=1", "trainer.max_steps=10"]),
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 10
    assert metrics["final_loss"] > 0 and metrics["train_accuracy"] is None


@pytest.mark.parametrize(
    "extra",
    [
        ["trainer.step=tests.custom_parts.first_box_step", "trainer.val_fraction=0.25"],
        [
            "loader.collate_fn._target_=tests.custom_parts.SizedCollate",
            "+loader.collate_fn.size=32",
        ],
        ["trainer.measure=loader"],
        ["trainer.measure=compute"],
        ["loader.num_workers=2", "loader.multiprocessing_context=forkserver"],
    ],
    ids=["accuracy", "collate-class", "measure-loader", "measure-compute", "forkserver"],
)
def test_your_own_parts_in_every_mode(tmp_path, extra):
    metrics = feedrate.run(
        feedrate.compose(shrink([*DETECTION, *extra]), config_dir=CONF), tmp_path
    )
    assert metrics["steps"] == 8 and metrics["samples_per_sec"] > 0
    if "trainer.val_fraction=0.25" in extra:  # a step that scores: accuracy, held out too
        assert 0 <= metrics["train_accuracy"] <= 1 and 0 <= metrics["val_accuracy"] <= 1
    elif "trainer.measure=loader" in extra:  # no model step: no loss
        assert metrics["final_loss"] is None
    else:
        assert metrics["final_loss"] > 0 and metrics["train_accuracy"] is None


def test_the_doctor_reads_your_own_collate(capsys):
    from feedrate import doctor

    doctor.main(shrink([*DETECTION, "loader.num_workers=2"]))
    out = capsys.readouterr().out
    assert "samples of a dict with image, boxes, labels" in out
    assert "Traceback" not in out and "unsafe" not in out.split("Dataset")[1].split("\n\n")[0]
