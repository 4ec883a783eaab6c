"""The server-side mode (issue 77, lightning_fl.flower.server_side): a Flower Strategy
that runs lightning_fl's sampler, aggregator and server optimizer in the ServerApp, and
ClientApps that train. Under Flower's simulation engine (Ray) the heart recipes' models
equal lightning-fl's own 1-process simulation; the Strategy's arithmetic is checked by
hand with a grid that answers for the nodes."""

from __future__ import annotations

import csv
import logging
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr", reason="lightning-fl[flower] is not installed")

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from lightning_fl.callbacks import SCAFFOLD, FedAdam, FedAvg, FedProx  # noqa: E402
from lightning_fl.engine.plugins import FederatedCallback  # noqa: E402
from lightning_fl.flower import server_side  # noqa: E402
from lightning_fl.flower.server_side import (  # noqa: E402
    FederatedServer,
    ServerSideError,
    Settings,
)
from lightning_fl.systems.samplers import FullParticipation  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEART = ROOT.parent / "shared" / "data" / "fed_heart_disease"
needs_heart = pytest.mark.skipif(not HEART.exists(), reason=f"real data not found at {HEART}")


class Reply:
    """What the Strategy reads of a node's reply."""

    class Metadata:
        def __init__(self, node: int) -> None:
            self.src_node_id = node

    def __init__(self, node: int, content: RecordDict) -> None:
        self.metadata, self.content = self.Metadata(node), content

    def has_error(self) -> bool:
        return False


class Grid:
    """Four nodes (100 + client) whose clients hold ``counts`` training samples; a node
    "trains" by moving every weight by (client + 1)·(round + 1)·0.1; ``silent`` nodes do
    not answer the train message of ``silent_round``."""

    def __init__(self, counts: list[int], silent: set[int] = frozenset(), silent_round=-1):
        self.counts, self.silent, self.silent_round = counts, silent, silent_round
        self.sent: list[tuple[int, str, list[int]]] = []
        self.server_states: list[dict[str, torch.Tensor]] = []
        self.seen_sum = False

    #: nodes not connected (a SuperNode stopped), from the next train message on
    gone: set[int] = frozenset()

    def get_node_ids(self) -> list[int]:
        return [100 + c for c in range(len(self.counts)) if 100 + c not in self.gone]

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for message in messages:
            node, kind = message.metadata.dst_node_id, message.metadata.message_type
            client = node - 100
            if kind == "query":
                metrics = MetricRecord({"client": client, "num-examples": self.counts[client]})
                replies.append(Reply(node, RecordDict({"metrics": metrics})))
                continue
            if kind == "evaluate":  # loss c and accuracy 1/(c + 1) on n_c samples
                metrics = MetricRecord({"client": client, "num-examples": self.counts[client],
                                        "val_loss": float(client),
                                        "val_acc": 1.0 / (client + 1)})  # fmt: skip
                replies.append(Reply(node, RecordDict({"metrics": metrics})))
                continue
            round_idx = int(message.content["config"]["round"])
            self.sent.append((round_idx, kind, client))
            if client in self.silent and round_idx == self.silent_round:
                continue
            start = message.content["arrays"].to_torch_state_dict()
            step = 0.1 * (client + 1) * (round_idx + 1)
            trained = {k: v + step for k, v in start.items()}
            metrics = MetricRecord({"client": client, "train_loss": float(client)})
            content = RecordDict({"arrays": ArrayRecord(torch_state_dict=trained),
                                  "metrics": metrics})  # fmt: skip
            if self.seen_sum:  # a plugin's round sum of shape (1,), in float64
                content["round_sums"] = ArrayRecord(torch_state_dict={
                    "Seen.seen.0": torch.tensor([client + 0.5], dtype=torch.float64)})  # fmt: skip
            if "server_state" in message.content:  # a SCAFFOLD client: its Σ p_i Δc_i
                self.server_states.append(message.content["server_state"].to_torch_state_dict())
                sums = {
                    "SCAFFOLD.control_delta.0": torch.full((2,), float(client + 1)),
                    "SCAFFOLD.control_delta.1": torch.full((1,), -float(client)),
                }
                content["round_sums"] = ArrayRecord(torch_state_dict=sums)
            replies.append(Reply(node, content))
        return replies


def replies_moved(seeding=None):
    """A ClientApp's next step that replies w = (3, 4) (an update of norm 5 from 0) for
    client 0, after ``seeding()`` (what the node's training does to NumPy's state)."""
    from flwr.app import Message

    def trained(msg, context):
        if seeding is not None:
            seeding()
        content = {"arrays": ArrayRecord(torch_state_dict={"w": torch.tensor([3.0, 4.0])}),
                   "metrics": MetricRecord({"client": 0})}  # fmt: skip
        return Message(RecordDict(content), reply_to=msg)

    return trained


@pytest.fixture
def flower_run(monkeypatch):
    """Flower builds messages only inside a run: a run id for the test's messages."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 7)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 3)


def test_the_strategy_applies_the_samplers_weights_by_hand_and_drops_a_silent_node(flower_run):
    """FedAvg over 4 clients of 10, 30, 0 and 60 samples, 3 rounds, client 3's node
    silent in round 1: ω = n_i / Σ n = (0.1, 0.3, 0, 0.6), client 2 (no data) never sent a
    message, and θ^{t+1} = θ^t + Σ_{i replied} ω_i (θ_i − θ^t), not renormalized."""
    grid = Grid([10, 30, 0, 60], silent={3}, silent_round=1)
    server = FederatedServer(FullParticipation(), FedAvg(), seed=0, clients=4)
    theta = {"steps": torch.tensor(3), "w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    arrays = ArrayRecord(torch_state_dict=theta)
    expected = {k: v.clone() for k, v in theta.items()}
    for server_round in (1, 2, 3):
        messages = server.configure_train(server_round, arrays, ConfigRecord({}), grid)
        assert sorted(m.metadata.dst_node_id for m in messages) == [100, 101, 103]
        arrays, metrics = server.aggregate_train(server_round, grid.send_and_receive(messages))
        r = server_round - 1
        moved = sum(w * 0.1 * (c + 1) * (r + 1) for c, w in ((0, 0.1), (1, 0.3), (3, 0.6))
                    if not (c == 3 and r == 1))  # fmt: skip
        for k in ("w", "b"):
            expected[k] = expected[k] + moved
        got = arrays.to_torch_state_dict()
        for k in ("w", "b"):
            assert torch.allclose(got[k], expected[k], atol=1e-6), (server_round, k)
        assert torch.equal(got["steps"], theta["steps"])  # an integer buffer is not averaged
        assert metrics["dropped_updates"] == (1.0 if r == 1 else 0.0)
        losses = {0: 0.0, 1: 1.0, 3: 3.0}
        if r == 1:
            losses.pop(3)
        counts = {0: 10, 1: 30, 3: 60}
        mean = sum(losses[c] * counts[c] for c in losses) / sum(counts[c] for c in losses)
        assert metrics["train_loss"] == pytest.approx(mean)
    assert np.array_equal(server.counts, [10, 30, 0, 60])
    assert server.nodes == {0: 100, 1: 101, 2: 102, 3: 103}


def test_each_rounds_evaluation_is_weighted_by_the_clients_samples(flower_run, tmp_path):
    """Every connected node gets θ^{t+1}; clients without data are left out; the means are
    Σ n_c m_c / Σ n_c and the uniform mean, one row a round in evaluation.csv."""
    grid = Grid([10, 30, 0, 1])
    server = FederatedServer(FullParticipation(), FedAvg(), seed=0, clients=4, out=tmp_path,
                             split="val", evaluate_every=2)  # fmt: skip
    server.meet(grid)
    arrays = ArrayRecord(torch_state_dict={"w": torch.zeros(2)})
    assert server.configure_evaluate(1, arrays, ConfigRecord({}), grid) == []  # every 2nd
    messages = server.configure_evaluate(2, arrays, ConfigRecord({}), grid)
    assert [m.metadata.dst_node_id for m in messages] == [100, 101, 102, 103]
    assert messages[0].content["config"]["split"] == "val"
    summary = server.aggregate_evaluate(2, grid.send_and_receive(messages))
    assert summary["clients"] == 3.0  # client 2 has no samples; client 3 has one
    assert summary["val_loss/weighted"] == pytest.approx((0 * 10 + 1 * 30 + 3 * 1) / 41)
    assert summary["val_loss/uniform"] == pytest.approx((0 + 1 + 3) / 3)
    assert summary["val_acc/weighted"] == pytest.approx((1 * 10 + 0.5 * 30 + 0.25) / 41)
    grid.gone = {103}
    gone = server.configure_evaluate(2, arrays, ConfigRecord({}), grid)
    assert [m.metadata.dst_node_id for m in gone] == [100, 101, 102]
    rows = (tmp_path / "evaluation.csv").read_text().splitlines()
    header = "round,clients,val_acc/weighted,val_acc/uniform,val_loss/weighted,val_loss/uniform"
    assert rows[0] == header
    assert rows[1] == ",".join(["1", "3", f"{25.25 / 41:.10g}", f"{1.75 / 3:.10g}",
                                f"{33 / 41:.10g}", f"{4 / 3:.10g}"])  # fmt: skip
    server.split = None
    assert server.configure_evaluate(2, arrays, ConfigRecord({}), grid) == []


def test_a_node_that_leaves_is_not_sent_and_min_available_nodes_stops_the_run(flower_run):
    """Client 1's SuperNode disconnects after round 0: with min_available_nodes=2 the
    rounds go on with clients 0 and 3 (client 1 a dropped update, its weight not given
    to the others); with min_available_nodes=4 the next round refuses, naming client 1."""
    grid = Grid([10, 30, 0, 60])
    server = FederatedServer(FullParticipation(), FedAvg(), seed=0, clients=4,
                             min_available_nodes=2, node_timeout=0.3)  # fmt: skip
    arrays = ArrayRecord(torch_state_dict={"w": torch.zeros(2)})
    messages = server.configure_train(1, arrays, ConfigRecord({}), grid)
    arrays, _ = server.aggregate_train(1, grid.send_and_receive(messages))
    grid.gone = {101, 102}
    messages = server.configure_train(2, arrays, ConfigRecord({}), grid)
    assert sorted(m.metadata.dst_node_id for m in messages) == [100, 103]
    after, metrics = server.aggregate_train(2, grid.send_and_receive(messages))
    assert metrics["dropped_updates"] == 1.0
    moved = 0.1 * 1 * 2 * 0.1 + 0.1 * 4 * 2 * 0.6  # clients 0 and 3, round 1, ω kept
    start = arrays.to_torch_state_dict()["w"]
    assert torch.allclose(after.to_torch_state_dict()["w"], start + moved, atol=1e-6)
    server.min_available_nodes = 4
    with pytest.raises(ServerSideError, match=r"round 2: 2 nodes are connected, fewer than "
                                              r"min_available_nodes=4 \(the nodes of clients "
                                              r"\[1, 2\] are not\)"):  # fmt: skip
        server.configure_train(3, after, ConfigRecord({}), grid)


def test_a_node_that_left_is_a_dropped_update_and_a_client_apps_error_stops_the_run(
    flower_run, caplog
):
    """Flower answers for a node that left (its heartbeat stopped, its ClientApp's
    process killed) with an error reply: the round goes on without it, as a dropped
    update; an error of the ClientApp itself stops the run, naming the node and reason."""
    from flwr.app import Error
    from flwr.common.constant import ErrorCode

    class Failed(Reply):  # the SuperLink's answer (node 1) to the message it names
        def __init__(self, node, code, reason, answers):
            super().__init__(node, RecordDict())
            self.error = Error(code, reason)
            self.metadata.reply_to_message_id = answers

        def has_error(self):
            return True

    class Leaving(Grid):
        code = ErrorCode.NODE_UNAVAILABLE

        def send_and_receive(self, messages, timeout=None):
            for message in messages:  # Flower sets each sent message's id in place
                message.metadata.__dict__["_message_id"] = f"id{message.metadata.dst_node_id}"
            replies = super().send_and_receive(messages, timeout)
            if not self.sent or self.sent[-1][0] != 1:
                return replies
            node = 1 if self.code == ErrorCode.NODE_UNAVAILABLE else 103
            return [Failed(node, self.code, "no heartbeat", "id103")
                    if r.metadata.src_node_id == 103 else r for r in replies]  # fmt: skip

    grid = Leaving([10, 30, 0, 60])
    server = FederatedServer(FullParticipation(), FedAvg(), seed=0, clients=4)
    arrays = ArrayRecord(torch_state_dict={"w": torch.zeros(2)})
    for server_round in (1, 2):
        messages = server.configure_train(server_round, arrays, ConfigRecord({}), grid)
        with caplog.at_level(logging.WARNING, logger="lightning_fl.flower.server_side"):
            arrays, metrics = server.aggregate_train(server_round, grid.send_and_receive(messages))
    assert metrics["dropped_updates"] == 1.0
    assert "Round 1: client 3's node left (no heartbeat); its update is dropped." in caplog.text
    moved = 0.1 * 1 * 0.1 + 0.1 * 2 * 0.3 + 0.1 * 4 * 0.6 + 0.2 * 1 * 0.1 + 0.2 * 2 * 0.3
    assert torch.allclose(arrays.to_torch_state_dict()["w"], torch.full((2,), moved))
    grid.code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    messages = server.configure_train(2, arrays, ConfigRecord({}), grid)  # round 1 again
    with pytest.raises(ServerSideError, match=r"client 3's node \(103\) failed: no heartbeat"):
        server.aggregate_train(2, grid.send_and_receive(messages))


def test_a_plugins_server_state_goes_down_and_its_round_sums_come_up(flower_run):
    """SCAFFOLD's server half on the server: c (zero at first) goes to every participant
    with θ^t, and c ← c + Σ_i (p_i Δc_i) of the replies (control_weighting "target": the
    clients applied p_i), added in the participants' order; round 1 then sends that c."""
    grid = Grid([10, 30, 0, 60])
    scaffold = SCAFFOLD(control_weighting="target")
    params = [torch.ones(2), torch.ones(1)]  # c starts at zeros shaped like them
    server = FederatedServer(FullParticipation(), FedAvg(), 0, [scaffold], params, clients=4)
    arrays = ArrayRecord(torch_state_dict={"w": torch.zeros(2), "b": torch.zeros(1)})
    for server_round in (1, 2):
        messages = server.configure_train(server_round, arrays, ConfigRecord({}), grid)
        arrays, _ = server.aggregate_train(server_round, grid.send_and_receive(messages))
    first, second = grid.server_states[0], grid.server_states[3]
    assert set(first) == {"SCAFFOLD.server_control.0", "SCAFFOLD.server_control.1"}
    assert torch.equal(first["SCAFFOLD.server_control.0"], torch.zeros(2))
    # clients 0, 1 and 3 replied: Σ (c + 1) = 1 + 2 + 4 and Σ −c = 0 − 1 − 3
    assert torch.equal(second["SCAFFOLD.server_control.0"], torch.full((2,), 7.0))
    assert torch.equal(second["SCAFFOLD.server_control.1"], torch.full((1,), -4.0))
    assert torch.equal(scaffold.server_control[0], torch.full((2,), 14.0))


