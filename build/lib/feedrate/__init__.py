"""feedrate: compose a PyTorch training run from Hydra configs and measure what the device
waits for.

From a notebook or a script::

    import feedrate
    cfg = feedrate.compose(["dataset=synthetic", "loader=notebook", "trainer.max_steps=60"])
    metrics = feedrate.run(cfg)
"""

from feedrate import config as _config  # noqa: F401  (registers the schemas with Hydra)
from feedrate.launch import compose, run
from feedrate.resolvers import register_resolvers

register_resolvers()

__all__ = ["compose", "run"]
__version__ = "0.1.0"
