"""The composition rules in process (``lightning_fl/engine/composition.py``): what each
plugin declares (its traits, against a list written by hand), every rule's refusal message,
and the refused pairs of the matrix's plugins (against a second list written by hand), on
stand-in trainers with the matrix's real plugins. tests/test_composition.py trains the
pairs; these run in seconds, so the mutation runner (issue 39) can measure the rules."""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fl import FullParticipation, UniformSampler
from lightning_fl.callbacks import DPFedAvg, FedEM, FedProx, FedRep, GossipAveraging
from lightning_fl.engine.composition import (
    LOSS_AND_METRICS,
    TRAIT_RULES,
    CompositionError,
    check,
    declared_traits,
    module_needs,
    named_plugins,
    ways_of_running,
)
from lightning_fl.engine.plugins import FederatedCallback
from lightning_fl.engine.traits import Trait, traits_of, traits_of_class
from lightning_fl.systems.samplers import (
    ClientSampler,
    ExcludedClients,
    SamplerWrapper,
    SimilarityClusteredSampler,
)
from tests import composition as matrix


def _trainer(*callbacks, module=None, datamodule=None):
    return SimpleNamespace(callbacks=list(callbacks), datamodule=datamodule,
                           lightning_module=module or object())  # fmt: skip


class MyFedEM(FedEM):
    """A user's subclass: refused where FedEM is, and named as the user wrote it."""


class _Internal(SamplerWrapper):
    """An internal wrapper (a leading underscore, as unlearning's): not shown."""


def test_plugins_are_named_as_a_user_wrote_them_and_ways_of_running_as_chosen():
    sampler = _Internal(ExcludedClients(UniformSampler(2), 0))
    fedem, checkpoint, prox = MyFedEM(), ModelCheckpoint(), FedProx(0.1)
    named = named_plugins(_trainer(fedem, checkpoint, prox), sampler)
    shown = "ExcludedClients(UniformSampler)"
    assert [name for _, name in named] == [shown, shown, "MyFedEM", "ModelCheckpoint",
                                           "FedProx", "object"]  # fmt: skip
    assert named[0][0] is sampler.sampler and named[2][0] is fedem
    three = ExcludedClients(ExcludedClients(UniformSampler(2), 0), 1)
    assert named_plugins(_trainer(), three)[0][1] == (
        "ExcludedClients(ExcludedClients(UniformSampler))"
    )
    assert ways_of_running(True, 3, True) == {
        "vectorize": "FederatedStrategy(vectorize=True)",
        "2 processes": "3 processes",
        "silos": "FederatedStrategy(silos=True)",
    }
    assert ways_of_running(False, 1, False) == {}
    assert ways_of_running(False, 2, False) == {"2 processes": "2 processes"}


# ---- what each plugin declares, written by hand -----------------------------------------

T = Trait
PARTIAL = matrix.PARTIAL
TRAITS_BY_HAND = matrix.TRAITS_BY_HAND


@cache
def _run_parts(names: tuple[str, ...]):
    """The stand-in trainer and sampler of the matrix's set-up of ``names``."""
    setup = matrix.build(names)
    trainer = _trainer(*setup.callbacks, module=setup.module(), datamodule=setup.datamodule())
    return trainer, setup.sampler or FullParticipation()


def test_each_matrix_plugin_declares_the_traits_written_by_hand():
    assert set(TRAITS_BY_HAND) == {p.name for p in matrix.PLUGINS}
    for name, expected in TRAITS_BY_HAND.items():
        declared = declared_traits(named_plugins(*_run_parts((name,))), {})
        assert set().union(*declared.values()) == expected, name


