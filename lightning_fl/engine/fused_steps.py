"""Several local steps of one client in one Lightning step: the sequential path with
``FederatedStrategy(local_steps_per_training_step=k)`` (None: all of a client's steps).

Lightning's per-step machinery (its loops, progress tracking, the result collection, a
dozen hook dispatches) costs about as much as a small model's step on a CPU
(``benchmarks/overhead.py --anatomy``). Here it is paid once per k local steps: each
local step still runs, in Lightning's order, the module's ``training_step``, the
optimizer's ``zero_grad``, Lightning's backward (with its ``on_before_backward`` and
``on_after_backward`` hooks) and Lightning's optimizer step (``on_before_optimizer_step``
hooks and gradient clipping), so the model is the one-step-per-batch path's, exactly.

What changes, and is refused where it would be seen (:func:`refusal`): hooks that run at
every Lightning batch (``on_train_batch_start``/``_end``) run once per k local steps, so a
plugin or module that reads every batch's start or end is refused, and so is a
learning-rate scheduler that steps every Lightning step; ``trainer.global_step`` and
``log_every_n_steps`` count Lightning steps; ``training_step`` receives the Lightning
step's ``batch_idx``. Accumulated gradients and manual optimization are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch

#: Hooks that run at every Lightning batch: once per k local steps here.
PER_BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end")
#: Hooks of Lightning's ``zero_grad``, which the fused step replaces by the optimizer's own.
ZERO_GRAD_HOOKS = ("on_before_zero_grad", "optimizer_zero_grad")


def refusal(trainer: pl.Trainer) -> str | None:
    """Why ``trainer``'s module, callbacks or optimization cannot fuse local steps, or
    None. A plugin's per-batch hooks are per local step; any other callback's (the
    strategy's own, Lightning's progress bars and checkpoints) see Lightning steps."""
    from lightning_fl.engine.plugins import FederatedCallback

    module = trainer.lightning_module
    if not module.automatic_optimization:
        return "the module optimizes manually (automatic_optimization=False)"
    if trainer.accumulate_grad_batches != 1:
        return f"gradients are accumulated over {trainer.accumulate_grad_batches} batches"
    for hook in (*PER_BATCH_HOOKS, *ZERO_GRAD_HOOKS):
        if getattr(type(module), hook) is not getattr(pl.LightningModule, hook):
            return f"{type(module).__name__} overrides {hook}, which runs at every local step"
    for cb in trainer.callbacks:
        hooks = ZERO_GRAD_HOOKS[:1]
        if isinstance(cb, FederatedCallback):
            hooks = (*PER_BATCH_HOOKS, *hooks)
        for hook in hooks:
            if getattr(type(cb), hook) is not getattr(pl.Callback, hook):
                name = type(cb).__name__
                return f"the callback {name} overrides {hook}, which runs at every local step"
    for config in trainer.lr_scheduler_configs:
        if config.interval == "step":
            return (
                f"the {type(config.scheduler).__name__} learning-rate scheduler steps every "
                "Lightning step"
            )
    return None


def check(trainer: pl.Trainer, fused: int | None) -> None:
    """Refuse ``local_steps_per_training_step=fused`` on the sequential path where
    :func:`refusal` finds a reason, naming it and the fix."""
    if fused == 1:
        return
    reason = refusal(trainer)
    if reason is not None:
        raise ValueError(
            f"local_steps_per_training_step={fused} runs several local steps of a client in "
            f"one Lightning step, but {reason}. Set local_steps_per_training_step=1."
        )


class FusedLocalSteps:
    """Runs a Lightning step's local steps of one client as Lightning would one per step.

    Args:
        backward: the strategy's backward of a loss for an optimizer.
        optimizer_step: the strategy's optimizer step of an optimizer with a closure.
        observe: takes each local step's loss (divergence checks).
    """

    def __init__(
        self,
        backward: Callable[[torch.Tensor, Any], Any],
        optimizer_step: Callable[[Any, Callable[[], Any]], Any],
        observe: Callable[[torch.Tensor], None],
    ) -> None:
        self.backward, self.optimizer_step, self.observe = backward, optimizer_step, observe

    def run(self, batches: Sequence[Any], optimizer: Any, user_step: Callable[[Any], Any]) -> None:
        """One local step per batch of ``batches``: Lightning's closure (``user_step``, the
        module's ``training_step`` of one batch through the strategy; zero grad; backward)
        inside Lightning's optimizer step."""
        for batch in batches:
            losses: list[torch.Tensor] = []

            def closure(batch: Any = batch, losses: list = losses) -> torch.Tensor | None:
                output = user_step(batch)
                loss = output.get("loss") if isinstance(output, dict) else output
                optimizer.zero_grad()
                if loss is not None:
                    self.backward(loss, optimizer)
                    losses.append(loss.detach())
                return loss

            self.optimizer_step(optimizer, closure)
            if losses and losses[-1].numel() == 1:
                self.observe(losses[-1])
