"""A user's own parts that go wrong, for tests/test_custom.py: a step that returns no loss,
a collate function that fails, a model that needs a key the config does not give, steps
that cannot be called as the loop calls them, streams of dict samples."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import IterableDataset, get_worker_info

from examples.detection import Shapes, TinyDetector, collate


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


def unpacked_step(model, images, labels):
    """Takes the batch's parts as arguments: the loop passes the batch whole."""
    return nn.functional.cross_entropy(model(images)[0][:, 0], labels)


def batch_only_step(batch):
    """Forgot the model."""
    return batch["images"].float().mean()


class ShapeStream(IterableDataset):
    """examples.detection.Shapes as a stream of dict samples, each worker reading its share."""

    classes = Shapes.classes

    def __init__(self, length: int = 256, size: int = 32, sleep_ms: float = 0.0) -> None:
        self.shapes = Shapes(length, size, sleep_ms)

    def __len__(self) -> int:
        return len(self.shapes)

    def __iter__(self):
        info = get_worker_info()
        every, first = (info.num_workers, info.id) if info is not None else (1, 0)
        for index in range(first, len(self.shapes), every):
            yield self.shapes[index]


class UnsplitShapeStream(ShapeStream):
    """Every worker reads every sample: trained on once per worker."""

    def __iter__(self):
        for index in range(len(self.shapes)):
            yield self.shapes[index]


def padded_collate(samples, pad_to):
    """A collate function with a setting of its own, given as +loader.collate_fn.pad_to=N."""
    batch = collate(samples)
    batch["boxes"] = [nn.functional.pad(b, (0, 0, 0, pad_to - len(b))) for b in batch["boxes"]]
    return batch


def no_model_step(batch, normalise):
    """Forgot the model, and names normalise."""
    return normalise(batch["images"]).mean()


class StepHolder:
    def step(self, model, batch):
        return model(batch["images"])[0].mean()


def weighted_step(model, batch, *, weight):
    """A setting of its own, by keyword only: given as +trainer.step.weight=W."""
    logits, corners = model(batch["images"].float())
    return weight * (logits.mean() + corners.mean())


class NotCallable:
    """A class named as a step: its instances are not functions."""


def keyword_step(model, batch, *, normalise):
    logits, _ = model(normalise(batch["images"]))
    return logits.mean()


def any_step(*args, **kwargs):
    model, batch = args
    logits, _ = model(kwargs["normalise"](batch["images"]))
    return logits.mean()


class CallableStep:
    """A step class: built from its keys, its instance called on each batch."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, model, batch, normalise):
        logits, _ = model(normalise(batch["images"]))
        return self.scale * logits.mean()
