"""CIFAR-10 and CIFAR-100 from the official python pickle batches (Krizhevsky 2009).

The batches are read with a restricted unpickler that builds only dicts, lists, strings,
numbers and numpy arrays: any other object in a file is refused, so a data file can never
run code.
"""

from __future__ import annotations

import io
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from lightning_fl.datamodules.download import download, require_download_root, verify
from lightning_fl.datamodules.in_memory import InMemoryFederatedDataModule
from lightning_fl.datamodules.partition import (
    dirichlet_partition,
    grouped_dirichlet_partition,
    iid_partition,
    pachinko_partition,
    shard_partition,
    split_fractions,
    unbalanced_dirichlet_partition,
)
from lightning_fl.engine.data_contract import arguments

CACHE = Path.home() / ".cache" / "lightning_fl"


@dataclass(frozen=True)
class CifarSpec:
    url: str
    archive_md5: str
    folder: str
    train: tuple[tuple[str, str], ...]
    test: tuple[tuple[str, str], ...]
    label_key: bytes
    coarse_key: bytes | None = None


CIFAR = {
    "cifar10": CifarSpec(
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        archive_md5="c58f30108f718f92721af3b95e74349a",
        folder="cifar-10-batches-py",
        train=(
            ("data_batch_1", "c99cafc152244af753f735de768cd75f"),
            ("data_batch_2", "d4bba439e000b95fd0a9bffe97cbabec"),
            ("data_batch_3", "54ebc095f3ab1f0389bbae665268c751"),
            ("data_batch_4", "634d18415352ddfa80567beed471001a"),
            ("data_batch_5", "482c414d41f54cd18b22e5b47cb7c3cb"),
        ),
        test=(("test_batch", "40351d587109b95175f43aff81a1287e"),),
        label_key=b"labels",
    ),
    "cifar100": CifarSpec(
        url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        archive_md5="eb9058c3a382ffc7106e4002c42a8d85",
        folder="cifar-100-python",
        train=(("train", "16019d7e3df5f24257cddd939b257f8d"),),
        test=(("test", "f0ef6b0ae62326f3e7ffdfab6717acfc"),),
        label_key=b"fine_labels",
        coarse_key=b"coarse_labels",
    ),
}

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
}


