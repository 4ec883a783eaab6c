"""Client samplers and their unbiased aggregation weights.

Fraboni et al., "A General Theory for Client Sampling in Federated Learning"
(FL-IJCAI'22; Fraboni thesis Ch. 2, App. A.1, Tab. 2.1). The server update is
θ^{t+1} = θ^t + η_g Σ_i ω_i(S_t)(θ_i^{t+1} − θ^t) (thesis eq. 2.3, Alg. 9), and a
scheme is unbiased when E[ω_i(S_t)] = p_i (Def. 2.1).

A sampler is a plain object: ``sample(round_idx, seed, p)`` is a pure function of
its arguments, so resumed runs and all ranks draw the same participants.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from lightning_fl.seeding import generator


@dataclass(frozen=True)
class Participation:
    """The clients of one round, in training order, and their aggregation weights ω_i."""

    clients: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.clients) != len(self.weights):
            raise ValueError("Participation needs one weight per client.")


class ClientSampler:
    """Base class. Subclasses implement :meth:`_draw` returning ``{client: ω_i}``."""

    def __init__(self, renormalize: bool = False) -> None:
        #: Opt-in for the biased "original FedAvg" weights ω_i / Σ_j ω_j.
        self.renormalize = renormalize

    def sample(self, round_idx: int, seed: int, p: torch.Tensor) -> Participation:
        """Choose the participants of ``round_idx`` given target weights ``p`` (Σ p = 1).

        Clients with p_i = 0 (for instance clients without training data) are never drawn.
        """
        p = _check_target_weights(p)
        weights = self._draw(p, generator(seed, "sampler", round_idx))
        clients = tuple(sorted(weights))
        omega = [weights[c] for c in clients]
        if self.renormalize:
            total = sum(omega)
            omega = [w / total for w in omega]
        return Participation(clients, tuple(omega))

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        raise NotImplementedError

    def check(self, num_eligible: int) -> None:
        """Raise a clear error when this sampler cannot work with ``num_eligible`` clients."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class FullParticipation(ClientSampler):
    """Every client with p_i > 0 takes part, with ω_i = p_i (Tab. 2.1, first row)."""

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        return {i: float(p[i]) for i in torch.nonzero(p > 0).flatten().tolist()}


class _FixedSizeSampler(ClientSampler):
    def __init__(self, clients_per_round: int, renormalize: bool = False) -> None:
        super().__init__(renormalize)
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}.")
        self.clients_per_round = clients_per_round


class UniformSampler(_FixedSizeSampler):
    """m clients uniformly without replacement; ω_i = (n/m)·p_i for each sampled i.

    Tab. 2.1, "Uniform": E[ω_i] = (m/n)(n/m)p_i = p_i. n counts the clients with
    p_i > 0. The weights sum to 1 only when p_i = 1/n.
    """

    def check(self, num_eligible: int) -> None:
        if self.clients_per_round > num_eligible:
            raise ValueError(
                f"clients_per_round={self.clients_per_round} but only {num_eligible} clients "
                f"have training data; set clients_per_round <= {num_eligible}."
            )

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        eligible = torch.nonzero(p > 0).flatten()
        n, m = len(eligible), self.clients_per_round
        self.check(n)
        chosen = eligible[torch.randperm(n, generator=gen)[:m]].tolist()
        return {i: n / m * float(p[i]) for i in chosen}


class MDSampler(_FixedSizeSampler):
    """MD: m i.i.d. draws with P(l_k = i) = p_i; ω_i = (number of draws of i)/m.

    Tab. 2.1, "MD" (multinomial distribution, with replacement). A client drawn twice
    trains once and counts twice. The weights always sum to 1.
    """

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        m = self.clients_per_round
        draws = torch.multinomial(p, m, replacement=True, generator=gen).tolist()
        return {i: count / m for i, count in Counter(draws).items()}


def _check_target_weights(p: torch.Tensor) -> torch.Tensor:
    p = torch.as_tensor(p, dtype=torch.float64)
    if p.ndim != 1 or len(p) == 0:
        raise ValueError("Target weights p must be a non-empty 1-D tensor.")
    if not torch.isfinite(p).all() or (p < 0).any():
        raise ValueError("Target weights p must be finite and non-negative.")
    if abs(float(p.sum()) - 1.0) > 1e-6:
        raise ValueError(f"Target weights p must sum to 1, got {float(p.sum())}.")
    return p
