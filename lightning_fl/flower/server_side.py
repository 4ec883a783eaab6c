"""Flower's own model: a Flower Strategy in the ServerApp that aggregates, and ClientApps
that train (issue 77's server-side mode; README, "Deploying across hospitals").

In the relay mode (:mod:`lightning_fl.flower.apps`) the server only adds and every site
aggregates; here the server is the classic trusted aggregator:

- :class:`FederatedServer`, a Flower ``Strategy``, holds the global model and runs
  lightning_fl's sampler, the recipe's aggregator and its server optimizer (FedAvg,
  FedAvgM, FedAdam, FedYogi, FedAdagrad): each round it draws the participants (a pure
  function of (seed, round), as in simulation), sends each the global model as an
  ``ArrayRecord`` in a ``train`` message, and applies θ^{t+1} = aggregate(Σ ω_i (θ_i −
  θ^t)) to the replies, with the sampler's weights ω_i;
- the ClientApp (``@train``) trains the node's client with the user's own
  ``LightningModule`` and the recipe's client-side plugins (FedProx's term, DP-SGD, ...):
  one lightning_fl fit of that one round (``FederatedStrategy(first_round=r)``, the
  client alone with weight 1), so its batches, seeds and local steps are the simulation's.

Both read the same recipe. The Flower App (``recipes/flower_server/``, ``flwr run``)
names :data:`server_app` and :data:`client_app`, whose run config gives ``recipe`` (the
YAML's path), ``overrides`` (extra recipe options, e.g. the data's root), ``clients``
(the number of nodes to wait for) and ``out`` (the server's folder); under Flower's
simulation engine :func:`make_apps` builds the same pair from arguments. A node trains
the recipe's client ``partition-id`` (the simulation engine's node config) or
``client`` (a SuperNode's ``--node-config client=N``; ``state-dir`` its folder of the
client's state, :class:`ClientStateFolder`).

A node opens only its own client's data (:func:`open_own_client`: the datamodule's silo
view of that one client), so its folder needs only that client's files. What crosses the
network: at the start each node says which client it trains and its number of training
samples (a ``query``); each round the server sends each participant θ^t, the round, its
weight ω_i and every client's training count (what the target weights p_i read, as silo
mode shares them), and each replies its trained model θ_i and its training loss. The
server sees every participant's model: use the relay mode (the server sees only sums), or
``secagg=true`` below, where the server is not trusted with them.

Each round the server also sends θ^{t+1} to every connected node in an ``evaluate``
message (run config ``evaluate``: the split, ``val`` by default unless the recipe
validates nothing during a fit (``limit_val_batches: 0``, as FLamby's), ``test``, or
``""`` for none); each replies its client's loss and metrics and sample count, and the server
writes their weighted and uniform means to ``<out>/evaluation.csv``. A round starts once
``min-available-nodes`` of the clients' nodes are connected; a participant whose node is
not, or does not reply within ``round-timeout`` seconds, is a dropped update.

User-level DP (McMahan et al. 2018, Alg. 1): ``DPFedAvg(noise="central")`` runs on the
server alone: it clips each reply's update as it arrives (:meth:`Aggregator.receive_update`)
and adds N(0, σ²) to the weighted sum, drawn from the server's operating system
(:class:`~lightning_fl.systems.privacy_noise.SecretNoise`), never from the recipe's seed,
which every site holds; ``dp/epsilon`` is in each round's metrics. ``DPFedAvg(noise=
"local")`` runs its client half on the nodes (:class:`AggregatorOnNode`): each clips its
update and adds its share of the noise from its own secret before it leaves. A ClientApp's own
noise (DP-SGD's) is its node's secret likewise (``secret_randomness``). Flower's own
fixed-clipping DP wrappers (run config ``dp-clipping``, :mod:`lightning_fl.flower.flower_dp`)
wrap the server where their calibration holds (m participants of weight 1/m each), with
NumPy's generator made secret first.

After every round the server writes ``<out>/server_checkpoint.pt`` (θ^{t+1}, the
aggregator's, the plugins' and the sampler's state, the clients' counts; tensors and plain
values, read with ``weights_only=True``); the run config's ``resume=true`` continues after
its round, exactly (:meth:`FederatedServer.resume`).

With the run config's ``secagg=true`` each round's training runs under Flower's SecAgg+
(:mod:`lightning_fl.flower.secure_rounds`): the server learns only the sum of the
participants' weighted updates and round sums (and each one's training loss, in clear).

Flower's adaptive-clipping wrappers and its ``LocalDpMod`` compose likewise (run config
``dp-clipping=server-adaptive|client-adaptive``, ``local-dp-*``:
:mod:`~lightning_fl.flower.flower_dp`).

A personalization plugin's local model is its declared client state, kept in the node's
``Context``; where a plugin personalizes the evaluated model, a node evaluates its client
by lightning_fl's own evaluation with that state (:func:`evaluate_personalized`).

A node with ``--node-config 'state-dir=/path'`` keeps its client's state in that folder
(:class:`ClientStateFolder`), so that a resumed run continues it; without one, a resume
of a run whose plugins keep client state is refused.

Not built yet (issue 77): plugins whose server half needs more than declared state, round
sums and a round-end hook.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.logger import log as flower_log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from lightning_fl.engine.client_store import ClientStore
from lightning_fl.engine.context import FederatedConfig
from lightning_fl.engine.outputs import append_csv
from lightning_fl.engine.plugins import (
    CLIENT_UPDATES,
    Aggregator,
    FedAvg,
    FederatedCallback,
    PluginView,
    RoundState,
    zero_round_sums,
)
from lightning_fl.engine.tensors import (
    FederatedTensors,
    all_finite,
    flat_size,
    flatten,
    float_names,
    zeros_like,
)
from lightning_fl.engine.traits import Trait, traits_of
from lightning_fl.flower import flower_dp, secure_rounds
from lightning_fl.flower.client_app import is_secure, secure_mod
from lightning_fl.flower.flower_dp import FlowerDP, LocalDP
from lightning_fl.flower.secure_rounds import SecureAggregationSettings
from lightning_fl.systems.samplers import ClientSampler, FullParticipation, Participation

logger = logging.getLogger(__name__)

#: the server's checkpoint in its folder (``out``), written after every round
CHECKPOINT = "server_checkpoint.pt"


class ServerSideError(RuntimeError):
    """A recipe or a node the server-side mode cannot run."""


@dataclass(frozen=True)
class Settings:
    """What both apps read: the recipe, its extra options, the nodes to wait for and the
    server's folder."""

    recipe: str
    overrides: tuple[str, ...] = ()
    clients: int | None = None
    out: str | None = None
    node_timeout: float = 120.0
    #: the fewest connected nodes a round starts with (default: ``clients``)
    min_available_nodes: int | None = None
    #: seconds the server waits for a round's replies (a node that has not replied by
    #: then is a dropped update)
    round_timeout: float = 600.0
    #: the split the nodes evaluate each round's model on ("val", "test"; "" for none)
    evaluate: str = "val"
    #: continue from ``<out>/server_checkpoint.pt`` (the last round the server completed)
    resume: bool = False
    #: run each round's training under Flower's SecAgg+ (None: in clear)
    secure: SecureAggregationSettings | None = None
    #: wrap the server in one of Flower's central-DP wrappers (None: none)
    dp: FlowerDP | None = None
    #: Flower's LocalDpMod on every node (None: none)
    local_dp: LocalDP | None = None

    @classmethod
    def read(cls, run_config: dict[str, Any]) -> Settings:
        if "recipe" not in run_config:
            raise ServerSideError(
                "the Flower run config has no 'recipe': submit the run with flwr run ... "
                "--run-config 'recipe=\"<the recipe's path>\"'."
            )
        overrides = str(run_config.get("overrides", "")).split()
        clients, least = run_config.get("clients"), run_config.get("min-available-nodes")
        return cls(
            str(run_config["recipe"]), tuple(overrides),
            None if clients is None else int(clients), run_config.get("out"),
            float(run_config.get("node-timeout", 120.0)),
            int(least) or None if least is not None else None,  # 0: every client's node
            float(run_config.get("round-timeout", 600.0)),
            str(run_config.get("evaluate", "val")),
            str(run_config.get("resume", "false")).lower() in ("true", "1", "yes"),
            SecureAggregationSettings.read(run_config), FlowerDP.read(run_config),
            LocalDP.read(run_config),
        )  # fmt: skip


