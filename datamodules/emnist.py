"""EMNIST (Cohen et al. 2017) in NIST's IDX files, split over clients as in FedEM's EMNIST
experiment (Marfoq thesis §3.5.6: 10% of the data, Dirichlet(0.4) over labels, 100
clients, the CNN of Reddi et al.)."""

from __future__ import annotations

import gzip
import os
import struct
import zipfile
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from lightning_fl.datamodules.download import download, require_download_root
from lightning_fl.datamodules.in_memory import InMemoryFederatedDataModule
from lightning_fl.datamodules.partition import (
    check_label_partition,
    label_partition,
    split_fractions,
)
from lightning_fl.engine.data_contract import arguments

EMNIST_URL = "https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip"
EMNIST_MD5 = "58c8d27c78d21e728a6bc7b3cc06412e"  # the value torchvision checks
CACHE = Path.home() / ".cache" / "lightning_fl"
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX array (LeCun's MNIST format, gzip or not): a 0x0000 magic, a type byte, the
    number of dimensions, big-endian sizes, then the data."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4].hex()}).")
    ndim = raw[3]
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    dtype = np.dtype(_DTYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    body = raw[4 + 4 * ndim :]
    if len(body) != expected:
        raise ValueError(
            f"{path}: the header promises shape {shape} ({expected} bytes) but the file holds "
            f"{len(body)}: it is truncated or corrupt."
        )
    return np.frombuffer(body, dtype=dtype).reshape(shape)


def read_emnist(folder: str | os.PathLike, split: str = "byclass") -> tuple[np.ndarray, np.ndarray]:
    """Train and test images of ``split`` together, upright (NIST stores them transposed),
    as uint8 [N, 28, 28], and int64 labels."""
    folder = Path(folder)
    images, labels = [], []
    for part in ("train", "test"):
        x = read_idx(folder / f"emnist-{split}-{part}-images-idx3-ubyte.gz")
        y = read_idx(folder / f"emnist-{split}-{part}-labels-idx1-ubyte.gz")
        if len(x) != len(y):
            raise ValueError(f"{folder}: {len(x)} {part} images but {len(y)} labels.")
        images.append(x.transpose(0, 2, 1))
        labels.append(y.astype(np.int64))
    return np.concatenate(images), np.concatenate(labels)


class EmnistDataModule(InMemoryFederatedDataModule):
    """EMNIST split over clients.

    Args:
        root: the folder holding NIST's ``gzip/`` folder (downloaded and extracted there
            with ``download=True``).
        split: EMNIST split (``byclass``: 62 classes).
        data_fraction: the fraction of all samples kept (FedEM: 0.1), drawn from ``seed``.
        partition: ``"dirichlet"`` over labels (``alpha``), ``"iid"``, ``"shards"``
            (``shards_per_client`` label-sorted shards each, McMahan et al. 2017) or
            ``"one_class"``: :func:`~lightning_fl.datamodules.partition.label_partition`.
        test_fraction, val_fraction: each client's held-out parts (of its samples, and of
            the rest).
        unseen_fraction: the last clients held out as unseen.
    """

    def __init__(
        self,
        root: str | None = None,
        download: bool = False,
        split: str = "byclass",
        data_fraction: float = 0.1,
        num_clients: int = 100,
        partition: Literal["dirichlet", "iid", "shards", "one_class"] = "dirichlet",
        alpha: float = 0.4,
        shards_per_client: int = 2,
        test_fraction: float = 0.2,
        val_fraction: float = 0.0,
        unseen_fraction: float = 0.0,
        seed: int = 0,
        batch_size: int = 128,
        eval_batch_size: int | None = 512,
    ) -> None:
        self._args = arguments(locals())
        if not 0 < data_fraction <= 1:
            raise ValueError(f"data_fraction must be in (0, 1], got {data_fraction}.")
        check_label_partition(partition)
        super().__init__(None, batch_size, eval_batch_size)
        self.hold_out(unseen_fraction)
        self.save_hyperparameters()

    def prepare_data(self) -> None:
        """Download and extract NIST's archive when it is missing (``download=True``)."""
        self._folder(fetch=self._args.download)

    def _folder(self, fetch: bool) -> Path:
        base = Path(self._args.root) if self._args.root else CACHE / "emnist"
        folder = base / "gzip"
        if not folder.exists():
            if not fetch:
                raise FileNotFoundError(
                    f"{folder} is missing: pass download=True or extract NIST's gzip.zip "
                    f"into {base}."
                )
            require_download_root(self._args.root)
            archive = download(EMNIST_URL, base / "gzip.zip", EMNIST_MD5, algorithm="md5")
            with zipfile.ZipFile(archive) as zipped:
                zipped.extractall(base)
        return folder

    def read_clients(self):
        """Read the split, keep ``data_fraction`` of it and partition it over the clients."""
        h = self._args
        seed, test_fraction, val_fraction = h.seed, h.test_fraction, h.val_fraction
        images, labels = read_emnist(self._folder(fetch=h.download), h.split)
        rng = np.random.default_rng(seed)
        keep = np.sort(rng.permutation(len(labels))[: max(1, round(h.data_fraction * len(labels)))])
        images, labels = images[keep], labels[keep]
        parts = label_partition(
            labels, h.partition, h.num_clients, seed, h.alpha,
            shards_per_client=h.shards_per_client,
        )  # fmt: skip
        x = torch.from_numpy(images.copy()).float().div_(255.0).unsqueeze(1)
        y = torch.from_numpy(labels)
        clients = []
        for c, idx in enumerate(parts):
            rest, test = split_fractions(idx, (1 - test_fraction, test_fraction), seed + 31 * c)
            fit, val = split_fractions(rest, (1 - val_fraction, val_fraction), seed + 37 * c)
            parts_c = {"train": fit, "val": val, "test": test}
            clients.append(
                {k: (x[torch.from_numpy(p)], y[torch.from_numpy(p)]) for k, p in parts_c.items()}
            )
        return clients, None
