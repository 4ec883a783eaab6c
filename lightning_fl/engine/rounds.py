"""The iterables that stand in for a round's "dataloader".

They only read data. Lightning's data fetcher reads one batch ahead, so nothing here
switches clients or aggregates: the strategy does that when a batch is consumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_fl.datamodules.base import FederatedDataModule, Split
from lightning_fl.engine.client_evaluation import ClientEvaluation
from lightning_fl.engine.context import FitContext, Ranks
from lightning_fl.engine.packed import PackedFederation
from lightning_fl.engine.planning import RoundPlan
from lightning_fl.engine.schedule import ClientSchedule, PackedLocalSteps, cycle_batches


class TrainRounds:
    """One round's training batches: each participant's local batches in turn. The round
    is planned by ``begin_round`` (the round engine's) when Lightning asks for them."""

    def __init__(self, fit: FitContext, begin_round: Callable[[int], RoundPlan]) -> None:
        self.fit, self.begin_round = fit, begin_round

    def __iter__(self) -> Iterator[Any]:
        # Lightning calls iter() once per epoch, after the previous epoch has ended (for the
        # first or a resumed epoch: during fit setup), so the round is planned here. The
        # generator below only reads data.
        # When resuming from a checkpoint taken at the end of epoch e, iter() runs while
        # current_epoch still reads e; the epoch to be trained is the processed count.
        # An error while the round is planned (a sampler's, a datamodule's) is raised at
        # the first batch instead: raised from iter(), Lightning's teardown would replace it
        # with "Please call `iter(combined_loader)` first".
        trainer = self.fit.trainer
        try:
            plan = self.begin_round(trainer.fit_loop.epoch_progress.current.processed)
        except Exception as err:  # noqa: BLE001 - re-raised unchanged at the first batch
            return _raise(err)
        return self._batches(plan)

    def _batches(self, plan) -> Iterator[Any]:
        if plan.chunks is not None:
            fit = self.fit
            fused = fit.config.local_steps_per_training_step
            yield from self._chunk_batches(plan, fused, fit.packed, fit.device)
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
                for first in range(0, local, per_call):
                    # Lightning reads the batch size of what a hook logs from the batch's
                    # first tensor: on the other paths, the batch of the first client
                    # with one at this step, which may be its pass's short last batch
                    opening = next(pos for pos in chunk if counts[pos] > first)
                    size = packed.batch_length(plan.schedule.clients[opening], first)
                    size_hint = torch.empty(size, 0, device=device)
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


def _raise(err: Exception) -> Iterator[Any]:
    raise err
    yield  # a generator: the error is raised at the first next()


class EvalRounds:
    """Held-out batches of every client this rank owns that has data for ``split``: the
    seen clients first, then the unseen (held-out) ones, which the strategy reports apart
    and which personalization callbacks adapt to before their batches. ``evaluation``
    begins its epoch over them when Lightning asks for them.

    On several processes a rank whose clients have no such data gives one idle batch
    ``()``, which evaluates nobody: Lightning refuses a rank with no batches while others
    have some, and the rank must still reach the epoch's end, where every rank's clients
    are gathered and reported. A module whose evaluation step itself logs with
    ``sync_dist=True`` (a plain LightningModule's) still needs data on every rank:
    Lightning syncs each logged name over ranks, and the idle rank logged none.
    """

    def __init__(
        self,
        datamodule: FederatedDataModule,
        split: Split,
        ranks: Ranks,
        evaluation: ClientEvaluation,
    ) -> None:
        self.evaluation = evaluation
        clients, loaders = [], []
        #: each client's number of samples in ``split``
        self.sizes: dict[int, int] = {}
        for c in [*datamodule.seen_clients(), *datamodule.unseen_clients]:
            if ranks.owner(c) != ranks.rank:
                continue
            dataset = datamodule.client_dataset(c, split)
            if dataset is not None and len(dataset) > 0:
                clients.append(c)
                loaders.append(datamodule.client_dataloader(dataset, split))
                self.sizes[c] = len(dataset)
        self.loaders = loaders
        self.schedule = ClientSchedule(tuple(clients), tuple(len(lo) for lo in loaders))
        #: whether this rank gives one idle batch (see the class docstring)
        self.idle = ranks.distributed and self.schedule.total == 0

    def __len__(self) -> int:
        return 1 if self.idle else self.schedule.total

    def __iter__(self) -> Iterator[Any]:
        self.evaluation.begin(self.schedule, self.sizes)
        if self.idle:
            yield ()
        for loader in self.loaders:
            yield from loader
