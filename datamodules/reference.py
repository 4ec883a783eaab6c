"""Training data paired with reference data, for WERM (Kaplan et al., PETS 2024): each
training batch comes with a batch of the reference data."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fl.engine.data_contract import PairedDataset, batch_loader
from lightning_fl.engine.seeding import derive_seed


class WERMDataset(PairedDataset):
    """A client's training data (what ``len`` and indexing see, so sample counts and
    aggregation weights are the training sizes) carrying its reference data."""

    def __init__(self, train: Dataset, reference: Dataset) -> None:
        if len(reference) == 0:  # type: ignore[arg-type]
            raise ValueError("The reference dataset is empty: WERM needs reference samples.")
        self.train, self.reference = train, reference

    def __len__(self) -> int:
        return len(self.train)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.train[index]

    def training_loader(self, batch_size: int, generator: torch.Generator | None) -> PairedLoader:
        """``{"train", "reference"}`` batch pairs (:func:`paired_loader`)."""
        return paired_loader(self, batch_size, generator=generator)


class PairedLoader:
    """Yields ``{"train": batch, "reference": batch}``: one pass over the training loader,
    with the reference loader cycled (reshuffled at every pass) alongside it. Its length
    is the training loader's, so an epoch is one pass over the training data."""

    def __init__(self, train: DataLoader, reference: DataLoader) -> None:
        self.train, self.reference = train, reference
        self._reference_iter: Iterator | None = None

    def __len__(self) -> int:
        return len(self.train)

    def _next_reference(self) -> Any:
        if self._reference_iter is None:
            self._reference_iter = iter(self.reference)
        try:
            return next(self._reference_iter)
        except StopIteration:
            self._reference_iter = iter(self.reference)
            return next(self._reference_iter)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.train:
            yield {"train": batch, "reference": self._next_reference()}


def paired_loader(
    dataset: WERMDataset,
    batch_size: int,
    reference_batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> PairedLoader:
    """Shuffled loaders of the training and reference data. The reference order comes from
    its own generator, derived from ``generator``'s seed without drawing from it, so the
    training batches are exactly those of a loader without reference data."""
    seed = generator.initial_seed() if generator is not None else 0
    reference_generator = torch.Generator().manual_seed(derive_seed(seed, "reference"))
    train = batch_loader(dataset.train, batch_size, True, generator)
    reference = batch_loader(
        dataset.reference, reference_batch_size or batch_size, True, reference_generator
    )
    return PairedLoader(train, reference)
