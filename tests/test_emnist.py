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
