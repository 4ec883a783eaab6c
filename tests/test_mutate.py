"""The mutation runner (tests/mutate.py, issue 39) on a module written for it: it finds
the rewrites it should, applies the one asked for, restores the module, and reports as
survivors exactly the mutants the tests cannot tell apart."""

from __future__ import annotations

import json
import os

from tests.mutate import main, mutants, mutated_source

MODULE = '''"""A clamp."""


def clamp(x, low, high):
    """x within [low, high]."""
    if x < low:
        return low
    return min(x, high)
'''

TESTS = """import sys

sys.path.insert(0, {folder!r})
from clamp import clamp


def test_clamp():
    assert clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0 and clamp(2, 0, 3) == 2
"""


def test_mutants_are_the_rewrites_of_function_bodies_only():
    found = [(m.line, m.description) for m in mutants(MODULE)]
    assert found == [(6, "Lt -> LtE"), (8, "call -> its first argument")]
    assert "if x <= low:" in mutated_source(MODULE, mutants(MODULE)[0])
    assert "return x\n" in mutated_source(MODULE, mutants(MODULE)[1]) + "\n"


def test_the_runner_reports_the_survivor_and_restores_the_module(tmp_path, capsys):
    """x < low and x <= low return the same value (x == low): an equivalent mutant, which
    survives; min(x, high) → x is caught by clamp(5, 0, 3). Progress goes to stderr, one
    line per mutant as it starts."""
    module, tests = tmp_path / "clamp.py", tmp_path / "test_clamp.py"
    module.write_text(MODULE)
    tests.write_text(TESTS.format(folder=str(tmp_path)))
    result = tmp_path / "result.json"
    assert main([str(module), str(tests), "--json", str(result)]) == 0
    summary = json.loads(result.read_text())
    assert (summary["mutants"], summary["caught"]) == (2, 1)
    assert [s["description"] for s in summary["survivors"]] == ["Lt -> LtE"]
    assert module.read_text() == MODULE
    progress = [line.split()[0] for line in capsys.readouterr().err.splitlines()]
    assert progress == ["[1/2]", "[2/2]"]


TWO = '''"""Two functions, one of them never called by the tests."""


def double(x):
    return x * 2


def halve(x):
    return x / 2
'''

TWO_TESTS = """import sys

sys.path.insert(0, {folder!r})
from two import double


def test_double():
    assert double(3) == 6


def test_nothing_of_the_module():
    assert True
"""


def test_only_the_tests_that_run_a_mutant_run_against_it_and_unrun_lines_survive(tmp_path):
    """The clean run is measured per test: ``x * 2`` is run by test_double alone (the other
    test never enters the module), and ``halve``'s ``x / 2`` by no test, so its two
    mutants (``/`` → ``*``, 2 → 3) survive without a run."""
    from tests.mutate import covering_tests, run_tests, tests_for

    module, tests = tmp_path / "two.py", tmp_path / "test_two.py"
    module.write_text(TWO)
    tests.write_text(TWO_TESTS.format(folder=str(tmp_path)))
    assert run_tests([str(tests)], 600, coverage_of=module)
    lines = covering_tests(module)
    found = mutants(TWO)
    assert [m.line for m in found] == [5, 9, 5, 9]  # ast.walk: breadth first
    assert tests_for(found[0], lines) == [f"{tests}::test_double"]
    assert tests_for(found[1], lines) == [] == tests_for(found[3], lines)
    result = tmp_path / "result.json"
    assert main([str(module), str(tests), "--json", str(result)]) == 0
    summary = json.loads(result.read_text())
    assert (summary["mutants"], summary["caught"]) == (4, 2)
    assert [s["line"] for s in summary["survivors"]] == [9, 9]
    assert module.read_text() == TWO
    # a test for the survivors, then only they run again
    text = tests.read_text().replace("from two import double", "from two import double, halve")
    tests.write_text(text + "\n\ndef test_halve():\n    assert halve(3) == 1.5\n")
    again = tmp_path / "again.json"
    assert main([str(module), str(tests), "--json", str(again), "--survivors", str(result)]) == 0
    assert json.loads(again.read_text())["mutants"] == 2 == json.loads(again.read_text())["caught"]


CHILD_TESTS = """import subprocess
import sys

sys.path.insert(0, {folder!r})
from two import double


def test_double():
    assert double(3) == 6


def test_halve_in_another_process():
    code = "import sys; sys.path.insert(0, {folder!r}); from two import halve; "
    subprocess.run([sys.executable, "-c", code + "assert halve(3) == 1.5"], check=True)
"""


def test_lines_only_another_process_runs_can_run_every_given_test(tmp_path):
    """``halve`` runs only in a child process, which coverage does not measure: its two
    mutants survive unrun by default, and are caught with ``--uncovered-runs-all``."""
    module, tests = tmp_path / "two.py", tmp_path / "test_two.py"
    module.write_text(TWO)
    tests.write_text(CHILD_TESTS.format(folder=str(tmp_path)))
    caught = []
    for extra in ([], ["--uncovered-runs-all"]):
        result = tmp_path / f"result{len(extra)}.json"
        assert main([str(module), str(tests), "--json", str(result), *extra]) == 0
        caught.append(json.loads(result.read_text())["caught"])
        assert module.read_text() == TWO
    assert caught == [2, 4]


