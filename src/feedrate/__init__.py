"""feedrate: compose a PyTorch training run from Hydra configs and measure what the device
waits for.

From a notebook or a script::

    import feedrate
    cfg = feedrate.compose(["dataset=synthetic", "loader=notebook", "trainer.max_steps=60"])
    metrics = feedrate.run(cfg)

Or only the tuned loader, in a training loop of your own::

    loader = feedrate.autotune_loader(dataset, batch_size=64, shuffle=True, budget_s=60)

The names load their modules when first used: ``import feedrate.tuning.policy`` (the pure
policy) loads neither torch's loaders nor Hydra nor the launcher.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from feedrate.launch import compose, run
    from feedrate.tuning import TuningLoader, autotune_loader

__all__ = ["TuningLoader", "autotune_loader", "compose", "run"]
__version__ = "0.1.0"

_HOME = {
    "compose": "feedrate.launch",  # which registers the schemas and resolvers (feedrate.config)
    "run": "feedrate.launch",
    "TuningLoader": "feedrate.tuning",
    "autotune_loader": "feedrate.tuning",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'feedrate' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
