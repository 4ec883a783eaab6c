"""Decentralized FL: every client keeps its own model and averages it with its neighbours'
over a mixing matrix (Marfoq thesis §3.3 Alg. 8, D-FedEM; §2.1 eq. 2.2 for the general
gossip step)."""

from __future__ import annotations

from collections import deque
from typing import Literal

import torch
from torch import Tensor

from lightning_fl.callbacks.base import Aggregator, RoundState
from lightning_fl.local_training import PersonalModels
from lightning_fl.seeding import generator
from lightning_fl.tensors import flatten, unflatten

STORE_KEY = "gossip_model"


def erdos_renyi(num_nodes: int, edge_probability: float, seed: int) -> Tensor:
    """A connected G(n, p) adjacency matrix (bool, no self loops), redrawn from the same
    seeded stream until connected."""
    if not 0.0 < edge_probability <= 1.0:
        raise ValueError(f"edge_probability must be in (0, 1], got {edge_probability}.")
    g = generator(seed, "erdos_renyi", num_nodes)
    for _ in range(1000):
        upper = torch.rand(num_nodes, num_nodes, generator=g, dtype=torch.float64)
        upper = torch.triu(upper < edge_probability, diagonal=1)
        adjacency = upper | upper.T
        if is_connected(adjacency):
            return adjacency
    raise ValueError(
        f"No connected Erdős–Rényi graph on {num_nodes} nodes with p={edge_probability} in "
        "1000 draws: raise edge_probability."
    )


def is_connected(adjacency: Tensor) -> bool:
    n = adjacency.shape[0]
    seen, frontier = {0}, deque([0])
    while frontier:
        node = frontier.popleft()
        for neighbour in torch.nonzero(adjacency[node]).flatten().tolist():
            if neighbour not in seen:
                seen.add(neighbour)
                frontier.append(neighbour)
    return len(seen) == n


def metropolis_weights(adjacency: Tensor) -> Tensor:
    """The Metropolis–Hastings mixing matrix: W_st = 1/(1 + max(d_s, d_t)) on edges and
    W_tt = 1 − Σ_s W_st; symmetric and doubly stochastic for any undirected graph."""
    degree = adjacency.sum(dim=1).double()
    pair = 1.0 / (1.0 + torch.maximum(degree[:, None], degree[None, :]))
    w = torch.where(adjacency, pair, torch.zeros_like(pair))
    return w + torch.diag(1.0 - w.sum(dim=1))


