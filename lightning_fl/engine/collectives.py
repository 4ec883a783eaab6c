"""The engine's collectives: how the processes of a run add tensors and share small values.

Every collective the engine and its plugins run goes through :func:`across_ranks`, which
answers the run's transport, or ``None`` on one process. Two transports implement it:

- :class:`TorchDistributed`, ``torch.distributed``'s process group (gloo on CPU, NCCL on
  GPU): every pair of processes connects, for trusted clusters (the default);
- :class:`lightning_fl.flower.site.FlowerSite`, Flower's runtime: each site dials out to one
  server (a SuperLink) over TLS, and the server adds the sites' tensors and passes their
  small values on, for sites across institutions (README, "Deploying across hospitals").

A transport adds tensors in place (:meth:`Collectives.all_reduce`), hands every rank the
list of all ranks' values, in rank order (:meth:`Collectives.all_gather_object`), and
copies one rank's tensor to all (:meth:`Collectives.broadcast`). A transport that lets
sites drop (Flower's, with ``min_sites``) also completes the collectives of a round
without them: :meth:`Collectives.sum_present` names who is missing from a sum, and
:meth:`Collectives.gather_present` lists what a missing site contributes. The arithmetic around
them is the same in every transport, so a run's model is the same (to float round-off: the
order of a sum's terms may differ).

Lightning's own collectives (``sync_dist``, barriers, broadcasts of paths) are not the
engine's: under Flower they stay on each site (no process group), which is exact because
the values the engine logs with ``sync_dist`` are equal on every site by construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class Collectives(ABC):
    """What a transport offers the engine: every rank calls each method together."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor``, in place, by its sum over all ranks."""

    @abstractmethod
    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (plain values: numbers, strings, tensors,
        and lists, tuples and dicts of them)."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Replace ``tensor``, in place, by rank ``src``'s."""

    def min_sites(self, world_size: int) -> int:
        """The fewest sites a round completes with: every one of the ``world_size`` on a
        lockstep transport (``torch.distributed``); fewer where the transport lets sites
        drop (:class:`lightning_fl.flower.site.FlowerSite`'s ``min_sites``)."""
        return world_size

    def sum_present(self, tensor: torch.Tensor) -> frozenset[int]:
        """:meth:`all_reduce` over the sites still there: a site that dropped adds nothing.
        Returns the ranks missing from the sum (none on a lockstep transport)."""
        self.all_reduce(tensor)
        return frozenset()

    @property
    def dropped(self) -> frozenset[int]:
        """The ranks of the sites dropped so far (and not back); none on a lockstep
        transport."""
        return frozenset()

    def rejoining(self) -> list[int]:
        """At a round's start, while a site is missing: the ranks of the dropped sites
        that are back (started again with ``--ckpt_path last``), which the others then
        welcome (:mod:`lightning_fl.engine.rejoin`); none on a lockstep transport."""
        return []

    def gather_present(self, value: Any, absent: Any) -> list[Any]:
        """:meth:`all_gather_object` over the sites still there: a dropped site's entry is
        ``absent`` (what a site that took no part contributes, e.g. an empty dict)."""
        return self.all_gather_object(value)


class SiteFault(Exception):
    """A failure that every site raises together after comparing what the sites hold (a
    recipe, a checkpoint), naming the site at fault (``site``): a transport tells the
    server that site, rather than its own name, so the server's error names the site to
    fix, not the one that reported it."""

    def __init__(self, message: str, site: str | None = None) -> None:
        super().__init__(message)
        self.site = site


def odd_site(values: Sequence[tuple[str, Any]]) -> tuple[str, str] | None:
    """The first site whose value differs from the most common one, and a site holding
    that one (``values``: each site's (name, value) in rank order; on a tie, the first
    site's value counts as the common one); None when every site holds the same."""
    counts: dict[Any, int] = {}
    for _, value in values:
        counts[value] = counts.get(value, 0) + 1
    common = max(counts, key=counts.__getitem__)  # on a tie, the first seen: the first site's
    holder = next(name for name, value in values if value == common)
    odd = next((name for name, value in values if value != common), None)
    return None if odd is None else (odd, holder)


class Transport(Collectives):
    """A transport a recipe chooses in place of ``torch.distributed``
    (``FederatedStrategy(transport=...)``): the strategy opens it at set-up, as this
    process's ``rank`` among ``world_size`` named sites (``site``) and installs it; the
    transport closes itself when the process exits (a test after the fit still uses it),
    or when the strategy closes it on an error (``failed``, and why: ``reason``; the site
    at fault, when the error names one: ``at_fault``)."""

    @abstractmethod
    def open(self, rank: int, world_size: int, site: str) -> None: ...

    @abstractmethod
    def close(
        self, failed: bool = False, reason: str = "", at_fault: str | None = None
    ) -> None: ...


class TorchDistributed(Collectives):
    """``torch.distributed``'s default process group as the engine's transport."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def all_gather_object(self, value: Any) -> list[Any]:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, value)
        return parts

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        dist.broadcast(tensor, src=src)


_TORCH = TorchDistributed()
#: The transport a fit installed in place of ``torch.distributed`` (:func:`install`).
_installed: Collectives | None = None


def install(transport: Collectives | None) -> None:
    """Make ``transport`` the run's (``None``: ``torch.distributed`` again). The strategy
    installs it at set-up, before its first collective, and removes it at teardown."""
    global _installed
    _installed = transport


def open_transport(transport: Transport, rank: int, world_size: int, site: str) -> None:
    """Open ``transport`` as this process's ``rank`` (site ``site``) and install it."""
    transport.open(rank, world_size, site)
    install(transport)


def close_transport(transport: Transport | None, failure: BaseException) -> None:
    """Uninstall ``transport`` (if any) and close it on a fit that raised ``failure``."""
    if transport is not None:
        install(None)
        at_fault = failure.site if isinstance(failure, SiteFault) else None
        reason = f"{type(failure).__name__}: {failure}"
        transport.close(failed=True, reason=reason, at_fault=at_fault)


def across_ranks(world_size: int) -> Collectives | None:
    """The run's transport when it spans several processes; ``None`` on one process (or
    several that share no process group: each then runs alone)."""
    if world_size <= 1:
        return None
    if _installed is not None:
        return _installed
    if dist.is_available() and dist.is_initialized():
        return _TORCH
    return None


def broadcast_module(module: torch.nn.Module, group: Collectives, src: int = 0) -> None:
    """Every rank's ``module`` takes rank ``src``'s parameters and buffers: one broadcast
    per dtype (a flat vector), not one per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        by_dtype.setdefault(tensor.dtype, []).append(tensor.data)
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        group.broadcast(flat, src=src)
        parts = flat.split([t.numel() for t in tensors])
        torch._foreach_copy_(tensors, [p.view_as(t) for p, t in zip(parts, tensors)])
