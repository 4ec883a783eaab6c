"""Distributed DP (issue 76): noise from a secret where the sites are separate parties, each
site's share added before the sum and scaled for t colluding sites, and the composition
rule over declared traits that refuses server-side noise where every site aggregates."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_fl import FederatedStrategy, FullParticipation, UniformSampler
from lightning_fl.callbacks import DPFedAvg, FederatedCallback
from lightning_fl.engine.composition import CompositionError, check
from lightning_fl.engine.plugins import Trait
from lightning_fl.engine.seeding import generator
from lightning_fl.systems.privacy_noise import SecretNoise, SeededNoise, secret_uniforms
from tests.helpers import make_trainer, params_of, tiny_datamodule, tiny_module
from tests.test_refusals import _trainer
from tests.test_robust import Recorder, fit
from tests.test_user_dp import COUNTS, ClipNorms

FIX = "Fix: DPFedAvg(noise='distributed'): each site adds its share of the noise"


# ---- the rule over declared traits --------------------------------------------------------


@pytest.mark.parametrize(
    "dp",
    [
        lambda: DPFedAvg(),
        lambda: DPFedAvg(noise="central", noise_multiplier=0.3),
        lambda: DPFedAvg(noise="local", target_quantile=0.5),  # its count noise is the server's
    ],
)
def test_server_side_noise_where_every_site_aggregates_is_refused_naming_both_and_the_fix(dp):
    with pytest.raises(CompositionError) as refused:
        check(_trainer(dp()), FullParticipation(), silos=True)
    message = str(refused.value)
    assert message.startswith(
        "DPFedAvg cannot be combined with FederatedStrategy(silos=True): DPFedAvg draws "
        "server-side randomness and FederatedStrategy(silos=True) aggregates the round's sum "
        "on every site; every site would hold the round's sum before"
    )
    assert FIX in message


@pytest.mark.parametrize(
    "dp",
    [
        lambda: DPFedAvg(noise="distributed"),
        lambda: DPFedAvg(noise="distributed", target_quantile=0.5),
        lambda: DPFedAvg(noise="local"),
        lambda: DPFedAvg(noise="central", noise_multiplier=0.0),  # clipping only: no noise
    ],
)
def test_noise_the_sites_add_themselves_is_accepted_in_silo_mode(dp):
    check(_trainer(dp()), FullParticipation(), silos=True)
    check(_trainer(DPFedAvg()), FullParticipation(), silos=False)  # a simulation's server


class CoinFlipServer(FederatedCallback):
    """A user's new plugin, unknown to any table: refused by what it declares."""

    def __init__(self) -> None:
        self.add_trait(Trait.DRAWS_SERVER_RANDOMNESS, "CoinFlipServer(on_sites=True)")


def test_a_new_plugin_is_refused_by_the_trait_it_declares_with_its_own_fix():
    with pytest.raises(CompositionError) as refused:
        check(_trainer(CoinFlipServer()), FullParticipation(), silos=True)
    message = str(refused.value)
    assert message.startswith(
        "CoinFlipServer cannot be combined with FederatedStrategy(silos=True)"
    )
    assert message.endswith("Fix: CoinFlipServer(on_sites=True).")
    check(_trainer(CoinFlipServer()), FullParticipation(), silos=False)


def test_a_silo_fit_with_central_noise_is_refused_before_training():
    trainer = make_trainer(FederatedStrategy(silos=True, local_steps=1), 1, [DPFedAvg()])
    with pytest.raises(CompositionError, match=r"silos=True\): DPFedAvg draws server-side"):
        trainer.fit(tiny_module(), datamodule=tiny_datamodule())
    assert trainer.current_epoch == 0


# ---- the sites' shares, written by hand ---------------------------------------------------


class SiteOfFour(DPFedAvg):
    """DPFedAvg on one process playing site ``rank`` of 4, with t = 1: its share of the
    noise is the one site ``rank`` of a 4-site run adds."""

    def __init__(self, rank: int, **kw) -> None:
        super().__init__(noise="distributed", **kw)
        self.playing_rank = rank

    def on_fit_start(self, trainer, pl_module) -> None:
        super().on_fit_start(trainer, pl_module)
        self._sites, self._rank, self.colluding_sites = 4, self.playing_rank, 1


