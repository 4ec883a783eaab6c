"""CIFAR: the official pickle format, a restricted unpickler, and the paper splits."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from lightning_fl.datamodules import (
    CifarDataModule,
    grouped_dirichlet_partition,
    load_pickle_batch,
    pachinko_partition,
)
from lightning_fl.datamodules.cifar import CIFAR, write_synthetic_cifar
from lightning_fl.datamodules.download import ChecksumError


@pytest.fixture
def cifar10_root(tmp_path):
    write_synthetic_cifar(tmp_path, CIFAR["cifar10"], train_per_file=60, test_size=100, seed=0)
    return tmp_path


def test_reads_official_format_and_splits_every_sample_once(cifar10_root):
    dm = CifarDataModule("cifar10", root=str(cifar10_root), check_md5=False, num_clients=6,
                         alpha=0.5, val_fraction=0.2, unseen_fraction=1 / 3)  # fmt: skip
    counts = [a + b for a, b in zip(dm.sample_counts("train"), dm.sample_counts("val"))]
    assert sum(counts) == 300 and sum(dm.sample_counts("test")) == 100
    x, y = dm.client_dataset(0, "train")[:]
    assert x.shape[1:] == (3, 32, 32) and 0 <= x.min() and x.max() <= 1
    assert dm.unseen_clients == [4, 5] and dm.seen_clients() == [0, 1, 2, 3]


def test_checksum_mismatch_names_the_file(cifar10_root):
    with pytest.raises(ChecksumError, match="data_batch_1: md5 is"):
        CifarDataModule("cifar10", root=str(cifar10_root), num_clients=2).setup()


def test_corrupt_pickle_names_the_file(cifar10_root):
    path = cifar10_root / "cifar-10-batches-py" / "data_batch_2"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="data_batch_2: not a valid CIFAR pickle batch"):
        CifarDataModule("cifar10", root=str(cifar10_root), check_md5=False, num_clients=2).setup()


class _Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_pickle_with_code_is_refused(tmp_path):
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _Exploit()}, protocol=2))
    with pytest.raises(ValueError, match=r"refusing to load (posix|os)\.system"):
        load_pickle_batch(path)


def test_wrong_image_size_and_missing_keys_name_the_file(cifar10_root):
    path = cifar10_root / "cifar-10-batches-py" / "data_batch_3"
    batch = load_pickle_batch(path)
    batch[b"data"] = np.zeros((60, 1024), dtype=np.uint8)
    path.write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(ValueError, match=r"data_batch_3: images must be rows of 3072"):
        CifarDataModule("cifar10", root=str(cifar10_root), check_md5=False, num_clients=2).setup()
    del batch[b"labels"]
    path.write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(ValueError, match="data_batch_3: missing key 'labels'"):
        CifarDataModule("cifar10", root=str(cifar10_root), check_md5=False, num_clients=2).setup()


def test_missing_files_say_how_to_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="download=True"):
        CifarDataModule("cifar10", root=str(tmp_path), num_clients=2).setup()


def test_grouped_dirichlet_keeps_each_label_group_together():
    labels = np.repeat(np.arange(10), 50)
    parts = grouped_dirichlet_partition(labels, 8, alpha=1e4, num_groups=2, seed=0)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(500))
    parts = grouped_dirichlet_partition(labels, 4, alpha=1e-3, num_groups=2, seed=0)
    label_sets = [set(labels[p]) for p in parts if len(p)]
    assert all(len(s) % 5 == 0 for s in label_sets)  # tiny alpha: clients get whole groups


def test_pachinko_draws_without_replacement_and_follows_coarse_skew():
    fine = np.repeat(np.arange(100), 20)
    coarse = fine // 5
    parts = pachinko_partition(coarse, fine, 10, 100, alpha=0.05, beta=10.0, seed=0)
    everything = np.concatenate(parts)
    assert len(everything) == 1000 and len(np.unique(everything)) == 1000
    coarse_counts = [np.bincount(coarse[p], minlength=20).max() / 100 for p in parts]
    assert np.mean(coarse_counts) > 0.5  # small alpha: few coarse labels per client
    again = pachinko_partition(coarse, fine, 10, 100, alpha=0.05, beta=10.0, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_cifar100_pachinko_datamodule(tmp_path):
    dm = CifarDataModule("cifar100", root=str(tmp_path), generate=True, num_clients=5,
                         partition="pachinko", alpha=0.3, beta=10.0, samples_per_client=50,
                         generate_sizes=(400, 200))  # fmt: skip
    assert dm.sample_counts("train") == [50] * 5
    assert (tmp_path / "cifar-100-python" / "train").exists()


def test_unbalanced_split_has_the_papers_sizes_and_shared_proportions():
    from lightning_fl.datamodules.partition import (
        unbalanced_dirichlet_partition,
        unbalanced_sizes,
    )

    assert sum(unbalanced_sizes(100)) == 48_500
    assert sorted(set(unbalanced_sizes(100))) == [100, 250, 500, 750, 1000]
    rng = np.random.default_rng(0)
    train, test = rng.integers(0, 10, 5000), rng.integers(0, 10, 1000)
    train_parts, test_parts = unbalanced_dirichlet_partition(train, test, 100, 0.01, seed=1)
    assert [len(p) for p in train_parts] == unbalanced_sizes(100)
    assert [len(p) for p in test_parts] == [n // 5 for n in unbalanced_sizes(100)]

    # α = 0.01: almost every client holds one class, the same one in train and test
    def top(labels, idx):
        return np.bincount(labels[idx], minlength=10).argmax()

    same = [top(train, tr) == top(test, te) for tr, te in zip(train_parts, test_parts)]
    assert np.mean(same) > 0.9


def test_cifar_datamodule_builds_the_unbalanced_split(tmp_path):
    from lightning_fl.datamodules.partition import unbalanced_sizes

    dm = CifarDataModule(root=str(tmp_path), generate=True, generate_sizes=(200, 200),
                         num_clients=20, partition="unbalanced", alpha=0.1)  # fmt: skip
    assert dm.sample_counts("train") == unbalanced_sizes(20)
    assert dm.sample_counts("test") == [n // 5 for n in unbalanced_sizes(20)]


def test_grouped_dirichlet_sizes_follow_each_groups_counts_and_one_group_is_accepted():
    """α = 10⁴: every group's multinomial splits it almost equally over the 3 clients, so
    each client holds about a third of the samples (a cut past the second client would
    leave the third empty); ``num_groups = 1`` pools every label; α = 0 is refused."""
    labels = np.repeat(np.arange(4), 75)
    for groups in (1, 2):
        parts = grouped_dirichlet_partition(labels, 3, alpha=1e4, num_groups=groups, seed=0)
        assert all(abs(len(p) - 100) < 25 for p in parts), [len(p) for p in parts]
    with pytest.raises(ValueError, match="alpha must be > 0, got 0"):
        grouped_dirichlet_partition(labels, 3, alpha=0.0, num_groups=1, seed=0)


def test_pachinko_follows_each_clients_fine_draw_on_any_coarse_ids_and_its_bounds():
    """α = β = 10⁻³: each client draws one coarse label and one fine label within it, so
    its 10 samples are of one fine label (pools of 50 never run out); coarse ids 5 and 9
    (not 0..C−1). Every sample taken at N·n = size; one more, or α or β = 0, is refused."""
    fine = np.repeat(np.arange(4), 50)
    coarse = np.where(fine < 2, 5, 9)
    parts = pachinko_partition(coarse, fine, 4, 10, alpha=1e-3, beta=1e-3, seed=0)
    assert all(len(set(fine[p])) == 1 for p in parts), [fine[p] for p in parts]
    parts = pachinko_partition(coarse, fine, 4, 50, alpha=0.5, beta=0.5, seed=0)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(200))
    with pytest.raises(ValueError, match="exceed the 200 samples"):
        pachinko_partition(coarse, fine, 67, 3, alpha=0.5, beta=0.5, seed=0)
    for alpha, beta in ((0.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError, match="alpha and beta must be > 0"):
            pachinko_partition(coarse, fine, 4, 10, alpha=alpha, beta=beta, seed=0)
    assert len(pachinko_partition(coarse, fine, 4, 10, alpha=0.5, beta=0.5, seed=0)) == 4
    for bad in ((coarse[:, None], fine), (coarse, fine[:, None])):
        with pytest.raises(ValueError, match="non-empty 1-D"):
            pachinko_partition(*bad, 4, 10, alpha=0.5, beta=0.5, seed=0)


def test_unbalanced_sizes_fill_with_the_largest_and_cut_to_the_clients():
    """Rounding the shares can leave clients over (4 clients: 0, 1, 1, 1, 0, then one 1000)
    or give one too many (6: 1, 2, 2, 1, 1, cut to 6); α = 0 and 2-D labels are refused."""
    from lightning_fl.datamodules.partition import (
        unbalanced_dirichlet_partition,
        unbalanced_sizes,
    )

    assert unbalanced_sizes(4) == [250, 500, 750, 1000]
    assert unbalanced_sizes(6) == [100, 250, 250, 500, 500, 750]
    labels = np.arange(100) % 10
    with pytest.raises(ValueError, match="alpha must be > 0, got 0"):
        unbalanced_dirichlet_partition(labels, labels, 4, 0.0, seed=0)
    for bad in ((labels[:, None], labels), (labels, labels[:, None])):
        with pytest.raises(ValueError, match="non-empty 1-D"):
            unbalanced_dirichlet_partition(*bad, 4, 0.5, seed=0)


def _labels(dm, split):
    return [dm.client_dataset(c, split)[:][1].tolist() for c in range(dm.num_clients)]


@pytest.mark.parametrize(
    "partition, options",
    [("iid", {}), ("shards", {"shards_per_client": 3}), ("dirichlet", {"num_groups": 2})],
)
def test_each_partition_splits_train_and_test_with_its_own_seeds(cifar10_root, partition, options):
    """The datamodule's clients by hand: the partition of the training labels with ``seed``,
    of the test labels with ``seed + 1``, and each client's validation share with
    ``seed + 31 c``."""
    from lightning_fl.datamodules.cifar import read_cifar
    from lightning_fl.datamodules.partition import (
        grouped_dirichlet_partition,
        iid_partition,
        shard_partition,
        split_fractions,
    )

    seed, n = 4, 5
    dm = CifarDataModule("cifar10", root=str(cifar10_root), check_md5=False, num_clients=n,
                         partition=partition, alpha=0.5, val_fraction=0.25, seed=seed,
                         **options)  # fmt: skip
    train = read_cifar(str(cifar10_root), CIFAR["cifar10"], "train", check=False)["labels"]
    test = read_cifar(cifar10_root, CIFAR["cifar10"], "test", check=False)["labels"]
    parts = {
        "iid": lambda y, s: iid_partition(y, n, s),
        "shards": lambda y, s: shard_partition(y, n, 3, s),
        "dirichlet": lambda y, s: grouped_dirichlet_partition(y, n, 0.5, 2, s),
    }[partition]
    fits = [
        split_fractions(p, (0.75, 0.25), seed + 31 * c) for c, p in enumerate(parts(train, seed))
    ]
    assert _labels(dm, "train") == [train[fit].tolist() for fit, _ in fits]
    assert _labels(dm, "val") == [train[val].tolist() for _, val in fits]
    assert _labels(dm, "test") == [test[p].tolist() for p in parts(test, seed + 1)]
    assert set(train.tolist()) == set(range(10))  # the generator's 10 classes, all drawn


def test_pachinko_test_share_is_the_training_share_scaled_down_and_at_least_one(tmp_path):
    """Pachinko draws ``samples_per_client`` training images per client and
    ⌊n_test · samples_per_client / n_train⌋ (at least 1) test images: 300 · 50 // 400 = 37."""
    options = dict(generate=True, partition="pachinko", alpha=0.3, beta=10.0, num_clients=4,
                   generate_sizes=(400, 300))  # fmt: skip
    dm = CifarDataModule("cifar100", root=str(tmp_path), samples_per_client=50, **options)
    assert dm.sample_counts("train") == [50] * 4 and dm.sample_counts("test") == [37] * 4
    dm = CifarDataModule("cifar100", root=str(tmp_path), samples_per_client=1, **options)
    assert dm.sample_counts("test") == [1] * 4  # 300 · 1 // 400 = 0


