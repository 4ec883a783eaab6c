"""SCAFFOLD (Karimireddy et al., ICML 2020), Algorithm 1 with control variates of option II.

Client i, from y_i = x and its control variate c_i, takes K local steps
    y_i ← y_i − η_l (g_i(y_i) − c_i + c)                       (Alg. 1, line 10)
then
    c_i⁺ = c_i − c + (x − y_i)/(K η_l)                          (option II, line 12)
    Δc_i = c_i⁺ − c_i.
The server updates the model with the aggregator (FedAvg: x ← x + η_g Σ ω_i Δy_i; with
uniform sampling and p_i = 1/N, ω_i = 1/|S| as in Alg. 1 line 16) and
    c ← c + (1/N) Σ_{i∈S} Δc_i                                  (line 17, |S|/N · mean)

Line 17 keeps c = (1/N) Σ_i c_i, the uniform mean of all clients' controls
(``control_weighting="uniform"``, the default). With sample-weighted aggregation the
matching invariant is c = Σ_i p_i c_i, kept by c ← c + Σ_{i∈S} p_i Δc_i with the
aggregator's target weights p_i (``control_weighting="target"``); with full participation
p_i is exactly the model's weight ω_i, as in FLamby's Scaffold, which the FLamby recipes
use.

The correction (c − c_i) is added to the gradient before the optimizer step, so the rule
is exact for plain SGD; K counts the optimizer steps taken and η_l is the learning rate of
the first parameter group. Memory: each client that took part stores c_i as one float32
vector, 4·d bytes (d parameters) in the client store.

Its state is declared (``FederatedCallback.add_client_state`` and friends), not written
by hand: c_i is client state (the store entry ``scaffold_c``, moved to the rank that trains
the client, sharded per silo, checkpointed for the clients that took part), Σ Δc_i a round
sum (added over the ranks in the round's all-reduce) and c server state (the callback's
checkpoint entry).
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import numpy as np
import torch
from torch.optim import Optimizer

from lightning_fl.engine.plugins import FederatedCallback, RoundState
from lightning_fl.engine.tensors import TensorList
from lightning_fl.engine.traits import Trait

#: c_i's client store key (kept from the first release: its checkpoints resume)
STORE_KEY = "scaffold_c"


class SCAFFOLD(FederatedCallback):
    """SCAFFOLD (Karimireddy et al., ICML 2020, Alg. 1, option II): every local gradient is
    corrected by c − c_i, the server's control variate minus the client's.

    Args:
    control_weighting: ``"uniform"`` for the paper's c ← c + (1/N) Σ_{i∈S} Δc_i, or
        ``"target"`` for c ← c + Σ_{i∈S} p_i Δc_i with the aggregator's weights p_i.
    """

    traits = {Trait.STEPS_OTHERWISE_THAN_FEDAVG: "", Trait.CORRECTS_EVERY_GRADIENT: ""}

    def __init__(self, control_weighting: Literal["uniform", "target"] = "uniform") -> None:
        if control_weighting not in ("uniform", "target"):
            raise ValueError(
                f"control_weighting must be 'uniform' or 'target', got {control_weighting!r}."
            )
        self.control_weighting = control_weighting
        self.add_client_state("control", key=STORE_KEY, like="params")  # c_i, 0 at first
        self.add_round_sum("control_delta")  # Σ_{i∈S} Δc_i (weighted by p_i: "target")
        self.add_server_state("server_control", like="params")  # c, 0 at first
        self._correction: TensorList | None = None
        self._stacked_correction: TensorList | None = None

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        control = self.client_state(state.store, client, "control")
        self._correction = torch._foreach_sub(self.server_control, control)

    supports_vectorized_clients = True

    def on_vectorized_clients_start(self, trainer, pl_module, clients, state: RoundState) -> None:
        """The corrections c − c_i of every client of the chunk, stacked by row."""
        corrections = [
            torch._foreach_sub(
                self.server_control, self.client_state(state.store, client, "control")
            )
            for client in clients
        ]
        self._stacked_correction = [torch.stack(column) for column in zip(*corrections)]

    @torch.no_grad()
    def on_before_vectorized_optimizer_step(
        self, trainer, pl_module, rows, params, grads, state: RoundState
    ) -> None:
        if any(g is None for g in grads):
            raise RuntimeError(
                "SCAFFOLD needs a gradient for every parameter; freeze parameters by "
                "excluding them from the module instead."
            )
        index = torch.tensor(rows, device=grads[0].device)
        for g, correction in zip(grads, self._stacked_correction):
            g.add_(correction.index_select(0, index))

    @torch.no_grad()
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._correction is None:
            return
        params = self.view.tensors.params
        pairs = [(p.grad, c) for p, c in zip(params, self._correction) if p.grad is not None]
        if not pairs:  # an idle step: nothing was trained
            return
        if len(pairs) != len(params):
            raise RuntimeError(
                "SCAFFOLD needs a gradient for every parameter; freeze parameters by "
                "excluding them from the module instead."
            )
        torch._foreach_add_([g for g, _ in pairs], [c for _, c in pairs])

    @torch.no_grad()
    def on_client_end(self, trainer, pl_module, client: int, update: TensorList, state) -> None:
        steps = state.local_steps.get(client, 0)
        if steps == 0:
            return
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        # Δc_i = c_i⁺ − c_i = −c + (x − y_i)/(K η_l) = −c − Δy_i/(K η_l)
        delta_c = torch._foreach_mul(update[: state.num_params], -1.0 / (steps * lr))
        torch._foreach_sub_(delta_c, self.server_control)
        weight = float(state.target_weights[client]) if self.control_weighting == "target" else 1.0
        torch._foreach_add_(state.round_sum(self, "control_delta"), delta_c, alpha=weight)
        new_control = torch._foreach_add(self.client_state(state.store, client, "control"), delta_c)
        self.set_client_state(state.store, client, "control", new_control)

    @torch.no_grad()
    def on_round_end(self, trainer, pl_module, state: RoundState) -> None:
        if self.control_weighting == "target":
            scale = 1.0  # the p_i were applied per client
        else:
            scale = 1.0 / self._clients_with_data(state.sample_counts)
        torch._foreach_add_(
            self.server_control, state.round_sum(self, "control_delta"), alpha=scale
        )
        self._correction = self._stacked_correction = None

    def _clients_with_data(self, counts: np.ndarray) -> int:
        """N of c = (1/N) Σ c_i: the clients with training data, counted once per fit's
        counts (a pass over the population, not one a round)."""
        if getattr(self, "_counted", (None,))[0] is not counts:
            self._counted = (counts, int(np.count_nonzero(counts)))
        return self._counted[1]
