"""Resuming from a between-rounds checkpoint reproduces the uninterrupted run exactly."""

from __future__ import annotations

import pytest
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


def _personalization_callbacks(name: str):
    from lightning_fl.callbacks import (
        APFL,
        ClusteredFL,
        Ditto,
        FedEM,
        FedRep,
        GossipAveraging,
        PFedMe,
    )

    return {
        "ditto": lambda: [Ditto(lam=0.5, personal_lr=0.05)],
        "apfl": lambda: [APFL(alpha=0.3, local_lr=0.05, adaptive_alpha=True)],
        "fedrep": lambda: [FedRep(head_epochs=1, head_lr=0.05)],
        "pfedme": lambda: [PFedMe(lam=2.0, personal_lr=0.05, inner_steps=2)],
        "clustered": lambda: [ClusteredFL(eps1=10.0, eps2=0.0, warmup_rounds=1)],
        "d_fedem": lambda: [FedEM(), GossipAveraging(edge_probability=0.5, seed=1)],
    }[name]()


@pytest.mark.parametrize("name", ["ditto", "apfl", "fedrep", "pfedme", "clustered", "d_fedem"])
def test_personalization_state_survives_resume(name, tmp_path):
    from lightning_fl import MLP, MixtureClassifier

    def module(seed=1):
        torch.manual_seed(seed)
        if name == "d_fedem":
            return MixtureClassifier(MLP(6, (8,), 3), num_components=2, lr=0.1)
        return tiny_module(0.1, seed=seed)

    def strategy():  # 4 clients of 10 a round: some take part for the first time after the resume
        partial = name in ("ditto", "apfl", "fedrep", "pfedme")
        return FederatedStrategy(
            sampler=UniformSampler(4) if partial else None, local_steps=3, seed=5
        )

    full = module()
    full_trainer = make_trainer(strategy(), 4, _personalization_callbacks(name))
    full_trainer.fit(full, datamodule=tiny_datamodule())
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}"
    )
    make_trainer(
        strategy(), 2, [*_personalization_callbacks(name), checkpoint], enable_checkpointing=True
    ).fit(module(), datamodule=tiny_datamodule())
    resumed = module(seed=123)
    trainer = make_trainer(strategy(), 4, _personalization_callbacks(name))
    trainer.fit(resumed, datamodule=tiny_datamodule(), ckpt_path=str(tmp_path / "epoch=1.ckpt"),
                weights_only=True)  # fmt: skip
    for a, b in zip(params_of(full), params_of(resumed)):
        assert torch.equal(a, b)
    store_full, store_resumed = full_trainer.strategy.client_store, trainer.strategy.client_store

    def assert_stores_equal():
        assert store_full.clients() == store_resumed.clients()
        for c in store_full.clients():
            for key, value in store_full.state_dict()[c].items():
                other = store_resumed.get(c, key)
                same = (
                    torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
                )
                assert same, (c, key)

    assert_stores_equal()
    if name == "ditto":  # the checkpoint's state is restored once: a later test keeps round 4's
        trainer.test(resumed, datamodule=tiny_datamodule(), verbose=False)
        assert_stores_equal()


def test_a_truncated_checkpoint_error_names_the_file(tmp_path):
    from lightning_fl.engine.federated_state import CheckpointReadError

    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, filename="{epoch}")
    make_trainer(FederatedStrategy(local_steps=2), 1, [checkpoint], enable_checkpointing=True).fit(
        tiny_module(), datamodule=tiny_datamodule()
    )
    path = tmp_path / "epoch=0.ckpt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    trainer = make_trainer(FederatedStrategy(local_steps=2), 2)
    with pytest.raises(CheckpointReadError, match=r"epoch=0\.ckpt: cannot be read.*truncated"):
        trainer.fit(tiny_module(), datamodule=tiny_datamodule(), ckpt_path=str(path))


def test_resume_with_the_similarity_sampler_is_exact(tmp_path):
    """The representative gradients G_i are sampler state: in the checkpoint, and the
    resumed run draws the same clients."""
    from lightning_fl import SimilarityClusteredSampler

    def strategy():
        return FederatedStrategy(sampler=SimilarityClusteredSampler(3), local_steps=3, seed=2)

    full, full_strategy = tiny_module(0.1), strategy()
    make_trainer(full_strategy, 4).fit(full, datamodule=tiny_datamodule())
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}"
    )
    make_trainer(strategy(), 2, [checkpoint], enable_checkpointing=True).fit(
        tiny_module(0.1), datamodule=tiny_datamodule()
    )
    saved = torch.load(tmp_path / "epoch=1.ckpt", weights_only=True)
    assert saved["callbacks"]["_RoundDriver"]["sampler"]["gradients"].any()
    resumed, resumed_strategy = tiny_module(0.1, seed=9), strategy()
    make_trainer(resumed_strategy, 4).fit(
        resumed, datamodule=tiny_datamodule(), ckpt_path=str(tmp_path / "epoch=1.ckpt"),
        weights_only=True,
    )  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(params_of(full), params_of(resumed)))
    assert torch.equal(full_strategy.sampler.gradients, resumed_strategy.sampler.gradients)


