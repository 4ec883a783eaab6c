"""LEAF's JSON converted once, streaming, into the on-disk format of :mod:`.arrays`.

LEAF's files (``{"users", "num_samples", "user_data"}``, Caldas et al. 2018) are read user
by user (:func:`iter_leaf_users`: a JSON reader that holds one user's samples at a time,
never a whole file), encoded as :class:`~lightning_fl.datamodules.LeafDataModule` encodes
them (:class:`LeafEncoding`), and written as a federation folder: the training files'
users are the clients, in file order; a test file's users are matched to them by name.

    lightning-fl data convert-leaf data/femnist/train --test data/femnist/test \
        --dataset femnist --out data/femnist_fed

The arrays of the converted splits are built in memory (their size, not the JSON's, which
is several times larger) and saved once.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from lightning_fl.datamodules.arrays import ClientArrays, FederationFormatError, save_federation
from lightning_fl.datamodules.leaf import (
    FEMNIST_PIXELS,
    SHAKESPEARE_LETTERS,
    LeafName,
    _sent140_words,
)

#: The LEAF datasets the converter encodes (CelebA's images are files, read by LeafDataModule)
DATASETS = ("synthetic", "femnist", "shakespeare", "sent140")


class LeafEncoding:
    """One LEAF dataset's samples as arrays, as :class:`LeafDataModule` encodes them:
    Synthetic's x as float32 rows; FEMNIST's as float32 1×28×28 images; Shakespeare's
    characters (x and y) as their index in LEAF's 80 letters (0 when absent); Sent140's
    tweet (``x[4]``) as the indices of its first ``max_words`` words in ``vocabulary``
    (0 pads, unknown words get len(vocabulary) + 1); labels as int64."""

    def __init__(
        self, dataset: LeafName, vocabulary: dict[str, int] | None = None, max_words: int = 25
    ) -> None:
        if dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}; got {dataset!r}.")
        if dataset == "sent140" and vocabulary is None:
            raise ValueError("Sent140 needs the training words' vocabulary.")
        self.dataset, self.vocabulary, self.max_words = dataset, vocabulary, max_words

    def x(self, xs: list, path: Path, user: str) -> np.ndarray:
        try:
            if self.dataset == "shakespeare":
                return np.array([[max(SHAKESPEARE_LETTERS.find(c), 0) for c in x] for x in xs],
                                dtype=np.int64).reshape(len(xs), -1)  # fmt: skip
            if self.dataset == "sent140":
                return np.array([self._words(x[4]) for x in xs], dtype=np.int64).reshape(
                    len(xs), self.max_words
                )
            x = np.asarray(xs, dtype=np.float32).reshape(len(xs), -1)
        except (TypeError, ValueError, IndexError) as err:
            raise FederationFormatError(
                f"{path}: user {user!r}'s samples are not {self.dataset} samples of one size "
                f"({err}); pass the dataset they are (--dataset)."
            ) from err
        if self.dataset == "femnist":
            if x.shape[1] != FEMNIST_PIXELS:
                raise FederationFormatError(
                    f"{path}: user {user!r} has FEMNIST images of {x.shape[1]} pixels; "
                    f"expected 28x28 = {FEMNIST_PIXELS}."
                )
            return x.reshape(len(xs), 1, 28, 28)
        return x

    def y(self, ys: list, path: Path, user: str) -> np.ndarray:
        try:
            if self.dataset == "shakespeare":
                return np.array([max(SHAKESPEARE_LETTERS.find(y), 0) for y in ys], dtype=np.int64)
            return np.array([int(y) for y in ys], dtype=np.int64)
        except (TypeError, ValueError) as err:
            raise FederationFormatError(
                f"{path}: user {user!r}'s labels are not {self.dataset} labels ({err})."
            ) from err

    def _words(self, text: str) -> list[int]:
        unknown = len(self.vocabulary) + 1
        ids = [self.vocabulary.get(w, unknown) for w in _sent140_words(text)]
        return (ids + [0] * self.max_words)[: self.max_words]


def sent140_vocabulary(files: Sequence[Path]) -> dict[str, int]:
    """The training words of Sent140 files (their tweets, ``x[4]``), sorted, numbered from
    1 (0 pads), read user by user: LeafDataModule's vocabulary."""
    words: Counter = Counter()
    for path in files:
        for _, xs, _ in iter_leaf_users(path):
            words.update(w for x in xs for w in _sent140_words(x[4]))
    return {w: i + 1 for i, w in enumerate(sorted(words))}


def convert_leaf(
    train: Sequence[str | os.PathLike],
    folder: str | os.PathLike,
    test: Sequence[str | os.PathLike] | None = None,
    dataset: LeafName = "synthetic",
    max_words: int = 25,
) -> Path:
    """LEAF JSON files (or folders of them, their ``*.json`` in sorted order) converted into
    a federation folder: the ``train`` files' users are the clients (a user split over
    consecutive files is joined); the ``test`` files' users are matched to them by name
    (a test user without training data is refused, naming it). Sent140's vocabulary (its
    training words) is written beside, ``vocabulary.txt``, one word a line from index 1."""
    files = _json_files(train)
    vocabulary = sent140_vocabulary(files) if dataset == "sent140" else None
    encoding = LeafEncoding(dataset, vocabulary, max_words)
    names, parts = _read_users(files, encoding)
    if not names:
        raise FederationFormatError(f"{files[0]}: no users. Nothing to convert.")
    splits = {"train": ClientArrays.from_clients(parts)}
    if test:
        by_name = dict(zip(*_read_users(_json_files(test), encoding)))
        known = set(names)
        strangers = [u for u in by_name if u not in known]
        if strangers:
            raise FederationFormatError(
                f"test user {strangers[0]!r} has no training data: give the training files "
                "of the same LEAF split (train/ and test/ of one preprocess.sh run)."
            )
        empty = _empty_like(parts[0])
        splits["test"] = ClientArrays.from_clients([by_name.get(u, empty) for u in names])
    folder = save_federation(folder, splits, client_names=names)
    if vocabulary is not None:
        (folder / "vocabulary.txt").write_text("".join(f"{w}\n" for w in vocabulary))
    return folder


def _read_users(
    files: list[Path], encoding: LeafEncoding
) -> tuple[list[str], list[tuple[np.ndarray, np.ndarray]]]:
    """Every user of ``files`` in order with its encoded (x, y); a user whose samples
    continue in the next file is joined, one that comes back later is refused."""
    names: list[str] = []
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    seen: set[str] = set()
    for path in files:
        for user, xs, ys in iter_leaf_users(path):
            x, y = encoding.x(xs, path, user), encoding.y(ys, path, user)
            if parts and x.shape[1:] != parts[0][0].shape[1:]:
                raise FederationFormatError(
                    f"{path}: user {user!r} has samples of shape {x.shape[1:]}, the first "
                    f"user {parts[0][0].shape[1:]}: every sample needs the same size."
                )
            if names and names[-1] == user:
                parts[-1] = (np.concatenate([parts[-1][0], x]), np.concatenate([parts[-1][1], y]))
                continue
            if user in seen:
                raise FederationFormatError(
                    f"{path}: user {user!r} appears again after other users; LEAF's files "
                    "list each user once per split: check the files given."
                )
            seen.add(user)
            names.append(user)
            parts.append((x, y))
    return names, parts


def _empty_like(part: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    x, y = part
    return np.zeros((0, *x.shape[1:]), x.dtype), np.zeros(0, y.dtype)


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
