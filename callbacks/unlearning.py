"""Federated unlearning: SIFU (IFU for a single request) and the baselines of its paper
(Fraboni et al., AISTATS 2024; Fraboni thesis ch. 5), and a reusable target-based stop."""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_fl.callbacks.objective import client_training_metrics
from lightning_fl.engine import collectives
from lightning_fl.engine.plugins import FederatedCallback, RoundState
from lightning_fl.engine.tensors import TensorList, add_flat_, flatten, unflatten
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.forgetting import SHARED_TRAINING, ForgettingRequest, forgetting_method
from lightning_fl.systems.samplers import ClientSampler, Participation, SamplerWrapper
from lightning_fl.systems.unlearning import (
    BranchHistory,
    ModelVersions,
    check_privacy,
    sensitivity_increments,
    sensitivity_threshold,
)

Method = Literal["sifu", "scratch", "fine_tuning", "last", "dp", "fedaccum"]


class StopAtTarget(pl.Callback):
    """Stop training once ``monitor`` reaches ``target`` (≥ for ``mode="max"``), after at
    least ``min_rounds`` rounds and at most ``max_rounds`` (the stopping rule of the
    unlearning experiments, thesis §5.5: target accuracy, 50 to 10,000 rounds).
    :meth:`reached` is the test, for callbacks that chain phases on it.

    The check runs every ``check_every`` rounds of a phase, more often as the value nears
    the target: ``check_near=[(gap, every), ...]`` checks every ``every`` rounds once a
    checked value came within ``gap`` of the target, for the rest of the phase. The SIFU
    authors' schedule (``FL/simu_unlearning.py`` of the SIFU branch of
    Accenture/Labs-Federated-Learning, accuracies in percent there) is ``check_every=20``,
    ``check_near=[(0.05, 10), (0.025, 5), (0.01, 2), (0.005, 1)]``, counted from the phase's
    round 0 (the model it starts from, see :meth:`observe`). The defaults check every
    round."""

    def __init__(
        self,
        monitor: str,
        target: float,
        min_rounds: int = 0,
        max_rounds: int | None = None,
        mode: Literal["max", "min"] = "max",
        check_every: int = 1,
        check_near: list[tuple[float, int]] | None = None,
    ) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}.")
        if min_rounds < 0 or (max_rounds is not None and max_rounds < max(min_rounds, 1)):
            raise ValueError(
                f"Need 0 <= min_rounds <= max_rounds, got {min_rounds} and {max_rounds}."
            )
        near = [(float(gap), int(every)) for gap, every in (check_near or [])]
        if check_every < 1 or any(gap < 0 or every < 1 for gap, every in near):
            raise ValueError(
                f"Need check_every >= 1 and check_near pairs (gap >= 0, every >= 1), got "
                f"check_every={check_every}, check_near={check_near}."
            )
        self.monitor, self.target, self.mode = monitor, target, mode
        self.min_rounds, self.max_rounds = min_rounds, max_rounds
        self.check_every, self.check_near = check_every, near
        #: rounds between checks in the current phase (only ever decreases within one)
        self.period = check_every

    @property
    def scheduled(self) -> bool:
        """Whether the checks can be less frequent than every round."""
        return self.check_every > 1

    def start_phase(self) -> None:
        """A new phase checks every ``check_every`` rounds again."""
        self.period = self.check_every

    def due(self, rounds: int) -> bool:
        """Whether the value is checked after ``rounds`` rounds of the phase (always at
        ``max_rounds``, which ends it)."""
        capped = self.max_rounds is not None and rounds >= self.max_rounds
        return capped or rounds % self.period == 0

    def observe(self, value: float) -> None:
        """Check more often from now on when ``value`` is within a ``check_near`` gap of
        the target (the authors' ``T_loss_acc``, set after each check that does not stop,
        including the check of the model a phase starts from)."""
        for gap, every in self.check_near:  # as the authors compare: acc >= target - gap
            near = value >= self.target - gap if self.mode == "max" else value <= self.target + gap
            if near:
                self.period = min(self.period, every)

    def state_dict(self) -> dict:
        return {"period": self.period}

    def load_state_dict(self, state: dict) -> None:
        self.period = int(state["period"])

    def reached(self, value: float | None, rounds: int) -> bool:
        """True when ``rounds`` rounds with a last value ``value`` end the phase."""
        if self.max_rounds is not None and rounds >= self.max_rounds:
            return True
        if value is None or rounds < self.min_rounds:
            return False
        return value >= self.target if self.mode == "max" else value <= self.target

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        rounds = trainer.current_epoch + 1
        if not self.due(rounds):
            return
        value = trainer.callback_metrics.get(self.monitor)
        value = None if value is None else float(value)
        if self.reached(value, rounds):
            trainer.should_stop = True
        elif value is not None:
            self.observe(value)


