"""Where a run's files go (one folder per run), and what the console says: a quiet
console, and a summary at the end that gives the run's notes and names its folder."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Sequence

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn


class RunSummary:
    """What a run says when a fit, validation or test ends, on rank 0: the notes the
    plugins left (a protocol that never started, requests left undone), each already
    warned when it arose, then ``Outputs: <the run's folder>``. Said once per change: a
    test after a fit with nothing new says nothing again. The command line says it itself,
    last (``automatic = False``)."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        #: say the summary at the end of every fit, validate and test
        self.automatic = True
        self._said: list[str] | None = None

    def note(self, message: str) -> None:
        """Warn now, and repeat ``message`` in the summary."""
        rank_zero_warn(message)
        if message not in self.notes:
            self.notes.append(message)

    def lines(self, trainer: pl.Trainer) -> list[str]:
        notes = [f"Note: {note}" for note in self.notes]
        return [*notes, f"Outputs: {os.path.abspath(run_dir(trainer))}"]

    def say(self, trainer: pl.Trainer, again: bool = False) -> None:
        if not trainer.is_global_zero:
            return
        lines = self.lines(trainer)
        if again or lines != self._said:
            print("\n".join(lines), flush=True)
            self._said = lines


def run_dir(trainer: pl.Trainer) -> str:
    """The folder of this run's files (per-client CSVs, plots, config.yaml).

    The first logger's ``log_dir`` when it has one (CSVLogger, TensorBoardLogger:
    ``save_dir/name/version_N``), else ``save_dir/name/version`` as Lightning's
    ModelCheckpoint builds it for the logger (WandbLogger: ``save_dir/project/run_id``), so
    a run's files sit beside its checkpoints and the next run does not overwrite them.
    Without a logger: ``default_root_dir``. Call it on rank 0 only: it may start the
    logger's experiment.
    """
    logger = trainer.loggers[0] if trainer.loggers else None
    if logger is None:
        return trainer.default_root_dir
    log_dir = getattr(logger, "log_dir", None)
    if log_dir:
        return log_dir
    save_dir = logger.save_dir or trainer.default_root_dir
    version = logger.version
    version = version if isinstance(version, str) else f"version_{version}"
    return os.path.join(save_dir, str(logger.name), version)


def append_csv(path: str, header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """Append ``rows`` to the CSV file ``path``, writing ``header`` first when the file is
    new (its folder is created)."""
    new_file = not os.path.exists(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", newline="") as handle:
        writer = csv.writer(handle)
        if new_file:
            writer.writerow(header)
        writer.writerows(rows)
