"""The stacked layers of a vectorized step (lightning_fl/engine/stacked_layers.py): the
clients' batches laid end to end through the task's own layers, each nn.Linear and
nn.Conv2d on its client's parameters, give every client the loss, metrics and gradient
it has alone; what cannot run that way is found, and the step stays vmapped."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap

from lightning_fl import Classifier
from lightning_fl.engine.stacked_layers import StackedLayers, agree, unstackable

ROWS, BATCH, CLASSES = 3, 5, 4


class _SmallCNN(nn.Module):
    """A convolution with stride, padding and groups, pooling, a custom forward that
    flattens by hand, a Linear without bias and one with."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2)
        self.pool = nn.MaxPool2d(2)
        self.hidden = nn.Linear(4 * 2 * 1, 6, bias=False)
        self.out = nn.Linear(6, CLASSES)

    def forward(self, x):
        h = self.pool(self.conv(x).relu())
        return self.out(self.hidden(h.view(h.shape[0], -1)).tanh())


class _PerPosition(nn.Module):
    """A Linear on 3-D inputs (each of a sample's 7 positions), then one on the flattened
    result."""

    def __init__(self) -> None:
        super().__init__()
        self.position = nn.Linear(1, 3)
        self.out = nn.Linear(21, CLASSES)

    def forward(self, x):
        return self.out(self.position(x.unsqueeze(-1)).flatten(1))


def _task(network: nn.Module) -> Classifier:
    torch.manual_seed(0)
    return Classifier(network=network)


def _cnn_task() -> Classifier:
    torch.manual_seed(0)
    return Classifier(network=_SmallCNN())


