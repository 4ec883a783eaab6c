"""Declared plugin state (issue 68, engine/plugins.py): what a plugin declares with
``add_client_state``, ``add_round_sum`` and ``add_server_state`` is kept, summed and
checkpointed by the engine, against a count by hand over rounds of unequal draws."""

from __future__ import annotations

import torch

from lightning_fl import FederatedStrategy, UniformSampler
from lightning_fl.callbacks import SCAFFOLD, FedAvg
from lightning_fl.engine.plugins import FederatedCallback
from lightning_fl.engine.tensors import flatten
from tests.helpers import make_trainer, tiny_datamodule, tiny_module


class Visits(FederatedCallback):
    """Counts each client's rounds (client state), the round's participants (a round sum
    of shape (1,)), their summed updates (a sum like the parameters) and the rounds
    (server state)."""

    def __init__(self) -> None:
        self.add_client_state("visits")
        self.add_round_sum("participants", shape=(1,))
        self.add_round_sum("updates")
        self.add_server_state("rounds", 0)
        self.seen: list[tuple[int, float, list[int]]] = []
        self.update_norms: list[tuple[float, float]] = []

    def on_round_start(self, trainer, pl_module, state) -> None:
        assert float(state.round_sum(self, "participants")[0]) == 0.0  # created at zero
        assert [t.shape for t in state.round_sum(self, "updates")] == [
            p.shape for p in state.global_params
        ]

    def on_client_end(self, trainer, pl_module, client, update, state) -> None:
        before = self.client_state(state.store, client, "visits")
        self.set_client_state(state.store, client, "visits", 1 if before is None else before + 1)
        state.round_sum(self, "participants")[0] += 1
        weight = state.weight_of(client)
        torch._foreach_add_(state.round_sum(self, "updates"), update[: state.num_params],
                            alpha=weight)  # fmt: skip

    def on_round_end(self, trainer, pl_module, state) -> None:
        self.rounds += 1
        count = float(state.round_sum(self, "participants")[0])
        self.seen.append((state.round_idx, count, sorted(state.participation.clients)))
        ours = torch.cat([t.flatten() for t in state.round_sum(self, "updates")])
        engine = torch.cat([t.flatten() for t in state.update_sum[: state.num_params]])
        self.update_norms.append((float(ours.norm()), float(engine.norm())))


def test_declared_state_is_kept_summed_and_checkpointed():
    plugin = Visits()
    assert plugin.keeps_client_state and plugin.client_state_in_store
    assert plugin.client_state_key("visits") == "Visits.visits"
    strategy = FederatedStrategy(sampler=UniformSampler(3), local_steps=2, seed=5)
    trainer = make_trainer(strategy, 4, [plugin, FedAvg()])
    trainer.fit(tiny_module(), datamodule=tiny_datamodule())
    by_hand: dict[int, int] = {}
    for round_idx, count, clients in plugin.seen:
        assert count == len(clients) == 3, round_idx
        for client in clients:
            by_hand[client] = by_hand.get(client, 0) + 1
    store = trainer.strategy.client_store
    assert {c: store.get(c, "Visits.visits") for c in store.clients()} == by_hand
    assert len(by_hand) < 10  # only the clients that took part hold state
    for ours, engine in plugin.update_norms:  # Σ ω_i Δ_i, summed by the plugin as declared
        assert abs(ours - engine) <= 1e-6 * max(1.0, engine)
    assert plugin.rounds == 4 and plugin.state_dict() == {"rounds": 4}
    restored = Visits()
    restored.load_state_dict({"rounds": 4})
    assert restored.rounds == 4
    restored.load_state_dict({})  # a checkpoint of an earlier release: kept
    assert restored.rounds == 4


def test_scaffold_declares_its_state_and_keeps_its_first_releases_store_key():
    scaffold = SCAFFOLD()
    assert scaffold.client_state_key("control") == "scaffold_c"
    assert list(scaffold.declared_round_sums()) == ["control_delta"]
    assert scaffold.state_dict() == {"server_control": None}


# ---- flags derived from the declarations (issue 79) -------------------------------------

#: Where each callback of the composition matrix keeps per-client state between rounds,
#: written by hand from the code: "store" (it moves with the client), "owner" (the client
#: stays on its owner), absent (none).
CLIENT_STATE_BY_HAND = {
    "SCAFFOLD": "store", "FedEM": "store", "Local": "store", "Ditto": "store",
    "APFL": "store", "FedRep": "store", "PFedMe": "store", "DPSGD": "store",
    "GossipAveraging": "owner", "AsynchronousFL": "owner", "ClusteredFL": "owner",
    "Unlearning": "owner",
}  # fmt: skip