class _ArraysOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def load_pickle_batch(path: str | Path) -> dict:
    """One CIFAR batch file: a dict of numpy arrays and lists, read with bytes keys."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            batch = _ArraysOnlyUnpickler(io.BytesIO(handle.read()), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise ValueError(
            f"{path}: not a valid CIFAR pickle batch ({err}). Only dicts of arrays and "
            "lists are accepted; delete the file and download it again."
        ) from err
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: expected a dict, got {type(batch).__name__}.")
    return batch


def read_cifar(
    root: str | Path, spec: CifarSpec, split: str, check: bool = True
) -> dict[str, np.ndarray]:
    """Images (n, 3, 32, 32) uint8, labels (n,) int64 and, for CIFAR-100, coarse labels."""
    folder = Path(root) / spec.folder
    images, labels, coarse = [], [], []
    for name, md5 in spec.train if split == "train" else spec.test:
        path = folder / name
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is missing. Pass root= the folder holding {spec.folder}/, or "
                "download=True to fetch it from the official source."
            )
        if check:
            verify(path, md5, "md5")
        batch = load_pickle_batch(path)
        for key in (b"data", spec.label_key, *([spec.coarse_key] if spec.coarse_key else [])):
            if key not in batch:
                raise ValueError(f"{path}: missing key {key.decode()!r}.")
        data = np.asarray(batch[b"data"])
        if data.ndim != 2 or data.shape[1] != 3072:
            raise ValueError(
                f"{path}: images must be rows of 3072 = 3x32x32 bytes, got {data.shape}."
            )
        if len(batch[spec.label_key]) != len(data):
            raise ValueError(f"{path}: {len(data)} images but {len(batch[spec.label_key])} labels.")
        images.append(data.reshape(-1, 3, 32, 32).astype(np.uint8))
        labels.append(np.asarray(batch[spec.label_key], dtype=np.int64))
        if spec.coarse_key:
            coarse.append(np.asarray(batch[spec.coarse_key], dtype=np.int64))
    out = {"images": np.concatenate(images), "labels": np.concatenate(labels)}
    if coarse:
        out["coarse"] = np.concatenate(coarse)
    return out


def fetch_cifar(root: str | Path, spec: CifarSpec) -> None:
    """Download the official archive (md5-checked) and extract it under ``root``."""
    root = Path(root)
    archive = download(spec.url, root / Path(spec.url).name, spec.archive_md5, "md5")
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(root, filter="data")


def write_synthetic_cifar(
    root: str | Path, spec: CifarSpec, train_per_file: int, test_size: int, seed: int = 0
) -> None:
    """Write small CIFAR-like batches in the official pickle format under ``root``.

    Images are a fixed random template per class plus noise, so a small model can learn
    them; CIFAR-100 files carry fine and coarse labels (coarse = fine // 5). Used by the
    ``small`` recipes and the tests: the real reader reads them.
    """
    rng = np.random.default_rng(seed)
    num_classes = 100 if spec.coarse_key else 10
    templates = rng.integers(0, 256, size=(num_classes, 3072))
    folder = Path(root) / spec.folder
    folder.mkdir(parents=True, exist_ok=True)
    files = [(name, train_per_file) for name, _ in spec.train] + [(spec.test[0][0], test_size)]
    for name, size in files:
        labels = rng.integers(0, num_classes, size=size)
        noise = rng.normal(0, 40, size=(size, 3072))
        data = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
        batch = {b"batch_label": name.encode(), b"data": data, spec.label_key: labels.tolist(),
                 b"filenames": [f"{i}.png".encode() for i in range(size)]}  # fmt: skip
        if spec.coarse_key:
            batch[spec.coarse_key] = (labels // 5).tolist()
        with open(folder / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=2)


class CifarDataModule(InMemoryFederatedDataModule):
    """CIFAR-10/100 split over clients.

    Args:
        dataset: ``"cifar10"`` or ``"cifar100"``.
        partition: ``"dirichlet"`` (per label, ``alpha``; with ``num_groups`` set, FedEM's
            grouped-label variant), ``"shards"`` (pathological, ``shards_per_client``),
            ``"pachinko"`` (CIFAR-100, ``alpha`` over coarse and ``beta`` over fine labels,
            ``samples_per_client``), ``"iid"`` or ``"unbalanced"`` (the clustered-sampling
            paper's split: 10/30/30/20/10% of the clients with 100/250/500/750/1000
            training samples drawn with replacement from Dir(``alpha``) class
            proportions, a fifth as many test samples with the same proportions).
        unseen_fraction: the last ``round(unseen_fraction · num_clients)`` clients never
            train; personalization evaluates them apart.
        val_fraction: each client's training samples held out for validation.
        generate: write small synthetic batches in the official format to ``root`` when it
            holds no data (CPU-sized ``small`` recipes; sizes from ``generate_sizes``:
            training images per file and test images). Checksums are then not checked.

    Each client's test set is a share of the official test set split the same way.
    """

    def __init__(
        self,
        dataset: Literal["cifar10", "cifar100"] = "cifar10",
        root: str | None = None,
        download: bool = False,
        num_clients: int = 200,
        partition: Literal["dirichlet", "shards", "pachinko", "iid", "unbalanced"] = "dirichlet",
        alpha: float = 0.3,
        beta: float = 10.0,
        num_groups: int | None = None,
        shards_per_client: int = 2,
        samples_per_client: int = 250,
        unseen_fraction: float = 0.0,
        val_fraction: float = 0.0,
        seed: int = 0,
        check_md5: bool = True,
        generate: bool = False,
        generate_sizes: tuple[int, int] = (1000, 1000),
        batch_size: int = 32,
        eval_batch_size: int | None = 256,
    ) -> None:
        self._args = arguments(locals())
        if dataset not in CIFAR:
            raise ValueError(f"dataset must be cifar10 or cifar100, got {dataset!r}.")
        partitions = ("dirichlet", "shards", "pachinko", "iid", "unbalanced")
        if partition not in partitions:
            raise ValueError(
                f"Unknown partition {partition!r}; use dirichlet, shards, pachinko or iid."
            )
        if partition == "pachinko" and dataset != "cifar100":
            raise ValueError("The pachinko partition needs CIFAR-100's coarse labels.")
        self.root = Path(root) if root else CACHE / dataset
        super().__init__(None, batch_size, eval_batch_size)
        self.hold_out(unseen_fraction)
        self.save_hyperparameters()

    def prepare_data(self) -> None:
        """Write the generated files (``generate=True``) or download the archive
        (``download=True``) when they are missing."""
        h, spec = self._args, CIFAR[self._args.dataset]
        if h.generate:
            if not (self.root / spec.folder).exists():
                write_synthetic_cifar(self.root, spec, *h.generate_sizes, seed=h.seed)
        elif h.download and not (self.root / spec.folder).exists():
            require_download_root(h.root)
            fetch_cifar(self.root, spec)

    def read_clients(self):
        """Read the batches and partition the training and test images over the clients
        (each client's test share split the same way as its training share)."""
        self.prepare_data()  # a no-op when the files are there
        h, spec = self._args, CIFAR[self._args.dataset]
        seed, num_clients, partition, alpha = h.seed, h.num_clients, h.partition, h.alpha
        samples_per_client, val_fraction = h.samples_per_client, h.val_fraction
        check_md5 = h.check_md5 and not h.generate
        train = read_cifar(self.root, spec, "train", check_md5)
        test = read_cifar(self.root, spec, "test", check_md5)

        def split(data: dict[str, np.ndarray], part_seed: int, per_client: int) -> list[np.ndarray]:
            y = data["labels"]
            if partition == "dirichlet" and h.num_groups:
                return grouped_dirichlet_partition(y, num_clients, alpha, h.num_groups, part_seed)
            if partition == "dirichlet":
                return dirichlet_partition(y, num_clients, alpha, part_seed)
            if partition == "shards":
                return shard_partition(y, num_clients, h.shards_per_client, part_seed)
            if partition == "pachinko":
                if "coarse" not in data:
                    raise ValueError("The pachinko partition needs CIFAR-100's coarse labels.")
                return pachinko_partition(
                    data["coarse"], y, num_clients, per_client, alpha, h.beta, part_seed
                )
            if partition == "iid":
                return iid_partition(y, num_clients, part_seed)
            raise ValueError(
                f"Unknown partition {partition!r}; use dirichlet, shards, pachinko or iid."
            )

        test_per_client = max(1, len(test["labels"]) * samples_per_client // len(train["labels"]))
        if partition == "unbalanced":
            train_parts, test_parts = unbalanced_dirichlet_partition(
                train["labels"], test["labels"], num_clients, alpha, seed
            )
        else:
            train_parts = split(train, seed, samples_per_client)
            test_parts = split(test, seed + 1, test_per_client)
        to_tensor = lambda d, idx: (  # noqa: E731
            torch.from_numpy(d["images"][idx]).float().div_(255.0),
            torch.from_numpy(d["labels"][idx]),
        )
        clients = []
        for c, (tr, te) in enumerate(zip(train_parts, test_parts)):
            fit_idx, val_idx = split_fractions(tr, (1 - val_fraction, val_fraction), seed + 31 * c)
            clients.append({"train": to_tensor(train, fit_idx), "val": to_tensor(train, val_idx),
                            "test": to_tensor(test, te)})  # fmt: skip
        return clients, None
