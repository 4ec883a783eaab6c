"""The GPU test mode (issue 35): ``pytest --accelerator gpu`` (``make test-gpu``).

It runs on CUDA the tests of :data:`GPU_MODULES` (the others stay CPU-only) and writes
what it found, with the device, torch, CUDA and driver versions, to
``benchmarks/results/gpu.md`` (``--gpu-report`` elsewhere). Without a CUDA device every
test of the mode is skipped, saying so. The mode keeps float32 exact
(``torch.set_float32_matmul_precision("highest")`` and cuDNN without TF32), so that the
vectorized = sequential equalities hold to the tolerances the CPU suite uses.

The accelerator reaches the tests through ``LIGHTNING_FL_TEST_ACCELERATOR``
(:data:`tests.helpers.ACCELERATOR`), which pytest-xdist workers and torchrun children
inherit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENVIRONMENT = "LIGHTNING_FL_TEST_ACCELERATOR"
ROOT = Path(__file__).resolve().parents[1]

#: The test modules the GPU mode runs, and what each covers there.
GPU_MODULES = {
    "test_late_paths": "every offline recipe far enough to reach its late paths",
    "test_vectorized": "the vectorized = sequential equalities",
    "test_packed": "the federation packed on the device",
    "test_composition": "the composition matrix (its 2-process test needs 2 GPUs)",
    "test_cli_and_logging": "every recipe's short run and its reports",
    "test_distributed": "the 2-process runs (NCCL: one GPU per process, so 2 GPUs)",
    "test_client_store": "client entries moved between ranks travel on the CPU",
    "test_robust": "robust aggregators over the round's update rows, the attacks",
    "test_user_dp": "DP-FedAvg's clipping, noise and adaptive clip norm",
}
#: Modules whose runs take several processes: NCCL needs a GPU for each.
MULTI_PROCESS = ("test_distributed", "test_composition::test_every_plugin_on_two_processes")


@pytest.fixture
def drawn(monkeypatch):
    """The figures as ``lightning_fl.plots._save`` saves them (drawn first, so that tick
    labels exist): file name → figure, and ``name + ":dpi"`` → each saving's dpi."""
    from lightning_fl import plots

    figures: dict[str, object] = {}
    real = plots._save

    def keep(plt, fig, path, dpi):
        fig.canvas.draw()
        figures[Path(path).name] = fig
        figures[Path(path).name + ":dpi"] = dpi
        return real(plt, fig, path, dpi)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--accelerator",
        choices=("cpu", "gpu"),
        default=os.environ.get(ENVIRONMENT, "cpu"),
        help="gpu: the GPU test mode (tests/conftest.py); cpu: the CPU suite (default).",
    )
    parser.addoption(
        "--gpu-report",
        default=str(ROOT / "benchmarks" / "results" / "gpu.md"),
        help="Where the GPU test mode writes its report.",
    )


def pytest_configure(config: pytest.Config) -> None:
    accelerator = config.getoption("--accelerator")
    os.environ[ENVIRONMENT] = accelerator
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None and int(workers) >= (os.cpu_count() or 1):
        # pytest-xdist runs a worker per core: one intra-op thread each, as the tests'
        # subprocesses have (OMP_NUM_THREADS=1). Two threads per worker on as many cores
        # as workers spin against each other (a CNN recipe's test: 14 s alone, 86 s so).
        import torch

        torch.set_num_threads(1)
    if accelerator == "gpu":
        import torch

        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        config._lightning_fl_started = time.time()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--accelerator") != "gpu":
        return
    import torch

    kept = [item for item in items if _module(item) in GPU_MODULES]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in kept:
        if gpus == 0:
            item.add_marker(pytest.mark.skip(reason="the GPU test mode needs a CUDA device"))
        elif gpus < 2 and any(key in item.nodeid for key in MULTI_PROCESS):
            item.add_marker(pytest.mark.skip(reason="2 processes need 2 GPUs under NCCL"))


def _module(item: pytest.Item) -> str:
    return item.path.stem


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if config.getoption("--accelerator") != "gpu" or hasattr(config, "workerinput"):
        return
    import torch

    if not torch.cuda.is_available():
        terminalreporter.write_line("GPU test mode: no CUDA device, every test skipped.")
        return
    path = Path(config.getoption("--gpu-report"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(gpu_report(terminalreporter.stats, config, exitstatus))
    terminalreporter.write_line(f"GPU test mode: report written to {path}")


def gpu_report(stats: dict, config: pytest.Config, exitstatus: int) -> str:
    """benchmarks/results/gpu.md: the machine, the counts and every failure's first line."""
    import lightning
    import torch

    from lightning_fl.systems.datastore import faiss_gpu_available

    reports = [r for key in ("passed", "failed", "error") for r in stats.get(key, [])]
    calls = [r for r in reports if r.when == "call" or r.outcome != "passed"]
    counts = {key: len(stats.get(key, [])) for key in ("passed", "failed", "error", "skipped")}
    elapsed = time.time() - getattr(config, "_lightning_fl_started", time.time())
    lines = [
        "# The GPU test mode",
        "",
        "Written by `make test-gpu` (`pytest --accelerator gpu`, tests/conftest.py).",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- device: {torch.cuda.get_device_name(0)} × {torch.cuda.device_count()}",
        f"- driver: {_driver_version()}; CUDA {torch.version.cuda}; torch {torch.__version__}; "
        f"Lightning {lightning.__version__}; Python {sys.version.split()[0]}",
        f"- faiss-gpu: {'yes' if faiss_gpu_available() else 'not installed (faiss-cpu used)'}",
        f"- command: `pytest {' '.join(config.invocation_params.args)}`",
        f"- result: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['error']} errors, {counts['skipped']} skipped in {elapsed:.0f} s "
        f"(exit status {exitstatus})",
        "",
        "| module | what it covers on the GPU | passed | failed |",
        "|---|---|---|---|",
    ]
    for module, covers in GPU_MODULES.items():
        mine = [r for r in calls if Path(r.fspath).stem == module]
        passed = sum(r.outcome == "passed" for r in mine)
        lines.append(f"| {module} | {covers} | {passed} | {len(mine) - passed} |")
    failures = [r for r in calls if r.outcome != "passed"]
    if failures:
        lines += ["", "## Failures", ""]
        for report in failures:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message.splitlines()[0] if crash else str(report.longrepr)[:200]
            lines.append(f"- `{report.nodeid}`: {message}")
    return "\n".join(lines) + "\n"


def _driver_version() -> str:
    try:
        found = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"
    return found.stdout.strip().splitlines()[0]
