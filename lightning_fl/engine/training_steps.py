"""What each Lightning training step of a round does: one local step of the client whose
batch it is (the sequential path), several of them (fused local steps,
:mod:`.fused_steps`), one step of a chunk of clients trained together (the vectorized
path, :mod:`.vectorized`), or nothing (a rank's idle padding batches)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_fl.engine.fused_steps import FusedLocalSteps
from lightning_fl.engine.planning import PADDING
from lightning_fl.engine.round_engine import RoundEngine
from lightning_fl.engine.vectorized import VectorizedClients


class TrainingSteps:
    """Locates each training batch in the round (:meth:`locate`, at Lightning's batch
    start: a client's or chunk's first batch starts it) and runs its step (:meth:`run`).
    ``idle`` says whether Lightning's optimizer step that follows has nothing to do: a
    padding batch, or a vectorized or fused step, which steps its clients itself."""

    def __init__(
        self,
        engine: RoundEngine,
        vectorized: VectorizedClients,
        device: torch.device,
        fused: FusedLocalSteps,
    ) -> None:
        self.engine, self.vectorized, self.device = engine, vectorized, device
        self.fused = fused
        self.idle = False

    def locate(self, batch_idx: int) -> None:
        plan = self.engine.current_round
        if plan.chunks is not None:
            chunk, step = plan.steps.locate(batch_idx)
            self.vectorized.current = (chunk, step)
            self.idle = True
            if step == 0 and chunk < len(plan.chunks):
                self.vectorized.start_chunk(chunk)
            return
        if plan.fused:
            self._locate_fused(plan, batch_idx)
            return
        pos, step = plan.schedule.locate(batch_idx)
        self.engine.current_client = (pos, step)
        self.idle = plan.is_padding(pos)
        if step == 0 and not self.idle:
            self.engine.start_client(pos)

    def _locate_fused(self, plan, batch_idx: int) -> None:
        """A fused step: its client, and as local step the last one it runs (or, for a
        rank's idle steps, the padding's)."""
        index, step = plan.steps.locate(batch_idx)
        pos = plan.steps.clients[index]
        self.idle = True  # the fused step steps the optimizer itself
        if pos == PADDING:
            self.engine.current_client = None
            return
        count = plan.schedule.num_batches[pos]
        per_step = self.engine.fit.config.local_steps_per_training_step or count
        self.engine.current_client = (pos, min((step + 1) * per_step, count) - 1)
        if step == 0:
            self.engine.start_client(pos)

    def run(self, batch: Any, user_step: Callable[[Any], Any]) -> Any:
        """The step of ``batch``: ``user_step`` (the module's ``training_step`` of a batch)
        for a client's batch; a vectorized chunk's or a client's fused local steps, which
        step the optimizer themselves; otherwise (and after those) a zero loss tied to no
        parameter, so that the optimizer step that follows finds no gradient and changes
        nothing."""
        plan, current = self.engine.current_round, self.vectorized.current
        if plan is not None and plan.chunks is not None and current is not None:
            if current[0] < len(plan.chunks):
                try:
                    self.vectorized.train_step(batch)
                except StopIteration as err:  # Lightning would end the epoch silently
                    raise RuntimeError("a vectorized step raised StopIteration") from err
            return torch.zeros((), device=self.device, requires_grad=True)
        if plan is not None and plan.fused:
            if batch:  # {"local_batches": [...]}; () is one of this rank's idle steps
                optimizer = self.engine.fit.trainer.optimizers[0]
                self.fused.run(batch["local_batches"], optimizer, user_step)
            return torch.zeros((), device=self.device, requires_grad=True)
        client = self.engine.current_client
        if client is not None and plan.is_padding(client[0]):
            return torch.zeros((), device=self.device, requires_grad=True)
        return user_step(batch)
