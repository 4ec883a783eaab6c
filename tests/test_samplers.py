"""Samplers draw from (seed, round) only, and their weights are unbiased: E[ω_i] = p_i."""

from __future__ import annotations

import pytest
import torch

from lightning_fl import (
    FederatedStrategy,
    FixedClustersSampler,
    FullParticipation,
    MDSampler,
    SampleSizeClusteredSampler,
    SimilarityClusteredSampler,
    UniformSampler,
)
from lightning_fl.callbacks import FedAvg
from tests.helpers import (
    make_trainer,
    params_of,
    tiny_datamodule,
    tiny_module,
    weights_over_rounds,
)

P = torch.tensor(
    [0.30, 0.20, 0.15, 0.10, 0.08, 0.07, 0.05, 0.03, 0.015, 0.005], dtype=torch.float64
)
DRAWS = 20_000


@pytest.mark.parametrize("sampler", [UniformSampler(4), MDSampler(4)], ids=["uniform", "md"])
def test_weights_are_unbiased_within_three_standard_errors(sampler):
    """Fraboni et al. Def. 2.1; the variances of Tab. 2.1 are checked too."""
    omega = weights_over_rounds(sampler, P, DRAWS)
    mean, std_err = omega.mean(0), omega.std(0) / DRAWS**0.5
    assert ((mean - P).abs() <= 3 * std_err + 1e-12).all(), (mean, P)
    n, m = len(P), 4
    expected_var = (n / m - 1) * P**2 if isinstance(sampler, UniformSampler) else (P - P**2) / m
    assert torch.allclose(omega.var(0), expected_var, rtol=0.1, atol=1e-5)


def test_md_weights_sum_to_one_and_count_repeats():
    part = MDSampler(50).sample(0, 0, torch.tensor([0.9, 0.1], dtype=torch.float64))
    assert abs(sum(part.weights) - 1) < 1e-12
    assert all(abs(w * 50 - round(w * 50)) < 1e-9 for w in part.weights)


def test_uniform_weights_are_n_over_m_p():
    part = UniformSampler(4).sample(7, 1, P)
    assert len(part.clients) == 4
    for c, w in zip(part.clients, part.weights):
        assert w == pytest.approx(10 / 4 * float(P[c]))


def test_renormalized_weights_are_an_explicit_opt_in():
    biased = UniformSampler(4, renormalize=True).sample(7, 1, P)
    plain = UniformSampler(4).sample(7, 1, P)
    assert biased.clients == plain.clients
    assert sum(biased.weights) == pytest.approx(1.0)
    assert sum(plain.weights) != pytest.approx(1.0)


def test_full_participation_uses_p_and_skips_empty_clients():
    p = torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64)
    part = FullParticipation().sample(0, 0, p)
    assert part.clients == (0, 2) and part.weights == (0.5, 0.5)


def test_same_seed_same_round_same_draw_and_seeds_differ():
    s = UniformSampler(3)
    assert s.sample(5, 11, P) == s.sample(5, 11, P)
    draws = {s.sample(5, seed, P).clients for seed in range(20)}
    assert len(draws) > 1


def test_more_clients_per_round_than_clients_is_a_clear_error():
    with pytest.raises(ValueError, match="clients_per_round=11 but only 10 clients"):
        UniformSampler(11).sample(0, 0, P)


def test_target_weights_are_checked():
    with pytest.raises(ValueError, match="sum to 1"):
        UniformSampler(1).sample(0, 0, torch.tensor([0.5, 0.2]))


