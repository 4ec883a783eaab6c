"""One vectorized local step of a chunk of clients (``FederatedStrategy(vectorize=True)``):
the clients' models stacked along a leading dimension (:class:`ClientChunk`), and
:class:`VectorizedStep`, which runs the user's ``loss_and_metrics(batch)`` under
``torch.func.vmap`` over them, takes every client's gradient in one backward pass, lets
the callbacks add their terms, clips each client's gradient and steps a stacked copy of
the module's optimizer. :mod:`lightning_fl.engine.vectorized` runs the chunks' life
cycle; the rules both keep are in its docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_map

from lightning_fl.engine.client_dropout import ClientDropout
from lightning_fl.engine.stacked_batches import batch_shape_key, batch_size_of, stack_batches
from lightning_fl.engine.stacked_layers import StackedLayers
from lightning_fl.engine.stacked_optimizer import StackedOptimizer, clip_gradients_
from lightning_fl.engine.tensors import TensorList
from lightning_fl.engine.vectorized_checks import not_vmappable, refuse


class _TaskLoss(nn.Module):
    """``functional_call`` target whose forward is the task's ``loss_and_metrics``; on a
    padded batch (``sample_mask``: which samples are the client's own), the means of its
    ``sample_losses_and_metrics`` over the client's own samples."""

    def __init__(self, task: nn.Module) -> None:
        super().__init__()
        self.task = task

    def forward(
        self, batch: Any, sample_mask: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        if sample_mask is None:
            return self.task.loss_and_metrics(batch)
        losses, metrics = self.task.sample_losses_and_metrics(batch)
        weights = sample_mask.to(losses.dtype)
        count = weights.sum()

        def mean(values: Tensor) -> Tensor:
            return (values * weights.to(values.dtype)).sum() / count.to(values.dtype)

        return mean(losses), {name: mean(values) for name, values in metrics.items()}


class ClientChunk:
    """The stacked models of a chunk of clients that train together.

    Args:
        clients: client ids, one per row.
        starts: each client's starting tensors (parameters, then floating buffers).
        num_params: how many of the tensors are parameters.
        generators: each client's generator (dropout masks, DP noise), or a function that
            makes them when first needed (most chunks never draw from them).
    """

    def __init__(
        self,
        clients: Sequence[int],
        starts: Sequence[TensorList],
        num_params: int,
        generators: Sequence[torch.Generator] | Callable[[], list[torch.Generator]],
    ) -> None:
        self.clients = list(clients)
        self.tensors = [torch.stack(column) for column in zip(*starts)]
        self.num_params = num_params
        self._generators = generators
        #: whether every row started from the same model (θ^t: :meth:`repeated`)
        self.shared_start = False

    @property
    def generators(self) -> list[torch.Generator]:
        """Each row's generator, made on first use."""
        if callable(self._generators):
            self._generators = self._generators()
        return list(self._generators)

    @classmethod
    def repeated(
        cls,
        clients: Sequence[int],
        start: TensorList,
        num_params: int,
        generators: Sequence[torch.Generator] | Callable[[], list[torch.Generator]],
    ) -> ClientChunk:
        """A chunk whose clients all start from ``start`` (θ^t): one copy per tensor."""
        chunk = cls.__new__(cls)
        chunk.clients, chunk.num_params = list(clients), num_params
        rows = len(chunk.clients)
        chunk.tensors = [t.unsqueeze(0).repeat(rows, *([1] * t.dim())) for t in start]
        chunk._generators = generators
        chunk.shared_start = True
        return chunk

    @property
    def params(self) -> TensorList:
        return self.tensors[: self.num_params]

    def row(self, index: int) -> TensorList:
        return [t[index] for t in self.tensors]


class VectorizedStep:
    """One local step of several clients at once: vmap of the task's loss over stacked
    parameters, one backward pass, the callbacks' gradient terms, per-client clipping and
    the stacked optimizer.

    Args:
        module: the FederatedTask (its parameters give names and order).
        param_names, buffer_names: the federated tensors' names, in order.
        optimizer: the stacked optimizer.
        gradient_terms: ``(rows, params, grads)``: adds the callbacks' per-step gradient
            terms to the stacked ``grads`` of chunk ``rows``, in place.
        clip: ``(value, "norm" | "value")`` per-client gradient clipping, or None.
    """

    def __init__(
        self,
        module: nn.Module,
        param_names: list[str],
        buffer_names: list[str],
        optimizer: StackedOptimizer,
        gradient_terms: Callable[[list[int], TensorList, list[Tensor | None]], None],
        clip: tuple[float, str] | None = None,
    ) -> None:
        self.loss_module = _TaskLoss(module)
        self.param_names = [f"task.{n}" for n in param_names]
        self.buffer_names = [f"task.{n}" for n in buffer_names]
        self.other_buffers = {
            f"task.{n}": b for n, b in module.named_buffers() if n not in set(buffer_names)
        }
        self.optimizer = optimizer
        self.gradient_terms, self.clip = gradient_terms, clip
        self.dropout = ClientDropout(module)
        #: the compiled loss and gradients (``compile=True``), or None: eager
        self.compiled: Any = None
        #: during the callbacks' gradient terms: the stacked batch of the rows being
        #: stepped and their generators (seeded per client as the sequential path seeds
        #: the global one), for callbacks whose gradient depends on the data (DP-SGD)
        self.batch: Any = None
        #: the rows' own samples in a padded :attr:`batch` (None: every sample is)
        self.sample_mask: Tensor | None = None
        self._stepping: tuple[ClientChunk, list[int] | None] | None = None
        #: per-client module state: one context factory per callback that has some, and
        #: the chunk's stacked tensors (set by the strategy at every chunk start)
        self.client_contexts: list[Callable[[list[Tensor]], Any]] = []
        self.client_state: list[list[Tensor]] = []
        #: the task's layers run on stacked parameters without vmap (set at set-up where
        #: they apply and agree with vmap: :mod:`lightning_fl.engine.stacked_layers`)
        self.stacked_layers: StackedLayers | None = None
        #: positions of the trainable parameters the loss does not use, found by the
        #: set-up probe (:meth:`check_runs`), for the compiled path, whose gradients are
        #: zeros for them; the eager path finds them at every step (no gradient)
        self.unused: set[int] = set()

    @property
    def generators(self) -> list[torch.Generator]:
        """The generators of the rows being stepped (seeded per client as the sequential
        path seeds the global one), made on first use."""
        if self._stepping is None:
            return []
        chunk, rows = self._stepping
        every = chunk.generators
        return every if rows is None else [every[r] for r in rows]

    def _client_loss(
        self,
        params: TensorList,
        buffers: TensorList,
        batch: Any,
        masks: list[Tensor] | None,
        client_state: list[list[Tensor]],
        sample_mask: Tensor | None = None,
    ):
        """One client's loss and metrics; ``masks``: its dropout masks (None: leave the
        dropout modules as they are, for the shape probe); ``client_state``: its rows of
        the callbacks' per-client tensors, installed by their contexts; ``sample_mask``:
        its own samples in a padded batch (None: every sample is)."""
        tensors = dict(zip(self.param_names, params))
        tensors.update(zip(self.buffer_names, buffers))
        tensors.update(self.other_buffers)
        with ExitStack() as stack:
            for context, rows in zip(self.client_contexts, client_state):
                stack.enter_context(context(rows))
            if masks is not None:
                stack.enter_context(self.dropout.applying(masks))
            return functional_call(self.loss_module, tensors, (batch, sample_mask))

    def check_runs(self, batch: Any) -> None:
        """Run the vmapped loss once, at setup, on two copies of the module's parameters
        and of ``batch`` (dropout as the identity), so that a loss that cannot run under
        vmap is refused before the first round rather than in it. The callbacks'
        per-client state is made at each chunk's start, so the probe runs without it. Its
        gradient finds the trainable parameters the loss does not use (:attr:`unused`)."""
        module = self.loss_module.task
        named = dict(module.named_parameters())
        named_buffers = dict(module.named_buffers())
        trainable = self.optimizer.trainable

        def pair(t: Tensor) -> Tensor:
            return t.detach().unsqueeze(0).expand(2, *t.shape)

        params = [
            pair(named[n[len("task.") :]]).clone().requires_grad_(j in trainable)
            for j, n in enumerate(self.param_names)
        ]
        buffers = [pair(named_buffers[n[len("task.") :]]).clone() for n in self.buffer_names]
        batches = stack_batches([batch, batch])
        try:
            with self.dropout._patched(lambda m, x: x), torch.enable_grad():
                probe = vmap(self._client_loss, in_dims=(0, 0, 0, None, None), randomness="error")
                loss, _ = probe(params, buffers, batches, None, [])
        except RuntimeError as err:
            raise not_vmappable(err) from err
        found = [None] * len(trainable)
        if loss.requires_grad:
            wanted = [params[j] for j in trainable]
            found = torch.autograd.grad(loss.sum(), wanted, allow_unused=True)
        self.unused = {j for j, g in zip(trainable, found) if g is None}

    def _dropout_masks(
        self,
        key: tuple,
        params: TensorList,
        buffers: TensorList,
        batch: Any,
        client_state: list[list[Tensor]],
    ) -> list[Tensor]:
        """The stacked rows' next dropout masks, drawn from their :attr:`generators` (none
        without dropout); the masks' shapes are probed once per batch shape ``key``."""
        if not self.dropout.active():
            return []
        first = tree_map(lambda t: t[0], batch)
        calls = self.dropout.shapes(
            key,
            lambda: self._client_loss(
                [p[0] for p in params], [b[0] for b in buffers], first, None,
                [[t[0] for t in tensors] for tensors in client_state],
            ),
        )  # fmt: skip
        return self.dropout.masks(calls, self.generators, params[0].dtype, params[0].device)

    def scale_lr(self, factors: list[float]) -> None:
        """Multiply row i's learning rate by ``factors[i]`` in the chunk's optimizer steps
        (``RoundState.scale_local_lr``)."""
        self.optimizer.lr_scale = factors

    def gradients_at(self, chunk: ClientChunk, rows: list[int], params: TensorList) -> TensorList:
        """The vectorized ``grads_at``: ∇ of each row's loss at its own stacked ``params``
        (every parameter), on the batch being stepped, with the rows' per-client state and
        new dropout masks drawn from their generators, the sequential path's next draws of
        the global RNG. For callbacks that take a second gradient per local step (APFL).
        Only from ``on_before_vectorized_optimizer_step``; refused for modules with
        running statistics, which a second forward pass would update."""
        if chunk.num_params < len(chunk.tensors):
            raise refuse(
                "a callback takes a second gradient at every local step, and the module has "
                "running statistics (BatchNorm) that this second forward pass would update "
                "per client. Use GroupNorm or LayerNorm."
            )
        index = torch.tensor(rows, device=params[0].device)
        client_state = [[t[index] for t in tensors] for tensors in self.client_state]
        batch = self.batch
        key = batch_shape_key(tree_map(lambda t: t[0], batch))
        masks = self._dropout_masks(key, params, [], batch, client_state)

        def loss(tensors, one_batch, one_masks, one_state, *own):
            return self._client_loss(tensors, [], one_batch, one_masks, one_state, *own)[0]

        own = () if self.sample_mask is None else (self.sample_mask,)  # vmap takes no None
        with torch.enable_grad():
            grads = vmap(torch.func.grad(loss), randomness="error")(
                [p.detach() for p in params], batch, masks, client_state, *own
            )
        return [g.detach() for g in grads]

    def __call__(
        self,
        chunk: ClientChunk,
        rows: list[int],
        batches: list[Any],
    ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """Train ``rows`` of ``chunk`` one step on ``batches`` (one per row). Returns the
        per-row losses, metrics and batch sizes, in the order of ``rows``."""
        groups: dict[tuple, list[int]] = {}
        for k, batch in enumerate(batches):
            groups.setdefault(batch_shape_key(batch), []).append(k)
        if len(groups) == 1:  # one shape: no regrouping of the outputs
            ((key, members),) = groups.items()
            loss, metric = self._group_step(
                chunk, rows, stack_batches(batches), key, self._rows_index(chunk, rows)
            )
            size = batch_size_of(batches[0])
            return loss, metric, torch.full((len(rows),), size, device=loss.device)
        losses = [None] * len(rows)
        metrics: list[dict[str, Tensor] | None] = [None] * len(rows)
        sizes = [0] * len(rows)
        for key, members in groups.items():
            group_rows = [rows[k] for k in members]
            stacked = stack_batches([batches[k] for k in members])
            index = self._rows_index(chunk, group_rows)
            loss, metric = self._group_step(chunk, group_rows, stacked, key, index)
            size = batch_size_of(batches[members[0]])
            for i, k in enumerate(members):
                losses[k] = loss[i]
                metrics[k] = {name: value[i] for name, value in metric.items()}
                sizes[k] = size
        names = metrics[0].keys() if metrics else ()
        return (
            torch.stack(losses),  # type: ignore[arg-type]
            {n: torch.stack([m[n] for m in metrics]) for n in names},  # type: ignore[index]
            torch.tensor(sizes, device=losses[0].device),  # type: ignore[union-attr]
        )

    def stacked(
        self,
        chunk: ClientChunk,
        rows: list[int],
        batch: Any,
        index: Tensor | None,
        sample_mask: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Train ``rows`` of ``chunk`` one step on their stacked ``batch`` (row k of every
        tensor: ``rows[k]``'s batch, all of one shape), drawn from the packed federation;
        ``index``: ``rows`` on the device, None for every row; ``sample_mask``: each row's
        own samples where short batches were padded. Returns the per-row losses and
        metrics (means over each row's own samples)."""
        key = tuple(t.shape[1:] for t in batch)
        return self._group_step(chunk, rows, batch, key, index, sample_mask)

    @staticmethod
    def _rows_index(chunk: ClientChunk, rows: list[int]) -> Tensor | None:
        """``rows`` as an index on the chunk's device, None when they are all its rows."""
        if rows == list(range(len(chunk.clients))):
            return None
        return torch.tensor(rows, device=chunk.tensors[0].device)

    def _group_step(self, chunk, group_rows, batch, key, index, sample_mask=None):
        tensors = chunk.tensors if index is None else [t[index] for t in chunk.tensors]
        trainable = set(self.optimizer.stepped)
        params = [
            t.detach().requires_grad_(j in trainable)
            for j, t in enumerate(tensors[: chunk.num_params])
        ]
        buffers = [t.detach() for t in tensors[chunk.num_params :]]
        self._stepping = (chunk, None if index is None else group_rows)
        client_state = [
            [t if index is None else t[index] for t in tensors] for tensors in self.client_state
        ]
        masks = self._dropout_masks(key, params, buffers, batch, client_state)
        if self.compiled is not None:
            loss, metrics, found = self.compiled(params, buffers, batch, key)
        else:
            if self.stacked_layers is not None and not masks and not self.client_contexts:
                loss, metrics = self.stacked_layers.losses(params, batch, sample_mask)
            else:
                try:
                    own = () if sample_mask is None else (sample_mask,)  # vmap takes no None
                    loss, metrics = vmap(self._client_loss, randomness="error")(
                        params, buffers, batch, masks, client_state, *own
                    )
                except RuntimeError as err:
                    raise not_vmappable(err) from err
            wanted = [params[j] for j in self.optimizer.stepped]
            found = torch.autograd.grad(loss.sum(), wanted, allow_unused=True)
        # a parameter the loss does not use has no gradient (None), as on the sequential
        # path, where torch's optimizer then leaves it alone (no decay, no momentum)
        grads: list[Tensor | None] = [None] * len(params)
        if self.compiled is not None:  # it differentiates every trainable parameter
            every = zip(self.optimizer.trainable, found)
            found = [None if j in self.unused else g for j, g in every if j in trainable]
        for j, g in zip(self.optimizer.stepped, found, strict=True):
            grads[j] = g
        self.batch, self.sample_mask = batch, sample_mask
        self.gradient_terms(group_rows, [p.detach() for p in params], grads)
        stepped = [grads[j] for j in self.optimizer.stepped]
        if self.clip is not None:
            clip_gradients_([g for g in stepped if g is not None], *self.clip)
        self.optimizer.step(chunk.params, stepped, group_rows, index)
        if index is not None:  # the rows' running statistics (BatchNorm), updated in place
            for full, rows in zip(chunk.tensors[chunk.num_params :], buffers):
                full[index] = rows
        return loss.detach(), {n: v.detach() for n, v in metrics.items()}


__all__ = ["ClientChunk", "VectorizedStep"]
