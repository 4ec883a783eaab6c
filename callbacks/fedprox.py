"""FedProx (Li et al., MLSys 2020): local objective L_i(θ) + (μ/2)‖θ − θ^t‖².

Fraboni thesis eq. B.31. The proximal gradient μ(θ − θ^t) is added to each parameter's
gradient before the optimizer step, before gradient clipping, exactly as if it were part
of the loss.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.optim import Optimizer

from lightning_fl.checks import require_rate
from lightning_fl.engine.plugins import FederatedCallback, RoundState
from lightning_fl.engine.tensors import TensorList


class FedProx(FederatedCallback):
    """FedProx (Li et al., MLSys 2020): each client minimizes L_i(θ) + (μ/2)‖θ − θ^t‖², the
    proximal gradient μ(θ − θ^t) added to its gradient at every local step.

    Args:
        mu: μ ≥ 0 (0 is FedAvg).
    """

    keeps_client_state = False  # the anchor is this round's global model

    def __init__(self, mu: float = 0.01) -> None:
        require_rate("mu", mu, 0.01, allow_zero=True)
        self.mu = mu
        self._anchor: TensorList | None = None

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        self._anchor = state.global_params

    @torch.no_grad()
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._anchor is None or self.mu == 0:
            return
        params = trainer.strategy.federated_tensors.params
        pairs = [(p, a) for p, a in zip(params, self._anchor) if p.grad is not None]
        if pairs:
            grads = [p.grad for p, _ in pairs]
            diff = torch._foreach_sub([p for p, _ in pairs], [a for _, a in pairs])
            torch._foreach_add_(grads, diff, alpha=self.mu)

    supports_vectorized_clients = True
    vectorized_client_hooks = False  # the vectorized term reads state.global_params

    @torch.no_grad()
    def on_before_vectorized_optimizer_step(
        self, trainer, pl_module, rows, params, grads, state: RoundState
    ) -> None:
        """The same proximal gradient μ(θ_c − θ^t) for every client row at once."""
        if self.mu == 0:
            return
        for p, g, anchor in zip(params, grads, state.global_params):
            if g is not None:
                g.add_(p - anchor, alpha=self.mu)

    def on_round_end(self, trainer, pl_module, state: RoundState) -> None:
        self._anchor = None
