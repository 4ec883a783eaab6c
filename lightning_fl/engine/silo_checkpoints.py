"""Sharded federated checkpoints of silo mode (``FederatedStrategy(silos=True)``).

Outside silo mode a checkpoint gathers every rank's client store into rank 0's file. In
silo mode a silo's private state (its clients' personal models, control variates,
mixture weights, kept optimizer states: the client store) never leaves it: rank 0's file
holds the global part (the model, the optimizer and server state, the round, the sampler's
state, every callback's server-side state) and each rank writes its own clients' store
beside it, ``<checkpoint>.silo<rank>-of-<world size>``. On resume each rank reads the
global file and its own shard; a missing shard, or a run on another number of silos, is
refused with the file it needs.

A shard records whose it is: the silo (rank and number of silos), its clients, the run
(the ``run_id`` drawn at the run's first fit and kept by its checkpoints) and the round.
Resuming checks them all against the silo and the global file: another silo's shard
(copied over this one's), a shard of another run or of another round is refused, naming
both, rather than loading another silo's private state.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from lightning_fl.engine import collectives
from lightning_fl.engine.federated_state import CheckpointReadError

#: Where a checkpoint's federated state lives (the round driver's callback state).
DRIVER_KEY = "_RoundDriver"


class SiloCheckpointError(collectives.SiteFault, RuntimeError):
    """A silo cannot resume: its shard is missing, or the checkpoint is of another layout."""


def shard_path(filepath: str | os.PathLike, rank: int, world_size: int) -> str:
    """The file beside ``filepath`` that holds silo ``rank``'s client store."""
    return f"{os.fspath(filepath)}.silo{rank}-of-{world_size}"


def split_off_shard(checkpoint: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Take this silo's client store out of ``checkpoint`` (which keeps an empty store and
    the number of silos) and return the shard to write beside it."""
    state = checkpoint["callbacks"][DRIVER_KEY]
    shard = {"client_store": state["client_store"], "rank": rank, "world_size": world_size,
             "clients": sorted(state["client_store"]), "run_id": state.get("run_id"),
             "round": state.get("round")}  # fmt: skip
    state["client_store"] = {}
    state["silos"] = world_size
    return shard


def merge_shard(
    checkpoint: dict[str, Any], filepath: str | os.PathLike, rank: int, world_size: int
) -> dict[str, Any]:
    """Put silo ``rank``'s shard of ``filepath`` back into its loaded ``checkpoint``."""
    state = checkpoint.get("callbacks", {}).get(DRIVER_KEY)
    if state is None:
        return checkpoint
    _check_silo_count(state, filepath, world_size)
    path = shard_path(filepath, rank, world_size)
    shard = read_own_shard(path)
    check_shard_identity(shard, state, path, rank, world_size)
    state["client_store"] = shard["client_store"]
    return checkpoint


def _check_silo_count(state: dict[str, Any], filepath: str | os.PathLike, world_size: int):
    """Refuse a global file made without silo mode, or by another number of silos."""
    saved = state.get("silos")
    if saved is None:
        raise SiloCheckpointError(
            f"{filepath}: made without silo mode (one file with every client's state): "
            "resume it with FederatedStrategy(silos=False), or start the silo run anew."
        )
    if saved != world_size:
        raise SiloCheckpointError(
            f"{filepath}: made by {saved} silos, resumed by {world_size}: each silo restores "
            f"its own clients' state, so resume with {saved} processes."
        )


def check_shard_identity(
    shard: dict[str, Any],
    state: dict[str, Any],
    path: str,
    rank: int,
    world_size: int,
    site: str | None = None,
) -> None:
    """Refuse a shard that is not this silo's (its ``site`` name, rank and clients), of
    this run, at this round (the fields a shard records; shards written before they
    existed are checked on what they hold)."""
    if site is not None and shard.get("site") not in (None, site):
        raise SiloCheckpointError(
            f"{path} holds the state of site {shard['site']!r}, not of this site {site!r}: "
            f"each site resumes from its own shard only. Put site {site!r}'s own shard "
            f"back, or start this process as --silo {shard['site']}."
        )
    owner = (shard.get("rank", rank), shard.get("world_size", world_size))
    if owner != (rank, world_size):
        raise SiloCheckpointError(
            f"{path} holds the state of silo {owner[0]} of {owner[1]}, not of this silo "
            f"({rank} of {world_size}): each silo resumes from its own shard only. Put "
            f"silo {rank}'s own shard back, or resume this silo as rank {owner[0]}."
        )
    foreign = [c for c in shard.get("clients", shard["client_store"]) if c % world_size != rank]
    if foreign:
        raise SiloCheckpointError(
            f"{path} holds clients {foreign[:5]} of other silos, not of silo {rank} of "
            f"{world_size}: it is not this silo's shard. Put silo {rank}'s own shard back."
        )
    for field, what in (("run_id", "run"), ("round", "round")):
        mine, theirs = shard.get(field), state.get(field)
        if mine is not None and theirs is not None and mine != theirs:
            raise SiloCheckpointError(
                f"{path} is of {what} {mine}, the checkpoint beside it of {what} {theirs}: "
                "a silo resumes from the shard written with the checkpoint. Resume from the "
                f"checkpoint of {what} {mine}, or put back the shard of {what} {theirs}."
            )


