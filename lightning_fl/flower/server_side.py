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
``client`` (a SuperNode's ``--node-config client=N``).

What crosses the network: at the start each node says which client it trains and its
number of training samples (a ``query``); each round the server sends each participant
θ^t and the round, and each replies its trained model θ_i, its sample count and its
training loss. The server sees every participant's model: use the relay mode (the server
sees only sums) where the server is not trusted with them.

Not built yet (issue 77): plugins with client state (SCAFFOLD's c_i) or server state
read by the clients, the evaluation messages, ``min_available_nodes``, Flower's mods and
DP wrappers, a server checkpoint to resume from.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from lightning_fl.engine.plugins import Aggregator, FedAvg, RoundState
from lightning_fl.systems.samplers import ClientSampler, FullParticipation, Participation

logger = logging.getLogger(__name__)


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

    @classmethod
    def read(cls, run_config: dict[str, Any]) -> Settings:
        if "recipe" not in run_config:
            raise ServerSideError(
                "the Flower run config has no 'recipe': submit the run with flwr run ... "
                "--run-config 'recipe=\"<the recipe's path>\"'."
            )
        overrides = str(run_config.get("overrides", "")).split()
        clients = run_config.get("clients")
        return cls(str(run_config["recipe"]), tuple(overrides),
                   None if clients is None else int(clients), run_config.get("out"))  # fmt: skip


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


def client_count(settings: Settings, client: int) -> int:
    """The client's number of training samples (what the sampler's weights read)."""
    cli = instantiate(settings, _QUIET)
    dm = cli.datamodule
    dm.prepare_data()
    dm.setup("fit")
    if not 0 <= client < dm.num_clients:
        raise ServerSideError(
            f"this node trains client {client}, and the recipe has {dm.num_clients} "
            f"clients (0-{dm.num_clients - 1}): fix the node's client or partition-id."
        )
    return int(dm.sample_counts("train")[client])


def train_client(
    settings: Settings, client: int, round_idx: int, start: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``client``'s model after its local training of round ``round_idx`` from ``start``,
    and its training loss: one lightning_fl fit of that round, the client alone, with the
    recipe's module, data, local steps, seed and client-side plugins."""
    from lightning.pytorch.callbacks import Checkpoint

    sampler = {"class_path": f"{__name__}.OneClient", "init_args": {"client": client}}
    one_round = ["--trainer.max_epochs", "1",
                 "--trainer.strategy.init_args.first_round", str(round_idx),
                 "--trainer.strategy.init_args.sampler", json.dumps(sampler)]  # fmt: skip
    cli = instantiate(settings, [*_QUIET, *one_round])
    trainer = cli.trainer
    # the recipe's aggregator and server optimizer run on the server; here FedAvg with
    # weight 1 and server_lr 1 leaves the client's model θ^t + (θ_i − θ^t) in the module
    kept = [cb for cb in trainer.callbacks if not isinstance(cb, (Aggregator, Checkpoint))]
    trainer.callbacks = [*kept, FedAvg(weighting="uniform")]
    cli.model.load_state_dict(start)
    trainer.fit(cli.model, datamodule=cli.datamodule)
    metrics = {
        name: float(value) for name, value in trainer.callback_metrics.items()
        if name == "train_loss"
    }  # fmt: skip
    return {k: v.detach().cpu() for k, v in cli.model.state_dict().items()}, metrics


#: a ClientApp's fits write nothing and say nothing
_QUIET = ("--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
          "--trainer.enable_model_summary", "false",
          "--trainer.strategy.init_args.enable_plots", "false")  # fmt: skip


def _answer_query(settings: Settings, message: Message, context: Context) -> Message:
    client = node_client(context.node_config)
    record = MetricRecord({"client": client, "num-examples": client_count(settings, client)})
    return Message(RecordDict({"metrics": record}), reply_to=message)


def _train(settings: Settings, message: Message, context: Context) -> Message:
    client = node_client(context.node_config)
    round_idx = int(message.content["config"]["round"])
    start = message.content["arrays"].to_torch_state_dict()
    trained, metrics = train_client(settings, client, round_idx, start)
    reply = RecordDict({
        "arrays": ArrayRecord(torch_state_dict=trained),
        "metrics": MetricRecord({"client": client, **metrics}),
    })  # fmt: skip
    return Message(reply, reply_to=message)


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
    clients: int | None = None
    out: Path | None = None
    node_timeout: float = 120.0
    #: client -> node, and each client's training count, from the nodes' answers
    nodes: dict[int, int] = field(default_factory=dict)
    counts: np.ndarray | None = None
    _round: tuple[int, Participation, dict[str, torch.Tensor]] | None = None

    def summary(self) -> None:
        aggregator, sampler = type(self.aggregator).__name__, type(self.sampler).__name__
        logger.info("lightning-fl FederatedServer: %s, %s, seed %d", aggregator, sampler, self.seed)

    def meet(self, grid: Grid) -> None:
        """Wait for the nodes, then ask each which client it trains and its count."""
        deadline = time.monotonic() + self.node_timeout
        while len(nodes := sorted(grid.get_node_ids())) < (self.clients or 1):
            if time.monotonic() > deadline:
                raise ServerSideError(
                    f"{len(nodes)} of {self.clients} nodes connected within "
                    f"{self.node_timeout:.0f} s: start every site's SuperNode."
                )
            time.sleep(0.2)
        asked = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=node,
                         message_type="query") for node in nodes]  # fmt: skip
        counts: dict[int, int] = {}
        for reply in grid.send_and_receive(asked, timeout=self.node_timeout):
            metrics = _content(reply, "metrics")
            client = int(metrics["client"])
            if client in counts:
                raise ServerSideError(
                    f"two nodes train client {client}: give each SuperNode its own client."
                )
            self.nodes[client] = reply.metadata.src_node_id
            counts[client] = int(metrics["num-examples"])
        size = max(counts) + 1
        self.counts = np.array([counts.get(c, 0) for c in range(size)], dtype=np.int64)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.counts is None:
            self.meet(grid)
        round_idx = server_round - 1
        p = self.aggregator.target_weights(self.counts)
        participation = self.aggregator.participation(round_idx, self.seed, p, self.sampler)
        missing = [c for c in participation.clients if c not in self.nodes]
        if missing:
            raise ServerSideError(
                f"round {round_idx} draws clients {missing}, which no node trains: start a "
                "SuperNode for every client of the recipe."
            )
        self._round = (round_idx, participation, arrays.to_torch_state_dict())
        content = RecordDict({"arrays": arrays,
                              "config": ConfigRecord({**config, "round": round_idx})})  # fmt: skip
        return [Message(content, dst_node_id=self.nodes[c], message_type="train")
                for c in participation.clients]  # fmt: skip

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        round_idx, participation, start = self._round
        trained: dict[int, dict[str, torch.Tensor]] = {}
        losses: dict[int, float] = {}
        for reply in replies:
            metrics = _content(reply, "metrics")
            client = int(metrics["client"])
            trained[client] = reply.content["arrays"].to_torch_state_dict()
            if "train_loss" in metrics:
                losses[client] = float(metrics["train_loss"])
        names = [k for k, v in start.items() if v.is_floating_point()]
        global_tensors = [start[k].clone() for k in names]
        update_sum = [torch.zeros_like(t) for t in global_tensors]
        for client, weight in zip(participation.clients, participation.weights):
            if client in trained:  # a node that did not reply: a dropped update
                update = [trained[client][k] - start[k] for k in names]
                torch._foreach_add_(update_sum, update, alpha=weight)
        dropped = [c for c in participation.clients if c not in trained]
        if dropped:
            logger.warning("Round %d: clients %s did not reply; their updates are dropped.",
                           round_idx, dropped)  # fmt: skip
        state = RoundState(
            round_idx=round_idx, participation=participation, global_tensors=global_tensors,
            update_sum=update_sum, model=None, store=None, num_clients=len(self.counts),
            sample_counts=self.counts, target_weights=self.aggregator.target_weights(self.counts),
            dropped=dropped, dropped_count=len(dropped),
        )  # fmt: skip
        self.aggregator.aggregate(None, None, state)
        new = {**start, **dict(zip(names, state.global_tensors))}
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            torch.save({"round": round_idx, "state_dict": new}, self.out / "server_model.pt")
        counts = {c: int(self.counts[c]) for c in losses}
        summary: dict[str, float] = {"participants": float(len(participation.clients)),
                                     "dropped_updates": float(len(dropped))}  # fmt: skip
        if losses:
            total = sum(counts.values()) or 1
            summary["train_loss"] = sum(losses[c] * counts[c] for c in losses) / total
        logger.info("round %d: %d participants, train_loss %s", round_idx,
                    len(participation.clients), summary.get("train_loss"))  # fmt: skip
        return ArrayRecord(torch_state_dict=new), MetricRecord(summary)

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []  # evaluation messages: not built yet (issue 77)

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None