def test_traits_are_inherited_withdrawn_with_none_and_derived_from_the_update_flags():
    class Partial(ClientSampler):
        pass

    class Whole(Partial):
        traits = {T.LEAVES_CLIENTS_OUT: None, T.UNKNOWN_INCLUSION_PROBABILITY: None}

    assert set(traits_of_class(Partial)) == PARTIAL
    assert set(traits_of_class(Whole)) == {T.DRAWS_A_RANDOM_NUMBER_OF_CLIENTS}
    assert traits_of_class(SamplerWrapper) == {}  # its property needs_updates is no value
    inner = SimilarityClusteredSampler(2)
    assert T.READS_EACH_UPDATE in traits_of(ExcludedClients(inner, [0]))  # the instance's
    assert T.READS_EACH_UPDATE not in traits_of(ExcludedClients(UniformSampler(2), [0]))
    # a wrapper that leaves clients out says so itself, whatever it wraps
    with pytest.raises(CompositionError, match=r"ExcludedClients\(FullParticipation\) leaves"):
        check(_trainer(GossipAveraging("complete")), ExcludedClients(FullParticipation(), [1]))
    check(_trainer(GossipAveraging("complete")), FullParticipation())
    assert traits_of(SimpleNamespace(needs_client_updates=True)) == {T.READS_EACH_UPDATE: ""}
    assert traits_of(object()) == {}


@pytest.mark.parametrize(
    ("settings", "draws"),
    [
        ({"noise": "central"}, True),
        ({"noise": "central", "noise_multiplier": 0.0}, False),
        ({"noise": "local"}, False),
        ({"noise": "local", "target_quantile": 0.5}, True),  # the server's count noise
        ({"noise": "distributed"}, False),
        ({"noise": "distributed", "target_quantile": 0.5}, False),  # count shares on sites
    ],
)
def test_dp_fedavg_draws_server_randomness_only_where_its_server_draws_noise(settings, draws):
    dp = DPFedAvg(**{"noise_multiplier": 1.0, **settings})
    assert (T.DRAWS_SERVER_RANDOMNESS in dp.declared_traits()) == draws
    assert T.BOUNDS_THE_SUMS_SENSITIVITY in dp.declared_traits()


# ---- each rule's message ----------------------------------------------------------------


def _declaring(name: str, traits: dict[str, str]) -> FederatedCallback:
    return type(name, (FederatedCallback,), {"traits": traits})()


@pytest.mark.parametrize("rule", TRAIT_RULES, ids=lambda rule: rule.first)
def test_every_rule_refuses_its_traits_naming_both_plugins_and_the_fix(rule):
    """Stand-ins that declare only the rule's traits, in either order: the plugin with
    the first trait answers, with its own fix, else the rule's (a rule between plugins of
    one trait: the first in the Trainer's order)."""
    for own_fix, fix in (("keep MyA alone", "keep MyA alone"), ("", rule.fix)):
        first = _declaring("MyA", {rule.first: own_fix})
        second = _declaring("TheirB", {rule.second: ""})
        symmetric = rule.first == rule.second  # then the first listed answers
        for callbacks in ((first, second),) if symmetric else ((first, second), (second, first)):
            with pytest.raises(CompositionError) as refused:
                check(_trainer(*callbacks), FullParticipation())
            assert str(refused.value) == (
                f"MyA cannot be combined with TheirB: MyA {rule.first} and TheirB "
                f"{rule.second}; {rule.reason}. Fix: {fix}."
            )
    if rule.first != rule.second:  # one plugin with both traits is not a pair
        check(_trainer(_declaring("Both", {rule.first: "", rule.second: ""})), FullParticipation())


