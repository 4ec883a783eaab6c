"""The distributed discrete Gaussian (issue 76; Kairouz, Liu, Steinke, ICML 2021): its ε
equals the paper's accountant (Prop. 14 / eq. 17 with Thm 1's τ) written out here, tends to
the Gaussian's as the grid gets fine; the sampler draws N_Z(0, s²); conditional randomized
rounding is unbiased and bounded; and DPFedAvg's integer shares are the paper's Alg. 1 on
each site, exact on the grid."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_fl import FullParticipation, UniformSampler
from lightning_fl.callbacks import DPFedAvg
from lightning_fl.systems.discrete_gaussian import (
    DiscreteGaussianShares,
    conditional_randomized_round,
    ddg_epsilon,
    rounded_l2_norm_bound,
    sample_discrete_gaussian,
)
from lightning_fl.systems.pairwise_masking import decode, encode
from lightning_fl.systems.privacy_noise import SeededNoise
from tests.test_distributed_dp import SiteOfFour
from tests.test_robust import Recorder, fit
from tests.test_user_dp import COUNTS

# ---- the accountant ----------------------------------------------------------------------


def paper_epsilon(c, gamma, s, n, d, rounds, delta, beta):
    """DDG's ε written out from the paper: Thm 1's rounded norm and τ, Prop. 14's three
    bounds at each integer order 2..128 and 256, composed, and converted to (ε, δ) by
    Canonne-Kamath-Steinke's Prop. 12 (ε = rdp + log(1 − 1/α) − log(δα)/(α − 1))."""
    scaled = c / gamma
    l2_sens = scaled + math.sqrt(d)  # β = 0: rounding without the condition
    if beta > 0:
        log_term = math.sqrt(2 * math.log(1 / beta)) * (scaled + math.sqrt(d) / 2)
        l2_sens = min(l2_sens, math.sqrt(scaled**2 + d / 4 + log_term))
    l1_sens = l2_sens * min(math.sqrt(d), l2_sens)
    tau = 10 * sum(math.exp(-2 * math.pi**2 * s**2 * k / (k + 1)) for k in range(1, n))
    l2, l1 = l2_sens / (math.sqrt(n) * s), l1_sens / (math.sqrt(n) * s)
    best = math.inf
    for a in [*range(2, 129), 256]:
        rdp = rounds * min(a * l2**2 / 2 + tau * d, a / 2 * (l2**2 + 2 * l1 * tau + tau**2 * d),
                           a / 2 * (l2 + math.sqrt(d) * tau) ** 2)  # fmt: skip
        best = min(best, rdp + math.log1p(-1 / a) - math.log(delta * a) / (a - 1))
    return best


