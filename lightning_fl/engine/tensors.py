"""The tensors that are federated (parameters and floating buffers) and their update math.

Everything is done with ``torch._foreach_*`` over lists, in place where possible.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter, methodcaller

import numpy as np
import torch
from torch import Tensor, nn

TensorList = list[Tensor]


class FederatedTensors:
    """The module's parameters followed by its floating-point buffers, by reference.

    Integer buffers (for example BatchNorm's ``num_batches_tracked``) stay local.
    """

    def __init__(self, module: nn.Module) -> None:
        self.param_names = [name for name, _ in module.named_parameters()]
        self.buffer_names = [
            name for name, b in module.named_buffers() if torch.is_floating_point(b)
        ]
        self.params: TensorList = [p for _, p in module.named_parameters()]
        self.tensors: TensorList = self.params + [
            b for _, b in module.named_buffers() if torch.is_floating_point(b)
        ]

    @property
    def num_params(self) -> int:
        return len(self.params)

    @torch.no_grad()
    def clone(self) -> TensorList:
        return [t.detach().clone() for t in self.tensors]

    @torch.no_grad()
    def load_(self, values: TensorList) -> None:
        torch._foreach_copy_(self.tensors, values)

    @torch.no_grad()
    def minus(self, reference: TensorList) -> TensorList:
        """The update: these tensors minus ``reference``."""
        return torch._foreach_sub([t.detach() for t in self.tensors], reference)


def float_names(state_dict: dict[str, Tensor]) -> list[str]:
    """The floating-point entries of a state dict, in its order: what a round averages (an
    integer buffer, such as BatchNorm's count, keeps its value)."""
    return [name for name, value in state_dict.items() if value.is_floating_point()]


def flatten(tensors: TensorList) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def flat_size(tensors: TensorList) -> int:
    """The length of :func:`flatten` of ``tensors``."""
    return sum(t.numel() for t in tensors)


def unflatten(flat: Tensor, like: TensorList) -> TensorList:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def add_flat_(tensors: TensorList, flat: Tensor) -> None:
    """tensors += unflatten(flat), in place."""
    offset = 0
    for t in tensors:
        t.add_(flat[offset : offset + t.numel()].view_as(t).to(t))
        offset += t.numel()


def all_finite(tensors: TensorList) -> bool:
    """False if any entry is NaN or ±Inf, with one host synchronization. Entries are
    tested one by one: a norm would overflow to Inf on a large but finite update (1e20)."""
    if not tensors:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def zeros_like(tensors: TensorList) -> TensorList:
    return [torch.zeros_like(t) for t in tensors]


#: A tensor's number of rows, called in C (``len`` of a tensor is a Python method).
row_count = methodcaller("size", 0)


def uniform_rows(parts: Sequence[Tensor]) -> bool:
    """Whether ``parts`` share one dtype, device and row shape (all but the first
    dimension): whether they concatenate without promotion. One pass in C per property."""
    return (
        len(set(map(attrgetter("dtype"), parts))) == 1
        and len(set(map(attrgetter("device"), parts))) == 1
        and len({shape[1:] for shape in map(attrgetter("shape"), parts)}) == 1
    )


def adjacent_view(parts: Sequence[Tensor]) -> Tensor | None:
    """The concatenation of ``parts`` as a view, when they already lie one after another
    in one contiguous storage (clients cut as slices of one tensor): no copy, and no
    memory to find. None otherwise. Each check is one pass in C over the parts
    (``map``): 10⁵ clients' tensors take milliseconds. Parts that lie end to end in
    memory, inside the first's storage, share it: a live storage's bytes are its own
    (an empty part has no address: 0)."""
    first = parts[0]
    if not uniform_rows(parts) or not all(map(Tensor.is_contiguous, parts)):
        return None
    count = len(parts)
    starts = np.fromiter(map(Tensor.storage_offset, parts), np.int64, count)
    ends = starts + np.fromiter(map(Tensor.numel, parts), np.int64, count)
    pointers = np.fromiter(map(Tensor.data_ptr, parts), np.int64, count)
    offset, storage, item = first.storage_offset(), first.untyped_storage(), first.element_size()
    if (
        (starts[1:] != ends[:-1]).any()
        or ((pointers - starts * item != storage.data_ptr()) & (ends > starts)).any()
        or ends[-1] * item > storage.nbytes()
    ):
        return None
    rows = int(np.fromiter(map(row_count, parts), np.int64, count).sum())
    shape, stride = (rows, *first.shape[1:]), first.stride()
    return first.new_empty(0).set_(storage, offset, shape, stride)
