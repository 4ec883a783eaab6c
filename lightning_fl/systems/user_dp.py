"""User-level differential privacy for federated averaging, free of Lightning.

- DP-FedAvg: McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private Recurrent
  Language Models", ICLR 2018, Algorithm 1: bounded weights w_k = min(n_k/ŵ, 1), the
  fixed-denominator estimator f̃_f = Σ_{k∈C} w_k Δ_k / (qW) and the clipped-denominator
  estimator f̃_c = Σ_{k∈C} w_k Δ_k / max(qW_min, Σ_{k∈C} w_k), and their noise
  σ = zS/(qW) and σ = 2zS/(qW_min) (:func:`bounded_weights`, :func:`noise_std`);
- adaptive clipping: Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private
  Learning with Adaptive Clipping", NeurIPS 2021, Algorithm 1: the geometric update
  C ← C·exp(−η_C (b̃ − γ)) toward the γ-quantile of the update norms, from the noised
  fraction b̃ of unclipped updates, and the split of the noise multiplier z between the
  updates and the count, z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (:func:`update_noise_multiplier`,
  :func:`next_clip_norm`);
- accounting (:func:`epsilon`): the rounds as a composition of sampled Gaussian
  mechanisms of noise multiplier z, by Rényi DP or by privacy-loss distributions, through
  Google's ``dp-accounting`` library. Poisson sampling of rate q uses the add/remove-one
  relation (``PoissonSampledDpEvent``); fixed-size sampling of m of n without replacement
  uses the replace-one relation (``SampledWithoutReplacementDpEvent``, Wang, Balle and
  Kasiviswanathan 2019), which dp-accounting's PLD accountant does not support;
  full participation is the plain Gaussian mechanism.

>>> bounded_weights([10, 40, 200], cap=100.0).tolist()
[0.1, 0.4, 1.0]
>>> round(update_noise_multiplier(1.0, count_std=5.0), 6)
1.005038
>>> round(next_clip_norm(1.0, unclipped_fraction=0.75, target_quantile=0.5, lr=0.2), 6)
0.951229
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Accountant = Literal["rdp", "pld"]
Estimator = Literal["fixed", "clipped"]


@dataclass(frozen=True)
class Sampling:
    """How each round's users are drawn, as the accountant needs it: ``"poisson"`` (each
    user independently with probability ``rate``), ``"fixed"`` (``size`` of
    ``population`` uniformly without replacement) or ``"full"`` (everyone, q = 1)."""

    kind: Literal["poisson", "fixed", "full"]
    rate: float
    population: int = 0
    size: int = 0

    @classmethod
    def poisson(cls, rate: float) -> Sampling:
        if not 0 < rate <= 1:
            raise ValueError(f"a Poisson sampling rate must be in (0, 1], got {rate}.")
        return cls("poisson", float(rate))

    @classmethod
    def fixed(cls, size: int, population: int) -> Sampling:
        if not 1 <= size <= population:
            raise ValueError(
                f"fixed-size sampling needs 1 <= size <= population, got {size} of {population}."
            )
        if size == population:
            return cls.full()
        return cls("fixed", size / population, int(population), int(size))

    @classmethod
    def full(cls) -> Sampling:
        return cls("full", 1.0)


def bounded_weights(counts: Sequence[int] | np.ndarray, cap: float | None) -> np.ndarray:
    """w_k = min(n_k/ŵ, 1) (McMahan et al. 2018, Alg. 1); ŵ = max n_k when ``cap`` is
    None (every weight n_k/max n, none capped). Users without data get 0."""
    n = np.asarray(counts, dtype=np.float64)
    cap = float(n.max()) if cap is None else float(cap)
    if not cap > 0:
        raise ValueError(f"the per-user example cap ŵ must be > 0, got {cap}.")
    return np.minimum(n / cap, 1.0)


def noise_std(
    noise_multiplier: float,
    clip_norm: float,
    rate: float,
    total_weight: float,
    estimator: Estimator = "fixed",
    min_weight: float | None = None,
) -> float:
    """σ of the Gaussian noise on the estimator (McMahan et al. 2018, Alg. 1):
    zS/(qW) for the fixed denominator, 2zS/(qW_min) for the clipped one."""
    if estimator == "fixed":
        return noise_multiplier * clip_norm / (rate * total_weight)
    if min_weight is None or not min_weight > 0:
        raise ValueError("the clipped-denominator estimator needs W_min > 0 (min_weight).")
    return 2 * noise_multiplier * clip_norm / (rate * min_weight)


def update_noise_multiplier(noise_multiplier: float, count_std: float) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2): the updates' share of the noise multiplier z when
    the count of unclipped updates gets noise σ_b (Andrew et al. 2021, Alg. 1 and Thm. 1).
    Needs 2σ_b > z."""
    if count_std <= noise_multiplier / 2:
        raise ValueError(
            f"adaptive clipping needs the count's noise σ_b > z/2 = {noise_multiplier / 2:g} "
            f"(Andrew et al. 2021, Alg. 1), got σ_b = {count_std:g}: raise count_std."
        )
    return (noise_multiplier**-2 - (2 * count_std) ** -2) ** -0.5


