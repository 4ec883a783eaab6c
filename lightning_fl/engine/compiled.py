"""The compiled vectorized step (``FederatedStrategy(vectorize=True, compile=True)``).

Eager ``vmap`` pays a dispatch cost per operator and per client row that exceeds the
arithmetic of a small model; ``torch.compile`` traces the per-client loss and gradient
once and fuses it. :class:`CompiledGradients` compiles ``vmap(grad_and_value(loss))`` of
the chunk's clients: client c's gradient is the gradient of its own loss, as on the eager
vectorized path (which takes the gradient of the sum of the rows' losses), so the two
agree to float round-off. The callbacks' gradient terms, clipping and the stacked
optimizer run after it, unchanged.

Graphs: the first call compiles with static shapes; a call with another number of rows
(clients that ran out of batches) or another batch size (a short last batch) recompiles
once with those dimensions dynamic, and that graph serves every later size (dynamo's
automatic dynamic shapes), so a run compiles a bounded number of graphs (two or three).
The first call of each new (rows, batch shape) is timed as compile time
(:attr:`CompiledGradients.seconds`), logged per round as ``fl/compile_seconds`` and shown
in the progress bar. Inductor's on-disk caches (``TORCHINDUCTOR_CACHE_DIR``, by default
under the system's temporary folder) make a second run of the same recipe compile
faster; ``benchmarks/overhead.py`` prints the compile time of each repeat.

Not compiled (refused at setup with the reason): BatchNorm (its running statistics change
in place inside the gradient transform), ``nn.Dropout`` with p > 0 (its masks come from
per-client generators outside the graph) and callbacks with per-client module state
(``vectorized_client_state``: FedEM's context is a Python context manager around the
loss).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.func import grad_and_value, vmap

from lightning_fl.engine.tensors import TensorList


class CompiledGradients:
    """Each client's loss, metrics and gradient with respect to its trainable parameters,
    for stacked parameters and batches, through one compiled function.

    Args:
        client_loss: ``(params, buffers, batch) -> (loss, metrics)`` of one client.
        trainable: positions of the parameters to differentiate.
        backend: ``torch.compile``'s backend ("inductor"; "aot_eager" traces without
            generating code, which tests use to stay fast).
    """

    def __init__(
        self,
        client_loss: Callable[[TensorList, TensorList, Any], tuple[Tensor, dict[str, Tensor]]],
        trainable: list[int],
        backend: str = "inductor",
    ) -> None:
        self.trainable = list(trainable)
        self.backend = backend
        trainable_set = self._trainable_set = set(self.trainable)

        def per_client(wanted: TensorList, others: TensorList, buffers: TensorList, batch: Any):
            params, w, o = [], iter(wanted), iter(others)
            for j in range(len(wanted) + len(others)):
                params.append(next(w) if j in trainable_set else next(o))
            return client_loss(params, buffers, batch)  # (loss, metrics: the aux output)

        self.function = torch.compile(
            vmap(grad_and_value(per_client, has_aux=True)), backend=backend
        )
        #: seconds spent in the first call of each new (rows, batch shape): compiling
        self.seconds = 0.0
        self._seen: set[tuple] = set()

    def __call__(
        self, params: TensorList, buffers: TensorList, batch: Any, key: tuple
    ) -> tuple[Tensor, dict[str, Tensor], list[Tensor]]:
        """(losses [rows], metrics {name: [rows]}, gradients of the trainable parameters)."""
        wanted = [params[j].detach() for j in self.trainable]
        others = [p.detach() for j, p in enumerate(params) if j not in self._trainable_set]
        shape = (len(wanted[0]) if wanted else 0, key)
        first = shape not in self._seen
        start = time.perf_counter()
        grads, (loss, metrics) = self.function(wanted, others, list(buffers), batch)
        if first:
            self._seen.add(shape)
            self.seconds += time.perf_counter() - start
        return loss, metrics, list(grads)
