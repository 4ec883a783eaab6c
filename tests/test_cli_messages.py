"""The command line's one-line errors by hand (``lightning_fl/cli.py``'s ``short_message``),
on the texts jsonargparse 4.x raises for each kind of mistake (copied from real runs of
``lightning_fl.cli.run(..., exit_on_error=False)`` on the quickstart recipe). In process and
without a run: tests/test_cli_and_logging.py drives the same messages through ``main``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from lightning_fl.cli import _plain, run, short_message

QUICKSTART = str(Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml")

UNION_INT = (
    'Parser key "trainer.max_epochs":\n  Does not validate against any of the Union subtypes\n'
    "  Subtypes: [<class 'int'>, <class 'NoneType'>]\n  Errors:\n"
    "    - Expected a <class 'int'>\n    - Expected a <class 'NoneType'>\n"
    "  Given value type: <class 'str'>\n  Given value: abc"
)
NESTED_NAN = (
    'Parser key "model":\n  Does not validate against any of the Union subtypes\n'
    "  Subtypes: [<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>]\n"
    "  Errors:\n    - Problem with given class_path 'lightning_fl.Classifier':\n"
    "        Parser key \"lr\":\n          Expected a <class 'float'>. Got value: nan\n"
    "    - Expected a <class 'NoneType'>\n"
    "  Given value type: <class 'jsonargparse._util.NestedArg'>\n"
    "  Given value: NestedArg(key='lr', val='nan')"
)
UNKNOWN_OPTION = (
    'Parser key "trainer.strategy":\n  Does not validate against any of the Union subtypes\n'
    "  Subtypes: [<class 'str'>, <class 'lightning.pytorch.strategies.strategy.Strategy'>]\n"
    "  Errors:\n    - Expected a <class 'str'>\n"
    "    - Problem with given class_path 'lightning_fl.FederatedStrategy':\n"
    "        Option 'lcal_steps' is not accepted\n"
    "  Given value type: <class 'jsonargparse._util.NestedArg'>\n"
    "  Given value: NestedArg(key='lcal_steps', val='3')"
)
INIT_ERROR = (
    "Does not validate against any of the Union subtypes\n"
    "Subtypes: [<class 'str'>, <class 'lightning.pytorch.strategies.strategy.Strategy'>]\n"
    "Errors:\n  - Expected a <class 'str'>\n  - local_steps must be >= 1, got 0.\n"
    "Given value type: <class 'jsonargparse._namespace.Namespace'>\n"
    "Given value: Namespace(class_path='lightning_fl.FederatedStrategy', ...)"
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (UNION_INT, "trainer.max_epochs: expected int or NoneType, got 'abc'"),
        (NESTED_NAN, "model.init_args.lr: expected float, got 'nan' (NaN and infinities are "
                     "refused: give a finite number)"),
        (UNKNOWN_OPTION, "trainer.strategy: Option 'lcal_steps' is not accepted"),
        (INIT_ERROR, "local_steps must be >= 1, got 0."),
        ("unrecognized arguments: --trainer.max_epoch 1",
         "unrecognized arguments: --trainer.max_epoch 1: options are spelled in full "
         "(`lightning-fl fit --help` lists them)"),
        ("no such file: a.yaml\nmore detail", "ValueError: no such file: a.yaml"),
        ('Parser key "seed":\n  Errors:\n    - Expected a <class \'int\'>\n  Given value type: x',
         "seed: expected int, got '?'"),
        ('Parser key "root":\n  Errors:\n    - Expected a <class \'int\'>\n'
         "  Given value: http://host:80", "root: expected int, got 'http://host:80'"),
        ('Parser key "lr":\n  Errors:\n    - lr is NaN (lr)\n  Given value: nan',
         "lr is NaN (lr)"),  # the reason names the key already
    ],
)  # fmt: skip
def test_one_line_per_kind_of_mistake(text, message):
    assert short_message(ValueError(text)) == message


def test_an_error_without_words_says_its_cause_or_its_type():
    try:
        try:
            raise KeyError("trainer")
        except KeyError as inner:
            raise RuntimeError("") from inner
    except RuntimeError as outer:
        assert short_message(outer) == "KeyError: 'trainer'"
    assert short_message(RuntimeError()) == "RuntimeError"
    try:
        try:
            raise OSError("disk full")
        except OSError:
            raise ValueError("   ")  # noqa: B904 - the implicit context is the point
    except ValueError as outer:
        assert short_message(outer) == "OSError: disk full"


def test_an_error_list_stops_at_its_first_unindented_line():
    """Items end where the list does; an informative item's continuation lines (deeper
    than the item) belong to it, its last line is the reason."""
    text = (
        "Parser key \"data\":\n  Errors:\n    - Expected a <class 'str'>\n"
        "    - Problem with given class_path 'x.DM':\n        first line\n"
        "        the real reason\n  Given value: 3\n    - a stray item after the list"
    )
    assert short_message(ValueError(text)) == "data: the real reason"


@pytest.mark.parametrize(
    ("reason", "plain"),
    [
        ("Expected a <class 'float'>. Got value: 0.5x", "expected float, got '0.5x'"),
        ("Expected a <class 'float'>. Got value: -inf",
         "expected float, got '-inf' (NaN and infinities are refused: give a finite number)"),
        ("Expected a <class 'float'>. Got value: .NaN",
         "expected float, got '.NaN' (NaN and infinities are refused: give a finite number)"),
        ("Expected a <class 'int'>. Got value: Infinity",
         "expected int, got 'Infinity' (NaN and infinities are refused: give a finite number)"),
        ("Expected a <class 'float'>. Got value: info", "expected float, got 'info'"),
        ("something else entirely", "something else entirely"),
    ],
)  # fmt: skip
def test_plain_reasons(reason, plain):
    assert _plain(reason) == plain


def test_the_command_line_offers_fit_validate_and_test_only():
    """``predict`` is not offered (FL evaluation is per client): in process, where the
    console script's own test runs in a subprocess."""
    from lightning_fl.cli import FederatedCLI

    assert set(FederatedCLI.subcommands()) == {"fit", "validate", "test"}
    with pytest.raises(BaseException, match="predict"):
        run(["predict"], exit_on_error=False)


