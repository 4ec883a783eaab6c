"""Resuming from a between-rounds checkpoint reproduces the uninterrupted run exactly."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fl import FederatedStrategy, UniformSampler
from lightning_fl.callbacks import SCAFFOLD, FedAdam
from tests.helpers import make_trainer, params_of, tiny_datamodule, tiny_module


def _module():
    module = tiny_module(0.1)
    module.hparams.momentum = 0.5
    module.hparams.lr_decay = 0.9
    return module


def _strategy():
    return FederatedStrategy(
        sampler=UniformSampler(3), local_steps=4, seed=5, keep_optimizer_state=True
    )


def _callbacks(dirpath=None):
    callbacks = [SCAFFOLD(), FedAdam(server_lr=0.02)]
    if dirpath is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        )
    return callbacks


def test_resume_from_round_3_of_6_is_exact(tmp_path):
    full = _module()
    make_trainer(_strategy(), 6, _callbacks(), limit_val_batches=None).fit(
        full, datamodule=tiny_datamodule()
    )

    first = _module()
    make_trainer(
        _strategy(), 3, _callbacks(tmp_path), enable_checkpointing=True, limit_val_batches=None
    ).fit(first, datamodule=tiny_datamodule())
    ckpt = tmp_path / "epoch=2.ckpt"
    assert ckpt.exists()
    saved = torch.load(ckpt, weights_only=True)
    assert saved["callbacks"]["_RoundDriver"]["client_store"]

    resumed_module = tiny_module(
        0.1, seed=123
    )  # different init: everything must come from the checkpoint
    resumed_module.hparams.momentum = 0.5
    resumed_module.hparams.lr_decay = 0.9
    strategy = _strategy()
    trainer = make_trainer(strategy, 6, _callbacks(), limit_val_batches=None)
    trainer.fit(
        resumed_module, datamodule=tiny_datamodule(), ckpt_path=str(ckpt), weights_only=True
    )

    assert trainer.current_epoch == 6
    for a, b in zip(params_of(full), params_of(resumed_module)):
        assert torch.equal(a, b)
