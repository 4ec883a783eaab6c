"""Data-stream building blocks: cache rules (FIFO, SRSR, DRSR), the discrepancy, the
weighted minibatch gradient and the configuration rule of the data-streams analysis."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fl.systems.streams import (
    CurrentBatchCache,
    FIFOCache,
    FixedCache,
    SelectiveReplacementCache,
    aggregation_weights,
    configuration_objective,
    configuration_rule,
    discrepancy,
    estimate_ratio,
    project_simplex,
    weighted_minibatch_coefficients,
)


def _batches(rounds, size, num_classes, seed=0):
    rng = np.random.default_rng(seed)
    start = 0
    for _ in range(rounds):
        labels = rng.integers(0, num_classes, size)
        yield np.arange(start, start + size), labels
        start += size


def test_fifo_with_capacity_of_one_batch_is_the_current_batch_only():
    fifo, current = FIFOCache(5), CurrentBatchCache(5)
    rng = np.random.default_rng(0)
    for ids, labels in _batches(6, 5, 3):
        fifo.update(ids, labels, rng)
        current.update(ids, labels, rng)
        assert fifo.ids.tolist() == current.ids.tolist() == ids.tolist()


def test_fifo_keeps_the_last_m_batches_and_fixed_never_changes():
    fifo, fixed = FIFOCache(6), FixedCache(6)
    rng = np.random.default_rng(0)
    batches = list(_batches(5, 3, 3))
    for ids, labels in batches:
        fifo.update(ids, labels, rng)
        fixed.update(ids, labels, rng)
    assert fifo.ids.tolist() == list(range(9, 15))  # the last two batches
    assert fixed.ids.tolist() == [0, 1, 2, 3, 4, 5]  # the first batches, then frozen


def test_srsr_hits_its_label_targets_case_by_case():
    """B = 6, B_s = 3, θ = 1: ñ_r = (1 − 1/2)·n_r(L) + n_r(S)."""
    cache = SelectiveReplacementCache(6, theta=1.0)
    rng = np.random.default_rng(1)
    cache.update([0, 1, 2], [0, 0, 1], rng)
    cache.update([3, 4, 5], [0, 1, 1], rng)  # filling: labels (0,0,1,0,1,1)
    cache.update([6, 7, 8], [2, 2, 0], rng)
    # n(L) = (3, 3, 0), n(S) = (1, 0, 2): targets (2.5, 1.5, 2) → (3, 1, 2) or (2, 2, 2)
    counts = np.bincount(cache.labels, minlength=3)
    assert counts.tolist() in ([3, 1, 2], [2, 2, 2])
    assert set(cache.ids[cache.labels == 2].tolist()) == {6, 7}  # Case 1 keeps batch samples
    assert 8 in cache.ids  # Case 2 inserts all of the batch's label-0 samples
    # Exactly, label by label (filling drew nothing): the targets round to (3, 1, 2);
    # label 0 keeps 2 of its 3 cached and its 1 new (Case 2), label 1 keeps 1 of 3
    # (Case 2), label 2's target equals its 2 new samples: Case 1, a draw of both
    rng = np.random.default_rng(1)
    expected = [
        *rng.choice([0, 1, 3], 2, replace=False),
        8,
        *rng.choice([2, 4, 5], 1, replace=False),
        *rng.choice([6, 7], 2, replace=False),
    ]
    assert cache.ids.tolist() == expected and cache.labels.tolist() == [0, 0, 0, 1, 2, 2]


def test_drsr_keeps_what_it_has_of_a_label_whose_target_exceeds_its_samples():
    """C = 3, one sample a round, labels 1, 1, 1, 2, 0, 2 (DRSR): label 0's sample is
    dropped in round 4, and in round 5 the targets (0.5, 1.5, 1) round to one sample of
    each label; label 0 has none cached and none new, so it keeps nothing (Case 2 drops
    no cached sample below zero), and the cache holds one sample of label 1 and the new
    label-2 sample: 2 samples, below its capacity."""
    cache = SelectiveReplacementCache(3, theta=None)
    rng = np.random.default_rng(1)
    for t, label in enumerate([1, 1, 1, 2, 0, 2]):
        cache.update([t], [label], rng)
    assert cache.targets == pytest.approx({0: 0.5, 1: 1.5, 2: 1.0})
    assert cache.labels.tolist() == [1, 2] and cache.ids[1] == 5 and cache.ids[0] in (0, 1)


def test_srsr_with_theta_zero_keeps_the_label_counts_of_a_full_cache():
    """θ = 0: ñ_r = n_r(L), so the label counts never change (Case 1 may still swap a
    cached sample for a batch sample of the same label)."""
    cache = SelectiveReplacementCache(4, theta=0.0)
    rng = np.random.default_rng(0)
    batches = list(_batches(6, 2, 3, seed=2))
    for k, (ids, labels) in enumerate(batches):
        cache.update(ids, labels, rng)
        if k == 1:
            full = np.bincount(cache.labels, minlength=3).tolist()
    assert np.bincount(cache.labels, minlength=3).tolist() == full


def test_drsr_cache_tracks_the_running_average_of_the_batches():
    """θ_t = B/(B_s t): v_t = (1/t) Σ_τ u_τ, up to the rounding of the targets."""
    capacity, batch = 24, 6
    cache = SelectiveReplacementCache(capacity, theta=None)
    rng = np.random.default_rng(0)
    pattern = [[0] * 6, [1] * 6, [0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    history = []
    for t in range(8):
        labels = np.array(pattern[t % 4])
        history.append(np.bincount(labels, minlength=2) / batch)
        cache.update(np.arange(t * batch, (t + 1) * batch), labels, rng)
        expected = np.mean(history, axis=0)
        assert cache.label_distribution(2) == pytest.approx(expected, abs=2 / capacity)
        assert len(cache.ids) == min(capacity, batch * (t + 1))


def test_drsr_follows_the_running_average_over_hundreds_of_rounds_with_a_small_cache():
    """C = 24, B_s = 6, a stream whose label-0 share is 0.9 for 150 rounds and then 0.1:
    the cache's share stays within one sample of the running average of the batches at
    every round (rounding the recursion itself froze it near 0.54 after 40 rounds)."""
    capacity, batch, rounds = 24, 6, 300
    cache = SelectiveReplacementCache(capacity, theta=None)
    rng = np.random.default_rng(5)
    seen = np.zeros(2)
    worst = 0.0
    for t in range(rounds):
        share = 0.9 if t < rounds // 2 else 0.1
        labels = (rng.random(batch) >= share).astype(np.int64)
        seen += np.bincount(labels, minlength=2)
        cache.update(np.arange(t * batch, (t + 1) * batch), labels, rng)
        running = seen[0] / seen.sum()
        worst = max(worst, abs(cache.label_distribution(2)[0] - running))
    assert worst <= 1 / capacity + 1e-12, worst
    assert abs(cache.label_distribution(2)[0] - 0.5) < 0.1  # it moved with the stream
    assert cache.targets[0] / capacity == pytest.approx(seen[0] / seen.sum(), abs=1e-9)


def test_drsr_discrepancy_falls_below_fifos_on_a_non_stationary_stream():
    rng = np.random.default_rng(3)
    target = np.array([0.5, 0.5])
    caches = {"fifo": FIFOCache(20), "drsr": SelectiveReplacementCache(20, theta=None)}
    totals = dict.fromkeys(caches, 0.0)
    start = 0
    for t in range(200):
        p = [0.9, 0.1] if (t // 5) % 2 == 0 else [0.1, 0.9]  # short-term drift, mean π
        labels = rng.choice(2, size=10, p=p)
        for name, cache in caches.items():
            cache.update(np.arange(start, start + 10), labels, rng)
            if t >= 100:
                totals[name] += discrepancy(cache.label_distribution(2)[None], target[None])
        start += 10
    assert totals["drsr"] < totals["fifo"]


def test_discrepancy_formula():
    v = np.array([[0.2, 0.8], [0.5, 0.5]])
    pi = np.array([[0.5, 0.5], [0.5, 0.5]])
    assert discrepancy(v, pi) == pytest.approx(0.09 + 0.09)


def test_weighted_minibatch_gradient_is_unbiased():
    """E_ξ[Σ_{j∈ξ} c_j ∇ℓ_j] = Σ_j (λ_j/Σλ) ∇ℓ_j for ξ uniform without replacement."""
    rng = np.random.default_rng(0)
    weights = rng.uniform(0, 2, 12)
    grads = rng.normal(size=12)
    expected = float(weights @ grads / weights.sum())
    draws = []
    for _ in range(20000):
        chosen = rng.choice(12, size=4, replace=False)
        draws.append(float(weighted_minibatch_coefficients(weights, chosen) @ grads[chosen]))
    assert np.mean(draws) == pytest.approx(expected, abs=0.015)
    assert aggregation_weights([1.0, 3.0]).tolist() == [0.25, 0.75]
    with pytest.raises(ValueError, match="λ must be >= 0"):
        weighted_minibatch_coefficients(np.array([1.0, -1.0]), np.array([0]))


def test_projection_onto_the_simplex():
    rng = np.random.default_rng(1)
    for _ in range(50):
        v = rng.normal(size=7)
        p = project_simplex(v)
        assert p.sum() == pytest.approx(1.0) and (p >= 0).all()
        for _ in range(20):  # no simplex point is closer
            q = project_simplex(rng.normal(size=7))
            assert np.linalg.norm(v - p) <= np.linalg.norm(v - q) + 1e-12


def test_configuration_rule_moves_from_historical_to_uniform_with_r():
    """P1 App. C: r ≪ 1 gives Historical (p_hist = 1), r ≫ 1 gives Uniform (p = n)."""
    n = np.array([0.2 / 10] * 10 + [0.8 / 40] * 40)  # N_hist/N = 20%
    fresh = np.arange(50) >= 10
    historical = configuration_rule(n, fresh, 1e-3, steps=4000)
    assert historical[~fresh].sum() == pytest.approx(1.0, abs=1e-3)
    uniform = configuration_rule(n, fresh, 1e3, steps=4000)
    assert uniform == pytest.approx(n, abs=2e-3)
    middle = configuration_rule(n, fresh, 1.0, steps=4000)
    assert 0.2 < middle[~fresh].sum() < 1.0
    for p in (historical, uniform, middle):  # never worse than Uniform or Historical
        r = {id(historical): 1e-3, id(uniform): 1e3, id(middle): 1.0}[id(p)]
        hist = np.where(fresh, 0.0, n / n[~fresh].sum())
        best_known = min(configuration_objective(n, n, fresh, r),
                         configuration_objective(hist, n, fresh, r))  # fmt: skip
        assert configuration_objective(p, n, fresh, r) <= best_known + 1e-6


@pytest.mark.parametrize("r, steps", [(0.3, 6), (4.0, 6), (0.01, 200)])
def test_configuration_rule_is_its_projected_subgradient_descent_by_hand(r, steps):
    """Every iterate by hand: from p = n, steps of length 0.05/(max(1, r)·√k) along the
    normalized subgradient of sqrt(Σ_fresh p²) + r·sqrt(Σ p²/n) (its first term left out
    while the fresh weights are all 0), projected on the simplex, keeping the best
    iterate. At r = 0.01 the fresh weights reach 0 and the best iterate is the 199th of
    200; r = 4 takes steps 4 times shorter than r = 0.3."""
    n = np.array([5.0, 1.0, 3.0, 8.0, 3.0]) / 20
    fresh = np.array([False, False, True, True, True])

    def objective(p):
        return math.sqrt(np.sum(p[fresh] ** 2)) + r * math.sqrt(np.sum(p**2 / n))

    p = best = n.copy()
    best_k, without_fresh = 0, 0
    for k in range(1, steps + 1):
        g = r * (p / n) / math.sqrt(np.sum(p**2 / n))
        fresh_norm = math.sqrt(np.sum(p[fresh] ** 2))
        if fresh_norm > 0:
            g[fresh] += p[fresh] / fresh_norm
        else:
            without_fresh += 1
        p = project_simplex(p - 0.05 / (max(1.0, r) * math.sqrt(k)) * g / np.linalg.norm(g))
        if objective(p) < objective(best):
            best, best_k = p.copy(), k
    assert configuration_rule(n, fresh, r, steps=steps) == pytest.approx(best, abs=1e-12)
    assert (best_k, without_fresh > 0) == ((199, True) if r == 0.01 else (steps, False))


def test_equation_204_reproduces_the_papers_femnist_and_shakespeare_ratios():
    """Table 3's inputs (D, G, B, d), N and the fresh clients (80% of 3,597 and 916)."""
    femnist = estimate_ratio(3.5, 12.9, 5.9, 867_390, 817_851, round(0.8 * 3597))
    shakespeare = estimate_ratio(6.1, 1.4, 2.6, 226_180, 3_436_096, round(0.8 * 916))
    assert femnist == pytest.approx(0.001, abs=2e-4)
    assert shakespeare == pytest.approx(0.064, abs=1e-3)