class GossipAveraging(Aggregator):
    """Replaces the server: after local training, client t's model becomes
    θ_t^k = Σ_s W_st θ_s^{k−½} (Alg. 8's consensus step), with W symmetric and doubly
    stochastic. With :class:`~lightning_fl.callbacks.FedEM` and a MixtureClassifier this is
    D-FedEM.

    Every client with training data takes part in every round (use the default full
    participation) and keeps its own model in the client store (4·d bytes per client).
    The strategy's global model is set to the sample-weighted average Σ_t (n_t/n) θ_t, which
    unseen clients are evaluated with; seen clients are evaluated with their own model.

    Args:
        graph: ``"erdos_renyi"`` (the D-FedEM experiment of App. E.9, p = 0.5) or
            ``"complete"``.
        edge_probability: p of the Erdős–Rényi graph.
        mixing_matrix: an explicit W (a nested list), which overrides ``graph``.
        step_scale: ``"samples"`` scales client t's learning rate by T·n_t/n, Alg. 8's
            local step (n_t/n)·η with the paper's η written as lr·T; ``"none"`` keeps it.
        seed: the graph's seed.

    The paper builds W with the fast-mixing Markov chain rule [BDX03], an SDP; this uses
    Metropolis–Hastings weights, which satisfy the same Assumption 15 on a connected graph.
    """

    def __init__(
        self,
        graph: Literal["erdos_renyi", "complete"] = "erdos_renyi",
        edge_probability: float = 0.5,
        mixing_matrix: list[list[float]] | None = None,
        step_scale: Literal["samples", "none"] = "samples",
        seed: int = 0,
    ) -> None:
        super().__init__(weighting="samples")
        if graph not in ("erdos_renyi", "complete"):
            raise ValueError(f"graph must be 'erdos_renyi' or 'complete', got {graph!r}.")
        if step_scale not in ("samples", "none"):
            raise ValueError(f"step_scale must be 'samples' or 'none', got {step_scale!r}.")
        self.graph, self.edge_probability, self.seed = graph, edge_probability, seed
        self.step_scale = step_scale
        self._given = None if mixing_matrix is None else torch.tensor(mixing_matrix).double()
        self.models = PersonalModels(STORE_KEY)
        self._half_step: dict[int, Tensor] = {}
        self._base_lrs: list[list[float]] = []
        self.mixing: Tensor | None = None
        self.nodes: list[int] = []

    def _build(self, state: RoundState) -> None:
        self.nodes = [c for c, n in enumerate(state.sample_counts) if n > 0]
        if self._given is not None:
            w = self._given
            if w.shape != (len(self.nodes), len(self.nodes)):
                raise ValueError(
                    f"mixing_matrix is {tuple(w.shape)} but {len(self.nodes)} clients have "
                    "training data: give one row and column per such client."
                )
            ones = torch.ones(len(w), dtype=w.dtype)
            if not (torch.allclose(w.sum(0), ones) and torch.allclose(w.sum(1), ones)):
                raise ValueError(
                    "mixing_matrix must be doubly stochastic (rows and columns sum to 1)."
                )
            self.mixing = w.double()
        elif self.graph == "complete":
            n = len(self.nodes)
            self.mixing = torch.full((n, n), 1.0 / n, dtype=torch.float64)
        else:
            adjacency = erdos_renyi(len(self.nodes), self.edge_probability, self.seed)
            self.mixing = metropolis_weights(adjacency)

    def on_round_start(self, trainer, pl_module, state: RoundState) -> None:
        if trainer.world_size > 1:
            raise ValueError(
                "GossipAveraging keeps every client's model on one process: run it with devices=1."
            )
        if self.mixing is None:
            self._build(state)
        if sorted(state.participation.clients) != self.nodes:
            raise ValueError(
                "GossipAveraging needs every client with training data in every round: use "
                "the default FullParticipation sampler."
            )
        self._half_step.clear()
        self._base_lrs = [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers]

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        self.models.load(state.store, client, trainer.strategy.federated_tensors)
        scale = 1.0
        if self.step_scale == "samples":
            counts = state.sample_counts
            scale = len(self.nodes) * counts[client] / sum(counts)
        for optimizer, lrs in zip(trainer.optimizers, self._base_lrs):
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr * scale

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        self._half_step[client] = flatten(trainer.strategy.federated_tensors.clone())

    def aggregate(self, trainer, pl_module, state: RoundState) -> None:
        for optimizer, lrs in zip(trainer.optimizers, self._base_lrs):
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr
        global_flat = flatten(state.global_tensors)
        # a dropped (NaN) update leaves that client's model where it was
        half = torch.stack([
            self._half_step.get(c, self._own_model(state, c, global_flat)) for c in self.nodes
        ]).double()  # fmt: skip
        mixed = (self.mixing.T.to(half) @ half).to(global_flat.dtype)  # row t: Σ_s W_st θ_s
        counts = torch.tensor([state.sample_counts[c] for c in self.nodes], dtype=torch.float64)
        for row, client in enumerate(self.nodes):
            state.store.set(client, STORE_KEY, mixed[row].clone())
        average = (counts / counts.sum()) @ mixed.double()
        torch._foreach_copy_(
            state.global_tensors, unflatten(average.to(global_flat.dtype), state.global_tensors)
        )
        self._half_step.clear()

    def _own_model(self, state: RoundState, client: int, global_flat: Tensor) -> Tensor:
        own = state.store.get(client, STORE_KEY)
        return global_flat if own is None else own

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        self.models.load(trainer.strategy.client_store, client, trainer.strategy.federated_tensors)

    def state_dict(self) -> dict:
        return {"mixing": self.mixing, "nodes": self.nodes}

    def load_state_dict(self, state_dict: dict) -> None:
        self.mixing, self.nodes = state_dict["mixing"], list(state_dict["nodes"])
