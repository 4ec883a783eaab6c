"""The engine owns its contract (issue 37): its modules are given what they read (a frozen
configuration and the fit's context, :mod:`lightning_fl.engine.context`), never the
strategy, and the plugin contract lives in the engine (:mod:`lightning_fl.engine.plugins`),
which never imports the plugins of ``lightning_fl.callbacks``.

Imports are counted wherever they are written: at the top, under ``TYPE_CHECKING`` and
inside functions.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "lightning_fl" / "engine"


def imported_modules(source: str, package: str = "lightning_fl.engine") -> set[str]:
    """Every module ``source`` imports, anywhere in it; ``from package import name`` counts
    as importing ``package.name`` (a submodule) and relative imports are resolved."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{module}" if module else base
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def engine_imports() -> dict[str, set[str]]:
    """Each engine module (by dotted name) and the modules it imports."""
    return {
        f"lightning_fl.engine.{path.stem}": imported_modules(path.read_text())
        for path in sorted(ENGINE.glob("*.py"))
        if path.stem != "__init__"
    }


def forbidden_imports(imports: dict[str, set[str]]) -> list[str]:
    """``module -> import`` for every engine module that imports the strategy (other than
    the strategy's own module) or anything of ``lightning_fl.callbacks`` or
    ``lightning_fl.datamodules`` (the engine owns both contracts: every import runs one
    way, as the folders show it)."""
    bad = []
    for module, modules in imports.items():
        for name in sorted(modules):
            strategy = name.startswith("lightning_fl.engine.strategy")
            above = any(
                name == package or name.startswith(f"{package}.")
                for package in ("lightning_fl.callbacks", "lightning_fl.datamodules")
            )
            if (strategy and module != "lightning_fl.engine.strategy") or above:
                bad.append(f"{module} -> {name}")
    return bad


def import_cycle(imports: dict[str, set[str]]) -> list[str] | None:
    """A cycle among the engine's modules (as a list of modules, first = last), or None."""
    graph = {m: sorted(n for n in names if n in imports and n != m) for m, names in imports.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for nxt in graph[module]:
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in graph:
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_engine_module_imports_the_strategy_or_the_callbacks():
    bad = forbidden_imports(engine_imports())
    assert not bad, "the engine is given what it reads (engine/context.py): " + "; ".join(bad)


def test_the_engine_has_no_import_cycle_counting_type_only_and_local_imports():
    cycle = import_cycle(engine_imports())
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
         "    from lightning_fl.engine.strategy import FederatedStrategy\n",
         ["lightning_fl.engine.planning -> lightning_fl.engine.strategy",
          "lightning_fl.engine.planning -> lightning_fl.engine.strategy.FederatedStrategy"]),
        ("def f():\n    from lightning_fl import callbacks\n",
         ["lightning_fl.engine.planning -> lightning_fl.callbacks"]),
        ("def f():\n    from lightning_fl.callbacks.base import Aggregator\n",
         ["lightning_fl.engine.planning -> lightning_fl.callbacks.base",
          "lightning_fl.engine.planning -> lightning_fl.callbacks.base.Aggregator"]),
        ("from .strategy import FederatedStrategy\n",
         ["lightning_fl.engine.planning -> lightning_fl.engine.strategy",
          "lightning_fl.engine.planning -> lightning_fl.engine.strategy.FederatedStrategy"]),
        ("from lightning_fl.engine.plugins import Aggregator\n", []),
    ],
    ids=["type-only", "function-local", "callbacks.base", "relative", "the-contract"],
)  # fmt: skip
def test_the_scan_finds_imports_wherever_they_are_written(source, expected):
    imports = {"lightning_fl.engine.planning": imported_modules(source)}
    assert forbidden_imports(imports) == expected


def test_the_cycle_check_sees_a_type_only_back_edge():
    """planning -> rounds is fine; a type-only import of planning in rounds closes a
    circle, which the check reports."""
    imports = {
        "lightning_fl.engine.planning": imported_modules(
            "from lightning_fl.engine.rounds import ClientSchedule\n"
        ),
        "lightning_fl.engine.rounds": imported_modules(
            "if TYPE_CHECKING:\n    from lightning_fl.engine.planning import RoundPlan\n"
        ),
    }
    assert import_cycle(imports) == [
        "lightning_fl.engine.planning",
        "lightning_fl.engine.rounds",
        "lightning_fl.engine.planning",
    ]
    del imports["lightning_fl.engine.rounds"]
    assert import_cycle(imports) is None


