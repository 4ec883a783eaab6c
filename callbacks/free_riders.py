"""Free-rider attacks on model aggregation (Fraboni, Vidal, Lorenzi, AISTATS 2021; Fraboni
thesis ch. 6, Alg. 8) and a detector for them."""

from __future__ import annotations

import math
from typing import Literal

import torch

from lightning_fl.engine.plugins import FederatedCallback, RoundState
from lightning_fl.engine.seeding import generator
from lightning_fl.engine.tensors import add_flat_, flat_size, flatten
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.samplers import FullParticipation

#: The disguised free-rider's noise scale in round 0, before any global increment exists
#: (the authors' code).
FIRST_ROUND_STD = 1e-3


class FreeRiders(FederatedCallback):
    """K free-riders join the federation: they hold no data but declare M_k samples each,
    and every round send back the global model θ̃^t they received (``"plain"``), or
    θ̃^t + φ(t)·ε_t with ε_t ~ N(0, I) fresh per round and parameter (``"disguised"``),
    φ(t) = coef·σ·max(t, 1)^{−γ} (thesis §6.3, the time-varying model of the experiments).

    Aggregation stays FedAvg's sample-size-weighted average over all declared samples
    N = Σ_j M_j + Σ_k M_k (Alg. 8): each fair client's weight is M_j/N, each free-rider's
    M_k/N, so θ̃^{t+1} = θ̃^t + Σ_j (M_j/N) Δ_j + Σ_k (M_k/N) φ(t) ε_{k,t}. Use it with
    :class:`~lightning_fl.callbacks.FedAvg` (and :class:`~lightning_fl.callbacks.FedProx`)
    and full participation, as in the paper. The free-riders are virtual: they train
    nothing, and their ids are ``num_clients, …, num_clients + K − 1``.

    Args:
        num_free_riders: K.
        mode: ``"plain"`` or ``"disguised"``.
        declared_samples: M_k; by default the mean training size of the fair clients.
        coef: the multiple of σ (the paper's σ and 3σ).
        gamma: γ of the decay t^{−γ}.
        sigma_estimate: how σ is read from the first global increment Δ = θ̃^1 − θ̃^0
            (of the first round the riders take part in, when they join a resumed run):
            ``"std"`` fits a zero-mean Gaussian to its entries, sqrt(mean Δ²) (the thesis);
            ``"mean_abs"`` is mean |Δ| (the authors' code). Their first round uses 10⁻³.
        seed: the noise's seed, mixed with the round and the free-rider's id.
    """

    traits = {
        Trait.ADDS_TO_THE_UPDATE_SUM: (
            "aggregate with FedAvg or a server optimizer (the thesis's FedAvg and FedProx)"
        ),
        Trait.NEEDS_FULL_PARTICIPATION: "",
        Trait.NEEDS_SYNCHRONOUS_ROUNDS: "",
    }

    supports_vectorized_clients = True  # no per-step hook: clients start and end as sequentially

    def __init__(
        self,
        num_free_riders: int,
        mode: Literal["plain", "disguised"] = "plain",
        declared_samples: int | None = None,
        coef: float = 1.0,
        gamma: float = 1.0,
        sigma_estimate: Literal["std", "mean_abs"] = "std",
        seed: int = 0,
    ) -> None:
        if isinstance(num_free_riders, bool) or int(num_free_riders) < 0:
            raise ValueError(f"num_free_riders must be >= 0, got {num_free_riders}.")
        if mode not in ("plain", "disguised"):
            raise ValueError(f"mode must be 'plain' or 'disguised', got {mode!r}.")
        if declared_samples is not None and declared_samples < 0:
            raise ValueError(
                f"declared_samples must be >= 0 (a sample count), got {declared_samples}."
            )
        if sigma_estimate not in ("std", "mean_abs"):
            raise ValueError(f"sigma_estimate must be 'std' or 'mean_abs', got {sigma_estimate!r}.")
        if not coef >= 0 or not gamma >= 0:
            raise ValueError(f"coef and gamma must be >= 0, got coef={coef}, gamma={gamma}.")
        self.num_free_riders, self.mode, self.declared = (
            int(num_free_riders),
            mode,
            declared_samples,
        )
        self.coef, self.gamma, self.sigma_estimate, self.seed = coef, gamma, sigma_estimate, seed
        self.add_server_state("sigma")  # σ of the disguised riders' noise, once estimated
        self.add_server_state("first_global")  # θ^0, the estimate's reference
        #: This round's free-rider updates θ̃_k^{t+1} − θ̃^t, by free-rider id (for detectors).
        self.updates: dict[int, torch.Tensor] = {}
        self.ids: list[int] = []
        self._declared = 0
        self._fair_total = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        if type(strategy.sampler) is not FullParticipation:
            raise ValueError(
                "FreeRiders follows the paper's full participation: drop the strategy's "
                f"{type(strategy.sampler).__name__}."
            )
        counts = self.view.sample_counts
        fair = [int(n) for n in counts if n > 0]
        self._fair_total = sum(fair)
        self._declared = (
            round(self._fair_total / len(fair)) if self.declared is None else self.declared
        )
        self.ids = [len(counts) + k for k in range(self.num_free_riders)]
        if self.num_free_riders and self._declared == 0:
            raise ValueError("declared_samples = 0 gives the free-riders no weight: declare > 0.")

    @property
    def free_rider_share(self) -> float:
        """M_K/N, the free-riders' share of the declared samples."""
        riders = self.num_free_riders * self._declared
        return riders / (riders + self._fair_total)

    def phi(self, round_idx: int) -> float:
        """φ(t) = coef·σ·max(t, 1)^{−γ}; 10⁻³ before σ is known (the riders' first round)."""
        if self.sigma is None:
            return FIRST_ROUND_STD
        return self.coef * self.sigma * max(round_idx, 1) ** (-self.gamma)

    def on_round_start(self, trainer, pl_module, state: RoundState) -> None:
        if self.first_global is None:  # round 0, or the first round of a rider added later
            self.first_global = flatten(state.global_tensors).clone()
        elif self.sigma is None and self.first_global is not None:
            increment = flatten(state.global_tensors) - self.first_global
            if self.sigma_estimate == "std":
                self.sigma = float(increment.pow(2).mean().sqrt())
            else:
                self.sigma = float(increment.abs().mean())
        # fair clients: M_j/N instead of M_j/N_fair
        fair_scale = self._fair_total / (self._fair_total + self.num_free_riders * self._declared)
        participation = state.participation
        state.participation = type(participation)(
            participation.clients, tuple(w * fair_scale for w in participation.weights)
        )
        self.updates = {}
        size = flat_size(state.global_tensors)
        like = state.global_tensors[0]
        weight = self._declared / (self._fair_total + self.num_free_riders * self._declared)
        for rider in self.ids:
            if self.mode == "plain":
                update = torch.zeros(size, dtype=like.dtype, device=like.device)
            else:
                noise = generator(self.seed, "free_rider", state.round_idx, rider)
                # host: a CPU generator draws the same noise whatever the device
                draw = torch.randn(size, generator=noise, dtype=torch.float64)
                update = (self.phi(state.round_idx) * draw).to(like)
            self.updates[rider] = update
            if trainer.global_rank == 0:  # added once: the round's all-reduce sums the ranks
                add_flat_(state.update_sum, weight * update)


