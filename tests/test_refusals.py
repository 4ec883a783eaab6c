"""The composition rules in process (``lightning_fl/engine/composition.py``): the names a
run's plugins carry and every row of the refusal table, on stand-in trainers, message by
message. tests/test_composition.py trains the pairs; these run in milliseconds, so the
mutation runner (issue 39) can measure the rules themselves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fl import FullParticipation, UniformSampler
from lightning_fl.callbacks import FedEM, FedProx
from lightning_fl.engine import composition
from lightning_fl.engine.composition import (
    LOSS_AND_METRICS,
    REFUSALS,
    CompositionError,
    check,
    module_needs,
    plugin_names,
)
from lightning_fl.systems.samplers import ExcludedClients, SamplerWrapper


def _trainer(*callbacks, module=None, datamodule=None):
    return SimpleNamespace(callbacks=list(callbacks), datamodule=datamodule,
                           lightning_module=module or object())  # fmt: skip


class MyFedEM(FedEM):
    """A user's subclass: refused where FedEM is, and named as the user wrote it."""


class _Internal(SamplerWrapper):
    """An internal wrapper (a leading underscore, as unlearning's): not shown."""


def test_plugin_names_map_every_class_along_the_mro_to_the_plugin_a_user_wrote():
    sampler = _Internal(ExcludedClients(UniformSampler(2), 0))
    checkpoint = ModelCheckpoint()
    trainer = _trainer(MyFedEM(), checkpoint, FedProx(0.1), datamodule=None)
    names = plugin_names(trainer, sampler, vectorize=False, world_size=1)
    assert names["ExcludedClients"] == names["UniformSampler"] == "ExcludedClients(UniformSampler)"
    assert names["ClientSampler"] == "ExcludedClients(UniformSampler)"  # the first plugin's
    assert "_Internal" not in names and "SamplerWrapper" in names
    assert names["MyFedEM"] == names["FedEM"] == "MyFedEM"
    assert names["FedProx"] == "FedProx"
    # Lightning's own callbacks, and classes of builtins, torch and Lightning, carry no name
    for absent in ("ModelCheckpoint", "Callback", "object", "vectorize", "2 processes", "silos"):
        assert absent not in names
    three = ExcludedClients(ExcludedClients(UniformSampler(2), 0), 1)
    shown = plugin_names(_trainer(), three, vectorize=True, world_size=3, silos=True)
    assert shown["UniformSampler"] == "ExcludedClients(ExcludedClients(UniformSampler))"
    assert shown["vectorize"] == "FederatedStrategy(vectorize=True)"
    assert shown["2 processes"] == "3 processes"
    assert shown["silos"] == "FederatedStrategy(silos=True)"
    assert "2 processes" not in plugin_names(_trainer(), FullParticipation(), False, 1)
    assert "2 processes" in plugin_names(_trainer(), FullParticipation(), False, 2)


@pytest.mark.parametrize(
    ("rule", "other"), [(rule, other) for rule in REFUSALS for other in rule.second]
)
def test_every_row_of_the_table_refuses_each_of_its_plugins(rule, other, monkeypatch):
    """Each (plugin, other) of the table, shown under the names a user wrote. Three pairs
    are in two rows (Unlearning with the asynchronous, gossip and clustered aggregators):
    the earlier row, theirs, answers."""
    names = {rule.first: f"My{rule.first}", other: f"Their{other}"}
    monkeypatch.setattr(composition, "plugin_names", lambda *args: names)
    with pytest.raises(CompositionError) as refused:
        check(_trainer(), FullParticipation())
    if rule.first == "Unlearning" and other in ("AsynchronousFL", "GossipAveraging", "ClusteredFL"):
        rule, other = next(r for r in REFUSALS if r.first == other), rule.first
        expected = f"Their{rule.first} cannot be combined with My{other}"
    else:
        expected = f"My{rule.first} cannot be combined with Their{other}"
    assert str(refused.value) == f"{expected}: {rule.reason}. Fix: {rule.fix}."


