"""Small fits on 2 processes (run by tests/test_strategy_fit.py), each compared there with
the same fit on one process:

- SCAFFOLD on 3 clients of unequal sizes, sequential then vectorized in chunks of 2, each
  rank starting from a model of its own seed (the strategy broadcasts rank 0's): the
  model, how many times the rank's optimizer stepped and how many times Lightning's
  SIGTERM flag was broadcast;
- DP-SGD on 5 clients, then a test with membership inference: what the rank logged (the
  round's training means, the largest ε, the attacks' means, over every rank's clients)
  and how many test batches it ran (its own clients' only);
- CA-Fed, whose loss probes run on each client's rank and are summed over ranks: the model;
- SIFU with a request, whose sensitivity increments are summed over ranks: the model, the
  history Ψ and the request's restart point; and FEDACCUM, refused on several processes;
- a test of a module that logs a torchmetrics macro accuracy: each client's value, computed
  on its rank from its own share of the metric's state, and the value pooled over the
  seen clients of every rank; and of a plain LightningModule that logs its loss synced:
  each client's value, read before Lightning syncs the epoch's sums over ranks; and a
  test where rank 1's clients have no test data: it logs the other rank's values;
- an array federation with a validation cohort and a full validation vectorized over
  clients: the model, the cohort's logged values and every client's values.

Each rank saves them to ``<root>/rank<r>.pt``, and writes to ``<root>/rank<r>.exit``
whether its process group was still alive after the strategy's exit handler (registered
after this script's, so run before it).

    python -m torch.distributed.run --nproc_per_node 2 -m tests.strategy_two_processes ROOT
"""

from __future__ import annotations

import atexit
import os
import sys

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from lightning_fl import MLP, Classifier, FederatedStrategy, UniformSampler
from lightning_fl.callbacks import DPSGD, SCAFFOLD, FedAvg, MembershipInference, Unlearning
from lightning_fl.datamodules import InMemoryFederatedDataModule
from lightning_fl.systems.availability import MarkovAvailability
from lightning_fl.systems.samplers import AvailableClients
from tests.helpers import (
    HIDDEN,
    IN,
    OUT,
    make_trainer,
    params_of,
    tiny_clients,
    tiny_datamodule,
    tiny_module,
)

ROUNDS, CLIENTS, CHUNK = 3, 3, 2
#: the values every rank logs, compared with one process: after the fit, then the test
FIT_LOGGED = ("train_loss_epoch", "train_acc_epoch", "dp/epsilon")
TEST_LOGGED = ("mia/train/best", "mia/train/loss")


def private_fit(**trainer_options) -> dict[str, float]:
    """DP-SGD on 5 clients for 2 rounds of 2 local steps (its accounting keeps client
    state: client c trains on rank c % 2), then a test with membership inference on every
    client (each rank attacks its own): what this rank logged, and its test batches."""
    private = DPSGD(noise_multiplier=0.5, max_grad_norm=0.5)
    attack, batches = MembershipInference(stages=("test",)), TestBatches()
    strategy = FederatedStrategy(local_steps=2, seed=3)
    trainer = make_trainer(strategy, 2, [private, attack, batches], **trainer_options)
    data, trained = tiny_datamodule(num_clients=5), module(seed=1)
    trainer.fit(trained, datamodule=data)
    logged = {name: float(trainer.callback_metrics[name]) for name in FIT_LOGGED}
    trainer.test(trained, datamodule=data, verbose=False)
    logged |= {name: float(trainer.callback_metrics[name]) for name in TEST_LOGGED}
    return logged | {"test_batches": batches.count}


def ca_fed_fit(**trainer_options) -> list[torch.Tensor]:
    """CA-Fed (κ̄² = 0.5) on 8 clients of unequal availability for 5 rounds: which
    clients it keeps depends on the losses probed on every available client, each on its
    own rank (here it excludes clients in rounds 1, 3 and 4).
    The model."""
    pi, lam = [0.9] * 4 + [0.15] * 4, [0.9, 0.0] * 4
    sampler = AvailableClients(MarkovAvailability(pi, lam), selector="ca_fed", kappa2=0.5)
    trained = tiny_module()
    trainer = make_trainer(FederatedStrategy(sampler=sampler, local_steps=2, seed=1), 5,
                           **trainer_options)  # fmt: skip
    trainer.fit(trained, datamodule=tiny_datamodule(num_clients=8))
    return params_of(trained)


class MacroAccuracy(Classifier):
    """A Classifier that also logs a torchmetrics macro accuracy in test."""

    def __init__(self, **kw) -> None:
        from torchmetrics.classification import MulticlassAccuracy

        super().__init__(**kw)
        self.macro = MulticlassAccuracy(num_classes=OUT, average="macro")

    def test_step(self, batch, batch_idx):
        super().test_step(batch, batch_idx)
        self.macro.update(self(batch[0]), batch[1])
        self.log("test_macro_acc", self.macro, on_epoch=True)


def torchmetrics_test(**trainer_options) -> dict:
    """One round on 6 clients (2 of them unseen), then a test: each client's macro
    accuracy, as (value, count) rows, and the logged value pooled over the seen clients."""
    torch.manual_seed(1)
    trained = MacroAccuracy(network=MLP(IN, (HIDDEN,), OUT), lr=0.1)
    data = tiny_datamodule(num_clients=6)
    data.hold_out(1 / 3)
    trainer = make_trainer(FederatedStrategy(local_steps=2, seed=0), 1, **trainer_options)
    trainer.fit(trained, datamodule=data)
    trainer.test(trained, datamodule=data, verbose=False)
    per_client = trainer.strategy.evaluation.last_report[1]["test_macro_acc"]
    return {"clients": {c: list(v) for c, v in per_client.items()},
            "pooled": float(trainer.callback_metrics["test_macro_acc"])}  # fmt: skip


