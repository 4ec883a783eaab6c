"""The round's life cycle on one rank (docs/architecture.md, "One round is one Lightning epoch",
steps 3–5).

At a client's first batch the global weights θ^t are loaded in place, its optimizer
state is reset (or restored) and the callbacks apply its persistent state; after its last
optimizer step, its update Δ_i = θ_i − θ^t is folded into Σ ω_i Δ_i (or dropped if it is
not finite); after the last participant, one all-reduce sums the round over ranks and the
one aggregator callback writes θ^{t+1}.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from lightning_fl.engine import collectives
from lightning_fl.engine.context import FitContext
from lightning_fl.engine.planning import RoundPlan, RoundPlanner
from lightning_fl.engine.plugins import CLIENT_UPDATES, Aggregator, FederatedCallback, RoundState
from lightning_fl.engine.seeding import derive_seed, seed_global_rng
from lightning_fl.engine.tensors import TensorList, all_finite, flat_size, flatten, unflatten


class NonFiniteUpdateError(RuntimeError):
    """Too many consecutive rounds had NaN or Inf client updates."""


class RoundEngine:
    """Runs the rounds of one rank of a fit (``fit``): plans each round (a
    :class:`RoundPlanner`), starts and finishes its clients, and ends it. Holds the round
    in progress (``current_round``, ``current_client``) and the count of consecutive
    rounds with dropped updates (checkpointed)."""

    def __init__(self, fit: FitContext) -> None:
        self.fit = fit
        self.planner = RoundPlanner(fit)
        self.current_round: RoundPlan | None = None
        self.current_client: tuple[int, int] | None = None  # (position, local step)
        self.consecutive_bad_rounds = 0

    def begin_round(self, round_idx: int) -> RoundPlan:
        """Plan ``round_idx`` and run the ``on_round_start`` hooks. A round without
        participants is ended at once when the aggregator aggregates empty rounds (its
        clock still advances)."""
        self.current_round = self.planner.plan(round_idx)
        self.call("on_round_start", self.current_round.state)
        aggregator = self.fit.plugins.aggregator
        if (
            not self.current_round.state.participation.clients
            and aggregator.aggregates_empty_rounds
        ):
            self.end_round()
        return self.current_round

    def start_client(self, pos: int) -> None:
        """Load θ^t, seed the global RNG with (seed, "client", round, client), reset or
        restore the client's optimizer state and run ``on_client_start``."""
        fit, state = self.fit, self.current_round.state
        client = self.current_round.schedule.clients[pos]
        fit.tensors.load_(state.global_tensors)
        seed = derive_seed(fit.config.seed, "client", state.round_idx, client)
        seed_global_rng(seed, fit.device)
        for i, optimizer in enumerate(fit.trainer.optimizers):
            optimizer.state.clear()
            kept = fit.config.keep_optimizer_state
            saved = fit.store.get(client, f"optimizer_{i}") if kept else None
            if saved is not None:
                optimizer.load_state_dict(
                    {"state": saved, "param_groups": optimizer.state_dict()["param_groups"]}
                )
        self.call("on_client_start", client, state)

    def finish_client(self, pos: int, optimizer_states: list[dict] | None = None) -> None:
        """Fold the client's update into the weighted sum (after its last optimizer step).
        ``optimizer_states``: the client's optimizer states to keep (default: those of the
        module's optimizers)."""
        fit, state = self.fit, self.current_round.state
        client = self.current_round.schedule.clients[pos]
        update = fit.tensors.minus(state.global_tensors)
        trainer, module = fit.trainer, fit.module
        # the aggregator's first: it turns the strategy's update into the client's own Δ_i
        # (against its cluster's model, its stale model), which the others then change
        for cb in self.ordered_callbacks("transform_update"):
            update = cb.transform_update(trainer, module, client, update, state)
        update = fit.plugins.aggregator.receive_update(client, update, state)
        if not all_finite(update):
            state.dropped.append(client)
            warnings.warn(
                f"Round {state.round_idx}: client {client} sent an update with NaN or Inf; "
                "it is dropped from this round.",
                stacklevel=2,
            )
            return
        torch._foreach_add_(state.update_sum, update, alpha=state.weight_of(client))
        state.accepted.append(client)
        if CLIENT_UPDATES in state.extra_sums:
            rows, row = state.extra_sums[CLIENT_UPDATES][0], state.row_of(client)
            rows[row, :-1], rows[row, -1] = flatten(update), 1.0  # the update, and 'sent'
        if fit.config.keep_optimizer_state:
            if optimizer_states is None:
                optimizer_states = [
                    copy.deepcopy(optimizer.state_dict()["state"])
                    for optimizer in trainer.optimizers
                ]
            for i, optimizer_state in enumerate(optimizer_states):
                fit.store.set(client, f"optimizer_{i}", optimizer_state)
        self.call("on_client_end", client, update, state)

    @torch.no_grad()
    def finish_clients(self, clients: list[int], stacked: TensorList) -> None:
        """:meth:`finish_client` for the rows of a vectorized chunk at once, when no
        callback needs a client hook (``VectorizedClients.batched_lifecycle``): row r of
        every tensor of ``stacked`` is ``clients[r]``'s trained model. A row whose update
        has NaN or Inf is dropped as on the sequential path; the others are folded with
        one weighted sum per tensor, Σ_r ω_r (θ_r − θ^t), not one addition per client, so
        the sum equals the sequential path's to float round-off."""
        state = self.current_round.state
        finite = torch.ones(len(clients), dtype=torch.bool, device=stacked[0].device)
        for rows, start in zip(stacked, state.global_tensors):
            finite &= (rows - start).flatten(1).isfinite().all(dim=1)
        keep = None if bool(finite.all()) else torch.nonzero(finite).flatten()
        if keep is not None:
            bad = set(torch.nonzero(~finite).flatten().tolist())
            for client in (c for r, c in enumerate(clients) if r in bad):
                state.dropped.append(client)
                warnings.warn(
                    f"Round {state.round_idx}: client {client} sent an update with NaN or "
                    "Inf; it is dropped from this round.",
                    stacklevel=2,
                )
            clients = [c for r, c in enumerate(clients) if r not in bad]
            stacked = [rows[keep] for rows in stacked]
        omega = torch.tensor(state.weights_of(clients), device=stacked[0].device)
        update_rows = state.extra_sums.get(CLIENT_UPDATES)
        flat_updates = []
        for total, rows, start in zip(state.update_sum, stacked, state.global_tensors):
            updates = rows - start
            total.add_(torch.tensordot(omega.to(updates.dtype), updates, dims=1))
            if update_rows is not None:
                flat_updates.append(updates.flatten(1))
        if update_rows is not None and clients:
            positions = torch.tensor(state.rows_of(clients), device=update_rows[0].device)
            sent = torch.ones(len(clients), 1, device=update_rows[0].device)
            update_rows[0][positions] = torch.cat([*flat_updates, sent], 1)
        state.accepted.extend(clients)

    def end_round(self) -> RoundState:
        """Aggregate, load θ^{t+1} into the module, and run the round-end hooks."""
        fit, state = self.fit, self.current_round.state
        self.call("on_before_round_sum", state)
        dropped, missing = self._all_reduce_round(state)
        state.dropped_count = dropped + self._drop_missing_sites(state, missing)
        self.planner.return_states(self.current_round)
        self.consecutive_bad_rounds = self.consecutive_bad_rounds + 1 if dropped else 0
        if self.consecutive_bad_rounds >= fit.config.max_consecutive_bad_rounds:
            raise NonFiniteUpdateError(
                f"{self.consecutive_bad_rounds} consecutive rounds had NaN/Inf client updates "
                f"(last: clients {state.dropped}). Lower the learning rate, clip gradients "
                "(Trainer(gradient_clip_val=...)) or check the data; raise "
                "max_consecutive_bad_rounds to tolerate more."
            )
        fit.plugins.aggregator.aggregate(fit.trainer, fit.module, state)
        fit.tensors.load_(state.global_tensors)
        if fit.plugins.sampler.needs_updates:
            clients, updates, _ = state.received_updates()  # accepted on some rank
            fit.plugins.sampler.observe(clients, updates, state.num_clients)
        self.call("on_round_end", state)
        return state

    def _all_reduce_round(self, state: RoundState) -> tuple[int, frozenset[int]]:
        """Sum the weighted updates, the callbacks' round sums, the number of dropped
        (NaN/Inf) updates and the module's training-metric sums over all ranks in one
        all-reduce (or a plugin's masked one:
        ``FederatedCallback.sum_over_ranks``); returns the total dropped and the ranks
        missing from the sum (sites that dropped)."""
        if not self.fit.ranks.distributed:
            return len(state.dropped), frozenset()
        group = collectives.across_ranks(self.fit.ranks.world_size)
        sums = [state.update_sum, *state.extra_sums.values()]
        flat = [flatten(s) for s in sums]
        dropped = torch.tensor([float(len(state.dropped))], device=self.fit.device)
        # a FederatedTask's training metrics ride the same sum (engine/round_metrics.py)
        metrics = getattr(self.fit.module, "round_metric_sums", None)
        carried = None if metrics is None else metrics.part(group, dropped.device, flat[0].dtype)
        buffer = torch.cat([*flat, dropped, *([carried] if carried is not None else [])])
        summed = (cb.sum_over_ranks(buffer, state.round_idx) for cb in self.fit.plugins.callbacks)
        secure = next((b for b in summed if b is not None), None)
        if secure is None:
            missing = group.sum_present(buffer)
        else:
            buffer, missing = secure
        offset = 0
        for part in sums:
            size = flat_size(part)
            torch._foreach_copy_(part, unflatten(buffer[offset : offset + size], part))
            offset += size
        if carried is not None:
            metrics.take(buffer[offset + 1 :])
        return int(buffer[offset].item()), missing

    def _drop_missing_sites(self, state: RoundState, missing: frozenset[int]) -> int:
        """The participants trained by the ``missing`` ranks (sites that dropped before
        their part of the round's sum arrived): their updates are not in the sum, so
        they are dropped updates, as a NaN update is (the others keep their weights ω_i:
        θ^{t+1} = θ^t + Σ_{i arrived} ω_i Δ_i, not renormalized), listed on every site
        that remains, counted in ``fl/dropped_updates`` but not as a bad round (nothing
        diverged). Returns how many."""
        if not missing:
            return 0
        plan = self.current_round
        clients = [c for c, r in zip(state.participation.clients, plan.trained_by or [])
                   if r in missing]  # fmt: skip
        state.dropped.extend(clients)
        names = self.fit.site_names
        sites = ", ".join(repr(names[r]) if names else f"rank {r}" for r in sorted(missing))
        warnings.warn(
            f"Round {state.round_idx}: site {sites} dropped before its part of the round's "
            f"sum arrived; its {len(clients)} participant(s) {clients} are dropped updates "
            "and the round goes on with the other sites.",
            stacklevel=2,
        )
        return len(clients)

    def call(self, hook: str, *args: Any) -> None:
        """Run ``hook`` on every federated callback, the aggregator first: it decides
        which model a client starts from (a cluster's, a gossip neighbour's, its own).
        Evaluation observers (membership inference) run before everyone in the client
        evaluation hooks: at the start they see the global model, at the end the
        personalized one."""
        trainer, module = self.fit.trainer, self.fit.module
        for cb in self.ordered_callbacks(hook):
            getattr(cb, hook)(trainer, module, *args)

    def ordered_callbacks(self, hook: str) -> list[FederatedCallback]:
        """The federated callbacks in the order ``hook`` runs on them (see :meth:`call`)."""
        evaluation = hook.startswith("on_client_evaluation")

        def order(cb: FederatedCallback) -> int:
            if evaluation and cb.evaluation_observer:
                return 0  # observers see the model before and after personalization
            return 1 if isinstance(cb, Aggregator) else 2

        return sorted(self.fit.plugins.callbacks, key=order)  # stable
