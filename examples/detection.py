"""Detection-style training with your own model, step and collate function (docs/custom.md).

Each sample is a dict: an image and the boxes in it, one to four of them, so the default
collate (which stacks every field) cannot batch it. `collate` stacks the images and keeps the
boxes and their labels as lists; `detection_step` turns such a batch into a loss of its own;
`TinyDetector` predicts a fixed number of box slots.

    python train.py dataset=custom dataset._target_=examples.detection.Shapes \\
        model=custom model._target_=examples.detection.TinyDetector +model.hidden=32 \\
        trainer.step._target_=examples.detection.detection_step \\
        loader.collate_fn._target_=examples.detection.collate
"""

import time

import torch
from torch import nn
from torch.utils.data import Dataset

SLOTS = 4  # boxes a detector predicts per image; the rest of its slots say "nothing"


class Shapes(Dataset):
    """Images of 1 to ``SLOTS`` filled rectangles on noise, each a square, a wide or a tall
    one: ``{"image": uint8 3xSxS, "boxes": float Nx4 (x0, y0, x1, y1 in 0..1), "labels":
    int64 N}``. Reading one waits ``sleep_ms`` (a store's latency); fixed by the index."""

    classes = ["square", "wide", "tall"]

    def __init__(self, length: int = 4096, size: int = 64, sleep_ms: float = 2.0) -> None:
        if size <= 24:
            raise ValueError(f"Shapes(size={size}): at least 25 px, the widest shape is 24")
        self.length, self.size, self.sleep_s = length, size, sleep_ms / 1000

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(index)
        s = self.size
        image = torch.randint(0, 60, (3, s, s), generator=g, dtype=torch.uint8)
        n = int(torch.randint(1, SLOTS + 1, (1,), generator=g))
        labels = torch.randint(0, len(self.classes), (n,), generator=g)
        boxes = []
        for label in labels.tolist():
            w, h = {0: (16, 16), 1: (24, 10), 2: (10, 24)}[label]
            x0 = int(torch.randint(0, s - w, (1,), generator=g))
            y0 = int(torch.randint(0, s - h, (1,), generator=g))
            image[label, y0 : y0 + h, x0 : x0 + w] = 255
            boxes.append([x0 / s, y0 / s, (x0 + w) / s, (y0 + h) / s])
        return {"image": image, "boxes": torch.tensor(boxes), "labels": labels}


def collate(samples: list[dict]) -> dict:
    """A batch: the images stacked, the boxes and labels a list of one tensor per image."""
    return {
        "images": torch.stack([s["image"] for s in samples]),
        "boxes": [s["boxes"] for s in samples],
        "labels": [s["labels"] for s in samples],
    }


class TinyDetector(nn.Module):
    """A small conv backbone and a head that predicts ``SLOTS`` boxes per image: for each,
    class logits (the dataset's classes and "nothing") and its corners."""

    def __init__(self, num_classes: int, hidden: int = 32) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.backbone = nn.Sequential(
            nn.Conv2d(3, hidden, 4, stride=4),
            nn.ReLU(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
        )
        self.head = nn.Linear(hidden * 16, SLOTS * (num_classes + 1 + 4))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(self.backbone(images)).view(len(images), SLOTS, -1)
        return out[..., : self.num_classes + 1], out[..., self.num_classes + 1 :].sigmoid()


def detection_step(model: nn.Module, batch: dict, normalise, box_weight: float = 5.0):
    """The loss of a batch: each image's boxes fill its first slots in order; a slot's class
    (or "nothing") by cross-entropy, a filled slot's corners by L1. No logits and labels are
    returned, so the run reports the loss and no accuracy."""
    logits, corners = model(normalise(batch["images"]))
    nothing = logits.shape[-1] - 1
    target = torch.full(logits.shape[:2], nothing, dtype=torch.long, device=logits.device)
    box_loss = logits.new_zeros(())
    for i, (boxes, labels) in enumerate(zip(batch["boxes"], batch["labels"], strict=True)):
        n = len(labels)
        target[i, :n] = labels
        box_loss = box_loss + nn.functional.l1_loss(corners[i, :n], boxes, reduction="sum")
    class_loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    filled = sum(len(labels) for labels in batch["labels"])
    return {"loss": class_loss + box_weight * box_loss / max(filled, 1)}