def test_bad_stream_settings_are_refused():
    with pytest.raises(ValueError, match="does not fit a cache of 4"):
        FIFOCache(4).update(np.arange(5), np.zeros(5, dtype=int), np.random.default_rng())
    with pytest.raises(ValueError, match=r"theta must be in \[0, 1\]"):
        SelectiveReplacementCache(10, theta=1.5)
    with pytest.raises(ValueError, match="r = c2/c1 must be > 0"):
        configuration_rule(np.array([0.5, 0.5]), np.array([False, True]), 0.0)
    for shares, flags in (([3.0, 1.0], [False, True]), ([1.0, 0.0], [False, True]),
                          ([0.5, 0.5], [False, True, True])):  # fmt: skip
        with pytest.raises(ValueError, match="pass counts / counts.sum()"):
            configuration_rule(np.array(shares), np.array(flags), 1.0, steps=5)
    configuration_rule(np.array([0.25, 0.75]), np.array([False, True]), 1.0, steps=5)


# ---- the streaming datamodule and P1's weights ------------------------------------------


def _stream_dm(cache="current", capacity=None, rounds=6, **kw):
    from lightning_fl.datamodules import LogisticStreamsDataModule, StreamingDataModule

    source = LogisticStreamsDataModule(num_clients=6, historical=2, historical_samples=30,
                                       fresh_samples=30, test_samples=10, seed=1)  # fmt: skip
    return StreamingDataModule(source, historical=2, rate=5, cache=cache, capacity=capacity,
                               rounds=rounds, **kw)  # fmt: skip


