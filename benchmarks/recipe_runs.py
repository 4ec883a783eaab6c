"""Run a recipe with edits from a benchmark, in-process, and read back its metrics."""

from __future__ import annotations

import csv
import glob
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import yaml
from lightning.pytorch import Callback

from lightning_fl.cli import run


def run_recipe(
    recipe: Path, edit: Callable[[dict], None], seed: int | None = None, args: list[str] = ()
):
    """Fit ``recipe`` (without checkpoints) after ``edit(config)``, with the extra command
    line ``args`` (``["--ckpt_path", path]`` resumes); with ``seed``, every seed of the
    recipe (run, strategy, data) is set to it. Returns the LightningCLI and the rows of its
    metrics.csv."""
    config = yaml.safe_load(Path(recipe).read_text())
    if seed is not None:
        config["seed_everything"] = seed
        config["trainer"]["strategy"]["init_args"]["seed"] = seed
        config["data"]["init_args"]["seed"] = seed
    callbacks = config["trainer"]["callbacks"]
    config["trainer"]["callbacks"] = [c for c in callbacks if "Checkpoint" not in c["class_path"]]
    # nor Lightning's default one, which saves the whole fit at every round's end (with
    # SIFU's kept models, 290 MB a round on Fashion-MNIST: half of a round's time)
    config["trainer"]["enable_checkpointing"] = False
    edit(config)
    with tempfile.TemporaryDirectory() as workdir:
        path = Path(workdir) / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        cli = run(["fit", "--config", str(path), "--trainer.enable_progress_bar", "false",
                   "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", workdir,
                   "--trainer.logger.init_args.save_dir", workdir, *args])  # fmt: skip
        (metrics,) = glob.glob(f"{workdir}/**/metrics.csv", recursive=True)
        with open(metrics) as handle:
            rows = list(csv.DictReader(handle))
    return cli, rows


class PhaseCheckpoint(Callback):
    """Save the fit to ``path`` and stop it when the ``Unlearning`` callback has finished
    ``phases`` phases (after that callback's round end: list this one after it)."""

    def __init__(self, path: str, phases: int = 1) -> None:
        self.path, self.phases = path, phases

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        unlearning = next(c for c in trainer.callbacks if type(c).__name__ == "Unlearning")
        if len(unlearning.phase_rounds) == self.phases and not trainer.should_stop:
            trainer.save_checkpoint(self.path, weights_only=False)
            trainer.should_stop = True


class ProgressCheckpoint(Callback):
    """Save the fit to ``path`` every ``every`` rounds, replacing the previous save (written
    beside it, then renamed: a run killed while saving keeps the previous one), so that a
    run stopped anywhere resumes from its last save (``--ckpt_path path``) with at most
    ``every`` − 1 rounds to train again. List it after the callbacks whose round end it
    must hold (``Unlearning``); nothing is saved at the round that stops the run. Each save
    prints one line: the round, and the last value of each metric of ``show`` logged so
    far (the run's progress, where a long benchmark's output is read)."""

    def __init__(self, path: str, every: int, show: list[str] = ()) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1 (rounds between saves), got {every}.")
        self.path, self.every, self.show = Path(path), every, list(show)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if (trainer.current_epoch + 1) % self.every or trainer.should_stop:
            return
        saving = self.path.with_name(self.path.name + ".saving")
        trainer.save_checkpoint(saving, weights_only=False)  # the whole fit
        os.replace(saving, self.path)
        metrics = trainer.callback_metrics
        shown = [f"{m} {float(metrics[m]):.4f}" for m in self.show if m in metrics]
        print(f"round {trainer.current_epoch + 1}: saved {self.path.name}", *shown,
              sep="; ", flush=True)  # fmt: skip


def callback_of(cli, name: str):
    """The trainer's callback of class ``name``."""
    return next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == name)


READING = "<!-- reading: kept when the script rewrites the file -->"


def write_keeping_reading(path: Path, text: str) -> str:
    """Write a results file's generated ``text`` and keep what follows the READING marker
    in the file already there (the hand-written reading of the numbers)."""
    path = Path(path)
    kept = ""
    if path.exists() and READING in path.read_text():
        kept = path.read_text().split(READING, 1)[1]
    text = text.rstrip() + "\n\n" + READING + (kept if kept.strip() else "\n")
    path.write_text(text)
    return text
