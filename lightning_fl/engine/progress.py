"""A progress bar that shows the round, the client i/n and the local step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar


class FederatedProgressBar(TQDMProgressBar):
    """``Round r/R`` as the description, ``client i/m`` and ``step k/K`` in the postfix.

    Rounds are numbered from 0 like Lightning's epochs, and shown as Lightning's Rich bar
    shows epochs: ``Round 3/39`` is round 3 (the fourth) of rounds 0..39. ``fl/round``,
    the ``round`` column of client_metrics.csv, warnings and checkpoint names
    (``epoch=3``) use the same number. Clients and local steps count from 1 (``client
    2/10`` is the second of ten). FederatedStrategy puts it in place of Lightning's bar.
    """

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # The round is planned when its batches are first drawn, so its size is known here.
        if batch_idx == 0 and trainer.strategy.current_round is not None:
            self.train_progress_bar.reset(total=trainer.strategy.current_round.steps.total)
            last = trainer.max_epochs - 1 if trainer.max_epochs and trainer.max_epochs > 0 else "?"
            self.train_progress_bar.set_description(f"Round {trainer.current_epoch}/{last}")

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        strategy = trainer.strategy
        engine = getattr(strategy, "engine", None)
        plan = engine.current_round if engine is not None else None
        where = engine.current_client if engine is not None else None
        vectorized = getattr(strategy, "vectorized", None)
        chunk = getattr(vectorized, "current", None)
        if trainer.training and plan is not None and plan.chunks is not None and chunk:
            index, step = chunk
            if index < len(plan.chunks):  # clients i–j of n, trained together
                first, last = plan.chunks[index][0], plan.chunks[index][-1]
                metrics["clients"] = f"{first + 1}–{last + 1}/{len(plan.schedule.clients)}"
                local = plan.chunk_local_steps(index)
                fused = strategy.config.local_steps_per_training_step or local
                low, high = step * fused + 1, min((step + 1) * fused, local)
                span = f"{low}" if low == high else f"{low}–{high}"
                metrics["step"] = f"{span}/{local}"
            seconds = getattr(vectorized, "compile_seconds", None)
            if seconds is not None:  # compile=True: the time spent compiling so far
                metrics["compile"] = f"{seconds:.1f}s"
        elif trainer.training and plan is not None and where is not None:
            pos, step = where
            metrics["client"] = f"{pos + 1}/{len(plan.schedule.clients)}"
            metrics["step"] = f"{step + 1}/{plan.schedule.num_batches[pos]}"
        return metrics