@pytest.mark.parametrize("cache", ["fifo", "drsr", "srsr"])
def test_a_stream_that_runs_out_warns_once_and_every_fresh_client_keeps_its_cache(cache):
    """30 fresh samples at 5 a round last rounds 0-5: from round 6 on, every fresh client
    keeps its round-5 cache of 10, and one warning names the first client and round;
    rounds 6 and 7 add no other."""
    import warnings

    dm = _stream_dm(cache=cache, capacity=10, rounds=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(6):
            dm.set_round(t)
        assert not caught
        at_five = {c: dm.cache_ids(c).tolist() for c in range(2, 6)}
        assert all(len(ids) == 10 for ids in at_five.values())
        dm.set_round(6)
        dm.set_round(7)
    assert [str(w.message) for w in caught] == [
        "Client 2's stream ran out at round 6: it keeps its cache. Lower rate or rounds, "
        "or give it more data."
    ]
    assert {c: dm.cache_ids(c).tolist() for c in range(2, 6)} == at_five


def test_fresh_clients_see_each_stream_sample_once_and_historical_ones_everything():
    dm = _stream_dm()
    seen = []
    for t in range(6):
        dm.set_round(t)
        ids = dm.cache_ids(3).tolist()
        assert len(ids) == 5 and not set(ids) & set(seen)  # never seen before
        seen += ids
        assert len(dm.client_dataset(0, "train")) == 30  # historical: always all of it
    assert sorted(seen) == list(range(30))
    assert dm.sample_counts() == [30, 30, 30, 30, 30, 30]  # N_m over the horizon
    fifo = _stream_dm("fifo", capacity=10)
    for t in range(4):
        fifo.set_round(t)
    last_two = set(dm._streams[3][10:20].tolist())
    assert set(fifo.cache_ids(3).tolist()) == last_two


def test_stream_weights_follow_the_papers_strategies():
    from lightning_fl.callbacks import StreamFedAvg

    counts = [30, 30, 20, 20, 20, 20]  # historical 60 of 140
    n = np.array(counts) / 140
    weights = {}
    for name, kw in (("uniform", {}), ("historical", {}), ("fresh", {}),
                     ("fixed", {"p_hist": 0.8}), ("ours", {"ratio": 1e-4})):  # fmt: skip
        aggregator = StreamFedAvg(name, **kw)
        aggregator.historical = 2
        weights[name] = aggregator.target_weights(counts).numpy()
    assert weights["uniform"] == pytest.approx(n)
    assert weights["historical"].tolist() == pytest.approx([0.5, 0.5, 0, 0, 0, 0])
    assert weights["fresh"].tolist() == pytest.approx([0, 0, 0.25, 0.25, 0.25, 0.25])
    assert weights["fixed"][:2].sum() == pytest.approx(0.8)
    assert weights["ours"][:2].sum() == pytest.approx(1.0, abs=1e-3)  # r ≪ 1: Historical
    with pytest.raises(ValueError, match="needs p_hist in"):
        StreamFedAvg("fixed")
    with pytest.raises(ValueError, match="needs ratio r"):
        StreamFedAvg("ours", ratio=0.0)


def test_streaming_training_uses_only_the_weighted_clients_and_resumes_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_fl import MLP, BinaryClassifier, FederatedStrategy
    from lightning_fl.callbacks import StreamFedAvg
    from tests.helpers import make_trainer, max_abs_diff, params_of

    def fit(rounds, callbacks=(), ckpt=None, seed=0):
        import torch

        torch.manual_seed(seed)
        module = BinaryClassifier(MLP(20, (), 1), lr=0.1)
        trainer = make_trainer(FederatedStrategy(local_steps=2, seed=4), rounds,
                               [StreamFedAvg("historical"), *callbacks],
                               enable_checkpointing=bool(callbacks))  # fmt: skip
        trainer.fit(module, datamodule=_stream_dm(), ckpt_path=ckpt)
        return module, trainer

    full, trainer = fit(5)
    assert trainer.strategy.current_round.state.participation.clients == (0, 1)
    checkpoint = ModelCheckpoint(tmp_path, "{epoch}", save_top_k=-1, every_n_epochs=1)
    fit(2, [checkpoint])
    resumed, _ = fit(5, ckpt=str(tmp_path / "epoch=1.ckpt"), seed=9)
    assert max_abs_diff(params_of(full), params_of(resumed)) == 0.0


def test_bad_streaming_settings_are_refused():
    with pytest.raises(ValueError, match="smaller than the batch of 5 samples"):
        _stream_dm("fifo", capacity=3)
    with pytest.raises(ValueError, match="arrival rate must be >= 1"):
        from lightning_fl.datamodules import LogisticStreamsDataModule, StreamingDataModule

        StreamingDataModule(LogisticStreamsDataModule(num_clients=3, historical=1), rate=0)


def test_streaming_settings_are_accepted_at_the_ends_of_their_ranges_and_refused_past():
    """Each bound alone: rate 1, capacity = rate, historical 0 and = the number of clients,
    SRSR θ 0 and 1, fresh_rounds 1 and = rounds, drift 0 are accepted; one step past each
    is refused with its message."""
    from lightning_fl.datamodules import LogisticStreamsDataModule, StreamingDataModule

    def make(**kw):
        source = LogisticStreamsDataModule(num_clients=3, historical=1, historical_samples=8,
                                           fresh_samples=8, test_samples=2)  # fmt: skip
        return StreamingDataModule(source, **{"rounds": 4, **kw})

    for kw in (dict(rate=1), dict(rate=3, capacity=3), dict(historical=0), dict(drift=0),
               dict(cache="srsr", theta=0.0), dict(cache="srsr", theta=1.0),
               dict(fresh_rounds=1), dict(fresh_rounds=4)):  # fmt: skip
        make(**kw)
    whole = make(historical=3)
    whole.setup()
    assert whole.num_clients == 3
    refused = [
        (dict(rate=0), "arrival rate must be >= 1"),
        (dict(rate=3, capacity=2), "cache capacity 2 is smaller than the batch of 3"),
        (dict(historical=-1), "historical must be >= 0"),
        (dict(drift=-1), "drift must be >= 0"),
        (dict(cache="srsr", theta=-0.01), "SRSR theta must be in"),
        (dict(cache="srsr", theta=1.01), "SRSR theta must be in"),
        (dict(fresh_rounds=0), "fresh_rounds must be in"),
        (dict(fresh_rounds=5), "fresh_rounds must be in"),
        (dict(drift=2, drift_concentration=0.0), "drift_concentration must be > 0"),
    ]
    for kw, message in refused:
        with pytest.raises(ValueError, match=message):
            make(**kw)
    with pytest.raises(ValueError, match=r"historical must be in \[0, 3\], got 4"):
        make(historical=4).setup()


def test_an_earlier_round_replays_the_streams_and_the_source_is_prepared_and_set_up():
    """Asking for round 1 after round 3 gives every fresh client the cache a fresh module
    has at round 1 (the streams restart, then advance again); preparing and setting up
    the streaming module prepares and sets up its source."""
    from lightning_fl.datamodules import LogisticStreamsDataModule

    calls = []

    class Recorded(LogisticStreamsDataModule):
        def prepare_data(self):
            calls.append("prepare_data")
            super().prepare_data()

        def setup(self, stage=None):
            calls.append(f"setup {stage}")
            super().setup(stage)

    dm = _stream_dm("fifo", capacity=10)
    dm.source.__class__ = Recorded
    dm.prepare_data()
    dm.setup("fit")
    assert calls == ["prepare_data", "setup fit"]
    fresh = _stream_dm("fifo", capacity=10)
    for t in (0, 1, 2, 3):
        dm.set_round(t)
    dm.set_round(1)
    fresh.set_round(0)
    fresh.set_round(1)
    assert {c: dm.cache_ids(c).tolist() for c in range(2, 6)} == {
        c: fresh.cache_ids(c).tolist() for c in range(2, 6)
    }
    dm.set_round(3)
    assert dm.cache_ids(2).tolist() != fresh.cache_ids(2).tolist()  # it moved on again


def test_drifting_stream_visits_every_sample_once_with_changing_label_mixes():
    from lightning_fl.datamodules.streaming import drifting_order

    labels = np.repeat([1, 4, 7], 100)
    order = drifting_order(labels, 10, 6, np.random.default_rng(0))
    assert sorted(order.tolist()) == list(range(300))  # every sample, never twice
    mixes = np.array([np.bincount(labels[order[i : i + 6]], minlength=8)[[1, 4, 7]]
                      for i in range(0, 240, 6)])  # fmt: skip
    assert mixes.std(axis=0).max() > 1.0  # short-term distributions differ from round to round


def test_a_recycled_drifting_stream_runs_the_whole_horizon_on_its_label_draws():
    """recycle (a stationary stream of any horizon): exactly rounds·rate samples; until a
    class first runs out it is the plain stream, sample for sample; then that class
    starts again from a new permutation of its samples (each pass over it visits every
    sample once), instead of its draws going to the other classes, so a small class
    keeps its share of the rounds."""
    from lightning_fl.datamodules import LogisticStreamsDataModule, StreamingDataModule
    from lightning_fl.datamodules.streaming import drifting_order

    labels = np.repeat([1, 4, 7], [30, 100, 100])
    plain = drifting_order(labels, 10, 6, np.random.default_rng(0))
    recycled = drifting_order(labels, 10, 6, np.random.default_rng(0), length=690)
    assert len(plain) == 230 and len(recycled) == 690
    small = np.flatnonzero(labels[recycled] == 1)
    first_out = small[29]  # the draw that takes class 1's last unseen sample
    assert np.array_equal(recycled[: first_out + 1], plain[: first_out + 1])
    passes = recycled[small[: 30 * (len(small) // 30)]].reshape(-1, 30)
    assert len(passes) >= 3 and all(sorted(p) == list(range(30)) for p in passes)
    assert np.sum(labels[plain[first_out + 1 :]] == 1) == 0  # the plain stream lost it
    with pytest.raises(ValueError, match="recycle applies to drifting streams"):
        StreamingDataModule(LogisticStreamsDataModule(num_clients=3, historical=1),
                            recycle=True)  # fmt: skip


def test_drift_concentration_sets_how_far_short_term_mixes_stray():
    """Dir(α) short-term distributions: a large α keeps each round's label mix near the
    client's long-term one, a small α concentrates rounds on few classes (the rounds'
    class shares vary more); α must be positive."""
    from lightning_fl.datamodules import LogisticStreamsDataModule, StreamingDataModule
    from lightning_fl.datamodules.streaming import drifting_order

    labels = np.repeat([1, 4, 7], 2000)

    def spread(concentration):
        spreads = []
        for seed in range(5):
            order = drifting_order(labels, 10, 30, np.random.default_rng(seed), concentration)
            mixes = np.array([np.bincount(labels[order[i : i + 30]], minlength=8)[[1, 4, 7]]
                              for i in range(0, 3000, 30)])  # fmt: skip
            spreads.append(mixes.std(axis=0).mean())
        return np.mean(spreads)

    assert spread(0.5) > 1.5 * spread(20.0)
    with pytest.raises(ValueError, match="drift_concentration must be > 0"):
        StreamingDataModule(LogisticStreamsDataModule(num_clients=3, historical=1), drift=2,
                            drift_concentration=0.0)  # fmt: skip


def test_cache_rules_recipe_runs_every_rule(tmp_path):
    from pathlib import Path

    from lightning_fl.cli import run

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "streams" / "digits_cache_rules.yaml"
    for rule in ("drsr", "srsr", "fifo", "lazy"):
        cli = run(["fit", "--config", str(recipe), "--data.init_args.cache", rule,
                   "--trainer.max_epochs", "3", "--trainer.default_root_dir", str(tmp_path / rule),
                   "--trainer.logger.init_args.save_dir", str(tmp_path / rule),
                   "--trainer.enable_progress_bar", "false"])  # fmt: skip
        assert 0.0 <= float(cli.trainer.callback_metrics["test_acc"]) <= 1.0


def _logistic_module(seed=0):
    import torch

    from lightning_fl import BinaryClassifier

    torch.manual_seed(seed)
    return BinaryClassifier(torch.nn.Linear(20, 1), lr=0.1)


def _logistic_gradient(module, x, y):
    """The mean logistic loss and its gradient in closed form: X^T(σ(Xw + b) − y)/n."""
    import torch

    w, b = module.network.weight.detach()[0], module.network.bias.detach()
    z = x @ w + b
    loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y.float())
    residual = (torch.sigmoid(z) - y.float()) / len(y)
    return float(loss), torch.cat([x.T @ residual, residual.sum().reshape(1)])


@pytest.mark.filterwarnings("ignore:.*stream.*ran out")
def test_cache_discrepancy_by_hand_with_fresh_clients_of_no_and_one_sample():
    """ψ_t = Σ_k Σ_r (v_t^{k,r} − π^{k,r})² over the fresh clients, by hand from their
    cache ids after 3 rounds of FIFO caches of 4 fed 2 samples a round; fresh client 3 has
    no training data (an empty stream and cache, which add nothing) and client 4 one
    sample (its cache and its stream are that sample)."""
    from lightning_fl.datamodules import InMemoryFederatedDataModule, StreamingDataModule
    from tests.helpers import tiny_clients

    clients = tiny_clients(5)
    del clients[3]["train"]
    clients[4]["train"] = tuple(t[:1] for t in clients[4]["train"])
    source = InMemoryFederatedDataModule(clients, batch_size=4)
    dm = StreamingDataModule(source, historical=1, rate=2, cache="fifo", capacity=4, rounds=3)
    for t in range(3):
        dm.set_round(t)
    expected = 0.0
    for c, size in ((1, 4), (2, 4), (4, 1)):
        labels = clients[c]["train"][1].numpy()
        cached = labels[dm.cache_ids(c)]
        assert len(cached) == size
        v = np.bincount(cached, minlength=3) / size
        expected += float(np.sum((v - np.bincount(labels, minlength=3) / len(labels)) ** 2))
    assert len(dm.cache_ids(3)) == 0
    assert dm.cache_discrepancy(3) == pytest.approx(expected, abs=1e-12) and expected > 0


def test_estimated_constants_of_one_full_batch_step_are_loss_gradient_and_step():
    """With one full-batch step on the whole data: B̂ = L(θ¹), Ĝ = ‖∇L(θ¹)‖ and
    D̂ = lr·‖∇L(θ¹)‖, the largest over the clients."""
    import torch

    from lightning_fl.systems.streams import estimate_constants

    dm = _stream_dm()
    datasets = [dm.client_dataset(c, "train") for c in range(2)]
    module = _logistic_module()
    before = [p.detach().clone() for p in module.parameters()]
    B, G, D = estimate_constants(module, datasets, steps=1, lr=0.3, batch_size=100, fraction=1.0)
    expected = [_logistic_gradient(module, *d.tensors) for d in datasets]
    assert B == pytest.approx(max(loss for loss, _ in expected), rel=1e-5)
    assert G == pytest.approx(max(float(g.norm()) for _, g in expected), rel=1e-5)
    assert D == pytest.approx(0.3 * G, rel=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))  # restored


def test_estimated_constants_by_hand_over_seeded_subsets_and_a_one_sample_client():
    """Three minibatch steps of 2 on a seeded 30% of each historical client's samples,
    rounded (4 of 12; a client of one sample keeps it), every step's loss and gradient in
    closed form: B̂ the largest loss, Ĝ the largest gradient norm, D̂ the farthest a
    client moved. A parameter the loss does not use has no gradient and stays put."""
    from torch.utils.data import TensorDataset

    from lightning_fl.systems.streams import estimate_constants

    dm = _stream_dm()
    x, y = dm.client_dataset(0, "train").tensors
    datasets = [TensorDataset(x[:12], y[:12]), TensorDataset(x[:1], y[:1])]
    module = _logistic_module()
    module.spare = torch.nn.Parameter(torch.ones(3))  # unused by the loss
    start = torch.cat([module.network.weight.detach()[0], module.network.bias.detach()])
    rng = torch.Generator().manual_seed(4)
    B = G = D = 0.0
    for data in datasets:
        xs, ys = data.tensors
        size = max(1, round(0.3 * len(xs)))
        part = torch.randperm(len(xs), generator=rng)[:size]
        theta = start.clone()
        for _ in range(3):
            rows = part[torch.randperm(size, generator=rng)[: min(2, size)]]
            z = xs[rows] @ theta[:-1] + theta[-1]
            target = ys[rows].float()
            loss = float(torch.nn.functional.binary_cross_entropy_with_logits(z, target))
            residual = (torch.sigmoid(z) - target) / len(rows)
            gradient = torch.cat([xs[rows].T @ residual, residual.sum().reshape(1)])
            B, G = max(B, loss), max(G, float(gradient.norm()))
            theta -= 0.1 * gradient
        D = max(D, float((theta - start).norm()))
    estimated = estimate_constants(module, datasets, 3, 0.1, 2, 0.3, seed=4)
    assert estimated == pytest.approx((B, G, D), rel=1e-5)
    assert torch.equal(module.spare, torch.ones(3))


def test_ours_with_an_estimated_ratio_runs_from_the_trainer_and_logs_it():
    from lightning_fl import BinaryClassifier, FederatedStrategy
    from lightning_fl.callbacks import StreamFedAvg
    from lightning_fl.systems.streams import estimate_constants
    from tests.helpers import make_trainer

    dm = _stream_dm()
    module = _logistic_module()
    datasets = [dm.client_dataset(c, "train") for c in range(2)]
    constants = estimate_constants(module, datasets, 20, 0.1, dm.batch_size, 0.2, seed=4)
    expected = estimate_ratio(*constants, 21, sum(dm.sample_counts()), 4)
    aggregator = StreamFedAvg("ours", ratio="estimate")
    trainer = make_trainer(FederatedStrategy(local_steps=2, seed=4), 2, [aggregator])
    trainer.fit(module, datamodule=dm)
    assert aggregator.estimated_ratio == pytest.approx(expected)
    assert float(trainer.callback_metrics["streams/ratio"]) == pytest.approx(expected, rel=1e-6)
    weights = aggregator.target_weights(dm.sample_counts()).numpy()
    n = np.array(dm.sample_counts()) / sum(dm.sample_counts())
    fresh = np.arange(6) >= 2
    assert weights == pytest.approx(configuration_rule(n, fresh, expected), abs=1e-9)
    # the estimate (at each fit's start) leaves the global RNG as it found it, and a
    # client without samples gets no weight, the rule running over the others
    constants = estimate_constants(module, datasets, 20, 0.1, dm.batch_size, 0.2, seed=4)
    trained = estimate_ratio(*constants, 21, sum(dm.sample_counts()), 4)  # the trained model's
    dropout = BinaryClassifier(torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(20, 1)))
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    aggregator.on_fit_start(trainer, module)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert aggregator.estimated_ratio == pytest.approx(trained)
    with_empty = aggregator.target_weights([*dm.sample_counts(), 0]).numpy()
    assert with_empty[-1] == 0.0
    assert with_empty[:-1] == pytest.approx(configuration_rule(n, fresh, trained), abs=1e-9)
    aggregator.on_fit_start(trainer, dropout)  # its masks come from the global RNG
    assert torch.equal(torch.random.get_rng_state(), before)


def test_full_batch_local_training_is_gradient_descent_on_the_cache():
    """full_batch=True: one local step is one GD step on the client's whole cache."""
    import torch

    from lightning_fl import FederatedStrategy, FullParticipation
    from lightning_fl.callbacks import StreamFedAvg
    from tests.helpers import make_trainer

    def fit(full_batch):
        dm = _stream_dm("fifo", capacity=15, full_batch=full_batch)
        dm.batch_size = 2  # minibatches of 2 unless full_batch
        module = _logistic_module()
        trainer = make_trainer(
            FederatedStrategy(sampler=FullParticipation(), local_steps=1, seed=0), 1,
            [StreamFedAvg("fresh")],
        )  # fmt: skip
        trainer.fit(module, datamodule=dm)
        return dm, torch.cat([p.detach().flatten() for p in module.parameters()])

    dm, trained = fit(True)
    _, minibatch = fit(False)
    start = torch.cat([p.detach().flatten() for p in _logistic_module().parameters()])
    dm.set_round(0)
    expected = torch.zeros_like(start)
    for c in range(2, 6):  # fresh clients, equal weights 1/4; one GD step from θ⁰ each
        reference = _logistic_module()
        _, gradient = _logistic_gradient(reference, *dm.client_dataset(c, "train").tensors)
        expected += (start - 0.1 * gradient) / 4
    assert torch.allclose(trained, expected, atol=1e-6)
    assert not torch.allclose(minibatch, expected, atol=1e-4)


def test_fresh_clients_with_windows_arrive_once_and_are_skipped_outside_them():
    """fresh_rounds = 2 (P1's Shakespeare): a fresh client's training set arrives in two
    consecutive rounds, half each; outside its window it has no data and the strategy
    skips it, counting it in fl/skipped_empty."""
    from lightning_fl import FederatedStrategy, FullParticipation
    from lightning_fl.callbacks import StreamFedAvg
    from tests.helpers import make_trainer

    dm = _stream_dm(fresh_rounds=2)
    seen = {c: [] for c in dm.fresh_clients}
    for t in range(6):
        dm.set_round(t)
        for c in dm.fresh_clients:
            ids = dm.cache_ids(c).tolist()
            start, stop = dm.window(c)
            assert bool(ids) == (start <= t < stop)
            seen[c] += ids
    for ids in seen.values():
        assert sorted(ids) == list(range(30))  # every sample, once
    assert dm.sample_counts() == [30] * 6

    class Participants(__import__("lightning").pytorch.Callback):
        def __init__(self):
            self.rounds = []

        def on_train_epoch_end(self, trainer, pl_module):
            state = trainer.strategy.current_round.state
            skipped = float(trainer.callback_metrics["fl/skipped_empty"])
            self.rounds.append((state.participation.clients, skipped))

    recorder = Participants()
    dm = _stream_dm(fresh_rounds=2)
    strategy = FederatedStrategy(sampler=FullParticipation(), local_steps=1, seed=0)
    with pytest.warns(UserWarning, match="no training data this round"):
        make_trainer(strategy, 6, [StreamFedAvg("uniform"), recorder]).fit(
            _logistic_module(), datamodule=dm
        )
    for t, (clients, skipped) in enumerate(recorder.rounds):
        present = [c for c in dm.fresh_clients if dm.window(c)[0] <= t < dm.window(c)[1]]
        assert clients == (0, 1, *present)
        assert skipped == 4 - len(present)
    assert any(skipped > 0 for _, skipped in recorder.rounds)


STREAM_RECIPES = sorted(
    (Path(__file__).resolve().parents[1] / "recipes" / "streams").glob("*.yaml")
)


@pytest.mark.parametrize("recipe", STREAM_RECIPES, ids=lambda r: r.stem)
def test_every_stream_recipe_parses(recipe, capsys):
    from lightning_fl.cli import run

    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", str(recipe), "--print_config"])
    assert exit_info.value.code == 0


def test_femnist_streams_small_recipe_runs_with_windows_and_an_estimated_ratio(tmp_path):
    from lightning_fl.cli import run

    recipe = STREAM_RECIPES[[r.stem for r in STREAM_RECIPES].index("femnist_streams_small")]
    cli = run(
        ["fit", "--config", str(recipe), "--data.init_args.source.init_args.root",
         str(tmp_path / "data"), "--trainer.default_root_dir", str(tmp_path),
         "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_epochs", "3",
         "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false"]
    )  # fmt: skip
    import csv

    (path,) = list(tmp_path.rglob("metrics.csv"))
    rows = list(csv.DictReader(open(path)))
    skipped = [float(r["fl/skipped_empty"]) for r in rows if r.get("fl/skipped_empty")]
    ratios = {float(r["streams/ratio"]) for r in rows if r.get("streams/ratio")}
    assert len(skipped) == 3 and min(skipped) > 0  # fresh writers outside their round
    assert len(ratios) == 1 and ratios.pop() > 0  # estimated once, by Eq. 204
    assert 0.0 <= float(cli.trainer.callback_metrics["test_acc"]) <= 1.0


def test_iterate_average_is_the_mean_of_the_models_the_rounds_started_from():
    import torch

    from lightning_fl import FederatedStrategy
    from lightning_fl.callbacks import IterateAverage, StreamFedAvg
    from tests.helpers import make_trainer

    class Starts(__import__("lightning").pytorch.Callback):
        def __init__(self):
            self.models = []

        def on_train_epoch_start(self, trainer, pl_module):
            self.models.append(torch.cat([p.detach().flatten() for p in pl_module.parameters()]))

    starts, average = Starts(), IterateAverage()
    module = _logistic_module()
    trainer = make_trainer(FederatedStrategy(local_steps=2, seed=0), 4,
                           [StreamFedAvg("uniform"), starts, average])  # fmt: skip
    trainer.fit(module, datamodule=_stream_dm())
    expected = torch.stack(starts.models).mean(0)
    loaded = torch.cat([p.detach().flatten() for p in module.parameters()])
    assert len(starts.models) == 4 and torch.allclose(loaded, expected, atol=1e-6)
    assert not torch.allclose(starts.models[0], starts.models[-1])  # the model did move


def test_configuration_objective_by_hand():
    """ψ(p)/c1 = sqrt(Σ_fresh p_m²) + r·sqrt(Σ_m p_m²/n_m) (Cor. 5.1) on unequal n_m,
    where dropping the 1/n_m would change the value."""
    from lightning_fl.systems.streams import configuration_objective

    p, n = np.array([0.5, 0.3, 0.2]), np.array([0.6, 0.3, 0.1])
    fresh = np.array([False, True, True])
    expected = math.sqrt(0.3**2 + 0.2**2) + 0.7 * math.sqrt(0.25 / 0.6 + 0.09 / 0.3 + 0.04 / 0.1)
    assert configuration_objective(p, n, fresh, 0.7) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("rounds", "fresh_rounds"), [(6, 2), (5, 5), (7, 1)])
