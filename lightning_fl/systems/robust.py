"""Robust aggregation rules over a round's client updates, free of Lightning.

Each rule reads the accepted updates as the rows of ``updates`` (k × d) and their
aggregation weights ω_i (k), and returns one d-vector. The weights are normalized,
ω̄_i = ω_i / Σ_j ω_j, so that with equal weights each rule is its paper's unweighted
rule, and with a sampler's unequal weights it is the weighted rule written beside it:

- :func:`coordinate_median`: Yin et al., "Byzantine-Robust Distributed Learning: Towards
  Optimal Statistical Rates", ICML 2018, Definition 1 (coordinate-wise median);
- :func:`trimmed_mean`: Yin et al. 2018, Definition 2 (coordinate-wise β-trimmed mean);
- :func:`krum_scores` and :func:`krum_select`: Blanchard et al., "Machine Learning with
  Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017, §4 (Krum, Multi-Krum);
- :func:`centered_clipping`: Karimireddy, He and Jaggi, "Learning from History for
  Byzantine Robust Optimization", ICML 2021, eq. (CC).

Ties are broken toward the lower row (the participation lists clients in increasing id).

>>> import torch
>>> rows = torch.tensor([[0.0], [1.0], [10.0]], dtype=torch.float64)
>>> coordinate_median(rows, torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64))
tensor([1.], dtype=torch.float64)
>>> coordinate_median(rows, torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64))
tensor([5.5000], dtype=torch.float64)
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Cumulative weights within this of exactly one half meet the median's interval rule.
HALF_TOLERANCE = 1e-12


def normalized(weights: Tensor) -> Tensor:
    """ω̄ = ω / Σω; refuses weights that are negative or sum to zero."""
    total = weights.sum()
    if bool((weights < 0).any()) or not float(total) > 0:
        raise ValueError(
            f"robust aggregation needs weights >= 0 with a positive sum, got {weights}."
        )
    return weights / total


def coordinate_median(updates: Tensor, weights: Tensor) -> Tensor:
    """The weighted median of each coordinate: a minimizer of Σ_i ω̄_i |x − u_{i,j}|.

    Sorted values x_(1) ≤ … ≤ x_(k) with cumulative weights F_l: the median is x_(l) at
    the first l with F_l ≥ 1/2, or, when F_l = 1/2 exactly (every point of
    [x_(l), x_(l+1)] minimizes), the midpoint (x_(l) + x_(l+1))/2. With equal weights this
    is the usual median (the mean of the two middle values for an even k), Yin et al.'s
    Definition 1.
    """
    w = normalized(weights).to(updates.dtype)
    values, order = torch.sort(updates, dim=0, stable=True)
    cumulative = torch.cumsum(w[order], dim=0)
    k = updates.shape[0]
    first = torch.searchsorted(cumulative.T.contiguous(), torch.full(
        (updates.shape[1], 1), 0.5 - HALF_TOLERANCE, dtype=cumulative.dtype,
        device=cumulative.device)).squeeze(1).clamp(max=k - 1)  # fmt: skip
    at = values.gather(0, first.unsqueeze(0)).squeeze(0)
    following = values.gather(0, (first + 1).clamp(max=k - 1).unsqueeze(0)).squeeze(0)
    reached = cumulative.gather(0, first.unsqueeze(0)).squeeze(0)
    exact_half = (reached - 0.5).abs() <= HALF_TOLERANCE
    return torch.where(exact_half & (first < k - 1), (at + following) / 2, at)


def trimmed_mean(updates: Tensor, weights: Tensor, beta: float) -> Tensor:
    """Per coordinate, drop the b = ⌊βk⌋ largest and b smallest of the k values and take
    the mean of the rest, weighted by their ω̄ renormalized over the kept values (Yin et
    al.'s Definition 2 with equal weights). Needs 0 ≤ β < 1/2."""
    if not 0 <= beta < 0.5:
        raise ValueError(f"beta must be in [0, 1/2), got {beta}.")
    w = normalized(weights).to(updates.dtype)
    k = updates.shape[0]
    b = int(beta * k)
    values, order = torch.sort(updates, dim=0, stable=True)
    kept_values, kept_weights = values[b : k - b], w[order][b : k - b]
    return (kept_values * kept_weights).sum(0) / kept_weights.sum(0)


def krum_scores(updates: Tensor, num_byzantine: int) -> Tensor:
    """Blanchard et al. 2017, §4: s(i) = Σ_{i→j} ‖u_i − u_j‖², the sum over the k − f − 2
    updates closest to u_i (itself excluded). Needs k > 2f + 2."""
    k, f = updates.shape[0], num_byzantine
    if k <= 2 * f + 2:
        raise ValueError(
            f"Krum with f={f} needs more than 2f + 2 = {2 * f + 2} updates in a round "
            f"(Blanchard et al. 2017, Prop. 1), got {k}: lower f or sample more clients."
        )
    distances = torch.cdist(updates, updates).pow(2)
    distances.fill_diagonal_(float("inf"))
    nearest = torch.sort(distances, dim=1).values[:, : k - f - 2]
    return nearest.sum(1)


def krum_select(updates: Tensor, num_byzantine: int, num_selected: int = 1) -> Tensor:
    """The rows of the ``num_selected`` lowest Krum scores, in increasing score (ties: the
    lower row): Krum for 1, Multi-Krum for more."""
    scores = krum_scores(updates, num_byzantine)
    if not 1 <= num_selected <= updates.shape[0]:
        raise ValueError(
            f"num_selected must be in [1, {updates.shape[0]}] (the round's updates), "
            f"got {num_selected}."
        )
    return torch.sort(scores, stable=True).indices[:num_selected]


def centered_clipping(
    updates: Tensor, weights: Tensor, center: Tensor, tau: float, iterations: int
) -> Tensor:
    """Karimireddy et al. 2021, eq. (CC), weighted: from v_0 = ``center`` (the previous
    round's aggregate), ``iterations`` times
    v_{l+1} = v_l + Σ_i ω̄_i (u_i − v_l) min(1, τ / ‖u_i − v_l‖)."""
    if not tau > 0 or iterations < 1:
        raise ValueError(f"tau must be > 0 and iterations >= 1, got {tau}, {iterations}.")
    w = normalized(weights).to(updates.dtype)
    v = center.to(updates.dtype)
    for _ in range(iterations):
        offsets = updates - v
        norms = offsets.norm(dim=1)
        scale = torch.where(norms > tau, tau / norms.clamp_min(torch.finfo(norms.dtype).tiny),
                            torch.ones_like(norms))  # fmt: skip
        v = v + (w * scale) @ offsets
    return v


__all__ = [
    "centered_clipping",
    "coordinate_median",
    "krum_scores",
    "krum_select",
    "normalized",
    "trimmed_mean",
]
