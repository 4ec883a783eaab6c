"""The federation on the device (engine/packed.py, issue 34): batched seeds equal the
per-client ones, packed batches equal the loaders' batches, vectorized rounds over packed
data equal the hand-written loop and the other paths, and the Python work of a
vectorized round does not grow with its number of clients."""

from __future__ import annotations

from collections import Counter

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from lightning_fl import MLP, Classifier, FederatedStrategy, MDSampler, UniformSampler
from lightning_fl.callbacks import SCAFFOLD, FedAvg, FedProx, Local
from lightning_fl.callbacks.baselines import STORE_KEY as LOCAL_KEY
from lightning_fl.datamodules import InMemoryFederatedDataModule
from lightning_fl.engine import packed as packed_module
from lightning_fl.engine.packed import pack_federation
from lightning_fl.engine.schedule import cycle_batches
from lightning_fl.engine.seeding import derive_seed, derive_seeds, generator
from lightning_fl.engine.tensors import adjacent_view, uniform_rows
from lightning_fl.engine.vectorized_checks import needs_client_hooks
from tests.helpers import (
    CallCounter,
    make_trainer,
    max_abs_diff,
    params_of,
    tiny_clients,
    tiny_datamodule,
    tiny_module,
)
from tests.test_exactness import reference, run_strategy


@pytest.mark.parametrize("keys", [(), (0,), (7,), (3, 11), (2**32 + 5, 1, 2)])
def test_derive_seeds_equals_derive_seed_bit_for_bit(keys):
    last = [0, 1, 2, 3549, -3, -1, 2**31, 2**32 - 1, 2**32 + 7, 123456789012]
    for seed in (0, 3, 2**40 + 17):
        expected = [derive_seed(seed, "data", *keys, k) for k in last]
        assert derive_seeds(seed, "data", *keys, last=last).tolist() == expected
    assert derive_seeds(0, "client", 4, last=[5]).tolist() != derive_seeds(0, "data", 4, last=[5])


def test_derive_seed_generator_and_the_global_seed_by_hand():
    """``derive_seed``: numpy's SeedSequence over (seed, crc32(purpose), keys), each word
    masked to 32 bits, its first 64-bit word halved to 63 bits; ``generator`` seeds a CPU
    generator with it; ``seed_global_rng`` gives the CPU stream ``torch.manual_seed``
    gives, on the CPU and for another device."""
    import zlib

    from lightning_fl.engine.seeding import seed_global_rng

    words = [2**32 + 3 & 0xFFFFFFFF, zlib.crc32(b"data"), 1, 2]
    first = np.random.SeedSequence(words).generate_state(2, dtype=np.uint64)[0]
    assert derive_seed(2**32 + 3, "data", 1, 2) == int(first) >> 1
    assert derive_seed(3, "data", 1, 2) == derive_seed(2**32 + 3, "data", 1, 2 + 2**32)
    drawn = torch.rand(4, generator=generator(3, "data", 1, 2))
    expected = torch.rand(4, generator=torch.Generator().manual_seed(derive_seed(3, "data", 1, 2)))
    assert torch.equal(drawn, expected)
    assert not torch.equal(drawn, torch.rand(4, generator=generator(3, "data", 2, 1)))
    torch.manual_seed(11)
    reference = torch.rand(5)
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        seed_global_rng(11, torch.device(device))
        assert torch.equal(torch.rand(5), reference), device


def test_the_global_seed_seeds_the_accelerators_generators_unless_a_cpu_run_never_uses_them(
    monkeypatch,
):
    """``torch.manual_seed`` (every device's generator) for a run on an accelerator, or on
    the CPU once CUDA is initialized; the CPU generator alone on a CPU run that never
    initialized CUDA (a GPU run whose CUDA generator was left unseeded would not be
    reproducible: this pins the choice on a machine without a GPU)."""
    from lightning_fl.engine import seeding

    everywhere = []
    monkeypatch.setattr(seeding.torch, "manual_seed", everywhere.append)
    for device, initialized, expected in (
        ("cuda", False, [7]),
        ("cuda", True, [7]),
        ("cpu", True, [7]),
        ("cpu", False, []),
    ):
        everywhere.clear()
        monkeypatch.setattr(seeding.torch.cuda, "is_initialized", lambda i=initialized: i)
        seeding.seed_global_rng(7, torch.device(device))
        assert everywhere == expected, (device, initialized)


