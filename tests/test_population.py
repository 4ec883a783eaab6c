"""Large populations (issue 66): array federations in memory and on disk, the LEAF
converter and generator, cohort evaluation, evaluation vectorized over clients, and a
round's Python work independent of the population."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lightning_fl import (
    AvailableClients,
    FederatedStrategy,
    SojournMarkovAvailability,
    UniformSampler,
)
from lightning_fl.callbacks import SCAFFOLD, FedAvg
from lightning_fl.datamodules import (
    ArrayFederatedDataModule,
    ClientArrays,
    FederationFormatError,
    InMemoryFederatedDataModule,
    convert_leaf,
    generate_population,
    leaf_convert,
    open_federation,
    population_counts,
    save_federation,
    write_leaf_population,
)
from lightning_fl.datamodules.arrays import client_names
from lightning_fl.datamodules.leaf_convert import iter_leaf_users
from lightning_fl.datamodules.population import population_samples
from lightning_fl.engine.cohort import cohort_standard_errors, draw_cohort
from lightning_fl.engine.context import LISTED_COUNTS, Federation, counts_digest
from lightning_fl.engine.federated_state import FederationMismatchError, check_federation
from lightning_fl.engine.segment_evaluation import segment_batches
from lightning_fl.systems.samplers import MDSampler
from tests.helpers import (
    IN,
    OUT,
    CallCounter,
    local_sgd,
    make_trainer,
    params_of,
    tiny_clients,
    tiny_module,
)

SPLITS = ("train", "val", "test")


def _arrays_of(clients: list[dict]) -> dict[str, ClientArrays]:
    return {split: ClientArrays.from_clients([c[split] for c in clients]) for split in SPLITS}


def _array_datamodule(num_clients: int = 10, **kw) -> ArrayFederatedDataModule:
    return ArrayFederatedDataModule(splits=_arrays_of(tiny_clients(num_clients)), **kw)


# ---------------------------------------------------------------- the data


def test_array_clients_are_the_given_clients_and_counts_come_from_the_offsets():
    clients = tiny_clients(10)
    dm = ArrayFederatedDataModule(splits=_arrays_of(clients), unseen_fraction=0.2)
    assert dm.num_clients == 10
    assert dm.sample_counts("train") == [len(c["train"][0]) for c in clients]
    assert dm.split_counts("val").tolist() == [3] * 10
    for c in (0, 3, 9):
        for split in SPLITS:
            x, y = dm.client_dataset(c, split).tensors
            assert torch.equal(x, clients[c][split][0]) and torch.equal(y, clients[c][split][1])
    assert dm.unseen_clients == [8, 9]
    assert Federation(dm).training_counts.tolist() == [*dm.sample_counts("train")[:8], 0, 0]
    with pytest.raises(IndexError, match="clients 0 to 9"):
        dm.client_dataset(10, "train")


def test_a_federation_folder_round_trips_memory_mapped(tmp_path):
    clients = tiny_clients(7)
    names = [f"writer_{c}" for c in range(7)]
    save_federation(tmp_path / "fed", _arrays_of(clients), client_names=names)
    opened = open_federation(tmp_path / "fed")
    assert isinstance(opened["train"].columns[0], np.memmap)
    dm = ArrayFederatedDataModule(str(tmp_path / "fed"), batch_size=4)
    for c in range(7):
        x, y = dm.client_dataset(c, "test").tensors
        assert torch.equal(x, clients[c]["test"][0]) and torch.equal(y, clients[c]["test"][1])
    assert client_names(tmp_path / "fed") == names
    header = json.loads((tmp_path / "fed" / "federation.json").read_text())
    assert header["splits"]["train"]["columns"][0] == {"name": "x", "dtype": "float32",
                                                       "shape": [IN]}  # fmt: skip


def _saved(tmp_path) -> object:
    folder = tmp_path / "fed"
    save_federation(folder, _arrays_of(tiny_clients(5)))
    return folder


def test_a_truncated_column_is_refused_naming_the_file(tmp_path):
    folder = _saved(tmp_path)
    path = folder / "train.x.npy"
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(FederationFormatError, match=r"train\.x\.npy: unreadable or truncated"):
        open_federation(folder)


def test_offsets_past_the_end_name_the_client(tmp_path):
    folder = _saved(tmp_path)
    offsets = np.load(folder / "train.offsets.npy")
    offsets[-1] += 3  # client 4 claims three rows the file does not have
    np.save(folder / "train.offsets.npy", offsets)
    with pytest.raises(FederationFormatError, match=r"train\.offsets\.npy: .*client 4 runs past"):
        open_federation(folder)


def test_decreasing_offsets_name_the_client(tmp_path):
    folder = _saved(tmp_path)
    offsets = np.load(folder / "train.offsets.npy")
    offsets[2], offsets[3] = offsets[3], offsets[2]
    np.save(folder / "train.offsets.npy", offsets)
    with pytest.raises(FederationFormatError, match=r"train\.offsets\.npy: client 2's offsets dec"):
        open_federation(folder)


def test_an_index_that_disagrees_with_the_data_is_refused(tmp_path):
    folder = _saved(tmp_path)
    header = json.loads((folder / "federation.json").read_text())
    header["splits"]["test"]["rows"] += 1
    (folder / "federation.json").write_text(json.dumps(header))
    with pytest.raises(FederationFormatError, match=r"test\.x\.npy: 15 rows, but"):
        open_federation(folder)
    header["splits"]["test"]["rows"] -= 1
    header["splits"]["test"]["columns"][1]["dtype"] = "float64"
    (folder / "federation.json").write_text(json.dumps(header))
    with pytest.raises(FederationFormatError, match=r"test\.y\.npy: int64 rows"):
        open_federation(folder)


def test_pickled_objects_and_missing_folders_are_refused(tmp_path):
    folder = _saved(tmp_path)
    np.save(folder / "val.y.npy", np.array([object()] * 15), allow_pickle=True)
    with pytest.raises(FederationFormatError, match=r"val\.y\.npy: unreadable"):
        open_federation(folder)
    with pytest.raises(FileNotFoundError, match="no federation here.*convert-leaf"):
        open_federation(tmp_path / "nowhere")


def test_population_counts_have_leafs_mean_and_spread():
    """1 + NB(r, q) with LEAF's Table 1 moments: Sent140 2.42 ± 4.71, Reddit 34.07 ±
    62.95 (a mistake in r or q moves the mean or the spread by far more than 1%)."""
    for shape, mean, std in (("sent140", 2.42, 4.71), ("reddit", 34.07, 62.95)):
        counts = population_counts(400_000, shape, seed=3)
        assert counts.min() >= 1
        assert abs(counts.mean() - mean) < 0.01 * mean
        assert abs(counts.std() - std) < 0.03 * std
    assert np.array_equal(population_counts(50, seed=1), population_counts(50, seed=1))


def test_a_generated_population_splits_each_clients_last_samples_for_test(tmp_path):
    generate_population(tmp_path / "pop", 300, features=3, test_fraction=0.25, seed=2)
    dm = ArrayFederatedDataModule(str(tmp_path / "pop"))
    counts = population_counts(300, seed=2)
    x, y = population_samples(counts, 3, 2, 1.0, 2)
    test = np.where(counts >= 2, np.maximum(1, np.floor(0.25 * counts)), 0).astype(int)
    assert dm.split_counts("test").tolist() == test.tolist()
    assert (dm.split_counts("train") + dm.split_counts("test")).tolist() == counts.tolist()
    start = int(counts[:7].sum())  # client 7: its first samples train, its last test
    n, k = int(counts[7]), int(test[7])
    assert torch.equal(
        dm.client_dataset(7, "train").tensors[0], torch.from_numpy(x[start : start + n - k])
    )
    assert torch.equal(
        dm.client_dataset(7, "test").tensors[1], torch.from_numpy(y[start + n - k : start + n])
    )


def test_leaf_json_converts_streaming_into_the_same_arrays(tmp_path, monkeypatch):
    """Pieces of 7 characters: every value crosses a piece boundary somewhere."""
    monkeypatch.setattr(leaf_convert._JsonStream, "CHUNK", 7)
    write_leaf_population(tmp_path / "leaf", 40, shape="reddit", features=3, users_per_file=15)
    convert_leaf([tmp_path / "leaf"], tmp_path / "fed")
    dm = ArrayFederatedDataModule(str(tmp_path / "fed"))
    counts = population_counts(40, "reddit")
    x, y = population_samples(counts, 3, 2, 1.0, 0)
    assert dm.sample_counts() == counts.tolist()
    assert np.allclose(dm.arrays["train"].columns[0], x, atol=1e-6)
    assert np.array_equal(dm.arrays["train"].columns[1], y)
    assert client_names(tmp_path / "fed")[:2] == ["f_0000000", "f_0000001"]


def test_malformed_leaf_json_names_the_file_and_the_user(tmp_path):
    path = tmp_path / "a.json"
    users = '{"u1": {"x": [[1.0]], "y": [0]}, "u2": {"x": [[1.0]], "y": [1]}}'
    path.write_text('{"users": ["u1", "u2"], "num_samples": [1, 2], "user_data": ' + users + "}")
    with pytest.raises(FederationFormatError, match=r"a\.json: user 'u2' has num_samples 2"):
        list(iter_leaf_users(path))
    path.write_text('{"users": ["u1"], "num_samples": [1], "user_data": {"u1": {"x": [[1.0')
    with pytest.raises(FederationFormatError, match=r"a\.json: invalid or truncated JSON"):
        convert_leaf([path], tmp_path / "out")
    path.write_text('{"users": ["u1", "u2"], "num_samples": [1, 1], "user_data": '
                    '{"u1": {"x": [[1.0]], "y": [0]}}}')  # fmt: skip
    with pytest.raises(FederationFormatError, match=r"lists 2 users but 'user_data' holds 1"):
        list(iter_leaf_users(path))


# ---------------------------------------------------------------- training


def _hand_written_fedavg(clients, rounds, sampler, steps, lr, batch_size, seed):
    """FedAvg written out: each round's participants train K SGD steps from θ^t on their
    own batches, θ^{t+1} = θ^t + Σ ω_i (θ_i − θ^t)."""
    net = tiny_module(lr).network
    counts = torch.tensor([len(c["train"][0]) for c in clients], dtype=torch.float64)
    p = counts / counts.sum()
    for t in range(rounds):
        part = sampler.sample(t, seed, p)
        start = [w.detach().clone() for w in net.parameters()]
        total = [torch.zeros_like(w) for w in start]
        for client, weight in zip(part.clients, part.weights):
            with torch.no_grad():
                for w, s in zip(net.parameters(), start):
                    w.copy_(s)
            local_sgd(net, clients[client]["train"], steps, lr, batch_size, seed, t, client)
            for acc, w, s in zip(total, net.parameters(), start):
                acc += weight * (w.detach() - s)
        with torch.no_grad():
            for w, s, acc in zip(net.parameters(), start, total):
                w.copy_(s + acc)
    return [w.detach().clone() for w in net.parameters()]


@pytest.mark.parametrize("vectorize", [False, True])
def test_fedavg_on_array_clients_equals_the_hand_written_loop(vectorize):
    """10 clients of 4–40 samples, 4 a round, 3 rounds, K = 3 steps of 4 (short last
    batches, reshuffles), sequential and vectorized (the packed view of the arrays)."""
    clients = tiny_clients(10)
    expected = _hand_written_fedavg(clients, 3, UniformSampler(4), 3, 0.1, 4, seed=5)
    model = tiny_module(0.1)
    strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=3, seed=5,
                                 vectorize=vectorize)  # fmt: skip
    trainer = make_trainer(strategy, 3, [FedAvg()])
    trainer.fit(model, datamodule=_array_datamodule(batch_size=4))
    if vectorize:
        assert trainer.strategy.fit.packed is not None
    for got, want in zip(params_of(model.network), expected):
        assert torch.allclose(got, want, atol=1e-6), float((got - want).abs().max())


def test_scaffold_keeps_state_only_for_clients_that_took_part():
    model = tiny_module(0.1)
    strategy = FederatedStrategy(sampler=MDSampler(3), local_steps=2, seed=1)
    trainer = make_trainer(strategy, 3, [SCAFFOLD()])
    trainer.fit(model, datamodule=_array_datamodule(batch_size=4))
    p = torch.tensor(_array_datamodule().sample_counts(), dtype=torch.float64)
    drawn = {c for t in range(3) for c in MDSampler(3).sample(t, 1, p / p.sum()).clients}
    assert set(trainer.strategy.client_store.clients()) == drawn and len(drawn) < 10


def _federation_of(counts: np.ndarray) -> Federation:
    splits = {"train": ClientArrays([np.zeros(int(counts.sum()))], np.r_[0, counts.cumsum()])}
    return Federation(ArrayFederatedDataModule(splits=splits))


def test_large_federations_keep_a_digest_of_their_counts_and_a_resume_checks_it():
    counts = np.arange(LISTED_COUNTS + 1) % 5 + 1
    identity = _federation_of(counts).identity()
    assert identity["train_counts"] == counts_digest(counts)
    assert identity["num_clients"] == LISTED_COUNTS + 1
    small = _federation_of(counts[:10]).identity()
    assert small["train_counts"] == counts[:10].tolist()
    moved = counts.copy()
    moved[77] += 1  # one client, one sample: another federation
    config = SimpleNamespace(allow_new_federation=False)
    check_federation(SimpleNamespace(federation=_federation_of(counts), config=config), identity)
    fit = SimpleNamespace(federation=_federation_of(moved), config=config)
    with pytest.raises(FederationMismatchError, match="train_counts .their digests differ"):
        check_federation(fit, identity)
    listed = dict(identity, train_counts=counts.tolist())  # a checkpoint that listed them
    check_federation(SimpleNamespace(federation=_federation_of(counts), config=config), listed)
    with pytest.raises(FederationMismatchError, match="digests differ"):
        check_federation(fit, listed)


def _population(num_clients: int) -> ArrayFederatedDataModule:
    rng = np.random.default_rng(0)

    def split(n):
        x = rng.standard_normal((num_clients * n, IN), dtype=np.float32)
        return ClientArrays([x, rng.integers(0, OUT, num_clients * n)],
                            np.arange(num_clients + 1) * n)  # fmt: skip

    return ArrayFederatedDataModule(splits={"train": split(6), "val": split(2)}, batch_size=3)


def _sampler(name: str, num_clients: int):
    if name == "uniform":
        return UniformSampler(20)
    chains = SojournMarkovAvailability(pi=20 / num_clients, lam=0.5)  # about 20 a round
    return AvailableClients(chains, selector="unbiased", estimate=True)


@pytest.mark.parametrize(
    "vectorize, sampler", [(False, "uniform"), (True, "uniform"), (True, "markov")]
)
def test_a_round_and_a_cohort_make_as_many_python_calls_for_100000_clients_as_for_1000(
    vectorize, sampler
):
    """Planning, sampling, weights, training 20 clients and a 50-client validation cohort:
    O(participants) Python whatever the population (within 5%); Markov availability
    walked by sojourns with CA-Fed's estimated π̂ as well."""

    def calls(num_clients: int) -> Counter:
        counter = CallCounter()
        strategy = FederatedStrategy(sampler=_sampler(sampler, num_clients), local_steps=2,
                                     seed=0, vectorize=vectorize, eval_clients=50)  # fmt: skip
        trainer = make_trainer(strategy, 2, [FedAvg(), counter], limit_val_batches=None)
        trainer.fit(tiny_module(), datamodule=_population(num_clients))
        return counter.calls

    few, many = calls(1000), calls(100_000)
    grown = {k: many[k] - few[k] for k in many if many[k] > few[k]}
    assert sum(many.values()) <= 1.05 * sum(few.values()), sorted(grown.items())[:10]
    assert sum(few.values()) > 1000  # the profiler did count the round


