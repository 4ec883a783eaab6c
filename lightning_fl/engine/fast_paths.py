"""Which of Lightning's per-step machinery the strategy may skip, decided once at setup.

The dispatch of a dozen empty hooks, and the walk of batch transfer over in-memory CPU
batches, cost more per step than a small model's arithmetic (``benchmarks/overhead.py
--anatomy``). They are skipped only where nothing could observe the difference: no
callback, no module and no precision plugin overrides the hooks concerned.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision

_TRANSFER_HOOKS = ("transfer_batch_to_device", "on_after_batch_transfer")


def direct_hooks(trainer: pl.Trainer, precision_plugin: object) -> dict[str, bool]:
    """Which of Lightning's per-step paths (``backward``, ``optimizer_step``) may skip
    their hook dispatch: those whose hooks no callback and not the module override, with
    the plain 32-bit precision (and, for the optimizer step, no gradient clipping)."""
    module = trainer.lightning_module
    plain = type(precision_plugin) is Precision and module.automatic_optimization

    def untouched(module_hooks: tuple[str, ...], callback_hooks: tuple[str, ...]) -> bool:
        if any(getattr(type(module), h) is not getattr(pl.LightningModule, h)
               for h in module_hooks):  # fmt: skip
            return False
        return not any(
            getattr(type(cb), h) is not getattr(pl.Callback, h)
            for cb in trainer.callbacks
            for h in callback_hooks
        )

    no_clipping = not trainer.gradient_clip_val
    return {
        "backward": plain
        and untouched(
            ("on_before_backward", "backward", "on_after_backward"),
            ("on_before_backward", "on_after_backward"),
        ),
        "optimizer_step": plain
        and no_clipping
        and untouched(
            ("on_before_optimizer_step", "configure_gradient_clipping"),
            ("on_before_optimizer_step",),
        ),
    }


def overrides_transfer(module: pl.LightningModule) -> bool:
    """Whether the module or its datamodule changes how batches reach the device."""
    datamodule = module.trainer.datamodule if module._trainer is not None else None
    pairs = [(module, pl.LightningModule), (datamodule, pl.LightningDataModule)]
    return any(
        getattr(type(obj), hook) is not getattr(base, hook)
        for obj, base in pairs
        if obj is not None
        for hook in _TRANSFER_HOOKS
    )
