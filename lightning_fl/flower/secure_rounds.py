"""The server-side mode's training under Flower's SecAgg+ (Bell et al., CCS 2020): the
server learns the sum of the participants' weighted updates, never one of them (issue 77;
README, "Two server models").

Each round, :class:`~lightning_fl.flower.server_side.FederatedServer` draws the
participants and their weights ω_i as usual; Flower's ``SecAggPlusWorkflow`` then runs its
four stages over their nodes (key setup, key shares, masked vectors, unmasking), carrying
the round's ``train`` message in its third stage. Each node's ClientApp, through
:func:`~lightning_fl.flower.client_app.secure_mod` (Flower's ``secaggplus_mod`` for the
messages of a secure round), trains as in the clear mode, and masks
:func:`contribution`: ω_i(θ_i − θ^t) over the model's floating-point entries, then its
plugins' declared round sums (SCAFFOLD's p_i Δc_i),
flattened in an order both sides derive from the recipe. The server unmasks only the
sum over the nodes that replied (:func:`run`), and steps from it
(:meth:`~lightning_fl.flower.server_side.FederatedServer.aggregate_sum`).

What the server sees of a node: its public keys, encrypted key shares for its neighbours,
its masked vector (uniform modulo 2^32 without the others' masks), its key shares at
unmasking, and, in clear, its client id and training loss (Flower's SecAgg+ leaves a
reply's metrics unmasked). A coalition of the server and fewer than
``reconstruction_threshold`` of a node's neighbours learns nothing more of its update.

Precision: SecAgg+ quantizes each coordinate of a node's vector over [−c, c]
(``clipping_range`` c, default 8) to ``quantization_range`` levels (default 2^22) by
stochastic rounding, which is unbiased: each coordinate of the sum carries an error of at
most 2c/2^22 ≈ 3.8e-6 per node; a coordinate beyond ±c is clipped, so choose c above the
largest weighted update. Flower weighs a vector by the node's example count before
quantizing; each node reports 1 (with ``max_weight`` 1), so that weighting keeps every
quantization level, and the unmasked mean times the number of nodes that replied is the sum.

Refused with secure aggregation: an aggregator that reads each update on the server
(``DPFedAvg``'s central clipping: use its ``noise="local"``, whose nodes clip and noise
their own updates), a round sum whose declared bound a node's entries reach beyond ±c,
and a round of fewer than 2 participants (SecAgg+ hides nothing there).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat
from flwr.server import ServerConfig, SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp import Grid

from lightning_fl.engine.tensors import float_names

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SecureAggregationSettings:
    """Flower's ``SecAggPlusWorkflow`` options (run config ``secagg-*``): a float share
    count or threshold is a fraction of the round's participants or shares."""

    #: each node's secrets are split among this many of the round's nodes (1.0: all)
    num_shares: float | int = 1.0
    #: shares needed to rebuild a node's secret (a coalition this large and the server
    #: could unmask it; a round survives up to num_shares − threshold dropped nodes)
    reconstruction_threshold: float | int = 0.67
    #: c: each coordinate of a node's vector is clipped to [−c, c] before quantization
    clipping_range: float = 8.0
    #: quantization levels over [−c, c]
    quantization_range: int = 2**22

    @classmethod
    def read(cls, run_config: dict[str, Any]) -> SecureAggregationSettings | None:
        """From the run config's ``secagg`` (true/false) and ``secagg-num-shares``,
        ``secagg-threshold``, ``secagg-clipping-range``; None without ``secagg``."""
        if str(run_config.get("secagg", "false")).lower() not in ("true", "1", "yes"):
            return None
        return cls(
            _share(run_config.get("secagg-num-shares", 1.0)),
            _share(run_config.get("secagg-threshold", 0.67)),
            float(run_config.get("secagg-clipping-range", 8.0)),
        )


def _share(value: Any) -> float | int:
    """A count (an integer) or a fraction (a float), as SecAggPlusWorkflow reads them."""
    number = float(value)
    return int(number) if number > 1 and number.is_integer() else number


# ---------------------------------------------------------------------- the nodes
def contribution(
    weight: float,
    start: dict[str, torch.Tensor],
    trained: dict[str, torch.Tensor],
    round_sums: dict[str, torch.Tensor],
) -> list[np.ndarray]:
    """What a node masks: ω_i(θ_i − θ^t) over ``start``'s floating-point entries in its
    order, then its round sums in the order of their names (float64)."""
    update = [weight * (trained[k].double() - start[k].double()) for k in float_names(start)]
    sums = [round_sums[k].double() for k in sorted(round_sums)]
    return [t.numpy() for t in [*update, *sums]]


def secure_reply(message: Message, vector: list[np.ndarray], metrics: dict[str, Any]) -> Message:
    """A secure round's reply, in the form ``secaggplus_mod`` masks (a ``FitRes`` of
    weight 1; the metrics go in clear)."""
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(vector), 1, metrics)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=message)