def _content(reply: Message, key: str) -> Any:
    if reply.has_error():
        raise ServerSideError(f"the node {reply.metadata.src_node_id} failed: {reply.error.reason}")
    return reply.content[key]


def serve(settings: Settings, grid: Grid) -> dict[str, torch.Tensor]:
    """The server's run: the recipe's initial model, sampler, seed, aggregator and
    number of rounds, through :class:`FederatedServer`; returns the final model."""
    cli = instantiate(settings, _QUIET)
    strategy = cli.trainer.strategy
    aggregators = [cb for cb in cli.trainer.callbacks if isinstance(cb, Aggregator)]
    aggregator = aggregators[0] if aggregators else FedAvg()
    if type(aggregator).aggregate is Aggregator.aggregate or not _server_only(aggregator):
        raise ServerSideError(
            f"{type(aggregator).__name__} does not run in the server-side mode yet: it "
            "has client-side hooks. Use FedAvg, FedAvgM, FedAdam, FedYogi or FedAdagrad, "
            "or the relay mode."
        )
    out = Path(settings.out) if settings.out else None
    server = FederatedServer(strategy.sampler, aggregator, strategy.config.seed,
                             settings.clients, out, settings.node_timeout)  # fmt: skip
    initial = {k: v.detach().cpu() for k, v in cli.model.state_dict().items()}
    result = server.start(grid, ArrayRecord(torch_state_dict=initial),
                          num_rounds=cli.trainer.max_epochs)  # fmt: skip
    final = result.arrays.to_torch_state_dict()
    if out is not None:
        torch.save(final, out / "final_model.pt")
    return final


