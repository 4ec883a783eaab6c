"""Small networks and a classification LightningModule for recipes, tests and benchmarks.

torchvision is not a dependency: the models are written here.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from lightning_fl.checks import require_rate
from lightning_fl.engine import collectives
from lightning_fl.engine.round_metrics import RoundMetricSums

#: the checkpoint entry of the training metrics' names agreed by the ranks
METRIC_NAMES_KEY = "round_metric_names"


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


class SifuFashionCNN(nn.Module):
    """The SIFU authors' Fashion-MNIST network (their code's ``CNN_FashionMNIST``, Fraboni
    et al. AISTATS 2024; thesis App. D.4 "with implementation at URL"): Conv(1,32,3,p1)-
    ReLU-MaxPool2-Conv(32,64,3,p1)-ReLU-MaxPool2-Linear(3136,256)-ReLU-Dropout(0.1)-
    Linear(256,C). The thesis's text says three convolutions; the code has two, and this
    follows the code. The code ends in ``log_softmax`` before a cross-entropy loss, which
    changes neither the loss nor its gradient (log_softmax is idempotent), so the logits
    are returned."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 7 * 7, 256), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(256, num_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, 1, 28, 28)))


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998) for 1×28×28 images, with ReLU and max-pooling, the
    backbone of the cache-rule paper's FMNIST experiments (Wang, Bian, Xu §V):
    Conv(1,6,5,p2)-ReLU-MaxPool2-Conv(6,16,5)-ReLU-MaxPool2-Linear(400,120)-ReLU-
    Linear(120,84)-ReLU-Linear(84,C)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(),
            nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, 1, 28, 28)))


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


class FemnistCNN(nn.Module):
    """The EMNIST/FEMNIST CNN of Reddi et al. (ICLR 2021, App. C), used by FedEM (§3.5.6):
    Conv(1,32,3)-ReLU-Conv(32,64,3)-ReLU-MaxPool2-Dropout(0.25)-Linear(9216,128)-ReLU-
    Dropout(0.5)-Linear(128,C)."""

    def __init__(self, num_classes: int = 62) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Dropout(0.25), nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(128, num_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.view(-1, 1, 28, 28))


class CifarCNN(nn.Module):
    """The CIFAR CNN of McMahan et al. (2017): Conv(3,32,5)-ReLU-MaxPool2-Conv(32,64,5)-
    ReLU-MaxPool2-Linear(1600,hidden)-ReLU-Linear(hidden,C); ``hidden=2048`` is the
    data-streams paper's CIFAR model (FedEM's CIFAR10CNN: d = 3,353,034 for C = 10)."""

    def __init__(self, num_classes: int = 10, hidden: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 5 * 5, hidden), nn.ReLU(), nn.Linear(hidden, num_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CharLSTM(nn.Module):
    """Next-character model for LEAF Shakespeare (FedEM §3.5.6; Fraboni Ch. 2 uses 100
    hidden units): Embedding(V, embed)-LSTM(layers × hidden)-Linear(hidden, V) on the last
    step.

    ``final_state`` (an identity, for hooks) sees the concatenated final hidden and cell
    states of every layer, 2·layers·hidden values per sequence (1024 for 2 × 256): the
    representation kNN-Per uses for Shakespeare (Marfoq thesis §3.6.4;
    ``KNNPer(representation_layer="network.final_state")`` in a Classifier)."""

    def __init__(
        self, vocab_size: int = 80, embed_dim: int = 8, hidden: int = 256, layers: int = 2
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)
        self.final_state = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h_n, c_n) = self.lstm(self.embedding(x))
        states = torch.cat([h_n, c_n], 0).transpose(0, 1)  # (batch, 2·layers, hidden)
        self.final_state(states.reshape(len(x), -1))
        return self.head(out[:, -1])


