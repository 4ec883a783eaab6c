"""Distributed DP under secure aggregation on 3 named silos, on the wire (run by
tests/test_distributed_dp.py):

    python -m torch.distributed.run --nproc_per_node 3 -m tests.ddp_wire ROOT CREDS

FedAvg with ``DPFedAvg(noise="distributed", colluding_sites=1)`` and
``SecureAggregation`` with the sites' signed keys (``CREDS/{silo}.key``, ``.pub``), 6
clients of unequal sizes, 2 rounds, twice (``first``, ``second``: the same recipe and
seed). Every ``torch.distributed.all_reduce`` is recorded (what this rank put on the wire),
with the rank's noiseless part of Σ ω_k Δ_k (before its share is added), its buffer as it
left the engine (with its share, before masking) and the total the sites decoded; each
rank saves them to ``ROOT/<run>_rank<r>.pt``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from lightning_fl import FederatedStrategy
from lightning_fl.callbacks import DPFedAvg, SecureAggregation
from lightning_fl.engine.tensors import flatten
from tests.helpers import make_trainer, params_of, tiny_datamodule, tiny_module
from tests.secure_wire import _Recorded

NAMES = ["usa", "hungary", "switzerland"]


class _Noiseless(DPFedAvg):
    """DPFedAvg that keeps this site's part of the sum before its share is added."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.noiseless: list[torch.Tensor] = []

    def on_before_round_sum(self, trainer, pl_module, state) -> None:
        self.noiseless.append(flatten(state.update_sum).double().clone())
        super().on_before_round_sum(trainer, pl_module, state)


class _Kept(SecureAggregation):
    """SecureAggregation that keeps what it masks and what it decodes."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.own: list[torch.Tensor] = []
        self.total: list[torch.Tensor] = []

    def sum_over_ranks(self, buffer, round_idx):
        self.own.append(buffer.detach().double().clone())
        summed = super().sum_over_ranks(buffer, round_idx)
        self.total.append(summed.total.detach().double().clone())
        return summed


def main() -> None:
    root, creds = sys.argv[1], sys.argv[2]
    original = dist.all_reduce
    for run in ("first", "second"):
        recorded = _Recorded(original)
        dist.all_reduce = recorded
        dp = _Noiseless(noise="distributed", colluding_sites=1, noise_multiplier=0.8,
                        clip_norm=0.3, seed=5)  # fmt: skip
        secure = _Kept(signing_key=f"{creds}/{{silo}}.key", site_keys=f"{creds}/{{silo}}.pub")
        trainer = make_trainer(FederatedStrategy(silos=NAMES, local_steps=3, seed=5), 2,
                               [dp, secure], devices=3)  # fmt: skip
        module = tiny_module()
        trainer.fit(module, datamodule=tiny_datamodule(num_clients=6))
        torch.save({"sent": recorded.sent, "own": secure.own, "total": secure.total,
                    "noiseless": dp.noiseless, "sigma": dp.last["noise_std"],
                    "params": params_of(module)},
                   f"{root}/{run}_rank{trainer.global_rank}.pt")  # fmt: skip
    dist.all_reduce = original


if __name__ == "__main__":
    main()
