"""A user's own parts that go wrong, for tests/test_custom.py: a step that returns no loss,
a collate function that fails, a model that needs a key the config does not give."""

from __future__ import annotations

from torch import nn

from examples.detection import TinyDetector


def no_loss_step(model, batch, normalise):
    """Forgot to return the loss: gives the model's outputs."""
    logits, corners = model(normalise(batch["images"]))
    return {"logits": logits, "corners": corners}


def broken_collate(samples):
    """Reads a key the samples do not have."""
    return {"images": [s["img"] for s in samples]}


class NeedsDepth(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Identity() for _ in range(depth)))


class NoClasses(TinyDetector):
    """A detector that fixes its own classes: it takes no num_classes."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__(num_classes=3, hidden=hidden)