class OneClient(ClientSampler):
    """The participant of a ClientApp's one-round fit: ``client``, with weight 1 (the
    fit's aggregator, FedAvg with ``server_lr`` 1, then leaves the client's trained model
    in the module)."""

    traits = FullParticipation.traits

    def __init__(self, client: int) -> None:
        super().__init__()
        self.client = client

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        return {self.client: 1.0}


def instantiate(settings: Settings, extra: Sequence[str] = ()) -> Any:
    """The recipe's objects (``cli.trainer``, ``cli.model``, ``cli.datamodule``), built by
    lightning-fl's command line without running it; the recipe's seed is set first, so
    the module starts from the simulation's initial weights."""
    from lightning.pytorch import LightningDataModule, LightningModule

    from lightning_fl.cli import FederatedCLI, PlainArgumentParser

    _check_recipe(settings.recipe)
    args = ["--config", settings.recipe, *settings.overrides, *extra]
    with warnings.catch_warnings():  # a Flower process's own argv is not the recipe's
        warnings.filterwarnings("ignore", message=".*args parameter is intended")
        cli = FederatedCLI(
            LightningModule, LightningDataModule, subclass_mode_model=True,
            subclass_mode_data=True, save_config_callback=None, args=args, run=False,
            auto_configure_optimizers=False, parser_class=PlainArgumentParser,
            parser_kwargs={"allow_abbrev": False, "exit_on_error": False},
        )  # fmt: skip
    strategy = cli.trainer.strategy
    if hasattr(strategy, "summary"):
        strategy.summary.automatic = False  # its fits write no run folder to name
    return cli


def _check_recipe(recipe: str) -> None:
    """Refuse a silo recipe (read as data, before anything is built)."""
    import yaml

    try:
        with open(recipe) as handle:
            config = yaml.safe_load(handle) or {}
    except OSError as err:
        raise ServerSideError(f"cannot read the recipe {recipe}: {err.strerror}.") from None
    strategy = (config.get("trainer") or {}).get("strategy") or {}
    options = strategy.get("init_args") or {} if isinstance(strategy, dict) else {}
    if options.get("silos") or options.get("transport"):
        raise ServerSideError(
            f"{recipe} names silos or a transport: in the server-side mode each Flower node "
            "trains one client of a plain recipe. Give a recipe without strategy.silos and "
            "strategy.transport (the relay mode runs silo recipes)."
        )


# ---------------------------------------------------------------------- the clients
def node_client(node_config: dict[str, Any]) -> int:
    """The recipe's client a node trains: its ``client``, else its ``partition-id``."""
    for key in ("client", "partition-id"):
        if key in node_config:
            return int(node_config[key])
    raise ServerSideError(
        "this SuperNode trains no client: start it with --node-config 'client=<the "
        "recipe's client id>'."
    )


#: a node config key: the folder where a node keeps its client's declared state
STATE_DIR = "state-dir"
#: the saved rounds a node keeps of its client's state (a resumed server repeats at most
#: the round it lost)
KEPT_ROUNDS = 3


class ClientStateFolder:
    """A node's folder of its client's declared state (SCAFFOLD's c_i, a personal model)
    after each round it trained (``--node-config 'state-dir=/path'``): it outlives a
    Flower run, whose ``Context`` a new run starts empty, so that a resumed server's run
    continues with each client's state as the uninterrupted run had it. Each round's
    state is its own file (``round_<r>.pt``, tensors only, read with
    ``weights_only=True``); a round reads the latest state saved before it, so a round
    the server lost and repeats reads the state that preceded it."""

    def __init__(self, folder: str | os.PathLike, client: int) -> None:
        self.folder = Path(folder) / f"client_{client}"

    def rounds(self) -> list[int]:
        """The rounds whose state is saved, ascending."""
        if not self.folder.is_dir():
            return []
        return sorted(int(p.stem.split("_")[1]) for p in self.folder.glob("round_*.pt"))

    def load(self, before: int) -> dict[str, torch.Tensor]:
        """The client's state after its last round before round ``before`` (none: {})."""
        saved = [r for r in self.rounds() if r < before]
        if not saved:
            return {}
        return torch.load(self.folder / f"round_{saved[-1]}.pt", weights_only=True)

    def save(self, round_idx: int, state: dict[str, torch.Tensor]) -> None:
        """Keep ``state`` as the client's after round ``round_idx`` (written whole, then
        renamed), and forget all but the last :data:`KEPT_ROUNDS` rounds."""
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.folder / f"round_{round_idx}.pt.partial"
        torch.save(state, partial)
        os.replace(partial, self.folder / f"round_{round_idx}.pt")
        for old in self.rounds()[:-KEPT_ROUNDS]:
            (self.folder / f"round_{old}.pt").unlink(missing_ok=True)


def state_folder(node_config: dict[str, Any], client: int) -> ClientStateFolder | None:
    """The node's :class:`ClientStateFolder` (node config ``state-dir``), or None: its
    client's state lives in the run's ``Context``."""
    folder = str(node_config.get(STATE_DIR, "") or "")
    return ClientStateFolder(folder, client) if folder else None


def open_own_client(dm: Any, client: int) -> None:
    """Make the node's datamodule hold ``client`` alone (its silo view, before ``setup``:
    it opens only that client's data, so a node's folder needs only its own files)."""
    if not 0 <= client < dm.num_clients:
        raise ServerSideError(
            f"this node trains client {client}, and the recipe has {dm.num_clients} "
            f"clients (0-{dm.num_clients - 1}): fix the node's client or partition-id."
        )
    dm.enter_silo(client, dm.num_clients)


def client_count(settings: Settings, client: int) -> int:
    """The client's number of training samples (what the sampler's weights read)."""
    cli = instantiate(settings, _QUIET)
    dm = cli.datamodule
    open_own_client(dm, client)
    dm.prepare_data()
    dm.setup("fit")
    return dm.local_sample_counts("train")[client]


def train_client(
    settings: Settings,
    client: int,
    round_idx: int,
    start: dict[str, torch.Tensor],
    server_state: dict[str, torch.Tensor] | None = None,
    client_state: dict[str, torch.Tensor] | None = None,
    counts: Sequence[int] | None = None,
    aggregator_state: dict[str, float] | None = None,
) -> Trained:
    """``client``'s local training of round ``round_idx`` from ``start``: one lightning_fl
    fit of that round, the client alone, with the recipe's module, data, local steps,
    seed and client-side plugins. The plugins' declared server state (SCAFFOLD's c) is
    ``server_state``'s, and the client's declared state (its c_i) ``client_state``'s;
    returned: the trained model, the plugins' round sums over this client (Σ Δc_i), its
    new declared state and its training loss. The datamodule opens ``client``'s data
    alone; ``counts`` are every client's training counts (the server's; the target
    weights p_i read them), by default the datamodule's; ``aggregator_state`` the
    aggregator's scalar server state its client half reads (DPFedAvg's adaptive C_t)."""
    one_round = ["--trainer.strategy.init_args.first_round", str(round_idx),
                 # a client's privacy noise (DP-SGD's) is its node's secret, not the recipe's
                 "--trainer.strategy.init_args.secret_randomness", "true",
                 # the nodes evaluate in evaluate messages: this fit trains, and opens no
                 # other client's validation data
                 "--trainer.limit_val_batches", "0",
                 "--trainer.num_sanity_val_steps", "0"]  # fmt: skip
    cli = instantiate(settings, [*_QUIET, *one_round, *_counts_options(counts)])
    if counts is not None:  # else the whole federation's counts are read on this node
        open_own_client(cli.datamodule, client)
    trainer, strategy = cli.trainer, cli.trainer.strategy
    rounds, trainer.fit_loop.max_epochs = trainer.max_epochs, 1  # the recipe's, then this one
    recipe_sampler, strategy.sampler = strategy.sampler, OneClient(client)
    aggregator = recipe_aggregator(trainer.callbacks)
    # the aggregator's client half (DPFedAvg's local noise) runs first, as in simulation
    on_node = []
    if aggregator.client_side_hooks():
        for name, value in (aggregator_state or {}).items():
            if name not in aggregator.declared_server_state():  # never its privacy settings
                raise ServerSideError(
                    f"the server sets {type(aggregator).__name__}'s {name!r}, which is not "
                    "its declared server state: a node takes only that from the server. "
                    "Give the server and this node the same lightning-fl and recipe."
                )
            setattr(aggregator, name, value)
        on_node = [AggregatorOnNode(aggregator, recipe_sampler, strategy.config, rounds)]
    plugins = one_client_fit(trainer, client, server_state, client_state, on_node)
    cli.model.load_state_dict(start)
    trainer.fit(cli.model, datamodule=cli.datamodule)
    state = trainer.strategy.engine.current_round.state
    declared = {plugin.round_sum_key(name) for plugin in plugins
                for name in plugin.declared_round_sums()}  # fmt: skip
    sums = {f"{key}.{i}": t.detach().cpu() for key, tensors in state.extra_sums.items()
            if key in declared for i, t in enumerate(tensors)}  # fmt: skip
    for half in on_node:
        sums.update(half.round_sums())
    kept_state = {}
    for plugin in plugins:
        for name, key in plugin.declared_client_state().items():
            value = strategy.client_store.get(client, key)
            if value is not None and not isinstance(value, torch.Tensor):
                raise ServerSideError(
                    f"{type(plugin).__name__}'s client state {name!r} is not a tensor: "
                    "the server-side mode keeps tensors in a node's state. Use the relay mode."
                )
            if value is not None:
                kept_state[key] = value.detach().cpu()
    metrics = {
        name: float(value) for name, value in trainer.callback_metrics.items()
        if name == "train_loss"
    }  # fmt: skip
    model = {k: v.detach().cpu() for k, v in cli.model.state_dict().items()}
    weight = on_node[0].weight if on_node else None
    return Trained(model, sums, kept_state, metrics, weight)


