"""Mutation testing of one module (issue 39): write realistic bugs into it, one at a time,
run the tests that exercise it, and print the mutants no test caught.

    python -m tests.mutate lightning_fl/systems/forgetting.py tests/test_unlearning.py
    make mutate MODULE=lightning_fl/systems/forgetting.py TESTS=tests/test_unlearning.py

The bugs are the ones issue 39 lists, as AST rewrites of the module's function bodies
(docstrings, annotations and message strings are left alone): a comparison turned
(``<`` and ``<=``, ``==`` and ``!=``), an arithmetic operator swapped (``+``/``-``,
``*``/``/``), an integer off by one, ``True``/``False`` and ``and``/``or`` exchanged, a
``not`` or a unary minus dropped, a statement dropped (an expression, an assignment to an
attribute or item, an augmented assignment, a ``continue``/``break``), a call's result
replaced by its first argument. Each mutant is written over the module, the tests run
(``pytest -x``, stopping at the first failure, with a time limit of 5 times the clean
run's, or of its own tests' clean times plus 10 s when they were measured:
:func:`time_limit`), and the module is restored, whatever happens. A mutant is caught
when the tests fail or time out. The summary line and the survivors go to stdout and,
with ``--json``, to a file.

From the command line each mutant's tests run in a fork of the runner, which imported
torch, Lightning and the other heavy libraries once (:data:`PRELOADED`) and never the
project: the child imports the mutated module from disk and writes no bytecode (a cached
``.pyc`` is checked against the source's size and modification time only, which a
mutant can share with the original). That is about 3.5 times faster than an interpreter
per mutant (benchmarks/results/mutation.md); ``main(fork=False)``, the default from
Python, keeps the interpreter per run.

Only the tests that execute a mutant's lines run against it: the clean run is measured
by coverage.py with one context per test (this module is its pytest plugin), and a
mutant on lines that no test executes survives without a run. A mutant's tests run
fastest first (their clean-run times), so that ``-x`` stops at the first cheap failure.
Tests run in other processes (torchrun) are not measured, so what only they exercise
shows as a survivor to look at; ``--uncovered-runs-all`` runs every given test against such
a mutant instead (give it the tests that launch those processes). Without coverage.py
installed every mutant runs every given test.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SWAPS = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.In: ast.NotIn, ast.NotIn: ast.In,
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div, ast.And: ast.Or, ast.Or: ast.And,
}  # fmt: skip


@dataclass(frozen=True)
class Mutant:
    """The ``index``-th rewrite site of the module: what it does, and where."""

    index: int
    line: int
    description: str
    #: the last line of the rewritten node (a statement or expression may span lines)
    end_line: int = 0


def _skipped(tree: ast.Module) -> set[int]:
    """ids of nodes never mutated: docstrings, annotations, strings, decorators."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                skip.update(id(n) for n in ast.walk(body[0]))
        annotations = []
        if isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        if isinstance(node, ast.arg) and node.annotation is not None:
            annotations.append(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations += [n for n in (node.returns, *node.decorator_list) if n is not None]
        if isinstance(node, (ast.JoinedStr, ast.Raise)):
            annotations.append(node)
        for a in annotations:
            skip.update(id(n) for n in ast.walk(a))
    return skip


def _inside_functions(tree: ast.Module) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for child in node.body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def _rewrites(node: ast.AST) -> Iterator[str]:
    """The rewrites of ``node`` (by name), applied by :func:`_apply`."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in SWAPS:
        yield f"{type(node.ops[0]).__name__} -> {SWAPS[type(node.ops[0])].__name__}"
    elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in SWAPS:
        yield f"{type(node.op).__name__} -> {SWAPS[type(node.op)].__name__}"
    elif isinstance(node, ast.BoolOp) and type(node.op) in SWAPS:
        yield f"{type(node.op).__name__} -> {SWAPS[type(node.op)].__name__}"
    elif isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool):
            yield f"{value} -> {not value}"
        elif isinstance(value, int):
            yield f"{value} -> {value + 1}"
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        yield f"drop {type(node.op).__name__}"
    if isinstance(node, (ast.Expr, ast.AugAssign, ast.Continue, ast.Break)) or (
        isinstance(node, ast.Assign)
        and all(isinstance(t, (ast.Attribute, ast.Subscript)) for t in node.targets)
    ):
        yield "drop statement"
    if isinstance(node, ast.Call) and node.args and not isinstance(node.func, ast.Attribute):
        yield "call -> its first argument"


def _apply(node: ast.AST, rewrite: str) -> ast.AST:
    """``node`` rewritten (a new node, or ``node`` changed in place)."""
    if rewrite == "drop statement":
        return ast.Pass()
    if rewrite == "call -> its first argument":
        return node.args[0]
    if rewrite.startswith("drop "):
        return node.operand
    if isinstance(node, ast.Compare):
        node.ops = [SWAPS[type(node.ops[0])]()]
    elif isinstance(node, (ast.BinOp, ast.AugAssign, ast.BoolOp)):
        node.op = SWAPS[type(node.op)]()
    elif isinstance(node, ast.Constant):
        node.value = (not node.value) if isinstance(node.value, bool) else node.value + 1
    return node


def mutants(source: str) -> list[Mutant]:
    """Every mutant of ``source``, in order."""
    tree = ast.parse(source)
    skip, inside = _skipped(tree), _inside_functions(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip or id(node) not in inside:
            continue
        for rewrite in _rewrites(node):
            line = getattr(node, "lineno", 0)
            end = getattr(node, "end_lineno", None) or line
            found.append(Mutant(len(found), line, rewrite, end))
    return found


def mutated_source(source: str, mutant: Mutant) -> str:
    """``source`` with ``mutant`` applied."""
    tree = ast.parse(source)
    skip, inside = _skipped(tree), _inside_functions(tree)
    count = 0
    for node in ast.walk(tree):  # the order of :func:`mutants`
        if id(node) in skip or id(node) not in inside:
            continue
        for rewrite in _rewrites(node):
            if count == mutant.index:
                _replace(tree, node, _apply(copy.deepcopy(node), rewrite))
                return ast.unparse(ast.fix_missing_locations(tree))
            count += 1
    raise IndexError(mutant)


def _replace(tree: ast.Module, old: ast.AST, new: ast.AST) -> None:
    """Put ``new`` where ``old`` is in ``tree``."""
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return
            if isinstance(value, list) and any(v is old for v in value):
                value[[v is old for v in value].index(True)] = new
                return


def run_tests(
    tests: list[str], timeout: float, coverage_of: Path | None = None, fork: bool = False
) -> bool:
    """Whether the tests pass (False on a failure or a timeout). With ``coverage_of``
    (a module's file), the run is measured: which test executes which of its lines
    (:func:`covering_tests` reads it). With ``fork``, an unmeasured run is a fork of this
    process (:func:`_run_forked`) instead of a new interpreter."""
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
    options = ["-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    if fork and coverage_of is None and hasattr(os, "fork"):
        return _run_forked([*options, *tests], timeout, env)
    runner = [sys.executable, "-m"]
    if coverage_of is not None:
        env[_DURATIONS_VARIABLE] = str(_durations_file())
        runner += ["coverage", "run", f"--data-file={_coverage_data()}",
                   f"--include=*/{coverage_of.name}", "-m"]  # fmt: skip
        tests = ["-p", "tests.mutate", *tests]
    paths = [Path(t.split("::")[0]).resolve() for t in tests if not t.startswith("-")]
    files = [f for f in paths if f.is_file()]  # (not a plugin's or -k's argument)
    outside = [f for f in files if not f.is_relative_to(ROOT)]
    if outside and len(outside) == len(files):  # tests of a module outside the repository
        # their own folder as the rootdir: pytest would otherwise walk the common parent
        options += ["--rootdir", os.path.commonpath([str(f.parent) for f in outside])]
    command = [*runner, "pytest", *options, *tests]
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0


#: Libraries a fork inherits already imported (the project itself is imported by each
#: child, from the mutated file): a test run then costs its tests, not their imports.
PRELOADED = ("numpy", "torch", "lightning.pytorch", "torchmetrics", "jsonargparse", "faiss")


def preload_libraries() -> None:
    """Import :data:`PRELOADED` (those installed) into this process, before any fork."""
    for name in PRELOADED:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)


def _run_forked(arguments: list[str], timeout: float, env: dict[str, str]) -> bool:
    """pytest ``arguments`` in a forked child, which imports the project afresh (this
    process never imports it) and writes no bytecode; killed after ``timeout`` seconds."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.environ.update(env)
            sys.dont_write_bytecode = True
            os.chdir(ROOT)
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            code = int(pytest.main(arguments))
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return False
        time.sleep(0.02)


def _coverage_data() -> Path:
    """This run's coverage data file (one per mutation run)."""
    return Path(tempfile.gettempdir()) / f".mutate-coverage-{os.getpid()}"


_DURATIONS_VARIABLE = "MUTATE_DURATIONS_FILE"


def _durations_file() -> Path:
    """This run's file of the clean run's test times: {node id: seconds}."""
    return Path(tempfile.gettempdir()) / f".mutate-durations-{os.getpid()}.json"


def _absolute_id(item) -> str:
    """The test's node id with its file absolute (node ids are relative to a rootdir)."""
    return "::".join([str(item.path), *item.nodeid.split("::")[1:]])


_clean_run_seconds: dict[str, float] = {}


def pytest_runtest_setup(item) -> None:
    """As a pytest plugin under coverage: the lines run from here on belong to ``item``."""
    import coverage

    current = coverage.Coverage.current()
    if current is not None:
        current.switch_context(_absolute_id(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """As a pytest plugin: each test's time, setup and teardown included."""
    start = time.perf_counter()
    try:
        return (yield)
    finally:
        _clean_run_seconds[_absolute_id(item)] = time.perf_counter() - start


def pytest_sessionfinish(session) -> None:
    """As a pytest plugin: write the times where the mutation run reads them."""
    target = os.environ.get(_DURATIONS_VARIABLE)
    if target:
        Path(target).write_text(json.dumps(_clean_run_seconds))


def clean_run_seconds() -> dict[str, float]:
    """{node id: seconds} of the measured clean run (empty if it wrote none)."""
    path = _durations_file()
    return json.loads(path.read_text()) if path.exists() else {}


def covering_tests(module: Path) -> dict[int, set[str]]:
    """{line: node ids of the tests that executed it} from the measured clean run."""
    import coverage

    data = coverage.CoverageData(basename=str(_coverage_data()))
    data.read()
    target = os.path.realpath(module)
    measured = [f for f in data.measured_files() if os.path.realpath(f) == target]
    lines: dict[int, set[str]] = {}
    for name in measured:
        for line, contexts in data.contexts_by_lineno(name).items():
            lines.setdefault(line, set()).update(c for c in contexts if c)
    return lines


def tests_for(
    mutant: Mutant, lines: dict[int, set[str]], seconds: dict[str, float] | None = None
) -> list[str]:
    """The node ids of the tests that ran any line of ``mutant``'s node, fastest first by
    their clean-run ``seconds`` (then by name; a test without a time goes last)."""
    found: set[str] = set()
    for line in range(mutant.line, max(mutant.end_line, mutant.line) + 1):
        found |= lines.get(line, set())
    seconds = seconds or {}
    return sorted(found, key=lambda test: (seconds.get(test, float("inf")), test))


def time_limit(tests: list[str], seconds: dict[str, float], whole_run: float) -> float:
    """A mutant's time limit: 5 times its tests' clean-run seconds plus 10 (a mutant that
    loops is caught in about that), or ``whole_run`` when a test has no time."""
    if not tests or any(test not in seconds for test in tests):
        return whole_run
    return min(whole_run, 5 * sum(seconds[test] for test in tests) + 10)


def changed_lines(module: Path, since: str) -> set[int]:
    """The lines of ``module`` as it is now that were added or changed since the git
    revision ``since`` (``git diff -U0``: its hunks' new line ranges); every line of a
    module git does not track yet (all of it is new)."""
    tracked = subprocess.run(
        ["git", "ls-files", "--error-unmatch", module.name], cwd=module.parent, capture_output=True
    )  # fmt: skip
    if tracked.returncode != 0:
        return set(range(1, len(module.read_text().splitlines()) + 1))
    diff = subprocess.run(
        ["git", "diff", "--no-color", "-U0", since, "--", module.name],
        cwd=module.parent, capture_output=True, text=True,
    )  # fmt: skip
    if diff.returncode != 0:
        raise SystemExit(f"git diff {since} failed: {diff.stderr.strip()}: give a revision.")
    lines: set[int] = set()
    for hunk in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff.stdout, re.MULTILINE):
        start = int(hunk[1])
        lines.update(range(start, start + int(hunk[2] or 1)))  # ",0": lines removed only
    return lines


def _touches(mutant: Mutant, lines: set[int]) -> bool:
    return any(line in lines for line in range(mutant.line, max(mutant.end_line, mutant.line) + 1))


def _same(mutant: Mutant, earlier: dict) -> bool:
    """Whether an earlier result's survivor is this mutant (its index, line and rewrite)."""
    return (earlier["index"], earlier["line"], earlier["description"]) == (
        mutant.index, mutant.line, mutant.description,
    )  # fmt: skip


def main(argv: list[str] | None = None, fork: bool = False) -> int:
    """The command line; ``fork``: each mutant's tests in a fork (:func:`run_tests`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", type=Path, help="the module's file, from the repository root")
    parser.add_argument(
        "tests", nargs="+", help="pytest arguments: the tests that exercise it (-k ... too)"
    )
    parser.add_argument("--json", type=Path, help="also write the result to this file")
    parser.add_argument("--limit", type=int, help="try only the first N mutants")
    parser.add_argument("--survivors", type=Path,
                        help="try only the survivors of this earlier --json result (after "
                        "adding tests for them)")  # fmt: skip
    parser.add_argument("--uncovered-runs-all", action="store_true",
                        help="run every given test against a mutant of lines no test runs "
                        "in process (lines only another process runs, such as torchrun's "
                        "ranks), instead of counting it a survivor")  # fmt: skip
    parser.add_argument("--since", metavar="REV",
                        help="try only the mutants of lines added or changed since the git "
                        "revision REV (the habit: mutate what you just wrote)")  # fmt: skip
    args, pytest_options = parser.parse_known_args(argv)  # -k, -m: pytest's
    args.tests += pytest_options
    path = (ROOT / args.module).resolve()
    original = path.read_text()
    changed = None if args.since is None else changed_lines(path, args.since)
    start = time.perf_counter()
    measure = importlib.util.find_spec("coverage") is not None
    if not run_tests(args.tests, timeout=3600, coverage_of=path if measure else None):
        print(f"the tests fail on the unmutated {args.module}: fix them first")
        return 2
    timeout = 5 * (time.perf_counter() - start) + 10
    lines = covering_tests(path) if measure else None
    seconds = clean_run_seconds()
    found = mutants(original)[: args.limit]
    if args.survivors is not None:
        earlier = json.loads(args.survivors.read_text())["survivors"]
        found = [m for m in found if any(_same(m, s) for s in earlier)]
    if changed is not None:
        found = [m for m in found if _touches(m, changed)]
    survivors = []
    try:
        for done, mutant in enumerate(found):
            print(f"[{done + 1}/{len(found)}] {args.module}:{mutant.line} {mutant.description}",
                  file=sys.stderr, flush=True)  # fmt: skip
            tests = args.tests if lines is None else tests_for(mutant, lines, seconds)
            if not tests and args.uncovered_runs_all:
                tests = args.tests
            path.write_text(mutated_source(original, mutant))
            limit = time_limit(tests, seconds, timeout)
            if not tests or run_tests(tests, limit, fork=fork):
                survivors.append(mutant)
                why = "" if tests else " (no test runs it)"
                print(f"survived: {args.module}:{mutant.line} {mutant.description}{why}",
                      flush=True)  # fmt: skip
    finally:
        path.write_text(original)
        _coverage_data().unlink(missing_ok=True)
        _durations_file().unlink(missing_ok=True)
    caught = len(found) - len(survivors)
    rate = caught / len(found) if found else 1.0
    print(f"{args.module}: {len(found)} mutants, {caught} caught, {len(survivors)} survived "
          f"({rate:.0%})")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({
            "module": str(args.module), "tests": args.tests, "mutants": len(found),
            "caught": caught, "survivors": [m.__dict__ for m in survivors],
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    # a SIGTERM (``timeout``, a CI limit) unwinds through ``finally``: the module is restored
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    preload_libraries()
    sys.exit(main(fork=True))