def test_a_round_sum_of_its_own_shape_and_dtype_and_a_client_without_a_node(flower_run):
    """A plugin's round sum declared of shape (1,) in float64 is added in that dtype over
    the replies; a client id that no node trains (1) counts 0 samples and is never
    drawn; with ``clients`` unset the server waits for one node."""

    class Seen(FederatedCallback):
        def __init__(self):
            self.add_round_sum("seen", shape=(1,), dtype=torch.float64)
            self.totals = []

        def on_round_end(self, trainer, pl_module, state):
            self.totals.append(state.round_sum(self, "seen")[0].clone())

    grid = Grid([10, 30, 60])
    grid.seen_sum = True
    grid.get_node_ids = lambda: [100, 102]  # client 1's node never came
    seen = Seen()
    server = FederatedServer(FullParticipation(), FedAvg(), 0, [seen], [torch.zeros(2)])
    arrays = ArrayRecord(torch_state_dict={"w": torch.zeros(2)})
    messages = server.configure_train(1, arrays, ConfigRecord({}), grid)
    assert list(server.counts) == [10, 0, 60]
    assert [m.metadata.dst_node_id for m in messages] == [100, 102]
    server.aggregate_train(1, grid.send_and_receive(messages))
    assert seen.totals[0].dtype == torch.float64 and seen.totals[0].tolist() == [0.5 + 2.5]
    alone = FederatedServer(FullParticipation(), FedAvg(), 0, node_timeout=0.2)
    single = Grid([5])
    assert len(alone.configure_train(1, arrays, ConfigRecord({}), single)) == 1  # one node
    empty = FederatedServer(FullParticipation(), FedAvg(), 0, node_timeout=0.2)
    nobody = Grid([])
    with pytest.raises(ServerSideError, match="0 of 1 nodes connected"):
        empty.meet(nobody)


def test_dp_fedavgs_central_noise_is_drawn_by_the_server_from_its_secret(flower_run, monkeypatch):
    """DPFedAvg(noise="central") on the server, 3 rounds: w_k = min(n_k/20, 1) = (0.5, 1,
    0, 1), W = 2.5, p = ω = (0.2, 0.4, 0, 0.4); each reply's update (every entry
    0.1(c + 1)(t + 1), ‖Δ‖ = that·√3) is clipped to C = 0.5 as it arrives, and θ^{t+1} =
    θ^t + η(Σ ω_k clip(Δ_k) + σ g_t) with σ = zC/(qW) = 0.7·0.5/2.5 and g_t the server's
    secret draw (here a known vector: the seeded source is never asked)."""
    from lightning_fl.callbacks import DPFedAvg
    from lightning_fl.systems import privacy_noise
    from lightning_fl.systems.user_dp import Sampling, epsilon

    draws = []

    def secret_normal(self, size, purpose="", *keys):
        draws.append((size, purpose, keys))
        return torch.tensor([0.3, -1.1, 2.0], dtype=torch.float64)[:size] * (len(draws))

    def seeded(self, *args):
        raise AssertionError("the server's noise came from the recipe's seed")

    monkeypatch.setattr(privacy_noise.SecretNoise, "normal", secret_normal)
    monkeypatch.setattr(privacy_noise.SeededNoise, "normal", seeded)
    grid = Grid([10, 30, 0, 60])
    dp = DPFedAvg(noise_multiplier=0.7, clip_norm=0.5, example_cap=20.0, server_lr=0.8)
    server = FederatedServer(FullParticipation(), dp, seed=5, clients=4, rounds=3)
    theta = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    arrays = ArrayRecord(torch_state_dict=theta)
    expected = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    sigma = 0.7 * 0.5 / 2.5
    for server_round in (1, 2, 3):
        messages = server.configure_train(server_round, arrays, ConfigRecord({}), grid)
        arrays, metrics = server.aggregate_train(server_round, grid.send_and_receive(messages))
        r = server_round - 1
        step = torch.zeros(3, dtype=torch.float64)
        for client, weight in ((0, 0.2), (1, 0.4), (3, 0.4)):
            move = 0.1 * (client + 1) * (r + 1)
            norm = move * 3**0.5
            step += weight * move * min(1.0, 0.5 / norm)
        step += sigma * torch.tensor([0.3, -1.1, 2.0], dtype=torch.float64) * server_round
        expected = expected + 0.8 * step
        got = arrays.to_torch_state_dict()
        assert torch.allclose(torch.cat([got["w"], got["b"]]).double(), expected, atol=1e-6)
        assert metrics["dp/noise_std"] == pytest.approx(sigma)
        assert metrics["dp/clip_norm"] == 0.5
        assert metrics["dp/epsilon"] == pytest.approx(
            epsilon(0.7, Sampling.full(), server_round, 1e-5, "rdp"))  # fmt: skip
    assert draws == [(3, "dp_fedavg", (0,)), (3, "dp_fedavg", (1,)), (3, "dp_fedavg", (2,))]
    assert dp.view.config.secret_randomness and dp.view.config.seed == 5


