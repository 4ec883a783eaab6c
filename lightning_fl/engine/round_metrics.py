"""A round's training metrics, added over the ranks inside the round's own sum.

A :class:`~lightning_fl.models.FederatedTask` keeps, per round, each training metric's
Σ value·B and Σ B over its clients' steps; the round's means are those sums added over
every rank. They ride the round's one all-reduce (``RoundEngine._all_reduce_round``),
beside the weighted update sum, rather than a collective of their own: across sites on
Flower each collective is a message to every site (README, "Deploying across hospitals"),
so a round costs one. With ``SecureAggregation`` they are masked with the update.

The metrics' names must be the same on every rank, in one order, to share a flat sum: the
first round agrees on them with one gather of the names (no values). A rank that later
logs a metric outside them flags it in the sum, and that round's sums are then gathered,
as before this module existed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_fl.engine.collectives import Collectives

#: {name: (Σ value·B, Σ B)}
Sums = dict[str, tuple[Tensor, Tensor]]

#: dtypes the sum carries metrics in (a half-precision update sum would round them)
CARRIED = (torch.float32, torch.float64)


class RoundMetricSums:
    """One module's training-metric sums of the round (``pop_local``: this rank's, then
    cleared), over the ranks: :meth:`part` is this rank's share of the round's sum,
    :meth:`take` receives the total, :meth:`totals` gives the module the round's sums."""

    def __init__(self, pop_local: Callable[[], Sums]) -> None:
        self._pop_local = pop_local
        #: the metrics' names, agreed by every rank in the first round that shares a sum
        self.names: tuple[str, ...] | None = None
        self._local: Sums | None = None  # this rank's, kept for a gather
        self._total: Sums | None = None  # over the ranks, from the round's sum

    def part(self, group: Collectives, device: torch.device, dtype: torch.dtype) -> Tensor | None:
        """This rank's share of the round's sum: 1 if it logged a metric outside the
        agreed names (else 0), then Σ value·B and Σ B of each agreed name (zeros for a
        name it did not log). None when ``dtype`` cannot carry them (each rank decides
        alike: the update sum's dtype is the same on every rank)."""
        self._local, self._total = self._pop_local(), None
        if dtype not in CARRIED:
            return None
        if self.names is None:  # the first round: the names, not the values
            listed = group.gather_present(sorted(self._local), [])
            self.names = tuple(sorted({name for names in listed for name in names}))
        values = [float(any(name not in self.names for name in self._local))]
        for name in self.names:
            total, count = self._local.get(name, (0.0, 0.0))
            values += [float(total), float(count)]
        return torch.tensor(values, dtype=dtype, device=device)

    def take(self, summed: Tensor) -> None:
        """The round's sum of every rank's :meth:`part`. When a rank flagged a metric
        outside the names, nothing is taken: :meth:`totals` gathers the round's values."""
        if float(summed[0]) > 0:
            return
        self._total = {
            name: (summed[1 + 2 * i], summed[2 + 2 * i])
            for i, name in enumerate(self.names)
            if float(summed[2 + 2 * i]) > 0  # a metric no rank logged this round
        }

    def totals(self, group: Collectives | None, device: torch.device) -> Sums:
        """The round's sums over every rank: those taken from the round's sum; on one
        process, this rank's own; else (no part was sent, or a rank flagged a name) one
        gather of every rank's, added in rank order."""
        local, self._local = self._local, None
        total, self._total = self._total, None
        if local is None:
            local = self._pop_local()
        if group is None:
            return local
        if total is None:
            total = gather_sums(local, group, device)
        dtype = torch.get_default_dtype()
        return {name: (t.to(device, dtype), c.to(device, dtype)) for name, (t, c) in total.items()}


def gather_sums(sums: Sums, group: Collectives, device: torch.device) -> Sums:
    """Every rank's ``sums`` added, in rank order; a rank whose clients logged nothing
    this round (it only padded) gets the others' sums, so all ranks log the same keys."""
    mine = {name: (float(total), float(count)) for name, (total, count) in sums.items()}
    parts = group.gather_present(mine, {})  # a site that dropped logged nothing
    added: dict[str, list[float]] = {}
    for part in parts:
        for name, (total, count) in part.items():
            entry = added.setdefault(name, [0.0, 0.0])
            entry[0] += total
            entry[1] += count
    dtype = torch.get_default_dtype()
    return {
        name: (
            torch.tensor(t, dtype=dtype, device=device),
            torch.tensor(c, dtype=dtype, device=device),
        )
        for name, (t, c) in added.items()
    }
