"""A chunk's clients through the module's own layers at once, without ``vmap``.

``torch.func.vmap`` runs any module over stacked parameters, but pays its dispatch on
every operation: for a small network it costs several times the step's arithmetic
(issue 78: a vmapped MLP step of 10 clients takes 0.85 ms where the same step written
with batched matrix products takes 0.24 ms). Here the clients' batches are laid end to
end (``[R·B, ...]``, client r's samples at rows ``r·B .. (r+1)·B``) and the task's
``sample_losses_and_metrics`` runs once on them, while each parameterized layer uses its
stacked copy: an ``nn.Linear`` as one batched product (``baddbmm``) per client block, an
``nn.Conv2d`` as one grouped convolution (the R clients' filters as R groups). Every
other layer acts sample by sample on the long batch (activations, pooling, flattening),
so each client's losses are its own; their means over each client's samples (its own
ones, where short batches are padded) are the clients' losses, and one backward pass of
their sum gives each client's gradient in its row, as under vmap.

A network with a convolution runs client by client on the CPU (``client_by_client``):
each client's block through the layers on its own row of parameters, cut to its own
samples. One client's activations stay in cache where R clients' long batch does not (a
20-client step of ``benchmarks/peers.py``'s CNN: 35.7 ms against 47.2 ms grouped), no work
goes to padding, and a layer that mixes a batch's samples sees its client's alone. On a
GPU the grouped convolution keeps the kernel launches per step constant in R.

Where it applies (:func:`unstackable` names why not): every parameter of the task
belongs to an ``nn.Linear`` or ``nn.Conv2d`` (zero padding), the task has no buffers, and
it gives per-sample losses. The set-up probe (:func:`agree`) then runs both ways on two
different clients and keeps this path only where the losses and gradients agree: a
layer that mixes samples (a batch mean) fails it and the step stays vmapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from operator import itemgetter
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_map

#: the layers with a stacked form: their parameters may have a client dimension
STACKED_LAYERS = (nn.Linear, nn.Conv2d)


def unstackable(task: nn.Module, param_names: Sequence[str]) -> str | None:
    """Why ``task``'s clients cannot run through its layers at once, or None."""
    if any(True for _ in task.buffers()):
        return "the module has buffers"
    owners = {}
    for name, module in task.named_modules():
        for own, _ in module.named_parameters(recurse=False):
            owners[f"{name}.{own}" if name else own] = module
    for name in param_names:
        layer = owners.get(name)
        if not isinstance(layer, STACKED_LAYERS):
            return f"the parameter {name} is not an nn.Linear's or nn.Conv2d's"
        if isinstance(layer, nn.Conv2d) and layer.padding_mode != "zeros":
            return f"the nn.Conv2d of {name} pads with {layer.padding_mode!r}"
    return None


