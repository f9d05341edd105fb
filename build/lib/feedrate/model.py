"""Models, built from ``cfg.model`` (a ``_partial_`` target) once the classes are known."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from feedrate.config import execution_whitelist


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


def build_model(cfg: DictConfig, num_classes: int) -> nn.Module:
    factory: Callable[..., nn.Module] = instantiate(
        cfg, _execution_whitelist_=execution_whitelist(cfg.get("_target_"))
    )
    return factory(num_classes=num_classes)
