"""The round planner in process (``lightning_fl/engine/planning.py``): who trains a round on
each rank, with which loaders and how many steps, by hand, on stand-in fit contexts of one
and two ranks (no process group: the planner's collectives are the client-store moves and
the loss probes' sum, both stood in for). The two-process runs of test_distributed.py run
under torchrun, where the mutation runner (issue 39) cannot see them."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_fl import FullParticipation, UniformSampler
from lightning_fl.callbacks import SCAFFOLD, FedAvg
from lightning_fl.datamodules import InMemoryFederatedDataModule
from lightning_fl.engine import planning
from lightning_fl.engine.client_store import ClientStore
from lightning_fl.engine.context import Plugins, Ranks
from lightning_fl.engine.planning import PADDING, RoundPlan, RoundPlanner
from lightning_fl.engine.plugins import CLIENT_UPDATES, POOLED_CLIENT, SERVER_CLIENT
from lightning_fl.engine.schedule import ClientSchedule
from lightning_fl.engine.seeding import generator
from lightning_fl.engine.tensors import FederatedTensors
from lightning_fl.systems.samplers import Participation
from tests.helpers import tiny_clients, tiny_module

SIZES = [4 + (c * 7) % 37 for c in range(10)]  # tiny_clients' training sizes


def _datamodule(batch_size=4, server=None):
    dm = InMemoryFederatedDataModule(tiny_clients(), batch_size=batch_size, server=server)
    dm.setup("fit")
    return dm


def _fit(world_size=1, rank=0, sampler=None, callbacks=None, datamodule=None, **config):
    callbacks = callbacks or [FedAvg()]
    module = tiny_module()
    dm = datamodule or _datamodule()
    settings = dict(seed=5, local_steps=None, local_epochs=2, vectorize=False,
                    max_vectorized_clients=None, local_steps_per_training_step=1,
                    silos=False, keep_optimizer_state=False)  # fmt: skip
    settings.update(config)
    counts = [len(dm.client_dataset(c, "train")) for c in range(dm.num_clients)]
    return SimpleNamespace(
        config=SimpleNamespace(**settings),
        datamodule=dm,
        module=module,
        ranks=Ranks(world_size, rank),
        plugins=Plugins(tuple(callbacks), callbacks[0], sampler or FullParticipation()),
        federation=SimpleNamespace(training_counts=counts, batches_per_pass=None),
        packed=None,
        store=ClientStore(),
        tensors=FederatedTensors(module),
        device=torch.device("cpu"),
        to_device=lambda batch: batch,
    )


def _first_batch(loader):
    return next(iter(loader))


def test_a_round_of_one_rank_by_hand():
    """The sampler's draw from (seed, round) with p_i = n_i / n; E = 2 passes of ⌈n_i/4⌉
    batches each; each loader shuffled with (seed, "data", round, client); the round's
    state: θ^t, a zero update sum, the counts, p and each client's local batches."""
    fit = _fit(sampler=UniformSampler(3))
    plan = RoundPlanner(fit).plan(2)
    p = torch.tensor(SIZES, dtype=torch.float64) / sum(SIZES)
    expected = UniformSampler(3).sample(2, 5, p)
    state = plan.state
    assert state.participation == expected and torch.equal(state.target_weights, p)
    clients = expected.clients
    batches = tuple(2 * math.ceil(SIZES[c] / 4) for c in clients)
    assert plan.schedule == plan.steps == ClientSchedule(clients, batches)
    assert plan.chunks is None and plan.moved is None
    assert state.local_steps == dict(zip(clients, batches))
    assert state.round_idx == 2 and list(state.sample_counts) == SIZES and state.num_clients == 10
    dm = fit.datamodule
    for client, loader in zip(clients, plan.loaders):
        own = dm.client_dataloader(
            dm.client_dataset(client, "train"), "train", generator(5, "data", 2, client)
        )
        assert torch.equal(_first_batch(loader)[0], _first_batch(own)[0])
    other_round = RoundPlanner(_fit(sampler=FullParticipation())).plan(3)
    client = clients[0]
    position = other_round.schedule.clients.index(client)
    assert not torch.equal(
        _first_batch(other_round.loaders[position])[0], _first_batch(plan.loaders[0])[0]
    )
    for global_t, zero, live in zip(state.global_tensors, state.update_sum, fit.tensors.tensors):
        assert torch.equal(global_t, live) and global_t is not live and not zero.any()
    assert CLIENT_UPDATES not in state.extra_sums


