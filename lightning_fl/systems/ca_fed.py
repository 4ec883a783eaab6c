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

    The counts are kept lazily (issue 66): a client's counts are closed at the last round
    its state changed (``closed_at``), and the rounds since, all in its current state, are
    added when it is read. A round then costs the clients whose state changed, found from
    the sorted sets A_{t−1} and A_t, not the population; :meth:`availability` of given
    clients reads only those. Host-side bookkeeping (float64 counts on the CPU).

    >>> estimator = AvailabilityEstimator(prior=(1.0, 1.0))
    >>> for available in ([0, 2], [0], [0, 1], [0, 1]):  # A_0 … A_3 of 3 clients
    ...     estimator.observe_clients(torch.tensor(available), 3)
    >>> [round(x, 4) for x in estimator.availability().tolist()]  # (Σ 1{k∈A_s} + 1)/(4 + 2)
    [0.8333, 0.5, 0.3333]
    >>> # client 1: 0→0, 0→1, 1→1 once each: (1+1)/(2+2) + (1+1)/(1+2) − 1 = 1/6
    >>> [round(x, 4) for x in estimator.correlation().tolist()]
    [0.3, 0.1667, 0.0833]
    """

    def __init__(self, prior: tuple[float, float] = (1.0, 1.0)) -> None:
        if min(prior) <= 0:
            raise ValueError(f"Beta prior counts must be > 0, got {prior}.")
        self.prior = prior
        self.rounds = 0
        self.active: torch.Tensor | None = None  # [N]: rounds on, up to closed_at
        self.stays: torch.Tensor | None = None  # [2, N]: 0→0, 1→1 counts, up to closed_at
        self.leaves: torch.Tensor | None = None  # [2, N]: 0→1, 1→0 counts
        self.closed_at: torch.Tensor | None = None  # [N]: the round the counts cover
        self.current: torch.Tensor | None = None  # sorted A_{t−1}

    def observe(self, available: torch.Tensor) -> None:
        """Observe A_t as a mask over the clients (boolean or 0/1)."""
        self.observe_clients(torch.nonzero(available.bool()).flatten(), len(available))

    def observe_clients(self, clients: torch.Tensor, num_clients: int) -> None:
        """Observe A_t as the sorted ids of its clients, among ``num_clients``."""
        clients = clients.to(torch.long)
        if self.current is None:
            self.active = torch.zeros(num_clients, dtype=torch.float64)
            self.stays = torch.zeros(2, num_clients, dtype=torch.float64)
            self.leaves = torch.zeros(2, num_clients, dtype=torch.float64)
            self.closed_at = torch.zeros(num_clients, dtype=torch.long)
            self.active[clients] = 1.0
        else:
            rose = clients[~torch.isin(clients, self.current)]
            fell = self.current[~torch.isin(self.current, clients)]
            for changed, was in ((rose, 0), (fell, 1)):  # close the runs that end at t − 1
                run = (self.rounds - 1 - self.closed_at[changed]).double()
                self.stays[was, changed] += run
                self.active[changed] += run * was + (1 - was)  # … and count round t
                self.leaves[was, changed] += 1
                self.closed_at[changed] = self.rounds
        self.current = clients
        self.rounds += 1

    def _open_rounds(self, clients: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rounds since the counts were closed, whether on) of ``clients`` (all: None)."""
        closed = self.closed_at if clients is None else self.closed_at[clients]
        on = torch.zeros(len(self.closed_at), dtype=torch.bool)
        if clients is None:
            on[self.current] = True
        else:
            on = torch.isin(clients, self.current)
        return (self.rounds - 1 - closed).double(), on

    def counts(self, clients: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The counts up to the last observed round: ``active`` [k], ``stays`` and
        ``leaves`` [2, k] (0→0, 1→1; 0→1, 1→0) of ``clients`` (all: None)."""
        pick = slice(None) if clients is None else clients
        run, on = self._open_rounds(clients)
        active = self.active[pick] + run * on
        stays = self.stays[:, pick].clone()
        stays[0] += run * ~on
        stays[1] += run * on
        return {"active": active, "stays": stays, "leaves": self.leaves[:, pick]}

    def availability(self, clients: torch.Tensor | None = None) -> torch.Tensor:
        """π̂ (of ``clients`` only, when given)."""
        n, m = self.prior
        pick = slice(None) if clients is None else clients
        run, on = self._open_rounds(clients)
        return (self.active[pick] + run * on + n) / (self.rounds + n + m)

    def correlation(self) -> torch.Tensor:
        """λ̂ = P̂(1→1) + P̂(0→0) − 1."""
        n, m = self.prior
        counts = self.counts()
        stays, leaves = counts["stays"], counts["leaves"]
        stay = (stays + n) / (stays + leaves + n + m)
        return stay[0] + stay[1] - 1

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "active": self.active, "stays": self.stays,
                "leaves": self.leaves, "closed_at": self.closed_at,
                "current": self.current}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state["rounds"])
        self.active, self.stays = state["active"], state["stays"]
        self.leaves = state["leaves"]
        if "closed_at" in state:
            self.closed_at, self.current = state["closed_at"], state["current"]
        elif state["last"] is not None:  # counts closed at the last round (before issue 66)
            self.closed_at = torch.full((len(self.active),), self.rounds - 1, dtype=torch.long)
            self.current = torch.nonzero(state["last"]).flatten()
        else:
            self.closed_at = self.current = None


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
    and Γ̂ = max_k (F̂_k − F̂_k*) (thesis eqs. 2.31–2.33).

    With the unbiased q = α/π, π ⊙̃ q = α: d_TV = 0 and ε̂ = ⟨F̂ − F̂*, α⟩.

    >>> import torch
    >>> alpha = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    >>> pi = torch.tensor([0.9, 0.5, 0.1], dtype=torch.float64)
    >>> gap = torch.tensor([0.2, 0.1, 0.4], dtype=torch.float64)
    >>> round(estimated_error(alpha / pi, alpha, gap, pi, kappa2=1.0), 4)  # 0.1 + 0.03 + 0.08
    0.21
    """
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
    but one dropped.

    CA-Fed's weights for the clients of :func:`estimated_error`'s example, visited from
    the least available: with κ̄² = 1 the bias term keeps q = α/π; with κ̄² = 0.05 the
    optimization term wins and only client 1 (the smallest F̂ − F̂*) keeps its weight.

    >>> import torch
    >>> alpha = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    >>> pi = torch.tensor([0.9, 0.5, 0.1], dtype=torch.float64)
    >>> gap = torch.tensor([0.2, 0.1, 0.4], dtype=torch.float64)
    >>> kept = truncate(alpha / pi, [2, 1, 0], alpha, gap, pi, 1.0, 0.0)
    >>> [round(x, 4) for x in kept.tolist()]
    [0.5556, 0.6, 2.0]
    >>> truncate(alpha / pi, [2, 1, 0], alpha, gap, pi, 0.05, 0.0).tolist()
    [0.0, 0.6, 0.0]
    """
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
