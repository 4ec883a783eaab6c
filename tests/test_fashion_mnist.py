"""Fashion-MNIST (issue 23): the IDX reader on small files written here in the real format,
the real files of Debian's dataset-fashion-mnist (installed by `make test` and .ci/run),
the partitions and the watermark, and errors that name the fix."""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fl.datamodules import FashionMnistDataModule, read_fashion_mnist
from lightning_fl.datamodules.fashion_mnist import DEBIAN_ROOT, FILES, sifu_partition, verify_idx


def _write_idx(path: Path, array: np.ndarray) -> None:
    """LeCun's IDX format, gzipped: magic 0x0000, type 0x08 (uint8), ndim, sizes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


def _fixture(folder: Path, train: int = 40, test: int = 20) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    arrays = (
        rng.integers(0, 256, (train, 28, 28)), np.arange(train) % 10,
        rng.integers(0, 256, (test, 28, 28)), np.arange(test) % 10,
    )  # fmt: skip
    for name, array in zip(FILES, arrays):
        _write_idx(folder / name, array)
    return arrays


def test_the_reader_returns_the_idx_arrays_exactly(tmp_path):
    arrays = _fixture(tmp_path)
    read = read_fashion_mnist(tmp_path, check=False)
    for ours, written in zip(read, arrays):
        assert np.array_equal(ours, written)
    assert read[0].dtype == np.uint8 and read[1].dtype == np.int64


def test_a_file_of_other_data_fails_its_checksum_naming_it(tmp_path):
    _fixture(tmp_path)
    name = "train-labels-idx1-ubyte.gz"
    with pytest.raises(ValueError, match=rf"{name}: its decompressed SHA-256 is .*reinstall"):
        verify_idx(tmp_path / name, FILES[name])


def test_a_truncated_file_is_refused(tmp_path):
    _fixture(tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    with gzip.open(path, "wb") as handle:
        handle.write(data[:-100])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_fashion_mnist(tmp_path, check=False)


def test_missing_files_name_the_apt_package_and_the_root_flag(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        FashionMnistDataModule(root=str(tmp_path / "nowhere")).setup()
    message = str(info.value)
    assert "apt-get install dataset-fashion-mnist" in message
    assert "--data.init_args.root" in message


def test_sifu_partition_draws_one_class_per_client_with_replacement():
    labels = np.repeat(np.arange(10), 7)  # 7 samples of each class: 100 draws must repeat
    parts = sifu_partition(labels, 20, 100, seed=3)
    for i, part in enumerate(parts):
        assert len(part) == 100 and set(labels[part]) == {i % 10}
        assert len(set(part.tolist())) <= 7  # with replacement
    assert not np.array_equal(parts[0], parts[10])  # clients of a class draw apart


_REAL = all((DEBIAN_ROOT / name).exists() for name in FILES)
_NEED_REAL = pytest.mark.skipif(
    not _REAL and not os.environ.get("CI"),
    reason="apt-get install dataset-fashion-mnist (make test installs it; CI requires it)",
)


@_NEED_REAL
def test_the_real_files_verify_and_the_datamodule_holds_their_arrays():
    """Debian's files hash to the published data; a client's tensors are the IDX bytes
    scaled by 1/255, read here with an independent parser."""
    for name, digest in FILES.items():
        with gzip.open(DEBIAN_ROOT / name, "rb") as handle:
            raw = handle.read()
        assert hashlib.sha256(raw).hexdigest() == digest
    with gzip.open(DEBIAN_ROOT / "train-images-idx3-ubyte.gz", "rb") as handle:
        images = np.frombuffer(handle.read()[16:], dtype=np.uint8).reshape(60000, 28, 28)
    with gzip.open(DEBIAN_ROOT / "train-labels-idx1-ubyte.gz", "rb") as handle:
        labels = np.frombuffer(handle.read()[8:], dtype=np.uint8)
    x_train, y_train, x_test, y_test = read_fashion_mnist(DEBIAN_ROOT)
    assert x_train.shape == (60000, 28, 28) and x_test.shape == (10000, 28, 28)
    assert np.array_equal(x_train, images) and np.array_equal(y_train, labels)
    assert np.bincount(y_train).tolist() == [6000] * 10
    assert np.bincount(y_test).tolist() == [1000] * 10
    dm = FashionMnistDataModule(num_clients=10, partition="iid", seed=0)
    assert sum(dm.sample_counts("train")) == 60000 and sum(dm.sample_counts("test")) == 10000
    x, y = dm.client_dataset(3, "train").tensors
    matches = torch.from_numpy(images.astype(np.float32) / 255.0)
    first = torch.nonzero((matches == x[0, 0]).all(dim=2).all(dim=1)).flatten()
    assert len(first) >= 1 and int(labels[int(first[0])]) == int(y[0])


@_NEED_REAL
def test_sifu_protocol_and_watermark_on_the_real_data():
    """Tab. D.1's FashionMNIST row: 100 clients of 100 samples of one class; the watermark
    sets the same 10 pixels of every sample of a client to 1, the pixels of clients of the
    same class i mod 10."""
    dm = FashionMnistDataModule(num_clients=100, partition="sifu", watermark=10, seed=1)
    assert dm.sample_counts("train") == [100] * 100
    for c in (0, 7, 17):
        x, y = dm.client_dataset(c, "train").tensors
        assert set(y.tolist()) == {c % 10}
        marked = (x.reshape(len(x), -1) == 1.0).all(dim=0)
        assert int(marked.sum()) >= 10
    a = (dm.client_dataset(7, "train").tensors[0].reshape(100, -1) == 1.0).all(0)
    b = (dm.client_dataset(17, "train").tensors[0].reshape(100, -1) == 1.0).all(0)
    assert torch.equal(a, b)
    # the SIFU authors' Normalize(0.5, 0.5), after the watermark: marked pixels stay 1
    normalized = FashionMnistDataModule(
        num_clients=100, partition="sifu", watermark=10, seed=1, normalize=(0.5, 0.5)
    )
    x, _ = dm.client_dataset(7, "train").tensors
    z, _ = normalized.client_dataset(7, "train").tensors
    assert torch.equal(z, (x - 0.5) / 0.5) and float(z.min()) == -1.0
    assert (z.reshape(100, -1)[:, a] == 1.0).all()
    with pytest.raises(ValueError, match="normalize must be \\(mean, std\\) with std > 0"):
        FashionMnistDataModule(num_clients=10, normalize=(0.5, 0.0))


@_NEED_REAL
def test_the_sifu_recipe_runs_on_the_real_data(tmp_path):
    import glob

    from lightning_fl.cli import run

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "fashion_mnist" / "sifu.yaml"
    cli = run(["fit", "--config", str(recipe), "--trainer.max_epochs", "2",
               "--trainer.enable_progress_bar", "false", "--test_after_fit", "false",
               "--trainer.default_root_dir", str(tmp_path),
               "--trainer.logger.init_args.save_dir", str(tmp_path)])  # fmt: skip
    assert cli.trainer.current_epoch == 2
    assert cli.datamodule.sample_counts("train") == [100] * 100
    (unlearning,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "Unlearning"]
    stop = unlearning.on_target  # the authors' schedule: the first check after 20 rounds
    assert (stop.check_every, stop.max_rounds, stop.period) == (20, 10_000, 20)
    assert cli.trainer.gradient_clip_val == 10_000  # SIFU_example.sh's --clip
    (metrics,) = glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)
    assert "unlearning/remaining_train_acc" not in open(metrics).readline()


@_NEED_REAL
def test_the_cache_rules_recipe_streams_fashion_mnist(tmp_path):
    """Fashion-MNIST as a stream source: 2 rounds of the cache-rule recipe (LeNet, B_s =
    150, B = 300, DRSR) fill every client's cache with its first 300 streamed samples."""
    from lightning_fl.cli import run

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "fashion_mnist" / "cache_rules.yaml"
    cli = run(["fit", "--config", str(recipe), "--trainer.max_epochs", "2",
               "--trainer.enable_progress_bar", "false", "--test_after_fit", "false",
               "--trainer.default_root_dir", str(tmp_path),
               "--trainer.logger.init_args.save_dir", str(tmp_path)])  # fmt: skip
    dm = cli.datamodule
    assert cli.trainer.current_epoch == 2
    assert [len(dm.client_dataset(c, "train")) for c in range(10)] == [300] * 10
    assert "streams/discrepancy" in cli.trainer.callback_metrics