def test_two_ranks_split_the_round_and_pad_to_the_same_length():
    """FedAvg keeps no client state: the participants are split by steps (longest first);
    each rank plans only its own clients' loaders, and the rank with fewer batches ends
    with idle PADDING batches up to the other's total."""
    plans = [RoundPlanner(_fit(2, rank, local_epochs=1)).plan(0) for rank in (0, 1)]
    batches = {c: math.ceil(n / 4) for c, n in enumerate(SIZES)}
    # by hand, longest first (batches 1 3 5 7 8 10 3 4 6 8): 5 (10) → r0, 4 (8) → r1,
    # 9 (8) → r1, 3 (7) → r0, 8 (6) → r1, 2 (5) → r0, 7 (4) → r0 (tie 22: the lower rank),
    # 1 (3) → r1, 6 (3) → r1, 0 (1) → r0
    ranks = [0, 1, 0, 0, 1, 0, 1, 0, 1, 1]
    totals = []
    for rank, plan in enumerate(plans):
        mine = [c for c in range(10) if ranks[c] == rank]
        real = [c for c in plan.schedule.clients if c != PADDING]
        assert real == mine and len(plan.loaders) == len(mine)
        totals.append(sum(batches[c] for c in mine))
    longest = max(totals)
    for rank, plan in enumerate(plans):
        assert plan.schedule.total == longest
        padded = totals[rank] < longest
        assert plan.is_padding(len(plan.schedule.clients) - 1) == padded
        if padded:
            assert plan.schedule.num_batches[-1] == longest - totals[rank]
    assert totals == [27, 28]


def test_local_steps_silos_and_the_server_client():
    """K local steps for every participant and one for SAFARI's server; in silo mode,
    E passes of each silo's own count of batches (no loader is built); without a length,
    local_epochs is refused with the fix."""
    planner = RoundPlanner(_fit(local_steps=3))
    assert planner._num_batches([SERVER_CLIENT, 4, 1], {}, 0) == [1, 3, 3]
    silo = _fit(local_epochs=3)
    silo.federation.batches_per_pass = [2, 5, 1, 7]
    assert RoundPlanner(silo)._num_batches([2, 0, SERVER_CLIENT, 3], {}, 0) == [3, 6, 1, 21]
    epochs = RoundPlanner(_fit(local_epochs=2))
    assert epochs._client_batches(SERVER_CLIENT, None) == 1
    assert epochs._client_batches(3, [0] * 5) == 10
    with pytest.raises(TypeError, match="use local_steps for iterable-style client datasets"):
        epochs._client_batches(3, iter([]))


def test_packed_clients_count_their_batches_and_draw_by_index():
    """Packed data: E · ⌈n/B⌉ from the packed federation's counts; vectorized chunks draw
    by index (no loader); the pooled pseudo-client's loader is built from the pooled data."""
    packed = SimpleNamespace(
        num_batches_per_pass=lambda clients: torch.tensor([3 + c for c in clients]),
        client_dataset=lambda client: TensorDataset(torch.arange(6.0)),
    )
    fit = _fit(local_epochs=2)
    fit.packed = packed
    planner = RoundPlanner(fit)
    assert planner._num_batches([1, 4], {}, 0) == [8, 14]
    assert planner.packs(2) and planner.packs(0) and not planner.packs(POOLED_CLIENT)
    assert len(planner._loader(2, 0).dataset) == 6
    pooled = planner._loader(POOLED_CLIENT, 0)
    assert len(pooled.dataset) == sum(SIZES)
    assert planner._num_batches([POOLED_CLIENT], {}, 0) == [2 * math.ceil(sum(SIZES) / 4)]
    vectorized = _fit(local_epochs=1, vectorize=True)
    vectorized.packed = packed
    plan = RoundPlanner(vectorized).plan(0)
    assert plan.loaders == [None] * 10 and plan.packed_chunk(0)
    assert plan.chunk_local_steps(0) == 3 + 9
    steps = _fit(local_steps=2, vectorize=True)  # K steps: no loader is needed either
    steps.packed = packed
    assert RoundPlanner(steps).plan(0).loaders == [None] * 10
    sequential = _fit(local_steps=2)  # sequential clients read their packed data by loader
    sequential.packed = packed
    assert [len(loader.dataset) for loader in RoundPlanner(sequential).plan(0).loaders] == [6] * 10
    unpacked = RoundPlanner(_fit(local_steps=2, vectorize=True)).plan(0)
    assert [len(loader.dataset) for loader in unpacked.loaders] == SIZES


