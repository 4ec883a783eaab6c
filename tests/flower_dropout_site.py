"""One site of a Flower run that loses a site (run by tests/test_flower_dropout.py):

    python -m tests.flower_dropout_site ROOT RANK MODE [KILL_ROUND]

Site ``NAMES[RANK]`` fits 4 rounds of FedAvg on 6 clients of unequal sizes (it owns
clients RANK and RANK + 3) through ``FlowerSite(min_sites=2)``, its mailbox
``ROOT/<name>.sock``, with ``SecureAggregation`` signed by ``ROOT/creds`` when MODE is
``secure`` (``plain``: without). With KILL_ROUND the process SIGKILLs itself at its first
local step of that round, as a site whose machine goes away; otherwise it saves its final
model to ``ROOT/<name>.pt``.
"""

from __future__ import annotations

import os
import signal
import sys

import lightning.pytorch as pl
import torch

from lightning_fl import FederatedStrategy
from lightning_fl.callbacks import SecureAggregation
from lightning_fl.flower import FlowerSite
from tests.helpers import make_trainer, params_of, tiny_datamodule, tiny_module

NAMES = ["usa", "hungary", "switzerland"]
ROUNDS, CLIENTS = 4, 6


class KilledAt(pl.Callback):
    """SIGKILL this process at its first local step of round ``$KILL_ROUND`` (every site
    has this callback, so that their recipes agree; only the killed site's environment
    names a round)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if str(trainer.current_epoch) == os.environ.get("KILL_ROUND"):
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    root, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if len(sys.argv) > 4:
        os.environ["KILL_ROUND"] = sys.argv[4]
    callbacks: list[pl.Callback] = [KilledAt()]
    if mode == "secure":
        creds = os.path.join(root, "creds")
        callbacks.append(SecureAggregation(signing_key=f"{creds}/{{silo}}.key",
                                           site_keys=f"{creds}/{{silo}}.pub"))  # fmt: skip
    site = FlowerSite(mailbox=os.path.join(root, "{silo}.sock"), timeout=60, min_sites=2)
    strategy = FederatedStrategy(silos=NAMES, silo=NAMES[rank], transport=site,
                                 local_steps=3, seed=5)  # fmt: skip
    trainer = make_trainer(strategy, ROUNDS, callbacks,
                           default_root_dir=os.path.join(root, NAMES[rank]),
                           num_nodes=len(NAMES), devices=1)  # fmt: skip
    module = tiny_module()
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=CLIENTS))
    torch.save(params_of(module), os.path.join(root, f"{NAMES[rank]}.pt"))


if __name__ == "__main__":
    main()
