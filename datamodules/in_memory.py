"""Clients held as tensors: :class:`InMemoryFederatedDataModule` (the tests', the
benchmarks' and the small datasets' federation)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from lightning_fl.engine.data_contract import FederatedDataModule, Split
from lightning_fl.engine.tensors import adjacent_view

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

    def split_arrays(self, split: Split) -> tuple[list[torch.Tensor], np.ndarray] | None:
        """The clients' tensors of ``split`` packed once into columns with N + 1 offsets (a
        view when the clients are slices of one tensor in order; else a copy, and each
        client's tensors become views of it: no second copy is kept), so that
        a full evaluation pass and packed training need no per-client Python. None in
        silo mode (a silo holds its own clients), where a subclass overrides
        ``client_dataset`` (its datasets are the truth), and where the clients' columns
        differ in number, dtype or row shape."""
        if self.silo is not None or type(self).client_dataset is not (
            InMemoryFederatedDataModule.client_dataset
        ):
            return None
        if split not in self._packed:
            self._packed[split] = self._pack(split)
        return self._packed[split]

    def _pack(self, split: Split) -> tuple[list[torch.Tensor], np.ndarray] | None:
        parts = [client.get(split) for client in self._clients]
        present = [p for p in parts if p is not None]
        if not present:
            return None
        width = len(present[0])
        shapes = {tuple((t.dtype, tuple(t.shape[1:]), t.device) for t in p) for p in present}
        if len(shapes) != 1 or any(len(p) != width for p in present):
            return None
        sizes = [0 if p is None else len(p[0]) for p in parts]
        parts_of = [[p[k] for p in present] for k in range(width)]
        # clients cut from one tensor in order are a view of it (no copy), else a copy
        views = [adjacent_view(column) for column in parts_of]
        columns = [torch.cat(c) if v is None else v for c, v in zip(parts_of, views)]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        for client, part, start, stop in zip(self._clients, parts, offsets, offsets[1:]):
            if part is not None:  # the client's tensors become views of the columns
                client[split] = tuple(column[start:stop] for column in columns)
        return columns, offsets
