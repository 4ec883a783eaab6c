"""Every example in the docstrings runs (issue 68): the modules of the package whose
docstrings hold a ``>>>`` example, found by reading the sources, each run with doctest.
A module named in :data:`REQUIRED` must keep its examples: the mathematics the issue asks
to show with small numbers (the samplers' ω_i, the aggregator's p_i, SIFU's restart, the
DP baseline's σ, CA-Fed's weights, the max-plus cycle time)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lightning_fl": ROOT / "lightning_fl", "lightning_fl.callbacks": ROOT / "callbacks",
            "lightning_fl.datamodules": ROOT / "datamodules"}  # fmt: skip
#: module → the objects whose examples must be there
REQUIRED = {
    "lightning_fl.systems.samplers": ["UniformSampler", "MDSampler", "PoissonSampler"],
    "lightning_fl.engine.plugins": [
        "Aggregator.target_weights",
        "FederatedCallback.add_server_state",
    ],
    "lightning_fl.systems.unlearning": ["BranchHistory.fork_point"],
    "lightning_fl.systems.forgetting": ["DPBaseline.round_noise_std"],
    "lightning_fl.systems.ca_fed": ["estimated_error", "truncate", "AvailabilityEstimator"],
    "lightning_fl.systems.topology": ["cycle_time"],
    "lightning_fl.systems.availability": ["SojournMarkovAvailability"],
    "lightning_fl.systems.user_dp": [],
    "lightning_fl.systems.robust": [],
    "lightning_fl.systems.pairwise_masking": [],
    "lightning_fl.systems.discrete_gaussian": [],
    "lightning_fl.systems.privacy_noise": [],
    "lightning_fl.systems.double_masking": [],
    "lightning_fl.datamodules.arrays": ["ArrayFederatedDataModule"],
}


def modules_with_examples() -> list[str]:
    found = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            if ">>> " in path.read_text(encoding="utf-8"):
                parts = path.relative_to(folder).with_suffix("").parts
                found.append(".".join((package, *parts)).removesuffix(".__init__"))
    return found


@pytest.mark.parametrize("name", modules_with_examples())
def test_the_examples_of_a_module_run(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(module) if t.examples]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0 and result.attempted > 0, name
    names = {t.name.removeprefix(f"{name}.") for t in tests}
    missing = set(REQUIRED.get(name, [])) - names
    assert not missing, f"{name} lost the examples of {sorted(missing)}"


def test_the_required_examples_are_found():
    assert set(REQUIRED) <= set(modules_with_examples())