def test_the_client_state_flags_are_derived_from_declarations_and_an_explicit_opt_in():
    from lightning_fl.engine.plugins import FederatedCallback
    from tests import composition

    class Plain(FederatedCallback):
        pass

    class Owned(FederatedCallback):
        undeclared_client_state = "owner"

    class Stored(FederatedCallback):
        undeclared_client_state = "store"

    flags = [(p.keeps_client_state, p.client_state_in_store) for p in
             (Plain(), Owned(), Stored(), Visits())]  # fmt: skip
    assert flags == [(False, False), (True, False), (True, True), (True, True)]
    for plugin in composition.PLUGINS:
        for callback in composition.build((plugin.name,)).callbacks:
            name = type(callback).__name__
            expected = CLIENT_STATE_BY_HAND.get(name)
            assert callback.keeps_client_state == (expected is not None), name
            assert callback.client_state_in_store == (expected == "store"), name


class Drift(FederatedCallback):
    """Per client: the sum of its updates (client state like θ); on the server: the sum of
    every round's Σ ω_i Δ_i (server state like θ), both zero before their first one."""

    def __init__(self) -> None:
        self.add_client_state("drift", like="params")
        self.add_server_state("total", like="params")
        self.add_round_rows("updates")  # each participant's update, in its row
        self.first_reads: dict[int, list[torch.Tensor]] = {}
        self.rows: list[tuple[tuple[int, ...], torch.Tensor]] = []

    def on_round_start(self, trainer, pl_module, state) -> None:
        assert [t.shape for t in self.total] == [p.shape for p in state.global_params]
        assert not state.round_rows(self, "updates").any()  # created at zero

    def on_client_end(self, trainer, pl_module, client, update, state) -> None:
        drift = self.client_state(state.store, client, "drift")
        self.first_reads.setdefault(client, [t.clone() for t in drift])
        new = torch._foreach_add(drift, update[: state.num_params])
        self.set_client_state(state.store, client, "drift", new)
        state.round_rows(self, "updates")[state.row_of(client)] = flatten(update)

    def on_round_end(self, trainer, pl_module, state) -> None:
        torch._foreach_add_(self.total, state.update_sum[: state.num_params])
        rows = state.round_rows(self, "updates").clone()
        self.rows.append((tuple(state.participation.clients), rows))


def test_state_like_the_parameters_starts_at_zero_and_sums_as_declared():
    """Three rounds of 3 of 10 clients: each client's first read is zero, its stored state
    is the sum of its updates, by hand (flattened in the store), and the server's is the
    sum of the rounds' update sums; a checkpoint's value is not reset at zero."""
    from lightning_fl.engine.tensors import flatten

    updates: dict[int, torch.Tensor] = {}
    sums: list[torch.Tensor] = []
    by_round: dict[int, dict[int, torch.Tensor]] = {}

    class Recorded(Drift):
        def on_client_end(self, trainer, pl_module, client, update, state) -> None:
            updates[client] = updates.get(client, 0) + flatten(update[: state.num_params])
            by_round.setdefault(state.round_idx, {})[client] = flatten(update).clone()
            super().on_client_end(trainer, pl_module, client, update, state)

        def on_round_end(self, trainer, pl_module, state) -> None:
            sums.append(flatten(state.update_sum[: state.num_params]).clone())
            super().on_round_end(trainer, pl_module, state)

    plugin = Recorded()
    assert plugin.total is None and plugin.server_state_like_params() == ["total"]
    strategy = FederatedStrategy(sampler=UniformSampler(3), local_steps=2, seed=5)
    trainer = make_trainer(strategy, 3, [plugin, FedAvg()])
    trainer.fit(tiny_module(), datamodule=tiny_datamodule())
    assert set(plugin.first_reads) == set(updates) and len(updates) > 3
    for first in plugin.first_reads.values():
        assert all(bool((t == 0).all()) for t in first)
    store = trainer.strategy.client_store
    for client, total in updates.items():
        stored = store.get(client, "Recorded.drift")
        assert stored.dim() == 1 and torch.allclose(stored, total, atol=1e-6), client
    assert torch.allclose(flatten(plugin.total), sum(sums), atol=1e-6)
    assert len(plugin.rows) == 3
    for (clients, rows), updates_of in zip(plugin.rows, by_round.values(), strict=True):
        assert rows.shape[0] == len(clients) == 3
        for row, client in enumerate(clients):  # participation order
            assert torch.equal(rows[row], updates_of[client]), client
    resumed = Drift()
    resumed.load_state_dict({"total": [torch.ones(2)]})
    assert [t.tolist() for t in resumed.total] == [[1.0, 1.0]]  # kept as loaded


def test_like_takes_only_params():
    import pytest

    with pytest.raises(ValueError, match="like must be 'params'"):
        Drift().add_client_state("x", like="buffers")
    with pytest.raises(ValueError, match="like must be 'params'"):
        Drift().add_server_state("y", like="buffers")
