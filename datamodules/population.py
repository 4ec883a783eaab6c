"""Large populations: generated LEAF-shaped federations, and LEAF's JSON converted once,
streaming, into the on-disk format of :mod:`.arrays`.

LEAF's real files cannot be downloaded here, so populations of any size are generated
with the shapes LEAF reports (Caldas et al. 2018, Table 1): Sent140 has 660,120 users
with 2.42 ± 4.71 samples each, Reddit 1,660,820 users with 34.07 ± 62.95. Sample counts
are 1 + a negative binomial with that mean and variance (exact moments, heavy tail). The
samples are a learnable classification task in the manner of LEAF's Synthetic dataset:
every user has its own mixture of class templates, x = template[y] + noise.

:func:`convert_leaf` reads LEAF JSON files (``{"users", "num_samples", "user_data"}``)
user by user, never the whole file, and writes :func:`~.arrays.save_federation`'s folder.
Numeric ``x`` (LEAF's Synthetic, FEMNIST's pixel lists, generated populations) is stored
as float32 rows; ``y`` as int64.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np

from lightning_fl.datamodules.arrays import (
    ArrayFederatedDataModule,
    ClientArrays,
    FederationFormatError,
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
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}.")
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
        population_counts(1, shape)  # the shape is checked here, before any data is read
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
    :func:`convert_leaf` and of ``lightning-fl data convert-leaf``."""
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


def convert_leaf(
    sources: list[str | os.PathLike], folder: str | os.PathLike, split: str = "train"
) -> Path:
    """LEAF JSON files (or folders of them, their ``*.json`` in sorted order) converted into
    a federation folder with one split ``split``, streaming: one user's samples in memory
    at a time. A user that appears in several files gets its samples concatenated only
    when its files are consecutive; otherwise the second appearance is refused."""
    files = _json_files(sources)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    writer = _ColumnWriter(folder, split)
    names: list[str] = []
    seen: set[str] = set()
    for path in files:
        for user, xs, ys in iter_leaf_users(path):
            if names and names[-1] == user:
                writer.extend_last(xs, ys, path, user)
                continue
            if user in seen:
                raise FederationFormatError(
                    f"{path}: user {user!r} appears again after other users; LEAF's files "
                    "list each user once per split: check the files given."
                )
            seen.add(user)
            names.append(user)
            writer.add(xs, ys, path, user)
    if not names:
        raise FederationFormatError(f"{files[0]}: no users. Nothing to convert.")
    arrays = writer.finish()
    return save_federation(folder, {split: arrays}, client_names=names)


def iter_leaf_users(path: str | os.PathLike) -> Iterator[tuple[str, list, list]]:
    """``(user, x, y)`` of every user of one LEAF JSON file, in the order of its
    ``user_data``, read incrementally; each is checked against ``users`` and
    ``num_samples`` (which LEAF writes before ``user_data``)."""
    path = Path(path)
    reader = _JsonStream(path)
    reader.expect("{")
    declared: dict[str, int] | None = None
    users: list | None = None
    counts: list | None = None
    found = 0
    while True:
        key = reader.value()
        reader.expect(":")
        if key != "user_data":
            value = reader.value()
            users = value if key == "users" else users
            counts = value if key == "num_samples" else counts
        else:
            if users is None or counts is None:
                raise FederationFormatError(
                    f"{path}: 'user_data' comes before 'users' and 'num_samples'; this "
                    "reader needs LEAF's order (users, num_samples, user_data)."
                )
            if len(users) != len(counts):
                raise FederationFormatError(
                    f"{path}: {len(users)} users but {len(counts)} num_samples entries."
                )
            declared = dict(zip(users, counts))
            for user, xs, ys in _user_entries(reader, path, declared):
                found += 1
                yield user, xs, ys
        if reader.peek() == "}":
            break
        reader.expect(",")
    if declared is None:
        raise FederationFormatError(f"{path}: missing key 'user_data' of LEAF's format.")
    if found != len(declared):
        raise FederationFormatError(
            f"{path}: 'users' lists {len(declared)} users but 'user_data' holds {found}."
        )


def _user_entries(
    reader: _JsonStream, path: Path, declared: dict[str, int]
) -> Iterator[tuple[str, list, list]]:
    """The entries of ``user_data`` (``{user: {"x", "y"}, ...}``), one at a time, each
    checked against its declared number of samples."""
    reader.expect("{")
    first = True
    while reader.peek() != "}":
        if not first:
            reader.expect(",")
        first = False
        user = reader.value()
        reader.expect(":")
        entry = reader.value()
        if user not in declared:
            raise FederationFormatError(f"{path}: user {user!r} is not in 'users'.")
        if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
            raise FederationFormatError(f"{path}: user {user!r} has no x and y.")
        if not len(entry["x"]) == len(entry["y"]) == declared[user]:
            raise FederationFormatError(
                f"{path}: user {user!r} has num_samples {declared[user]} but "
                f"{len(entry['x'])} x and {len(entry['y'])} y."
            )
        yield user, entry["x"], entry["y"]
    reader.expect("}")


