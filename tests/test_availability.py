"""Client availability (Marfoq thesis §2.2): two-state Markov chains match their π and λ,
the Unbiased selector is unbiased for α under the chains' stationary law, More available
keeps only the more available clients, and the chain state resumes exactly."""

from __future__ import annotations

import pytest
import torch

from lightning_fl import AvailableClients, FederatedStrategy, MarkovAvailability
from tests.helpers import (
    make_trainer,
    params_of,
    tiny_datamodule,
    tiny_module,
    weights_over_rounds,
)


def _trace(model, rounds, n, seed=0):
    return torch.stack([model.available(t, seed, n) for t in range(rounds)]).double()


def test_two_state_chains_have_their_stationary_activity_and_lag_one_correlation():
    pi, lam = torch.tensor([0.9, 0.1, 0.5, 0.3]), torch.tensor([0.9, 0.0, -0.5, 0.6])
    trace = _trace(MarkovAvailability(pi.tolist(), lam.tolist()), 20_000, 4)
    assert torch.allclose(trace.mean(0), pi.double(), atol=0.03)
    x = trace - trace.mean(0)
    lag1 = (x[1:] * x[:-1]).mean(0) / x.var(0)  # the chain's autocorrelation is λ
    assert torch.allclose(lag1, lam.double(), atol=0.05)


def test_clustered_chains_move_their_clients_together():
    model = MarkovAvailability([0.9, 0.1], [0.5, 0.5], clusters=[0, 0, 0, 1, 1])
    trace = _trace(model, 200, 5)
    assert torch.equal(trace[:, 0], trace[:, 2]) and torch.equal(trace[:, 3], trace[:, 4])
    assert torch.allclose(model.stationary(5), torch.tensor([0.9, 0.9, 0.9, 0.1, 0.1]).double())


def test_unbiased_selector_weights_average_to_alpha():
    """E[ω_k] = E[1{k ∈ A_t}] α_k/π_k = α_k (the biased objective 2.17 becomes the target)."""
    pi = [0.9, 0.9, 0.1, 0.1, 0.5, 0.3]
    alpha = torch.tensor([0.3, 0.1, 0.2, 0.1, 0.2, 0.1], dtype=torch.float64)
    sampler = AvailableClients(MarkovAvailability(pi, [0.8, 0.0, 0.8, 0.0, 0.3, 0.5]))
    rounds = 20_000
    omega = weights_over_rounds(sampler, alpha, rounds, seed=3)
    assert torch.allclose(omega.mean(0), alpha, rtol=0.1)


def test_more_available_keeps_only_the_more_available_clients():
    pi = [0.9, 0.9, 0.1, 0.1]
    sampler = AvailableClients(MarkovAvailability(pi, 0.0), selector="more_available")
    alpha = torch.full((4,), 0.25, dtype=torch.float64)
    seen = set()
    for t in range(200):
        part = sampler.sample(t, 0, alpha)
        seen |= set(part.clients)
        assert all(w == pytest.approx(0.25 / (0.9 * 0.5)) for w in part.weights)
    assert seen == {0, 1}


def test_bad_availability_is_refused():
    with pytest.raises(ValueError, match="π_k must be in"):
        MarkovAvailability([1.0])
    with pytest.raises(ValueError, match="probability matrix"):
        MarkovAvailability([0.9], [-0.5])
    with pytest.raises(ValueError, match="selector must be"):
        AvailableClients(MarkovAvailability(0.5), selector="oracle")
    with pytest.raises(ValueError, match="kappa2"):
        AvailableClients(MarkovAvailability(0.5), selector="ca_fed", kappa2=-1.0)


def test_training_with_availability_resumes_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def strategy():
        sampler = AvailableClients(MarkovAvailability(0.6, 0.7))
        return FederatedStrategy(sampler=sampler, local_steps=2, seed=1)

    full = tiny_module()
    make_trainer(strategy(), 4).fit(full, datamodule=tiny_datamodule())
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}"
    )
    make_trainer(strategy(), 2, [checkpoint], enable_checkpointing=True).fit(
        tiny_module(), datamodule=tiny_datamodule()
    )
    resumed = tiny_module(seed=5)
    make_trainer(strategy(), 4).fit(
        resumed, datamodule=tiny_datamodule(), ckpt_path=str(tmp_path / "epoch=1.ckpt"),
        weights_only=True,
    )  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(params_of(full), params_of(resumed)))


def test_a_round_without_available_clients_is_skipped_and_training_goes_on():
    sampler = AvailableClients(MarkovAvailability(0.05, 0.0))
    p = torch.full((10,), 0.1, dtype=torch.float64)
    sizes = [len(sampler.sample(t, 1, p).clients) for t in range(6)]
    assert 0 in sizes and any(sizes)
    module = tiny_module()
    trainer = make_trainer(FederatedStrategy(sampler=sampler, local_steps=2, seed=1), 6)
    trainer.fit(module, datamodule=tiny_datamodule())
    assert trainer.current_epoch == 6


def test_availability_recipe_runs_with_both_selectors(tmp_path):
    import csv
    from pathlib import Path

    from lightning_fl.cli import run

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "participation" / "availability.yaml"
    for selector in ("unbiased", "more_available"):
        folder = tmp_path / selector
        cli = run(
            ["fit", "--config", str(recipe), "--trainer.max_epochs", "3",
             "--trainer.strategy.init_args.sampler.init_args.selector", selector,
             "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(folder),
             "--trainer.logger.init_args.save_dir", str(folder)]
        )  # fmt: skip
        assert isinstance(cli.trainer.strategy.sampler.availability, MarkovAvailability)
        (path,) = folder.rglob("participation.csv")
        clients = {int(r["client"]) for r in csv.DictReader(open(path))}
        if selector == "more_available":
            assert clients <= set(range(10))  # only the π = 0.9 clients
