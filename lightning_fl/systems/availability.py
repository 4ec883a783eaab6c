"""Client availability (Rodio et al., INFOCOM 2023; Marfoq thesis §2.2): the set A_t of
clients that can take part in round t is exogenous, and samplers choose only among it.

An availability model is a plain seeded object: ``available(round_idx, seed, n)`` is a
function of (seed, round, n) alone. A Markov chain's past is cached and advanced one
round at a time from its saved state, so resumed runs and every rank see the same sets
at the cost of one step per round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_fl.engine.seeding import generator


class AlwaysAvailable:
    """Every client, every round (π_k = 1): the behaviour without an availability model."""

    def available(self, round_idx: int, seed: int, num_clients: int) -> torch.Tensor:
        return torch.ones(num_clients, dtype=torch.bool)

    def stationary(self, num_clients: int) -> torch.Tensor:
        return torch.ones(num_clients, dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class MarkovAvailability:
    """Two-state Markov chains (inactive 0, active 1), one per client or one per cluster of
    clients (spatial correlation), with stationary activity π and second eigenvalue λ
    (thesis eqs. D.226–D.228):

        P = [[1 − (1−λ)π,      (1−λ)π     ],
             [(1−λ)(1−π),  λ + (1−λ)π     ]],

    so P(active → active) − P(inactive → active) = λ, the lag-1 autocorrelation of the
    activity. A chain starts from its stationary law at round 0 and takes one step per
    round with draws seeded from (seed, round).

    The seed rules: ``available(t, seed, n)`` is a function of (seed, t, n) alone. The
    chain's state is only a cache of the walk from round 0 (so that rounds in order cost
    one step each); it is kept with the seed it was drawn with, and a call with another
    seed, an earlier round or another number of chains walks again from round 0.

    Args:
        pi: π_k per chain (or one value for all), in (0, 1).
        lam: λ_k per chain (or one value), in (−1, 1) and such that P is a probability
            matrix.
        clusters: the chain of each client (default: one chain per client).
    """

    def __init__(
        self,
        pi: float | Sequence[float],
        lam: float | Sequence[float] = 0.0,
        clusters: Sequence[int] | None = None,
    ) -> None:
        self.pi = torch.as_tensor(pi, dtype=torch.float64).flatten()
        self.lam = torch.as_tensor(lam, dtype=torch.float64).flatten()
        if ((self.pi <= 0) | (self.pi >= 1)).any():
            raise ValueError(f"Every π_k must be in (0, 1), got {self.pi.tolist()}.")
        up, down = (1 - self.lam) * self.pi, (1 - self.lam) * (1 - self.pi)  # 0→1, 1→0
        if ((up < 0) | (up > 1) | (down < 0) | (down > 1)).any():
            raise ValueError(
                "λ_k must keep P a probability matrix: (1−λ)π and (1−λ)(1−π) ∈ [0, 1]."
            )
        self.clusters = None if clusters is None else torch.as_tensor(clusters, dtype=torch.long)
        self._round: int | None = None
        self._seed: int | None = None
        self._state: torch.Tensor | None = None

    def _chains(self, num_clients: int) -> int:
        return num_clients if self.clusters is None else int(self.clusters.max()) + 1

    def _per_chain(self, values: torch.Tensor, chains: int) -> torch.Tensor:
        if len(values) == 1:
            return values.expand(chains)
        if len(values) != chains:
            raise ValueError(f"Got {len(values)} values for {chains} availability chains.")
        return values

    def stationary(self, num_clients: int) -> torch.Tensor:
        """π_k of every client."""
        pi = self._per_chain(self.pi, self._chains(num_clients))
        return pi if self.clusters is None else pi[self.clusters]

    def correlation(self, num_clients: int) -> torch.Tensor:
        """λ_k of every client (its chain's second eigenvalue)."""
        lam = self._per_chain(self.lam, self._chains(num_clients))
        return lam if self.clusters is None else lam[self.clusters]

    def available(self, round_idx: int, seed: int, num_clients: int) -> torch.Tensor:
        chains = self._chains(num_clients)
        pi = self._per_chain(self.pi, chains)
        lam = self._per_chain(self.lam, chains)
        if (
            self._state is None
            or self._round is None
            or self._round > round_idx
            or self._seed != seed
            or len(self._state) != chains
        ):
            self._seed = seed
            draw = torch.rand(
                chains, generator=generator(seed, "availability", 0), dtype=torch.float64
            )
            self._round, self._state = 0, draw < pi
        stay, rise = self._thresholds(pi, lam)
        while self._round < round_idx:
            self._round += 1
            draw = torch.rand(
                chains, generator=generator(seed, "availability", self._round), dtype=torch.float64
            )
            # active next with probability λ + (1−λ)π when active now, (1−λ)π when not
            self._state = torch.where(self._state, draw < stay, draw < rise)
        state = self._state
        return state if self.clusters is None else state[self.clusters]

    def _thresholds(
        self, pi: torch.Tensor, lam: torch.Tensor
    ) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """(λ + (1−λ)π, (1−λ)π): per chain, or two numbers when every chain shares π and
        λ (a step then makes no pass over the population to compute them)."""
        if len(self.pi) == 1 and len(self.lam) == 1:
            p, lam_ = float(self.pi[0]), float(self.lam[0])
            return lam_ + (1 - lam_) * p, (1 - lam_) * p
        return lam + (1 - lam) * pi, (1 - lam) * pi

    def state_dict(self) -> dict[str, Any]:
        return {"round": self._round, "seed": self._seed, "state": self._state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._round, self._state = state.get("round"), state.get("state")
        self._seed = state.get("seed")


class TwoClassAvailability(MarkovAvailability):
    """The availability of the CA-Fed experiments (Marfoq thesis §2.2.6.1): the first half
    of the clients is "more available" (π = 1/2 + g), the second "less available"
    (π = 1/2 − g); each half is split into a correlated part (λ = ν) and a weakly
    correlated one (λ ~ N(0, ε²), drawn with ``seed``).

    Args:
        num_clients: N (the thesis: 100).
        gap: g (0.4: π = 0.9 and 0.1).
        correlation: ν (0.9).
        noise: ε (10⁻²).
    """

    def __init__(
        self,
        num_clients: int = 100,
        gap: float = 0.4,
        correlation: float = 0.9,
        noise: float = 0.01,
        seed: int = 0,
    ) -> None:
        if not 0 < gap < 0.5:
            raise ValueError(f"gap g must be in (0, 0.5) so that π stays in (0, 1), got {gap}.")
        if num_clients < 4:
            raise ValueError(f"TwoClassAvailability needs at least 4 clients, got {num_clients}.")
        half, quarter = num_clients // 2, num_clients // 4
        pi = [0.5 + gap] * half + [0.5 - gap] * (num_clients - half)
        weak = torch.randn(num_clients, generator=generator(seed, "weak_correlation")) * noise
        lam = []
        for k in range(num_clients):
            within = k if k < half else k - half
            lam.append(correlation if within < quarter else float(weak[k]))
        super().__init__(pi, lam)
