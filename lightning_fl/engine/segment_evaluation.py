"""Evaluation vectorized over clients: one pass over a split's arrays, per-client sums by
segment reductions.

The sequential evaluation runs one Lightning step per client batch: about 0.4 ms of
Lightning's per-step machinery on a CPU, 44 s for 10⁵ clients of 4 samples. Here, when
the split is held as arrays with per-client offsets
(:meth:`~lightning_fl.datamodules.FederatedDataModule.split_arrays`), the clients' batches
are the same ones (client c's batch j is rows ``o_c + j·B : o_c + min((j+1)·B, n_c)``, the
loader's without shuffling), grouped by their length L. One Lightning step evaluates a
group of G such batches as one stacked ``[G, L, ...]`` batch: ``loss_and_metrics`` of the
module runs once under ``torch.func.vmap`` over G, and every batch's mean value·L is added
to its client's sums with ``index_add_`` (Σ value·B and Σ B per client, as
:meth:`~lightning_fl.FederatedTask.pop_evaluation_sums` keeps them). Each client's mean
equals the sequential path's to float round-off (sums in float64).

It serves :class:`~lightning_fl.FederatedTask` modules whose evaluation step is the
library's (``loss_and_metrics`` of a batch of columns) when no callback acts at the
clients' evaluation boundaries (personalized models, membership inference); otherwise,
and for datamodules without arrays, evaluation stays client by client
(:func:`refusal` says why). The first client's batch is checked against a plain call
before the pass (:meth:`SegmentEvaluation.disagreement`): a loss that cannot run under
``vmap`` falls back, or is refused with ``vectorize_evaluation=True``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

#: Rows of one evaluation step (G·L): large enough that Lightning's per-step cost
#: vanishes, small enough to bound the step's activations.
MAX_ROWS = 1 << 16


@dataclass
class SegmentBatch:
    """G client batches of ``length`` samples each: rows ``starts[g] : starts[g] + length``
    of the split's arrays belong to the epoch's client at position ``positions[g]``.
    Host-side bookkeeping (numpy), left alone by Lightning's batch transfer."""

    positions: np.ndarray
    starts: np.ndarray
    length: int