@pytest.mark.parametrize("rank", [0, 2])
def test_a_sites_share_is_sigma_over_root_w_minus_t_of_its_own_draw(rank):
    """Σ_k ω_k clip(Δ_k) plus the site's share σ/√(W − t) ξ(round, rank), W = 4, t = 1,
    σ = zC/(qW) with the bounded weights: 3 rounds of 3 of 6 clients of unequal sizes."""
    recorder, z, clip, cap, m = Recorder(), 0.7, 0.2, 12, 3
    fit([SiteOfFour(rank, noise_multiplier=z, clip_norm=clip, example_cap=cap, seed=4),
         recorder], UniformSampler(m), rounds=3)  # fmt: skip
    plain = Recorder()  # what the clients send: no noise, no clipping on the client
    fit([plain], UniformSampler(m), rounds=1)
    for k, raw in recorder.rounds[0]["raw"].items():
        assert torch.allclose(raw, plain.rounds[0]["raw"][k], atol=1e-7), k
    w = [min(n / cap, 1.0) for n in COUNTS.tolist()]
    q, total = m / len(w), sum(w)
    sigma = z * clip / (q * total)
    clipped_some = False
    for t, round_ in enumerate(recorder.rounds):
        step = torch.zeros_like(round_["start"])
        for k, delta in sorted(round_["raw"].items()):
            clipped_some |= float(delta.norm()) > clip
            step += w[k] / (q * total) * delta * min(1.0, clip / float(delta.norm()))
        xi = torch.randn(len(step), generator=generator(4, "dp_fedavg_distributed", t, rank),
                         dtype=torch.float64)  # fmt: skip
        expected = step + sigma / math.sqrt(4 - 1) * xi
        assert torch.allclose(round_["end"] - round_["start"], expected, atol=2e-6), t
    assert clipped_some


def test_adaptive_clipping_counts_with_the_sites_shares_of_the_count_noise():
    """Andrew et al. Alg. 1 with the count's noise σ_b split as the updates' is: b̃ =
    (Σ b_k + σ_b/√(W − t) ξ_b(round, rank))/(qn), and no server draw."""
    z, sigma_b, gamma, lr, c0, m = 0.8, 1.5, 0.6, 0.3, 0.3, 4
    dp = SiteOfFour(1, noise_multiplier=z, clip_norm=c0, target_quantile=gamma, clip_lr=lr,
                    count_std=sigma_b, weighting="uniform")  # fmt: skip
    recorder = ClipNorms(dp)
    fit([dp, recorder], UniformSampler(m), rounds=4)
    z_delta = (z**-2 - (2 * sigma_b) ** -2) ** -0.5
    clip = c0
    for t, round_ in enumerate(recorder.rounds):
        assert recorder.norms[t] == pytest.approx(clip, abs=1e-6)
        updates = [round_["raw"][k] for k in sorted(round_["raw"])]
        unclipped = sum(1.0 for u in updates if float(u.norm()) <= clip)
        clipped = [u * min(1.0, clip / float(u.norm())) for u in updates]
        xi = torch.randn(len(updates[0]), generator=generator(0, "dp_fedavg_distributed", t, 1),
                         dtype=torch.float64)  # fmt: skip
        expected = (sum(clipped) + z_delta * clip / math.sqrt(3) * xi) / m
        assert torch.allclose(round_["end"] - round_["start"], expected, atol=2e-6), t
        xi_b = float(torch.randn(1, generator=generator(0, "dp_count_distributed", t, 1),
                                 dtype=torch.float64))  # fmt: skip
        clip = clip * math.exp(-lr * ((unclipped + sigma_b / math.sqrt(3) * xi_b) / m - gamma))
    assert dp.clip_norm == pytest.approx(clip, abs=1e-6)


def test_epsilon_is_the_mechanisms_against_t_colluding_sites():
    """W − t shares of σ²/(W − t) carry σ²: ε against t colluders is the central ε(z)."""
    recorder = Recorder()
    dp = SiteOfFour(0, noise_multiplier=0.9)
    fit([dp, recorder], UniformSampler(3), rounds=2)
    central = DPFedAvg(noise_multiplier=0.9)
    central.population = dp.population
    assert dp.last["epsilon"] == pytest.approx(central.epsilon(2), abs=1e-12)