class _FullBatchDataModule(InMemoryFederatedDataModule):
    """Client 2 trains full-batch (its whole set in one batch), the others with batch 4."""

    def training_batch_size(self, dataset: Dataset) -> int:
        return len(dataset) if len(dataset) == 18 else self.batch_size


def _loader_batches(dm, client: int, round_idx: int, count: int) -> list[list[torch.Tensor]]:
    dataset = dm.client_dataset(client, "train")
    loader = dm.client_dataloader(dataset, "train", generator(3, "data", round_idx, client))
    return list(cycle_batches(loader, count))


@pytest.mark.parametrize("module_cls", [InMemoryFederatedDataModule, _FullBatchDataModule])
def test_chunk_batches_are_the_loaders_batches(module_cls):
    """Unequal clients (4..39 samples, short last batches), several passes, unequal
    numbers of batches (E passes), a full-batch client: every row's batch at every step
    is the one its loader yields, and the groups hold exactly the rows with a batch."""
    dm = module_cls(tiny_clients(), batch_size=4)
    counts = dm.sample_counts()
    packed, reason = pack_federation(dm, counts, torch.device("cpu"))
    assert reason == ""
    clients = [9, 2, 0, 5, 2]  # client 2 twice (sampling with replacement)
    for num_batches in ([13, 13, 13, 13, 13], [3, 1, 7, 2, 5]):
        batches = packed.chunk_batches(3, 4, clients, num_batches)
        assert len(batches) == max(num_batches)
        expected = [_loader_batches(dm, c, 4, n) for c, n in zip(clients, num_batches)]
        for step, groups in enumerate(batches.steps):
            rows = sorted(r for g in groups for r in g.rows)
            assert rows == [r for r, n in enumerate(num_batches) if n > step]
            for group in groups:
                x, y = batches.batch(step, group, packed)
                assert x.shape[:2] == (len(group.rows), group.size)
                for k, row in enumerate(group.rows):
                    ex, ey = expected[row][step]
                    assert torch.equal(x[k], ex) and torch.equal(y[k], ey)


def test_padded_chunk_batches_are_the_loaders_batches_then_the_clients_own_samples():
    """With short batches padded (one group a step): row k's first ``lengths[k]`` samples
    are its loader's batch, the mask marks exactly them, the padding holds samples of the
    same client, and a step whose rows all have full batches has no mask. By hand: clients
    of 9, 14 and 3 samples, batch 4: batches (4, 4, 1), (4, 4, 4, 2), (3)."""
    sizes = [9, 14, 3]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(sum(sizes), 2, generator=g), torch.arange(sum(sizes))
    cuts = np.cumsum([0, *sizes])
    dm = InMemoryFederatedDataModule(
        [{"train": (x[a:b], y[a:b])} for a, b in zip(cuts[:-1], cuts[1:])], batch_size=4
    )
    packed, _ = pack_federation(dm, dm.sample_counts(), torch.device("cpu"))
    clients, num_batches = [0, 1, 2], [3, 4, 1]
    batches = packed.chunk_batches(3, 2, clients, num_batches, pad_short_batches=True)
    expected = [_loader_batches(dm, c, 2, n) for c, n in zip(clients, num_batches)]
    by_hand = [([0, 1, 2], 4, [4, 4, 3]), ([0, 1], 4, [4, 4]), ([0, 1], 4, [1, 4]), ([1], 2, [2])]
    assert len(batches.steps) == 4
    for step, (groups, (rows, size, lengths)) in enumerate(zip(batches.steps, by_hand)):
        (group,) = groups
        assert (group.rows, group.size) == (rows, size)
        assert (group.rows_index is None) == (rows == [0, 1, 2])  # every row: no gather
        if lengths == [size] * len(rows):
            assert group.lengths is None and group.sample_mask is None
        else:
            assert group.lengths.tolist() == lengths
            assert group.sample_mask.tolist() == [[i < n for i in range(size)] for n in lengths]
        _, labels = batches.batch(step, group, packed)  # y is each sample's global index
        for k, (row, n) in enumerate(zip(rows, lengths)):
            assert torch.equal(labels[k, :n], expected[row][step][1])
            own = (labels[k] >= cuts[row]) & (labels[k] < cuts[row + 1])
            assert bool(own.all()), (step, row)