def segment_batches(
    starts: np.ndarray, sizes: np.ndarray, batch_size: int, max_rows: int = MAX_ROWS
) -> list[SegmentBatch]:
    """The batches of clients with rows from ``starts`` (``sizes`` each), cut every
    ``batch_size`` rows, grouped by length (longest first), at most ``max_rows`` rows a
    group; O(batches) numpy, no Python per client.

    >>> [(b.positions.tolist(), b.starts.tolist(), b.length)
    ...  for b in segment_batches(np.array([0, 5]), np.array([5, 2]), 2)]
    [([0, 0, 1], [0, 2, 5], 2), ([0], [4], 1)]
    """
    # host: index arithmetic on the offsets; the rows are gathered per step
    per_client = -(-sizes // batch_size)
    total = int(per_client.sum())
    positions = np.repeat(np.arange(len(sizes)), per_client)
    first = np.repeat(np.cumsum(per_client) - per_client, per_client)
    within = np.arange(total) - first
    rows = np.repeat(starts, per_client) + within * batch_size
    lengths = np.minimum(batch_size, np.repeat(sizes, per_client) - within * batch_size)
    out = []
    for length in np.unique(lengths)[::-1].tolist():
        chosen = np.flatnonzero(lengths == length)
        step = max(1, max_rows // length)
        for k in range(0, len(chosen), step):
            part = chosen[k : k + step]
            out.append(SegmentBatch(positions[part], rows[part], int(length)))
    return out


def refusal(
    module: object, callbacks: Iterable[object], batch_limit: int | float | None = None
) -> str | None:
    """Why the clients of ``module`` cannot be evaluated vectorized, or None.
    ``batch_limit``: the Trainer's ``limit_val_batches`` / ``limit_test_batches``; one
    that cuts the epoch counts each client's own batches, which a vectorized step (many
    clients' batches at once) does not have."""
    from lightning_fl.engine.plugins import FederatedCallback
    from lightning_fl.models import FederatedTask

    if not isinstance(module, FederatedTask):
        return f"{type(module).__name__} is not a FederatedTask (no loss_and_metrics)"
    for hook in ("validation_step", "test_step", "_step", "add_evaluation_sums"):
        if getattr(type(module), hook) is not getattr(FederatedTask, hook):
            return f"{type(module).__name__} overrides {hook}"
    if module.accepts_reference_batches:
        return f"{type(module).__name__} trains on reference batch pairs"
    if batch_limit is not None and batch_limit != 1.0:
        return f"a batch limit ({batch_limit}) cuts the epoch at a client's own batch"
    for cb in callbacks:
        for hook in ("on_client_evaluation_start", "on_client_evaluation_end"):
            if getattr(type(cb), hook, None) not in (None, getattr(FederatedCallback, hook)):
                return f"{type(cb).__name__} acts at each client's evaluation ({hook})"
    return None


def factory(
    wanted: bool | str,
    module: torch.nn.Module,
    callbacks: Iterable[object],
    batch_limit: int | float | None = None,
) -> SegmentEvaluationFactory | None:
    """What ``vectorize_evaluation=wanted`` gives ``module`` with ``callbacks`` (and the
    epoch's ``batch_limit``): a factory (strict for True), or None (False, or "auto" where
    :func:`refusal` finds a reason); True with a reason is refused, naming it."""
    if wanted is False:
        return None
    reason = refusal(module, callbacks, batch_limit)
    if reason is not None and wanted is True:
        raise ValueError(
            f"vectorize_evaluation=True cannot evaluate clients vectorized: {reason}. "
            "Set vectorize_evaluation='auto' (client by client where it cannot)."
        )
    return None if reason is not None else SegmentEvaluationFactory(module, wanted is True)


@dataclass(frozen=True)
class SegmentEvaluationFactory:
    """Makes each epoch's :class:`SegmentEvaluation` of ``module``; ``strict``: a split
    that cannot be evaluated vectorized is an error (``vectorize_evaluation=True``)
    rather than evaluated client by client."""

    module: torch.nn.Module
    strict: bool = False

    def __call__(self, columns: Sequence[Tensor], num_positions: int) -> SegmentEvaluation:
        return SegmentEvaluation(self.module, columns, num_positions)


class SegmentEvaluation:
    """One evaluation epoch's per-client sums over ``num_positions`` clients, filled by
    :meth:`run` on each :class:`SegmentBatch` of the split's ``columns``."""

    def __init__(
        self, module: torch.nn.Module, columns: Sequence[Tensor], num_positions: int
    ) -> None:
        self.module, self.columns = module, list(columns)
        self.num_positions = num_positions
        self.totals: dict[str, Tensor] = {}
        self.counts: Tensor | None = None

    def reset(self) -> None:
        """Empty the per-client sums: an epoch's evaluation starts from none (a loader
        Lightning keeps across epochs reuses this object)."""
        self.totals, self.counts = {}, None

    def _stacked(self, batch: SegmentBatch, device: torch.device) -> list[Tensor]:
        # host: the indices are cut on the host, next to the (possibly memory-mapped) rows
        index = torch.from_numpy(batch.starts)[:, None] + torch.arange(batch.length)
        flat = index.reshape(-1)
        return [
            c.index_select(0, flat).view(*index.shape, *c.shape[1:]).to(device)
            for c in self.columns
        ]

    def _values(self, stacked: list[Tensor]) -> dict[str, Tensor]:
        module = self.module

        def one_batch(*columns: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            return module.loss_and_metrics(list(columns))

        loss, metrics = torch.func.vmap(one_batch)(*stacked)
        return {"loss": loss, **metrics}

    def run(self, batch: SegmentBatch) -> None:
        """Evaluate the G batches of ``batch`` in one call and add each one's mean·L to
        its client's sums."""
        device = self.module.device
        values = self._values(self._stacked(batch, device))
        # host: the positions are host bookkeeping, moved once to the device
        positions = torch.from_numpy(batch.positions).to(device)
        if self.counts is None:
            self.counts = torch.zeros(self.num_positions, dtype=torch.float64, device=device)
        self.counts.index_add_(
            0, positions, torch.full((len(positions),), float(batch.length), device=device,
                                     dtype=torch.float64),
        )  # fmt: skip
        for name, value in values.items():
            total = self.totals.get(name)
            if total is None:
                total = torch.zeros(self.num_positions, dtype=torch.float64, device=device)
                self.totals[name] = total
            total.index_add_(0, positions, value.detach().double().reshape(-1) * batch.length)

    def disagreement(self, batch: SegmentBatch) -> str | None:
        """Why the first batch of ``batch`` cannot be evaluated under ``vmap``, or None when
        it gives what a plain call of ``loss_and_metrics`` gives (to 1e-5): the plain call
        fails on the federation's columns, or the vmapped one fails, or they differ."""
        probe = SegmentBatch(batch.positions[:1], batch.starts[:1], batch.length)
        device = self.module.device
        with torch.no_grad():
            stacked = self._stacked(probe, device)
            try:
                loss, metrics = self.module.loss_and_metrics([c[0] for c in stacked])
            except Exception as error:  # noqa: BLE001 - any failure is the reason to give
                return (
                    f"the module's loss_and_metrics fails on a batch of the federation's "
                    f"{len(stacked)} columns even without vmap ({type(error).__name__}: "
                    f"{error}): make it take every column the federation holds"
                )
            try:
                vectorized = self._values(stacked)
            except Exception as error:  # noqa: BLE001 - any failure under vmap: not vectorizable
                return (
                    "the module's loss_and_metrics does not run under torch.func.vmap "
                    f"({type(error).__name__}: {error})"
                )
        plain = {"loss": loss, **metrics}
        agree = set(plain) == set(vectorized) and all(
            torch.allclose(
                vectorized[k].reshape(-1)[0].double(),
                plain[k].double().reshape(()),
                rtol=1e-5,
                atol=1e-6,
            )  # fmt: skip
            for k in plain
        )
        if not agree:
            return (
                "the module's loss_and_metrics gives other values under vmap than in a plain call"
            )
        return None

    def per_client(
        self, stage: str, clients: Sequence[int]
    ) -> dict[str, dict[int, tuple[float, float]]]:
        """``{f"{stage}_{name}": {client: (mean, samples)}}`` of every evaluated client."""
        if self.counts is None:
            return {}
        counts = self.counts.cpu().numpy()
        has = np.flatnonzero(counts > 0)
        ids = np.asarray(clients)[has].tolist()
        out = {}
        for name, total in self.totals.items():
            means = (total.cpu().numpy()[has] / counts[has]).tolist()
            out[f"{stage}_{name}"] = dict(zip(ids, zip(means, counts[has].tolist())))
        return out