def test_a_refusal_by_hand_and_the_first_rule_wins(monkeypatch):
    names = {"Unlearning": "Unlearning", "SCAFFOLD": "SCAFFOLD", "FixedClustersSampler": "F",
             "DPSGD": "DPSGD", "PFedMe": "PFedMe"}  # fmt: skip
    monkeypatch.setattr(composition, "plugin_names", lambda *args: names)
    with pytest.raises(CompositionError) as refused:
        check(_trainer(), FullParticipation())
    assert str(refused.value) == (
        "Unlearning cannot be combined with SCAFFOLD: SIFU's sensitivity bound (thesis eq. "
        "5.8, Thm 5.1) is for FedAvg's server step θ + η_g Σ ω_i Δ_i; server state (momentum, "
        "control variates, clusters, a clock, server rounds) would keep what a removed client "
        "contributed. Fix: aggregate with FedAvg."
    )


def test_one_plugin_carrying_both_names_is_not_refused_with_itself(monkeypatch):
    """A class that is both FedEM and Ditto (one plugin) is not a pair; a FedEM beside a
    Ditto is, and the personalization rows name the fix."""
    monkeypatch.setattr(composition, "plugin_names",
                        lambda *args: {"FedEM": "Both", "Ditto": "Both"})  # fmt: skip
    check(_trainer(), FullParticipation())
    monkeypatch.setattr(composition, "plugin_names",
                        lambda *args: {"FedEM": "FedEM", "Ditto": "Ditto"})  # fmt: skip
    with pytest.raises(CompositionError, match=r"Fix: keep one of them \(FedEM or the other\)"):
        check(_trainer(), FullParticipation())


def test_rows_cover_the_personal_model_pairs_once():
    """Every unordered pair of personal-model callbacks is refused by exactly one row."""
    personal = composition.PERSONAL_MODELS
    pairs = [
        (rule.first, other)
        for rule in REFUSALS
        if rule.first in personal
        for other in rule.second
        if other in personal
    ]
    assert len(pairs) == len(personal) * (len(personal) - 1) // 2 == 21
    assert len({frozenset(pair) for pair in pairs}) == 21


class _Needs(Callback):
    module_methods = ("criterion(logits, target) -> loss", "features(x) -> z")

    def __init__(self, task_loss: bool) -> None:
        self.requires_task_loss = task_loss


class _Module(LightningModule):
    def features(self, x):
        return x


def test_module_needs_and_their_refusal_by_hand():
    assert module_needs(_Needs(True)) == [LOSS_AND_METRICS, *_Needs.module_methods]
    assert module_needs(_Needs(False)) == list(_Needs.module_methods)
    assert module_needs(SimpleNamespace(needs_losses=True)) == [LOSS_AND_METRICS]
    assert module_needs(object()) == []
    with pytest.raises(CompositionError) as refused:
        check(_trainer(_Needs(True), module=_Module()), FullParticipation())
    assert str(refused.value) == (
        "_Needs cannot be combined with _Module: besides training_step it calls "
        f"{LOSS_AND_METRICS} and criterion(logits, target) -> loss on the module, which "
        "_Module lacks. Fix: subclass lightning_fl.FederatedTask (Classifier, "
        "BinaryClassifier, ...) or add those methods (README, 'Your own module')."
    )

    class OneShort(_Module):
        def loss_and_metrics(self, batch):
            return batch

    with pytest.raises(CompositionError, match="add that method"):
        check(_trainer(_Needs(False), module=OneShort()), FullParticipation())
    sampler = SimpleNamespace(needs_losses=True, sampler=None)
    with pytest.raises(CompositionError, match=r"^SimpleNamespace cannot be combined"):
        check(_trainer(module=_Module()), sampler)


def test_a_federated_task_without_criterion_is_told_to_add_it_not_to_subclass():
    """DP-SGD calls criterion, which FederatedTask leaves to its subclasses: a subclass
    without it is told to add it, not to subclass FederatedTask."""
    from lightning_fl import MLP, FederatedTask
    from lightning_fl.callbacks import DPSGD

    class MyTask(FederatedTask):
        def loss_and_metrics(self, batch):
            x, y = batch
            return torch.nn.functional.cross_entropy(self(x), y), {}

    with pytest.raises(CompositionError) as refused:
        check(_trainer(DPSGD(), module=MyTask(MLP())), FullParticipation())
    message = str(refused.value)
    assert message.startswith("DPSGD cannot be combined with MyTask: besides training_step it "
                              "calls criterion(logits, target) -> loss")  # fmt: skip
    assert "Fix: add that method to MyTask (FederatedTask leaves them" in message
    assert "subclass lightning_fl.FederatedTask" not in message


