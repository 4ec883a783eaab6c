"""The samplers at the ends of their ranges (``lightning_fl/systems/samplers.py``): zero
exclusions, unsorted exclusion lists, invalid target weights, clients of zero weight, an
availability exactly at the threshold, fewer available clients than F3AST's budget, a
single client left for clustering, every client with a distribution of its own, and the
refusals' texts. Each pins a value by hand where the tests of test_samplers did not
separate a mistake (issue 39)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_fl import (
    AvailableClients,
    ExcludedClients,
    FixedClustersSampler,
    FullParticipation,
    SampleSizeClusteredSampler,
    SimilarityClusteredSampler,
    UniformSampler,
)


def _p(*weights: float) -> torch.Tensor:
    return torch.tensor(weights, dtype=torch.float64)


def test_excluded_clients_at_zero_as_a_sorted_list_and_drawn_by_hand():
    assert ExcludedClients(FullParticipation(), 0).sample(0, 1, _p(0.5, 0.5)).clients == (0, 1)
    with pytest.raises(ValueError, match="excluded must be >= 0, got -1"):
        ExcludedClients(FullParticipation(), -1)
    assert ExcludedClients(FullParticipation(), [3, 1]).excluded_clients(5, 0) == [1, 3]
    from lightning_fl.engine.seeding import generator

    order = torch.randperm(10, generator=generator(7, "excluded")).tolist()
    drawn = ExcludedClients(FullParticipation(), 3).excluded_clients(10, 7)
    assert drawn == sorted(order[:3]) and drawn != order[:3]  # sorted, not in drawn order


@pytest.mark.parametrize(
    "make",
    [lambda: ExcludedClients(FullParticipation(), [0]),
     lambda: AvailableClients(SimpleNamespace(), "unbiased")],
)  # fmt: skip
def test_wrappers_refuse_target_weights_that_do_not_sum_to_one(make):
    with pytest.raises(ValueError, match="Target weights p must sum to 1, got 1.1"):
        make().sample(0, 0, _p(0.5, 0.6))


class _Availability:
    """A stand-in availability model: fixed π and a fixed available set."""

    def __init__(self, pi, available) -> None:
        self.pi, self.mask = _p(*pi), torch.tensor(available)

    def stationary(self, n):
        return self.pi

    def available(self, round_idx, seed, n):
        return self.mask.clone()


def test_available_clients_of_zero_weight_never_take_part():
    """Client 1 has no training data (α = 0) though it is available: never a participant."""
    availability = _Availability([0.5, 0.5, 0.25], [True, True, True])
    part = AvailableClients(availability, "unbiased").sample(0, 0, _p(0.5, 0.0, 0.5))
    assert part.clients == (0, 2) and part.weights == (1.0, 2.0)  # q = α/π


def test_more_available_keeps_a_client_exactly_at_the_threshold():
    """π = (0.5, 0.4, 0.8) and min_availability 0.5: clients 0 (at it) and 2 are kept,
    each with q = α/π renormalized over the kept α's (0.25 + 0.25)."""
    availability = _Availability([0.5, 0.4, 0.8], [True, True, True])
    sampler = AvailableClients(availability, "more_available", min_availability=0.5)
    part = sampler.sample(0, 0, _p(0.25, 0.5, 0.25))
    assert part.clients == (0, 2)
    assert part.weights == pytest.approx((0.25 / 0.5 / 0.5, 0.25 / 0.8 / 0.5))


def test_f3ast_takes_only_the_available_clients_when_fewer_than_its_budget():
    availability = _Availability([0.5, 0.5, 0.5, 0.5], [True, False, True, False])
    sampler = AvailableClients(availability, "f3ast", clients_per_round=3, smoothness=1.0)
    part = sampler.sample(0, 0, _p(0.25, 0.25, 0.25, 0.25))
    assert part.clients == (0, 2)  # r = 1 after a smoothness of 1: weights α/r
    assert part.weights == (0.25, 0.25)


def test_f3ast_breaks_ties_in_favour_of_the_lower_index():
    """Twenty available clients, α alternating 0.04 and 0.06, r = 1: ten tie for the top
    score; a budget of 3 takes the first three of them, clients 1, 3 and 5."""
    availability = _Availability([0.5] * 20, [True] * 20)
    sampler = AvailableClients(availability, "f3ast", clients_per_round=3, smoothness=1.0)
    part = sampler.sample(0, 0, _p(*[0.04, 0.06] * 10))
    assert part.clients == (1, 3, 5)


def test_more_available_refuses_when_only_clients_without_data_are_kept():
    availability = _Availability([0.9, 0.3, 0.3], [True, True, True])
    sampler = AvailableClients(availability, "more_available", min_availability=0.5)
    with pytest.raises(ValueError, match="No client has π_k >= min_availability=0.5"):
        sampler.sample(0, 0, _p(0.0, 0.5, 0.5))


def test_smoothness_is_refused_outside_zero_to_one():
    availability = _Availability([1.0], [True])
    for ok in (0.0, 1.0):
        AvailableClients(availability, "f3ast", smoothness=ok)
    with pytest.raises(ValueError, match=r"smoothness must be in \[0, 1\], got 1.5"):
        AvailableClients(availability, "f3ast", smoothness=1.5)


