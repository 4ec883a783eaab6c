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
from typing import Any

import torch

from lightning_fl.engine.federated_state import CheckpointReadError

#: Where a checkpoint's federated state lives (the round driver's callback state).
DRIVER_KEY = "_RoundDriver"


class SiloCheckpointError(RuntimeError):
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
    path = shard_path(filepath, rank, world_size)
    if not os.path.exists(path):
        raise SiloCheckpointError(
            f"{path} is missing: silo {rank} restores its clients' state from it (it never "
            "leaves the silo). Copy it back beside the checkpoint, or resume from a "
            "checkpoint whose shards every silo has."
        )
    try:  # weights_only: a shard is data, never code to run
        shard = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises several types for bad files
        raise CheckpointReadError.of(path, err) from err
    check_shard_identity(shard, state, path, rank, world_size)
    state["client_store"] = shard["client_store"]
    return checkpoint


def check_shard_identity(
    shard: dict[str, Any], state: dict[str, Any], path: str, rank: int, world_size: int
) -> None:
    """Refuse a shard that is not this silo's, of this run, at this round (the fields a
    shard records; shards written before they existed are checked on what they hold)."""
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
    """One process's side of a checkpoint's files: in silo mode its shard beside the
    global file (written, removed and read back with it); otherwise the global file
    alone, which a sharded checkpoint cannot be resumed from."""

    def __init__(self, silos: bool, rank: int, world_size: int) -> None:
        self.silos, self.rank, self.world_size = silos, rank, world_size

    def path(self, filepath: str | os.PathLike) -> str:
        """This silo's shard beside ``filepath``."""
        return shard_path(filepath, self.rank, self.world_size)

    def save(self, checkpoint: dict[str, Any], filepath: str | os.PathLike) -> None:
        """Write this silo's clients' store beside ``filepath`` and take it out of
        ``checkpoint`` (a federated checkpoint in silo mode; otherwise nothing)."""
        if not self.silos or DRIVER_KEY not in checkpoint.get("callbacks", {}):
            return
        shard = split_off_shard(checkpoint, self.rank, self.world_size)
        path = self.path(filepath)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(shard, path)

    def remove(self, filepath: str | os.PathLike) -> None:
        """Remove this silo's shard of ``filepath`` (silo mode)."""
        if self.silos and os.path.exists(path := self.path(filepath)):
            os.remove(path)

    def attach(self, checkpoint: dict[str, Any], filepath: str | os.PathLike) -> dict[str, Any]:
        """``checkpoint`` with this silo's shard put back (silo mode), or checked to have
        none (outside it)."""
        if self.silos:
            return merge_shard(checkpoint, filepath, self.rank, self.world_size)
        check_not_sharded(checkpoint, filepath)
        return checkpoint