def test_the_first_rule_answers_and_ways_of_running_are_refused_by_their_traits():
    """Unlearning beside gossip is refused by full participation (the earlier rule), not
    by FedAvg's server step; silo mode and 2 processes by their traits."""
    with pytest.raises(CompositionError, match=r"^GossipAveraging cannot be combined with "
                       r"Unlearning: GossipAveraging needs every client"):  # fmt: skip
        check(*_run_parts(("GossipAveraging", "Unlearning")))
    trainer, sampler = _run_parts(("Pooled",))
    with pytest.raises(CompositionError) as refused:
        check(trainer, sampler, world_size=2, silos=True)
    assert str(refused.value).startswith(
        "FederatedStrategy(silos=True) cannot be combined with Pooled: "
        "FederatedStrategy(silos=True) keeps each client's data on its own site and Pooled "
        "needs every client's data in one process"
    )
    check(trainer, sampler, world_size=2)  # pooled on 2 processes of one machine: fine
    trainer, sampler = _run_parts(("ClusteredFL",))
    with pytest.raises(CompositionError, match=r"^ClusteredFL cannot be combined with 3 "
                       r"processes: .*Fix: use devices=1\.$"):  # fmt: skip
        check(trainer, sampler, world_size=3)
    trainer, sampler = _run_parts(("DPFedAvg",))
    with pytest.raises(CompositionError, match=r"Fix: DPFedAvg\(noise='distributed'\)"):
        check(trainer, sampler, world_size=2, silos=True)
    check(trainer, sampler, world_size=2)


def test_a_users_own_sampler_is_refused_until_it_withdraws_the_traits():
    """A sampler of the user's own is assumed to leave clients out: refused beside gossip
    at set-up, naming the trait; once it declares full participation, it composes."""

    class FirstThree(ClientSampler):
        def _draw(self, p, gen):
            return {i: float(p[i]) for i in range(3)}

    with pytest.raises(CompositionError, match=r"^GossipAveraging cannot be combined with "
                       r"FirstThree: .* FirstThree leaves clients out"):  # fmt: skip
        check(_trainer(GossipAveraging("complete")), FirstThree())

    class EveryClient(FirstThree):
        traits = {T.LEAVES_CLIENTS_OUT: None, T.DRAWS_A_RANDOM_NUMBER_OF_CLIENTS: None}

    check(_trainer(GossipAveraging("complete")), EveryClient())


def test_a_users_subclass_is_refused_where_its_base_is_and_named_as_written():
    with pytest.raises(CompositionError, match=r"^MyFedEM cannot be combined with FedRep: "):
        check(_trainer(MyFedEM(), FedRep()), FullParticipation())


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


def test_the_refusal_table_has_one_row_per_rule_naming_who_declares_each_trait():
    from lightning_fl.callbacks.catalog import refusal_table

    table = refusal_table().splitlines()
    assert table[:2] == ["| plugins that … | refused with plugins that … | why | fix |",
                         "|---|---|---|---|"]  # fmt: skip
    assert len(table) == 2 + len(TRAIT_RULES)
    assert table[2].startswith(
        "| draws server-side randomness: DPFedAvg | aggregates the round's sum on every "
        "site: silos | every site would hold"
    )
    assert table[3].startswith(
        "| hides each client's update inside the round's sum: SecureAggregation | reads "
        "each client's update or model: CenteredClipping, ClusteredFL, CoordinateMedian, "
        "FreeRiderDetector, GossipAveraging, Krum, TrimmedMean, SimilarityClusteredSampler |"
    )