ORDER_TESTS = """import sys
import time

sys.path.insert(0, {folder!r})
from two import double


def test_a_slow():
    time.sleep(0.6)
    assert double(2) == 4
    with open({log!r}, "a") as log:
        log.write("slowest ")


def test_b_fast():
    assert double(3) == 6
    with open({log!r}, "a") as log:
        log.write("fast ")


def test_c_slow_too():
    time.sleep(0.3)
    assert double(1) == 2
    with open({log!r}, "a") as log:
        log.write("slow ")
"""


def test_a_mutants_tests_run_fastest_first_by_their_clean_run_times(tmp_path):
    """Three tests run ``double``: the mutant's list puts them in order of their measured
    clean-run times (not by name), and pytest runs them in that order, so ``-x`` stops at
    the cheapest failure."""
    from tests.mutate import clean_run_seconds, covering_tests, run_tests, tests_for

    module, tests, log = tmp_path / "two.py", tmp_path / "test_order.py", tmp_path / "log"
    module.write_text(TWO)
    tests.write_text(ORDER_TESTS.format(folder=str(tmp_path), log=str(log)))
    assert run_tests([str(tests)], 600, coverage_of=module)
    seconds = clean_run_seconds()
    names = [f"{tests}::test_{n}" for n in ("b_fast", "c_slow_too", "a_slow")]
    assert seconds[names[0]] < seconds[names[1]] < seconds[names[2]]
    ordered = tests_for(mutants(TWO)[0], covering_tests(module), seconds)
    assert ordered == names
    log.write_text("")
    assert run_tests(ordered, 600)
    assert log.read_text() == "fast slow slowest "
    assert tests_for(mutants(TWO)[0], covering_tests(module)) == sorted(names)  # no times


def test_a_forked_run_imports_the_module_as_written_now_and_is_killed_at_its_time_limit(
    tmp_path, monkeypatch
):
    """The fork mode (the command line's): each child imports the module from disk, so a
    bug written after an earlier run is seen (no module or bytecode kept from it: the bug
    has the source's size and, set here, its modification time, which is all a cached
    ``.pyc`` is checked against), and
    the whole runner with ``fork=True`` finds what the interpreter-per-run mode finds; a
    child past its time limit is killed and counts as a failure."""
    import sys

    from tests.mutate import run_tests

    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as a fork would inherit it
    module, tests = tmp_path / "clamp.py", tmp_path / "test_clamp.py"
    tests.write_text(TESTS.format(folder=str(tmp_path)))
    module.write_text(MODULE)
    assert run_tests([str(tests)], 600, fork=True)
    written = module.stat()
    module.write_text(MODULE.replace("min(x, high)", "max(x, high)"))
    os.utime(module, ns=(written.st_atime_ns, written.st_mtime_ns))
    assert not run_tests([str(tests)], 600, fork=True)
    module.write_text(MODULE)
    assert run_tests([str(tests)], 600, fork=True)
    module.write_text(MODULE.replace('"""x within [low, high]."""', "while True: pass"))
    assert not run_tests([str(tests)], 2, fork=True)
    module.write_text(MODULE)
    result = tmp_path / "result.json"
    assert main([str(module), str(tests), "--json", str(result)], fork=True) == 0
    summary = json.loads(result.read_text())
    assert (summary["mutants"], summary["caught"]) == (2, 1)
    assert module.read_text() == MODULE


def test_a_mutants_time_limit_is_its_own_tests_clean_time_not_the_whole_runs():
    """5 × (0.5 + 1.5) + 10 = 20 s for a mutant whose two tests took 0.5 and 1.5 s clean,
    capped by the whole run's limit; the whole run's when a test has no measured time (a
    loop in one cheap test's lines no longer waits out the slowest file's limit)."""
    from tests.mutate import time_limit

    seconds = {"a": 0.5, "b": 1.5, "c": 40.0}
    assert time_limit(["a", "b"], seconds, 600.0) == 20.0
    assert time_limit(["a", "c"], seconds, 100.0) == 100.0
    assert time_limit(["a", "unmeasured"], seconds, 600.0) == 600.0
    assert time_limit([], seconds, 600.0) == 600.0


def test_since_a_revision_only_the_changed_lines_are_mutated(tmp_path):
    """``--since REV``: the mutants of lines added or changed since a git revision, here
    ``halve``'s rewritten body (its two mutants), not ``double``'s (two more); a revision
    git does not know is refused before any test runs."""
    import subprocess

    import pytest

    from tests.mutate import changed_lines

    module, tests = tmp_path / "two.py", tmp_path / "test_two.py"
    module.write_text(TWO)
    tests.write_text(TWO_TESTS.format(folder=str(tmp_path)).replace("double", "double, halve", 1))
    tests.write_text(tests.read_text() + "\n\ndef test_halve():\n    assert halve(7) == 3\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "two.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "two"], check=True)
    module.write_text(TWO.replace("return x / 2", "return x // 2"))
    assert changed_lines(module, "HEAD") == {9}
    result = tmp_path / "result.json"
    assert main([str(module), str(tests), "--json", str(result), "--since", "HEAD"]) == 0
    summary = json.loads(result.read_text())
    assert (summary["mutants"], summary["caught"]) == (2, 2)  # // → /, 2 → 3: line 9 only
    with pytest.raises(SystemExit, match="give a revision"):
        main([str(module), str(tests), "--since", "no-such-revision"])
    fresh = tmp_path / "fresh.py"  # not tracked yet: all of it is new
    fresh.write_text(TWO)
    assert changed_lines(fresh, "HEAD") == set(range(1, len(TWO.splitlines()) + 1))
