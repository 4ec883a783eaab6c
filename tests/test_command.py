"""The ``lightning-fl`` console script's front door, in process: usage, early errors and
their exit codes before torch or Lightning is imported (the subprocess tests in
test_cli_and_logging check the imports; these pin the messages and codes)."""

from __future__ import annotations

import sys

import pytest

from lightning_fl.command import USAGE, config_error, early_error, main


def _exit_code(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    out, err = capsys.readouterr()
    return stopped.value.code, out, err


def test_usage_on_no_arguments_and_on_help(capsys, monkeypatch):
    assert _exit_code([], capsys) == (2, USAGE + "\n", "")
    for flag in ("-h", "--help"):
        assert _exit_code([flag], capsys) == (0, USAGE + "\n", "")
    monkeypatch.setattr(sys, "argv", ["lightning-fl", "--help"])
    assert _exit_code(None, capsys)[0] == 0  # argv from the command line, after the program


def test_an_early_error_stops_the_run_with_code_2_and_names_the_problem(capsys):
    code, out, err = _exit_code(("fitt", "--config", "x.yaml"), capsys)
    assert (code, out) == (2, "")
    assert err == (
        "lightning-fl: the run did not start.\n"
        "error: invalid choice: 'fitt' (choose from 'fit', 'validate', 'test', 'data')\n"
    )


def test_a_valid_command_goes_to_the_full_parser(monkeypatch):
    import lightning_fl.cli

    seen = []
    monkeypatch.setattr(lightning_fl.cli, "main", seen.append)
    main(("fit", "--trainer.max_epochs", "1"))
    assert seen == [["fit", "--trainer.max_epochs", "1"]]
    main(("--print_config",))  # an option first: the full parser decides
    assert seen[-1] == ["--print_config"]


def test_early_errors_by_hand(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("trainer:\n  max_epochs: 1\n")
    assert early_error(["fit", "--traceback", "--config", str(good)]) is None
    assert early_error(["fit", f"--config={good}", "--trainer.max_epochs=2"]) is None
    assert early_error(["fit", "--config"]) == "--config : no such file (recipes are in recipes/)"
    assert early_error(["fit", "--trainr.max_epochs", "1"]).startswith(
        "unrecognized option --trainr.max_epochs"
    )
    assert early_error(["fit", "positional", "--config", str(good)]) is None
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1,\n")
    assert config_error(str(bad)).startswith(f"--config {bad}: not valid YAML at line 2 (")
    bad.write_text("trainer: \x07\n")  # PyYAML's reader: no mark, no problem, two lines
    assert config_error(str(bad)) == (
        f"--config {bad}: not valid YAML (unacceptable character #x0007: special characters "
        "are not allowed): fix the file's syntax"
    )
    bad.write_text("- 1\n- 2\n")
    assert config_error(str(bad)).endswith("a configuration is a mapping of keys, got a list")
    bad.write_text("traner:\n  max_epochs: 1\n")
    assert config_error(str(bad)) == (
        f"--config {bad}: unknown top-level key 'traner': did you mean 'trainer'?"
    )
    bad.write_text("")
    assert config_error(str(bad)) is None
    bad.write_text("1: one\ntrainer: {}\n")  # a key that is not a string goes to the full parser
    assert config_error(str(bad)) is None