def test_generated_cifar_by_hand(tmp_path):
    """The ``small`` recipes' CIFAR-100 stand-in: a template per class drawn from
    ``default_rng(seed)``, plus N(0, 40) noise per image, clipped to [0, 255]; coarse labels
    are fine // 5; files in pickle protocol 2, like the official ones. Writing again over
    them is allowed."""
    from lightning_fl.datamodules.cifar import read_cifar

    spec = CIFAR["cifar100"]
    for _ in range(2):
        write_synthetic_cifar(str(tmp_path / "new" / "root"), spec, 30, test_size=20, seed=3)
    rng = np.random.default_rng(3)
    templates = rng.integers(0, 256, size=(100, 3072))
    for split, size in (("train", 30), ("test", 20)):
        labels = rng.integers(0, 100, size=size)
        pixels = np.clip(templates[labels] + rng.normal(0, 40, size=(size, 3072)), 0, 255)
        data = read_cifar(tmp_path / "new" / "root", spec, split, check=False)
        np.testing.assert_array_equal(data["images"].reshape(size, -1), pixels.astype(np.uint8))
        assert data["labels"].tolist() == labels.tolist()
        assert data["coarse"].tolist() == (labels // 5).tolist()
    assert (tmp_path / "new" / "root" / spec.folder / "train").read_bytes()[:2] == b"\x80\x02"


def test_download_fetches_the_archive_once_and_extracts_it(tmp_path, monkeypatch):
    """``download=True`` fetches the (md5-checked) archive into ``root`` and extracts it
    there, once: a second datamodule reads the extracted files without the source."""
    import hashlib
    import tarfile

    from lightning_fl.datamodules import cifar

    source = tmp_path / "source"
    write_synthetic_cifar(source, CIFAR["cifar10"], train_per_file=10, test_size=10, seed=0)
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    spec = dataclasses.replace(CIFAR["cifar10"], url=archive.as_uri(), archive_md5=md5)
    monkeypatch.setitem(cifar.CIFAR, "cifar10", spec)
    cifar.fetch_cifar(str(tmp_path / "direct"), spec)
    assert (tmp_path / "direct" / "cifar-10-batches-py" / "test_batch").exists()
    root = tmp_path / "root"
    root.mkdir()  # a root= the user names must exist (a mistyped one is not created)
    dm = CifarDataModule("cifar10", root=str(root), download=True, check_md5=False, num_clients=2)
    assert sum(dm.sample_counts("train")) == 50 and (root / "cifar-10-python.tar.gz").exists()
    archive.unlink()
    (root / "cifar-10-python.tar.gz").unlink()
    again = CifarDataModule(
        "cifar10", root=str(root), download=True, check_md5=False, num_clients=2
    )
    assert again.sample_counts("train") == dm.sample_counts("train")


def test_cifar_hyperparameters_default_root_and_bounds(tmp_path):
    from lightning_fl.datamodules.cifar import CACHE

    dm = CifarDataModule("cifar100", num_clients=3, alpha=0.7)
    assert dm.root == CACHE / "cifar100" and dm.hparams["alpha"] == 0.7
    with pytest.raises(ValueError, match=r"unseen_fraction must be in \[0, 1\)"):
        CifarDataModule("cifar10", unseen_fraction=1.0)
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps([1, 2], protocol=2))
    with pytest.raises(ValueError, match="batch: expected a dict, got list"):
        load_pickle_batch(str(path))