def test_the_server_clients_loader_reads_the_server_data():
    server = (torch.randn(7, 5), torch.randint(0, 3, (7,)))
    planner = RoundPlanner(_fit(datamodule=_datamodule(server=server)))
    loader = planner._loader(SERVER_CLIENT, 0)
    assert torch.equal(loader.dataset.tensors[0], server[0])


def test_vectorized_chunks_fuse_steps_and_pad():
    """Chunks of 2 with every local step in one Lightning step (fused None): one step per
    chunk; a rank with 3 chunks pads a rank with 2 by one idle step."""
    planner = RoundPlanner(
        _fit(vectorize=True, max_vectorized_clients=2, local_steps_per_training_step=None)
    )
    per_rank = [[4, 1, 6], [2, 2, 9, 3, 5]]
    schedule, steps, chunks = planner._schedules([0, 2, 4], [4, 1, 6], per_rank)
    assert chunks == [(0, 1), (2,)] and schedule == ClientSchedule((0, 2, 4), (4, 1, 6))
    assert steps == ClientSchedule((0, 1, PADDING), (1, 1, 1))
    assert planning._fused(7, None) == 1 and planning._fused(7, 3) == 3
    assert planning._fused(6, 3) == 2 and planning._fused(0, None) == planning._fused(0, 3) == 0
    assert planning._chunked_steps([2, 2, 9, 3, 5], 2, 4) == 1 + 3 + 2
    assert planning._chunked_steps([2, 2, 9, 3, 5], None, 4) == 3
    plan = RoundPlan(schedule, [None, object(), None], None, steps, chunks)
    assert not plan.packed_chunk(0) and plan.packed_chunk(1)
    assert plan.chunk_local_steps(0) == 4 and plan.chunk_local_steps(1) == 6


def test_clients_without_data_are_skipped_and_named_once():
    """A participant with no data this round is dropped with the others' weights kept,
    counted in ``skipped_now``, and named in one warning, sorted and cut at 10."""

    class Gaps(InMemoryFederatedDataModule):
        gaps: list[int] = []

        def clients_without_data_now(self, clients):
            return [c for c in clients if c in self.gaps]

    dm = Gaps(tiny_clients(14), batch_size=4)
    dm.setup("fit")
    planner = RoundPlanner(_fit(datamodule=dm))
    everyone = Participation(tuple(range(14)), tuple(0.1 * (c + 1) for c in range(14)))
    dm.gaps = [13, 0, 12, 1, 11, 2, 10, 3, 9, 4, 8]
    with pytest.warns(UserWarning) as caught:
        kept = planner._skip_clients_without_data(everyone, 4)
    assert str(caught[0].message).startswith(
        "Round 4: clients [0, 1, 2, 3, 4, 8, 9, 10, 11, 12] have no training data"
    )
    assert (
        kept == Participation((5, 6, 7), tuple(0.1 * (c + 1) for c in (5, 6, 7)))
        and planner.skipped_now == 11
    )
    dm.gaps = [6]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = planner._skip_clients_without_data(everyone, 5)
        assert len(kept.clients) == 13 and planner.skipped_now == 1
        dm.gaps = []
        assert planner._skip_clients_without_data(everyone, 6) is everyone
        assert planner.skipped_now == 0