@dataclass(frozen=True)
class Trained:
    """A client's round: its model, its round sums and declared state (flattened to
    named tensors), its training loss, and, where the aggregator's client half ran on
    the node, the weight ω_i the node drew for itself."""

    model: dict[str, torch.Tensor]
    round_sums: dict[str, torch.Tensor]
    client_state: dict[str, torch.Tensor]
    metrics: dict[str, float]
    weight: float | None = None


class AggregatorOnNode(FederatedCallback):
    """The recipe aggregator's client half in a node's one-client fit: the hooks it runs
    beside its clients before the update leaves them (:data:`NODE_HOOKS`: DPFedAvg's
    ``noise="local"``, each client clipping its update to C and adding its share
    N(0, σ²/K)/ω_k of the noise, McMahan et al. 2018, Alg. 1 with the noise split over
    the round's K participants), run first, as the engine runs the aggregator's.

    The node draws the round's participation itself, from the recipe's sampler and seed
    and the fit's training counts (the pure function of (seed, round) the server draws),
    so the K and ω_k its share reads are the recipe's, not the server's word; its noise
    comes from the node's secret (``secret_randomness``), and the aggregator's round sums
    (adaptive clipping's count of unclipped updates) go up with the reply. The
    aggregator's scalar server state comes down with θ^t (:func:`scalar_server_state`:
    adaptive clipping's C_t, which scales the clipping and the noise alike, so that a
    server that sends another C changes the update's scale, not its ε)."""

    supports_vectorized_clients = True

    def __init__(
        self, aggregator: Aggregator, sampler: ClientSampler, config: FederatedConfig, rounds: int
    ) -> None:
        self.aggregator, self.sampler, self.rounds = aggregator, sampler, rounds
        self.config = replace(config, secret_randomness=True)
        self.state: RoundState | None = None
        #: ω_k of this node's client in the round, as the node drew it
        self.weight: float | None = None

    def transform_update(self, trainer, pl_module, client: int, update, state: RoundState):
        self.state = self._round(client, state)
        self.weight = self.state.weight_of(client)
        return self.aggregator.transform_update(trainer, pl_module, client, update, self.state)

    def _round(self, client: int, fit: RoundState) -> RoundState:
        """The round as the aggregator sees it on the server: its participants and
        weights, θ^t, and the aggregator's declared round sums at zero."""
        aggregator = self.aggregator
        aggregator.view = PluginView(ClientStore(), fit.sample_counts, self.view.tensors,
                                     self.config, aggregator)  # fmt: skip
        aggregator.on_server_start(self.rounds)
        target = aggregator.target_weights(fit.sample_counts)
        participation = aggregator.participation(fit.round_idx, self.config.seed, target,
                                                 self.sampler)  # fmt: skip
        if client not in participation.clients:
            raise ServerSideError(
                f"the server sent client {client} round {fit.round_idx}, and the recipe's "
                f"{type(self.sampler).__name__} does not draw it: give the server and "
                "this node the same recipe and seed."
            )
        sums = zero_round_sums([aggregator], fit.global_params)
        return replace(
            fit,
            participation=participation,
            extra_sums=sums,
            update_sum=zeros_like(fit.global_tensors),
            accepted=[],
            dropped=[],
        )

    def round_sums(self) -> dict[str, torch.Tensor]:
        """The aggregator's round sums over this node's client, named ``<key>.<i>``."""
        if self.state is None:
            return {}
        return {f"{key}.{i}": t.detach().cpu() for key, parts in self.state.extra_sums.items()
                for i, t in enumerate(parts)}  # fmt: skip


def _counts_options(counts: Sequence[int] | None) -> list[str]:
    """The recipe options that give a node's fit every client's training counts (the
    server's), where it has them."""
    if counts is None:
        return []
    return ["--trainer.strategy.init_args.training_counts", json.dumps(list(counts))]


def one_client_fit(
    trainer: Any,
    client: int,
    server_state: dict[str, torch.Tensor] | None,
    client_state: dict[str, torch.Tensor] | None,
    first: Sequence[FederatedCallback] = (),
) -> list[FederatedCallback]:
    """Make the recipe's trainer ``client``'s alone: the recipe's aggregator and server
    optimizer run on the server, so here FedAvg of weight 1 and ``server_lr`` 1 (with the
    recipe's weighting: the target weights p_i SCAFFOLD's "target" weighting reads) leaves
    θ^t + (θ_i − θ^t) in the module; checkpoints go, ``first`` runs before the plugins,
    the plugins get their declared server state and the client its declared state.
    Returns the plugins."""
    from lightning.pytorch.callbacks import Checkpoint

    aggregator = recipe_aggregator(trainer.callbacks)
    kept = [cb for cb in trainer.callbacks if not isinstance(cb, (Aggregator, Checkpoint))]
    trainer.callbacks = [*first, *kept, FedAvg(weighting=aggregator.weighting)]
    plugins = client_plugins(kept)
    for plugin in plugins:
        load_server_state(plugin, server_state or {})
    for key, value in (client_state or {}).items():
        trainer.strategy.client_store.set(client, key, value)
    return plugins


def recipe_aggregator(callbacks: Sequence[Any]) -> Aggregator:
    """The recipe's aggregator (FedAvg when it names none)."""
    return next((cb for cb in callbacks if isinstance(cb, Aggregator)), None) or FedAvg()


def client_plugins(callbacks: Sequence[Any]) -> list[FederatedCallback]:
    """The recipe's plugins other than the aggregator."""
    return [cb for cb in callbacks
            if isinstance(cb, FederatedCallback) and not isinstance(cb, Aggregator)]  # fmt: skip


def server_state_arrays(plugins: Sequence[FederatedCallback]) -> dict[str, torch.Tensor]:
    """The plugins' declared server state that is tensors (SCAFFOLD's c, shaped like the
    parameters; Ditto's w^0, one flat tensor), as named tensors ``<Class>.<name>.<i>`` for
    a list and ``<Class>.<name>`` for one tensor (what the clients need of the server's
    state); a value still None is not sent."""
    arrays = {}
    for plugin in plugins:
        for name in plugin.declared_server_state():
            value, prefix = getattr(plugin, name), f"{type(plugin).__name__}.{name}"
            if isinstance(value, torch.Tensor):
                arrays[prefix] = value.detach().cpu()
            elif name in plugin.server_state_like_params():
                for i, tensor in enumerate(value or []):
                    arrays[f"{prefix}.{i}"] = tensor.detach().cpu()
            elif value is not None:
                raise ServerSideError(
                    f"{type(plugin).__name__}'s server state {name!r} is a "
                    f"{type(value).__name__}, not tensors: the server-side mode sends only "
                    "tensors to the clients. Use the relay mode."
                )
    return arrays


