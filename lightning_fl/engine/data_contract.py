"""The datamodule contract the engine reads: :class:`FederatedDataModule` (per-client
datasets, built lazily, and the loaders the strategy uses), :class:`FederatedLoader` and
the split names. It lives in the engine, as the plugin contract does
(:mod:`lightning_fl.engine.plugins`), so that the engine never imports
``lightning_fl.datamodules``; users import these names from ``lightning_fl.datamodules``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

Split = Literal["train", "val", "test", "reference"]


class TensorBatchLoader:
    """Batches of a :class:`TensorDataset` cut by indexing its tensors: no per-sample
    ``__getitem__`` and collation. Each pass over the data (each ``iter()``) shuffles with
    one ``torch.randperm(n, generator=generator)`` (the global generator when None) and
    yields ``order[k·B : (k+1)·B]``, the last batch short when B does not divide n; without
    shuffling, the samples in order. Batches are copies, never views of the dataset.

    A client's batches are thus a function of its generator alone, one permutation per
    pass, which the packed federation (:mod:`lightning_fl.engine.packed`) draws the same
    way for every client of a vectorized chunk. (Before issue 34 this loader also drew the
    two values a ``DataLoader`` draws and throws away, the workers' base seed and a
    trailing permutation, to give a DataLoader's exact batches; they were two thirds of
    the shuffle's cost.)
    """

    def __init__(
        self,
        dataset: TensorDataset,
        batch_size: int,
        shuffle: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.dataset, self.batch_size = dataset, batch_size
        self.shuffle, self.generator = shuffle, generator

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    def __iter__(self):
        tensors, n, size = self.dataset.tensors, len(self.dataset), self.batch_size
        if not self.shuffle:
            for start in range(0, n, size):
                yield [t[start : start + size].clone() for t in tensors]
            return
        # host: the shuffle's order comes from the loader's CPU generator, then moves
        order = torch.randperm(n, generator=self.generator).to(tensors[0].device)
        for start in range(0, n, size):
            index = order[start : start + size]
            yield [t[index] for t in tensors]


def batch_loader(
    dataset: Dataset, batch_size: int, shuffle: bool, generator: torch.Generator | None = None
) -> DataLoader:
    """A :class:`TensorBatchLoader` for an in-memory ``TensorDataset`` (batches cut by
    indexing its tensors), a torch ``DataLoader`` for any other dataset."""
    if type(dataset) is TensorDataset:
        return TensorBatchLoader(dataset, batch_size, shuffle, generator)  # type: ignore[return-value]
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator)


def arguments(values: dict[str, Any]) -> SimpleNamespace:
    """A constructor's arguments (its ``locals()`` taken at its first line), kept to read
    the data at set-up. Not ``hparams``: under LightningCLI, a datamodule nested in another
    (a stream's ``source``) gets the outer one's configuration there."""
    return SimpleNamespace(**{k: v for k, v in values.items() if k not in ("self", "__class__")})


class PairedDataset(Dataset):
    """A client's training data carrying other data beside it (WERM's reference data:
    :class:`~lightning_fl.datamodules.reference.WERMDataset`): ``len`` and indexing are
    the training data's, and the engine's plain batches (local training of a personal
    model, evaluation on training data) read ``train`` alone."""

    train: Dataset

    def training_loader(self, batch_size: int, generator: torch.Generator | None) -> Any:
        """The loader of the paired batches a client trains on (shuffled by
        ``generator``)."""
        raise NotImplementedError


class FederatedLoader:
    """What ``train/val/test_dataloader`` return: a handle that FederatedStrategy expands
    into one round's client-by-client batches. Iterating it without the strategy is an error.
    """

    def __init__(self, datamodule: FederatedDataModule, split: Split) -> None:
        self.datamodule = datamodule
        self.split = split

    def __iter__(self):
        # A generator: Lightning calls iter() to check iterability before the strategy
        # replaces this handle; only actually drawing a batch is an error.
        raise RuntimeError(
            "A FederatedDataModule's loaders run only under FederatedStrategy: pass "
            "Trainer(strategy=lightning_fl.FederatedStrategy(...))."
        )
        yield  # pragma: no cover


class SiloError(RuntimeError):
    """In silo mode, a rank asked for the data of a client that another silo holds."""


class FederatedDataModule(pl.LightningDataModule):
    """Base class. Subclasses implement :attr:`num_clients` and :meth:`client_dataset`.

    ``client_dataset(c, split)`` may build datasets lazily; it returns ``None`` or an empty
    dataset when client ``c`` has no data for that split.

    Constructors only store and validate their arguments (Lightning's convention): data is
    downloaded in ``prepare_data`` and read in ``setup``, or at its first use by a script
    that reads a datamodule without a Trainer, so that parsing a configuration reads no
    dataset.
    """

    def __init__(self, batch_size: int = 32, eval_batch_size: int | None = None) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self._unseen_fraction = 0.0
        self._unseen: list[int] | None = None
        #: (rank, world size) in silo mode: this process holds only the clients it owns
        self.silo: tuple[int, int] | None = None
        self.silo_name: str | None = None  # the site's name, when the recipe names them

    @property
    def num_clients(self) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------------ silo mode
    def enter_silo(self, rank: int, world_size: int, name: str | None = None) -> None:
        """Silo mode (``FederatedStrategy(silos=True)``, called before ``setup``): this
        process is silo ``rank`` of ``world_size`` (the site ``name`` when the recipe
        names its sites) and holds only its own clients, those with
        ``client % world_size == rank``; it opens only their data, and asking for another
        client's is a :class:`SiloError`."""
        self.silo, self.silo_name = (rank, world_size), name

    def silo_folder(self, template: str | Path) -> Path:
        """``template`` with ``{rank}`` replaced by this silo's rank and ``{silo}`` by its
        site name (``data/heart/{silo}``: each site its own folder); refused outside silo
        mode, and ``{silo}`` where the sites have no names."""
        text = str(template)
        if self.silo is None or ("{silo}" in text and self.silo_name is None):
            needs = "FederatedStrategy(silos=[...names])" if "{silo}" in text else (
                "FederatedStrategy(silos=True)")  # fmt: skip
            raise ValueError(
                f"{text!r} names a folder per silo: run it with {needs}, or give one folder "
                "of every client's files."
            )
        return Path(text.format(rank=self.silo[0], silo=self.silo_name))

    @staticmethod
    def per_silo(template: str | Path) -> bool:
        """Whether ``template`` names a folder per silo (``{rank}`` or ``{silo}``)."""
        return "{rank}" in str(template) or "{silo}" in str(template)

    def owns(self, client: int) -> bool:
        """Whether this process holds ``client``'s data (always, outside silo mode)."""
        return self.silo is None or client % self.silo[1] == self.silo[0]

    def local_clients(self) -> list[int]:
        """The clients whose data this process holds: every client outside silo mode."""
        return [c for c in range(self.num_clients) if self.owns(c)]

    def check_owned(self, client: int) -> None:
        """Refuse to open ``client``'s data on a silo that does not hold it."""
        if not self.owns(client):
            rank, world_size = self.silo
            raise SiloError(
                f"client {client}'s data is held by silo {client % world_size}, not by this "
                f"one ({rank} of {world_size}): in silo mode a process opens only its own "
                "clients' data. A plugin that reads every client's data cannot run with "
                "FederatedStrategy(silos=True); drop it, or set silos=False."
            )

    def local_sample_counts(self, split: Split = "train") -> dict[int, int]:
        """Samples in ``split`` of each client this process holds (0 when it has none)."""
        return {c: _size(self.client_dataset(c, split)) for c in self.local_clients()}

    @property
    def unseen_clients(self) -> list[int]:
        """Clients held out of training ("unseen"); evaluation reports them apart."""
        if self._unseen is None:
            n = self.num_clients
            self._unseen = list(range(n - round(self._unseen_fraction * n), n))
        return self._unseen

    @unseen_clients.setter
    def unseen_clients(self, clients: Sequence[int]) -> None:
        self._unseen = list(clients)

    def hold_out(self, unseen_fraction: float) -> None:
        """Make the last ``round(unseen_fraction · num_clients)`` clients unseen: they never
        train, are left out of the pooled data, and are evaluated apart (FedEM Table 3.3 and
        kNN-Per Table 3.6 hold out 20%). Reads no data: the clients are counted when the
        unseen ones are first asked for."""
        if not 0 <= unseen_fraction < 1:
            raise ValueError(f"unseen_fraction must be in [0, 1), got {unseen_fraction}.")
        self._unseen_fraction, self._unseen = unseen_fraction, None

    def client_dataset(self, client: int, split: Split) -> Dataset | None:
        raise NotImplementedError

    def sample_counts(self, split: Split = "train") -> list[int]:
        """Number of samples of every client in ``split`` (0 when it has none)."""
        return [_size(self.client_dataset(c, split)) for c in range(self.num_clients)]

    def seen_clients(self) -> list[int]:
        unseen = set(self.unseen_clients)
        return [c for c in range(self.num_clients) if c not in unseen]

    def server_dataset(self) -> Dataset | None:
        """The server's own training data (SAFARI's auxiliary set), if it has any."""
        return None

    def split_arrays(self, split: Split) -> tuple[list[torch.Tensor], np.ndarray] | None:
        """Every client's data of ``split`` as columns (tensors) with the clients' rows one
        after another and N + 1 offsets, when the datamodule holds it so: packing the
        training data and evaluating clients vectorized then need no per-client Python.
        None otherwise (the per-client datasets are the only access)."""
        return None

    def set_round(self, round_idx: int) -> None:
        """Called by the strategy at the start of every training round, before the
        participants' loaders are built: streaming datamodules move their clients'
        caches to that round here. A no-op for static data."""

    def training_batch_size(self, dataset: Dataset) -> int:
        """The batch size of a client's training loader over ``dataset``."""
        return self.batch_size

    def clients_without_data_now(self, clients: Sequence[int]) -> list[int]:
        """Those of ``clients`` with no training data in the current round (a stream
        client outside its arrival window). The strategy skips them for the round, logged
        as ``fl/skipped_empty``. Static data: none."""
        return []

    def pooled_dataset(self, split: Split = "train") -> Dataset:
        """The union of the seen clients' data (the centralized baseline)."""
        if self.silo is not None:
            raise SiloError(
                "the pooled dataset is every client's data in one process, which silo mode "
                "forbids: use silos=False for the centralized baseline."
            )
        parts = [self.client_dataset(c, split) for c in self.seen_clients()]
        return torch.utils.data.ConcatDataset([d for d in parts if _size(d) > 0])

    def client_dataloader(
        self, dataset: Dataset, split: Split, generator: torch.Generator | None = None
    ) -> DataLoader:
        """The loader for one client's dataset; training loaders shuffle with ``generator``.
        Training data that carries other data (a :class:`PairedDataset`: WERM's) gets its
        own loader of batch pairs."""
        shuffle = split == "train"
        batch_size = self.training_batch_size(dataset) if shuffle else self.eval_batch_size
        if shuffle and isinstance(dataset, PairedDataset):
            return dataset.training_loader(batch_size, generator)
        return batch_loader(dataset, batch_size, shuffle, generator)

    def train_dataloader(self) -> FederatedLoader:
        return FederatedLoader(self, "train")

    def val_dataloader(self) -> FederatedLoader:
        return FederatedLoader(self, "val")

    def test_dataloader(self) -> FederatedLoader:
        return FederatedLoader(self, "test")


def _size(dataset: Dataset | None) -> int:
    return 0 if dataset is None else len(dataset)  # type: ignore[arg-type]
