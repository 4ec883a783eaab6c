"""Client availability (Marfoq thesis §2.2): two-state Markov chains match their π and λ,
the Unbiased selector is unbiased for α under the chains' stationary law, More available
keeps only the more available clients, and the chain state resumes exactly."""

from __future__ import annotations

import pytest
import torch

from lightning_fl import (
    AvailableClients,
    FederatedStrategy,
    MarkovAvailability,
    SojournMarkovAvailability,
)
from tests.helpers import (
    make_trainer,
    max_abs_diff,
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
    """π at 0 or 1 is refused; λ = −1 at π = 1/2 puts 1 in both off-diagonal entries of P,
    the end of the range, and is accepted (a chain that alternates), and so is λ = 1 (0 in
    both: a chain that never moves); one step past is refused."""
    for pi in ([1.0], [0.0], [0.5, 0.0]):
        with pytest.raises(ValueError, match="π_k must be in"):
            MarkovAvailability(pi)
    for pi, lam in ((0.9, -0.5), (0.1, -0.2)):  # (1 − λ)π = 1.35, then (1 − λ)(1 − π) = 1.08
        with pytest.raises(ValueError, match="probability matrix"):
            MarkovAvailability([pi], [lam])
    alternating = MarkovAvailability([0.5], [-1.0])
    states = [bool(alternating.available(r, 0, 1)[0]) for r in range(6)]
    assert all(a != b for a, b in zip(states, states[1:]))
    frozen = MarkovAvailability([0.5, 0.5], [1.0, 1.0])  # λ = 1: P = I, the other end
    first = frozen.available(0, 3, 2).tolist()
    assert all(frozen.available(r, 3, 2).tolist() == first for r in range(1, 6))
    with pytest.raises(ValueError, match="probability matrix"):
        MarkovAvailability([0.5], [-1.01])
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
    for selector in ("unbiased", "more_available", "ca_fed"):
        folder = tmp_path / selector
        cli = run(
            ["fit", "--config", str(recipe), "--trainer.max_epochs", "3",
             "--trainer.strategy.init_args.sampler.init_args.selector", selector,
             "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(folder),
             "--trainer.logger.init_args.save_dir", str(folder)]
        )  # fmt: skip
        assert isinstance(cli.trainer.strategy.sampler.availability, MarkovAvailability)
        (path,) = folder.rglob("participation.csv")
        assert (path.parent / "participation.png").exists()
        (metrics,) = folder.rglob("metrics.csv")
        assert "fl/excluded" in open(metrics).readline()  # available clients left out
        clients = {int(r["client"]) for r in csv.DictReader(open(path))}
        if selector == "more_available":
            assert clients <= set(range(10))  # only the π = 0.9 clients


# ---- CA-Fed, AdaFed, F3AST (thesis §2.2, Alg. 6) -------------------------------------------


def test_beta_prior_estimators_converge_to_the_chains_pi_and_lambda():
    from lightning_fl.systems.ca_fed import AvailabilityEstimator

    pi, lam = [0.9, 0.1, 0.5, 0.3], [0.0, 0.6, 0.9, -0.2]
    model, estimator = MarkovAvailability(pi, lam), AvailabilityEstimator((1.0, 1.0))
    for t in range(20000):
        estimator.observe(model.available(t, 3, 4))
    assert estimator.availability() == pytest.approx(
        torch.tensor(pi, dtype=torch.float64), abs=0.03
    )
    assert estimator.correlation() == pytest.approx(
        torch.tensor(lam, dtype=torch.float64), abs=0.05
    )


def test_history_feeds_the_estimator_the_chains_first_rounds_and_shifts_training():
    """t′ rounds of history (Fig. 2.14): after the first draw the estimator has seen the
    chains' rounds 0..t′ (its π̂ is the Beta-prior count over them) and training round t
    is the chains' round t′ + t; a sampler without history starts at round 0."""
    pi, lam, n, seed, history = [0.9, 0.1, 0.5, 0.3], [0.0, 0.6, 0.9, -0.2], 4, 7, 25
    chains = MarkovAvailability(pi, lam)
    sampler = AvailableClients(MarkovAvailability(pi, lam), "adafed", estimate=True,
                               history=history)  # fmt: skip
    p = torch.full((n,), 0.25, dtype=torch.float64)
    trace = torch.stack([chains.available(t, seed, n) for t in range(history + 3)]).double()
    for t in range(3):
        drawn = sampler.sample(t, seed, p)
        assert set(drawn.clients) == set(torch.nonzero(trace[history + t]).flatten().tolist())
        seen = trace[: history + t + 1]
        expected = (seen.sum(0) + 1) / (len(seen) + 2)  # Beta(1, 1)
        assert torch.allclose(sampler.estimator.availability(), expected)
    plain = AvailableClients(MarkovAvailability(pi, lam), "adafed")
    assert set(plain.sample(0, seed, p).clients) == set(torch.nonzero(trace[0]).flatten().tolist())
    with pytest.raises(ValueError, match="history"):
        AvailableClients(chains, history=-1)


def test_estimated_error_and_get_by_hand():
    """ε̂ = ⟨gap, w⟩ + 4κ̄² d_TV(α, w)² max gap, w = π⊙q normalized (eqs. 2.31–2.33)."""
    from lightning_fl.systems.ca_fed import estimated_error, truncate

    alpha = torch.tensor([0.5, 0.5], dtype=torch.float64)
    pi = torch.tensor([0.9, 0.1], dtype=torch.float64)
    gap = torch.tensor([0.1, 0.5], dtype=torch.float64)
    q = alpha / pi  # π⊙q = α: no bias
    assert estimated_error(q, alpha, gap, pi, 1.0) == pytest.approx(0.3)
    dropped = torch.tensor([q[0], 0.0], dtype=torch.float64)  # w = (1, 0): d_TV = 0.5
    assert estimated_error(dropped, alpha, gap, pi, 1.0) == pytest.approx(0.1 + 4 * 0.25 * 0.5)
    # κ̄² = 1: dropping client 1 costs 0.6 > 0.3, kept; κ̄² = 0: it lowers ε̂ to 0.1, dropped
    assert torch.equal(truncate(q, [1, 0], alpha, gap, pi, 1.0, 0.0), q)
    assert truncate(q, [1, 0], alpha, gap, pi, 0.0, 0.0).tolist() == [q[0].item(), 0.0]
    # the last client is never dropped, and a tolerance τ keeps what gains less than τ
    assert truncate(dropped, [0], alpha, gap, pi, 0.0, 0.0)[0] > 0
    assert torch.equal(truncate(q, [1, 0], alpha, gap, pi, 0.0, 0.5), q)


def _selector(selector, **kw):
    pi = [0.9] * 4 + [0.15] * 4
    lam = [0.9, 0.0] * 4
    return AvailableClients(MarkovAvailability(pi, lam), selector=selector, **kw)


def _fit_with(sampler, rounds=5):
    module = tiny_module()
    trainer = make_trainer(FederatedStrategy(sampler=sampler, local_steps=2, seed=1), rounds)
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=8))
    return module


