"""kNN-Per (§3.6): the FAISS datastore equals brute force, λ = 0 is the global model,
λ = 1 is a brute-force kNN classifier, and the datastore update rules."""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F

from lightning_fl import FederatedStrategy
from lightning_fl.callbacks import KNNPer
from lightning_fl.systems.datastore import Datastore, knn_probabilities
from tests.helpers import make_trainer, tiny_clients, tiny_datamodule, tiny_module


def test_faiss_flat_and_ivf_equal_brute_force():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(300, 16, generator=g)
    labels = torch.randint(0, 5, (300,), generator=g)
    queries = torch.randn(40, 16, generator=g)
    exact_d, exact_l = Datastore(backend="torch").build(keys, labels).search(queries, 7)
    reference = torch.cdist(queries, keys).topk(7, largest=False)
    assert torch.allclose(exact_d, reference.values)
    for store in (
        Datastore(backend="faiss").build(keys, labels),
        Datastore(backend="faiss", index="ivf", nlist=4, nprobe=4).build(keys, labels),
    ):
        d, lab = store.search(queries, 7)
        assert torch.allclose(d, exact_d, atol=1e-4)
        assert torch.equal(lab, exact_l)


def test_knn_probabilities_by_hand():
    distances = torch.tensor([[0.0, 1.0, 2.0]])
    labels = torch.tensor([[2, 0, 2]])
    w = torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 2.0)
    expected = torch.tensor([[w[1], 0.0, w[0] + w[2]]]) / w.sum()
    assert torch.allclose(knn_probabilities(distances, labels, 3, scale=2.0), expected)


def test_datastore_update_rules():
    keys, labels = torch.arange(6.0)[:, None], torch.arange(6)
    fifo = Datastore(backend="torch", capacity=4, update_rule="fifo").build(keys[:3], labels[:3])
    fifo.update(keys[3:], labels[3:])
    assert fifo.labels.tolist() == [2, 3, 4, 5]
    grow = Datastore(backend="torch", capacity=4, update_rule="concatenate").build(
        keys[:3], labels[:3]
    )
    grow.update(keys[3:], labels[3:])
    assert grow.labels.tolist() == [0, 1, 2, 3, 4, 5]
    fixed = Datastore(backend="torch", update_rule="fixed").build(keys[:3], labels[:3])
    fixed.update(keys[3:], labels[3:])
    assert fixed.labels.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="empty"):
        Datastore().search(keys, 1)


def _trained():
    module = tiny_module(0.1)
    trainer = make_trainer(FederatedStrategy(local_steps=5, seed=1), 3, [])
    trainer.fit(module, datamodule=tiny_datamodule())
    return module


def _test(module, callbacks, tmp_path=None):
    kw = {} if tmp_path is None else {"default_root_dir": str(tmp_path)}
    trainer = make_trainer(FederatedStrategy(seed=1), 1, callbacks, **kw)
    results = trainer.test(module, datamodule=tiny_datamodule(), verbose=False)[0]
    return results, dict(trainer.strategy.evaluation.capture.per_client["test_acc"])


def test_lambda_zero_is_the_global_model():
    module = _trained()
    plain, plain_clients = _test(module, [])
    knn, knn_clients = _test(module, [KNNPer(lambda_=0.0)])
    assert abs(plain["test_loss"] - knn["test_loss"]) < 1e-5
    assert plain_clients == knn_clients


def test_lambda_one_is_a_brute_force_knn_classifier():
    module = _trained()
    k, scale = 3, 0.7
    _, knn_clients = _test(module, [KNNPer(lambda_=1.0, k=k, scale=scale)])
    net = module.network.net
    embed = torch.nn.Sequential(*list(net)[:-1])  # the input of the last Linear
    for c, data in enumerate(tiny_clients()):
        with torch.no_grad():
            keys, queries = embed(data["train"][0]), embed(data["test"][0])
        d = torch.cdist(queries, keys)
        kk = min(k, len(keys))
        dist, idx = d.topk(kk, largest=False)
        votes = torch.zeros(len(queries), 3)
        votes.scatter_add_(1, data["train"][1][idx], torch.exp(-dist / scale))
        accuracy = float((votes.argmax(1) == data["test"][1]).float().mean())
        assert knn_clients[c][0] == pytest.approx(accuracy, abs=1e-6)