#: Two settings where every term counts: a coarse grid whose τ and rounding inflate ε
#: (s = 0.8 grid units, 4 parties; the L1 bound below √d), and the paper's regime of many
#: parties and a fine grid.
SETTINGS = [
    dict(c=0.5, gamma=2.0**-3, s=0.8, n=4, d=1000, rounds=3, delta=1e-5, beta=math.exp(-0.5)),
    dict(c=0.03, gamma=2.0**-16, s=1500.0, n=100, d=10_000, rounds=500, delta=1e-6, beta=0.0),
    # few coordinates: Prop. 14's first bound (α Δ₂²/(2ns²) + τd) is the least
    dict(c=0.5, gamma=2.0**-3, s=0.8, n=4, d=10, rounds=1, delta=1e-5, beta=math.exp(-0.5)),
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_epsilon_is_the_papers_accountant_to_1e_6(setting):
    ours = ddg_epsilon(setting["c"], setting["gamma"], setting["s"], setting["n"], setting["d"],
                       setting["rounds"], setting["delta"], setting["beta"])  # fmt: skip
    paper = paper_epsilon(**setting)
    print(f"DDG ε: lightning_fl {ours:.9f} | the paper's formula {paper:.9f}")
    assert ours == pytest.approx(paper, abs=1e-6)
    assert 0 < ours < math.inf


def test_on_a_fine_grid_the_epsilon_is_the_gaussians():
    """With γ → 0 the rounding and τ vanish: ε tends to the Gaussian mechanism's at
    z = Δ/σ (RDP α/(2z²) per round), and a coarse grid costs more ε."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    z, c, n, d, rounds, delta = 1.2, 0.5, 5, 200, 30, 1e-5
    sigma = z * c  # the sum's noise, in real units
    gamma = 2.0**-30
    fine = ddg_epsilon(c, gamma, sigma / math.sqrt(n) / gamma, n, d, rounds, delta)
    orders = [*range(2, 129), 256]
    gaussian = compute_epsilon(orders, [rounds * a / (2 * z**2) for a in orders], delta)[0]
    assert fine == pytest.approx(gaussian, rel=1e-4)
    gamma = 2.0**-2
    coarse = ddg_epsilon(c, gamma, sigma / math.sqrt(n) / gamma, n, d, rounds, delta)
    assert coarse > 1.5 * fine


def test_the_accountants_ends():
    assert ddg_epsilon(1.0, 0.5, 2.0, 3, 10, 0, 1e-5) == 0.0  # no round spends nothing
    assert ddg_epsilon(1.0, 0.5, 0.0, 3, 10, 5, 1e-5) == math.inf  # no noise: no privacy
    assert rounded_l2_norm_bound(0.5, 0.0, 1) == 1.5  # one coordinate, a norm below 1
    for bad in ((0.0, 0.0, 4), (1.0, 0.0, 0), (1.0, -0.1, 4)):
        with pytest.raises(ValueError, match="rounded_l2_norm_bound needs"):
            rounded_l2_norm_bound(*bad)


def test_rounded_norm_bound_both_cases():
    assert rounded_l2_norm_bound(3.0, 0.0, 16) == 7.0  # c + √d
    beta = 1e-3
    squared = 9.0 + 4.0 + math.sqrt(2 * math.log(1 / beta)) * (3.0 + 2.0)
    assert rounded_l2_norm_bound(3.0, beta, 16) == pytest.approx(math.sqrt(squared))
    assert rounded_l2_norm_bound(3.0, 0.999, 16) < 7.0
    with pytest.raises(ValueError, match="beta in"):
        rounded_l2_norm_bound(3.0, 1.0, 16)


# ---- the samplers ------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.7, 3.0])
def test_the_sampler_draws_the_discrete_gaussian(scale):
    """Frequencies against the pmf ∝ exp(−k²/(2s²)) over 200,000 seeded draws (each
    within 5 standard errors), and the exact variance of N_Z(0, s²)."""
    draws = sample_discrete_gaussian(scale, 200_000, SeededNoise(1).uniforms("test"))
    assert draws.dtype == np.int64
    support = np.arange(-40, 41)
    pmf = np.exp(-(support**2) / (2 * scale**2))
    pmf /= pmf.sum()
    counts = np.array([(draws == k).sum() for k in support]) / len(draws)
    standard_error = np.sqrt(pmf * (1 - pmf) / len(draws))
    assert np.all(np.abs(counts - pmf) <= 5 * standard_error + 1e-6)
    variance = float((pmf * support**2).sum())
    assert float(draws.var()) == pytest.approx(variance, rel=0.02)
    assert sample_discrete_gaussian(0.0, 3, SeededNoise(1).uniforms("t")).tolist() == [0, 0, 0]
    stream = SeededNoise(2).uniforms("one")
    singles = [int(sample_discrete_gaussian(scale, 1, stream)[0]) for _ in range(400)]
    assert len(set(singles)) > 2  # one draw at a time is drawn too


def test_conditional_randomized_rounding_is_unbiased_and_bounded():
    values = np.array([0.25, -1.5, 2.0, 3.9, -0.1])
    uniforms = SeededNoise(2).uniforms("round")
    draws = np.stack([conditional_randomized_round(values, 10.0, uniforms) for _ in range(20_000)])
    assert np.all((draws == np.floor(values)) | (draws == np.ceil(values)))
    assert np.allclose(draws.mean(0), values, atol=0.02)
    tight = np.sqrt(np.sum(np.floor(values) ** 2)) + 0.5  # only roundings close to ⌊v⌋ pass
    kept = np.stack([conditional_randomized_round(values, tight, uniforms) for _ in range(200)])
    assert np.all(np.linalg.norm(kept, axis=1) <= tight)
    with pytest.raises(RuntimeError, match="no rounding of norm <= 1"):
        conditional_randomized_round(values, 1.0, uniforms, max_tries=5)


def test_grid_values_go_through_secure_aggregations_fixed_point_exactly():
    grid = DiscreteGaussianShares(bits=24, beta=0.0, dim=300)
    uniforms = SeededNoise(3).uniforms("x")
    values = np.random.default_rng(0).normal(size=300) * 0.01
    on_grid = grid.contribution(values, 1.0, uniforms) + grid.noise_share(0.05, uniforms)
    assert np.all(on_grid / 2.0**-24 == np.round(on_grid / 2.0**-24))
    tensor = torch.from_numpy(on_grid)
    assert torch.equal(decode(*encode(tensor, 32), 32), tensor)


# ---- DPFedAvg's integer shares -----------------------------------------------------------


def test_each_sites_integer_share_is_algorithm_1_written_by_hand():
    """Site 2 of 4 with t = 1, full participation of 6 clients of unequal sizes, 3 rounds:
    its sum is Σ_k γ·CRR(ω_k clip(Δ_k)/γ) + γ·N_Z(0, (σ/(γ√3))²)^d, every value a multiple
    of γ = 2^−10, with the rounding and noise streams of (seed, tag, round, client|rank)."""
    z, clip, cap, bits, beta = 0.6, 0.2, 12, 10, 0.01
    integer = dict(mechanism="discrete_gaussian", granularity_bits=bits, rounding_beta=beta)
    dp = SiteOfFour(2, noise_multiplier=z, clip_norm=clip, example_cap=cap, seed=6, **integer)
    recorder = GridRecorder(dp)
    fit([dp, recorder], FullParticipation(), rounds=3)
    w = [min(n / cap, 1.0) for n in COUNTS.tolist()]
    total, gamma = sum(w), 2.0**-bits
    sensitivity, sigma = clip / total, z * clip / total
    dim = len(recorder.rounds[0]["start"])
    bound = rounded_l2_norm_bound(sensitivity / gamma, beta, dim)
    for t, round_ in enumerate(recorder.rounds):
        expected = np.zeros(dim)
        for k, delta in sorted(round_["raw"].items()):
            contribution = (w[k] / total) * delta.numpy() * min(1.0, clip / float(delta.norm()))
            stream = SeededNoise(6).uniforms("dp_rounding", t, k)
            expected += conditional_randomized_round(contribution / gamma, bound, stream) * gamma
        stream = SeededNoise(6).uniforms("dp_fedavg_discrete", t, 2)
        expected += sample_discrete_gaussian(sigma / gamma / math.sqrt(3), dim, stream) * gamma
        grid_sum = recorder.grid_sums[t]
        assert torch.equal(grid_sum / gamma, torch.round(grid_sum / gamma))
        assert torch.equal(grid_sum, torch.from_numpy(expected)), t
        assert torch.allclose(round_["end"] - round_["start"], grid_sum, atol=1e-6)
    shares = 3
    assert dp.last["epsilon"] == pytest.approx(
        ddg_epsilon(sensitivity, gamma, sigma / math.sqrt(shares) / gamma, shares, dim, 3,
                    1e-5, beta), abs=1e-12)  # fmt: skip


class GridRecorder(Recorder):
    def __init__(self, dp: DPFedAvg) -> None:
        super().__init__()
        self.dp, self.grid_sums = dp, []

    def on_round_end(self, trainer, pl_module, state) -> None:
        super().on_round_end(trainer, pl_module, state)
        self.grid_sums.append(state.round_sum(self.dp, "grid_sum")[0].cpu().clone())


def test_a_simulated_integer_mechanism_is_its_seeds_and_settings_are_checked():
    first = fit([DPFedAvg(noise="distributed", mechanism="discrete_gaussian", seed=2)],
                FullParticipation(), rounds=2)  # fmt: skip
    again = fit([DPFedAvg(noise="distributed", mechanism="discrete_gaussian", seed=2)],
                FullParticipation(), rounds=2)  # fmt: skip
    for a, b in zip(first.lightning_module.parameters(), again.lightning_module.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="set noise='distributed' \\(got noise='central'\\)"):
        DPFedAvg(mechanism="discrete_gaussian")
    with pytest.raises(ValueError, match="set target_quantile=None"):
        DPFedAvg(noise="distributed", mechanism="discrete_gaussian", target_quantile=0.5)
    for bad in (0, 41, True):
        with pytest.raises(ValueError, match=r"granularity_bits must be an integer in \[1, 40\]"):
            DPFedAvg(noise="distributed", mechanism="discrete_gaussian", granularity_bits=bad)
    with pytest.raises(ValueError, match="mechanism must be 'gaussian' or 'discrete_gaussian'"):
        DPFedAvg(mechanism="laplace")
    with pytest.raises(ValueError, match=r"full participation only .* UniformSampler draws q=0.5"):
        fit([DPFedAvg(noise="distributed", mechanism="discrete_gaussian")], UniformSampler(3),
            rounds=1)  # fmt: skip
