"""A round's schedule by hand: chunks of participants, the (client, local step) of every
batch index with a client that has no batches, and local batches drawn across passes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_fl.engine.schedule import (
    ClientSchedule,
    PackedLocalSteps,
    chunk_positions,
    cycle_batches,
)


def test_chunk_positions_by_hand():
    positions = [4, 0, 7, 2, 9]
    assert chunk_positions(positions, None) == [(4, 0, 7, 2, 9)]
    assert chunk_positions(positions, 5) == [(4, 0, 7, 2, 9)]  # exactly the size: one chunk
    assert chunk_positions(positions, 6) == [(4, 0, 7, 2, 9)]
    assert chunk_positions(positions, 2) == [(4, 0), (7, 2), (9,)]
    assert chunk_positions(positions, 1) == [(4,), (0,), (7,), (2,), (9,)]
    assert chunk_positions([], None) == [] and chunk_positions([], 3) == []


def test_client_schedule_locates_every_batch_and_skips_a_client_without_batches():
    schedule = ClientSchedule(clients=(5, 2, 8, 1), num_batches=(3, 0, 2, 1))
    assert schedule.total == 6
    located = [schedule.locate(i) for i in range(6)]
    assert located == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (3, 0)]
    for outside in (-1, 6):
        with pytest.raises(IndexError, match=f"batch {outside} is outside this schedule of 6"):
            schedule.locate(outside)
    assert ClientSchedule(clients=(), num_batches=()).total == 0


def test_cycle_batches_starts_a_new_shuffled_pass_when_one_ends():
    data = TensorDataset(torch.arange(5))
    loader = DataLoader(
        data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    reference = DataLoader(
        data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    expected = [b[0].tolist() for _ in range(3) for b in reference][:7]  # passes of 3 batches
    drawn = [b[0].tolist() for b in cycle_batches(loader, 7)]
    assert drawn == expected
    assert drawn[:3] != drawn[3:6]  # the second pass is shuffled anew
    assert sorted(sum(drawn[:3], [])) == [0, 1, 2, 3, 4]
    assert list(cycle_batches(loader, 0)) == []
    assert len(list(cycle_batches(loader, 3))) == 3  # exactly one pass, no batch of the next


def test_packed_local_steps_name_their_chunk_and_steps():
    steps = PackedLocalSteps(chunk=2, first=3, stop=6)
    assert (steps.chunk, steps.first, steps.stop) == (2, 3, 6)
    assert repr(steps) == "PackedLocalSteps(chunk=2, steps 3..5)"