def test_window_starts_cover_exactly_the_admissible_rounds(rounds, fresh_rounds):
    """A fresh client's window starts at a round drawn uniformly in [0, rounds −
    fresh_rounds]: over 400 clients both ends occur, nothing outside, each start about
    equally often (a window filling the run starts at 0), and the draw is the seeded
    one: the same client and seed, the same window."""
    dm = _stream_dm(rounds=rounds, fresh_rounds=fresh_rounds)
    starts = [dm.window(c)[0] for c in range(400)]
    last = rounds - fresh_rounds
    assert set(starts) == set(range(last + 1))
    assert all(dm.window(c)[1] - dm.window(c)[0] == fresh_rounds for c in range(400))
    counts = np.bincount(starts, minlength=last + 1)
    expected = 400 / (last + 1)
    assert (abs(counts - expected) <= 5 * expected**0.5).all()  # 5 binomial sds
    assert dm.window(17) == _stream_dm(rounds=rounds, fresh_rounds=fresh_rounds).window(17)


class _MapStyle(torch.utils.data.Dataset):
    """A plain map-style dataset over a sequence of samples (not a TensorDataset)."""

    def __init__(self, samples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def test_stream_labels_from_any_map_style_dataset():
    """A source whose training set is not a TensorDataset (a map-style dataset of
    (x, y) pairs, y a 0-d tensor or an int): the stream reads each sample's label."""
    import torch
    from torch.utils.data import TensorDataset

    from lightning_fl.datamodules.streaming import _labels

    def pairs(labels):
        return _MapStyle([(torch.zeros(2), label) for label in labels])

    assert _labels(pairs([torch.tensor(3), torch.tensor(1), torch.tensor(3)]), 3).tolist() == [
        3,
        1,
        3,
    ]
    assert _labels(pairs([2, 0]), 2).tolist() == [2, 0]
    tensors = TensorDataset(torch.zeros(3, 2), torch.tensor([1.0, 0.0, 2.0]))
    got = _labels(tensors, 3)
    assert got.tolist() == [1, 0, 2] and got.dtype == np.int64
    assert _labels(None, 0).tolist() == [] and _labels(pairs([]), 0).tolist() == []


def test_cache_discrepancy_logs_each_rounds_value_and_their_running_sum():
    """Over four rounds with a FIFO cache: ``streams/discrepancy`` is the last round's ψ_t
    (the datamodule's, read after each round) and ``streams/accumulated_discrepancy`` the
    sum of the four."""
    import torch
    from lightning.pytorch import Callback

    from lightning_fl import MLP, BinaryClassifier, FederatedStrategy
    from lightning_fl.callbacks import CacheDiscrepancy, StreamFedAvg
    from tests.helpers import make_trainer

    values = []

    class Record(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            values.append(trainer.datamodule.cache_discrepancy(2))

    torch.manual_seed(0)
    module = BinaryClassifier(MLP(20, (), 1), lr=0.1)
    callbacks = [StreamFedAvg("fresh"), CacheDiscrepancy(num_classes=2), Record()]
    trainer = make_trainer(FederatedStrategy(local_steps=2, seed=4), 4, callbacks)
    trainer.fit(module, datamodule=_stream_dm(cache="fifo", capacity=10))
    assert len(values) == 4 and len(set(values)) > 1
    metrics = trainer.callback_metrics
    assert float(metrics["streams/discrepancy"]) == pytest.approx(values[-1], rel=1e-6)
    assert float(metrics["streams/accumulated_discrepancy"]) == pytest.approx(sum(values), rel=1e-6)


def test_a_given_ratio_is_not_estimated_and_estimating_needs_both_groups():
    """``ratio=0.5`` is used as given (no estimate, no ``streams/ratio``); ``'estimate'``
    refuses a stream with no historical client, and one with no fresh client."""
    from lightning_fl import MLP, BinaryClassifier, FederatedStrategy
    from lightning_fl.callbacks import StreamFedAvg
    from lightning_fl.datamodules import LogisticStreamsDataModule, StreamingDataModule
    from tests.helpers import make_trainer

    given = StreamFedAvg("ours", ratio=0.5)
    trainer = make_trainer(FederatedStrategy(local_steps=1, seed=4), 1, [given])
    trainer.fit(BinaryClassifier(MLP(20, (), 1), lr=0.1), datamodule=_stream_dm())
    assert given.estimated_ratio is None and "streams/ratio" not in trainer.callback_metrics
    for historical in (0, 6):
        source = LogisticStreamsDataModule(num_clients=6, historical=historical,
                                           historical_samples=30, fresh_samples=30,
                                           test_samples=10, seed=1)  # fmt: skip
        dm = StreamingDataModule(source, historical=historical, rate=5, rounds=3)
        trainer = make_trainer(FederatedStrategy(local_steps=1, seed=4), 1,
                               [StreamFedAvg("ours", ratio="estimate")])  # fmt: skip
        with pytest.raises(ValueError, match="needs historical and fresh clients"):
            trainer.fit(BinaryClassifier(MLP(20, (), 1), lr=0.1), datamodule=dm)


@pytest.mark.parametrize(
    "strategy, p_hist, historical, refused",
    [
        ("historical", None, 0, True),  # no historical client to put the weight on
        ("fresh", None, 3, True),  # no fresh client
        ("fixed", 0.0, 0, False),  # p_hist = 0 needs no historical client
        ("fixed", 1.0, 3, False),  # p_hist = 1 needs no fresh client
        ("fixed", 0.3, 0, True),
        ("fixed", 0.3, 3, True),
        ("fixed", 0.3, 1, False),
    ],
)
def test_p1_weights_need_the_groups_their_p_hist_puts_weight_on(
    strategy, p_hist, historical, refused
):
    """Three clients of 10, 20 and 30 samples, the first ``historical`` of them historical:
    a strategy refuses only a stream that lacks a group it gives weight to; p_hist = 0.3 with
    client 0 historical gives it 0.3 and the fresh clients 0.7·(20, 30)/50."""
    from lightning_fl.callbacks import StreamFedAvg

    callback = StreamFedAvg(strategy, p_hist=p_hist)
    callback.historical = historical
    if refused:
        with pytest.raises(ValueError, match="needs clients of both groups"):
            callback.target_weights([10, 20, 30])
        return
    weights = callback.target_weights([10, 20, 30]).tolist()
    by_size = [1 / 6, 2 / 6, 3 / 6]  # one group only: the sample shares
    expected = {0: by_size, 1: [0.3, 0.7 * 0.4, 0.7 * 0.6], 3: by_size}
    assert weights == pytest.approx(expected[historical])


@pytest.mark.parametrize("p_hist", [-0.1, 1.5, None])
def test_a_fixed_p_hist_outside_0_1_is_refused(p_hist):
    from lightning_fl.callbacks import StreamFedAvg

    with pytest.raises(ValueError, match="needs p_hist in"):
        StreamFedAvg("fixed", p_hist=p_hist)


def test_iterate_average_without_load_at_end_keeps_the_last_iterate_and_the_average_apart():
    """``load_at_end=False``: the module ends on the last round's model (the same as a run
    without the callback), and ``average`` still holds θ̄."""
    import torch

    from lightning_fl import FederatedStrategy
    from lightning_fl.callbacks import IterateAverage, StreamFedAvg
    from tests.helpers import make_trainer

    def fit(callbacks):
        module = _logistic_module()
        trainer = make_trainer(FederatedStrategy(local_steps=2, seed=0), 4,
                               [StreamFedAvg("uniform"), *callbacks])  # fmt: skip
        trainer.fit(module, datamodule=_stream_dm())
        return torch.cat([p.detach().flatten() for p in module.parameters()])

    average = IterateAverage(load_at_end=False)
    kept, plain = fit([average]), fit([])
    assert torch.equal(kept, plain)
    mean = torch.cat([t.flatten() for t in average.average])
    assert not torch.allclose(mean, kept)


def test_the_configuration_rule_finds_the_minimizer_a_grid_search_finds():
    """Three clients (n = 0.5, 0.3, 0.2; the first historical), r = 1: the rule's p̂* is,
    within the grid's resolution, the minimizer of ψ over the simplex found by evaluating ψ
    on every point of a 0.002 grid (an interior point: neither Uniform nor Historical)."""
    from lightning_fl.systems.streams import configuration_objective

    n, fresh, r = np.array([0.5, 0.3, 0.2]), np.array([False, True, True]), 1.0
    step = 0.002
    a, b = np.meshgrid(np.arange(0, 1 + step / 2, step), np.arange(0, 1 + step / 2, step))
    inside = a + b <= 1 + 1e-12
    grid = np.stack([a[inside], b[inside], 1 - a[inside] - b[inside]], 1).clip(0, 1)
    values = np.sqrt((grid[:, 1:] ** 2).sum(1)) + r * np.sqrt((grid**2 / n).sum(1))
    best = grid[values.argmin()]
    assert 0.05 < best[0] < 0.95 and not np.allclose(best, n, atol=0.02)
    rule = configuration_rule(n, fresh, r)
    assert rule == pytest.approx(best, abs=4 * step)
    assert configuration_objective(rule, n, fresh, r) <= values.min() + 1e-6


def test_stream_helpers_at_their_bounds_and_by_hand():
    """A cache of one sample; largest-remainder rounding by hand (and of all-zero values);
    λ-masses with a negative entry or all zero refused; Eq. 204's inputs each refused at 0
    and its value by hand; estimate_constants' bounds, each bad one alone."""
    import torch

    from lightning_fl.systems.streams import _round_to_total, estimate_constants

    one = FIFOCache(1)
    one.update(np.array([7]), np.array([2]), np.random.default_rng(0))
    assert one.ids.tolist() == [7]
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        FIFOCache(0)
    # 1, 2, 3.5 scaled to 10: 1.54, 3.08, 5.38 → floors 1, 3, 5 and the largest remainder
    assert _round_to_total(np.array([1.0, 2.0, 3.5]), 10).tolist() == [2, 3, 5]
    assert _round_to_total(np.zeros(3), 2).tolist() == [1, 1, 0]
    assert _round_to_total(np.array([0.2, 0.3]), 5).tolist() == [2, 3]  # a sum below 1, scaled
    assert one.label_distribution(4).tolist() == [0.0, 0.0, 1.0, 0.0]
    assert FIFOCache(3).label_distribution(2).tolist() == [0.0, 0.0]  # empty: no 0/0
    assert aggregation_weights([0.25, 0.75]).tolist() == [0.25, 0.75]
    assert aggregation_weights([0.0, 1.0, 3.0]).tolist() == [0.0, 0.25, 0.75]  # one at 0
    coefficients = weighted_minibatch_coefficients(np.array([0.0, 1.0, 3.0]), np.array([0, 2]))
    assert coefficients.tolist() == [0.0, 3 / 2 * 3 / 4]  # a zero weight is allowed
    for bad in ([-1.0, 3.0], [0.0, 0.0]):
        with pytest.raises(ValueError, match="λ-masses must be >= 0 and not all 0"):
            aggregation_weights(bad)
    assert estimate_ratio(2.0, 3.0, 0.5, 100, 25, 4) == pytest.approx((2 + 2) / (3 * 0.5 * 2))
    for position in range(6):
        args = [2.0, 3.0, 0.5, 100, 25, 4]
        args[position] = 0
        with pytest.raises(ValueError, match="must be > 0"):
            estimate_ratio(*args)
    module = _logistic_module()
    datasets = [_stream_dm().client_dataset(0, "train")]
    for bad in ({"steps": 0}, {"fraction": 0.0}, {"fraction": 1.5}, {"lr": 0.0}):
        with pytest.raises(ValueError, match="steps >= 1, fraction in"):
            estimate_constants(module, datasets, **bad)
    alone = estimate_constants(module, datasets, steps=2, fraction=1.0)
    empty = torch.utils.data.TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))
    assert estimate_constants(module, [None, empty, *datasets], steps=2, fraction=1.0) == alone


