"""Partitioners are pure functions of (labels, seed); the embedded digits datamodule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fl.datamodules import (
    DigitsDataModule,
    dirichlet_partition,
    iid_partition,
    load_digits,
    shard_partition,
)

LABELS = np.repeat(np.arange(10), 100)


def _histograms(parts):
    return np.stack([np.bincount(LABELS[p], minlength=10) / max(len(p), 1) for p in parts])


@pytest.mark.parametrize(
    "split",
    [
        lambda s: iid_partition(LABELS, 7, s),
        lambda s: dirichlet_partition(LABELS, 7, 0.3, s),
        lambda s: shard_partition(LABELS, 7, 2, s),
    ],
    ids=["iid", "dirichlet", "shards"],
)
def test_every_sample_once_and_same_seed_same_split(split):
    parts = split(0)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))
    assert all(np.array_equal(a, b) for a, b in zip(parts, split(0)))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, split(1)))


def test_dirichlet_alpha_controls_skew():
    near_iid = _histograms(dirichlet_partition(LABELS, 5, 1e4, seed=0))
    skewed = _histograms(dirichlet_partition(LABELS, 5, 0.05, seed=0))
    assert np.abs(near_iid - 0.1).max() < 0.05
    assert np.abs(skewed - 0.1).max() > 0.4


def test_dirichlet_min_size_and_impossible_min_size():
    parts = dirichlet_partition(LABELS, 10, 0.5, seed=0, min_size=20)
    assert min(len(p) for p in parts) >= 20
    with pytest.raises(ValueError, match="lower min_size"):
        dirichlet_partition(LABELS, 10, 0.5, seed=0, min_size=200)


def test_shards_give_few_classes_per_client():
    parts = shard_partition(LABELS, 10, 2, seed=0)
    assert max(len(np.unique(LABELS[p])) for p in parts) <= 2


def test_too_many_clients_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds the 1000 samples"):
        iid_partition(LABELS, 1001, 0)


def test_digits_is_embedded_and_split_per_client():
    x, y = load_digits()
    assert x.shape == (1797, 64) and set(np.unique(y)) == set(range(10))
    assert 0 <= x.min() and x.max() <= 1
    dm = DigitsDataModule(num_clients=20, alpha=0.5, seed=0)
    total = sum(sum(dm.sample_counts(s)) for s in ("train", "val", "test"))
    assert dm.num_clients == 20 and total == 1797
    assert min(dm.sample_counts("train")) > 0
    with pytest.raises(ValueError, match="Unknown partition"):
        DigitsDataModule(partition="zipf")


def test_mobilenet_v2_matches_the_published_architecture():
    """torchvision's mobilenet_v2(num_classes=1000) has 3,504,872 parameters (Sandler et al.)."""
    import torch

    from lightning_fl import MobileNetV2

    assert sum(p.numel() for p in MobileNetV2(1000).parameters()) == 3_504_872
    assert MobileNetV2(100)(torch.zeros(2, 3, 32, 32)).shape == (2, 100)


@pytest.mark.parametrize("n", [12, 13])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("seeded", [True, False])
def test_tensor_batches_are_one_permutation_per_pass(n, shuffle, seeded):
    """Pass after pass, one randperm(n) of the loader's generator (the global one when
    None), cut into batches of 4 (the last one short: n = 13); in order without shuffling.
    The batches of a DataLoader without its two thrown-away draws, and no other draw."""
    from torch.utils.data import TensorDataset

    from lightning_fl.engine.data_contract import TensorBatchLoader

    x, y = torch.randn(n, 3), torch.arange(n)
    dataset = TensorDataset(x, y)
    torch.manual_seed(7)
    generator = torch.Generator().manual_seed(3) if seeded else None
    loader = TensorBatchLoader(dataset, 4, shuffle, generator)
    ours = [[[t.clone() for t in b] for b in loader] for _ in range(3)]
    after = torch.rand(1)
    torch.manual_seed(7)
    reference = torch.Generator().manual_seed(3) if seeded else None
    for our_pass in ours:
        order = torch.randperm(n, generator=reference) if shuffle else torch.arange(n)
        expected = [order[s : s + 4] for s in range(0, n, 4)]
        assert len(our_pass) == len(expected) == len(loader)
        for (bx, by), index in zip(our_pass, expected):
            assert torch.equal(bx, x[index]) and torch.equal(by, index)
    assert torch.equal(after, torch.rand(1))  # the global RNG advanced alike
    if seeded:
        assert torch.equal(generator.get_state(), reference.get_state())


