"""Robust aggregators (issue 69): each rule equals a brute-force reference on updates with
ties, outliers and unequal weights, and through the strategy the server step equals the
rule applied to the round's received updates, sequential and vectorized, over 3 rounds of
a sampled federation of unequal clients; the attacks corrupt exactly their clients."""

from __future__ import annotations

import itertools
import tempfile

import numpy as np
import pytest
import torch

from lightning_fl import UniformSampler
from lightning_fl.callbacks import (
    CenteredClipping,
    CoordinateMedian,
    FedAvg,
    GaussianUpdates,
    Krum,
    ScaledUpdates,
    SignFlipping,
    TrimmedMean,
)
from lightning_fl.callbacks.attacks import attackers
from lightning_fl.engine.plugins import FederatedCallback
from lightning_fl.engine.seeding import generator
from lightning_fl.engine.tensors import flatten
from lightning_fl.systems.robust import (
    centered_clipping,
    coordinate_median,
    krum_scores,
    krum_select,
    trimmed_mean,
)
from tests import composition

# updates with ties (rows 1 and 4 share coordinates, rows 2 and 3 are equal), an outlier
# (row 5) and unequal weights
UPDATES = torch.tensor(
    [
        [0.5, -1.0, 2.0, 0.0],
        [1.0, 0.5, -0.5, 1.0],
        [0.2, 0.3, 0.1, -0.2],
        [0.2, 0.3, 0.1, -0.2],
        [1.0, 0.5, 0.7, 1.0],
        [40.0, -30.0, 25.0, 90.0],
        [-0.4, 0.1, 0.3, 0.6],
    ],
    dtype=torch.float64,
)
WEIGHTS = torch.tensor([0.05, 0.3, 0.1, 0.1, 0.25, 0.15, 0.05], dtype=torch.float64)


def brute_median(values: list[float], weights: list[float]) -> float:
    """The midpoint of the minimizers of Σ w_i |x − v_i| (a convex piecewise-linear
    function: its minimizers form an interval between two data points)."""
    cost = [sum(w * abs(x - v) for v, w in zip(values, weights)) for x in values]
    best = min(cost)
    minimizers = [x for x, c in zip(values, cost) if c <= best + 1e-12]
    return (min(minimizers) + max(minimizers)) / 2


def brute_trimmed(values: list[float], weights: list[float], beta: float) -> float:
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    b = int(beta * len(values))
    kept = order[b : len(values) - b]
    return sum(values[i] * weights[i] for i in kept) / sum(weights[i] for i in kept)


def brute_krum(rows: list[list[float]], f: int) -> list[float]:
    k = len(rows)
    scores = []
    for i in range(k):
        distances = sorted(
            sum((a - b) ** 2 for a, b in zip(rows[i], rows[j])) for j in range(k) if j != i
        )
        scores.append(sum(distances[: k - f - 2]))
    return scores


@pytest.mark.parametrize("weights", [WEIGHTS, torch.ones(7, dtype=torch.float64)])
def test_coordinate_median_is_the_minimizer_of_the_weighted_absolute_deviation(weights):
    got = coordinate_median(UPDATES, weights)
    for j in range(UPDATES.shape[1]):
        column = UPDATES[:, j].tolist()
        expected = brute_median(column, (weights / weights.sum()).tolist())
        assert float(got[j]) == pytest.approx(expected, abs=1e-12), j


def test_median_of_an_even_count_with_equal_weights_is_the_mean_of_the_middle_two():
    rows = UPDATES[:6]
    got = coordinate_median(rows, torch.ones(6, dtype=torch.float64))
    assert got.tolist() == pytest.approx(np.median(rows.numpy(), axis=0).tolist(), abs=1e-15)


def test_median_interval_rule_with_weights_of_exactly_one_half():
    rows = torch.tensor([[0.0], [1.0], [10.0]], dtype=torch.float64)
    weights = torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64)
    assert float(coordinate_median(rows, weights)) == 5.5  # any x in [1, 10] minimizes
    assert float(coordinate_median(rows, torch.tensor([1.0, 1.5, 2.0]).double())) == 1.0


@pytest.mark.parametrize("beta", [0.0, 0.15, 0.3, 0.49])
def test_trimmed_mean_equals_the_sorted_reference_with_ties(beta):
    got = trimmed_mean(UPDATES, WEIGHTS, beta)
    for j in range(UPDATES.shape[1]):
        expected = brute_trimmed(UPDATES[:, j].tolist(), WEIGHTS.tolist(), beta)
        assert float(got[j]) == pytest.approx(expected, abs=1e-12), (beta, j)
    with pytest.raises(ValueError, match="beta must be in"):
        trimmed_mean(UPDATES, WEIGHTS, 0.5)