class _PerClient(InMemoryFederatedDataModule):
    """Clients as TensorDatasets only (its own ``client_dataset``: no arrays), so that
    packing takes the per-client path these tests check."""

    def client_dataset(self, client, split):
        return super().client_dataset(client, split)


def test_a_federation_that_cannot_be_packed_says_why(monkeypatch):
    class _Wrapped(Dataset):
        def __init__(self, data) -> None:
            self.data = TensorDataset(*data)

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i):
            return self.data[i]

    class _Lazy(InMemoryFederatedDataModule):
        def client_dataset(self, client, split):
            return _Wrapped(self._clients[client][split])

    class _Stream(InMemoryFederatedDataModule):
        def set_round(self, round_idx: int) -> None:
            pass

    dm = _PerClient(tiny_clients(), batch_size=4)
    counts = dm.sample_counts()
    lazy = _Lazy(tiny_clients())
    assert pack_federation(lazy, counts, torch.device("cpu")) == (
        None,
        "its training sets are _Wrapped, not plain TensorDatasets",
    )

    class _Mixed(InMemoryFederatedDataModule):  # three kinds of dataset, named in order
        def client_dataset(self, client, split):
            data = TensorDataset(*self._clients[client][split])
            if client % 3 == 0:
                return _Wrapped(self._clients[client][split])
            return Subset(data, range(len(data))) if client % 3 == 1 else ConcatDataset([data])

    assert pack_federation(_Mixed(tiny_clients()), counts, torch.device("cpu")) == (
        None,
        "its training sets are ConcatDataset, Subset, _Wrapped, not plain TensorDatasets",
    )
    stream = pack_federation(_Stream(tiny_clients()), counts, torch.device("cpu"))
    assert stream == (None, "its clients' data changes every round (a stream)")
    size = sum(t.numel() * t.element_size() for c in range(10)
               for t in dm.client_dataset(c, "train").tensors)  # fmt: skip
    monkeypatch.setattr(packed_module, "_free_memory", lambda device: 2 * size - 1)
    packed, reason = pack_federation(dm, counts, torch.device("cpu"))
    assert packed is None and reason.startswith("it takes 0.0 MiB, more than 50% of the")
    assert isinstance(reason, packed_module.TooLarge)
    strategy = FederatedStrategy(vectorize=True, seed=3, local_steps=2)
    with pytest.warns(UserWarning, match="training data stays with the datamodule's loaders: it"):
        make_trainer(strategy, 1, [FedAvg()]).fit(
            Classifier(network=MLP(6, (8,), 3)), datamodule=_PerClient(tiny_clients())
        )
    assert strategy.fit.packed is None
    monkeypatch.setattr(packed_module, "_free_memory", lambda device: 2 * size)
    assert pack_federation(dm, counts, torch.device("cpu"))[0] is not None


def test_the_memory_budget_reads_the_gpus_free_memory_not_its_total(monkeypatch):
    """On a CUDA device the budget is ``torch.cuda.mem_get_info``'s free bytes (its first
    value; the second is the total), asked of that device; checked here without a GPU."""
    asked = []
    monkeypatch.setattr(packed_module.torch.cuda, "mem_get_info",
                        lambda device: asked.append(device) or (3 << 30, 80 << 30))  # fmt: skip
    device = torch.device("cuda", 1)
    assert packed_module._free_memory(device) == 3 << 30
    assert asked == [device]


