"""FedProx (Li et al., MLSys 2020): local objective L_i(θ) + (μ/2)‖θ − θ^t‖², θ^t the
model the client starts from.

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
    """FedProx (Li et al., MLSys 2020, eq. 2): each client minimizes L_i(θ) + (μ/2)‖θ − θ^t‖²,
    θ^t its starting model, adding μ(θ − θ^t) to each local gradient.

    Thesis eq. B.31. The anchor θ^t is the model the client received, the one it starts
    its local steps from: the round's global model under synchronous FedAvg, the stale
    model θ^ρ it was sent under :class:`AsynchronousFL`, its cluster's model under
    :class:`ClusteredFL`, its own model under :class:`Local` or :class:`GossipAveraging`.
    It is read at the client's first optimizer step, after every callback's
    ``on_client_start``, so the order of the Trainer's callbacks does not matter.
    Vectorized clients: each row's starting model, copied once per chunk (none when every
    row starts from the round's global model).

    Args:
        mu: μ ≥ 0 (0 is FedAvg).
    """

    def __init__(self, mu: float = 0.01) -> None:
        require_rate("mu", mu, 0.01, allow_zero=True)
        self.mu = mu
        self._anchor: TensorList = []
        self._anchor_stale = True  # until the client's first step
        self._rows_anchor: TensorList | None = None

    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        self._anchor_stale = True  # read at the first step, after every callback's start

    @torch.no_grad()
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self.mu == 0:
            return
        params = self.view.tensors.params
        if self._anchor_stale:
            self._anchor = [p.detach().clone() for p in params]
            self._anchor_stale = False
        pairs = [(p, a) for p, a in zip(params, self._anchor) if p.grad is not None]
        if pairs:
            grads = [p.grad for p, _ in pairs]
            diff = torch._foreach_sub([p for p, _ in pairs], [a for _, a in pairs])
            torch._foreach_add_(grads, diff, alpha=self.mu)

    supports_vectorized_clients = True
    vectorized_client_hooks = False  # the rows' anchors are read in on_vectorized_clients_start

    def on_vectorized_clients_start(self, trainer, pl_module, clients, state: RoundState) -> None:
        """Each row's anchor: its starting model, copied when the rows start from different
        models (None: every row starts from the round's global model)."""
        chunk = state.chunk
        self._rows_anchor = None if chunk.shared_start else [t.clone() for t in chunk.params]

    @torch.no_grad()
    def on_before_vectorized_optimizer_step(
        self, trainer, pl_module, rows, params, grads, state: RoundState
    ) -> None:
        """The same proximal gradient μ(θ_c − θ_c^start) for every client row at once."""
        if self.mu == 0:
            return
        anchors = state.global_params
        if self._rows_anchor is not None:
            anchors = self._rows_anchor
            if len(rows) < len(anchors[0]):  # some rows have finished: pick the others
                index = torch.tensor(rows, device=params[0].device)
                anchors = [t.index_select(0, index) for t in anchors]
        for p, g, anchor in zip(params, grads, anchors):
            if g is not None:
                g.add_(p - anchor, alpha=self.mu)

    def on_round_end(self, trainer, pl_module, state: RoundState) -> None:
        self._rows_anchor = None