def test_lambda_is_chosen_per_client_and_written(tmp_path):
    module = _trained()
    callback = KNNPer(k=3)
    _test(module, [callback], tmp_path)
    assert set(callback.lambdas) == set(range(10))
    assert all(lam in callback.lambda_grid for lam in callback.lambdas.values())
    rows = list(csv.DictReader(open(tmp_path / "knn_per_lambdas.csv")))
    assert len(rows) == 10 and int(rows[0]["datastore_size"]) == 4


def test_lambda_is_the_first_best_on_the_client_validation_data():
    """λ_t = the first grid value with the best validation accuracy of
    λ·p_kNN + (1 − λ)·softmax(h(x)) (eq. 3.33), recomputed by brute force."""
    module = _trained()
    k, scale = 3, 0.7
    callback = KNNPer(k=k, scale=scale)
    _test(module, [callback])
    net = module.network.net
    embed = torch.nn.Sequential(*list(net)[:-1])
    chosen_differs_from_last_best = False
    for c, data in enumerate(tiny_clients()):
        with torch.no_grad():
            keys, (x, y) = embed(data["train"][0]), data["val"]
            queries, model_probs = embed(x), torch.softmax(module.network(x), dim=1)
        dist, idx = torch.cdist(queries, keys).topk(min(k, len(keys)), largest=False)
        votes = torch.zeros(len(queries), 3)
        votes.scatter_add_(1, data["train"][1][idx], torch.exp(-dist / scale))
        knn = votes / votes.sum(1, keepdim=True)
        accs = [
            float(((lam * knn + (1 - lam) * model_probs).argmax(1) == y).float().mean())
            for lam in callback.lambda_grid
        ]
        best = callback.lambda_grid[accs.index(max(accs))]
        last_best = callback.lambda_grid[len(accs) - 1 - accs[::-1].index(max(accs))]
        chosen_differs_from_last_best |= best != last_best
        assert callback.lambdas[c] == best, (c, accs)
    assert chosen_differs_from_last_best  # the tie rule is exercised


def test_capacity_keeps_a_fraction_of_the_datastore():
    module = _trained()
    callback = KNNPer(k=3, capacity=0.5, lambda_=0.5)
    _test(module, [callback])
    sizes = [len(c["train"][1]) for c in tiny_clients()]
    assert callback.datastore_sizes == {c: max(1, round(0.5 * n)) for c, n in enumerate(sizes)}
    tiny = KNNPer(k=3, capacity=0.01, lambda_=0.5)  # round(0.01·n) = 0: one key kept
    _test(module, [tiny])
    assert tiny.datastore_sizes == dict.fromkeys(range(10), 1)


def test_bad_knn_settings_are_refused():
    with pytest.raises(ValueError, match="capacity"):
        KNNPer(capacity=0.0)
    with pytest.raises(ValueError, match="λ"):
        KNNPer(lambda_=1.5)


def test_shakespeare_representation_is_hidden_and_cell_states_concatenated():
    """kNN-Per's Shakespeare representation (thesis §3.6.4): the final (h, c) of both LSTM
    layers, 2·2·hidden values, as the paper recipe asks."""
    from lightning_fl import CharLSTM, Classifier

    torch.manual_seed(0)
    module = Classifier(CharLSTM(vocab_size=10, embed_dim=4, hidden=8, layers=2))
    callback = KNNPer(representation_layer="network.final_state")
    handle = callback._capture(module)
    x = torch.randint(0, 10, (5, 7))
    with torch.no_grad():
        module(x)
        _, (h, c) = module.network.lstm(module.network.embedding(x))
    handle.remove()
    expected = torch.cat([h[0], h[1], c[0], c[1]], dim=1)
    assert callback._captured.shape == (5, 32)
    assert torch.equal(callback._captured, expected)