def test_pachinko_by_hand_with_labels_running_out():
    """Reddi et al.'s Pachinko allocation (App. C.1) written out on 3 coarse labels of
    2, 1 and 3 fine labels with 1 to 4 samples each, 3 clients of 5 samples (15 of 16),
    so that fine and coarse labels run out: per client, coarse proportions ~ Dir(α),
    fine ones ~ Dir(β) per coarse label; per sample, a coarse label among those with a
    sample left (renormalized; any such label when the client's own have none), a fine
    label among its own with a sample left, and that label's pool's last sample (the
    pools shuffled once, in fine-label order)."""
    fine = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4, 5, 5, 5, 0])
    coarse = np.array([{0: 0, 1: 0, 2: 1, 3: 2, 4: 2, 5: 2}[f] for f in fine])
    alpha, beta, seed, clients, size = 0.3, 0.8, 7, 3, 5
    rng = np.random.default_rng(seed)
    fine_of = {0: [0, 1], 1: [2], 2: [3, 4, 5]}
    pools = {f: list(rng.permutation([i for i in range(16) if fine[i] == f])) for f in range(6)}
    expected = []
    for _ in range(clients):
        p_coarse = rng.dirichlet([alpha] * 3)
        p_fine = {c: rng.dirichlet([beta] * len(fine_of[c])) for c in (0, 1, 2)}
        taken = []
        for _ in range(size):
            left = [any(pools[f] for f in fine_of[c]) for c in (0, 1, 2)]
            weights = [p_coarse[c] if left[c] else 0.0 for c in (0, 1, 2)]
            if sum(weights) == 0:
                weights = [1.0 if left[c] else 0.0 for c in (0, 1, 2)]
            c = rng.choice(3, p=np.array(weights) / sum(weights))
            weights = [p_fine[c][j] if pools[f] else 0.0 for j, f in enumerate(fine_of[c])]
            if sum(weights) == 0:
                weights = [1.0 if pools[f] else 0.0 for f in fine_of[c]]
            j = rng.choice(len(fine_of[c]), p=np.array(weights) / sum(weights))
            taken.append(int(pools[fine_of[c][j]].pop()))
        expected.append(sorted(taken))
    got = pachinko_partition(coarse, fine, clients, size, alpha=alpha, beta=beta, seed=seed)
    assert [p.tolist() for p in got] == expected
    assert sum(len(pool) for pool in pools.values()) == 1  # labels did run out
