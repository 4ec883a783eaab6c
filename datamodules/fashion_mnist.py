"""Fashion-MNIST (Xiao, Rasul, Vollgraf 2017; MIT licence) in its four official IDX files,
split over clients: iid, McMahan shards, Dirichlet over labels, one class per client, or
the SIFU protocol (Fraboni thesis §5.5, Tab. D.1: client i holds ``samples_per_client``
samples of class i mod 10 drawn with replacement), with the unlearning watermark.

The files are read from ``root``, else from Debian's package ``dataset-fashion-mnist``
(``/usr/share/datasets/fashion-mnist``), else downloaded from the official address into
the cache with ``download=True``. Every file is checked against the SHA-256 of its
decompressed IDX bytes, so a gzip recompressed by a distribution still verifies.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from lightning_fl.datamodules.digits import watermarked
from lightning_fl.datamodules.emnist import CACHE, read_idx
from lightning_fl.datamodules.in_memory import InMemoryFederatedDataModule
from lightning_fl.datamodules.partition import (
    label_partition,
    random_subset,
    server_split,
    split_fractions,
)
from lightning_fl.engine.data_contract import arguments

DEBIAN_ROOT = Path("/usr/share/datasets/fashion-mnist")
URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
#: SHA-256 of each decompressed IDX file (60,000 + 10,000 images of 28×28, uint8 labels)
FILES = {
    "train-images-idx3-ubyte.gz": (
        "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"
    ),
    "train-labels-idx1-ubyte.gz": (
        "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"
    ),
    "t10k-images-idx3-ubyte.gz": (
        "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"
    ),
    "t10k-labels-idx1-ubyte.gz": (
        "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"
    ),
}
MISSING = (
    "Fashion-MNIST's IDX files are not in {where}: install them with `apt-get install "
    "dataset-fashion-mnist`, or point --data.init_args.root at a folder holding {files}, "
    "or pass --data.init_args.download true."
)

Partition = Literal["iid", "shards", "dirichlet", "one_class", "sifu"]


def fashion_mnist_folder(root: str | os.PathLike | None, download: bool) -> Path:
    """The folder of the four files: ``root``, Debian's, or the cache (downloaded)."""
    candidates = [Path(root)] if root else [DEBIAN_ROOT, CACHE / "fashion-mnist"]
    for folder in candidates:
        if all((folder / name).exists() for name in FILES):
            return folder
    if not download:
        where = " or ".join(str(c) for c in candidates)
        raise FileNotFoundError(MISSING.format(where=where, files=", ".join(FILES)))
    from lightning_fl.datamodules.download import download as fetch
    from lightning_fl.datamodules.download import require_download_root

    require_download_root(root)
    folder = Path(root) if root else CACHE / "fashion-mnist"
    for name in FILES:
        fetch(URL + name, folder / name, None)  # checked decompressed, below
    return folder


def verify_idx(path: Path, expected: str) -> None:
    """Raise a ValueError naming ``path`` unless its decompressed bytes hash to ``expected``."""
    with gzip.open(path, "rb") as handle:
        actual = hashlib.sha256(handle.read()).hexdigest()
    if actual != expected:
        raise ValueError(
            f"{path}: its decompressed SHA-256 is {actual}, not the published data's "
            f"{expected}: the file is corrupt or another dataset; reinstall it."
        )


def read_fashion_mnist(
    folder: str | os.PathLike, check: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels): uint8 [N, 28, 28] and
    int64 [N], exactly the IDX files' arrays."""
    folder = Path(folder)
    if check:
        for name, digest in FILES.items():
            verify_idx(folder / name, digest)
    arrays = [read_idx(folder / name) for name in FILES]
    x_train, y_train, x_test, y_test = arrays
    for x, y, part in ((x_train, y_train, "train"), (x_test, y_test, "t10k")):
        if x.ndim != 3 or x.shape[1:] != (28, 28) or len(x) != len(y):
            raise ValueError(
                f"{folder}: {part} images of shape {x.shape} for {len(y)} labels; expected "
                "[N, 28, 28] images and N labels."
            )
    return x_train, y_train.astype(np.int64), x_test, y_test.astype(np.int64)


def sifu_partition(
    labels: np.ndarray, num_clients: int, samples_per_client: int, seed: int
) -> list[np.ndarray]:
    """Client i: ``samples_per_client`` samples of class i mod C drawn with replacement
    (Fraboni thesis §5.5, Tab. D.1: M = 100 clients of 100 samples from one class)."""
    classes = np.unique(labels)
    rng = np.random.default_rng([seed, 5])
    pools = {int(c): np.flatnonzero(labels == c) for c in classes}
    return [
        np.sort(rng.choice(pools[int(classes[i % len(classes)])], samples_per_client, True))
        for i in range(num_clients)
    ]


