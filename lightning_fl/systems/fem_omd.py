"""FEM-OMD: online federated learning with mixture models (Marfoq thesis §4.4, App. H),
as plain simulations over clients that each play a mixture and then receive samples of a
mixture whose weights change every round: Algorithm 15 for Gaussian mixtures
(:class:`FemOmdGMM`; unit covariance, P̌_ω = N(ω, I_d)), Algorithm 17 for classifiers
(:class:`FemOmdClassifier`), and the FedOMD baseline (:class:`FedOMD`). The components
ω are shared by all clients; each client c has its own weights π_c.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch


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


# ---------------------------------------------------------------------------- Alg. 17
class _Functional:
    """A network called with given parameters (``functional_call``), its names read once."""

    def __init__(self, network: torch.nn.Module) -> None:
        self.network = network
        self.names = [name for name, _ in network.named_parameters()]

    def logits(self, params, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.network, dict(zip(self.names, params)), (x,))

    def losses(self, params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """ℓ(h_ω(x_i), y_i) for every sample (cross-entropy)."""
        return torch.nn.functional.cross_entropy(self.logits(params, x), y, reduction="none")


class FemOmdClassifier:
    """FEM-OMD for discriminative models (Marfoq thesis §4.4.4, Algorithm 17), as a plain
    simulation. m components h_{ω_j} are shared by the clients; client c plays the mixture
    h_{t,c} = Σ_j π_{t,c,j} h_{ω_{t,j}} (the mixture of the components' class
    probabilities), then receives n samples and, each round t:

    1. K local EM steps from π̃^(1) = π_{t,c} and ω̃^(1) = ω_t, with P̌_ω(z) ∝ exp(−ℓ(h_ω; z)):
       E-step w_{j,i} ∝ π̃_j exp(−ℓ(h_{ω̃_j}; z_i)) (eq. 4.44), π̃_j = Σ_i w_{j,i}/n (4.45),
       one SGD step ω̃_{c,j} = ω̃_j − η_ω Σ_i w_{j,i} ∇ℓ(h_{ω̃_j}; z_i) (4.46), and the
       server's weighted synchronisation ω̃_j = Σ_c π̃_{c,j} ω̃_{c,j} / Σ_c π̃_{c,j} (line 10);
    2. the running average of line 12, ω_{t+1} = (t ω_t + ω̃^(K+1)) / (t + 1), printed with
       ω_{t+1} on the right; ``averaging`` chooses the reading (below);
    3. OMD with the negative entropy on each client's weights (lines 13–15):
       π_{t+1,c,j} ∝ π_{t,c,j} exp(−η_π ∇̂_{t,c,j}), ∇̂_{t,c,j} = −mean_i P̌_{ω_{t+1,j}}(z_i) /
       Σ_l π_{t,c,l} P̌_{ω_{t+1,l}}(z_i).

    Gaps the thesis leaves, filled here: the two learning rates are separate (η_ω for the
    components' SGD step, η_π for OMD; the thesis writes η for both); Approx_n in line 14
    is the mean over the client's n received samples (a discriminative P̌_ω cannot be
    sampled from), with ω_{t+1} in numerator and denominator as in Alg. 15; the
    components start from independent initializations (seeded).

    Args:
        make_network: builds one component network (logits for cross-entropy).
        num_components: m.
        num_clients: C.
        component_lr: η_ω.
        weight_lr: η_π (theory: sqrt(log m)/(G sqrt(T))).
        em_steps: K.
        seed: the components' initialization.
        averaging: the reading of lines 7 and 12 (issue 26 item 3):

            - ``"restart"``: ω_t on the right of line 12 (as in Alg. 15) and line 7's
              ω̃^(1)_t = ω_t: each round's SGD step starts from the played average, so the
              components' step is η_ω/(t + 1) and they stall after a few dozen rounds
              (the printed algorithm; for GMMs, Alg. 15, the K EM steps contract to the
              round's estimate whatever the start, and this average is of estimates);
            - ``"polyak"``: the SGD chain goes on from its own last synchronized iterate
              (ω̃^(1)_{t+1} = ω̃^(K+1)_t, the tilde index t + 1 of lines 10 and 12) and line
              12 averages the chain, ω_{t+1} = (t ω_t + ω̃_{t+1}) / (t + 1): the played
              components are the Polyak–Ruppert average of SGD iterates, the online-to-batch
              reading under which a discriminative component converges;
            - ``"none"``: the synchronized ω̃^(K+1) is played (an ablation; the same as
              ``"restart"`` with η_ω growing as t + 1).
    """

    def __init__(
        self,
        make_network,
        num_components: int,
        num_clients: int,
        component_lr: float = 0.05,
        weight_lr: float = 0.1,
        em_steps: int = 1,
        seed: int = 0,
        averaging: Literal["restart", "polyak", "none"] = "restart",
    ) -> None:
        if averaging not in ("restart", "polyak", "none"):
            raise ValueError(f"averaging must be 'restart', 'polyak' or 'none', got {averaging!r}.")
        if not component_lr > 0 or not weight_lr > 0:
            raise ValueError("component_lr and weight_lr must be > 0.")
        if em_steps < 1 or num_components < 1 or num_clients < 1:
            raise ValueError("em_steps, num_components and num_clients must be >= 1.")
        torch.manual_seed(seed)
        networks = [make_network() for _ in range(num_components)]
        self.network = networks[0]
        self.model = _Functional(self.network)
        self.components = [[p.detach().clone() for p in net.parameters()] for net in networks]
        device = self.components[0][0].device
        self.weights = torch.full(
            (num_clients, num_components), 1.0 / num_components, device=device
        )
        self.component_lr, self.weight_lr, self.em_steps = component_lr, weight_lr, em_steps
        self.averaging = averaging
        #: the SGD chain ω̃ that ``"polyak"`` averages (it starts at ω_1)
        self.chain = [[p.clone() for p in comp] for comp in self.components]
        self.round = 0

    def component_losses(self, components, x, y) -> torch.Tensor:
        """ℓ_j(z_i) for every component and sample: [m, n]."""
        return torch.stack([self.model.losses(p, x, y) for p in components])

    @torch.no_grad()
    def predict_proba(self, client: int, x: torch.Tensor) -> torch.Tensor:
        """The played model h_{t,c}(x) = Σ_j π_{t,c,j} softmax(h_{ω_{t,j}}(x))."""
        probs = [self.model.logits(p, x).softmax(-1) for p in self.components]
        return torch.einsum("j,jnk->nk", self.weights[client], torch.stack(probs))

    def step(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One round, after every client has played."""
        m = len(self.components)
        local_weights = self.weights.clone()
        start = self.chain if self.averaging == "polyak" else self.components
        shared = [[p.clone() for p in comp] for comp in start]  # line 7
        for _ in range(self.em_steps):
            local = []
            for c, (x, y) in enumerate(samples):
                params = [[p.detach().requires_grad_() for p in comp] for comp in shared]
                losses = self.component_losses(params, x, y)  # [m, n]
                with torch.no_grad():
                    log_w = local_weights[c].clamp_min(1e-30).log()[:, None] - losses
                    w = (log_w - log_w.logsumexp(dim=0, keepdim=True)).exp()  # (4.44)
                    local_weights[c] = w.mean(dim=1)  # (4.45)
                flat = [p for comp in params for p in comp]
                grads = torch.autograd.grad((w * losses).sum(), flat, allow_unused=True)
                updated, offset = [], 0
                for comp in params:  # (4.46)
                    size = len(comp)
                    updated.append([
                        (p - self.component_lr * (g if g is not None else 0)).detach()
                        for p, g in zip(comp, grads[offset : offset + size])
                    ])  # fmt: skip
                    offset += size
                local.append(updated)
            mass = local_weights.sum(dim=0).clamp_min(1e-30)  # line 10: weighted sync
            shared = [
                [sum(local_weights[c, j] * local[c][j][k] for c in range(len(samples))) / mass[j]
                 for k in range(len(shared[j]))]
                for j in range(m)
            ]  # fmt: skip
        self.chain = shared
        t = 0 if self.averaging == "none" else self.round + 1
        self.components = [
            [(t * old + new) / (t + 1) for old, new in zip(comp, comp_new)]
            for comp, comp_new in zip(self.components, shared)
        ]  # line 12
        with torch.no_grad():
            for c, (x, y) in enumerate(samples):  # lines 13–15
                log_p = -self.component_losses(self.components, x, y)  # log P̌_j up to a constant
                played = (self.weights[c].clamp_min(1e-30).log()[:, None] + log_p).logsumexp(0)
                gradient = -(log_p - played[None, :]).exp().mean(dim=1)
                logits = self.weights[c].clamp_min(1e-30).log() - self.weight_lr * gradient
                self.weights[c] = logits.softmax(dim=0)
        self.round += 1


class FedOMD:
    """The FedOMD baseline of the thesis (Mitra, Hassani, Pappas 2021) with the L2
    regularizer: with the Euclidean mirror map, online mirror descent is online gradient
    descent. Clients play the global model θ_t, receive their samples, take
    ``local_steps`` gradient steps on ℓ + (λ/2)‖θ‖² from θ_t, and the server averages:
    θ_{t+1} = mean_c θ_{t,c}."""

    def __init__(
        self, make_network, lr: float = 0.05, l2: float = 1e-4, local_steps: int = 1, seed: int = 0
    ) -> None:
        if not lr > 0 or l2 < 0 or local_steps < 1:
            raise ValueError("FedOMD needs lr > 0, l2 >= 0 and local_steps >= 1.")
        torch.manual_seed(seed)
        self.network = make_network()
        self.model = _Functional(self.network)
        self.params = [p.detach().clone() for p in self.network.parameters()]
        self.lr, self.l2, self.local_steps = lr, l2, local_steps

    @torch.no_grad()
    def predict_proba(self, client: int, x: torch.Tensor) -> torch.Tensor:
        return self.model.logits(self.params, x).softmax(-1)

    def step(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        total = [torch.zeros_like(p) for p in self.params]
        for x, y in samples:
            params = [p.clone() for p in self.params]
            for _ in range(self.local_steps):
                leaves = [p.requires_grad_() for p in params]
                loss = self.model.losses(leaves, x, y).mean()
                loss = loss + 0.5 * self.l2 * sum((p * p).sum() for p in leaves)
                grads = torch.autograd.grad(loss, leaves)
                params = [(p - self.lr * g).detach() for p, g in zip(leaves, grads)]
            total = [s + p for s, p in zip(total, params)]
        self.params = [s / len(samples) for s in total]