@_NEED_REAL
def test_server_samples_are_held_out_before_the_split():
    """SAFARI's auxiliary set: 500 training images drawn before the split, so the clients
    hold the other 59,500 and every class's 6,000 images are counted once."""
    dm = FashionMnistDataModule(num_clients=10, partition="shards", shards_per_client=1,
                                server_samples=500, seed=0, image=False)  # fmt: skip
    x, y = dm.server_dataset().tensors
    assert x.shape == (500, 784) and sum(dm.sample_counts("train")) == 59500
    labels = torch.cat([y, *(dm.client_dataset(c, "train").tensors[1] for c in range(10))])
    assert torch.bincount(labels).tolist() == [6000] * 10
    assert len(set(y.tolist())) == 10
    with pytest.raises(ValueError, match="server_samples must be in"):
        FashionMnistDataModule(num_clients=10, server_samples=60000).setup()


@_NEED_REAL
def test_the_safari_recipe_runs_on_the_real_data(tmp_path):
    """2 rounds of SAFARI on Fashion-MNIST, vectorized with a round per Lightning step:
    the server's 1000 images are held out, 9 of 10 clients train (s = 4 never do)."""
    import csv
    import glob

    from lightning_fl.cli import run

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "fashion_mnist" / "safari.yaml"
    cli = run(["fit", "--config", str(recipe), "--trainer.max_epochs", "2",
               "--trainer.enable_progress_bar", "false", "--test_after_fit", "false",
               "--trainer.default_root_dir", str(tmp_path),
               "--trainer.logger.init_args.save_dir", str(tmp_path)])  # fmt: skip
    assert len(cli.datamodule.server_dataset()) == 1000
    assert sum(cli.datamodule.sample_counts("train")) == 59000
    (participation,) = glob.glob(str(tmp_path / "**" / "participation.csv"), recursive=True)
    clients = {int(r["client"]) for r in csv.DictReader(open(participation))}
    assert clients and clients <= {*range(6), -3}  # the 4 excluded never take part
    assert cli.trainer.global_step == 2  # a round per Lightning step


