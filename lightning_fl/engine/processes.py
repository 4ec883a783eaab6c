"""The processes of a federated run: their CPU threads, the process group of a restarted
torchrun worker, and the SIGTERM check Lightning makes before every training step."""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _destroy_dist_connection

#: Below this many parameters, ``num_threads="auto"`` uses one CPU thread per process.
SMALL_MODEL_PARAMETERS = 1_000_000

NumThreads = int | Literal["auto"] | None


def as_timedelta(timeout: timedelta | float) -> timedelta:
    """A collective's timeout, given as a ``timedelta`` or in seconds (a recipe's number)."""
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))


def check_num_threads(num_threads: Any) -> NumThreads:
    """``num_threads`` as given, refused unless ``"auto"``, None or an int >= 1."""
    if num_threads not in (None, "auto") and not (
        isinstance(num_threads, int) and num_threads >= 1
    ):
        raise ValueError(f"num_threads must be 'auto', None or an int >= 1, got {num_threads!r}.")
    return num_threads


def set_cpu_threads(
    num_threads: NumThreads, model: torch.nn.Module, processes: int, device: torch.device
) -> None:
    """Apply ``num_threads`` when ``device`` is the CPU: an int sets it; None leaves
    torch's setting; ``"auto"`` leaves ``OMP_NUM_THREADS`` alone when set, else uses one
    thread under :data:`SMALL_MODEL_PARAMETERS` parameters and the cores divided among
    this machine's ``processes`` above. FL's small models run many tiny ops, which gain
    nothing from more threads, and waiting threads stall when another process holds a
    core: the quickstart takes 10.7 s with one or two threads on an idle 2-core machine,
    but 15 s with one and 41 s with two while the other core is busy."""
    if num_threads is None or device.type != "cpu":
        return
    if num_threads != "auto":
        torch.set_num_threads(num_threads)
    elif not os.environ.get("OMP_NUM_THREADS"):
        size = sum(p.numel() for p in model.parameters())
        share = max(1, (os.cpu_count() or 1) // max(1, processes))
        torch.set_num_threads(1 if size < SMALL_MODEL_PARAMETERS else share)


def restarted_worker_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """Under torchrun, the workers' process group meets in the agent's store, which
    outlives a restart: the keys of the failed attempt's group (every rank's address) are
    still there, and a restarted worker would read a dead rank's address ("Connection
    refused"). This attempt's keys get a prefix of its own (``TORCHELASTIC_RESTART_COUNT``);
    None outside a restarted torchrun worker."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=False, timeout=timeout,
    )  # fmt: skip
    return dist.PrefixStore(f"/lightning_fl/attempt_{attempt}", agent)


def destroy_group_at_exit() -> None:
    """Destroy the process group when the interpreter exits, for every backend (once,
    however many fits): Lightning registers that for NCCL only, and a Gloo group left to
    the interpreter's finalization aborts the process now and then ("terminate called
    without an active exception", exit -6) after the run has finished, which torchrun
    reports as a failed run (pytorch/pytorch#190489)."""
    atexit.unregister(_destroy_dist_connection)
    atexit.register(_destroy_dist_connection)


def check_sigterm_once_per_round(trainer: pl.Trainer, world_size: int) -> None:
    """On several processes, Lightning (2.6) broadcasts rank 0's SIGTERM flag before
    every training step: a collective per local step, which makes every rank wait for
    the slowest one at each step (1.1 s of a 10-round cnn run on 2 processes, and
    each step costs the slower rank's time). Here it is broadcast at each round's
    first step only, the same step on every rank: a SIGTERM still stops every rank
    together, at the next round's start (the round's end is where a checkpoint is
    taken and a run can resume from)."""
    loop = trainer.fit_loop.epoch_loop
    broadcast = getattr(loop, "_broadcast_sigterm_tensor", None)
    if broadcast is None or world_size == 1:
        return
    checked = {"round": None}

    def once_per_round() -> None:
        if checked["round"] != trainer.current_epoch:
            checked["round"] = trainer.current_epoch
            broadcast()

    loop._broadcast_sigterm_tensor = once_per_round