def test_one_class_partition_gives_client_i_digit_i_mod_10():
    from lightning_fl.datamodules import DigitsDataModule

    dm = DigitsDataModule(num_clients=100, partition="one_class", seed=3)
    for c in (0, 7, 10, 55, 99):
        labels = torch.cat([dm.client_dataset(c, s).tensors[1] for s in ("train", "val", "test")])
        assert set(labels.tolist()) == {c % 10}
    sizes = [len(dm.client_dataset(c, "train")) for c in range(100)]
    assert max(sizes) - min(sizes) <= 3


def test_watermark_sets_the_same_ten_pixels_to_the_maximum_for_each_client():
    from lightning_fl.datamodules import DigitsDataModule

    plain = DigitsDataModule(num_clients=20, partition="iid", seed=0)
    marked = DigitsDataModule(num_clients=20, partition="iid", seed=0, watermark=10)
    for c in (0, 10, 3):
        positions = np.random.default_rng(42 + c % 10).choice(64, 10, replace=False)
        x = marked.client_dataset(c, "train").tensors[0]
        original = plain.client_dataset(c, "train").tensors[0]
        assert bool((x[:, positions] == 1.0).all())  # the data's maximum (16/16)
        others = np.setdiff1d(np.arange(64), positions)
        assert torch.equal(x[:, others], original[:, others])


def test_constructors_store_and_validate_and_setup_reads_the_data_once(monkeypatch, tmp_path):
    """Lightning's convention (issue 37): a constructor reads no data, so a process that
    parses a configuration reads no dataset; ``setup`` (or the first use) reads it, once.
    A missing dataset is named at set-up; an invalid argument still at construction."""
    from lightning_fl.datamodules import (
        CifarDataModule,
        FashionMnistDataModule,
        FedHeartDiseaseDataModule,
        LeafDataModule,
        Purchase100DataModule,
    )
    from lightning_fl.datamodules import digits as digits_module

    reads = []
    original = digits_module.load_digits
    monkeypatch.setattr(digits_module, "load_digits", lambda: reads.append(1) or original())
    dm = DigitsDataModule(num_clients=10, unseen_fraction=0.2)
    assert reads == []
    dm.setup("fit")
    dm.setup("test")
    assert reads == [1]
    assert dm.num_clients == 10 and dm.unseen_clients == [8, 9]
    nowhere = str(tmp_path / "nowhere")
    for missing in (
        FashionMnistDataModule(root=nowhere),
        CifarDataModule("cifar10", root=nowhere, num_clients=2),
        LeafDataModule(nowhere, "femnist"),
        FedHeartDiseaseDataModule(root=nowhere),
        Purchase100DataModule(root=nowhere),
    ):
        with pytest.raises(FileNotFoundError, match="nowhere"):
            missing.setup("fit")
    with pytest.raises(ValueError, match="Unknown partition 'zipf'"):
        DigitsDataModule(partition="zipf")


# ---------------------------------------------------------------- partitioners' bounds
def _partitioners():
    """Every partitioner, as a function of (labels, num_clients), with its other options
    at accepting values."""
    from lightning_fl.datamodules.partition import (
        grouped_dirichlet_partition,
        one_class_partition,
    )

    return {
        "iid": lambda y, n: iid_partition(y, n, 0),
        "dirichlet": lambda y, n: dirichlet_partition(y, n, 0.5, 0),
        "shards": lambda y, n: shard_partition(y, n, 1, 0),
        "one_class": lambda y, n: one_class_partition(y, n, 0),
        "grouped": lambda y, n: grouped_dirichlet_partition(y, n, 0.5, 1, 0),
    }


