"""The federations and the runner shared by benchmarks/user_level_dp.py and
benchmarks/robust_aggregation.py: digits (the embedded 1,797 images) or the first 6,000
Fashion-MNIST training images (Debian's dataset-fashion-mnist), flattened to [0, 1], split
iid over the clients into (train, reference, validation, test) parts by
ReferenceDataModule, so that every method of a table trains on the same data."""

from __future__ import annotations

import logging
import platform
import tempfile
import warnings

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_fl import MLP, Classifier, FederatedStrategy, WERMClassifier
from lightning_fl.datamodules import ReferenceDataModule
from lightning_fl.datamodules.digits import load_digits
from lightning_fl.datamodules.fashion_mnist import read_fashion_mnist

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
DATASETS = ("digits", "fashion_mnist")


def arrays(dataset: str) -> tuple[np.ndarray, np.ndarray]:
    if dataset == "digits":
        return load_digits()
    x, y, _, _ = read_fashion_mnist(FASHION_MNIST)
    return (x[:6000].reshape(6000, -1) / 255.0).astype(np.float32), y[:6000]


def federation(
    dataset: str,
    num_clients: int,
    werm: bool = False,
    batch_size: int = 8,
    split: tuple[float, float, float, float] = (0.4, 0.3, 0.0, 0.3),
) -> ReferenceDataModule:
    """Each client's samples split into (train, reference, validation, test); WERM's runs
    pair the training and reference batches, the others train on the training part only."""
    x, y = arrays(dataset)
    return ReferenceDataModule(x, y, num_clients=num_clients, split=split,
                               reference="client" if werm else "none", seed=0,
                               batch_size=batch_size, eval_batch_size=512)  # fmt: skip


def module(dataset: str, lr: float, werm: float | None = None) -> pl.LightningModule:
    torch.manual_seed(0)
    network = MLP(64 if dataset == "digits" else 784, (32,), 10)
    if werm is not None:
        return WERMClassifier(network, w=werm, lr=lr)
    return Classifier(network, lr=lr)


def fit_and_test(module_, datamodule, callbacks, rounds: int, **strategy) -> dict[str, float]:
    """Train ``rounds`` rounds, test once; the last round's and the test's metrics."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            max_epochs=rounds, default_root_dir=root, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            limit_val_batches=0, accelerator="cpu",
            strategy=FederatedStrategy(seed=0, enable_plots=False, **strategy),
            callbacks=callbacks,
        )  # fmt: skip
        trainer.fit(module_, datamodule=datamodule)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        trainer.test(module_, datamodule=datamodule, verbose=False)
    metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})
    return metrics


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch "
        f"thread(s), torch {torch.__version__}, Python {platform.python_version()}, cpu"
    )