def _make_divisible(value: float, divisor: int = 8) -> int:
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def _conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """MobileNet-v2 block (Sandler et al. 2018, Table 1): expand 1×1, depthwise 3×3,
    linear 1×1 projection; a residual connection when the shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers = [] if expand == 1 else [_conv_bn_relu6(cin, hidden, 1, 1)]
        layers += [
            _conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.residual else self.block(x)


class MobileNetV2(nn.Module):
    """MobileNet-v2 (Sandler et al., CVPR 2018, Table 2), the architecture of
    torchvision's ``mobilenet_v2`` that FedEM and kNN-Per train on CIFAR: (t, c, n, s) =
    (1,16,1,1) (6,24,2,2) (6,32,3,2) (6,64,4,2) (6,96,3,1) (6,160,3,2) (6,320,1,1), a 32-channel
    stem of stride 2, a 1280-channel head, dropout 0.2 and a linear classifier."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))  # fmt: skip

    def __init__(
        self, num_classes: int = 10, width_mult: float = 1.0, dropout: float = 0.2
    ) -> None:
        super().__init__()
        cin = _make_divisible(32 * width_mult)
        last = _make_divisible(1280 * max(1.0, width_mult))
        layers: list[nn.Module] = [_conv_bn_relu6(3, cin, 3, 2)]
        for t, c, n, s in self.SETTINGS:
            cout = _make_divisible(c * width_mult)
            for i in range(n):
                layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        layers.append(_conv_bn_relu6(cin, last, 1, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))
        for m in self.modules():  # torchvision's initialization
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


