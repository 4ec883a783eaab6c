"""Aggregation weights for historical and fresh clients (Marfoq et al., "Federated learning
for data streams", AISTATS 2023, §5 and App. C) and the cache discrepancy metric."""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_fl.callbacks.aggregation import FedAvg
from lightning_fl.engine.plugins import FederatedCallback
from lightning_fl.systems.streams import configuration_rule, estimate_constants, estimate_ratio

Strategy = Literal["uniform", "historical", "fresh", "fixed", "ours"]


class StreamFedAvg(FedAvg):
    """FedAvg whose client weights p_m follow one of P1's strategies, over a
    :class:`~lightning_fl.datamodules.StreamingDataModule` (n_m = N_m/N over the horizon):

    - ``"uniform"``: p_m = n_m (every sample the same importance);
    - ``"historical"``: only historical clients, p_m ∝ n_m among them (p_hist = 1);
    - ``"fresh"``: only fresh clients, p_m ∝ n_m among them (p_hist = 0);
    - ``"fixed"``: a given ``p_hist``, split ∝ n_m within each group (the "Optimal" grid);
    - ``"ours"``: p̂* = argmin_p sqrt(Σ_fresh p_m²) + r·sqrt(Σ_m p_m²/n_m) with r = ``ratio``
      (ĉ2/ĉ1, e.g. from :func:`lightning_fl.systems.streams.estimate_ratio`, Eq. 204), or
      ``ratio="estimate"``: r̂ from Eq. 204 at the start of the fit, with B̂, Ĝ, D̂ from
      ``estimate_steps`` SGD steps on ``estimate_fraction`` of each historical client's
      data (:func:`lightning_fl.systems.streams.estimate_constants`, lr: the client optimizer's),
      d the model's parameters, N the samples over the horizon; logged as
      ``streams/ratio``.

    With full participation the server step is θ ← θ + η_g Σ_m p_m Δ_m (Alg. 1, fixed p).
    """

    def __init__(
        self,
        strategy: Strategy = "uniform",
        p_hist: float | None = None,
        ratio: float | Literal["estimate"] | None = None,
        server_lr: float = 1.0,
        estimate_steps: int = 20,
        estimate_fraction: float = 0.2,
    ) -> None:
        super().__init__("samples", server_lr)
        if strategy not in ("uniform", "historical", "fresh", "fixed", "ours"):
            raise ValueError(
                f"strategy must be uniform, historical, fresh, fixed or ours; got {strategy!r}."
            )
        if strategy == "fixed" and (p_hist is None or not 0 <= p_hist <= 1):
            raise ValueError(f"strategy 'fixed' needs p_hist in [0, 1], got {p_hist}.")
        if strategy == "ours" and ratio != "estimate" and (ratio is None or not ratio > 0):
            raise ValueError(
                f"strategy 'ours' needs ratio r = c2/c1 > 0 or 'estimate', got {ratio}."
            )
        self.strategy, self.p_hist, self.ratio = strategy, p_hist, ratio
        self.estimate_steps, self.estimate_fraction = estimate_steps, estimate_fraction
        self.estimated_ratio: float | None = None
        self.historical = 0
        self._weights: torch.Tensor | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        historical = getattr(trainer.datamodule, "historical", None)
        if historical is None:
            raise ValueError("StreamFedAvg needs a lightning_fl.datamodules.StreamingDataModule.")
        self.historical, self._weights = historical, None
        if self.strategy == "ours" and self.ratio == "estimate":
            self.estimated_ratio = self._estimate(trainer, pl_module)

    def _estimate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
        """r̂ by Eq. 204 (see the class docstring); the same on every rank (every rank
        reads the historical clients' data)."""
        dm = trainer.datamodule
        fresh = dm.num_clients - dm.historical
        if dm.historical == 0 or fresh == 0:
            raise ValueError("ratio='estimate' needs historical and fresh clients.")
        datasets = [dm.client_dataset(c, "train") for c in range(dm.historical)]
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        state = torch.random.get_rng_state()
        constants = estimate_constants(
            pl_module, datasets, self.estimate_steps, lr, dm.batch_size,
            self.estimate_fraction, seed=self.view.config.seed,
        )  # fmt: skip
        torch.random.set_rng_state(state)
        dim = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        samples = sum(dm.sample_counts("train"))
        return estimate_ratio(*constants, dim, samples, fresh)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.estimated_ratio is not None:
            sync = trainer.world_size > 1  # estimated from every client, on every rank
            pl_module.log("streams/ratio", self.estimated_ratio, on_epoch=True, sync_dist=sync)

    def target_weights(self, sample_counts: list[int]) -> torch.Tensor:
        if self._weights is None:
            self._weights = self._compute(np.asarray(sample_counts, dtype=float))
        return self._weights

    def _compute(self, counts: np.ndarray) -> torch.Tensor:
        n = counts / counts.sum()
        fresh = np.arange(len(n)) >= self.historical
        hist_share = n[~fresh].sum()
        if self.strategy == "uniform":
            p = n
        elif self.strategy == "ours":
            keep = n > 0
            p = np.zeros_like(n)
            ratio = self.estimated_ratio if self.ratio == "estimate" else self.ratio
            p[keep] = configuration_rule(n[keep], fresh[keep], ratio)
        else:
            p_hist = {"historical": 1.0, "fresh": 0.0}.get(self.strategy, self.p_hist)
            if (p_hist > 0 and hist_share == 0) or (p_hist < 1 and hist_share == 1):
                raise ValueError(f"strategy {self.strategy!r} needs clients of both groups.")
            p = np.where(fresh, (1 - p_hist) * n / max(1 - hist_share, 1e-300),
                         p_hist * n / max(hist_share, 1e-300))  # fmt: skip
        return torch.as_tensor(p / p.sum(), dtype=torch.float64)  # host: the sampler's p


