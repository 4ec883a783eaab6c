"""The Flower apps of a lightning-fl federation: the server's relay and the sites' courier.

The federation's Flower App (``recipes/flower/``, submitted with ``flwr run``) names
``server_app`` and ``client_app``. Its run config (``[tool.flwr.app.config]``):

- ``sites``: how many sites the recipe names (the run waits for that many SuperNodes);
- ``step-timeout``: seconds a step may take, a round's local training included; a site
  that does not answer in time stops the run, naming it (default 600);
- ``site-start-timeout``: seconds the courier waits for the site's ``lightning-fl fit``
  to open its mailbox (default 120).

What the server receives at each step, from each site: its rank and name, the kind of
collective, and its part: a tensor to add (the round's weighted update sum and declared
round sums; masked limbs with ``SecureAggregation``) or a small value to list (names and
recipe digests at set-up, sample counts, the round's metric sums, per-client evaluation
metrics). What it sends back: the sum, or the list. It keeps nothing between runs.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from lightning_fl.flower import wire  # torch only when a value is encoded

logger = logging.getLogger(__name__)

server_app = ServerApp()
client_app = ClientApp()

_RECORD = "lightning_fl"


class SiteFailure(RuntimeError):
    """A step the server cannot complete: a site failed, dropped or disagreed."""


@dataclass(frozen=True)
class RunSettings:
    """The Flower run config the apps read (:mod:`lightning_fl.flower.apps`)."""

    sites: int
    step_timeout: float = 600.0
    site_start_timeout: float = 120.0

    @property
    def probe_timeout(self) -> float:
        """Seconds the server waits for a dropped site's answer when it probes whether the
        site is back (at a round's end, while a site is missing)."""
        return min(self.step_timeout, 30.0)

    @classmethod
    def read(cls, run_config: Mapping[str, Any]) -> RunSettings:
        if "sites" not in run_config:
            raise SiteFailure(
                "the Flower run config has no 'sites': submit the run with "
                "flwr run ... --run-config 'sites=<the number of sites in the recipe>'."
            )
        settings = cls(
            sites=int(run_config["sites"]),
            step_timeout=float(run_config.get("step-timeout", 600.0)),
            site_start_timeout=float(run_config.get("site-start-timeout", 120.0)),
        )
        if settings.sites < 1 or settings.step_timeout <= 0:
            raise SiteFailure(f"sites must be >= 1 and step-timeout > 0, got {settings}.")
        return settings


#: What :meth:`StepRelay.combine` returns when the sites ask who rejoins: the server
#: probes the dropped sites (``run_steps``), and the result is the ranks that came back.
REJOIN = "rejoin"


class StepRelay:
    """What the server does with one step's answers: adds the sites' tensors or lists
    their values in rank order (:meth:`combine`).

    A site that does not answer a step (its process killed, its SuperNode gone, a
    timeout) stops the run, naming it, unless every site that answers marks the step as
    one that may complete without it (``min_sites`` in its answer: the rounds' sums and
    gathers, ``FlowerSite(min_sites=...)``) and at least ``min_sites`` sites remain. Then
    the site is dropped for the rest of the run: it is no longer asked, a sum is over
    the sites that remain, a list holds ``None`` at its rank, and every request names the
    dropped ranks (``absent``). A later step that needs every site stops the run, naming
    the dropped one."""

    def __init__(self, sites: int) -> None:
        self.sites = sites
        self.names: dict[int, str] = {}  # node id -> site name, learnt from the answers
        self.ranks: dict[int, int] = {}  # node id -> rank, learnt from the answers
        self.dropped: dict[int, str] = {}  # node id -> why it was dropped

    @property
    def absent(self) -> list[int]:
        """The ranks of the dropped sites."""
        return sorted(self.ranks[node] for node in self.dropped)

    def present_nodes(self) -> list[int] | None:
        """The nodes to ask next (None: every node, while no site was dropped)."""
        if not self.dropped:
            return None
        return sorted(node for node in self.ranks if node not in self.dropped)

    def combine(self, step: int, answers: Mapping[int, Any]) -> tuple[bool, Any]:
        """``answers``: node id -> the decoded answer, or a string (why it has none).
        Returns (finished, result): finished when every site is done."""
        present = {node: a for node, a in answers.items() if not isinstance(a, str)}
        for node, answer in present.items():
            self.names[node] = answer["site"]
            self.ranks[node] = answer["rank"]
        failed = sorted((a for a in present.values() if a["op"] == "failed"),
                        key=lambda a: a["rank"])  # fmt: skip
        if failed:
            raise SiteFailure(_failure(failed))
        silent = {node: a for node, a in answers.items() if isinstance(a, str)}
        if silent:
            self._drop(step, silent, list(present.values()))
        by_rank = sorted(present.values(), key=lambda a: a["rank"])
        ranks = [a["rank"] for a in by_rank]
        expected = [r for r in range(self.sites) if r not in self.absent]
        if ranks != expected:
            raise SiteFailure(
                f"the sites answer as ranks {ranks} ({[a['site'] for a in by_rank]}), not "
                f"{expected}: start each site once, under its own name."
            )
        ops = {a["op"] for a in by_rank}
        if len(ops) > 1:
            where = ", ".join(f"{a['site']!r}: {a['op']}" for a in by_rank)
            raise SiteFailure(
                f"the sites are at different collectives at step {step} ({where}): their "
                "recipes or lightning-fl versions differ. Start every site with the same ones."
            )
        op = ops.pop()
        if op == "done":
            return True, None
        if self.dropped and not all("min_sites" in a for a in by_rank):
            raise SiteFailure(
                f"{self._dropped_sites()} dropped earlier, and step {step} ({op}) needs every "
                "site (the set-up, or a plugin's own collective): restart it with "
                "--ckpt_path last and submit the run again."
            )
        if op == "rejoin":
            return False, REJOIN
        parts = [a["payload"] for a in by_rank]
        if op == "gather":
            listed: list[Any] = [None] * self.sites
            for rank, part in zip(ranks, parts):
                listed[rank] = part
            return False, listed
        return False, self._sum(parts, [a["site"] for a in by_rank])

    def asked_next(self, held: Mapping[int, Any]) -> list[int] | None:
        """The nodes to ask at the next step: those not dropped, less those whose answer
        is ``held`` (a site that rejoined answered its first step when it was probed);
        None: every node (no site dropped, nothing held)."""
        present = self.present_nodes()
        if not held:
            return present
        return [n for n in (present or sorted(self.ranks)) if n not in held]

    def admit(self, probed: Mapping[int, Any]) -> dict[int, Any]:
        """The dropped sites that answered a probe (``probed``: node -> answer, or why it
        has none), admitted again: node -> its answer, held for the next step. A site
        that answers as another rank stays dropped."""
        back = {}
        for node, answer in probed.items():
            if isinstance(answer, str) or answer.get("rank") != self.ranks[node]:
                continue
            del self.dropped[node]
            back[node] = answer
            logger.warning("%s is back: the others welcome it at this round's end.",
                           self._label(node))  # fmt: skip
        return back

    def _drop(self, step: int, silent: Mapping[int, str], present: list[dict]) -> None:
        """Drop the ``silent`` nodes, or stop the run when the step needs them."""
        node, reason = next(iter(silent.items()))
        floors = {a["min_sites"] for a in present if "min_sites" in a}
        may_miss = bool(present) and len(floors) == 1 and all("min_sites" in a for a in present)
        if not may_miss or any(n not in self.ranks for n in silent):
            raise SiteFailure(f"{self._label(node)} {reason}")
        min_sites = floors.pop()
        left = self.sites - len(self.dropped) - len(silent)
        if left < min_sites:
            who = ", ".join(self._label(n) for n in silent)
            raise SiteFailure(
                f"{who} {reason}; {left} of {self.sites} sites remain, fewer than "
                f"min_sites={min_sites}: the run stops. Restart the dropped sites with "
                "--ckpt_path last and submit the run again."
            )
        for n, why in silent.items():
            self.dropped[n] = why
            logger.warning(
                "%s %s: dropped at step %d; the run goes on with %d of %d sites "
                "(min_sites=%d).", self._label(n), why, step, left, self.sites, min_sites,
            )  # fmt: skip

    def _dropped_sites(self) -> str:
        return ", ".join(self._label(node) for node in sorted(self.dropped))

    def _sum(self, parts: list[Any], sites: list[str]) -> Any:
        first = parts[0]
        for part, site in zip(parts[1:], sites[1:]):
            if part.shape != first.shape or part.dtype != first.dtype:
                raise SiteFailure(
                    f"site {site!r} sends a {tuple(part.shape)} {part.dtype} sum, site "
                    f"{sites[0]!r} a {tuple(first.shape)} {first.dtype} one: their models differ."
                )
        total = first.clone()
        for part in parts[1:]:
            total += part  # int64 limbs wrap around, as SecureAggregation's arithmetic needs
        return total

    def _label(self, node: int) -> str:
        name = self.names.get(node)
        return f"site {name!r} (SuperNode {node})" if name else f"the site of SuperNode {node}"


def _failure(failed: list[dict]) -> str:
    """Why the run stops, from the sites' ``failed`` answers (rank order): the site at
    fault when the sites that report it agree on one (a site whose recipe or checkpoint
    differs from the others', named by every site that compared them), with its own
    report if it sent one; otherwise the first site that failed, and its reason."""
    blamed = {a.get("at_fault") for a in failed}
    if len(blamed) == 1 and (site := blamed.pop()) is not None:
        report = next((a for a in failed if a["site"] == site), failed[0])
        reporters = ", ".join(repr(a["site"]) for a in failed)
        return f"site {site!r} is at fault (reported by {reporters}): {report['payload']}"
    return f"site {failed[0]['site']!r} failed: {failed[0]['payload']}"


# ---------------------------------------------------------------------- the server
@server_app.main()
def relay_steps(grid: Grid, context: Context) -> None:
    """Wait for the sites' SuperNodes, then relay steps until every site is done."""
    settings = RunSettings.read(context.run_config)
    nodes = _wait_for_sites(grid, settings)

    def ask(receivers: list[int] | None, request: bytes, timeout: float, first: bool):
        return _ask(grid, nodes if receivers is None else receivers, request, timeout, first)

    run_steps(settings, ask)


#: ``ask(nodes, request, timeout, first)``: send ``request`` to ``nodes`` (None: every
#: site) and return each node's decoded answer, or a string saying why it has none.
Ask = Callable[[list[int] | None, bytes, float, bool], dict[int, Any]]


def run_steps(settings: RunSettings, ask: Ask) -> int:
    """The server's loop: each step's request carries the last result, until every site
    is done (returns the number of steps). A failed step stops the sites that wait for
    the next request, with the reason, and raises it."""
    relay = StepRelay(settings.sites)
    step, result, held = 0, None, {}
    while True:
        request = wire.encode({"step": step, "result": result, "absent": relay.absent})
        answers = {**ask(relay.asked_next(held), request, settings.step_timeout, step == 0),
                   **held}  # fmt: skip
        held = {}
        try:
            finished, result = relay.combine(step, answers)
            if result is REJOIN:  # probe the dropped sites: one started again answers
                dropped = sorted(relay.dropped)
                held = relay.admit(ask(dropped, request, settings.probe_timeout, False))
                result = sorted(relay.ranks[node] for node in held)
        except SiteFailure as failure:
            waiting = [n for n, a in answers.items() if not isinstance(a, str)
                       and a["op"] not in ("failed", "done")]  # fmt: skip
            if waiting:
                ask(waiting, wire.encode({"stop": str(failure)}), 30.0, False)
            raise
        if finished:
            return step
        step += 1


def _wait_for_sites(grid: Grid, settings: RunSettings) -> list[int]:
    deadline = time.monotonic() + settings.site_start_timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) == settings.sites:
            return nodes
        if len(nodes) > settings.sites:
            raise SiteFailure(
                f"{len(nodes)} SuperNodes are connected, the run config says sites="
                f"{settings.sites}: stop the extra SuperNodes or fix --run-config sites."
            )
        if time.monotonic() > deadline:
            raise SiteFailure(
                f"{len(nodes)} of {settings.sites} SuperNodes connected within "
                f"{settings.site_start_timeout:.0f} s: start every site's SuperNode."
            )
        time.sleep(0.5)


