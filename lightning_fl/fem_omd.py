"""FEM-OMD for Gaussian mixtures: online federated learning with mixture models (Marfoq
thesis §4.4, App. H, Algorithm 15), as a plain simulation over clients that each play a
mixture and then receive samples of a mixture whose weights change every round.

Every mixture has unit covariance: P̌_ω = N(ω, I_d). The components' means ω are shared by
all clients; each client c has its own weights π_c.
"""

from __future__ import annotations

import math

import numpy as np


def log_gaussian(x: np.ndarray, means: np.ndarray) -> np.ndarray:
    """log N(x; μ_j, I_d) for every sample and component: [n, m]."""
    d = x.shape[1]
    squared = ((x[:, None, :] - means[None, :, :]) ** 2).sum(-1)
    return -0.5 * squared - 0.5 * d * math.log(2 * math.pi)


def responsibilities(x: np.ndarray, weights: np.ndarray, means: np.ndarray) -> np.ndarray:
    """E-step (eq. 4.34): w_{j,i} = π_j f_{μ_j}(x_i) / Σ_l π_l f_{μ_l}(x_i), as [n, m]."""
    logits = np.log(np.maximum(weights, 1e-300))[None, :] + log_gaussian(x, means)
    logits -= logits.max(axis=1, keepdims=True)
    w = np.exp(logits)
    return w / w.sum(axis=1, keepdims=True)


def mixture_log_density(x: np.ndarray, weights: np.ndarray, means: np.ndarray) -> np.ndarray:
    logs = np.log(np.maximum(weights, 1e-300))[None, :] + log_gaussian(x, means)
    top = logs.max(axis=1, keepdims=True)
    return (top + np.log(np.exp(logs - top).sum(axis=1, keepdims=True)))[:, 0]


def sample_mixture(
    weights: np.ndarray, means: np.ndarray, n: int, rng: np.random.Generator
) -> np.ndarray:
    components = rng.choice(len(weights), size=n, p=weights / weights.sum())
    return means[components] + rng.standard_normal((n, means.shape[1]))


def mixture_kl(
    true_weights: np.ndarray,
    true_means: np.ndarray,
    weights: np.ndarray,
    means: np.ndarray,
    rng: np.random.Generator,
    samples: int = 2000,
) -> float:
    """KL(true ‖ played) by Monte Carlo (the loss φ_{t,c} of eq. 4.24)."""
    z = sample_mixture(true_weights, true_means, samples, rng)
    return float(np.mean(mixture_log_density(z, true_weights, true_means)
                         - mixture_log_density(z, weights, means)))  # fmt: skip


class FemOmdGMM:
    """Algorithm 15. Each round t, given every client's n samples:

    1. local EM on K sample-split batches (eqs. 4.34–4.36), starting from the client's π_c
       and the shared means, with the server's weighted mean synchronisation after every
       EM step: μ̃_j = Σ_c π̃_{c,j} μ̃_{c,j} / Σ_c π̃_{c,j};
    2. the running average of the components, ω_{t+1} = (t ω_t + μ̃^(K+1)) / (t + 1);
    3. each client's mixture weights by online mirror descent with the negative entropy:
       π_{t+1,c,j} ∝ π_{t,c,j} exp(−η ∇̂_{t,c,j}), with the gradient estimate
       ∇̂_{t,c,j} = −mean_Z [P̌_{ω_{t+1,j}}(Z) / Σ_l π_{t,c,l} P̌_{ω_{t+1,l}}(Z)] over n draws
       Z ~ Σ_r π̃_{c,r} P̌_{ω_{t+1,r}} (eq. 4.41).

    Args:
        means: the initial component means ω_1 (m × d).
        num_clients: C.
        lr: η (theory: sqrt(log m)/(G sqrt(T))).
        em_steps: K (n must be at least K).
        seed: the Monte Carlo draws' seed.
    """

    def __init__(
        self, means: np.ndarray, num_clients: int, lr: float = 0.1, em_steps: int = 3, seed: int = 0
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}.")
        if em_steps < 1:
            raise ValueError(f"em_steps must be >= 1, got {em_steps}.")
        self.means = np.array(means, dtype=float)
        m = len(self.means)
        self.weights = np.full((num_clients, m), 1.0 / m)
        self.lr, self.em_steps = lr, em_steps
        self.round = 0
        self.rng = np.random.default_rng(seed)

    def step(self, samples: list[np.ndarray]) -> None:
        """One round, after every client has played (self.means, self.weights[c])."""
        if any(len(x) < self.em_steps for x in samples):
            raise ValueError(
                f"every client needs at least K = {self.em_steps} samples per round to split "
                "them into K batches: lower em_steps."
            )
        m = len(self.means)
        local_weights = self.weights.copy()
        shared = self.means.copy()
        batches = [np.array_split(x, self.em_steps) for x in samples]
        for k in range(self.em_steps):
            local_means = np.zeros((len(samples), m, shared.shape[1]))
            for c, parts in enumerate(batches):
                w = responsibilities(parts[k], local_weights[c], shared)
                local_weights[c] = w.mean(axis=0)
                mass = np.maximum(w.sum(axis=0), 1e-12)
                local_means[c] = (w.T @ parts[k]) / mass[:, None]
            totals = np.maximum(local_weights.sum(axis=0), 1e-12)
            shared = np.einsum("cj,cjd->jd", local_weights, local_means) / totals[:, None]
        t = self.round + 1
        self.means = (t * self.means + shared) / (t + 1)
        for c, x in enumerate(samples):
            z = sample_mixture(local_weights[c], self.means, len(x), self.rng)
            component = np.exp(log_gaussian(z, self.means))
            played = component @ self.weights[c]
            gradient = -(component / played[:, None]).mean(axis=0)
            logits = np.log(self.weights[c]) - self.lr * gradient
            logits -= logits.max()
            self.weights[c] = np.exp(logits) / np.exp(logits).sum()
        self.round += 1
