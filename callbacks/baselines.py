"""The two reference points of every FL table: Local (no communication) and Pooled
(centralized training on the union of the clients' data)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_fl.callbacks.aggregation import FedAvg
from lightning_fl.engine.local_training import PersonalModels
from lightning_fl.engine.plugins import Aggregator, RoundState, Weighting
from lightning_fl.engine.traits import Trait

STORE_KEY = "local_model"


class Local(Aggregator):
    """Each client trains its own model and never communicates.

    Every client keeps its model in the client store (one float32 vector of the model's
    size: 4·d bytes per client) and is evaluated on its own held-out data with it, so the
    per-client metrics are the Local baseline. The global model never changes, so unseen
    clients (which never train) are evaluated with the untrained initial model: their
    ``*/unseen/*`` metrics are chance level, not a Local result.
    """

    traits = {Trait.STEPS_OTHERWISE_THAN_FEDAVG: "", Trait.IGNORES_THE_UPDATE_SUM: ""}

    supports_vectorized_clients = True

    models = PersonalModels(STORE_KEY)

    def __init__(self, weighting: Weighting = "samples") -> None:
        super().__init__(weighting)
        self.add_client_state("model", key=STORE_KEY)  # the client's own model

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        self.models.load(state.store, client, state.model)

    def transform_update(self, trainer, pl_module, client: int, update, state: RoundState):
        """θ_i − θ_i^start, the client's own update (what SCAFFOLD's control variate and
        the samplers read), rather than the strategy's θ_i − θ^0."""
        return self.models.own_update(state.store, client, update, state.global_tensors)

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        self.models.save(state.store, client, state.model)

    def aggregate(self, trainer, pl_module, state: RoundState) -> None:
        """No communication: θ stays at its initial value."""

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        self.models.load(self.view.store, client, self.view.tensors)

    @torch.no_grad()
    def cross_evaluate(self, trainer: pl.Trainer, split: str = "test") -> dict[str, torch.Tensor]:
        """Every client's model on every client's ``split`` data, FLamby's protocol for its
        "Local i" baselines (du Terrail et al. 2022, §4): ``{metric: M}`` with ``M[i, j]``
        the metric of client i's model on client j's whole ``split`` set (one batch, as
        FLamby scores a C-index over a whole test set). FLamby reports row means,
        ``M[i].mean()``; the usual Local number (each model on its own data) is the
        diagonal. Rows of clients without a model are NaN. The global model is restored.
        """
        module, tensors = trainer.lightning_module, self.view.tensors
        to_device = trainer.strategy.batch_to_device
        dm = trainer.datamodule
        clients = range(dm.num_clients)
        data = {j: dm.client_dataset(j, split) for j in clients}
        data = {j: to_device(d[:]) for j, d in data.items() if d is not None and len(d)}
        saved = tensors.clone()
        table: dict[str, torch.Tensor] = {}
        try:
            for i in clients:
                if not self.models.load(self.view.store, i, tensors):
                    continue
                for j, batch in data.items():
                    loss, metrics = module.loss_and_metrics(batch)
                    for name, value in {"loss": loss, **metrics}.items():
                        n = dm.num_clients
                        # host: a table of Python floats for the report
                        grid = table.setdefault(name, torch.full((n, n), float("nan")))
                        grid[i, j] = float(value)
        finally:
            tensors.load_(saved)
        return table


class Pooled(FedAvg):
    """Centralized training: one virtual client holds the union of all clients' training
    data, takes part in every round and its model becomes the global model (ω = 1)."""

    traits = {Trait.STEPS_OTHERWISE_THAN_FEDAVG: "", Trait.NEEDS_EVERY_CLIENTS_DATA: ""}

    pools_clients = True

    def __init__(self) -> None:
        super().__init__(weighting="samples", server_lr=1.0)
