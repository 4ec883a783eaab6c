"""Every tensor the package creates is placed on a device, or is host-side on purpose and
says why (issue 35).

A tensor that takes part in the model's math must be created on the model's device: one
made on the CPU beside CUDA tensors ends a GPU run with "Expected all tensors to be on the
same device" (the free-rider bug), usually in a path that runs late or only with an option.
No GPU is needed to keep it so: this test scans the source for tensor factories
(``torch.zeros``, ``torch.randn``, ``torch.tensor``, ``torch.from_numpy``, ...) and requires
each to have a ``device=``, or a ``# host: <reason>`` comment on its statement (or on the line
above it, or at the top of its function's body, for a whole function of host bookkeeping),
or to live in one of the few modules below that are host-side as a whole.
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("lightning_fl", "callbacks", "datamodules")
FACTORIES = frozenset(
    "zeros ones empty full rand randn randint randperm arange linspace logspace eye tensor "
    "as_tensor from_numpy normal bernoulli multinomial".split()
)
MARK = "# host:"

#: Modules whose tensors are host-side as a whole, each with its reason.
HOST_MODULES = {
    "datamodules/": "datasets are built on the host; the strategy moves each batch to the "
    "device, or packs the whole federation there once (engine/packed.py)",
    "lightning_fl/systems/samplers.py": "participation (which clients, with which weights) "
    "is decided on the host from CPU generators; update representations arrive via .cpu()",
    "lightning_fl/systems/availability.py": "which clients are available is host "
    "bookkeeping drawn from CPU generators, the same on every device",
    "lightning_fl/systems/ca_fed.py": "CA-Fed's availability and loss estimates are host "
    "bookkeeping of per-client floats",
    "lightning_fl/systems/membership.py": "attack scores are computed from softmax outputs "
    "already moved to the host (callbacks/privacy.predict_proba)",
    "lightning_fl/systems/streams.py": "a stream's cache is a set of sample ids, drawn on the host",
}


def unplaced_factories(source: str, path: str = "<source>") -> list[str]:
    """``path:line: torch.name`` for every tensor factory in ``source`` that has no
    ``device=`` and no ``# host: <reason>`` mark."""
    tree = ast.parse(source)
    lines = source.splitlines()
    marks = [
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and _is_mark(tok.string)
    ]
    marked = set(marks)
    alone = {line for line in marks if lines[line - 1].lstrip().startswith("#")}
    covered: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body_start = _first_statement(node).lineno
            if any(node.lineno <= line < body_start for line in marked):
                covered.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        elif isinstance(node, ast.stmt) and not isinstance(node, ast.ClassDef):
            own = range(node.lineno, _header_end(node) + 1)
            if node.lineno - 1 in alone or marked.intersection(own):
                covered.update(own)
    found = []
    for node in ast.walk(tree):
        if _is_factory(node) and not any(k.arg == "device" for k in node.keywords):
            if node.lineno not in covered:
                found.append(f"{path}:{node.lineno}: torch.{node.func.attr}")
    return sorted(found)


def _is_mark(comment: str) -> bool:
    reason = comment[len(MARK) :].strip() if comment.startswith(MARK) else ""
    return len(reason.split()) >= 3  # a reason, not a bare tag


def _is_factory(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
        and node.func.attr in FACTORIES
    )


def _first_statement(function: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.stmt:
    """The body's first statement after the docstring (the docstring itself if alone)."""
    body = function.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1] if has_docstring and len(body) > 1 else body[0]


def _header_end(statement: ast.stmt) -> int:
    """The last line of a compound statement's header (a simple statement's last line)."""
    body = getattr(statement, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
        return body[0].lineno - 1
    return statement.end_lineno or statement.lineno


def package_files() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))


def is_host_module(relative: str) -> bool:
    return any(relative.startswith(prefix) for prefix in HOST_MODULES)


