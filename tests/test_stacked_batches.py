"""Stacking several clients' batches (engine/stacked_batches.py) for every batch form a
module may yield: (x, y) pairs, a single tensor, a dict, and a tuple with a non-tensor."""

from __future__ import annotations

import torch

from lightning_fl.engine.stacked_batches import batch_shape_key, batch_size_of, stack_batches


def _batches(clients: int = 3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 3, generator=g), torch.randint(0, 4, (2,), generator=g))
            for _ in range(clients)]  # fmt: skip


def test_pairs_stack_per_column():
    batches = _batches()
    stacked = stack_batches(batches)
    assert torch.equal(stacked[0], torch.stack([b[0] for b in batches]))
    assert torch.equal(stacked[1], torch.stack([b[1] for b in batches]))
    assert batch_shape_key(batches[0]) == ((2, 3), (2,))
    assert batch_size_of(batches[0]) == 2


def test_a_single_tensor_batch_stacks_whole_and_counts_its_rows():
    """A batch that is one tensor (tokens, unlabeled inputs): its clients stack along a new
    dimension, not row by row; its key is its shape; its size is its number of rows."""
    a, b = torch.arange(6.0).reshape(3, 2), torch.arange(6.0, 12.0).reshape(3, 2)
    stacked = stack_batches([a, b])
    assert isinstance(stacked, torch.Tensor) and torch.equal(stacked, torch.stack([a, b]))
    assert batch_shape_key(a) == ((3, 2),)
    size = batch_size_of(a)
    assert size == 3 and isinstance(size, int)


def test_a_dict_batch_keeps_its_keys_and_counts_by_its_last_tensor():
    batches = [{"x": x, "y": y} for x, y in _batches(2)]
    stacked = stack_batches(batches)
    assert sorted(stacked) == ["x", "y"]
    assert torch.equal(stacked["x"], torch.stack([b["x"] for b in batches]))
    assert torch.equal(stacked["y"], torch.stack([b["y"] for b in batches]))
    assert batch_shape_key(batches[0]) == ((2, 3), (2,))
    assert batch_size_of({"x": torch.zeros(5, 3), "y": torch.zeros(4)}) == 4


def test_a_non_tensor_entry_enters_the_key_and_not_the_size():
    """(x, y, tag): batches with other tags do not stack together, and the size is the
    last tensor's length, not the tag's (a string of 3 characters, here)."""
    x, y = _batches(1)[0]
    assert batch_shape_key((x, y, "a")) == ((2, 3), (2,), "a")
    assert batch_shape_key((x, y, "a")) != batch_shape_key((x, y, "b"))
    assert batch_size_of((x, y, "tag")) == 2
    assert batch_size_of({"x": torch.zeros(5, 3), "y": torch.zeros(4), "id": "abc"}) == 4


def test_one_client_and_a_nested_pair():
    """A chunk of one client stacks to a leading dimension of 1; (x, (y, z)) keeps its
    nesting, each leaf stacked."""
    x, y = _batches(1)[0]
    (alone_x, alone_y) = stack_batches([(x, y)])
    assert torch.equal(alone_x, x[None]) and torch.equal(alone_y, y[None])
    nested = [(x, (y, y + 1)), (x + 2, (y + 3, y + 4))]
    stacked = stack_batches(nested)
    assert torch.equal(stacked[0], torch.stack([x, x + 2]))
    assert torch.equal(stacked[1][0], torch.stack([y, y + 3]))
    assert torch.equal(stacked[1][1], torch.stack([y + 1, y + 4]))