def test_the_strategy_refuses_a_bad_data_on_device():
    with pytest.raises(ValueError, match="data_on_device must be True, False or 'auto'"):
        FederatedStrategy(data_on_device="yes")


@pytest.mark.parametrize("sampler", [UniformSampler(3), MDSampler(3)], ids=["uniform", "md"])
def test_vectorized_fedavg_over_packed_data_equals_hand_written_loop(sampler):
    """Five rounds of sampled FedAvg, unequal clients, batches drawn by index on the
    packed data against torch's own DataLoader in the hand-written loop."""
    ours = run_strategy(sampler, [FedAvg()], vectorize=True, max_vectorized_clients=2)
    ref = reference(sampler, lambda t, d, r: [a + b for a, b in zip(t, d)])
    assert max_abs_diff(ours, ref) <= 1e-5


def _fit(callbacks, rounds=3, **strategy_kw):
    torch.manual_seed(1)
    module = Classifier(
        network=torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3)
        ),
        lr=0.1,
        momentum=0.5,
    )
    kw = {"sampler": UniformSampler(6), "local_epochs": 2, "seed": 3}
    kw.update(strategy_kw)
    strategy = FederatedStrategy(**kw)
    trainer = make_trainer(strategy, rounds, callbacks)
    trainer.fit(module, datamodule=tiny_datamodule())
    return params_of(module), trainer


@pytest.mark.parametrize(
    "callbacks",
    [lambda: [FedAvg()], lambda: [FedProx(mu=0.3)], lambda: [SCAFFOLD()],
     lambda: [Local(), FedProx(mu=0.3)]],
    ids=["fedavg", "fedprox", "scaffold", "fedprox-local"],
)  # fmt: skip
def test_packed_and_unpacked_vectorized_paths_equal_the_sequential_path(callbacks):
    """Dropout, momentum, unequal batch counts (E = 2 passes), chunks of 4: packed data
    with clients started together (FedAvg, FedProx) or one by one (SCAFFOLD's control
    variates; Local's own models, each row's FedProx anchor its own, the rows that still
    step picked out of the chunk's), unpacked data, and the sequential path over packed
    data."""
    sequential, reference = _fit(callbacks(), data_on_device=False)
    runs = {
        "sequential, packed": _fit(callbacks(), data_on_device=True),
        "vectorized, packed": _fit(callbacks(), vectorize=True, max_vectorized_clients=4),
        "vectorized, loaders": _fit(
            callbacks(), vectorize=True, max_vectorized_clients=4, data_on_device=False
        ),
    }
    local = isinstance(callbacks()[0], Local)  # each client's own model, in its store
    own = [reference.strategy.client_store.get(c, LOCAL_KEY) for c in range(10)]
    assert not local or sum(m is not None for m in own) >= 6
    for name, (params, trainer) in runs.items():
        assert max_abs_diff(sequential, params) <= 1e-5, name
        if local:
            store = trainer.strategy.client_store
            ours = [store.get(c, LOCAL_KEY) for c in range(10)]
            assert max_abs_diff([m for m in own if m is not None],
                                [m for m in ours if m is not None]) <= 1e-5, name  # fmt: skip
            assert [m is None for m in own] == [m is None for m in ours], name
        packed = trainer.strategy.fit.packed is not None
        assert packed == ("packed" in name), name
    vectorized = runs["vectorized, packed"][1].strategy.vectorized
    assert vectorized.batched_lifecycle == (not isinstance(callbacks()[0], (SCAFFOLD, Local)))


def test_client_hooks_decide_the_batched_lifecycle():
    assert not needs_client_hooks(FedAvg()) and not needs_client_hooks(FedProx())
    assert needs_client_hooks(SCAFFOLD())