def test_every_tensor_factory_is_placed_or_marked_host_side():
    unplaced = [
        entry
        for path in package_files()
        if not is_host_module(rel := path.relative_to(ROOT).as_posix())
        for entry in unplaced_factories(path.read_text(), rel)
    ]
    assert not unplaced, (
        f"{len(unplaced)} tensor(s) created without a device:\n  "
        + "\n  ".join(unplaced)
        + "\nPass device= (the model's, or that of the tensors it meets), or add "
        "'# host: <reason>' where it is host-side bookkeeping on purpose."
    )


def test_every_host_module_exists_and_creates_tensors():
    for prefix in HOST_MODULES:
        files = [p for p in package_files() if p.relative_to(ROOT).as_posix().startswith(prefix)]
        assert files, f"HOST_MODULES lists {prefix!r}, which is not in the package"
        assert any(
            _is_factory(node) for p in files for node in ast.walk(ast.parse(p.read_text()))
        ), f"{prefix!r} creates no tensor: drop it from HOST_MODULES"


BARE = """
import torch
def f(x):
    y = torch.zeros(3)
    return x + torch.randn(3, generator=None).to(x)
"""
ZEROS, RANDN = "<source>:4: torch.zeros", "<source>:5: torch.randn"
LOOP = "import torch\nfor i in range(2):  # host: the loop header only\n    torch.ones(i)\n"
MOVED = "import torch\nt = torch.from_numpy(a).to(dev)\nu = torch.zeros_like(t)\n"


@pytest.mark.parametrize(
    "source, expected",
    [
        (BARE, [ZEROS, RANDN]),
        (BARE.replace("zeros(3)", "zeros(3, device=x.device)"), [RANDN]),
        (BARE.replace("(3)\n", "(3)  # host: counts are Python floats\n"), [RANDN]),
        (BARE.replace("(3)\n", "(3)  # host:\n"), [ZEROS, RANDN]),  # no reason
        (BARE.replace("(x):\n", "(x):\n    # host: all of it is host bookkeeping\n"), []),
        (
            BARE.replace("    return", "    # host: a CPU generator, moved after\n    return"),
            [ZEROS],
        ),
        (LOOP, ["<source>:3: torch.ones"]),  # a header's mark does not cover its body
        (MOVED, ["<source>:2: torch.from_numpy"]),  # *_like follows its argument
    ],
)
def test_the_scan_flags_what_it_should(source, expected):
    assert unplaced_factories(source) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine runs the mode itself")
def test_the_gpu_mode_skips_cleanly_without_a_gpu(tmp_path):
    report = tmp_path / "gpu.md"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--accelerator", "gpu",
         "--gpu-report", str(report), "tests/test_packed.py", "tests/test_bad_input.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert " skipped" in summary and " deselected" in summary and "passed" not in summary
    assert "no CUDA device, every test skipped" in result.stdout
    assert not report.exists()


def test_the_gpu_report_names_the_machine_and_every_failure(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(conftest, "_driver_version", lambda: "580.65")

    def report(nodeid: str, outcome: str, message: str = ""):
        crash = SimpleNamespace(reprcrash=SimpleNamespace(message=message)) if message else None
        return SimpleNamespace(nodeid=nodeid, outcome=outcome, when="call", longrepr=crash,
                               fspath=nodeid.split("::")[0])  # fmt: skip

    stats = {
        "passed": [report("tests/test_vectorized.py::test_a", "passed")] * 3,
        "failed": [report("tests/test_late_paths.py::test_b", "failed", "RuntimeError: cpu\nx")],
        "skipped": [report("tests/test_distributed.py::test_c", "skipped")] * 2,
    }
    config = SimpleNamespace(invocation_params=SimpleNamespace(args=("--accelerator", "gpu")))
    text = conftest.gpu_report(stats, config, exitstatus=1)
    assert "- device: NVIDIA H200 × 1" in text
    assert f"- driver: 580.65; CUDA {torch.version.cuda}; torch {torch.__version__}" in text
    assert "3 passed, 1 failed, 0 errors, 2 skipped" in text
    assert "| test_vectorized | the vectorized = sequential equalities | 3 | 0 |" in text
    assert (
        "| test_late_paths | every offline recipe far enough to reach its late paths | 0 | 1 |"
        in text
    )
    assert "- `tests/test_late_paths.py::test_b`: RuntimeError: cpu\n" in text