# ---------------------------------------------------------------- evaluation


def test_segment_batches_cut_every_client_as_its_loader_does():
    starts, sizes = np.array([0, 7, 9, 9]), np.array([7, 2, 0, 5])
    batches = segment_batches(starts, sizes, 3, max_rows=6)
    got = sorted((int(p), int(s), b.length) for b in batches for p, s in zip(b.positions, b.starts))
    assert got == [(0, 0, 3), (0, 3, 3), (0, 6, 1), (1, 7, 2), (3, 9, 3), (3, 12, 2)]
    assert [b.length for b in batches] == [3, 3, 2, 1]  # longest first, ≤ 6 rows a step


def _evaluated(vectorize_evaluation, stage="validate", **strategy):
    dm = _array_datamodule(12, batch_size=4, eval_batch_size=2, unseen_fraction=0.25)
    model = tiny_module(0.1)
    strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=2, seed=3,
                                 vectorize_evaluation=vectorize_evaluation, **strategy)  # fmt: skip
    trainer = make_trainer(strategy, 2, [FedAvg()], limit_val_batches=None)
    trainer.fit(model, datamodule=dm)
    metrics = getattr(trainer, stage)(model, datamodule=dm, verbose=False)[0]
    return trainer.strategy.evaluation.last_report[1], metrics