# ---------------------------------------------------------------------- the server
def run(
    server: Any,
    grid: Grid,
    initial: ArrayRecord,
    rounds: int,
    settings: SecureAggregationSettings,
    timeout: float | None = None,
) -> ArrayRecord:
    """``rounds`` rounds of ``server`` (a FederatedServer) with each round's training
    under SecAgg+, then its evaluation as in the clear mode; returns the final model.
    ``timeout``: the seconds each stage waits for its replies (the run's round timeout:
    a node that has not answered by then has dropped)."""
    arrays = initial
    for server_round in range(1, rounds + 1):
        messages = list(server.configure_train(server_round, arrays, ConfigRecord({}), grid))
        total, metrics = secure_sum(grid, messages, server_round, settings, timeout)
        update_sum, round_sums = split_sum(total, arrays.to_torch_state_dict(),
                                           server.round_sum_shapes())  # fmt: skip
        arrays, _ = server.aggregate_sum(update_sum, round_sums, metrics)
        evaluations = list(server.configure_evaluate(server_round, arrays, ConfigRecord({}), grid))
        if evaluations:
            replies = grid.send_and_receive(evaluations, timeout=timeout)
            server.aggregate_evaluate(server_round, replies)
    return arrays


def secure_sum(
    grid: Grid,
    messages: Sequence[Message],
    server_round: int,
    settings: SecureAggregationSettings,
    timeout: float | None = None,
) -> tuple[list[np.ndarray] | None, dict[int, Any]]:
    """SecAgg+ over the nodes of ``messages`` (each node's round content), each stage
    waiting ``timeout`` seconds at most: the sum of the vectors of the nodes that replied
    (None if none did), and their metrics by client."""
    if len(messages) < 2:
        raise RuntimeError(
            f"round {server_round - 1} has {len(messages)} participant(s) with a node: SecAgg+ "
            "needs at least 2 (one node's sum is its update). Sample more clients a round, "
            "or run without secagg."
        )
    nodes = [m.metadata.dst_node_id for m in messages]
    collector = _Collector(nodes)
    manager = SimpleClientManager()
    for node in nodes:
        manager.register(GridClientProxy(node, grid, run_id=0))
    state = RecordDict({
        MAIN_CONFIGS_RECORD: ConfigRecord({Key.CURRENT_ROUND: server_round}),
        MAIN_PARAMS_RECORD: ArrayRecord(),
    })  # fmt: skip
    context = LegacyContext(Context(0, 0, {}, state, {}), ServerConfig(1), collector, manager)
    workflow = _RoundWorkflow(
        {m.metadata.dst_node_id: m.content for m in messages},
        num_shares=settings.num_shares, reconstruction_threshold=settings.reconstruction_threshold,
        max_weight=1.0, clipping_range=settings.clipping_range,
        quantization_range=settings.quantization_range, timeout=timeout,
    )  # fmt: skip
    workflow(grid, context)
    if collector.mean is None:
        return None, {}
    replied = len(collector.metrics)  # the mean is over the nodes that replied
    return [a * replied for a in collector.mean], collector.metrics


def split_sum(
    total: list[np.ndarray] | None,
    start: dict[str, torch.Tensor],
    sum_shapes: dict[str, tuple[int, ...]],
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The unmasked sum back as Σ ω_i Δ_i (shaped and typed like ``start``'s floating
    entries) and the round sums (``sum_shapes``: their names and shapes, in the order of
    :func:`contribution`)."""
    names = float_names(start)
    if total is None:
        return [torch.zeros_like(start[k]) for k in names], {}
    # on θ^t's device: the server's arrays (Flower's records are host-side)
    update = [torch.as_tensor(np.asarray(a), device=start[k].device).reshape(start[k].shape)
              .to(start[k].dtype) for k, a in zip(names, total)]  # fmt: skip
    rest = total[len(names) :]
    keys = sorted(sum_shapes)
    if len(rest) != len(keys):
        raise RuntimeError(
            f"the nodes' vectors hold {len(rest)} round sums and the server's plugins declare "
            f"{len(keys)}: run the same recipe on the server and every node."
        )
    # host: the round sums are added into the server's totals, which move them as needed
    sums = {k: torch.from_numpy(np.asarray(a)).reshape(sum_shapes[k]) for k, a in zip(keys, rest)}
    return update, sums


class _Collector(LegacyStrategy):
    """The legacy Strategy that SecAggPlusWorkflow drives: it selects the round's nodes
    and keeps the unmasked mean and each reply's metrics (aggregation is lightning_fl's)."""

    def __init__(self, nodes: Sequence[int]) -> None:
        self.nodes = list(nodes)
        self.mean: list[np.ndarray] | None = None
        self.metrics: dict[int, Any] = {}

    def configure_fit(self, server_round, parameters, client_manager):
        proxies = client_manager.all()
        empty = FitIns(Parameters([], ""), {})
        return [(proxies[str(node)], empty) for node in self.nodes]

    def aggregate_fit(self, server_round, results, failures):
        from flwr.common import parameters_to_ndarrays

        for _, fitres in results:
            self.metrics[int(fitres.metrics["client"])] = dict(fitres.metrics)
        if results:
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}

    def initialize_parameters(self, client_manager):
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


class _RoundWorkflow(SecAggPlusWorkflow):
    """SecAgg+ whose third stage carries each node's own round content (θ^t, its weight
    ω_i, the plugins' server state) rather than a legacy ``FitIns``."""

    def __init__(self, contents: dict[int, RecordDict], **options: Any) -> None:
        super().__init__(**options)
        self.contents = contents

    def setup_stage(self, grid, context, state) -> bool:
        carried = super().setup_stage(grid, context, state)
        state.nid_to_fitins = {node: self.contents[node] for node in state.nid_to_fitins}
        return carried


__all__ = [
    "SecureAggregationSettings",
    "contribution",
    "run",
    "secure_reply",
    "secure_sum",
    "split_sum",
]
