"""Client samplers and their unbiased aggregation weights.

Fraboni et al., "A General Theory for Client Sampling in Federated Learning"
(FL-IJCAI'22; Fraboni thesis Ch. 2, App. A.1, Tab. 2.1). The server update is
θ^{t+1} = θ^t + η_g Σ_i ω_i(S_t)(θ_i^{t+1} − θ^t) (thesis eq. 2.3, Alg. 9), and a
scheme is unbiased when E[ω_i(S_t)] = p_i (Def. 2.1).

A sampler is a plain object: ``sample(round_idx, seed, p)`` is a pure function of
its arguments, so resumed runs and all ranks draw the same participants.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
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


class ClusteredSampler(_FixedSizeSampler):
    """Clustered sampling (Fraboni et al., ICML 2021; Fraboni thesis Ch. 3, §3.3): one
    client from each of m distributions W_k with P(l_k = i) = r_ki, aggregated as MD,
    ω_i = (number of draws of i)/m. It is unbiased when every row of r sums to 1 (eq. 3.7)
    and every column to m·p_i (eq. 3.8), and then Var[ω_i] = Σ_k r_ki(1 − r_ki)/m² is at
    most MD's p_i(1 − p_i)/m. Subclasses build r.
    """

    def distributions(self, p: torch.Tensor) -> torch.Tensor:
        """r: [m, n], float64."""
        raise NotImplementedError

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        m = self.clients_per_round
        r = self.distributions(p)
        draws = [int(torch.multinomial(r[k], 1, generator=gen)) for k in range(m)]
        return {i: count / m for i, count in Counter(draws).items()}


class SampleSizeClusteredSampler(ClusteredSampler):
    """Clustered sampling by sample size (thesis Alg. 2, ICML Alg. 1).

    Client i owns m·p_i of the m distributions' total mass. Clients are taken by
    decreasing p_i and their mass is poured into the distributions in turn, each of
    capacity 1, a client spilling into the next distribution when one is full. The masses
    are integers, as in the thesis (m·n_i sample units in distributions of capacity
    Σ n_i): p is read back as exact fractions n_i/N when it is one (sample counts give
    that), so the rows sum to 1 and the columns to m·p_i exactly. Other p are scaled to
    m·10¹⁰ units as in the authors' code, rounded by largest remainders so that they sum
    exactly (the authors truncate, which can leave 10⁻¹⁰ of a client in the next
    distribution). r is computed once and again only when p changes.
    A client is drawn at most ⌊m·p_i⌋ + 2 times; with equal p_i and m dividing the number
    of clients, the distributions are disjoint and this is uniform sampling without
    replacement.
    """

    UNITS = 10**10

    def __init__(self, clients_per_round: int, renormalize: bool = False) -> None:
        super().__init__(clients_per_round, renormalize)
        self._cache: tuple[tuple[float, ...], torch.Tensor] | None = None

    def check(self, num_eligible: int) -> None:
        if self.clients_per_round > num_eligible:
            raise ValueError(
                f"clients_per_round={self.clients_per_round} but only {num_eligible} clients "
                f"have training data; set clients_per_round <= {num_eligible}."
            )

    def distributions(self, p: torch.Tensor) -> torch.Tensor:
        key = tuple(p.tolist())
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        m, n = self.clients_per_round, len(p)
        self.check(int((p > 0).sum()))
        units, capacity = _integer_masses(p, m, self.UNITS)
        order = sorted(range(n), key=lambda i: (-units[i], i))
        filled = [[0] * n for _ in range(m)]
        k, level = 0, 0
        for i in order:
            left = units[i]
            while left > 0 and k < m:
                put = min(capacity - level, left)
                filled[k][i] += put
                level, left = level + put, left - put
                if level == capacity:
                    k, level = k + 1, 0
        r = torch.tensor(filled, dtype=torch.float64)
        r = r / r.sum(dim=1, keepdim=True)
        self._cache = (key, r)
        return r


def _integer_masses(p: torch.Tensor, m: int, units: int) -> tuple[list[int], int]:
    """Integer masses m·p_i and the capacity of one distribution: exact when p holds
    fractions n_i/N (denominators up to 10⁹), else ``units`` per distribution with the
    masses rounded by largest remainders to sum to m·units exactly."""
    fractions = [Fraction(float(w)).limit_denominator(10**9) for w in p]
    if sum(fractions) == 1:
        capacity = math.lcm(*(f.denominator for f in fractions))
        if capacity <= 10**15:
            return [int(f * m * capacity) for f in fractions], capacity
    total = m * units
    shares = [float(w) / float(p.sum()) * total for w in p]
    masses = [int(x) for x in shares]
    by_remainder = sorted(range(len(p)), key=lambda i: (-(shares[i] - masses[i]), i))
    for i in by_remainder[: total - sum(masses)]:
        masses[i] += 1
    return masses, units


def _check_target_weights(p: torch.Tensor) -> torch.Tensor:
    p = torch.as_tensor(p, dtype=torch.float64)
    if p.ndim != 1 or len(p) == 0:
        raise ValueError("Target weights p must be a non-empty 1-D tensor.")
    if not torch.isfinite(p).all() or (p < 0).any():
        raise ValueError("Target weights p must be finite and non-negative.")
    if abs(float(p.sum()) - 1.0) > 1e-6:
        raise ValueError(f"Target weights p must sum to 1, got {float(p.sum())}.")
    return p