class _ValidationsDuringFit(pl.Callback):
    """The metrics every validation of a fit logs (one per round)."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, float]] = []

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        self.rounds.append({k: float(v) for k, v in metrics.items() if k.startswith("val_")})


def test_every_rounds_vectorized_validation_is_that_rounds_alone():
    """Three rounds, each validated during the fit: vectorized evaluation reports each
    round's own per-client means, equal to client-by-client evaluation's, not the running
    sums over the rounds so far (a kept loader reuses its segment sums: they are emptied
    at each epoch's start)."""
    logged = {}
    for vectorize in (False, True):
        dm = _array_datamodule(12, batch_size=4, eval_batch_size=2)
        strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=2, seed=3,
                                     vectorize_evaluation=vectorize)  # fmt: skip
        record = _ValidationsDuringFit()
        trainer = make_trainer(strategy, 3, [FedAvg(), record], limit_val_batches=None)
        trainer.fit(tiny_module(0.1), datamodule=dm)
        logged[vectorize] = record.rounds
    assert len(logged[True]) == len(logged[False]) == 3
    for plain, fast in zip(logged[False], logged[True]):
        assert plain.keys() == fast.keys() and "val_acc" in plain
        for key, value in plain.items():
            assert math.isclose(fast[key], value, rel_tol=1e-6, abs_tol=1e-7), key
    assert logged[False][0]["val_loss"] != logged[False][2]["val_loss"]  # the rounds differ


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_vectorized_evaluation_equals_client_by_client(stage):
    """12 clients (3 unseen), 3 or 6–7 held-out samples in batches of 2: every client's
    loss and accuracy, and the summaries, equal the sequential path's."""
    plain, plain_metrics = _evaluated(False, stage)
    fast, fast_metrics = _evaluated(True, stage)
    assert (
        plain.keys() == fast.keys()
        and len(plain["val_loss" if stage == "validate" else "test_loss"]) == 12
    )
    for name in plain:
        assert plain[name].keys() == fast[name].keys()
        for client, (value, count) in plain[name].items():
            assert fast[name][client][1] == count
            assert math.isclose(fast[name][client][0], value, rel_tol=1e-6, abs_tol=1e-7)
    assert plain_metrics.keys() == fast_metrics.keys()
    for key, value in plain_metrics.items():
        assert math.isclose(fast_metrics[key], value, rel_tol=1e-6, abs_tol=1e-7), key


