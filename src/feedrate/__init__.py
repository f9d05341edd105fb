"""feedrate: compose a PyTorch training run from Hydra configs and measure what the device
waits for.

From a notebook or a script::

    import feedrate
    cfg = feedrate.compose(["dataset=synthetic", "loader=notebook", "trainer.max_steps=60"])
    metrics = feedrate.run(cfg)

Or only the tuned loader, in a training loop of your own::

    loader = feedrate.autotune_loader(dataset, batch_size=64, shuffle=True, budget_s=60)
"""

from feedrate import config as _config  # noqa: F401  (registers the schemas with Hydra)
from feedrate.launch import compose, run
from feedrate.resolvers import register_resolvers
from feedrate.tuning import TuningLoader, autotune_loader

register_resolvers()

__all__ = ["TuningLoader", "autotune_loader", "compose", "run"]
__version__ = "0.1.0"