def test_the_plugin_contract_is_the_engines_and_reexported_where_users_import_it():
    from lightning_fl import callbacks
    from lightning_fl.callbacks import base
    from lightning_fl.engine import plugins

    for name in ("FederatedCallback", "Aggregator", "RoundState", "FedAvg"):
        assert getattr(callbacks, name) is getattr(plugins, name)
    for name in ("FederatedCallback", "Aggregator", "RoundState", "POOLED_CLIENT"):
        assert getattr(base, name) is getattr(plugins, name)


def test_the_configuration_is_frozen_and_the_strategy_reads_it():
    from lightning_fl import FederatedStrategy

    strategy = FederatedStrategy(local_steps=3, seed=7, keep_optimizer_state=True)
    config = strategy.config
    assert (config.local_steps, config.seed, config.keep_optimizer_state) == (3, 7, True)
    assert config.local_epochs is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.config.seed = 8  # one owner: the frozen configuration
    assert not hasattr(strategy, "seed")


def test_a_sample_count_is_read_once_and_every_reader_asks_the_federation(monkeypatch):
    """The walk of a client's sample count: the datamodule's ``sample_counts`` is read
    once per fit, by the fit's Federation; the planner's target weights p_i, the sampler's
    draw, the strategy's ``training_counts`` (the plugins') and the checkpoint's federation
    all ask it. The counts are unequal (tiny_datamodule), so p_i = n_i / n is checked
    against numbers that differ from uniform weights."""
    from lightning_fl import FederatedStrategy
    from lightning_fl.callbacks import FedAvg
    from tests.helpers import make_trainer, tiny_datamodule, tiny_module

    dm = tiny_datamodule()
    reads = []
    original = type(dm).sample_counts

    def counting(self, split):
        if split == "train":
            reads.append(split)
        return original(self, split)

    monkeypatch.setattr(type(dm), "sample_counts", counting)
    trainer = make_trainer(FederatedStrategy(local_steps=2), 3, [FedAvg()])
    trainer.fit(tiny_module(), datamodule=dm)
    fit = trainer.strategy.fit
    assert len(reads) == 1
    counts = original(dm, "train")
    assert fit.federation.training_counts.tolist() == counts
    assert trainer.strategy.fit.federation.training_counts.tolist() == counts
    assert len(set(counts)) > 1
    state = trainer.strategy.current_round.state
    expected = [n / sum(counts) for n in counts]
    assert state.target_weights.tolist() == pytest.approx(expected, rel=1e-12)
    assert state.sample_counts.tolist() == counts
    assert fit.federation.identity()["train_counts"] == counts


def test_the_federation_of_two_silos_is_gathered_once_by_hand(monkeypatch):
    """Silo mode's one collective, with 2 silos of unequal clients (tiny_datamodule: client
    c holds its own counts): each silo contributes only its own clients' train and
    validation counts and batches per pass; the merged lists equal the simulation's, the
    unseen clients count 0 for training, and batches per pass are ⌈n/B⌉."""
    import math

    from lightning_fl.datamodules import InMemoryFederatedDataModule
    from lightning_fl.engine import collectives
    from lightning_fl.engine.context import Federation, Ranks
    from tests.helpers import tiny_clients, tiny_datamodule

    silos = []
    for rank in (0, 1):
        dm = tiny_datamodule(batch_size=3)
        dm.unseen_clients = [9]
        dm.enter_silo(rank, 2)
        silos.append(dm)
    gathered = []

    class OtherSilo(collectives.Collectives):  # the other silo's contribution, as gloo gives it
        def all_gather_object(self, local):
            gathered.append(local)
            other = silos[1].local_sample_counts("train")
            mine = {"train": other, "val": silos[1].local_sample_counts("val"),
                    "batches": {c: math.ceil(n / 3) for c, n in other.items()}}  # fmt: skip
            return [local, mine]

        def all_reduce(self, tensor):
            raise AssertionError("no sum at set-up")

        broadcast = all_reduce

    monkeypatch.setattr(collectives, "_installed", OtherSilo())
    federation = Federation(silos[0], ranks=Ranks(2, 0))
    whole = tiny_datamodule(batch_size=3)
    train = whole.sample_counts("train")
    assert len(gathered) == 1 and set(gathered[0]["train"]) == {0, 2, 4, 6, 8}
    assert len(set(train)) > 1
    assert list(federation.training_counts) == [*train[:9], 0]  # client 9 unseen
    assert federation.has_validation_data() == any(whole.sample_counts("val"))
    assert federation._validation_counts == whole.sample_counts("val")
    per_pass = federation.batches_per_pass  # indexed by client, as the planner reads it
    assert [per_pass[c] for c in range(10)] == [math.ceil(n / 3) for n in train]
    outside = Federation(tiny_datamodule(batch_size=3))
    assert outside.batches_per_pass is None and list(outside.training_counts) == train
    empty = tiny_datamodule()
    empty.unseen_clients = list(range(10))
    empty.enter_silo(0, 1)
    with pytest.raises(ValueError, match="Every silo's clients have an empty training set"):
        Federation(empty, ranks=Ranks(1, 0))
    assert (
        Federation(empty, require_data=False, ranks=Ranks(1, 0)).training_counts.tolist()
        == [0] * 10
    )
    assert Federation(empty, require_data=False).training_counts.tolist() == [0] * 10  # 1 process
    clients = tiny_clients()
    clients[3]["train"] = (clients[3]["train"][0][:0], clients[3]["train"][1][:0])
    one_silo = InMemoryFederatedDataModule(clients, batch_size=3)
    one_silo.enter_silo(0, 1)
    federation = Federation(one_silo)
    assert federation.training_counts[3] == 0 and federation.batches_per_pass[3] == 0
    assert federation.batches_per_pass[4] == math.ceil(train[4] / 3)


