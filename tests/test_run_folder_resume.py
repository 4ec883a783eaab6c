"""A resumed fit continues in its run's folder (issue 68, engine/resume.py): after a crash
in round 2 and a resume from the last checkpoint, the folder's metrics.csv,
participation.csv and client_metrics.csv are byte-identical to an uninterrupted run's,
``last.ckpt`` is written over (no ``last-v1.ckpt``) and no second version appears."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_fl import FederatedStrategy, UniformSampler
from lightning_fl.engine.resume import last_checkpoint, next_round, run_folder_of
from tests.helpers import make_trainer, tiny_datamodule, tiny_module

FILES = ("metrics.csv", "participation.csv", "client_metrics.csv")


class CrashAt(pl.Callback):
    """Raises in the middle of ``round_idx`` (after some of its steps were logged)."""

    def __init__(self, round_idx: int) -> None:
        self.round_idx = round_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == self.round_idx and batch_idx == 3:
            raise RuntimeError("crash")


def _fit(root: Path, rounds: int, ckpt_path=None, crash_at=None, every=1) -> pl.Trainer:
    strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=2, seed=3)
    callbacks = [ModelCheckpoint(save_last=True, every_n_epochs=every)]
    callbacks += [CrashAt(crash_at)] if crash_at is not None else []
    trainer = make_trainer(
        strategy, rounds, callbacks, logger=CSVLogger(root, name="run"),
        enable_checkpointing=True, limit_val_batches=None, log_every_n_steps=1,
        default_root_dir=root,
    )  # fmt: skip
    trainer.fit(tiny_module(), datamodule=tiny_datamodule(), ckpt_path=ckpt_path,
                weights_only=True)  # fmt: skip
    return trainer


@pytest.mark.parametrize(("every", "relative"), [(1, False), (2, False), (1, True)])
def test_a_crashed_run_resumes_in_its_folder_as_if_uninterrupted(
    tmp_path, monkeypatch, every, relative
):
    """Checkpoints every round (the crash in round 2 leaves its steps' metrics) or every
    other round (the last checkpoint is of round 1: round 2's participation, validation
    and metrics rows are the crashed run's and are dropped before round 2 runs again);
    with a relative run folder (the recipes' ``outputs/...``) as with an absolute one:
    the checkpoint callback's state, whose folder is compared as written, is restored,
    so ``last.ckpt`` is written over."""
    if relative:
        monkeypatch.chdir(tmp_path)
        tmp_path = Path(".")
    _fit(tmp_path / "whole", 4, every=every)
    crash_at = 2 if every == 1 else 3
    with pytest.raises(RuntimeError, match="crash"):
        _fit(tmp_path / "crashed", 4, crash_at=crash_at, every=every)
    folder = tmp_path / "crashed" / "run" / "version_0"
    assert f"{crash_at}," in (folder / "metrics.csv").read_text()  # the crash left its steps
    if every == 2:
        rounds = [line.split(",")[1] for line in (folder / "client_metrics.csv").open()]
        assert "2" in rounds  # round 2's validation, which the resume trains again
    trainer = _fit(tmp_path / "crashed", 4, ckpt_path=folder / "checkpoints" / "last.ckpt",
                   every=every)  # fmt: skip
    assert Path(trainer.logger.log_dir).resolve() == folder.resolve()
    assert sorted(p.name for p in (tmp_path / "crashed" / "run").iterdir()) == ["version_0"]
    whole = tmp_path / "whole" / "run" / "version_0"
    for name in FILES:
        assert (folder / name).read_bytes() == (whole / name).read_bytes(), name
    checkpoints = sorted(p.name for p in (folder / "checkpoints").iterdir())
    assert checkpoints == sorted(p.name for p in (whole / "checkpoints").iterdir())
    assert "last-v1.ckpt" not in checkpoints
    assert not list(folder.glob("*.before-resume"))


def test_a_checkpoint_outside_the_loggers_folders_starts_a_new_version(tmp_path):
    _fit(tmp_path, 2)
    elsewhere = tmp_path / "elsewhere.ckpt"
    elsewhere.write_bytes((tmp_path / "run/version_0/checkpoints/last.ckpt").read_bytes())
    trainer = _fit(tmp_path, 3, ckpt_path=elsewhere)
    assert trainer.logger.log_dir == str(tmp_path / "run" / "version_1")
    assert "1," in (tmp_path / "run/version_0/metrics.csv").read_text()  # left alone


def test_the_last_checkpoint_and_the_round_a_resume_trains(tmp_path):
    for version, has_last in ((0, True), (3, True), (11, False)):
        folder = tmp_path / f"version_{version}" / "checkpoints"
        folder.mkdir(parents=True)
        if has_last:
            (folder / "last.ckpt").write_bytes(b"")
    assert last_checkpoint(tmp_path) == str(tmp_path / "version_3/checkpoints/last.ckpt")
    assert last_checkpoint(tmp_path / "version_11") is None
    for shard in ("hungarian/last.ckpt", "last.ckpt.silo1-of-2"):  # a site's machine
        site = tmp_path / "sites" / "version_2" / "checkpoints" / shard
        site.parent.mkdir(parents=True, exist_ok=True)
        site.write_bytes(b"")
        found = last_checkpoint(tmp_path / "sites")
        assert found == str(tmp_path / "sites/version_2/checkpoints/last.ckpt")
        site.unlink()
    (tmp_path / "sites" / "version_2" / "checkpoints" / "epoch=1.ckpt").write_bytes(b"")
    assert last_checkpoint(tmp_path / "sites") is None  # no last checkpoint, no shard of one
    assert run_folder_of(tmp_path / "version_3/checkpoints/last.ckpt") == tmp_path / "version_3"
    assert run_folder_of(tmp_path / "last.ckpt") is None
    progress = {"current": {"completed": 3, "processed": 4}}
    assert next_round({"epoch": 3, "loops": {"fit_loop": {"epoch_progress": progress}}}) == 4
    assert next_round({"epoch": 6}) == 7