def test_vectorized_evaluation_true_is_refused_at_set_up_naming_the_reason():
    strategy = FederatedStrategy(vectorize_evaluation=True, local_steps=1)
    trainer = make_trainer(strategy, 1, [FedAvg()], limit_val_batches=None)

    class Lazy(InMemoryFederatedDataModule):  # datasets of its own: no arrays
        def client_dataset(self, client, split):
            return super().client_dataset(client, split)

    with pytest.raises(ValueError, match="Lazy does not hold its clients as arrays"):
        trainer.fit(tiny_module(), datamodule=Lazy(tiny_clients(4)))
    from lightning_fl.callbacks import Ditto

    strategy = FederatedStrategy(vectorize_evaluation=True, local_steps=1)
    trainer = make_trainer(strategy, 1, [Ditto(lam=0.5)], limit_val_batches=None)
    with pytest.raises(ValueError, match="Ditto acts at each client's evaluation"):
        trainer.fit(tiny_module(), datamodule=_array_datamodule())


def test_vectorized_evaluation_true_names_a_module_that_cannot_take_the_columns():
    """A 3-column federation (x, y and a weight) with a module that unpacks two: the
    refusal names the plain call's failure and the number of columns, not vmap."""
    three = {
        split: ClientArrays.from_clients(
            [(*c[split], torch.ones(len(c[split][1]))) for c in tiny_clients(4)]
        )
        for split in SPLITS
    }
    strategy = FederatedStrategy(vectorize_evaluation=True, local_steps=1)
    trainer = make_trainer(strategy, 1, [FedAvg()], limit_val_batches=None)
    with pytest.raises(ValueError) as refused:
        trainer.fit(tiny_module(), datamodule=ArrayFederatedDataModule(splits=three))
    message = str(refused.value)
    assert "fails on a batch of the federation's 3 columns even without vmap" in message
    assert "too many values to unpack" in message and "under torch.func.vmap" not in message
    assert message.endswith("or set vectorize_evaluation='auto' or False.")


