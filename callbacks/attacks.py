"""Byzantine clients that send a corrupted update, to measure robust aggregators and
user-level DP against (beside the free-riders of :mod:`.free_riders`):

- :class:`SignFlipping`: −s·Δ_i (Damaskinos et al. 2018; Karimireddy et al. 2021, §6);
- :class:`ScaledUpdates`: s·Δ_i, a boosted update (Bhagoji et al., ICML 2019);
- :class:`GaussianUpdates`: N(0, σ² I) in place of Δ_i (Blanchard et al. 2017, §5).

The attackers are a fixed ``fraction`` of the clients, ⌊fraction·N⌋ of them, drawn once
from ``seed`` (a prefix of a seeded permutation of the client ids): the same on every rank,
after a resume, and whichever sampler draws the rounds. An attacker trains as usual and
corrupts what it sends (``transform_update``, after the aggregator's), so a server-side
defence (a robust aggregator, DP-FedAvg's central clipping) sees the corrupted update.
"""

from __future__ import annotations

import torch

from lightning_fl.checks import require_rate
from lightning_fl.engine.plugins import FederatedCallback, RoundState
from lightning_fl.engine.seeding import generator
from lightning_fl.engine.tensors import TensorList, flat_size, unflatten


def attackers(num_clients: int, fraction: float, seed: int) -> frozenset[int]:
    """The first ⌊fraction·N⌋ ids of a permutation of the N clients seeded by ``seed``.

    >>> sorted(attackers(10, 0.2, seed=0)) == sorted(attackers(10, 0.2, seed=0))
    True
    >>> len(attackers(10, 0.25, seed=1))
    2
    """
    count = int(fraction * num_clients)
    # host: the draw is bookkeeping of who attacks, on a CPU generator
    order = torch.randperm(num_clients, generator=generator(seed, "byzantine"))
    return frozenset(order[:count].tolist())


class ByzantineClients(FederatedCallback):
    """Base class: a fixed fraction of the clients replace their update by
    :meth:`corrupt` of it. ``attacked`` lists the attackers that sent an update in the
    last round (for logs and tests)."""

    supports_vectorized_clients = True  # no per-step hook: clients end as sequentially

    def __init__(self, fraction: float = 0.1, seed: int = 0) -> None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}.")
        self.fraction, self.seed = float(fraction), seed
        self.attackers: frozenset[int] = frozenset()
        self._population = -1
        self.attacked: list[int] = []

    def on_round_start(self, trainer, pl_module, state: RoundState) -> None:
        if state.num_clients != self._population:
            self._population = state.num_clients
            self.attackers = attackers(state.num_clients, self.fraction, self.seed)
        self.attacked = []

    def transform_update(self, trainer, pl_module, client: int, update, state: RoundState):
        if client not in self.attackers:
            return update
        self.attacked.append(client)
        return self.corrupt(update, client, state)

    def corrupt(self, update: TensorList, client: int, state: RoundState) -> TensorList:
        raise NotImplementedError

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        """Logs ``attack/updates``, the corrupted updates of the round (summed over ranks)."""
        pl_module.log("attack/updates", float(len(self.attacked)), on_epoch=True,
                      sync_dist=trainer.world_size > 1, reduce_fx="sum")  # fmt: skip


class SignFlipping(ByzantineClients):
    """Each attacker sends −s·Δ_i, its honest update reversed and scaled by s."""

    def __init__(self, fraction: float = 0.1, scale: float = 1.0, seed: int = 0) -> None:
        super().__init__(fraction, seed)
        self.scale = require_rate("scale", scale, 1.0)

    def corrupt(self, update, client, state):
        return torch._foreach_mul(update, -self.scale)


class ScaledUpdates(ByzantineClients):
    """Each attacker sends s·Δ_i, its honest update boosted by s."""

    def __init__(self, fraction: float = 0.1, scale: float = 10.0, seed: int = 0) -> None:
        super().__init__(fraction, seed)
        self.scale = require_rate("scale", scale, 10.0)

    def corrupt(self, update, client, state):
        return torch._foreach_mul(update, self.scale)


class GaussianUpdates(ByzantineClients):
    """Each attacker sends N(0, σ² I), drawn from (seed, round, client)."""

    def __init__(self, fraction: float = 0.1, std: float = 1.0, seed: int = 0) -> None:
        super().__init__(fraction, seed)
        self.std = require_rate("std", std, 1.0)

    def corrupt(self, update, client, state):
        size = flat_size(update)
        gen = generator(self.seed, "byzantine_gaussian", state.round_idx, client)
        # host: a CPU generator draws the same noise on every rank and device
        draw = self.std * torch.randn(size, generator=gen, dtype=torch.float64)
        return [part.to(t) for part, t in zip(unflatten(draw, update), update)]


__all__ = ["ByzantineClients", "GaussianUpdates", "ScaledUpdates", "SignFlipping", "attackers"]