class _PoisonClient(pl.Callback):
    """Client 3's training inputs become NaN in rounds 0 and 2 only (a clean round between)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x, self.clean = x, x.clone()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.x.copy_(self.clean if trainer.current_epoch == 1 else torch.full_like(self.x, 1e38))
        packed = trainer.strategy.fit.packed
        if packed is not None:  # the packed copy is the data the chunks read
            start, size = int(packed.offsets[3]), int(packed.sizes[3])
            packed.columns[0][start : start + size] = self.x


def _poisoned_fit(**strategy_kw):
    clients = tiny_clients()
    dm = InMemoryFederatedDataModule(clients, batch_size=4)
    torch.manual_seed(1)
    module = Classifier(network=MLP(6, (8,), 3), lr=0.1)
    strategy = FederatedStrategy(sampler=UniformSampler(10), local_steps=3, seed=3, **strategy_kw)
    trainer = make_trainer(strategy, 3, [FedAvg(), _PoisonClient(clients[3]["train"][0])])
    with pytest.warns(UserWarning, match="client 3 sent an update with NaN or Inf"):
        trainer.fit(module, datamodule=dm)
    return params_of(module), trainer


def test_a_non_finite_update_is_dropped_in_a_batched_chunk_as_sequentially():
    """Rounds 0 and 2 drop client 3 (the streak resets in round 1); the other clients'
    updates are folded with their weights, as on the sequential path."""
    sequential, seq_trainer = _poisoned_fit()
    batched, vec_trainer = _poisoned_fit(vectorize=True, max_vectorized_clients=4)
    assert vec_trainer.strategy.vectorized.batched_lifecycle
    assert max_abs_diff(sequential, batched) <= 1e-5
    assert vec_trainer.strategy.engine.consecutive_bad_rounds == 1
    assert vec_trainer.strategy.engine.current_round.state.dropped == [3]
    assert float(vec_trainer.callback_metrics["fl/dropped_updates"]) == 1.0
    assert float(seq_trainer.callback_metrics["fl/dropped_updates"]) == 1.0


def _round_calls(num_clients: int) -> Counter:
    g = torch.Generator().manual_seed(0)
    clients = [
        {"train": (torch.randn(10, 4, generator=g), torch.randint(0, 3, (10,), generator=g))}
        for _ in range(num_clients)
    ]
    counter = CallCounter()
    strategy = FederatedStrategy(
        sampler=UniformSampler(num_clients), local_steps=5, seed=0, vectorize=True
    )
    torch.manual_seed(0)
    trainer = make_trainer(strategy, 2, [FedAvg(weighting="uniform"), counter])
    trainer.fit(
        Classifier(network=MLP(4, (8,), 3), lr=0.1),
        datamodule=InMemoryFederatedDataModule(clients, batch_size=4),
    )
    return counter.calls


def test_a_vectorized_round_makes_as_many_python_calls_for_1000_clients_as_for_100():
    """The design holds: planning, the chunk's start, its local steps (batches drawn by
    index) and its finish cost O(1) Python calls in the number of clients."""
    few, many = _round_calls(100), _round_calls(1000)
    grown = {k: many[k] - few[k] for k in many if many[k] > few[k]}
    assert sum(many.values()) <= 1.1 * sum(few.values()), sorted(grown.items())[:10]
    assert sum(few.values()) > 1000  # the profiler did count the round


def test_packed_federation_keeps_client_offsets_and_sizes():
    dm = tiny_datamodule()
    counts = dm.sample_counts()
    packed, _ = pack_federation(dm, counts, torch.device("cpu"))
    assert packed.sizes.tolist() == counts
    assert packed.offsets.tolist() == np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    for c in (0, 4, 9):
        x, y = dm.client_dataset(c, "train").tensors
        px, py = packed.client_dataset(c).tensors
        assert torch.equal(px, x) and torch.equal(py, y)
    assert packed.num_batches_per_pass([0, 9]).tolist() == [1, -(-counts[9] // 4)]


def test_clients_cut_from_one_tensor_are_packed_without_a_copy(monkeypatch):
    """Adjacent slices of one tensor (in client order) are packed as a view of it, even
    with no memory free (a view needs none); any other layout (a gap, another order) is
    concatenated, and refused then; both equal torch.cat."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 3, generator=g), torch.arange(30)
    adjacent = [{"train": (x[a:b], y[a:b])} for a, b in ((0, 4), (4, 15), (15, 30))]
    gap = [{"train": (x[a:b], y[a:b])} for a, b in ((0, 4), (5, 15), (15, 30))]
    swapped = [adjacent[1], adjacent[0], adjacent[2]]
    for clients, shared in ((adjacent, True), (gap, False), (swapped, False)):
        dm = _PerClient(clients, batch_size=4)
        packed, _ = pack_federation(dm, dm.sample_counts(), torch.device("cpu"))
        expected = [torch.cat([c["train"][k] for c in clients]) for k in range(2)]
        for column, concatenated, base in zip(packed.columns, expected, (x, y)):
            assert torch.equal(column, concatenated)
            assert (column.data_ptr() == base.data_ptr()) == shared
        with monkeypatch.context() as patched:
            patched.setattr(packed_module, "_free_memory", lambda device: 0)
            tight, _ = pack_federation(dm, dm.sample_counts(), torch.device("cpu"))
            assert (tight is not None) == shared