class FreeRiderDetector(FederatedCallback):
    """Flags clients whose update looks free-ridden, every round, and logs
    ``free_riders/detection_rate`` (flagged free-riders / free-riders) and
    ``free_riders/false_alarm_rate`` (flagged fair clients / fair clients).

    Two tests, an extension beyond the thesis (which proposes none for disguised riders):

    - **zero update**: ‖Δ_i‖ = 0 exactly, a plain free-rider (thesis §6.5);
    - **no descent direction**: a disguised free-rider's update is isotropic noise, so its
      cosine with the other clients' mean update is N(0, 1/d) in d dimensions; flagged
      when |cos| < ``z``/√d (a fair client's update shares the descent direction).

    Needs :class:`FreeRiders` in the same run (it reads the free-riders' updates there);
    single process.
    """

    traits = {Trait.READS_EACH_UPDATE: "", Trait.COMPARES_UPDATES_IN_ONE_PLACE: ""}

    supports_vectorized_clients = True  # no per-step hook: clients start and end as sequentially

    def __init__(self, z: float = 3.0) -> None:
        if not z > 0:
            raise ValueError(f"z must be > 0, got {z}.")
        self.z = z
        self._fair: dict[int, torch.Tensor] = {}
        self.flagged: list[int] = []

    def on_round_start(self, trainer, pl_module, state: RoundState) -> None:
        self._fair = {}  # two processes are refused at setup (engine/composition.py)

    def on_client_end(self, trainer, pl_module, client: int, update, state: RoundState) -> None:
        self._fair[client] = flatten(update).double()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        attack = next((cb for cb in trainer.callbacks if isinstance(cb, FreeRiders)), None)
        if attack is None:
            raise ValueError("FreeRiderDetector needs the FreeRiders callback in the same run.")
        riders = {k: v.double() for k, v in attack.updates.items()}
        updates = {**self._fair, **riders}
        if len(updates) < 2:
            return
        self.flagged = [c for c, u in updates.items() if self._suspicious(c, u, updates)]
        caught = sum(1 for c in self.flagged if c in riders)
        false = sum(1 for c in self.flagged if c not in riders)
        if riders:
            pl_module.log("free_riders/detection_rate", caught / len(riders), on_epoch=True)
        if self._fair:
            pl_module.log("free_riders/false_alarm_rate", false / len(self._fair), on_epoch=True)

    def _suspicious(self, client: int, update: torch.Tensor, updates: dict) -> bool:
        norm = float(update.norm())
        if norm == 0.0:
            return True
        others = [u for c, u in updates.items() if c != client and float(u.norm()) > 0]
        if not others:
            return False
        mean = torch.stack(others).mean(0)
        if float(mean.norm()) == 0.0:
            return False
        cosine = float(update @ mean) / (norm * float(mean.norm()))
        return abs(cosine) < self.z / math.sqrt(update.numel())