class PlainTest(pl.LightningModule):
    """A LightningModule with Lightning's methods only, logging its test loss synced."""

    def __init__(self) -> None:
        super().__init__()
        self.network = MLP(IN, (HIDDEN,), OUT)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.network(batch[0]), batch[1])

    def test_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.network(batch[0]), batch[1])
        self.log("test_loss", loss, on_epoch=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def plain_test(**trainer_options) -> dict[int, list[float]]:
    """One round on 5 clients, then a test of :class:`PlainTest`: each client's logged
    loss, as (value, count) rows."""
    torch.manual_seed(1)
    trained, data = PlainTest(), tiny_datamodule(num_clients=5)
    trainer = make_trainer(FederatedStrategy(local_steps=2, seed=0), 1, **trainer_options)
    trainer.fit(trained, datamodule=data)
    trainer.test(trained, datamodule=data, verbose=False)
    return {c: list(v) for c, v in trainer.strategy.evaluation.last_report[1]["test_loss"].items()}


def idle_rank_test(**trainer_options) -> dict[str, float]:
    """One round on 4 clients, then a test where clients 1 and 3 (rank 1's) have no test
    data: the logged test loss and accuracy."""
    clients = tiny_clients(4)
    for c in (1, 3):
        del clients[c]["test"]
    data = InMemoryFederatedDataModule(clients, batch_size=4)
    trained = tiny_module()
    trainer = make_trainer(FederatedStrategy(local_steps=2, seed=0), 1, **trainer_options)
    trainer.fit(trained, datamodule=data)
    trainer.test(trained, datamodule=data, verbose=False)
    return {name: float(trainer.callback_metrics[name]) for name in ("test_loss", "test_acc")}


def population_fit(**trainer_options) -> dict:
    """An array federation of 9 clients (some unseen), 4 a round, a validation cohort of 5
    each round, then a full validation vectorized over clients: the model, the cohort's
    logged values and every client's validation values."""
    from lightning_fl.datamodules import ArrayFederatedDataModule, ClientArrays

    clients = tiny_clients(9)
    splits = {split: ClientArrays.from_clients([c[split] for c in clients])
              for split in ("train", "val")}  # fmt: skip
    data = ArrayFederatedDataModule(splits=splits, unseen_fraction=0.2, batch_size=4,
                                    eval_batch_size=2)  # fmt: skip
    trained = tiny_module()
    strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=2, seed=2,
                                 eval_clients=5, vectorize_evaluation=True)  # fmt: skip
    trainer = make_trainer(strategy, 3, [FedAvg()], limit_val_batches=None, **trainer_options)
    trainer.fit(trained, datamodule=data)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    trainer.validate(trained, datamodule=data, verbose=False)
    per_client = trainer.strategy.evaluation.last_report[1]
    return {"params": params_of(trained), "cohort": logged,
            "clients": {k: dict(v) for k, v in per_client.items()}}  # fmt: skip


def unlearning_fit(method: str, **trainer_options) -> dict:
    """``method`` on 8 clients, 4 a round, 6 rounds, with clients 0 and 1 asking to be
    forgotten at round 4 (SIFU at σ = 0.01 restarts from round 1, a point that the
    sensitivities of every rank's clients decide): the model, SIFU's history Ψ (one
    tensor a branch, rounds × clients) and the requests served."""
    forgetting = Unlearning(method, sigma=0.01, requests={4: [0, 1]})
    trained = tiny_module()
    strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=3, seed=3)
    trainer = make_trainer(strategy, 6, [FedAvg(), forgetting], **trainer_options)
    trainer.fit(trained, datamodule=tiny_datamodule(num_clients=8))
    psi = [torch.tensor(np.array(branch, dtype=np.float64)) for branch in forgetting.history.psi]
    return {"params": params_of(trained), "psi": psi, "requests": forgetting.done_requests}


def module(seed: int) -> Classifier:
    torch.manual_seed(seed)
    return Classifier(network=MLP(IN, (HIDDEN,), OUT), lr=0.1)


def strategy(vectorize: bool, **kw) -> FederatedStrategy:
    return FederatedStrategy(local_epochs=1, seed=3, vectorize=vectorize,
                             max_vectorized_clients=CHUNK if vectorize else None, **kw)  # fmt: skip


class TestBatches(pl.Callback):
    """Counts the test batches this process runs."""

    def __init__(self) -> None:
        self.count = 0

    def on_test_batch_start(self, *args) -> None:
        self.count += 1


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

    def record_process_group_at_exit() -> None:
        alive = torch.distributed.is_initialized()
        with open(os.path.join(root, f"rank{rank}.exit"), "w") as file:
            file.write("alive" if alive else "destroyed")

    atexit.register(record_process_group_at_exit)
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
    results["ca_fed"] = ca_fed_fit(devices=2)
    results["sifu"] = unlearning_fit("sifu", devices=2)
    results["torchmetrics"] = torchmetrics_test(devices=2)
    results["plain"] = plain_test(devices=2)
    results["idle_rank"] = idle_rank_test(devices=2)
    results["population"] = population_fit(devices=2)
    try:
        unlearning_fit("fedaccum", devices=2)
        results["fedaccum"] = "ran"
    except ValueError as err:
        results["fedaccum"] = str(err)
    torch.save(results, os.path.join(root, f"rank{rank}.pt"))
