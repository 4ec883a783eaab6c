"""Clients held as tensors: :class:`InMemoryFederatedDataModule` (the tests', the
benchmarks' and the small datasets' federation)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset, TensorDataset

from lightning_fl.engine.data_contract import FederatedDataModule, Split

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
        self._given = None if clients is None else (list(clients), server)
        self._loaded: tuple[list[ClientTensors], tuple | None] | None = None

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
