"""Federated learning from data streams: client caches and their update rules, the
discrepancy they leave, and the weighting rule of the data-streams analysis.

- Marfoq, Neglia, Kameni, Vidal, "Federated learning for data streams" (AISTATS 2023;
  Marfoq thesis §4.3): weighted ERM over the memories (Alg. 1, eqs. 3–5), the unbiased
  weighted minibatch gradient, and the configuration rule p̂* (Sec. 5, App. C, Eq. 204).
- Wang, Bian, Xu, "On the local cache update rules in streaming federated learning":
  FIFO, SRSR and DRSR (Sec. IV, eqs. 8–12) and the label discrepancy ψ_t.

These are the building blocks, pure functions and small classes over sample ids and
labels; a cache holds the ids of the samples it keeps.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import default_collate

# ---- caches (P2 §IV) ------------------------------------------------------------------


class Cache:
    """A client's memory of capacity C: ``update`` returns the sample ids and labels kept
    after a new batch arrives. Subclasses are the rules."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}.")
        self.capacity = capacity
        self.ids = np.zeros(0, dtype=np.int64)
        self.labels = np.zeros(0, dtype=np.int64)
        self.round = 0

    def update(self, ids: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> None:
        ids, labels = np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)
        if len(ids) > self.capacity:
            raise ValueError(
                f"a batch of {len(ids)} samples does not fit a cache of {self.capacity}: "
                "raise the capacity to at least the batch size."
            )
        self.round += 1
        self.ids, self.labels = self._replace(ids, labels, rng)

    def _replace(self, ids, labels, rng):
        raise NotImplementedError

    def label_distribution(self, num_classes: int) -> np.ndarray:
        """v_t: the cache's label frequencies."""
        counts = np.bincount(self.labels, minlength=num_classes).astype(float)
        return counts / max(len(self.labels), 1)


class FIFOCache(Cache):
    """First in, first out (P2 eq. 8; P1's rule): the newest samples evict the oldest."""

    def _replace(self, ids, labels, rng):
        ids = np.concatenate([self.ids, ids])[-self.capacity :]
        return ids, np.concatenate([self.labels, labels])[-self.capacity :]


class CurrentBatchCache(Cache):
    """The memory is the current batch only (P1's fresh clients)."""

    def _replace(self, ids, labels, rng):
        return ids, labels


class FixedCache(Cache):
    """Filled by the first batches, then never updated (P2's LAZY baseline: the initial
    cache is kept for good)."""

    def _replace(self, ids, labels, rng):
        if len(self.ids) + len(ids) > self.capacity:
            return self.ids, self.labels
        return np.concatenate([self.ids, ids]), np.concatenate([self.labels, labels])


class SelectiveReplacementCache(Cache):
    """SRSR(θ) (P2 §IV): per label r, the target count
    ñ_r = (1 − (B_s/B)θ)·n_r(L_{t−1}) + θ·n_r(S_t), rounded to integers summing to the
    kept total by largest remainders; then Case 1 (ñ_r ≤ n_r(S_t)): drop every cached
    label-r sample and insert ñ_r of the batch's, drawn without replacement; Case 2: drop
    n_r(L) + n_r(S) − ñ_r cached label-r samples at random (clamped at 0) and insert all
    of the batch's. Until the cache is first full, new samples are simply added (the
    initial cache is the first batches); a target above the supply keeps every sample.

    ``theta=None`` is DRSR: θ_t = B/(B_s t), so v_t is the running average of the
    batches' label distributions.

    Rounding: the recursion of eqs. 11, 13 and 16 runs on the real-valued targets ñ_r,
    carried from round to round (:attr:`targets`); only the samples kept are rounded.
    Rounding the recursion itself (ñ_r from the cache's integer counts) freezes DRSR once
    the change θ_t·(n_r(S) − (B_s/B)·n_r(L)) falls below half a sample, about t > 2B/B_s
    rounds: a cache of 24 fed 6 samples a round stopped following a stream that changed
    halfway (a label share of 0.54 after 40 rounds against the running average's 0.77).
    The paper's analysis (v_t = ñ/B, eq. 13; Prop. 3) is of the real-valued recursion.
    """

    def __init__(self, capacity: int, theta: float | None = 2 / 3) -> None:
        super().__init__(capacity)
        if theta is not None and not 0 <= theta <= 1:
            raise ValueError(f"SRSR theta must be in [0, 1], got {theta}.")
        self.theta = theta
        #: ñ_r of the last replacement, real-valued, by label (None while filling)
        self.targets: dict[int, float] | None = None

    def _replace(self, ids, labels, rng):
        if len(self.ids) + len(ids) <= self.capacity:  # filling the initial cache
            return np.concatenate([self.ids, ids]), np.concatenate([self.labels, labels])
        batch = len(ids)
        theta = self.capacity / (batch * self.round) if self.theta is None else self.theta
        if self.targets is None:  # the first replacement: the initial cache's counts
            held, counts = np.unique(self.labels, return_counts=True)
            self.targets = {int(r): float(n) for r, n in zip(held, counts)}
        classes = np.union1d(np.union1d(self.labels, labels), list(self.targets))
        classes = classes.astype(np.int64)
        cached = np.array([np.sum(self.labels == r) for r in classes], dtype=float)
        new = np.array([np.sum(labels == r) for r in classes], dtype=float)
        previous = np.array([self.targets.get(int(r), 0.0) for r in classes])
        real = np.maximum((1 - batch / self.capacity * theta) * previous + theta * new, 0.0)
        self.targets = {int(r): float(v) for r, v in zip(classes, real)}
        total = min(self.capacity, int(cached.sum() + new.sum()))
        targets = _round_to_total(real, total)
        keep_ids, keep_labels = [], []
        for r, target, n_cached, n_new in zip(classes, targets, cached, new):
            old, fresh = self.ids[self.labels == r], ids[labels == r]
            if target <= n_new:  # Case 1: only batch samples of label r
                kept = rng.choice(fresh, size=int(target), replace=False)
            else:  # Case 2: every batch sample, and the cached ones not dropped
                drop = min(int(max(n_cached + n_new - target, 0)), len(old))
                kept = np.concatenate([rng.choice(old, size=len(old) - drop, replace=False), fresh])
            keep_ids.append(np.asarray(kept, dtype=np.int64))
            keep_labels.append(np.full(len(kept), r, dtype=np.int64))
        return np.concatenate(keep_ids), np.concatenate(keep_labels)


