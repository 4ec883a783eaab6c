"""The documentation site (issue 68): it builds strictly from the repository's sources
(a broken link, cross-reference or anchor, or a public name without a docstring, fails
the build), and its hooks find what they should."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("mkdocstrings_handlers.python", reason="pip install -e '.[docs]'")


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly_with_every_page(tmp_path):
    """From a clean clone's state: no source tree left by an earlier build."""
    shutil.rmtree(ROOT / "build" / "docs_src", ignore_errors=True)
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    site = tmp_path / "site"
    api = (site / "api" / "lightning_fl" / "index.html").read_text()
    assert 'id="lightning_fl.systems.samplers.UniformSampler"' in api
    callbacks = (site / "api" / "callbacks" / "index.html").read_text()
    assert 'id="lightning_fl.callbacks.user_dp.DPFedAvg"' in callbacks
    # a role is a link to where the object is rendered (DPFedAvg's noise_source names
    # lightning_fl.systems.privacy_noise, on the systems page)
    assert 'href="../systems/#lightning_fl.systems.privacy_noise"' in callbacks
    assert ":class:`" not in callbacks and ":mod:`" not in callbacks
    systems = (site / "api" / "systems" / "index.html").read_text()
    assert 'id="lightning_fl.systems.robust.krum_scores"' in systems
    assert 'id="lightning_fl.systems.samplers.UniformSampler"' not in systems  # once only
    recipes = (site / "recipes" / "index.html").read_text()
    assert "quickstart.yaml" in recipes and "population/sent140_markov.yaml" in recipes
    guide = (site / "index.html").read_text()
    assert "Large populations" in guide and not (site / "hooks.py").exists()
    assert (site / "architecture" / "index.html").exists()


def test_a_public_name_without_a_docstring_is_a_warning(caplog, monkeypatch):
    hooks = _hooks()

    class Undocumented:
        pass

    Undocumented.__module__ = "lightning_fl.systems.samplers"
    monkeypatch.setattr(hooks, "public_names", lambda package: [("Undocumented", Undocumented)])
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.lightning_fl"):
        page = hooks.names_page("lightning_fl")
    assert "::: lightning_fl.systems.samplers.Undocumented" in page
    assert ["lightning_fl.Undocumented has no docstring"] == [
        r.getMessage().split(":")[0] for r in caplog.records
    ]


def test_cross_references_resolve_or_warn(caplog, tmp_path):
    hooks = _hooks()
    assert hooks.resolves("lightning_fl.engine.tensors.flatten", "lightning_fl.engine.plugins")
    assert hooks.resolves(".personalized", "lightning_fl.callbacks")  # relative module
    assert hooks.resolves("~.samplers.UniformSampler".lstrip("~"), "lightning_fl.systems.ca_fed")
    assert hooks.resolves("ForgettingMethod.restart", "lightning_fl.systems.forgetting")
    assert not hooks.resolves("lightning_fl.engine.tensors.flattened", "lightning_fl.engine")
    assert not hooks.resolves("NoSuchClass", "lightning_fl.systems.samplers")
    assert hooks.canonical("lightning_fl.callbacks.FedAvg", "lightning_fl.cli") == (
        "lightning_fl.engine.plugins.FedAvg"  # where it is defined, and rendered
    )
    assert hooks.canonical(".personalized", "lightning_fl.callbacks") == (
        "lightning_fl.callbacks.personalized"
    )
    assert hooks.canonical("ForgettingMethod.restart", "lightning_fl.systems.forgetting") == (
        "lightning_fl.systems.forgetting.ForgettingMethod.restart"
    )
    assert hooks.canonical("NoSuchClass", "lightning_fl.systems.samplers") is None
    source = tmp_path / "module.py"
    source.write_text('"""See :class:`~lightning_fl.NoSuch` and :func:`sorted`."""\n')
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.lightning_fl"):
        text = hooks.ROLE.sub(lambda m: hooks._role(m, "lightning_fl", source), source.read_text())
    assert text == '"""See `NoSuch` and `sorted`."""\n'
    assert len(caplog.records) == 1 and "lightning_fl.NoSuch" in caplog.records[0].getMessage()


def test_doctests_are_fenced_and_readme_links_stay_inside_the_site():
    hooks = _hooks()
    text = '    """Sum.\n\n    >>> 1 + 1\n    2\n    """\n'
    assert hooks.fenced_examples(text) == (
        '    """Sum.\n\n    ```python\n    >>> 1 + 1\n    2\n    ```\n    """\n'
    )
    page = hooks.readme_page()
    assert "](recipes.md#flamby-heart-silos-yaml)" in page  # a recipe: its entry
    assert "](architecture.md#repository-files)" in page  # another file: read it in a clone
    assert "](benchmarks/" not in page and "](tests/" not in page
    assert "](#large-populations)" in page


def test_the_callbacks_page_groups_the_plugins_by_family():
    """Each plugin under its family's heading (lightning_fl.callbacks.FAMILIES), every
    public name once, the contract first; a package without families is one list."""
    hooks = _hooks()
    page = hooks.names_page("lightning_fl.callbacks").splitlines()
    headings = [line for line in page if line.startswith("## ")]
    assert headings == ["## The contract, FedAvg and the figures", "## Aggregation",
                        "## Personalization", "## Participation and time",
                        "## Privacy and robustness"]  # fmt: skip

    def section_of(name: str) -> str:
        row = next(i for i, line in enumerate(page) if line.endswith(f".{name}"))
        return next(line for line in reversed(page[:row]) if line.startswith("## "))

    assert section_of("FederatedCallback") == headings[0]
    assert section_of("SCAFFOLD") == section_of("IterateAverage") == "## Aggregation"
    assert section_of("FedEM") == section_of("GossipAveraging") == "## Personalization"
    assert section_of("SAFARI") == "## Participation and time"
    assert section_of("SecureAggregation") == section_of("Krum") == "## Privacy and robustness"
    import lightning_fl.callbacks as callbacks

    blocks = [line for line in page if line.startswith("::: ")]
    assert sorted(b.rsplit(".", 1)[-1] for b in blocks) == sorted(callbacks.__all__)
    assert not [line for line in hooks.names_page("lightning_fl").splitlines() if line[:3] == "## "]
