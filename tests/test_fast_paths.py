"""Which of Lightning's per-step hooks the strategy may skip (engine/fast_paths.py), path
by path: each condition alone turns off only the paths it concerns."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
from lightning.pytorch.plugins.precision import HalfPrecision, Precision

from lightning_fl.engine.fast_paths import direct_hooks, overrides_transfer
from tests.helpers import tiny_datamodule, tiny_module


def _hooks(module=None, callbacks=(), clip=None, precision=None):
    trainer = SimpleNamespace(lightning_module=module or tiny_module(), callbacks=list(callbacks),
                              gradient_clip_val=clip)  # fmt: skip
    return direct_hooks(trainer, precision or Precision())


class AfterBackward(pl.Callback):
    def on_after_backward(self, trainer, pl_module):
        pass


class BeforeStep(pl.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pass


def test_each_condition_turns_off_only_its_paths():
    assert _hooks() == {"backward": True, "optimizer_step": True}
    assert _hooks(callbacks=[pl.Callback()]) == {"backward": True, "optimizer_step": True}
    assert _hooks(callbacks=[AfterBackward()]) == {"backward": False, "optimizer_step": True}
    assert _hooks(callbacks=[BeforeStep()]) == {"backward": True, "optimizer_step": False}
    assert _hooks(clip=0.5) == {"backward": True, "optimizer_step": False}
    assert _hooks(clip=0.0) == {"backward": True, "optimizer_step": True}
    half = HalfPrecision("16-true")
    assert _hooks(precision=half) == {"backward": False, "optimizer_step": False}
    manual = tiny_module()
    manual.automatic_optimization = False
    assert _hooks(module=manual) == {"backward": False, "optimizer_step": False}


@pytest.mark.parametrize(
    ("hook", "expected"),
    [
        ("on_before_backward", {"backward": False, "optimizer_step": True}),
        ("backward", {"backward": False, "optimizer_step": True}),
        ("on_after_backward", {"backward": False, "optimizer_step": True}),
        ("on_before_optimizer_step", {"backward": True, "optimizer_step": False}),
        ("configure_gradient_clipping", {"backward": True, "optimizer_step": False}),
    ],
)
def test_a_module_that_overrides_a_hook_keeps_its_path(hook, expected):
    module = tiny_module()
    subclass = type("Overriding", (type(module),), {hook: lambda self, *a, **k: None})
    module.__class__ = subclass
    assert _hooks(module=module) == expected


def test_a_module_or_datamodule_that_moves_batches_itself_keeps_the_transfer():
    module = tiny_module()
    assert not overrides_transfer(module)  # no trainer: the module alone

    class Moving(type(module)):
        def on_after_batch_transfer(self, batch, dataloader_idx):
            return batch

    module.__class__ = Moving
    assert overrides_transfer(module)
    plain = tiny_module()
    datamodule = tiny_datamodule()

    class MovingData(type(datamodule)):
        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            return batch

    datamodule.__class__ = MovingData
    plain._trainer = SimpleNamespace(datamodule=datamodule)
    assert overrides_transfer(plain)
    datamodule.__class__ = type(tiny_datamodule())
    assert not overrides_transfer(plain)