@pytest.mark.parametrize("name", ["iid", "dirichlet", "shards", "one_class", "grouped"])
def test_every_partitioner_takes_one_client_to_one_per_sample_and_refuses_past_both(name):
    split = _partitioners()[name]
    labels = np.zeros(5, dtype=int)
    for bad in (np.zeros((5, 1), dtype=int), np.zeros(0, dtype=int)):
        with pytest.raises(ValueError, match="labels must be a non-empty 1-D array"):
            split(bad, 1)
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        split(labels, 0)
    with pytest.raises(ValueError, match="exceeds the 5 samples"):
        split(labels, 6)
    for n in (1, 5):
        parts = split(labels, n)
        assert len(parts) == n
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(5))
    assert [p.tolist() for p in split(np.zeros(1, dtype=int), 1)] == [[0]]


def test_shards_count_shards_against_the_samples_and_one_class_needs_a_client_per_class():
    from lightning_fl.datamodules.partition import one_class_partition

    labels = np.arange(6) % 3
    assert len(shard_partition(labels, 3, 2, 0)) == 3  # 6 shards of one sample each
    with pytest.raises(ValueError, match="num_clients=8 exceeds the 6 samples"):
        shard_partition(labels, 4, 2, 0)
    assert [labels[p].tolist() for p in one_class_partition(labels, 3, 0)] == [
        [0, 0],
        [1, 1],
        [2, 2],
    ]
    with pytest.raises(ValueError, match="2 clients for 3 classes"):
        one_class_partition(labels, 2, 0)


def test_dirichlet_min_size_at_its_bound_and_past_it():
    """min_size · N equal to the samples is accepted (each client exactly min_size, found
    by redrawing) and one more is refused."""
    labels = np.zeros(6, dtype=int)
    parts = dirichlet_partition(labels, 2, 1e9, seed=0, min_size=3)
    assert [len(p) for p in parts] == [3, 3]
    with pytest.raises(ValueError, match="min_size=4 for 2 clients"):
        dirichlet_partition(labels, 2, 1e9, seed=0, min_size=4)


def test_label_partition_refuses_an_unknown_name_with_the_choices():
    from lightning_fl.datamodules.partition import label_partition

    with pytest.raises(ValueError, match="Unknown partition 'zipf'; use dirichlet"):
        label_partition(LABELS, "zipf", 3, 0)


def test_split_fractions_refuse_negatives_and_sums_off_one_either_way():
    from lightning_fl.datamodules.partition import split_fractions

    for bad in ((0.5, 0.6), (0.3, 0.3), (-0.5, 1.5), (1.0 - 2e-6,)):
        with pytest.raises(ValueError, match="split fractions"):
            split_fractions(np.arange(10), bad, 0)
    assert [len(p) for p in split_fractions(np.arange(10), (0.0, 0.3, 0.7), 0)] == [0, 3, 7]


def test_random_subset_at_both_ends_and_its_own_stream():
    """1 to ``size`` samples; the (seed, 23) stream is pinned, so that a subset drawn by an
    earlier run is drawn again."""
    from lightning_fl.datamodules.partition import random_subset

    assert len(random_subset(5, 1, 0, "x")) == 1
    assert random_subset(5, 5, 0, "x").tolist() == [0, 1, 2, 3, 4]
    for bad in (0, 6):
        with pytest.raises(ValueError, match="use 1 to 5"):
            random_subset(5, bad, 0, "x")
    assert random_subset(10, 4, 1, "x").tolist() == [2, 4, 5, 9]  # (1, 24) draws 1, 5, 8, 9


