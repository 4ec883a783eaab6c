"""Large populations: generated LEAF-shaped federations in the on-disk format of
:mod:`.arrays` (LEAF's own JSON is converted by :mod:`.leaf_convert`).

LEAF's real files cannot be downloaded here, so populations of any size are generated
with the shapes LEAF reports (Caldas et al. 2018, Table 1): Sent140 has 660,120 users
with 2.42 ± 4.71 samples each, Reddit 1,660,820 users with 34.07 ± 62.95. Sample counts
are 1 + a negative binomial with that mean and variance (exact moments, heavy tail). The
samples are a learnable classification task in the manner of LEAF's Synthetic dataset:
every user has its own mixture of class templates, x = template[y] + noise.

:func:`write_leaf_population` writes the same populations as LEAF JSON, the input of
:func:`~.leaf_convert.convert_leaf`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import numpy as np

from lightning_fl.datamodules.arrays import (
    ArrayFederatedDataModule,
    ClientArrays,
    save_federation,
)

#: (users, mean samples, standard deviation) per user, LEAF's Table 1
SHAPES: dict[str, tuple[int, float, float]] = {
    "sent140": (660_120, 2.42, 4.71),
    "reddit": (1_660_820, 34.07, 62.95),
}
Shape = Literal["sent140", "reddit"]


def population_counts(num_clients: int, shape: Shape = "sent140", seed: int = 0) -> np.ndarray:
    """Samples per client: 1 + NegativeBinomial(r, q) with LEAF's mean μ and standard
    deviation σ of ``shape`` (r = (μ−1)²/(σ² − μ + 1), q = r/(r + μ − 1))."""
    _check_shape(shape)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}.")
    _, mean, std = SHAPES[shape]
    extra = mean - 1.0
    r = extra**2 / (std**2 - extra)
    rng = np.random.default_rng([seed, 0])
    return 1 + rng.negative_binomial(r, r / (r + extra), size=num_clients).astype(np.int64)


def generate_population(
    folder: str | os.PathLike,
    num_clients: int,
    shape: Shape = "sent140",
    features: int = 4,
    classes: int = 2,
    test_fraction: float = 0.2,
    noise: float = 1.0,
    seed: int = 0,
    val_fraction: float = 0.0,
) -> Path:
    """Write a generated population of ``num_clients`` to ``folder`` in the on-disk format.
    A client's rows are [train | val | test]: its last ⌊test_fraction · n⌋ samples (at
    least one when it has two or more) are its test set, the ⌊val_fraction · n⌋ before
    them (at least one when ``val_fraction`` > 0 and two are left) its validation set.
    Vectorized: about a second per million samples."""
    for name, value in (("test_fraction", test_fraction), ("val_fraction", val_fraction)):
        if not 0 <= value < 1:
            raise ValueError(f"{name} must be in [0, 1), got {value}.")
    counts = population_counts(num_clients, shape, seed)
    x, y = population_samples(counts, features, classes, noise, seed)
    test = _held_out(counts, test_fraction)
    val = _held_out(counts - test, val_fraction, of=counts)
    train = counts - test - val
    position = np.arange(len(y)) - np.repeat(np.cumsum(counts) - counts, counts)
    ends = {"train": train, "val": train + val, "test": counts}
    splits, begin = {}, np.zeros_like(counts)
    for split, end in ends.items():
        rows = (position >= np.repeat(begin, counts)) & (position < np.repeat(end, counts))
        if split == "train" or (end - begin).any():
            splits[split] = ClientArrays([x[rows], y[rows]], _offsets(end - begin))
        begin = end
    return save_federation(folder, splits)


def _held_out(available: np.ndarray, fraction: float, of: np.ndarray | None = None) -> np.ndarray:
    """⌊fraction · n⌋ of each client's n samples (``of``, default ``available``), at least
    one where at least two are ``available``; none for a fraction of 0."""
    if fraction == 0:
        return np.zeros_like(available)
    size = of if of is not None else available
    wanted = np.maximum(1, np.floor(fraction * size)).astype(np.int64)
    return np.where(available >= 2, np.minimum(wanted, available - 1), 0)


class GeneratedPopulationDataModule(ArrayFederatedDataModule):
    """A generated LEAF-shaped population (:func:`generate_population`), written once under
    ``root`` (``prepare_data``, or the first use) and read memory-mapped.

    Args:
        root: the folder of generated populations; this one is
            ``<root>/<shape>_<clients>_f<features>_c<classes>_s<seed>``.
        num_clients: N (Sent140: 660,120; Reddit: 1,660,820).
        shape: ``"sent140"`` or ``"reddit"``: the per-client sample counts of LEAF's
            Table 1.
        features, classes: the samples' size and number of classes.
        test_fraction, val_fraction: each client's held-out shares.
        seed: the population's (counts and samples).
    """

    def __init__(
        self,
        root: str = "data/populations",
        num_clients: int = SHAPES["sent140"][0],
        shape: Shape = "sent140",
        features: int = 4,
        classes: int = 2,
        test_fraction: float = 0.2,
        val_fraction: float = 0.0,
        seed: int = 0,
        unseen_fraction: float = 0.0,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
    ) -> None:
        name = f"{shape}_{num_clients}_f{features}_c{classes}_s{seed}"
        if val_fraction:
            name += f"_v{val_fraction:g}"
        if test_fraction != 0.2:
            name += f"_t{test_fraction:g}"
        self.folder = Path(root) / name
        self._population = dict(num_clients=num_clients, shape=shape, features=features,
                                classes=classes, test_fraction=test_fraction,
                                val_fraction=val_fraction, seed=seed)  # fmt: skip
        _check_shape(shape)  # before any data is read
        super().__init__(str(self.folder), None, unseen_fraction, batch_size, eval_batch_size)

    def prepare_data(self) -> None:
        """Generate the population unless its folder already holds it."""
        if not (self.folder / "federation.json").is_file():
            generate_population(self.folder, **self._population)

    @property
    def arrays(self) -> dict[str, ClientArrays]:
        if self._splits is None:
            self.prepare_data()
        return super().arrays


def population_samples(
    counts: np.ndarray, features: int, classes: int, noise: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Every client's samples, clients one after another: client c draws its labels from
    its own Dirichlet(0.5) class mixture and x = T[y] + noise·ε with shared class
    templates T ~ N(0, I)."""
    rng = np.random.default_rng([seed, 1])
    templates = rng.standard_normal((classes, features)).astype(np.float32)
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(counts)), counts)
    # a client's class mixture, drawn per sample by inverse CDF on its own cumulative row
    mixture = rng.dirichlet(np.full(classes, 0.5), size=len(counts)).cumsum(axis=1)
    u = rng.random(total)
    y = (u[:, None] > mixture[owner]).sum(axis=1).clip(max=classes - 1).astype(np.int64)
    x = templates[y] + noise * rng.standard_normal((total, features)).astype(np.float32)
    return x.astype(np.float32), y


