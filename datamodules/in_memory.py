"""Clients held as tensors: :class:`InMemoryFederatedDataModule` (the tests', the
benchmarks' and the small datasets' federation)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from lightning_fl.engine.bulk import collector_paused
from lightning_fl.engine.data_contract import FederatedDataModule, Split
from lightning_fl.engine.tensors import adjacent_view, row_count, uniform_rows

#: One client's tensors per split: ``{"train": (x, y), "val": (x, y), "test": (x, y)}``.
ClientTensors = dict[str, tuple[torch.Tensor, torch.Tensor]]


class InMemoryFederatedDataModule(FederatedDataModule):
    """Clients as tensors: ``clients[c][split] = (x, y)``, given (tests and benchmarks) or
    read by a subclass's :meth:`read_clients`, once, at ``setup`` or the first use."""

    def __init__(
        self,
        clients: Sequence[ClientTensors] | None = None,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        server: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(batch_size, eval_batch_size)
        # each client's dict copied: packing (split_arrays) replaces its tensors by views
        self._given = None if clients is None else ([dict(c) for c in clients], server)
        self._loaded: tuple[list[ClientTensors], tuple | None] | None = None
        self._packed: dict[Split, tuple[list[torch.Tensor], np.ndarray] | None] = {}

    def read_clients(self) -> tuple[list[ClientTensors], tuple[torch.Tensor, ...] | None]:
        """Every client's tensors and the server's own data (or None): what the constructor
        was given; a subclass reads and partitions its dataset here."""
        if self._given is None:
            raise NotImplementedError(
                f"{type(self).__name__} gives no clients: pass clients=[...] or override "
                "read_clients()."
            )
        return self._given

    def setup(self, stage: str | None = None) -> None:
        """Read the clients' data (once)."""
        self._data()

    def _data(self) -> tuple[list[ClientTensors], tuple | None]:
        if self._loaded is None:
            self._loaded = self.read_clients()
        return self._loaded

    @property
    def _clients(self) -> list[ClientTensors]:
        return self._data()[0]

    def server_dataset(self) -> Dataset | None:
        server = self._data()[1]
        return None if server is None else TensorDataset(*server)

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    def client_dataset(self, client: int, split: Split) -> Dataset | None:
        self.check_owned(client)
        data = self._clients[client].get(split)
        return None if data is None else TensorDataset(*data)

    def _reads_own_tensors(self) -> bool:
        """Whether the clients' tensors are the truth: not in silo mode (a silo holds its
        own clients) and not where a subclass overrides ``client_dataset``."""
        return self.silo is None and (
            type(self).client_dataset is InMemoryFederatedDataModule.client_dataset
        )

    def sample_counts(self, split: Split = "train") -> list[int]:
        """Each client's rows in ``split``, read from its tensors (no dataset made); a
        client whose tensors differ in length is refused, naming it."""
        if not self._reads_own_tensors():
            return super().sample_counts(split)
        with collector_paused():
            return _row_counts([client.get(split) for client in self._clients], split).tolist()

    def split_arrays(self, split: Split) -> tuple[list[torch.Tensor], np.ndarray] | None:
        """The clients' tensors of ``split`` packed once into columns with N + 1 offsets (a
        view when the clients are slices of one tensor in order; else a copy, and each
        client's tensors become views of it: no second copy is kept), so that
        a full evaluation pass and packed training need no per-client Python. None in
        silo mode (a silo holds its own clients), where a subclass overrides
        ``client_dataset`` (its datasets are the truth), and where the clients' columns
        differ in number, dtype or row shape."""
        if not self._reads_own_tensors():
            return None
        if split not in self._packed:
            with collector_paused():
                self._packed[split] = self._pack(split)
        return self._packed[split]

    def _pack(self, split: Split) -> tuple[list[torch.Tensor], np.ndarray] | None:
        parts = [client.get(split) for client in self._clients]
        present = [p for p in parts if p is not None]
        if not present or len(set(map(len, present))) != 1:  # tuples' len: C
            return None
        parts_of = list(zip(*present))
        if not all(map(uniform_rows, parts_of)):
            return None
        sizes = _row_counts(parts, split)
        # clients cut from one tensor in order are a view of it (no copy), else a copy
        views = [adjacent_view(column) for column in parts_of]
        columns = [torch.cat(c) if v is None else v for c, v in zip(parts_of, views)]
        # the clients' tensors become views of the columns (torch.split: one call in C)
        pieces = [torch.split(column, sizes[sizes > 0].tolist()) for column in columns]
        holders = [client for client, size in zip(self._clients, sizes.tolist()) if size]
        for client, own in zip(holders, zip(*pieces)):
            client[split] = own
        return columns, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _row_counts(parts: list[tuple[torch.Tensor, ...] | None], split: Split) -> np.ndarray:
    """Rows of each client's tensors (0 where it has none); a client whose tensors differ
    in length is refused, naming it."""
    sizes = np.zeros(len(parts), dtype=np.int64)
    present = [c for c, p in enumerate(parts) if p is not None]
    for k, column in enumerate(zip(*(parts[c] for c in present))):
        rows = np.fromiter(map(row_count, column), np.int64, len(present))
        if k > 0 and (bad := np.flatnonzero(rows != sizes[present])).size:
            c = present[bad[0]]
            raise ValueError(
                f"Client {c}'s {split!r} tensors differ in length ({sizes[c]} rows in the "
                f"first, {rows[bad[0]]} in tensor {k}): every tensor of a client's split has "
                f"one row per sample. Fix client {c}'s data given to "
                "InMemoryFederatedDataModule."
            )
        sizes[present] = rows
    return sizes
