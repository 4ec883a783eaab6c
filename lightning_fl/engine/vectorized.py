"""Vectorized clients: a round's participants train together, one local step of every
client per Lightning step, or ``local_steps_per_training_step`` of them
(``FederatedStrategy(vectorize=True)``).

The client models are stacked along a leading client dimension. Each step runs the
user's ``loss_and_metrics(batch)`` under ``torch.func.vmap`` with ``functional_call``
over the stacked parameters, takes every client's gradient with one backward pass of the
sum of the client losses (client c's loss depends only on row c, so row c of the gradient
is exactly its own), lets the callbacks add their gradient terms (FedProx, SCAFFOLD),
clips each client's gradient by its own norm and applies a stacked copy of the module's
optimizer (SGD with momentum, dampening, Nesterov and weight decay; Adam; AdamW) with
per-client state. The result equals the sequential path's, client by client:

- clients with fewer batches (``local_epochs`` with unequal data) stop taking steps: their
  rows are masked out of later steps, never fed fake data;
- a step whose clients' batches differ in shape (a smaller last batch) runs one vmap per
  shape; or, on packed data, when the task gives per-sample losses
  (``sample_losses_and_metrics``, e.g. :class:`~lightning_fl.Classifier`), one vmap: a
  short batch is padded with other samples of its client, weighted 0 in the loss, its
  metrics and its logged batch size (:attr:`VectorizedClients.pads_short_batches`);
- ``nn.Dropout`` draws its masks from a generator per client seeded with (seed, round,
  client), in the order the sequential path draws them from the global generator it seeds
  the same way, so dropout masks are the same on the CPU (on CUDA the sequential path
  uses a fused dropout kernel: the same distribution, not the same masks).

What a module must satisfy (checked at setup, refused with a message naming the fix):
it is a :class:`~lightning_fl.FederatedTask` (the loss lives in ``loss_and_metrics``),
its loss and metrics are tensor functions of the batch (no ``.item()``, ``float()`` or
Python control flow on tensor values), a BatchNorm has a momentum (its running statistics
are per-client stacked buffers, updated in place; ``momentum=None``'s step count is an
integer buffer the clients would share), its only randomness is
``nn.Dropout`` modules, and it overrides none of the per-step hooks (``training_step``,
``on_before_optimizer_step``, ...), which the vectorized step does not call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.func import vmap

from lightning_fl.engine.packed import ChunkBatches
from lightning_fl.engine.schedule import PackedLocalSteps
from lightning_fl.engine.seeding import derive_seeds, generator, seed_global_rng
from lightning_fl.engine.stacked_layers import StackedLayers, agree, unstackable
from lightning_fl.engine.stacked_optimizer import StackedOptimizer
from lightning_fl.engine.tensors import TensorList
from lightning_fl.engine.vectorized_checks import (
    VectorizationError,
    check_callback,
    check_compilable,
    check_module,
    check_trainer,
    needs_client_hooks,
)
from lightning_fl.engine.vectorized_step import ClientChunk, VectorizedStep

if TYPE_CHECKING:
    from lightning_fl.engine.context import FitContext
    from lightning_fl.engine.round_engine import RoundEngine


class VectorizedClients:
    """The strategy's vectorized rounds (``vectorize=True``): the set-up checks, and the
    life cycle of each chunk of clients that train together. Every client of a chunk
    starts and finishes through the round engine exactly as on the sequential path; in
    between, one :class:`VectorizedStep` per Lightning step trains the chunk."""

    def __init__(self, fit: FitContext, engine: RoundEngine) -> None:
        self.fit, self.engine = fit, engine
        self.step: VectorizedStep | None = None
        self.chunk: ClientChunk | None = None
        self.current: tuple[int, int] | None = None  # (chunk, step) of the training step
        #: the current chunk's batch indices when its data is packed on the device
        self.batches: ChunkBatches | None = None
        #: whether a chunk's clients start and finish together (set at set-up: no
        #: callback needs its client hooks one client at a time, no kept optimizer state)
        self.batched_lifecycle = False
        #: whether packed chunks pad short batches to their step's widest (set at set-up)
        self.pads_short_batches = False

    def setup(self) -> None:
        """Check that the module, optimizer and callbacks can train clients together,
        build the step, and run the loss once vectorized on the first client's batch."""
        fit, config = self.fit, self.fit.config
        trainer, module = fit.trainer, fit.module
        check_module(module)
        for cb in trainer.callbacks:
            check_callback(cb)
        check_trainer(trainer)
        if config.compile:
            check_compilable(module, trainer.callbacks)
        self.batched_lifecycle = not config.keep_optimizer_state and not any(
            needs_client_hooks(cb) for cb in fit.plugins.callbacks
        )
        tensors = fit.tensors
        optimizer = StackedOptimizer(trainer.optimizers[0], tensors.params)
        callbacks = self.engine.ordered_callbacks("on_before_vectorized_optimizer_step")

        def gradient_terms(rows: list[int], params: TensorList, grads: list) -> None:
            state = self.engine.current_round.state
            for cb in callbacks:
                cb.on_before_vectorized_optimizer_step(trainer, module, rows, params, grads, state)

        clip = None
        if trainer.gradient_clip_val:
            algorithm = "value" if trainer.gradient_clip_algorithm == "value" else "norm"
            clip = (float(trainer.gradient_clip_val), algorithm)
        self.step = VectorizedStep(
            module, tensors.param_names, tensors.buffer_names, optimizer, gradient_terms, clip
        )
        if config.compile:
            from lightning_fl.engine.compiled import CompiledGradients

            backend = "inductor" if config.compile is True else str(config.compile)
            self.step.compiled = CompiledGradients(
                lambda params, buffers, batch: self.step._client_loss(
                    params, buffers, batch, None, []
                ),
                optimizer.trainable,
                backend,
            )
        self.pads_short_batches = self._can_pad_short_batches()
        self._check_first_batch_runs()

    def _can_pad_short_batches(self) -> bool:
        """Whether a padded batch gives each client its own batch's loss, gradient and
        metrics: the task gives per-sample losses, and nothing else sees the padding
        (a BatchNorm's batch statistics, dropout masks of the batch's shape, a callback
        that computes its own gradient from the batch, the compiled step)."""
        from lightning_fl.models import FederatedTask

        fit = self.fit
        # a FederatedTask (check_module refused anything else)
        if type(fit.module).sample_losses_and_metrics is FederatedTask.sample_losses_and_metrics:
            return False
        dropout = any(m.p > 0 for m in self.step.dropout.modules)
        replaces = any(cb.replaces_gradient for cb in fit.plugins.callbacks)
        return not (fit.config.compile or fit.tensors.buffer_names or dropout or replaces)

    @property
    def compile_seconds(self) -> float | None:
        """Seconds spent compiling so far (None without ``compile``)."""
        compiled = self.step.compiled if self.step is not None else None
        return None if compiled is None else compiled.seconds

    def _check_first_batch_runs(self) -> None:
        fit = self.fit
        dm = fit.datamodule
        dm.set_round(0)  # a stream's caches hold data from the first round on
        with_data = np.flatnonzero(fit.federation.training_counts).tolist()
        empty = set(dm.clients_without_data_now(with_data))
        first = next((c for c in with_data if c not in empty), None)
        if first is not None and not fit.plugins.aggregator.pools_clients:
            loader = dm.client_dataloader(
                dm.client_dataset(first, "train"), "train", generator(fit.config.seed, "probe")
            )
            batch = fit.to_device(next(iter(loader)))
            self.step.check_runs(batch)
            if self.pads_short_batches:
                self.pads_short_batches = self._sample_means_agree(batch)
            if self.pads_short_batches and self._has_stacked_form():
                self.step.stacked_layers = self._stacked_layers(batch)
                self.pads_short_batches = self.step.stacked_layers is not None

    def _has_stacked_form(self) -> bool:
        """Whether the task's parameters are all ``nn.Linear``'s and ``nn.Conv2d``'s."""
        return unstackable(self.fit.module, self.fit.tensors.param_names) is None

    def _stacked_layers(self, batch: Any) -> StackedLayers | None:
        """The task's layers on stacked parameters (no vmap), where the set-up probe finds
        the same losses, metrics and gradients as vmap; None otherwise (a layer that
        mixes the samples of a batch, say: then padded batches would mix too, and are not
        padded), and the log says why."""
        fit, step = self.fit, self.step
        # on the CPU a convolution's activations stay in cache client by client
        convolutional = any(isinstance(m, nn.Conv2d) for m in fit.module.modules())
        client_by_client = convolutional and fit.device.type == "cpu"
        stacked = StackedLayers(fit.module, fit.tensors.param_names, client_by_client)
        vmapped = vmap(
            lambda params, one: step._client_loss(params, [], one, None, []), randomness="error"
        )
        if agree(stacked, vmapped, fit.tensors.params, batch):
            return stacked
        rank_zero_info(
            f"lightning_fl: vectorized steps stay under vmap, and short last batches run as "
            f"steps of their own: {type(fit.module).__name__}'s layers on the clients' "
            "batches laid end to end do not give each client its own loss and gradient (a "
            "layer that mixes a batch's samples?)."
        )
        return None

    def _sample_means_agree(self, batch: Any) -> bool:
        """Whether the task's ``sample_losses_and_metrics`` means equal its
        ``loss_and_metrics`` on ``batch`` (to float round-off); if not (a subclass that
        changed one of them, a criterion without ``reduction``), short batches are not
        padded, and the log says why."""
        module = self.fit.module
        with torch.no_grad():
            loss, metrics = module.loss_and_metrics(batch)
            try:
                losses, per_sample = module.sample_losses_and_metrics(batch)
                means = {"loss": losses.mean(), **{n: v.mean() for n, v in per_sample.items()}}
            except (TypeError, NotImplementedError) as err:
                reason = f"it raised {type(err).__name__}: {err}"
            else:
                expected = {"loss": loss, **metrics}
                if means.keys() == expected.keys() and all(
                    torch.allclose(means[k].float(), expected[k].float(), rtol=1e-5, atol=1e-6)
                    for k in means
                ):
                    return True
                reason = f"its means {_show(means)} differ from loss_and_metrics' {_show(expected)}"
        rank_zero_info(
            f"lightning_fl: short last batches run as steps of their own: "
            f"{type(module).__name__}.sample_losses_and_metrics does not give "
            f"loss_and_metrics per sample ({reason}). Fix or remove it to pad them."
        )
        return False

    def start_chunk(self, index: int) -> None:
        """Start every client of chunk ``index`` as the sequential path does (global
        weights, seeded RNG, ``on_client_start``), and stack their models. When no
        callback needs its client hooks (:attr:`batched_lifecycle`), the clients start
        together: θ^t repeated once per row, the global RNG seeded once, as the last
        client's start leaves it. With packed data, draw the chunk's batch indices."""
        fit, plan = self.fit, self.engine.current_round
        state, positions = plan.state, plan.chunks[index]
        clients = [plan.schedule.clients[pos] for pos in positions]
        seeds = derive_seeds(fit.config.seed, "client", state.round_idx, last=clients).tolist()
        device = fit.device

        def generators() -> list[torch.Generator]:
            return [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

        num_params = fit.tensors.num_params
        if self.batched_lifecycle:
            fit.tensors.load_(state.global_tensors)
            seed_global_rng(seeds[-1], device)
            self.chunk = ClientChunk.repeated(clients, state.global_tensors, num_params, generators)
            saved: list[dict | None] = [None] * len(clients)
        else:
            starts, saved = [], []
            for pos, client in zip(positions, clients):
                self.engine.start_client(pos)
                starts.append(fit.tensors.clone())
                kept = fit.config.keep_optimizer_state
                saved.append(fit.store.get(client, "optimizer_0") if kept else None)
            self.chunk = ClientChunk(clients, starts, num_params, generators)
        self.batches = None
        if plan.packed_chunk(index):
            batches = [plan.schedule.num_batches[pos] for pos in positions]
            self.batches = fit.packed.chunk_batches(
                fit.config.seed, state.round_idx, clients, batches, self.pads_short_batches
            )
        self.step.optimizer.reset(self.chunk.params, saved)
        state.chunk, state.vectorized_step = self.chunk, self.step  # the hooks' context
        self.engine.call("on_vectorized_clients_start", clients, state)
        params = fit.tensors.params
        self.step.optimizer.frozen = {
            j for j in self.step.optimizer.trainable if not params[j].requires_grad
        }
        trainer, module = fit.trainer, fit.module
        contexts, stacked_state = [], []
        for cb in self.engine.ordered_callbacks("vectorized_client_state"):
            stacked = cb.vectorized_client_state(trainer, module, clients, state)
            if stacked is not None:
                contexts.append(lambda rows, cb=cb: cb.vectorized_client_context(module, rows))
                stacked_state.append(stacked)
        self.step.client_contexts, self.step.client_state = contexts, stacked_state

    def train_step(self, batch: dict[str, Any]) -> None:
        """The Lightning step's local steps of the chunk's clients that still have
        batches (``local_steps_per_training_step`` of them); with packed data, each step's
        batches are gathered by index, one gather per group of rows of one batch size."""
        module = self.fit.module
        packed = batch["local_steps"]
        if isinstance(packed, PackedLocalSteps):
            steps = (self._packed_step(step) for step in range(packed.first, packed.stop))
        else:
            steps = (self.step(self.chunk, s["rows"], s["batches"]) for s in batch["local_steps"])
        for losses, metrics, sizes in steps:
            module._log_vectorized_training_step(losses, metrics, sizes)
            self.fit.divergence.observe(losses)

    def _packed_step(self, step: int) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """Local step ``step`` of the chunk on its packed batches: the rows' losses,
        metrics and batch sizes (rows grouped by batch size)."""
        packed, outputs = self.fit.packed, []
        for group in self.batches.steps[step]:
            batch = self.batches.batch(step, group, packed)
            loss, metrics = self.step.stacked(
                self.chunk, group.rows, batch, group.rows_index, group.sample_mask
            )
            sizes = group.lengths
            if sizes is None:
                sizes = torch.full((len(loss),), group.size, device=loss.device)
            outputs.append((loss, metrics, sizes))
        if len(outputs) == 1:
            return outputs[0]
        return (
            torch.cat([loss for loss, _, _ in outputs]),
            {name: torch.cat([m[name] for _, m, _ in outputs]) for name in outputs[0][1]},
            torch.cat([sizes for _, _, sizes in outputs]),
        )

    def finish_chunk(self, index: int) -> None:
        """Finish every client of chunk ``index`` as the sequential path does, its trained
        model loaded into the module; or, with :attr:`batched_lifecycle`, fold the
        chunk's stacked updates into the round's sum at once."""
        chunk, fit = self.chunk, self.fit
        self.batches = None
        if self.batched_lifecycle:
            self.engine.finish_clients(chunk.clients, chunk.tensors)
            self.chunk = None
            return
        for row, pos in enumerate(self.engine.current_round.chunks[index]):
            fit.tensors.load_(chunk.row(row))
            optimizer_state = None
            if fit.config.keep_optimizer_state:
                optimizer_state = [self.step.optimizer.state_of(row)]
            self.engine.finish_client(pos, optimizer_state)
        self.chunk = None


def _show(values: dict[str, Tensor]) -> str:
    return "{" + ", ".join(f"{k}: {float(v):.6g}" for k, v in values.items()) + "}"


__all__ = [
    "ClientChunk",
    "VectorizationError",
    "VectorizedClients",
    "VectorizedStep",
]