class StackedLayers:
    """The task's ``nn.Linear`` and ``nn.Conv2d`` layers, run on stacked parameters.

    Args:
        task: the FederatedTask.
        param_names: the federated parameters' names, in the order of the stacked tensors.
    """

    def __init__(
        self, task: nn.Module, param_names: Sequence[str], client_by_client: bool = False
    ) -> None:
        self.task, self.client_by_client = task, client_by_client
        modules = dict(task.named_modules())
        self._slots: list[tuple[nn.Module, str]] = []
        for name in param_names:
            owner, _, attr = name.rpartition(".")
            self._slots.append((modules[owner], attr))
        #: each layer, its stacked forward ``(params, rows, x)`` and its forward on one
        #: client's parameters ``(params, x)``, found once
        self._layers = [
            (layer, _linear, _one_linear)
            if isinstance(layer, nn.Linear)
            else (layer, partial(_conv2d, layer), partial(_one_conv2d, layer))
            for layer in dict.fromkeys(layer for layer, _ in self._slots)
        ]

    @contextmanager
    def installed(self, params: Sequence[Tensor], rows: int | None) -> Iterator[None]:
        """Within: each layer's forward uses its stacked parameters (``params``, one row
        per client, every parameter of the task: :func:`unstackable` checked that each is
        a layer's) on a long batch of ``rows`` clients' blocks; with ``rows=None``, one
        client's parameters (no client dimension) on its own batch."""
        by_layer: dict[nn.Module, dict[str, Tensor]] = {layer: {} for layer, *_ in self._layers}
        for (layer, attr), value in zip(self._slots, params, strict=True):
            by_layer[layer][attr] = value
        for layer, stacked, one in self._layers:  # instance attributes, removed below
            bound = (by_layer[layer],) if rows is None else (by_layer[layer], rows)
            layer.forward = partial(one if rows is None else stacked, *bound)
        try:
            yield
        finally:
            for layer, *_ in self._layers:
                del layer.forward

    def losses(
        self, params: Sequence[Tensor], batch: Any, sample_mask: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Each client's mean loss and metrics over its own samples of the stacked
        ``batch`` (``[R, B, ...]`` per tensor), from the task's per-sample ones."""
        rows = params[0].shape[0]
        if self.client_by_client:
            return self._client_by_client(params, batch, rows, sample_mask)
        long_batch = tree_map(lambda t: t.reshape(-1, *t.shape[2:]), batch)
        with self.installed(params, rows):
            losses, metrics = self.task.sample_losses_and_metrics(long_batch)

        def mean(values: Tensor) -> Tensor:
            values = values.reshape(rows, -1)
            if sample_mask is None:
                return values.mean(dim=1)
            own = sample_mask.to(values.dtype)
            return (values * own).sum(dim=1) / own.sum(dim=1)

        return mean(losses), {name: mean(values) for name, values in metrics.items()}

    def _client_by_client(
        self, params: Sequence[Tensor], batch: Any, rows: int, sample_mask: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Each client's mean loss and metrics, its block through the layers on its own
        row of parameters (views of the stacked rows: one backward pass still gives every
        row its gradient), a padded block cut to the client's own samples (its first
        ones: :class:`~lightning_fl.engine.packed.StepGroup`), so no work goes to the
        padding. On the CPU a convolution's activations of one client's batch stay in
        cache, those of R clients' long batch do not: a 20-client step of the CNN shape
        (``benchmarks/peers.py``) took 35.7 ms client by client, 47.2 ms as one grouped
        convolution."""
        own = [p.unbind(0) for p in params]
        # host: the client-by-client form runs on the CPU, where the counts need no sync
        counts = None if sample_mask is None else sample_mask.sum(dim=1).tolist()
        losses, metrics = [], {}
        for r in range(rows):
            index = r if counts is None else (r, slice(counts[r]))
            one = tree_map(itemgetter(index), batch)
            with self.installed([p[r] for p in own], None):
                loss, values = self.task.sample_losses_and_metrics(one)
            losses.append(loss.mean())
            for name, value in values.items():
                metrics.setdefault(name, []).append(value.mean())
        return torch.stack(losses), {name: torch.stack(v) for name, v in metrics.items()}


def _one_linear(params: dict[str, Tensor], x: Tensor) -> Tensor:
    return F.linear(x, params["weight"], params.get("bias"))


def _one_conv2d(layer: nn.Conv2d, params: dict[str, Tensor], x: Tensor) -> Tensor:
    return F.conv2d(
        x, params["weight"], params.get("bias"), layer.stride, layer.padding, layer.dilation,
        layer.groups,
    )  # fmt: skip


def _linear(params: dict[str, Tensor], rows: int, x: Tensor) -> Tensor:
    """``x @ W_rᵀ + b_r`` for each client r's block of rows of ``x`` (any leading shape)."""
    weight, bias = params["weight"], params.get("bias")
    blocks = x.reshape(rows, -1, x.shape[-1])
    if bias is None:
        out = torch.bmm(blocks, weight.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.unsqueeze(1), blocks, weight.transpose(1, 2))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _conv2d(layer: nn.Conv2d, params: dict[str, Tensor], rows: int, x: Tensor) -> Tensor:
    """Client r's filters on its block of samples: one convolution with the clients'
    channels side by side and ``rows × groups`` groups."""
    weight, bias = params["weight"], params.get("bias")
    batch, channels, height, width = x.shape
    per_client = batch // rows
    side_by_side = (
        x.reshape(rows, per_client, channels, height, width)
        .transpose(0, 1)
        .reshape(per_client, rows * channels, height, width)
    )
    out = F.conv2d(
        side_by_side,
        weight.reshape(-1, *weight.shape[2:]),
        None if bias is None else bias.reshape(-1),
        layer.stride,
        layer.padding,
        layer.dilation,
        layer.groups * rows,
    )
    out_channels, out_h, out_w = out.shape[1] // rows, out.shape[2], out.shape[3]
    return (
        out.reshape(per_client, rows, out_channels, out_h, out_w)
        .transpose(0, 1)
        .reshape(batch, out_channels, out_h, out_w)
    )


def agree(
    stacked: StackedLayers,
    vmapped: Callable[[list[Tensor], Any], tuple[Tensor, dict[str, Tensor]]],
    params: Sequence[Tensor],
    batch: Any,
) -> bool:
    """Whether the stacked layers give ``vmapped``'s losses, metrics and gradients on
    two clients that differ: the first client's parameters and batch, and the same
    perturbed (the parameters and the batch's floating tensors moved by a seeded draw,
    its other tensors' samples in reverse)."""
    generator = torch.Generator().manual_seed(0)  # host: a fixed probe draw, then moved

    def moved(t: Tensor) -> Tensor:
        noise = torch.randn(
            t.shape, generator=generator, dtype=t.dtype
        )  # host: the seeded probe draw
        return t + 0.1 * noise.to(t.device)

    rows = [torch.stack([p.detach(), moved(p.detach())]) for p in params]
    batches = tree_map(
        lambda t: torch.stack([t, moved(t) if t.is_floating_point() else t.flip(0)]), batch
    )
    results = []
    for run in (vmapped, lambda p, b: stacked.losses(p, b, None)):
        with torch.enable_grad():
            leaves = [r.clone().requires_grad_(r.is_floating_point()) for r in rows]
            loss, metrics = run(leaves, batches)
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            grads = torch.autograd.grad(loss.sum(), wanted, allow_unused=True)
        results.append((loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results

    def close(a: Tensor | None, b: Tensor | None) -> bool:
        if a is None or b is None:
            return a is None and b is None
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-6)

    return (
        close(loss_a, loss_b)
        and metrics_a.keys() == metrics_b.keys()
        and all(close(metrics_a[k], metrics_b[k]) for k in metrics_a)
        and all(close(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    )


__all__ = ["STACKED_LAYERS", "StackedLayers", "agree", "unstackable"]