class CacheDiscrepancy(pl.Callback):
    """Logs ``streams/discrepancy``, ψ_t = Σ_k Σ_r (v_t^{k,r} − π^{k,r})² over the fresh
    clients' caches (Wang et al., §IV), and its running sum ``streams/accumulated_discrepancy``."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes, self.total = num_classes, 0.0

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        value = trainer.datamodule.cache_discrepancy(self.num_classes)
        self.total += value
        sync = trainer.world_size > 1  # every rank streams every client's cache
        pl_module.log("streams/discrepancy", value, on_epoch=True, sync_dist=sync)
        pl_module.log("streams/accumulated_discrepancy", self.total, on_epoch=True, sync_dist=sync)


class IterateAverage(FederatedCallback):
    """The output of Alg. 1 of the data-streams paper: θ̄^(T) = Σ_t q^(t) θ^(t), the
    q-weighted average of the global models the rounds started from (Marfoq et al.,
    AISTATS 2023, §3, Eq. 6). q^(t) is round t's share of the λ-mass; with P1's strategies
    (client weights p_m fixed, λ uniform within a client) every round carries the same
    mass Σ_m p_m, so q^(t) = 1/T: the plain average, which this callback keeps. At the end
    of the fit θ̄ replaces the last iterate in the module when ``load_at_end`` (so that
    ``trainer.test`` evaluates it); it is in ``average`` either way, and in checkpoints."""

    supports_vectorized_clients = True

    def __init__(self, load_at_end: bool = True) -> None:
        self.load_at_end = load_at_end
        self.add_server_state("total")  # Σ_t θ^(t)
        self.add_server_state("count", 0)  # T

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        current = self.view.tensors.clone()
        if self.total is None:
            self.total = current
        else:
            torch._foreach_add_(self.total, current)
        self.count += 1

    @property
    def average(self) -> list[torch.Tensor] | None:
        if self.total is None:
            return None
        return torch._foreach_div(self.total, float(self.count))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.load_at_end and self.total is not None:
            self.view.tensors.load_(self.average)