def test_the_base_datamodule_at_its_edges():
    """Batches of one accepted and of none refused (the loader and the datamodule); a
    client without a split counts 0 samples in it; a silo refuses another silo's client by
    name; a federated loader iterates only under FederatedStrategy, and says so at the
    first batch, not when Lightning calls iter()."""
    from torch.utils.data import TensorDataset

    from lightning_fl.datamodules import InMemoryFederatedDataModule
    from lightning_fl.engine.data_contract import SiloError, TensorBatchLoader

    data = TensorDataset(torch.arange(3.0), torch.arange(3))
    assert [b[1].tolist() for b in TensorBatchLoader(data, 1)] == [[0], [1], [2]]
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        TensorBatchLoader(data, 0)
    clients = [{"train": (torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))} for _ in range(3)]
    clients[1]["val"] = (torch.zeros(2, 2), torch.zeros(2, dtype=torch.long))
    dm = InMemoryFederatedDataModule(clients, batch_size=1)
    assert dm.sample_counts("val") == [0, 2, 0] and dm.sample_counts() == [4, 4, 4]
    clients[2]["val"] = (torch.ones(1, 2), torch.ones(1, dtype=torch.long))  # one sample
    pooled = InMemoryFederatedDataModule(clients, batch_size=1).pooled_dataset("val")
    assert [int(y) for _, y in pooled] == [0, 0, 1]  # client 1's two, then client 2's one
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        InMemoryFederatedDataModule(clients, batch_size=0)
    dm.enter_silo(0, 2)
    assert len(dm.client_dataset(2, "train")) == 4
    with pytest.raises(SiloError, match="client 1's data is held by silo 1, not by this one"):
        dm.client_dataset(1, "train")
    with pytest.raises(ValueError, match=r"unseen_fraction must be in \[0, 1\), got 1.0"):
        dm.hold_out(1.0)
    batches = iter(dm.train_dataloader())
    with pytest.raises(RuntimeError, match="run only under FederatedStrategy"):
        next(batches)


def test_digits_clients_and_server_by_hand_as_images():
    """The server's samples drawn first (``server_split`` with ``seed``), the rest
    partitioned, client c's part split with ``seed + 7919 (c + 1)``; ``image=True`` serves
    the same 64 features as row-major 1×8×8 images, the server's too."""
    from lightning_fl.datamodules import DigitsDataModule
    from lightning_fl.datamodules.partition import label_partition, server_split, split_fractions

    seed, split = 2, (0.5, 0.3, 0.2)
    dm = DigitsDataModule(num_clients=4, partition="iid", seed=seed, split=split,
                          server_samples=100, image=True, batch_size=5)  # fmt: skip
    x, y = load_digits()
    held, kept = server_split(len(y), 100, seed, "the digits")
    server_x, server_y = dm.server_dataset()[:]
    assert server_x.shape == (100, 1, 8, 8) and server_y.tolist() == y[held].tolist()
    assert torch.equal(server_x.reshape(100, 64), torch.from_numpy(x[held]))
    x, y = x[kept], y[kept]
    for c, idx in enumerate(label_partition(y, "iid", 4, seed)):
        for name, rows in zip(
            ("train", "val", "test"), split_fractions(idx, split, seed + 7919 * (c + 1))
        ):
            images, labels = dm.client_dataset(c, name)[:]
            assert images.shape[1:] == (1, 8, 8) and labels.tolist() == y[rows].tolist()
            assert torch.equal(images.reshape(len(rows), 64), torch.from_numpy(x[rows]))
    assert dm.hparams["server_samples"] == 100


def test_a_watermark_may_cover_every_pixel_but_no_more():
    from lightning_fl.datamodules.digits import watermarked

    features = torch.rand(3, 1, 8, 8)
    assert bool((watermarked(features, 4, 64, 2.0) == 2.0).all())
    with pytest.raises(ValueError, match="watermark of 65 pixels on samples of 64"):
        watermarked(features, 4, 65, 2.0)


#: labels in no order, with ties and classes of unequal sizes (7, 13, 5, 20 samples)
UNEVEN = np.random.default_rng(11).permutation(np.repeat(np.arange(4), [7, 13, 5, 20]))


def test_dirichlet_split_by_hand_with_floor_cuts_and_retries_on_one_stream():
    """Hsu et al.'s split as FedLab cuts it: for each class in increasing order, a
    permutation of its samples, then q ~ Dir(α·1_N); client c takes the samples between
    floor(n·Σ_{j<c} q_j) and floor(n·Σ_{j≤c} q_j). With ``min_size`` a draw that leaves a
    client short is drawn again from the same generator (seed 2 needs four retries here)."""
    from lightning_fl.datamodules.partition import dirichlet_partition

    def by_hand(alpha, seed, clients, min_size=0):
        rng = np.random.default_rng(seed)
        tries = 0
        while True:
            tries += 1
            parts = [[] for _ in range(clients)]
            for k in (0, 1, 2, 3):
                members = rng.permutation([i for i, y in enumerate(UNEVEN) if y == k])
                q = rng.dirichlet([alpha] * clients)
                start, total = 0, 0.0
                for c in range(clients):
                    total += q[c]
                    stop = len(members) if c == clients - 1 else int(total * len(members))
                    parts[c] += list(members[start:stop])
                    start = stop
            if min(len(p) for p in parts) >= min_size:
                return [sorted(p) for p in parts], tries

    for alpha, seed, clients, min_size in ((0.7, 5, 3, 0), (0.3, 2, 4, 6), (5.0, 0, 5, 0)):
        expected, tries = by_hand(alpha, seed, clients, min_size)
        got = dirichlet_partition(UNEVEN, clients, alpha, seed, min_size=min_size)
        assert [p.tolist() for p in got] == expected, (alpha, seed)
        assert (tries > 1) == bool(min_size)  # the retries are exercised


