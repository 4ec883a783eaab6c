"""FEM-OMD for Gaussian mixtures (Marfoq thesis §4.4, Alg. 15): one round by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_fl.systems.fem_omd import FemOmdGMM, mixture_kl, responsibilities


def _normal(x, mu):
    return math.exp(-0.5 * (x - mu) ** 2) / math.sqrt(2 * math.pi)


@pytest.mark.parametrize("lr", [0.5, 900.0])
def test_one_round_of_algorithm_15_by_hand(lr):
    """C = 2 clients, m = 2 components in d = 1, K = 1: E-step, M-step, the server's
    weighted sync, the running average of the means and the OMD step. At η = 900 the OMD
    exponent passes 709, where exp overflows unless the logits are shifted first."""
    means = np.array([[-1.0], [2.0]])
    samples = [np.array([[-1.5], [0.0], [2.5]]), np.array([[1.0], [3.0]])]
    alg = FemOmdGMM(means, num_clients=2, lr=lr, em_steps=1, seed=3)
    new_weights, new_means = [], []
    for x in samples:  # E and M steps from π = (1/2, 1/2)
        w = np.array([[0.5 * _normal(v, -1.0), 0.5 * _normal(v, 2.0)] for v in x[:, 0]])
        w /= w.sum(axis=1, keepdims=True)
        assert responsibilities(x, np.array([0.5, 0.5]), means) == pytest.approx(w)
        new_weights.append(w.mean(axis=0))
        new_means.append((w.T @ x[:, 0]) / w.sum(axis=0))
    pi, mu = np.array(new_weights), np.array(new_means)
    synced = (pi * mu).sum(axis=0) / pi.sum(axis=0)
    expected_means = (1 * means[:, 0] + synced) / 2  # t = 1: ω_2 = (ω_1 + μ̃)/2
    rng = np.random.default_rng(3)  # the OMD draws replayed
    expected_weights = []
    for c, x in enumerate(samples):
        comp = rng.choice(2, size=len(x), p=pi[c] / pi[c].sum())
        z = expected_means[comp] + rng.standard_normal((len(x), 1))[:, 0]
        f = np.array([[_normal(v, expected_means[j]) for j in range(2)] for v in z])
        gradient = -(f / (f @ np.array([0.5, 0.5]))[:, None]).mean(axis=0)
        exponent = -lr * gradient  # π ∝ 0.5 exp(−η ∇̂), the common 0.5 cancels
        shifted = np.exp(exponent - exponent.max())
        expected_weights.append(shifted / shifted.sum())
    assert lr < 1 or np.abs(lr * gradient).max() > 709  # the large rate does overflow
    alg.step(samples)
    assert alg.means[:, 0] == pytest.approx(expected_means)
    assert alg.weights == pytest.approx(np.array(expected_weights))


def test_mixture_kl_is_zero_for_the_same_mixture_and_positive_otherwise():
    rng = np.random.default_rng(0)
    means = np.array([[0.0, 0.0], [4.0, 0.0]])
    same = mixture_kl(np.array([0.3, 0.7]), means, np.array([0.3, 0.7]), means, rng)
    other = mixture_kl(np.array([0.3, 0.7]), means, np.array([0.9, 0.1]), means, rng)
    assert same == pytest.approx(0.0, abs=1e-12) and other > 0.3


def test_bad_fem_omd_settings_are_refused():
    with pytest.raises(ValueError, match="lr must be > 0"):
        FemOmdGMM(np.zeros((2, 1)), 2, lr=0.0)
    alg = FemOmdGMM(np.zeros((2, 1)), 1, em_steps=4)
    with pytest.raises(ValueError, match="at least K = 4 samples"):
        alg.step([np.zeros((3, 1))])


def _linear():
    import torch

    return torch.nn.Linear(1, 2, bias=False)


def test_one_round_of_algorithm_17_by_hand():
    """C = 2 clients, m = 2 linear softmax components, K = 1: the E-step with exp(−ℓ)
    likelihoods (4.44), π̃ (4.45), the weighted SGD step on each component with the
    closed-form softmax gradient Σ_i w_i (p_i − e_{y_i}) x_i (4.46), the π̃-weighted sync,
    the running average and the OMD step on π."""
    import torch

    from lightning_fl.systems.fem_omd import FemOmdClassifier

    alg = FemOmdClassifier(_linear, 2, 2, component_lr=0.3, weight_lr=0.7, em_steps=1, seed=4)
    omega = [comp[0].clone().double() for comp in alg.components]  # W_j: [2 classes, 1]
    samples = [
        (torch.tensor([[1.0], [-2.0], [0.5]]), torch.tensor([0, 1, 1])),
        (torch.tensor([[3.0], [-1.0]]), torch.tensor([1, 0])),
    ]

    def losses(weights, x, y):  # per-sample cross-entropy of a linear softmax model
        logits = x.double() @ weights.T
        return logits.logsumexp(1) - logits[torch.arange(len(y)), y]

    pis, locals_ = [], []
    for x, y in samples:
        ell = torch.stack([losses(w, x, y) for w in omega])  # [m, n]
        lik = 0.5 * torch.exp(-ell)
        resp = lik / lik.sum(0, keepdim=True)
        pis.append(resp.mean(1))
        updated = []
        for j, w in enumerate(omega):
            probs = (x.double() @ w.T).softmax(1)
            onehot = torch.nn.functional.one_hot(y, 2).double()
            grad = (resp[j][:, None] * (probs - onehot)).T @ x.double()
            updated.append(w - 0.3 * grad)
        locals_.append(updated)
    pi = torch.stack(pis)
    synced = [sum(pi[c, j] * locals_[c][j] for c in range(2)) / pi[:, j].sum() for j in range(2)]
    expected = [(1 * omega[j] + synced[j]) / 2 for j in range(2)]  # t = 1
    expected_pi = []
    for x, y in samples:
        lik = torch.stack([torch.exp(-losses(w, x, y)) for w in expected])
        gradient = -(lik / (0.5 * lik).sum(0, keepdim=True)).mean(1)
        weights = 0.5 * torch.exp(-0.7 * gradient)
        expected_pi.append(weights / weights.sum())
    alg.step(samples)
    for j in range(2):
        assert torch.allclose(alg.components[j][0].double(), expected[j], atol=1e-6)
    assert torch.allclose(alg.weights.double(), torch.stack(expected_pi), atol=1e-6)


def test_identical_components_with_uniform_weights_stay_symmetric():
    """Identical components and uniform π: every responsibility is 1/m, every component
    takes the same step, and every ∇̂_j is −1, so π stays uniform."""
    import torch

    from lightning_fl.systems.fem_omd import FemOmdClassifier

    alg = FemOmdClassifier(_linear, 3, 1, component_lr=0.1, weight_lr=5.0)
    alg.components = [[alg.components[0][0].clone()] for _ in range(3)]
    alg.step([(torch.tensor([[1.0], [2.0]]), torch.tensor([0, 1]))])
    assert torch.allclose(alg.weights[0], torch.full((3,), 1 / 3), atol=1e-6)
    assert all(torch.equal(c[0], alg.components[0][0]) for c in alg.components)
    assert not torch.equal(alg.components[0][0], alg.network.weight)  # they did move


def test_fedomd_with_one_client_is_l2_regularized_sgd():
    import torch

    from lightning_fl.systems.fem_omd import FedOMD

    alg = FedOMD(_linear, lr=0.2, l2=0.1, local_steps=1, seed=0)
    w = alg.params[0].clone()
    x, y = torch.tensor([[1.0], [-1.0]]), torch.tensor([1, 0])
    probs = (x @ w.T).softmax(1)
    grad = (probs - torch.nn.functional.one_hot(y, 2)).T @ x / 2 + 0.1 * w
    alg.step([(x, y)])
    assert torch.allclose(alg.params[0], w - 0.2 * grad, atol=1e-6)


def _gauss(x, mu):  # N(x; μ, I) in any dimension, written out
    d = len(x)
    return math.exp(-0.5 * sum((a - b) ** 2 for a, b in zip(x, mu))) / (2 * math.pi) ** (d / 2)


def test_three_rounds_of_algorithm_15_with_two_em_steps_by_hand():
    """Three rounds, K = 2 split batches, d = 2: after the first round π is no longer
    uniform and t > 1, so the E-step's start from the client's π_t, the running average's
    (t ω_t + μ̃)/(t + 1) and OMD's prior π_t all show (a single round with t = 1 and
    uniform π hides them). The clients hold 7 and 5 samples a round, so their two split
    batches differ in size (4 and 3, 3 and 2): each EM step's π̃ is the mean over its own
    batch."""
    rng_data = np.random.default_rng(11)
    means = np.array([[-1.0, 0.0], [1.5, 1.0], [0.0, 2.5]])
    alg = FemOmdGMM(means, num_clients=2, lr=0.8, em_steps=2, seed=5)
    omega, pi = [list(map(float, mu)) for mu in means], [[1 / 3] * 3, [1 / 3] * 3]
    replay = np.random.default_rng(5)
    for t in (1, 2, 3):
        samples = [rng_data.normal(loc=[0.5 * c, 1.0], size=(7 - 2 * c, 2)) for c in range(2)]
        local_pi = [list(p) for p in pi]
        shared = [list(mu) for mu in omega]
        for k in range(2):
            local_means = []
            for c in range(2):
                part = np.array_split(samples[c], 2)[k]
                resp = []
                for x in part:
                    row = [local_pi[c][j] * _gauss(x, shared[j]) for j in range(3)]
                    resp.append([v / sum(row) for v in row])
                local_pi[c] = [sum(r[j] for r in resp) / len(resp) for j in range(3)]
                local_means.append([
                    [sum(r[j] * x[d] for r, x in zip(resp, part)) / sum(r[j] for r in resp)
                     for d in range(2)]
                    for j in range(3)
                ])  # fmt: skip
            shared = [
                [sum(local_pi[c][j] * local_means[c][j][d] for c in range(2))
                 / sum(local_pi[c][j] for c in range(2)) for d in range(2)]
                for j in range(3)
            ]  # fmt: skip
        omega = [[(t * omega[j][d] + shared[j][d]) / (t + 1) for d in range(2)] for j in range(3)]
        new_pi = []
        for c in range(2):
            p = np.array(local_pi[c])
            n = len(samples[c])
            comp = replay.choice(3, size=n, p=p / p.sum())
            z = np.array(omega)[comp] + replay.standard_normal((n, 2))
            grad = [-sum(_gauss(v, omega[j]) / sum(pi[c][i] * _gauss(v, omega[i])
                                                 for i in range(3)) for v in z) / n
                    for j in range(3)]  # fmt: skip
            unnormalized = [pi[c][j] * math.exp(-0.8 * grad[j]) for j in range(3)]
            new_pi.append([u / sum(unnormalized) for u in unnormalized])
        pi = new_pi
        alg.step(samples)
        assert alg.means == pytest.approx(np.array(omega), abs=1e-10), t
        assert alg.weights == pytest.approx(np.array(pi), abs=1e-10), t
    assert abs(pi[0][0] - 1 / 3) > 1e-3  # π moved away from uniform


@pytest.mark.parametrize("averaging", ["restart", "polyak", "none"])
def test_three_rounds_of_algorithm_17_with_two_em_steps_by_hand(averaging):
    """Alg. 17 over three rounds with K = 2 EM steps per round, carried by hand: the running
    average at t = 2, 3 and OMD from a non-uniform π, which one round cannot test; under
    each reading of lines 7 and 12 (where the round's SGD starts, what is averaged)."""
    import torch

    from lightning_fl.systems.fem_omd import FemOmdClassifier

    alg = FemOmdClassifier(
        _linear, 2, 2, component_lr=0.4, weight_lr=0.9, em_steps=2, seed=6, averaging=averaging
    )
    omega = [comp[0].clone().double() for comp in alg.components]
    chain = [w.clone() for w in omega]
    pi = torch.full((2, 2), 0.5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(2)

    def losses(weights, x, y):
        logits = x.double() @ weights.T
        return logits.logsumexp(1) - logits[torch.arange(len(y)), y]

    for t in (1, 2, 3):
        samples = [(torch.randn(4, 1, generator=gen) + c, torch.randint(0, 2, (4,), generator=gen))
                   for c in range(2)]  # fmt: skip
        local_pi = pi.clone()
        shared = [w.clone() for w in (chain if averaging == "polyak" else omega)]
        for _ in range(2):
            updated = []
            for c, (x, y) in enumerate(samples):
                ell = torch.stack([losses(w, x, y) for w in shared])
                lik = local_pi[c][:, None] * torch.exp(-ell)
                resp = lik / lik.sum(0, keepdim=True)
                local_pi[c] = resp.mean(1)
                steps = []
                for j, w in enumerate(shared):
                    probs = (x.double() @ w.T).softmax(1)
                    onehot = torch.nn.functional.one_hot(y, 2).double()
                    steps.append(w - 0.4 * (resp[j][:, None] * (probs - onehot)).T @ x.double())
                updated.append(steps)
            shared = [sum(local_pi[c, j] * updated[c][j] for c in range(2)) / local_pi[:, j].sum()
                      for j in range(2)]  # fmt: skip
        chain = shared
        if averaging == "none":
            omega = shared
        else:
            omega = [(t * omega[j] + shared[j]) / (t + 1) for j in range(2)]
        new_pi = []
        for c, (x, y) in enumerate(samples):
            lik = torch.stack([torch.exp(-losses(w, x, y)) for w in omega])
            gradient = -(lik / (pi[c][:, None] * lik).sum(0, keepdim=True)).mean(1)
            weights = pi[c] * torch.exp(-0.9 * gradient)
            new_pi.append(weights / weights.sum())
        pi = torch.stack(new_pi)
        alg.step(samples)
        for j in range(2):
            assert torch.allclose(alg.components[j][0].double(), omega[j], atol=1e-5), t
        assert torch.allclose(alg.weights.double(), pi, atol=1e-5), t
    assert not torch.allclose(pi, torch.full((2, 2), 0.5, dtype=torch.float64), atol=1e-3)


def test_three_rounds_of_fedomd_over_clients_of_unequal_size_by_hand():
    """Three clients holding 1, 2 and 4 samples, two local steps, three rounds: the server
    averages the clients' models uniformly (θ_{t+1} = mean_c θ_{t,c}, not weighted by
    size), every local step restarts its gradient from the client's current model, and
    the L2 term λθ enters each step's gradient. Written in float64 numpy from the softmax
    cross-entropy's closed-form gradient (p − e_y)ᵀx / n."""
    import torch

    from lightning_fl.systems.fem_omd import FedOMD

    def network():
        return torch.nn.Linear(2, 3, bias=False)

    alg = FedOMD(network, lr=0.3, l2=0.2, local_steps=2, seed=4)
    rng = np.random.default_rng(9)
    theta = alg.params[0].double().numpy().copy()  # (3 classes, 2 features)
    for _ in range(3):
        samples = [(rng.normal(size=(n, 2)), rng.integers(0, 3, size=n)) for n in (1, 2, 4)]
        ends = []
        for x, y in samples:
            w = theta.copy()
            for _ in range(2):
                logits = x @ w.T
                p = np.exp(logits - logits.max(1, keepdims=True))
                p /= p.sum(1, keepdims=True)
                grad = (p - np.eye(3)[y]).T @ x / len(y) + 0.2 * w
                w = w - 0.3 * grad
            ends.append(w)
        theta = sum(ends) / 3
        alg.step([(torch.tensor(x, dtype=torch.float32), torch.tensor(y)) for x, y in samples])
        np.testing.assert_allclose(alg.params[0].double().numpy(), theta, atol=1e-5)


def test_mixture_densities_and_kl_by_hand():
    """log Σ_j π_j N(x; μ_j, I) in d = 2 with its (2π)^{-d/2} constant, written out per
    sample; responsibilities for a sample 40 units from every mean (the unstabilized
    exponentials underflow to 0/0); the Monte Carlo KL from the same replayed draws."""
    from lightning_fl.systems.fem_omd import mixture_log_density, sample_mixture

    weights, means = np.array([0.25, 0.75]), np.array([[0.0, 0.0], [2.0, -1.0]])
    x = np.array([[0.5, 0.5], [3.0, -2.0], [-1.0, 4.0]])

    def by_hand(w, mu, point):
        return math.log(sum(wj * _gauss(point, m) for wj, m in zip(w, mu)))

    expected = [by_hand(weights, means, p) for p in x]
    assert mixture_log_density(x, weights, means).tolist() == pytest.approx(expected)
    far = np.array([[40.0, 40.0]])
    d0, d1 = (far[0] - means[0]) @ (far[0] - means[0]), (far[0] - means[1]) @ (far[0] - means[1])
    ratio = 0.75 / 0.25 * math.exp(-0.5 * (d1 - d0))  # w_1 / w_0, by hand
    assert responsibilities(far, weights, means)[0].tolist() == pytest.approx(
        [1 / (1 + ratio), ratio / (1 + ratio)]
    )
    other_w, other_mu = np.array([0.6, 0.4]), np.array([[1.0, 0.0], [2.0, 1.0]])
    z = sample_mixture(weights, means, 50, np.random.default_rng(8))
    kl = np.mean([by_hand(weights, means, p) - by_hand(other_w, other_mu, p) for p in z])
    got = mixture_kl(weights, means, other_w, other_mu, np.random.default_rng(8), samples=50)
    assert got == pytest.approx(kl)


def test_settings_are_refused_below_and_accepted_at_the_ends_of_their_ranges():
    """Each bound alone: a rate of 0, a count of 0 and a negative λ are refused; a count of
    1, λ = 0 and a round with exactly K samples per client are accepted."""
    import torch

    from lightning_fl.systems.fem_omd import FedOMD, FemOmdClassifier

    with pytest.raises(ValueError, match="em_steps must be >= 1"):
        FemOmdGMM(np.zeros((2, 1)), 2, em_steps=0)
    alg = FemOmdGMM(np.array([[-1.0], [1.0]]), 1, em_steps=3)
    alg.step([np.array([[-1.0], [0.5], [2.0]])])  # n = K: one sample per batch
    assert alg.round == 1
    good = dict(component_lr=0.1, weight_lr=0.1, em_steps=1)
    for bad in (dict(component_lr=0.0), dict(weight_lr=0.0)):
        with pytest.raises(ValueError, match="component_lr and weight_lr must be > 0"):
            FemOmdClassifier(_linear, 1, 1, **{**good, **bad})
    for components, clients, steps in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            FemOmdClassifier(_linear, components, clients, **{**good, "em_steps": steps})
    one = FemOmdClassifier(_linear, 1, 1, **good)
    one.step([(torch.tensor([[1.0]]), torch.tensor([1]))])
    assert one.weights.tolist() == [[1.0]]
    for bad in (dict(lr=0.0), dict(l2=-1e-9), dict(local_steps=0)):
        with pytest.raises(ValueError, match="FedOMD needs lr > 0"):
            FedOMD(_linear, **bad)
    FedOMD(_linear, lr=0.1, l2=0.0, local_steps=1)


def test_classifier_and_fedomd_initializations_follow_their_seed_not_the_global_state():
    import torch

    from lightning_fl.systems.fem_omd import FedOMD, FemOmdClassifier

    torch.manual_seed(5)
    expected = [_linear().weight.detach().clone() for _ in range(3)]
    torch.manual_seed(123)  # whatever the caller's state was
    alg = FemOmdClassifier(_linear, 3, 2, seed=5)
    assert all(torch.equal(c[0], e) for c, e in zip(alg.components, expected))
    torch.manual_seed(123)
    assert torch.equal(FedOMD(_linear, seed=5).params[0], expected[0])


def test_played_class_probabilities_by_hand():
    """h_{t,c}(x) = Σ_j π_{c,j} softmax(W_j x) with each client's own π, and FedOMD's
    softmax(θ x)."""
    import torch

    from lightning_fl.systems.fem_omd import FedOMD, FemOmdClassifier

    alg = FemOmdClassifier(_linear, 2, 2, seed=1)
    alg.weights = torch.tensor([[0.2, 0.8], [0.9, 0.1]])
    x = torch.tensor([[1.5], [-0.5]])
    w = [comp[0].double() for comp in alg.components]
    soft = [torch.exp(x.double() @ wj.T) / torch.exp(x.double() @ wj.T).sum(1, keepdim=True)
            for wj in w]  # fmt: skip
    for c, (a, b) in enumerate(((0.2, 0.8), (0.9, 0.1))):
        expected = a * soft[0] + b * soft[1]
        assert torch.allclose(alg.predict_proba(c, x).double(), expected, atol=1e-6)
    fed = FedOMD(_linear, seed=2)
    logits = x.double() @ fed.params[0].double().T
    expected = torch.exp(logits) / torch.exp(logits).sum(1, keepdim=True)
    assert torch.allclose(fed.predict_proba(0, x).double(), expected, atol=1e-6)


def test_a_component_parameter_outside_the_loss_is_left_as_it_is():
    """A network with a parameter its forward never reads (a frozen branch): the EM step
    gets no gradient for it and must leave it unchanged rather than fail or move it."""
    import torch

    from lightning_fl.systems.fem_omd import FemOmdClassifier

    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(1, 2, bias=False)
            self.unused = torch.nn.Parameter(torch.tensor([0.25, -0.5]))

        def forward(self, x):
            return self.linear(x)

    alg = FemOmdClassifier(WithUnused, 2, 2, component_lr=0.5, em_steps=2, seed=3)
    before = [[p.clone() for p in comp] for comp in alg.components]
    samples = [(torch.tensor([[1.0], [-2.0]]), torch.tensor([0, 1])),
               (torch.tensor([[0.5]]), torch.tensor([1]))]  # fmt: skip
    alg.step(samples)
    moved, unused = alg.model.names.index("linear.weight"), alg.model.names.index("unused")
    for comp, old in zip(alg.components, before):
        assert not torch.equal(comp[moved], old[moved])
        assert torch.equal(comp[unused], old[unused])


def test_sample_mixture_normalizes_unnormalized_weights():
    """Weights (2, 6) draw components with probabilities (1/4, 3/4)."""
    from lightning_fl.systems.fem_omd import sample_mixture

    means = np.array([[0.0], [10.0]])
    got = sample_mixture(np.array([2.0, 6.0]), means, 40, np.random.default_rng(4))
    rng = np.random.default_rng(4)
    which = rng.choice(2, size=40, p=[0.25, 0.75])
    np.testing.assert_allclose(got, means[which] + rng.standard_normal((40, 1)))