def test_ca_fed_with_huge_kappa_is_unbiased_and_with_zero_kappa_drops_clients():
    unbiased = _fit_with(_selector("unbiased"))
    huge = _fit_with(_selector("ca_fed", kappa2=1e12))
    assert (
        max(float((a - b).abs().max()) for a, b in zip(params_of(unbiased), params_of(huge))) == 0
    )
    greedy = _selector("ca_fed", kappa2=0.0)
    p = torch.full((8,), 1 / 8, dtype=torch.float64)
    greedy.losses = lambda clients: [1.0 + c for c in clients]  # the less available lose more
    dropped = []
    for t in range(30):
        participation = greedy.sample(t, 0, p)
        dropped += list(greedy.excluded)
        assert not set(participation.clients) & set(greedy.excluded)
    assert dropped and set(dropped) <= set(range(8))


def test_ca_fed_probes_every_available_clients_loss_even_excluded_ones():
    sampler = _selector("ca_fed", kappa2=0.0)
    _fit_with(sampler, rounds=6)
    assert sampler.filter.estimate is not None and bool((sampler.filter.estimate > 0).all())


def test_adafed_normalizes_over_the_available_clients_and_f3ast_takes_the_top_k():
    p = torch.full((8,), 1 / 8, dtype=torch.float64)
    adafed = _selector("adafed")
    for t in range(10):
        part = adafed.sample(t, 0, p)
        if part.clients:
            assert sum(part.weights) == pytest.approx(1.0)
    f3ast = _selector("f3ast", clients_per_round=2, smoothness=0.1)
    for t in range(10):
        available = f3ast.availability.available(t, 0, 8)
        part = f3ast.sample(t, 0, p)
        assert len(part.clients) == min(2, int(available.sum()))
        rates = f3ast.rates
        chosen_scores = sorted((1 / rates[c] ** 2).item() for c in part.clients)
        others = [(1 / rates[c] ** 2).item() for c in torch.nonzero(available).flatten().tolist()
                  if c not in part.clients]  # fmt: skip
        assert not others or min(chosen_scores) >= max(others) - 1e-12
        assert part.weights == pytest.approx([(p[c] / rates[c]).item() for c in part.clients])


