"""SAFARI: server-assisted federated averaging under incomplete client participation
(seed paper 004, "Understanding of server-assisted federated learning with incomplete
client participation", Algorithm 1)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_fl.checks import require_rate
from lightning_fl.engine.plugins import SERVER_CLIENT, Aggregator, RoundState, Weighting
from lightning_fl.engine.seeding import generator
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.samplers import ClientSampler, Participation


class SAFARI(Aggregator):
    """Each round r is, with probability q, a client round and otherwise a server round
    (Alg. 1), drawn from (seed, r) so that a resumed run makes the same draws:

    - client round: the sampler's clients take their local steps from x_r, and
      x_{r+1} = Σ ω_i x_r^i (with a uniform sampler over the participating clients and
      ``weighting="uniform"``, the default, this is Alg. 1's plain average (1/|S_r|) Σ x_r^i);
    - server round: one SGD step on a minibatch of the server's data,
      x_{r+1} = x_r − η_s ∇F(x_r, ξ_r), with η_s = ``server_lr`` (the client learning rate
      when None). The server's data is the datamodule's ``server_dataset()``.

    q = 1 is FedAvg, q = 0 SGD on the server's data. The paper leaves q open; its
    theory suggests q ≈ 1 − 1/(mK). Needs plain SGD (the server step is an SGD step).
    Logged: ``safari/server_round`` (1 for a server round).

    Combine with :class:`~lightning_fl.ExcludedClients` for incomplete participation.
    """

    traits = {
        Trait.AGGREGATES_OUTSIDE_SYNCHRONOUS_ROUNDS: "",
        Trait.STEPS_OTHERWISE_THAN_FEDAVG: "",
        Trait.TRAINS_ON_SERVER_DATA: "",
    }

    supports_vectorized_clients = True  # no per-step hook: clients start and end as sequentially

    def __init__(
        self, q: float, server_lr: float | None = None, weighting: Weighting = "uniform"
    ) -> None:
        super().__init__(weighting)
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], got {q}.")
        if server_lr is not None:
            require_rate("server_lr", server_lr, 1.0)
        self.q, self.server_lr = q, server_lr
        self._server_round = 0.0  # whether the round in progress is the server's

    def is_server_round(self, round_idx: int, seed: int) -> bool:
        # host: a CPU generator: the same server rounds on every device
        draw = torch.rand(1, generator=generator(seed, "safari", round_idx), dtype=torch.float64)
        return bool(draw >= self.q)

    def participation(
        self, round_idx: int, seed: int, p: torch.Tensor, sampler: ClientSampler
    ) -> Participation:
        if self.is_server_round(round_idx, seed):
            return Participation((SERVER_CLIENT,), (1.0,))
        return sampler.sample(round_idx, seed, p)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.q < 1 and trainer.datamodule.server_dataset() is None:
            raise ValueError(
                f"SAFARI with q={self.q} needs server data: give the datamodule a "
                "server_dataset (DigitsDataModule(server_samples=...)), or use q=1 (FedAvg)."
            )
        optimizers = trainer.optimizers
        if self.q < 1 and not all(type(o) is torch.optim.SGD for o in optimizers):
            raise TypeError("SAFARI's server round is an SGD step: use the SGD optimizer.")

    @torch.no_grad()
    def aggregate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: RoundState
    ) -> None:
        scale = 1.0
        if state.participation.clients == (SERVER_CLIENT,) and self.server_lr is not None:
            scale = self.server_lr / trainer.optimizers[0].param_groups[0]["lr"]
        torch._foreach_add_(state.global_tensors, state.update_sum, alpha=scale)

    def on_round_start(self, trainer, pl_module, state: RoundState) -> None:
        self._server_round = float(state.participation.clients == (SERVER_CLIENT,))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.log(
            "safari/server_round", self._server_round, on_epoch=True,
            sync_dist=trainer.world_size > 1,
        )  # fmt: skip


__all__ = ["SAFARI"]
