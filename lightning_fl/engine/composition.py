"""Which plugins compose (docs/architecture.md, "Plugins compose").

A run is made of plugins: a sampler (and the wrappers around it), federated callbacks
(the aggregator, personalization, privacy, robustness), the module, the datamodule, and
how it executes (vectorized clients, several processes, silos). Every combination either
keeps its invariants or is refused at setup, before any training, by :func:`check` with a
:class:`CompositionError` that names both plugins, the reason and the fix.

The rules read what plugins declare, never their class names: each plugin declares its
traits (:mod:`lightning_fl.engine.traits`), the ways a run executes have traits too
(:data:`WAY_TRAITS`), and a rule of :data:`TRAIT_RULES` refuses any plugin with one trait
beside any plugin, or way of running, with another. A new plugin is checked by what it
declares. The README's table is printed from the rules and the package's declarations
(``python -m lightning_fl.callbacks.catalog refusals``), and the matrix test
(tests/test_composition.py) trains every pair of plugins and checks that exactly the pairs
these rules predict from a hand-written list of each plugin's traits, and the
vectorization refusals of :mod:`lightning_fl.engine.vectorized`, are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import lightning.pytorch as pl

from lightning_fl.engine.traits import Trait, traits_of, traits_of_class
from lightning_fl.systems.samplers import ClientSampler, SamplerWrapper

#: The names the table gives the ways a run executes, beside the plugins' class names.
WAYS_OF_RUNNING = ("vectorize", "2 processes", "silos")


class CompositionError(ValueError):
    """Two plugins that cannot work together, refused at setup before any training."""


@dataclass(frozen=True)
class TraitRule:
    """A plugin with trait ``first`` is refused with any other plugin, or way of running,
    with trait ``second``: ``reason``. The fix is the one the first plugin declared with
    its trait, else ``fix``."""

    first: str
    second: str
    reason: str
    fix: str


#: The traits of the ways a run executes (:data:`WAYS_OF_RUNNING`).
WAY_TRAITS: dict[str, tuple[str, ...]] = {
    "2 processes": (Trait.SPLITS_CLIENTS_OVER_PROCESSES,),
    "silos": (Trait.AGGREGATES_ON_EVERY_SITE, Trait.KEEPS_DATA_ON_ITS_SITE),
}

#: The composition rules, in the order they are checked (the first that refuses a pair
#: answers).
TRAIT_RULES: tuple[TraitRule, ...] = (
    TraitRule(
        Trait.DRAWS_SERVER_RANDOMNESS,
        Trait.AGGREGATES_ON_EVERY_SITE,
        "every site would hold the round's sum before the server's noise is added, and a "
        "noise drawn from the recipe's seed can be drawn again, and subtracted, by any "
        "site that has the recipe",
        "add the noise on the sites, before the sum",
    ),
    TraitRule(
        Trait.HIDES_EACH_UPDATE,
        Trait.READS_EACH_UPDATE,
        "the round's sum would carry each client's update one by one, or the updates would "
        "cross unmasked",
        "drop SecureAggregation (and say what crosses the network), or aggregate with "
        "FedAvg, a server optimizer or DPFedAvg",
    ),
    TraitRule(
        Trait.NEEDS_INCLUSION_PROBABILITY,
        Trait.UNKNOWN_INCLUSION_PROBABILITY,
        "DP-FedAvg's noise and ε need one known inclusion probability q per client and "
        "round (McMahan et al. 2018, Alg. 1)",
        "use UniformSampler, PoissonSampler or FullParticipation",
    ),
    TraitRule(
        Trait.BOUNDS_THE_SUMS_SENSITIVITY,
        Trait.ADDS_TO_THE_UPDATE_SUM,
        "the updates it adds are neither clipped nor counted by the sensitivity bound, and "
        "it rescales the clients' weights",
        "drop the plugin that adds updates, or aggregate with FedAvg",
    ),
    TraitRule(
        Trait.NEEDS_MORE_THAN_2F_PLUS_2_CLIENTS,
        Trait.DRAWS_A_RANDOM_NUMBER_OF_CLIENTS,
        "a round may fall to 2f + 2 clients or fewer, where Krum is undefined (Blanchard "
        "et al. 2017, Prop. 1)",
        "use FullParticipation or UniformSampler with clients_per_round > 2f + 2",
    ),
    TraitRule(
        Trait.ADDS_TO_THE_UPDATE_SUM,
        Trait.IGNORES_THE_UPDATE_SUM,
        "what it adds (a free-rider's update, the server's step) would never be read: the "
        "aggregator steps by each client's update, mixes the clients' trained models, "
        "never aggregates, or averages each cluster's own updates, so the addition would "
        "silently do nothing",
        "aggregate with FedAvg or a server optimizer",
    ),
    TraitRule(
        Trait.KEEPS_DATA_ON_ITS_SITE,
        Trait.NEEDS_EVERY_CLIENTS_DATA,
        "the pooled baseline trains on every client's data in one process, and a stream's "
        "schedule is decided over every client's arrival window",
        "set silos=False for this run",
    ),
    TraitRule(
        Trait.NEEDS_FULL_PARTICIPATION,
        Trait.LEAVES_CLIENTS_OUT,
        "what it computes each round (gossip's mixing matrix, a cluster's split, the "
        "asynchronous clock, the free-rider attack) is defined over every client of the "
        "federation",
        "use the default FullParticipation sampler, without Unlearning",
    ),
    TraitRule(
        Trait.NEEDS_SYNCHRONOUS_ROUNDS,
        Trait.AGGREGATES_OUTSIDE_SYNCHRONOUS_ROUNDS,
        "the free-riders add their update to every aggregation at the share they would "
        "hold in a synchronous round, which asynchronous aggregations (each fair client "
        "returns now and then) and SAFARI's server rounds (no clients) do not have",
        "attack synchronous rounds: FedAvg or a server optimizer",
    ),
    TraitRule(
        Trait.NEEDS_THE_FEDAVG_STEP,
        Trait.STEPS_OTHERWISE_THAN_FEDAVG,
        "SIFU's sensitivity bound (thesis eq. 5.8, Thm 5.1) is for FedAvg's server step "
        "θ + η_g Σ ω_i Δ_i; server state (momentum, control variates, clusters, a clock, "
        "server rounds) would keep what a removed client contributed",
        "aggregate with FedAvg",
    ),
    TraitRule(
        Trait.CHANGES_TARGET_WEIGHTS,
        Trait.FIXED_TO_ITS_TARGET_WEIGHTS,
        "removing clients changes the target weights, and fixed clusters are unbiased only "
        "at the weights they were built for",
        "use SampleSizeClusteredSampler, which rebuilds its clusters from the weights",
    ),
    TraitRule(
        Trait.FREEZES_PART_OF_THE_MODEL,
        Trait.CORRECTS_EVERY_GRADIENT,
        "FedRep freezes the head during the body's steps, and SCAFFOLD's correction "
        "c − c_i moves every parameter",
        "use FedRep with FedAvg, or SCAFFOLD without FedRep",
    ),
    TraitRule(
        Trait.DECIDES_THE_EVALUATED_MODEL,
        Trait.DECIDES_THE_EVALUATED_MODEL,
        "a client is evaluated with one personalized model",
        "keep one of them",
    ),
    TraitRule(
        Trait.PRIVATIZES_EACH_GRADIENT,
        Trait.STEPS_FROM_NON_PRIVATE_GRADIENTS,
        "pFedMe's local step uses the personalized model θ̂ found with non-private "
        "gradients of the batch, so the update a client sends would not be private",
        "use DP-SGD with FedAvg, FedProx, SCAFFOLD, Ditto, APFL or FedRep",
    ),
    TraitRule(
        Trait.COMPARES_UPDATES_IN_ONE_PLACE,
        Trait.SPLITS_CLIENTS_OVER_PROCESSES,
        "each process holds only its own clients' updates",
        "use devices=1",
    ),
    TraitRule(
        Trait.TRAINS_ON_SERVER_DATA,
        Trait.HAS_NO_SERVER_DATA,
        "the server's own training data comes from the datamodule's server_dataset()",
        "use a datamodule with server data (DigitsDataModule(server_samples=...))",
    ),
    TraitRule(
        Trait.READS_THE_SERVER_REFERENCE,
        Trait.HAS_NO_SERVER_REFERENCE,
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


def named_plugins(trainer: pl.Trainer, sampler: ClientSampler) -> list[tuple[object, str]]:
    """The run's plugins (``sampler`` and the samplers it wraps, the Trainer's callbacks,
    datamodule and module), each with the name a user wrote: a sampler chain is shown as
    written (``ExcludedClients(UniformSampler)``); internal wrappers (a leading
    underscore, as unlearning's) are left out."""
    chain = [s for s in sampler_chain(sampler) if not type(s).__name__.startswith("_")]
    sampler_name = "(".join(type(s).__name__ for s in chain) + ")" * (len(chain) - 1)
    named: list[tuple[object, str]] = [(s, sampler_name) for s in chain]
    named += [
        (obj, type(obj).__name__)
        for obj in [*trainer.callbacks, trainer.datamodule, trainer.lightning_module]
        if obj is not None
    ]
    return named


def ways_of_running(vectorize: bool, world_size: int, silos: bool) -> dict[str, str]:
    """The ways the run executes (:data:`WAYS_OF_RUNNING`), each with how a refusal shows
    it."""
    shown = ("FederatedStrategy(vectorize=True)", f"{world_size} processes",
             "FederatedStrategy(silos=True)")  # fmt: skip
    used = (vectorize, world_size > 1, silos)
    return {way: name for way, name, on in zip(WAYS_OF_RUNNING, shown, used) if on}


def check(
    trainer: pl.Trainer,
    sampler: ClientSampler,
    vectorize: bool = False,
    world_size: int = 1,
    silos: bool = False,
) -> None:
    """Refuse the run's first pair of plugins that a rule of :data:`TRAIT_RULES` refuses,
    and callbacks or samplers whose needs the module does not meet."""
    named = named_plugins(trainer, sampler)
    check_traits(declared_traits(named, ways_of_running(vectorize, world_size, silos)))
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
    named: Iterable[tuple[object, str]], ways: dict[str, str]
) -> dict[str, dict[str, str]]:
    """What the run's plugins declare, by the name a user wrote (a sampler chain's
    samplers together), each trait with its fix, and the traits of the ways the run
    executes (``ways``: :func:`ways_of_running`)."""
    declared: dict[str, dict[str, str]] = {}
    for plugin, shown in named:
        traits = traits_of(plugin)
        if traits:
            declared.setdefault(shown, {}).update(traits)
    for way, shown in ways.items():
        for trait in WAY_TRAITS.get(way, ()):
            declared.setdefault(shown, {})[trait] = ""
    return declared


def check_traits(declared: dict[str, dict[str, str]]) -> None:
    """Refuse the first pair of plugins (or a plugin and a way of running) that a rule of
    :data:`TRAIT_RULES` refuses, naming both, their traits, the reason and the fix."""
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


def refusal_table(plugins: Sequence[type]) -> str:
    """The README's table of refused pairs: one row per rule of :data:`TRAIT_RULES`,
    naming the public classes of ``plugins`` (and the ways of running) that declare each
    trait."""

    def holders(trait: str) -> str:
        names = [cls.__name__ for cls in plugins
                 if trait in traits_of_class(cls) and not cls.__name__.startswith("_")]  # fmt: skip
        names += [way for way, traits in WAY_TRAITS.items() if trait in traits]
        return ", ".join(names)

    rows = ["| plugins that … | refused with plugins that … | why | fix |", "|---|---|---|---|"]
    for rule in TRAIT_RULES:
        rows.append(f"| {rule.first}: {holders(rule.first)} | {rule.second}: "
                    f"{holders(rule.second)} | {rule.reason} | the plugin's own, else: "
                    f"{rule.fix} |")  # fmt: skip
    return "\n".join(rows)
