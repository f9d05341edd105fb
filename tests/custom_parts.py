"""A user's own parts that go wrong, for tests/test_custom.py: a step that returns no loss,
a collate function that fails, a model that needs a key the config does not give."""

from __future__ import annotations

import torch
from torch import nn

from examples.detection import TinyDetector, collate


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


def first_box_step(model, batch, normalise):
    """Scores each image's first box: the logits and labels of slot 0, for accuracy."""
    logits, _ = model(normalise(batch["images"]))
    labels = torch.stack([labels[0] for labels in batch["labels"]])
    first = logits[:, 0]
    return {"loss": nn.functional.cross_entropy(first, labels), "logits": first, "labels": labels}


class SizedCollate:
    """A collate class: built once from its keys, its instance called on each batch; it
    checks the images' size, then collates as examples.detection.collate does."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, samples: list[dict]) -> dict:
        sizes = {tuple(s["image"].shape[1:]) for s in samples}
        if sizes != {(self.size, self.size)}:
            raise ValueError(f"images of {sizes}, not {self.size} px")
        return collate(samples)
