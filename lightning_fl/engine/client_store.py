"""Per-client persistent state, keyed by client id, saved in checkpoints."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_fl.engine import collectives


class ClientStore:
    """A dict of dicts: ``store[client][key] -> Tensor``.

    It holds small tensors (control variates, mixture weights, a personal head). A
    model-sized entry, such as a SCAFFOLD control variate, costs 4·d bytes per client
    that has participated (d parameters, float32); clients that never took part cost
    nothing. Values must be tensors, numbers or strings so that checkpoints load with
    ``torch.load(weights_only=True)``.
    """

    def __init__(self) -> None:
        self._state: dict[int, dict[str, Any]] = {}

    def get(self, client: int, key: str, default: Any = None) -> Any:
        return self._state.get(client, {}).get(key, default)

    def set(self, client: int, key: str, value: Tensor | int | float | str) -> None:
        self._state.setdefault(client, {})[key] = value

    def clients(self) -> list[int]:
        return sorted(self._state)

    def pop(self, client: int) -> dict[str, Any]:
        """Remove and return ``client``'s entries (empty if it has none)."""
        return self._state.pop(client, {})

    def put(self, client: int, entries: dict[str, Any]) -> None:
        """Set ``client``'s entries to ``entries`` (nothing for none)."""
        if entries:
            self._state[client] = dict(entries)

    def nbytes(self) -> int:
        return sum(
            v.numel() * v.element_size()
            for entries in self._state.values()
            for v in entries.values()
            if isinstance(v, Tensor)
        )

    def state_dict(self) -> dict[int, dict[str, Any]]:
        return {c: dict(entries) for c, entries in self._state.items()}

    def load_state_dict(self, state: dict[int, dict[str, Any]]) -> None:
        self._state = {int(c): dict(entries) for c, entries in state.items()}


def move_client_states(
    store: ClientStore, moves: dict[int, tuple[int, int]], rank: int, world_size: int
) -> None:
    """Move each client's entries from one rank's store to another's: ``moves`` maps a
    client to (the rank that holds its entries, the rank that needs them), the same on
    every rank, and every rank calls this together (one ``all_gather_object``, tensors
    sent on the CPU). Ranks that only send drop the entries; the receiver holds them."""
    moving = {c: ends for c, ends in moves.items() if ends[0] != ends[1]}
    if not moving:
        return
    outgoing = {c: store.pop(c) for c, (src, _) in moving.items() if src == rank}
    outgoing = tree_map(lambda v: v.cpu() if isinstance(v, Tensor) else v, outgoing)
    parts = collectives.across_ranks(world_size).all_gather_object(outgoing)
    for part in parts:
        for client, entries in part.items():
            if moving[client][1] == rank:
                store.put(client, entries)
