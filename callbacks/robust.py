"""Robust aggregators: the server step reads every accepted update, not only their
weighted sum, and replaces FedAvg's weighted mean with a statistic that a few malicious
clients cannot move far (the rules of :mod:`lightning_fl.systems.robust`).

θ^{t+1} = θ^t + η_g · R(Δ_1, …, Δ_k; ω̄), with the sampler's weights normalized,
ω̄_i = ω_i / Σ_j ω_j: a robust rule estimates the participants' weighted mean update, so
the unbiased scale Σ_j ω_j ≠ 1 of some samplers (uniform sampling with sample weights,
Poisson sampling) is not applied. The updates ride the round's all-reduce as one row per
participant (``RoundState.received_updates``), so several processes give the
one-process result; the memory is k × d floats a round.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_fl.checks import require_rate
from lightning_fl.engine.plugins import Aggregator, RoundState, Weighting
from lightning_fl.engine.tensors import add_flat_
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.robust import (
    centered_clipping,
    coordinate_median,
    krum_select,
    normalized,
    trimmed_mean,
)


class RobustAggregator(Aggregator):
    """Base class: θ^{t+1} = θ^t + η_g · :meth:`robust_update` of the round's accepted
    updates (rows) and weights. Rounds whose updates were all dropped leave θ unchanged."""

    traits = {Trait.IGNORES_THE_UPDATE_SUM: "", Trait.STEPS_OTHERWISE_THAN_FEDAVG: ""}

    supports_vectorized_clients = True
    needs_client_updates = True

    def __init__(self, weighting: Weighting = "samples", server_lr: float = 1.0) -> None:
        super().__init__(weighting)
        self.server_lr = require_rate("server_lr", server_lr, 1.0)

    def robust_update(
        self, clients: tuple[int, ...], updates: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The aggregate of the (k × d) ``updates`` of ``clients`` with weights ω (k)."""
        raise NotImplementedError

    @torch.no_grad()
    def aggregate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: RoundState
    ) -> None:
        clients, updates, weights = state.received_updates()
        if not clients:
            return
        aggregate = self.robust_update(clients, updates.double(), weights)
        add_flat_(state.global_tensors, self.server_lr * aggregate)


class CoordinateMedian(RobustAggregator):
    """Coordinate-wise median (Yin et al., ICML 2018, Def. 1), weighted by ω̄: each
    coordinate of the server step is a minimizer of Σ_i ω̄_i |x − Δ_{i,j}| (the midpoint
    when a whole interval minimizes; the usual median for equal weights)."""

    def robust_update(self, clients, updates, weights):
        return coordinate_median(updates, weights)


class TrimmedMean(RobustAggregator):
    """Coordinate-wise β-trimmed mean (Yin et al., ICML 2018, Def. 2): the ⌊βk⌋ largest and
    smallest values of each coordinate dropped, the rest averaged with their ω̄.

    Args:
        beta: the fraction trimmed at each end, in [0, 1/2).
    """

    def __init__(
        self, beta: float = 0.1, weighting: Weighting = "samples", server_lr: float = 1.0
    ) -> None:
        super().__init__(weighting, server_lr)
        if not 0 <= beta < 0.5:
            raise ValueError(f"beta must be in [0, 1/2), got {beta}.")
        self.beta = beta

    def robust_update(self, clients, updates, weights):
        return trimmed_mean(updates, weights, self.beta)


class Krum(RobustAggregator):
    """Krum and Multi-Krum (Blanchard et al., NeurIPS 2017, §4): each update is scored by
    the squared distances to its k − f − 2 nearest others; the ``num_selected`` best are
    averaged with their ω̄ (Krum: the single best update). A round needs k > 2f + 2
    accepted updates, or it stops with the count.

    Args:
        num_byzantine: f, the attackers tolerated in a round.
        num_selected: m of Multi-Krum (1: Krum).
    """

    traits = {Trait.NEEDS_MORE_THAN_2F_PLUS_2_CLIENTS: ""}

    def __init__(
        self,
        num_byzantine: int = 1,
        num_selected: int = 1,
        weighting: Weighting = "samples",
        server_lr: float = 1.0,
    ) -> None:
        super().__init__(weighting, server_lr)
        if num_byzantine < 0 or num_selected < 1:
            raise ValueError(
                f"num_byzantine must be >= 0 and num_selected >= 1, got {num_byzantine}, "
                f"{num_selected}."
            )
        self.num_byzantine, self.num_selected = int(num_byzantine), int(num_selected)
        #: The participants chosen in the last round (for logs and tests).
        self.selected: tuple[int, ...] = ()

    def robust_update(self, clients, updates, weights):
        rows = krum_select(updates, self.num_byzantine, self.num_selected)
        self.selected = tuple(clients[r] for r in rows.tolist())
        return normalized(weights[rows]).to(updates.dtype) @ updates[rows]


class CenteredClipping(RobustAggregator):
    """Centered clipping (Karimireddy, He and Jaggi, ICML 2021, eq. CC), weighted by ω̄:
    from the previous round's aggregate v (0 at the start),
    v ← v + Σ_i ω̄_i (Δ_i − v) min(1, τ/‖Δ_i − v‖), ``iterations`` times; the server steps
    by v, which is kept (and checkpointed) for the next round.

    Args:
        tau: the clipping radius τ.
        iterations: the fixed-point iterations L.
    """

    def __init__(
        self,
        tau: float = 10.0,
        iterations: int = 1,
        weighting: Weighting = "samples",
        server_lr: float = 1.0,
    ) -> None:
        super().__init__(weighting, server_lr)
        if not tau > 0 or iterations < 1:
            raise ValueError(f"tau must be > 0 and iterations >= 1, got {tau}, {iterations}.")
        self.tau, self.iterations = float(tau), int(iterations)
        self.add_server_state("center")  # v of the last round (the next round's start)

    def robust_update(self, clients, updates, weights):
        start = torch.zeros_like(updates[0]) if self.center is None else self.center
        self.center = centered_clipping(updates, weights, start, self.tau, self.iterations)
        return self.center


__all__ = ["CenteredClipping", "CoordinateMedian", "Krum", "RobustAggregator", "TrimmedMean"]
