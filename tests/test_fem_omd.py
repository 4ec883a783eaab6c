"""FEM-OMD for Gaussian mixtures (Marfoq thesis §4.4, Alg. 15): one round by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_fl.fem_omd import FemOmdGMM, mixture_kl, responsibilities


def _normal(x, mu):
    return math.exp(-0.5 * (x - mu) ** 2) / math.sqrt(2 * math.pi)


def test_one_round_of_algorithm_15_by_hand():
    """C = 2 clients, m = 2 components in d = 1, K = 1: E-step, M-step, the server's
    weighted sync, the running average of the means and the OMD step."""
    means = np.array([[-1.0], [2.0]])
    samples = [np.array([[-1.5], [0.0], [2.5]]), np.array([[1.0], [3.0]])]
    alg = FemOmdGMM(means, num_clients=2, lr=0.5, em_steps=1, seed=3)
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
        weights = 0.5 * np.exp(-0.5 * gradient)
        expected_weights.append(weights / weights.sum())
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