def test_dp_fedavgs_client_half_is_refused_and_an_empty_round_steps_only_if_it_aggregates(
    flower_run,
):
    """DPFedAvg's distributed noise acts on the sites' sums before they leave (the
    ClientApps train without the aggregator): refused, naming the hook; central noise
    runs on the server, local noise on the nodes (their half of the aggregator), and
    secagg hides nothing the server needs only with local noise. A round
    that draws nobody is not aggregated (FedAvgM's momentum would move θ), unless the
    aggregator aggregates empty rounds (DPFedAvg noises it all the same)."""
    from lightning_fl.callbacks import DPFedAvg, FedAvgM
    from lightning_fl.systems.samplers import Participation

    refused = "DPFedAvg does not run in the server-side mode yet: its on_before_round_sum run"
    with pytest.raises(ServerSideError, match=refused):
        server_side.check_server_side(DPFedAvg(noise="distributed"), [])
    server_side.check_server_side(DPFedAvg(noise="central"), [])
    server_side.check_server_side(DPFedAvg(noise="local"), [])
    server_side.check_secure(DPFedAvg(noise="local"))
    with pytest.raises(ServerSideError, match="DPFedAvg reads each client's update on the "
                                              "server, and secagg hides them"):  # fmt: skip
        server_side.check_secure(DPFedAvg(noise="central"))
    over = DPFedAvg(noise_multiplier=0.7, epsilon_budget=1.0)  # the run's 3 rounds: ε > 1
    tight = FederatedServer(FullParticipation(), over, seed=0, clients=2, rounds=3)
    arrays = ArrayRecord(torch_state_dict={"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="DPFedAvg: 3 rounds at z=0.7 .* over the budget"):
        tight.configure_train(1, arrays, ConfigRecord({}), Grid([10, 30]))

    def nobody_in_round_1() -> FullParticipation:
        sampler = FullParticipation()
        draw = sampler.sample
        sampler.sample = lambda r, seed, p: Participation((), ()) if r == 1 else draw(r, seed, p)
        return sampler

    theta = {"w": torch.tensor([1.0, -2.0])}
    for aggregator, moves in ((FedAvgM(server_lr=1.0, beta=0.9), False),
                              (DPFedAvg(noise_multiplier=0.5, clip_norm=9.0), True)):  # fmt: skip
        grid = Grid([10, 30])
        server = FederatedServer(nobody_in_round_1(), aggregator, seed=0, clients=2, rounds=2)
        arrays = ArrayRecord(torch_state_dict=theta)
        messages = server.configure_train(1, arrays, ConfigRecord({}), grid)
        arrays, _ = server.aggregate_train(1, grid.send_and_receive(messages))
        before = arrays.to_torch_state_dict()["w"]
        assert server.configure_train(2, arrays, ConfigRecord({}), grid) == []
        after, _ = server.aggregate_train(2, [])
        assert torch.equal(after.to_torch_state_dict()["w"], before) is not moves


def test_a_resumed_server_continues_from_its_checkpoint_bit_for_bit(flower_run, tmp_path):
    """FedAdam (its moments) and UniformSampler (2 of 4 a round), 4 rounds: a server that
    stops after round 1 and a new one resumed from its ``server_checkpoint.pt`` (read with
    ``weights_only``) send rounds 2 and 3 and end at the uninterrupted model exactly.
    Refused: nodes that report other counts, a plugin's client state (SCAFFOLD's c_i in
    the nodes' Context), no checkpoint."""
    from lightning_fl.systems.samplers import UniformSampler

    class Counted(UniformSampler):  # a sampler with state: the rounds it drew
        def __init__(self):
            super().__init__(2)
            self.draws = 0

        def sample(self, round_idx, seed, p):
            self.draws += 1
            return super().sample(round_idx, seed, p)

        def state_dict(self):
            return {"draws": self.draws}

        def load_state_dict(self, state):
            self.draws = state["draws"]

    class Moved(FederatedCallback):  # server state like the parameters: Σ of the steps
        def __init__(self):
            self.add_server_state("moved", like="params")

        def on_round_end(self, trainer, pl_module, state):
            torch._foreach_add_(self.moved, state.update_sum)

    def server(out, plugins=None):
        plugins = [Moved()] if plugins is None else plugins
        return FederatedServer(Counted(), FedAdam(server_lr=0.05), seed=3, plugins=plugins,
                               params=[torch.zeros(2), torch.zeros(1)], clients=4, out=out,
                               rounds=4)  # fmt: skip

    def train(server, arrays, rounds, grid):
        for server_round in rounds:
            messages = server.configure_train(server_round, arrays, ConfigRecord({}), grid)
            arrays, _ = server.aggregate_train(server_round, grid.send_and_receive(messages))
        return arrays.to_torch_state_dict()

    theta = ArrayRecord(torch_state_dict={"w": torch.tensor([1.0, -2.0]), "b": torch.zeros(1)})
    whole_grid, cut_grid, resumed_grid = Grid([10, 30, 5, 60]), Grid([10, 30, 5, 60]), Grid(
        [10, 30, 5, 60])  # fmt: skip
    uninterrupted = server(tmp_path / "whole")
    whole = train(uninterrupted, theta, (1, 2, 3, 4), whole_grid)
    train(server(tmp_path / "cut" / "out"), theta, (1, 2), cut_grid)  # its folder made
    checkpoint = server_side.read_checkpoint(tmp_path / "cut" / "out")
    assert checkpoint["round"] == 1 and checkpoint["aggregator"]["first_moment"] is not None
    resumed = server(tmp_path / "cut" / "out")
    model = resumed.resume(checkpoint)
    assert resumed.sampler.draws == 2
    final = train(resumed, ArrayRecord(torch_state_dict=model), (1, 2), resumed_grid)
    assert all(torch.equal(final[k], whole[k]) for k in whole)
    moved, whole_moved = resumed.plugins[0].moved, uninterrupted.plugins[0].moved
    assert all(torch.equal(a, b) for a, b in zip(moved, whole_moved))
    unsafe = tmp_path / "unsafe"
    unsafe.mkdir()
    torch.save({"round": 1, "code": Settings("r.yaml")}, unsafe / "server_checkpoint.pt")
    with pytest.raises(Exception, match="Weights only load failed"):  # never run as code
        server_side.read_checkpoint(unsafe)
    assert [r for r, _, _ in resumed_grid.sent] == [2, 2, 3, 3]
    assert resumed_grid.sent == whole_grid.sent[4:]
    assert server_side.read_checkpoint(tmp_path / "cut" / "out")["round"] == 3
    other = server(tmp_path / "cut" / "out")
    other.resume(checkpoint)
    with pytest.raises(ServerSideError, match=r"the nodes report the training counts "
                                              r"\[10, 30, 5, 61\], and the checkpoint's run "
                                              r"had \[10, 30, 5, 60\]"):  # fmt: skip
        other.meet(Grid([10, 30, 5, 61]))
    forgetful = server(tmp_path / "cut" / "out", [SCAFFOLD()])
    forgetful.resume({**checkpoint, "plugins": {"SCAFFOLD": SCAFFOLD().state_dict()}})
    with pytest.raises(ServerSideError, match=r"SCAFFOLD keeps each client's state on its "
                                              r"node, and the nodes of clients \[0, 1, 2, 3\] "
                                              r"keep it in the run's Context"):  # fmt: skip
        forgetful.meet(Grid([10, 30, 5, 60]))
    with pytest.raises(ServerSideError, match="resume=true, and there is no "
                                              "server_checkpoint.pt"):  # fmt: skip
        server_side.read_checkpoint(tmp_path / "nowhere")
    assert Settings.read({"recipe": "r.yaml", "resume": True}).resume
    assert not Settings.read({"recipe": "r.yaml", "resume": "false"}).resume


def test_serve_resumes_the_recipes_run_from_its_out_folder(flower_run, tmp_path):
    """The ServerApp's run of recipes/fedadam.yaml (20 clients, 10 a round, FedAdam) over
    the answering grid: 2 rounds, then resume=true with max_epochs 4, end at the 4-round
    run's model exactly; a resume with nothing left to train returns the checkpoint's.
    The nodes evaluate each round unless the recipe validates nothing during a fit, and a
    recipe the mode cannot run is refused before any node is asked."""

    def serve(out, rounds, resume=False, evaluate="", recipe="fedadam.yaml", extra=()):
        settings = Settings(str(ROOT / "recipes" / recipe),
                            ("--trainer.max_epochs", str(rounds), *extra), clients=20,
                            out=str(out), evaluate=evaluate, resume=resume)  # fmt: skip
        return server_side.serve(settings, Grid([5 + c for c in range(20)]))

    serve(tmp_path / "evaluated", 1, evaluate="val")
    assert (tmp_path / "evaluated" / "evaluation.csv").exists()
    serve(tmp_path / "validates_nothing", 1, evaluate="val",
          extra=("--trainer.limit_val_batches", "0"))  # fmt: skip
    assert not (tmp_path / "validates_nothing" / "evaluation.csv").exists()
    with pytest.raises(ServerSideError, match="Local does not run in the server-side mode"):
        serve(tmp_path / "local", 1, recipe="local.yaml")
    from lightning_fl.flower.flower_dp import FlowerDP, FlowerDPError
    from lightning_fl.flower.secure_rounds import SecureAggregationSettings

    recipe = str(ROOT / "recipes" / "fedadam.yaml")  # sample weights: Flower's noise misfits
    with pytest.raises(FlowerDPError, match="scales its noise to m clients"):
        server_side.serve(Settings(recipe, dp=FlowerDP("server", 1.0, 1.0)), Grid([5, 6]))
    dp_recipe = str(ROOT / "recipes" / "privacy" / "digits_dp_fedavg.yaml")
    with pytest.raises(ServerSideError, match="DPFedAvg reads each client's update"):
        server_side.serve(
            Settings(dp_recipe, evaluate="", secure=SecureAggregationSettings()), Grid([5, 6])
        )

    whole = serve(tmp_path / "whole", 4)
    cut = serve(tmp_path / "cut", 2)
    assert all(torch.equal(a, b) for a, b in zip(serve(tmp_path / "cut", 2, True).values(),
                                                 cut.values()))  # fmt: skip
    resumed = serve(tmp_path / "cut", 4, True)
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert not all(torch.equal(cut[k], whole[k]) for k in whole)
    saved = torch.load(tmp_path / "cut" / "final_model.pt", weights_only=True)
    assert all(torch.equal(saved[k], whole[k]) for k in whole)


def test_secure_rounds_read_their_settings_and_refuse_what_they_would_hide(flower_run):
    """The run config's secagg options; an aggregator that reads each update on the
    server (DPFedAvg's clipping) and a round of one node are refused; a node's vector is
    ω_i Δ_i over the floating entries in state-dict order, then its round sums by name,
    and the unmasked sum splits back into them (a vector of other round sums refused)."""
    from lightning_fl.callbacks import DPFedAvg
    from lightning_fl.flower import secure_rounds
    from lightning_fl.flower.secure_rounds import SecureAggregationSettings

    assert SecureAggregationSettings.read({}) is None
    read = SecureAggregationSettings.read({"secagg": True, "secagg-num-shares": 3,
                                           "secagg-threshold": 0.5,
                                           "secagg-clipping-range": 2})  # fmt: skip
    assert read == SecureAggregationSettings(3, 0.5, 2.0)
    # a TOML float that is a whole count above 1 is a count; 1.0 and below, a fraction
    shares = [SecureAggregationSettings.read({"secagg": "true", "secagg-num-shares": n})
              .num_shares for n in (3.0, 2.0, 1.0, 0.5, "4")]  # fmt: skip
    assert shares == [3, 2, 1.0, 0.5, 4] and [type(n) for n in shares] == [
        int, int, float, float, int]  # fmt: skip
    assert Settings.read({"recipe": "r.yaml", "secagg": "true"}).secure == (
        SecureAggregationSettings())  # fmt: skip
    with pytest.raises(ServerSideError, match="DPFedAvg reads each client's update on the "
                                              "server, and secagg hides them"):  # fmt: skip
        server_side.check_secure(DPFedAvg())
    from lightning_fl.callbacks import CoordinateMedian

    with pytest.raises(ServerSideError, match="CoordinateMedian reads each client's update"):
        server_side.check_secure(CoordinateMedian())  # its rows: no receive_update of its own
    server_side.check_secure(FedAdam())
    adaptive = DPFedAvg(noise="local", target_quantile=0.5)  # its count: 0 or 1 a node
    clipped = (
        "DPFedAvg's round sum 'unclipped' reaches 1 a client, and "
        "secagg-clipping-range=0.5 would clip it: set secagg-clipping-range to at least 1"
    )
    with pytest.raises(ServerSideError, match=clipped):
        server_side.check_secure(adaptive, [SCAFFOLD()], 0.5)
    server_side.check_secure(adaptive, [SCAFFOLD()], 1.0)
    one = [flwr.app.Message(RecordDict(), dst_node_id=5, message_type="train")]
    with pytest.raises(RuntimeError, match="round 2 has 1 participant.*needs at least 2"):
        secure_rounds.secure_sum(Grid([1]), one, 3, SecureAggregationSettings())
    start = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(4), "b": torch.tensor([0.5])}
    trained = {"w": torch.tensor([1.5, 1.0]), "n": torch.tensor(9), "b": torch.tensor([1.5])}
    sums = {"S.x.1": torch.tensor([7.0]), "S.x.0": torch.tensor([[3.0, 4.0]])}
    vector = secure_rounds.contribution(0.25, start, trained, sums)
    assert [v.tolist() for v in vector] == [[0.125, -0.25], [0.25], [[3.0, 4.0]], [7.0]]
    shapes = {"S.x.0": (1, 2), "S.x.1": (1,)}
    update, split = secure_rounds.split_sum(vector, start, shapes)
    assert [u.tolist() for u in update] == [[0.125, -0.25], [0.25]]
    assert update[0].dtype == torch.float32
    assert {k: v.tolist() for k, v in split.items()} == {"S.x.0": [[3.0, 4.0]], "S.x.1": [7.0]}
    with pytest.raises(RuntimeError, match="hold 2 round sums and the server's plugins "
                                           "declare 1"):  # fmt: skip
        secure_rounds.split_sum(vector, start, {"S.x.0": (1, 2)})
    nothing, none = secure_rounds.split_sum(None, start, shapes)
    assert [u.tolist() for u in nothing] == [[0.0, 0.0], [0.0]] and none == {}


def test_a_robust_rule_reads_each_reply_and_a_non_finite_update_is_dropped(flower_run):
    """CoordinateMedian on the server, 3 rounds, weights n = (10, 30, 5, 60): the
    ω̄-weighted median of the updates (0.1(c + 1)(t + 1) every entry) is client 3's, 0.4(t + 1);
    in round 1 client 3 replies NaN and is dropped as the engine drops it (counted, a
    warning), and the median over clients 0-2, weights (10, 30, 5)/45, is client 1's."""
    from lightning_fl.callbacks import CoordinateMedian

    class NaNInRound1(Grid):
        def send_and_receive(self, messages, timeout=None):
            replies = super().send_and_receive(messages, timeout)
            for reply in replies:
                if reply.metadata.src_node_id == 103 and self.sent and self.sent[-1][0] == 1:
                    nan = {
                        k: torch.full_like(v, float("nan"))
                        for k, v in reply.content["arrays"].to_torch_state_dict().items()
                    }
                    reply.content["arrays"] = ArrayRecord(torch_state_dict=nan)  # fmt: skip
            return replies

    grid = NaNInRound1([10, 30, 5, 60])
    server = FederatedServer(FullParticipation(), CoordinateMedian(), seed=0, clients=4)
    arrays, expected = ArrayRecord(torch_state_dict={"w": torch.zeros(2)}), 0.0
    for server_round, moved in ((1, 0.4), (2, 0.2 * 2), (3, 0.4 * 3)):
        messages = server.configure_train(server_round, arrays, ConfigRecord({}), grid)
        arrays, metrics = server.aggregate_train(server_round, grid.send_and_receive(messages))
        expected += moved
        assert torch.allclose(arrays.to_torch_state_dict()["w"], torch.full((2,), expected))
        assert metrics["dropped_updates"] == (1.0 if server_round == 2 else 0.0)


def test_every_clients_count_goes_down_and_equal_weights_are_checked_each_round(flower_run):
    """The recipe's 6 clients, 4 with a node: the counts sent with each train message cover
    all 6 (the last two at 0); a wrapper that promises m participants of weight 1/m is
    held to both: 2 of weight 1/4 each are refused, as sample weights are."""
    grid = Grid([10, 30, 5, 60])
    server = FederatedServer(FullParticipation(), FedAvg(), seed=0, clients=4, num_clients=6)
    arrays = ArrayRecord(torch_state_dict={"w": torch.zeros(2)})
    messages = server.configure_train(1, arrays, ConfigRecord({}), grid)
    assert list(messages[0].content["config"]["counts"]) == [10, 30, 5, 60, 0, 0]
    sampler = FullParticipation()
    sampler.sample = lambda r, seed, p: server_side.Participation((0, 1), (0.25, 0.25))
    quarter = FederatedServer(sampler, FedAvg(weighting="uniform"), seed=0, clients=4)
    quarter.equal_weights = (2, "Wrapper")
    with pytest.raises(ServerSideError, match=r"round 0 draws 2 participants of weights "
                                              r"\[0.25, 0.25\], and Wrapper scales its "
                                              r"noise to 2 of weight 1/2"):  # fmt: skip
        quarter.configure_train(1, arrays, ConfigRecord({}), Grid([10, 30, 5, 60]))
    from lightning_fl.systems.samplers import UniformSampler

    weighted = FederatedServer(UniformSampler(2), FedAvg(), seed=0, clients=4)
    weighted.equal_weights = (2, "Wrapper")
    with pytest.raises(ServerSideError, match="round 0 draws 2 participants of weights"):
        weighted.configure_train(1, arrays, ConfigRecord({}), Grid([10, 30, 5, 60]))


def test_the_flower_apps_run_config_declares_every_option_with_its_default():
    """``flwr run --run-config`` accepts only keys the app declares: every key the server
    and the nodes read is in recipes/flower_server/pyproject.toml, and its values there
    are the readers' defaults (min-available-nodes 0: every client's node)."""
    import tomllib

    app = tomllib.loads((ROOT / "recipes" / "flower_server" / "pyproject.toml").read_text())
    declared = app["tool"]["flwr"]["app"]["config"]

    class Asked(dict):
        asked: set[str] = set()

        def get(self, key, default=None):
            self.asked.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            self.asked.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            self.asked.add(key)
            return super().__contains__(key)

    read = Settings.read(Asked(declared))
    Settings.read(Asked({**declared, "secagg": True, "dp-clipping": "server",
                         "dp-noise-multiplier": 1.0, "dp-clipping-norm": 1.0,
                         "local-dp-epsilon": 1.0, "local-dp-delta": 1e-5,
                         "local-dp-clipping-norm": 1.0, "local-dp-sensitivity": 1.0}))  # fmt: skip
    assert Asked.asked <= set(declared), Asked.asked - set(declared)
    assert set(declared) <= Asked.asked, set(declared) - Asked.asked
    defaults = Settings(declared["recipe"], (), 4, declared["out"])
    assert read == defaults
    assert Settings.read({**declared, "min-available-nodes": "3"}).min_available_nodes == 3


def test_refusals_name_the_cause_and_the_fix(flower_run, tmp_path):
    with pytest.raises(ServerSideError, match="has no 'recipe'"):
        Settings.read({})
    settings = Settings.read({"recipe": "r.yaml", "overrides": "--a 1 --b 2", "clients": 3,
                              "min-available-nodes": 2, "round-timeout": 30})  # fmt: skip
    assert (settings.overrides, settings.clients) == (("--a", "1", "--b", "2"), 3)
    assert (settings.min_available_nodes, settings.round_timeout) == (2, 30.0)
    assert server_side.node_client({"partition-id": 2}) == 2
    assert server_side.node_client({"client": 5, "partition-id": 2}) == 5
    assert server_side.node_client({"client": "3"}) == 3  # a quoted --node-config value
    with pytest.raises(ServerSideError, match="--node-config 'client="):
        server_side.node_client({})
    twice = Grid([10, 30])
    twice.get_node_ids = lambda: [100, 101, 100]  # two nodes answer as client 0
    server = FederatedServer(FullParticipation(), FedAvg(), seed=0, clients=2)
    with pytest.raises(ServerSideError, match="two nodes train client 0"):
        server.meet(twice)
    late = FederatedServer(FullParticipation(), FedAvg(), seed=0, clients=5, node_timeout=0.3)
    with pytest.raises(ServerSideError, match="4 of 5 nodes connected"):
        late.meet(Grid([1, 1, 1, 1]))
    for options in ("silos: [a, b]", "transport: {class_path: x.Y}"):
        recipe = tmp_path / "silo.yaml"
        recipe.write_text(f"trainer:\n  strategy:\n    init_args: {{{options}}}\n")
        with pytest.raises(ServerSideError, match="names silos or a transport"):
            server_side.instantiate(Settings(str(recipe)))
    with pytest.raises(ServerSideError, match="cannot read the recipe nowhere.yaml"):
        server_side.instantiate(Settings("nowhere.yaml"))

    class Starts(FederatedCallback):
        def on_round_start(self, trainer, pl_module, state):
            pass

    with pytest.raises(ServerSideError, match=r"Starts does not run in the server-side mode "
                                              r"yet \(on_round_start\)"):  # fmt: skip
        server_side.check_server_side(FedAvg(), [Starts()])

    class Counted(FederatedCallback):
        def __init__(self):
            self.add_server_state("rounds", 0)

    with pytest.raises(ServerSideError, match=r"Counted's server state \['rounds'\] is not"):
        server_side.check_server_side(FedAvg(), [Counted()])

    class Near(FedAvg):
        def on_client_start(self, trainer, pl_module, client, state):
            pass

    with pytest.raises(
        ServerSideError,
        match="Near does not run in the server-side mode yet: "
        "its on_client_start run beside the clients",
    ):
        server_side.check_server_side(Near(), [])
    server_side.check_server_side(FedAdam(), [SCAFFOLD(), FedProx(mu=0.1)])
    from lightning_fl.callbacks import FineTune, KNNPer, Pooled
    from lightning_fl.systems.samplers import SimilarityClusteredSampler

    with pytest.raises(ServerSideError, match="Pooled trains on every client's data in one"):
        server_side.check_server_side(Pooled(), [])
    with pytest.raises(ServerSideError, match="SimilarityClusteredSampler reads the round's "
                                              "updates or the clients' losses"):  # fmt: skip
        server_side.check_server_side(FedAvg(), [], SimilarityClusteredSampler(2))
    from lightning_fl.callbacks import MembershipInference
    from lightning_fl.engine.traits import Trait

    class Decides(FederatedCallback):  # the trait alone, no evaluation hook
        traits = {Trait.DECIDES_THE_EVALUATED_MODEL: ""}

    for plugin in (FineTune(), KNNPer(), Decides()):  # personalized: each node evaluates its own
        assert server_side.personalizes_evaluation(plugin)
        server_side.check_server_side(FedAvg(), [plugin], FullParticipation(), "val")
    assert not server_side.personalizes_evaluation(FedProx(mu=0.1))
    from lightning_fl.callbacks import Ditto

    server_side.check_server_side(FedAvg(), [Ditto()], FullParticipation(), "val")
    observer = MembershipInference()  # every client's evaluation together: refused there
    with pytest.raises(ServerSideError, match="MembershipInference observes every client's "
                                              "evaluation together"):  # fmt: skip
        server_side.check_server_side(FedAvg(), [observer], FullParticipation(), "val")
    server_side.check_server_side(FedAvg(), [observer], FullParticipation(), None)
    server_side.check_server_side(FedAvg(), [FedProx(mu=0.1)], FullParticipation(), "val")
    silo = ROOT / "recipes" / "flamby" / "heart_flower.yaml"
    with pytest.raises(ServerSideError, match="names silos or a transport"):
        server_side.instantiate(Settings(str(silo)))


def _simulated(recipe: Path, rounds: int, folder: Path, test: bool):
    """lightning-fl's fit of ``recipe`` on one process: the model, and its test metrics."""
    from lightning_fl.cli import run

    cli = run(["fit", "--config", str(recipe), "--data.init_args.root", str(HEART),
               "--trainer.max_epochs", str(rounds), "--test_after_fit", str(test).lower(),
               "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
               "--trainer.default_root_dir", str(folder)], exit_on_error=False)  # fmt: skip
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    return cli.model.state_dict(), metrics


@needs_heart
def test_a_node_opens_only_its_own_clients_files_and_trains_as_with_all_of_them(tmp_path, capsys):
    """A node of client 2 (switzerland) whose folder holds only processed.switzerland.data:
    its count, its round of the heart SCAFFOLD recipe (c_i's "target" weighting reads p_2
    from the server's counts) and its evaluation equal those of a node with all four
    files; counts that disagree with its own data are refused. A node's fits name no run
    folder on its console (they write none)."""
    own = tmp_path / "switzerland"
    own.mkdir()
    shutil.copy(HEART / "processed.switzerland.data", own)
    recipe = str(ROOT / "recipes" / "flamby" / "heart_scaffold.yaml")
    whole = Settings(recipe, ("--data.init_args.root", str(HEART)))
    alone = Settings(recipe, ("--data.init_args.root", str(own)))
    counts = [server_side.client_count(whole, c) for c in range(4)]
    assert server_side.client_count(alone, 2) == counts[2] and len(set(counts)) == 4
    start = {k: v.clone() for k, v in server_side.instantiate(whole).model.state_dict().items()}
    everything = server_side.train_client(whole, 2, 1, start)
    only_its_own = server_side.train_client(alone, 2, 1, start, counts=counts)
    for k in start:
        assert torch.equal(only_its_own.model[k], everything.model[k]), k
    assert (
        only_its_own.round_sums.keys()
        == everything.round_sums.keys()
        == {f"SCAFFOLD.control_delta.{i}" for i in range(len(start))}
    )  # its declared sums only
    for k, v in everything.round_sums.items():  # p_2 Δc_2: the server's p_2
        assert torch.equal(only_its_own.round_sums[k], v), k
    assert server_side.evaluate_client(alone, 2, start, "test") == (
        server_side.evaluate_client(whole, 2, start, "test"))  # fmt: skip
    wrong = [*counts[:2], counts[2] + 1, counts[3]]
    with pytest.raises(ValueError, match=f"client 2 has {counts[2]} training samples here, "
                                         f"and training_counts says {counts[2] + 1}"):  # fmt: skip
        server_side.train_client(alone, 2, 1, start, counts=wrong)
    with pytest.raises(ValueError, match="training_counts gives 3 clients, and the "
                                         "datamodule has 4"):  # fmt: skip
        server_side.train_client(alone, 2, 1, start, counts=counts[:3])
    assert "Outputs:" not in capsys.readouterr().out


@needs_heart
def test_a_nodes_evaluation_is_its_models_mean_over_the_clients_samples():
    """``evaluate_client`` by hand: the given model (not the recipe's initial weights) on
    client 2's test split in batches of 5, 5, 5 and 1, the loss and accuracy the means over
    its 16 samples (batch means weighted by their sizes), ``num-examples`` its count."""
    recipe = str(ROOT / "recipes" / "flamby" / "heart_scaffold.yaml")
    overrides = ("--data.init_args.root", str(HEART), "--data.init_args.eval_batch_size", "5")
    settings = Settings(recipe, overrides)
    cli = server_side.instantiate(settings)
    g = torch.Generator().manual_seed(3)
    model = {
        k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in cli.model.state_dict().items()
    }
    got = server_side.evaluate_client(settings, 2, model, "test")
    cli.datamodule.prepare_data()
    cli.datamodule.setup("test")
    x, y = cli.datamodule.client_dataset(2, "test").tensors
    assert len(y) == 16
    logits = (x @ model["network.weight"].T + model["network.bias"]).reshape(-1)
    target = y.reshape(-1).double()
    losses = torch.nn.functional.binary_cross_entropy_with_logits(
        logits.double(), target, reduction="none"
    )
    accuracy = ((logits > 0).double() == target).double().mean()
    assert got["num-examples"] == 16
    assert got["test_loss"] == pytest.approx(float(losses.mean()), rel=1e-6)
    assert got["test_acc"] == pytest.approx(float(accuracy), abs=1e-7)
    assert set(got) == {"num-examples", "test_loss", "test_acc"}


def _run_simulation(server, client, folder: Path) -> None:
    """The apps under Flower's simulation engine (Ray), 4 SuperNodes, in ``folder`` (what
    a ClientApp's fit writes stays there)."""
    from flwr.simulation import run_simulation

    pytest.importorskip("ray", reason="flwr[simulation] is not installed")
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run_simulation(server, client, num_supernodes=4, backend_config={
                "client_resources": {"num_cpus": 1},
                "init_args": {"num_cpus": 2, "include_dashboard": False}})  # fmt: skip
    finally:
        os.chdir(cwd)


@needs_heart
@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_flowers_simulation_engine_equals_lightning_fl_simulation(name, tmp_path):
    """The heart recipe (FLamby's setup: 4 centers, 100 local steps, its learning rates)
    over 3 rounds: the Flower App's ServerApp and ClientApp under ``run_simulation`` (4
    SuperNodes, Ray) give lightning-fl's 1-process model to 1e-6. SCAFFOLD's c travels
    down with θ^t, each node keeps its c_i in its Context's state, and the server adds
    the replies' Σ p_i Δc_i (measured: FedAvg 0.0, SCAFFOLD 3.7e-9; FedAdam, FedYogi and
    FedProx 0.0 by the same run, outside the suite)."""
    recipe = ROOT / "recipes" / "flamby" / f"heart_{name}.yaml"
    out = tmp_path / "server"
    overrides = ("--data.init_args.root", str(HEART), "--trainer.max_epochs", "3")
    split = "test" if name == "fedavg" else ""  # each round's evaluation, on one recipe
    settings = Settings(str(recipe), overrides, clients=4, out=str(out), evaluate=split)
    _run_simulation(*server_side.make_apps(settings), tmp_path)
    flower = torch.load(out / "final_model.pt", weights_only=True)
    simulated, tested = _simulated(recipe, 3, tmp_path / "simulation", test=bool(split))
    assert max(float((flower[k] - simulated[k]).abs().max()) for k in simulated) <= 1e-6
    if split:  # the last round's evaluation is lightning-fl's test of the final model
        with open(out / "evaluation.csv") as handle:
            rows = list(csv.DictReader(handle))
        assert [row["round"] for row in rows] == ["0", "1", "2"]
        for key in ("test_acc/weighted", "test_loss/weighted", "test_acc/uniform"):
            assert float(rows[-1][key]) == pytest.approx(tested[key], abs=1e-6), key


@needs_heart
def test_secagg_plus_hides_each_update_and_its_sum_steps_the_model(tmp_path):
    """SecAgg+ (``secaggplus_mod`` on the nodes, Flower's workflow on the server) for the
    heart SCAFFOLD recipe with DPFedAvg(noise="local")'s adaptive clipping as its
    aggregator (z = 0: each node clips its own update to C_t before SCAFFOLD reads it,
    and masks its count of unclipped updates; C^0 = 0.05 clips 3 of the 4 in round 0),
    2 rounds under ``run_simulation``: no train reply the server receives holds an array
    in clear, each masked vector is spread over [0, 2^32) where its quantized clear
    values would all sit near 2^21, and the model that the unmasked sums step (Σ ω_i
    clip(Δ_i), SCAFFOLD's Σ p_i Δc_i, and the count that moves C_1) is lightning-fl's
    1-process model within SecAgg+'s quantization: c = 1 (the count's bound), a level
    2c/2^22 a coordinate, node and round (measured with SCAFFOLD and FedAvg: 1.8e-5 with
    Flower's default c = 8, 1.8e-6 with c = 1)."""
    import yaml
    from flwr.common import bytes_to_ndarray
    from flwr.serverapp import ServerApp

    from lightning_fl.flower.secure_rounds import SecureAggregationSettings

    config = yaml.safe_load((ROOT / "recipes" / "flamby" / "heart_scaffold.yaml").read_text())
    config["trainer"]["callbacks"][1] = {"class_path": "lightning_fl.callbacks.DPFedAvg",
        "init_args": {"noise": "local", "noise_multiplier": 0.0, "clip_norm": 0.05,
                      "target_quantile": 0.5}}  # fmt: skip
    recipe = tmp_path / "heart_scaffold_dp.yaml"
    recipe.write_text(yaml.safe_dump(config))
    out = tmp_path / "server"
    overrides = ("--data.init_args.root", str(HEART), "--trainer.max_epochs", "2")
    settings = Settings(str(recipe), overrides, clients=4, out=str(out), evaluate="",
                        secure=SecureAggregationSettings(clipping_range=1.0))  # fmt: skip
    received = []

    class Recording:
        def __init__(self, grid):
            self.grid = grid

        def __getattr__(self, name):
            return getattr(self.grid, name)

        def send_and_receive(self, messages, timeout=None):
            replies = list(self.grid.send_and_receive(messages, timeout=timeout))
            received.extend(r for r in replies if r.metadata.message_type == "train")
            return replies

    server = ServerApp()

    @server.main()
    def _main(grid, context):
        server_side.serve(settings, Recording(grid))

    _run_simulation(server, server_side.make_apps(settings)[1], tmp_path)
    masked = [r.content.config_records["secaggplus_configs"]["masked_params"]
              for r in received if "fitres.parameters" in r.content.array_records]  # fmt: skip
    assert len(masked) == 8  # 4 nodes, 2 rounds
    assert all(len(record) == 0 for r in received for record in r.content.array_records.values())
    for vector in masked:
        values = np.concatenate([bytes_to_ndarray(b).ravel() for b in vector]).astype(np.float64)
        near = np.mean(np.abs(values - 2**21) < 2**20)  # a clear vector: all of them
        assert near < 0.5 and values.max() < 2**32
    flower = torch.load(out / "final_model.pt", weights_only=True)
    simulated, _ = _simulated(recipe, 2, tmp_path / "simulation", test=False)
    gap = max(float((flower[k] - simulated[k]).abs().max()) for k in simulated)
    assert gap <= 2 * 4 * 2 * 1.0 / 2**22  # 2 rounds, 4 nodes, a level 2c/2^22 each


def test_flowers_dp_wrappers_compose_where_their_noise_is_calibrated(flower_run, monkeypatch):
    """DifferentialPrivacyServerSideFixedClipping around the server, FedAvg with uniform
    weights and UniformSampler (2 of 4: ω = 1/2 = 1/m), 3 rounds: each reply's update
    (every entry 0.1(c + 1)(t + 1)) is clipped to C = 0.3, and θ^{t+1} = θ^t + Σ ½ clip(Δ_i)
    + N(0, (zC/m)²), the noise drawn from NumPy's global generator, whose state the
    wrapping replaced with the OS's entropy (no longer the recipe's seed)."""
    from lightning_fl.flower import flower_dp
    from lightning_fl.flower.flower_dp import FlowerDP
    from lightning_fl.systems.samplers import UniformSampler

    asked = []

    def entropy(size):
        asked.append(size)
        return bytes(i % 251 for i in range(size))

    system = os.urandom
    monkeypatch.setattr(flower_dp.os, "urandom", entropy)
    flower_dp.secret_numpy_state()  # the whole Mersenne Twister state from the OS: 624 words
    monkeypatch.setattr(flower_dp.os, "urandom", system)
    state = np.random.get_state()
    assert asked == [624 * 4] and (state[2], state[3]) == (624, 0)
    assert np.array_equal(state[1], np.frombuffer(entropy(2496), dtype=np.uint32))
    np.random.seed(0)  # what the recipe's seed_everything leaves
    seeded = np.random.get_state()[1].copy()
    server = FederatedServer(UniformSampler(2), FedAvg(weighting="uniform"), seed=1, clients=4)
    dp = FlowerDP("server", 0.8, 0.3)
    flower_dp.check(dp, server.aggregator, server.sampler, [], secure=False)
    wrapped = flower_dp.wrap(dp, server, 4)
    assert not np.array_equal(np.random.get_state()[1], seeded)
    stds = []

    def normal(mean, std, shape):
        stds.append(std)
        return np.full(shape, 1.5 * std)

    monkeypatch.setattr(np.random, "normal", normal)
    grid = Grid([10, 30, 5, 60])
    theta = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    arrays, expected = ArrayRecord(torch_state_dict=theta), torch.tensor([1.0, -2.0, 0.5])
    for server_round in (1, 2, 3):
        messages = wrapped.configure_train(server_round, arrays, ConfigRecord({}), grid)
        arrays, _ = wrapped.aggregate_train(server_round, grid.send_and_receive(messages))
        r = server_round - 1
        clients = [c for t, _, c in grid.sent if t == r]
        assert len(clients) == 2
        step = sum(0.5 * min(0.1 * (c + 1) * (r + 1), 0.3 / 3**0.5) for c in clients)
        expected = expected + step + 0.8 * 0.3 / 2 * 1.5
        got = arrays.to_torch_state_dict()
        assert torch.allclose(torch.cat([got["w"], got["b"]]), expected, atol=1e-6)
    assert stds == [pytest.approx(0.8 * 0.3 / 2)] * 6  # w and b, 3 rounds


def test_flowers_dp_wrappers_are_refused_where_their_noise_or_clipping_does_not_fit(
    flower_run,
):
    """Sample weights, a random number of clients, SCAFFOLD's round sums, DPFedAvg, secagg
    and a client without data (3 participants of 1/3 where m = 4 was promised) are refused,
    naming the wrapper and the fix; the client-side wrapper sends C and fixedclipping_mod
    (the ClientApp's dp_mod) clips the reply to it."""
    from flwr.app import Message

    from lightning_fl.callbacks import DPFedAvg
    from lightning_fl.flower import flower_dp
    from lightning_fl.flower.flower_dp import FlowerDP, FlowerDPError
    from lightning_fl.systems.samplers import PoissonSampler, UniformSampler

    dp = FlowerDP("server", 1.0, 0.5)
    uniform, sampler = FedAvg(weighting="uniform"), UniformSampler(2)
    refusals = [
        (FedAvg(), sampler, [], False, "scales its noise to m clients of weight 1/m"),
        (uniform, PoissonSampler(0.5), [], False, "with PoissonSampler weighs them otherwise"),
        (uniform, sampler, [SCAFFOLD()], False, "SCAFFOLD sends round sums or server state"),
        (DPFedAvg(), sampler, [], False, "and DPFedAvg both clip and noise"),
        (uniform, sampler, [], True, "secagg hides them"),
    ]
    for aggregator, chosen, plugins, secure, why in refusals:
        with pytest.raises(
            FlowerDPError, match=f"DifferentialPrivacyServerSideFixedClipping.*{why}"
        ):
            flower_dp.check(dp, aggregator, chosen, plugins, secure)
    flower_dp.check(dp, uniform, FullParticipation(), [FedProx(mu=0.1)], False)
    server = FederatedServer(FullParticipation(), FedAvg(weighting="uniform"), seed=0, clients=4)
    wrapped = flower_dp.wrap(dp, server, 4)
    arrays = ArrayRecord(torch_state_dict={"w": torch.zeros(2)})
    with pytest.raises(ServerSideError, match=r"round 0 draws 3 participants of weights "
                                              r"\[0.333333, 0.333333, 0.333333\], and "
                                              r"DifferentialPrivacyServerSideFixedClipping "
                                              r"scales its noise to 4 of weight 1/4"):  # fmt: skip
        wrapped.configure_train(1, arrays, ConfigRecord({}), Grid([10, 0, 5, 60]))
    with pytest.raises(FlowerDPError, match="dp-clipping='both': give 'server'"):
        FlowerDP.read({"dp-clipping": "both"})
    with pytest.raises(FlowerDPError, match=r"needs dp-noise-multiplier > 0 and "
                                            r"dp-clipping-norm > 0 in the run config \(got 1 "
                                            r"and 0\)"):  # fmt: skip
        FlowerDP.read({"dp-clipping": "client", "dp-noise-multiplier": 1})
    with pytest.raises(FlowerDPError, match=r"\(got 0 and 1\)"):  # z = 0: no noise at all
        FlowerDP.read({"dp-clipping": "server", "dp-noise-multiplier": 0, "dp-clipping-norm": 1})
    settings = Settings.read({"recipe": "r.yaml", "dp-clipping": "client",
                              "dp-noise-multiplier": "1.1", "dp-clipping-norm": "0.2"})  # fmt: skip
    assert settings.dp == FlowerDP("client", 1.1, 0.2)  # from a run config's strings too

    class Summed(FederatedCallback):  # round sums alone: the wrappers would clip them
        def __init__(self):
            self.add_round_sum("s", shape=(1,))

    with pytest.raises(FlowerDPError, match="Summed sends round sums or server state"):
        flower_dp.check(dp, uniform, sampler, [Summed()], False)
    client_side = flower_dp.wrap(settings.dp, FederatedServer(
        UniformSampler(2), FedAvg(weighting="uniform"), seed=0, clients=4), 4)  # fmt: skip
    sent = client_side.configure_train(1, arrays, ConfigRecord({}), Grid([10, 30, 5, 60]))
    assert sent[0].content["config"]["clipping_norm"] == 0.2
    message = Message(sent[0].content, dst_node_id=100, message_type="train")

    reply = flower_dp.dp_mod(message, None, replies_moved())
    clipped = reply.content["arrays"].to_torch_state_dict()["w"]
    assert torch.allclose(clipped, torch.tensor([0.12, 0.16]))  # scaled to norm 0.2
    plain = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=100,
                    message_type="train")  # fmt: skip
    assert flower_dp.dp_mod(plain, None, lambda m, c: "untouched") == "untouched"


