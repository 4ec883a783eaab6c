"""Your own module (README, "Your own module"; issue 38): the README's example module runs
with every main plugin, a plain LightningModule is refused by exactly the plugins whose row
says they need more than ``training_step`` (naming the method), and the README's plugin
table is the one generated from the plugins' signatures and docstrings."""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fl import (
    ClientTimes,
    FedBuffSchedule,
    FederatedStrategy,
    MixtureClassifier,
    callbacks,
)
from lightning_fl.callbacks.catalog import MAIN_PLUGINS, plugin_table
from lightning_fl.datamodules import DigitsDataModule
from lightning_fl.engine.composition import CompositionError, method_of, module_needs
from tests.helpers import make_trainer

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SECTION = README[README.index("## Your own module") : README.index("## Recipes")]
(EXAMPLE,) = re.findall(r"```python\n(.*?)```", SECTION, re.S)

#: constructor arguments of the plugins that have required ones or need a short setting
ARGUMENTS = {
    "AsynchronousFL": lambda: {"schedule": FedBuffSchedule(2, ClientTimes(heterogeneity=4))},
    "SAFARI": lambda: {"q": 0.5},
    "Unlearning": lambda: {"requests": {1: [0]}},
    "FreeRiders": lambda: {"num_free_riders": 1},
    "KNNPer": lambda: {"backend": "torch"},
    "ClusteredFL": lambda: {"warmup_rounds": 1},
    "FineTune": lambda: {"stages": ("validate",)},
    "MembershipInference": lambda: {"stages": ("validate",)},
}


def example_module() -> type:
    """``DigitsNet``, from the README's example (the code before its training run)."""
    namespace: dict = {}
    exec(compile(EXAMPLE.split("pl.seed_everything")[0], "README.md", "exec"), namespace)
    return namespace["DigitsNet"]


class Plain(pl.LightningModule):
    """A LightningModule with Lightning's methods only."""

    def __init__(self) -> None:
        super().__init__()
        self.network = nn.Linear(64, 10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.network(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module: pl.LightningModule, name: str) -> pl.Trainer:
    plugin = getattr(callbacks, name)(**ARGUMENTS.get(name, dict)())
    server = 40 if name == "SAFARI" else 0  # SAFARI's server round trains on its own data
    datamodule = DigitsDataModule(
        num_clients=6, split=[0.6, 0.2, 0.2], seed=0, batch_size=16, server_samples=server
    )
    strategy = FederatedStrategy(local_steps=2, seed=0)  # every client, every round
    trainer = make_trainer(strategy, 2, [plugin], limit_val_batches=None)
    trainer.fit(module, datamodule=datamodule)
    return trainer


@pytest.mark.parametrize("name", MAIN_PLUGINS)
def test_the_readme_example_module_runs_with_every_main_plugin(name):
    plugin = getattr(callbacks, name)
    if plugin.module_type == "MixtureClassifier":  # its row says so: refused by name
        with pytest.raises(TypeError, match="needs a lightning_fl.MixtureClassifier"):
            fit(example_module()(hidden=8), name)
        fit(MixtureClassifier(nn.Linear(64, 10), num_components=2), name)
        return
    module = example_module()(hidden=8)
    trainer = fit(module, name)
    assert trainer.current_epoch == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize("name", [n for n in MAIN_PLUGINS if n != "FedEM"])
def test_a_plain_module_is_refused_exactly_where_the_table_says(name):
    needs = module_needs(getattr(callbacks, name))
    missing = [need for need in needs if not hasattr(Plain(), method_of(need))]
    if not missing:
        assert fit(Plain(), name).current_epoch == 2
        return
    with pytest.raises(CompositionError) as refused:
        fit(Plain(), name)
    message = str(refused.value)
    assert message.startswith(f"{name} cannot be combined with Plain: besides training_step")
    assert all(need in message for need in missing) and "FederatedTask" in message


def test_the_readme_shows_the_generated_plugin_table():
    assert plugin_table() in SECTION, "regenerate it: python -m lightning_fl.callbacks.catalog"


def test_every_main_plugin_has_a_summary_line():
    for name in MAIN_PLUGINS:
        doc = getattr(callbacks, name).__doc__ or ""
        first = doc.strip().split("\n\n")[0]
        assert first and not first.startswith("Args"), name


def test_the_plugin_table_has_a_row_per_plugin_by_hand(monkeypatch):
    """One row per main plugin, in order; a row by hand for a plugin with a module type and
    two needs (the type first), one with neither, and summaries at both ends of the cut."""
    from lightning_fl.callbacks import catalog

    class Typed:
        """A plugin of a :class:`~lightning_fl.models.MixtureClassifier`: |x| ``ok``."""

        module_type, requires_task_loss, module_methods = "Mixture", True, ("extra(x) -> y",)

        def __init__(self, rate: float = 0.5, *args, steps: int, **kw) -> None: ...

    class Bare:
        def __init__(self) -> None: ...

    table = plugin_table().splitlines()
    assert len(table) == 2 + len(MAIN_PLUGINS) and all(r in SECTION for r in table)
    monkeypatch.setattr(catalog, "MAIN_PLUGINS", ("Typed", "Bare"))
    monkeypatch.setattr(catalog.callbacks, "Typed", Typed, raising=False)
    monkeypatch.setattr(catalog.callbacks, "Bare", Bare, raising=False)
    assert catalog.plugin_table().splitlines()[2:] == [
        "| `Typed` | `rate=0.5`, `steps` | a `Mixture`; `loss_and_metrics(batch) -> (loss, {name: "
        "value})`; `extra(x) -> y` | A plugin of a `MixtureClassifier`: ∣x∣ `ok`. |",
        "| `Bare` | — | training_step only |  |",
    ]
    word = "abcdefghi "  # 10 characters a word
    exact = (word * 16).strip() + "j"  # 160 characters: kept whole
    assert len(exact) == 160 and catalog._summary(exact) == exact
    assert catalog._summary(exact + "k") == (word * 15).strip() + " …"  # 161: cut at a word