def test_clients_without_any_data_are_warned_once_unseen_ones_never():
    dm = _datamodule()
    dm.unseen_clients = [3]
    planner = RoundPlanner(_fit(datamodule=dm))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planner._warn_clients_without_data([5, 4, 2, 0])  # only the unseen client 3 is empty
    empty = [0] * 12 + [5]
    with pytest.warns(UserWarning, match=r"^Skipping 11 client\(s\) with no training data: "
                      r"\[0, 1, 2, 4, 5, 6, 7, 8, 9, 10\]\.\.\.$"):  # fmt: skip
        planner._warn_clients_without_data(empty)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planner._warn_clients_without_data(empty)
    two = RoundPlanner(_fit(datamodule=_datamodule()))
    with pytest.warns(UserWarning, match=r"data: \[0, 1\]$"):
        two._warn_clients_without_data([0, 0, 3])
    ten = RoundPlanner(_fit(datamodule=_datamodule()))
    with pytest.warns(UserWarning, match=r"data: \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9\]$"):
        ten._warn_clients_without_data([0] * 10 + [3])  # all ten named: no "..."


def test_who_may_train_away_from_its_owner():
    """Silo mode never moves a client; a callback whose per-client state stays outside the
    client store, or a stream datamodule, keeps clients on their owners; the answer is
    read once."""
    assert not RoundPlanner(_fit(2, silos=True)).balanced()
    assert RoundPlanner(_fit(2, callbacks=[SCAFFOLD()])).balanced()
    fixed = SimpleNamespace(keeps_client_state=True, client_state_in_store=False)
    store = SimpleNamespace(keeps_client_state=True, client_state_in_store=True)
    none = SimpleNamespace(keeps_client_state=False, client_state_in_store=False)
    assert not RoundPlanner(_fit(2, callbacks=[FedAvg(), fixed])).balanced()
    assert RoundPlanner(_fit(2, callbacks=[FedAvg(), store, none])).balanced()

    class Stream(InMemoryFederatedDataModule):
        def set_round(self, round_idx):
            pass

    streams = Stream(tiny_clients(), batch_size=4)
    planner = RoundPlanner(_fit(2, datamodule=streams))
    assert not planner.balanced()
    planner.fit.datamodule = _datamodule()
    assert not planner.balanced()  # read once per fit
    assert planner.ranks([0, 1, 2, 3], [1, 9, 9, 1]) == [0, 1, 0, 1]  # owners


def test_states_move_to_the_training_rank_and_back(monkeypatch):
    """With SCAFFOLD (state in the client store) on 2 ranks, the participants that train
    away from their owner are moved there (owner, trainer) and back (trainer, owner) at
    the round's end; the pooled pseudo-client never moves."""
    calls = []

    def record(store, moves, rank, world_size):
        calls.append((moves, rank, world_size))

    monkeypatch.setattr(planning, "move_client_states", record)
    planner = RoundPlanner(_fit(2, 1, callbacks=[SCAFFOLD()]))
    moved = planner._move_states_in([0, 1, 2, 3, POOLED_CLIENT], [1, 1, 0, 0, 0])
    assert moved == {0: (0, 1), 3: (1, 0)}
    assert calls == [({0: (0, 1), 3: (1, 0)}, 1, 2)]
    planner.return_states(SimpleNamespace(moved=moved))
    assert calls[1] == ({0: (1, 0), 3: (0, 1)}, 1, 2)
    planner.return_states(SimpleNamespace(moved=None))
    assert len(calls) == 2
    assert RoundPlanner(_fit(2, 1))._move_states_in([0, 1], [1, 0]) is None  # nothing kept
    assert RoundPlanner(_fit(1, 0, callbacks=[SCAFFOLD()]))._move_states_in([0], [0]) is None


