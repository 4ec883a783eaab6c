"""Small fits on 2 processes (run by tests/test_strategy_fit.py): SCAFFOLD on 3 clients of
unequal sizes, sequential then vectorized in chunks of 2, each rank starting from a model
of its own seed (the strategy broadcasts rank 0's); then DP-SGD on 5 clients, whose
logged values (the round's training means, the largest ε) must be over every rank's
clients. Each rank saves, per fit, the model, how many times its optimizer stepped, how
many times Lightning's SIGTERM flag was broadcast and what it logged, to
``<root>/rank<r>.pt``.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.strategy_two_processes ROOT
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from lightning_fl import MLP, Classifier, FederatedStrategy
from lightning_fl.callbacks import DPSGD, SCAFFOLD, MembershipInference
from tests.helpers import HIDDEN, IN, OUT, make_trainer, params_of, tiny_datamodule

ROUNDS, CLIENTS, CHUNK = 3, 3, 2
#: the values every rank logs, compared with one process: after the fit, then the test
FIT_LOGGED = ("train_loss_epoch", "train_acc_epoch", "dp/epsilon")
TEST_LOGGED = ("mia/train/best", "mia/train/loss")


def private_fit(**trainer_options) -> dict[str, float]:
    """DP-SGD on 5 clients for 2 rounds of 2 local steps (its accounting keeps client
    state: client c trains on rank c % 2), then a test with membership inference on every
    client (each rank attacks its own): what this rank logged."""
    private = DPSGD(noise_multiplier=0.5, max_grad_norm=0.5)
    attack = MembershipInference(stages=("test",))
    strategy = FederatedStrategy(local_steps=2, seed=3)
    trainer = make_trainer(strategy, 2, [private, attack], **trainer_options)
    data, trained = tiny_datamodule(num_clients=5), module(seed=1)
    trainer.fit(trained, datamodule=data)
    logged = {name: float(trainer.callback_metrics[name]) for name in FIT_LOGGED}
    trainer.test(trained, datamodule=data, verbose=False)
    return logged | {name: float(trainer.callback_metrics[name]) for name in TEST_LOGGED}


def module(seed: int) -> Classifier:
    torch.manual_seed(seed)
    return Classifier(network=MLP(IN, (HIDDEN,), OUT), lr=0.1)


def strategy(vectorize: bool, **kw) -> FederatedStrategy:
    return FederatedStrategy(local_epochs=1, seed=3, vectorize=vectorize,
                             max_vectorized_clients=CHUNK if vectorize else None, **kw)  # fmt: skip


class OptimizerSteps(pl.Callback):
    """Counts the calls of the module's optimizer's ``step``."""

    def __init__(self) -> None:
        self.steps = 0

    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        step = optimizer.step

        def counted(*args, **kwargs):
            self.steps += 1
            return step(*args, **kwargs)

        optimizer.step = counted


if __name__ == "__main__":
    root, rank = sys.argv[1], int(os.environ["RANK"])
    broadcasts = [0]
    original = _TrainingEpochLoop._broadcast_sigterm_tensor

    def counted_broadcast(self) -> None:
        broadcasts[0] += 1
        original(self)

    _TrainingEpochLoop._broadcast_sigterm_tensor = counted_broadcast
    results = {}
    for name, vectorize in (("sequential", False), ("vectorized", True)):
        broadcasts[0] = 0
        steps = OptimizerSteps()
        trained = module(seed=100 + rank)  # rank 0's model is the one every rank starts from
        trainer = make_trainer(strategy(vectorize, timeout=120), ROUNDS, [SCAFFOLD(), steps],
                               devices=2)  # fmt: skip
        trainer.fit(trained, datamodule=tiny_datamodule(num_clients=CLIENTS))
        results[name] = {"params": params_of(trained), "optimizer_steps": steps.steps,
                         "sigterm_broadcasts": broadcasts[0]}  # fmt: skip
    results["logged"] = private_fit(devices=2)
    torch.save(results, os.path.join(root, f"rank{rank}.pt"))