def _drifting_order_by_hand(labels, states, rate, seed, concentration, length=None):
    """The docstring's stream, written out: u^j ~ Dir(α) (+1e-9, renormalized), P(i → j) ∝
    exp(−KL(u^i ‖ u^j)), a permutation of each class's samples, a start state; each round
    ``rate`` labels from u^state, each taking its class's last unseen sample (or, when the
    class is out, the first class with samples left; with ``length``, a fresh permutation
    of the class), then one transition."""
    rng = np.random.default_rng(seed)
    classes = sorted(set(labels.tolist()))
    u = rng.dirichlet([concentration] * len(classes), size=states) + 1e-9
    u = u / u.sum(1, keepdims=True)
    p = np.array([[math.exp(-sum(a * math.log(a / b) for a, b in zip(ui, uj))) for uj in u]
                  for ui in u])  # fmt: skip
    p = p / p.sum(1, keepdims=True)
    pools = {c: list(rng.permutation(np.flatnonzero(labels == c))) for c in classes}
    order, state = [], int(rng.integers(states))
    while (len(order) < length) if length else any(pools.values()):
        for c in rng.choice(classes, size=rate, p=u[state]):
            if length and not pools[c]:
                pools[c] = list(rng.permutation(np.flatnonzero(labels == c)))
            pool = pools[c] if pools[c] else next((q for q in pools.values() if q), [])
            if pool:
                order.append(pool.pop())
        state = int(rng.choice(states, p=p[state]))
    return order[:length] if length else order


