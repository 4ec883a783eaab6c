"""One site of a Flower run that loses a site and gets it back (run by
tests/test_flower_dropout.py):

    python -m tests.flower_dropout_site ROOT RANK MODE [kill|rejoin]

Site ``NAMES[RANK]`` fits 4 rounds of FedAvg on 6 clients of unequal sizes (it owns
clients RANK and RANK + 3) through ``FlowerSite(min_sites=2)``, its mailbox
``ROOT/<name>.sock``, with ``SecureAggregation`` signed by ``ROOT/creds`` when MODE is
``secure`` (``plain``: without), and a checkpoint every round (``ROOT/checkpoints``).

- ``kill``: the process SIGKILLs itself at its first local step of round KILL_ROUND, as a
  site whose machine goes away.
- ``rejoin``: the site starts again from its last checkpoint (``--ckpt_path last``) and
  writes ``ROOT/back`` once its mailbox is open.
- The others, at the start of round KILL_ROUND + 1, write ``ROOT/waiting`` and wait for
  ``ROOT/back`` (so that the site rejoins at the end of that round, and trains again from
  round KILL_ROUND + 2 on: a deterministic schedule for the test).

Every site that finishes saves its final model to ``ROOT/<name>.pt``; each logs to
``ROOT/<name>/logs/version_0`` (usa, rank 0, also writes ``participation.csv`` there).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_fl import FederatedStrategy
from lightning_fl.callbacks import SecureAggregation
from lightning_fl.flower import FlowerSite
from tests.helpers import make_trainer, params_of, tiny_datamodule, tiny_module

NAMES = ["usa", "hungary", "switzerland"]
ROUNDS, CLIENTS, KILL_ROUND = 4, 6, 1


class Schedule(pl.Callback):
    """The test's schedule (every site has it, so that their recipes agree; what it does
    depends on the site's ``role``)."""

    def __init__(self, root: str, role: str) -> None:
        self.root, self.role = Path(root), role

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.role == "kill" and trainer.current_epoch == KILL_ROUND:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.role == "stay" and trainer.current_epoch == KILL_ROUND + 1:
            (self.root / "waiting").touch()
            deadline = time.monotonic() + 120
            while not (self.root / "back").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("the killed site did not come back within 120 s")
                time.sleep(0.1)


class AnnouncedSite(FlowerSite):
    """FlowerSite that writes ``<root>/back`` once a rejoining site's mailbox is open."""

    def __init__(self, root: str, role: str) -> None:
        super().__init__(mailbox=os.path.join(root, "{silo}.sock"), timeout=60, min_sites=2)
        self.root, self.role = Path(root), role

    def open(self, rank: int, world_size: int, site: str) -> None:
        super().open(rank, world_size, site)
        if self.role == "rejoin":
            (self.root / "back").touch()


def main() -> None:
    root, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    role = sys.argv[4] if len(sys.argv) > 4 else "stay"
    callbacks: list[pl.Callback] = [
        Schedule(root, role),
        ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"), save_last=True),
    ]
    if mode == "secure":
        creds = os.path.join(root, "creds")
        callbacks.append(SecureAggregation(signing_key=f"{creds}/{{silo}}.key",
                                           site_keys=f"{creds}/{{silo}}.pub"))  # fmt: skip
    strategy = FederatedStrategy(silos=NAMES, silo=NAMES[rank], transport=AnnouncedSite(root, role),
                                 local_steps=3, seed=5)  # fmt: skip
    logger = CSVLogger(os.path.join(root, NAMES[rank]), name="logs", version=0)
    trainer = make_trainer(strategy, ROUNDS, callbacks, enable_checkpointing=True,
                           default_root_dir=os.path.join(root, NAMES[rank]), logger=logger,
                           num_nodes=len(NAMES), devices=1)  # fmt: skip
    module = tiny_module()
    last = os.path.join(root, "checkpoints", "last.ckpt") if role == "rejoin" else None
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=CLIENTS), ckpt_path=last)
    torch.save(params_of(module), os.path.join(root, f"{NAMES[rank]}.pt"))


if __name__ == "__main__":
    main()
