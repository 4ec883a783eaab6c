"""Datasets of the reference-data privacy experiments (WERM, Kaplan et al. PETS 2024):
Purchase100 and Texas100 in the files Shokri et al. published, and a CPU variant on the
embedded digits. Every client's data is split into training, reference, validation and
test (non-member) parts; the reference data stays with the clients or goes to the server.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, TensorDataset

from lightning_fl.datamodules.digits import load_digits
from lightning_fl.datamodules.download import download
from lightning_fl.datamodules.partition import (
    check_label_partition,
    label_partition,
    split_fractions,
)
from lightning_fl.datamodules.reference import WERMDataset
from lightning_fl.engine.data_contract import FederatedDataModule, Split
from lightning_fl.engine.traits import Trait

#: Shokri et al.'s published archives (privacytrustlab/datasets). No checksum is published:
#: pass ``sha256`` to pin the copy you verified.
PURCHASE_URL = "https://github.com/privacytrustlab/datasets/raw/master/dataset_purchase.tgz"
TEXAS_URL = "https://github.com/privacytrustlab/datasets/raw/master/dataset_texas.tgz"
ReferenceHolder = Literal["client", "server", "none"]


def _parse_rows(path: Path, expected_columns: int | None, what: str) -> np.ndarray:
    rows = []
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                values = [int(float(v)) for v in line.split(",")]
            except ValueError as err:
                raise ValueError(
                    f"{path}, line {number}: {what} must be comma-separated numbers ({err})."
                ) from err
            if expected_columns is not None and len(values) != expected_columns:
                raise ValueError(
                    f"{path}, line {number}: expected {expected_columns} comma-separated values "
                    f"({what}), got {len(values)}. The file is truncated or not the published one."
                )
            rows.append(values)
    if not rows:
        raise ValueError(f"{path} holds no rows of {what}.")
    return np.asarray(rows, dtype=np.int64)


def _check_labels(labels: np.ndarray, path: Path) -> np.ndarray:
    if labels.min() < 1 or labels.max() > 100:
        raise ValueError(f"{path}: labels must be 1..100, got {labels.min()}..{labels.max()}.")
    return labels - 1


def load_purchase100(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """``dataset_purchase``: one line per customer, ``label,f_1,...,f_600`` with labels
    1..100 and binary features. Returns float32 features and labels 0..99."""
    path = Path(path)
    table = _parse_rows(path, 601, "label and 600 features")
    features = table[:, 1:]
    if not np.isin(features, (0, 1)).all():
        raise ValueError(f"{path}: Purchase100 features must be 0 or 1.")
    return features.astype(np.float32), _check_labels(table[:, 0], path)


def load_texas100(root: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """``texas/100/feats`` (6,169 binary features per line) and ``texas/100/labels`` (one
    label 1..100 per line). Returns float32 features and labels 0..99."""
    root = Path(root)
    feats_path, labels_path = root / "texas" / "100" / "feats", root / "texas" / "100" / "labels"
    for path in (feats_path, labels_path):
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: extract dataset_texas.tgz into {root}.")
    features = _parse_rows(feats_path, 6169, "6169 features")
    labels = _parse_rows(labels_path, 1, "one label")[:, 0]
    if len(labels) != len(features):
        raise ValueError(
            f"{labels_path} has {len(labels)} labels for {len(features)} rows of {feats_path}."
        )
    return features.astype(np.float32), _check_labels(labels, labels_path)


def _extract(archive: Path, root: Path) -> None:
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")


class ReferenceDataModule(FederatedDataModule):
    """Clients with training, reference, validation and test data (one client = the
    centralized setting of the paper).

    Args:
        split: fractions of each client's samples for (train, reference, val, test). The
            test part is the non-member data of the membership-inference evaluation.
        reference: ``"client"``: each client keeps its reference part and trains with
            WERM batch pairs; ``"server"``: the reference parts are pooled at the server
            (:meth:`server_reference`, for :class:`~lightning_fl.callbacks.ServerReference`);
            ``"none"``: plain training data, the reference parts are only evaluated.
        partition: ``"iid"`` or ``"dirichlet"`` (label skew ``alpha``) over clients.
    """

    traits = {Trait.HAS_NO_SERVER_DATA: ""}

    def __init__(
        self,
        features: np.ndarray | None = None,
        labels: np.ndarray | None = None,
        num_clients: int = 1,
        partition: Literal["iid", "dirichlet"] = "iid",
        alpha: float = 0.5,
        split: tuple[float, float, float, float] = (0.4, 0.3, 0.0, 0.3),
        reference: ReferenceHolder = "client",
        seed: int = 0,
        batch_size: int = 64,
        eval_batch_size: int | None = 512,
    ) -> None:
        super().__init__(batch_size, eval_batch_size)
        if reference not in ("client", "server", "none"):
            raise ValueError(f"reference must be 'client', 'server' or 'none', got {reference!r}.")
        if len(split) != 4:
            raise ValueError(f"split gives (train, reference, val, test) fractions, got {split}.")
        check_label_partition(partition)
        self.reference = reference
        self._table = None if features is None else (features, labels)
        self._partition = (num_clients, partition, alpha, tuple(split), seed)
        self._parts: list[dict[str, TensorDataset]] | None = None

    def read_table(self) -> tuple[np.ndarray, np.ndarray]:
        """The features and labels: those given; a subclass reads or generates them."""
        if self._table is None:
            raise NotImplementedError(
                f"{type(self).__name__}: pass features and labels, or override read_table()."
            )
        return self._table

    def setup(self, stage: str | None = None) -> None:
        """Read the table and split it over the clients (once)."""
        self._clients  # noqa: B018 - reads it

    @property
    def _clients(self) -> list[dict[str, TensorDataset]]:
        if self._parts is None:
            self._parts = self._split(*self.read_table())
        return self._parts

    def _split(self, features: np.ndarray, labels: np.ndarray) -> list[dict[str, TensorDataset]]:
        """Partition the samples over the clients and each client's share into (train,
        reference, val, test)."""
        num_clients, partition, alpha, split, seed = self._partition
        parts = label_partition(labels, partition, num_clients, seed, alpha)
        x, y = torch.from_numpy(np.ascontiguousarray(features)), torch.from_numpy(labels)
        clients = []
        for c, idx in enumerate(parts):
            pieces = split_fractions(idx, split, seed + 7919 * (c + 1))
            names = ("train", "reference", "val", "test")
            clients.append(
                {
                    n: TensorDataset(x[torch.from_numpy(p)], y[torch.from_numpy(p)])
                    for n, p in zip(names, pieces)
                }
            )
        return clients

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    def client_dataset(self, client: int, split: Split) -> Dataset | None:
        self.check_owned(client)
        data = self._clients[client]
        if split == "train" and self.reference == "client" and len(data["reference"]):
            return WERMDataset(data["train"], data["reference"])
        if split == "reference" and self.reference == "server":
            return None  # it is at the server
        dataset = data[split]
        return dataset if len(dataset) else None

    def server_reference(self) -> Dataset:
        """All clients' reference parts, held by the server (``reference="server"``)."""
        if self.reference != "server":
            raise ValueError("server_reference() needs reference='server' in the datamodule.")
        return ConcatDataset([d["reference"] for d in self._clients if len(d["reference"])])

    def server_nonmembers(self) -> Dataset:
        """The pooled test parts: non-members for the attack on the server's reference data."""
        return ConcatDataset([d["test"] for d in self._clients if len(d["test"])])


