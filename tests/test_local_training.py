"""The client-side helpers personalization callbacks train with outside the user's loop
(:mod:`lightning_fl.engine.local_training`): modes, loaders, plain SGD and personal copies,
each against values written by hand."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_fl.datamodules import InMemoryFederatedDataModule
from lightning_fl.engine.client_store import ClientStore
from lightning_fl.engine.local_training import (
    PersonalModels,
    client_loader,
    evaluation_mode,
    grads_at,
    sgd,
    task_loss,
    training_mode,
)
from lightning_fl.engine.tensors import FederatedTensors
from tests.helpers import tiny_module


@pytest.mark.parametrize("start_training", [True, False])
def test_the_modes_switch_and_restore_the_modules_mode_and_autograd(start_training):
    module = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    module.train(start_training)
    with torch.inference_mode():
        with training_mode(module):
            assert module.training and module[1].training and torch.is_grad_enabled()
            assert not torch.is_inference_mode_enabled()
        assert module.training == start_training
    with evaluation_mode(module):
        assert not module.training and not module[1].training and not torch.is_grad_enabled()
    assert module.training == start_training


def test_client_loader_is_none_without_data_and_a_loader_from_one_sample():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 6, generator=g), torch.arange(5) % 3
    clients = [
        {"train": (x, y), "val": (x[:1], y[:1])},
        {"train": (x, y), "val": (x[:0], y[:0])},
        {"train": (x, y)},
    ]
    trainer = SimpleNamespace(datamodule=InMemoryFederatedDataModule(clients, batch_size=2))
    (batch,) = list(client_loader(trainer, 0, "val"))
    assert torch.equal(batch[0], x[:1])
    assert client_loader(trainer, 1, "val") is None and client_loader(trainer, 2, "val") is None
    shuffled = [
        b[1].tolist() for b in client_loader(trainer, 0, "train", shuffle_seed=(3, "personal", 7))
    ]
    assert sorted(sum(shuffled, [])) == [0, 0, 1, 1, 2] and len(shuffled) == 3


def test_task_loss_refuses_a_module_without_loss_and_metrics():
    with pytest.raises(TypeError, match="LightningModule has no loss_and_metrics"):
        task_loss(pl.LightningModule(), None)


def test_sgd_by_hand_counts_its_steps_and_leaves_unused_and_other_parameters():
    """Two epochs over batches of 2 and 1: 4 steps of θ ← θ − lr(∇L + g_extra) on the
    last layer only; a parameter the loss does not use gets a zero gradient."""
    module = tiny_module()
    module.unused = nn.Parameter(torch.ones(3))
    head = module.network.net[-1]
    params = [head.weight, head.bias, module.unused]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 6, generator=g), torch.tensor([0, 2, 1])
    loader = [(x[:2], y[:2]), (x[2:], y[2:])]
    extra = [torch.full_like(p, 0.01) for p in params]
    reference = tiny_module()
    ref_params = [reference.network.net[-1].weight, reference.network.net[-1].bias]
    for _ in range(2):
        for bx, by in loader:
            loss = nn.functional.cross_entropy(reference.network(bx), by)
            grads = torch.autograd.grad(loss, ref_params)
            with torch.no_grad():
                for p, grad in zip(ref_params, grads):
                    p -= 0.1 * (grad + 0.01)
    first = module.network.net[1].weight.detach().clone()
    steps = sgd(module, params, loader, lr=0.1, epochs=2, extra_grad=lambda: extra)
    assert steps == 4
    for p, ref in zip(params, ref_params):
        assert torch.allclose(p, ref, atol=1e-6)
    assert torch.allclose(module.unused, torch.ones(3) - 4 * 0.1 * 0.01)
    assert torch.equal(module.network.net[1].weight, first)


def test_grads_at_other_values_restores_the_parameters_and_zeroes_unused_ones():
    module = tiny_module()
    module.unused = nn.Parameter(torch.ones(2))
    params = [*module.network.parameters(), module.unused]
    saved = [p.detach().clone() for p in params]
    values = [p.detach() * 0.5 for p in params]
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(4, 6, generator=g), torch.tensor([0, 1, 2, 0]))
    grads = grads_at(module, params, values, batch)
    half = tiny_module()
    with torch.no_grad():
        for p in half.parameters():
            p.mul_(0.5)
    loss = nn.functional.cross_entropy(half.network(batch[0]), batch[1])
    expected = torch.autograd.grad(loss, list(half.network.parameters()))
    for grad, ref in zip(grads, expected):
        assert torch.allclose(grad, ref, atol=1e-6)
    assert torch.equal(grads[-1], torch.zeros(2))
    assert all(torch.equal(p, s) for p, s in zip(params, saved))


def test_personal_models_save_load_and_say_when_a_client_has_none():
    module = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model, store, personal = FederatedTensors(module), ClientStore(), PersonalModels("mine")
    kept = model.clone()
    personal.save(store, 3, model)
    assert personal.has(store, 3) and not personal.has(store, 1)
    with torch.no_grad():
        for t in model.tensors:
            t.add_(1.0)
    changed = model.clone()
    assert personal.load(store, 1, model) is False
    assert all(torch.equal(a, b) for a, b in zip(model.tensors, changed))
    assert personal.load(store, 3, model) is True
    assert all(torch.equal(a, b) for a, b in zip(model.tensors, kept))


def test_client_loader_gives_plain_training_batches_where_training_data_carries_reference():
    """With WERM's reference data at the clients (``reference='client'``) the training
    loader pairs every batch with a reference batch; personalization's own passes train on
    the client's training data alone, so client_loader unwraps it: (x, y) batches of
    exactly the training samples."""
    import numpy as np

    from lightning_fl.datamodules import ReferenceDataModule

    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 3)).astype(np.float32)
    y = rng.integers(0, 2, size=60).astype(np.int64)
    dm = ReferenceDataModule(x, y, num_clients=2, reference="client", batch_size=4)
    dm.setup("fit")
    trainer = SimpleNamespace(datamodule=dm)
    train = dm.client_dataset(0, "train").train
    loader = client_loader(trainer, 0, "train", shuffle_seed=(3, "personal", 7))
    batches = list(loader)
    assert all(isinstance(b, (list, tuple)) and len(b) == 2 for b in batches)
    seen = torch.cat([b[0] for b in batches])
    expected = torch.stack([train[i][0] for i in range(len(train))])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, expected.tolist()))