class Nodes:
    """Nodes (four by default) that answer as the ClientApp does (its query, train and
    evaluate handlers, each node with its own Context: ``client`` in its node config, its
    own state)."""

    def __init__(self, settings: Settings, clients: int = 4, state_dir: Path | None = None):
        from flwr.app import Context

        self.settings = settings
        folder = {} if state_dir is None else {"state-dir": str(state_dir)}
        self.contexts = {100 + c: Context(7, 100 + c, {"client": c, **folder}, RecordDict(), {})
                         for c in range(clients)}  # fmt: skip

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        answer = {"query": server_side.answer_query, "train": server_side.train,
                  "evaluate": server_side.evaluate}  # fmt: skip
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            handler = answer[message.metadata.message_type]
            reply = handler(self.settings, message, self.contexts[node])
            replies.append(Reply(node, reply.content))
        return replies


def _dp_recipe(folder: Path, noise: str, sampler: dict) -> Path:
    """The heart FedAvg recipe, 10 local steps, with DPFedAvg's ``noise`` and adaptive
    clipping (C^0 = 0.05 clips some updates and not others)."""
    import yaml

    recipe = yaml.safe_load((ROOT / "recipes" / "flamby" / "heart_fedavg.yaml").read_text())
    recipe["trainer"]["strategy"]["init_args"].update(local_steps=10, sampler=sampler)
    recipe["trainer"]["callbacks"] = [{"class_path": "lightning_fl.callbacks.DPFedAvg",
        "init_args": {"noise": noise, "noise_multiplier": 0.8, "clip_norm": 0.05,
                      "example_cap": 100.0, "target_quantile": 0.5, "count_std": 1.0,
                      "server_lr": 0.9}}]  # fmt: skip
    path = folder / f"heart_dp_{noise}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@needs_heart
