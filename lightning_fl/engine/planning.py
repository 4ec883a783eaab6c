"""Who trains a round on this rank, with which loaders, in which order of steps.

docs/architecture.md, "One round is one Lightning epoch", steps 1–2: the sampler chooses the
participants and their weights from (seed, round); each participant's loader is seeded
with (seed, "data", round, client); every rank steps through a round of the same length
(idle steps for a rank with fewer local batches).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader

from lightning_fl.engine import collectives
from lightning_fl.engine.client_store import move_client_states
from lightning_fl.engine.context import FitContext
from lightning_fl.engine.data_contract import FederatedDataModule
from lightning_fl.engine.plugins import (
    CLIENT_UPDATES,
    POOLED_CLIENT,
    SERVER_CLIENT,
    RoundState,
    zero_round_sums,
)
from lightning_fl.engine.schedule import ClientSchedule, chunk_positions
from lightning_fl.engine.seeding import generator
from lightning_fl.engine.tensors import flat_size, zeros_like
from lightning_fl.systems.samplers import Participation

#: Pseudo-client of the idle batches that give every rank a round of the same length.
PADDING = -2


@dataclass
class RoundPlan:
    """One round of this rank: its clients in order (``schedule``), their loaders, the
    hooks' state and, with vectorized clients, the chunks of schedule positions that train
    together. ``steps`` is the schedule of Lightning steps: one per client batch, or one
    per ``local_steps_per_training_step`` local steps of a chunk, or of a client on the
    sequential path (:attr:`fused`; idle steps for a rank with fewer, as a trailing
    PADDING entry)."""

    schedule: ClientSchedule
    loaders: list[DataLoader]
    state: RoundState
    steps: ClientSchedule
    chunks: list[tuple[int, ...]] | None = None
    #: the participants whose client-store entries came from their owner rank to the rank
    #: that trains them this round: client → (owner, trainer); they go back at its end
    moved: dict[int, tuple[int, int]] | None = None
    #: the rank that trains each participant (``state.participation.clients``' order)
    trained_by: list[int] | None = None

    @property
    def fused(self) -> bool:
        """Whether a Lightning step runs several local steps of one client (the sequential
        path with ``local_steps_per_training_step`` other than 1)."""
        return self.chunks is None and self.steps is not self.schedule

    def is_padding(self, pos: int) -> bool:
        """Whether schedule position ``pos`` is this rank's idle batches."""
        return self.schedule.clients[pos] == PADDING

    def packed_chunk(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` draws its batches from the packed federation (none of
        its clients has a loader)."""
        loaders = [self.loaders[pos] for pos in self.chunks[chunk]]
        return loaders.count(None) == len(loaders)

    def chunk_local_steps(self, chunk: int) -> int:
        """Local steps of chunk ``chunk``: those of its longest client."""
        return max([self.schedule.num_batches[pos] for pos in self.chunks[chunk]])


class RoundPlanner:
    """Plans rounds for one rank of a fit: reads its sampler, aggregator, seed, local work
    (K steps or E epochs), ranks and federation (``fit``); keeps only its warnings'
    state."""

    def __init__(self, fit: FitContext) -> None:
        self.fit = fit
        self.skipped_now = 0  # participants skipped this round for want of data
        self._warned_empty = False
        self._warned_skipped = False
        self._balanced: bool | None = None
        self._target_weights: torch.Tensor | None = None
        self._unseen: np.ndarray | None = None
        self._checked_counts: np.ndarray | None = None

    @property
    def datamodule(self) -> FederatedDataModule:
        return self.fit.datamodule

    def plan(self, round_idx: int) -> RoundPlan:
        """The participants of ``round_idx`` and this rank's loaders and steps."""
        fit, config, dm = self.fit, self.fit.config, self.datamodule
        dm.set_round(round_idx)
        counts = fit.federation.training_counts
        self._warn_clients_without_data(counts)
        p = self.target_weights()
        participation = self._participants(round_idx, p)
        clients = participation.clients
        # Only this rank's participants need loaders, unless local_epochs makes every
        # participant's batch count depend on its loader's length. Vectorized clients
        # whose data is packed on the device need none: their chunks draw by index.
        built: dict[int, DataLoader | None] = {}
        silos = fit.federation.batches_per_pass is not None
        if config.local_steps is None and fit.packed is None and not silos:
            built = {i: self._loader(c, round_idx) for i, c in enumerate(clients)}
        batches = self._num_batches(clients, built, round_idx)
        ranks = self.ranks(clients, batches)
        moved = self._move_states_in(clients, ranks)
        rank = fit.ranks.rank
        mine = [i for i, r in enumerate(ranks) if r == rank]
        by_index = config.vectorize and fit.packed is not None
        for i in mine:
            if i not in built:
                drawn = by_index and clients[i] >= 0
                built[i] = None if drawn else self._loader(clients[i], round_idx)
        per_rank: list[list[int]] = [[] for _ in range(fit.ranks.world_size)]
        for r, n in zip(ranks, batches):
            per_rank[r].append(n)
        schedule, steps, chunks = self._schedules(
            [participation.clients[i] for i in mine], [batches[i] for i in mine], per_rank
        )
        state = self._round_state(round_idx, participation, counts, p, schedule)
        return RoundPlan(schedule, [built[i] for i in mine], state, steps, chunks, moved, ranks)

    def ranks(self, clients: Sequence[int], batches: Sequence[int]) -> list[int]:
        """The rank that trains each participant this round: its owner (client %
        world_size, where its state lives), or, when every per-client state can move
        (:meth:`balanced`), the least loaded rank, taking the participants by decreasing
        number of steps (longest processing time first; ties to the earlier participant
        and the lower rank), so that ranks finish the round together. A client drawn
        several times (sampling with replacement) trains every time on one rank, in
        order, as on one process."""
        world_size = self.fit.ranks.world_size
        if world_size == 1 or not self.balanced():
            return self.fit.ranks.owners(clients)
        positions: dict[int, list[int]] = {}
        for i, client in enumerate(clients):
            positions.setdefault(client, []).append(i)
        work = {c: sum(batches[i] for i in group) for c, group in positions.items()}
        load = [0] * world_size
        ranks = [0] * len(clients)
        for client in sorted(positions, key=lambda c: (-work[c], positions[c][0])):
            rank = min(range(world_size), key=lambda r: (load[r], r))
            for i in positions[client]:
                ranks[i] = rank
            load[rank] += work[client]
        return ranks

    def _move_states_in(
        self, clients: Sequence[int], ranks: Sequence[int]
    ) -> dict[int, tuple[int, int]] | None:
        """Bring the client-store entries of the participants that train away from their
        owner to the rank that trains them (:meth:`return_states` takes them back)."""
        fit, ranks_ = self.fit, self.fit.ranks
        if ranks_.world_size == 1 or not (self.balanced() and self.moves_state()):
            return None
        moved = {c: (ranks_.owner(c), r) for c, r in zip(clients, ranks)
                 if c >= 0 and ranks_.owner(c) != r}  # fmt: skip
        move_client_states(fit.store, moved, ranks_.rank, ranks_.world_size)
        return moved

    def return_states(self, plan: RoundPlan) -> None:
        """At the round's end, every moved participant's entries back to its owner."""
        if plan.moved is not None:
            back = {c: (trainer, owner) for c, (owner, trainer) in plan.moved.items()}
            ranks = self.fit.ranks
            move_client_states(self.fit.store, back, ranks.rank, ranks.world_size)

    def moves_state(self) -> bool:
        """Whether a client trained away from its owner needs its store entries there: a
        callback keeps them, or clients keep their optimizer state."""
        return self.fit.plugins.keep_client_state or self.fit.config.keep_optimizer_state

    def balanced(self) -> bool:
        """Whether participants may train on any rank: every callback that keeps
        per-client state keeps all of it in the client store (``client_state_in_store``:
        it moves with the client; so does a kept optimizer state), and the datamodule has
        no per-client stream state (``set_round``)."""
        if self.fit.config.silos:
            return False  # a client never leaves its silo
        if self._balanced is None:
            fixed = [cb for cb in self.fit.plugins.callbacks
                     if cb.keeps_client_state and not cb.client_state_in_store]  # fmt: skip
            streams = type(self.datamodule).set_round is not FederatedDataModule.set_round
            self._balanced = not (fixed or streams)
        return self._balanced

    def target_weights(self) -> torch.Tensor:
        """The aggregator's target weights p_i of the fit's training counts, computed at
        the first round and kept: the counts are fixed for a fit (a stream's
        ``set_round`` changes the data a client holds now, not its count)."""
        if self._target_weights is None:
            counts = self.fit.federation.training_counts
            self._target_weights = self.fit.plugins.aggregator.target_weights(counts)
        return self._target_weights

    def _warn_clients_without_data(self, counts: np.ndarray) -> None:
        """Once per fit: the clients that have no training data at all."""
        if self._warned_empty or counts is self._checked_counts:
            return  # warned, or these counts (the fit's: the same array every round) had none
        self._checked_counts = counts
        if self._unseen is None:  # fixed for a fit
            self._unseen = np.asarray(self.datamodule.unseen_clients, dtype=np.int64)
        empty_mask = np.asarray(counts) == 0
        empty_mask[self._unseen] = False
        empty = np.flatnonzero(empty_mask).tolist()
        if empty:
            self._warned_empty = True
            warnings.warn(
                f"Skipping {len(empty)} client(s) with no training data: {empty[:10]}"
                + ("..." if len(empty) > 10 else ""),
                stacklevel=4,
            )

    def _participants(self, round_idx: int, p: torch.Tensor) -> Participation:
        """The aggregator's participation (the sampler's, or its own), without the clients
        that have no data this round."""
        sampler = self.fit.plugins.sampler
        if sampler.needs_losses:
            sampler.losses = lambda clients: self._probe_losses(clients, round_idx)
        participation = self.fit.plugins.aggregator.participation(
            round_idx, self.fit.config.seed, p, sampler
        )
        return self._skip_clients_without_data(participation, round_idx)

    def _skip_clients_without_data(
        self, participation: Participation, round_idx: int
    ) -> Participation:
        """Drop the participants with no training data this round (a stream client outside
        its window): their update counts as zero, the others' weights are kept (the
        data-streams analysis's convention for absent clients). Counted in
        ``fl/skipped_empty``; the first time, a warning names them."""
        empty = set(self.datamodule.clients_without_data_now(participation.clients))
        self.skipped_now = len(empty)
        if not empty:
            return participation
        if not self._warned_skipped:
            self._warned_skipped = True
            warnings.warn(
                f"Round {round_idx}: clients {sorted(empty)[:10]} have no training data this "
                "round (outside their arrival window) and are skipped; fl/skipped_empty "
                "counts them every round.",
                stacklevel=5,
            )
        kept = [(c, w) for c, w in zip(participation.clients, participation.weights)
                if c not in empty]  # fmt: skip
        return Participation(tuple(c for c, _ in kept), tuple(w for _, w in kept))

    @torch.no_grad()
    def _probe_losses(self, clients: list[int], round_idx: int) -> list[float]:
        """The current global model's training loss on one batch of each of ``clients``
        (CA-Fed's report from every available client, thesis Alg. 6): each rank computes
        its own clients', summed over ranks. The batch is the first of a loader shuffled
        with (seed, "loss_probe", round, client)."""
        fit, dm = self.fit, self.datamodule
        losses = torch.zeros(len(clients), dtype=torch.float64, device=fit.device)
        for i, client in enumerate(clients):
            if fit.ranks.owner(client) != fit.ranks.rank:
                continue
            loader = dm.client_dataloader(
                dm.client_dataset(client, "train"), "train",
                generator(fit.config.seed, "loss_probe", round_idx, client),
            )  # fmt: skip
            batch = fit.to_device(next(iter(loader)))
            losses[i] = float(fit.module.loss_and_metrics(batch)[0])
        if (group := collectives.across_ranks(fit.ranks.world_size)) is not None:
            group.all_reduce(losses)
        return losses.cpu().tolist()

    def packs(self, client: int) -> bool:
        """Whether ``client``'s training data is packed on the device (not the pooled or
        server pseudo-clients)."""
        return self.fit.packed is not None and client >= 0

    def _loader(self, client: int, round_idx: int) -> DataLoader:
        """A participant's training loader, shuffled with (seed, "data", round, client)
        (over its packed tensors on the device, when they are)."""
        dm = self.datamodule
        if self.packs(client):
            dataset = self.fit.packed.client_dataset(client)
        elif client == POOLED_CLIENT:
            dataset = dm.pooled_dataset("train")
        elif client == SERVER_CLIENT:
            dataset = dm.server_dataset()
        else:
            dataset = dm.client_dataset(client, "train")
        rng = generator(self.fit.config.seed, "data", round_idx, client)
        return dm.client_dataloader(dataset, "train", rng)

    def _num_batches(
        self, clients: Sequence[int], loaders: dict[int, DataLoader | None], round_idx: int
    ) -> list[int]:
        """Each participant's local batches: K, E passes over its loader (or over its
        packed data: E·⌈n/B⌉), or the server's one SGD step (SAFARI, Alg. 1 line 10)."""
        config, packed = self.fit.config, self.fit.packed
        if config.local_steps is not None:
            return [1 if c == SERVER_CLIENT else config.local_steps for c in clients]
        per_pass = self.fit.federation.batches_per_pass
        if per_pass is not None:  # silo mode: from every silo's counts, no other's loader
            return [1 if c == SERVER_CLIENT else config.local_epochs * per_pass[c] for c in clients]
        if packed is not None and (not clients or min(clients) >= 0):
            per_pass = packed.num_batches_per_pass(clients)
            return (config.local_epochs * per_pass).tolist()
        if packed is not None:
            loaders = {i: self._loader(c, round_idx) for i, c in enumerate(clients)}
        return [self._client_batches(c, loaders.get(i)) for i, c in enumerate(clients)]

    def _client_batches(self, client: int, loader: DataLoader | None) -> int:
        if client == SERVER_CLIENT:
            return 1
        try:
            return self.fit.config.local_epochs * len(loader)
        except TypeError as err:
            raise TypeError(
                "local_epochs needs client loaders with a length; use local_steps for "
                "iterable-style client datasets."
            ) from err

    def _schedules(
        self, clients: list[int], batches: list[int], per_rank: list[list[int]]
    ) -> tuple[ClientSchedule, ClientSchedule, list[tuple[int, ...]] | None]:
        """This rank's client schedule, its schedule of Lightning steps and, with
        vectorized clients, its chunks; padded to the longest rank's number of steps."""
        config = self.fit.config
        size, fused = config.max_vectorized_clients, config.local_steps_per_training_step
        if not config.vectorize and fused == 1:
            longest = max(map(sum, per_rank))
            if longest > sum(batches):
                clients, batches = [*clients, PADDING], [*batches, longest - sum(batches)]
            schedule = ClientSchedule(tuple(clients), tuple(batches))
            return schedule, schedule, None
        # vectorized chunks of clients, or (fused local steps) one client per "chunk"
        size = size if config.vectorize else 1
        chunks = chunk_positions(range(len(clients)), size)
        steps = [_fused(max([batches[p] for p in chunk]), fused) for chunk in chunks]
        longest = max(_chunked_steps(counts, size, fused) for counts in per_rank)
        step_ids = list(range(len(chunks)))
        if longest > sum(steps):
            step_ids.append(PADDING)
            steps.append(longest - sum(steps))
        schedule = ClientSchedule(tuple(clients), tuple(batches))
        steps_schedule = ClientSchedule(tuple(step_ids), tuple(steps))
        return schedule, steps_schedule, chunks if config.vectorize else None

    def _round_state(
        self,
        round_idx: int,
        participation: Participation,
        counts: np.ndarray,
        p: torch.Tensor,
        schedule: ClientSchedule,
    ) -> RoundState:
        """What the round's hooks see: θ^t, a zero update sum, the weights and, for a
        sampler that needs them, a row per participant for their updates."""
        fit = self.fit
        model = fit.tensors
        global_tensors = model.clone()
        local_steps = {c: n for c, n in zip(schedule.clients, schedule.num_batches) if c != PADDING}
        state = RoundState(
            round_idx=round_idx,
            participation=participation,
            global_tensors=global_tensors,
            update_sum=zeros_like(global_tensors),
            model=model,
            store=fit.store,
            num_clients=self.datamodule.num_clients,
            sample_counts=counts,
            target_weights=p,
            local_steps=local_steps,
        )
        for plugin in fit.plugins.callbacks:  # declared server state like θ, at zero once
            for name in plugin.server_state_like_params():
                if getattr(plugin, name) is None:
                    setattr(plugin, name, zeros_like(global_tensors[: model.num_params]))
        # the declared round sums, at zero
        state.extra_sums.update(
            zero_round_sums(fit.plugins.callbacks, global_tensors[: model.num_params])
        )
        for plugin in fit.plugins.callbacks:
            for name in plugin.declared_round_rows():  # a row per participant, at zero
                rows = torch.zeros(len(participation.clients), flat_size(global_tensors),
                                   dtype=global_tensors[0].dtype, device=fit.device)  # fmt: skip
                state.extra_sums[plugin.round_sum_key(name)] = [rows]
        if fit.plugins.sampler.needs_updates or fit.plugins.aggregator.needs_client_updates:
            size = flat_size(global_tensors) + 1
            rows = torch.zeros(len(participation.clients), size, device=fit.device,
                               dtype=global_tensors[0].dtype)  # fmt: skip
            state.extra_sums[CLIENT_UPDATES] = [rows]
        return state


def _fused(local_steps: int, fused: int | None) -> int:
    """Lightning steps that run ``local_steps`` local steps, ``fused`` at a time (None: all
    in one; none for none)."""
    if local_steps == 0:
        return 0
    return 1 if fused is None else -(-local_steps // fused)


def _chunked_steps(batches: list[int], size: int | None, fused: int | None) -> int:
    """Lightning steps of a rank whose clients have ``batches`` local batches each, with
    vectorized clients in chunks of at most ``size``: the longest client of every chunk,
    ``fused`` local steps per Lightning step."""
    chunks = chunk_positions(range(len(batches)), size)
    return sum(_fused(max([batches[p] for p in chunk]), fused) for chunk in chunks)
