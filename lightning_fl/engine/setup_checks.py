"""What a federated fit refuses or adjusts at set-up, rather than at a late epoch."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lightning_fl.engine.context import Federation
from lightning_fl.engine.data_contract import FederatedDataModule


def check_trainer(trainer: pl.Trainer) -> None:
    """Refuse gradient accumulation (client boundaries fall on optimizer steps) and a
    datamodule that is not a :class:`FederatedDataModule`."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            "FederatedStrategy needs accumulate_grad_batches=1: client boundaries must "
            "fall on optimizer steps. Raise the datamodule's batch_size instead."
        )
    if not isinstance(trainer.datamodule, FederatedDataModule):
        raise TypeError(
            "FederatedStrategy needs a lightning_fl.datamodules.FederatedDataModule: "
            "call trainer.fit(model, datamodule=...)."
        )


def check_federation(
    datamodule: FederatedDataModule, world_size: int, vectorize_evaluation: Any
) -> None:
    """Refuse fewer clients than processes, and ``vectorize_evaluation=True`` on a
    datamodule that does not hold its clients as arrays."""
    if vectorize_evaluation is True and datamodule.split_arrays("train") is None:
        raise ValueError(
            f"vectorize_evaluation=True, but {type(datamodule).__name__} does not hold its "
            "clients as arrays (split_arrays): use an ArrayFederatedDataModule or an "
            "InMemoryFederatedDataModule of plain tensors, or vectorize_evaluation='auto'."
        )
    if datamodule.num_clients < world_size:
        raise ValueError(
            f"{world_size} processes but only {datamodule.num_clients} clients: every rank "
            "must own at least one client; use fewer devices."
        )


def skip_validation_without_data(trainer: pl.Trainer, federation: Federation) -> None:
    """No client has a validation split: no validation loop (instead of Lightning's
    "Total length of `EvalRounds` across ranks is zero")."""
    if trainer.limit_val_batches != 0 and not federation.has_validation_data():
        rank_zero_info("No client has validation data: validation is skipped.")
        trainer.limit_val_batches = 0