# ------------------------------------------------------------------ clustered sampling
@pytest.mark.parametrize("m", [3, 4, 7])
def test_sample_size_clusters_satisfy_eqs_3_7_and_3_8(m):
    """Rows are distributions (3.7) and column i holds m·p_i (3.8), on random sizes."""
    g = torch.Generator().manual_seed(m)
    counts = torch.randint(1, 500, (23,), generator=g).double()
    p = counts / counts.sum()
    r = SampleSizeClusteredSampler(m).distributions(p)
    assert r.shape == (m, 23) and (r >= 0).all()
    assert torch.allclose(r.sum(1), torch.ones(m, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(r.sum(0), m * p, atol=1e-9)


def test_sample_size_clustered_weights_are_unbiased_with_less_variance_than_md():
    """E[ω_i] = p_i (Prop. 3.1), Var[ω_i] = Σ_k r_ki(1 − r_ki)/m² ≤ p_i(1 − p_i)/m, and a
    client is drawn at most ⌊m p_i⌋ + 2 times."""
    m = 4
    sampler = SampleSizeClusteredSampler(m)
    omega = weights_over_rounds(sampler, P, DRAWS)
    mean, std_err = omega.mean(0), omega.std(0) / DRAWS**0.5
    assert ((mean - P).abs() <= 3 * std_err + 1e-12).all(), (mean, P)
    dist = sampler.distributions(P)
    expected_var = (dist * (1 - dist)).sum(0) / m**2
    assert torch.allclose(omega.var(0), expected_var, rtol=0.1, atol=1e-5)
    assert (expected_var <= P * (1 - P) / m + 1e-12).all()
    assert (expected_var < P * (1 - P) / m).any()  # strictly better somewhere
    assert ((omega * m).round().max(0).values <= torch.floor(m * P) + 2).all()


def test_balanced_clients_give_uniform_sampling_without_replacement():
    n, m = 12, 4
    sampler = SampleSizeClusteredSampler(m)
    p = torch.full((n,), 1 / n, dtype=torch.float64)
    r = sampler.distributions(p)
    assert ((r > 0).sum(0) == 1).all()  # every client in exactly one distribution
    for t in range(50):
        part = sampler.sample(t, 0, p)
        assert len(part.clients) == m and set(part.weights) == {1 / m}


def test_sample_size_clusters_by_hand_and_for_arbitrary_floats():
    """p = (0.4, 0.35, 0.25), m = 2: masses 0.8, 0.7, 0.5 poured in decreasing order into
    two distributions of capacity 1 (thesis Alg. 2)."""
    r = SampleSizeClusteredSampler(2).distributions(torch.tensor([0.4, 0.35, 0.25]).double())
    assert torch.allclose(r, torch.tensor([[0.8, 0.2, 0.0], [0.0, 0.5, 0.5]]).double())
    torch.manual_seed(0)
    p = torch.distributions.Dirichlet(torch.ones(17)).sample((1,))[0].double()
    p = p / p.sum()  # not fractions with small denominators: the 10¹⁰-unit path
    r = SampleSizeClusteredSampler(5).distributions(p)
    assert torch.allclose(r.sum(1), torch.ones(5, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(r.sum(0), 5 * p, atol=1e-9)


def _groups_of_gradients(n: int, groups: int, d: int = 6, seed: int = 0) -> torch.Tensor:
    """Client i's representative gradient points along axis i mod ``groups``."""
    g = torch.Generator().manual_seed(seed)
    gradients = 0.01 * torch.randn(n, d, generator=g)
    gradients[torch.arange(n), torch.arange(n) % groups] += 1.0
    return gradients


@pytest.mark.parametrize("similarity", ["arccos", "L2", "L1"])
@pytest.mark.parametrize("authors_linkage", [False, True])
def test_similarity_clusters_satisfy_eqs_3_7_and_3_8(similarity, authors_linkage):
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(1, 100, (30,), generator=g).double()
    counts[0] = 900  # a client with m·p_i > 1 gets a distribution of its own
    p = counts / counts.sum()
    sampler = SimilarityClusteredSampler(5, similarity=similarity, authors_linkage=authors_linkage)
    sampler.observe(tuple(range(30)), torch.randn(30, 8, generator=g), 30)
    r = sampler.distributions(p)
    assert r.shape == (5, 30) and (r >= 0).all()
    assert torch.allclose(r.sum(1), torch.ones(5, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(r.sum(0), 5 * p, atol=1e-12)
    assert (r[:, 0] == 1.0).sum() == int(5 * p[0])


def test_similarity_sampling_draws_one_client_of_each_group_and_is_unbiased():
    """Four groups of similar updates and m = 4: every distribution holds one group, so
    each round has one client of each (the thesis' "oracle" sampling), and E[ω_i] = p_i."""
    n, m = 20, 4
    sampler = SimilarityClusteredSampler(m)
    sampler.observe(tuple(range(n)), _groups_of_gradients(n, m), n)
    p = torch.full((n,), 1 / n, dtype=torch.float64)
    r = sampler.distributions(p)
    for row in r:
        assert len({i % m for i in torch.nonzero(row).flatten().tolist()}) == 1
    omega = torch.zeros(4000, n, dtype=torch.float64)
    for t in range(4000):
        part = sampler.sample(t, 0, p)
        assert sorted(c % m for c in part.clients) == list(range(m))
        omega[t, list(part.clients)] = torch.tensor(part.weights, dtype=torch.float64)
    std_err = omega.std(0) / 4000**0.5  # 4 standard errors: 20 clients checked at once
    assert ((omega.mean(0) - p).abs() <= 4 * std_err + 1e-12).all()


def test_similarity_sampler_sees_the_updates_the_server_aggregated():
    """After one FedAvg round with full participation, Σ ω_i G_i = θ¹ − θ⁰, and the G_i
    are the sampler's checkpointed state."""
    module = tiny_module()
    before = params_of(module)
    sampler = SimilarityClusteredSampler(10)
    strategy = FederatedStrategy(sampler=sampler, local_steps=3, seed=0)
    make_trainer(strategy, 1, [FedAvg()]).fit(module, datamodule=tiny_datamodule())
    part = strategy.current_round.state.participation
    assert sampler.gradients.shape[0] == 10
    summed = sum(w * sampler.gradients[c].double() for c, w in zip(part.clients, part.weights))
    change = torch.cat([(a - b).flatten() for a, b in zip(params_of(module), before)])
    assert torch.allclose(summed.float(), change, atol=1e-5)
    assert torch.equal(sampler.state_dict()["gradients"], sampler.gradients)
    unseen = set(range(10)) - set(part.clients)
    assert all(not sampler.gradients[c].any() for c in unseen)


@pytest.mark.parametrize("vectorize", [False, True])
def test_a_client_whose_update_is_exactly_zero_is_observed_as_sent(vectorize):
    """A zero update (a zero learning rate, a free rider) was sent: the sampler sees it,
    with its zero row, and rows as wide as the model (the 'sent' flag is not passed on)."""
    seen = []

    class Recording(SimilarityClusteredSampler):
        def observe(self, clients, updates, num_clients):
            seen.append((clients, updates.clone()))
            super().observe(clients, updates, num_clients)

    module = tiny_module(lr=0.0)
    size = sum(p.numel() for p in module.parameters())
    strategy = FederatedStrategy(sampler=Recording(4), local_steps=2, seed=0, vectorize=vectorize)
    make_trainer(strategy, 2, [FedAvg()]).fit(module, datamodule=tiny_datamodule())
    assert len(seen) == 2
    for clients, updates in seen:
        assert len(clients) == 4 and updates.shape == (4, size)
        assert not updates.any()


def test_fixed_clusters_draw_one_client_of_each_and_refuse_unequal_weights():
    p = torch.full((6,), 1 / 6, dtype=torch.float64)
    sampler = FixedClustersSampler([[0, 3], [1, 4], [2, 5]])
    for t in range(20):
        assert sorted(c % 3 for c in sampler.sample(t, 0, p).clients) == [0, 1, 2]
    with pytest.raises(ValueError, match="weight 1/m"):
        FixedClustersSampler([[0], [1, 2, 3, 4, 5]]).distributions(p)
    with pytest.raises(ValueError, match="disjoint"):
        FixedClustersSampler([[0, 1], [1, 2]])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_similarity_sampling_pours_the_leftover_group_by_hand(seed):
    """m = 2, six clients of unequal weight whose updates point along four axes: {0, 1}
    (m·p = 0.4 + 0.3), {2, 3} (0.5 + 0.2), and clients 4 and 5 (0.4, 0.2), which Ward
    merges into one group of weight 0.3 ≤ 1/m. The two heaviest groups open the two
    distributions (0.7 each: a tie, so the first group's fills first); the leftover group's
    clients, in the random order of the seeded generator, fill the first to 1, then the
    second: client 4 first gives 0.3 | 0.1 + 0.2, client 5 first 0.2 + 0.1 | 0.3."""
    p = torch.tensor([0.2, 0.15, 0.25, 0.1, 0.2, 0.1], dtype=torch.float64)
    axes = torch.tensor([0, 0, 1, 1, 2, 3])
    updates = torch.nn.functional.one_hot(axes, 4).float()
    updates += 0.01 * torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    sampler = SimilarityClusteredSampler(2)
    sampler.observe(tuple(range(6)), updates, 6)
    assert sorted(map(sorted, sampler.groups(p))) == [[0, 1], [2, 3], [4, 5]]
    order = torch.randperm(2, generator=torch.Generator().manual_seed(seed)).tolist()
    r = sampler.distributions(p, torch.Generator().manual_seed(seed))
    if order == [0, 1]:  # client 4, then 5
        expected = [[0.4, 0.3, 0, 0, 0.3, 0], [0, 0, 0.5, 0.2, 0.1, 0.2]]
    else:
        expected = [[0.4, 0.3, 0, 0, 0.1, 0.2], [0, 0, 0.5, 0.2, 0.3, 0]]
    assert torch.allclose(r, torch.tensor(expected, dtype=torch.float64), atol=1e-12)


def test_sample_size_clusters_pour_clients_by_decreasing_weight_and_cache_r():
    """p = (0.1, 0.4, 0.2, 0.3), m = 2: exact masses 2, 8, 4, 6 tenths poured in the order
    clients 1, 3, 2, 0 (decreasing p, not index order) into distributions of capacity 10:
    {1: 8, 3: 2} | {3: 4, 2: 4, 0: 2}. r is computed once per p; fewer clients with data
    than distributions is refused."""
    sampler = SampleSizeClusteredSampler(2)
    p = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    r = sampler.distributions(p)
    expected = torch.tensor([[0.0, 0.8, 0.0, 0.2], [0.2, 0.0, 0.4, 0.4]], dtype=torch.float64)
    assert torch.allclose(r, expected, atol=1e-15)
    assert sampler.distributions(p.clone()) is r
    other = sampler.distributions(torch.tensor([0.4, 0.1, 0.2, 0.3], dtype=torch.float64))
    assert other is not r and other[0].tolist() == pytest.approx([0.8, 0.0, 0.0, 0.2])
    for refusing in (SampleSizeClusteredSampler(3), SimilarityClusteredSampler(3)):
        with pytest.raises(ValueError, match="clients_per_round=3 but only 2 clients"):
            refusing.distributions(torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64))


def test_integer_masses_round_by_largest_remainders_off_the_fraction_path():
    """Weights that are not fractions n_i/N (1/e, 1 − 1/e − 1/π, 1/π) take the units path:
    m = 2 and 10 units a distribution give shares 7.358, 6.276, 6.366, floored to 7, 6, 6
    (19 of 20); the unit left goes to the largest remainder, client 2 (0.366), not to the
    first client."""
    from lightning_fl.systems.samplers import _integer_masses

    inv_pi, inv_e = 1 / torch.pi, 1 / torch.e
    p = torch.tensor([inv_e, 1 - inv_e - inv_pi, inv_pi], dtype=torch.float64)
    assert _integer_masses(p, 2, 10) == ([7, 6, 7], 10)
    exact = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)  # fractions: exact masses
    assert _integer_masses(exact, 3, 10) == ([3, 6, 3], 4)


@pytest.mark.parametrize(
    "similarity, expected",
    [
        # G = (3, 4), (0, 2), (0, 0): cos(G_0, G_1) = 8/10; a zero gradient is at angle 0
        ("arccos", [[0, 0.6435011087932844, 0], [0.6435011087932844, 0, 0], [0, 0, 0]]),
        ("L2", [[0, 13, 25], [13, 0, 4], [25, 4, 0]]),  # squared, no root (authors' code)
        ("L1", [[0, 5, 7], [5, 0, 2], [7, 2, 0]]),
    ],
)
def test_similarity_matrices_by_hand(similarity, expected):
    sampler = SimilarityClusteredSampler(2, similarity=similarity)
    sampler.observe((0, 1, 2), torch.tensor([[3.0, 4.0], [0.0, 2.0], [0.0, 0.0]]), 3)
    rho = sampler.similarity_matrix()
    assert torch.allclose(rho, torch.tensor(expected, dtype=torch.float64), atol=1e-12)


def test_similarity_sampling_keeps_the_heaviest_groups_and_pours_the_lightest_first():
    """m = 3 and five clients, each its own group (1/m = 0.333): clients 0 and 1 (m·p 0.36
    and 0.24) lie on either side of client 2 (0.9), clients 3 and 4 (0.75 each) on other
    axes. The three heaviest groups open the distributions though they come last in index
    order; the leftover groups go lightest first (client 1, then 0) into the emptiest
    distributions first (3's, then 4's, then 2's): 1 puts 0.24 beside 3, then 0 puts 0.01
    there, 0.25 beside 4 and 0.1 beside 2."""
    p = torch.tensor([0.12, 0.08, 0.3, 0.25, 0.25], dtype=torch.float64)
    updates = torch.tensor([[1, 0.1, 0, 0], [1, -0.1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0],
                            [0, 0, 0, 1.0]])  # fmt: skip
    sampler = SimilarityClusteredSampler(3, similarity="L2")
    sampler.observe(tuple(range(5)), updates, 5)
    assert sampler.groups(p) == [[0], [1], [2], [3], [4]]
    r = sampler.distributions(p, torch.Generator().manual_seed(0))
    expected = [[0.1, 0, 0.9, 0, 0], [0.01, 0.24, 0, 0.75, 0], [0.25, 0, 0, 0, 0.75]]
    assert torch.allclose(r, torch.tensor(expected, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize(
    "p, message",
    [
        ([[0.5, 0.5]], "non-empty 1-D"),
        ([], "non-empty 1-D"),
        ([0.5, float("nan"), 0.5], "finite and non-negative"),
        ([1.0, float("inf")], "finite and non-negative"),
        ([1.5, -0.5], "finite and non-negative"),  # sums to 1
        ([0.5, 0.4999], "sum to 1, got 0.9999"),
    ],
)
def test_each_malformed_target_weight_vector_is_refused_alone(p, message):
    with pytest.raises(ValueError, match=message):
        UniformSampler(1).sample(0, 0, torch.tensor(p, dtype=torch.float64))


def test_participants_come_in_increasing_order_whatever_the_draw_order():
    """The visiting order is the clients' ids, not the order the multinomial drew them in
    (which differs on some of these rounds), so that two samplers drawing the same set
    train it in the same order."""
    from lightning_fl.engine.seeding import generator

    unsorted_draws = 0
    for sampler in (MDSampler(4), UniformSampler(4), SampleSizeClusteredSampler(4)):
        for t in range(10):
            drawn = list(sampler._draw(P, generator(0, "sampler", t)))
            unsorted_draws += drawn != sorted(drawn)
            part = sampler.sample(t, 0, P)
            assert list(part.clients) == sorted(drawn)
    assert unsorted_draws > 0


def test_a_wrapper_hands_its_samplers_narrow_inputs_checks_metrics_and_state_through():
    """ExcludedClients around a sampler that records what it is given: the needs, the loss
    function, ``check`` (less the excluded clients), ``observe``, the round metrics and the
    state go to the wrapped sampler and come back from it unchanged."""
    from lightning_fl import ExcludedClients
    from lightning_fl.systems.samplers import ClientSampler, SamplerWrapper

    class Recording(ClientSampler):
        needs_updates, needs_losses = True, True

        def __init__(self):
            super().__init__(renormalize=True)
            self.seen, self.state = [], {"kept": 1}

        def check(self, num_eligible):
            self.seen.append(("check", num_eligible))

        def observe(self, clients, updates, num_clients):
            self.seen.append(("observe", clients, num_clients))

        def round_metrics(self):
            return {"fl/recorded": 2.0}

        def state_dict(self):
            return dict(self.state)

        def load_state_dict(self, state):
            self.state = state

    inner = Recording()
    wrapper = ExcludedClients(inner, excluded=[4, 1])
    assert wrapper.needs_updates and wrapper.needs_losses and wrapper.renormalize

    def losses(clients):
        return torch.zeros(len(clients))

    wrapper.losses = losses
    assert inner.losses is losses and wrapper.losses is losses
    wrapper.check(10)
    wrapper.observe((0, 3), torch.zeros(2, 5), 10)
    SamplerWrapper(inner).check(9)  # the base wrapper passes the count on as it is
    assert inner.seen == [("check", 8), ("observe", (0, 3), 10), ("check", 9)]
    assert wrapper.round_metrics() == {"fl/recorded": 2.0}
    assert wrapper.state_dict() == {"kept": 1}
    wrapper.load_state_dict({"kept": 7})
    assert inner.state == {"kept": 7}