def test_distributed_settings_are_checked():
    with pytest.raises(ValueError, match=r"colluding_sites=1 .* noise='local': set noise="):
        DPFedAvg(noise="local", colluding_sites=1)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="colluding_sites must be an integer >= 0"):
            DPFedAvg(noise="distributed", colluding_sites=bad)
    with pytest.raises(ValueError, match="estimator='fixed' with distributed noise"):
        DPFedAvg(noise="distributed", estimator="clipped", min_weight=1.0)
    with pytest.raises(ValueError, match=r"may have 1 site\(s\).* at most 0, or run more"):
        fit([DPFedAvg(noise="distributed", colluding_sites=1)], rounds=1)


# ---- where the noise comes from -----------------------------------------------------------


def _silo_run(silos: bool) -> list[torch.Tensor]:
    strategy = FederatedStrategy(silos=silos, local_steps=2, seed=3)
    dp = DPFedAvg(noise="distributed", noise_multiplier=1.0, clip_norm=0.5, seed=3)
    trainer = make_trainer(strategy, 2, [dp])
    module = tiny_module()
    trainer.fit(module, datamodule=tiny_datamodule())
    return params_of(module)


def test_a_silos_noise_is_secret_and_a_simulations_is_its_seeds():
    """Two silo runs of one recipe draw different noise, and neither is the noise any party
    could draw from the recipe (its seed, tag, round and rank); two simulations are equal."""
    first, second = _silo_run(True), _silo_run(True)
    simulated, again = _silo_run(False), _silo_run(False)
    assert all(torch.equal(a, b) for a, b in zip(simulated, again))
    for run in (first, second):
        assert not any(torch.equal(a, b) for a, b in zip(run, simulated))
    assert not any(torch.equal(a, b) for a, b in zip(first, second))


def test_secret_noise_is_standard_normal_and_never_repeats():
    draws = SecretNoise().normal(400_000).numpy()
    assert abs(draws.mean()) < 0.01 and abs(draws.std() - 1.0) < 0.01
    assert abs(np.mean(np.abs(draws) > 1.959964) - 0.05) < 0.003  # the normal's tails
    assert not np.array_equal(draws[:8], SecretNoise().normal(8).numpy())
    uniforms = secret_uniforms(100_000)
    assert uniforms.min() >= 0.0 and uniforms.max() < 1.0 and abs(uniforms.mean() - 0.5) < 0.01
    seeded = SeededNoise(7).normal(5, "dp_fedavg", 2)
    by_hand = torch.randn(5, generator=generator(7, "dp_fedavg", 2), dtype=torch.float64)
    assert torch.equal(seeded, by_hand)


# ---- on the wire: 3 silos, distributed noise under signed secure aggregation ---------------