def write_leaf_population(
    folder: str | os.PathLike,
    num_clients: int,
    shape: Shape = "sent140",
    features: int = 4,
    classes: int = 2,
    users_per_file: int = 100_000,
    seed: int = 0,
) -> list[Path]:
    """The same generated population as LEAF JSON files (``all_data_<k>.json``, at most
    ``users_per_file`` users each), written user by user: the input of
    :func:`~.leaf_convert.convert_leaf` and of ``lightning-fl data convert-leaf``."""
    counts = population_counts(num_clients, shape, seed)
    x, y = population_samples(counts, features, classes, 1.0, seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    starts = np.concatenate([[0], np.cumsum(counts)])
    paths = []
    for k, first in enumerate(range(0, num_clients, users_per_file)):
        users = range(first, min(first + users_per_file, num_clients))
        path = folder / f"all_data_{k}.json"
        with open(path, "w") as out:
            names = [f"f_{c:07d}" for c in users]
            out.write(f'{{"users": {json.dumps(names)}, ')
            out.write(f'"num_samples": {json.dumps(counts[first : users.stop].tolist())}, ')
            out.write('"user_data": {')
            for i, c in enumerate(users):
                rows = slice(starts[c], starts[c + 1])
                entry = {"x": np.round(x[rows], 6).tolist(), "y": y[rows].tolist()}
                out.write(("" if i == 0 else ", ") + f'"{names[i]}": {json.dumps(entry)}')
            out.write("}}")
        paths.append(path)
    return paths


def _check_shape(shape: str) -> None:
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}.")


def _offsets(sizes: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def shape_summary(counts: np.ndarray) -> str:
    """``users, samples, mean ± std`` of a population's counts (for the CLI)."""
    return (
        f"{len(counts):,} clients, {int(counts.sum()):,} samples, "
        f"{counts.mean():.2f} ± {counts.std():.2f} per client"
        f" (max {int(counts.max())}, {np.mean(counts == 1):.0%} with one)"
    )
