"""DP-FedAvg (issue 69): ε equals dp-accounting's for Poisson and fixed-size sampling and a
hand-computed Gaussian mechanism; the server step equals McMahan et al.'s Algorithm 1 written
out by hand (bounded weights, fixed and clipped denominators, the noise), and the clip norm
follows Andrew et al.'s Algorithm 1 over 5 rounds on the same updates and noise."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp
from scipy.optimize import brentq
from scipy.stats import norm

from lightning_fl import FullParticipation, MDSampler, PoissonSampler, UniformSampler
from lightning_fl.callbacks import DPFedAvg, SignFlipping
from lightning_fl.engine.composition import CompositionError
from lightning_fl.engine.seeding import generator
from lightning_fl.systems.user_dp import Sampling, epsilon
from tests import composition
from tests.test_robust import Recorder, fit

COUNTS = np.array([len(c["train"][1]) for c in composition._clients()[0]])  # 6, 9, ..., 21


# ---- accounting --------------------------------------------------------------------------


@pytest.mark.parametrize(("z", "q", "rounds"), [(1.1, 0.1, 50), (0.8, 0.02, 400), (3.0, 1.0, 7)])
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_of_poisson_sampling_equals_dp_accounting(z, q, rounds, accountant):
    event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
    library = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    library.compose(dpa.SelfComposedDpEvent(event, rounds))
    got = epsilon(z, Sampling.poisson(q), rounds, 1e-5, accountant)
    assert got == pytest.approx(library.get_epsilon(1e-5), abs=1e-6)


@pytest.mark.parametrize(("z", "m", "n", "rounds"), [(1.1, 10, 100, 50), (0.7, 3, 1000, 300)])
def test_epsilon_of_fixed_size_sampling_equals_dp_accounting_replace_one(z, m, n, rounds):
    library = rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    event = dpa.SampledWithoutReplacementDpEvent(n, m, dpa.GaussianDpEvent(z))
    library.compose(dpa.SelfComposedDpEvent(event, rounds))
    got = epsilon(z, Sampling.fixed(m, n), rounds, 1e-5)
    assert got == pytest.approx(library.get_epsilon(1e-5), abs=1e-6)
    with pytest.raises(ValueError, match="PLD accountant has no fixed-size sampling"):
        epsilon(z, Sampling.fixed(m, n), rounds, 1e-5, "pld")


def test_epsilon_pins_hand_computed_cases():
    """Full participation: T rounds of the Gaussian mechanism are one Gaussian mechanism
    of μ = √T/z, whose exact (ε, δ) curve is δ = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Balle
    and Wang 2018, Thm. 8), solved here for ε: PLD agrees to its discretization. And a
    value pinned from dp-accounting 0.6.0: z = 1.1, q = 0.1, 50 rounds, δ = 1e-5."""
    z, rounds, delta = 2.0, 16, 1e-5
    mu = math.sqrt(rounds) / z

    def excess(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    exact = brentq(excess, 1e-6, 50.0, xtol=1e-12)
    assert exact == pytest.approx(9.997256, abs=1e-6)
    assert epsilon(z, Sampling.full(), rounds, delta, "pld") == pytest.approx(exact, abs=2e-3)
    assert epsilon(z, Sampling.full(), rounds, delta, "rdp") >= exact  # RDP is an upper bound
    assert epsilon(1.1, Sampling.poisson(0.1), 50, 1e-5) == pytest.approx(4.8996361, abs=1e-6)
    assert epsilon(0.0, Sampling.full(), 3, 1e-5) == math.inf
    assert epsilon(1.0, Sampling.full(), 0, 1e-5) == 0.0


# ---- the server step (McMahan et al. 2018, Algorithm 1) ----------------------------------


def reference_step(round_: dict, t: int, *, z, clip, cap, m, estimator="fixed", w_min=None):
    """Algorithm 1 by hand: w_k = min(n_k/ŵ, 1), W = Σ w_k, q = m/n, each update clipped
    to norm ``clip``, then Σ w_k Δ_k/(qW) or Σ w_k Δ_k / max(qW_min, Σ_C w_k), plus
    N(0, σ²) with σ = z·clip/(qW) or 2z·clip/(qW_min), drawn from (seed 0, round t)."""
    w = [min(n / cap, 1.0) for n in COUNTS.tolist()]
    total, q = sum(w), m / len(w)
    sampled = sorted(round_["weights"])
    denominator = q * total
    if estimator == "clipped":
        denominator = max(q * w_min, sum(w[k] for k in sampled))
    step = torch.zeros_like(round_["start"])
    for k in sorted(round_["raw"]):
        delta = round_["raw"][k]
        step += w[k] * delta * min(1.0, clip / float(delta.norm())) / denominator
    sigma = z * clip / (q * total) if estimator == "fixed" else 2 * z * clip / (q * w_min)
    noise = torch.randn(len(step), generator=generator(0, "dp_fedavg", t), dtype=torch.float64)
    return step + sigma * noise


@pytest.mark.parametrize("vectorize", [False, True])
@pytest.mark.parametrize(
    ("estimator", "w_min"), [("fixed", None), ("clipped", 2.0), ("clipped", 6.0)]
)
def test_the_server_step_is_algorithm_1_written_by_hand(estimator, w_min, vectorize):
    recorder = Recorder()
    dp = DPFedAvg(noise_multiplier=0.3, clip_norm=0.2, example_cap=12, estimator=estimator,
                  min_weight=w_min)  # fmt: skip
    fit([dp, recorder], UniformSampler(3), rounds=3, vectorize=vectorize)
    norms = [float(u.norm()) for r in recorder.rounds for u in r["raw"].values()]
    assert min(norms) < 0.2 < max(norms)  # some updates clipped, some not
    for t, round_ in enumerate(recorder.rounds):
        expected = reference_step(round_, t, z=0.3, clip=0.2, cap=12, m=3, estimator=estimator,
                                  w_min=w_min)  # fmt: skip
        assert torch.allclose(round_["end"] - round_["start"], expected, atol=2e-6), t


def test_the_server_clips_an_attackers_update_after_the_attack():
    recorder = Recorder()
    dp = DPFedAvg(noise_multiplier=0.0, clip_norm=0.05)
    flip = SignFlipping(fraction=0.5, scale=50.0, seed=2)
    fit([dp, flip, recorder], rounds=2)  # the recorder sees what the attackers sent
    for t, round_ in enumerate(recorder.rounds):
        expected = reference_step(round_, t, z=0.0, clip=0.05, cap=max(COUNTS), m=6)
        assert torch.allclose(round_["end"] - round_["start"], expected, atol=2e-6)
        assert float((round_["end"] - round_["start"]).norm()) <= 0.05 + 1e-6


def test_local_noise_sums_to_the_central_noise_of_the_round():
    """Each of the K participants clips its update and adds N(0, σ²/K)/ω_k, drawn from
    (seed, round, client), to what it sends; the server sums ω_k times what it received,
    so the sum's noise is Σ_k (σ/√K) ξ_k, of variance σ². In round 0 both runs start from
    θ⁰: a client's clipped update there is the central run's."""
    central, local = Recorder(), Recorder()
    kw = dict(noise_multiplier=0.5, clip_norm=0.2, example_cap=12)
    fit([DPFedAvg(noise="local", **kw), local], UniformSampler(3), rounds=3)
    fit([DPFedAvg(noise="central", **kw), central], UniformSampler(3), rounds=1)
    w = [min(n / 12, 1.0) for n in COUNTS.tolist()]
    sigma = 0.5 * 0.2 / (0.5 * sum(w))
    for t, round_ in enumerate(local.rounds):
        step = torch.zeros_like(round_["start"])
        for k, sent in sorted(round_["raw"].items()):
            omega = w[k] / (0.5 * sum(w))
            assert round_["weights"][k] == pytest.approx(omega, abs=1e-12)
            xi = torch.randn(len(sent), generator=generator(0, "dp_fedavg_local", t, k),
                             dtype=torch.float64)  # fmt: skip
            clipped = sent - sigma / math.sqrt(3) / omega * xi
            assert float(clipped.norm()) <= 0.2 + 1e-6
            if t == 0:
                raw = central.rounds[0]["raw"][k]
                expected = raw * min(1.0, 0.2 / float(raw.norm()))
                assert torch.allclose(clipped, expected, atol=1e-6), k
            step += omega * sent
        assert torch.allclose(round_["end"] - round_["start"], step, atol=2e-6), t


# ---- adaptive clipping (Andrew et al. 2021, Algorithm 1) ---------------------------------


class ClipNorms(Recorder):
    def __init__(self, dp: DPFedAvg) -> None:
        super().__init__()
        self.dp, self.norms = dp, []

    def on_round_start(self, trainer, pl_module, state) -> None:
        super().on_round_start(trainer, pl_module, state)
        self.norms.append(self.dp.clip_norm)


def test_adaptive_clip_norm_follows_algorithm_1_written_by_hand_over_5_rounds():
    z, sigma_b, gamma, lr, c0, m = 0.8, 1.5, 0.6, 0.3, 0.3, 4
    dp = DPFedAvg(noise_multiplier=z, clip_norm=c0, target_quantile=gamma, clip_lr=lr,
                  count_std=sigma_b, weighting="uniform")  # fmt: skip
    recorder = ClipNorms(dp)
    fit([dp, recorder], UniformSampler(m), rounds=5)
    z_delta = (z**-2 - (2 * sigma_b) ** -2) ** -0.5
    clip, trajectory = c0, []
    for t, round_ in enumerate(recorder.rounds):
        trajectory.append(clip)
        updates = [round_["raw"][k] for k in sorted(round_["raw"])]
        unclipped = sum(1.0 for u in updates if float(u.norm()) <= clip)
        clipped = [u * min(1.0, clip / float(u.norm())) for u in updates]
        noise = torch.randn(len(updates[0]), generator=generator(0, "dp_fedavg", t),
                            dtype=torch.float64)  # fmt: skip
        # Alg. 1: Δ̃ = (1/m)(Σ Δ_i + N(0, σ_Δ²)), σ_Δ = z_Δ C
        expected = (sum(clipped) + z_delta * clip * noise) / m
        assert torch.allclose(round_["end"] - round_["start"], expected, atol=2e-6), t
        count_noise = float(torch.randn(1, generator=generator(0, "dp_count", t),
                                        dtype=torch.float64))  # fmt: skip
        b = (unclipped + sigma_b * count_noise) / m
        if t == len(recorder.rounds) - 1:
            assert dp.last["unclipped_fraction"] == pytest.approx(b, abs=1e-12)
        clip = clip * math.exp(-lr * (b - gamma))
    assert recorder.norms == pytest.approx(trajectory, abs=1e-6)
    assert dp.clip_norm == pytest.approx(clip, abs=1e-6)
    assert len({round(c, 6) for c in trajectory}) == 5  # it moved every round


def test_adaptive_clipping_refuses_count_noise_at_or_below_half_the_multiplier():
    with pytest.raises(ValueError, match=r"σ_b > z/2 = 0.5 .* raise count_std"):
        fit([DPFedAvg(noise_multiplier=1.0, target_quantile=0.5, count_std=0.5)], rounds=1)
    with pytest.raises(ValueError, match="count_std is -1.0, not > 0"):
        DPFedAvg(target_quantile=0.5, count_std=-1.0)


def test_a_second_fit_accounts_for_its_own_sampler():
    dp = DPFedAvg(noise_multiplier=1.0)
    fit([dp], UniformSampler(3), rounds=2)
    assert dp.last["epsilon"] == pytest.approx(epsilon(1.0, Sampling.fixed(3, 6), 2, 1e-5))
    fit([dp], FullParticipation(), rounds=2)
    assert dp.last["epsilon"] == pytest.approx(epsilon(1.0, Sampling.full(), 2, 1e-5))


# ---- budget, samplers, logging ------------------------------------------------------------


def test_a_run_over_its_epsilon_budget_is_refused_before_training_unless_allowed():
    planned = epsilon(0.5, Sampling.fixed(3, 6), 4, 1e-5)
    seen = composition._TrainingSeen()
    with pytest.raises(ValueError, match=r"4 rounds .* over the budget ε=1\. .*allow_over_budget"):
        fit([DPFedAvg(noise_multiplier=0.5, epsilon_budget=1.0), seen], UniformSampler(3), 4)
    assert seen.steps == 0
    trainer = fit([DPFedAvg(noise_multiplier=0.5, epsilon_budget=1.0, allow_over_budget=True)],
                  UniformSampler(3), rounds=4)  # fmt: skip
    assert float(trainer.callback_metrics["dp/epsilon"]) == pytest.approx(planned, abs=1e-6)
    fit([DPFedAvg(noise_multiplier=0.5, epsilon_budget=planned + 1e-3)], UniformSampler(3), 4)


def test_dp_epsilon_is_logged_every_round_for_the_sampling_used():
    class Logged(Recorder):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.rounds[-1]["epsilon"] = float(trainer.callback_metrics["dp/epsilon"])

    logged = Logged()
    fit([DPFedAvg(noise_multiplier=1.2, accountant="pld"), logged], PoissonSampler(0.5), 3)
    for t, round_ in enumerate(logged.rounds):
        expected = epsilon(1.2, Sampling.poisson(0.5), t + 1, 1e-5, "pld")
        assert round_["epsilon"] == pytest.approx(expected, abs=1e-6)


def test_samplers_without_one_known_q_are_refused_by_name():
    with pytest.raises(CompositionError, match="DPFedAvg cannot be combined with MDSampler"):
        fit([DPFedAvg()], MDSampler(3), rounds=1)
    with pytest.raises(ValueError, match="renormalize=True"):
        fit([DPFedAvg()], UniformSampler(3, renormalize=True), rounds=1)
    fit([DPFedAvg(noise_multiplier=0.1)], FullParticipation(), rounds=1)


def test_a_poisson_round_without_participants_still_gets_its_noise():
    recorder = Recorder()
    fit([DPFedAvg(noise_multiplier=0.7, clip_norm=0.2), recorder], PoissonSampler(0.01), 2)
    sigma = 0.7 * 0.2 / (0.01 * sum(COUNTS / max(COUNTS)))
    for t, round_ in enumerate(recorder.rounds):
        assert not round_["weights"]  # p = 0.01: nobody drawn in these two rounds
        noise = torch.randn(len(round_["start"]), generator=generator(0, "dp_fedavg", t),
                            dtype=torch.float64)  # fmt: skip
        assert torch.allclose(round_["end"] - round_["start"], sigma * noise, atol=1e-5)


def test_poisson_sampling_is_unbiased_with_rate_q():
    """Each client's inclusion frequency over 4,000 rounds is q within 4 standard errors,
    and ω_i = p_i/q whenever it is drawn."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    sampler, q, rounds = PoissonSampler(0.3), 0.3, 4000
    counts = np.zeros(4)
    for t in range(rounds):
        draw = sampler.sample(t, 5, p)
        for c, w in zip(draw.clients, draw.weights):
            counts[c] += 1
            assert w == pytest.approx(float(p[c]) / q, abs=1e-15)
    bound = 4 * math.sqrt(q * (1 - q) / rounds)
    assert np.all(np.abs(counts / rounds - q) < bound), counts / rounds