def test_ca_fed_resumes_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    full = _fit_with(_selector("ca_fed", kappa2=0.5, estimate=True), rounds=6)
    checkpoint = ModelCheckpoint(tmp_path, "{epoch}", save_top_k=-1, every_n_epochs=1)
    module = tiny_module()

    def strategy():
        sampler = _selector("ca_fed", kappa2=0.5, estimate=True)
        return FederatedStrategy(sampler=sampler, local_steps=2, seed=1)

    make_trainer(strategy(), 3, [checkpoint], enable_checkpointing=True).fit(
        module, datamodule=tiny_datamodule(num_clients=8)
    )
    resumed = tiny_module(seed=9)
    trainer = make_trainer(strategy(), 6)
    trainer.fit(resumed, datamodule=tiny_datamodule(num_clients=8),
                ckpt_path=str(tmp_path / "epoch=2.ckpt"), weights_only=True)  # fmt: skip
    assert max_abs_diff(params_of(full), params_of(resumed)) == 0


def test_synthetic_ca_fed_recipe_runs_shortened(tmp_path):
    from pathlib import Path

    import yaml

    from lightning_fl.cli import run

    root = Path(__file__).resolve().parents[1]
    config = yaml.safe_load((root / "recipes/participation/synthetic_ca_fed.yaml").read_text())
    sampler = config["trainer"]["strategy"]["init_args"]["sampler"]["init_args"]
    sampler["availability"]["init_args"]["num_clients"] = 12
    config["data"]["init_args"].update(root=str(tmp_path / "data"), num_users=12)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(config))
    cli = run(["fit", "--config", str(tmp_path / "recipe.yaml"), "--trainer.max_epochs", "3",
               "--trainer.default_root_dir", str(tmp_path),
               "--trainer.logger.init_args.save_dir", str(tmp_path),
               "--trainer.enable_progress_bar", "false"])  # fmt: skip
    assert cli.trainer.current_epoch == 3
    assert 0.0 <= float(cli.trainer.callback_metrics["test_acc"]) <= 1.0


def test_normalized_ca_fed_keeps_the_same_clients_with_weights_summing_to_one():
    """Issue 40's probe: CA-Fed's kept weights α_k/π_k rescaled per round to sum to 1 (the
    authors' code hands them over unnormalized, so their sum follows how many clients are
    available). Unequal α, π and losses; 12 rounds in which that sum varies."""
    p = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.05, 0.1, 0.15, 0.2], dtype=torch.float64)

    def chains():
        return MarkovAvailability([0.9, 0.7, 0.5, 0.3] * 2, [0.0] * 8)

    plain = AvailableClients(chains(), "ca_fed", kappa2=0.3)
    normalized = AvailableClients(chains(), "ca_fed", kappa2=0.3, normalize_weights=True)
    sums, excluded = [], 0
    for sampler in (plain, normalized):
        sampler.losses = lambda clients: [1.0 + 0.3 * c for c in clients]
    for t in range(12):
        a, b = plain.sample(t, 2, p), normalized.sample(t, 2, p)
        assert a.clients == b.clients and plain.excluded == normalized.excluded
        excluded += len(plain.excluded)
        if not a.clients:
            continue
        pi = plain.availability.stationary(8)
        expected = [float(p[c] / pi[c]) for c in a.clients]  # α_k/π_k, unnormalized
        assert list(a.weights) == pytest.approx(expected, rel=1e-12)
        assert list(b.weights) == pytest.approx([w / sum(expected) for w in expected], rel=1e-12)
        sums.append(round(sum(a.weights), 6))
    assert excluded and min(sums) < 0.2 and max(sums) > 1.3  # the step swings 10-fold