def test_the_aggregator_runs_first_and_observers_first_in_client_evaluation():
    """Every hook runs the aggregator first (it decides which model a client starts from,
    and its ``transform_update`` makes the update the client's own), then the others in
    the order given; in the client evaluation hooks the evaluation
    observers (membership inference) run before everyone."""
    from lightning_fl import FederatedStrategy
    from lightning_fl.callbacks import FedAvg
    from lightning_fl.engine.plugins import FederatedCallback
    from tests.helpers import make_trainer, tiny_datamodule, tiny_module

    calls: dict[str, list[str]] = {
        "on_round_start": [], "on_client_evaluation_start": [], "transform_update": []
    }  # fmt: skip

    def recording(base, name, **attributes):
        def hook(kind):
            def record(self, *args):
                calls[kind].append(name)
                return args[3] if kind == "transform_update" else None  # the update

            return record

        hooks = {kind: hook(kind) for kind in calls}
        return type(name, (base,), {**hooks, **attributes})()

    callbacks = [recording(FederatedCallback, "plain"), recording(FedAvg, "aggregator"),
                 recording(FederatedCallback, "observer", evaluation_observer=True)]  # fmt: skip
    trainer = make_trainer(FederatedStrategy(local_steps=1, seed=0), 1, callbacks,
                           limit_val_batches=1.0)  # fmt: skip
    trainer.fit(tiny_module(), datamodule=tiny_datamodule(num_clients=3))
    assert calls["on_round_start"] == ["aggregator", "plain", "observer"]
    assert calls["transform_update"][:3] == ["aggregator", "plain", "observer"]  # a client
    evaluation = calls["on_client_evaluation_start"]
    assert evaluation and evaluation[:3] == ["observer", "aggregator", "plain"]


@pytest.mark.parametrize("vectorize", [False, True])
def test_the_round_state_lists_the_accepted_clients_on_both_paths(vectorize):
    """RoundState.accepted (part of the plugin contract) holds the round's participants
    whose update was folded in, in the batched vectorized lifecycle as sequentially."""
    from lightning_fl import FederatedStrategy, UniformSampler
    from lightning_fl.engine.plugins import FederatedCallback
    from tests.helpers import make_trainer, tiny_datamodule, tiny_module

    seen = []

    class Accepted(FederatedCallback):
        supports_vectorized_clients = True

        def on_round_end(self, trainer, pl_module, state) -> None:
            seen.append((sorted(state.accepted), list(state.participation.clients)))

    strategy = FederatedStrategy(local_steps=1, seed=0, sampler=UniformSampler(3),
                                 vectorize=vectorize)  # fmt: skip
    make_trainer(strategy, 3, [Accepted()]).fit(tiny_module(), datamodule=tiny_datamodule())
    assert len(seen) == 3
    assert all(accepted == participants and len(accepted) == 3 for accepted, participants in seen)