def test_a_rebuilt_datastore_searches_its_new_keys_and_k_beyond_its_size():
    """Build, search (the FAISS index is cached), build again: the search reads the new
    keys, not the cached index; k larger than the store gives all N neighbours; keys that
    are not [N, d], or labels of another length, are each refused."""
    for backend in ("faiss", "torch"):
        store = Datastore(backend).build(torch.tensor([[0.0], [10.0]]), torch.tensor([0, 1]))
        assert store.search(torch.tensor([[9.0]]), 1)[1].tolist() == [[1]]
        store.build(torch.tensor([[0.0], [10.0], [8.5]]), torch.tensor([0, 1, 2]))
        distances, labels = store.search(torch.tensor([[9.0]]), 10)
        assert labels.tolist() == [[2, 1, 0]]
        assert distances[0].tolist() == pytest.approx([0.5, 1.0, 9.0])
    with pytest.raises(ValueError, match="keys must be"):
        Datastore("torch").build(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="keys must be"):
        Datastore("torch").build(torch.zeros(3, 2), torch.zeros(2))


def test_faiss_gpu_is_used_only_with_its_gpu_resources_and_a_gpu(monkeypatch):
    import sys
    from types import SimpleNamespace

    from lightning_fl.systems.datastore import faiss_gpu_available

    def fake(gpus, resources=True):
        module = SimpleNamespace(get_num_gpus=lambda: gpus)
        if resources:
            module.StandardGpuResources = object
        return module

    for module, expected in ((fake(1), True), (fake(2), True), (fake(0), False),
                             (fake(1, resources=False), False), (None, False)):  # fmt: skip
        monkeypatch.setitem(sys.modules, "faiss", module)  # None: the import fails
        assert faiss_gpu_available() is expected