class FashionMnistDataModule(InMemoryFederatedDataModule):
    """Fashion-MNIST over ``num_clients`` clients. Training and validation data come from
    the official training set (``val_fraction`` of each client's samples held out), test
    data from the official test set, split the same way (the same partition with the same
    seed, so a client's test labels follow its training labels; ``sifu`` draws each
    client's ``samples_per_client`` test samples of its class).

    Args:
        root: the folder of the four IDX files (default: Debian's, then the cache).
        download: fetch the files from the official address when missing.
        partition: ``"iid"``, ``"shards"`` (``shards_per_client`` label-sorted shards,
            McMahan et al. 2017), ``"dirichlet"`` (``alpha``), ``"one_class"`` (client i
            holds class i mod 10, the class's samples shared) or ``"sifu"``.
        samples_per_client: the SIFU protocol's n_i (100).
        watermark: if > 0, that many fixed pixels of every sample of client i set to 1
            (positions seeded 42 + i mod 10: the thesis's §5.5.3 check).
        image: 1×28×28 images (default) or 784 features.
        server_samples: training images drawn at random (seeded) before the split among
            clients, as the server's own training data (``server_dataset``: SAFARI's
            auxiliary set, i.i.d. from the global distribution, disjoint from the clients').
        normalize: (mean, std) applied to the pixels in [0, 1] after the watermark, as
            torchvision's ``Normalize``; the SIFU authors' code uses (0.5, 0.5). None:
            pixels stay in [0, 1].
        train_samples, test_samples: if set, only that many training (after the server's
            draw) and test images, drawn at random (seeded) before the split among
            clients: the free-rider authors' MNIST files hold 5 clients × 600 training and
            300 test images (Fraboni et al. AISTATS 2021, §6; their ``mnist_iid.py``).
    """

    def __init__(
        self,
        root: str | None = None,
        download: bool = False,
        num_clients: int = 100,
        partition: Partition = "iid",
        alpha: float = 0.5,
        shards_per_client: int = 2,
        samples_per_client: int = 100,
        val_fraction: float = 0.0,
        watermark: int = 0,
        image: bool = True,
        normalize: tuple[float, float] | None = None,
        server_samples: int = 0,
        train_samples: int | None = None,
        test_samples: int | None = None,
        unseen_fraction: float = 0.0,
        seed: int = 0,
        batch_size: int = 20,
        eval_batch_size: int | None = 1000,
    ) -> None:
        self._args = arguments(locals())
        if partition not in ("iid", "shards", "dirichlet", "one_class", "sifu"):
            raise ValueError(
                f"partition must be iid, shards, dirichlet, one_class or sifu; got {partition!r}."
            )
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}.")
        if watermark < 0:
            raise ValueError(f"watermark must be >= 0 pixels, got {watermark}.")
        if normalize is not None and (len(normalize) != 2 or not normalize[1] > 0):
            raise ValueError(
                f"normalize must be (mean, std) with std > 0, got {normalize!r}; "
                "for example [0.5, 0.5]."
            )
        super().__init__(None, batch_size, eval_batch_size)
        self.hold_out(unseen_fraction)
        self.save_hyperparameters()

    def prepare_data(self) -> None:
        """Find the IDX files, or download them (``download=True``)."""
        fashion_mnist_folder(self._args.root, self._args.download)

    def read_clients(self):
        """Read the IDX files, draw the server's and the subsets' samples, partition the
        rest over the clients (train and test apart) and watermark and scale them."""
        h = self._args
        seed, num_clients, partition, image = h.seed, h.num_clients, h.partition, h.image
        normalize, watermark, val_fraction = h.normalize, h.watermark, h.val_fraction
        folder = fashion_mnist_folder(h.root, h.download)
        x_train, y_train, x_test, y_test = read_fashion_mnist(folder)
        held, kept = server_split(len(y_train), h.server_samples, seed, "the training images")
        server_images, server_labels = x_train[held], y_train[held]
        kept = kept[random_subset(len(kept), h.train_samples, seed, "train_samples")]
        if len(kept) < len(y_train):  # otherwise every index: no copy of the 47 MB array
            x_train, y_train = x_train[kept], y_train[kept]
        if h.test_samples is not None:
            tested = random_subset(len(y_test), h.test_samples, seed + 1, "test_samples")
            x_test, y_test = x_test[tested], y_test[tested]

        def parts(labels: np.ndarray, offset: int) -> list[np.ndarray]:
            if partition == "sifu":
                return sifu_partition(labels, num_clients, h.samples_per_client, seed + offset)
            return label_partition(labels, partition, num_clients, seed, h.alpha, 0,
                                   h.shards_per_client)  # fmt: skip

        def tensors(images: np.ndarray) -> torch.Tensor:
            x = torch.from_numpy(images.astype(np.float32) / 255.0)
            return x.unsqueeze(1) if image else x.reshape(len(x), -1)

        def scaled(x: torch.Tensor) -> torch.Tensor:
            return x if normalize is None else (x - normalize[0]) / normalize[1]

        server = None
        if h.server_samples:
            server = (scaled(tensors(server_images)), torch.from_numpy(server_labels))
        xs, ys = tensors(x_train), torch.from_numpy(y_train)
        xt, yt = tensors(x_test), torch.from_numpy(y_test)
        clients = []
        for c, (fit_idx, test_idx) in enumerate(zip(parts(y_train, 0), parts(y_test, 1))):
            fit, val = split_fractions(fit_idx, (1 - val_fraction, val_fraction), seed + 41 * c)
            client = {
                "train": (xs[torch.from_numpy(fit)], ys[torch.from_numpy(fit)]),
                "val": (xs[torch.from_numpy(val)], ys[torch.from_numpy(val)]),
                "test": (xt[torch.from_numpy(test_idx)], yt[torch.from_numpy(test_idx)]),
            }
            if watermark:
                client = {
                    k: (watermarked(x, c, watermark, 1.0) if len(x) else x, y)
                    for k, (x, y) in client.items()
                }
            clients.append({k: (scaled(x), y) for k, (x, y) in client.items()})
        return clients, server
