"""Clustered FL (Sattler, Müller and Samek, IEEE TNNLS 2020, Alg. 1): recursive
bi-partitioning of the clients by the cosine similarity of their updates."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fl.engine.local_training import batches, client_loader, evaluation_mode, task_loss
from lightning_fl.engine.plugins import Aggregator, RoundState
from lightning_fl.engine.tensors import flatten, unflatten
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.samplers import FullParticipation


def cosine_similarities(updates: Tensor) -> Tensor:
    """α_ij = ⟨Δθ_i, Δθ_j⟩ / (‖Δθ_i‖‖Δθ_j‖) for the rows of ``updates``."""
    unit = updates / updates.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return unit @ unit.T


def complete_linkage_bipartition(similarity: Tensor) -> tuple[list[int], list[int]]:
    """Two clusters by agglomerative clustering with complete linkage on the distance
    −similarity, as the authors' code does (scikit-learn's AgglomerativeClustering); of
    equally close pairs of clusters, the first in index order merges."""
    n = similarity.shape[0]
    if n < 2:
        raise ValueError("Bi-partitioning needs at least 2 clients.")
    distance = -similarity.double()
    clusters: list[list[int]] = [[i] for i in range(n)]
    while len(clusters) > 2:
        best, pair = float("inf"), (0, 1)
        for a in range(len(clusters)):
            for b in range(a + 1, len(clusters)):
                link = float(distance[clusters[a]][:, clusters[b]].max())
                if link < best:
                    best, pair = link, (a, b)
        a, b = pair
        clusters[a] = sorted(clusters[a] + clusters[b])
        del clusters[b]
    return clusters[0], clusters[1]


class ClusteredFL(Aggregator):
    """One model per cluster of clients; a cluster is split in two when its clients have
    reached a stationary point of the joint objective but not of their own ones:
    ‖Σ_i w_i Δθ_i‖ < ε1 (mean update small) and max_i ‖Δθ_i‖ > ε2 (some update large),
    with more than 2 clients and after ``warmup_rounds`` rounds (the authors' code waits
    20). The split is the complete-linkage bipartition of the update similarities.

    Within a cluster, updates are averaged with sample weights n_i/Σ_{cluster} n (the
    authors' code averages uniformly; ``weighting="uniform"`` does that). Both halves of a
    split start from the cluster's current model. Seen clients are evaluated with their
    cluster's model; an unseen client joins the cluster whose model has the lowest loss on
    its validation data (its training data if it has none), as in the kNN-Per paper.

    Needs full participation and one process: the split compares every client's update.
    Cluster models live in this callback's checkpoint state (4·d bytes per cluster).
    """

    traits = {
        Trait.READS_EACH_UPDATE: "",
        Trait.IGNORES_THE_UPDATE_SUM: "",
        Trait.NEEDS_FULL_PARTICIPATION: "",
        Trait.STEPS_OTHERWISE_THAN_FEDAVG: "",
        Trait.DECIDES_THE_EVALUATED_MODEL: "keep one of them (ClusteredFL or the other)",
        Trait.COMPARES_UPDATES_IN_ONE_PLACE: "",
    }
    #: each client's cluster and update of the round, kept in the callback
    undeclared_client_state = "owner"

    supports_vectorized_clients = True  # no per-step hook: clients start and end as sequentially

    requires_task_loss = True

    def __init__(
        self,
        eps1: float = 0.4,
        eps2: float = 1.6,
        warmup_rounds: int = 20,
        weighting: str = "samples",
    ) -> None:
        super().__init__(weighting)
        if eps1 < 0 or eps2 < 0:
            raise ValueError("eps1 and eps2 must be >= 0.")
        self.eps1, self.eps2, self.warmup_rounds = eps1, eps2, warmup_rounds
        self.add_server_state("clusters", [])  # the clusters' member lists
        self.add_server_state("models", [])  # each cluster's model, flat
        self._updates: dict[int, Tensor] = {}

    def cluster_of(self, client: int) -> int | None:
        for index, members in enumerate(self.clusters):
            if client in members:
                return index
        return None

    def on_round_start(self, trainer, pl_module, state: RoundState) -> None:
        # two processes are refused at setup (composition.REFUSALS); a sampler of the
        # user's own is not named there
        if not isinstance(trainer.strategy.sampler, FullParticipation):
            raise ValueError(
                "ClusteredFL needs full participation: use the default FullParticipation sampler."
            )
        if not self.clusters:
            self.clusters = [[c for c, n in enumerate(state.sample_counts) if n > 0]]
            self.models = [flatten(state.global_tensors).clone()]
        self._updates.clear()

    def _load(self, trainer, cluster: int) -> None:
        model = self.view.tensors
        model.load_(unflatten(self.models[cluster].to(model.tensors[0].device), model.tensors))

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        self._load(trainer, self.cluster_of(client))

    def transform_update(self, trainer, pl_module, client: int, update, state: RoundState):
        """The update relative to the client's cluster model (the strategy measured it
        against the global model)."""
        cluster = unflatten(self.models[self.cluster_of(client)].to(update[0].device), update)
        shift = torch._foreach_sub(cluster, state.global_tensors)
        return torch._foreach_sub(update, shift)

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        self._updates[client] = flatten(update).clone()

    def aggregate(self, trainer, pl_module, state: RoundState) -> None:
        counts = state.sample_counts
        new_clusters: list[list[int]] = []
        new_models: list[Tensor] = []
        for members, model in zip(self.clusters, self.models):
            present = [c for c in members if c in self._updates]
            if not present:
                new_clusters.append(members)
                new_models.append(model)
                continue
            updates = torch.stack([self._updates[c] for c in present])
            if self.weighting == "uniform":
                weights = torch.full((len(present),), 1.0 / len(present), device=updates.device)
            else:
                weights = torch.tensor([float(counts[c]) for c in present], device=updates.device)
                weights = weights / weights.sum()
            mean_update = weights.to(updates) @ updates
            model = model + mean_update
            mean_norm = float(mean_update.norm())
            max_norm = float(updates.norm(dim=1).max())
            split = (
                mean_norm < self.eps1
                and max_norm > self.eps2
                and len(present) > 2
                and state.round_idx >= self.warmup_rounds
            )
            if split:
                first, second = complete_linkage_bipartition(cosine_similarities(updates))
                new_clusters += [[present[i] for i in first], [present[i] for i in second]]
                new_models += [model.clone(), model.clone()]
            else:
                new_clusters.append(members)
                new_models.append(model)
        self.clusters, self.models = new_clusters, new_models
        models = torch.stack(self.models)
        sizes = [float(sum(counts[c] for c in m)) for m in self.clusters]
        sizes = torch.tensor(sizes, device=models.device)
        average = (sizes / sizes.sum()).to(models) @ models
        torch._foreach_copy_(state.global_tensors, unflatten(average, state.global_tensors))
        self._updates.clear()

    def on_round_end(self, trainer, pl_module, state: RoundState) -> None:
        # after the round's last step: on_step would log it as num_clusters_step/_epoch
        clusters = float(len(self.clusters))
        pl_module.log("clustered_fl/num_clusters", clusters, on_step=False, on_epoch=True)

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        if not self.models:
            return
        cluster = self.cluster_of(client)
        if cluster is None:
            cluster = self._closest_cluster(trainer, pl_module, client)
        self._load(trainer, cluster)

    def _closest_cluster(self, trainer, module, client: int) -> int:
        loader = client_loader(trainer, client, "val") or client_loader(trainer, client, "train")
        if loader is None or len(self.models) == 1:
            return 0
        losses = []
        for index in range(len(self.models)):
            self._load(trainer, index)
            with evaluation_mode(module):
                total = sum(
                    float(task_loss(module, b)) * len(b[-1]) for b in batches(loader, module.device)
                )
            losses.append(total)
        return losses.index(min(losses))