def test_dp_fedavgs_local_noise_is_added_on_each_node_from_its_secret(
    flower_run, monkeypatch, tmp_path
):
    """DPFedAvg(noise="local") with adaptive clipping, UniformSampler 3 of 4, 3 rounds, on
    the heart data (counts 199, 172, 30, 85: w = (1, 1, 0.3, 0.85) with ŵ = 100): each
    node draws the round's participation itself, clips its update and adds its share
    N(0, σ²/K)/ω_k from its own secret, and replies its count of unclipped updates; the
    server adds the count's noise from its secret. With every secret draw replaced by the
    seeded one of the same (purpose, keys), the server's model equals lightning-fl's
    1-process simulation to 1e-6; the nodes drew "dp_fedavg_local" for exactly the
    round's participants, the server only "dp_count"."""
    from lightning_fl.systems import privacy_noise

    drawn: list[tuple[str, tuple[int, ...]]] = []
    seeded = privacy_noise.SeededNoise.normal

    def secret_normal(self, size, purpose="", *keys):
        drawn.append((purpose, keys))
        return seeded(privacy_noise.SeededNoise(0), size, purpose, *keys)

    monkeypatch.setattr(privacy_noise.SecretNoise, "normal", secret_normal)
    sampler = {"class_path": "lightning_fl.UniformSampler", "init_args": {"clients_per_round": 3}}
    recipe = _dp_recipe(tmp_path, "local", sampler)
    overrides = ("--data.init_args.root", str(HEART), "--trainer.max_epochs", "3")
    settings = Settings(str(recipe), overrides, clients=4, evaluate="")
    flower = server_side.serve(settings, Nodes(settings))
    local = [keys for purpose, keys in drawn if purpose == "dp_fedavg_local"]
    assert [p for p, _ in drawn if p != "dp_fedavg_local"] == ["dp_count"] * 3
    assert len(local) == 9 and {r for r, _ in local} == {0, 1, 2}
    for r in range(3):  # the participants the recipe's sampler draws, each once
        from lightning_fl.systems.samplers import UniformSampler

        p = torch.tensor([1.0, 1.0, 0.3, 0.85], dtype=torch.float64) / 3.15
        assert sorted(c for t, c in local if t == r) == sorted(
            UniformSampler(3).sample(r, 0, p).clients)  # fmt: skip
    simulated, _ = _simulated(recipe, 3, tmp_path / "simulation", test=False)
    assert max(float((flower[k] - simulated[k]).abs().max()) for k in simulated) <= 1e-6
    # a node scales its share by its own ω_k, and refuses a server that says otherwise
    from flwr.app import Message

    drawn_0 = [c for t, c in local if t == 0]
    left_out = ({0, 1, 2, 3} - set(drawn_0)).pop()
    nodes = Nodes(settings)
    for client, weight, why, extra in (
        (drawn_0[0], 0.123, "weighs client .* by 0.123, and the recipe's sampler by", {}),
        (left_out, 0.5, f"sent client {left_out} round 0, and the recipe's UniformSampler "
                        "does not draw it", {}),
        (drawn_0[0], 0.5, "sets DPFedAvg's 'noise_multiplier', which is not its declared "
                          "server state", {"aggregator.noise_multiplier": 0.0}),
    ):  # fmt: skip
        config = ConfigRecord({"round": 0, "weight": weight, "counts": [199, 172, 30, 85],
                               **extra})  # fmt: skip
        content = RecordDict({"arrays": ArrayRecord(torch_state_dict=flower), "config": config})
        message = Message(content, dst_node_id=100 + client, message_type="train")
        with pytest.raises(ServerSideError, match=why):
            server_side.train(settings, message, nodes.contexts[100 + client])