@_NEED_REAL
def test_train_and_test_samples_draw_distinct_real_images_before_the_split():
    """The free-rider authors' MNIST files on Fashion-MNIST: 5 clients × 600 training and
    300 test images, drawn without replacement from the IDX arrays (each row is a real
    image with its own label, none twice), another seed drawing others; a count larger
    than the data names both numbers."""
    x_train, y_train, x_test, y_test = read_fashion_mnist(DEBIAN_ROOT)

    def rows(images, labels):
        return {(bytes(i.tobytes()), int(y)) for i, y in zip(images, labels)}

    def drawn(dm, split):
        xs, ys = zip(*(dm.client_dataset(c, split).tensors for c in range(5)))
        x = (torch.cat(xs) * 255).round().to(torch.uint8).reshape(-1, 28, 28).numpy()
        return rows(x, torch.cat(ys).numpy())

    dm = FashionMnistDataModule(num_clients=5, partition="iid", train_samples=3000,
                                test_samples=1500, image=False, seed=0)  # fmt: skip
    assert dm.sample_counts("train") == [600] * 5 and dm.sample_counts("test") == [300] * 5
    train, test = drawn(dm, "train"), drawn(dm, "test")
    assert len(train) == 3000 and train <= rows(x_train, y_train)
    assert len(test) == 1500 and test <= rows(x_test, y_test)
    other = FashionMnistDataModule(num_clients=5, partition="iid", train_samples=3000,
                                   image=False, seed=1)  # fmt: skip
    assert drawn(other, "train") != train and sum(other.sample_counts("test")) == 10000
    with pytest.raises(
        ValueError, match="train_samples: asked for 60001 samples, but there are 60000"
    ):
        FashionMnistDataModule(num_clients=5, train_samples=60001).setup()


@_NEED_REAL
def test_the_free_rider_recipe_runs_on_the_real_data(tmp_path):
    """3 rounds of the free-rider recipe: 5 fair clients of 600 images, 5 disguised
    free-riders flagged by the detector, a round per Lightning step."""
    import csv
    import glob

    from lightning_fl.cli import run

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "fashion_mnist" / "free_riders.yaml"
    cli = run(["fit", "--config", str(recipe), "--trainer.max_epochs", "3",
               "--trainer.enable_progress_bar", "false", "--test_after_fit", "false",
               "--trainer.default_root_dir", str(tmp_path),
               "--trainer.logger.init_args.save_dir", str(tmp_path)])  # fmt: skip
    assert cli.datamodule.sample_counts("train") == [600] * 5
    assert cli.trainer.global_step == 3
    (metrics,) = glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)
    last = {k: v for r in csv.DictReader(open(metrics)) for k, v in r.items() if v}
    assert float(last["free_riders/detection_rate"]) == 1.0
    assert float(last["free_riders/false_alarm_rate"]) == 0.0