#: The refused pairs of the matrix's plugins, written out from the table that named
#: classes before the traits (commit 9ce0a73), so that a trait or a rule lost or added
#: fails here in seconds (the matrix test in test_composition trains them).
REFUSED_BY_HAND = {
    "UniformSampler": ["AsynchronousFL", "GossipAveraging", "ClusteredFL", "FreeRiders",
                       "FreeRiderDetector"],
    "MDSampler": ["AsynchronousFL", "GossipAveraging", "DPFedAvg", "Krum", "ClusteredFL",
                  "FreeRiders", "FreeRiderDetector"],
    "SampleSizeClusteredSampler": ["AsynchronousFL", "GossipAveraging", "DPFedAvg", "Krum",
                                   "ClusteredFL", "FreeRiders", "FreeRiderDetector"],
    "SimilarityClusteredSampler": ["AsynchronousFL", "GossipAveraging", "DPFedAvg", "Krum",
                                   "ClusteredFL", "FreeRiders", "FreeRiderDetector",
                                   "SecureAggregation"],
    "FixedClustersSampler": ["AsynchronousFL", "GossipAveraging", "DPFedAvg", "Krum",
                             "ClusteredFL", "Unlearning", "FreeRiders", "FreeRiderDetector"],
    "AvailableClients(ca_fed)": ["AsynchronousFL", "GossipAveraging", "DPFedAvg", "Krum",
                                 "ClusteredFL", "FreeRiders", "FreeRiderDetector"],
    "ExcludedClients": ["AsynchronousFL", "GossipAveraging", "DPFedAvg", "ClusteredFL",
                        "FreeRiders", "FreeRiderDetector"],
    "PoissonSampler": ["AsynchronousFL", "GossipAveraging", "Krum", "ClusteredFL",
                       "FreeRiders", "FreeRiderDetector"],
    "FedAvgM": ["Unlearning"],
    "FedAdam": ["Unlearning"],
    "FedYogi": ["Unlearning"],
    "FedAdagrad": ["Unlearning"],
    "SCAFFOLD": ["FedRep", "Unlearning"],
    "AsynchronousFL": ["Unlearning", "FreeRiders", "FreeRiderDetector"],
    "GossipAveraging": ["ServerReference", "Unlearning", "FreeRiders", "FreeRiderDetector",
                        "SecureAggregation"],
    "SAFARI": ["ServerReference", "Unlearning", "FreeRiders", "FreeRiderDetector",
               "StreamingDataModule"],
    "Pooled": ["Unlearning"],
    "Local": ["ServerReference", "Unlearning", "FreeRiders", "FreeRiderDetector"],
    "DPFedAvg": ["ServerReference", "Unlearning", "FreeRiders", "FreeRiderDetector"],
    "CoordinateMedian": ["ServerReference", "Unlearning", "FreeRiders", "FreeRiderDetector",
                         "SecureAggregation"],
    "TrimmedMean": ["ServerReference", "Unlearning", "FreeRiders", "FreeRiderDetector",
                    "SecureAggregation"],
    "Krum": ["ServerReference", "Unlearning", "FreeRiders", "FreeRiderDetector",
             "SecureAggregation"],
    "CenteredClipping": ["ServerReference", "Unlearning", "FreeRiders", "FreeRiderDetector",
                         "SecureAggregation"],
    "FedEM": ["Ditto", "APFL", "FedRep", "PFedMe", "ClusteredFL", "FineTune"],
    "Ditto": ["APFL", "FedRep", "PFedMe", "ClusteredFL", "FineTune"],
    "APFL": ["FedRep", "PFedMe", "ClusteredFL", "FineTune"],
    "FedRep": ["PFedMe", "ClusteredFL", "FineTune"],
    "PFedMe": ["ClusteredFL", "FineTune", "DPSGD"],
    "ClusteredFL": ["FineTune", "ServerReference", "Unlearning", "FreeRiders",
                    "FreeRiderDetector", "SecureAggregation"],
    "ServerReference": ["StreamingDataModule"],
    "Unlearning": ["FreeRiders", "FreeRiderDetector"],
    "FreeRiderDetector": ["SecureAggregation"],
}  # fmt: skip


def test_the_refused_pairs_are_exactly_those_written_by_hand():
    """Every pair of the matrix (two samplers aside), built with its real plugins and run
    through :func:`check`: refused by a rule exactly when the hand-written list names it,
    in either order, naming both plugins; 133 pairs."""
    refused = {frozenset((a, b)) for a, others in REFUSED_BY_HAND.items() for b in others}
    assert len(refused) == 133
    for a, b in matrix.pairs():
        try:
            check(*_run_parts((a, b)))
            message = None
        except CompositionError as error:
            message = str(error)
        by_a_rule = message is not None and "besides training_step" not in message
        assert by_a_rule == (frozenset((a, b)) in refused), (a, b, message)
        if by_a_rule:
            assert matrix.names_plugin(message, a) and matrix.names_plugin(message, b), message
