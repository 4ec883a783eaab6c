"""Client-side work that personalization callbacks run outside the user's training loop:
an E-step, a fine-tuning pass, a personal head's epochs, an unseen client's adaptation.

These run inside Lightning's hooks, including evaluation hooks where Lightning has turned
on inference mode; :func:`training_mode` turns autograd back on for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_fl.engine.client_store import ClientStore
from lightning_fl.engine.data_contract import PairedDataset, Split
from lightning_fl.engine.seeding import generator
from lightning_fl.engine.tensors import FederatedTensors, TensorList, flatten, unflatten


@contextlib.contextmanager
def training_mode(module: nn.Module) -> Iterator[None]:
    """Autograd on (also inside Lightning's evaluation inference mode) and ``module.train()``;
    the module's previous mode is restored on exit."""
    was_training = module.training
    with torch.inference_mode(False), torch.enable_grad():
        module.train()
        try:
            yield
        finally:
            module.train(was_training)


@contextlib.contextmanager
def evaluation_mode(module: nn.Module) -> Iterator[None]:
    """No autograd and ``module.eval()`` (dropout off, BatchNorm running statistics used)."""
    was_training = module.training
    with torch.no_grad():
        module.eval()
        try:
            yield
        finally:
            module.train(was_training)


def log_global_baseline(trainer: pl.Trainer, module: pl.LightningModule, client: int) -> None:
    """Log the current (global) model's loss and metrics on ``client``'s evaluation data
    as ``<stage>_global_<metric>`` (``val_global_acc``, ``val_global_loss``, ...), for a
    personalization plugin to call in ``on_client_evaluation_start``, before it installs
    the client's model: the report over clients then gives the global model's weighted,
    uniform and percentile values beside the personalized ones, over every rank's
    clients. One more pass over the client's evaluation data, through the module's
    ``loss_and_metrics``, summed as its own evaluation (``add_evaluation_sums``)."""
    stage = "test" if trainer.testing else "val"
    loader = client_loader(trainer, client, stage)
    if loader is None:
        return
    with evaluation_mode(module):
        for batch in batches(loader, module.device):
            loss, metrics = module.loss_and_metrics(batch)
            size = len(batch[-1])
            if hasattr(module, "add_evaluation_sums"):  # a FederatedTask: summed per client
                module.add_evaluation_sums(f"{stage}_global", loss, metrics, size)
                continue
            for name, value in {"loss": loss, **metrics}.items():  # as Lightning logs it
                module.log(f"{stage}_global_{name}", value, on_epoch=True, batch_size=size,
                           sync_dist=True)  # fmt: skip


def client_loader(
    trainer: pl.Trainer, client: int, split: Split, shuffle_seed: tuple | None = None
) -> DataLoader | None:
    """``client``'s ``split`` loader from the datamodule, or None when it has no data.

    With ``shuffle_seed`` (a tuple of seed parts, the run's seed first) the loader is a
    training loader shuffled by a generator derived from those parts; without it, the
    evaluation loader (fixed order). Training data that carries WERM reference data gives
    plain batches of the training data.
    """
    dm = trainer.datamodule
    dataset = dm.client_dataset(client, split)
    if dataset is None or len(dataset) == 0:
        return None
    if isinstance(dataset, PairedDataset):  # plain (x, y) batches of the training data
        dataset = dataset.train
    if shuffle_seed is None:
        return dm.client_dataloader(dataset, "val")
    return dm.client_dataloader(dataset, "train", generator(*shuffle_seed))


def batches(loader: DataLoader, device: torch.device) -> Iterator[Any]:
    for batch in loader:
        yield move_data_to_device(batch, device)


def task_loss(module: pl.LightningModule, batch: Any) -> Tensor:
    """The module's training loss on ``batch`` through ``loss_and_metrics`` (a
    :class:`~lightning_fl.models.FederatedTask`)."""
    if not hasattr(module, "loss_and_metrics"):
        raise TypeError(
            f"{type(module).__name__} has no loss_and_metrics(batch): personalization "
            "callbacks train outside training_step and need a lightning_fl.FederatedTask "
            "(Classifier, BinaryClassifier, ...) or a module with that method."
        )
    return module.loss_and_metrics(batch)[0]


def sgd(
    module: pl.LightningModule,
    params: list[nn.Parameter],
    loader: DataLoader,
    lr: float,
    epochs: int = 1,
    extra_grad: Callable[[], TensorList] | None = None,
) -> int:
    """``epochs`` passes of plain SGD on ``params`` with the module's loss:
    θ ← θ − lr (∇L(θ; batch) + extra_grad()). Other parameters are left unchanged.
    Returns the number of steps."""
    steps = 0
    with training_mode(module):
        for _ in range(epochs):
            for batch in batches(loader, module.device):
                grads = torch.autograd.grad(task_loss(module, batch), params, allow_unused=True)
                grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
                if extra_grad is not None:
                    torch._foreach_add_(grads, extra_grad())
                with torch.no_grad():
                    torch._foreach_add_(params, grads, alpha=-lr)
                steps += 1
    return steps


class PersonalModels:
    """One flat float32 copy of the module's federated tensors per client, in the client
    store under ``key`` (4·d bytes per client that has one)."""

    def __init__(self, key: str) -> None:
        self.key = key

    def has(self, store: ClientStore, client: int) -> bool:
        return store.get(client, self.key) is not None

    def save(self, store: ClientStore, client: int, model: FederatedTensors) -> None:
        store.set(client, self.key, flatten(model.clone()))

    def load(self, store: ClientStore, client: int, model: FederatedTensors) -> bool:
        """Load ``client``'s copy into ``model``; False (nothing loaded) if it has none."""
        flat = store.get(client, self.key)
        if flat is None:
            return False
        model.load_(unflatten(flat, model.tensors))
        return True

    @torch.no_grad()
    def own_update(
        self, store: ClientStore, client: int, update: TensorList, global_tensors: TensorList
    ) -> TensorList:
        """The update of a client that started from its copy rather than θ^t: the
        strategy's θ_i − θ^t plus θ^t − θ_i^start, i.e. θ_i − θ_i^start (``update`` itself
        for a client without a copy yet, which started from θ^t). Call it before the
        client's new model is saved."""
        flat = store.get(client, self.key)
        if flat is None:
            return update
        drift = flatten(global_tensors) - flat.to(global_tensors[0])
        return torch._foreach_add(update, unflatten(drift, update))


def grads_at(
    module: pl.LightningModule, params: list[nn.Parameter], values: TensorList, batch: Any
) -> TensorList:
    """∇L(values; batch): the module's loss gradient with ``params`` temporarily set to
    ``values`` (autograd on; the parameters are restored afterwards)."""
    saved = [p.detach().clone() for p in params]
    with torch.inference_mode(False), torch.enable_grad():
        with torch.no_grad():
            torch._foreach_copy_(params, values)
        try:
            grads = torch.autograd.grad(task_loss(module, batch), params, allow_unused=True)
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, saved)
    return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]