def test_cohorts_are_seeded_without_replacement_among_eligible_clients():
    eligible = np.array([1, 4, 5, 8, 11, 12, 20])
    first = draw_cohort(eligible, 4, seed=7, round_idx=3)
    assert np.array_equal(first, draw_cohort(eligible, 4, seed=7, round_idx=3))
    assert len(set(first.tolist())) == 4 and set(first.tolist()) <= set(eligible.tolist())
    assert not np.array_equal(first, draw_cohort(eligible, 4, seed=7, round_idx=4))
    rounds = [draw_cohort(eligible, 3, seed=0, round_idx=t) for t in range(700)]
    frequency = Counter(c for cohort in rounds for c in cohort.tolist())
    assert all(abs(n / 700 - 3 / 7) < 0.06 for n in frequency.values())  # uniform: 3/7 each


def test_cohort_standard_errors_by_hand():
    """Cochran's eqs. 2.12 and 6.9 on 4 clients of a population of 10."""
    y, n = [0.9, 0.5, 0.7, 0.2], [2, 6, 1, 3]
    f = 1 - 4 / 10
    mean = sum(y) / 4
    s2 = sum((v - mean) ** 2 for v in y) / 3
    ratio = sum(a * b for a, b in zip(y, n)) / sum(n)
    nbar = sum(n) / 4
    spread = sum((b / nbar) ** 2 * (a - ratio) ** 2 for a, b in zip(y, n))
    se = cohort_standard_errors(y, n, 10)
    assert math.isclose(se["uniform_se"], math.sqrt(f * s2 / 4))
    assert math.isclose(se["se"], math.sqrt(f * spread / (4 * 3)))
    assert cohort_standard_errors(y, n, 4) == {"se": 0.0, "uniform_se": 0.0}
    assert all(math.isnan(v) for v in cohort_standard_errors([1.0], [3], 10).values())


def test_a_validation_cohort_reports_its_clients_and_their_standard_error():
    """eval_clients=5 of 12 clients (9 seen): the logged means are those of the round's
    cohort, as a full pass over the same clients gives them, with their errors."""
    dm = _array_datamodule(12, batch_size=4, eval_batch_size=2, unseen_fraction=0.25)
    model = tiny_module(0.1)
    strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=2, seed=3,
                                 eval_clients=5)  # fmt: skip
    trainer = make_trainer(strategy, 2, [FedAvg()], limit_val_batches=None)
    trainer.fit(model, datamodule=dm)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}  # round 1's cohort
    _, per_client, unseen = trainer.strategy.evaluation.last_report
    cohort = draw_cohort(np.arange(12), 5, seed=3, round_idx=1)
    assert sorted(per_client["val_acc"]) == cohort.tolist()
    trainer.validate(model, datamodule=dm, verbose=False)  # every client
    everyone = trainer.strategy.evaluation.last_report[1]["val_acc"]
    assert len(everyone) == 12
    seen = [c for c in cohort.tolist() if c not in unseen]
    values = [everyone[c][0] for c in seen]
    counts = [everyone[c][1] for c in seen]
    weighted = sum(v * n for v, n in zip(values, counts)) / sum(counts)
    se = cohort_standard_errors(values, counts, population=12 - 3)
    assert logged["val_acc"] == pytest.approx(weighted, abs=1e-6)
    assert logged["val_acc/se"] == pytest.approx(se["se"], abs=1e-6)
    assert logged["val_acc/uniform_se"] == pytest.approx(se["uniform_se"], abs=1e-6)


