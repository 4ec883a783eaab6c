"""Decentralized FL: every client keeps its own model and averages it with its neighbours'
over a mixing matrix (Marfoq thesis §3.3 Alg. 8, D-FedEM; §2.1 eq. 2.2 for the general
gossip step)."""

from __future__ import annotations

import weakref
from collections import deque
from typing import Literal

import torch
from torch import Tensor

from lightning_fl.engine.local_training import PersonalModels
from lightning_fl.engine.plugins import Aggregator, RoundState
from lightning_fl.engine.seeding import generator
from lightning_fl.engine.tensors import flatten, unflatten
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.topology import SiloTopology

STORE_KEY = "gossip_model"


def erdos_renyi(num_nodes: int, edge_probability: float, seed: int) -> Tensor:
    """A connected G(n, p) adjacency matrix (bool, no self loops), redrawn from the same
    seeded stream until connected."""
    if not 0.0 < edge_probability <= 1.0:
        raise ValueError(f"edge_probability must be in (0, 1], got {edge_probability}.")
    g = generator(seed, "erdos_renyi", num_nodes)
    for _ in range(1000):
        # host: the overlay is drawn once from a CPU generator, the same on every device
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
    θ_t^k = Σ_s W_st θ_s^{k−½}, the consensus step of DPASGD (Marfoq thesis §2.1 eq. 2.2)
    and of D-FedEM (§3.5 Alg. 8, with :class:`~lightning_fl.callbacks.FedEM` and a
    MixtureClassifier).

    Every client with training data takes part in every round (use the default full
    participation) and keeps its own model in the client store (4·d bytes per client).
    The strategy's global model is set to the sample-weighted average Σ_t (n_t/n) θ_t, which
    unseen clients are evaluated with; seen clients are evaluated with their own model.

    Args:
        graph: ``"erdos_renyi"`` (the D-FedEM experiment of App. E.9, p = 0.5) or
            ``"complete"`` (uniform weights 1/N: FedAvg with full participation).
        edge_probability: p of the Erdős–Rényi graph.
        mixing_matrix: an explicit doubly stochastic W (a nested list), ``W[s][t]`` the weight
            client t gives client s; overrides ``graph``.
        topology: a :class:`~lightning_fl.systems.topology.SiloTopology`: W is the local-degree
            matrix of its overlay (eqs. 2.12–2.13; STAR averages at its orchestrator), and
            every round's simulated wall-clock time (eq. 2.4) is logged as ``fl/time``.
            Overrides ``graph`` and ``mixing_matrix``.
        step_scale: ``"samples"`` scales client t's learning rate by T·n_t/n, Alg. 8's
            local step (n_t/n)·η with the paper's η written as lr·T; ``"none"`` keeps it
            (DPASGD).
        seed: the graph's seed.

    Several processes: every rank trains its own clients; their models travel in the
    round's one all-reduce as an N×d matrix (each rank fills its clients' rows), so every
    rank mixes the same models and keeps the results of the clients it owns. That buffer
    costs 4·N·d bytes per rank, fine for cross-silo N.

    For the Erdős–Rényi graph the paper builds W with the fast-mixing Markov chain rule
    [BDX03], an SDP; this uses Metropolis–Hastings weights, which satisfy the same
    Assumption 15 on a connected graph.

    Vectorized clients: each row starts from its client's own model (``on_client_start``)
    and steps with its client's learning-rate factor (the stacked optimizer's
    ``lr_scale``), so a vectorized round equals the sequential one.
    """

    traits = {
        Trait.READS_EACH_UPDATE: "",
        Trait.IGNORES_THE_UPDATE_SUM: "",
        Trait.NEEDS_FULL_PARTICIPATION: "",
        Trait.STEPS_OTHERWISE_THAN_FEDAVG: "",
    }
    #: the clients' personal models, in the store under its own key, written for every
    #: client at the round's end: each client stays on its owner
    undeclared_client_state = "owner"

    supports_vectorized_clients = True

    def __init__(
        self,
        graph: Literal["erdos_renyi", "complete"] = "erdos_renyi",
        edge_probability: float = 0.5,
        mixing_matrix: list[list[float]] | None = None,
        topology: SiloTopology | None = None,
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
        self.topology = topology
        # host: W is checked and kept on the host; the mixing step moves it to the models
        self._given = None if mixing_matrix is None else torch.tensor(mixing_matrix).double()
        self.models = PersonalModels(STORE_KEY)
        self._lr_scale = 1.0
        self._hooked: weakref.WeakSet = weakref.WeakSet()
        self.add_round_rows("half_steps")  # θ_t^{k−½} of every client, summed over ranks
        self.add_server_state("mixing")  # W (host), built at the first fit's start
        self.add_server_state("nodes", [])  # the clients W's rows stand for
        self.add_server_state("clock", stateful=True)  # the topology's max-plus clock

    def on_fit_start(self, trainer, pl_module) -> None:
        counts = self.view.sample_counts
        nodes = [c for c, n in enumerate(counts) if n > 0]
        overlay = None
        if self.mixing is None:
            self.nodes = nodes
            if self.topology is not None:
                overlay, self.clock = self._topology(trainer)
                # host: W lives on the host, as _given
                self.mixing = torch.from_numpy(overlay.mixing_matrix())
            else:
                self.mixing = self._mixing_matrix()
        if self.topology is not None and self.clock is None:  # resumed: W is in the state
            _, self.clock = self._topology(trainer)
            self.restore_server_state("clock")
        self._hook_optimizers(trainer)

    def _mixing_matrix(self) -> Tensor:
        n = len(self.nodes)
        if self._given is not None:
            w = self._given
            if w.shape != (n, n):
                raise ValueError(
                    f"mixing_matrix is {tuple(w.shape)} but {n} clients have "
                    "training data: give one row and column per such client."
                )
            ones = torch.ones(n, dtype=w.dtype, device=w.device)
            if not (torch.allclose(w.sum(0), ones) and torch.allclose(w.sum(1), ones)):
                raise ValueError(
                    "mixing_matrix must be doubly stochastic (rows and columns sum to 1)."
                )
            return w.double()
        if self.graph == "complete":
            # host: W lives on the host, as _given
            return torch.full((n, n), 1.0 / n, dtype=torch.float64)
        return metropolis_weights(erdos_renyi(n, self.edge_probability, self.seed))

    def _topology(self, trainer):
        bits = 32.0 * sum(p.numel() for p in self.view.tensors.params)
        return self.topology.build(len(self.nodes), bits, self.view.config.local_steps)

    def on_round_start(self, trainer, pl_module, state: RoundState) -> None:
        if list(state.participation.clients) != self.nodes:  # the rows' order is W's
            raise ValueError(
                "GossipAveraging needs every client with training data in every round: use "
                "the default FullParticipation sampler."
            )
        # every client's half-step model, filled by the rank that trains it (its own model
        # stays if its update is dropped) and summed over ranks by the round's all-reduce
        global_flat = flatten(state.global_tensors)
        rows = state.round_rows(self, "half_steps")  # row t: client nodes[t]'s
        for row, client in enumerate(self.nodes):
            if trainer.strategy.owner(client) == trainer.global_rank:
                own = state.store.get(client, STORE_KEY)
                rows[row] = global_flat if own is None else own

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        self.models.load(state.store, client, state.model)
        self._lr_scale = self._step_factor(client, state)

    def _step_factor(self, client: int, state: RoundState) -> float:
        """Client t's learning-rate factor: T·n_t/n with ``step_scale="samples"``, else 1."""
        if self.step_scale != "samples":
            return 1.0
        counts = state.sample_counts
        return len(self.nodes) * int(counts[client]) / int(counts.sum())

    def on_vectorized_clients_start(self, trainer, pl_module, clients, state: RoundState) -> None:
        if self.step_scale == "samples":
            scale = [self._step_factor(c, state) for c in clients]
            state.scale_local_lr(scale)  # one Python factor per row

    def _hook_optimizers(self, trainer) -> None:
        """Scale the learning rate only inside each optimizer step (torch step pre- and
        post-hooks), so that LR schedulers, which Lightning steps before the round's last
        batch ends, never see the scaled value."""
        for optimizer in trainer.optimizers:
            if optimizer in self._hooked:
                continue
            self._hooked.add(optimizer)
            saved: list[float] = []

            def scale(opt, args, kwargs, saved=saved) -> None:
                saved[:] = [g["lr"] for g in opt.param_groups]
                for group in opt.param_groups:
                    group["lr"] *= self._lr_scale

            def restore(opt, args, kwargs, saved=saved) -> None:
                for group, lr in zip(opt.param_groups, saved):
                    group["lr"] = lr

            optimizer.register_step_pre_hook(scale)
            optimizer.register_step_post_hook(restore)

    def transform_update(self, trainer, pl_module, client: int, update, state: RoundState):
        """θ_t^{k−½} − θ_t^{k−1}, the client's own update (what SCAFFOLD's control variate
        reads), rather than the strategy's difference with the average model."""
        return self.models.own_update(state.store, client, update, state.global_tensors)

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        model = state.model.tensors
        state.round_rows(self, "half_steps")[state.row_of(client)] = flatten(
            [t.detach() for t in model]
        )

    def aggregate(self, trainer, pl_module, state: RoundState) -> None:
        self._lr_scale = 1.0
        half = state.round_rows(self, "half_steps").double()
        mixed = (self.mixing.T.to(half) @ half).to(state.global_tensors[0].dtype)
        for row, client in enumerate(self.nodes):  # row t: Σ_s W_st θ_s
            if trainer.strategy.owner(client) == trainer.global_rank:
                state.store.set(client, STORE_KEY, mixed[row].clone())
        counts = state.sample_counts[self.nodes]
        counts = torch.tensor(counts, dtype=torch.float64, device=half.device)
        average = (counts / counts.sum()) @ mixed.to(half)
        torch._foreach_copy_(
            state.global_tensors, unflatten(average.to(mixed.dtype), state.global_tensors)
        )
        if self.clock is not None:
            self.clock.advance()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.clock is not None:
            now = torch.tensor(float(self.clock.now), dtype=torch.float64, device=pl_module.device)
            sync = trainer.world_size > 1  # every rank runs the same clock
            pl_module.log("fl/time", now, on_epoch=True, batch_size=1, sync_dist=sync)

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        self.models.load(self.view.store, client, self.view.tensors)
