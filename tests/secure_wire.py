"""What each rank sends in the round's all-reduce, with and without SecureAggregation (run
by tests/test_secure_aggregation.py on 3 processes):

    python -m torch.distributed.run --nproc_per_node 3 -m tests.secure_wire ROOT

SCAFFOLD (its control-variate sums ride the same all-reduce) on 6 clients of unequal
sizes for 3 rounds, twice: plain, then with ``SecureAggregation()``. Every call of
``torch.distributed.all_reduce`` is recorded (what this rank put on the wire) beside the
plain buffer the round summed (this rank's own terms); each rank saves them and the final
model to ``ROOT/<plain|secure>_rank<r>.pt``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from lightning_fl import FederatedStrategy
from lightning_fl.callbacks import SCAFFOLD, SecureAggregation
from tests.helpers import make_trainer, params_of, tiny_datamodule, tiny_module


class _Recorded:
    """``dist.all_reduce`` that keeps a copy of every tensor this rank sends."""

    def __init__(self, all_reduce) -> None:
        self.all_reduce, self.sent = all_reduce, []

    def __call__(self, tensor, *args, **kwargs):
        self.sent.append(tensor.detach().clone())
        return self.all_reduce(tensor, *args, **kwargs)


class _Kept(SecureAggregation):
    """SecureAggregation that keeps each round's buffer (this rank's own terms)."""

    def __init__(self) -> None:
        super().__init__()
        self.own: list[torch.Tensor] = []

    def sum_over_ranks(self, buffer, round_idx):
        self.own.append(buffer.detach().clone())
        return super().sum_over_ranks(buffer, round_idx)


def main() -> None:
    root = sys.argv[1]
    original = dist.all_reduce
    for name in ("plain", "secure"):
        recorded = _Recorded(original)
        dist.all_reduce = recorded  # the module the engine and the plugin call it through
        secure = [_Kept()] if name == "secure" else []
        trainer = make_trainer(FederatedStrategy(local_steps=3, seed=5), 3,
                               [SCAFFOLD(), *secure], devices=3)  # fmt: skip
        module = tiny_module()
        trainer.fit(module, datamodule=tiny_datamodule(num_clients=6))
        own = secure[0].own if secure else recorded.sent
        torch.save({"sent": recorded.sent, "own": own, "params": params_of(module)},
                   f"{root}/{name}_rank{trainer.global_rank}.pt")  # fmt: skip
    dist.all_reduce = original


if __name__ == "__main__":
    main()