def test_the_data_command_generates_converts_and_checks(tmp_path, capsys):
    from lightning_fl.command import main

    main(["data", "generate-leaf", "--shape", "reddit", "--clients", "30", "--features", "3",
          "--out", str(tmp_path / "json")])  # fmt: skip
    main(["data", "convert-leaf", str(tmp_path / "json"), "--out", str(tmp_path / "fed")])
    out = capsys.readouterr().out
    counts = population_counts(30, "reddit")
    assert f"train: 30 clients, {int(counts.sum()):,} samples" in out
    assert ArrayFederatedDataModule(str(tmp_path / "fed")).sample_counts() == counts.tolist()
    (tmp_path / "fed" / "train.y.npy").write_bytes(b"\x93NUMPY broken")
    with pytest.raises(SystemExit) as stopped:
        main(["data", "info", str(tmp_path / "fed")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert err.splitlines() == [
        "lightning-fl data: info did not complete.",
        err.splitlines()[1],
    ] and err.splitlines()[1].startswith(f"error: {tmp_path / 'fed' / 'train.y.npy'}: unreadable")


def test_the_generate_command_writes_a_validation_split_by_default(tmp_path, capsys):
    """`lightning-fl data generate` writes train, val and test (10% and 20% of each
    client's samples, the library's own split), so that eval_clients has data to evaluate;
    --val-fraction 0 leaves validation out."""
    from lightning_fl.command import main
    from lightning_fl.datamodules.arrays import open_federation
    from lightning_fl.datamodules.population import generate_population

    main(["data", "generate", "--clients", "40", "--out", str(tmp_path / "fed")])
    out = capsys.readouterr().out
    assert f"{tmp_path / 'fed'}: val: 40 clients" in out
    written = open_federation(tmp_path / "fed")
    expected = open_federation(generate_population(tmp_path / "lib", 40, val_fraction=0.1,
                                                   test_fraction=0.2))  # fmt: skip
    assert set(written) == {"train", "val", "test"}
    for split in written:
        assert written[split].counts.tolist() == expected[split].counts.tolist()
    counts = written["train"].counts + written["val"].counts + written["test"].counts
    test = np.where(counts >= 2, np.minimum(np.maximum(1, counts // 5), counts - 1), 0)
    left = counts - test
    val = np.where(left >= 2, np.minimum(np.maximum(1, counts // 10), left - 1), 0)
    assert written["val"].counts.tolist() == val.tolist() and val.sum() > 0
    main(["data", "generate", "--clients", "40", "--val-fraction", "0", "--out",
          str(tmp_path / "none")])  # fmt: skip
    assert set(open_federation(tmp_path / "none")) == {"train", "test"}


def test_per_client_figures_of_many_clients_are_histograms(tmp_path, monkeypatch):
    from lightning_fl import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda plt, fig, path, dpi: figures.append(fig) or path)
    rng = np.random.default_rng(0)
    many = {c: float(v) for c, v in enumerate(rng.random(plots.MANY_CLIENTS + 1))}
    plots.plot_client_distributions({"seen": many}, str(tmp_path / "c.png"), "acc")
    (ax,) = figures[-1].axes
    assert not ax.collections  # no dot a client
    assert ax.get_lines()[0].get_xdata()[0] == pytest.approx(np.quantile(list(many.values()), 0.1))
    assert "1,001 clients" in ax.get_title()
    few = {c: v for c, v in list(many.items())[:50]}
    plots.plot_client_distributions({"seen": few}, str(tmp_path / "d.png"), "acc")
    assert len(figures[-1].axes[0].collections[0].get_offsets()) == 50  # a dot a client
    rows = [(t, c, 0.5) for t in range(3) for c in (5, 2_000_000 + t)]
    path = tmp_path / "participation.csv"
    path.write_text("round,client,weight\n" + "".join(f"{t},{c},{w}\n" for t, c, w in rows))
    plots.plot_participation(str(path), str(tmp_path / "p.png"))
    bars = figures[-1].axes[0]
    heights = sorted(p.get_height() for p in bars.patches if p.get_height() > 0)
    assert heights == [1, 3]  # 3 clients took part once, client 5 three times
    assert "4 clients took part" in bars.get_title()


def test_draws_in_o_of_the_drawn_equal_torchs_draws():
    """randperm_prefix and multinomial_draws replay torch.randperm and torch.multinomial
    (with replacement) bit for bit: every n from 1 to 40 and 10⁵, several seeds (a
    63-bit one too), prefixes up to the whole permutation, weights with zeros."""
    from lightning_fl.engine import seeding
    from lightning_fl.engine.seeding import cumulative_weights, multinomial_draws, randperm_prefix

    assert seeding._replays_torch()  # the replay is in use here, not torch's fallback
    for n in [*range(1, 41), 100_000]:
        for seed in (0, 17, 2**62 + 5):
            generator = torch.Generator().manual_seed(seed)
            for count in {1, min(n, 7), n if n <= 40 else 300}:
                full = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
                assert randperm_prefix(n, count, seed) == full[:count].tolist(), (n, seed)
            p = torch.rand(n, dtype=torch.float64, generator=generator)
            p[::3] = 0
            if float(p.sum()) == 0:
                continue
            p /= p.sum()
            expected = torch.multinomial(p, 25, True, generator=torch.Generator().manual_seed(seed))
            got = multinomial_draws(cumulative_weights(p), 25, seed)
            assert got.tolist() == expected.tolist(), (n, seed)


def test_uniform_and_md_samplers_draw_what_torch_draws_over_rounds():
    """The samplers' participants over 30 rounds of 20,000 clients (some without data)
    equal those of torch's own O(n) calls with the round's generator."""
    from lightning_fl.engine.seeding import generator

    counts = torch.arange(20_000, dtype=torch.float64) % 7
    p = counts / counts.sum()
    eligible = torch.nonzero(p > 0).flatten()
    uniform, md = UniformSampler(50), MDSampler(50)
    for t in range(30):
        gen = generator(4, "sampler", t)
        chosen = eligible[torch.randperm(len(eligible), generator=gen)[:50]].tolist()
        assert uniform.sample(t, 4, p).clients == tuple(sorted(chosen))
        gen = generator(4, "sampler", t)
        draws = torch.multinomial(p, 50, replacement=True, generator=gen).tolist()
        part = md.sample(t, 4, p)
        assert part.clients == tuple(sorted(set(draws)))
        assert part.weights == tuple(Counter(draws)[c] / 50 for c in part.clients)


def test_a_large_population_resumes_bit_identical_with_a_checkpoint_of_its_participants(
    tmp_path,
):
    """120,000 clients (above LISTED_COUNTS: the counts are a digest), MD sampling of 5,
    SCAFFOLD and kept optimizer states, cohort validation: 4 rounds straight equal 2 rounds,
    a checkpoint, and 2 resumed rounds; the checkpoint holds only the participants'."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(rounds, module, callbacks=(), ckpt_path=None, **kw):
        strategy = FederatedStrategy(sampler=MDSampler(5), local_steps=2, seed=9,
                                     keep_optimizer_state=True, eval_clients=40)  # fmt: skip
        trainer = make_trainer(strategy, rounds, [SCAFFOLD(), *callbacks],
                               limit_val_batches=None, **kw)  # fmt: skip
        trainer.fit(module, datamodule=_population(120_000), ckpt_path=ckpt_path,
                    weights_only=True)  # fmt: skip

    full = tiny_module(0.1)
    fit(4, full)
    first = tiny_module(0.1)
    saver = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    fit(2, first, [saver], enable_checkpointing=True)
    saved = torch.load(tmp_path / "epoch=1.ckpt", weights_only=True)
    state = saved["callbacks"]["_RoundDriver"]
    assert isinstance(state["federation"]["train_counts"], str)  # the digest, not 120,000 ints
    assert 0 < len(state["client_store"]) <= 10  # 2 rounds of 5 draws
    resumed = tiny_module(0.1, seed=77)  # a fresh run: everything comes from the checkpoint
    fit(4, resumed, ckpt_path=str(tmp_path / "epoch=1.ckpt"))
    for a, b in zip(params_of(full), params_of(resumed)):
        assert torch.equal(a, b)


#: plugins of the composition matrix run on the same federation held as arrays
ON_ARRAYS = ("FedAvg", "SCAFFOLD", "UniformSampler", "FedEM", "KNNPer", "Ditto", "DPSGD",
             "MembershipInference", "Unlearning", "FreeRiders", "vectorize", "resume")  # fmt: skip


@pytest.mark.parametrize("name", ON_ARRAYS)
def test_plugins_on_an_array_federation_equal_the_in_memory_one(name, monkeypatch):
    """The composition matrix's tiny federation, as arrays: every plugin trains the same
    model (exactly) and tests to the same metrics (1e-6: the test pass may run vectorized
    over clients)."""
    from tests import composition

    composition.quiet()
    plain = composition.run((name,))
    clients, _ = composition._clients()
    build = composition.build

    def on_arrays(names):
        setup = build(names)
        if setup.datamodule is composition.tiny_federation:
            setup.datamodule = lambda: ArrayFederatedDataModule(splits=_arrays_of(clients),
                                                                batch_size=4)  # fmt: skip
        return setup

    monkeypatch.setattr(composition, "build", on_arrays)
    arrays = composition.run((name,))
    assert plain.status == arrays.status == "ok", (plain.message, arrays.message)
    for a, b in zip(plain.params, arrays.params):
        assert torch.equal(a, b)
    assert arrays.weights == plain.weights
    assert arrays.metrics.keys() == plain.metrics.keys()
    for key, value in plain.metrics.items():
        assert arrays.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def _sent140_leaf(root) -> None:
    """A tiny Sent140 in LEAF's layout: x = [id, date, query, user, tweet], y in {0, 1}."""
    from lightning_fl.datamodules import write_leaf_json

    tweets = ["I love this!", "so sad today...", "love love, the best", "not good; sad",
              "what a day", "best day ever!", "sad sad sad", "hello world"]  # fmt: skip
    users = {}
    for k in range(4):
        rows = [tweets[(k + j) % len(tweets)] for j in range(2 + k)]
        users[f"user{k}"] = {"x": [["1", "Mon", "NO_QUERY", f"user{k}", t] for t in rows],
                             "y": [int("sad" not in t) for t in rows]}  # fmt: skip
    train = {u: {"x": e["x"][:-1], "y": e["y"][:-1]} for u, e in users.items()}
    test = {u: {"x": e["x"][-1:], "y": e["y"][-1:]} for u, e in users.items() if u != "user2"}
    test["user3"]["x"][0][4] = "an unseen word"
    write_leaf_json(root / "train" / "sent140_train.json", train)
    write_leaf_json(root / "test" / "sent140_test.json", test)


@pytest.mark.parametrize("dataset", ["synthetic", "femnist", "shakespeare", "sent140"])
def test_converted_leaf_equals_what_leafdatamodule_reads(dataset, tmp_path):
    """LEAF's train/ and test/ files converted (train users the clients, test users matched
    by name; Sent140's vocabulary from the training tweets) give every client the tensors
    LeafDataModule gives it."""
    from lightning_fl.datamodules import LeafDataModule
    from lightning_fl.datamodules.leaf import write_synthetic_leaf

    if dataset == "sent140":
        _sent140_leaf(tmp_path / "leaf")
    else:
        write_synthetic_leaf(tmp_path / "leaf", dataset, num_users=5, samples=12, seed=1)
    convert_leaf([tmp_path / "leaf" / "train"], tmp_path / "fed",
                 test=[tmp_path / "leaf" / "test"], dataset=dataset)  # fmt: skip
    converted = ArrayFederatedDataModule(str(tmp_path / "fed"))
    reference = LeafDataModule(str(tmp_path / "leaf"), dataset)
    assert converted.num_clients == reference.num_clients
    assert client_names(tmp_path / "fed") == reference.users
    for c in range(reference.num_clients):
        for split in ("train", "test"):
            want = reference.client_dataset(c, split)
            got = converted.client_dataset(c, split)
            if want is None:
                assert len(got) == 0
                continue
            for a, b in zip(got.tensors, want.tensors):
                assert a.dtype == b.dtype and torch.equal(a, b), (dataset, c, split)
    if dataset == "sent140":
        words = (tmp_path / "fed" / "vocabulary.txt").read_text().splitlines()
        assert {w: i + 1 for i, w in enumerate(words)} == reference.vocabulary


def test_a_test_user_without_training_data_is_refused(tmp_path):
    from lightning_fl.datamodules import write_leaf_json

    write_leaf_json(tmp_path / "train.json", {"a": {"x": [[1.0]], "y": [0]}})
    write_leaf_json(tmp_path / "test.json", {"b": {"x": [[1.0]], "y": [0]}})
    with pytest.raises(FederationFormatError, match="test user 'b' has no training data"):
        convert_leaf([tmp_path / "train.json"], tmp_path / "fed", test=[tmp_path / "test.json"])


def test_the_command_line_knows_the_converters_datasets():
    from lightning_fl import data_command

    assert data_command.DATASETS == leaf_convert.DATASETS


def test_client_metrics_in_bulk_are_the_csv_writers_rows(tmp_path):
    """The bulk writer's bytes equal csv.writer's rows of the same values (quoting a
    metric name with a comma and a quote, 8 significant digits, clients in order)."""
    import csv

    from lightning_fl.engine.evaluation import write_client_metrics_csv

    rng = np.random.default_rng(0)
    per_client = {
        name: {int(c): (float(v), float(n)) for c, v, n in
               zip(rng.permutation(300), rng.standard_normal(300) * 1e3, rng.integers(1, 9, 300))}
        for name in ("test_loss", 'odd,"name"')
    }  # fmt: skip
    bulk = tmp_path / "bulk.csv"
    write_client_metrics_csv(str(bulk), "test", 3, per_client)
    write_client_metrics_csv(str(bulk), "val", 4, per_client)
    with open(tmp_path / "rows.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["stage", "round", "metric", "client", "value", "num_samples"])
        for stage, round_idx in (("test", 3), ("val", 4)):
            for name, values in per_client.items():
                for client, (value, count) in sorted(values.items()):
                    writer.writerow([stage, round_idx, name, client, f"{value:.8g}", int(count)])
    assert bulk.read_bytes() == (tmp_path / "rows.csv").read_bytes()


def test_the_data_commands_options_their_defaults_and_what_they_print(tmp_path, capsys):
    """Each subcommand's required options are refused when missing (the subcommand too);
    ``generate`` defaults to 4 features and 2 classes, ``convert-leaf`` to Sent140's 25
    words; ``generate-leaf`` says how many files it wrote, and each run ends with its
    time."""
    from lightning_fl.command import main
    from lightning_fl.data_command import parser
    from lightning_fl.datamodules.arrays import open_federation

    for argv in ([], ["generate", "--out", "x"], ["generate", "--clients", "3"],
                 ["generate-leaf", "--out", "x"], ["generate-leaf", "--clients", "3"],
                 ["convert-leaf", "in.json"]):  # fmt: skip
        with pytest.raises(SystemExit) as refused:
            parser().parse_args(argv)
        assert refused.value.code == 2, argv
    assert parser().parse_args(["convert-leaf", "a.json", "--out", "o"]).max_words == 25
    main(["data", "generate", "--clients", "30", "--out", str(tmp_path / "fed")])
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"\(\d+\.\d s\)", out[-1]), out
    train = open_federation(tmp_path / "fed")["train"]
    assert train.columns[0].shape[1] == 4 and set(np.unique(train.columns[1])) == {0, 1}
    main(["data", "generate-leaf", "--clients", "12", "--out", str(tmp_path / "json")])
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"\d+ LEAF JSON file\(s\) in {re.escape(str(tmp_path / 'json'))} "
                        r"\(\d+\.\d s\)", out[-1]), out  # fmt: skip
