"""Small networks and a classification LightningModule for recipes, tests and benchmarks.

torchvision is not a dependency: the models are written here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn


class MLP(nn.Module):
    """Fully connected ReLU network: in → hidden... → out."""

    def __init__(
        self, in_features: int = 64, hidden: tuple[int, ...] = (64,), num_classes: int = 10
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class MnistCNN(nn.Module):
    """Conv(1,16,5)-ReLU-MaxPool2-Conv(16,32,5)-ReLU-MaxPool2-Linear(512,64)-ReLU-Linear(64,C)
    for 1×28×28 inputs (the core issue's "cnn" benchmark workload)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DigitsCNN(nn.Module):
    """A small CNN for 1×8×8 digits:
    Conv(1,16,3,p1)-ReLU-Conv(16,32,3,p1)-ReLU-MaxPool2-Linear(512,C)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, num_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.view(-1, 1, 8, 8))


class Classifier(LightningModule):
    """Cross-entropy classification with SGD; logs ``{stage}_loss`` and ``{stage}_acc``.

    Args:
        network: any ``nn.Module`` mapping inputs to logits (default: MLP 64-64-10).
        lr, momentum, weight_decay: the client optimizer (SGD).
        lr_decay: multiply the learning rate by this factor after every round (1 = constant).
    """

    def __init__(
        self,
        network: nn.Module | None = None,
        lr: float = 0.05,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_decay: float = 1.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["network"])
        self.network = network if network is not None else MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def _step(self, batch, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(dim=-1) == y).float().mean()
        on_step = stage == "train"
        self.log(f"{stage}_loss", loss, on_step=on_step, on_epoch=True, batch_size=len(y))
        self.log(
            f"{stage}_acc",
            acc,
            on_step=False,
            on_epoch=True,
            batch_size=len(y),
            prog_bar=stage != "train",
        )
        return loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay
        )
        if hp.lr_decay == 1.0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=hp.lr_decay)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"},
        }
