"""A resumed fit continues in its run's folder (issue 68).

A checkpoint that Lightning's ``ModelCheckpoint`` wrote beside a logger's files sits in
``<save_dir>/<name>/version_K/checkpoints/``. Resuming from it (``trainer.fit(...,
ckpt_path=...)``, or ``--ckpt_path`` on the command line) keeps the run in
``version_K``: the logger takes that version rather than the next one, so the metrics,
plots, ``last.ckpt`` and per-client files stay one run's. The rows the interrupted run
wrote for the rounds it is about to train again (its metrics after the checkpoint) are
dropped, so the folder ends as the uninterrupted run's would:

- ``metrics.csv`` keeps the rows of the epochs before the resumed one. Lightning's
  ``CSVLogger`` deletes an existing ``metrics.csv`` when it starts; the file is moved
  aside first (``metrics.csv.before-resume``) and its kept rows written back through the
  logger's writer when the fit starts, so a crash in between loses nothing;
- ``participation.csv`` and ``client_metrics.csv`` keep the rows of the rounds before it.

Only loggers with a ``root_dir`` and a version (``CSVLogger``, ``TensorBoardLogger``)
are moved; a checkpoint outside such a folder leaves the logger alone.
"""

from __future__ import annotations

import csv
import os
import re
import warnings
from pathlib import Path

import lightning.pytorch as pl

#: the per-round files of a run and the column holding their round
ROUND_FILES = {"participation.csv": "round", "client_metrics.csv": "round"}
METRICS = "metrics.csv"
ASIDE = ".before-resume"


def run_folder_of(ckpt_path: str | os.PathLike) -> Path | None:
    """``version_K`` for ``.../version_K/checkpoints/<file>.ckpt``, else None."""
    path = Path(ckpt_path).resolve()
    return path.parent.parent if path.parent.name == "checkpoints" else None


def last_checkpoint(root_dir: str | os.PathLike) -> str | None:
    """The ``last.ckpt`` of the newest ``version_K`` under ``root_dir`` that has one, or
    a silo's shard of it (a site's machine holds its own shard only: the name it is
    resumed from is the checkpoint's, :class:`~.silo_checkpoints.SiloShards` maps it)."""
    found = []
    for folder in Path(root_dir).glob("version_*"):
        number = re.fullmatch(r"version_(\d+)", folder.name)
        last = folder / "checkpoints" / "last.ckpt"
        shards = [*last.parent.glob("*/last.ckpt"), *last.parent.glob("last.ckpt.silo*")]
        if number and (last.is_file() or shards):
            found.append((int(number.group(1)), last))
    return str(max(found)[1]) if found else None


def next_round(checkpoint: dict) -> int:
    """The first round a fit resumed from ``checkpoint`` trains: the epochs whose training
    was processed (a checkpoint saved at an epoch's end counts that epoch, as Lightning's
    fit loop does when it restarts), else the saved epoch + 1."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {})
    processed = progress.get("current", {}).get("processed")
    return int(processed) if processed is not None else int(checkpoint.get("epoch", -1)) + 1


class ResumedRun:
    """The run folder a resumed fit continues in, and the round it resumes at."""

    def __init__(self, folder: Path, round_idx: int) -> None:
        self.folder, self.round_idx = folder, round_idx

    @classmethod
    def adopt(
        cls, trainer: pl.Trainer, ckpt_path: str | os.PathLike, round_idx: int
    ) -> ResumedRun | None:
        """Give the first logger the version of the checkpoint's run folder, and the
        ModelCheckpoints that write into the logger's folder that folder's
        ``checkpoints/`` (so that ``last.ckpt`` is written over, not beside, as
        ``last-v1.ckpt``); None when the checkpoint is not in one of the logger's
        versions. Called when the checkpoint is read, before the callbacks' states are
        restored and the logger starts. Moves ``metrics.csv`` aside on rank 0."""
        logger = trainer.loggers[0] if trainer.loggers else None
        folder = run_folder_of(ckpt_path)
        root = getattr(logger, "root_dir", None)
        if folder is None or root is None or not hasattr(logger, "_version"):
            return None
        if folder.parent != Path(root).resolve():
            return None
        started = Path(logger.log_dir).resolve()  # the next version, chosen at set-up
        number = re.fullmatch(r"version_(\d+)", folder.name)
        logger._version = int(number.group(1)) if number else folder.name
        logger._experiment = None  # started again, in the adopted folder
        for callback in trainer.checkpoint_callbacks:
            path = getattr(callback, "dirpath", None)
            if path and Path(path).resolve() == started / "checkpoints":
                # written as it was (a relative folder stays relative), so that the
                # callback's saved state, whose dirpath is compared as a string, is restored
                callback.dirpath = str(Path(path).parent.parent / folder.name / "checkpoints")
        if trainer.is_global_zero:
            metrics = folder / METRICS
            if metrics.is_file():
                os.replace(metrics, folder / (METRICS + ASIDE))
            _leave(started, folder)
        return cls(folder, round_idx)

    def keep_earlier_rounds(self, trainer: pl.Trainer) -> None:
        """Drop the rows of the resumed round and later (rank 0): the interrupted run's
        rows of the rounds the resumed fit trains again."""
        if not trainer.is_global_zero:
            return
        round_idx = self.round_idx
        for name, column in ROUND_FILES.items():
            path = self.folder / name
            if path.is_file():
                header, rows = _read(path)
                kept = [row for row in rows if int(row[column]) < round_idx]
                if len(kept) < len(rows):
                    _write(path, header, kept)
        aside = self.folder / (METRICS + ASIDE)
        if not aside.is_file():
            return
        header, rows = _read(aside)
        kept = [row for row in rows if row.get("epoch") and int(row["epoch"]) < round_idx]
        with warnings.catch_warnings():  # "previous log files will be deleted": moved aside
            warnings.filterwarnings("ignore", message="Experiment logs directory")
            writer = getattr(trainer.loggers[0], "experiment", None) if trainer.loggers else None
        if writer is not None and hasattr(writer, "metrics_keys"):  # CSVLogger's writer
            writer.metrics_keys = sorted(set(writer.metrics_keys) | set(header))
            writer.metrics = [*kept, *writer.metrics]
            writer.save()
        else:
            _write(self.folder / METRICS, header, kept)
        aside.unlink()


def _leave(started: Path, folder: Path) -> None:
    """Move what the set-up wrote into the version the fit started in (its
    ``config.yaml``) to the adopted folder, and remove that version if nothing else is
    in it."""
    if started == folder or not started.is_dir():
        return
    if (started / "config.yaml").is_file():
        os.replace(started / "config.yaml", folder / "config.yaml")
    if not any(started.iterdir()):
        started.rmdir()


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def _write(path: Path, header: list[str], rows: list[dict[str, str]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