def test_the_refusal_table_has_one_row_per_rule():
    table = composition.refusal_table().splitlines()
    assert table[:2] == ["| plugin | refused with | why | fix |", "|---|---|---|---|"]
    assert len(table) == 2 + len(composition.TRAIT_RULES) + len(REFUSALS)
    assert table[2].startswith(
        "| every plugin that draws server-side randomness | every plugin or way of running "
        "that aggregates the round's sum on every site | every site would hold"
    )
    assert table[-1] == (
        "| ServerReference | StreamingDataModule | the server's reference data comes from "
        "ReferenceDataModule(reference='server') | use a ReferenceDataModule with "
        "reference='server' |"
    )


#: The refused pairs written out by hand, not derived from composition.py's constants, so
#: that an entry dropped from PARTIAL_SAMPLERS, NON_FEDAVG or WITHOUT_UPDATE_SUM, or a row
#: lost, fails here in milliseconds (the matrix test in test_composition trains them).
PARTIAL = ["UniformSampler", "MDSampler", "ClusteredSampler", "AvailableClients",
           "ExcludedClients"]  # fmt: skip
REFUSED_BY_HAND = {
    "SecureAggregation": [
        "GossipAveraging",
        "ClusteredFL",
        "FreeRiderDetector",
        "SimilarityClusteredSampler",
    ],  # and the robust aggregators (the matrix test trains those pairs)
    "silos": ["Pooled", "StreamingDataModule"],
    "GossipAveraging": [*PARTIAL, "Unlearning", "FreeRiders", "ServerReference"],
    "ClusteredFL": [
        *PARTIAL,
        "Unlearning",
        "FreeRiders",
        "ServerReference",
        "2 processes",
        "FedEM",
        "Ditto",
        "APFL",
        "FedRep",
        "PFedMe",
        "FineTune",
    ],
    "AsynchronousFL": [*PARTIAL, "Unlearning", "FreeRiders"],
    "FreeRiders": [*PARTIAL, "Unlearning", "Local", "SAFARI"],
    "Unlearning": [
        "FedAvgM",
        "FedAdam",
        "FedYogi",
        "FedAdagrad",
        "SCAFFOLD",
        "SAFARI",
        "Pooled",
        "Local",
        "FixedClustersSampler",
    ],
    "FedRep": ["SCAFFOLD", "FedEM", "Ditto", "APFL", "PFedMe", "FineTune"],
    "FedEM": ["Ditto", "APFL", "PFedMe", "FineTune"],
    "Ditto": ["APFL", "PFedMe", "FineTune"],
    "APFL": ["PFedMe", "FineTune"],
    "PFedMe": ["FineTune", "DPSGD"],
    "FreeRiderDetector": ["2 processes"],
    "SAFARI": ["StreamingDataModule", "ReferenceDataModule"],
    "ServerReference": ["Local", "StreamingDataModule"],
}
#: Plugins refused with nothing above, beside which every plugin of the table composes.
COMPOSE_WITH_ALL = ["FedAvg", "FedProx", "FullParticipation", "SampleSizeClusteredSampler",
                    "KNNPer", "vectorize"]  # fmt: skip


def test_the_refused_pairs_are_exactly_those_written_by_hand(monkeypatch):
    """Every unordered pair of the plugins named above, run through :func:`check`: refused
    exactly when the hand-written table lists it, in either order."""
    refused = {frozenset((a, b)) for a, others in REFUSED_BY_HAND.items() for b in others}
    plugins = sorted({name for pair in refused for name in pair} | set(COMPOSE_WITH_ALL))
    for i, first in enumerate(plugins):
        for second in plugins[i + 1 :]:
            names = {first: first, second: second}
            monkeypatch.setattr(composition, "plugin_names", lambda *args, names=names: names)
            try:
                check(_trainer(), FullParticipation())
                was_refused = False
            except CompositionError as error:
                was_refused = True
                assert {first, second} <= set(
                    str(error).split(": ")[0].split(" cannot be combined with ")
                )
            assert was_refused == (frozenset((first, second)) in refused), (first, second)
