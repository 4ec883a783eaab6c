"""The two reference points of every FL table: Local (no communication) and Pooled
(centralized training on the union of the clients' data)."""

from __future__ import annotations

import torch

from lightning_fl.callbacks.aggregation import FedAvg
from lightning_fl.callbacks.base import Aggregator, RoundState
from lightning_fl.tensors import flatten, unflatten

STORE_KEY = "local_model"


class Local(Aggregator):
    """Each client trains its own model and never communicates.

    Every client keeps its model in the client store (one float32 vector of the model's
    size: 4·d bytes per client) and is evaluated on its own held-out data with it, so the
    per-client metrics are the Local baseline. The global model never changes, so unseen
    clients (which never train) are evaluated with the untrained initial model: their
    ``*/unseen/*`` metrics are chance level, not a Local result.
    """

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        self._load(trainer, state.store.get(client, STORE_KEY))

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        model = trainer.strategy.federated_tensors
        state.store.set(client, STORE_KEY, flatten(model.clone()))

    def aggregate(self, trainer, pl_module, state: RoundState) -> None:
        """No communication: θ stays at its initial value."""

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        self._load(trainer, trainer.strategy.client_store.get(client, STORE_KEY))

    @staticmethod
    @torch.no_grad()
    def _load(trainer, flat) -> None:
        if flat is not None:
            model = trainer.strategy.federated_tensors
            model.load_(unflatten(flat, model.tensors))


class Pooled(FedAvg):
    """Centralized training: one virtual client holds the union of all clients' training
    data, takes part in every round and its model becomes the global model (ω = 1)."""

    pools_clients = True

    def __init__(self) -> None:
        super().__init__(weighting="samples", server_lr=1.0)
