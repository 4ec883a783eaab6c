"""FedEM's synthetic mixture: the authors' generator reproduced exactly (checksums of
their data/synthetic/generate_data.py output), the corrected generator, the paper's
per-client test sets, and the one-logit binary mixture."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
import torch
from torch import nn

from lightning_fl import MixtureClassifier
from lightning_fl.datamodules import SyntheticMixtureDataModule
from lightning_fl.datamodules.synthetic import generate_mixture_tasks, iter_mixture_tasks

#: sha256 of (features float32 ‖ labels int64), training then test rows, of tasks 0, 1, 2
#: and 299 as written by the authors' generate_data.py --n_tasks 300 --n_test 5000
#: --seed 12345 (with their defaults: 3 components, d = 150, noise 0.1, alpha 0.4).
AUTHORS_SHA256 = {
    0: (86, "0891a348991846f6be8ce4a91e24e7d2cdbc578ba9e891882a48dd46e0915ba4"),
    1: (192, "43635cba0633074372f92a64b9df7c8515fe182ef484f66d4e5811fe07fdd1a6"),
    2: (69, "1a462f406ce50985f197edb7646347dd4fa325123de7e5c04d96fb5691433e91"),
    299: (358, "689f4c240660e6c6ef0ee83d69edca9312788b29fa8e8f3cdbe582c52a8614a8"),
}


def test_authors_generator_reproduces_their_files():
    seen, total, positives, capped = 0, 0, 0, 0
    for t, (x, y, n) in enumerate(iter_mixture_tasks(generator="authors")):
        assert len(y) == n + 5000  # the paper's 5,000 test samples per client
        total, positives, capped = total + n, positives + int(y[:n].sum()), capped + (n == 1000)
        if t in AUTHORS_SHA256:
            size, digest = AUTHORS_SHA256[t]
            assert n == size and hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest() == digest
            seen += 1
    assert seen == 4
    # the issue's figures for the authors' data: 67,758 samples, 17 clients at the cap,
    # 37.3% positives (their component loop forces about a quarter of the labels to 0)
    assert (total, capped) == (67_758, 17) and abs(positives / total - 0.3733) < 5e-4


def test_corrected_generator_labels_every_sample_by_its_component():
    tasks = generate_mixture_tasks(num_tasks=20, num_test=2000, noise_level=0.0, seed=3)
    x = np.concatenate(tasks.features).astype(np.float64)
    y = np.concatenate(tasks.labels)
    # with no noise every label is 1{xᵀθ*_z ≥ 0} for one of the M components
    explained = np.zeros(len(y), dtype=bool)
    for theta in tasks.components:
        explained |= (x @ theta >= 0).astype(np.int64) == y
    assert explained.all() and 0.45 < y.mean() < 0.55  # no forced zeros


def test_first_tasks_do_not_depend_on_how_many_are_taken():
    a = list(itertools.islice(iter_mixture_tasks(generator="corrected", num_tasks=50), 2))
    b = list(itertools.islice(iter_mixture_tasks(generator="corrected", num_tasks=50), 3))[:2]
    assert all(np.array_equal(p[0], q[0]) and np.array_equal(p[1], q[1]) for p, q in zip(a, b))


def test_per_task_test_sets():
    dm = SyntheticMixtureDataModule(num_tasks=10, num_test_per_task=300)
    assert dm.sample_counts("test") == [300] * 10
    shared = SyntheticMixtureDataModule(num_tasks=10, num_test=300)
    assert sum(shared.sample_counts("test")) == pytest.approx(300, abs=10)
    with pytest.raises(ValueError, match="generator must be"):
        generate_mixture_tasks(num_tasks=2, generator="theirs")


def test_one_logit_mixture_equals_the_two_logit_form_0_z():
    """A one-logit component z is the two-logit component [0, z] with its first row
    frozen at 0: the same mixture output, per-component BCE, E-step and gradients. (A
    free two-logit Linear also trains the first row, which doubles the step on the logit
    difference: the reason the paper recipe uses one logit.)"""
    torch.manual_seed(0)
    one = MixtureClassifier(nn.Linear(6, 1), num_components=2, lr=0.1)
    two = MixtureClassifier(nn.Linear(6, 2), num_components=2, lr=0.1)
    with torch.no_grad():
        for a, b in zip(one.network, two.network):
            b.weight.zero_(), b.bias.zero_()
            b.weight[1:].copy_(a.weight), b.bias[1:].copy_(a.bias)
    one.log_mixture_weights = two.log_mixture_weights = torch.log(torch.tensor([0.3, 0.7]))
    x, y = torch.randn(8, 6), torch.randint(0, 2, (8,))
    assert torch.allclose(one(x), two(x), atol=1e-6)
    z = torch.stack([h(x)[:, 0] for h in one.network], 1).detach()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        z, y[:, None].float().expand_as(z), reduction="none"
    )
    assert torch.allclose(one.component_losses(x, y), bce, atol=1e-6)
    q = torch.softmax(torch.log(torch.tensor([0.3, 0.7])) - bce, dim=1)  # E-step by hand
    for module in (one, two):
        module.responsibilities = lambda *_: q
        module.train()
        module.zero_grad()
        module.loss_and_metrics((x, y))[0].backward()
    for a, b in zip(one.network, two.network):
        assert torch.allclose(a.weight.grad, b.weight.grad[1:], atol=1e-6)
        assert torch.allclose(a.bias.grad, b.bias.grad[1:], atol=1e-6)


def _corrected_by_hand(num_tasks, num_components, dimension, alpha, noise, num_test, seed):
    """FedEM's synthetic mixture (App. I.1) as the corrected generator draws it from
    ``default_rng(seed)``: θ*_m ~ U[-1, 1]^d, π*_t ~ Dir(α 1_M), n_t = min(⌊lognormal(4, 2)⌋
    + 50, 1000), test sizes max(1, round(num_test · n_t / Σn)); then per task x ~ U[-1, 1]^d,
    z ~ π*_t, y = 1{xᵀθ*_z + σ ε ≥ 0}."""
    rng = np.random.default_rng(seed)
    theta = rng.uniform(-1.0, 1.0, size=(num_components, dimension))
    pi = rng.dirichlet([alpha] * num_components, size=num_tasks)
    n = [min(int(s) + 50, 1000) for s in rng.lognormal(4.0, 2.0, size=num_tasks)]
    test = [max(1, round(num_test * k / sum(n))) for k in n]
    tasks = []
    for t in range(num_tasks):
        x = rng.uniform(-1.0, 1.0, size=(n[t] + test[t], dimension))
        z = rng.choice(num_components, size=len(x), p=pi[t])
        logit = (x * theta[z]).sum(1) + noise * rng.standard_normal(len(x))
        tasks.append((x.astype(np.float32), (logit >= 0).astype(np.int64), n[t]))
    return theta, pi, tasks


def test_corrected_generator_by_hand():
    """Eight tasks, two of them at the 1,000 cap (seed 0), and test shares that round to 0
    for the small tasks (num_test = 10), so each keeps 1."""
    theta, pi, expected = _corrected_by_hand(8, 4, 5, 0.3, 0.7, 10, seed=0)
    tasks = generate_mixture_tasks(8, 4, 5, 0.3, 0.7, 10, seed=0)
    assert max(n for _, _, n in expected) == 1000 and tasks.train_sizes == [
        n for _, _, n in expected
    ]
    assert [len(y) - n for _, y, n in expected].count(1) >= 2
    np.testing.assert_allclose(tasks.components, theta)
    np.testing.assert_allclose(tasks.mixture_weights, pi)
    for (x, y, _), xs, ys in zip(expected, tasks.features, tasks.labels):
        np.testing.assert_array_equal(xs, x)
        np.testing.assert_array_equal(ys, y)
    assert all(type(n) is int for _, _, n in iter_mixture_tasks(3, 2, 4, generator="authors",
                                                                num_test_per_task=2))  # fmt: skip
    assert all(type(n) is int for _, _, n in iter_mixture_tasks(3, 2, 4))


@pytest.mark.parametrize("field", ["num_tasks", "num_components", "dimension"])
def test_sizes_of_one_are_accepted_and_zero_refused(field):
    sizes = {"num_tasks": 2, "num_components": 2, "dimension": 3}
    generate_mixture_tasks(**{**sizes, field: 1}, num_test=4)
    with pytest.raises(ValueError, match="must be >= 1"):
        generate_mixture_tasks(**{**sizes, field: 0}, num_test=4)


def test_datamodule_splits_each_task_by_hand():
    """Client t: its first n_t rows split into train and val with ``seed + 31 t``, the rest
    its test set; the last clients held out as unseen; the mixture read before setup."""
    from lightning_fl.datamodules.partition import split_fractions

    dm = SyntheticMixtureDataModule(num_tasks=5, num_components=2, dimension=4, num_test=50,
                                    val_fraction=0.3, unseen_fraction=0.4, seed=7)  # fmt: skip
    tasks = dm.tasks
    assert dm.hparams["val_fraction"] == 0.3 and dm.unseen_clients == [3, 4]
    assert tasks.train_sizes == generate_mixture_tasks(5, 2, 4, num_test=50, seed=7).train_sizes
    for t, (x, y) in enumerate(zip(tasks.features, tasks.labels)):
        n = tasks.train_sizes[t]
        fit, val = split_fractions(np.arange(n), (0.7, 0.3), 7 + 31 * t)
        for split, rows in (("train", fit), ("val", val), ("test", np.arange(n, len(y)))):
            xs, ys = dm.client_dataset(t, split)[:]
            assert torch.equal(xs, torch.from_numpy(x[rows])) and ys.tolist() == y[rows].tolist()
