"""A callback that kills its process by signal once (issue 36's restart test, run by
tests/test_silos.py under ``torchrun --max-restarts``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning.pytorch as pl


class KillOnce(pl.Callback):
    """On torchrun's first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), rank ``rank``
    writes ``marker`` and sends itself SIGKILL after batch ``batch`` of round ``round``:
    mid-round, between two checkpoints, as a crashed machine does."""

    def __init__(self, marker: str, rank: int = 1, round: int = 2, batch: int = 3) -> None:
        self.marker, self.rank, self.round, self.batch = marker, rank, round, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        here = (trainer.global_rank, trainer.current_epoch, batch_idx)
        if first_attempt and here == (self.rank, self.round, self.batch):
            Path(self.marker).write_text(f"killed rank {self.rank} in round {self.round}\n")
            os.kill(os.getpid(), signal.SIGKILL)
