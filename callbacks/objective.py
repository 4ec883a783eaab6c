"""The federated problem's training objective, measured on every client's training data
(the metrics of the asynchronous-FL experiments, Fraboni thesis §4.5)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_fl.callbacks.base import FederatedCallback
from lightning_fl.local_training import task_loss


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

    def __init__(self, every_n_rounds: int = 1) -> None:
        if every_n_rounds < 1:
            raise ValueError(f"every_n_rounds must be >= 1, got {every_n_rounds}.")
        self.every_n_rounds = every_n_rounds

    @torch.no_grad()
    def client_losses(self, trainer, pl_module) -> torch.Tensor:
        """L_i(θ) for every client (0 for clients without training data)."""
        strategy, dm = trainer.strategy, trainer.datamodule
        counts = strategy.training_counts
        losses = torch.zeros(len(counts), dtype=torch.float64, device=strategy.root_device)
        was_training = pl_module.training
        pl_module.eval()
        for client, n in enumerate(counts):
            if n == 0 or strategy.owner(client) != trainer.global_rank:
                continue
            loader = dm.client_dataloader(dm.client_dataset(client, "train"), "val")
            total = 0.0
            for batch in loader:
                batch = strategy.batch_to_device(batch)
                size = len(batch[-1]) if isinstance(batch, (list, tuple)) else n
                total += float(task_loss(pl_module, batch)) * size
            losses[client] = total / n
        pl_module.train(was_training)
        if dist.is_initialized() and trainer.world_size > 1:
            dist.all_reduce(losses)
        return losses.cpu()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        last = trainer.current_epoch + 1 >= trainer.max_epochs
        if (trainer.current_epoch + 1) % self.every_n_rounds and not last:
            return
        losses = self.client_losses(trainer, pl_module)
        aggregator = trainer.strategy.aggregator
        p = aggregator.target_weights(trainer.strategy.training_counts)
        federated = float(p @ losses)
        spread = float(p @ (losses - federated) ** 2) ** 0.5
        pl_module.log("fl/federated_loss", federated, on_epoch=True)
        pl_module.log("fl/client_loss_std", spread, on_epoch=True)
        if hasattr(aggregator, "surrogate_weights"):
            q = torch.zeros_like(p)
            q[aggregator.clients] = torch.as_tensor(aggregator.surrogate_weights())
            pl_module.log("fl/surrogate_loss", float(q @ losses), on_epoch=True)
