"""EMNIST's IDX files: the reader, the transposition to upright images, bad files."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from lightning_fl.datamodules import EmnistDataModule, read_idx


def _write_idx(path, array: np.ndarray, type_byte: int = 0x08) -> None:
    header = bytes([0, 0, type_byte, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.astype(">u1" if type_byte == 0x08 else array.dtype).tobytes())


def _fixture(folder, n_train=300, n_test=100, classes=62, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    written = []
    for part, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, classes, n, dtype=np.uint8)
        _write_idx(folder / f"emnist-byclass-{part}-images-idx3-ubyte.gz", images)
        _write_idx(folder / f"emnist-byclass-{part}-labels-idx1-ubyte.gz", labels)
        written.append(images)
    return written


def test_idx_reader_and_upright_images(tmp_path):
    train_images, test_images = _fixture(tmp_path / "gzip")
    stored_path = tmp_path / "gzip" / "emnist-byclass-test-images-idx3-ubyte.gz"
    assert np.array_equal(read_idx(stored_path), test_images)
    dm = EmnistDataModule(root=str(tmp_path), data_fraction=1.0, num_clients=5, partition="iid",
                          test_fraction=0.2, seed=0)  # fmt: skip
    total = sum(len(dm.client_dataset(c, s)) for c in range(5) for s in ("train", "test"))
    assert total == 400
    x, _ = dm.client_dataset(0, "train")[0]
    assert tuple(x.shape) == (1, 28, 28) and float(x.max()) <= 1.0
    # every image is the transpose of NIST's stored one (NIST stores them transposed)
    stored = np.concatenate([train_images, test_images])
    upright = {im.T.tobytes() for im in stored}
    as_stored = {im.tobytes() for im in stored}
    served = [
        (dm.client_dataset(c, s)[i][0][0].numpy() * 255).round().astype(np.uint8).tobytes()
        for c in range(5) for s in ("train", "test") for i in range(len(dm.client_dataset(c, s)))
    ]  # fmt: skip
    assert all(b in upright for b in served)
    assert not any(b in as_stored for b in served)


def test_fraction_and_dirichlet_split(tmp_path):
    _fixture(tmp_path / "gzip")
    dm = EmnistDataModule(root=str(tmp_path), data_fraction=0.5, num_clients=4, alpha=0.4, seed=1)
    assert sum(dm.sample_counts("train")) + sum(dm.sample_counts("test")) == 200


def test_bad_idx_files_are_refused(tmp_path):
    bad = tmp_path / "bad.gz"
    with gzip.open(bad, "wb") as handle:
        handle.write(b"\x12\x34\x08\x01\x00\x00\x00\x02ab")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(bad)
    with gzip.open(bad, "wb") as handle:
        handle.write(bytes([0, 0, 8, 1]) + struct.pack(">I", 5) + b"abc")
    with pytest.raises(ValueError, match="truncated"):
        read_idx(bad)
    with pytest.raises(FileNotFoundError, match="download=True"):
        EmnistDataModule(root=str(tmp_path / "nothing")).setup()


def test_clients_by_hand(tmp_path):
    """The kept samples are the first ``round(f N)`` of ``default_rng(seed).permutation(N)``,
    sorted; they are partitioned with ``seed``, and client c's test share is split off with
    ``seed + 31 c``, its validation share from the rest with ``seed + 37 c``."""
    from lightning_fl.datamodules.emnist import read_emnist
    from lightning_fl.datamodules.partition import label_partition, split_fractions

    _fixture(tmp_path / "gzip")
    seed, n = 3, 4
    dm = EmnistDataModule(root=str(tmp_path), data_fraction=0.4, num_clients=n, alpha=0.5,
                          test_fraction=0.25, val_fraction=0.3, unseen_fraction=0.25,
                          seed=seed)  # fmt: skip
    images, labels = read_emnist(str(tmp_path / "gzip"))
    keep = np.sort(np.random.default_rng(seed).permutation(400)[:160])
    parts = label_partition(labels[keep], "dirichlet", n, seed, 0.5)
    for c, idx in enumerate(parts):
        rest, test = split_fractions(idx, (0.75, 0.25), seed + 31 * c)
        fit, val = split_fractions(rest, (0.7, 0.3), seed + 37 * c)
        for split, rows in (("train", fit), ("val", val), ("test", test)):
            assert dm.client_dataset(c, split)[:][1].tolist() == labels[keep][rows].tolist()
    assert dm.unseen_clients == [3] and dm.hparams["alpha"] == 0.5
    tiny = EmnistDataModule(root=str(tmp_path), data_fraction=1e-3, num_clients=1, partition="iid")
    assert tiny.sample_counts("train") == [1]  # round(0.4) = 0 samples, kept at 1


def test_options_are_checked_at_construction():
    with pytest.raises(ValueError, match=r"data_fraction must be in \(0, 1\]"):
        EmnistDataModule(data_fraction=1.5)
    with pytest.raises(ValueError, match="Unknown partition 'pachinko'"):
        EmnistDataModule(partition="pachinko")


def test_download_extracts_nists_archive_once(tmp_path, monkeypatch):
    """``prepare_data`` with ``download=True`` fetches the md5-checked ``gzip.zip`` into
    ``root`` and extracts it; without ``download`` it says where the files should be (the
    user cache when no root is given)."""
    import hashlib
    import zipfile

    from lightning_fl.datamodules import emnist

    _fixture(tmp_path / "source" / "gzip")
    archive = tmp_path / "gzip.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for f in sorted((tmp_path / "source" / "gzip").iterdir()):
            zipped.write(f, f"gzip/{f.name}")
    monkeypatch.setattr(emnist, "EMNIST_URL", archive.as_uri())
    monkeypatch.setattr(emnist, "EMNIST_MD5", hashlib.md5(archive.read_bytes()).hexdigest())
    monkeypatch.setattr(emnist, "CACHE", tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'cache' / 'emnist' / 'gzip'} is"):
        EmnistDataModule().prepare_data()
    (tmp_path / "root").mkdir()  # a root= the user names must exist (issue 68)
    dm = EmnistDataModule(root=str(tmp_path / "root"), download=True, data_fraction=1.0,
                          num_clients=2, partition="iid")  # fmt: skip
    dm.prepare_data()
    assert (tmp_path / "root" / "gzip" / "emnist-byclass-train-images-idx3-ubyte.gz").exists()
    archive.unlink()
    assert sum(dm.sample_counts("train")) + sum(dm.sample_counts("test")) == 400


def test_idx_reader_reads_plain_files_wide_types_and_checks_each_magic_byte(tmp_path):
    plain = tmp_path / "plain-idx"
    values = np.array([[-2, 300], [7, -32768]], dtype=">i2")
    plain.write_bytes(bytes([0, 0, 0x0B, 2]) + struct.pack(">2I", 2, 2) + values.tobytes())
    assert read_idx(str(plain)).tolist() == values.tolist()
    plain.write_bytes(bytes([0, 0, 0x0B, 1]) + struct.pack(">I", 3) + values.tobytes()[:5])
    with pytest.raises(ValueError, match=r"shape \(3,\) \(6 bytes\) but the file holds 5"):
        read_idx(plain)
    for content in (b"\x01\x00\x08\x01", b"\x00\x01\x08\x01", b"\x00\x00\x07\x01", b""):
        plain.write_bytes(content + struct.pack(">I", 1) + b"a" if content else b"\x00\x00\x08")
        with pytest.raises(ValueError, match="not an IDX file"):
            read_idx(plain)
    plain.write_bytes(b"\x00\x00\x08\x00")  # no sizes, no data: a 0-d array missing its byte
    with pytest.raises(ValueError, match=r"shape \(\) \(1 bytes\) but the file holds 0"):
        read_idx(plain)


def test_shards_split_by_hand_and_every_partition_is_offered_to_the_cli(tmp_path):
    """``partition="shards"`` gives each client its ``shards_per_client`` label-sorted
    shards (``shard_partition`` of the kept labels, by hand); the type the CLI reads lists
    every partition the constructor accepts."""
    import typing

    from lightning_fl.datamodules.partition import LABEL_PARTITIONS, shard_partition

    train, test = _fixture(tmp_path / "gzip")
    dm = EmnistDataModule(root=str(tmp_path), data_fraction=1.0, num_clients=4,
                          partition="shards", shards_per_client=3, seed=2)  # fmt: skip
    labels = np.concatenate([
        read_idx(tmp_path / "gzip" / f"emnist-byclass-{part}-labels-idx1-ubyte.gz")
        for part in ("train", "test")
    ]).astype(np.int64)  # fmt: skip
    parts = shard_partition(labels, 4, 3, 2)
    two = shard_partition(labels, 4, 2, 2)  # the default would give other clients
    assert not all(np.array_equal(np.sort(a), np.sort(b)) for a, b in zip(parts, two))
    for client, indices in enumerate(parts):
        held = [dm.client_dataset(client, split) for split in ("train", "test")]
        served = [int(data[i][1]) for data in held for i in range(len(data))]
        assert sorted(served) == sorted(labels[indices].tolist())
    hints = typing.get_type_hints(EmnistDataModule.__init__)
    assert set(typing.get_args(hints["partition"])) == set(LABEL_PARTITIONS)
