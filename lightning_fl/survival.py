"""Survival analysis for Fed-TCGA-BRCA (FLamby, du Terrail et al., NeurIPS 2022 D&B, §4).

The reference model is a linear Cox proportional-hazards model trained with the negative
Cox partial log-likelihood; the metric is Harrell's concordance index.
"""

from __future__ import annotations

import torch
from torch import Tensor


def cox_partial_likelihood_loss(scores: Tensor, events: Tensor, times: Tensor) -> Tensor:
    """Mean over the batch of E_i · (log Σ_{j ∈ R_i} exp(s_j) − s_i).

    The batch is sorted by decreasing time (stable, so tied times keep their input order)
    and the risk set R_i of the i-th sample is every sample up to and including it, as in
    FLamby's ``BaselineLoss`` (Cox 1972, eq. 12, Breslow-free "order of appearance" ties).
    Censored samples contribute 0 but count in the mean.
    """
    scores, events, times = scores.reshape(-1), events.reshape(-1), times.reshape(-1)
    order = torch.sort(-times, stable=True).indices
    s, e = scores[order], events[order].to(scores.dtype)
    return ((torch.logcumsumexp(s, dim=0) - s) * e).mean()


def concordance_index(times: Tensor, risk: Tensor, events: Tensor) -> float:
    """Harrell's C-index of ``risk`` scores (higher risk = earlier event).

    A pair (i, j) is comparable when i has an observed event and T_i < T_j, or T_i = T_j
    with j censored (lifelines' convention). It is concordant when risk_i > risk_j; equal
    risks count one half. Matches ``lifelines.utils.concordance_index(T, -risk, E)``, the
    metric of FLamby's Fed-TCGA-BRCA. Returns NaN when no pair is comparable.
    """
    t = times.reshape(-1, 1).double()
    r = risk.reshape(-1, 1).double()
    e = events.reshape(-1, 1).bool()
    comparable = e & ((t < t.T) | ((t == t.T) & ~e.T))
    if not comparable.any():
        return float("nan")
    score = (r > r.T).double() + 0.5 * (r == r.T).double()
    return float(score[comparable].sum() / comparable.sum())