def test_loss_filter_and_estimators_by_hand_over_three_rounds():
    """Eq. 2.30 at β = 0.3 for 3 clients over 3 rounds, by hand: round 0 hears clients 0
    and 2 (losses 2.0, 1.0), so client 1 starts at their mean 1.5; then F̂ ← 0.7 F̂ + 0.3 F
    for the available ones only, and F̂* is the running minimum. The Beta(2, 3) estimators
    over the same sets: π̂ = (count + 2)/(t + 5); λ̂ from the transitions 0→0, 1→1."""
    from lightning_fl.systems.ca_fed import AvailabilityEstimator, LossFilter

    rounds = [([1, 0, 1], [2.0, 9.0, 1.0]), ([1, 1, 0], [1.0, 3.0, 9.0]),
              ([0, 1, 1], [9.0, 1.0, 2.0])]  # fmt: skip
    loss_filter, estimator = LossFilter(beta=0.3), AvailabilityEstimator((2.0, 3.0))
    for available, losses in rounds:
        mask = torch.tensor(available, dtype=torch.bool)
        loss_filter.update(torch.tensor(available), torch.tensor(losses, dtype=torch.float64))
        estimator.observe(mask)  # the filter takes a 0/1 mask as well as a boolean one
    # client 0: 2.0 -> 0.7*2 + 0.3*1 = 1.7 -> unavailable: 1.7
    # client 1: 1.5 -> 0.7*1.5 + 0.3*3 = 1.95 -> 0.7*1.95 + 0.3*1 = 1.665
    # client 2: 1.0 -> unavailable: 1.0 -> 0.7*1 + 0.3*2 = 1.3
    assert loss_filter.estimate.tolist() == pytest.approx([1.7, 1.665, 1.3])
    assert loss_filter.minimum.tolist() == pytest.approx([1.7, 1.5, 1.0])
    assert estimator.availability().tolist() == pytest.approx([4 / 8, 4 / 8, 4 / 8])
    # transitions: client 0: 1→1, 1→0; client 1: 0→1, 1→1; client 2: 1→0, 0→1
    stay_00 = [(0 + 2) / (0 + 0 + 5), (0 + 2) / (1 + 5), (0 + 2) / (1 + 5)]
    stay_11 = [(1 + 2) / (2 + 5), (1 + 2) / (1 + 5), (0 + 2) / (1 + 5)]
    expected = [a + b - 1 for a, b in zip(stay_00, stay_11)]
    assert estimator.correlation().tolist() == pytest.approx(expected)
    empty = LossFilter(beta=0.5)
    empty.update(torch.zeros(2, dtype=torch.bool), torch.tensor([4.0, 5.0]))
    assert empty.estimate.tolist() == [0.0, 0.0]  # nobody heard from yet
    for beta in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"beta must be in \(0, 1\]"):
            LossFilter(beta=beta)
    assert LossFilter(beta=1.0).beta == 1.0  # the upper end is allowed
    with pytest.raises(ValueError, match="Beta prior counts must be > 0"):
        AvailabilityEstimator((0.0, 1.0))


def test_get_visits_a_client_whose_weight_is_one_and_drops_at_exactly_the_tolerance():
    """α = (½, ½), π = (½, ⅛): q = α/π = (1, 4) and π⊙q normalized is (½, ½); with gaps
    (0.5, 0.25) and κ̄² = 0, ε̂ = 0.375, and dropping client 0 gives ε̂ = 0.25: a gain of
    exactly 0.125 (binary fractions, no rounding). q_0 = 1 is a weight like any other, and
    a gain equal to the tolerance τ = 0.125 is enough (Alg. 6: "by at least τ")."""
    from lightning_fl.systems.ca_fed import estimated_error, truncate

    alpha = torch.tensor([0.5, 0.5], dtype=torch.float64)
    pi = torch.tensor([0.5, 0.125], dtype=torch.float64)
    gap = torch.tensor([0.5, 0.25], dtype=torch.float64)
    q = alpha / pi
    assert q.tolist() == [1.0, 4.0]
    assert estimated_error(q, alpha, gap, pi, 0.0) == 0.375
    assert truncate(q, [0, 1], alpha, gap, pi, 0.0, 0.125).tolist() == [0.0, 4.0]
    assert truncate(q, [0, 1], alpha, gap, pi, 0.0, 0.126).tolist() == [1.0, 4.0]


def test_markov_availability_by_hand_in_order_and_out_of_order():
    """Three chains with their own π and λ over rounds 0–4: round 0 draws the stationary
    start (u < π), round r ≥ 1 stays on with λ + (1 − λ)π and turns on with (1 − λ)π, each
    round from its own draw (seed, round); asking for an earlier round replays the chain.
    Seed 6 makes every round's state differ from the one before (with seed 4 rounds 0 and
    1 agree, and a chain that skipped round 1's draw went unseen)."""
    from lightning_fl.engine.seeding import generator

    pi, lam = [0.3, 0.6, 0.8], [0.5, 0.2, 0.0]
    chain = MarkovAvailability(pi, lam)
    states = []
    for r in range(5):
        u = torch.rand(3, generator=generator(6, "availability", r), dtype=torch.float64)
        if r == 0:
            state = [float(u[k]) < pi[k] for k in range(3)]
        else:
            state = [
                float(u[k]) < (lam[k] + (1 - lam[k]) * pi[k] if state[k] else (1 - lam[k]) * pi[k])
                for k in range(3)
            ]
        states.append(state)
    assert all(a != b for a, b in zip(states, states[1:]))  # the chains move every round
    assert [chain.available(r, 6, 3).tolist() for r in range(5)] == states
    assert chain.available(2, 6, 3).tolist() == states[2]  # back in time: replayed
    assert chain.available(4, 6, 3).tolist() == states[4]


