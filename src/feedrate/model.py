"""Models, built from ``cfg.model`` (a ``_partial_`` target) once the classes are known."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from feedrate import targets
from feedrate.config import (
    PooledLinearConfig,
    TinyCNNConfig,
    TorchvisionModelConfig,
    execution_whitelist,
)
from feedrate.errors import ConfigError

# the keys of the built-in models' configs: a class of the user's under one of them is told
# to take model=custom
BUILTIN_KEYS = {
    name
    for schema in (TinyCNNConfig, PooledLinearConfig, TorchvisionModelConfig)
    for name in schema.__dataclass_fields__
} - set(targets.META)


class TinyCNN(nn.Module):
    """A 4x4 patchify stem, three strided conv stages and a linear head.

    Cheap enough on a CPU (about 70 ms per 64 images at 224 px on 2 cores) that the input
    pipeline, not the model, decides the pace of a CPU run.
    """

    def __init__(self, num_classes: int, width: int = 16, in_channels: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, width, 4, stride=4, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        ]
        c_in = width
        for _ in range(3):
            c_out = c_in * 2
            layers += [
                nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
            ]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class PooledLinear(nn.Module):
    """Average-pool to ``grid`` x ``grid``, then one linear layer: almost no compute.

    For measuring the input pipeline itself: with this model, samples/s is what the loader
    delivers into a real training step (host-to-device copy, normalisation, backward, update).
    """

    def __init__(self, num_classes: int, grid: int = 8, in_channels: int = 3) -> None:
        super().__init__()
        self.grid = grid
        self.head = nn.Linear(in_channels * grid * grid, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(x, self.grid)
        return self.head(torch.flatten(x, 1))


def check_model(cfg: DictConfig) -> tuple[Callable[..., nn.Module], list[str]]:
    """The class ``cfg`` names, with the keys given for it, checked against its signature
    (before any data is built); ConfigError naming the key otherwise."""
    target = cfg.get("_target_")
    cls = targets.load("model", target)
    given = [k for k in cfg if k not in targets.META]
    builtin = str(target).startswith(("feedrate.", "torchvision."))

    def hint(name: str) -> str:  # a built-in model's key, under a class of the user's
        if builtin or name not in BUILTIN_KEYS:
            return ""
        return f"; for a model of your own: model=custom model._target_={target}"

    targets.check_keys("model", str(target), cls, given, hint)
    return cls, given


def build_model(cfg: DictConfig, num_classes: Callable[[], int]) -> nn.Module:
    """The model ``cfg`` names: its keys checked against the class first, and the dataset's
    class count (``num_classes()``, read only then) passed where the class takes it."""
    target = cfg.get("_target_")
    cls, given = check_model(cfg)
    classes = targets.accepts(cls, "num_classes") and "num_classes" not in given
    need = targets.missing(cls, [*given, *(["num_classes"] * classes)])
    if need:
        raise ConfigError(
            f"model._target_={target} needs {need[0]}, which the config does not give:"
            f" add it with +model.{need[0]}=<value>"
        )
    factory: Callable[..., nn.Module] = instantiate(
        {**OmegaConf.to_container(cfg, resolve=True), "_partial_": True},
        _execution_whitelist_=execution_whitelist(target),
    )
    return factory(**({"num_classes": num_classes()} if classes else {}))
