"""WERM: weighted empirical risk minimization over training and reference data (Kaplan,
Xu, Marfoq, Neglia and Santana de Oliveira, "A Cautionary Tale: On the Role of Reference
Data in Empirical Privacy Defenses", PETS 2024; Marfoq thesis §1.6.1).

ERM with a constraint on the generalization error becomes, in practice,
    min_θ (1 − w)·(1/n) Σ_{train} ℓ(θ; x, y) + w·(1/m) Σ_{reference} ℓ(θ; x, y),
where w ∈ [0, 1] sets the relative privacy of the two datasets: w = 0 is plain ERM on the
training data, w = 1 trains on the reference data only.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from lightning_fl.models import Classifier


class WERMClassifier(Classifier):
    """A :class:`~lightning_fl.Classifier` trained with the WERM objective.

    Training batches are ``{"train": (x, y), "reference": (x_ref, y_ref)}`` pairs (a
    :class:`~lightning_fl.datamodules.reference.PairedLoader`, which the datamodules build
    when the training data carries reference data); the stochastic loss
    (1 − w)·mean ℓ(train batch) + w·mean ℓ(reference batch) is an unbiased estimate of the
    objective. A term with weight 0 is not computed at all, so w = 0 is exactly ERM.
    Evaluation batches are plain ``(x, y)``.

    With the reference data at the server instead of the clients, use
    :class:`~lightning_fl.callbacks.ServerReference` with a plain ``Classifier``.
    """

    accepts_reference_batches = True

    def __init__(
        self, network: nn.Module | None = None, w: float = 0.5, lr: float = 0.05, **optim
    ) -> None:
        if not 0.0 <= w <= 1.0:
            raise ValueError(f"The WERM weight w must be in [0, 1], got {w}.")
        super().__init__(network, lr=lr, **optim)  # saves w with the other hyperparameters

    @staticmethod
    def batch_size_of(batch) -> int:
        return len(batch["train"][-1]) if isinstance(batch, dict) else len(batch[-1])

    def loss_and_metrics(self, batch):
        if not isinstance(batch, dict):
            return super().loss_and_metrics(batch)
        w = float(self.hparams.w)
        loss, metrics = 0.0, {}
        if w < 1.0:
            x, y = batch["train"]
            logits = self(x)
            loss = (1.0 - w) * F.cross_entropy(logits, y)
            metrics["acc"] = (logits.argmax(-1) == y).float().mean()
        if w > 0.0:
            x_ref, y_ref = batch["reference"]
            ref_logits = self(x_ref)
            loss = loss + w * F.cross_entropy(ref_logits, y_ref)
            metrics["reference_acc"] = (ref_logits.argmax(-1) == y_ref).float().mean()
        return loss, metrics