def _round_to_total(values: np.ndarray, total: int) -> np.ndarray:
    """Integers with the given total, each the floor or ceiling of ``values`` scaled to
    that total (largest-remainder rounding)."""
    scaled = values * (total / values.sum()) if values.sum() > 0 else values
    floors = np.floor(scaled).astype(int)
    short = total - int(floors.sum())
    order = np.argsort(-(scaled - floors), kind="stable")
    floors[order[:short]] += 1
    return floors


def discrepancy(cached: np.ndarray, target: np.ndarray) -> float:
    """ψ_t = Σ_k Σ_r (v_t^{k,r} − π^{k,r})² (P2 §IV, per-slot discrepancy) for the clients'
    cache label distributions ``cached`` and long-term distributions ``target`` (K × R)."""
    return float(np.sum((np.asarray(cached) - np.asarray(target)) ** 2))


# ---- weighted ERM (P1 §3, Alg. 1) -------------------------------------------------------


def weighted_minibatch_coefficients(weights: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """The coefficients of Alg. 1's gradient g = (|I|/|ξ|) Σ_{j∈ξ} (λ_j/Σ_{j'} λ_j') ∇ℓ_j for
    the minibatch ``chosen`` (indices into the memory): unbiased for the weighted memory
    loss (eq. 3) when ξ is drawn uniformly without replacement."""
    weights = np.asarray(weights, dtype=float)
    if (weights < 0).any():
        raise ValueError("sample weights λ must be >= 0.")
    return len(weights) / len(chosen) * weights[chosen] / weights.sum()


def aggregation_weights(memory_mass: np.ndarray) -> np.ndarray:
    """p_m^(t) = Σ_j λ_m^(t,j) / Σ_{m'} Σ_j λ_{m'}^(t,j) (P1 eq. 5) from each client's
    λ-mass."""
    mass = np.asarray(memory_mass, dtype=float)
    if (mass < 0).any() or mass.sum() <= 0:
        raise ValueError("the clients' λ-masses must be >= 0 and not all 0.")
    return mass / mass.sum()


# ---- the configuration rule (P1 §5, App. C) ---------------------------------------------


def project_simplex(v: np.ndarray) -> np.ndarray:
    """The Euclidean projection onto the probability simplex (Duchi et al. 2008)."""
    v = np.asarray(v, dtype=float)
    u = np.sort(v)[::-1]
    cumulative = np.cumsum(u) - 1.0
    index = np.arange(1, len(v) + 1)
    rho = index[u - cumulative / index > 0][-1]
    return np.maximum(v - cumulative[rho - 1] / rho, 0.0)


def configuration_objective(p: np.ndarray, n: np.ndarray, fresh: np.ndarray, r: float) -> float:
    """ψ(p)/c1 up to a constant: sqrt(Σ_{fresh} p_m²) + r·sqrt(Σ_m p_m²/n_m) (Cor. 5.1)."""
    return float(np.sqrt(np.sum(p[fresh] ** 2)) + r * np.sqrt(np.sum(p**2 / n)))


def configuration_rule(
    n: np.ndarray, fresh: np.ndarray, r: float, steps: int = 20000
) -> np.ndarray:
    """p̂* = argmin over the simplex of sqrt(Σ_{fresh} p_m²) + r·sqrt(Σ_m p_m²/n_m) (P1's
    "Ours"), by projected subgradient descent with steps 1/√k from the Uniform weights
    p = n, keeping the best iterate. ``n`` are the clients' shares n_m = N_m/N of all the
    samples they collect, ``fresh`` marks the fresh clients. r ≫ 1 gives Uniform, r ≪ 1
    Historical (p_hist = 1)."""
    if not r > 0:
        raise ValueError(f"the ratio r = c2/c1 must be > 0, got {r}.")
    n = np.asarray(n, dtype=float)
    fresh = np.asarray(fresh, dtype=bool)
    if n.shape != fresh.shape or not (n > 0).all() or not math.isclose(n.sum(), 1.0):
        raise ValueError(
            f"the shares n must be one positive value per client summing to 1 (got "
            f"{n.size} shares summing to {n.sum():.6g} for {fresh.size} fresh flags): "
            "pass counts / counts.sum() over the clients with samples."
        )
    p = n / n.sum()
    best, best_value = p.copy(), configuration_objective(p, n, fresh, r)
    scale = 1.0 / max(1.0, r)
    for k in range(1, steps + 1):
        fresh_norm = math.sqrt(float(np.sum(p[fresh] ** 2)))
        grad = np.zeros_like(p)
        if fresh_norm > 0:
            grad[fresh] = p[fresh] / fresh_norm
        grad += r * (p / n) / math.sqrt(float(np.sum(p**2 / n)))
        step = scale * 0.05 / math.sqrt(k) / max(float(np.linalg.norm(grad)), 1e-12)
        p = project_simplex(p - step * grad)
        value = configuration_objective(p, n, fresh, r)
        if value < best_value:
            best, best_value = p.copy(), value
    return best


def estimate_constants(
    module: torch.nn.Module,
    datasets: list,
    steps: int = 20,
    lr: float = 0.05,
    batch_size: int = 32,
    fraction: float = 0.2,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(B̂, Ĝ, D̂) of Eq. 204 from historical data (P1 App. C.6): for each dataset (a
    historical client's), ``steps`` SGD steps from the current model θ^(1) on a seeded
    ``fraction`` of its samples give θ̂*_m; D̂ = max_m ‖θ̂*_m − θ^(1)‖. The paper does not
    say how B and G are measured: here B̂ is the largest minibatch loss and Ĝ the largest
    minibatch gradient norm met on the way. The module's loss is ``loss_and_metrics``; its
    parameters are restored."""
    if steps < 1 or not 0 < fraction <= 1 or not lr > 0:
        raise ValueError("estimate_constants needs steps >= 1, fraction in (0, 1] and lr > 0.")
    params = [p for p in module.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    loss_bound = grad_bound = distance = 0.0
    rng = torch.Generator().manual_seed(seed)
    try:
        for data in datasets:
            if data is None or len(data) == 0:
                continue
            size = max(1, int(round(fraction * len(data))))
            part = torch.randperm(len(data), generator=rng)[:size]
            with torch.no_grad():
                torch._foreach_copy_(params, start)
            for _ in range(steps):
                order = part[torch.randperm(size, generator=rng)[: min(batch_size, size)]]
                batch = default_collate([data[int(i)] for i in order])
                loss = module.loss_and_metrics(batch)[0]
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
                loss_bound = max(loss_bound, float(loss))
                grad_bound = max(grad_bound, float(torch.cat([g.flatten() for g in grads]).norm()))
                with torch.no_grad():
                    torch._foreach_add_(params, grads, alpha=-lr)
            with torch.no_grad():
                moved = torch.cat([(p - s).flatten() for p, s in zip(params, start)]).norm()
            distance = max(distance, float(moved))
    finally:
        with torch.no_grad():
            torch._foreach_copy_(params, start)
    if distance == 0.0:
        raise ValueError("no historical data to estimate D from: give historical clients data.")
    return loss_bound, grad_bound, distance


def estimate_ratio(
    loss_bound: float, grad_bound: float, distance: float, dim: int, samples: int, fresh: int
) -> float:
    """ĉ2/ĉ1 ≈ (B + sqrt(d/N)) / (G·D·sqrt(M − M_hist)) (P1 App. C.6, Eq. 204)."""
    if min(loss_bound, grad_bound, distance, dim, samples, fresh) <= 0:
        raise ValueError("B, G, D, d, N and the number of fresh clients must be > 0.")
    return (loss_bound + math.sqrt(dim / samples)) / (grad_bound * distance * math.sqrt(fresh))