def test_ranks_by_owner_when_one_process_or_state_stays():
    planner = RoundPlanner(_fit(3, 0, silos=True))
    assert planner.ranks([0, 4, 5, 7], [9, 1, 1, 1]) == [0, 1, 2, 1]
    assert RoundPlanner(_fit(1, 0)).ranks([3, 1], [1, 9]) == [0, 0]
    # three ranks by steps, ties to the earlier participant and the lower rank
    assert RoundPlanner(_fit(3, 0)).ranks([0, 1, 2, 3, 4], [4, 4, 4, 4, 1]) == [0, 1, 2, 0, 1]
    # a client drawn twice (MD sampling) weighs both its draws, 3 + 3, and trains on one
    # rank: client 5 (6 steps) first, then 7 (5), then 2 (4) on the less loaded rank 1
    assert RoundPlanner(_fit(2, 0)).ranks([5, 2, 5, 7], [3, 4, 3, 5]) == [0, 1, 0, 1]


def test_a_sampler_that_needs_updates_gets_a_row_per_participant():
    class Observing(FullParticipation):
        needs_updates = True

    fit = _fit(sampler=Observing())
    plan = RoundPlanner(fit).plan(0)
    size = sum(t.numel() for t in fit.tensors.tensors) + 1
    (rows,) = plan.state.extra_sums[CLIENT_UPDATES]
    assert rows.shape == (10, size) and not rows.any()


def test_loss_probes_on_this_ranks_clients(monkeypatch):
    """CA-Fed's probe: the current model's loss on the first batch of a loader shuffled
    with (seed, "loss_probe", round, client), for this rank's clients only (the others'
    are summed in from their ranks)."""
    fit = _fit(2, 1)
    planner = RoundPlanner(fit)
    losses = planner._probe_losses([1, 2, 3], 7)
    dm = fit.datamodule
    expected = []
    for client in (1, 3):
        loader = dm.client_dataloader(
            dm.client_dataset(client, "train"), "train", generator(5, "loss_probe", 7, client)
        )
        expected.append(float(fit.module.loss_and_metrics(_first_batch(loader))[0]))
    assert losses[0] == pytest.approx(expected[0], rel=1e-12) and losses[1] == 0.0
    assert losses[2] == pytest.approx(expected[1], rel=1e-12)
    assert losses[0] != pytest.approx(losses[2])

    class Probed(FullParticipation):
        needs_losses = True

    sampler = Probed()
    RoundPlanner(_fit(1, 0, sampler=sampler)).plan(7)
    assert sampler.losses([1])[0] == pytest.approx(
        RoundPlanner(_fit(1, 0))._probe_losses([1], 7)[0], rel=1e-12
    )


def test_a_plan_moves_the_datamodule_to_its_round_and_warns_of_empty_clients():
    """``plan`` first moves a stream's caches to the round (``set_round``), then warns of
    the clients without any training data (once per fit), then draws among the others."""

    class Recording(InMemoryFederatedDataModule):
        rounds: list[int] = []

        def set_round(self, round_idx):
            self.rounds.append(round_idx)

    clients = tiny_clients()
    clients[6]["train"] = (clients[6]["train"][0][:0], clients[6]["train"][1][:0])
    dm = Recording(clients, batch_size=4)
    dm.setup("fit")
    planner = RoundPlanner(_fit(datamodule=dm))
    with pytest.warns(UserWarning, match=r"Skipping 1 client\(s\) with no training data: \[6\]$"):
        plan = planner.plan(4)
    assert dm.rounds == [4] and 6 not in plan.schedule.clients
    assert len(plan.schedule.clients) == 9


