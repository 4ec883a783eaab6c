"""What vectorized clients can train exactly, checked at set-up (``vectorize=True``).

A module, optimizer, trainer or callback that the vectorized step cannot run exactly is
refused with a :class:`VectorizationError` naming the fix (:mod:`lightning_fl.engine.vectorized`
says what a module must satisfy, and why).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: LightningModule hooks that run at every local step of the sequential path; the
#: vectorized step does not call them, so a module that overrides one is refused.
PER_STEP_MODULE_HOOKS = (
    "training_step",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "on_before_zero_grad",
    "optimizer_zero_grad",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
    "optimizer_step",
)
#: Callback hooks that run at every local step of the sequential path.
PER_STEP_CALLBACK_HOOKS = (
    "on_before_backward",
    "on_after_backward",
    "on_before_zero_grad",
    "on_before_optimizer_step",
)


class VectorizationError(ValueError):
    """The module, optimizer or callbacks cannot train clients together."""


def refuse(problem: str) -> VectorizationError:
    return VectorizationError(
        f"vectorize=True: {problem} Fix that, or train clients one after another with "
        "FederatedStrategy(vectorize=False)."
    )


def not_vmappable(err: RuntimeError) -> VectorizationError:
    return refuse(
        "the module's loss_and_metrics cannot run under torch.func.vmap "
        f"({str(err).splitlines()[0]}). Keep the loss and metrics tensor functions "
        "of the batch: no .item(), float(), Python control flow on tensor values, "
        "or random ops other than nn.Dropout."
    )


def check_module(module: nn.Module) -> None:
    """Refuse a module the vectorized step cannot run exactly (see the module docstring)."""
    from lightning_fl.models import FederatedTask

    if not isinstance(module, FederatedTask):
        raise refuse(
            f"{type(module).__name__} is not a lightning_fl.FederatedTask: the vectorized "
            "step runs the loss of loss_and_metrics(batch). Subclass FederatedTask (or "
            "Classifier) and move the loss there."
        )
    for hook in PER_STEP_MODULE_HOOKS:
        if getattr(type(module), hook) is not getattr(FederatedTask, hook):
            raise refuse(
                f"{type(module).__name__} overrides {hook}, which runs at every local step "
                "of the sequential path and is not called by the vectorized step."
            )
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.momentum is None:
            raise refuse(
                f"{name} is a {type(sub).__name__} with momentum=None: its cumulative "
                "average counts steps in num_batches_tracked, an integer buffer the "
                "clients share. Give it a momentum (the default 0.1)."
            )
        dropout_like = isinstance(sub, nn.modules.dropout._DropoutNd)
        if dropout_like and type(sub) is not nn.Dropout and sub.p > 0:
            raise refuse(
                f"{name} is a {type(sub).__name__}; only nn.Dropout draws per-client masks."
            )


def check_callback(callback: Any) -> None:
    """Refuse a callback that acts at every local step or does not support vectorized
    clients (a FederatedCallback says so with ``supports_vectorized_clients``)."""
    from lightning.pytorch import Callback

    from lightning_fl.engine.plugins import FederatedCallback

    name = type(callback).__name__
    if isinstance(callback, FederatedCallback):
        if not callback.supports_vectorized_clients:
            reason = callback.not_vectorized_because
            raise refuse(
                f"the callback {name} does not support vectorized clients"
                + (f": {reason}." if reason else ".")
            )
        return
    for hook in PER_STEP_CALLBACK_HOOKS:
        if getattr(type(callback), hook) is not getattr(Callback, hook):
            raise refuse(
                f"the callback {name} overrides {hook}, which runs at every local step of "
                "the sequential path."
            )


#: The per-client hooks a batched chunk start and finish would skip.
CLIENT_HOOKS = ("on_client_start", "transform_update", "on_client_end", "receive_update")


def needs_client_hooks(callback: Any) -> bool:
    """Whether vectorized clients must run ``callback``'s client hooks one client at a
    time (its ``vectorized_client_hooks``, or, when None, whether it overrides one)."""
    from lightning_fl.engine.plugins import Aggregator, FederatedCallback

    declared = callback.vectorized_client_hooks
    if declared is not None:
        return declared
    kind = type(callback)
    return any(
        getattr(kind, hook, None) is not getattr(FederatedCallback, hook, None)
        and getattr(kind, hook, None) is not getattr(Aggregator, hook, None)
        for hook in CLIENT_HOOKS
    )


def check_compilable(module: nn.Module, callbacks: Sequence[Any]) -> None:
    """What the compiled step cannot run (:mod:`lightning_fl.engine.compiled`)."""
    from lightning_fl.engine.plugins import FederatedCallback

    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm):
            raise VectorizationError(
                f"compile=True: {name} is a {type(sub).__name__}, whose running statistics "
                "change in place inside the gradient transform, which torch.compile cannot "
                "trace. Use compile=False (the eager vectorized path keeps them per client)."
            )
        if isinstance(sub, nn.Dropout) and sub.p > 0:
            raise VectorizationError(
                f"compile=True: {name} is an nn.Dropout with p={sub.p}, whose per-client "
                "masks are drawn outside the compiled graph. Use compile=False, or p=0."
            )
    base = FederatedCallback.vectorized_client_state
    for cb in callbacks:
        if isinstance(cb, FederatedCallback) and type(cb).vectorized_client_state is not base:
            raise VectorizationError(
                f"compile=True: the callback {type(cb).__name__} installs per-client module "
                "state around the loss (vectorized_client_state). Use compile=False."
            )


def check_trainer(trainer: pl.Trainer) -> None:
    """32-bit precision, exactly one optimizer, and learning-rate schedules per round."""
    from lightning.pytorch.plugins.precision import Precision

    if type(trainer.precision_plugin) is not Precision:
        raise VectorizationError(
            f"vectorize=True runs in 32-bit precision; got "
            f"{type(trainer.precision_plugin).__name__}. Use Trainer(precision='32-true'), "
            "or vectorize=False."
        )
    if len(trainer.optimizers) != 1:
        raise VectorizationError(
            f"vectorize=True needs exactly one optimizer, got {len(trainer.optimizers)}. "
            "Return one from configure_optimizers, or use vectorize=False."
        )
    for config in trainer.lr_scheduler_configs:
        if config.interval == "step":
            raise VectorizationError(
                f"vectorize=True: the {type(config.scheduler).__name__} learning-rate "
                "scheduler steps every Lightning step, which trains every client of a chunk "
                "one or more local steps, not one client one step as the sequential path "
                "does. Step it per round (interval 'epoch'), or use vectorize=False."
            )