def next_clip_norm(
    clip_norm: float, unclipped_fraction: float, target_quantile: float, lr: float
) -> float:
    """C^{t+1} = C^t · exp(−η_C (b̃^t − γ)) (Andrew et al. 2021, Alg. 1)."""
    return clip_norm * math.exp(-lr * (unclipped_fraction - target_quantile))


def epsilon(
    noise_multiplier: float,
    sampling: Sampling,
    rounds: int,
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """ε after ``rounds`` rounds at ``delta``, by ``dp-accounting`` (RDP with its default
    orders, or PLD). 0 rounds spend nothing; z = 0 is no privacy (∞)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    try:
        import dp_accounting  # noqa: F401
    except ImportError as missing:
        raise ImportError(
            "privacy accounting needs Google's dp-accounting: pip install dp-accounting "
            '(or pip install -e ".[privacy]" from a clone).'
        ) from missing
    return _epsilon(float(noise_multiplier), sampling, int(rounds), float(delta), accountant)


@functools.lru_cache(maxsize=1024)
def _epsilon(
    noise_multiplier: float, sampling: Sampling, rounds: int, delta: float, accountant: str
) -> float:
    if accountant == "rdp":
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

        orders, one_round = _one_round_rdp(noise_multiplier, sampling)
        # what RdpAccountant.compose(SelfComposedDpEvent(event, rounds)) holds: rounds × RDP
        return float(compute_epsilon(orders, rounds * one_round, delta)[0])
    if sampling.kind == "fixed":
        raise ValueError(
            "dp-accounting's PLD accountant has no fixed-size sampling without replacement: "
            "use accountant='rdp', or sample by Poisson (PoissonSampler)."
        )
    from dp_accounting import pld

    event, relation = _one_round_event(noise_multiplier, sampling)
    import dp_accounting as dpa

    engine = pld.PLDAccountant(neighboring_relation=relation)
    engine.compose(dpa.SelfComposedDpEvent(event, rounds))
    return float(engine.get_epsilon(delta))


def _one_round_event(noise_multiplier: float, sampling: Sampling):
    """dp-accounting's event of one round, and its neighbouring relation."""
    import dp_accounting as dpa

    gaussian = dpa.GaussianDpEvent(noise_multiplier)
    if sampling.kind == "poisson":
        return dpa.PoissonSampledDpEvent(
            sampling.rate, gaussian
        ), dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    if sampling.kind == "fixed":
        event = dpa.SampledWithoutReplacementDpEvent(sampling.population, sampling.size, gaussian)
        return event, dpa.NeighboringRelation.REPLACE_ONE
    return gaussian, dpa.NeighboringRelation.ADD_OR_REMOVE_ONE


@functools.lru_cache(maxsize=64)
def _one_round_rdp(noise_multiplier: float, sampling: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """The RDP orders and one round's RDP, by dp-accounting's accountant (computed once per
    mechanism: a fixed-size round costs about 0.4 s, and a fit asks for ε every round)."""
    from dp_accounting import rdp

    event, relation = _one_round_event(noise_multiplier, sampling)
    engine = rdp.RdpAccountant(neighboring_relation=relation)
    absl = logging.getLogger("absl")  # quiet: RDP orders that do not converge are skipped
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        engine.compose(event)
    finally:
        absl.setLevel(level)
    return np.asarray(engine._orders), np.asarray(engine._rdp)


__all__ = [
    "Sampling",
    "bounded_weights",
    "epsilon",
    "next_clip_norm",
    "noise_std",
    "update_noise_multiplier",
]