@_NEED_REAL
def test_clients_and_server_by_hand_under_the_sifu_split():
    """The server's images drawn first (``seed``), then ``train_samples`` of the rest
    (``seed``) and ``test_samples`` of the test set (``seed + 1``); the SIFU split of the
    training labels with ``seed``, of the test labels with ``seed + 1``; client c's
    validation share with ``seed + 41 c``; pixels / 255, then (x − mean) / std, the
    server's too."""
    from lightning_fl.datamodules.partition import random_subset, server_split, split_fractions

    seed, mean, std = 3, 0.3, 0.6
    dm = FashionMnistDataModule(num_clients=4, partition="sifu", samples_per_client=6,
                                server_samples=30, train_samples=500, test_samples=200,
                                val_fraction=0.5, normalize=(mean, std), seed=seed,
                                image=False, unseen_fraction=0.25)  # fmt: skip
    x_train, y_train, x_test, y_test = read_fashion_mnist(DEBIAN_ROOT)
    pixels = lambda images: (images.reshape(len(images), -1) / 255.0 - mean) / std  # noqa: E731
    held, kept = server_split(60000, 30, seed, "the training images")
    server_x, server_y = dm.server_dataset()[:]
    np.testing.assert_allclose(server_x.numpy(), pixels(x_train[held]), rtol=1e-5, atol=1e-6)
    assert server_y.tolist() == y_train[held].tolist()
    kept = kept[random_subset(len(kept), 500, seed, "train_samples")]
    tested = random_subset(10000, 200, seed + 1, "test_samples")
    x_train, y_train, x_test, y_test = x_train[kept], y_train[kept], x_test[tested], y_test[tested]
    train_parts = sifu_partition(y_train, 4, 6, seed)
    test_parts = sifu_partition(y_test, 4, 6, seed + 1)
    for c, (fit_idx, test_idx) in enumerate(zip(train_parts, test_parts)):
        fit, val = split_fractions(fit_idx, (0.5, 0.5), seed + 41 * c)
        for split, x, y, rows in (("train", x_train, y_train, fit), ("val", x_train, y_train, val),
                                  ("test", x_test, y_test, test_idx)):  # fmt: skip
            got_x, got_y = dm.client_dataset(c, split)[:]
            np.testing.assert_allclose(got_x.numpy(), pixels(x[rows]), rtol=1e-5, atol=1e-6)
            assert got_y.tolist() == y[rows].tolist()
    assert dm.unseen_clients == [3] and dm.hparams["samples_per_client"] == 6


@_NEED_REAL
def test_the_dirichlet_split_leaves_clients_empty_rather_than_redraw():
    """Fashion-MNIST's Dirichlet split takes no minimum size: at α = 0.05 over 30 clients
    some clients hold nothing, as ``label_partition`` draws it with ``min_size=0``."""
    from lightning_fl.datamodules.partition import label_partition, random_subset

    dm = FashionMnistDataModule(num_clients=30, partition="dirichlet", alpha=0.05,
                                train_samples=300, test_samples=100, seed=1)  # fmt: skip
    _, y_train, _, _ = read_fashion_mnist(DEBIAN_ROOT)
    y = y_train[random_subset(60000, 300, 1, "train_samples")]
    expected = [len(p) for p in label_partition(y, "dirichlet", 30, 1, 0.05, 0)]
    assert dm.sample_counts("train") == expected and 0 in expected


@_NEED_REAL
def test_download_copies_the_four_files_into_root(tmp_path, monkeypatch):
    from lightning_fl.datamodules import fashion_mnist

    monkeypatch.setattr(fashion_mnist, "URL", DEBIAN_ROOT.as_uri() + "/")
    with pytest.raises(FileNotFoundError, match="apt-get install"):
        FashionMnistDataModule(root=str(tmp_path)).prepare_data()
    FashionMnistDataModule(root=str(tmp_path), download=True).prepare_data()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)
    assert (
        read_fashion_mnist(str(tmp_path))[1].tolist() == read_fashion_mnist(DEBIAN_ROOT)[1].tolist()
    )
    monkeypatch.setattr(fashion_mnist, "DEBIAN_ROOT", tmp_path / "no-debian")
    monkeypatch.setattr(fashion_mnist, "CACHE", tmp_path / "cache")
    FashionMnistDataModule(download=True).prepare_data()  # no root: into the cache
    assert sorted(p.name for p in (tmp_path / "cache" / "fashion-mnist").iterdir()) == sorted(FILES)
    FashionMnistDataModule().prepare_data()  # found there next time, without download


def test_the_reader_checks_the_published_checksums_and_the_shapes(tmp_path):
    _fixture(tmp_path)
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz: its decompressed SHA-256"):
        read_fashion_mnist(tmp_path)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.arange(19) % 10)
    with pytest.raises(ValueError, match=r"t10k images of shape \(20, 28, 28\) for 19 labels"):
        read_fashion_mnist(tmp_path, check=False)
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
        FashionMnistDataModule(val_fraction=1.0)


def test_sifu_partition_draws_from_its_own_seeded_stream_by_hand():
    """Client i: ``samples_per_client`` draws with replacement from class (i mod C)'s
    indices, clients in turn, from ``default_rng([seed, 5])``, each sorted; the classes
    are the labels present (here 2, 5 and 7)."""
    labels = np.array([7, 2, 5, 5, 7, 2, 2, 7, 5, 5, 2, 7])
    rng = np.random.default_rng([4, 5])
    expected = [
        np.sort(rng.choice(np.flatnonzero(labels == c), 3, replace=True)) for c in (2, 5, 7, 2)
    ]
    got = sifu_partition(labels, 4, 3, seed=4)
    assert [p.tolist() for p in got] == [p.tolist() for p in expected]
