"""FedAvg and the adaptive server optimizers of Reddi et al., "Adaptive Federated
Optimization" (ICLR 2021), Algorithm 2. FedAvg, the default aggregator, lives with the
plugin contract in :mod:`lightning_fl.engine.plugins` and is re-exported here.

The pseudo-gradient of round t is Δ_t = Σ_{i∈S_t} ω_i (θ_i^{t+1} − θ^t), with the
sampler's unbiased weights ω_i (Fraboni thesis eq. 2.3). All server optimizers treat
floating buffers (e.g. BatchNorm statistics) like parameters.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_fl.checks import require_rate
from lightning_fl.engine.plugins import Aggregator, FedAvg, RoundState, Weighting
from lightning_fl.engine.tensors import TensorList, zeros_like
from lightning_fl.engine.traits import Trait

__all__ = ["FedAdagrad", "FedAdam", "FedAvg", "FedAvgM", "FedYogi"]


class _StatefulServerOptimizer(Aggregator):
    """Server optimizer state (``_state_names``, declared server state) is kept across
    rounds and saved in checkpoints."""

    traits = {Trait.STEPS_OTHERWISE_THAN_FEDAVG: ""}

    supports_vectorized_clients = True

    _state_names: tuple[str, ...] = ()

    def __init__(self, weighting: Weighting, server_lr: float) -> None:
        super().__init__(weighting)
        self.server_lr = require_rate("server_lr", server_lr, 1.0)
        for name in self._state_names:
            self.add_server_state(name)


class FedAvgM(_StatefulServerOptimizer):
    """Server momentum (Hsu et al. 2019; Reddi et al. 2021, §3):
    m_t = β m_{t−1} + Δ_t,  θ^{t+1} = θ^t + η m_t."""

    _state_names = ("momentum",)

    def __init__(
        self, server_lr: float = 1.0, beta: float = 0.9, weighting: Weighting = "samples"
    ) -> None:
        super().__init__(weighting, server_lr)
        if not 0 <= beta < 1:
            raise ValueError(f"beta must be in [0, 1), got {beta}.")
        self.beta = beta

    @torch.no_grad()
    def aggregate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: RoundState
    ) -> None:
        if self.momentum is None:
            self.momentum = zeros_like(state.update_sum)
        torch._foreach_mul_(self.momentum, self.beta)
        torch._foreach_add_(self.momentum, state.update_sum)
        torch._foreach_add_(state.global_tensors, self.momentum, alpha=self.server_lr)


class _AdaptiveServerOptimizer(_StatefulServerOptimizer):
    """Reddi et al. 2021, Algorithm 2 (FedAdagrad / FedYogi / FedAdam):

        m_t = β1 m_{t−1} + (1 − β1) Δ_t
        v_t = (rule of each method)
        θ^{t+1} = θ^t + η m_t / (√v_t + τ)

    with m_{−1} = 0 and no bias correction. Algorithm 2 initializes v_{−1} ≥ τ²; the
    default is the smallest such value, v_{−1} = τ². ``initial_second_moment`` sets another
    start: FLamby's FedOpt starts from v_{−1} = 0 (``initial_second_moment=0.0``, used by
    the FLamby recipes).
    """

    _state_names = ("first_moment", "second_moment")

    def __init__(
        self,
        server_lr: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
        weighting: Weighting = "samples",
        initial_second_moment: float | None = None,
    ) -> None:
        super().__init__(weighting, server_lr)
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {beta1}, {beta2}.")
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau}.")
        if initial_second_moment is not None and not initial_second_moment >= 0:
            raise ValueError(
                f"initial_second_moment must be >= 0 (or None for tau²), got "
                f"{initial_second_moment}."
            )
        self.beta1, self.beta2, self.tau = beta1, beta2, tau
        self.initial_second_moment = (
            tau**2 if initial_second_moment is None else float(initial_second_moment)
        )

    def _update_second_moment(self, v: TensorList, delta_sq: TensorList) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def aggregate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: RoundState
    ) -> None:
        delta = state.update_sum
        if self.first_moment is None:
            self.first_moment = zeros_like(delta)
            self.second_moment = [torch.full_like(d, self.initial_second_moment) for d in delta]
        torch._foreach_mul_(self.first_moment, self.beta1)
        torch._foreach_add_(self.first_moment, delta, alpha=1 - self.beta1)
        self._update_second_moment(self.second_moment, torch._foreach_mul(delta, delta))
        denom = torch._foreach_sqrt(self.second_moment)
        torch._foreach_add_(denom, self.tau)
        torch._foreach_addcdiv_(
            state.global_tensors, self.first_moment, denom, value=self.server_lr
        )


class FedAdagrad(_AdaptiveServerOptimizer):
    """v_t = v_{t−1} + Δ_t² (Reddi et al. 2021, Alg. 2)."""

    def _update_second_moment(self, v: TensorList, delta_sq: TensorList) -> None:
        torch._foreach_add_(v, delta_sq)


class FedYogi(_AdaptiveServerOptimizer):
    """v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²) (Reddi et al. 2021, Alg. 2)."""

    def _update_second_moment(self, v: TensorList, delta_sq: TensorList) -> None:
        sign = torch._foreach_sub(v, delta_sq)
        sign = [torch.sign(s) for s in sign]
        torch._foreach_mul_(sign, delta_sq)
        torch._foreach_add_(v, sign, alpha=-(1 - self.beta2))


class FedAdam(_AdaptiveServerOptimizer):
    """v_t = β2 v_{t−1} + (1 − β2) Δ_t² (Reddi et al. 2021, Alg. 2)."""

    def _update_second_moment(self, v: TensorList, delta_sq: TensorList) -> None:
        torch._foreach_mul_(v, self.beta2)
        torch._foreach_add_(v, delta_sq, alpha=1 - self.beta2)