def load_server_state(plugin: FederatedCallback, arrays: dict[str, torch.Tensor]) -> None:
    """Set ``plugin``'s declared server state from ``arrays`` (:func:`server_state_arrays`);
    a state the server has not set yet stays as it is (None: the engine starts state like
    the parameters at zero)."""
    for name in plugin.declared_server_state():
        prefix = f"{type(plugin).__name__}.{name}"
        if prefix in arrays:
            setattr(plugin, name, arrays[prefix])
            continue
        parts = sorted(
            (int(k[len(prefix) + 1 :]), v) for k, v in arrays.items() if k.startswith(prefix + ".")
        )
        if parts:
            setattr(plugin, name, [v for _, v in parts])


def scalar_server_state(plugin: FederatedCallback) -> dict[str, float]:
    """``plugin``'s declared server state that is a number (DPFedAvg's clip norm C_t),
    by name: what a node's half of the aggregator reads of the server's."""
    values = {name: getattr(plugin, name) for name in plugin.declared_server_state()}
    return {name: float(value) for name, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}  # fmt: skip


#: a train message's config entries of the aggregator's scalar server state
AGGREGATOR_STATE = "aggregator."


#: a ClientApp's fits write nothing and say nothing
_QUIET = ("--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
          "--trainer.enable_model_summary", "false",
          "--trainer.strategy.init_args.enable_plots", "false")  # fmt: skip


def answer_query(settings: Settings, message: Message, context: Context) -> Message:
    """A node's answer to the server's first message: its client and training count."""
    client = node_client(context.node_config)
    record = MetricRecord({"client": client, "num-examples": client_count(settings, client),
                           "keeps-state": int(state_folder(context.node_config, client)
                                              is not None)})  # fmt: skip
    return Message(RecordDict({"metrics": record}), reply_to=message)


def personalizes_evaluation(plugin: FederatedCallback) -> bool:
    """Whether ``plugin`` acts around a client's evaluation (its evaluation hooks, or the
    trait of deciding the evaluated model: FineTune, APFL, FedRep, pFedMe, kNN-Per)."""
    hooks = plugin.overridden_hooks(EVALUATION_HOOKS)
    return bool(hooks) or Trait.DECIDES_THE_EVALUATED_MODEL in traits_of(plugin)


