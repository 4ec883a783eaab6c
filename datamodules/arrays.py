"""Federations stored as arrays with per-client offsets, in memory or memory-mapped on disk.

A population of 10⁵–10⁶ clients (LEAF's Sent140 has 660,120 users, its Reddit split 1.66
million) cannot be a Python object per client. Here one split of a federation is a few
arrays ("columns": inputs, targets, ...) holding every client's rows one after another,
and an ``offsets`` array of N + 1 entries: client c's rows are
``offsets[c] : offsets[c + 1]``. The clients' sample counts are ``diff(offsets)``, read
once as an array; a client's dataset is a slice, built only when it is asked for.

On disk (:func:`save_federation`, :func:`open_federation`) a federation is a folder:

- ``federation.json``: the format's name and version, the number of clients, each split's
  number of rows and its columns (name, dtype, per-row shape);
- ``<split>.offsets.npy`` (int64, N + 1 entries) and ``<split>.<column>.npy`` per column:
  NumPy's ``.npy`` format, opened memory-mapped (``np.load(mmap_mode="c")``, never with
  pickles), so that opening reads the headers and the offsets only, and a round reads the
  pages of its own clients;
- optionally ``clients.txt``: one client name per line (the LEAF user ids).

Every file is checked when it is opened: a truncated column, offsets that decrease or run
past the column's end, a column whose rows disagree with ``federation.json`` are each
refused with an error naming the file (and the client) and the fix. Nothing is read past
the end of a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lightning_fl.engine.data_contract import FederatedDataModule, Split, arguments

FORMAT = "lightning-fl/federation"
VERSION = 1
SPLITS: tuple[Split, ...] = ("train", "val", "test")


class FederationFormatError(ValueError):
    """A federation folder or its arrays are malformed; the message names the file."""


class ClientArrays:
    """One split of a federation: ``columns`` (arrays or tensors of equal length, the
    clients' rows one after another) and ``offsets`` (N + 1 non-decreasing int64 entries
    from 0 to the number of rows): client c's rows are ``offsets[c] : offsets[c + 1]``.

    Host-side bookkeeping: the arrays stay where they are (in memory or memory-mapped);
    a client's rows become tensors when its dataset is built.
    """

    def __init__(
        self,
        columns: Sequence[np.ndarray | torch.Tensor],
        offsets: np.ndarray | Sequence[int],
        source: str = "arrays",
    ) -> None:
        self.columns = [c.numpy() if isinstance(c, torch.Tensor) else c for c in columns]
        self.offsets = np.asarray(offsets, dtype=np.int64)
        _check_offsets(self.offsets, [len(c) for c in self.columns], source)

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    @property
    def counts(self) -> np.ndarray:
        """Each client's number of rows (int64, N entries)."""
        return np.diff(self.offsets)

    def rows(self, client: int) -> list[torch.Tensor]:
        """Client ``client``'s rows of every column, as tensors (a copy of a memory-mapped
        array's rows, a view of an in-memory one)."""
        start, stop = int(self.offsets[client]), int(self.offsets[client + 1])
        return [_tensor(c[start:stop]) for c in self.columns]

    @classmethod
    def from_clients(cls, clients: Sequence[Sequence[np.ndarray | torch.Tensor]]) -> ClientArrays:
        """The arrays of a list of clients, each a tuple of columns (x, y)."""
        if not clients:
            raise ValueError("from_clients needs at least one client.")
        width = len(clients[0])
        columns = [
            np.concatenate([np.asarray(client[k]) for client in clients]) for k in range(width)
        ]
        sizes = [len(client[0]) for client in clients]
        return cls(columns, np.concatenate([[0], np.cumsum(sizes)]))