def test_the_config_is_saved_in_a_run_folder_the_callback_creates(tmp_path):
    """``RunFolderSaveConfig`` writes ``config.yaml`` into the run's folder (made if
    missing), keeping unset entries (the jsonargparse keyword of its version)."""
    from types import SimpleNamespace

    from lightning_fl.cli import KEEP_UNSET, RunFolderSaveConfig

    saved = []

    def save(config, path, **options):
        saved.append((config, path, options))
        open(path, "w").close()

    parser = SimpleNamespace(save=save)
    callback = RunFolderSaveConfig(parser, {"seed": 1}, "config.yaml", overwrite=True)
    folder = tmp_path / "new" / "run"
    trainer = SimpleNamespace(loggers=[], default_root_dir=str(folder))
    callback.save_config(trainer, None, "fit")
    assert saved == [({"seed": 1}, str(folder / "config.yaml"),
                      {"overwrite": True, "multifile": False, **KEEP_UNSET})]  # fmt: skip
    assert (folder / "config.yaml").exists() and callback.save_to_log_dir is False


def test_fit_and_validate_name_their_folder_once_and_last(tmp_path, capsys):
    """In process: ``fit`` (with its test of the final model) and ``validate`` each end
    with one ``Outputs:`` line, the last; without a terminal the progress bar is off by
    default and the saved config says so."""
    from tests.helpers import ACCELERATOR

    args = ["--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path),
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_epochs", "1",
            "--trainer.accelerator", ACCELERATOR]  # fmt: skip
    for command, folder in (("fit", "version_0"), ("validate", "version_1")):
        cli = run([command, *args])
        out = capsys.readouterr().out.strip().splitlines()
        expected = f"Outputs: {tmp_path / 'fedavg' / folder}"  # the recipe's logger name
        assert [line for line in out if line.startswith("Outputs:")] == [expected]
        assert out[-1] == expected
        assert cli.trainer.progress_bar_callback is None
    config = (tmp_path / "fedavg" / "version_0" / "config.yaml").read_text()
    assert "enable_progress_bar: false" in config


def test_a_resume_trains_on_with_the_checkpoints_hyper_parameters(tmp_path):
    """As LightningCLI resumes: a checkpoint made at lr = 0.3 (given on the command line;
    the recipe says 0.2), resumed without lr, trains on at the checkpoint's 0.3."""
    import glob

    from tests.helpers import ACCELERATOR

    args = ["--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path),
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--test_after_fit", "false",
            "--trainer.accelerator", ACCELERATOR]  # fmt: skip
    first = run(["fit", *args, "--trainer.max_epochs", "1", "--model.init_args.lr", "0.3"])
    assert first.model.hparams.lr == 0.3
    (checkpoint,) = glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)
    resumed = run(["fit", *args, "--trainer.max_epochs", "2", "--ckpt_path", checkpoint])
    assert resumed.model.hparams.lr == 0.3 and resumed.trainer.current_epoch == 2


def test_main_says_the_run_did_not_start_then_the_one_line(tmp_path, capsys, monkeypatch):
    """An argument error: the run never started (exit status 2, as the command line's early
    errors); an error once it runs: it stopped (1)."""
    from lightning_fl.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIGHTNING_FL_TRACEBACK", raising=False)
    monkeypatch.setattr(sys, "argv", ["lightning-fl", "fit", "--config", QUICKSTART,
                                      "--trainer.max_epoch", "1"])  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        main()  # the command line's own arguments
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "lightning-fl: the run did not start (--traceback shows where).",
        "error: unrecognized arguments: --trainer.max_epoch 1: options are spelled in full "
        "(`lightning-fl fit --help` lists them)",
    ]
    monkeypatch.setattr(sys, "argv", ["lightning-fl", "fit", "--config", QUICKSTART,
                                      "--trainer.max_epochs", "1", "--ckpt_path",
                                      str(tmp_path / "missing.ckpt")])  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 1 and err[0] == (
        "lightning-fl: the run stopped (--traceback shows where)."
    ), err


