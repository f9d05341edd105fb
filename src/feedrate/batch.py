"""Batches of any structure a collate function makes: a tensor, or tuples, lists and dicts of
them at any depth (detection targets, ragged sequences, a model's keyword inputs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch


def apply(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with ``fn`` applied to each of its tensors, the structure kept."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: apply(v, fn) for k, v in batch.items()}) if batch else batch
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(apply(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(apply(v, fn) for v in batch)
    return batch


def tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``batch``, in order."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from tensors(v)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Every tensor of ``batch`` on ``device``."""
    return apply(batch, lambda t: t.to(device, non_blocking=non_blocking))


def batch_len(batch: Any) -> int | None:
    """Samples in ``batch``: the first dimension of its first tensor at the top level (the
    images of ``(images, labels)`` or of a dict); where the top level holds none, the length
    of a list of per-sample items there (boxes that vary in number); else one level down."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() else None
    parts = list(batch.values()) if isinstance(batch, Mapping) else batch
    if not isinstance(parts, (list, tuple)):
        return None
    for part in parts:
        if isinstance(part, torch.Tensor) and part.dim():
            return len(part)
    for part in parts:
        if isinstance(part, list) and part:
            return len(part)
    for part in parts:
        n = batch_len(part)
        if n is not None:
            return n
    return None


def nbytes(sample: Any) -> int:
    """Bytes of the tensors and arrays in one sample (what a batch of it moves, per sample)."""
    if isinstance(sample, np.ndarray):
        return int(sample.nbytes)
    if isinstance(sample, torch.Tensor):
        return sample.element_size() * sample.nelement()
    if isinstance(sample, Mapping):
        return sum(nbytes(v) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        return sum(nbytes(v) for v in sample)
    return 0


def describe(value: Any) -> str:
    """A value's structure in a few words, for an error: ``a dict with boxes, image``."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a dict with {', '.join(map(str, value)) or 'nothing'}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else f"a {type(value).__name__}"