class ArrayFederatedDataModule(FederatedDataModule):
    """A federation given as :class:`ClientArrays` per split (``splits``), or read from a
    folder written by :func:`save_federation` (``path``: memory-mapped, opened at set-up).

    Sample counts are the offsets' differences (no dataset is built to count them); client
    c's dataset is a ``TensorDataset`` of its rows, built when it is asked for. Every split
    must have the same number of clients; a split may be absent (no validation data).

    The batch the module receives (``training_step``, ``validation_step``,
    ``loss_and_metrics``) is a list with one tensor per column, in the columns' order:
    ``[x, y]`` for two columns, ``[x, y, w]`` for three. Row b of every tensor is the same
    sample, the first dimension is the batch (a short last batch included) and the rest is
    the column's row shape and dtype (``float32`` features of shape ``(F,)``, ``int64``
    labels of shape ``()``: what :func:`save_federation` wrote). A module that unpacks
    ``x, y = batch`` takes two columns only; vectorized clients stack one more leading
    dimension, the clients.

    >>> arrays = ClientArrays.from_clients([(np.zeros((3, 2), "float32"), np.arange(3)),
    ...                                     (np.ones((2, 2), "float32"), np.arange(2))])
    >>> dm = ArrayFederatedDataModule(splits={"train": arrays}, batch_size=2)
    >>> batch = next(iter(dm.client_dataloader(dm.client_dataset(1, "train"), "val")))
    >>> [tuple(column.shape) for column in batch], batch[1].tolist()
    ([(2, 2), (2,)], [0, 1])

    Args:
        path: a federation folder (:func:`save_federation`, ``lightning-fl data``).
        splits: ``{"train": ClientArrays, "val": ..., "test": ...}`` instead of ``path``.
        unseen_fraction: hold out the last clients as unseen (:meth:`hold_out`).
        batch_size, eval_batch_size: the clients' loaders'.
    """

    def __init__(
        self,
        path: str | None = None,
        splits: Mapping[str, ClientArrays] | None = None,
        unseen_fraction: float = 0.0,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
    ) -> None:
        self._args = arguments(locals())
        super().__init__(batch_size, eval_batch_size)
        if (path is None) == (splits is None):
            raise ValueError("Give ArrayFederatedDataModule either path= or splits=, not both.")
        self.hold_out(unseen_fraction)
        self._splits: dict[str, ClientArrays] | None = None
        if splits is not None:
            self._splits = _checked_splits(dict(splits), "splits")

    def setup(self, stage: str | None = None) -> None:
        """Open the federation folder (its headers and offsets; the rows stay on disk)."""
        _ = self.arrays

    @property
    def arrays(self) -> dict[str, ClientArrays]:
        """The splits' arrays (opened from ``path`` at the first use)."""
        if self._splits is None:
            self._splits = open_federation(self._args.path)
        return self._splits

    @property
    def num_clients(self) -> int:
        return next(iter(self.arrays.values())).num_clients

    def split_counts(self, split: Split = "train") -> np.ndarray:
        """Every client's number of samples in ``split`` as an int64 array (zeros for an
        absent split)."""
        arrays = self.arrays.get(split)
        return np.zeros(self.num_clients, np.int64) if arrays is None else arrays.counts

    def sample_counts(self, split: Split = "train") -> list[int]:
        return self.split_counts(split).tolist()

    def local_sample_counts(self, split: Split = "train") -> dict[int, int]:
        counts = self.split_counts(split)
        return {c: int(counts[c]) for c in self.local_clients()}

    def client_dataset(self, client: int, split: Split) -> TensorDataset | None:
        self.check_owned(client)
        arrays = self.arrays.get(split)
        if arrays is None:
            return None
        if not 0 <= client < arrays.num_clients:
            last = arrays.num_clients - 1
            raise IndexError(
                f"client {client} does not exist: the federation has clients 0 to {last}."
            )
        return TensorDataset(*arrays.rows(client))

    def split_arrays(self, split: Split) -> tuple[list[torch.Tensor], np.ndarray] | None:
        """The split's columns as tensors over the same memory (a memory-mapped column
        stays on disk until its rows are read) and its offsets; None for an absent split
        and in silo mode (a silo holds only its own clients)."""
        arrays = self.arrays.get(split)
        if self.silo is not None or arrays is None:
            return None
        return [torch.from_numpy(c) for c in arrays.columns], arrays.offsets


def save_federation(
    folder: str | os.PathLike,
    splits: Mapping[str, ClientArrays],
    column_names: Sequence[str] = ("x", "y"),
    client_names: Sequence[str] | None = None,
) -> Path:
    """Write ``splits`` as a federation folder (see the module docstring); returns it."""
    folder = Path(folder)
    splits = _checked_splits(dict(splits), str(folder))
    folder.mkdir(parents=True, exist_ok=True)
    header: dict = {"format": FORMAT, "version": VERSION, "splits": {}}
    for split, arrays in splits.items():
        if len(column_names) != len(arrays.columns):
            raise ValueError(
                f"{len(column_names)} column names for {len(arrays.columns)} columns of "
                f"split {split!r}: give one name per column."
            )
        np.save(folder / f"{split}.offsets.npy", arrays.offsets)
        columns = []
        for name, column in zip(column_names, arrays.columns):
            np.save(folder / f"{split}.{name}.npy", np.ascontiguousarray(column))
            columns.append({"name": name, "dtype": str(column.dtype),
                            "shape": list(column.shape[1:])})  # fmt: skip
        header["splits"][split] = {"rows": int(arrays.offsets[-1]), "columns": columns}
    header["num_clients"] = next(iter(splits.values())).num_clients
    if client_names is not None:
        if len(client_names) != header["num_clients"]:
            raise ValueError(f"{len(client_names)} client names for {header['num_clients']} "
                             "clients: give one name per client.")  # fmt: skip
        (folder / "clients.txt").write_text("".join(f"{name}\n" for name in client_names))
    (folder / "federation.json").write_text(json.dumps(header, indent=1) + "\n")
    return folder