@pytest.mark.parametrize(
    "counts, concentration, length",
    [((10, 7, 4), 0.8, None), ((10, 7, 4), 0.8, 50), ((10, 1, 10), 50.0, None), ((7,), 1.0, None)],
)
def test_drifting_order_by_hand(counts, concentration, length):
    """Classes of unequal size, 4 states, rate 3: they run out at different rounds (a class
    of one sample, drawn about a third of the time at α = 50, runs out at once and its
    draws go to the others); with ``length`` 50 the stream outlasts the 21 samples; one
    class alone is a permutation of it, 7 samples at 3 a round leaving the last round short."""
    from lightning_fl.datamodules.streaming import drifting_order

    labels = np.concatenate([np.full(n, c) for n, c in zip(counts, (2, 5, 9))])
    got = drifting_order(labels, 4, 3, np.random.default_rng(6), concentration, length)
    expected = _drifting_order_by_hand(labels, 4, 3, 6, concentration, length)
    assert got.tolist() == expected and got.dtype == np.int64
    assert len(got) == (length or len(labels))
    assert drifting_order(labels[:0], 4, 3, np.random.default_rng(0)).tolist() == []


@pytest.mark.parametrize(
    "cache, kind, theta",
    [("lazy", "FixedCache", None), ("drsr", "SelectiveReplacementCache", None),
     ("srsr", "SelectiveReplacementCache", 0.25), ("fifo", "FIFOCache", None),
     ("current", "CurrentBatchCache", None)],
)  # fmt: skip
def test_each_cache_rule_builds_its_cache(cache, kind, theta):
    dm = _stream_dm(cache=cache, capacity=10, theta=0.25)
    made = dm._new_cache()
    assert type(made).__name__ == kind and getattr(made, "theta", None) == theta