def test_one_pi_and_one_lambda_for_every_chain_by_hand():
    """The shortcut for one π and one λ (two thresholds for the whole population, no pass
    over it) walks as the rule written out: stay on with λ + (1 − λ)π, turn on with
    (1 − λ)π, from the draws of (seed, round)."""
    from lightning_fl.engine.seeding import generator

    pi, lam = 0.3, 0.5
    chain = MarkovAvailability(pi, lam)
    states = []
    for r in range(12):
        u = torch.rand(4, generator=generator(6, "availability", r), dtype=torch.float64)
        if r == 0:
            state = [float(u[k]) < pi for k in range(4)]
        else:
            state = [float(u[k]) < (lam + (1 - lam) * pi if state[k] else (1 - lam) * pi)
                     for k in range(4)]  # fmt: skip
        states.append(state)
    assert len({tuple(s) for s in states}) > 4  # the chains move
    assert [chain.available(r, 6, 4).tolist() for r in range(12)] == states


def test_two_class_availability_by_hand():
    """N = 6, g = 0.3, ν = 0.8, ε = 0.05: π = 0.8 for the first half and 0.2 for the
    second; in each half the first quarter (⌊6/4⌋ = 1 client) is correlated (λ = ν), the
    rest weakly (λ_k = ε·z_k, z the seeded normal draw); 4 clients are the fewest."""
    from lightning_fl.engine.seeding import generator
    from lightning_fl.systems.availability import TwoClassAvailability

    chains = TwoClassAvailability(num_clients=6, gap=0.3, correlation=0.8, noise=0.05, seed=2)
    z = torch.randn(6, generator=generator(2, "weak_correlation")) * 0.05
    assert chains.stationary(6).tolist() == pytest.approx([0.8, 0.8, 0.8, 0.2, 0.2, 0.2])
    expected = [0.8, float(z[1]), float(z[2]), 0.8, float(z[4]), float(z[5])]
    assert chains.correlation(6).tolist() == pytest.approx(expected)
    four = TwoClassAvailability(num_clients=4, noise=0.0)
    assert four.correlation(4).tolist() == pytest.approx([0.9, 0.0, 0.9, 0.0])
    with pytest.raises(ValueError, match="at least 4 clients, got 3"):
        TwoClassAvailability(num_clients=3)
    for gap in (0.0, 0.5):
        with pytest.raises(ValueError, match=f"gap g must be in \\(0, 0.5\\).*got {gap}"):
            TwoClassAvailability(gap=gap)


class _Scripted:
    """Availability read from a script: round t's mask, and a fixed stationary π."""

    def __init__(self, masks: list[list[int]], pi: list[float]) -> None:
        self.masks = [torch.tensor(m, dtype=torch.bool) for m in masks]
        self.pi = torch.tensor(pi, dtype=torch.float64)

    def available(self, t: int, seed: int, n: int) -> torch.Tensor:
        return self.masks[t].clone()

    def stationary(self, n: int) -> torch.Tensor:
        return self.pi.clone()

    def correlation(self, n: int) -> torch.Tensor:
        return getattr(self, "lam", torch.zeros(n, dtype=torch.float64)).clone()

    def state_dict(self) -> dict:
        return {}


def test_f3ast_by_hand_over_four_rounds_with_unequal_weights():
    """F3AST (Ribero et al.): r ← (1 − s)·r + s·1{available} from r = π, then the k = 2
    available clients with the largest p²/r² (ties to the smaller id), weighted p/r; with
    p, π and the masks unequal, written out independently over five rounds (the last with
    one client available). Then k = 1 between p = 0.3, r = 0.9 and p = 0.2, r = 0.65: p/r
    ranks the first higher, as p²/r² does, but p²/r³ would not."""
    masks = [[1, 1, 1, 0, 1], [1, 0, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 1, 0]]
    pi = [0.5, 0.6, 0.7, 0.8, 0.9]
    p = torch.tensor([0.1, 0.15, 0.2, 0.25, 0.3], dtype=torch.float64)
    smoothness = 0.3
    sampler = AvailableClients(_Scripted(masks, pi), selector="f3ast", clients_per_round=2,
                               smoothness=smoothness)  # fmt: skip
    rates = list(pi)
    for t, mask in enumerate(masks):
        rates = [(1 - smoothness) * r + smoothness * a for r, a in zip(rates, mask)]
        scores = {c: (float(p[c]) / rates[c]) ** 2 for c in range(5) if mask[c]}
        chosen = sorted(scores, key=lambda c: (-scores[c], c))[:2]
        part = sampler.sample(t, 0, p)
        assert sorted(part.clients) == sorted(chosen), t
        weights = dict(zip(part.clients, part.weights))
        for c in chosen:
            assert weights[c] == pytest.approx(float(p[c]) / rates[c], rel=1e-12), (t, c)
    scripted = _Scripted([[0, 0, 1, 0, 1]], [0.5, 0.5, 0.5, 0.5, 6 / 7])
    one = AvailableClients(scripted, selector="f3ast", clients_per_round=1, smoothness=0.3)
    assert one.sample(0, 0, p).clients == (4,)


