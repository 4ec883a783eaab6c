"""A run's folder, its summary lines and the quiet console, in process (issue 38's pieces,
measured by issue 39's mutation runner, which sees only what runs in its own process)."""

from __future__ import annotations

import csv
import logging
import os
import warnings
from types import SimpleNamespace

import pytest

from lightning_fl import console
from lightning_fl.engine.outputs import RunSummary, append_csv, run_dir


def _trainer(*loggers, root="/root_dir", rank_zero=True):
    return SimpleNamespace(loggers=list(loggers), default_root_dir=root, is_global_zero=rank_zero)


def test_run_dir_for_each_kind_of_logger():
    """No logger: the Trainer's folder. A logger with a ``log_dir`` (CSV, TensorBoard): that
    folder, whatever else it says. One without (W&B): ``save_dir/name/version_N``, a string
    version kept as it is (W&B's run id); only the first logger counts."""
    assert run_dir(_trainer()) == "/root_dir"
    csv_logger = SimpleNamespace(log_dir="/logs/csv/version_7", save_dir="/ignored", name="n",
                                 version=1)  # fmt: skip
    wandb = SimpleNamespace(save_dir="/wandb", name="proj", version="run1x")
    assert run_dir(_trainer(csv_logger, wandb)) == "/logs/csv/version_7"
    assert run_dir(_trainer(wandb, csv_logger)) == "/wandb/proj/run1x"
    empty_log_dir = SimpleNamespace(log_dir="", save_dir="/s", name="proj", version=0)
    assert run_dir(_trainer(empty_log_dir)) == "/s/proj/version_0"
    numbered = SimpleNamespace(save_dir=None, name=7, version=12)  # as ModelCheckpoint reads it
    assert run_dir(_trainer(numbered)) == "/root_dir/7/version_12"


def test_append_csv_in_the_working_folder(tmp_path, monkeypatch):
    """A bare file name (no folder to create) works; a new file gets its header first, an
    existing one only rows, and a new file with no rows its header alone."""
    monkeypatch.chdir(tmp_path)
    append_csv("rows.csv", ["a"], [[1]])
    append_csv("rows.csv", ["a"], [[2], [3]])
    assert list(csv.reader(open(tmp_path / "rows.csv"))) == [["a"], ["1"], ["2"], ["3"]]
    append_csv("empty.csv", ["a", "b"], [])
    assert (tmp_path / "empty.csv").read_text().splitlines() == ["a,b"]


def test_the_summary_is_said_once_per_change_on_rank_zero(capsys, monkeypatch, tmp_path):
    """Notes in the order they arose, then the folder as an absolute path; said again only
    when a line changed or when asked; never on another rank."""
    monkeypatch.chdir(tmp_path)
    trainer = _trainer(root="relative")
    summary = RunSummary()
    assert summary.automatic
    with pytest.warns(UserWarning):
        summary.note("second arose first")
        summary.note("then this")
    expected = ["Note: second arose first", "Note: then this",
                f"Outputs: {tmp_path / 'relative'}"]  # fmt: skip
    assert summary.lines(trainer) == expected
    summary.say(_trainer(root="relative", rank_zero=False))
    assert capsys.readouterr().out == ""
    summary.say(trainer)
    assert capsys.readouterr().out.splitlines() == expected
    summary.say(trainer)
    assert capsys.readouterr().out == ""
    summary.say(trainer, again=True)
    assert capsys.readouterr().out.splitlines() == expected
    with pytest.warns(UserWarning):
        summary.note("a third")
    summary.say(trainer)
    assert capsys.readouterr().out.splitlines()[2] == "Note: a third"


@pytest.fixture
def restored_console():
    levels = {name: logging.getLogger(name).level for name in console.QUIET_LOGGERS}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _warn_all():
    warnings.warn("Consider increasing the value of the `num_workers` argument: the "
                  "dataloader does not have many workers", UserWarning, stacklevel=2)  # fmt: skip
    warnings.warn(
        "`isinstance(treespec, LeafSpec)` is deprecated, use ...", UserWarning, stacklevel=2
    )
    warnings.warn_explicit("old API", DeprecationWarning, "cli.py", 1,
                           module="lightning.pytorch.cli")  # fmt: skip
    warnings.warn_explicit("old API", DeprecationWarning, "trainer.py", 1,
                           module="lightning.pytorch.trainer")  # fmt: skip
    warnings.warn("a warning about this run", UserWarning, stacklevel=2)


@pytest.mark.parametrize("verbose", [None, "0"])
def test_quiet_console_filters_the_listed_noise_only(verbose, restored_console, monkeypatch):
    """Unset or ``0``: Lightning's INFO loggers go to WARNING, the listed warnings and
    LightningCLI's own deprecations are dropped, and everything else stays (a deprecation
    raised elsewhere in Lightning, a warning about the run)."""
    for name in console.QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    if verbose is None:
        monkeypatch.delenv(console.VERBOSE_ENVIRONMENT, raising=False)
    else:
        monkeypatch.setenv(console.VERBOSE_ENVIRONMENT, verbose)
    console.quiet_console()
    assert [logging.getLogger(n).level for n in console.QUIET_LOGGERS] == [logging.WARNING] * 3
    _warn_all()
    kept = [(w.category, str(w.message)) for w in restored_console]
    assert kept == [(DeprecationWarning, "old API"), (UserWarning, "a warning about this run")]


def test_verbose_console_keeps_everything(restored_console, monkeypatch):
    for name in console.QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    monkeypatch.setenv(console.VERBOSE_ENVIRONMENT, "1")
    console.quiet_console()
    assert [logging.getLogger(n).level for n in console.QUIET_LOGGERS] == [logging.INFO] * 3
    _warn_all()
    assert len(restored_console) == 5
    assert os.environ[console.VERBOSE_ENVIRONMENT] == "1"