def _ask(
    grid: Grid, nodes: list[int], request: bytes, timeout: float, first: bool
) -> dict[int, Any]:
    """Send ``request`` to every node; each node's decoded answer, or why it has none
    (``first``: the run's first step, to which a site may still be starting)."""
    messages = [
        Message(
            RecordDict({_RECORD: ConfigRecord({"frame": request, "first": first})}),
            dst_node_id=node,
            message_type="query",
        )
        for node in nodes
    ]
    answers: dict[int, Any] = {
        node: f"did not answer within {timeout:.0f} s (it dropped, or a round took longer "
        "than step-timeout)"
        for node in nodes
    }
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            answers[node] = f"answered with an error: {reply.error.reason}"
            continue
        record = reply.content[_RECORD]
        if "error" in record:
            answers[node] = str(record["error"])
        else:
            answers[node] = wire.decode(record["frame"])
    return answers


# ---------------------------------------------------------------------- the sites
@client_app.query()
def carry_step(message: Message, context: Context) -> Message:
    """Carry one step's request to the site's mailbox and its answer back, unread."""
    request, first = message.content[_RECORD]["frame"], message.content[_RECORD]["first"]
    settings = RunSettings.read(context.run_config)  # the server read the same
    mailbox = context.node_config.get("mailbox")
    try:
        if not mailbox:
            raise OSError(
                "has no mailbox: start its SuperNode with --node-config "
                "'mailbox=\"<FlowerSite's mailbox path>\"'"
            )
        start_timeout = settings.site_start_timeout if first else 0.0
        answer = _through_mailbox(str(mailbox), request, settings.step_timeout, start_timeout)
        record = ConfigRecord({"frame": answer})
    except OSError as err:
        record = ConfigRecord({"error": str(err)})
    return Message(RecordDict({_RECORD: record}), reply_to=message)


def _through_mailbox(path: str, request: bytes, timeout: float, start_timeout: float) -> bytes:
    """The site's answer to ``request``; the site may take ``start_timeout`` seconds to
    open its mailbox (the first step; later, a closed mailbox means the site stopped)."""
    wire.check_mailbox(path)
    deadline = time.monotonic() + start_timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        while True:
            try:
                connection.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() >= deadline:
                    raise OSError(
                        f"has no site process at its mailbox {path}"
                        + (f" after {start_timeout:.0f} s" if start_timeout else "")
                        + ": its `lightning-fl fit --silo NAME` stopped or never started "
                        "(its console says why; its FlowerSite mailbox must be this path). "
                        "Restart it with --ckpt_path last and submit the run again."
                    ) from None
                time.sleep(0.2)
        connection.settimeout(timeout)
        wire.send_frame(connection, request)
        try:
            return wire.read_frame(connection)
        except ConnectionError:
            raise OSError(
                "closed its mailbox without answering: the site's `lightning-fl fit` stopped "
                "or crashed (its console says why); restart it with --ckpt_path last"
            ) from None