@pytest.mark.parametrize("f", [0, 1, 2])
def test_krum_scores_and_choice_match_brute_force_scoring(f):
    rows = UPDATES.tolist()
    expected = brute_krum(rows, f)
    assert krum_scores(UPDATES, f).tolist() == pytest.approx(expected, rel=1e-12)
    order = sorted(range(len(rows)), key=lambda i: (expected[i], i))
    for m in (1, 3):
        assert krum_select(UPDATES, f, m).tolist() == order[:m], (f, m)
    assert 5 not in order[:3]  # the outlier is never chosen
    # rows 2 and 3 are equal: a tie, broken toward the lower row
    assert order.index(2) < order.index(3) or expected[2] != expected[3]


def test_krum_refuses_rounds_of_2f_plus_2_updates_or_fewer():
    with pytest.raises(ValueError, match=r"more than 2f \+ 2 = 6 updates in a round"):
        krum_scores(UPDATES[:6], 2)
    assert krum_scores(UPDATES, 2).shape == (7,)  # 7 > 6


def test_centered_clipping_equals_the_iterated_reference():
    """With weights summing to 3: the rule normalizes them."""
    tau, center = 1.5, torch.tensor([0.1, 0.0, -0.1, 0.2], dtype=torch.float64)
    w = (WEIGHTS / WEIGHTS.sum()).tolist()
    weights = 3 * WEIGHTS
    v = center.tolist()
    for _ in range(3):
        step = [0.0] * 4
        for i, row in enumerate(UPDATES.tolist()):
            offset = [a - b for a, b in zip(row, v)]
            norm = sum(o * o for o in offset) ** 0.5
            scale = min(1.0, tau / norm)
            step = [s + w[i] * scale * o for s, o in zip(step, offset)]
        v = [a + s for a, s in zip(v, step)]
    got = centered_clipping(UPDATES, weights, center, tau, iterations=3)
    assert got.tolist() == pytest.approx(v, abs=1e-12)
    one = centered_clipping(UPDATES, weights, center, tau, iterations=1)
    assert not torch.allclose(one, got)  # the iterations matter here
    for bad in ({"tau": 0.0, "iterations": 1}, {"tau": 1.0, "iterations": 0}):
        with pytest.raises(ValueError, match="tau must be > 0 and iterations >= 1"):
            centered_clipping(UPDATES, weights, center, **bad)


def test_weights_must_be_nonnegative_with_a_positive_sum():
    for bad in (torch.tensor([0.5, -0.1, 0.6]), torch.zeros(3)):
        with pytest.raises(ValueError, match="weights >= 0 with a positive sum"):
            coordinate_median(UPDATES[:3], bad.double())
    with pytest.raises(ValueError, match=r"num_selected must be in \[1, 7\]"):
        krum_select(UPDATES, 1, 0)
    with pytest.raises(ValueError, match=r"num_selected must be in \[1, 7\]"):
        krum_select(UPDATES, 1, 8)


def test_a_client_with_more_than_half_the_weight_is_the_median():
    """The largest value holds 0.8 of the weight: it is the median of every coordinate
    (the first sorted position reaching 1/2 is the last one)."""
    rows = torch.tensor([[0.0, 5.0], [1.0, 6.0], [9.0, 7.0]], dtype=torch.float64)
    weights = torch.tensor([0.1, 0.1, 0.8], dtype=torch.float64)
    assert coordinate_median(rows, weights).tolist() == [9.0, 7.0]


# ---- through the strategy ---------------------------------------------------------------


class Recorder(FederatedCallback):
    """θ^t, each client's update as its transform sees it, ω, and θ^{t+1}, every round."""

    supports_vectorized_clients = True

    def __init__(self) -> None:
        self.rounds: list[dict] = []

    def on_round_start(self, trainer, pl_module, state) -> None:
        part = state.participation
        start = flatten(state.global_tensors).double().cpu().clone()
        weights = dict(zip(part.clients, part.weights))
        self.rounds.append({"start": start, "raw": {}, "weights": weights})

    def transform_update(self, trainer, pl_module, client, update, state):
        self.rounds[-1]["raw"][client] = flatten(update).double().cpu().clone()
        return update

    def on_round_end(self, trainer, pl_module, state) -> None:
        self.rounds[-1]["end"] = flatten(state.global_tensors).double().cpu().clone()


def fit(callbacks: list, sampler=None, rounds: int = 3, vectorize: bool = False, **strategy):
    setup = composition.Setup(sampler=sampler, callbacks=list(callbacks))
    setup.strategy.update(strategy, vectorize=vectorize)
    with tempfile.TemporaryDirectory() as root:
        trainer = composition._trainer(setup, rounds, root, [])
        trainer.fit(setup.module(), datamodule=setup.datamodule())
    return trainer