def check_not_sharded(checkpoint: dict[str, Any], filepath: str | os.PathLike) -> None:
    """Refuse to resume a silo checkpoint outside silo mode: its clients' state is in
    shards that one process cannot read."""
    state = checkpoint.get("callbacks", {}).get(DRIVER_KEY) or {}
    if state.get("silos"):
        raise SiloCheckpointError(
            f"{filepath}: made by {state['silos']} silos, whose clients' state is in their "
            "own shards: resume it with FederatedStrategy(silos=True) on as many processes."
        )


class SiloShards:
    """One process's side of a checkpoint's files. In silo mode each site writes its shard
    (its clients' store, what identifies it, and a copy of the global part) to its own
    place, :meth:`path`: ``<folder>/<site>/<name>`` for a named site, else
    ``<checkpoint>.silo<rank>-of-<world size>`` beside the checkpoint; rank 0 also writes
    the global file, as Lightning does. A site resumes from its shard alone (no folder
    needs to be shared; a shard written before shards held the global part is merged
    with the global file), and the sites then agree, with one ``all_gather_object``, that
    every one of them could and that they resume the same run at the same round; or,
    where the others are mid-run and offer the global part, this site rejoins them
    (:mod:`lightning_fl.engine.rejoin`).
    Outside silo mode the global file is read, and a sharded one refused."""

    def __init__(self, silos: bool, rank: int, world_size: int, site: str | None = None):
        self.silos, self.rank, self.world_size, self.site = silos, rank, world_size, site

    def path(self, filepath: str | os.PathLike) -> str:
        """This site's shard of the checkpoint ``filepath``."""
        if self.site is None:
            return shard_path(filepath, self.rank, self.world_size)
        folder, name = os.path.split(os.fspath(filepath))
        return os.path.join(folder, self.site, name)

    def save(self, checkpoint: dict[str, Any], filepath: str | os.PathLike) -> None:
        """Write this site's shard of ``checkpoint`` and take its clients' store out of
        ``checkpoint`` (a federated checkpoint in silo mode; otherwise nothing)."""
        if not self.silos or DRIVER_KEY not in checkpoint.get("callbacks", {}):
            return
        shard = split_off_shard(checkpoint, self.rank, self.world_size)
        shard["site"], shard["checkpoint"] = self.site, checkpoint
        path = self.path(filepath)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(shard, path)

    def remove(self, filepath: str | os.PathLike) -> None:
        """Remove this site's shard of ``filepath`` (silo mode)."""
        if self.silos and os.path.exists(path := self.path(filepath)):
            os.remove(path)

    def load(
        self, filepath: str | os.PathLike, read: Callable[[str | os.PathLike], dict[str, Any]]
    ) -> dict[str, Any]:
        """The checkpoint ``filepath`` as this process resumes it: in silo mode from this
        site's shard (``read`` reads the global file, for older shards), checked to be
        this site's and agreed on by every site; otherwise the global file (``read``)."""
        if not self.silos:
            checkpoint = read(filepath)
            check_not_sharded(checkpoint, filepath)
            return checkpoint
        checkpoint, problem = None, None
        try:
            checkpoint = self._own(filepath, read)
        except (SiloCheckpointError, CheckpointReadError) as err:
            problem = str(err)
        state = (checkpoint or {}).get("callbacks", {}).get(DRIVER_KEY) or {}
        label = self.site or f"silo {self.rank}"
        mine = (label, problem, state.get("run_id"), state.get("round"))
        sites = [mine]
        if (group := collectives.across_ranks(self.world_size)) is not None:
            sites = group.all_gather_object(mine)
        if (rejoined := rejoined_checkpoint(checkpoint, sites, label)) is not None:
            return rejoined  # the others are mid-run: this site rejoins them
        agree(sites, label)
        return checkpoint

    def _own(self, filepath: str | os.PathLike, read: Callable) -> dict[str, Any]:
        path = self.path(filepath)
        shard = read_own_shard(path)
        checkpoint = shard.pop("checkpoint", None)
        if checkpoint is None:  # written before shards held the global part: the file beside
            checkpoint = read(filepath)
            state = checkpoint.get("callbacks", {}).get(DRIVER_KEY)
            if state is None:
                return checkpoint
            _check_silo_count(state, filepath, self.world_size)
        else:
            state = checkpoint["callbacks"][DRIVER_KEY]
        check_shard_identity(shard, state, path, self.rank, self.world_size, self.site)
        state["client_store"] = shard["client_store"]
        return checkpoint


