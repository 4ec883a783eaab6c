"""kNN-Per: personalization through local memorization (Marfoq et al., ICML 2022;
Marfoq thesis §3.6, eqs. 3.29–3.33)."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_fl.checks import require_rate
from lightning_fl.engine import collectives
from lightning_fl.engine.local_training import batches, client_loader, evaluation_mode
from lightning_fl.engine.outputs import run_dir
from lightning_fl.engine.plugins import FederatedCallback
from lightning_fl.engine.seeding import generator
from lightning_fl.systems.datastore import Backend, Datastore, knn_probabilities

LAMBDA_GRID = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0)


def last_linear(module: nn.Module) -> str:
    names = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ValueError(
            f"{type(module).__name__} has no nn.Linear layer: name the representation and "
            "output layers (representation_layer=..., output_layer=...)."
        )
    return names[-1]


class KNNPer(FederatedCallback):
    """Interpolates the global model with a kNN model over each client's own datastore.

    When a client is evaluated (at ``stages``, after the global model h_S is trained by
    any FL algorithm):

    1. datastore (3.29): {(φ(x_i), y_i)} over the client's training data, where φ(x) is
       the input of ``representation_layer`` (default: the last ``nn.Linear``);
       ``capacity`` keeps a random fraction of it (seeded per client);
    2. kNN model (3.30–3.32): the k nearest keys under the Euclidean distance and the
       kernel exp(−d/σ);
    3. prediction (3.33): h_t(x) = λ_t·p_kNN(x) + (1−λ_t)·softmax(h_S(x)); the output of
       ``output_layer`` (default: the last ``nn.Linear``, which must produce the logits) is
       replaced by log h_t(x), so the module's own loss and accuracy score the
       personalized model;
    4. λ_t: each client picks from ``lambda_grid`` the value with the best accuracy on its
       validation data (the first best, so the smaller λ on ties); a fixed ``lambda_``
       skips the choice. Without validation data, ``default_lambda`` is used.

    Seen and unseen clients are treated alike: kNN-Per never trains. Every client's λ_t and
    training-set size are written to ``<log_dir>/knn_per_lambdas.csv`` (and, after a test
    in a run that draws figures, ``FederatedStrategy(enable_plots=True)`` with matplotlib,
    plotted against it in ``knn_per_lambdas.png``); λ's mean is
    logged as ``knn_per/lambda_mean``.

    The thesis' kernel is exp(−‖z−z'‖); the authors' code uses exp(−‖z−z'‖²/(p·scale));
    ``squared_distance=True`` with ``scale=p`` gives the latter.
    """

    #: the representation is the input of the last nn.Linear (or ``representation_layer``)
    module_methods = ("forward(x) -> logits",)
    supports_vectorized_clients = True  # no per-step hook: clients start and end as sequentially

    def __init__(
        self,
        k: int = 10,
        scale: float = 1.0,
        capacity: float = 1.0,
        lambda_: float | None = None,
        lambda_grid: Sequence[float] = LAMBDA_GRID,
        default_lambda: float = 0.5,
        representation_layer: str | None = None,
        output_layer: str | None = None,
        backend: Backend = "faiss",
        index: str = "flat",
        squared_distance: bool = False,
        stages: Sequence[str] = ("test",),
        seed: int = 0,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}.")
        require_rate("scale", scale, 1.0)  # σ
        if not 0.0 < capacity <= 1.0:
            raise ValueError(f"capacity is a fraction of the local data in (0, 1], got {capacity}.")
        for value in [*lambda_grid, default_lambda] + ([] if lambda_ is None else [lambda_]):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"λ values must be in [0, 1], got {value}.")
        unknown = set(stages) - {"validate", "test"}
        if unknown:
            raise ValueError(f"stages may contain 'validate' and 'test', got {sorted(unknown)}.")
        self.k, self.scale, self.capacity = k, scale, capacity
        self.lambda_, self.lambda_grid, self.default_lambda = (
            lambda_,
            tuple(lambda_grid),
            default_lambda,
        )
        self.representation_layer, self.output_layer = representation_layer, output_layer
        self.backend, self.index, self.squared_distance = backend, index, squared_distance
        self.stages, self.seed = tuple(stages), seed
        self.lambdas: dict[int, float] = {}
        self.datastore_sizes: dict[int, int] = {}
        self._hooks: list = []
        self._captured: Tensor | None = None

    # ------------------------------------------------------------------ layers and hooks
    def _layers(self, module: nn.Module) -> tuple[nn.Module, nn.Module]:
        modules = dict(module.named_modules())
        names = (
            self.representation_layer or last_linear(module),
            self.output_layer or last_linear(module),
        )
        for name in names:
            if name not in modules:
                raise ValueError(f"{type(module).__name__} has no layer named {name!r}.")
        return modules[names[0]], modules[names[1]]

    def _capture(self, module: nn.Module):
        representation, _ = self._layers(module)

        def hook(_layer, inputs):
            self._captured = inputs[0].detach().flatten(1)

        return representation.register_forward_pre_hook(hook)

    def _run(self, module: pl.LightningModule, loader) -> tuple[Tensor, Tensor, Tensor]:
        """Representations, model probabilities and labels of every sample of ``loader``."""
        _, output = self._layers(module)
        logits: list[Tensor] = []
        handles = [
            self._capture(module),
            output.register_forward_hook(lambda _m, _i, out: logits.append(out.detach())),
        ]
        keys, labels = [], []
        try:
            with evaluation_mode(module):
                for x, y in batches(loader, module.device):
                    module(x)
                    keys.append(self._captured.cpu())
                    labels.append(y.cpu())
        finally:
            for handle in handles:
                handle.remove()
        probs = torch.softmax(torch.cat(logits).float().cpu(), dim=-1)
        return torch.cat(keys), probs, torch.cat(labels)

    # ------------------------------------------------------------------ per client
    def _active(self, trainer: pl.Trainer) -> bool:
        stage = "test" if trainer.testing else "validate"
        return stage in self.stages and not trainer.sanity_checking

    def build_datastore(
        self, trainer: pl.Trainer, module: pl.LightningModule, client: int
    ) -> Datastore | None:
        loader = client_loader(trainer, client, "train")
        if loader is None:
            return None
        keys, _, labels = self._run(module, loader)
        if self.capacity < 1.0:
            keep = max(1, round(self.capacity * len(keys)))
            order = torch.randperm(  # host: the keys are on the host, as the draw
                len(keys), generator=generator(self.seed, "knn_capacity", client)
            )
            keys, labels = keys[order[:keep]], labels[order[:keep]]
        return Datastore(backend=self.backend, index=self.index).build(keys, labels)

    def knn_probs(self, datastore: Datastore, queries: Tensor, num_classes: int) -> Tensor:
        distances, labels = datastore.search(queries, self.k)
        if self.squared_distance:
            distances = distances**2
        return knn_probabilities(distances, labels, num_classes, self.scale)

    def choose_lambda(self, trainer, module, client: int, datastore: Datastore) -> float:
        if self.lambda_ is not None:
            return self.lambda_
        loader = client_loader(trainer, client, "val")
        if loader is None:
            return self.default_lambda
        queries, model_probs, labels = self._run(module, loader)
        knn = self.knn_probs(datastore, queries, model_probs.shape[1])
        accuracies = [
            float(((lam * knn + (1 - lam) * model_probs).argmax(1) == labels).float().mean())
            for lam in self.lambda_grid
        ]
        return self.lambda_grid[accuracies.index(max(accuracies))]

    def on_client_evaluation_start(self, trainer, pl_module, client: int) -> None:
        if not self._active(trainer):
            return
        datastore = self.build_datastore(trainer, pl_module, client)
        if datastore is None:
            return
        lam = self.choose_lambda(trainer, pl_module, client, datastore)
        self.lambdas[client], self.datastore_sizes[client] = lam, len(datastore)
        _, output = self._layers(pl_module)

        def interpolate(_layer, _inputs, logits: Tensor) -> Tensor:
            model_probs = torch.softmax(logits.float(), dim=-1)
            knn = self.knn_probs(datastore, self._captured, logits.shape[-1]).to(model_probs)
            mixed = lam * knn + (1 - lam) * model_probs
            return torch.log(mixed.clamp_min(1e-12)).to(logits.dtype)

        self._hooks = [self._capture(pl_module), output.register_forward_hook(interpolate)]

    def on_client_evaluation_end(self, trainer, pl_module, client: int) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._captured = [], None

    # ------------------------------------------------------------------ report
    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self.lambdas.clear()
        self.datastore_sizes.clear()

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self.on_test_epoch_start(trainer, pl_module)

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._report(trainer, pl_module)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if self._active(trainer):
            self._report(trainer, pl_module)

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rows = {c: (lam, self.datastore_sizes[c]) for c, lam in self.lambdas.items()}
        if (group := collectives.across_ranks(trainer.world_size)) is not None:
            parts = group.all_gather_object(rows)
            rows = {c: v for part in parts for c, v in part.items()}
        if not rows:
            return
        mean = sum(lam for lam, _ in rows.values()) / len(rows)
        pl_module.log("knn_per/lambda_mean", mean, sync_dist=True)
        if trainer.is_global_zero:
            log_dir = run_dir(trainer)
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, "knn_per_lambdas.csv")
            with open(path, "w", newline="") as handle:
                writer = csv.writer(handle)
                writer.writerow(["client", "lambda", "datastore_size"])
                for client, (lam, size) in sorted(rows.items()):
                    writer.writerow([client, lam, size])
            if trainer.testing and _draws_figures(trainer):
                from lightning_fl.plots import plot_lambda_vs_size

                plot_lambda_vs_size(path, os.path.join(log_dir, "knn_per_lambdas.png"))


def _draws_figures(trainer: pl.Trainer) -> bool:
    """Whether the run draws figures: a FederatedPlots callback is installed (by
    ``FederatedStrategy(enable_plots=True)``, the default, or by the user) and matplotlib
    is there."""
    import importlib.util

    from lightning_fl.plots import FederatedPlots

    has_plots = any(isinstance(cb, FederatedPlots) for cb in trainer.callbacks)
    return has_plots and importlib.util.find_spec("matplotlib") is not None