def test_who_keeps_client_state_decides_whether_states_move_and_ranks_need_a_group():
    """A callback with per-client state (SCAFFOLD's c_i) or a kept optimizer state makes
    the planner move a client's entries with it; FedAvg alone does not. Two ranks without a
    process group run no collective."""
    from types import SimpleNamespace

    from lightning_fl import FullParticipation
    from lightning_fl.callbacks import SCAFFOLD, FedAvg
    from lightning_fl.engine.context import Plugins, Ranks
    from lightning_fl.engine.planning import RoundPlanner

    def planner(callbacks, keep_optimizer_state=False):
        plugins = Plugins(tuple(callbacks), callbacks[0], FullParticipation())
        config = SimpleNamespace(keep_optimizer_state=keep_optimizer_state, silos=False)
        return RoundPlanner(SimpleNamespace(plugins=plugins, config=config))

    assert planner([FedAvg()]).moves_state() is False
    assert planner([SCAFFOLD()]).moves_state() is True
    assert planner([FedAvg()], keep_optimizer_state=True).moves_state() is True
    assert not Ranks(2, 0).distributed and not Ranks(1, 0).distributed


def test_a_process_group_of_one_runs_no_collective():
    """Under an initialized process group of one process (a user's own, or Lightning's
    on one device) the fit is not distributed; of two ranks it is."""
    import torch.distributed as dist

    from lightning_fl.engine.context import Ranks

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert not Ranks(1, 0).distributed and Ranks(2, 0).distributed
    finally:
        dist.destroy_process_group()


def _aggregators():
    from lightning_fl import AsyncSchedule, ClientTimes, FedBuffSchedule
    from lightning_fl.callbacks import (
        SAFARI,
        AsynchronousFL,
        ClusteredFL,
        FedAdam,
        FedAvg,
        GossipAveraging,
        Local,
        Pooled,
    )

    return {
        "FedAvg": lambda: FedAvg(server_lr=0.7),
        "FedAdam": lambda: FedAdam(server_lr=0.05),
        "AsynchronousFL": lambda: AsynchronousFL(AsyncSchedule(ClientTimes(80.0))),
        "FedBuff": lambda: AsynchronousFL(FedBuffSchedule(2, ClientTimes(50.0))),
        "ClusteredFL": lambda: ClusteredFL(eps1=10.0, eps2=0.0, warmup_rounds=1),
        "Local": Local,
        "GossipAveraging": lambda: GossipAveraging(graph="erdos_renyi", edge_probability=0.6),
        "SAFARI": lambda: SAFARI(q=1.0),
        "Pooled": Pooled,
    }


@pytest.mark.parametrize("vectorize", [False, True])
@pytest.mark.parametrize("aggregator", list(_aggregators()))
def test_every_callback_receives_the_clients_own_update(aggregator, vectorize):
    """Part of the plugin contract (RoundState's docstring): whatever model the aggregator
    starts a client from (θ^t, the stale θ^ρ, its cluster's, its own), the update the
    other callbacks' ``transform_update`` and ``on_client_end`` receive is θ_i − θ_i^start,
    the client's trained model minus the one its steps started from (SCAFFOLD's control
    variates read it). Rounds enough for stale clients, own models, cluster splits."""
    from lightning_fl import FederatedStrategy
    from lightning_fl.engine.plugins import FederatedCallback
    from lightning_fl.engine.tensors import flatten
    from tests.helpers import make_trainer, tiny_datamodule, tiny_module

    class OwnUpdate(FederatedCallback):
        supports_vectorized_clients = True

        def __init__(self) -> None:
            self.starts, self.gaps = {}, []

        def on_client_start(self, trainer, pl_module, client, state) -> None:
            self.starts[client] = flatten(trainer.strategy.fit.tensors.tensors).clone()

        def on_client_end(self, trainer, pl_module, client, update, state) -> None:
            end = flatten(trainer.strategy.fit.tensors.tensors)
            own = end - self.starts.pop(client)
            self.gaps.append(float((flatten(update) - own).abs().max()))

    spy = OwnUpdate()
    strategy = FederatedStrategy(local_steps=2, seed=1, vectorize=vectorize)
    trainer = make_trainer(strategy, 5, [_aggregators()[aggregator](), spy])
    trainer.fit(tiny_module(), datamodule=tiny_datamodule(num_clients=6))
    assert len(spy.gaps) >= 5 and max(spy.gaps) <= 1e-6, (aggregator, max(spy.gaps))
