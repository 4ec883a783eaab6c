"""What a checkpoint holds beyond Lightning's own state, and the checks on resume.

The federated state is the round, the seed, the federation it belongs to, every rank's
client store (gathered into one file), the sampler's state and the count of consecutive
rounds with dropped updates. It travels in checkpoints as the round driver callback's
state, so Lightning saves and restores it with everything else.
"""

from __future__ import annotations

import pickle
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_fl.engine import collectives
from lightning_fl.engine.context import FitContext, counts_digest

if TYPE_CHECKING:
    from lightning_fl.engine.round_engine import RoundEngine


class FederationMismatchError(ValueError):
    """A checkpoint is resumed with a federation (clients, sample counts, partition seed)
    other than the one it was made with."""


class CheckpointReadError(RuntimeError):
    """A checkpoint file could not be read (truncated, not a checkpoint, or refused by
    ``weights_only`` loading)."""

    @classmethod
    def reading(cls, path: Any, load: Any, weights_only: bool | None = None) -> dict:
        """``load(path, weights_only=...)``, its errors but a missing file's raised as
        this error, naming the file."""
        try:
            return load(path, weights_only=weights_only)
        except FileNotFoundError:
            raise
        except Exception as err:  # noqa: BLE001 - torch raises several types for bad files
            raise cls.of(path, err) from err

    @classmethod
    def of(cls, path: Any, err: BaseException) -> CheckpointReadError:
        """The error for ``path``, whose loading raised ``err``: the file, what is wrong
        and what to do, without torch's advice to load it with ``weights_only=False``."""
        if isinstance(err, pickle.UnpicklingError) or "weights_only" in str(err):
            what = "not a checkpoint, or one holding objects that safe weights_only loading refuses"
        else:
            text = str(err).strip()
            what = text.splitlines()[0] if text else type(err).__name__
            what = what.split(". ")[0]
        return cls(
            f"{path}: cannot be read as a checkpoint ({what}). It may be truncated (an "
            "interrupted save or copy) or not a Lightning checkpoint of this library: "
            "resume from another one, e.g. the previous round's."
        )


def federated_state_dict(fit: FitContext, engine: RoundEngine) -> dict[str, Any]:
    """The federated state of a fit, with every rank's clients."""
    store = fit.store.state_dict()
    if fit.ranks.distributed and not fit.config.silos:  # every rank's clients, in one file
        parts = collectives.across_ranks(fit.ranks.world_size).all_gather_object(
            {c: {k: _to_cpu(v) for k, v in e.items()} for c, e in store.items()}
        )
        store = {c: e for part in parts for c, e in part.items()}
    return {
        "round": fit.trainer.current_epoch,
        "seed": fit.config.seed,
        "federation": fit.federation.identity(),
        "client_store": store,
        "sampler": fit.plugins.sampler.state_dict(),
        "consecutive_bad_rounds": engine.consecutive_bad_rounds,
    }


def load_federated_state_dict(fit: FitContext, engine: RoundEngine, state: dict[str, Any]) -> None:
    """Restore ``state`` into a fit: this rank's clients only, after the federation
    check; a changed seed is allowed with a warning."""
    check_federation(fit, state.get("federation"))
    num_clients, seed = fit.federation.num_clients, fit.config.seed
    if state.get("seed", seed) != seed:
        warnings.warn(
            f"Resuming with seed {seed} from a checkpoint made with seed "
            f"{state['seed']}: the resumed run will differ from the original.",
            stacklevel=2,
        )
    ranks = fit.ranks
    fit.store.load_state_dict(
        {
            c: e
            for c, e in state["client_store"].items()
            if ranks.owner(int(c)) == ranks.rank and int(c) < num_clients
        }
    )
    fit.plugins.sampler.load_state_dict(state["sampler"])
    engine.consecutive_bad_rounds = state["consecutive_bad_rounds"]


def check_federation(fit: FitContext, saved: dict[str, Any] | None) -> None:
    """Refuse to resume a checkpoint of another federation (see the strategy's
    ``allow_new_federation``)."""
    if saved is None:
        return
    now = fit.federation.identity()
    differ = [k for k in ("datamodule", "num_clients", "partition_seed") if saved[k] != now[k]]
    before, after = saved["train_counts"], now["train_counts"]
    if saved["num_clients"] == now["num_clients"] and isinstance(before, str) != isinstance(
        after, str
    ):  # one side listed, the other digested (another LISTED_COUNTS): compare digests
        before, after = (_digest(before), _digest(after))
    if saved["num_clients"] == now["num_clients"] and before != after:
        if isinstance(before, str):
            differ.append("train_counts (their digests differ)")
        else:
            changed = [c for c, (a, b) in enumerate(zip(before, after)) if a != b]
            differ.append(f"train_counts (clients {changed[:10]})")
    if not differ:
        return
    said = "; ".join(
        f"{k}: saved {saved[k]!r}, now {now[k]!r}" if k in saved else k for k in differ
    )
    if not fit.config.allow_new_federation:
        raise FederationMismatchError(
            f"The checkpoint was made with another federation ({said}): its client "
            "state, sampler and stream state belong to those clients. Resume with the "
            "datamodule settings it was made with, or pass "
            "FederatedStrategy(allow_new_federation=True) to keep only what fits."
        )
    warnings.warn(
        f"Resuming on another federation ({said}): client state of clients that no "
        "longer exist is dropped (allow_new_federation=True).",
        stacklevel=3,
    )


def _digest(counts: list[int] | str) -> str:
    return counts if isinstance(counts, str) else counts_digest(np.asarray(counts))


def _to_cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value