class FederatedTask(LightningModule):
    """A network, a loss and metrics, with the client optimizer as hyper-parameters.

    Subclasses implement :meth:`loss_and_metrics`. Logs ``{stage}_loss`` and
    ``{stage}_{metric}`` as batch-size-weighted epoch means (per client under
    FederatedStrategy).

    Args:
        network: the ``nn.Module`` to train.
        optimizer: ``"sgd"`` or ``"adam"`` (client optimizer).
        lr, momentum, weight_decay: its settings (momentum is ignored by Adam).
        lr_decay: multiply the learning rate by this factor after every round (1 = constant).
        lr_milestones: rounds after which the learning rate is multiplied by ``lr_gamma``
            (the "multi_step" schedule of FedEM and kNN-Per: lr ÷10 at R/2 and 3R/4);
            exclusive with ``lr_decay``.
    """

    def __init__(
        self,
        network: nn.Module,
        lr: float = 0.05,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_decay: float = 1.0,
        lr_milestones: list[int] | None = None,
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__()
        if optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}.")
        require_rate("lr", lr, 0.05, allow_zero=True)  # 0: clients send Δ = 0
        require_rate("momentum", momentum, 0.9, allow_zero=True)
        require_rate("weight_decay", weight_decay, 1e-4, allow_zero=True)
        require_rate("lr_decay", lr_decay, 0.99)
        if lr_milestones and lr_decay != 1.0:
            raise ValueError("Give either lr_decay or lr_milestones, not both.")
        self.save_hyperparameters(ignore=["network"])
        self.network = network
        # the round's step values and batch sizes per metric (see _log_training_step)
        self._training_values = _RoundMeans()
        # their sums over the ranks, carried by the round's sum (engine/round_metrics.py)
        self.round_metric_sums = RoundMetricSums(self._training_values.pop_sums)
        self._evaluation_sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def __setattr__(self, name: str, value) -> None:
        # Lightning sets _current_fx_name twice per hook call, a dozen times per step;
        # nn.Module.__setattr__'s parameter/module/buffer checks cost more than the small
        # models' steps. It is never a parameter, module or buffer: store it directly.
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def loss_and_metrics(self, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def sample_losses_and_metrics(self, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Optional: the loss and metrics of each sample of ``batch`` (tensors of shape
        ``[B]``) whose means are :meth:`loss_and_metrics`'s, for losses that are a mean
        over the batch's samples (cross-entropy, not a Cox partial likelihood or a
        BatchNorm's batch statistics). With it, the vectorized path pads a client's short
        last batch to its step's batch and weights the padding out (one vmapped call a
        local step instead of one per batch size: :mod:`lightning_fl.engine.vectorized`);
        the set-up probe checks that its means equal :meth:`loss_and_metrics`."""
        raise NotImplementedError

    @staticmethod
    def batch_size_of(batch) -> int:
        return len(batch[-1])

    #: True for modules that train on {"train", "reference"} batch pairs (WERM).
    accepts_reference_batches = False

    def _step(self, batch, stage: str) -> torch.Tensor:
        if isinstance(batch, dict) and not self.accepts_reference_batches:
            raise TypeError(
                f"{type(self).__name__} got a {{'train', 'reference'}} batch pair: the "
                "datamodule pairs training data with reference data (reference='client'). "
                "Train a lightning_fl.WERMClassifier, or set the datamodule's reference to "
                "'none' or 'server'."
            )
        loss, metrics = self.loss_and_metrics(batch)
        size = self.batch_size_of(batch)
        if stage == "train":
            self._log_training_step(loss, metrics, size)
            return loss
        if getattr(self.trainer.strategy, "collects_evaluation_sums", False):
            self.add_evaluation_sums(stage, loss, metrics, size)
            return loss
        self.log(f"{stage}_loss", loss, on_epoch=True, batch_size=size, sync_dist=True)
        for name, value in metrics.items():
            # Evaluation means are synced over ranks at epoch end (sum and count), so the
            # logged value is the sample-weighted mean over all clients.
            self.log(
                f"{stage}_{name}", value, on_epoch=True, batch_size=size, prog_bar=True,
                sync_dist=True,
            )  # fmt: skip
        return loss

    def _log_training_step(self, loss: torch.Tensor, metrics: dict, size: int) -> None:
        """Training metrics without Lightning's per-call cost of ``self.log`` (it moves its
        stored results at every call): the step values are kept on the device and their
        batch-size-weighted means logged once per round (:meth:`on_train_epoch_end`), and
        the step values only at the steps the loggers write (``log_every_n_steps``). Keys
        and values are those of ``self.log(name, value, on_step=True, on_epoch=True)``:
        ``train_<m>_step``, ``train_<m>_epoch`` (and ``train_<m>`` in
        ``callback_metrics``) for the loss and every metric. Not synced over ranks (a
        collective per step), as before. A subclass that overrides ``on_train_epoch_end``
        calls super().
        """
        for name, value in (("loss", loss), *metrics.items()):
            self._training_values.add(name, value, size)
        trainer = self.trainer
        if trainer._logger_connector.should_update_logs or trainer.fast_dev_run:
            for name, value in (("loss", loss), *metrics.items()):
                self.log(f"train_{name}_step", value, on_step=True, on_epoch=False, batch_size=size)

    def _log_vectorized_training_step(
        self, losses: torch.Tensor, metrics: dict[str, torch.Tensor], sizes: torch.Tensor
    ) -> None:
        """:meth:`_log_training_step` for one vectorized step of several clients (per-client
        ``losses``, ``metrics`` and batch ``sizes``): the epoch sums get every client's
        value·B, so the round's ``train_<m>_epoch`` equals the sequential path's; the step
        value logged is the batch-size-weighted mean over the step's clients."""
        sizes = sizes.to(losses.device)
        for name, values in (("loss", losses), *metrics.items()):
            self._training_values.add(name, values, sizes)
        trainer = self.trainer
        if trainer._logger_connector.should_update_logs or trainer.fast_dev_run:
            total = int(sizes.sum())  # a sync: only at the logging steps
            for name, values in (("loss", losses), *metrics.items()):
                mean = (values.detach().float() * sizes).sum() / total
                self.log(f"train_{name}_step", mean, on_step=True, on_epoch=False, batch_size=total)

    def add_evaluation_sums(self, stage: str, loss: torch.Tensor, metrics: dict, size: int):
        """Under FederatedStrategy, evaluation metrics are summed per client on the device
        (Σ value·B, Σ B, as Lightning's mean reduction does) instead of one ``self.log``
        per batch; the strategy takes each client's sums at its boundary
        (:meth:`pop_evaluation_sums`) and logs the epoch values once, with the same keys
        (``val_loss``, ``val_<metric>``, ...) and, to float round-off, the same values.
        A plugin may add a batch's values under another prefix (``stage``: "val_global"
        for the global model's ``val_global_acc``); they are reported over clients and
        ranks as the module's own are."""
        for name, value in (("loss", loss), *metrics.items()):
            _accumulate(self._evaluation_sums, f"{stage}_{name}", value, size)

    def pop_evaluation_sums(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The open client's evaluation sums ``{key: (Σ value·B, Σ B)}``, then cleared."""
        sums = dict(self._evaluation_sums)
        self._evaluation_sums.clear()
        return sums

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The training metrics' agreed names (:mod:`lightning_fl.engine.round_metrics`):
        a resumed fit, or a site that rejoins from the others' checkpoint, shares the
        round's sum in the same layout as the sites that never stopped."""
        checkpoint[METRIC_NAMES_KEY] = self.round_metric_sums.names

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        names = checkpoint.get(METRIC_NAMES_KEY)
        self.round_metric_sums.names = None if names is None else tuple(names)

    def on_train_epoch_end(self) -> None:
        """The round's training means. On several processes, every rank's sums are added
        first (inside the round's all-reduce: :mod:`lightning_fl.engine.round_metrics`),
        so the mean is over all the round's clients, as on one process, and every rank
        logs the same value (``sync_dist``: a mean of equal values)."""
        trainer = self.trainer
        group = collectives.across_ranks(trainer.world_size)
        synced = group is not None
        sums = self.round_metric_sums.totals(group, self.device)
        for name, (total, count) in sums.items():
            mean = total / count
            self.log(f"train_{name}_epoch", mean, on_epoch=True, batch_size=1, sync_dist=synced)
            self.log(
                f"train_{name}", mean, on_epoch=True, batch_size=1, logger=False,
                sync_dist=synced,
            )  # fmt: skip

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        else:
            optimizer = torch.optim.SGD(
                self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay
            )
        milestones = hp.get("lr_milestones")
        if milestones:
            scheduler = torch.optim.lr_scheduler.MultiStepLR(
                optimizer, milestones=list(milestones), gamma=hp.get("lr_gamma", 0.1)
            )
        elif hp.lr_decay == 1.0:
            return optimizer
        else:
            scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=hp.lr_decay)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"},
        }