def test_adjacent_view_checks_every_part_s_place_in_one_storage():
    """A view where the parts lie end to end in one storage (an empty part first or
    between: an empty tensor has no address), None where the offsets chain but the
    addresses do not (parts of two tensors), where a part is not contiguous, where the
    rows differ in dtype, row shape or device, and where a later part's storage runs past
    the first's (two storages over one buffer): a view would read outside it."""
    x, z = torch.arange(24.0).reshape(12, 2), torch.arange(24.0).reshape(12, 2)
    view = adjacent_view([x[0:0], x[0:3], x[3:3], x[3:7]])
    assert torch.equal(view, x[:7]) and view.data_ptr() == x.data_ptr()
    assert torch.equal(adjacent_view([x[2:5], x[5:6]]), x[2:6])
    assert adjacent_view([x[0:3], z[3:7]]) is None  # offsets chain, addresses do not
    assert adjacent_view([x[0:3], x[4:7]]) is None  # a gap
    assert adjacent_view([x[0:3], x[3:7:2]]) is None  # not contiguous
    assert adjacent_view([x[0:3], x[3:5].double()]) is None
    assert adjacent_view([x[0:3], torch.empty(2, 2, device="meta")]) is None
    flat = torch.arange(24.0)
    assert adjacent_view([flat[0:6], flat[6:12].reshape(3, 2)]) is None  # row shapes
    buffer = np.arange(20, dtype=np.float32)
    short, long = torch.from_numpy(buffer[:6]), torch.from_numpy(buffer)
    assert short.data_ptr() == long.data_ptr()
    assert adjacent_view([short[0:6], long[6:20]]) is None  # past the first's storage
    assert uniform_rows([x[0:3], x[5:6]]) and not uniform_rows([x[:1], x[:1].long()])


def test_an_in_memory_federation_counts_rows_from_its_tensors():
    """The counts equal the datasets' (the base implementation, one TensorDataset per
    client), 0 for a client without the split; a client whose tensors differ in length is
    refused, naming it, by the counts and by the packing alike; the garbage collector is
    paused during the work and left as it was (off stays off)."""
    import gc

    from lightning_fl.engine.bulk import collector_paused
    from lightning_fl.engine.data_contract import FederatedDataModule

    x, y = torch.randn(12, 3), torch.arange(12)
    clients = [{"train": (x[:5], y[:5])}, {"val": (x[5:7], y[5:7])}, {"train": (x[7:], y[7:])}]
    dm = InMemoryFederatedDataModule(clients)
    for split in ("train", "val", "test"):
        assert dm.sample_counts(split) == FederatedDataModule.sample_counts(dm, split)
    assert dm.sample_counts("train") == [5, 0, 5]
    bad = [clients[0], {"train": (x[5:9], y[5:8])}]
    message = r"Client 1's 'train' tensors differ in length \(4 rows in the first, 3 in tensor 1\)"
    with pytest.raises(ValueError, match=message):
        InMemoryFederatedDataModule(bad).sample_counts("train")
    with pytest.raises(ValueError, match=message):
        InMemoryFederatedDataModule(bad).split_arrays("train")
    seen = []
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            with collector_paused():
                seen.append(gc.isenabled())
            assert gc.isenabled() == enabled
        finally:
            gc.enable()
    assert seen == [False, False]


