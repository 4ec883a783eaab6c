"""A site's end of a Flower run: the engine's collectives through the site's mailbox."""

from __future__ import annotations

import atexit
import os
import socket
from pathlib import Path
from typing import Any

import torch

from lightning_fl.engine.collectives import Transport
from lightning_fl.flower import wire


class FlowerRunStopped(RuntimeError):
    """The Flower server stopped the run (a site failed, dropped or disagreed)."""


class FlowerSite(Transport):
    """The engine's collectives as steps of a Flower run (:mod:`lightning_fl.flower`).

    The site listens on its mailbox, a Unix socket (mode 0600) that the site's ClientApp
    opens once per Flower message: the message's request carries the result of the site's
    last collective, and the ClientApp's answer carries the site's part of the next one.
    Nothing listens on the network: the SuperNode dials out.

    Args:
        mailbox: the socket's path; ``{silo}`` is replaced by the site's name. The site's
            SuperNode is started with ``--node-config 'mailbox="<the same path>"'``.
        timeout: seconds to wait for the server's next message before the site stops
            (a step's wait includes every other site's local training of the round).
        min_sites: the fewest sites a round completes with (default: every site). With
            fewer than all, a site that stops answering during the rounds (its process
            killed, its machine gone) is dropped from the run, and the others go on
            while at least ``min_sites`` remain: its clients' updates of the round are
            dropped updates (``fl/dropped_updates``), and ``SecureAggregation`` runs the
            protocol that survives it (Bonawitz et al. 2017, threshold ``min_sites``).
            The set-up's steps, and a plugin's own collectives, still need every site.
    """

    def __init__(
        self, mailbox: str = "flower/{silo}.sock", timeout: float = 600.0,
        min_sites: int | None = None,
    ) -> None:  # fmt: skip
        if timeout <= 0:
            raise ValueError(f"FlowerSite timeout must be positive seconds, got {timeout}.")
        if min_sites is not None and (isinstance(min_sites, bool) or min_sites < 1):
            raise ValueError(f"FlowerSite min_sites must be an integer >= 1, got {min_sites!r}.")
        self.mailbox, self.timeout, self._min_sites = mailbox, float(timeout), min_sites
        self._absent: frozenset[int] = frozenset()  # the sites the server dropped
        self._listener: socket.socket | None = None
        self._open: socket.socket | None = None  # the request whose answer is due
        self._identity: dict[str, Any] = {}
        self._world_size = 1
        self._stopped = False  # the server ended the run: nothing more to answer
        self.path: Path | None = None

    # ------------------------------------------------------------------ Transport
    def open(self, rank: int, world_size: int, site: str) -> None:
        if self._listener is not None:  # a test after the fit: the run goes on
            return
        if self._min_sites is not None and self._min_sites > world_size:
            raise ValueError(
                f"FlowerSite(min_sites={self._min_sites}) on a run of {world_size} sites: "
                f"set min_sites to at most {world_size}."
            )
        self.path = Path(wire.check_mailbox(self.mailbox.format(silo=site, rank=rank)))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_mask = os.umask(0o177)  # the socket is this user's alone from its creation
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old_mask)
        listener.listen(1)
        atexit.register(self.close)
        listener.settimeout(self.timeout)
        self._listener = listener
        self._identity = {"rank": rank, "site": site}
        self._world_size = world_size

    def close(self, failed: bool = False, reason: str = "", at_fault: str | None = None) -> None:
        """Answer the pending request with ``done`` (or ``failed``: ``reason``, and the
        site at fault when the error names one), so the server ends the run, and remove
        the mailbox."""
        if self._listener is None:
            return
        try:
            if self._stopped:
                return
            if failed:
                extra = {"at_fault": at_fault} if at_fault else {}
                self._answer("failed", reason or "the site's fit failed", extra=extra)
            else:
                self._answer("done", None)
        except (OSError, FlowerRunStopped):  # ConnectionError and TimeoutError included
            pass  # the server already ended the run
        finally:
            self._listener.close()
            self._listener = None
            if self.path is not None:
                self.path.unlink(missing_ok=True)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        total = self._exchange("sum", tensor.detach().cpu())
        tensor.copy_(total.to(tensor.device))

    def all_gather_object(self, value: Any) -> list[Any]:
        return self._exchange("gather", value)

    def min_sites(self, world_size: int) -> int:
        return world_size if self._min_sites is None else self._min_sites

    def sum_present(self, tensor: torch.Tensor) -> frozenset[int]:
        total = self._exchange("sum", tensor.detach().cpu(), may_miss=True)
        tensor.copy_(total.to(tensor.device))
        return self._absent

    @property
    def dropped(self) -> frozenset[int]:
        return self._absent

    def rejoining(self) -> list[int]:
        if not self._absent:
            return []
        return list(self._exchange("rejoin", None, may_miss=True))

    def gather_present(self, value: Any, absent: Any) -> list[Any]:
        parts = self._exchange("gather", value, may_miss=True)
        return [absent if rank in self._absent else part for rank, part in enumerate(parts)]

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Rank ``src``'s tensor: a sum to which every other site adds zeros (exact)."""
        mine = tensor if self._identity["rank"] == src else torch.zeros_like(tensor)
        self.all_reduce(mine)
        tensor.copy_(mine)

    # ------------------------------------------------------------------ the mailbox
    def _exchange(self, op: str, payload: Any, may_miss: bool = False) -> Any:
        """Answer the pending request with this site's part, then wait for the next
        request, which carries the result (and the sites dropped so far); keep it pending
        for the next collective. ``may_miss``: the step may complete without a site that
        drops (at least ``min_sites`` answering)."""
        self._answer(op, payload, may_miss)
        request = self._next_request()
        self._absent = frozenset(request.get("absent", ()))
        return request["result"]

    def _answer(
        self, op: str, payload: Any, may_miss: bool = False, extra: dict | None = None
    ) -> None:
        if self._open is None:  # the run's first step: its request carries no result
            self._next_request()
        connection, self._open = self._open, None
        answer = {**self._identity, "op": op, "payload": payload, **(extra or {})}
        if may_miss:
            answer["min_sites"] = self.min_sites(self._world_size)
        with connection:
            wire.send_frame(connection, wire.encode(answer))

    def _next_request(self) -> dict[str, Any]:
        if self._listener is None:
            raise RuntimeError("FlowerSite is not open: the strategy opens it at set-up.")
        try:
            connection, _ = self._listener.accept()
        except TimeoutError:
            raise FlowerRunStopped(
                f"site {self._identity['site']!r} had no message from the Flower server for "
                f"{self.timeout:.0f} s (mailbox {self.path}): is the run submitted (flwr run) "
                "and this site's SuperNode started with this mailbox? Raise FlowerSite's "
                "timeout if a round takes longer."
            ) from None
        connection.settimeout(self.timeout)
        request = wire.decode(wire.read_frame(connection))
        if "stop" in request:
            connection.close()
            self._stopped = True
            raise FlowerRunStopped(f"the Flower server stopped the run: {request['stop']}")
        self._open = connection
        return request