def test_with_faiss_gpu_the_index_moves_to_gpu_0_and_keeps_its_resources(monkeypatch):
    """Where faiss-gpu sees a GPU, the built index is handed to ``index_cpu_to_gpu`` on GPU
    0 with a ``StandardGpuResources``, which the store keeps alive as long as the index,
    and searches go to the moved index (the faiss-gpu calls stood in for here: without a
    GPU, the moved index answers with the CPU index)."""
    import faiss

    from lightning_fl.systems import datastore as datastore_module

    moved = []

    class Resources:
        pass

    class OnGpu:  # stands for the GPU index: the CPU index's answers, counted
        def __init__(self, index) -> None:
            self.index, self.calls = index, []

        def add(self, keys) -> None:
            self.calls.append("add")
            self.index.add(keys)

        def search(self, queries, k):
            self.calls.append("search")
            return self.index.search(queries, k)

    def to_gpu(resources, device, index):
        moved.append((resources, device, index))
        return OnGpu(index)

    monkeypatch.setattr(datastore_module, "faiss_gpu_available", lambda: True)
    monkeypatch.setattr(faiss, "StandardGpuResources", Resources, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_gpu", to_gpu, raising=False)
    store = Datastore("faiss").build(torch.tensor([[0.0], [10.0], [8.5]]), torch.tensor([0, 1, 2]))
    distances, labels = store.search(torch.tensor([[9.0]]), 2)
    assert labels.tolist() == [[2, 1]] and distances[0].tolist() == pytest.approx([0.5, 1.0])
    [(resources, device, index)] = moved
    assert isinstance(resources, Resources) and device == 0
    assert isinstance(index, faiss.IndexFlatL2) and store._index.index is index
    assert store._index.calls == ["add", "search"]
    assert store._keep_alive[1] is resources


def test_a_capacity_of_one_keeps_the_last_key_and_zero_is_refused():
    store = Datastore("torch", capacity=1, update_rule="fifo")
    store.build(torch.tensor([[0.0], [1.0], [2.0]]), torch.tensor([5, 6, 7]))
    store.update(torch.tensor([[3.0]]), torch.tensor([8]))
    assert store.keys.tolist() == [[3.0]] and store.labels.tolist() == [8]
    with pytest.raises(ValueError, match="capacity must be >= 1 or None, got 0"):
        Datastore("torch", capacity=0)


def test_a_new_datastore_is_empty_until_built_or_updated():
    store = Datastore("torch", update_rule="fixed")
    assert len(store) == 0
    with pytest.raises(ValueError, match="The datastore is empty"):
        store.search(torch.zeros(1, 2), 1)
    store.update(torch.ones(2, 2), torch.tensor([3, 4]))  # fixed: the first pairs are kept
    assert len(store) == 2 and store.search(torch.ones(1, 2), 1)[1].tolist() == [[3]]


def test_ivf_from_exactly_nlist_keys_probes_one_cell_and_missing_neighbours_weigh_nothing():
    """IVF is built from nlist keys on (one key a cell), below that the store is flat: with
    nprobe = 1 a query near a key finds that key alone, and the k − 1 neighbours FAISS could
    not find come back as key 0 at an infinite distance, whose kNN weight is 0."""
    keys = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [10.0, 10.0]])
    labels = torch.tensor([2, 0, 1, 0])
    query = torch.tensor([[0.0, 9.0]])
    ivf = Datastore(backend="faiss", index="ivf", nlist=4, nprobe=1).build(keys, labels)
    distances, found = ivf.search(query, 3)
    assert distances[0, 0].item() == pytest.approx(1.0)
    assert found[0].tolist() == [1, 2, 2]  # key 2's label, then key 0's for the missing
    assert distances[0, 1:].tolist() == [float("inf")] * 2
    assert ivf._faiss_index() is ivf._faiss_index()  # trained once, until the next build
    probabilities = knn_probabilities(distances, found, 3, scale=1e30)
    assert torch.equal(probabilities, torch.tensor([[0.0, 1.0, 0.0]]))

    flat = Datastore(backend="faiss", index="ivf", nlist=5, nprobe=1).build(keys, labels)
    distances, found = flat.search(query, 3)  # fewer keys than cells: exact search
    assert torch.allclose(distances, torch.tensor([[1.0, 9.0, 101.0**0.5]]))
    assert found.tolist() == [[1, 2, 0]]


def test_an_intermediate_lambda_with_the_authors_squared_kernel_scores_the_mixture_by_hand():
    """λ = 0.3, k = 4, the authors' kernel exp(−‖z − z'‖²/scale) (``squared_distance``),
    scale 2: each client's test loss is the NLL of 0.3·p_kNN + 0.7·softmax(h(x)) (eq. 3.33)
    over its test samples, and ``knn_per/lambda_mean`` is 0.3. Batches of 2 and 1 test
    samples, so that no batch has as many rows as there are classes."""
    module = _trained()
    k, scale, lam = 4, 2.0, 0.3
    knn_per = KNNPer(lambda_=lam, k=k, scale=scale, squared_distance=True)
    trainer = make_trainer(FederatedStrategy(seed=1), 1, [knn_per])
    trainer.test(module, datamodule=tiny_datamodule(batch_size=2), verbose=False)
    losses = dict(trainer.strategy.evaluation.capture.per_client["test_loss"])
    assert float(trainer.callback_metrics["knn_per/lambda_mean"]) == pytest.approx(lam)
    net = module.network.net
    embed = torch.nn.Sequential(*list(net)[:-1])
    for c, data in enumerate(tiny_clients()):
        x, y = data["test"]
        with torch.no_grad():
            keys, queries = embed(data["train"][0]), embed(x)
            model_probs = torch.softmax(module.network(x), dim=1)
        dist, idx = torch.cdist(queries, keys).topk(min(k, len(keys)), largest=False)
        votes = torch.zeros(len(queries), 3)
        votes.scatter_add_(1, data["train"][1][idx], torch.exp(-(dist**2) / scale))
        knn = votes / votes.sum(1, keepdim=True)
        expected = F.nll_loss(torch.log(lam * knn + (1 - lam) * model_probs), y)
        assert losses[c][0] == pytest.approx(float(expected), abs=1e-5), c