class _RoundMeans:
    """Batch-size-weighted means of a round's training metrics. A step only appends its
    detached values (a scalar, or one value per client of a vectorized step) and batch
    sizes; the means Σ value·B / Σ B are taken once, at the round's end."""

    def __init__(self) -> None:
        self._values: dict[str, list[tuple[torch.Tensor, int | torch.Tensor]]] = {}

    def add(self, name: str, value: torch.Tensor, size: int | torch.Tensor) -> None:
        self._values.setdefault(name, []).append((value.detach(), size))

    def pop_sums(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{name: (Σ value·B, Σ B)}`` of the round's steps, then cleared."""
        sums = {}
        for name, entries in self._values.items():
            values = torch.cat([v.reshape(-1) for v, _ in entries])
            if values.dtype not in (torch.float32, torch.float64):
                values = values.to(torch.get_default_dtype())
            sizes_list = [b for _, b in entries]
            if all(isinstance(b, int) for b in sizes_list):
                sizes = torch.tensor(sizes_list, device=values.device)
            else:
                sizes = torch.cat(
                    [torch.as_tensor(b, device=values.device).reshape(-1) for b in sizes_list]
                )
            sizes = sizes.to(values.dtype)
            # a running sum in step order and in the values' precision, as Lightning's
            # mean reduction accumulates (numpy's accumulate is sequential; torch's sum
            # and cumsum are not, or accumulate in double)
            products = (values * sizes).cpu().numpy()
            total = torch.tensor(np.add.accumulate(products)[-1], device=values.device)
            sums[name] = (total, sizes.sum())
        self._values.clear()
        return sums


def _accumulate(sums: dict, key: str, value: torch.Tensor, size: int) -> None:
    """sums[key] += (value·size, size) as Lightning's mean reduction accumulates: a float32
    (or float64) total and an integer count, on the value's device."""
    value = value.detach()
    if value.dtype not in (torch.float32, torch.float64):
        value = value.to(torch.get_default_dtype())
    if key not in sums:
        sums[key] = (torch.tensor(0.0, device=value.device), torch.tensor(0, device=value.device))
    total, count = sums[key]
    sums[key] = (total + value * size, count + size)


class Classifier(FederatedTask):
    """Multi-class classification: cross-entropy loss, accuracy (default network MLP 64-64-10)."""

    def __init__(self, network: nn.Module | None = None, lr: float = 0.05, **optim) -> None:
        super().__init__(network if network is not None else MLP(), lr=lr, **optim)

    #: The per-batch loss of a logits batch (DP-SGD computes it sample by sample).
    criterion = staticmethod(F.cross_entropy)

    def loss_and_metrics(self, batch):
        x, y = batch
        logits = self(x)
        acc = (logits.argmax(dim=-1) == y).float().mean()
        return self.criterion(logits, y), {"acc": acc}

    def sample_losses_and_metrics(self, batch):
        x, y = batch
        logits = self(x)
        correct = (logits.argmax(dim=-1) == y).float()
        return self.criterion(logits, y, reduction="none"), {"acc": correct}


class BinaryClassifier(FederatedTask):
    """Binary classification on one logit: BCE-with-logits loss, accuracy at p = 0.5.

    Equal to FLamby's Fed-Heart-Disease baseline (sigmoid(Linear(13, 1)) with BCELoss).
    """

    def __init__(self, network: nn.Module | None = None, lr: float = 1e-3, **optim) -> None:
        super().__init__(network if network is not None else nn.Linear(13, 1), lr=lr, **optim)

    def loss_and_metrics(self, batch):
        x, y = batch
        logits = self(x).reshape(-1)
        target = y.reshape(-1).to(logits.dtype)
        acc = ((logits > 0).to(target.dtype) == target).float().mean()
        return F.binary_cross_entropy_with_logits(logits, target), {"acc": acc}

    def sample_losses_and_metrics(self, batch):
        x, y = batch
        logits = self(x).reshape(-1)
        target = y.reshape(-1).to(logits.dtype)
        correct = ((logits > 0).to(target.dtype) == target).float()
        losses = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        return losses, {"acc": correct}


class CoxRegression(FederatedTask):
    """Cox proportional hazards with a network giving the risk score (default Linear(39, 1),
    FLamby's Fed-TCGA-BRCA baseline). Targets are (event, time) pairs. Loss: negative Cox
    partial log-likelihood; metric: C-index of the batch (FLamby evaluates each client's
    whole test set as one batch)."""

    def __init__(self, network: nn.Module | None = None, lr: float = 0.1, **optim) -> None:
        super().__init__(network if network is not None else nn.Linear(39, 1), lr=lr, **optim)

    def loss_and_metrics(self, batch):
        from lightning_fl.survival import concordance_index, cox_partial_likelihood_loss

        x, target = batch
        scores = self(x).reshape(-1)
        events, times = target[:, 0], target[:, 1]
        loss = cox_partial_likelihood_loss(scores, events, times)
        cindex = concordance_index(times, scores.detach(), events)
        return loss, {"cindex": torch.tensor(cindex, device=scores.device)}
