"""The iterables that stand in for a round's "dataloader".

They only read data. Lightning's data fetcher reads one batch ahead, so nothing here
switches clients or aggregates: the strategy does that when a batch is consumed.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from lightning_fl.datamodules.base import FederatedDataModule, Split

if TYPE_CHECKING:
    from lightning_fl.engine.packed import PackedFederation
    from lightning_fl.engine.strategy import FederatedStrategy


@dataclass(frozen=True)
class ClientSchedule:
    """Clients in visiting order and how many batches each contributes."""

    clients: tuple[int, ...]
    num_batches: tuple[int, ...]

    def __post_init__(self) -> None:
        starts = [0, *itertools.accumulate(self.num_batches)]
        object.__setattr__(self, "_starts", starts)

    @property
    def total(self) -> int:
        return self._starts[-1]  # type: ignore[attr-defined]

    def locate(self, batch_idx: int) -> tuple[int, int]:
        """(position of the client in :attr:`clients`, local step) of a batch index."""
        if not 0 <= batch_idx < self.total:
            raise IndexError(f"batch {batch_idx} is outside this schedule of {self.total} batches.")
        pos = bisect.bisect_right(self._starts, batch_idx) - 1  # type: ignore[attr-defined]
        return pos, batch_idx - self._starts[pos]  # type: ignore[attr-defined]


def cycle_batches(loader: DataLoader, count: int) -> Iterator[Any]:
    """Exactly ``count`` batches, starting a new pass (a new shuffle) when one ends."""
    produced = 0
    while produced < count:
        for batch in loader:
            yield batch
            produced += 1
            if produced == count:
                return


class TrainRounds:
    """One round's training batches: each participant's local batches in turn."""

    def __init__(self, strategy: FederatedStrategy) -> None:
        self.strategy = strategy

    def __iter__(self) -> Iterator[Any]:
        # Lightning calls iter() once per epoch, after the previous epoch has ended (for the
        # first or a resumed epoch: during fit setup), so the round is planned here. The
        # generator below only reads data.
        # When resuming from a checkpoint taken at the end of epoch e, iter() runs while
        # current_epoch still reads e; the epoch to be trained is the processed count.
        # An error while the round is planned (a sampler's, a datamodule's) is raised at
        # the first batch instead: raised from iter(), Lightning's teardown would replace it
        # with "Please call `iter(combined_loader)` first".
        trainer = self.strategy.lightning_module.trainer
        try:
            plan = self.strategy.engine.begin_round(
                trainer.fit_loop.epoch_progress.current.processed
            )
        except Exception as err:  # noqa: BLE001 - re-raised unchanged at the first batch
            return _raise(err)
        return self._batches(plan)

    def _batches(self, plan) -> Iterator[Any]:
        if plan.chunks is not None:
            strategy = self.strategy
            yield from self._chunk_batches(
                plan, strategy.local_steps_per_training_step, strategy.packed, strategy.root_device
            )
            return
        for client_loader, count in zip(plan.loaders, plan.schedule.num_batches):
            yield from cycle_batches(client_loader, count)
        padding = plan.schedule.total - sum(plan.schedule.num_batches[: len(plan.loaders)])
        for _ in range(padding):  # idle batches: this rank has fewer local batches
            yield ()

    @staticmethod
    def _chunk_batches(
        plan, fused: int | None, packed: PackedFederation | None, device: torch.device
    ) -> Iterator[Any]:
        """Vectorized clients: per Lightning step, ``fused`` local steps of a chunk (None:
        all of them). A local step is the next batch of each of the chunk's clients that
        has one left (``{"rows": [...], "batches": [...]}``, rows of the chunk), each
        client's batches exactly those of the sequential path; a Lightning step's batch is
        ``{"local_steps": [step, ...]}``."""
        counts = plan.schedule.num_batches
        for index, chunk in enumerate(plan.chunks):
            local = plan.chunk_local_steps(index)
            per_call = local if fused is None else fused
            if plan.packed_chunk(index):  # packed on the device
                first_client = plan.schedule.clients[chunk[0]]
                size = min(packed.batch_sizes[first_client], packed.sizes[first_client])
                # Lightning reads the batch size of what a hook logs from the batch's
                # first tensor: the first client's batch size, as on the other paths
                size_hint = torch.empty(int(size), 0, device=device)
                for first in range(0, local, per_call):
                    steps = PackedLocalSteps(index, first, min(first + per_call, local))
                    yield {"batch_size": size_hint, "local_steps": steps}
                continue
            streams = [cycle_batches(plan.loaders[pos], counts[pos]) for pos in chunk]
            for first in range(0, local, per_call):
                steps = []
                for step in range(first, min(first + per_call, local)):
                    rows = [row for row, pos in enumerate(chunk) if counts[pos] > step]
                    steps.append({"rows": rows, "batches": [next(streams[r]) for r in rows]})
                yield {"local_steps": steps}
        for _ in range(plan.steps.total - sum(plan.steps.num_batches[: len(plan.chunks)])):
            yield ()


class PackedLocalSteps:
    """A Lightning step's local steps when the chunk's data is packed on the device:
    ``first`` to ``stop`` (exclusive) of chunk ``chunk``, whose batches the vectorized
    step draws by index when it trains them. A plain object, which Lightning's batch
    transfer leaves alone: nothing is read ahead or copied. The step's batch is
    ``{"batch_size": ..., "local_steps": PackedLocalSteps}``."""

    __slots__ = ("chunk", "first", "stop")

    def __init__(self, chunk: int, first: int, stop: int) -> None:
        self.chunk, self.first, self.stop = chunk, first, stop

    def __repr__(self) -> str:
        return f"PackedLocalSteps(chunk={self.chunk}, steps {self.first}..{self.stop - 1})"


def _raise(err: Exception) -> Iterator[Any]:
    raise err
    yield  # a generator: the error is raised at the first next()


class EvalRounds:
    """Held-out batches of every client this rank owns that has data for ``split``: the
    seen clients first, then the unseen (held-out) ones, which the strategy reports apart
    and which personalization callbacks adapt to before their batches.
    """

    def __init__(
        self, datamodule: FederatedDataModule, split: Split, strategy: FederatedStrategy
    ) -> None:
        self.datamodule = datamodule
        self.split = split
        self.strategy = strategy
        clients, loaders = [], []
        #: each client's number of samples in ``split``
        self.sizes: dict[int, int] = {}
        for c in [*datamodule.seen_clients(), *datamodule.unseen_clients]:
            if strategy.owner(c) != strategy.global_rank:
                continue
            dataset = datamodule.client_dataset(c, split)
            if dataset is not None and len(dataset) > 0:
                clients.append(c)
                loaders.append(datamodule.client_dataloader(dataset, split))
                self.sizes[c] = len(dataset)
        self.loaders = loaders
        self.schedule = ClientSchedule(tuple(clients), tuple(len(lo) for lo in loaders))

    def __len__(self) -> int:
        return self.schedule.total

    def __iter__(self) -> Iterator[Any]:
        self.strategy.evaluation.begin(self.schedule, self.sizes)
        for loader in self.loaders:
            yield from loader