def test_streaming_train_split_is_the_cache_and_other_splits_the_sources():
    """``train`` is the client's cache (sorted ids into its training set); ``test`` and
    its counts are the source's; with ``full_batch`` an empty cache keeps the source's
    batch size; a source of plain datasets is served as a ``Subset``."""
    from torch.utils.data import TensorDataset

    dm = _stream_dm(cache="fifo", capacity=10, full_batch=True)
    dm.set_round(1)
    source_train = dm.source.client_dataset(3, "train")
    ids = np.sort(dm.cache_ids(3))
    x, y = dm.client_dataset(3, "train")[:]
    assert torch.equal(x, source_train.tensors[0][ids]) and len(ids) == 10
    test = dm.client_dataset(3, "test")
    assert torch.equal(test.tensors[0], dm.source.client_dataset(3, "test").tensors[0])
    assert dm.sample_counts("test") == dm.source.sample_counts("test") == [10] * 6
    assert dm.training_batch_size(TensorDataset(torch.zeros(0, 2))) == dm.batch_size
    assert dm.training_batch_size(TensorDataset(torch.zeros(7, 2))) == 7
    assert dm.training_batch_size(TensorDataset(torch.zeros(1, 2))) == 1 != dm.batch_size

    from lightning_fl.datamodules import StreamingDataModule

    plain_source = _stream_dm(cache="fifo", capacity=10).source
    wrapped = plain_source.client_dataset
    plain_source.client_dataset = lambda c, s: _MapStyle(wrapped(c, s))  # noqa: ARG005
    plain = StreamingDataModule(plain_source, historical=2, rate=5, cache="fifo", capacity=10,
                                rounds=6)  # fmt: skip
    plain.set_round(1)
    served = plain.client_dataset(3, "train")
    assert type(served).__name__ == "Subset" and served.indices == ids.tolist()
    assert torch.equal(torch.stack([served[i][0] for i in range(10)]), x)


