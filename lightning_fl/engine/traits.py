"""What a plugin declares about what it does: its traits, the facts the composition rules
read (:mod:`lightning_fl.engine.composition`), never its class name.

A plugin (a callback, a sampler, a datamodule) declares its traits in a class attribute,
``traits = {Trait.X: fix}``, where ``fix`` says how a user keeps this plugin when a rule
refuses the trait ("" leaves the rule's own fix). Subclasses inherit their bases' traits,
and a subclass withdraws one by mapping it to ``None``. Two declarations are derived, so
that no fact is stated twice: an aggregator with ``needs_client_updates`` and a sampler
with ``needs_updates`` read each client's update (:data:`Trait.READS_EACH_UPDATE`). A
callback may add traits that depend on its settings with
:meth:`~lightning_fl.engine.plugins.FederatedCallback.add_trait`.

Samplers are checked conservatively: :class:`~lightning_fl.systems.samplers.ClientSampler`
declares that it leaves clients out, of a random number, with no known inclusion
probability, and each sampler withdraws what it does not do. A sampler of the user's own
is then refused where any of these could break a plugin, until it says otherwise.

This module imports nothing of the package, so every layer may declare traits.
"""

from __future__ import annotations

from collections.abc import Mapping


class Trait:
    """The traits a plugin may declare. Each reads after the plugin's name in a refusal
    ("DPFedAvg draws server-side randomness")."""

    # -- privacy --
    #: It draws randomness that protects privacy where the round's sum is aggregated (a
    #: server's DP noise): only a trusted aggregator may draw it, from a secret.
    DRAWS_SERVER_RANDOMNESS = "draws server-side randomness"
    #: Every site aggregates the same sum itself, and no trusted server exists (silo mode).
    AGGREGATES_ON_EVERY_SITE = "aggregates the round's sum on every site"
    #: It hides each client's update inside the round's sum (secure aggregation).
    HIDES_EACH_UPDATE = "hides each client's update inside the round's sum"
    #: It reads each client's update or trained model, one by one.
    READS_EACH_UPDATE = "reads each client's update or model"
    #: Its noise and ε need each client's inclusion probability q (DP-FedAvg).
    NEEDS_INCLUSION_PROBABILITY = "needs one known inclusion probability per client and round"
    #: Its draws have no single known inclusion probability per client and round.
    UNKNOWN_INCLUSION_PROBABILITY = "has no known inclusion probability per client and round"
    #: It bounds the sensitivity of the round's sum by clipping every update in it.
    BOUNDS_THE_SUMS_SENSITIVITY = "bounds the round's sum's sensitivity by clipping each update"
    #: It adds updates of its own to the round's update sum Σ ω_i Δ_i (a free-rider's
    #: update, the server's WERM step) and rescales the clients' weights.
    ADDS_TO_THE_UPDATE_SUM = "adds updates of its own to the round's update sum"
    #: It never reads the round's update sum Σ ω_i Δ_i (robust aggregators, gossip, local
    #: training, clustered FL).
    IGNORES_THE_UPDATE_SUM = "never reads the round's update sum"
    #: It makes each local gradient differentially private (DP-SGD).
    PRIVATIZES_EACH_GRADIENT = "makes each local gradient private"
    #: Its local step uses a model found with non-private gradients of the batch (pFedMe).
    STEPS_FROM_NON_PRIVATE_GRADIENTS = "steps from a model found with non-private gradients"
    # -- who takes part --
    #: It needs more than 2f + 2 clients in every round (Krum).
    NEEDS_MORE_THAN_2F_PLUS_2_CLIENTS = "needs more than 2f + 2 clients in every round"
    #: Its rounds have a random number of distinct clients.
    DRAWS_A_RANDOM_NUMBER_OF_CLIENTS = "draws a random number of distinct clients a round"
    #: It needs every client of a fixed federation in every round.
    NEEDS_FULL_PARTICIPATION = "needs every client of a fixed federation in every round"
    #: It leaves clients out of rounds, or removes them from the federation.
    LEAVES_CLIENTS_OUT = "leaves clients out of rounds or removes them"
    #: It adds to every aggregation in proportion to a synchronous round of clients.
    NEEDS_SYNCHRONOUS_ROUNDS = "adds to every aggregation by a synchronous round's shares"
    #: Its aggregations are not synchronous rounds of clients (asynchronous returns,
    #: server rounds).
    AGGREGATES_OUTSIDE_SYNCHRONOUS_ROUNDS = "aggregates outside synchronous rounds of clients"
    #: It changes the clients' target weights during the run (unlearning removes clients).
    CHANGES_TARGET_WEIGHTS = "changes the clients' target weights during the run"
    #: It is unbiased only at the target weights it was built for.
    FIXED_TO_ITS_TARGET_WEIGHTS = "is unbiased only at the target weights it was built for"
    # -- the server step and the model --
    #: It needs FedAvg's server step θ + η_g Σ ω_i Δ_i, with no server state (SIFU).
    NEEDS_THE_FEDAVG_STEP = "needs FedAvg's server step and no server state"
    #: Its server step is not FedAvg's, or it keeps server state.
    STEPS_OTHERWISE_THAN_FEDAVG = "steps the server otherwise than FedAvg"
    #: It freezes part of the model during some local steps (FedRep's head and body).
    FREEZES_PART_OF_THE_MODEL = "freezes part of the model during local steps"
    #: It corrects the gradient of every parameter (SCAFFOLD's c − c_i).
    CORRECTS_EVERY_GRADIENT = "corrects the gradient of every parameter"
    #: It decides the personalized model a client is evaluated with.
    DECIDES_THE_EVALUATED_MODEL = "decides the personalized model a client is evaluated with"
    # -- where it runs, and its data --
    #: It compares every client's update of the round in one place.
    COMPARES_UPDATES_IN_ONE_PLACE = "compares every client's update of the round in one place"
    #: It splits a round's clients over several processes.
    SPLITS_CLIENTS_OVER_PROCESSES = "splits a round's clients over processes"
    #: It keeps each client's data in its own site's process (silo mode).
    KEEPS_DATA_ON_ITS_SITE = "keeps each client's data on its own site"
    #: It needs every client's data, or every client's schedule, in one process.
    NEEDS_EVERY_CLIENTS_DATA = "needs every client's data in one process"
    #: It trains on the datamodule's ``server_dataset()`` (SAFARI).
    TRAINS_ON_SERVER_DATA = "trains on the datamodule's server data"
    #: Its ``server_dataset()`` is empty.
    HAS_NO_SERVER_DATA = "provides no server data"
    #: It reads the server's reference data (WERM's server reference).
    READS_THE_SERVER_REFERENCE = "reads the server's reference data"
    #: It provides no server reference data.
    HAS_NO_SERVER_REFERENCE = "provides no server reference data"