@pytest.mark.parametrize("make", [lambda: SampleSizeClusteredSampler(5),
                                  lambda: SimilarityClusteredSampler(5)])  # fmt: skip
def test_clustered_samplers_name_the_count_of_clients_with_data(make):
    message = (
        r"^clients_per_round=5 but only 4 clients have training data; set clients_per_round <= 4\.$"
    )
    with pytest.raises(ValueError, match=message):
        make().distributions(_p(0.25, 0.25, 0.0, 0.25, 0.25))


def test_similarity_sampling_with_one_client_left_and_with_none_left():
    """m = 2: client 0 (m·p = 1.2) gets a distribution of its own and keeps 0.2, the only
    client left to group, which goes into the second distribution with client 1 (0.8).
    With p = (0.5, 0.5) each client fills a distribution and none is left to group."""
    sampler = SimilarityClusteredSampler(2)
    sampler.observe((0, 1), torch.tensor([[1.0, 0.0], [0.0, 1.0]]), 2)
    r = sampler.distributions(_p(0.6, 0.4), torch.Generator().manual_seed(0))
    assert torch.allclose(r, _p(1.0, 0.0, 0.2, 0.8).reshape(2, 2), atol=1e-12)
    r = sampler.distributions(_p(0.5, 0.5), torch.Generator().manual_seed(0))
    assert torch.equal(r, torch.eye(2, dtype=torch.float64))


def test_one_client_of_weight_is_a_group_of_its_own():
    """``groups`` of weights with a single positive entry: that client alone (Ward's tree
    needs two; through ``distributions`` the fractional masses left always come two or
    more at a time); two clients merge while their weight is at most 1/m."""
    sampler = SimilarityClusteredSampler(2)
    sampler.observe((0, 1, 2), torch.eye(3), 3)
    assert sampler.groups(_p(0.0, 0.3, 0.0)) == [[1]]
    assert sampler.groups(_p(0.0, 0.3, 0.2)) == [[1, 2]]  # 0.3 + 0.2 ≤ 1/m: one subtree
    assert sampler.groups(_p(0.0, 0.3, 0.3)) == [[1], [2]]  # 0.6 > 1/m: two


def test_fixed_clusters_keep_their_own_copy_of_the_lists():
    clusters = [[0, 2], [1, 3]]
    sampler = FixedClustersSampler(clusters)
    clusters[0].append(1)
    assert sampler.clusters == [[0, 2], [1, 3]]
    part = sampler.sample(0, 0, _p(0.25, 0.25, 0.25, 0.25))
    assert sorted(c % 2 for c in part.clients) == [0, 1]


def test_uniform_sampler_refusal_names_the_count():
    with pytest.raises(ValueError, match="clients_per_round=3 but only 2 clients"):
        UniformSampler(3).check(2)


@pytest.mark.filterwarnings("ignore:The symmetric non-negative hollow observation matrix")
def test_ward_on_the_distances_by_hand_and_the_authors_rows_as_observations():
    """One-dimensional updates 0, 1, 4, 8 (L1: ρ = |x − y|), equal weights, m = 2: Ward on
    these distances merges 0 and 1 (distance 1), then 4 and 8 (√(2·1·1/2)·4 = 4) before
    {0, 1} and 4 (√(2·2·1/3)·3.5 ≈ 4.04): two groups of weight 1/2. The authors' code
    hands Ward the square matrix, whose rows it takes for points, and splits 4 from 8."""
    groups = []
    for authors_linkage in (False, True):
        sampler = SimilarityClusteredSampler(2, similarity="L1", authors_linkage=authors_linkage)
        sampler.observe((0, 1, 2, 3), torch.tensor([[0.0], [1.0], [4.0], [8.0]]), 4)
        groups.append(sorted(map(sorted, sampler.groups(_p(0.25, 0.25, 0.25, 0.25)))))
    assert groups == [[[0, 1], [2, 3]], [[0, 1], [2], [3]]]


def test_the_leftover_order_without_a_generator_is_seed_zeros():
    """``distributions(p)`` without a generator pours the leftover group in the order of a
    generator seeded 0 (the sampler's draws pass their round's own): test_samplers'
    example, where seeds 0 and 1 order clients 4 and 5 differently."""
    p = _p(0.2, 0.15, 0.25, 0.1, 0.2, 0.1)
    axes = torch.tensor([0, 0, 1, 1, 2, 3])
    updates = torch.nn.functional.one_hot(axes, 4).float()
    updates += 0.01 * torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    sampler = SimilarityClusteredSampler(2)
    sampler.observe(tuple(range(6)), updates, 6)
    seeded = [sampler.distributions(p, torch.Generator().manual_seed(s)) for s in (0, 1)]
    assert not torch.equal(seeded[0], seeded[1])
    assert torch.equal(sampler.distributions(p), seeded[0])