class Purchase100DataModule(ReferenceDataModule):
    """Purchase100 (Shokri et al., S&P 2017): 197,324 customers, 600 binary features, 100
    classes. ``root`` holds ``dataset_purchase`` (downloaded from Shokri et al.'s archive
    with ``download=True``)."""

    def __init__(
        self,
        root: str = "data/purchase100",
        download: bool = False,
        sha256: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.root, self.download, self.sha256 = Path(root), download, sha256

    def prepare_data(self) -> None:
        """Download and extract the archive when ``dataset_purchase`` is missing
        (``download=True``)."""
        path = self.root / "dataset_purchase"
        if not path.exists():
            if not self.download:
                raise FileNotFoundError(
                    f"{path} is missing: pass download=True or copy dataset_purchase there."
                )
            _extract(_fetch(PURCHASE_URL, self.root, self.sha256), self.root)

    def read_table(self) -> tuple[np.ndarray, np.ndarray]:
        self.prepare_data()
        return load_purchase100(self.root / "dataset_purchase")


class Texas100DataModule(ReferenceDataModule):
    """Texas100 (Shokri et al., S&P 2017): 67,330 hospital discharge records, 6,169 binary
    features, 100 procedure classes. ``root`` holds ``texas/100/{feats,labels}``
    (downloaded from Shokri et al.'s archive with ``download=True``)."""

    def __init__(
        self,
        root: str = "data/texas100",
        download: bool = False,
        sha256: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.root, self.download, self.sha256 = Path(root), download, sha256

    def prepare_data(self) -> None:
        """Download and extract the archive when the files are missing (``download=True``)."""
        if not (self.root / "texas" / "100" / "feats").exists() and self.download:
            _extract(_fetch(TEXAS_URL, self.root, self.sha256), self.root)

    def read_table(self) -> tuple[np.ndarray, np.ndarray]:
        self.prepare_data()
        return load_texas100(str(self.root))


class DigitsReferenceDataModule(ReferenceDataModule):
    """The CPU variant: the embedded digits (1,797 samples, 64 features, 10 classes)."""

    def read_table(self) -> tuple[np.ndarray, np.ndarray]:
        return load_digits()


def generate_purchase_like(
    num_samples: int = 6000,
    num_features: int = 600,
    num_classes: int = 100,
    flip_probability: float = 0.4,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """A Purchase100-like table: one random binary prototype per class (Purchase100's
    classes are clusters of binary purchase vectors), every sample its class prototype
    with each bit flipped with ``flip_probability``. Small and noisy enough that an MLP
    memorizes its training data (membership inference well above chance)."""
    if not 0.0 <= flip_probability <= 0.5:
        raise ValueError(f"flip_probability must be in [0, 0.5], got {flip_probability}.")
    rng = np.random.default_rng(seed)
    prototypes = rng.integers(0, 2, size=(num_classes, num_features))
    labels = rng.integers(0, num_classes, size=num_samples)
    flips = rng.random((num_samples, num_features)) < flip_probability
    features = np.where(flips, 1 - prototypes[labels], prototypes[labels])
    return features.astype(np.float32), labels.astype(np.int64)


class SyntheticPurchaseDataModule(ReferenceDataModule):
    """The generated CPU variant of Purchase100 (:func:`generate_purchase_like`)."""

    def __init__(
        self,
        num_samples: int = 6000,
        num_features: int = 600,
        num_classes: int = 100,
        flip_probability: float = 0.4,
        data_seed: int = 0,
        **kwargs,
    ) -> None:
        if not 0.0 <= flip_probability <= 0.5:
            raise ValueError(f"flip_probability must be in [0, 0.5], got {flip_probability}.")
        super().__init__(**kwargs)
        self._generate = (num_samples, num_features, num_classes, flip_probability, data_seed)

    def read_table(self) -> tuple[np.ndarray, np.ndarray]:
        return generate_purchase_like(*self._generate)


def _fetch(url: str, root: Path, sha256: str | None) -> Path:
    return download(url, root / url.rsplit("/", 1)[-1], sha256)
