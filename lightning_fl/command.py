"""The ``lightning-fl`` console script's front: what can be answered before torch and
Lightning are imported (about 7 s on a 2-core machine) is answered at once.

- ``lightning-fl`` and ``lightning-fl --help``: the subcommands (``lightning-fl fit
  --help`` needs every class's signature: the full command line answers it);
- a subcommand that does not exist (``predict``);
- a ``--config`` file that is missing, is not YAML, or has a misspelt top-level key;
- an option outside the command line's groups (``--traner.max_epochs``).

Everything else goes to :func:`lightning_fl.cli.main`, which reports its errors in the same
form: one ``error:`` line naming the problem and the fix.
"""

from __future__ import annotations

import difflib
import os
import sys

SUBCOMMANDS = ("fit", "validate", "test")
#: subcommands of their own, outside LightningCLI
TOOLS = ("data",)
#: the top-level keys of a subcommand: LightningCLI's and lightning_fl.cli's own
KEYS = (
    "config", "print_config", "seed_everything", "trainer", "model", "data", "optimizer",
    "lr_scheduler", "ckpt_path", "weights_only", "test_after_fit", "float32_matmul_precision",
    "help", "silo",
)  # fmt: skip
USAGE = f"""usage: lightning-fl [-h] {{{",".join(SUBCOMMANDS + TOOLS)}}} ...

Federated learning with PyTorch Lightning: LightningCLI with federated recipes.

subcommands:
  fit        train rounds (and test the final model; --test_after_fit false skips it)
  validate   evaluate a model on every client's validation data
  test       evaluate a model on every client's test data
  data       large federations on disk: generate, generate-leaf, convert-leaf, info

`lightning-fl fit --help` lists every option; recipes are in recipes/, e.g.
  lightning-fl fit --config recipes/quickstart.yaml"""


def early_error(argv: list[str]) -> str | None:
    """The first mistake of ``argv`` found without importing torch or Lightning, or None."""
    if not argv or argv[0].startswith("-"):
        return None
    if argv[0] not in SUBCOMMANDS:
        choices = ", ".join(repr(c) for c in SUBCOMMANDS + TOOLS)
        return f"invalid choice: {argv[0]!r} (choose from {choices})"
    for index, argument in enumerate(argv[1:], start=1):
        if not argument.startswith("--"):
            continue
        name, _, value = argument[2:].partition("=")
        if name == "traceback":
            continue
        if name.split(".")[0] not in KEYS:
            return (
                f"unrecognized option --{name}: options are spelled in full "
                f"(`lightning-fl {argv[0]} --help` lists them)"
            )
        if name == "config":
            path = value or (argv[index + 1] if index + 1 < len(argv) else "")
            problem = config_error(path)
            if problem:
                return problem
    return None


def config_error(path: str) -> str | None:
    """What is wrong with the configuration file ``path``, or None."""
    import yaml

    if not os.path.isfile(path):
        return f"--config {path}: no such file (recipes are in recipes/)"
    try:
        with open(path) as handle:
            config = yaml.safe_load(handle)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        return f"--config {path}: not valid YAML{where} ({problem}): fix the file's syntax"
    if config is None:
        return None
    if not isinstance(config, dict):
        return (
            f"--config {path}: a configuration is a mapping of keys, got a {type(config).__name__}"
        )
    for key in config:  # a misspelt key; others (a newer Lightning's) go to the full parser
        close = difflib.get_close_matches(str(key), KEYS, n=1, cutoff=0.75)
        if key not in KEYS and close:
            return f"--config {path}: unknown top-level key {key!r}: did you mean {close[0]!r}?"
    return None


def main(argv: list[str] | None = None) -> None:
    """The ``lightning-fl`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv in (["-h"], ["--help"]):
        print(USAGE)
        sys.exit(0 if argv else 2)
    if argv[0] == "data":
        from lightning_fl.data_command import main as data

        data(argv[1:])
        return
    problem = early_error(argv)
    if problem is not None:
        print("lightning-fl: the run did not start.", file=sys.stderr)
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    from lightning_fl.cli import main as full

    full(argv)


if __name__ == "__main__":
    main()
