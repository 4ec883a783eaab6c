"""The iterables that stand in for a round's "dataloader".

They only read data. Lightning's data fetcher reads one batch ahead, so nothing here
switches clients or aggregates: the strategy does that when a batch is consumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from lightning_fl.engine.client_evaluation import ClientEvaluation
from lightning_fl.engine.context import Federation, FitContext, Ranks
from lightning_fl.engine.data_contract import FederatedDataModule, Split
from lightning_fl.engine.packed import PackedFederation
from lightning_fl.engine.planning import RoundPlan
from lightning_fl.engine.schedule import ClientSchedule, PackedLocalSteps, cycle_batches
from lightning_fl.engine.segment_evaluation import (
    SegmentBatch,
    SegmentEvaluation,
    SegmentEvaluationFactory,
    segment_batches,
)


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
            epoch = trainer.fit_loop.epoch_progress.current.processed
            plan = self.begin_round(epoch + self.fit.config.first_round)
        except Exception as err:  # noqa: BLE001 - re-raised unchanged at the first batch
            return _raise(err)
        return self._batches(plan)

    def _batches(self, plan) -> Iterator[Any]:
        if plan.chunks is not None:
            fit = self.fit
            fused = fit.config.local_steps_per_training_step
            yield from self._chunk_batches(plan, fused, fit.packed, fit.device)
            return
        if plan.fused:
            yield from self._fused_batches(plan, self.fit.config.local_steps_per_training_step)
            return
        for client_loader, count in zip(plan.loaders, plan.schedule.num_batches):
            yield from cycle_batches(client_loader, count)
        padding = plan.schedule.total - sum(plan.schedule.num_batches[: len(plan.loaders)])
        for _ in range(padding):  # idle batches: this rank has fewer local batches
            yield ()

    @staticmethod
    def _fused_batches(plan, fused: int | None) -> Iterator[Any]:
        """Fused local steps of one client: per Lightning step, the client's next
        ``fused`` batches (None: all of them), ``{"local_batches": [...]}``; then this
        rank's idle steps."""
        for client_loader, count in zip(plan.loaders, plan.schedule.num_batches):
            stream = cycle_batches(client_loader, count)
            per_step = fused or count
            for first in range(0, count, per_step):
                yield {"local_batches": [next(stream) for _ in range(min(per_step, count - first))]}
        clients = len(plan.loaders)
        for _ in range(plan.steps.total - sum(plan.steps.num_batches[:clients])):
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
    """Held-out batches of every client this rank owns that has data for ``split`` (or of
    ``cohort``'s, a seeded cohort of clients: :mod:`.cohort`): the seen clients first,
    then the unseen (held-out) ones, which the strategy reports apart and which
    personalization callbacks adapt to before their batches. ``evaluation`` begins its
    epoch over them when Lightning asks for them.

    With ``segments`` (a :class:`~.segment_evaluation.SegmentEvaluation` factory, given
    when the module and callbacks allow it) and a datamodule that holds the split as
    arrays, the batches are :class:`~.segment_evaluation.SegmentBatch` groups of many
    clients each (one Lightning step per group), if the first one agrees with a plain
    call; otherwise one client's batch per step.

    On several processes a rank whose clients have no such data gives one idle batch
    ``()``, which evaluates nobody: Lightning refuses a rank with no batches while others
    have some, and the rank must still reach the epoch's end, where every rank's clients
    are gathered and reported. A module whose evaluation step itself logs with
    ``sync_dist=True`` (a plain LightningModule's) still needs data on every rank:
    Lightning syncs each logged name over ranks, and the idle rank logged none.
    """

    def __init__(
        self,
        federation: Federation,
        split: Split,
        ranks: Ranks,
        evaluation: ClientEvaluation,
        cohort: np.ndarray | None = None,
        segments: SegmentEvaluationFactory | None = None,
        population: int | None = None,
    ) -> None:
        self.evaluation = evaluation
        #: with a cohort, the number of clients it was drawn from (its standard errors')
        self.population = population
        self.loaders: list = []
        self.segments: SegmentEvaluation | None = None
        self.batches: list[SegmentBatch] = []
        datamodule = federation.datamodule
        candidates = _candidates(federation, ranks, cohort)
        arrays = datamodule.split_arrays(split)
        if arrays is None:
            if segments is not None and segments.strict:
                raise ValueError(
                    f"vectorize_evaluation=True, but {type(datamodule).__name__} does not "
                    f"hold its {split!r} split as arrays (split_arrays): use an "
                    "ArrayFederatedDataModule or an InMemoryFederatedDataModule of plain "
                    "tensors, or vectorize_evaluation='auto'."
                )
            clients, sizes = self._datasets(datamodule, split, candidates)
        else:
            clients, sizes = self._arrays(datamodule, split, candidates, arrays, segments)
        #: each client's number of samples in ``split``
        self.sizes: dict[int, int] = dict(zip(clients, sizes))
        if self.segments is not None:
            # the boundaries are the segment sums' (ClientEvaluation reads them at the end)
            self.schedule = ClientSchedule(tuple(clients), (0,) * len(clients))
            self.total = len(self.batches)
        else:
            self.schedule = ClientSchedule(tuple(clients), tuple(len(lo) for lo in self.loaders))
            self.total = self.schedule.total
        #: whether this rank gives one idle batch (see the class docstring)
        self.idle = ranks.distributed and self.total == 0

    def _datasets(
        self, datamodule: FederatedDataModule, split: Split, candidates: np.ndarray
    ) -> tuple[list[int], list[int]]:
        """The candidates with data, by building each one's dataset and loader."""
        clients, sizes = [], []
        for c in candidates.tolist():
            dataset = datamodule.client_dataset(c, split)
            if dataset is not None and len(dataset) > 0:
                clients.append(c)
                sizes.append(len(dataset))
                self.loaders.append(datamodule.client_dataloader(dataset, split))
        return clients, sizes

    def _arrays(
        self,
        datamodule: FederatedDataModule,
        split: Split,
        candidates: np.ndarray,
        arrays: tuple[list[torch.Tensor], np.ndarray],
        segments: SegmentEvaluationFactory | None,
    ) -> tuple[list[int], list[int]]:
        """The candidates with data, from the offsets; their segment batches when they can
        be evaluated vectorized, else their loaders."""
        columns, offsets = arrays
        counts = offsets[candidates + 1] - offsets[candidates]
        kept, sizes = candidates[counts > 0], counts[counts > 0]
        clients = kept.tolist()
        if segments is not None and clients:
            batches = segment_batches(offsets[kept], sizes, datamodule.eval_batch_size)
            evaluator = segments(columns, len(clients))
            reason = evaluator.disagreement(batches[0])
            if reason is None:
                self.segments, self.batches = evaluator, batches
            elif segments.strict:
                raise ValueError(
                    f"vectorize_evaluation=True, but {reason}; or set "
                    "vectorize_evaluation='auto' or False."
                )
        if self.segments is None:
            self.loaders = [
                datamodule.client_dataloader(datamodule.client_dataset(c, split), split)
                for c in clients
            ]
        return clients, sizes.tolist()

    def __len__(self) -> int:
        return 1 if self.idle else self.total

    def __iter__(self) -> Iterator[Any]:
        if self.segments is not None:
            self.segments.reset()  # this epoch's sums only
        self.evaluation.begin(self.schedule, self.sizes, self.segments, self.population)
        if self.idle:
            yield ()
        if self.segments is not None:
            yield from self.batches
            return
        for loader in self.loaders:
            yield from loader


def _candidates(federation: Federation, ranks: Ranks, cohort: np.ndarray | None) -> np.ndarray:
    """The clients to evaluate on this rank, seen first (ascending), then unseen (in the
    datamodule's order): every client, or the cohort's."""
    # host: client ids
    unseen, is_unseen = federation.unseen, federation.unseen_mask
    if cohort is None:
        seen = np.flatnonzero(~is_unseen)
    else:
        seen = cohort[~is_unseen[cohort]]
        unseen = unseen[np.isin(unseen, cohort)]
    ordered = np.concatenate([seen, unseen]).astype(np.int64)
    ordered = ordered[ordered % ranks.world_size == ranks.rank]
    silo = getattr(federation.datamodule, "silo", None)
    if silo is not None:  # a silo view holds its own clients alone (a Flower node's: one)
        ordered = ordered[ordered % silo[1] == silo[0]]
    return ordered