def traits_of_class(cls: type) -> dict[str, str]:
    """The traits ``cls`` declares: its ``traits``, merged along the MRO from the base
    down (``None`` withdraws an inherited one), and those its class flags imply."""
    merged: dict[str, str | None] = {}
    for klass in reversed(cls.__mro__):
        merged.update(vars(klass).get("traits", {}))
    traits = {trait: fix for trait, fix in merged.items() if fix is not None}
    return _with_derived(traits, cls)


def traits_of(plugin: object) -> dict[str, str]:
    """What ``plugin`` declares: its class's traits, those its settings add (a callback's
    ``declared_traits()``), and those its flags imply."""
    declared = getattr(plugin, "declared_traits", None)
    traits = declared() if callable(declared) else traits_of_class(type(plugin))
    return _with_derived(traits, plugin)


def _with_derived(traits: dict[str, str], holder: object) -> dict[str, str]:
    """``traits`` and :data:`Trait.READS_EACH_UPDATE` where ``holder`` (a plugin or its
    class) sets ``needs_client_updates`` or ``needs_updates`` to True (a wrapper's
    property, read on its class, is not a value)."""
    flags = (getattr(holder, name, False) for name in ("needs_client_updates", "needs_updates"))
    if any(flag is True for flag in flags):
        return {Trait.READS_EACH_UPDATE: "", **traits}
    return traits


#: The type of a plugin class's ``traits`` attribute.
Traits = Mapping[str, "str | None"]