def test_ca_fed_selection_by_hand_drops_by_correlation_then_by_availability():
    """Alg. 6 through the sampler, over four scripted rounds: the filtered losses (β = 0.5)
    give the gaps F̂ − F̂*, q = α/π, then ``get`` visits the clients by decreasing |λ| (ties
    to the smaller id) and then by increasing π, each pass with the truncation of
    ``ca_fed.truncate`` (itself checked by hand above); the round's clients are the available
    ones left with q > 0, weighted q, and the others are reported as excluded. The script
    (found by a search) keeps other clients if either pass visited in another order (by
    increasing |λ|, by signed λ, or by decreasing π)."""
    from lightning_fl.systems.ca_fed import LossFilter, truncate

    masks = [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 1, 1]]
    pi = torch.tensor([0.13, 0.34, 0.76, 0.25, 0.74, 0.62], dtype=torch.float64)
    lam = torch.tensor([-0.6, -0.1, -0.2, 0.6, -0.6, 0.2], dtype=torch.float64)
    p = torch.tensor([0.175, 0.147, 0.317, 0.078, 0.085, 0.198], dtype=torch.float64)
    losses = [
        [1.79, 2.18, 1.68, 1.75, 2.29, 2.17],
        [1.6, 1.13, 2.36, 1.85, 2.49, 2.29],
        [1.77, 2.47, 1.68, 1.67, 1.72, 1.88],
        [1.27, 1.68, 1.02, 1.16, 1.51, 2.31],
    ]
    scripted = _Scripted(masks, pi.tolist())
    scripted.lam = lam
    sampler = AvailableClients(scripted, selector="ca_fed", kappa2=0.05, loss_beta=0.5)
    reference = LossFilter(0.5)
    by_correlation = [0, 3, 4, 2, 5, 1]  # |λ| 0.6 ×3, 0.2 ×2, 0.1
    by_availability = [0, 3, 1, 5, 4, 2]  # π 0.13, 0.25, 0.34, 0.62, 0.74, 0.76
    for t, mask in enumerate(masks):
        sampler.losses = lambda clients, t=t: [losses[t][c] for c in clients]
        part = sampler.sample(t, 0, p)
        available = torch.tensor(mask, dtype=torch.bool)
        loss = torch.tensor([losses[t][c] if mask[c] else 0.0 for c in range(6)],
                            dtype=torch.float64)  # fmt: skip
        reference.update(available, loss)
        gap = (reference.estimate - reference.minimum).clamp_min(0.0)
        q = p / pi
        q = truncate(q, by_correlation, p, gap, pi, 0.05, 0.0)
        q = truncate(q, by_availability, p, gap, pi, 0.05, 0.0)
        kept = [c for c in range(6) if mask[c] and q[c] > 0]
        assert part.clients == tuple(kept), t
        assert part.weights == pytest.approx([float(q[c]) for c in kept], rel=1e-12)
        assert sampler.excluded == tuple(c for c in range(6) if mask[c] and q[c] == 0)
    assert part.clients == (0, 2, 4)  # the last round, as the search found it


# ------------------------------------------------- the sojourn walk (issue 66)


def _sojourn_reference(pi, lam, seed, rounds):
    """The chains walked by their sojourn times, by hand: a dict of next changes, scanned
    over every chain each round (what the calendar avoids)."""
    import math

    from lightning_fl.engine.seeding import generator

    n = len(pi)

    def stays_then_changes(k, on, v):
        leave = (1 - lam[k]) * (1 - pi[k]) if on else (1 - lam[k]) * pi[k]
        if leave == 0:
            return math.inf
        if leave == 1:
            return 1
        return 1 + math.floor(math.log(v) / math.log1p(-leave))

    u = torch.rand(n, generator=generator(seed, "availability", 0), dtype=torch.float64)
    state = [float(u[k]) < pi[k] for k in range(n)]
    first = generator(seed, "availability_sojourns", 0)
    v = 1 - torch.rand(n, generator=first, dtype=torch.float64)
    change = {k: stays_then_changes(k, state[k], float(v[k])) for k in range(n)}
    states = [list(state)]
    for t in range(1, rounds):
        changing = sorted(k for k in range(n) if change[k] == t)
        v = 1 - torch.rand(len(changing), generator=generator(seed, "availability", t),
                           dtype=torch.float64)  # fmt: skip
        for j, k in enumerate(changing):
            state[k] = not state[k]
            change[k] = t + stays_then_changes(k, state[k], float(v[j]))
        states.append(list(state))
    return states


PI = [0.3, 0.6, 0.05, 0.9, 0.5, 0.4, 0.5]
LAM = [0.5, 0.2, 0.0, 0.8, -1.0, -0.3, 1.0]  # ℓ = 1 both ways (alternates), λ = 1 (frozen)