class _JsonStream:
    """Values of a JSON document read from a file in pieces (``json``'s ``raw_decode``
    on a buffer that grows only until the next value is complete)."""

    CHUNK = 1 << 20

    def __init__(self, path: Path) -> None:
        self.path, self.handle = path, open(path, encoding="utf-8")  # noqa: SIM115
        self.buffer, self.position, self.eof = "", 0, False
        self.decoder = json.JSONDecoder()

    def _fill(self) -> bool:
        chunk = self.handle.read(self.CHUNK)
        if not chunk:
            self.eof = True
            self.handle.close()
            return False
        self.buffer = self.buffer[self.position :] + chunk
        self.position = 0
        return True

    def peek(self) -> str:
        while True:
            while self.position < len(self.buffer) and self.buffer[self.position].isspace():
                self.position += 1
            if self.position < len(self.buffer):
                return self.buffer[self.position]
            if not self._fill():
                raise FederationFormatError(
                    f"{self.path}: ends early (truncated JSON). Produce the file again."
                )

    def expect(self, char: str) -> None:
        found = self.peek()
        if found != char:
            raise FederationFormatError(
                f"{self.path}: expected {char!r} at character {self.position} of a piece, "
                f"found {found!r}: not LEAF's JSON layout."
            )
        self.position += 1

    def value(self):
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.position)
            except json.JSONDecodeError as err:
                if not self.eof and self._fill():
                    continue
                raise FederationFormatError(
                    f"{self.path}: invalid or truncated JSON ({err.msg}). Produce the file again."
                ) from err
            if end == len(self.buffer) and not self.eof and self._fill():
                continue  # a number may go on in the next piece
            self.position = end
            return value


class _ColumnWriter:
    """Rows appended client by client to two growing files, then saved as ``.npy``."""

    def __init__(self, folder: Path, split: str) -> None:
        self.folder, self.split = folder, split
        self.x_parts: list[np.ndarray] = []
        self.y_parts: list[np.ndarray] = []
        self.sizes: list[int] = []

    def _arrays(self, xs: list, ys: list, path: Path, user: str) -> tuple[np.ndarray, ...]:
        try:
            x = np.asarray(xs, dtype=np.float32)
            y = np.asarray(ys, dtype=np.int64)
        except (TypeError, ValueError) as err:
            raise FederationFormatError(
                f"{path}: user {user!r}'s x or y is not numeric ({err}); convert_leaf "
                "stores numeric samples (LEAF's Synthetic, FEMNIST): read text datasets "
                "with LeafDataModule."
            ) from err
        x = x.reshape(len(ys), -1) if len(ys) else x.reshape(0, self._width())
        if self.x_parts and x.shape[1:] != self.x_parts[0].shape[1:]:
            raise FederationFormatError(
                f"{path}: user {user!r} has samples of {x.shape[1:]} values, the first "
                f"user {self.x_parts[0].shape[1:]}: every sample needs the same size."
            )
        return x, y

    def _width(self) -> int:
        return self.x_parts[0].shape[1] if self.x_parts else 0

    def add(self, xs: list, ys: list, path: Path, user: str) -> None:
        x, y = self._arrays(xs, ys, path, user)
        self.x_parts.append(x)
        self.y_parts.append(y)
        self.sizes.append(len(y))

    def extend_last(self, xs: list, ys: list, path: Path, user: str) -> None:
        x, y = self._arrays(xs, ys, path, user)
        self.x_parts.append(x)
        self.y_parts.append(y)
        self.sizes[-1] += len(y)

    def finish(self) -> ClientArrays:
        x = np.concatenate(self.x_parts) if self.x_parts else np.zeros((0, 0), np.float32)
        return ClientArrays([x, np.concatenate(self.y_parts)], _offsets(np.asarray(self.sizes)))


def _json_files(sources: list[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for source in map(Path, sources):
        if source.is_dir():
            found = sorted(source.glob("*.json"))
            if not found:
                raise FileNotFoundError(f"{source}: no LEAF .json files.")
            files += found
        elif source.is_file():
            files.append(source)
        else:
            raise FileNotFoundError(f"{source}: no such file or folder.")
    return files


def _offsets(sizes: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def shape_summary(counts: np.ndarray) -> str:
    """``users, samples, mean ± std`` of a population's counts (for the CLI)."""
    return (
        f"{len(counts):,} clients, {int(counts.sum()):,} samples, "
        f"{counts.mean():.2f} ± {counts.std():.2f} per client"
        f" (max {int(counts.max())}, {math.fsum(counts == 1) / len(counts):.0%} with one)"
    )
