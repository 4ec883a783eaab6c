"""The distributed discrete Gaussian mechanism: noise in the integers (Kairouz, Liu, Steinke,
"The Distributed Discrete Gaussian Mechanism for Federated Learning with Secure
Aggregation", ICML 2021; DDG below).

Noise added to fixed-point values as floats leaks through the floats' low bits (Mironov,
"On Significance of the Least Significant Bits for Differential Privacy", CCS 2012).
DDG works on the integer grid instead, where secure aggregation's sums are exact:

1. **scale and round** (DDG §4.1, Alg. 1 step 3): a contribution x (L2 norm ≤ c) becomes
   x/γ (granularity γ, here a power of two, 2^−g, so that γ·k is exact in float64 and in
   secure aggregation's fixed point), rounded coordinate by coordinate to ⌊x/γ⌋ or
   ⌈x/γ⌉ with the probabilities that make it unbiased, again until its norm is at most
   the bound of DDG Thm 1 / Prop. 22 (:func:`rounded_l2_norm_bound`), which holds for a
   draw with probability ≥ 1 − β (**conditional randomized rounding**);
2. **noise** (DDG Alg. 1 step 4): each of the n parties that add noise adds a vector of
   independent discrete Gaussians N_Z(0, s²) (:func:`sample_discrete_gaussian`: Canonne,
   Kamath, Steinke, NeurIPS 2020, Alg. 3: discrete Laplace proposals accepted with
   probability exp(−(|Y| − s²/t)²/(2s²)), t = ⌊s⌋ + 1);
3. **accounting** (:func:`ddg_epsilon`): the sum of n discrete Gaussians N_Z(0, s²) is
   close to N_Z(0, ns²) (DDG Thm 1, with the inflation τ = 10 Σ_{k=1}^{n−1}
   exp(−2π²s² k/(k+1))), and the mechanism with L2 sensitivity Δ₂ and L1 sensitivity Δ₁
   (in grid units) is (α, ε(α))-RDP with ε(α) the least of α Δ₂²/(2ns²) + τd,
   (α/2)(Δ₂²/(ns²) + 2Δ₁τ/(√n s) + τ²d) and (α/2)(Δ₂/(√n s) + τ√d)² (DDG Prop. 14,
   eq. 17), composed over rounds and converted to (ε, δ) by dp-accounting's
   conversion (Canonne, Kamath, Steinke 2020, Prop. 12), over the integer orders
   2, ..., 128 and 256 of the authors' code. Δ₂ is the rounded bound of step 1 and
   Δ₁ = Δ₂ · min(√d, Δ₂) (integers: L1 ≤ L2²).

What is left out of DDG: the random rotation (a randomized Hadamard transform) that
flattens a vector before a small modulus m (16 to 20 bits) wraps it: secure
aggregation's ring here is Z_{2^64}, whose sums do not wrap, so no coordinate needs
flattening; and amplification by subsampling (the accountant is for full participation,
cross-silo's rounds).

>>> round(rounded_l2_norm_bound(10.0, 0.0, 4), 6)  # c/γ + √d
12.0
>>> tau(3.0, 1)  # one party adds noise: its sum is a discrete Gaussian
0.0
>>> tau(0.5, 3) > tau(1.0, 3) > 0  # shares of small scale are far from a discrete Gaussian
True
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

#: The RDP orders of the authors' accountant (integers: the bound is for integer α).
ORDERS = (*range(2, 129), 256)

#: Uniform float64 draws in [0, 1): a noise source's stream (see :mod:`.privacy_noise`).
Uniforms = Callable[[int], np.ndarray]


def rounded_l2_norm_bound(l2_bound: float, beta: float, dim: int) -> float:
    """The L2 norm bound, in grid units, after conditional randomized rounding of a vector
    of norm ≤ ``l2_bound`` (already scaled by 1/γ) in ``dim`` coordinates: c + √d with
    β = 0, else min(c + √d, √(c² + d/4 + √(2 ln(1/β))(c + √d/2))) (DDG Thm 1)."""
    if not l2_bound > 0 or dim < 1 or not 0 <= beta < 1:
        raise ValueError(
            f"rounded_l2_norm_bound needs l2_bound > 0, dim >= 1 and beta in [0, 1), got "
            f"{l2_bound}, {dim}, {beta}."
        )
    plain = l2_bound + math.sqrt(dim)
    if beta == 0:
        return plain
    squared = (
        l2_bound**2 + dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (l2_bound + math.sqrt(dim) / 2)
    )
    return min(plain, math.sqrt(squared))


def tau(local_std: float, parties: int) -> float:
    """τ = 10 Σ_{k=1}^{n−1} exp(−2π² s² k/(k+1)): how far the sum of n discrete Gaussians
    N_Z(0, s²) is from N_Z(0, ns²) (DDG Thm 1)."""
    return 10 * math.fsum(
        math.exp(-2 * (math.pi * local_std) ** 2 * k / (k + 1)) for k in range(1, parties)
    )


def ddg_rdp(order: int, l2_sensitivity: float, l1_sensitivity: float, local_std: float,
            parties: int, dim: int) -> float:  # fmt: skip
    """ε(α) of one round of the distributed discrete Gaussian: n parties each add
    N_Z(0, s²)^d to a sum of sensitivities Δ₂, Δ₁ (grid units; DDG Prop. 14, eq. 17)."""
    t = tau(local_std, parties)
    scale = math.sqrt(parties) * local_std
    l2, l1 = l2_sensitivity / scale, l1_sensitivity / scale
    return min(
        order * l2**2 / 2 + t * dim,
        order / 2 * (l2**2 + 2 * l1 * t + t**2 * dim),
        order / 2 * (l2 + math.sqrt(dim) * t) ** 2,
    )


#: β of the authors' conditional randomized rounding.
DEFAULT_BETA = math.exp(-0.5)


def ddg_epsilon(
    l2_clip: float, granularity: float, local_std: float, parties: int, dim: int,
    rounds: int, delta: float, beta: float = DEFAULT_BETA,
) -> float:  # fmt: skip
    """ε at ``delta`` after ``rounds`` rounds of full participation: contributions of norm
    ≤ ``l2_clip`` on the grid γ = ``granularity``, conditionally rounded at ``beta`` (the
    authors' default e^{−1/2}), ``parties`` shares of N_Z(0, ``local_std``²) in grid units,
    in ``dim`` coordinates (see the module's docstring)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    if rounds <= 0:
        return 0.0
    if local_std <= 0:
        return math.inf
    l2 = rounded_l2_norm_bound(l2_clip / granularity, beta, dim)
    l1 = l2 * min(math.sqrt(dim), l2)
    rdp = [rounds * ddg_rdp(a, l2, l1, local_std, parties, dim) for a in ORDERS]
    return float(compute_epsilon(ORDERS, rdp, delta)[0])


def sample_discrete_gaussian(scale: float, size: int, uniforms: Uniforms) -> np.ndarray:
    """``size`` independent draws of N_Z(0, scale²) as int64 (Canonne, Kamath, Steinke 2020,
    Alg. 3): Y = G₁ − G₂ with G ~ Geometric of P(G ≥ k) = e^{−k/t}, t = ⌊scale⌋ + 1 (a
    discrete Laplace), kept with probability exp(−(|Y| − scale²/t)²/(2 scale²)); the
    acceptance is compared in float64, as in the authors' code. ``uniforms`` draws the
    randomness (secret on a site, seeded in a simulation)."""
    if scale < 0:
        raise ValueError(f"the discrete Gaussian's scale must be >= 0, got {scale}.")
    if scale == 0 or size == 0:
        return np.zeros(size, dtype=np.int64)
    t = math.floor(scale) + 1
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        batch = max(2 * (size - filled), 16)
        first = np.floor(-t * np.log1p(-uniforms(batch)))  # −t ln U, U ∈ (0, 1]
        second = np.floor(-t * np.log1p(-uniforms(batch)))
        proposal = first - second
        keep = uniforms(batch) < np.exp(-((np.abs(proposal) - scale**2 / t) ** 2)
                                        / (2 * scale**2))  # fmt: skip
        accepted = proposal[keep][: size - filled].astype(np.int64)
        out[filled : filled + len(accepted)] = accepted
        filled += len(accepted)
    return out


def conditional_randomized_round(values: np.ndarray, bound: float, uniforms: Uniforms,
                                 max_tries: int = 1000) -> np.ndarray:  # fmt: skip
    """``values`` (grid units) rounded to ⌊v⌋ + Bernoulli(v − ⌊v⌋) coordinate by coordinate,
    drawn again until the L2 norm is at most ``bound`` (DDG Alg. 1 step 3); int64."""
    floor = np.floor(values)
    fraction = values - floor
    for _ in range(max_tries):
        rounded = floor + (uniforms(len(values)) < fraction)
        if float(np.linalg.norm(rounded)) <= bound:
            return rounded.astype(np.int64)
    raise RuntimeError(
        f"conditional randomized rounding found no rounding of norm <= {bound:g} in "
        f"{max_tries} tries: the values' norm {float(np.linalg.norm(values)):g} exceeds "
        "the clip norm the bound was computed for."
    )


class DiscreteGaussianShares:
    """One site's side of the distributed discrete Gaussian on the grid γ = 2^−``bits``:
    its clients' contributions rounded onto the grid, and its share of the noise, both as
    float64 multiples of γ (exact: |k| < 2^53), so that sums over clients and sites,
    and secure aggregation's fixed point with at least ``bits`` fraction bits, are exact.

    Args:
        bits: g of the granularity γ = 2^−g.
        beta: β of conditional randomized rounding.
        dim: d, the contribution's number of coordinates.
    """

    def __init__(self, bits: int, beta: float, dim: int) -> None:
        self.granularity, self.beta, self.dim = 2.0**-bits, beta, dim

    def contribution(
        self, values: np.ndarray, sensitivity: float, uniforms: Uniforms
    ) -> np.ndarray:
        """``values`` (norm ≤ ``sensitivity``) conditionally rounded onto the grid."""
        bound = rounded_l2_norm_bound(sensitivity / self.granularity, self.beta, self.dim)
        rounded = conditional_randomized_round(values / self.granularity, bound, uniforms)
        return rounded * self.granularity

    def noise_share(self, std: float, uniforms: Uniforms) -> np.ndarray:
        """A share N_Z(0, (std/γ)²)^d, as multiples of γ: its std is ``std``."""
        return (
            sample_discrete_gaussian(std / self.granularity, self.dim, uniforms) * self.granularity
        )

    def epsilon(self, sensitivity: float, share_std: float, shares: int, rounds: int,
                delta: float) -> float:  # fmt: skip
        """ε at ``delta`` of ``rounds`` rounds where ``shares`` shares of std ``share_std``
        (real units) cover contributions of norm ≤ ``sensitivity``."""
        return ddg_epsilon(sensitivity, self.granularity, share_std / self.granularity,
                           shares, self.dim, rounds, delta, self.beta)  # fmt: skip


__all__ = [
    "ORDERS",
    "DiscreteGaussianShares",
    "conditional_randomized_round",
    "ddg_epsilon",
    "ddg_rdp",
    "rounded_l2_norm_bound",
    "sample_discrete_gaussian",
    "tau",
]