def open_federation(folder: str | os.PathLike) -> dict[str, ClientArrays]:
    """The splits of a federation folder, memory-mapped and checked (module docstring)."""
    folder = Path(folder)
    index = folder / "federation.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"{index}: no federation here. Write one with lightning_fl.datamodules."
            "save_federation, or convert LEAF's JSON with `lightning-fl data convert-leaf`."
        )
    try:
        header = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FederationFormatError(f"{index}: not a readable federation index ({err}).") from err
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise FederationFormatError(
            f"{index}: format {header.get('format')!r} version {header.get('version')!r}, "
            f"expected {FORMAT!r} version {VERSION}: rewrite it with this lightning_fl."
        )
    splits = {}
    for split, spec in header.get("splits", {}).items():
        offsets = _load(folder / f"{split}.offsets.npy", mmap=False)
        columns = [_load(folder / f"{split}.{c['name']}.npy", mmap=True) for c in spec["columns"]]
        for column, c in zip(columns, spec["columns"]):
            path = folder / f"{split}.{c['name']}.npy"
            if str(column.dtype) != c["dtype"] or list(column.shape[1:]) != c["shape"]:
                raise FederationFormatError(
                    f"{path}: {column.dtype} rows of shape {list(column.shape[1:])}, but "
                    f"{index.name} says {c['dtype']} of shape {c['shape']}: the file does "
                    "not belong to this index; write the federation again."
                )
            if len(column) != spec["rows"]:
                raise FederationFormatError(
                    f"{path}: {len(column)} rows, but {index.name} says {spec['rows']}: "
                    "the index disagrees with the data; write the federation again."
                )
        _check_offsets(offsets, [len(c) for c in columns], str(folder / f"{split}.offsets.npy"))
        splits[split] = ClientArrays(columns, offsets, source=str(folder / f"{split}.*.npy"))
    if not splits:
        raise FederationFormatError(f"{index}: no splits. Write the federation again.")
    return _checked_splits(splits, str(folder))


def client_names(folder: str | os.PathLike) -> list[str] | None:
    """The client names of a federation folder (``clients.txt``), or None."""
    path = Path(folder) / "clients.txt"
    return path.read_text().splitlines() if path.is_file() else None


def _load(path: Path, mmap: bool) -> np.ndarray:
    """An ``.npy`` file without pickles; memory-mapped copy-on-write (writes never reach
    the file) with ``mmap``; a truncated file is an error naming it."""
    if not path.is_file():
        raise FederationFormatError(f"{path}: missing. Write the federation again.")
    try:
        array = np.load(path, mmap_mode="c" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise FederationFormatError(
            f"{path}: unreadable or truncated ({err}). Write the federation again."
        ) from err
    if array.dtype.hasobject:
        raise FederationFormatError(f"{path}: holds Python objects, which are never loaded.")
    return array


def _check_offsets(offsets: np.ndarray, lengths: list[int], source: str) -> None:
    """Offsets are 1-D, start at 0, never decrease and end at every column's length."""
    if offsets.ndim != 1 or len(offsets) < 2:
        raise FederationFormatError(
            f"{source}: offsets must be 1-D with N + 1 >= 2 entries, got shape {offsets.shape}."
        )
    if offsets[0] != 0:
        raise FederationFormatError(f"{source}: offsets must start at 0, got {offsets[0]}.")
    steps = np.diff(offsets)
    if (steps < 0).any():
        client = int(np.argmax(steps < 0))
        raise FederationFormatError(
            f"{source}: client {client}'s offsets decrease ({offsets[client]} then "
            f"{offsets[client + 1]}): offsets must never decrease."
        )
    for length in lengths:
        if offsets[-1] != length:
            client = int(np.searchsorted(offsets, length, side="right")) - 1
            raise FederationFormatError(
                f"{source}: the offsets end at row {offsets[-1]} but a column has {length} "
                f"rows (client {min(client, len(offsets) - 2)} runs past its end, or the "
                "file is truncated): write the federation again."
            )


def _checked_splits(splits: dict[str, ClientArrays], source: str) -> dict[str, ClientArrays]:
    unknown = sorted(set(splits) - set(SPLITS))
    if unknown:
        raise ValueError(f"{source}: unknown split(s) {unknown}; splits are {list(SPLITS)}.")
    if "train" not in splits:
        raise ValueError(f"{source}: a federation needs a 'train' split.")
    sizes = {split: arrays.num_clients for split, arrays in splits.items()}
    if len(set(sizes.values())) != 1:
        raise FederationFormatError(
            f"{source}: splits have different numbers of clients {sizes}: every split "
            "needs an entry (possibly empty) for every client."
        )
    return splits


def _tensor(rows: np.ndarray) -> torch.Tensor:
    # host: a client's rows are read on the CPU; the strategy moves batches to the device
    if isinstance(rows, np.memmap) or not rows.flags.writeable:
        rows = np.array(rows)
    return torch.from_numpy(rows)