def test_flowers_adaptive_clipping_wrappers_move_c_as_flower_computes_it(
    flower_run, monkeypatch, caplog
):
    """DifferentialPrivacyServerSideAdaptiveClipping around the server (FedAvg, uniform
    weights, UniformSampler 2 of 4), z = 0.8, C^0 = 0.3, γ = 0.5, η_C = 0.2, σ_b = 1, 3
    rounds, each reply's update every entry 0.1(c + 1)(t + 1): Flower clips each to C_t,
    counts the clipped ones, moves C_{t+1} = C_t·exp(−η_C((count + σ_b g)/2 − γ)) and
    noises the mean with z_Δ C_{t+1}/2, z_Δ = (z⁻² − (2σ_b)⁻²)^−½ (g: NumPy's draw, here
    1.5 a draw); the wrapping warns that this is not Andrew et al.'s direction. The
    client-side wrapper sends C_t, and the nodes' dp_mod applies adaptiveclipping_mod,
    which clips and replies the norm bit."""
    import math

    from flwr.app import Message

    from lightning_fl.flower import flower_dp
    from lightning_fl.flower.flower_dp import FlowerDP
    from lightning_fl.systems.samplers import UniformSampler

    def normal(mean, std, shape=None):
        return mean + 1.5 * std if shape is None else np.full(shape, mean + 1.5 * std)

    server = FederatedServer(UniformSampler(2), FedAvg(weighting="uniform"), seed=1, clients=4)
    dp = FlowerDP("server-adaptive", 0.8, 0.3, 0.5, 0.2, 1.0)
    flower_dp.check(dp, server.aggregator, server.sampler, [], secure=False)
    with caplog.at_level(logging.WARNING, logger="lightning_fl.flower.flower_dp"):
        wrapped = flower_dp.wrap(dp, server, 4)
    assert "moves C by the fraction of clipped updates, where Andrew et al." in caplog.text
    monkeypatch.setattr(np.random, "normal", normal)
    grid = Grid([10, 30, 5, 60])
    theta = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    arrays, expected = ArrayRecord(torch_state_dict=theta), torch.tensor([1.0, -2.0, 0.5])
    clip, z_delta = 0.3, (0.8**-2 - 2.0**-2) ** -0.5
    for server_round in (1, 2, 3):
        messages = wrapped.configure_train(server_round, arrays, ConfigRecord({}), grid)
        arrays, _ = wrapped.aggregate_train(server_round, grid.send_and_receive(messages))
        r = server_round - 1
        clients = [c for t, _, c in grid.sent if t == r]
        moves = [0.1 * (c + 1) * (r + 1) for c in clients]
        step = sum(0.5 * min(move, clip / 3**0.5) for move in moves)
        clipped = sum(move * 3**0.5 > clip for move in moves)
        clip *= math.exp(-0.2 * ((clipped + 1.5) / 2 - 0.5))
        expected = expected + step + 1.5 * z_delta * clip / 2
        got = arrays.to_torch_state_dict()
        assert torch.allclose(torch.cat([got["w"], got["b"]]), expected, atol=1e-6)
        assert wrapped.clipping_norm == pytest.approx(clip)
    client_side = flower_dp.wrap(FlowerDP("client-adaptive", 0.8, 0.2, clipped_count_stddev=1.0),
                                 FederatedServer(UniformSampler(2), FedAvg(weighting="uniform"),
                                                 seed=0, clients=4), 4)  # fmt: skip
    arrays = ArrayRecord(torch_state_dict={"w": torch.zeros(2)})
    sent = client_side.configure_train(1, arrays, ConfigRecord({}), Grid([10, 30, 5, 60]))
    config = sent[0].content["config"]
    assert (config["clipping_norm"], config[flower_dp.MOD_KEY]) == (0.2, "client-adaptive")
    message = Message(sent[0].content, dst_node_id=100, message_type="train")

    reply = flower_dp.dp_mod(message, None, replies_moved())
    assert torch.allclose(reply.content["arrays"].to_torch_state_dict()["w"],
                          torch.tensor([0.12, 0.16]))  # fmt: skip
    assert reply.content["metrics"]["norm_bit"] == 1  # clipped