def _server_only(aggregator: Aggregator) -> bool:
    """Whether the aggregator does its work in ``aggregate`` alone (the FedAvg family):
    no client or round hooks of its own, which would need to run on the nodes."""
    hooks = ("on_client_start", "on_client_end", "transform_update", "receive_update",
             "on_round_start", "on_round_end")  # fmt: skip
    return all(getattr(type(aggregator), h) is getattr(Aggregator, h) for h in hooks)


def make_apps(settings: Settings) -> tuple[ServerApp, ClientApp]:
    """A ServerApp and a ClientApp bound to ``settings`` (Flower's simulation engine:
    ``flwr.simulation.run_simulation``, which passes no run config)."""
    server, client = ServerApp(), ClientApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        serve(settings, grid)

    @client.query()
    def _query(message: Message, context: Context) -> Message:
        return _answer_query(settings, message, context)

    @client.train()
    def _client_train(message: Message, context: Context) -> Message:
        return _train(settings, message, context)

    return server, client


server_app = ServerApp()
client_app = ClientApp()


@server_app.main()
def _serve_run(grid: Grid, context: Context) -> None:
    serve(Settings.read(context.run_config), grid)


@client_app.query()
def _query_run(message: Message, context: Context) -> Message:
    return _answer_query(Settings.read(context.run_config), message, context)


@client_app.train()
def _train_run(message: Message, context: Context) -> Message:
    return _train(Settings.read(context.run_config), message, context)
