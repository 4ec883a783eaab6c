"""What the engine reads: the strategy's frozen settings and one fit's context.

The engine's objects (:class:`~.planning.RoundPlanner`, :class:`~.round_engine.RoundEngine`,
:class:`~.driver.RoundDriver`, :class:`~.vectorized.VectorizedClients`,
:class:`~.client_evaluation.ClientEvaluation`, :mod:`.federated_state`) are given these
objects, never the strategy: a reader of ``RoundPlanner.plan`` finds every input it has in
the fields below. :class:`~lightning_fl.FederatedStrategy` builds the
:class:`FederatedConfig` when it is constructed and a :class:`FitContext` at each set-up.

One owner per value:

- a client's training sample count: :class:`Federation` (read once from the datamodule at
  set-up; the aggregator's target weights p_i, the samplers, the checkpoint's federation
  check and the plugins ask it, through ``FederatedStrategy.training_counts``);
- the local work per round (K steps or E epochs): :class:`FederatedConfig`; a participant's
  steps in a given round: that round's ``RoundState.local_steps``;
- the round's aggregation weights ω_i: the round's ``RoundState.participation``.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_fl.engine import collectives
from lightning_fl.engine.client_store import ClientStore
from lightning_fl.engine.data_contract import FederatedDataModule
from lightning_fl.engine.divergence import DivergenceMonitor
from lightning_fl.engine.packed import PackedFederation
from lightning_fl.engine.plugins import Aggregator, FederatedCallback
from lightning_fl.engine.tensors import FederatedTensors
from lightning_fl.systems.samplers import ClientSampler


@dataclass(frozen=True)
class FederatedConfig:
    """The strategy's federated settings (see :class:`~lightning_fl.FederatedStrategy`'s
    arguments), fixed when it is constructed."""

    seed: int
    local_steps: int | None
    local_epochs: int | None
    keep_optimizer_state: bool
    max_consecutive_bad_rounds: int
    vectorize: bool
    compile: bool | str
    max_vectorized_clients: int | None
    local_steps_per_training_step: int | None
    allow_new_federation: bool
    #: validation during a fit evaluates a seeded cohort of this many clients (None: all)
    eval_clients: int | None = None
    #: evaluate clients vectorized over arrays: True, False or "auto"
    vectorize_evaluation: bool | str = "auto"
    #: silo mode: client c lives on rank c % world_size for the whole run, and each rank
    #: opens only its own clients' data
    silos: bool = False
    #: the round index of the fit's first epoch (a fit that trains one round of a longer
    #: run: a Flower ClientApp's, lightning_fl.flower.server_side)
    first_round: int = 0
    #: randomness that protects privacy (DP noise) comes from the operating system's
    #: secret generator, never from the seed: the sites are separate institutions (silo
    #: mode), or the fit is one site's part of a deployment (a Flower ClientApp's)
    secret_randomness: bool = False
    #: every client's training count, given rather than read: a fit whose datamodule
    #: opens only its own clients (a Flower ClientApp's, with the server's counts)
    training_counts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """Check the settings together (one local-work rule, the vectorized options'
        dependencies, the evaluation's); without local_steps or local_epochs a client
        makes one pass over its data (local_epochs = 1)."""
        steps, epochs = self.local_steps, self.local_epochs
        if steps is not None and epochs is not None:
            raise ValueError("Give either local_steps or local_epochs, not both.")
        if steps is None and epochs is None:
            object.__setattr__(self, "local_epochs", 1)
        for name, value in (("local_steps", steps), ("local_epochs", epochs)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if isinstance(self.first_round, bool) or self.first_round < 0:
            raise ValueError(f"first_round must be an integer >= 0, got {self.first_round!r}.")
        if self.max_consecutive_bad_rounds < 1:
            raise ValueError("max_consecutive_bad_rounds must be >= 1.")
        chunk = self.max_vectorized_clients
        if chunk is not None and chunk < 1:
            raise ValueError(f"max_vectorized_clients must be >= 1 or None, got {chunk}.")
        if self.compile and not self.vectorize:
            raise ValueError(
                "compile=True compiles the vectorized step: set vectorize=True as well, or "
                "compile=False."
            )
        self._check_fused_steps()
        self._check_evaluation()

    def _check_fused_steps(self) -> None:
        steps = self.local_steps_per_training_step
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ValueError(f"local_steps_per_training_step must be >= 1 or None, got {steps!r}.")

    def _check_evaluation(self) -> None:
        if self.vectorize_evaluation not in (True, False, "auto"):
            raise ValueError(
                "vectorize_evaluation must be True, False or 'auto', got "
                f"{self.vectorize_evaluation!r}."
            )
        clients = self.eval_clients
        if clients is not None and (isinstance(clients, bool) or clients < 1):
            raise ValueError(
                f"eval_clients must be a number of clients >= 1, or None for every client; "
                f"got {clients!r}."
            )


@dataclass(frozen=True)
class Ranks:
    """The processes of a fit: this one's ``rank`` among ``world_size``, and which rank owns
    a client (trains it and keeps its state): ``client % world_size``."""

    world_size: int
    rank: int

    @property
    def distributed(self) -> bool:
        """Whether collectives run: a transport (``torch.distributed``'s group or a
        recipe's) spans more than one rank (:mod:`~lightning_fl.engine.collectives`)."""
        return collectives.across_ranks(self.world_size) is not None

    def owner(self, client: int) -> int:
        return client % self.world_size

    def owners(self, clients: Sequence[int]) -> list[int]:
        world_size = self.world_size
        return [client % world_size for client in clients]


def silo_counts(dm: FederatedDataModule) -> dict[str, dict[int, int]]:
    """What a silo tells the others of its clients: their training and validation sample
    counts and their training batches per pass."""
    train = dm.local_sample_counts("train")
    batches = {c: len(dm.client_dataloader(dm.client_dataset(c, "train"), "train"))
               if n else 0 for c, n in train.items()}  # fmt: skip
    return {"train": train, "val": dm.local_sample_counts("val"), "batches": batches}


class Federation:
    """The clients of a fit: the datamodule and every client's training sample count, read
    from it once (``sample_counts("train")``, unseen clients counting 0). ``require_data``:
    refuse a federation without any training data (a fit's).

    In silo mode (the datamodule's ``silo`` is set) each rank reads only its own clients'
    counts, and one ``all_gather_object`` at set-up shares every silo's: its clients'
    training and validation sample counts and training batches per pass (what the rounds
    are planned from). Nothing else about a client crosses ranks."""

    def __init__(
        self,
        datamodule: FederatedDataModule,
        require_data: bool = True,
        ranks: Ranks | None = None,
        given: Sequence[int] | None = None,
    ) -> None:
        self.datamodule = datamodule
        #: in silo mode, every client's training batches per pass over its data
        self.batches_per_pass: tuple[int, ...] | None = None
        self._validation_counts: list[int] | None = None
        self._split_counts: dict[str, np.ndarray] = {}
        self._with_data: dict[str, np.ndarray] = {}
        if datamodule.silo is None:
            counts = client_training_counts(datamodule, require_data)
        else:
            counts = self._gather_silos(ranks or Ranks(1, 0), require_data)
        if given is not None:  # every client's count, given: this process's must agree
            counts = _agreeing(np.asarray(counts, dtype=np.int64), given, datamodule)
        #: every client's training sample count (unseen clients: 0), an int64 array read
        #: once; read-only, host-side bookkeeping
        self.training_counts: np.ndarray = np.asarray(counts, dtype=np.int64)
        self.training_counts.flags.writeable = False

    @property
    def num_clients(self) -> int:
        return self.datamodule.num_clients

    @functools.cached_property
    def unseen(self) -> np.ndarray:
        """The held-out (unseen) clients, in the datamodule's order, read once."""
        return np.asarray(self.datamodule.unseen_clients, dtype=np.int64)

    @functools.cached_property
    def unseen_mask(self) -> np.ndarray:
        """Whether each client is held out (a bool array over the clients)."""
        mask = np.zeros(self.num_clients, dtype=bool)
        mask[self.unseen] = True
        return mask

    @functools.cached_property
    def unseen_set(self) -> frozenset[int]:
        """The held-out clients, for membership tests per client."""
        return frozenset(self.unseen.tolist())

    def has_validation_data(self) -> bool:
        """Whether any client has a validation split."""
        return bool(self.split_counts("val").any())

    def split_counts(self, split: str) -> np.ndarray:
        """Every client's sample count in ``split`` (an int64 array, read once): the
        training counts for ``"train"`` (unseen clients at 0), the datamodule's for the
        held-out splits."""
        if split == "train":
            return self.training_counts
        if split == "val" and self._validation_counts is not None:
            return np.asarray(self._validation_counts, dtype=np.int64)
        if split not in self._split_counts:
            self._split_counts[split] = np.asarray(
                self.datamodule.sample_counts(split), dtype=np.int64
            )
        return self._split_counts[split]

    def clients_with_data(self, split: str) -> np.ndarray:
        """The ids of the clients with samples in ``split``, ascending (read once)."""
        if split not in self._with_data:
            self._with_data[split] = np.flatnonzero(self.split_counts(split))
        return self._with_data[split]

    def _gather_silos(self, ranks: Ranks, require_data: bool) -> list[int]:
        """Every silo's counts (one collective), as the lists of all clients."""
        dm = self.datamodule
        local = silo_counts(dm)
        parts = [local]
        if (group := collectives.across_ranks(ranks.world_size)) is not None:
            parts = group.all_gather_object(local)
        every = {k: {c: n for part in parts for c, n in part[k].items()} for k in local}
        n = dm.num_clients
        counts = _seen_training_counts(
            np.array([every["train"].get(c, 0) for c in range(n)], dtype=np.int64), dm,
            require_data,
            "Every silo's clients have an empty training set: there is nothing to train on. "
            "Check each silo's data folder.",
        )  # fmt: skip
        self._validation_counts = [every["val"].get(c, 0) for c in range(n)]
        self.batches_per_pass = tuple(every["batches"].get(c, 0) for c in range(n))
        return counts

    def identity(self) -> dict[str, Any]:
        """What identifies the federation a checkpoint belongs to: the datamodule's class,
        its number of clients, every client's training sample count, and its partition
        seed (the datamodule's ``seed`` hyper-parameter, where it has one). Above
        :data:`LISTED_COUNTS` clients the counts are kept as their SHA-256 digest, so that
        a checkpoint grows with the participants, not with the population."""
        hparams = getattr(self.datamodule, "hparams", {}) or {}
        counts = self.training_counts
        listed = len(counts) <= LISTED_COUNTS
        return {
            "datamodule": type(self.datamodule).__name__,
            "num_clients": self.num_clients,
            "train_counts": counts.tolist() if listed else counts_digest(counts),
            "partition_seed": hparams.get("seed"),
        }


#: Up to this many clients a checkpoint lists every training count (and a resume on other
#: counts names the clients that changed); above, it keeps their digest.
LISTED_COUNTS = 100_000


def counts_digest(counts: np.ndarray) -> str:
    """``sha256:<hex>`` of the counts as little-endian int64."""
    data = np.ascontiguousarray(counts, dtype="<i8").tobytes()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def client_training_counts(dm: FederatedDataModule, require_data: bool = True) -> np.ndarray:
    """Training samples per client; unseen (held-out) clients count 0."""
    return _seen_training_counts(
        np.array(dm.sample_counts("train"), dtype=np.int64), dm, require_data,
        "Every client has an empty training set: there is nothing to train on. Check the "
        "datamodule's split fractions and data path.",
    )  # fmt: skip


def _agreeing(read: np.ndarray, given: Sequence[int], dm: FederatedDataModule) -> np.ndarray:
    """The ``given`` counts, once this process's own clients' ``read`` counts agree."""
    counts = np.asarray(given, dtype=np.int64)
    if len(counts) != len(read):
        raise ValueError(
            f"training_counts gives {len(counts)} clients, and the datamodule has "
            f"{len(read)}: give every client's count (the server's, in the client order)."
        )
    for client in dm.local_clients():
        if counts[client] != read[client]:
            raise ValueError(
                f"client {client} has {read[client]} training samples here, and "
                f"training_counts says {counts[client]}: this process's data differs from "
                "what the counts were taken from."
            )
    return counts


def _seen_training_counts(
    counts: np.ndarray, dm: FederatedDataModule, require_data: bool, empty: str
) -> np.ndarray:
    """``counts`` with the unseen clients at 0; with ``require_data``, the error ``empty``
    when no client is left with training data."""
    counts[np.asarray(dm.unseen_clients, dtype=np.int64)] = 0
    if require_data and not counts.any():
        raise ValueError(empty)
    return counts


@dataclass(frozen=True)
class Plugins:
    """The fit's plugins: its federated callbacks (in the Trainer's order), the one
    aggregator among them, and the sampler as the callbacks wrapped it
    (``FederatedCallback.wrap_sampler``)."""

    callbacks: tuple[FederatedCallback, ...]
    aggregator: Aggregator
    sampler: ClientSampler

    @property
    def keep_client_state(self) -> bool:
        """Whether a callback keeps per-client state between rounds."""
        return any(cb.keeps_client_state for cb in self.callbacks)


@dataclass(frozen=True)
class FitContext:
    """What one fit's engine reads, built by the strategy at set-up."""

    config: FederatedConfig
    trainer: pl.Trainer
    module: pl.LightningModule
    device: torch.device
    ranks: Ranks
    #: the module's parameters and floating buffers, as the flat list the rounds move
    tensors: FederatedTensors
    #: per-client state of the clients this rank owns
    store: ClientStore
    plugins: Plugins
    federation: Federation
    #: the federation's training data on the device, or None: the datamodule's loaders
    packed: PackedFederation | None
    #: Lightning's batch transfer to ``device`` (the strategy's ``batch_to_device``)
    to_device: Callable[[Any], Any]
    divergence: DivergenceMonitor
    #: the recipe's site names in rank order (``FederatedStrategy(silos=[...])``), or None
    site_names: tuple[str, ...] | None = None

    @property
    def datamodule(self) -> FederatedDataModule:
        return self.federation.datamodule