def test_leftover_clients_pour_into_the_emptiest_distributions_in_turn():
    """m = 3, five clients each a group of its own (no two weigh ≤ 1/3 together): the
    three heaviest (m·p = 0.7, 0.65, 0.6) open the distributions, with room for 0.3,
    0.35 and 0.4. The leftovers go lightest first into the emptiest first: client 3 (0.47)
    fills 0.4 beside client 2 and puts 0.07 beside client 1; client 4 (0.58) fills the
    0.28 left there, then 0.3 beside client 0."""
    masses = (0.7, 0.65, 0.6, 0.47, 0.58)
    sampler = SimilarityClusteredSampler(3)
    sampler.observe(tuple(range(5)), torch.eye(5), 5)
    r = sampler.distributions(_p(*(x / 3 for x in masses)), torch.Generator().manual_seed(0))
    expected = [[0.7, 0, 0, 0, 0.3], [0, 0.65, 0, 0.07, 0.28], [0, 0, 0.6, 0.4, 0]]
    assert torch.allclose(r, torch.tensor(expected, dtype=torch.float64), atol=1e-12)


def test_the_last_distribution_takes_the_crumbs_of_a_distribution_filled_within_tolerance():
    """m = 3, masses m·p = 0.8 (clients 0-2) and 0.2 − 3·10⁻¹³, 0.2, 0.2 + 3·10⁻¹³ (clients
    3-5, close updates: one leftover group), poured in seed 3's order 4, 3, 5. Client 4
    fills client 0's distribution; client 3 ends 3·10⁻¹³ short of full in client 1's,
    within the 10⁻¹² tolerance, so it counts as full; client 5 fills client 2's with 0.2,
    and the 3·10⁻¹³ left, with no distribution open, goes to the last one (client 2's,
    not the middle one). Each row is then normalized."""
    d = 3e-13
    sampler = SimilarityClusteredSampler(3)
    updates = torch.zeros(6, 4)
    updates[:3, :3] = torch.eye(3)
    updates[3:, 3] = torch.tensor([1.0, 1.01, 1.02])
    sampler.observe(tuple(range(6)), updates, 6)
    p = torch.tensor([0.8, 0.8, 0.8, 0.2 - d, 0.2, 0.2 + d], dtype=torch.float64) / 3
    r = sampler.distributions(p, torch.Generator().manual_seed(3))
    expected = torch.tensor([[0.8, 0, 0, 0, 0.2, 0], [0, 0.8, 0, 0.2 - d, 0, 0],
                             [0, 0, 0.8, 0, 0, 0.2 + d]], dtype=torch.float64)  # fmt: skip
    expected /= expected.sum(dim=1, keepdim=True)
    assert torch.allclose(r, expected, rtol=0, atol=1e-15)
    assert r[2, 5] - 0.2 > 2e-13  # the crumbs are there


def test_sample_size_clusters_pour_a_single_unit():
    """m = 1, p = (1/3, 2/3): capacity 3, client 0 holds one unit, which is poured."""
    r = SampleSizeClusteredSampler(1).distributions(_p(1 / 3, 2 / 3))
    assert torch.allclose(r, _p(1 / 3, 2 / 3).reshape(1, 2), atol=1e-15)


def test_exact_masses_only_while_the_capacity_stays_below_10_to_the_15():
    """Pairs summing to 1/3 over the primes a, b, c near 10⁵: exact fractions, but their
    common capacity 3abc ≈ 3·10¹⁵ is past the exact path's bound, so the masses are
    ``units`` per distribution, rounded by largest remainders."""
    from lightning_fl.systems.samplers import _integer_masses

    a, b, c = 100003, 100019, 100043
    p = _p(1 / a, 1 / 3 - 1 / a, 1 / b, 1 / 3 - 1 / b, 1 / c, 1 / 3 - 1 / c)
    masses, capacity = _integer_masses(p, 2, 10)
    assert capacity == 10 and sum(masses) == 20
    # shares 20·p: 0.0002, 6.66647, 0.0002, 6.66648, 0.0002, 6.66649, floored to 18 units:
    # the 2 left go to the largest remainders, clients 5 and 3 (1/c < 1/b < 1/a)
    assert masses == [0, 6, 0, 7, 0, 7]


def test_target_weights_below_one_are_refused_too():
    with pytest.raises(ValueError, match="Target weights p must sum to 1, got 0.9"):
        ExcludedClients(FullParticipation(), [0]).sample(0, 0, _p(0.5, 0.4))


def test_sample_size_clusters_fill_three_distributions_in_order_by_hand():
    """p = (0.1, 0.4, 0.2, 0.3), m = 3: capacity 10, masses 3, 12, 6, 9 units poured in the
    order clients 1, 3, 2, 0: {1: 10} | {1: 2, 3: 8} | {3: 1, 2: 6, 0: 3}."""
    r = SampleSizeClusteredSampler(3).distributions(_p(0.1, 0.4, 0.2, 0.3))
    expected = [[0, 1, 0, 0], [0, 0.2, 0, 0.8], [0.3, 0, 0.6, 0.1]]
    assert torch.allclose(r, torch.tensor(expected, dtype=torch.float64), atol=1e-15)