def test_shards_by_hand_from_the_stably_sorted_labels():
    """McMahan et al.'s shards: the samples sorted by label, ties kept in index order, cut
    into N·s shards of (almost) equal size, and a permutation of the shards dealt s to
    each client in turn."""
    from lightning_fl.datamodules.partition import shard_partition

    clients, per_client, seed = 3, 2, 4
    order = sorted(range(len(UNEVEN)), key=lambda i: (UNEVEN[i], i))
    sizes = [len(order) // 6 + (s < len(order) % 6) for s in range(6)]  # 8, 8, 8, 7, 7, 7
    bounds = np.cumsum([0, *sizes])
    shards = [order[bounds[s] : bounds[s + 1]] for s in range(6)]
    dealt = np.random.default_rng(seed).permutation(6)
    expected = [sorted(shards[dealt[2 * c]] + shards[dealt[2 * c + 1]]) for c in range(clients)]
    got = shard_partition(UNEVEN, clients, per_client, seed)
    assert [p.tolist() for p in got] == expected


def test_fedems_grouped_split_by_hand_shuffles_the_labels_into_groups():
    """FedEM's ``split_dataset_by_labels``: the labels shuffled and dealt into G groups of
    (almost) equal size; for each group, its samples shuffled, w ~ Dir(α·1_N) and counts ~
    Multinomial(group size, w) cut them over the clients in order."""
    from lightning_fl.datamodules.partition import grouped_dirichlet_partition

    clients, alpha, groups, seed = 3, 0.4, 2, 3
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(4)
    expected = [[] for _ in range(clients)]
    for group in (shuffled[:2], shuffled[2:]):
        members = rng.permutation([i for i, y in enumerate(UNEVEN) if y in group])
        w = rng.dirichlet([alpha] * clients)
        counts = rng.multinomial(len(members), w)
        start = 0
        for c in range(clients):
            expected[c] += list(members[start : start + counts[c]])
            start += counts[c]
    got = grouped_dirichlet_partition(UNEVEN, clients, alpha, groups, seed)
    assert [p.tolist() for p in got] == [sorted(p) for p in expected]
    assert sorted(shuffled[:2]) != [0, 1]  # the seed shuffles the labels: groups differ


def test_held_out_clients_pooled_data_and_evaluation_batches_by_hand():
    """``hold_out(f)`` makes the last round(f·n) clients unseen (6 clients at f = 0.45:
    round(2.7) = 3, not int's 2); the pooled data is the seen clients' only, in client
    order; training loaders cut ``batch_size`` batches, evaluation loaders
    ``eval_batch_size`` ones."""
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    clients = [
        {
            "train": (torch.full((5, 2), float(c)), torch.full((5,), c, dtype=torch.long)),
            "val": (torch.zeros(5, 2), torch.zeros(5, dtype=torch.long)),
        }
        for c in range(6)
    ]
    dm = InMemoryFederatedDataModule(clients, batch_size=2, eval_batch_size=4)
    dm.hold_out(0.45)
    assert dm.unseen_clients == [3, 4, 5] and dm.seen_clients() == [0, 1, 2]
    assert [int(y) for _, y in dm.pooled_dataset("train")] == [0] * 5 + [1] * 5 + [2] * 5
    train = dm.client_dataloader(dm.client_dataset(1, "train"), "train", torch.Generator())
    val = dm.client_dataloader(dm.client_dataset(1, "val"), "val")
    assert [len(b[1]) for b in train] == [2, 2, 1] and [len(b[1]) for b in val] == [4, 1]
