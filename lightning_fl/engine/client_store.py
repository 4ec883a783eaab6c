"""Per-client persistent state, keyed by client id, saved in checkpoints."""

from __future__ import annotations

from typing import Any

from torch import Tensor


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
