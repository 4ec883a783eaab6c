"""Which plugins compose (docs/architecture.md, "Plugins compose").

A run is made of plugins: a sampler (and the wrappers around it), federated callbacks
(the aggregator, personalization, privacy, robustness), the module, the datamodule, and
how it executes (vectorized clients, several processes). Every combination either keeps
its invariants or is refused at setup, before any training, by :func:`check` with a
:class:`CompositionError` that names both plugins, the reason and the fix.

Two kinds of rule refuse a pair. :data:`TRAIT_RULES` read what plugins declare
(:meth:`~lightning_fl.engine.plugins.FederatedCallback.add_trait`) and the traits of the
ways a run executes (:data:`WAY_TRAITS`), so that a new plugin is checked by what it
declares; the older table :data:`REFUSALS` names classes, one row per reason. The README's
composition matrix is printed from it (``python -m lightning_fl.engine.composition``), and the
matrix test (tests/test_composition.py) trains every pair of plugins and checks that
exactly the pairs of this table, and the vectorization refusals of
:mod:`lightning_fl.engine.vectorized`, are refused.

Plugins are matched by class name along the MRO, so a subclass of a plugin is refused
where its base is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from lightning_fl.engine.plugins import Trait
from lightning_fl.systems.samplers import ClientSampler, SamplerWrapper

#: The names the table gives the ways a run executes, beside the plugins' class names.
WAYS_OF_RUNNING = ("vectorize", "2 processes", "silos")


class CompositionError(ValueError):
    """Two plugins that cannot work together, refused at setup before any training."""


@dataclass(frozen=True)
class TraitRule:
    """A plugin with trait ``first`` is refused with any plugin, or way of running, with
    trait ``second``: ``reason``; the fix is the plugin's own (declared with the trait),
    else ``fix``."""

    first: str
    second: str
    reason: str
    fix: str


#: The traits of the ways a run executes (:data:`WAYS_OF_RUNNING`).
WAY_TRAITS: dict[str, tuple[str, ...]] = {"silos": (Trait.AGGREGATES_ON_EVERY_SITE,)}

TRAIT_RULES: tuple[TraitRule, ...] = (
    TraitRule(
        Trait.DRAWS_SERVER_RANDOMNESS,
        Trait.AGGREGATES_ON_EVERY_SITE,
        "every site would hold the round's sum before the server's noise is added, and a "
        "noise drawn from the recipe's seed can be drawn again, and subtracted, by any "
        "site that has the recipe",
        "add the noise on the sites, before the sum",
    ),
)


#: Samplers that leave clients out of a round (every sampler but FullParticipation).
PARTIAL_SAMPLERS = (
    "UniformSampler",
    "PoissonSampler",
    "MDSampler",
    "ClusteredSampler",
    "AvailableClients",
    "ExcludedClients",
)
#: Aggregators that step by a robust statistic of the round's updates, not their sum.
ROBUST = ("CoordinateMedian", "TrimmedMean", "Krum", "CenteredClipping")
#: Samplers whose rounds have a random number of distinct clients.
RANDOM_SIZE_SAMPLERS = ("MDSampler", "PoissonSampler", "ClusteredSampler", "AvailableClients")
#: Callbacks that decide which model a client is evaluated with (its personalized model).
PERSONAL_MODELS = ("FedEM", "Ditto", "APFL", "FedRep", "PFedMe", "FineTune", "ClusteredFL")
#: Aggregators whose server step is not FedAvg's θ + η_g Σ ω_i Δ_i.
NON_FEDAVG = (
    "FedAvgM",
    "FedAdam",
    "FedYogi",
    "FedAdagrad",
    "SCAFFOLD",
    "AsynchronousFL",
    "GossipAveraging",
    "SAFARI",
    "Pooled",
    "Local",
    "ClusteredFL",
    "DPFedAvg",
    *ROBUST,
)
#: Aggregators that never read the round's update sum Σ_i ω_i Δ_i, where the strategy and
#: other callbacks put what they add to a round (a free-rider's update, the server's WERM
#: step): gossip mixes the clients' trained models, local training never aggregates, and
#: clustered FL averages each cluster's own client updates.
WITHOUT_UPDATE_SUM = ("GossipAveraging", "Local", "ClusteredFL")


@dataclass(frozen=True)
class Refusal:
    """``first`` is refused with any plugin of ``second``: ``reason``; ``fix``."""

    first: str
    second: tuple[str, ...]
    reason: str
    fix: str


#: Plugins that read each client's update (or model) on every rank, which
#: SecureAggregation exists to hide.
READ_EACH_UPDATE = (*ROBUST, "SimilarityClusteredSampler", "GossipAveraging", "ClusteredFL",
                    "FreeRiderDetector")  # fmt: skip

REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "SecureAggregation",
        READ_EACH_UPDATE,
        "it reads each client's update or model, which secure aggregation hides: the "
        "round's sum would carry them one by one, or they would cross unmasked",
        "drop SecureAggregation (and say what crosses the network), or aggregate with "
        "FedAvg, a server optimizer or DPFedAvg",
    ),
    Refusal(
        "DPFedAvg",
        ("MDSampler", "ClusteredSampler", "AvailableClients", "ExcludedClients"),
        "DP-FedAvg's noise and ε need one known inclusion probability q per client and "
        "round (McMahan et al. 2018, Alg. 1), which this sampler does not have",
        "use UniformSampler, PoissonSampler or FullParticipation",
    ),
    Refusal(
        "DPFedAvg",
        ("FreeRiders", "ServerReference"),
        "it adds updates to the round's sum that are neither clipped nor counted by the "
        "sensitivity bound, and rescales the clients' weights",
        "drop it, or aggregate with FedAvg",
    ),
    Refusal(
        "Krum",
        RANDOM_SIZE_SAMPLERS,
        "this sampler's rounds have a random number of distinct clients, which may fall to "
        "2f + 2 or fewer, where Krum is undefined (Blanchard et al. 2017, Prop. 1)",
        "use FullParticipation or UniformSampler with clients_per_round > 2f + 2",
    ),
    *(
        Refusal(
            robust,
            ("FreeRiders", "ServerReference"),
            "it adds to the round's update sum, which a robust aggregator does not read "
            "(it reads each client's update)",
            "aggregate with FedAvg or a server optimizer",
        )
        for robust in ROBUST
    ),
    Refusal(
        "silos",
        ("Pooled", "StreamingDataModule"),
        "silo mode keeps each client's data in its own process: the pooled baseline trains on "
        "every client's data in one process, and a stream's schedule is decided over every "
        "client's arrival window",
        "set silos=False for this run",
    ),
    Refusal(
        "GossipAveraging",
        (*PARTIAL_SAMPLERS, "Unlearning"),
        "gossip mixes every client's model with its neighbours' in every round, over a "
        "mixing matrix of all clients",
        "use the default FullParticipation sampler",
    ),
    Refusal(
        "ClusteredFL",
        (*PARTIAL_SAMPLERS, "Unlearning"),
        "a split compares the updates of every client of a cluster in the same round, and "
        "the cluster models keep what removed clients contributed",
        "use the default FullParticipation sampler, without Unlearning",
    ),
    Refusal(
        "AsynchronousFL",
        (*PARTIAL_SAMPLERS, "Unlearning"),
        "the simulated clock chooses who returns in each aggregation",
        "drop the sampler (FullParticipation, the default), without Unlearning",
    ),
    Refusal(
        "FreeRiders",
        (*PARTIAL_SAMPLERS, "Unlearning"),
        "the attack and its detector follow the paper's full participation of a fixed federation",
        "use the default FullParticipation sampler, without Unlearning",
    ),
    Refusal(
        "FreeRiders",
        WITHOUT_UPDATE_SUM,
        "the free-riders' updates and the fair clients' rescaled weights go into the round's "
        "update sum, which this aggregator never reads: the attack would silently do nothing",
        "aggregate with FedAvg or a server optimizer (the thesis's FedAvg and FedProx)",
    ),
    Refusal(
        "FreeRiders",
        ("AsynchronousFL",),
        "the free-riders add their update to every aggregation, while each fair client "
        "returns only now and then, so their share is no longer the declared one (the "
        "thesis's attack is on synchronous rounds)",
        "use synchronous rounds: FedAvg or a server optimizer",
    ),
    Refusal(
        "FreeRiders",
        ("SAFARI",),
        "SAFARI's server rounds have no clients, yet the free-riders would add their update "
        "to them and rescale the server's SGD step by the fair clients' share",
        "attack FedAvg or a server optimizer, or run SAFARI without FreeRiders",
    ),
    Refusal(
        "Unlearning",
        NON_FEDAVG,
        "SIFU's sensitivity bound (thesis eq. 5.8, Thm 5.1) is for FedAvg's server step "
        "θ + η_g Σ ω_i Δ_i; server state (momentum, control variates, clusters, a clock, "
        "server rounds) would keep what a removed client contributed",
        "aggregate with FedAvg",
    ),
    Refusal(
        "Unlearning",
        ("FixedClustersSampler",),
        "removing clients changes the target weights, and fixed clusters are unbiased only "
        "at the weights they were built for",
        "use SampleSizeClusteredSampler, which rebuilds its clusters from the weights",
    ),
    Refusal(
        "FedRep",
        ("SCAFFOLD",),
        "FedRep freezes the head during the body's steps, and SCAFFOLD corrects the "
        "gradient of every parameter",
        "use FedRep with FedAvg, or SCAFFOLD without FedRep",
    ),
    *(
        Refusal(
            first,
            PERSONAL_MODELS[i + 1 :],
            "each decides the personalized model a client is evaluated with",
            f"keep one of them ({first} or the other)",
        )
        for i, first in enumerate(PERSONAL_MODELS[:-1])
    ),
    Refusal(
        "DPSGD",
        ("PFedMe",),
        "pFedMe's local step uses the personalized model θ̂ found with non-private "
        "gradients of the batch, so the update a client sends would not be private",
        "use DP-SGD with FedAvg, FedProx, SCAFFOLD, Ditto, APFL or FedRep",
    ),
    Refusal(
        "ClusteredFL",
        ("2 processes",),
        "a split compares every client's update of the round in one place",
        "use devices=1",
    ),
    Refusal(
        "FreeRiderDetector",
        ("2 processes",),
        "the detector compares every client's update of the round in one place",
        "use devices=1",
    ),
    Refusal(
        "SAFARI",
        ("StreamingDataModule", "ReferenceDataModule"),
        "the server's own training data comes from the datamodule's server_dataset(), "
        "which this datamodule does not provide",
        "use a datamodule with server data (DigitsDataModule(server_samples=...))",
    ),
    Refusal(
        "ServerReference",
        WITHOUT_UPDATE_SUM,
        "the server's steps go into the round's update sum, which this aggregator never "
        "reads: gossip mixes the clients' trained models, local training never aggregates, "
        "and clustered FL averages each cluster's client updates",
        "aggregate with FedAvg or a server optimizer, or drop ServerReference",
    ),
    Refusal(
        "ServerReference",
        ("StreamingDataModule",),
        "the server's reference data comes from ReferenceDataModule(reference='server')",
        "use a ReferenceDataModule with reference='server'",
    ),
)


def sampler_chain(sampler: ClientSampler) -> list[ClientSampler]:
    """``sampler`` and the samplers it wraps, outermost first."""
    chain = [sampler]
    while isinstance(chain[-1], SamplerWrapper):
        chain.append(chain[-1].sampler)
    return chain


def plugin_names(
    trainer: pl.Trainer,
    sampler: ClientSampler,
    vectorize: bool,
    world_size: int,
    silos: bool = False,
) -> dict[str, str]:
    """Every class name (along the MRO) of the run's plugins (the Trainer's callbacks,
    datamodule and module, and ``sampler`` with the samplers it wraps), mapped to the name
    of the plugin that carries it (the class a user wrote), and the ways the run executes
    (``vectorize``, ``world_size`` processes)."""
    # internal wrappers (unlearning's) are not shown
    chain = [s for s in sampler_chain(sampler) if not type(s).__name__.startswith("_")]
    sampler_name = "(".join(type(s).__name__ for s in chain) + ")" * (len(chain) - 1)
    objects: list[tuple[Any, str]] = [(s, sampler_name) for s in chain]
    objects += [
        (obj, type(obj).__name__)
        for obj in [*trainer.callbacks, trainer.datamodule, trainer.lightning_module]
        if obj is not None
    ]
    names: dict[str, str] = {}
    for obj, shown in objects:
        for cls in type(obj).__mro__:
            if cls.__module__.split(".")[0] not in ("builtins", "torch", "lightning"):
                names.setdefault(cls.__name__, shown)
    shown = ("FederatedStrategy(vectorize=True)", f"{world_size} processes",
             "FederatedStrategy(silos=True)")  # fmt: skip
    for way, shown_as, used in zip(WAYS_OF_RUNNING, shown, (vectorize, world_size > 1, silos)):
        if used:
            names[way] = shown_as
    return names


def check(
    trainer: pl.Trainer,
    sampler: ClientSampler,
    vectorize: bool = False,
    world_size: int = 1,
    silos: bool = False,
) -> None:
    """Refuse the run's first incompatible pair of plugins (see :data:`REFUSALS`) and
    callbacks or samplers whose needs the module does not meet."""
    names = plugin_names(trainer, sampler, vectorize, world_size, silos)
    check_traits(declared_traits(trainer, sampler, names))
    for rule in REFUSALS:
        if rule.first not in names:
            continue
        for other in rule.second:
            if other in names and names[other] != names[rule.first]:
                raise CompositionError(
                    f"{names[rule.first]} cannot be combined with {names[other]}: "
                    f"{rule.reason}. Fix: {rule.fix}."
                )
    module = trainer.lightning_module
    for plugin in [*trainer.callbacks, sampler]:
        missing = [need for need in module_needs(plugin) if not hasattr(module, method_of(need))]
        if missing:
            methods = "that method" if len(missing) == 1 else "those methods"
            if any(cls.__name__ == "FederatedTask" for cls in type(module).__mro__):
                fix = (f"add {methods} to {type(module).__name__} (FederatedTask leaves "
                       "them to its subclasses; Classifier has them)")  # fmt: skip
            else:
                fix = ("subclass lightning_fl.FederatedTask (Classifier, BinaryClassifier, "
                       f"...) or add {methods}")  # fmt: skip
            raise CompositionError(
                f"{type(plugin).__name__} cannot be combined with {type(module).__name__}: "
                f"besides training_step it calls {' and '.join(missing)} on the module, "
                f"which {type(module).__name__} lacks. Fix: {fix} (README, 'Your own module')."
            )


def declared_traits(
    trainer: pl.Trainer, sampler: ClientSampler, names: dict[str, str]
) -> dict[str, dict[str, str]]:
    """What each of the run's plugins declares (by the name a user wrote: its traits and
    their fixes), and the traits of the ways the run executes (from ``names``, see
    :func:`plugin_names`)."""
    declared: dict[str, dict[str, str]] = {}
    for plugin in [*trainer.callbacks, *sampler_chain(sampler)]:
        traits = getattr(plugin, "declared_traits", dict)()
        if traits:
            declared.setdefault(type(plugin).__name__, {}).update(traits)
    for way, traits in WAY_TRAITS.items():
        if way in names:
            declared.setdefault(names[way], {}).update(dict.fromkeys(traits, ""))
    return declared


def check_traits(declared: dict[str, dict[str, str]]) -> None:
    """Refuse the first pair of plugins (or a plugin and a way of running) that a rule of
    :data:`TRAIT_RULES` refuses, naming both, the trait, the reason and the fix."""
    for rule in TRAIT_RULES:
        for first, traits in declared.items():
            if rule.first not in traits:
                continue
            for second, others in declared.items():
                if second != first and rule.second in others:
                    fix = traits[rule.first] or rule.fix
                    raise CompositionError(
                        f"{first} cannot be combined with {second}: {first} "
                        f"{rule.first} and {second} {rule.second}; {rule.reason}. Fix: {fix}."
                    )


#: What a plugin that computes the loss outside ``training_step`` calls (personalization,
#: evaluation on training data, loss-based samplers): :class:`~lightning_fl.FederatedTask`'s.
LOSS_AND_METRICS = "loss_and_metrics(batch) -> (loss, {name: value})"


def module_needs(plugin: object) -> list[str]:
    """The methods ``plugin`` (a callback or sampler, or its class) calls on the module
    besides Lightning's hooks, as signatures: ``loss_and_metrics`` when it computes the
    loss outside ``training_step`` (``requires_task_loss``, a sampler's ``needs_losses``),
    then its own ``module_methods``."""
    needs = []
    if getattr(plugin, "requires_task_loss", False) or getattr(plugin, "needs_losses", False):
        needs.append(LOSS_AND_METRICS)
    return [*needs, *getattr(plugin, "module_methods", ())]


def method_of(signature: str) -> str:
    """``criterion`` of ``"criterion(logits, target) -> loss"``."""
    return signature.split("(")[0].strip()


def refusal_table() -> str:
    """The README's table of refused pairs: one row per rule of :data:`REFUSALS`."""
    rows = ["| plugin | refused with | why | fix |", "|---|---|---|---|"]
    for trait_rule in TRAIT_RULES:
        rows.append(f"| every plugin that {trait_rule.first} | every plugin or way of running "
                    f"that {trait_rule.second} | {trait_rule.reason} | the plugin's own, else: "
                    f"{trait_rule.fix} |")  # fmt: skip
    for rule in REFUSALS:
        rows.append(f"| {rule.first} | {', '.join(rule.second)} | {rule.reason} | {rule.fix} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(refusal_table())
