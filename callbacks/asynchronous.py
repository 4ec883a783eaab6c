"""Asynchronous FL with stale client updates (Fraboni, Vidal, Kameni, Lorenzi, JMLR 2023;
Fraboni thesis ch. 4, Alg. 4), on the simulated clock of :mod:`lightning_fl.systems.asynchrony`."""

from __future__ import annotations

import os
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from lightning_fl.checks import require_rate
from lightning_fl.engine.outputs import append_csv, run_dir
from lightning_fl.engine.plugins import Aggregator, RoundState, Weighting
from lightning_fl.engine.tensors import TensorList, flatten, unflatten
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.asynchrony import Aggregation, Schedule, exact
from lightning_fl.systems.samplers import ClientSampler, FullParticipation, Participation


class AsynchronousFL(Aggregator):
    """The server of Alg. 4: aggregation n (one Lightning epoch) happens at the time its
    ``schedule`` gives, with the updates of the clients that have returned since, each
    computed from the global model θ^{ρ_i(n)} that client last received:

        θ^{n+1} = θ^n + η_g Σ_{i∈S_n} d_i Δ_i(ρ_i(n)),   Δ_i(ρ) = θ_i^{ρ,K} − θ^ρ.

    Training is lazy, as in the authors' simulator: a client's K local steps are computed
    when its update is aggregated, from the stale model it started from, so the whole run
    stays in the sequential round loop. Only the model versions that some in-flight client
    still needs are kept (at most one per client: M·d·4 bytes in the worst case, typically
    a few versions); they are saved in checkpoints with the schedule.

    Args:
        schedule: :class:`~lightning_fl.systems.asynchrony.SyncSchedule`, ``AsyncSchedule``,
            ``FedFixSchedule`` or ``FedBuffSchedule``, with its client times.
        weights: ``"time_based"`` (the scheme's unbiased d_i: p_i for sync, eq. 4.36 for
            async, eq. 4.40 for FedFix, p_i / participation frequency for FedBuff) or
            ``"identical"`` (the same d_i for all: 1 for async, 1/c for FedBuff, 1/M for
            sync and FedFix).
        server_lr: η_g.
        time_budget: stop once the next aggregation would end after this simulated time
            (also ``max_epochs`` aggregations at most).
        weighting: the target weights p_i of the federated problem Σ p_i L_i.

    Every round logs ``fl/time`` (t^{n+1}) and ``fl/staleness`` (mean n − ρ_i(n) of the
    aggregated updates). Clients are the datamodule's clients with training data, in
    order; use the default FullParticipation sampler (the schedule decides who returns).
    """

    traits = {
        Trait.NEEDS_FULL_PARTICIPATION: (
            "drop the sampler (FullParticipation, the default), without Unlearning"
        ),
        Trait.AGGREGATES_OUTSIDE_SYNCHRONOUS_ROUNDS: "",
        Trait.STEPS_OTHERWISE_THAN_FEDAVG: "",
    }
    #: each client's model version and pending update, kept in the callback
    undeclared_client_state = "owner"

    supports_vectorized_clients = True  # no per-step hook: clients start and end as sequentially

    aggregates_empty_rounds = True  # FedFix windows with no return still advance the clock

    def __init__(
        self,
        schedule: Schedule,
        weights: Literal["time_based", "identical"] = "time_based",
        server_lr: float = 1.0,
        time_budget: float | None = None,
        weighting: Weighting = "samples",
    ) -> None:
        super().__init__(weighting)
        if weights not in ("time_based", "identical"):
            raise ValueError(f"weights must be 'time_based' or 'identical', got {weights!r}.")
        require_rate("server_lr", server_lr, 1.0)
        if time_budget is not None and not time_budget > 0:
            raise ValueError(f"time_budget must be > 0 time units, got {time_budget}.")
        self.weights, self.server_lr = weights, server_lr
        self.add_server_state("schedule", schedule, stateful=True)  # the simulated clock
        self.add_server_state("models", {})  # version -> θ^v, the versions still training
        self.time_budget = time_budget
        self.clients: list[int] = []
        self.d = np.zeros(0)
        self._event: Aggregation | None = None
        self._start_model: Tensor | None = None
        self._surrogate: np.ndarray | None = None

    # ---- set-up ----------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        if type(strategy.sampler) is not FullParticipation:
            raise ValueError(
                f"AsynchronousFL chooses who returns from the simulated clock; the strategy's "
                f"{type(strategy.sampler).__name__} would conflict: drop the sampler (the "
                "default FullParticipation)."
            )
        counts = self.view.sample_counts
        self.clients = [c for c, n in enumerate(counts) if n > 0]
        if not self.restored:  # a fresh fit: a resumed one loaded its schedule and versions
            self.schedule.reset(len(self.clients), self.view.config.seed)
            self.models = {0: flatten([t.detach() for t in self.view.tensors.tensors])}
        p = self.target_weights(counts).numpy()[self.clients]
        p = p / p.sum()
        self._surrogate = None
        if self.weights == "time_based":
            self.d = self.schedule.time_based_weights(p)
        else:
            self.d = self.schedule.identical_weights()
        if self.time_budget is not None and self.schedule.round == 0:
            first = self.schedule.plan().time
            if first > exact(self.time_budget):
                raise ValueError(
                    f"time_budget = {self.time_budget} allows no aggregation: the first one "
                    f"ends at t = {float(first):g}; raise time_budget."
                )

    def participation(
        self, round_idx: int, seed: int, p: torch.Tensor, sampler: ClientSampler
    ) -> Participation:
        if round_idx != self.schedule.round:
            raise RuntimeError(
                f"Round {round_idx} but the asynchronous schedule is at aggregation "
                f"{self.schedule.round}: resume from a checkpoint that holds its state."
            )
        self._event = self.schedule.plan()
        clients = tuple(self.clients[i] for i in self._event.clients)
        return Participation(clients, tuple(float(self.d[i]) for i in self._event.clients))

    def _version(self, client: int, state: RoundState) -> int:
        position = self._event.clients.index(self.clients.index(client))
        return self._event.versions[position]

    # ---- one aggregation ---------------------------------------------------------------
    def on_round_start(self, trainer, pl_module, state: RoundState) -> None:
        self._start_model = flatten(state.global_tensors)

    @torch.no_grad()
    def on_client_start(self, trainer, pl_module, client: int, state: RoundState) -> None:
        version = self._version(client, state)
        if version != state.round_idx:  # train from the stale θ^ρ the client received
            model = state.model
            model.load_(unflatten(self.models[version].to(self._start_model), model.tensors))

    @torch.no_grad()
    def transform_update(
        self, trainer, pl_module, client: int, update: TensorList, state: RoundState
    ) -> TensorList:
        """θ_i − θ^n (the strategy's update) + (θ^n − θ^ρ) = Δ_i(ρ), the client's own."""
        version = self._version(client, state)
        if version == state.round_idx:
            return update
        drift = self._start_model - self.models[version].to(self._start_model)
        return torch._foreach_add(update, unflatten(drift, update))

    @torch.no_grad()
    def aggregate(self, trainer, pl_module, state: RoundState) -> None:
        torch._foreach_add_(state.global_tensors, state.update_sum, alpha=self.server_lr)
        n = state.round_idx
        self.schedule.commit(self._event)
        known = {**self.models, n: self._start_model, n + 1: flatten(state.global_tensors)}
        self.models = {v: known[v].clone() for v in sorted(self.schedule.needed_versions())}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._event is None:
            return
        event = self._event
        staleness = [self.schedule.round - 1 - v for v in event.versions]
        # float64: float32 would keep 0.016 of resolution at t = 2·10⁵
        now = torch.tensor(float(self.schedule.now), dtype=torch.float64, device=pl_module.device)
        sync = trainer.world_size > 1  # every rank plans the same schedule
        pl_module.log("fl/time", now, on_epoch=True, batch_size=1, sync_dist=sync)
        mean_staleness = float(np.mean(staleness)) if staleness else 0.0
        pl_module.log("fl/staleness", mean_staleness, on_epoch=True, sync_dist=sync)
        if self.time_budget is not None and self.schedule.plan().time > exact(self.time_budget):
            trainer.should_stop = True

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and trainer.loggers:
            path = os.path.join(run_dir(trainer), "updates_per_client.csv")
            rows = zip(self.clients, self.updates_per_client().tolist())
            append_csv(path, ("client", "updates"), rows)

    def updates_per_client(self) -> np.ndarray:
        """How many updates each client has sent so far (clients with training data)."""
        return self.schedule.starts.copy()

    def surrogate_weights(self) -> np.ndarray:
        """The stationary weights q_i ∝ (participation frequency)·d_i of the problem the
        scheme actually optimizes (thesis eq. 4.10); = p with TIME-BASED weights."""
        if self._surrogate is None:  # a dry run of the schedule, once per fit
            q = self.schedule.participation_frequency() * self.d
            self._surrogate = q / q.sum()
        return self._surrogate