def test_sojourn_walk_by_hand_over_300_rounds_with_unequal_chains():
    from lightning_fl.systems.availability import SojournMarkovAvailability

    chains = SojournMarkovAvailability(PI, LAM)
    expected = _sojourn_reference(PI, LAM, seed=5, rounds=300)
    got = [chains.available(t, 5, 7).tolist() for t in range(300)]
    assert got == expected
    assert [s[4] for s in got[:4]] in ([True, False, True, False], [False, True, False, True])
    assert len({s[6] for s in got}) == 1  # λ = 1: never changes
    assert sum(a != b for a, b in zip(got, got[1:])) > 100  # the calendar was exercised
    ids = [torch.nonzero(torch.tensor(s)).flatten().tolist() for s in expected]
    assert chains.active_clients(120, 5, 7).tolist() == ids[120]  # back in time: replayed
    assert chains.active_clients(299, 5, 7).tolist() == ids[299]
    per_round = MarkovAvailability(PI, LAM)  # the same start at round 0
    assert chains.available(0, 5, 7).tolist() == per_round.available(0, 5, 7).tolist()


def test_sojourn_walk_resumes_from_its_state_dict_and_clusters_move_together(tmp_path):
    from lightning_fl.systems.availability import SojournMarkovAvailability

    expected = _sojourn_reference(PI, LAM, seed=2, rounds=200)
    walked = SojournMarkovAvailability(PI, LAM)
    walked.available(90, 2, 7)
    torch.save(walked.state_dict(), tmp_path / "chains.pt")
    saved = torch.load(tmp_path / "chains.pt", weights_only=True)
    resumed = SojournMarkovAvailability(PI, LAM)
    resumed.available(40, 9, 7)  # a walk of another seed, replaced by the loaded one
    resumed.load_state_dict(saved)
    again = resumed.state_dict()  # loaded as saved, not walked again from round 0
    assert again["round"] == 90 and all(torch.equal(again[k], saved[k]) for k in
                                        ("state", "change_rounds", "change_chains"))  # fmt: skip
    on_at_91 = [k for k in range(7) if expected[91][k]]
    assert resumed.active_clients(91, 2, 7).tolist() == on_at_91  # not the other walk's
    assert [resumed.available(t, 2, 7).tolist() for t in range(91, 200)] == expected[91:]
    assert resumed._round == 199 and len(resumed._calendar.runs) < 12

    clustered = SojournMarkovAvailability([0.3, 0.7], [0.5, 0.0], clusters=[1, 0, 1, 1, 0])
    reference = _sojourn_reference([0.3, 0.7], [0.5, 0.0], seed=1, rounds=50)
    for t in range(50):
        mask = clustered.available(t, 1, 5).tolist()
        assert mask == [reference[t][c] for c in (1, 0, 1, 1, 0)]
        assert clustered.active_clients(t, 1, 5).tolist() == [k for k in range(5) if mask[k]]


def test_sojourn_walk_edge_cases_frozen_chains_a_new_seed_and_one_shared_pi(tmp_path):
    """λ = 1 everywhere: nothing ever changes and the calendar is empty (its checkpoint
    too); a walk of another seed starts again, its active set included; one π and λ for
    all chains is the walk of the same value given per chain."""
    from lightning_fl.systems.availability import SojournMarkovAvailability

    frozen = SojournMarkovAvailability([0.5, 0.5, 0.5], [1.0, 1.0, 1.0])
    start = frozen.active_clients(0, 4, 3).tolist()
    assert all(frozen.active_clients(t, 4, 3).tolist() == start for t in range(1, 6))
    state = frozen.state_dict()
    assert len(state["change_rounds"]) == len(state["change_chains"]) == 0
    again = SojournMarkovAvailability([0.5, 0.5, 0.5], [1.0, 1.0, 1.0])
    again.load_state_dict(state)
    assert again.active_clients(8, 4, 3).tolist() == start

    chains = SojournMarkovAvailability(PI, LAM)
    chains.active_clients(60, 9, 7)
    expected = _sojourn_reference(PI, LAM, seed=2, rounds=40)
    assert chains.active_clients(39, 2, 7).tolist() == [k for k in range(7) if expected[39][k]]

    shared = SojournMarkovAvailability(0.3, 0.5)
    per_chain = SojournMarkovAvailability([0.3] * 50, [0.5] * 50)
    assert all(torch.equal(shared.available(t, 1, 50), per_chain.available(t, 1, 50))
               for t in range(40))  # fmt: skip


def test_the_calendar_stays_a_few_runs_however_many_changes_it_holds():
    """5,000 chains of π = 0.01, λ = 0 over 200 rounds: about 50 chains turn on a round
    and off the next, and those that turn off wait about 100 rounds; merged runs keep the
    calendar to O(log) runs (without merging, about a hundred)."""
    from lightning_fl.systems.availability import SojournMarkovAvailability

    chains = SojournMarkovAvailability(0.01, 0.0)
    most = 0
    for t in range(200):
        chains.active_clients(t, 0, 5000)
        most = max(most, len(chains._calendar.runs))
    assert most <= 16