def evaluate_client(
    settings: Settings,
    client: int,
    model: dict[str, torch.Tensor],
    split: str,
    counts: Sequence[int] | None = None,
    client_state: dict[str, torch.Tensor] | None = None,
    server_state: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """``model`` on ``client``'s ``split`` data (``val``, or ``test`` for a recipe
    without a validation split): the module's loss and metrics, each the batch-size
    weighted mean over the client's samples (Σ value·B / Σ B, as lightning_fl sums a
    client's evaluation), and ``num-examples``. Where a plugin personalizes the evaluated
    model, lightning_fl's own evaluation of that one client runs instead
    (:func:`evaluate_personalized`)."""
    from lightning_fl.engine.local_training import batches, evaluation_mode

    cli = instantiate(settings, [*_QUIET, *_counts_options(counts)])
    if any(personalizes_evaluation(p) for p in client_plugins(cli.trainer.callbacks)):
        return evaluate_personalized(cli, client, model, split, counts is not None,
                                     client_state, server_state)  # fmt: skip
    dm, module = cli.datamodule, cli.model
    open_own_client(dm, client)
    dm.prepare_data()
    dm.setup("fit" if split == "val" else "test")
    module.load_state_dict(model)
    dataset = dm.client_dataset(client, split)
    if dataset is None or len(dataset) == 0:
        return {"num-examples": 0}
    if not hasattr(module, "loss_and_metrics"):
        raise ServerSideError(
            f"{type(module).__name__} has no loss_and_metrics(batch), which a node's "
            "evaluation reads: use a lightning_fl.FederatedTask (Classifier, ...), or turn "
            'evaluation off with the run config\'s evaluate="".'
        )
    totals: dict[str, float] = {}
    count = 0
    with evaluation_mode(module):
        for batch in batches(dm.client_dataloader(dataset, "val"), module.device):
            loss, metrics = module.loss_and_metrics(batch)
            size = len(batch[-1])
            for name, value in {"loss": loss, **metrics}.items():
                totals[name] = totals.get(name, 0.0) + float(value) * size
            count += size
    return {"num-examples": count, **{f"{split}_{k}": v / count for k, v in totals.items()}}


def evaluate_personalized(
    cli: Any,
    client: int,
    model: dict[str, torch.Tensor],
    split: str,
    alone: bool,
    client_state: dict[str, torch.Tensor] | None = None,
    server_state: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """lightning_fl's evaluation (``validate``, or ``test``) of ``client`` alone with the
    recipe's plugins: its declared state (FedRep's head, APFL's v and α, pFedMe's θ̂)
    from ``client_state`` (the node's ``Context``), the plugins' declared server state
    from ``server_state``, and their evaluation hooks (FineTune's fine-tuning, a personal
    model loaded), as in simulation; ``alone``: the datamodule opens ``client``'s data
    only (the recipe's training counts are the server's). The client's metrics and its
    sample count, from the fit's per-client report."""
    trainer, strategy = cli.trainer, cli.trainer.strategy
    if alone:
        open_own_client(cli.datamodule, client)
    one_client_fit(trainer, client, server_state, client_state)
    cli.model.load_state_dict(model)
    run = trainer.validate if split == "val" else trainer.test
    run(cli.model, datamodule=cli.datamodule, verbose=False)
    report = strategy.evaluation.last_report
    values = {} if report is None else {
        name: per_client[client] for name, per_client in report[1].items()
        if client in per_client}  # fmt: skip
    if not values:
        return {"num-examples": 0}
    count = max(int(n) for _, n in values.values())
    return {"num-examples": count, **{name: float(v) for name, (v, _) in values.items()}}


def evaluate(settings: Settings, message: Message, context: Context) -> Message:
    """A node's ``evaluate`` reply: its client's metric means and sample count (with its
    declared state from the node's ``Context`` where a plugin personalizes the model)."""
    client = node_client(context.node_config)
    config = message.content["config"]
    split = str(config.get("split", "val"))
    model = message.content["arrays"].to_torch_state_dict()
    counts = config.get("counts")
    folder = state_folder(context.node_config, client)
    kept = (
        _arrays(context.state, CLIENT_STATE)
        if folder is None
        else folder.load(int(config.get("round", 0)) + 1)
    )  # the state after the round that made the model
    metrics = evaluate_client(settings, client, model, split,
                              None if counts is None else [int(n) for n in counts], kept,
                              _arrays(message.content, "server_state"))  # fmt: skip
    return Message(RecordDict({"metrics": MetricRecord({"client": client, **metrics})}),
                   reply_to=message)  # fmt: skip


#: the node's Context.state entry of its client's declared state (SCAFFOLD's c_i)
CLIENT_STATE = "lightning_fl.client_state"


def train(settings: Settings, message: Message, context: Context) -> Message:
    """A node's ``train`` reply: its client's round (:func:`train_client`), in clear or
    masked for a secure round; its client's declared state stays in ``context.state``."""
    client = node_client(context.node_config)
    config = message.content["config"]
    round_idx = int(config["round"])
    start = message.content["arrays"].to_torch_state_dict()
    server_state = _arrays(message.content, "server_state")
    folder = state_folder(context.node_config, client)
    client_state = _arrays(context.state, CLIENT_STATE) if folder is None else folder.load(
        round_idx)  # fmt: skip
    counts = config.get("counts")
    aggregator_state = {k[len(AGGREGATOR_STATE) :]: float(v) for k, v in config.items()
                        if k.startswith(AGGREGATOR_STATE)}  # fmt: skip
    trained = train_client(settings, client, round_idx, start, server_state, client_state,
                           None if counts is None else [int(n) for n in counts],
                           aggregator_state)  # fmt: skip
    weight = float(config["weight"])
    if trained.weight is not None and not math.isclose(trained.weight, weight, rel_tol=1e-12):
        raise ServerSideError(
            f"the server weighs client {client}'s update of round {round_idx} by {weight:.6g}, "
            f"and the recipe's sampler by {trained.weight:.6g} (the weight its privacy noise "
            "is scaled to): give the server and this node the same recipe, data and seed."
        )
    if trained.client_state and folder is not None:  # kept on the node, never sent
        folder.save(round_idx, trained.client_state)
    elif trained.client_state:
        context.state[CLIENT_STATE] = ArrayRecord(torch_state_dict=trained.client_state)
    rounds = config.get("rounds")
    flower_log(INFO, "lightning-fl: client %d: round %d/%s trained, train_loss %s", client,
               round_idx, "?" if rounds is None else int(rounds) - 1,
               trained.metrics.get("train_loss", "n/a"))  # fmt: skip
    if is_secure(message.content):  # masked by secaggplus_mod
        vector = secure_rounds.contribution(weight, start, trained.model, trained.round_sums)
        return secure_rounds.secure_reply(message, vector, {"client": client, **trained.metrics})
    reply = RecordDict({
        "arrays": ArrayRecord(torch_state_dict=trained.model),
        "metrics": MetricRecord({"client": client, **trained.metrics}),
    })  # fmt: skip
    if trained.round_sums:
        reply["round_sums"] = ArrayRecord(torch_state_dict=trained.round_sums)
    return Message(reply, reply_to=message)


def _arrays(records: RecordDict, key: str) -> dict[str, torch.Tensor]:
    """The named tensors of ``records[key]`` (an ArrayRecord), or none."""
    if key not in records:
        return {}
    return dict(records[key].to_torch_state_dict())


# ---------------------------------------------------------------------- the server
@dataclass
class FederatedServer(Strategy):
    """lightning_fl's sampler, aggregator and server optimizer as a Flower ``Strategy``.

    Round t (Flower's ``server_round`` t + 1): the participants and their weights ω_i are
    ``aggregator.participation(t, seed, p, sampler)`` with p the aggregator's target
    weights of the nodes' sample counts (:meth:`Aggregator.target_weights`); each
    participant's node is sent θ^t; the replies' models θ_i give the pseudo-gradient
    Δ_t = Σ_i ω_i (θ_i − θ^t), summed in the participants' order as the engine sums it,
    and the aggregator writes θ^{t+1} (FedAvg: θ^t + η Δ_t; Reddi et al.'s server
    optimizers, Algorithm 2). A participant that does not reply is a dropped update, as
    in lightning_fl (its weight is not given to the others)."""

    sampler: ClientSampler
    aggregator: Aggregator
    seed: int
    #: the server's instances of the other plugins: their declared server state (sent to
    #: the participants) and their round-end hooks over the round sums the clients reply
    plugins: list[FederatedCallback] = field(default_factory=list)
    #: the model's parameters (the shape of server state declared like them)
    params: list[torch.Tensor] = field(default_factory=list)
    clients: int | None = None
    out: Path | None = None
    node_timeout: float = 120.0
    #: the fewest connected nodes a round starts with (default: ``clients``, or 1)
    min_available_nodes: int | None = None
    #: the split the nodes evaluate the new model on (None: no evaluation)
    split: str | None = None
    evaluate_every: int = 1
    #: the recipe's federated settings (seed, ...), read by the plugins through their
    #: view; the server's randomness that protects privacy is secret whatever they say
    config: FederatedConfig | None = None
    #: the server's model's tensors, read by the plugins through their view
    tensors: FederatedTensors | None = None
    #: the run's number of rounds (the plugins' ``on_server_start``)
    rounds: int | None = None
    #: the round index of Flower's first ``server_round`` (a resumed run's next round)
    first_round: int = 0
    #: the clients' training counts of the run a checkpoint resumes (checked at ``meet``)
    resumed_counts: np.ndarray | None = None
    #: (m, why): every round must have m participants of weight 1/m (Flower's DP wrappers)
    equal_weights: tuple[int, str] | None = None
    #: entries of every train message's config beside the round's (the clipping mod a
    #: client-side DP wrapper has the nodes apply)
    train_config: dict[str, Any] = field(default_factory=dict)
    #: the recipe's number of clients (the counts sent to the nodes cover them all)
    num_clients: int | None = None
    #: client -> node, and each client's training count, from the nodes' answers
    nodes: dict[int, int] = field(default_factory=dict)
    counts: np.ndarray | None = None
    #: the aggregator's target weights p_i of those counts
    target: torch.Tensor | None = None
    _round: tuple[int, Participation, dict[str, torch.Tensor]] | None = None
    #: the last messages sent, each with its client
    _sent: list[tuple[Message, int]] = field(default_factory=list)

    @property
    def server_halves(self) -> list[FederatedCallback]:
        """The plugins with a half on the server: those that declare server state or round
        sums, which their round-end hook updates (SCAFFOLD's c); another plugin's
        round-end hook tends its client's module, in the node's fit (FedRep's head)."""
        return [p for p in self.plugins
                if p.declared_server_state() or p.declared_round_sums()]  # fmt: skip

    def summary(self) -> None:
        aggregator, sampler = type(self.aggregator).__name__, type(self.sampler).__name__
        logger.info("lightning-fl FederatedServer: %s, %s, seed %d", aggregator, sampler, self.seed)

    def meet(self, grid: Grid) -> None:
        """Wait for the nodes, then ask each which client it trains and its count."""
        deadline = time.monotonic() + self.node_timeout
        wanted = self.clients or 1
        while len(nodes := sorted(grid.get_node_ids())) < wanted:
            if time.monotonic() > deadline:
                raise ServerSideError(
                    f"{len(nodes)} of {wanted} nodes connected within "
                    f"{self.node_timeout:.0f} s: start every site's SuperNode."
                )
            time.sleep(0.2)
        asked = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=node,
                         message_type="query") for node in nodes]  # fmt: skip
        counts: dict[int, int] = {}
        forgetful: list[int] = []  # clients whose node keeps no state across runs
        for reply in grid.send_and_receive(asked, timeout=self.node_timeout):
            metrics = _content(reply, "metrics")
            client = int(metrics["client"])
            if client in counts:
                raise ServerSideError(
                    f"two nodes train client {client}: give each SuperNode its own client."
                )
            self.nodes[client] = reply.metadata.src_node_id
            counts[client] = int(metrics["num-examples"])
            if not int(metrics.get("keeps-state", 0)):
                forgetful.append(client)
        kept = [type(p).__name__ for p in self.plugins if p.declared_client_state()]
        if self.first_round > 0 and kept and forgetful:
            raise ServerSideError(
                f"{', '.join(kept)} keeps each client's state on its node, and the nodes of "
                f"clients {sorted(forgetful)} keep it in the run's Context, which a new Flower "
                "run starts empty: the resumed run would differ from the uninterrupted one. "
                f"Start each SuperNode with --node-config '{STATE_DIR}=<a folder>' from the "
                "run's start, or start the run over (resume=false)."
            )
        size = max(max(counts) + 1, self.num_clients or 0)
        self.counts = np.array([counts.get(c, 0) for c in range(size)], dtype=np.int64)
        if self.resumed_counts is not None and not np.array_equal(self.counts, self.resumed_counts):
            raise ServerSideError(
                f"the nodes report the training counts {self.counts.tolist()}, and the "
                f"checkpoint's run had {self.resumed_counts.tolist()}: resume with the same "
                "recipe, data and nodes, or start the run over without resume."
            )
        self.target = self.aggregator.target_weights(self.counts)  # fixed for the run
        self._start_plugins()

    def _start_plugins(self) -> None:
        """Give the aggregator and the plugins their view of the run (the nodes' counts,
        the recipe's settings with secret randomness: the server's noise protects the
        released model from the sites, who hold the recipe) and run ``on_server_start``."""
        config = self.config or FederatedConfig(
            seed=self.seed, local_steps=None, local_epochs=None, keep_optimizer_state=False,
            max_consecutive_bad_rounds=3, vectorize=False, compile=False,
            max_vectorized_clients=None, local_steps_per_training_step=1,
            allow_new_federation=False,
        )  # fmt: skip
        config = replace(config, secret_randomness=True)
        view = PluginView(ClientStore(), self.counts, self.tensors, config, self.aggregator)
        for plugin in (self.aggregator, *self.plugins):
            plugin.view = view
            plugin.on_server_start(self.rounds)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.counts is None:
            self.meet(grid)
        round_idx = self.first_round + server_round - 1
        participation = self.aggregator.participation(round_idx, self.seed, self.target,
                                                      self.sampler)  # fmt: skip
        self._check_equal_weights(round_idx, participation)
        missing = [c for c in participation.clients if c not in self.nodes]
        if missing:
            raise ServerSideError(
                f"round {round_idx} draws clients {missing}, which no node trains: start a "
                "SuperNode for every client of the recipe."
            )
        connected = self.available(grid, round_idx)
        away = [c for c in participation.clients if self.nodes[c] not in connected]
        if away:  # not sent: dropped updates of this round
            logger.warning("Round %d: the nodes of clients %s are not connected; their "
                           "updates are dropped.", round_idx, away)  # fmt: skip
        self._round = (round_idx, participation, arrays.to_torch_state_dict())
        for plugin in self.plugins:  # declared server state like θ, at zero once
            for name in plugin.server_state_like_params():
                if getattr(plugin, name) is None:
                    setattr(plugin, name, zeros_like(self.params))
        server_state = server_state_arrays(self.plugins)
        counts = self.counts.tolist()  # every client's: the nodes' target weights read them
        down = {**self.train_config, "round": round_idx, "counts": counts}
        if self.rounds is not None:
            down["rounds"] = self.rounds
        if self.aggregator.client_side_hooks():  # its half on the nodes reads its state
            down |= {AGGREGATOR_STATE + k: v
                     for k, v in scalar_server_state(self.aggregator).items()}  # fmt: skip
        messages = []
        for client, weight in zip(participation.clients, participation.weights):
            if client in away:
                continue
            # ω_i: what a node weighs its update by under secure aggregation
            config_record = ConfigRecord({**config, **down, "weight": weight})
            content = RecordDict({"arrays": arrays, "config": config_record})
            if server_state:
                content["server_state"] = ArrayRecord(torch_state_dict=server_state)
            message = Message(content, dst_node_id=self.nodes[client], message_type="train")
            messages.append((message, client))
        self._sent = messages  # their ids, set as Flower sends them, name a node that left
        return [message for message, _ in messages]

    def _check_equal_weights(self, round_idx: int, participation: Participation) -> None:
        if self.equal_weights is None:
            return
        m, why = self.equal_weights
        weights = participation.weights
        if len(weights) != m or any(abs(w * m - 1.0) > 1e-9 for w in weights):
            raise ServerSideError(
                f"round {round_idx} draws {len(weights)} participants of weights "
                f"{[round(w, 6) for w in weights]}, and {why} scales its noise to {m} of "
                f"weight 1/{m} each: give every client data and weighting='uniform', or use "
                "DPFedAvg(noise='central')."
            )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        _, participation, start = self._round
        trained: dict[int, dict[str, torch.Tensor]] = {}
        sums: dict[int, dict[str, torch.Tensor]] = {}
        metrics: dict[int, Any] = {}
        for reply in arrived(replies, self._round[0], self._sent):
            record = _content(reply, "metrics", self.nodes)
            client = int(record["client"])
            metrics[client] = record
            trained[client] = reply.content["arrays"].to_torch_state_dict()
            sums[client] = _arrays(reply.content, "round_sums")
        state = self._round_state(metrics)
        self._add_round_sums(state, [sums[c] for c in participation.clients if c in sums])
        names = float_names(start)
        if self.aggregator.needs_client_updates:  # robust rules read each update's row
            rows = torch.zeros(len(participation.clients), flat_size(state.global_tensors) + 1,
                               dtype=state.global_tensors[0].dtype,
                               device=state.global_tensors[0].device)  # fmt: skip
            state.extra_sums[CLIENT_UPDATES] = [rows]
        for client in participation.clients:
            if client not in trained or client in state.accepted:  # not replied: dropped
                continue
            update = [trained[client][k] - start[k] for k in names]
            update = self.aggregator.receive_update(client, update, state)  # DP's clip
            if not all_finite(update):  # as the engine: dropped, with a warning
                logger.warning("Round %d: client %d sent an update with NaN or Inf; it is "
                               "dropped.", state.round_idx, client)  # fmt: skip
                state.dropped.append(client)
                state.dropped_count += 1
                continue
            torch._foreach_add_(state.update_sum, update, alpha=state.weight_of(client))
            state.accepted.append(client)
            if CLIENT_UPDATES in state.extra_sums:
                rows, row = state.extra_sums[CLIENT_UPDATES][0], state.row_of(client)
                rows[row, :-1], rows[row, -1] = flatten(update), 1.0
        return self._step(state, metrics)

    def aggregate_sum(
        self,
        update_sum: list[torch.Tensor],
        round_sums: dict[str, torch.Tensor],
        metrics: dict[int, Any],
    ) -> tuple[ArrayRecord, MetricRecord]:
        """The round's step from sums alone (secure aggregation: the server never sees an
        update): ``update_sum`` is Σ ω_i (θ_i − θ^t) over the clients in ``metrics`` (those
        that replied, each with its metrics), ``round_sums`` the plugins' declared round
        sums over them, named ``<key>.<i>`` as a ClientApp replies them."""
        state = self._round_state(metrics)
        torch._foreach_add_(state.update_sum, update_sum)
        self._add_round_sums(state, [round_sums])
        return self._step(state, metrics)

    def _round_state(self, replied: dict[int, Any]) -> RoundState:
        """The round's state before its sums: θ^t's floating tensors, zero sums, and the
        participants that did not reply (dropped updates)."""
        round_idx, participation, start = self._round
        global_tensors = [start[k].clone() for k in float_names(start)]
        dropped = [c for c in participation.clients if c not in replied]
        if dropped:
            logger.warning("Round %d: clients %s did not reply; their updates are dropped.",
                           round_idx, dropped)  # fmt: skip
        return RoundState(
            round_idx=round_idx, participation=participation, global_tensors=global_tensors,
            update_sum=[torch.zeros_like(t) for t in global_tensors], model=None, store=None,
            num_clients=len(self.counts), sample_counts=self.counts, target_weights=self.target,
            extra_sums=self._round_sums(), dropped=dropped, dropped_count=len(dropped),
        )  # fmt: skip

    def _step(self, state: RoundState, metrics: dict[int, Any]) -> tuple[ArrayRecord, MetricRecord]:
        """Aggregate (a round without participants only where the aggregator aggregates
        empty rounds), run the plugins' round-end hooks, checkpoint, and summarize."""
        round_idx, participation, start = self._round
        if participation.clients or self.aggregator.aggregates_empty_rounds:
            self.aggregator.aggregate(None, None, state)
            for plugin in self.server_halves:  # after aggregation, as the engine runs them
                plugin.on_round_end(None, None, state)
        new = {**start, **dict(zip(float_names(start), state.global_tensors))}
        if self.out is not None:
            self.save_checkpoint(round_idx, new)
        losses = {c: float(m["train_loss"]) for c, m in metrics.items() if "train_loss" in m}
        counts = {c: int(self.counts[c]) for c in losses}
        summary: dict[str, float] = {"participants": float(len(participation.clients)),
                                     "dropped_updates": float(state.dropped_count)}  # fmt: skip
        if losses:
            total = sum(counts.values()) or 1
            summary["train_loss"] = sum(losses[c] * counts[c] for c in losses) / total
        for plugin in (self.aggregator, *self.plugins):
            summary.update(plugin.round_metrics())
        self.report_round(round_idx, participation.clients, state.dropped, summary)
        return ArrayRecord(torch_state_dict=new), MetricRecord(summary)

    def report_round(
        self, round_idx: int, clients: Sequence[int], dropped: Sequence[int], summary: dict
    ) -> None:
        """Say the round on the server's console (Flower's log: ``flwr run --stream``,
        ``flwr log RUN``) and append it to ``<out>/rounds.csv``: round r of R, its
        participants, the dropped updates and the training loss (and the plugins'
        metrics, in the round's ``MetricRecord``)."""
        loss = summary.get("train_loss")
        shown = "n/a" if loss is None else f"{loss:.6g}"
        total = "?" if self.rounds is None else str(self.rounds - 1)
        flower_log(INFO, "lightning-fl: round %d/%s: clients %s, dropped %s, train_loss %s",
                   round_idx, total, list(clients), list(dropped), shown)  # fmt: skip
        if self.out is not None:
            row = [round_idx, " ".join(map(str, clients)), " ".join(map(str, dropped)),
                   "" if loss is None else loss]  # fmt: skip
            header = ["round", "participants", "dropped", "train_loss"]
            append_csv(str(self.out / "rounds.csv"), header, [row])

    def save_checkpoint(self, round_idx: int, model: dict[str, torch.Tensor]) -> None:
        """``<out>/server_checkpoint.pt`` after round ``round_idx``: θ^{t+1}, the
        aggregator's and the plugins' declared server state (a server optimizer's moments,
        SCAFFOLD's c, DP-FedAvg's clip norm), the sampler's state and the clients' counts;
        tensors and plain values only (read back with ``weights_only=True``), replaced
        whole (a crash mid-write leaves the previous round's)."""
        self.out.mkdir(parents=True, exist_ok=True)
        # host: the counts are bookkeeping, saved beside the model
        counts = torch.from_numpy(self.counts)
        state = {
            "round": round_idx, "model": model, "counts": counts,
            "aggregator": self.aggregator.state_dict(), "sampler": self.sampler.state_dict(),
            "plugins": {type(p).__name__: p.state_dict() for p in self.plugins},
        }  # fmt: skip
        path = self.out / CHECKPOINT
        torch.save(state, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)

    def resume(self, checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Continue after the checkpoint's round: restore the server's state and return
        its model. Where a plugin keeps client state (SCAFFOLD's c_i), every node must
        keep it in a folder (``state-dir``: a new Flower run starts its ``Context``
        empty), checked when the nodes answer (:meth:`meet`)."""
        self.first_round = int(checkpoint["round"]) + 1
        self.resumed_counts = checkpoint["counts"].numpy()
        self.aggregator.load_state_dict(checkpoint["aggregator"])
        self.sampler.load_state_dict(checkpoint["sampler"])
        for plugin in self.plugins:
            plugin.load_state_dict(checkpoint["plugins"][type(plugin).__name__])
        return checkpoint["model"]

    def _round_sums(self) -> dict[str, list[torch.Tensor]]:
        """The aggregator's and the plugins' declared round sums, at zero."""
        return zero_round_sums([self.aggregator, *self.plugins], self.params)

    def round_sum_shapes(self) -> dict[str, tuple[int, ...]]:
        """The declared round sums' parts, named ``<key>.<i>`` as a ClientApp replies
        them, and their shapes."""
        return {f"{key}.{i}": tuple(part.shape) for key, parts in self._round_sums().items()
                for i, part in enumerate(parts)}  # fmt: skip

    def _add_round_sums(self, state: RoundState, parts: Sequence[dict[str, torch.Tensor]]) -> None:
        """Add each reply's round sums (named ``<key>.<i>``), in the given order (the
        participants': the order in which one process adds them)."""
        for part in parts:
            for key, total in state.extra_sums.items():
                if f"{key}.0" in part:
                    torch._foreach_add_(total, [part[f"{key}.{i}"] for i in range(len(total))])

    def available(self, grid: Grid, round_idx: int) -> set[int]:
        """The connected nodes of the run's clients, once at least
        ``min_available_nodes`` are (waiting up to ``node_timeout`` seconds)."""
        least = self.min_available_nodes or self.clients or 1
        deadline = time.monotonic() + self.node_timeout
        while True:
            connected = set(grid.get_node_ids()) & set(self.nodes.values())
            if len(connected) >= least:
                return connected
            if time.monotonic() > deadline:
                gone = sorted(c for c, node in self.nodes.items() if node not in connected)
                raise ServerSideError(
                    f"round {round_idx}: {len(connected)} nodes are connected, fewer than "
                    f"min_available_nodes={least} (the nodes of clients {gone} are not): "
                    "restart them, or lower min-available-nodes."
                )
            time.sleep(0.2)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """θ^{t+1} to every connected client's node with data of ``split`` (every
        ``evaluate_every`` rounds; none when ``split`` is None)."""
        if self.split is None or server_round % self.evaluate_every:
            return []
        connected = set(grid.get_node_ids())
        down = {**config, "split": self.split, "counts": self.counts.tolist(),
                "round": self.first_round + server_round - 1}  # fmt: skip
        content = RecordDict({"arrays": arrays, "config": ConfigRecord(down)})
        if server_state := server_state_arrays(self.plugins):
            content["server_state"] = ArrayRecord(torch_state_dict=server_state)
        self._sent = [(Message(content, dst_node_id=node, message_type="evaluate"), client)
                      for client, node in sorted(self.nodes.items())
                      if node in connected]  # fmt: skip
        return [message for message, _ in self._sent]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The clients' metrics, weighted by their samples (``<m>/weighted``, lightning_fl's
        weighted mean over clients) and uniform (``<m>/uniform``), written with the round
        to ``<out>/evaluation.csv``."""
        round_idx = self.first_round + server_round - 1
        reports = [_content(r, "metrics", self.nodes)
                   for r in arrived(replies, round_idx, self._sent)]  # fmt: skip
        reports = [r for r in reports if int(r["num-examples"]) > 0]
        if not reports:
            return None
        counts = [int(r["num-examples"]) for r in reports]
        names = sorted({k for r in reports for k in r.keys()} - {"client", "num-examples"})
        summary: dict[str, float] = {"clients": float(len(reports))}
        for name in names:
            values = [float(r[name]) for r in reports]
            summary[f"{name}/weighted"] = sum(v * n for v, n in zip(values, counts)) / sum(counts)
            summary[f"{name}/uniform"] = sum(values) / len(values)
        if self.out is not None:
            header = ["round", *summary]
            row = [round_idx, *(f"{v:.10g}" for v in summary.values())]
            append_csv(str(self.out / "evaluation.csv"), header, [row])
        return MetricRecord(summary)


#: Flower's error codes of a node that left (its SuperNode stopped, or its ClientApp's
#: process was killed): a dropped update, not a failed run
NODE_GONE = (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
             ErrorCode.NODE_UNAVAILABLE, ErrorCode.CLIENT_APP_CRASHED)  # fmt: skip


def arrived(
    replies: Iterable[Message], round_idx: int, sent: Sequence[tuple[Message, int]] = ()
) -> list[Message]:
    """The replies with content; a node that left is logged, naming its client (``sent``:
    the messages sent, each with its client; Flower's error reply comes from the
    SuperLink and names the message it answers), and left out (its client a dropped
    update); any other error (the ClientApp raised) stops the run, naming it."""
    clients = {m.metadata.message_id: c for m, c in sent if m.metadata.message_id}
    kept = []
    for reply in replies:
        if reply.has_error() and reply.error.code in NODE_GONE:
            client = clients.get(reply.metadata.reply_to_message_id)
            who = "a node" if client is None else f"client {client}'s node"
            logger.warning("Round %d: %s left (%s); its update is dropped.", round_idx, who,
                           reply.error.reason)  # fmt: skip
            continue
        kept.append(reply)
    return kept


def _content(reply: Message, key: str, nodes: dict[int, int] | None = None) -> Any:
    """``reply``'s record ``key``; an error reply stops the run, naming the node's client
    (``nodes``: client -> node) and Flower's reason."""
    if reply.has_error():
        node = reply.metadata.src_node_id
        client = {n: c for c, n in (nodes or {}).items()}.get(node)
        who = f"the node {node}" if client is None else f"client {client}'s node ({node})"
        raise ServerSideError(f"{who} failed: {reply.error.reason}")
    return reply.content[key]


def serve(settings: Settings, grid: Grid) -> dict[str, torch.Tensor]:
    """The server's run: the recipe's initial model, sampler, seed, aggregator, other
    plugins and number of rounds, through :class:`FederatedServer`; returns the final
    model."""
    cli = instantiate(settings, _QUIET)
    strategy = cli.trainer.strategy
    aggregator = recipe_aggregator(cli.trainer.callbacks)
    plugins = client_plugins(cli.trainer.callbacks)
    split = settings.evaluate or None
    if split == "val" and cli.trainer.limit_val_batches == 0:
        split = None  # the recipe validates nothing during a fit (FLamby's)
    check_server_side(aggregator, plugins, strategy.sampler, split)
    out = Path(settings.out) if settings.out else None
    params = [p.detach().cpu().clone() for p in cli.model.parameters()]
    server = FederatedServer(strategy.sampler, aggregator, strategy.config.seed, plugins, params,
                             settings.clients, out, settings.node_timeout,
                             settings.min_available_nodes, split, config=strategy.config,
                             tensors=FederatedTensors(cli.model),
                             rounds=cli.trainer.max_epochs,
                             num_clients=cli.datamodule.num_clients)  # fmt: skip
    initial = {k: v.detach().cpu() for k, v in cli.model.state_dict().items()}
    if settings.resume:
        initial = server.resume(read_checkpoint(out))
        flower_log(INFO, "lightning-fl: the server resumed from its checkpoint of round %d",
                    server.first_round - 1)  # fmt: skip
    rounds = cli.trainer.max_epochs - server.first_round
    if rounds <= 0:
        flower_log(INFO, "lightning-fl: the checkpoint's run had its %d rounds",
                    server.first_round)  # fmt: skip
        return initial
    arrays = ArrayRecord(torch_state_dict=initial)
    integers = [name for name in initial if name not in float_names(initial)]
    if settings.local_dp is not None:  # the nodes' LocalDpMod
        flower_dp.check_local(settings.local_dp, settings.dp, aggregator, plugins,
                              bool(settings.secure), integers)  # fmt: skip
    if settings.dp is not None:  # Flower's wrapper, where its calibration holds
        flower_dp.check(settings.dp, aggregator, server.sampler, plugins, bool(settings.secure),
                        integers)  # fmt: skip
        wrapped = flower_dp.wrap(settings.dp, server, settings.clients or 1)
        final = wrapped.start(grid, arrays, rounds, settings.round_timeout).arrays
    elif settings.secure is not None:
        check_secure(aggregator, plugins, settings.secure.clipping_range)
        final = secure_rounds.run(server, grid, arrays, rounds, settings.secure,
                                  settings.round_timeout)  # fmt: skip
    else:
        final = server.start(grid, arrays, rounds, settings.round_timeout).arrays
    final = final.to_torch_state_dict()
    if out is not None:
        torch.save(final, out / "final_model.pt")
    return final


def read_checkpoint(out: Path | None) -> dict[str, Any]:
    """The server's checkpoint in ``out`` (tensors and plain values only)."""
    path = None if out is None else out / CHECKPOINT
    if path is None or not path.exists():
        raise ServerSideError(
            f"resume=true, and there is no {CHECKPOINT} in the run config's out "
            f"({out}): give the out of the run to resume, or start over with resume=false."
        )
    return torch.load(path, weights_only=True)


#: hooks a plugin's server half may not need in the server-side mode (yet): what runs at
#: a round's start or around its sum needs the relay mode's engine
SERVER_HOOKS = ("on_round_start", "on_before_round_sum", "sum_over_ranks")


#: an aggregator's client-side hooks that a node runs in its fit (:class:`AggregatorOnNode`)
NODE_HOOKS = ("transform_update",)


#: a plugin's hooks around a client's evaluation, which the nodes' evaluation skips
EVALUATION_HOOKS = ("on_client_evaluation_start", "on_client_evaluation_end")


def check_server_side(
    aggregator: Aggregator,
    plugins: Sequence[FederatedCallback],
    sampler: ClientSampler | None = None,
    split: str | None = None,
) -> None:
    """Refuse, naming it, an aggregator that acts beside its clients
    (:meth:`Aggregator.client_side_hooks` other than :data:`NODE_HOOKS`: the ClientApps
    train without it) or pools them, a sampler that reads the round's updates or losses,
    a plugin whose server half needs more than its declared server state, round sums and
    round-end hook, and, where the nodes evaluate (``split``), an observer of every
    client's evaluation together (membership inference; a plugin that personalizes the
    evaluated model is evaluated on each node, :func:`evaluate_personalized`)."""
    if aggregator.pools_clients:
        raise ServerSideError(
            f"{type(aggregator).__name__} trains on every client's data in one process (the "
            "centralized baseline), not on the nodes: run it with lightning-fl fit."
        )
    if sampler is not None and (sampler.needs_updates or sampler.needs_losses):
        raise ServerSideError(
            f"{type(sampler).__name__} reads the round's updates or the clients' losses, "
            "which the server-side mode does not gather yet: use UniformSampler, MDSampler, "
            "PoissonSampler or FullParticipation, or the relay mode."
        )
    for plugin in plugins if split is not None else ():
        if plugin.evaluation_observer:
            raise ServerSideError(
                f"{type(plugin).__name__} observes every client's evaluation together, and "
                'each node evaluates its own client: set the run config\'s evaluate="" '
                "(and evaluate with lightning-fl test), or use the relay mode."
            )
    if own := [h for h in aggregator.client_side_hooks() if h not in NODE_HOOKS]:
        raise ServerSideError(
            f"{type(aggregator).__name__} does not run in the server-side mode yet: its "
            f"{', '.join(own)} run beside the clients. Use FedAvg, FedAvgM, FedAdam, FedYogi, "
            "FedAdagrad or DPFedAvg(noise='central' or 'local'), or the relay mode."
        )
    for plugin in plugins:
        name = type(plugin).__name__
        hooks = plugin.overridden_hooks(SERVER_HOOKS)
        if hooks or plugin.declared_round_rows() or plugin.undeclared_client_state is not None:
            why = ", ".join(hooks) or "per-participant rows or undeclared client state"
            raise ServerSideError(
                f"{name} does not run in the server-side mode yet ({why}): use the relay "
                "mode, whose sites run every hook."
            )
        other = [n for n in plugin.declared_server_state()
                 if n not in plugin.server_state_like_params()
                 and not isinstance(getattr(plugin, n), (torch.Tensor, type(None)))]  # fmt: skip
        if other:
            raise ServerSideError(
                f"{name}'s server state {other} is not tensors: the server-side mode sends "
                "only tensors to the clients. Use the relay mode."
            )


def check_secure(
    aggregator: Aggregator,
    plugins: Sequence[FederatedCallback] = (),
    clipping_range: float | None = None,
) -> None:
    """Refuse an aggregator that reads each update on the server, which SecAgg+ hides,
    and a round sum whose declared bound on one client's entries (a count's 1) SecAgg+'s
    ``clipping_range`` would clip."""
    if aggregator.reads_each_update():
        raise ServerSideError(
            f"{type(aggregator).__name__} reads each client's update on the server, and "
            "secagg hides them: run without secagg, or use DPFedAvg(noise='local'), whose "
            "nodes clip and noise their own updates."
        )
    for plugin in (aggregator, *plugins) if clipping_range is not None else ():
        for name in plugin.declared_round_sums():
            bound = plugin.round_sum_bound(name)
            if bound is not None and bound > clipping_range:
                raise ServerSideError(
                    f"{type(plugin).__name__}'s round sum {name!r} reaches {bound:g} a "
                    f"client, and secagg-clipping-range={clipping_range:g} would clip it: "
                    f"set secagg-clipping-range to at least {bound:g}."
                )


def client_mods(local_of: Any) -> list[Any]:
    """The ClientApp's mods: Flower's secaggplus_mod for a secure round's messages, its
    fixedclipping_mod or adaptiveclipping_mod for those of a client-side DP wrapper, and
    its LocalDpMod where the run asks for it (``local_of``: a node's context → the run's
    :class:`~lightning_fl.flower.flower_dp.LocalDP`)."""
    return [secure_mod, flower_dp.dp_mod, flower_dp.local_dp_mod(local_of)]


def make_apps(settings: Settings) -> tuple[ServerApp, ClientApp]:
    """A ServerApp and a ClientApp bound to ``settings`` (Flower's simulation engine:
    ``flwr.simulation.run_simulation``, which passes no run config). A deployment's
    ClientApp is :data:`lightning_fl.flower.client_app.client_app`, which imports this
    module when a message needs it."""
    server = ServerApp()
    client = ClientApp(mods=client_mods(lambda context: settings.local_dp))

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        serve(settings, grid)

    @client.query()
    def _query(message: Message, context: Context) -> Message:
        return answer_query(settings, message, context)

    @client.train()
    def _client_train(message: Message, context: Context) -> Message:
        return train(settings, message, context)

    @client.evaluate()
    def _client_evaluate(message: Message, context: Context) -> Message:
        return evaluate(settings, message, context)

    return server, client


#: the Flower App's ServerApp (its ClientApp: :mod:`lightning_fl.flower.client_app`)
server_app = ServerApp()


@server_app.main()
def _serve_run(grid: Grid, context: Context) -> None:
    serve(Settings.read(context.run_config), grid)