def test_a_resumed_rank_loads_only_the_clients_it_owns_and_that_still_exist():
    """A checkpoint holds every rank's clients (gathered to one file): rank 1 of 3 takes
    back clients 1 and 4 (c mod 3 = 1) of a federation of 7, not the other ranks'
    clients, nor client 7 of the checkpoint's larger federation (kept under
    ``allow_new_federation``); the bad-round count and the sampler's state come back."""
    from lightning_fl.engine.federated_state import load_federated_state_dict

    fit = _fit(world_size=3, rank=1, allow_new_federation=True)
    identity = {"datamodule": "X", "num_clients": 7, "train_counts": [5] * 7,
                "partition_seed": None}  # fmt: skip
    fit.federation = SimpleNamespace(num_clients=7, identity=lambda: identity)
    restored = []
    fit.plugins.sampler.load_state_dict = restored.append
    engine = SimpleNamespace(consecutive_bad_rounds=0)
    state = {"seed": 5, "federation": {**identity, "num_clients": 8, "train_counts": [5] * 8},
             "client_store": {c: {"own": torch.tensor(float(c))} for c in range(8)},
             "sampler": {"drawn": 3}, "consecutive_bad_rounds": 2}  # fmt: skip
    with pytest.warns(UserWarning, match="another federation"):
        load_federated_state_dict(fit, engine, state)
    assert fit.store.clients() == [1, 4]
    assert [float(fit.store.get(c, "own")) for c in (1, 4)] == [1.0, 4.0]
    assert engine.consecutive_bad_rounds == 2 and restored == [{"drawn": 3}]


def test_a_federations_counts_held_out_clients_and_splits_by_hand():
    """7 clients of unequal sizes, clients 5 and 6 held out (unseen), client 2 without
    validation data: the training counts zero the unseen, the masks and sets name them, the
    splits' counts and the clients with data are the datamodule's, read once."""
    from lightning_fl.datamodules import ArrayFederatedDataModule
    from lightning_fl.datamodules.arrays import ClientArrays
    from lightning_fl.engine.context import Federation, client_training_counts

    def arrays(sizes):
        x = np.zeros((sum(sizes), 2), "float32")
        return ClientArrays([x, np.zeros(sum(sizes), "int64")], np.cumsum([0, *sizes]))

    train, val = [3, 1, 4, 1, 5, 9, 2], [1, 2, 0, 1, 1, 3, 1]
    dm = ArrayFederatedDataModule(splits={"train": arrays(train), "val": arrays(val)},
                                  unseen_fraction=2 / 7)  # fmt: skip
    fed = Federation(dm)
    assert fed.training_counts.tolist() == [3, 1, 4, 1, 5, 0, 0]
    assert not fed.training_counts.flags.writeable
    assert fed.unseen.tolist() == [5, 6] and fed.unseen_set == frozenset({5, 6})
    assert fed.unseen_mask.tolist() == [False] * 5 + [True, True]
    assert fed.split_counts("val").tolist() == val and fed.has_validation_data()
    assert fed.clients_with_data("val").tolist() == [0, 1, 3, 4, 5, 6]
    assert fed.clients_with_data("train").tolist() == [0, 1, 2, 3, 4]
    assert fed.split_counts("val") is fed.split_counts("val")  # read once
    no_val = ArrayFederatedDataModule(splits={"train": arrays(train)})
    assert not Federation(no_val).has_validation_data()
    empty = ArrayFederatedDataModule(splits={"train": arrays([0, 0, 2])}, unseen_fraction=1 / 3)
    with pytest.raises(ValueError, match="Every client has an empty training set"):
        Federation(empty)
    assert client_training_counts(empty, require_data=False).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("settings", "refused"),
    [
        ({"eval_clients": 1}, None),
        ({"eval_clients": 0}, "eval_clients must be a number of clients >= 1"),
        ({"eval_clients": True}, "eval_clients must be a number of clients >= 1"),
        ({"vectorize_evaluation": True}, None),
        ({"vectorize_evaluation": False}, None),
        ({"vectorize_evaluation": "yes"}, "vectorize_evaluation must be True, False or 'auto'"),
        ({"local_steps_per_training_step": 1}, None),
        ({"local_steps_per_training_step": 2}, None),
        ({"local_steps_per_training_step": None}, None),
        ({"local_steps_per_training_step": 2, "vectorize": True}, None),
        ({"local_steps_per_training_step": 0, "vectorize": True}, "must be >= 1 or None"),
        ({"local_steps_per_training_step": 0}, "must be >= 1 or None"),
    ],
)
def test_the_configs_checks_at_both_ends_of_their_ranges(settings, refused):
    from lightning_fl import FederatedStrategy

    if refused is None:
        FederatedStrategy(**settings)
    else:
        with pytest.raises(ValueError, match=refused):
            FederatedStrategy(**settings)
