"""Several clients' batches as one stacked batch (vectorized clients): stacking, the shape
key that says which batches stack together, and a batch's size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten


def stack_batches(batches: Sequence[Any]) -> Any:
    """Stack the same-shaped batches of several clients along a new leading dimension."""
    first = batches[0]
    if isinstance(first, (list, tuple)) and all(isinstance(t, Tensor) for t in first):
        return [torch.stack(column) for column in zip(*batches)]  # the common (x, y) case
    leaves = [tree_flatten(b)[0] for b in batches]
    spec = tree_flatten(first)[1]
    return tree_unflatten([torch.stack(column) for column in zip(*leaves)], spec)


def batch_shape_key(batch: Any) -> tuple:
    """The shapes of a batch's tensors (batches of one key stack together)."""
    if isinstance(batch, (list, tuple)) and all(isinstance(t, Tensor) for t in batch):
        return tuple(t.shape for t in batch)
    return tuple(
        tuple(leaf.shape) if isinstance(leaf, Tensor) else leaf for leaf in tree_flatten(batch)[0]
    )


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the length of its last tensor (the targets)."""
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[-1], Tensor):
        return len(batch[-1])
    tensors = [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, Tensor)]
    if not tensors:
        raise ValueError("a batch needs at least one tensor to count its samples.")
    return len(tensors[-1])