def test_the_tasks_own_their_optimizers():
    """``--optimizer`` is not offered (``auto_configure_optimizers=False``): the client
    optimizer is the task's hyper-parameters (``--model.init_args.optimizer``)."""
    with pytest.raises(BaseException, match="--optimizer"):
        run(["fit", "--config", QUICKSTART, "--optimizer", "Adam"], exit_on_error=False)


def test_the_summary_is_the_strategys_or_a_plain_one():
    """The notes the plugins left are the strategy's summary's; a strategy without one
    gets a plain summary, kept for the run."""
    from types import SimpleNamespace

    from lightning_fl.cli import FederatedCLI
    from lightning_fl.engine.outputs import RunSummary

    own = RunSummary()
    federated = SimpleNamespace(trainer=SimpleNamespace(strategy=SimpleNamespace(summary=own)))
    assert FederatedCLI._summary(federated) is own
    plain = SimpleNamespace(trainer=SimpleNamespace(strategy=SimpleNamespace()))
    made = FederatedCLI._summary(plain)
    assert isinstance(made, RunSummary) and FederatedCLI._summary(plain) is made


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.callbacks+=FedProxx"],
         "trainer.callbacks: there is no plugin named 'FedProxx': did you mean FedProx?"),
        (["--trainer.callbacks+=lightning_fl.callbacks.Krumm"],
         "trainer.callbacks: there is no plugin named 'lightning_fl.callbacks.Krumm': did you "
         "mean Krum?"),
        (["--trainer.callbacks+=Zzzz"],
         "trainer.callbacks: there is no plugin named 'Zzzz': `python -m "
         "lightning_fl.callbacks.catalog` lists the plugins"),
    ],
)  # fmt: skip
def test_an_unknown_plugin_name_is_said_with_the_near_ones(args, message, tmp_path):
    with pytest.raises(BaseException) as refused:
        run(["fit", "--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path), *args],
            exit_on_error=False)  # fmt: skip
    assert short_message(refused.value) == message
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_rank_stopped_by_another_ranks_failure_says_so_in_one_line(capsys, monkeypatch):
    """With several processes, the rank whose collective failed because a peer ended says
    so in one line (not gloo's message); the failing rank's own error names its rank."""
    import lightning_fl.cli as cli

    monkeypatch.delenv("LIGHTNING_FL_TRACEBACK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    gloo = RuntimeError(
        "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:30444."
    )

    def fails(error):
        def run(**kwargs):
            kwargs["on_start"]()
            raise error

        return run

    for rank, error, expected in (
        ("0", gloo, ["lightning-fl: rank 0 stopped because another process failed; that "
                     "process's error names the problem. Resume every site with --ckpt_path "
                     "last."]),
        ("1", ValueError("bad data"), ["lightning-fl: the run stopped on rank 1 (--traceback "
                                       "shows where).", "error: ValueError: bad data"]),
    ):  # fmt: skip
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(cli, "run", fails(error))
        with pytest.raises(SystemExit) as stopped:
            cli.main(["fit"])
        assert stopped.value.code == 1
        assert capsys.readouterr().err.strip().splitlines() == expected
    monkeypatch.setenv("LIGHTNING_FL_SILO", "bern")  # a named site says which it is
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(cli, "run", fails(gloo))
    with pytest.raises(SystemExit):
        cli.main(["fit"])
    assert capsys.readouterr().err.startswith("lightning-fl: site 'bern' (rank 1) stopped")
    monkeypatch.setattr(cli, "run", fails(ValueError("bad data")))
    with pytest.raises(SystemExit):
        cli.main(["fit"])
    assert capsys.readouterr().err.startswith("lightning-fl: the run stopped on site 'bern'")
    wrapped = RuntimeError("the round's all-reduce failed")
    wrapped.__cause__ = gloo
    assert cli.peer_failed(wrapped) and not cli.peer_failed(ValueError("closed"))


@pytest.mark.parametrize(
    "args",
    [
        ["fit", "--help"],
        ["fit", "--trainer.callbacks.help", "lightning_fl.callbacks.DPFedAvg"],
        ["fit", "--data.help", "lightning_fl.datamodules.ReferenceDataModule"],
    ],
)
def test_help_prints_plain_text_not_docstring_markup(args, capsys):
    """Sphinx roles and RST literals of the docstrings print as the names they show:
    DPFedAvg's ``noise`` help reads "central" (the server clips ...), not ````"central"````."""
    with pytest.raises(SystemExit):
        run(args, exit_on_error=False)
    out = capsys.readouterr().out
    assert "--" in out and not re.search(r":(class|func|meth|mod|data|attr):`|``", out), out
    if "DPFedAvg" in args[-1]:
        assert '"central" (the server clips and adds the noise)' in " ".join(out.split())


def test_plain_text_shows_what_a_role_shows():
    from lightning_fl.cli import plain_text

    assert plain_text(":class:`~a.b.C` and :meth:`a.b.C.d`, ``x = 1``") == "C and a.b.C.d, x = 1"
    assert plain_text("no markup: `x`") == "no markup: `x`"