class _RequestAwareSampler(SamplerWrapper):
    """The strategy's sampler, asked only among the clients not yet removed, after the
    unlearning callback has applied the requests due this round."""

    def __init__(self, sampler: ClientSampler, unlearning: Unlearning) -> None:
        super().__init__(sampler)
        self.unlearning = unlearning

    def sample(self, round_idx: int, seed: int, p: torch.Tensor) -> Participation:
        self.unlearning.apply_due_requests(round_idx)
        p = p.clone()
        p[sorted(self.unlearning.removed)] = 0.0
        return self.sampler.sample(round_idx, seed, p / p.sum())


class Unlearning(FederatedCallback):
    """Unlearning requests during FedAvg training, by SIFU (Alg. 7; IFU, Alg. 6, is its
    single-request case) or a baseline.

    During training, for every participating client i (Alg. 6, App. D.2.5):

        Ψ_r(n+1, i) = decay·Ψ_r(n, i) + η_g (p_i/(1 − p_i)) ‖Δ_i − Δ̄‖₂,

    with p_i the aggregator's target weight of i renormalized over the remaining clients
    (uniform in the authors' code; see :meth:`sensitivity_increments`) and 0 added for
    the others. A request W_r (at a round of ``requests``, or :meth:`request` between fits)
    removes W_r for good: its clients are never sampled again (the sampler is wrapped, see
    :meth:`wrap_sampler`), so their training data is never read again. The model then
    restarts as the method says (one object each, :mod:`lightning_fl.systems.forgetting`):
    ``"sifu"`` from θ_ζ^T + N(0, σ² I), (ζ_r, T_r) from the branch history (eqs.
    5.17–5.19) and Ψ* = εσ/sqrt(2 ln(1.25/δ)) (eq. 5.13); ``"scratch"`` from θ_0^0;
    ``"fine_tuning"`` from θ; ``"last"`` from θ + N(0, σ_L² I) (Thm 5.2); ``"dp"`` from θ,
    kept private by clipped updates and noise after every aggregation; ``"fedaccum"`` from
    a shadow model without the removal set (``requests`` known in advance, one process).

    Args:
        method: see above.
        epsilon, delta, sigma: ε, δ and the SIFU noise σ (Tab. D.1: 10, 0.01, 0.05).
        requests: ``{round: [clients]}`` removed at the start of that round, or, with
            ``on_target``, a list of client sets removed one after another each time
            training reaches the target.
        on_target: a :class:`StopAtTarget` on ``unlearning/remaining_train_acc``: train to
            the target, then apply the next request, retrain to the target, …, and stop
            after the last one (the thesis's protocol). The rounds of each phase are in
            :attr:`phase_rounds`, and, with ``evaluate_forgotten``, the accuracy on the
            clients forgotten so far when each phase reached the target in
            :attr:`phase_forgotten_acc` (NaN before the first request); both are kept in
            checkpoints.
        decay: (1 − η_l λ)^K for an L2 weight λ (Cor. 5.1); 1 without.
        clip: C of the DP baseline.
        evaluate_every: rounds between evaluations of the remaining clients without
            ``on_target``; with it, ``on_target`` says when (:meth:`StopAtTarget.due`).
        evaluate_forgotten: also measure the accuracy on the removed clients' training
            data (an experimenter's metric: a real server no longer holds that data, and
            without it the removed clients' data is never read again).
        seed: seed of the noise draws.

    Logs ``unlearning/remaining_train_acc`` (p-weighted accuracy on the remaining clients'
    training data), ``unlearning/forgotten_acc`` (on the removed clients' training data;
    lower is better, SCRATCH is the reference), ``unlearning/branch``.
    """

    traits = {
        Trait.LEAVES_CLIENTS_OUT: "",
        Trait.NEEDS_THE_FEDAVG_STEP: "",
        Trait.CHANGES_TARGET_WEIGHTS: "",
    }
    #: each client's contributions and removal records, kept in the callback
    undeclared_client_state = "owner"

    supports_vectorized_clients = True  # no per-step hook: clients start and end as sequentially

    requires_task_loss = True

    def __init__(
        self,
        method: Method = "sifu",
        epsilon: float = 10.0,
        delta: float = 0.01,
        sigma: float = 0.05,
        requests: dict[int, list[int]] | list[list[int]] | None = None,
        on_target: StopAtTarget | None = None,
        decay: float = 1.0,
        clip: float = 0.5,
        evaluate_every: int = 1,
        evaluate_forgotten: bool = False,
        seed: int = 0,
    ) -> None:
        check_privacy(epsilon, delta, sigma)
        _check_settings(requests, on_target, decay, clip)
        #: the method's object: how a request restarts training, and its training hooks
        self.forgetting = forgetting_method(method, epsilon, delta, sigma, clip)
        self.method, self.epsilon, self.delta, self.sigma = method, epsilon, delta, sigma
        self.threshold = sensitivity_threshold(epsilon, delta, sigma)
        #: {round: clients} requests, or the on-target queue of client sets
        self.scheduled: dict[int, list[int]] = {}
        self.queue: list[list[int]] = []
        if isinstance(requests, dict):
            self.scheduled = {int(k): list(v) for k, v in requests.items()}
        elif requests is not None:
            self.queue = [list(q) for q in requests]
        self.on_target, self.decay, self.clip = on_target, decay, clip
        self.evaluate_every, self.seed = evaluate_every, seed
        self.evaluate_forgotten = evaluate_forgotten
        self.removed: list[int] = []  # clients forgotten so far
        self.pending: list[list[int]] = []  # requests to apply at the next round's start
        self.history: BranchHistory | None = None
        self.versions = ModelVersions()
        self.phase_rounds, self.phase_forgotten_acc, self._phase_start = [], [], 0
        self.done_requests: list[dict] = []
        self._deltas: dict[int, torch.Tensor] = {}
        self._start: torch.Tensor | None = None
        self._trainer: pl.Trainer | None = None
        self._foretold = False  # whether this fit already said that requests will not run

    @property
    def initial(self) -> torch.Tensor | None:
        """θ_0^0, the model training started from: branch 0 is always on the lineage, so
        its round 0 is always among the kept versions."""
        return self.versions.models.get((0, 0))

    # ---- requests ----------------------------------------------------------------------
    def request(self, clients: list[int]) -> None:
        """Forget ``clients`` at the start of the next round (e.g. between two fits)."""
        self.pending.append(list(clients))

    def apply_due_requests(self, round_idx: int) -> None:
        due = self.pending + ([self.scheduled[round_idx]] if round_idx in self.scheduled else [])
        self.pending = []
        for clients in due:
            self._forget(sorted(set(clients)), round_idx)

    @property
    def shadows(self) -> dict[tuple[int, ...], torch.Tensor]:
        """FEDACCUM's shadow models, one per removal set still to come (empty otherwise)."""
        return getattr(self.forgetting, "shadows", {})

    @torch.no_grad()
    def _forget(self, clients: list[int], round_idx: int) -> None:
        check_request(clients, self.removed, self.view.sample_counts)
        model = self.view.tensors
        current = flatten([t.detach() for t in model.tensors])
        request = ForgettingRequest(
            clients=clients,
            removed=list(self.removed),
            current=current,
            history=self.history,
            versions=self.versions,
            seed=self.seed,
            draw=(round_idx, len(self.done_requests)),
        )
        start, restart = self.forgetting.restart(request)
        if restart is None:  # the current node
            restart = (self.history.branch, self.history.rounds(self.history.branch))
        self.removed = sorted(set(self.removed) | set(clients))
        self.history.fork(clients)
        self.versions.keep((self.history.branch, 0), start.clone())
        self.versions.prune(self.history, self._remaining())
        model.load_(unflatten(start.to(current), model.tensors))
        self.done_requests.append({"round": round_idx, "clients": clients,
                                   "branch": restart[0], "restart_round": restart[1]})  # fmt: skip

    def _with_data(self) -> list[int]:
        """The federation's clients with training data, removed ones included."""
        return [c for c, n in enumerate(self.view.sample_counts) if n > 0]

    def _remaining(self) -> list[int]:
        removed = set(self.removed)
        return [c for c in self._with_data() if c not in removed]

    # ---- set-up ------------------------------------------------------------------------
    def wrap_sampler(self, sampler: ClientSampler) -> ClientSampler:
        """Draw only among the clients not yet removed (:class:`_RequestAwareSampler`)."""
        return _RequestAwareSampler(sampler, self)

    def on_fit_start(self, trainer, pl_module) -> None:
        self._trainer = trainer
        self.forgetting.check(trainer.world_size)
        model = flatten([t.detach() for t in self.view.tensors.tensors])
        if self.history is None:
            self.history = BranchHistory(trainer.datamodule.num_clients, self.threshold)
            self.versions.keep((0, 0), model.clone())
            ordered = [self.scheduled[k] for k in sorted(self.scheduled)] + self.queue
            self.forgetting.prepare(model, removal_sets(ordered, self.removed))
        self._foretold = self._check_run_length(trainer)

    def _check_run_length(self, trainer: pl.Trainer) -> bool:
        """Say (a warning, and a note of the run's summary) when ``max_epochs`` ends the
        run before a request can run. True when it did."""
        first = self.on_target.min_rounds if self.on_target is not None else 0
        queued = 0 if self.done_requests else len(self.queue)
        notes = run_length_notes(trainer.max_epochs, first, queued, self._undone_rounds())
        for note in notes:
            trainer.strategy.summary.note(note)
        return bool(notes)

    def _undone_rounds(self) -> list[int]:
        done = {request["round"] for request in self.done_requests}
        return sorted(r for r in self.scheduled if r not in done)

    def on_train_end(self, trainer, pl_module) -> None:
        left = len(self.queue) + len(self.pending) + len(self._undone_rounds())
        if left and not self._foretold:
            trainer.strategy.summary.note(
                f"Unlearning: {left} forgetting request(s) did not run before the run ended "
                f"after round {trainer.current_epoch - 1} ({len(self.done_requests)} ran): "
                "raise max_epochs, or on_target's max_rounds.",
            )

    # ---- every round -------------------------------------------------------------------
    def on_round_start(self, trainer, pl_module, state: RoundState) -> None:
        if self.on_target is not None and self.on_target.scheduled:
            if state.round_idx == self._phase_start:  # the model the phase starts from
                self.on_target.observe(self._measure(trainer, pl_module, log=False)[0])
        self._start = flatten(state.global_tensors).clone()
        self._deltas = {}
        noise = self.forgetting.round_noise(len(self._with_data()), self._start, self.seed,
                                            state.round_idx, len(self.done_requests))  # fmt: skip
        if noise is not None and trainer.global_rank == 0:
            add_flat_(state.update_sum, noise / self._server_lr)  # θ^{n+1} gets N(0, std²) once

    def transform_update(self, trainer, pl_module, client, update: TensorList, state):
        return self.forgetting.transform_update(update)

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        self._deltas[client] = flatten([u.detach() for u in update])

    @torch.no_grad()
    def on_round_end(self, trainer, pl_module, state: RoundState) -> None:
        new = flatten(state.global_tensors)
        remaining = self._remaining()
        mean_update = (new - self._start) / self._server_lr
        increments = sensitivity_increments(self._deltas, state.target_weights, remaining,
                                            mean_update, self._server_lr,
                                            self.history.num_clients)  # fmt: skip
        if (group := collectives.across_ranks(trainer.world_size)) is not None:
            increments = increments.to(new.device)
            group.all_reduce(increments)
        self.history.record(increments.cpu().numpy(), self.decay)
        branch = self.history.branch
        self.versions.keep((branch, self.history.rounds(branch)), new.clone())
        self.versions.prune(self.history, remaining)
        weights = {c: state.weight_of(c) for c in self._deltas}
        self.forgetting.after_round(self._start, self._deltas, weights, self._server_lr)

    @property
    def _server_lr(self) -> float:
        """η_g, the aggregator's server step size (1 for an aggregator without one)."""
        return getattr(self.view.aggregator, "server_lr", 1.0)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        epoch = trainer.current_epoch
        phase = epoch + 1 - self._phase_start
        if self.on_target is None:
            if (epoch + 1) % self.evaluate_every == 0:
                self._measure(trainer, pl_module, log=True)
            return
        if not self.on_target.due(phase):
            return
        value, forgotten = self._measure(trainer, pl_module, log=True)
        if not self.on_target.reached(value, phase):
            self.on_target.observe(value)
            return
        self.phase_rounds.append(phase)
        self.phase_forgotten_acc.append(forgotten)
        self._phase_start = epoch + 1
        self.on_target.start_phase()
        if self.queue:
            self.pending.append(self.queue.pop(0))
        else:
            trainer.should_stop = True

    def _measure(self, trainer, pl_module, log: bool) -> tuple[float, float]:
        """The p-weighted training accuracy of the remaining clients and, with ``log`` and
        ``evaluate_forgotten``, of the removed ones (else NaN); with ``log``, logged with
        the branch."""
        forgotten = self.removed if self.evaluate_forgotten and log else []
        value, value_forgotten = training_accuracies(
            trainer, pl_module, self._remaining(), forgotten, self.view.sample_counts
        )
        if log:
            pl_module.log("unlearning/remaining_train_acc", value, on_epoch=True)
            pl_module.log("unlearning/branch", float(self.history.branch), on_epoch=True)
        if forgotten:
            pl_module.log("unlearning/forgotten_acc", value_forgotten, on_epoch=True)
        return value, value_forgotten

    # ---- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "privacy": self._privacy(),
            "removed": self.removed, "pending": self.pending, "queue": self.queue,
            "history": None if self.history is None else self.history.state_dict(),
            "versions": {f"{s},{n}": m for (s, n), m in self.versions.models.items()},
            "shadows": self.forgetting.state_dict(),
            "phase_rounds": self.phase_rounds, "phase_start": self._phase_start,
            "phase_forgotten_acc": self.phase_forgotten_acc,
            "done_requests": self.done_requests,
            "on_target": None if self.on_target is None else self.on_target.state_dict(),
        }  # fmt: skip

    def _privacy(self) -> dict[str, float | str]:
        return {"method": self.method, "epsilon": self.epsilon, "delta": self.delta,
                "sigma": self.sigma}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        check_resumed_settings(state, self._privacy())
        self.removed, self.queue = list(state["removed"]), [list(q) for q in state["queue"]]
        self.pending = [list(p) for p in state["pending"]] + self.pending
        if state["history"] is not None:
            self.history = BranchHistory(1, self.threshold)
            self.history.load_state_dict(state["history"])
        self.versions.models = {
            tuple(int(x) for x in k.split(",")): v for k, v in state["versions"].items()
        }
        self.forgetting.load_state_dict(state["shadows"])
        self.phase_rounds, self._phase_start = list(state["phase_rounds"]), state["phase_start"]
        unknown = [math.nan] * len(self.phase_rounds)  # checkpoints that predate the record
        self.phase_forgotten_acc = list(state.get("phase_forgotten_acc", unknown))
        self.done_requests = list(state["done_requests"])
        if self.on_target is not None and state.get("on_target") is not None:
            self.on_target.load_state_dict(state["on_target"])