def test_k_of_one_is_accepted_and_zero_refused():
    assert KNNPer(k=1).k == 1
    with pytest.raises(ValueError, match="k must be >= 1"):
        KNNPer(k=0)


def test_last_linear_is_the_last_linear_layer_not_the_last_module():
    from callbacks.knn_per import last_linear

    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2), torch.nn.Identity())
    assert last_linear(net) == "1"


def test_a_reused_callback_reports_only_its_latest_epoch_and_leaves_no_hooks(tmp_path):
    """The per-epoch tables are cleared at each epoch's start: the same KNNPer tested on 10
    clients, then on 4, reports the 4 (λ, sizes, CSV rows); the PNG follows the test's CSV
    in a folder the run creates when the run draws figures (FederatedPlots), and not
    otherwise (``enable_plots=False``); no hook stays on the network after an
    evaluation."""
    module = _trained()
    callback = KNNPer(k=3, lambda_=0.5)
    _test(module, [callback])
    folder = tmp_path / "fresh" / "run"
    plain = make_trainer(FederatedStrategy(seed=1), 1, [callback], default_root_dir=str(folder))
    plain.test(module, datamodule=tiny_datamodule(num_clients=4), verbose=False)
    assert not (folder / "knn_per_lambdas.png").exists()  # the run draws no figures
    from lightning_fl.plots import FederatedPlots

    trainer = make_trainer(FederatedStrategy(seed=1), 1, [callback, FederatedPlots()],
                           default_root_dir=str(folder))  # fmt: skip
    trainer.test(module, datamodule=tiny_datamodule(num_clients=4), verbose=False)
    sizes = [len(c["train"][1]) for c in tiny_clients(num_clients=4)]
    assert callback.lambdas == {c: 0.5 for c in range(4)}
    assert callback.datastore_sizes == dict(enumerate(sizes))
    rows = list(csv.DictReader(open(folder / "knn_per_lambdas.csv")))
    assert [int(r["datastore_size"]) for r in rows] == sizes
    assert (folder / "knn_per_lambdas.png").exists()
    for layer in module.modules():
        assert not layer._forward_hooks and not layer._forward_pre_hooks


def test_the_validate_stage_reports_per_round_and_the_test_stage_stays_out_of_validation(
    tmp_path,
):
    """``stages=("validate",)``: λ per client and its CSV at each validation (no figure,
    which is the test's), cleared between validations; a test-only KNNPer leaves
    validation to the global model."""
    module = _trained()
    plain = make_trainer(FederatedStrategy(seed=1), 1, [], limit_val_batches=None)
    plain_loss = plain.validate(module, datamodule=tiny_datamodule(), verbose=False)[0]
    test_only = KNNPer(k=3, lambda_=1.0)
    trainer = make_trainer(FederatedStrategy(seed=1), 1, [test_only], limit_val_batches=None)
    loss = trainer.validate(module, datamodule=tiny_datamodule(), verbose=False)[0]
    assert loss == plain_loss and test_only.lambdas == {}
    callback = KNNPer(k=3, lambda_=0.25, stages=("validate",))
    for clients in (10, 3):
        trainer = make_trainer(
            FederatedStrategy(seed=1),
            1,
            [callback],
            limit_val_batches=None,
            default_root_dir=str(tmp_path),
        )
        trainer.validate(module, datamodule=tiny_datamodule(num_clients=clients), verbose=False)
        assert callback.lambdas == {c: 0.25 for c in range(clients)}
        assert float(trainer.callback_metrics["knn_per/lambda_mean"]) == 0.25
        assert len(list(csv.DictReader(open(tmp_path / "knn_per_lambdas.csv")))) == clients
    assert not (tmp_path / "knn_per_lambdas.png").exists()
