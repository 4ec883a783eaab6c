"""Per-client dropout masks for vectorized clients, drawn as the sequential path draws them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


class ClientDropout:
    """Per-client dropout masks for the ``nn.Dropout`` modules of a network.

    The sequential path seeds the global generator with (seed, round, client) when a
    client starts and ``F.dropout`` draws ``empty_like(x).bernoulli_(1 − p) / (1 − p)`` for
    every call. Here each client has a generator seeded the same way, and every step draws
    the same masks in the same order: the shapes of the step's dropout inputs come from
    one probe forward per batch shape, outside vmap."""

    def __init__(self, module: nn.Module) -> None:
        self.modules = [m for m in module.modules() if type(m) is nn.Dropout]
        self._shapes: dict[Any, list[tuple[nn.Dropout, torch.Size]]] = {}

    def active(self) -> bool:
        return any(m.training and m.p > 0 for m in self.modules)

    @contextmanager
    def _patched(self, forward: Callable[[nn.Dropout, Tensor], Tensor]) -> Iterator[None]:
        for m in self.modules:
            if m.training and m.p > 0:
                m.forward = lambda x, m=m: forward(m, x)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for m in self.modules:
                m.__dict__.pop("forward", None)

    def shapes(self, key: Any, probe: Callable[[], Any]) -> list[tuple[nn.Dropout, torch.Size]]:
        """The dropout calls of one client step, in order, for batches of shape ``key``."""
        if key not in self._shapes:
            calls: list[tuple[nn.Dropout, torch.Size]] = []

            def record(m: nn.Dropout, x: Tensor) -> Tensor:
                calls.append((m, x.shape))
                return x

            with self._patched(record), torch.no_grad():
                probe()
            self._shapes[key] = calls
        return self._shapes[key]

    def masks(
        self,
        calls: list[tuple[nn.Dropout, torch.Size]],
        generators: Sequence[torch.Generator],
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[Tensor]:
        """One stacked mask per call, row c drawn from ``generators[c]``."""
        out = []
        for m, shape in calls:
            rows = []
            for g in generators:
                if m.p == 1:
                    rows.append(torch.zeros(shape, dtype=dtype, device=device))
                else:
                    noise = torch.empty(shape, dtype=dtype, device=device)
                    rows.append(noise.bernoulli_(1 - m.p, generator=g).div_(1 - m.p))
            out.append(torch.stack(rows))
        return out

    @contextmanager
    def applying(self, masks: list[Tensor]) -> Iterator[None]:
        """Inside vmap: each dropout call multiplies by the next mask."""
        if not masks:
            yield
            return
        queue = iter(masks)
        with self._patched(lambda m, x: x * next(queue)):
            yield