def check_request(clients: list[int], removed: list[int], counts: np.ndarray) -> None:
    """Refuse a request naming clients that do not exist or were already removed, or
    that would remove every client with training data (``counts``)."""
    unknown = [c for c in clients if not 0 <= c < len(counts)]
    if unknown:
        raise ValueError(
            f"Unlearning request names clients {unknown} that do not exist (0..{len(counts) - 1})."
        )
    again = sorted(set(clients) & set(removed))
    if again:
        raise ValueError(f"Clients {again} were already removed: drop them from the request.")
    gone = set(removed) | set(clients)
    if not any(n > 0 and c not in gone for c, n in enumerate(counts)):
        raise ValueError("The request would remove every client: keep at least one.")


def removal_sets(ordered: list[list[int]], removed: list[int]) -> list[tuple[int, ...]]:
    """The cumulative removal sets F_r of the requests in ``ordered``, after ``removed``.

    >>> removal_sets([[3], [1, 3], [0]], removed=[5])
    [(3, 5), (1, 3, 5), (0, 1, 3, 5)]
    """
    sets, gone = [], set(removed)
    for clients in ordered:
        gone |= set(clients)
        sets.append(tuple(sorted(gone)))
    return sets


def check_resumed_settings(state: dict, current: dict[str, float | str]) -> None:
    """Refuse a checkpoint whose sensitivity history was made under other settings than
    ``current`` (method, ε, δ, σ): its Ψ* and branches would not match the run. Only a
    checkpoint taken before any request may pass between the methods that share that
    training (:data:`SHARED_TRAINING`)."""
    saved = state.get("privacy", current)
    changed = {k: (v, current[k]) for k, v in saved.items() if current[k] != v}
    before_requests = not state["done_requests"] and not state["removed"]
    shared = before_requests and {saved["method"], current["method"]} <= SHARED_TRAINING
    if set(changed) == {"method"} and shared:
        return
    if changed:
        said = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(
            f"Unlearning: the checkpoint's sensitivity history was made under other "
            f"settings ({said}); its Ψ* and branches would not match this run. Resume "
            "with the checkpoint's method, epsilon, delta and sigma, or start a new fit "
            "(only before any request may sifu, scratch, fine_tuning and last take "
            "each other's checkpoint)."
        )