def test_on_three_silos_the_wire_never_carries_a_noiseless_sum_and_noise_is_secret(tmp_path):
    """tests/ddp_wire.py, twice with one recipe and seed. What each site sends is masked
    limbs, none equal to its own encoding; its own buffer already holds its share (its
    noiseless part never leaves it), of std σ/√(W − t); the total every site decodes is the
    sum of the noised parts, σ√(W/(W − t)) away from the noiseless sum; the two runs' shares
    differ, and none is the share any party could draw from the recipe."""
    pytest.importorskip("cryptography")
    from lightning_fl.flower.credentials import write_credentials
    from lightning_fl.systems.pairwise_masking import encode
    from tests.helpers import torchrun

    write_credentials(tmp_path / "creds", ["usa", "hungary", "switzerland"])
    torchrun("tests.ddp_wire", str(tmp_path), str(tmp_path / "creds"), timeout=300, nproc=3)
    runs = {
        (run, rank): torch.load(tmp_path / f"{run}_rank{rank}.pt", weights_only=True)
        for run in ("first", "second")
        for rank in range(3)
    }
    sigma = runs["first", 0]["sigma"]
    dim = runs["first", 0]["noiseless"][0].numel()
    shares: dict[tuple[str, int], list[torch.Tensor]] = {}
    for (run, rank), saved in runs.items():  # dim: the model's; size: the round's sums
        assert len(saved["own"]) == len(saved["noiseless"]) == 2  # 2 rounds
        size = saved["own"][0].numel()
        masked = [t for t in saved["sent"] if t.dtype == torch.int64 and t.numel() == 2 * size]
        assert len(masked) == 2
        assert not [t for t in saved["sent"] if t.numel() in (size, dim)]  # nothing in clear
        for sent, own in zip(masked, saved["own"]):
            lo, hi = encode(own, 32)
            assert not bool((sent[:size] == lo).any() or (sent[size:] == hi).any())
        shares[run, rank] = [o[:dim] - n for o, n in zip(saved["own"], saved["noiseless"])]
    for run in ("first", "second"):
        pooled = torch.cat([s for r in range(3) for s in shares[run, r]])
        assert float(pooled.std()) == pytest.approx(sigma / math.sqrt(2), rel=0.15)
        noises = []
        for round_idx in range(2):
            total = runs[run, 0]["total"][round_idx][:dim]
            noiseless = sum(runs[run, r]["noiseless"][round_idx] for r in range(3))
            noises.append(total - noiseless)
            assert torch.allclose(noises[-1], sum(shares[run, r][round_idx] for r in range(3)),
                                  atol=1e-6)  # fmt: skip
            for r in range(3):
                assert torch.equal(
                    runs[run, r]["total"][round_idx], runs[run, 0]["total"][round_idx]
                )
        # σ√(3/2): no party decodes a noiseless sum. Pooled over both rounds, the sample
        # std's relative spread is 1/√(4·dim); rel=0.25 is more than 4.5 of them, so a
        # secret (unseeded) draw fails this less than once in 10⁵ runs.
        pooled_noise = torch.cat(noises)
        assert float(pooled_noise.std()) == pytest.approx(sigma * math.sqrt(1.5), rel=0.25)
    for rank in range(3):
        for round_idx in range(2):
            first, second = shares["first", rank][round_idx], shares["second", rank][round_idx]
            assert float((first - second).abs().max()) > sigma / 10
            seeded = SeededNoise(5).normal(dim, "dp_fedavg_distributed", round_idx, rank)
            from_recipe = seeded * sigma / math.sqrt(2)
            assert float((first - from_recipe).abs().max()) > sigma / 10
            correlation = float(torch.corrcoef(torch.stack([first, seeded]))[0, 1])
            assert abs(correlation) < 0.5


def _dpsgd_run(silos: bool, secret_randomness: bool = False) -> list[torch.Tensor]:
    from lightning_fl.callbacks import DPSGD

    strategy = FederatedStrategy(silos=silos, local_steps=2, seed=3,
                                 secret_randomness=secret_randomness)  # fmt: skip
    trainer = make_trainer(strategy, 2,
                           [DPSGD(noise_multiplier=1.0, max_grad_norm=0.5)])  # fmt: skip
    module = tiny_module()
    trainer.fit(module, datamodule=tiny_datamodule())
    return params_of(module)


def test_dp_sgds_noise_in_a_silo_is_its_own_and_a_simulations_is_its_seeds():
    first, second = _dpsgd_run(True), _dpsgd_run(True)
    simulated, again = _dpsgd_run(False), _dpsgd_run(False)
    assert all(torch.equal(a, b) for a, b in zip(simulated, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, second))
    assert not any(torch.equal(a, b) for a, b in zip(first, simulated))
    # one site's part of a deployment (a Flower ClientApp's fit): its own noise too
    alone, again_alone = _dpsgd_run(False, True), _dpsgd_run(False, True)
    assert not any(torch.equal(a, b) for a, b in zip(alone, again_alone))
    assert not any(torch.equal(a, b) for a, b in zip(alone, _dpsgd_run(False)))


def test_with_sites_that_may_drop_the_shares_are_scaled_to_min_sites():
    """FlowerSite(min_sites=2) of 3 sites: any 2 sites must carry σ² against t colluders,
    so each share is σ/√(2 − t) (W is 2 in the share's scale), and t = 2 is refused."""
    from types import SimpleNamespace

    from lightning_fl.engine import collectives

    class TwoOfThree(collectives.Collectives):
        def all_reduce(self, tensor): ...

        def all_gather_object(self, value): ...

        def broadcast(self, tensor, src=0): ...

        def min_sites(self, world_size):
            return 2

    trainer = SimpleNamespace(max_epochs=3, world_size=3, global_rank=1)
    collectives.install(TwoOfThree())
    try:
        with pytest.raises(ValueError, match=r"may have 2 site\(s\).* at most 1, or run more"):
            DPFedAvg(noise="distributed", colluding_sites=2).on_fit_start(trainer, None)
        dp = DPFedAvg(noise="distributed", colluding_sites=1)
        dp.on_fit_start(trainer, None)
        assert (dp._sites, dp._rank) == (2, 1)
    finally:
        collectives.install(None)