def test_resuming_with_another_seed_warns_naming_both_and_the_same_seed_does_not(tmp_path):
    import warnings

    checkpoint = ModelCheckpoint(tmp_path, "saved", every_n_epochs=1)
    first = make_trainer(
        FederatedStrategy(local_steps=1, seed=3), 1, [checkpoint], enable_checkpointing=True
    )
    first.fit(tiny_module(), datamodule=tiny_datamodule())
    path = str(tmp_path / "saved.ckpt")
    with pytest.warns(UserWarning, match="Resuming with seed 7 from a checkpoint made with seed 3"):
        make_trainer(FederatedStrategy(local_steps=1, seed=7), 2).fit(
            tiny_module(), datamodule=tiny_datamodule(), ckpt_path=path
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Resuming with seed")
        make_trainer(FederatedStrategy(local_steps=1, seed=3), 2).fit(
            tiny_module(), datamodule=tiny_datamodule(), ckpt_path=path
        )


def test_a_resume_keeps_the_count_of_consecutive_bad_rounds(tmp_path):
    """Every update is NaN in rounds 1 and 2, at most 2 bad rounds in a row: the run
    resumed from the checkpoint after round 1 (one bad round so far) stops at round 2,
    as the uninterrupted run does; a count restarted at 0 would let it go on."""
    from lightning_fl.engine.round_engine import NonFiniteUpdateError
    from tests.helpers import PoisonedUpdates

    def trainer(rounds, *extra, **kw):
        strategy = FederatedStrategy(local_steps=1, max_consecutive_bad_rounds=2)
        poison = PoisonedUpdates(rounds=[1, 2], clients=list(range(10)))
        return make_trainer(strategy, rounds, [poison, *extra], **kw)

    checkpoint = ModelCheckpoint(tmp_path, "{epoch}", save_top_k=-1, every_n_epochs=1)
    with pytest.warns(UserWarning, match="NaN or Inf"):
        first = trainer(2, checkpoint, enable_checkpointing=True)
        first.fit(tiny_module(), datamodule=tiny_datamodule())
    assert first.strategy.engine.consecutive_bad_rounds == 1
    resumed = trainer(4)
    with pytest.warns(UserWarning, match="NaN or Inf"):
        with pytest.raises(NonFiniteUpdateError, match="2 consecutive rounds"):
            resumed.fit(tiny_module(), datamodule=tiny_datamodule(),
                        ckpt_path=str(tmp_path / "epoch=1.ckpt"))  # fmt: skip


def test_a_checkpoint_read_error_says_what_is_wrong_in_one_sentence():
    """Unpickling refusals and torch's weights_only refusals read "not a checkpoint, or one
    holding objects ..." (without torch's advice to load unsafely); any other error gives
    its first line's first sentence, and an error without a message its type."""
    import pickle

    from lightning_fl.engine.federated_state import CheckpointReadError

    refused = "(not a checkpoint, or one holding objects that safe weights_only loading refuses)"
    unsafe_advice = "Weights only load failed. Re-running with weights_only=False ..."
    for err in (pickle.UnpicklingError("invalid load key, 'x'."), RuntimeError(unsafe_advice)):
        message = str(CheckpointReadError.of("a.ckpt", err))
        assert message.startswith(f"a.ckpt: cannot be read as a checkpoint {refused}. It may")
        assert "weights_only=False" not in message
    zip_error = RuntimeError(
        "PytorchStreamReader failed reading zip archive: failed finding central directory. "
        "More.\nA second line."
    )
    message = str(CheckpointReadError.of("b.ckpt", zip_error))
    first = "PytorchStreamReader failed reading zip archive: failed finding central directory"
    assert message.startswith(f"b.ckpt: cannot be read as a checkpoint ({first}). It may")
    assert str(CheckpointReadError.of("c.ckpt", EOFError())).startswith(
        "c.ckpt: cannot be read as a checkpoint (EOFError). It may be truncated"
    )