def _step(round_: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    clients = sorted(round_["raw"])
    rows = torch.stack([round_["raw"][c] for c in clients])
    weights = torch.tensor([round_["weights"][c] for c in clients], dtype=torch.float64)
    return rows, weights, round_["end"] - round_["start"]


AGGREGATORS = {
    "median": (lambda: CoordinateMedian(server_lr=0.7),
               lambda rows, w, _: 0.7 * coordinate_median(rows, w)),
    "trimmed": (lambda: TrimmedMean(beta=0.25), lambda rows, w, _: trimmed_mean(rows, w, 0.25)),
    "multi_krum": (lambda: Krum(num_byzantine=0, num_selected=2),
                   lambda rows, w, _: (w[krum_select(rows, 0, 2)] / w[krum_select(rows, 0, 2)]
                                       .sum()) @ rows[krum_select(rows, 0, 2)]),
}  # fmt: skip


@pytest.mark.parametrize("vectorize", [False, True])
@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_the_server_step_is_the_rule_of_the_rounds_updates_and_weights(name, vectorize):
    make, rule = AGGREGATORS[name]
    recorder = Recorder()
    fit([make(), recorder], UniformSampler(4), rounds=3, vectorize=vectorize)
    assert len(recorder.rounds) == 3
    for t, round_ in enumerate(recorder.rounds):
        rows, weights, step = _step(round_)
        assert len(set(weights.tolist())) > 1  # unequal weights
        assert torch.allclose(step, rule(rows, weights, t), atol=2e-6), (name, t)
        mean = weights @ rows
        assert (step - mean).abs().max() > 1e-4  # not FedAvg's weighted sum


def test_centered_clipping_starts_each_round_from_the_last_aggregate():
    recorder = Recorder()
    fit([CenteredClipping(tau=0.05, iterations=2), recorder], UniformSampler(4), rounds=3)
    center = torch.zeros_like(recorder.rounds[0]["start"])
    for t, round_ in enumerate(recorder.rounds):
        rows, weights, step = _step(round_)
        center = centered_clipping(rows, weights, center, 0.05, 2)
        assert torch.allclose(step, center, atol=2e-6), t


def test_krum_discards_a_sign_flipping_attacker_that_fedavg_follows():
    recorder = Recorder()
    krum = Krum(num_byzantine=1)
    flip = SignFlipping(fraction=1 / 6, scale=5.0, seed=3)
    fit([krum, flip, recorder], rounds=3)
    (attacker,) = flip.attackers
    for round_ in recorder.rounds:
        rows, _, step = _step(round_)
        scores = brute_krum(rows.tolist(), 1)
        best = min(range(len(scores)), key=lambda i: (scores[i], i))
        assert torch.allclose(step, rows[best], atol=2e-6)
    assert attacker not in krum.selected


# ---- attacks ---------------------------------------------------------------------------


@pytest.mark.parametrize(("fraction", "count"), [(0.0, 0), (0.34, 2), (0.5, 3), (1.0, 6)])
def test_attackers_are_the_floor_of_the_fraction_and_fixed_by_the_seed(fraction, count):
    chosen = attackers(6, fraction, seed=4)
    assert len(chosen) == count and chosen == attackers(6, fraction, seed=4)
    assert chosen <= set(range(6))
    assert attackers(1000, 0.1, 1) != attackers(1000, 0.1, 2)


@pytest.mark.parametrize(
    ("attack", "corrupt"),
    [
        (lambda: SignFlipping(0.5, scale=2.0, seed=1), lambda u, c: -2.0 * u),
        (lambda: ScaledUpdates(0.5, scale=7.0, seed=1), lambda u, c: 7.0 * u),
        (lambda: GaussianUpdates(0.5, std=0.3, seed=1), lambda u, c: 0.3 * torch.randn(
            len(u), generator=generator(1, "byzantine_gaussian", 0, c), dtype=torch.float64)),
    ],
)  # fmt: skip
def test_an_attacker_sends_its_corruption_and_the_others_their_honest_update(attack, corrupt):
    """In round 0 every client starts from the same θ^0 with or without the attack: the
    honest updates are those of the run without it."""
    honest, seen = Recorder(), Recorder()
    fit([FedAvg(), honest], rounds=1)
    plugin = attack()
    fit([FedAvg(), plugin, seen], rounds=1)
    assert len(plugin.attackers) == 3 and sorted(plugin.attacked) == sorted(plugin.attackers)
    for client, update in honest.rounds[0]["raw"].items():
        sent = seen.rounds[0]["raw"][client]
        expected = corrupt(update, client) if client in plugin.attackers else update
        assert torch.allclose(sent, expected, atol=1e-6), client


def test_robust_aggregators_refuse_plugins_that_add_to_the_update_sum():
    from lightning_fl.callbacks import FreeRiders
    from lightning_fl.engine.composition import CompositionError

    for aggregator, other in itertools.product(
        (CoordinateMedian(), TrimmedMean(), Krum(0), CenteredClipping()), (FreeRiders(1),)
    ):
        with pytest.raises(CompositionError, match="never reads the round.s update sum"):
            fit([aggregator, other], rounds=1)
    with pytest.raises(CompositionError, match="Krum cannot be combined with MDSampler"):
        from lightning_fl import MDSampler

        fit([Krum(0)], MDSampler(3), rounds=1)
