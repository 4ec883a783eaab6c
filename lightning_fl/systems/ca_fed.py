"""CA-Fed's pieces (Rodio, Faticanti, Marfoq, Neglia, Leonardi, INFOCOM 2023 / ToN; Marfoq
thesis §2.2, Alg. 6): availability estimators with Beta priors, the client-loss filter, and
the greedy ``get`` that drops clients while the estimated error falls."""

from __future__ import annotations

from typing import Any

import torch


class AvailabilityEstimator:
    """Bayesian estimates of each client's two-state activity chain (thesis §2.2.4.2):

    - π̂_k = (Σ_{s≤t} 1{k ∈ A_s} + n) / (t + n + m), a Beta(n, m) prior;
    - P̂_k(1→1) and P̂_k(0→0) from the observed transitions with the same prior, and
      λ̂_k = P̂(1→1) + P̂(0→0) − 1, the chain's second eigenvalue.
    """

    def __init__(self, prior: tuple[float, float] = (1.0, 1.0)) -> None:
        if min(prior) <= 0:
            raise ValueError(f"Beta prior counts must be > 0, got {prior}.")
        self.prior = prior
        self.rounds = 0
        self.active: torch.Tensor | None = None
        self.stays: torch.Tensor | None = None  # [2, N]: 0→0, 1→1 counts
        self.leaves: torch.Tensor | None = None  # [2, N]: 0→1, 1→0 counts
        self.last: torch.Tensor | None = None

    def observe(self, available: torch.Tensor) -> None:
        available = available.bool()
        if self.active is None:
            n = len(available)
            self.active = torch.zeros(n, dtype=torch.float64)
            self.stays = torch.zeros(2, n, dtype=torch.float64)
            self.leaves = torch.zeros(2, n, dtype=torch.float64)
        self.active += available
        if self.last is not None:  # one masked add per count (no index over the clients)
            was_on, now_on = self.last, available
            self.stays[0] += ~was_on & ~now_on
            self.stays[1] += was_on & now_on
            self.leaves[0] += ~was_on & now_on
            self.leaves[1] += was_on & ~now_on
        self.last = available.clone()
        self.rounds += 1

    def availability(self, clients: torch.Tensor | None = None) -> torch.Tensor:
        """π̂ (of ``clients`` only, when given)."""
        n, m = self.prior
        active = self.active if clients is None else self.active[clients]
        return (active + n) / (self.rounds + n + m)

    def correlation(self) -> torch.Tensor:
        """λ̂ = P̂(1→1) + P̂(0→0) − 1."""
        n, m = self.prior
        stay = (self.stays + n) / (self.stays + self.leaves + n + m)
        return stay[0] + stay[1] - 1

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "active": self.active, "stays": self.stays,
                "leaves": self.leaves, "last": self.last}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state["rounds"])
        self.active, self.stays = state["active"], state["stays"]
        self.leaves, self.last = state["leaves"], state["last"]


class LossFilter:
    """F̂_k^(t) = (1 − β 1{k∈A_t}) F̂_k^(t−1) + β 1{k∈A_t} F_k^(t) (thesis eq. 2.30) and
    F̂_k* = min_{s≤t} F̂_k^(s). At the first round the clients not yet heard from get the
    mean loss of the available ones (the authors' code)."""

    def __init__(self, beta: float = 1.0) -> None:
        if not 0 < beta <= 1:
            raise ValueError(f"loss filter beta must be in (0, 1], got {beta}.")
        self.beta = beta
        self.estimate: torch.Tensor | None = None
        self.minimum: torch.Tensor | None = None

    def update(self, available: torch.Tensor, losses: torch.Tensor) -> None:
        available = available.bool()
        if self.estimate is None:
            fill = losses[available].mean() if bool(available.any()) else torch.tensor(0.0)
            self.estimate = torch.where(available, losses, fill.to(losses)).double()
            self.minimum = self.estimate.clone()
            return
        mixed = (1 - self.beta) * self.estimate + self.beta * losses.double()
        self.estimate = torch.where(available, mixed, self.estimate)
        self.minimum = torch.minimum(self.minimum, self.estimate)

    def state_dict(self) -> dict[str, Any]:
        return {"estimate": self.estimate, "minimum": self.minimum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.estimate, self.minimum = state["estimate"], state["minimum"]


def estimated_error(
    q: torch.Tensor, alpha: torch.Tensor, gap: torch.Tensor, pi: torch.Tensor, kappa2: float
) -> float:
    """ε̂ = ⟨F̂ − F̂*, π ⊙̃ q⟩ + 4 κ̄² d_TV(α, π ⊙̃ q)² Γ̂, with (π ⊙̃ q)_k = π_k q_k / Σ π_h q_h
    and Γ̂ = max_k (F̂_k − F̂_k*) (thesis eqs. 2.31–2.33)."""
    weights = pi * q
    weights = weights / weights.sum()
    tv = 0.5 * float((alpha - weights).abs().sum())
    return float(gap @ weights) + 4.0 * kappa2 * tv**2 * float(gap.max())


def truncate(
    q: torch.Tensor,
    order: list[int],
    alpha: torch.Tensor,
    gap: torch.Tensor,
    pi: torch.Tensor,
    kappa2: float,
    tolerance: float,
) -> torch.Tensor:
    """Alg. 6's ``get``: visit clients in ``order``, set q_k = 0 when that lowers ε̂ by at
    least τ, and never drop the last client. A removal must lower ε̂ strictly: with τ = 0
    and no information yet (every filtered loss at its minimum, ε̂ = 0 for any q, as in
    the first rounds with the running-minimum F̂*), every client is kept rather than all
    but one dropped."""
    q = q.clone()
    best = estimated_error(q, alpha, gap, pi, kappa2)
    for k in order:
        if q[k] == 0:
            continue
        trial = q.clone()
        trial[k] = 0.0
        if float(trial.sum()) == 0.0:
            break
        error = estimated_error(trial, alpha, gap, pi, kappa2)
        if error < best and best - error >= tolerance:
            q, best = trial, error
    return q
