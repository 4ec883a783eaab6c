"""A round's schedule of batches: which client (or chunk) each Lightning step belongs to.

:class:`ClientSchedule` maps a step index to (position, local step); :func:`chunk_positions`
splits a round's participants into vectorized chunks; :func:`cycle_batches` draws a
client's local batches from its loader; :class:`PackedLocalSteps` names a step's local
steps when the data is packed on the device.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader


def chunk_positions(positions: Sequence[int], size: int | None) -> list[tuple[int, ...]]:
    """Consecutive chunks of at most ``size`` positions (all in one chunk for None)."""
    if size is None or size >= len(positions):
        return [tuple(positions)] if positions else []
    return [tuple(positions[i : i + size]) for i in range(0, len(positions), size)]


@dataclass(frozen=True)
class ClientSchedule:
    """Clients in visiting order and how many batches each contributes."""

    clients: tuple[int, ...]
    num_batches: tuple[int, ...]

    def __post_init__(self) -> None:
        starts = [0, *itertools.accumulate(self.num_batches)]
        object.__setattr__(self, "_starts", starts)

    @property
    def total(self) -> int:
        return self._starts[-1]  # type: ignore[attr-defined]

    def locate(self, batch_idx: int) -> tuple[int, int]:
        """(position of the client in :attr:`clients`, local step) of a batch index."""
        if not 0 <= batch_idx < self.total:
            raise IndexError(f"batch {batch_idx} is outside this schedule of {self.total} batches.")
        pos = bisect.bisect_right(self._starts, batch_idx) - 1  # type: ignore[attr-defined]
        return pos, batch_idx - self._starts[pos]  # type: ignore[attr-defined]


def cycle_batches(loader: DataLoader, count: int) -> Iterator[Any]:
    """Exactly ``count`` batches, starting a new pass (a new shuffle) when one ends."""
    produced = 0
    while produced < count:
        for batch in loader:
            yield batch
            produced += 1
            if produced == count:
                return


class PackedLocalSteps:
    """A Lightning step's local steps when the chunk's data is packed on the device:
    ``first`` to ``stop`` (exclusive) of chunk ``chunk``, whose batches the vectorized
    step draws by index when it trains them. A plain object, which Lightning's batch
    transfer leaves alone: nothing is read ahead or copied. The step's batch is
    ``{"batch_size": ..., "local_steps": PackedLocalSteps}``."""

    __slots__ = ("chunk", "first", "stop")

    def __init__(self, chunk: int, first: int, stop: int) -> None:
        self.chunk, self.first, self.stop = chunk, first, stop

    def __repr__(self) -> str:
        return f"PackedLocalSteps(chunk={self.chunk}, steps {self.first}..{self.stop - 1})"