def test_flowers_local_dp_mod_noises_each_reply_from_the_nodes_secret(flower_run, monkeypatch):
    """LocalDpMod (run config local-dp-*: C = 0.5, s = 0.5, ε = 2, δ = 1e-5) on a node
    (θ^t = 0, Δ = (3, 4)): the reply θ^t + clip(Δ) + N(0, σ²), σ = s√(2 ln(1.25/δ))/ε,
    the noise drawn after the training, from NumPy's global generator set from the OS's
    entropy (the training had seeded it from the recipe); messages other than train, and
    runs without it, pass. Refused beside a central wrapper, DPFedAvg, SCAFFOLD's round
    sums, secagg and a model with integer entries, naming both."""
    from flwr.app import Message

    from lightning_fl.callbacks import DPFedAvg
    from lightning_fl.flower import flower_dp
    from lightning_fl.flower.flower_dp import FlowerDP, FlowerDPError, LocalDP

    run_config = {"local-dp-epsilon": "2", "local-dp-delta": "1e-5",
                  "local-dp-clipping-norm": "0.5", "local-dp-sensitivity": "0.5"}  # fmt: skip
    local = Settings.read({"recipe": "r.yaml", **run_config}).local_dp
    assert local == LocalDP(0.5, 0.5, 2.0, 1e-5)
    sigma = 0.5 * (2 * np.log(1.25 / 1e-5)) ** 0.5 / 2.0
    assert local.noise_std == pytest.approx(sigma)
    entropy = bytes((7 * i) % 256 for i in range(624 * 4))
    monkeypatch.setattr(flower_dp.os, "urandom", lambda size: entropy[:size])
    start = {"w": torch.zeros(2)}
    content = RecordDict({"arrays": ArrayRecord(torch_state_dict=start),
                          "config": ConfigRecord({"round": 0})})  # fmt: skip
    message = Message(content, dst_node_id=100, message_type="train")
    trained = replies_moved(seeding=lambda: np.random.seed(0))  # the recipe's seed_everything
    mod = flower_dp.local_dp_mod(lambda context: local)
    got = mod(message, None, trained).content["arrays"].to_torch_state_dict()["w"]
    np.random.set_state(("MT19937", np.frombuffer(entropy, dtype=np.uint32), 624, 0, 0.0))
    noise = np.random.normal(0, sigma, (2,)).astype(np.float32)
    assert torch.allclose(got, torch.tensor([0.3, 0.4]) + torch.from_numpy(noise), atol=1e-6)
    np.random.seed(0)
    assert not torch.allclose(got, torch.tensor([0.3, 0.4]) + torch.from_numpy(
        np.random.normal(0, sigma, (2,)).astype(np.float32)), atol=1e-3)  # fmt: skip
    evaluate = Message(content, dst_node_id=100, message_type="evaluate")
    assert mod(evaluate, None, lambda m, c: "untouched") == "untouched"
    assert flower_dp.local_dp_mod(lambda c: None)(message, None, lambda m, c: "as is") == "as is"
    uniform = FedAvg(weighting="uniform")
    refusals = [
        (FlowerDP("server", 1.0, 0.5), uniform, [], False, (), "and DifferentialPrivacyServer"),
        (None, DPFedAvg(), [], False, (), "and DPFedAvg both clip and noise"),
        (None, uniform, [SCAFFOLD()], False, (), "SCAFFOLD sends round sums or server state"),
        (None, uniform, [], True, (), "secagg masks it"),
        (None, uniform, [], False, ["bn.num_batches_tracked"], r"\['bn.num_batches_tracked'\] "
                                                               "hold integers"),
    ]  # fmt: skip
    for dp, aggregator, plugins, secure, integers, why in refusals:
        with pytest.raises(FlowerDPError, match=rf"LocalDpMod \(local-dp-epsilon\).*{why}"):
            flower_dp.check_local(local, dp, aggregator, plugins, secure, integers)
    flower_dp.check_local(local, None, uniform, [FedProx(mu=0.1)], False)
    for key, value, got in (("local-dp-clipping-norm", 0, "0, 0.5 and 1e-05"),
                            ("local-dp-sensitivity", "0", "0.5, 0 and 1e-05"),
                            ("local-dp-delta", "1", "0.5, 0.5 and 1")):  # fmt: skip
        with pytest.raises(
            FlowerDPError, match=rf"needs local-dp-clipping-norm > 0, .*\(got {got}\)"
        ):
            LocalDP.read({**run_config, key: value})
    with pytest.raises(FlowerDPError, match="DifferentialPrivacyServerSideFixedClipping scales "
                                            "and noises every entry"):  # fmt: skip
        flower_dp.check(FlowerDP("server", 1.0, 0.5), uniform, FullParticipation(), [], False,
                        ["bn.num_batches_tracked"])  # fmt: skip
    adaptive = {
        "dp-clipping": "client-adaptive",
        "dp-noise-multiplier": "1",
        "dp-clipping-norm": "0.1",
        "dp-target-clipped-quantile": "0.4",
        "dp-clip-norm-lr": "0.3",
        "dp-clipped-count-stddev": "2",
    }  # a run config's strings
    assert FlowerDP.read(adaptive) == FlowerDP("client-adaptive", 1.0, 0.1, 0.4, 0.3, 2.0)
    assert FlowerDP.read({**adaptive, "dp-clipped-count-stddev": "0"}).clipped_count_stddev is None
    for key, value, got in (("dp-target-clipped-quantile", "1.5", "1.5, 0.3 and 2"),
                            ("dp-clip-norm-lr", "0", "0.4, 0 and 2"),
                            ("dp-clipped-count-stddev", "-1", "0.4, 0.3 and -1")):  # fmt: skip
        with pytest.raises(
            FlowerDPError, match=rf"dp-target-clipped-quantile in \[0, 1\].*\(got {got}\)"
        ):
            FlowerDP.read({**adaptive, key: value})