def test_p1_synthetic_task_by_hand():
    """App. D.1.1 drawn from ``Generator().manual_seed(seed)``: θ_0 ~ N(0, I), then per
    client θ_m = θ_0 + ε N(0, I), x ~ U[−1, 1]^d (training rows, then test rows), y ~
    Bernoulli(σ(⟨x, θ_m⟩)); the first ``historical`` clients hold ``historical_samples``."""
    from lightning_fl.datamodules import LogisticStreamsDataModule

    dm = LogisticStreamsDataModule(num_clients=3, historical=1, dim=4, epsilon=0.5,
                                   historical_samples=6, fresh_samples=3, test_samples=2,
                                   seed=9)  # fmt: skip
    g = torch.Generator().manual_seed(9)
    theta0 = torch.randn(4, generator=g)
    for m, size in enumerate((6, 3, 3)):
        theta = theta0 + 0.5 * torch.randn(4, generator=g)
        x = torch.rand(size + 2, 4, generator=g) * 2 - 1
        y = torch.bernoulli(torch.sigmoid(x @ theta), generator=g)
        for split, rows in (("train", slice(0, size)), ("test", slice(size, None))):
            got_x, got_y = dm.client_dataset(m, split)[:]
            assert torch.equal(got_x, x[rows]) and torch.equal(got_y, y[rows])
    LogisticStreamsDataModule(num_clients=2, historical=0, epsilon=0.0)  # ε = 0: one model
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        LogisticStreamsDataModule(num_clients=2, historical=0, epsilon=-0.1)


def test_streams_and_caches_by_hand_from_their_seeds():
    """Client c's stream is ``default_rng([seed, 7, c]).permutation(n)`` (or, with drift,
    ``drifting_order`` from that generator, ``rounds · rate`` long with ``recycle``); round
    t's cache update draws from ``default_rng([seed, 11, c, t])``; before any round the
    module serves round 0's cache. Counts: historical clients their whole set, fresh ones
    at most ``rate · rounds``, and with ``recycle`` a historical client still its 30
    samples (it held 50 indices into 30 rows before the fix)."""
    from lightning_fl.datamodules.streaming import drifting_order
    from lightning_fl.systems.streams import SelectiveReplacementCache

    dm = _stream_dm(cache="srsr", capacity=10, rounds=4, theta=0.4, seed=5)
    first = dm.client_dataset(3, "train")  # no set_round yet: round 0
    first_ids = np.sort(dm.cache_ids(3)).tolist()
    labels = {c: dm.source.client_dataset(c, "train").tensors[1].long().numpy() for c in (2, 3)}
    for c in (2, 3):
        stream = np.random.default_rng([5, 7, c]).permutation(30)
        cache = SelectiveReplacementCache(10, 0.4)
        for t in range(3):
            batch = stream[5 * t : 5 * t + 5]
            cache.update(batch, labels[c][batch], np.random.default_rng([5, 11, c, t]))
            if t == 0 and c == 3:
                assert len(first) == 5 and np.sort(cache.ids).tolist() == first_ids
        dm.set_round(2)
        assert np.sort(dm.cache_ids(c)).tolist() == np.sort(cache.ids).tolist()
    assert dm.sample_counts() == [30, 30, 20, 20, 20, 20]  # fresh: at most 5 · 4 rounds
    drifting = _stream_dm(drift=3, recycle=True, rounds=10, seed=5)
    for c in (2, 5):
        rng = np.random.default_rng([5, 7, c])
        labels_c = drifting.source.client_dataset(c, "train").tensors[1].long().numpy()
        expected = drifting_order(labels_c, 3, 5, rng, 0.5, 50)
        drifting.set_round(0)
        assert drifting._streams[c].tolist() == expected.tolist() and len(expected) == 50
    assert drifting.sample_counts() == [30, 30, 50, 50, 50, 50]
    assert [len(drifting.client_dataset(c, "train")) for c in (0, 1)] == [30, 30]


def test_windowed_clients_by_hand():
    """A fresh client's window starts at ``default_rng([seed, 13, c]).integers(0, rounds −
    fresh_rounds + 1)``; before any round its cache is round 0's part; it counts its whole
    training set; ``clients_without_data_now`` names every client (0 included) outside its
    window, and none outside the federation."""
    dm = _stream_dm(fresh_rounds=2, rounds=6, seed=8)
    for c in range(2, 6):
        start = int(np.random.default_rng([8, 13, c]).integers(0, 5))
        assert dm.window(c) == (start, start + 2)
    assert dm.sample_counts() == [30] * 6
    at_zero = [c for c in range(2, 6) if dm.window(c)[0] == 0]
    assert [c for c in range(2, 6) if len(dm.cache_ids(c))] == at_zero
    from lightning_fl.datamodules import StreamingDataModule

    empty = StreamingDataModule(dm.source, historical=0, rate=5, rounds=6, fresh_rounds=2, seed=8)
    t = next(t for t in range(6) if not empty.window(0)[0] <= t < empty.window(0)[1])
    empty.set_round(t)
    outside = [c for c in range(6) if not empty.window(c)[0] <= t < empty.window(c)[1]]
    assert empty.clients_without_data_now([-1, *range(6), 6]) == outside and 0 in outside


def test_cache_discrepancy_by_hand():
    """ψ_t = Σ_k Σ_r (v_t^{k,r} − π^{k,r})² over the fresh clients: v the cache's label
    frequencies, π those of the client's whole stream (P2 §IV)."""
    dm = _stream_dm(cache="fifo", capacity=10)
    dm.set_round(1)
    expected = 0.0
    for c in range(2, 6):
        labels = dm.source.client_dataset(c, "train").tensors[1].long().numpy()
        cached = labels[dm.cache_ids(c)]
        v = np.bincount(cached, minlength=3) / len(cached)
        pi = np.bincount(labels, minlength=3) / len(labels)
        expected += float(((v - pi) ** 2).sum())
    assert dm.cache_discrepancy(3) == pytest.approx(expected, rel=1e-12) and expected > 0


def test_one_sample_streams_cache_their_sample_and_count_it_in_the_discrepancy():
    """Fresh clients of one sample: the stream is that sample (its label read), the cache
    holds it after round 0, and π is its one label."""
    from lightning_fl.datamodules import LogisticStreamsDataModule, StreamingDataModule

    source = LogisticStreamsDataModule(num_clients=3, historical=1, historical_samples=4,
                                       fresh_samples=1, test_samples=1, seed=2)  # fmt: skip
    dm = StreamingDataModule(source, historical=1, rate=1, rounds=2, cache="fifo")
    dm.set_round(0)
    assert [dm.cache_ids(c).tolist() for c in (1, 2)] == [[0], [0]]
    assert dm.cache_discrepancy(2) == 0.0  # the cache is the whole stream
    assert dm.sample_counts() == [4, 1, 1]