def _check_settings(requests: Any, on_target: Any, decay: float, clip: float) -> None:
    """Refuse :class:`Unlearning` settings that cannot run together, naming the fix."""
    if not 0 < decay <= 1:
        raise ValueError(f"decay must be in (0, 1], got {decay}.")
    if on_target is None and isinstance(requests, list):
        raise ValueError(
            "requests is a list of client sets, which are forgotten one after another "
            "each time training reaches a target, but no on_target was given: add "
            "on_target=StopAtTarget(...), or give requests as {round: [clients]}."
        )
    if on_target is not None and isinstance(requests, dict):
        raise ValueError(
            "requests is {round: [clients]}, but on_target forgets client sets each time "
            "training reaches its target: give requests as a list of client sets, or "
            "drop on_target."
        )
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}.")


def run_length_notes(
    max_epochs: int | None, min_rounds: int, queued: int, undone_rounds: list[int]
) -> list[str]:
    """What to say when a run of ``max_epochs`` rounds ends before requests can run: the
    ``queued`` on-target requests (none done yet) before ``min_rounds``, or the scheduled
    ``undone_rounds`` at or after its end.

    >>> run_length_notes(10, 0, 0, [4, 12])  # doctest: +ELLIPSIS
    ["Unlearning: the requests of rounds [12] come after the run's last round (9), ..."]
    """
    if max_epochs is None or max_epochs < 0:
        return []
    notes = []
    if queued and max_epochs <= min_rounds:
        notes.append(
            f"Unlearning: the run stops after max_epochs={max_epochs} rounds, before "
            f"on_target's min_rounds={min_rounds}, so none of its {queued} forgetting "
            f"requests will run: raise max_epochs above {min_rounds}, or lower min_rounds."
        )
    late = [r for r in undone_rounds if r >= max_epochs]
    if late:
        notes.append(
            f"Unlearning: the requests of rounds {late} come after the run's last round "
            f"({max_epochs - 1}), so they will not run: raise max_epochs above {late[-1]}, "
            "or schedule them earlier."
        )
    return notes


def training_accuracies(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    remaining: list[int],
    forgotten: list[int],
    sample_counts: np.ndarray,
) -> tuple[float, float]:
    """The sample-weighted training accuracy of the ``remaining`` clients and of the
    ``forgotten`` ones (NaN when there are none), each rank evaluating its own."""
    _, accuracy = client_training_metrics(trainer, pl_module, remaining + forgotten)
    # host: as the accuracies (client_training_metrics returns them on the host)
    counts = torch.tensor(sample_counts, dtype=torch.float64)
    value = float(_weighted(accuracy, counts, remaining))
    return value, float(_weighted(accuracy, counts, forgotten)) if forgotten else math.nan


def _weighted(values: torch.Tensor, counts: torch.Tensor, clients: list[int]) -> float:
    weights = counts[clients]
    return float((values[clients] * weights).sum() / weights.sum())
