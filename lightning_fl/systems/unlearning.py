"""Informed federated unlearning: the sensitivity bookkeeping of IFU and SIFU (Fraboni, Van
Waerebeke, Scaman, Vidal, Lorenzi, Andreux, "Sequential informed federated unlearning",
AISTATS 2024; Fraboni thesis ch. 5, Alg. 6–7). Pure functions and plain objects; the
callback that drives them is :class:`lightning_fl.callbacks.Unlearning`."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch


def sensitivity_threshold(epsilon: float, delta: float, sigma: float) -> float:
    """Ψ* = ε σ / sqrt(2 ln(1.25/δ)) (thesis eq. 5.13): the largest sensitivity that noise
    N(0, σ² I) makes (ε, δ)-unlearned (Thm 5.2)."""
    check_privacy(epsilon, delta, sigma)
    return epsilon * sigma / math.sqrt(2 * math.log(1.25 / delta))


def noise_for_sensitivity(psi: float, epsilon: float, delta: float) -> float:
    """σ(n, c) = sqrt(2 ln(1.25/δ)) Ψ(n, c) / ε (Thm 5.2)."""
    check_privacy(epsilon, delta, 0.0)
    return math.sqrt(2 * math.log(1.25 / delta)) * psi / epsilon


def check_privacy(epsilon: float, delta: float, sigma: float) -> None:
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}.")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}.")
    if not sigma >= 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}.")


class BranchHistory:
    """Alg. 7's bookkeeping. Branch 0 is the original training; branch r is the retraining
    after the r-th request. ``psi[s][n]`` holds Ψ_s(n, i) for every client i (eq. 5.15:
    restarted at 0 on each branch, 0 for removed clients). ``lineage`` is the oracle O(r):
    the nodes (s, n) at which the current branch's ancestry left branch s.

    Memory: one float64 per client and round of the branches on the lineage (10⁴ rounds ×
    100 clients = 8 MB per branch); models are kept by :class:`ModelVersions`.
    """

    def __init__(self, num_clients: int, threshold: float) -> None:
        self.num_clients, self.threshold = num_clients, threshold
        self.psi: list[list[np.ndarray]] = [[np.zeros(num_clients)]]
        self.lineage: list[tuple[int, int]] = []
        #: per branch, each client's latest round with Ψ_s(n, i) ≤ Ψ* (up to the branch's node)
        self.best: list[np.ndarray] = [np.zeros(num_clients, dtype=np.int64)]

    @property
    def branch(self) -> int:
        return len(self.psi) - 1

    def rounds(self, branch: int) -> int:
        """The last round index n recorded in ``branch``."""
        return len(self.psi[branch]) - 1

    def record(self, increments: np.ndarray, decay: float = 1.0) -> None:
        """Ψ_r(n+1, i) = decay·Ψ_r(n, i) + increment_i (Alg. 6, App. D.2.5)."""
        self.psi[-1].append(decay * self.psi[-1][-1] + np.asarray(increments, dtype=float))
        within = self.psi[-1][-1] <= self.threshold
        self.best[-1][within] = self.rounds(self.branch)

    def set_sensitivity(self, branch: int, clients: Iterable[int], n: int) -> float:
        """Ψ_s(n, W) = max_{i∈W} Ψ_s(n, i) (eq. 5.16)."""
        return float(max(self.psi[branch][n][list(clients)], default=0.0))

    def last_within(self, branch: int, clients: Iterable[int], upto: int) -> int:
        """T = argmax {n ≤ upto : Ψ_s(n, W) ≤ Ψ*} (eq. 5.18); n = 0 always qualifies."""
        clients = list(clients)
        for n in range(upto, -1, -1):
            if self.set_sensitivity(branch, clients, n) <= self.threshold:
                return n
        return 0

    def fork_point(self, clients: Iterable[int]) -> tuple[int, int]:
        """(ζ_r, T_r) of eqs. 5.17–5.18: the first node of O(r−1) where the requested
        clients' sensitivity exceeds Ψ*, else the current branch; and the latest round of
        that branch (up to its node) within Ψ*.

        Three rounds of increments (0.4, 0.2, 0.6) and Ψ* = 1: Ψ(n, 0) = 0.4n passes Ψ*
        after round 2, Ψ(n, 1) = 0.2n never does, Ψ(n, 2) = 0.6n after round 1; a set's
        Ψ is its largest client's (eq. 5.16), so SIFU restarts {0, 1} from round 2.

        >>> history = BranchHistory(num_clients=3, threshold=1.0)
        >>> for _ in range(3):
        ...     history.record([0.4, 0.2, 0.6])
        >>> [history.fork_point(w) for w in ([0], [1], [2], [0, 1])]
        [(0, 2), (0, 3), (0, 1), (0, 2)]
        """
        clients = list(clients)
        for branch, node in self.lineage:
            if self.set_sensitivity(branch, clients, node) > self.threshold:
                return branch, self.last_within(branch, clients, node)
        current = self.branch
        return current, self.last_within(current, clients, self.rounds(current))

    def fork(self, clients: Iterable[int]) -> tuple[int, int]:
        """Apply a request: O(r) = {(s, n) ∈ O(r−1) : s < ζ_r} ∪ {(ζ_r, T_r)} (eq. 5.19) and
        a new branch whose Ψ starts at 0. Returns (ζ_r, T_r)."""
        zeta, t = self.fork_point(clients)
        self.lineage = [(s, n) for s, n in self.lineage if s < zeta] + [(zeta, t)]
        self.best[zeta] = np.array(
            [self.last_within(zeta, [i], t) for i in range(self.num_clients)]
        )
        self.psi.append([np.zeros(self.num_clients)])
        self.best.append(np.zeros(self.num_clients, dtype=np.int64))
        return zeta, t

    def max_sensitivity(self) -> float:
        """max over rounds and clients of the current branch's Ψ (LAST's noise)."""
        return float(max(row.max() for row in self.psi[-1]))

    def state_dict(self) -> dict:
        return {
            "num_clients": self.num_clients, "threshold": self.threshold,
            "psi": [np.stack(rows).tolist() for rows in self.psi],
            "lineage": [list(node) for node in self.lineage],
            "best": [b.tolist() for b in self.best],
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.num_clients, self.threshold = int(state["num_clients"]), float(state["threshold"])
        self.psi = [[np.asarray(row, dtype=float) for row in rows] for rows in state["psi"]]
        self.lineage = [(int(s), int(n)) for s, n in state["lineage"]]
        self.best = [np.asarray(b, dtype=np.int64) for b in state["best"]]


class ModelVersions:
    """The global models θ_s^n a future request may restart from, keyed by (branch, round):
    for every client i and every branch s of the lineage (and the current one), the latest
    round whose Ψ_s(n, i) ≤ Ψ* (the authors' memory-efficient scheme), plus each branch's
    round 0. With decay = 1, Ψ is non-decreasing, so a request's T_r (the smallest of its
    clients' rounds) is always kept. Memory: (distinct kept versions) × d × 4 bytes; most
    clients pass Ψ* early, so the versions are few.
    """

    def __init__(self) -> None:
        self.models: dict[tuple[int, int], object] = {}

    def keep(self, key: tuple[int, int], model) -> None:
        self.models[key] = model

    def needed(self, history: BranchHistory, remaining: Iterable[int]) -> set[tuple[int, int]]:
        remaining = list(remaining)
        branches = [s for s, _ in history.lineage] + [history.branch]
        needed = {(s, 0) for s in branches}
        for s in branches:
            needed |= {(s, int(n)) for n in history.best[s][remaining]}
        return needed

    def prune(self, history: BranchHistory, remaining: Iterable[int]) -> None:
        needed = self.needed(history, remaining)
        self.models = {k: v for k, v in self.models.items() if k in needed}

    def restart_model(self, history: BranchHistory, branch: int, t: int, clients: list[int]):
        """θ_ζ^T, or (decay < 1) the latest kept round n ≤ T of that branch with
        Ψ_ζ(n, W) ≤ Ψ*."""
        for n in range(t, -1, -1):
            if (branch, n) in self.models and (
                history.set_sensitivity(branch, clients, n) <= history.threshold
            ):
                return n, self.models[(branch, n)]
        raise KeyError(f"No kept model of branch {branch} at or before round {t}.")


def sensitivity_increments(
    deltas: dict[int, torch.Tensor],
    target_weights: torch.Tensor,
    remaining: list[int],
    mean_update: torch.Tensor,
    server_lr: float,
    num_clients: int,
) -> torch.Tensor:
    """‖Δ(I, θ^n) − Δ(I∖{c}, θ^n)‖ for each participant c of ``deltas`` (eq. 5.8's term;
    App. D.2.5), in closed form:

        η_g (p_c/(1 − p_c)) ‖Δ_c − Δ̄‖,   Δ̄ = (θ^{n+1} − θ^n)/η_g = Σ_j ω_j Δ_j,

    where p_c is c's weight in the federated objective (the aggregator's target weights,
    renormalized over the ``remaining`` clients; uniform p_c = 1/|I| in the authors' code)
    and removing c renormalizes the others' weights by 1/(1 − p_c). Under full
    participation (ω = p) this equals the difference of the two FedAvg aggregations
    exactly, whatever the weighting and η_g. ``mean_update`` is Δ̄; 0 for the others.

    >>> deltas = {0: torch.tensor([1.0, 0.0]), 2: torch.tensor([0.0, 2.0])}
    >>> p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    >>> sensitivity_increments(deltas, p, [0, 1, 2], torch.zeros(2), 1.0, 3).tolist()
    [1.0, 0.0, 0.6666666666666666]
    """
    p = target_weights.to(torch.float64)
    total = float(p[remaining].sum()) if remaining else 0.0
    # host: ζ's increments are Python floats (the norms below), kept in the history
    increments = torch.zeros(num_clients, dtype=torch.float64)
    for client, delta in deltas.items():
        p_c = float(p[client]) / total if total > 0 else 0.0
        if 0 < p_c < 1:
            scale = server_lr * p_c / (1 - p_c)
            increments[client] = scale * float((delta - mean_update).double().norm())
    return increments