def test_the_deployed_client_app_imports_torch_only_for_a_message_that_needs_it(flower_run):
    """The Flower App's ClientApp (lightning_fl.flower.client_app, a process a message)
    starts with Flower alone: SecAgg+'s stages without training never import torch or
    Lightning; its secure rounds are recognized by Flower's own record name."""
    import subprocess
    import sys

    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    from lightning_fl.flower import client_app

    assert client_app.SECAGG_RECORD == RECORD_KEY_CONFIGS
    from flwr.app import Context, Message

    from lightning_fl.flower import flower_dp

    def message(kind, **config):
        content = RecordDict({"arrays": ArrayRecord(torch_state_dict={"w": torch.zeros(2)}),
                              "config": ConfigRecord(config)})  # fmt: skip
        return Message(content, dst_node_id=100, message_type=kind)

    moved = replies_moved()
    plain = Context(7, 100, {"client": 0}, RecordDict(), {})
    for kind in ("train", "evaluate", "query"):  # nothing to mask, clip or noise: as is
        for mod in client_app.client_app._mods:
            assert mod(message(kind), plain, lambda m, c: "as is") == "as is"
    clipped = message("train", **{flower_dp.MOD_KEY: "client", "clipping_norm": 0.5})
    reply = client_app._dp_mod(clipped, plain, moved)  # the wrapper's mod, by its name
    assert torch.allclose(reply.content["arrays"].to_torch_state_dict()["w"],
                          torch.tensor([0.3, 0.4]))  # fmt: skip
    local = Context(7, 100, {"client": 0}, RecordDict(), {
        "local-dp-epsilon": 1.0, "local-dp-delta": 1e-5, "local-dp-clipping-norm": 0.5,
        "local-dp-sensitivity": 1e-9})  # fmt: skip
    reply = client_app._local_dp_mod(message("train"), local, moved)  # from the run config
    assert torch.allclose(reply.content["arrays"].to_torch_state_dict()["w"],
                          torch.tensor([0.3, 0.4]), atol=1e-6)  # clipped, σ ≈ 5e-9  # fmt: skip
    assert client_app._local_dp_mod(message("evaluate"), local, lambda m, c: "as is") == "as is"
    probe = (
        "import sys, lightning_fl.flower.client_app; "
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, check=True).stdout.split("\n")[-2]  # fmt: skip
    assert "torch" not in loaded and "lightning" not in loaded, loaded
    app = (ROOT / "recipes" / "flower_server" / "pyproject.toml").read_text()
    assert 'clientapp = "lightning_fl.flower.client_app:client_app"' in app


MIXTURE = {"class_path": "lightning_fl.MixtureClassifier",
           "init_args": {"num_components": 2, "lr": 0.2, "network": {
               "class_path": "lightning_fl.MLP",
               "init_args": {"in_features": 64, "hidden": [64], "num_classes": 10}}}}  # fmt: skip


@pytest.mark.parametrize(
    "plugin, kept, model",
    [({"class_path": "lightning_fl.callbacks.FedRep",
       "init_args": {"head_epochs": 2, "head_lr": 0.05}}, "fedrep_head", None),
     ({"class_path": "lightning_fl.callbacks.Ditto",
       "init_args": {"lam": 0.5, "personal_lr": 0.05}}, "ditto_personal", None),
     ({"class_path": "lightning_fl.callbacks.FedEM"}, "fedem_pi", MIXTURE)],
    ids=["fedrep", "ditto", "fedem"],
)  # fmt: skip
def test_a_personal_model_stays_on_its_node_and_evaluates_the_client_as_in_simulation(
    flower_run, tmp_path, plugin, kept, model
):
    """FedRep (Collins et al. 2021), Ditto (Li et al. 2021) and FedEM (Marfoq et al.
    2021, a mixture of 2 MLPs) in the server-side mode, the quickstart MLP on 3 digits
    clients, 2 a round, 2 rounds (client 1 first trains in round 1, clients 0 and 2 in
    round 0): each node keeps its client's head, personal model v_k or mixture weights π
    in its Context (never sent), and each node's evaluation (lightning_fl's
    own, with what its Context holds) gives that client's test loss and accuracy of
    lightning-fl's 1-process fit to 1e-6, as does the final model. FedRep's round-end
    hook tends the node's module, not the server's (it has no server half); Ditto's w^0,
    client 1's v_k start in round 1, is the server's first model, sent down with
    its declared server state."""
    import yaml
    from flwr.app import Message

    from lightning_fl.cli import run

    config = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    config["trainer"]["callbacks"] = [{"class_path": "lightning_fl.callbacks.FedAvg"}, plugin]
    config["model"] = model or config["model"]
    recipe = tmp_path / "personalized.yaml"
    recipe.write_text(yaml.safe_dump(config))
    cut = ("--data.init_args.num_clients", "3", "--trainer.max_epochs", "2",
           "--trainer.strategy.init_args.sampler.init_args.clients_per_round", "2")  # fmt: skip
    settings = Settings(str(recipe), cut, clients=3, evaluate="")
    nodes = Nodes(settings, clients=3)
    flower = server_side.serve(settings, nodes)
    assert all(set(c.state[server_side.CLIENT_STATE].keys()) == {kept}
               for c in nodes.contexts.values())  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = run(["fit", "--config", str(recipe), *cut, "--trainer.logger", "false",
                   "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir",
                   str(tmp_path / "simulation")], exit_on_error=False)  # fmt: skip
    simulated = cli.model.state_dict()
    assert max(float((flower[k] - simulated[k]).abs().max()) for k in simulated) <= 1e-6
    tested = cli.trainer.strategy.evaluation.last_report[1]
    sizes = cli.datamodule.local_sample_counts("train")
    for node, context in nodes.contexts.items():
        client = node - 100
        config = ConfigRecord({"split": "test", "counts": [int(sizes[c]) for c in range(3)]})
        content = RecordDict({"arrays": ArrayRecord(torch_state_dict=flower), "config": config})
        message = Message(content, dst_node_id=node, message_type="evaluate")
        metrics = server_side.evaluate(settings, message, context).content["metrics"]
        for name in ("test_loss", "test_acc"):
            assert metrics[name] == pytest.approx(tested[name][client][0], abs=1e-6), name
        assert metrics["num-examples"] == tested["test_loss"][client][1]


@needs_heart
def test_a_node_keeps_its_clients_state_in_its_folder_and_a_resumed_run_reads_it(
    flower_run, tmp_path
):
    """SCAFFOLD on the heart data, UniformSampler 2 of 4, nodes started with
    ``state-dir``: each keeps its c_i after each round in its folder (a file a round,
    tensors only). The server runs round 0, a second run resumes it and runs round 1 (its
    nodes save their c_i of round 1), then the server loses round 1 (its checkpoint of
    round 0 put back) and a third run, with new nodes (empty Contexts), repeats round 1
    and runs round 2: each node reads the c_i saved before the round it trains, so the
    final model equals lightning-fl's 1-process 3-round fit to 1e-6."""
    import shutil as files

    import yaml

    config = yaml.safe_load((ROOT / "recipes" / "flamby" / "heart_scaffold.yaml").read_text())
    config["trainer"]["strategy"]["init_args"].update(
        local_steps=10,
        sampler={
            "class_path": "lightning_fl.UniformSampler",
            "init_args": {"clients_per_round": 2},
        },
    )
    recipe = tmp_path / "heart_scaffold_2of4.yaml"
    recipe.write_text(yaml.safe_dump(config))
    out, state = tmp_path / "server", tmp_path / "nodes"

    def serve(rounds: int, resume: bool) -> dict[str, torch.Tensor]:
        overrides = ("--data.init_args.root", str(HEART), "--trainer.max_epochs", str(rounds))
        settings = Settings(str(recipe), overrides, clients=4, out=str(out), evaluate="",
                            resume=resume)  # fmt: skip
        return server_side.serve(settings, Nodes(settings, state_dir=state))

    serve(1, False)
    files.copy(out / server_side.CHECKPOINT, tmp_path / "round_0.pt")
    serve(2, True)
    saved = {c: server_side.ClientStateFolder(state, c).rounds() for c in range(4)}
    assert any(1 in rounds for rounds in saved.values()), saved  # someone trained round 1
    files.copy(tmp_path / "round_0.pt", out / server_side.CHECKPOINT)  # round 1 is lost
    flower = serve(3, True)
    simulated, _ = _simulated(recipe, 3, tmp_path / "simulation", test=False)
    assert max(float((flower[k] - simulated[k]).abs().max()) for k in simulated) <= 1e-6


def test_fedems_round_end_on_the_server_keeps_its_entropy_for_the_rounds_metrics():
    """FedEM's round-end hook on the server (no trainer, no module): the round's mean
    entropy of the clients' π, Σ H / count from its round sum, is the round's
    ``fedem/pi_entropy`` metric; a round that counted no client reports none."""
    from lightning_fl.callbacks import FedEM
    from lightning_fl.engine.plugins import RoundState
    from lightning_fl.systems.samplers import Participation

    fedem = FedEM()

    def ended(total: float, count: float) -> dict[str, float]:
        sums = {fedem.round_sum_key("entropy"): [torch.tensor([total, count])]}
        state = RoundState(0, Participation((), ()), [], [], None, None, 0, np.zeros(0),
                           torch.zeros(0), extra_sums=sums)  # fmt: skip
        fedem.on_round_end(None, None, state)
        return fedem.round_metrics()

    assert ended(1.2, 3.0) == {"fedem/pi_entropy": pytest.approx(0.4)}
    assert type(fedem.round_metrics()["fedem/pi_entropy"]) is float  # a MetricRecord's value
    assert ended(0.0, 0.0) == {}
    assert ended(0.9, 1.0) == {"fedem/pi_entropy": pytest.approx(0.9)}
