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


class PadCollate:
    """A collate class: built once from its keys, called on each batch; pads the boxes."""

    def __init__(self, pad_to: int) -> None:
        self.pad_to = pad_to

    def __call__(self, samples: list[dict]) -> dict:
        out = collate(samples)
        out["boxes"] = [nn.functional.pad(b, (0, 0, 0, self.pad_to - len(b))) for b in out["boxes"]]
        out["boxes"] = [b[: len(labels)] for b, labels in zip(out["boxes"], out["labels"])]
        return out