def _rows(task: Classifier, seed: int = 1) -> list[torch.Tensor]:
    """ROWS clients' parameters, each row its own."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.stack([p.detach() + 0.3 * torch.randn(p.shape, generator=g) for _ in range(ROWS)])
        for p in task.parameters()
    ]


def _batch(shape: tuple[int, ...], seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, BATCH, *shape, generator=g)
    return x, torch.randint(0, CLASSES, (ROWS, BATCH), generator=g)


class _LossOf(nn.Module):
    def __init__(self, task: Classifier) -> None:
        super().__init__()
        self.task = task

    def forward(self, batch):
        return self.task.loss_and_metrics(batch)


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: _task(nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, CLASSES))), (7,)),
        (_cnn_task, (2, 8, 4)),  # not square: height and width kept apart
        (lambda: _task(_PerPosition()), (7,)),
    ],
    ids=["mlp", "cnn", "linear_on_3d_inputs"],
)
@pytest.mark.parametrize("client_by_client", [False, True], ids=["long_batch", "by_client"])
def test_each_client_gets_its_own_loss_metrics_and_gradient(make, shape, client_by_client):
    """Three clients with their own parameters and batches, the third of them with 1 of
    its 5 samples its own (a padded short batch), the second with 3: each row's loss,
    accuracy and gradient equal that client's own, computed alone on its own samples;
    through the long batch and client by client (the CPU's form for convolutions)."""
    task = make()
    names = [n for n, _ in task.named_parameters()]
    stacked = StackedLayers(task, names, client_by_client=client_by_client)
    params = [p.clone().requires_grad_() for p in _rows(task)]
    x, y = _batch(shape)
    own = [BATCH, 3, 1]
    mask = torch.tensor([[k < n for k in range(BATCH)] for n in own])
    loss, metrics = stacked.losses(params, (x, y), mask)
    grads = torch.autograd.grad(loss.sum(), params)
    loss_module = _LossOf(task)
    names = [f"task.{n}" for n, _ in task.named_parameters()]
    for row, n in enumerate(own):
        leaves = [p[row].detach().clone().requires_grad_() for p in params]
        one_loss, one_metrics = functional_call(
            loss_module, dict(zip(names, leaves)), ((x[row, :n], y[row, :n]),)
        )
        assert float(loss[row].detach()) == pytest.approx(float(one_loss), rel=1e-5)
        assert float(metrics["acc"][row].detach()) == pytest.approx(float(one_metrics["acc"]))
        for g, leaf in zip(grads, torch.autograd.grad(one_loss, leaves)):
            torch.testing.assert_close(g[row], leaf, rtol=1e-4, atol=1e-6)
    # the layers are given back: the task runs alone again
    assert "forward" not in vars(task.network) and all(
        "forward" not in vars(m) for m in task.modules()
    )


@pytest.mark.parametrize("client_by_client", [False, True], ids=["long_batch", "by_client"])
def test_without_a_mask_each_client_averages_its_whole_batch(client_by_client):
    task = _task(nn.Sequential(nn.Linear(7, CLASSES)))
    names = [n for n, _ in task.named_parameters()]
    stacked = StackedLayers(task, names, client_by_client=client_by_client)
    params = _rows(task)
    x, y = _batch((7,))
    loss, _ = stacked.losses(params, (x, y), None)
    for row in range(ROWS):
        logits = x[row] @ params[0][row].T + params[1][row]
        expected = nn.functional.cross_entropy(logits, y[row])
        assert float(loss[row]) == pytest.approx(float(expected), rel=1e-6)


class _WithSpare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(7, CLASSES), nn.Linear(7, CLASSES)

    def forward(self, x):
        return self.used(x)


class _MixesSamples(nn.Module):
    """A layer without parameters that mixes a batch's samples: not per sample."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


class _MixesGradients(nn.Module):
    """Per sample in value (a sum minus itself), but not in its gradient."""

    def forward(self, x):
        total = x.sum(dim=0, keepdim=True)
        return x + (total - total.detach())


class _BatchLoss(Classifier):
    """Per-sample losses, and a metric that is its batch's mean loss for every sample:
    right on one client, not on clients laid end to end."""

    def loss_and_metrics(self, batch):
        loss, metrics = super().loss_and_metrics(batch)
        return loss, {**metrics, "batch_loss": loss}

    def sample_losses_and_metrics(self, batch):
        losses, metrics = super().sample_losses_and_metrics(batch)
        return losses, {**metrics, "batch_loss": losses.mean().expand_as(losses)}


def _vmapped(task: Classifier):
    names = [f"task.{n}" for n, _ in task.named_parameters()]
    loss_module = _LossOf(task)

    def one(params, batch):
        return functional_call(loss_module, dict(zip(names, params)), (batch,))

    return vmap(one, randomness="error")


def test_the_probe_keeps_per_sample_layers_and_finds_a_layer_that_mixes_samples():
    """Two clients that differ (parameters moved, samples reversed): a network of
    per-sample layers agrees with vmap; one that mixes the samples of its batch, in its
    values (of a layer or of a metric) or only in its gradient, does not on the long
    batch, and does client by client."""
    x, y = _batch((7,))
    one_batch = (x[0], y[0])
    fine = _task(nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, CLASSES)))
    names = [n for n, _ in fine.named_parameters()]
    params = list(fine.parameters())
    assert agree(StackedLayers(fine, names), _vmapped(fine), params, one_batch)
    torch.manual_seed(0)
    spare = _task(_WithSpare())  # a parameter the loss does not use: no gradient either way
    names = [n for n, _ in spare.named_parameters()]
    assert agree(StackedLayers(spare, names), _vmapped(spare), list(spare.parameters()), one_batch)
    networks = [
        nn.Sequential(nn.Linear(7, 5), _MixesSamples(), nn.Linear(5, CLASSES)),
        nn.Sequential(nn.Linear(7, 5), _MixesGradients(), nn.Linear(5, CLASSES)),
        nn.Sequential(_MixesSamples(), nn.Linear(7, 5), nn.Linear(5, CLASSES)),  # the input
    ]
    tasks = [_task(network) for network in networks]
    torch.manual_seed(0)
    tasks.append(_BatchLoss(nn.Sequential(nn.Linear(7, 5), nn.Linear(5, CLASSES))))
    for mixing in tasks:
        names = [n for n, _ in mixing.named_parameters()]
        params = list(mixing.parameters())
        assert not agree(StackedLayers(mixing, names), _vmapped(mixing), params, one_batch)
        # client by client, a layer that mixes samples sees its client's alone, as vmap
        by_client = StackedLayers(mixing, names, client_by_client=True)
        assert agree(by_client, _vmapped(mixing), params, one_batch)


class _WithScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(7, CLASSES)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.linear(x) * self.scale


@pytest.mark.parametrize(
    ("network", "reason"),
    [
        (nn.Sequential(nn.Linear(7, 5), nn.Linear(5, CLASSES)), None),
        (nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5)), "the module has buffers"),
        (
            nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5)),
            "the parameter network.1.weight is not an nn.Linear's or nn.Conv2d's",
        ),
        (_WithScale(), "the parameter network.scale is not an nn.Linear's or nn.Conv2d's"),
        (
            nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect")),
            "the nn.Conv2d of network.0.weight pads with 'reflect'",
        ),
    ],
    ids=["linear", "batchnorm", "layernorm", "bare_parameter", "reflect_padding"],
)
def test_what_has_no_stacked_form_is_named(network, reason):
    task = _task(network)
    assert unstackable(task, [n for n, _ in task.named_parameters()]) == reason
