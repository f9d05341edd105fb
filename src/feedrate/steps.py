"""The training step: what turns a batch into a loss (``trainer.step``).

The loop moves every tensor of the batch to the device, runs the step under autocast, then
does the backward pass and the optimiser's step. A step is a function of the model and the
batch, in whatever structure the collate function made; it returns the loss, or a dict with
``loss`` and, for accuracy, ``logits`` and ``labels``:

    def detection_step(model, batch, normalise):
        out = model(normalise(batch["images"]))
        return {"loss": box_loss(out, batch["boxes"]) + class_loss(out, batch["labels"])}

``normalise`` (uint8 to float, the mean and spread, channels_last) is passed where the step
names it; a step that does not name it gets its tensors as the loader made them. Keys given
beside ``_target_`` (``+trainer.step.weight=2``) are passed to it by keyword.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from feedrate import targets
from feedrate.batch import describe
from feedrate.config import DEFAULT_STEP
from feedrate.errors import ConfigError

DEFAULT = DEFAULT_STEP


def classify(model: nn.Module, batch: Any, normalise: Callable[..., torch.Tensor]) -> dict:
    """feedrate's step: ``(images, labels)`` batches, the cross-entropy of the logits."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ConfigError(
            f"the training step trainer.step._target_={DEFAULT} trains (images, labels)"
            f" batches, and the batch is {describe(batch)}: name a step of your own that turns"
            " it into a loss (trainer.step._target_=my_pkg.steps.my_step, docs/custom.md)"
        )
    images, labels = batch
    logits = model(normalise(images))
    return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits, "labels": labels}


@dataclass
class Output:
    """What a step gave: the loss, and the logits and labels where it gave them."""

    loss: torch.Tensor
    logits: torch.Tensor | None = None
    labels: torch.Tensor | None = None

    @property
    def scored(self) -> bool:
        return self.logits is not None and self.labels is not None

    @property
    def parts(self) -> tuple:
        """(loss, logits, labels), as the meter takes them."""
        return self.loss, self.logits, self.labels


class Step:
    """``trainer.step`` resolved and checked before anything runs: ``step(model, batch,
    normalise)`` calls the user's function and checks what it returned."""

    def __init__(self, cfg: DictConfig | Mapping | None, objective: str = "") -> None:
        cfg = {"_target_": DEFAULT} if cfg is None else cfg
        self.objective = objective  # the run returns it: an accuracy needs logits and labels
        self.target = str(targets.target_of(cfg))
        self.fn = targets.bound(
            "trainer.step", cfg, call="step(model, batch)", passed=("normalise",)
        )
        given = targets.keys_of(cfg)
        self.takes_normalise = targets.accepts(self.fn, "normalise") and "normalise" not in given
        self.classifies = self.target == DEFAULT

    def __call__(
        self, model: nn.Module, batch: Any, normalise: Callable, training: bool = True
    ) -> Output:
        extra = {"normalise": normalise} if self.takes_normalise else {}
        return self.checked(self.fn(model, batch, **extra), training)

    def checked(self, out: Any, training: bool = True) -> Output:
        """``out`` as an :class:`Output`, or a ConfigError that says what was wrong with it."""
        if isinstance(out, torch.Tensor):
            got = Output(out)
        elif isinstance(out, Mapping) and "loss" in out:
            got = Output(out["loss"], out.get("logits"), out.get("labels"))
        else:
            raise self._wrong(f"returned {describe(out)}, not a loss")
        if not isinstance(got.loss, torch.Tensor) or got.loss.numel() != 1:
            raise self._wrong(f"returned a loss that is {describe(got.loss)}, not one number")
        if training and not got.loss.requires_grad:
            raise self._wrong(
                "returned a loss that does not depend on the model's parameters (no gradient):"
                " compute it from the model's output"
            )
        if got.scored and _scores(got) is not None:
            raise self._wrong(_scores(got))
        if self.objective.endswith("accuracy") and not got.scored:
            raise ConfigError(
                f"objective={self.objective} is an accuracy, and trainer.step._target_="
                f"{self.target} returns no logits and labels to score: return them in its"
                " dict, or optimise the loss (objective=val_loss"
                " hydra.sweeper.direction=minimize)"
            )
        return got

    def _wrong(self, what: str) -> ConfigError:
        return ConfigError(
            f"trainer.step._target_={self.target} {what}: return the loss (a tensor of one"
            " element), or a dict with 'loss' (and 'logits' and 'labels' for accuracy)"
        )


def _scores(got: Output) -> str | None:
    """What is wrong with the logits and labels for scoring, or None: class scores along
    dimension 1, one label for each of the rest (a sample's, a pixel's, a token's)."""
    logits, labels = got.logits, got.labels
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return f"returned logits and labels that are {describe(logits)} and {describe(labels)}"
    if logits.dim() < 2 or logits.shape[:1] + logits.shape[2:] != labels.shape:
        return (
            f"returned logits of shape {tuple(logits.shape)} and labels of shape"
            f" {tuple(labels.shape)}, which do not pair (class scores along dimension 1, one"
            " label for each of the rest)"
        )
    return None
