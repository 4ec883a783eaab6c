"""``lightning-fl``: LightningCLI with fit, validate and test, reading YAML recipes.

    lightning-fl fit --config recipes/quickstart.yaml

What it adds to LightningCLI:

- ``fit`` tests the final global model (``--test_after_fit false`` skips it);
- everything a run writes (config.yaml, per-client CSVs, plots, checkpoints) goes to the
  run's own folder (:func:`lightning_fl.engine.outputs.run_dir`), named on the last line;
- an error ends with one short line naming the problem (``--traceback`` shows the trace);
- a quiet console: no Lightning tips or known-harmless warnings (``lightning_fl``'s import
  applies :func:`lightning_fl.console.quiet_console`), and no progress bar when the output
  is not a terminal (``--trainer.enable_progress_bar true`` brings it back).

``predict`` is not offered: FL evaluation is per client (``validate``, ``test``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any, Literal

import torch
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning_utilities.core.imports import RequirementCache

from lightning_fl.engine.outputs import RunSummary, run_dir
from lightning_fl.engine.resume import last_checkpoint
from lightning_fl.engine.silo_sites import SILO_ENV

#: A Sphinx role of a docstring (``:class:`~lightning_fl.callbacks.FedAvg```), and RST's inline
#: literal (````x````): the help prints them as plain text.
_ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|exc|obj):`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(text: str) -> str:
    """``text`` (a docstring's words) without its markup: a role becomes the name it
    shows (the last part after ``~``), an inline literal its content.

    >>> plain_text("Σ of :class:`~lightning_fl.callbacks.FedAvg` (``x='y'``), :func:`sorted`")
    "Σ of FedAvg (x='y'), sorted"
    """
    text = _ROLE.sub(lambda m: m[2].rsplit(".", 1)[-1] if m[1] else m[2], text)
    return _LITERAL.sub(r"\1", text)


class PlainHelpFormatter(DefaultHelpFormatter):
    """``--help`` and ``--<group>.help CLASS`` as plain text (:func:`plain_text`)."""

    def _get_help_string(self, action) -> str | None:
        help_string = super()._get_help_string(action)
        return None if help_string is None else plain_text(help_string)

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))


class PlainArgumentParser(LightningArgumentParser):
    """LightningCLI's parser with :class:`PlainHelpFormatter`, kept by the parsers
    jsonargparse makes from it (a class's ``--<group>.help``)."""

    def __init__(self, *args: Any, formatter_class=PlainHelpFormatter, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


class RunFolderSaveConfig(SaveConfigCallback):
    """Saves config.yaml into the run's folder, beside its metrics and checkpoints."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "save_to_log_dir": False})

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        folder = run_dir(trainer)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, self.config_filename)
        self.parser.save(self.config, path, overwrite=True, multifile=False, **KEEP_UNSET)


#: The keyword that keeps ``None`` entries in a saved config: ``skip_unset`` since
#: jsonargparse 4.49, which deprecates the former ``skip_none``.
KEEP_UNSET = {("skip_unset" if RequirementCache("jsonargparse>=4.49") else "skip_none"): False}


class FederatedCLI(LightningCLI):
    """LightningCLI whose ``fit`` also tests the final global model when asked to.

    ``on_start`` (optional) is called when the subcommand's run begins, after the
    arguments are parsed and the classes built: an error before it means that the run
    never started."""

    def __init__(self, *args: Any, on_start: Callable[[], None] | None = None, **kwargs: Any):
        self._on_start = on_start
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        commands = LightningCLI.subcommands()
        commands.pop("predict", None)
        return commands

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--test_after_fit", type=bool, default=True, help="Run trainer.test after fit."
        )
        parser.add_argument(
            "--float32_matmul_precision",
            type=Literal["highest", "high", "medium"],
            default="highest",
            help="torch.set_float32_matmul_precision: 'high' lets a GPU use TF32 tensor cores "
            "(faster; results then differ from a CPU run's in the 4th significant digit).",
        )
        parser.add_argument(
            "--silo",
            type=str | None,
            default=None,
            help=f"This site's name, one of the recipe's FederatedStrategy(silos=[...]) "
            f"(default: ${SILO_ENV}).",
        )
        parser.set_defaults({"trainer.enable_progress_bar": sys.stderr.isatty()})

    def before_instantiate_classes(self) -> None:
        # run=False (lightning_fl.flower.server_side builds a recipe's objects): no subcommand
        config = self.config[self.subcommand] if self.subcommand else self.config
        torch.set_float32_matmul_precision(config.get("float32_matmul_precision", "highest"))
        if config.get("silo"):  # the strategy reads it when the recipe names its sites
            os.environ[SILO_ENV] = config["silo"]

    def _parse_ckpt_path(self) -> None:
        """LightningCLI reads the checkpoint's hyper-parameters before the Trainer loads
        it; a bad file fails here as it would in the Trainer (CheckpointReadError)."""
        from lightning_fl.engine.federated_state import CheckpointReadError

        try:
            super()._parse_ckpt_path()
        except FileNotFoundError:
            raise
        except Exception as err:  # noqa: BLE001 - torch raises several types for bad files
            path = self.config[self.config.subcommand].get("ckpt_path")
            raise CheckpointReadError.of(path, err) from err

    def before_fit(self) -> None:
        self._find_last_checkpoint()
        self._started()

    def _started(self) -> None:
        if self._on_start is not None:
            self._on_start()
        self._summary().automatic = False  # said once, last (after the test)

    before_validate = before_test = _started

    def _find_last_checkpoint(self) -> None:
        """``--ckpt_path last``: the ``last.ckpt`` of the logger's newest version that has
        one (Lightning looks only in ModelCheckpoint's folder, unknown before the run's
        version is). The fit then continues in that version (engine/resume.py)."""
        config = self.config_init[self.subcommand]
        logger = self.trainer.loggers[0] if self.trainer.loggers else None
        if config.get("ckpt_path") != "last" or getattr(logger, "root_dir", None) is None:
            return
        found = last_checkpoint(logger.root_dir)
        if found is not None:
            config["ckpt_path"] = found

    def after_fit(self) -> None:
        if self.config[self.subcommand].get("test_after_fit", True):
            self.trainer.test(self.model, datamodule=self.datamodule)
        self._summary().say(self.trainer, again=True)

    def after_validate(self) -> None:
        self._summary().say(self.trainer, again=True)

    after_test = after_validate

    def _summary(self) -> RunSummary:
        """The strategy's run summary; a plain one under another strategy."""
        strategy = self.trainer.strategy
        if not hasattr(strategy, "summary"):
            strategy.summary = RunSummary()
        return strategy.summary


def run(
    args: list[str] | None = None,
    exit_on_error: bool = True,
    on_start: Callable[[], None] | None = None,
) -> FederatedCLI:
    """Parse ``args`` (default: the command line), run the subcommand, return the CLI.
    With ``exit_on_error=False`` a bad argument raises instead of printing the usage;
    ``on_start`` is called when the run begins (:class:`FederatedCLI`)."""
    # allow_abbrev=False: --trainer.max_epoch is an error, not max_epochs
    options = {"allow_abbrev": False, **({} if exit_on_error else {"exit_on_error": False})}
    parser_kwargs = {
        **options,
        **{command: dict(options) for command in FederatedCLI.subcommands()},
    }
    return FederatedCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=RunFolderSaveConfig,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
        parser_kwargs=parser_kwargs,
        parser_class=PlainArgumentParser,
        on_start=on_start,
    )


def short_message(error: BaseException) -> str:
    """One line naming the problem. jsonargparse wraps a bad value, a bad option or an error
    raised by a class's ``__init__`` with every union member it tried and a dump of the
    arguments; this keeps the key and the informative reason."""
    text = str(error).strip()
    parser_key = re.match(r'Parser key "([\w.]+)"', text)
    missing = re.search(r"(?:Problem with given class_path '|has no attribute ')([\w.]+)'", text)
    if parser_key and parser_key.group(1).endswith("callbacks") and missing:
        return f"{parser_key.group(1)}: {unknown_plugin(missing.group(1))}"
    if text.startswith("unrecognized arguments:"):
        return f"{text}: options are spelled in full (`lightning-fl fit --help` lists them)"
    if "Errors:" not in text:
        first = text.splitlines()[0] if text else ""
        cause = error.__cause__ or error.__context__
        if not first and cause is not None:
            return short_message(cause)
        return f"{type(error).__name__}: {first}" if first else type(error).__name__
    lines = text.splitlines()
    key = lines[0].split('"')[1] if lines[0].startswith("Parser key") else ""
    items: list[list[str]] = []
    for line in lines[lines.index(next(x for x in lines if x.strip() == "Errors:")) + 1 :]:
        stripped = line.strip()
        if stripped.startswith("- "):
            items.append([stripped[2:]])
        elif line.startswith("      ") and items:
            items[-1].append(stripped)
        else:
            break
    given = next((x.split(":", 1)[1].strip() for x in lines if "Given value:" in x), "?")
    if key.endswith("callbacks") and any("dot import path" in item[0] for item in items):
        return f"{key}: {unknown_plugin(given)}"
    informative = [item for item in items if not item[0].startswith("Expected a")]
    if informative:
        nested = [line.split('"')[1] for line in informative[-1] if line.startswith("Parser key")]
        if key and nested and "class_path" in informative[-1][0]:
            key = ".".join([key, "init_args", *nested])
        reason = _plain(informative[-1][-1])
    else:
        expected = " or ".join(item[0].split("'")[1] for item in items if "'" in item[0])
        reason = f"expected {expected}, got {given!r}"
    return f"{key}: {reason}" if key and key not in reason else reason


def unknown_plugin(name: str) -> str:
    """What to say of a callback name that no class answers: the near names among
    lightning_fl's plugins and Lightning's callbacks."""
    import difflib

    import lightning.pytorch.callbacks as lightning_callbacks

    from lightning_fl import callbacks

    known = sorted({*callbacks.__all__, *lightning_callbacks.__all__})
    near = difflib.get_close_matches(name.split(".")[-1], known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(near)}?" if near else (
        "`python -m lightning_fl.callbacks.catalog` lists the plugins")  # fmt: skip
    return f"there is no plugin named {name!r}: {hint}"


def _plain(reason: str) -> str:
    """jsonargparse's "Expected a <class 'float'>. Got value: nan" as "expected float, got
    'nan'", saying why when the value is a NaN or an infinity."""
    found = re.fullmatch(r"Expected a <class '(\w+)'>\. Got value: (.*)", reason)
    if found is None:
        return reason
    kind, given = found.groups()
    reason = f"expected {kind}, got {given!r}"
    if given.strip().lower().lstrip("+-.") in ("nan", "inf", "infinity"):
        reason += " (NaN and infinities are refused: give a finite number)"
    return reason


def main(argv: list[str] | None = None) -> None:
    """The ``lightning-fl`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    show_trace = "--traceback" in argv or bool(os.environ.get("LIGHTNING_FL_TRACEBACK"))
    sys.argv = [sys.argv[0], *(a for a in argv if a != "--traceback")]
    started: list[bool] = []
    try:
        run(exit_on_error=show_trace, on_start=lambda: started.append(True))
    except Exception as error:  # noqa: BLE001 - every failure ends with one short line
        if show_trace:
            raise
        rank, world = _rank_and_world()
        site = os.environ.get(SILO_ENV)
        who = f"site {site!r} (rank {rank})" if site else f"rank {rank}"
        if world > 1 and peer_failed(error):  # gloo's or NCCL's word for another rank's end
            print(f"lightning-fl: {who} stopped because another process failed; that "
                  "process's error names the problem. Resume every site with --ckpt_path "
                  "last.", file=sys.stderr)  # fmt: skip
            sys.exit(1)
        # the same words as the command line's early errors (lightning_fl.command)
        what = "stopped" if started else "did not start"
        where = f" on {who}" if world > 1 else ""
        print(f"lightning-fl: the run {what}{where} (--traceback shows where).", file=sys.stderr)
        print(f"error: {short_message(error)}", file=sys.stderr)
        sys.exit(1 if started else 2)


#: What gloo and NCCL say when a peer process has ended (its own error is the real one).
PEER_FAILURE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL's watchdog",
)


def peer_failed(error: BaseException) -> bool:
    """Whether ``error`` (or its cause) is a collective's failure because another process
    ended, rather than a problem of its own."""
    while error is not None:
        if any(marker in str(error) for marker in PEER_FAILURE):
            return True
        error = error.__cause__ or error.__context__
    return False


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes (1, 1 outside a distributed run),
    from the process group or the launcher's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = os.environ
    return int(env.get("RANK", env.get("LOCAL_RANK", 0))), int(env.get("WORLD_SIZE", 1))


if __name__ == "__main__":
    main()
