"""The federated problem's training objective, measured on every client's training data
(the metrics of the asynchronous-FL experiments, Fraboni thesis §4.5)."""

from __future__ import annotations

import torch

from lightning_fl.engine import collectives
from lightning_fl.engine.plugins import FederatedCallback


class FederatedObjective(FederatedCallback):
    """Every ``every_n_rounds`` rounds, the global model's mean training loss L_i on each
    client's training data, logged as

    - ``fl/federated_loss``: Σ_i p_i L_i, the federated problem (thesis eq. 4.2);
    - ``fl/client_loss_std``: sqrt(Σ_i p_i (L_i − Σ_j p_j L_j)²), the spread across clients;
    - ``fl/surrogate_loss``: Σ_i q_i L_i with the stationary weights q of the problem the
      aggregator actually optimizes (eq. 4.10), when it has them
      (:class:`~lightning_fl.callbacks.AsynchronousFL`).

    p_i are the aggregator's target weights. Each rank evaluates the clients it owns; the
    losses are summed over ranks. Costs one forward pass over all training data.
    """

    requires_task_loss = True

    supports_vectorized_clients = True

    def __init__(self, every_n_rounds: int = 1) -> None:
        if every_n_rounds < 1:
            raise ValueError(f"every_n_rounds must be >= 1, got {every_n_rounds}.")
        self.every_n_rounds = every_n_rounds

    def client_losses(self, trainer, pl_module) -> torch.Tensor:
        """L_i(θ) for every client (0 for clients without training data)."""
        counts = self.view.sample_counts
        clients = [c for c, n in enumerate(counts) if n > 0]
        return client_training_metrics(trainer, pl_module, clients)[0]

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        last = trainer.current_epoch + 1 >= trainer.max_epochs
        if (trainer.current_epoch + 1) % self.every_n_rounds and not last:
            return
        losses = self.client_losses(trainer, pl_module)
        aggregator = self.view.aggregator
        p = aggregator.target_weights(self.view.sample_counts)
        federated = float(p @ losses)
        spread = float(p @ (losses - federated) ** 2) ** 0.5
        sync = trainer.world_size > 1  # the losses are summed over ranks: equal everywhere
        pl_module.log("fl/federated_loss", federated, on_epoch=True, sync_dist=sync)
        pl_module.log("fl/client_loss_std", spread, on_epoch=True, sync_dist=sync)
        if hasattr(aggregator, "surrogate_weights"):
            q = torch.zeros_like(p)
            q[aggregator.clients] = torch.as_tensor(aggregator.surrogate_weights(), device=q.device)
            pl_module.log("fl/surrogate_loss", float(q @ losses), on_epoch=True, sync_dist=sync)


@torch.no_grad()
def client_training_metrics(
    trainer, pl_module, clients: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's mean loss and accuracy (its ``acc`` metric, NaN without one) on each
    of ``clients``' training data; vectors over all clients, 0 elsewhere. Each rank
    evaluates the clients it owns; the results are summed over ranks."""
    strategy, dm = trainer.strategy, trainer.datamodule
    n_all = dm.num_clients
    sums = torch.zeros(2, n_all, dtype=torch.float64, device=pl_module.device)
    was_training = pl_module.training
    pl_module.eval()
    for client in clients:
        if strategy.owner(client) != trainer.global_rank:
            continue
        dataset = dm.client_dataset(client, "train")
        seen = 0
        for batch in dm.client_dataloader(dataset, "val"):
            batch = strategy.batch_to_device(batch)
            loss, metrics = pl_module.loss_and_metrics(batch)
            size = pl_module.batch_size_of(batch)
            accuracy = metrics.get("acc", float("nan"))
            sums[0, client] += float(loss) * size
            sums[1, client] += float(accuracy) * size
            seen += size
        sums[:, client] /= max(seen, 1)
    pl_module.train(was_training)
    if (group := collectives.across_ranks(trainer.world_size)) is not None:
        group.all_reduce(sums)
    return sums[0].cpu(), sums[1].cpu()
