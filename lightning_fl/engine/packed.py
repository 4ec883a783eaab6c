"""The federation's training data on the training device (docs/architecture.md, "Where the
data lives").

An in-memory federation (every client's training set a plain ``TensorDataset``, no stream)
is packed once, at fit set-up, into one contiguous tensor per dataset column with
per-client offsets, and placed on the training device. A vectorized chunk then draws every
batch of its clients' local steps with one index computation per chunk and one gather per
column and step: no per-client Python iterator, no host-to-device copy per step.

The batches are exactly those of the client's loader on the sequential path
(:class:`~lightning_fl.engine.data_contract.TensorBatchLoader` shuffled by the generator
seeded with (seed, "data", round, client)): pass p over the client's data is the p-th
``randperm(n)`` of that generator, and batch j of the round is samples
``perm_p[b·B : (b+1)·B]`` of pass p = j // ⌈n/B⌉, b = j mod ⌈n/B⌉. What stays per client
is that permutation draw, a few C calls on the host (about 9 µs a client and a pass on a
CPU); the seeds of all the chunk's clients come from one vectorized call
(:func:`~lightning_fl.engine.seeding.derive_seeds`).

A federation that does not fit (more than half of the device's free memory; a view of the
clients' tensors where they already lie on that device needs none), a stream, a
dataset that is not a plain ``TensorDataset`` (reference pairs, lazily decoded images)
keeps the loaders of today's path; the strategy says which, and why, in the log.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import TensorDataset

from lightning_fl.engine.data_contract import FederatedDataModule
from lightning_fl.engine.seeding import derive_seeds
from lightning_fl.engine.tensors import adjacent_view

#: The share of the device's free memory a packed federation may take.
MEMORY_SHARE = 0.5


class TooLarge(str):
    """The reason a federation is not packed when it is its size (a user can act on it)."""


class PackedFederation:
    """Every client's training tensors, concatenated on one device.

    Args:
        columns: one tensor per dataset column (inputs, targets, ...), clients one after
            another along dimension 0, on the training device.
        offsets: host-side bookkeeping: client c's samples are rows
            ``offsets[c] : offsets[c] + sizes[c]`` of every column.
        sizes: each client's number of training samples (0: none, or unseen).
        batch_sizes: each client's training batch size (the datamodule's
            ``training_batch_size`` of its dataset).
    """

    def __init__(
        self,
        columns: Sequence[Tensor],
        offsets: np.ndarray,
        sizes: np.ndarray,
        batch_sizes: np.ndarray,
    ) -> None:
        self.columns = list(columns)
        self.offsets, self.sizes, self.batch_sizes = offsets, sizes, batch_sizes

    @property
    def device(self) -> torch.device:
        return self.columns[0].device

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.columns)

    def client_dataset(self, client: int) -> TensorDataset:
        """Client ``client``'s training data as views of the packed tensors (the
        sequential path's loaders read it on the device)."""
        start, size = int(self.offsets[client]), int(self.sizes[client])
        return TensorDataset(*(c[start : start + size] for c in self.columns))

    def num_batches_per_pass(self, clients: Sequence[int]) -> np.ndarray:
        """⌈n/B⌉ of each of ``clients``."""
        index = np.asarray(clients, dtype=np.int64)
        return -(-self.sizes[index] // self.batch_sizes[index])

    def batch_length(self, client: int, step: int) -> int:
        """The number of samples in ``client``'s local batch ``step``: B, or what is left
        of its n samples in the last batch of a pass."""
        size, batch = int(self.sizes[client]), int(self.batch_sizes[client])
        return min(batch, size - (step % -(-size // batch)) * batch)

    def chunk_batches(
        self,
        seed: int,
        round_idx: int,
        clients: Sequence[int],
        num_batches: Sequence[int],
        pad_short_batches: bool = False,
    ) -> ChunkBatches:
        """The sample indices of every local batch of ``clients`` (row r: ``clients[r]``,
        ``num_batches[r]`` batches) this round, grouped per local step by batch size; with
        ``pad_short_batches``, one group a step: a short batch is padded to the step's
        widest with other samples of the same client, which the group's
        :attr:`StepGroup.sample_mask` weights out."""
        # host: index arithmetic on the numpy metadata; the indices cross once, at the end
        index = np.asarray(clients, dtype=np.int64)
        sizes, batch = self.sizes[index], self.batch_sizes[index]
        steps = np.asarray(num_batches, dtype=np.int64)
        per_pass = -(-sizes // batch)
        passes = -(-steps // per_pass)
        orders = _permutations(derive_seeds(seed, "data", round_idx, last=index), sizes, passes)
        longest, widest = int(steps.max()), int(batch.max())
        j = torch.arange(longest)[None, :]
        n, b = torch.from_numpy(sizes)[:, None], torch.from_numpy(batch)[:, None]
        within = j % torch.from_numpy(per_pass)[:, None]
        start = (j // torch.from_numpy(per_pass)[:, None]) * orders.shape[2] + within * b
        orders = orders.view(len(index), -1)
        length = torch.minimum(b, n - within * b)  # the pass's last batch may be short
        length = torch.where(j < torch.from_numpy(steps)[:, None], length, 0)
        position = start[..., None] + torch.arange(widest)
        position = position.clamp_(max=orders.shape[1] - 1).view(len(index), -1)
        samples = orders.gather(1, position).view(len(index), longest, widest)
        samples += torch.from_numpy(self.offsets[index])[:, None, None]
        groups = _padded_groups(length) if pad_short_batches else _groups(length)
        return ChunkBatches(samples.to(self.device), groups)

    def gather(self, samples: Tensor) -> list[Tensor]:
        """The batch of sample indices ``samples`` (any shape), one tensor per column
        (``index_select`` of the flattened indices: 3–4× faster than advanced indexing
        with a strided index on a CPU)."""
        flat = samples.reshape(-1)
        return [c.index_select(0, flat).view(*samples.shape, *c.shape[1:]) for c in self.columns]


@dataclass
class StepGroup:
    """The rows of a chunk that take a local step on batches of ``size`` samples; where
    their batches were padded, ``sample_mask[k, i]`` says whether sample i of row k's
    batch is one of its own (its first ``lengths[k]``), ``lengths`` each row's count."""

    rows: list[int]
    rows_index: Tensor | None  # on the device; None: every row of the chunk
    size: int
    lengths: Tensor | None = None  # on the device; None: every row has ``size`` samples
    sample_mask: Tensor | None = None


class ChunkBatches:
    """A chunk's batches for the round: ``samples[r, j, :size]`` are the indices of row r's
    j-th local batch (on the device); ``steps[j]`` the groups of rows of step j."""

    def __init__(
        self, samples: Tensor, steps: list[list[tuple[list[int], int, Tensor | None]]]
    ) -> None:
        self.samples = samples
        rows_total, device = samples.shape[0], samples.device
        self.steps: list[list[StepGroup]] = [
            [_step_group(rows, size, lengths, rows_total, device) for rows, size, lengths in groups]
            for groups in steps
        ]

    def __len__(self) -> int:
        return len(self.steps)

    def batch(self, step: int, group: StepGroup, packed: PackedFederation) -> list[Tensor]:
        """The stacked batch of ``group`` at local step ``step`` (rows, size, ...)."""
        samples = self.samples[:, step, : group.size]
        if group.rows_index is not None:
            samples = samples[group.rows_index]
        return packed.gather(samples)


def _permutations(seeds: np.ndarray, sizes: np.ndarray, passes: np.ndarray) -> Tensor:
    """``[rows, max(passes), max(sizes)]``: row r's permutation of its ``sizes[r]``
    samples in each of its ``passes[r]`` passes, one ``randperm`` per pass from a
    generator seeded with ``seeds[r]``, as
    :class:`~lightning_fl.engine.data_contract.TensorBatchLoader` draws them; unused
    entries are zeros. Host-side bookkeeping (a CPU generator): two C calls per client and
    a call per pass, each written in place (about 9 µs a client and pass on a CPU)."""
    # host: a CPU generator gives the same permutations whatever the device
    width = int(sizes.max())
    out = torch.zeros(len(seeds), int(passes.max()), width, dtype=torch.int64)
    rng = torch.Generator()
    seed_rng, randperm = rng.manual_seed, torch.randperm
    for row, seed, n, count in zip(out.unbind(0), seeds.tolist(), sizes.tolist(), passes.tolist()):
        seed_rng(seed)
        for order in row.unbind(0)[:count]:
            randperm(n, generator=rng, out=order if n == width else order[:n])
    return out


def _step_group(
    rows: list[int], size: int, lengths: Tensor | None, rows_total: int, device: torch.device
) -> StepGroup:
    rows_index = None if len(rows) == rows_total else torch.tensor(rows, device=device)
    if lengths is None:
        return StepGroup(rows, rows_index, size)
    counts = lengths.to(device)
    mask = torch.arange(size, device=device)[None, :] < counts[:, None]
    return StepGroup(rows, rows_index, size, counts, mask)


def _groups(length: Tensor) -> list[list[tuple[list[int], int, Tensor | None]]]:
    """Per step (column of ``length``, rows × steps): the rows with a batch, grouped by
    its size, larger sizes first; O(distinct sizes) Python per step."""
    out = []
    for column in length.t():
        groups = []
        for size in torch.unique(column).flip(0).tolist():
            if size > 0:
                groups.append((torch.nonzero(column == size).flatten().tolist(), size, None))
        out.append(groups)
    return out


def _padded_groups(length: Tensor) -> list[list[tuple[list[int], int, Tensor | None]]]:
    """Per step: one group, the rows with a batch, padded to the longest of them (their
    lengths; None where every row's batch is that long); O(1) Python per step. Every
    step has a row with a batch: the chunk's steps are its longest client's."""
    out = []
    for column in length.t():
        rows = torch.nonzero(column > 0).flatten()
        lengths = column[rows]
        size, shortest = int(lengths.max()), int(lengths.min())
        out.append([(rows.tolist(), size, None if shortest == size else lengths)])
    return out


def check_data_on_device(data_on_device: Any) -> bool | str:
    """``data_on_device`` as given, refused unless True, False or ``"auto"``."""
    if data_on_device not in (True, False, "auto"):
        raise ValueError(f"data_on_device must be True, False or 'auto', got {data_on_device!r}.")
    return data_on_device


def pack_for_fit(
    datamodule: FederatedDataModule,
    counts: Sequence[int],
    device: torch.device,
    data_on_device: bool | str,
    vectorize: bool,
    silos: bool,
) -> PackedFederation | None:
    """A fit's packed federation (``FederatedStrategy(data_on_device=...)``; ``"auto"``:
    with ``vectorize`` or on an accelerator; never in silo mode, where packing would read
    every client's data), or None; the log says which, and why."""
    wanted = data_on_device
    if wanted == "auto":
        wanted = vectorize or device.type != "cpu"
    if not wanted:
        return None
    if silos:
        rank_zero_info("lightning_fl: silo mode: the training data stays with its silo.")
        return None
    packed, reason = pack_federation(datamodule, list(counts), device)
    if packed is None:
        message = f"lightning_fl: the training data stays with the datamodule's loaders: {reason}."
        if isinstance(reason, TooLarge):  # batches cross from the host at every step
            rank_zero_warn(
                message + " Free device memory, or set data_on_device=False to silence this."
            )
        elif data_on_device is True:
            rank_zero_warn(message + " Set data_on_device='auto' to silence this.")
        else:
            rank_zero_info(message)
        return None
    rank_zero_info(
        f"lightning_fl: the training data ({len(packed.columns[0])} samples, "
        f"{packed.nbytes / 2**20:.1f} MiB) is packed on {packed.device}."
    )
    return packed


def pack_federation(
    datamodule: FederatedDataModule, counts: Sequence[int], device: torch.device
) -> tuple[PackedFederation | None, str]:
    """The packed federation of ``datamodule``'s training data on ``device``, or None and
    the reason it stays with the datamodule's loaders."""
    if type(datamodule).set_round is not FederatedDataModule.set_round:
        return None, "its clients' data changes every round (a stream)"
    arrays = datamodule.split_arrays("train")
    if arrays is not None:
        return _pack_arrays(datamodule, *arrays, counts, device)
    datasets = {c: datamodule.client_dataset(c, "train") for c, n in enumerate(counts) if n > 0}
    others = sorted({type(d).__name__ for d in datasets.values() if type(d) is not TensorDataset})
    if others:
        return None, f"its training sets are {', '.join(others)}, not plain TensorDatasets"
    first = next(iter(datasets.values()))
    widths = {len(d.tensors) for d in datasets.values()}
    if len(widths) != 1:
        return None, "its clients' datasets have different numbers of tensors"
    parts = [[d.tensors[k] for d in datasets.values()] for k in range(len(first.tensors))]
    views = [adjacent_view(column) for column in parts]
    on_host = all(v is not None and v.device == device for v in views)
    nbytes = sum(t.numel() * t.element_size() for d in datasets.values() for t in d.tensors)
    free = _free_memory(device)
    if not on_host and nbytes > MEMORY_SHARE * free:
        return None, TooLarge(
            f"it takes {nbytes / 2**20:.1f} MiB, more than {MEMORY_SHARE:.0%} of the "
            f"{free / 2**20:.1f} MiB free on {device}"
        )
    sizes = np.zeros(len(counts), dtype=np.int64)
    batch_sizes = np.ones(len(counts), dtype=np.int64)
    for c, d in datasets.items():
        sizes[c] = len(d)
        batch_sizes[c] = datamodule.training_batch_size(d)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    columns = [
        (torch.cat(column) if view is None else view).to(device)
        for column, view in zip(parts, views)
    ]
    return PackedFederation(columns, offsets, sizes, batch_sizes), ""


def _pack_arrays(
    datamodule: FederatedDataModule,
    columns: Sequence[Tensor],
    offsets: np.ndarray,
    counts: Sequence[int],
    device: torch.device,
) -> tuple[PackedFederation | None, str]:
    """A federation that is already arrays with offsets (``split_arrays``): its columns
    as they are (no copy on the CPU), moved once to an accelerator; no per-client Python."""
    nbytes = sum(c.numel() * c.element_size() for c in columns)
    free = _free_memory(device)
    if columns[0].device != device and nbytes > MEMORY_SHARE * free:
        return None, TooLarge(
            f"it takes {nbytes / 2**20:.1f} MiB, more than {MEMORY_SHARE:.0%} of the "
            f"{free / 2**20:.1f} MiB free on {device}"
        )
    sizes = np.asarray(counts, dtype=np.int64).copy()  # unseen clients count 0
    if type(datamodule).training_batch_size is FederatedDataModule.training_batch_size:
        batch_sizes = np.full(len(sizes), datamodule.batch_size, dtype=np.int64)
    else:  # a per-dataset batch size (full-batch GD): asked of each client with data
        batch_sizes = np.ones(len(sizes), dtype=np.int64)
        for c in np.flatnonzero(sizes).tolist():
            batch_sizes[c] = datamodule.training_batch_size(datamodule.client_dataset(c, "train"))
    columns = [c.to(device) for c in columns]
    starts = np.asarray(offsets[:-1], dtype=np.int64)
    return PackedFederation(columns, starts, sizes, batch_sizes), ""


def _free_memory(device: torch.device) -> int:
    """Bytes free on ``device``: the accelerator's free memory, or the host's available
    memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume it fits
        return 1 << 62
