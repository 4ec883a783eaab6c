"""The engine's collectives in process (``lightning_fl/engine/collectives.py``): which
transport a run's collectives go through, a transport opened, installed and closed with
the failure's reason, ``torch.distributed``'s group as a transport, and a module broadcast
one flat vector per dtype. The transports themselves are run across processes by
tests/test_distributed.py (gloo) and tests/test_flower_relay.py (Flower); these checks
reach the lines only other processes run there."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_fl.engine import collectives
from lightning_fl.engine.collectives import (
    Transport,
    across_ranks,
    broadcast_module,
    close_transport,
    install,
    open_transport,
)


class _Recording(Transport):
    """A transport that records what it is asked, as a 2-site run's rank 1 would see it:
    rank 0 holds ``source`` (its broadcast value), and a sum adds the other rank's ones."""

    def __init__(self, source: dict[torch.dtype, torch.Tensor] | None = None) -> None:
        self.calls: list[tuple] = []
        self.source = source or {}

    def open(self, rank: int, world_size: int, site: str) -> None:
        self.calls.append(("open", rank, world_size, site))

    def close(self, failed: bool = False, reason: str = "", at_fault: str | None = None) -> None:
        self.calls.append(("close", failed, reason))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        tensor.add_(1)

    def all_gather_object(self, value: Any) -> list[Any]:
        return ["rank 0's", value]

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.calls.append(("broadcast", tensor.dtype, tensor.numel(), src))
        tensor.copy_(self.source[tensor.dtype])


@pytest.fixture(autouse=True)
def _nothing_installed():
    install(None)
    yield
    install(None)


def test_one_process_has_no_collectives_and_several_use_the_installed_transport():
    transport = _Recording()
    assert across_ranks(1) is None and across_ranks(0) is None
    assert across_ranks(2) is None  # no process group and no transport: each runs alone
    install(transport)
    assert across_ranks(2) is transport and across_ranks(1) is None
    install(None)
    assert across_ranks(3) is None


def test_torch_distributed_is_the_transport_of_an_initialized_group(monkeypatch):
    monkeypatch.setattr(collectives.dist, "is_initialized", lambda: True)
    assert across_ranks(2) is collectives._TORCH
    install(_Recording())
    assert across_ranks(2) is not collectives._TORCH  # an installed transport wins


def test_a_transport_is_opened_installed_and_closed_with_the_failure():
    transport = _Recording()
    open_transport(transport, 1, 3, "hungary")
    assert transport.calls == [("open", 1, 3, "hungary")]
    assert across_ranks(3) is transport
    close_transport(transport, ValueError("the sample counts differ"))
    assert transport.calls[-1] == ("close", True, "ValueError: the sample counts differ")
    assert across_ranks(3) is None  # uninstalled
    close_transport(None, RuntimeError("no transport"))  # nothing to close


def test_torch_distributeds_collectives_call_the_process_group(monkeypatch):
    """Each method calls ``torch.distributed``'s own, on the tensor in place; the gather
    lists every rank's value in rank order (a fake group of 3 ranks here)."""
    seen: list[tuple] = []

    def all_reduce(tensor):
        seen.append(("all_reduce", tensor))
        tensor.mul_(3)  # 3 ranks holding the same value

    def all_gather_object(parts, value):
        seen.append(("all_gather_object", len(parts)))
        parts[:] = [value * r for r in (1, 2, 3)]

    def broadcast(tensor, src):
        seen.append(("broadcast", src))
        tensor.fill_(7)

    fake = SimpleNamespace(all_reduce=all_reduce, all_gather_object=all_gather_object,
                           broadcast=broadcast, get_world_size=lambda: 3)  # fmt: skip
    monkeypatch.setattr(collectives, "dist", fake)
    torch_group = collectives.TorchDistributed()
    tensor = torch.tensor([1.0, 2.0])
    torch_group.all_reduce(tensor)
    assert tensor.tolist() == [3.0, 6.0] and seen[0][1] is tensor
    assert torch_group.all_gather_object(5) == [5, 10, 15]
    assert seen[1] == ("all_gather_object", 3)
    torch_group.broadcast(tensor, src=2)
    assert tensor.tolist() == [7.0, 7.0] and seen[2] == ("broadcast", 2)


def test_a_module_takes_the_sources_parameters_and_buffers_one_broadcast_per_dtype():
    """A float32 network with a BatchNorm (its int64 ``num_batches_tracked``) and a
    float64 parameter: three dtypes, three broadcasts of one flat vector each, from rank
    ``src``; every tensor then holds the source's values, in place."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    module.register_parameter("scale", torch.nn.Parameter(torch.ones(4, dtype=torch.float64)))
    source = {
        torch.float32: torch.arange(16, dtype=torch.float32),  # w, b, bn w, b, mean, var
        torch.float64: torch.tensor([0.5, 1.5, 2.5, 3.5], dtype=torch.float64),
        torch.int64: torch.tensor([9]),
    }
    weight = module[0].weight
    transport = _Recording(source)
    broadcast_module(module, transport, src=1)
    broadcasts = {c[1]: c[2:] for c in transport.calls if c[0] == "broadcast"}
    assert len(broadcasts) == len(transport.calls) == 3  # one a dtype
    assert broadcasts == {torch.float32: (16, 1), torch.float64: (4, 1), torch.int64: (1, 1)}
    assert module[0].weight is weight  # in place
    assert module[0].weight.flatten().tolist() == list(range(6))
    assert module[0].bias.tolist() == [6.0, 7.0]
    assert module[1].weight.tolist() == [8.0, 9.0] and module[1].bias.tolist() == [10.0, 11.0]
    assert module[1].running_mean.tolist() == [12.0, 13.0]
    assert module[1].running_var.tolist() == [14.0, 15.0]
    assert module[1].num_batches_tracked.item() == 9
    assert module.scale.tolist() == [0.5, 1.5, 2.5, 3.5]