def read_own_shard(path: str) -> dict[str, Any]:
    """This silo's shard at ``path``, read as data only (``weights_only``: never code to
    run); its absence is refused, naming the file."""
    if not os.path.exists(path):
        raise SiloCheckpointError(
            f"{path} is missing: this silo resumes its clients' state from it (it never "
            "leaves the silo). Put it back, or resume from a checkpoint whose shards every "
            "silo has."
        )
    return CheckpointReadError.reading(path, partial(torch.load, map_location="cpu"), True)


def agree(sites: list[tuple[str, str | None, Any, Any]], mine: str) -> None:
    """Refuse, on every site, a resume that some site cannot make, or where sites hold
    checkpoints of different runs or rounds: ``sites`` is each site's (name, problem, run
    id, round), gathered in rank order; ``mine`` is this site's name."""
    failed = [(name, problem) for name, problem, _, _ in sites if problem is not None]
    if failed:
        name, problem = next(((n, p) for n, p in failed if n == mine), failed[0])
        others = ", ".join(n for n, _ in failed if n != name)
        also = f" (and {others})" if others else ""
        raise SiloCheckpointError(
            f"site {name!r}{also} cannot resume, so no site does: {problem}",
            site=failed[0][0],  # the same site at fault on every site
        )
    held = [(name, (run_id, round_idx)) for name, _, run_id, round_idx in sites]
    odd = collectives.odd_site(held)  # the site at fault differs from most sites
    if odd is None:
        return
    name, holder = odd
    theirs, ours = dict(held)[name], dict(held)[holder]
    what, index = ("run", 0) if theirs[0] != ours[0] else ("round", 1)
    raise SiloCheckpointError(
        f"site {name!r}'s checkpoint is of {what} {theirs[index]}, site {holder!r}'s of "
        f"{what} {ours[index]}: every site resumes from the checkpoint of the same {what}. "
        "Give each site the checkpoint of one round (--ckpt_path).",
        site=name,
    )


def rejoined_checkpoint(
    own: dict[str, Any] | None, sites: list[tuple], label: str
) -> dict[str, Any] | None:
    """The checkpoint a site resumes from when the others offer the run's global part in
    the resume agreement (``sites``: every site's entry, in rank order; the others' carry
    the global part as a fifth value): that part with this site's own client store (from
    ``own``, its shard's checkpoint); None when nobody offers one (every site resumes
    together, :func:`~lightning_fl.engine.silo_checkpoints.agree`)."""
    offers = [site for site in sites if len(site) > 4 and site[4] is not None]
    if not offers:
        return None
    mine = next(site for site in sites if site[0] == label)
    name, their_round, checkpoint = offers[0][0], offers[0][3], offers[0][4]
    check_joining(mine, offers[0][2], their_round)
    state = checkpoint["callbacks"][DRIVER_KEY]
    state["client_store"] = own["callbacks"][DRIVER_KEY]["client_store"]
    print(
        f"site {label!r} rejoins the run after round {their_round} (its own checkpoint is "
        f"of round {mine[3]}); the global part comes from site {name!r}.",
        flush=True,
    )
    return checkpoint


def check_joining(entry: tuple, run_id: str | None, round_idx: int) -> None:
    """Refuse a rejoining site whose shard could not be read, is of another run, or of a
    round after the others' (``entry``: its (name, problem, run id, round))."""
    name, problem, theirs, their_round = entry[:4]
    if problem is not None:
        raise SiloCheckpointError(f"site {name!r} cannot rejoin the run: {problem}", site=name)
    if theirs != run_id:
        raise SiloCheckpointError(
            f"site {name!r} rejoins with a checkpoint of run {theirs}, the others run "
            f"{run_id}: restart it with this run's checkpoint (--ckpt_path last).",
            site=name,
        )
    if their_round is None or their_round > round_idx:
        raise SiloCheckpointError(
            f"site {name!r} rejoins with a checkpoint of round {their_round}, after the "
            f"others' round {round_idx}: restart it with this run's last checkpoint.",
            site=name,
        )