@pytest.mark.parametrize("walk", ["per_round", "sojourns"])
def test_both_walks_have_the_chains_stationary_activity_and_correlation(walk):
    from lightning_fl.systems.availability import SojournMarkovAvailability

    pi, lam = torch.tensor([0.9, 0.1, 0.5, 0.3]), torch.tensor([0.9, 0.0, -0.5, 0.6])
    model = MarkovAvailability if walk == "per_round" else SojournMarkovAvailability
    trace = _trace(model(pi.tolist(), lam.tolist()), 20_000, 4)
    assert torch.allclose(trace.mean(0), pi.double(), atol=0.03)
    x = trace - trace.mean(0)
    lag1 = (x[1:] * x[:-1]).mean(0) / x.var(0)
    assert torch.allclose(lag1, lam.double(), atol=0.05)


def _dense_counts(masks, prior):
    """π̂ and λ̂ of the estimator by hand: counts over every client every round."""
    n, m = prior
    masks = torch.stack(masks).bool()
    rounds = len(masks)
    active = masks.double().sum(0)
    was, now = masks[:-1], masks[1:]
    stays = torch.stack([(~was & ~now).sum(0), (was & now).sum(0)]).double()
    leaves = torch.stack([(~was & now).sum(0), (was & ~now).sum(0)]).double()
    stay = (stays + n) / (stays + leaves + n + m)
    return (active + n) / (rounds + n + m), stay[0] + stay[1] - 1


def test_lazy_estimator_equals_the_counts_over_every_client_every_round():
    from lightning_fl.systems.ca_fed import AvailabilityEstimator

    gen = torch.Generator().manual_seed(4)
    masks, state = [], torch.rand(9, generator=gen) < 0.4
    lazy, old_format = AvailabilityEstimator((2.0, 3.0)), None
    for t in range(40):
        state = torch.where(torch.rand(9, generator=gen) < 0.3, ~state, state)
        masks.append(state.clone())
        if t % 2:
            lazy.observe(state)
        else:
            lazy.observe_clients(torch.nonzero(state).flatten(), 9)
        pi, lam = _dense_counts(masks, (2.0, 3.0))
        assert torch.allclose(lazy.availability(), pi, rtol=0, atol=1e-12)
        assert torch.allclose(lazy.correlation(), lam, rtol=0, atol=1e-12)
        some = torch.tensor([7, 0, 3])
        assert torch.allclose(lazy.availability(some), pi[some], rtol=0, atol=1e-12)
        if t == 19:  # a checkpoint of the counts over every client (before issue 66)
            stays_and_leaves = _dense_counts_raw(masks)
            old_format = {"rounds": 20, "active": torch.stack(masks).double().sum(0),
                          **stays_and_leaves, "last": state.clone()}  # fmt: skip
    resumed = AvailabilityEstimator((2.0, 3.0))
    resumed.load_state_dict(old_format)
    for mask in masks[20:]:
        resumed.observe(mask)
    assert torch.allclose(resumed.correlation(), lazy.correlation(), rtol=0, atol=1e-12)
    assert torch.allclose(resumed.availability(), lazy.availability(), rtol=0, atol=1e-12)


def _dense_counts_raw(masks):
    masks = torch.stack(masks).bool()
    was, now = masks[:-1], masks[1:]
    return {"stays": torch.stack([(~was & ~now).sum(0), (was & now).sum(0)]).double(),
            "leaves": torch.stack([(~was & now).sum(0), (was & ~now).sum(0)]).double()}  # fmt: skip


def test_the_examples_in_the_availability_docstrings_run():
    import doctest

    from lightning_fl.systems import availability, ca_fed

    for module in (availability, ca_fed):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted >= 1, module.__name__


@pytest.mark.parametrize("model", [MarkovAvailability, SojournMarkovAvailability])
def test_one_shared_pi_with_a_lambda_per_chain_keeps_each_chains_lambda(model):
    """π shared, λ per chain: the shortcut for one π and one λ must not take the first
    chain's λ for all. Chain 0 (π = ½, λ = −1: P(leave) = 1) flips at every round; chain 1
    (λ = 0.9: P(leave) = 0.05) flips rarely: 19 flips in 20 rounds against at most 8
    (binomial(19, 0.05) exceeds 8 with probability below 1e-7; the draws are seeded)."""
    chains = model(pi=0.5, lam=[-1.0, 0.9])
    states = torch.stack([chains.available(t, seed=4, num_clients=2) for t in range(20)])
    flips = (states[1:] != states[:-1]).sum(dim=0).tolist()
    assert flips[0] == 19 and flips[1] <= 8
