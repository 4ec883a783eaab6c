"""The embedded default dataset: scikit-learn's copy of the UCI optical digits test set.

1,797 grayscale 8×8 images (features 0..16), 10 classes. License CC BY 4.0 (Alpaydin &
Kaynak, UCI Machine Learning Repository). The file ships with the package: no download.
"""

from __future__ import annotations

import gzip
from importlib import resources
from typing import Literal

import numpy as np
import torch

from lightning_fl.datamodules.in_memory import InMemoryFederatedDataModule
from lightning_fl.datamodules.partition import (
    check_label_partition,
    label_partition,
    server_split,
    split_fractions,
)
from lightning_fl.engine.data_contract import arguments

DIGITS_FILE = "digits.csv.gz"


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """Features as float32 in [0, 1] of shape (1797, 64) and int64 labels."""
    raw = resources.files("lightning_fl.datamodules").joinpath("data", DIGITS_FILE).read_bytes()
    table = np.loadtxt(gzip.decompress(raw).decode().splitlines(), delimiter=",")
    if table.shape != (1797, 65):
        raise ValueError(f"{DIGITS_FILE}: expected 1797 rows of 65 columns, got {table.shape}.")
    return (table[:, :64] / 16.0).astype(np.float32), table[:, 64].astype(np.int64)


class DigitsDataModule(InMemoryFederatedDataModule):
    """Digits split over ``num_clients`` clients, each with its own train/val/test parts.

    Args:
        partition: ``"dirichlet"`` (label skew with ``alpha``), ``"iid"``, ``"shards"``
            (``shards_per_client`` label shards per client) or ``"one_class"`` (client i
            holds digit i mod 10).
        split: fractions of each client's samples for train, val and test.
        image: yield 1×8×8 images instead of 64 features.
        unseen_fraction: the last ``round(unseen_fraction · num_clients)`` clients are held
            out of training and evaluated apart.
        server_samples: samples drawn at random (seeded) from all the digits, before the
            split among clients, as the server's own training data (``server_dataset``,
            SAFARI's auxiliary set: i.i.d. from the global distribution, disjoint from the
            clients' data).
        watermark: if > 0, that many fixed pixels of every sample of client i are set to
            the maximum value, positions drawn with seed 42 + (i mod 10) (the unlearning
            verification of the Fraboni thesis §5.5.3).
    """

    def __init__(
        self,
        num_clients: int = 20,
        partition: Literal["dirichlet", "iid", "shards", "one_class"] = "dirichlet",
        alpha: float = 0.5,
        shards_per_client: int = 2,
        min_size: int = 10,
        split: tuple[float, float, float] = (0.6, 0.2, 0.2),
        image: bool = False,
        unseen_fraction: float = 0.0,
        seed: int = 0,
        batch_size: int = 16,
        eval_batch_size: int | None = 256,
        server_samples: int = 0,
        watermark: int = 0,
    ) -> None:
        self._args = arguments(locals())
        if watermark < 0:
            raise ValueError(f"watermark must be >= 0 pixels, got {watermark}.")
        check_label_partition(partition)
        super().__init__(None, batch_size, eval_batch_size)
        self.hold_out(unseen_fraction)
        self.save_hyperparameters()

    def read_clients(self):
        """Load the digits, draw the server's samples, partition the rest over the clients
        and split each client's part into train, val and test."""
        h = self._args
        image, seed, watermark = h.image, h.seed, h.watermark
        x, y = load_digits()
        held, kept = server_split(len(y), h.server_samples, seed, "the digits")
        server = None
        if h.server_samples:
            server_x = torch.from_numpy(x[held])
            server = (server_x.view(-1, 1, 8, 8) if image else server_x, torch.from_numpy(y[held]))
        x, y = x[kept], y[kept]
        parts = label_partition(
            y, h.partition, h.num_clients, seed, h.alpha, h.min_size, h.shards_per_client
        )
        features = torch.from_numpy(x)
        if image:
            features = features.view(-1, 1, 8, 8)
        labels = torch.from_numpy(y)
        clients = []
        top = float(features.max())
        for c, idx in enumerate(parts):
            pieces = split_fractions(idx, tuple(h.split), seed + 7919 * (c + 1))
            client = {
                name: (features[torch.from_numpy(p)], labels[torch.from_numpy(p)])
                for name, p in zip(("train", "val", "test"), pieces)
            }
            if watermark:
                client = {
                    k: (watermarked(x_part, c, watermark, top), y_part)
                    for k, (x_part, y_part) in client.items()
                }
            clients.append(client)
        return clients, server


def watermarked(features: torch.Tensor, client: int, pixels: int, value: float) -> torch.Tensor:
    """``features`` with ``pixels`` fixed pixels set to ``value`` (the data's maximum) in
    every sample: client i's positions are drawn with seed 42 + (i mod 10), the watermark
    of the unlearning verification (Fraboni thesis §5.5.3; the authors' code)."""
    flat = features.reshape(len(features), -1).clone()
    if pixels > flat.shape[1]:
        raise ValueError(f"watermark of {pixels} pixels on samples of {flat.shape[1]}.")
    positions = np.random.default_rng(42 + client % 10).choice(flat.shape[1], pixels, False)
    flat[:, torch.from_numpy(positions)] = value
    return flat.view_as(features)