def test_the_schedule_primitives_by_hand():
    """chunk_positions' cut (a short last chunk, None and sizes ≥ the count as one chunk,
    nothing for no positions); ClientSchedule.locate at both ends of every client's range,
    a client with no batch skipped, outside the range refused; cycle_batches gives exactly
    ``count`` batches, a new pass after each end, none for 0."""
    from lightning_fl.engine.schedule import ClientSchedule, chunk_positions

    assert chunk_positions([5, 3, 8, 1, 9], 2) == [(5, 3), (8, 1), (9,)]
    assert chunk_positions([5, 3, 8], None) == chunk_positions([5, 3, 8], 3) == [(5, 3, 8)]
    assert chunk_positions([], None) == chunk_positions([], 2) == []
    schedule = ClientSchedule((4, 1, 7), (3, 0, 2))
    assert schedule.total == 5
    located = [schedule.locate(i) for i in range(5)]
    assert located == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]
    for outside in (-1, 5):
        with pytest.raises(IndexError, match=f"batch {outside} is outside this schedule of 5"):
            schedule.locate(outside)

    class Passes:  # a loader of 3 batches whose every pass is told apart
        def __init__(self) -> None:
            self.passes = 0

        def __iter__(self):
            self.passes += 1
            return iter([(self.passes, i) for i in range(3)])

    loader = Passes()
    assert list(cycle_batches(loader, 0)) == [] and loader.passes == 0
    assert list(cycle_batches(loader, 7)) == [
        (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (3, 0)
    ]  # fmt: skip
    assert loader.passes == 3


def test_packed_local_steps_name_their_chunk_and_steps():
    from lightning_fl.engine.schedule import PackedLocalSteps

    steps = PackedLocalSteps(chunk=2, first=3, stop=6)
    assert (steps.chunk, steps.first, steps.stop) == (2, 3, 6)
    assert repr(steps) == "PackedLocalSteps(chunk=2, steps 3..5)"


def test_packed_steps_carry_the_batch_size_lightning_reads_from_loaders():
    """Lightning weighs a value a hook logs without ``batch_size`` by the size of the
    batch's first tensor: on the loaders' path, the batch of the chunk's first client
    with one at that step. Batches of 8 (client 0 has 4 samples, client 8's pass ends
    with 7), E = 2 passes (client 0 runs out after 2 steps, so client 1 opens the later
    steps), 2 local steps per Lightning step: the packed path's epoch mean is the same."""

    class StepIndex(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pl_module.log("step_index", float(batch_idx), on_epoch=True, on_step=False)

    means = []
    for on_device in (True, False):
        strategy = FederatedStrategy(
            local_epochs=2, seed=3, vectorize=True, max_vectorized_clients=4,
            local_steps_per_training_step=2, data_on_device=on_device,
        )  # fmt: skip
        trainer = make_trainer(strategy, 2, [FedAvg(), StepIndex()])
        trainer.fit(tiny_module(), datamodule=tiny_datamodule(batch_size=8))
        assert (trainer.strategy.fit.packed is not None) == on_device
        means.append(float(trainer.callback_metrics["step_index"]))
    assert means[0] == pytest.approx(means[1], abs=1e-6)


def test_a_packed_clients_batch_lengths_by_hand():
    """11 samples in batches of 4: 4, 4, 3, then the next pass; 4 in batches of 4: 4."""
    packed, _ = pack_federation(*_federation_of_sizes([11, 4], batch_size=4))
    assert [packed.batch_length(0, step) for step in range(7)] == [4, 4, 3, 4, 4, 3, 4]
    assert [packed.batch_length(1, step) for step in range(3)] == [4, 4, 4]


def _federation_of_sizes(sizes, batch_size):
    clients = [{"train": (torch.zeros(n, 2), torch.zeros(n, dtype=torch.long))} for n in sizes]
    dm = InMemoryFederatedDataModule(clients, batch_size=batch_size)
    return dm, dm.sample_counts(), torch.device("cpu")


def test_packing_keeps_one_sample_clients_skips_empty_ones_and_counts_its_bytes():
    """Clients of 0, 1 and 6 samples: the one-sample client is packed (its row a view of
    its data), the empty one is left out; ``nbytes`` is the packed columns' bytes (7 rows
    of 3 float32 features and 7 int64 labels)."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(n, 3, generator=g), torch.arange(n)) for n in (0, 1, 6)]
    dm = InMemoryFederatedDataModule([{"train": d} for d in data], batch_size=4)
    packed, reason = pack_federation(dm, dm.sample_counts(), torch.device("cpu"))
    assert reason == "" and packed.nbytes == 7 * 3 * 4 + 7 * 8
    for c in (1, 2):
        x, y = packed.client_dataset(c).tensors
        assert torch.equal(x, data[c][0]) and torch.equal(y, data[c][1])


def test_an_in_memory_federation_packs_each_split_into_arrays_once():
    """Columns equal to the clients' tensors one after another (a client without the
    split counts 0), offsets their running sizes, a view of the tensor the clients were cut
    from in order (no copy), the clients' own tensors then views of the columns, the
    caller's dicts untouched; None where a subclass gives its own datasets, in silo mode
    and where the clients' columns differ."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 3, generator=g), torch.arange(20)
    clients = [{"train": (x[0:4], y[0:4]), "val": (x[13:15], y[13:15])},
               {"train": (x[4:4], y[4:4])},  # no val split, an empty train split
               {"train": (x[4:13], y[4:13]), "val": (x[16:20], y[16:20])}]  # fmt: skip
    given = [dict(c) for c in clients]
    dm = InMemoryFederatedDataModule(clients, batch_size=4)
    columns, offsets = dm.split_arrays("train")
    assert offsets.tolist() == [0, 4, 4, 13]
    assert torch.equal(columns[0], x[:13]) and columns[0].data_ptr() == x.data_ptr()
    val_columns, val_offsets = dm.split_arrays("val")
    assert val_offsets.tolist() == [0, 2, 2, 6]
    assert torch.equal(val_columns[1], torch.cat([y[13:15], y[16:20]]))
    assert val_columns[1].data_ptr() != y[13:].data_ptr()  # a gap between clients: a copy
    third = dm.client_dataset(2, "val").tensors[0]
    assert torch.equal(third, x[16:20]) and third.data_ptr() == val_columns[0][2:].data_ptr()
    assert all(c[s] is g_[s] for c, g_ in zip(clients, given) for s in c)  # untouched
    assert dm.split_arrays("val") is dm.split_arrays("val")  # packed once
    assert dm.split_arrays("test") is None
    assert _PerClient(clients).split_arrays("train") is None
    dm.enter_silo(0, 2)
    assert dm.split_arrays("train") is None
    mixed = [{"train": (x[:2], y[:2])}, {"train": (x[2:4].double(), y[2:4])}]
    assert InMemoryFederatedDataModule(mixed).split_arrays("train") is None
    wider = [{"train": (x[:2], y[:2])}, {"train": (torch.randn(2, 4), y[2:4])}]  # rows of 3, 4
    assert InMemoryFederatedDataModule(wider).split_arrays("train") is None
    longer = [{"train": (x[:2], y[:2])}, {"train": (x[2:4], y[2:4], y[2:4])}]  # 2, 3 tensors
    assert InMemoryFederatedDataModule(longer).split_arrays("train") is None
    alone = [{"train": (x[:2], y[:2])}, {"train": (x[2:5], y[2:5]), "test": (x[5:7], y[5:7])}]
    test_columns, test_offsets = InMemoryFederatedDataModule(alone).split_arrays("test")
    assert test_offsets.tolist() == [0, 0, 2] and torch.equal(test_columns[0], x[5:7])
