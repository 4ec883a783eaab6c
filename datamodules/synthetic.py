"""The FedEM paper's synthetic mixture dataset (Marfoq et al., NeurIPS 2021, §3.5.6 and the
authors' data/synthetic generator): every client's distribution is a mixture of M linear
binary classification tasks (Assumptions 8–10), generated here from a seed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from lightning_fl.datamodules.in_memory import InMemoryFederatedDataModule
from lightning_fl.datamodules.partition import split_fractions
from lightning_fl.engine.data_contract import arguments


@dataclass
class MixtureTasks:
    """Generated data: per-task features, labels and the true mixture (θ*, π*)."""

    features: list[np.ndarray]
    labels: list[np.ndarray]
    train_sizes: list[int]
    components: np.ndarray  # θ*_m, [M, d]
    mixture_weights: np.ndarray  # π*_t, [T, M]


Generator = Literal["corrected", "authors"]


def generate_mixture_tasks(
    num_tasks: int = 300,
    num_components: int = 3,
    dimension: int = 150,
    alpha: float = 0.4,
    noise_level: float = 0.1,
    num_test: int = 5000,
    seed: int = 12345,
    generator: Generator = "corrected",
    num_test_per_task: int | None = None,
) -> MixtureTasks:
    """FedEM's synthetic mixture (thesis §3.5.6): θ*_m ~ U([−1, 1]^d); π*_t ~ Dir(α·1_M);
    n_t = min(⌊LogNormal(4, 2)⌋ + 50, 1000) training samples; x ~ U([−1, 1]^d); each
    sample's component z ~ π*_t; y = round(sigmoid(xᵀθ*_z + ε)), ε ~ N(0, noise_level²).
    Task t's features and labels hold its n_t training samples, then its test samples.

    Two generators:

    - ``"corrected"`` (default): the model above, drawn with ``np.random.default_rng`` in
      the order θ, π, n.
    - ``"authors"``: the authors' ``data/synthetic/generate_data.py`` exactly, as the
      published Table 2 used it: the legacy ``np.random.seed(seed)`` stream in their
      order (n, then π task by task, then θ; then per task its training set, then its
      test set, each a multinomial count of samples per component, uniform x, normal
      noise per component, and a final shuffle). Their loop never advances the row
      index of a component's samples, so each component relabels the first rows (the
      last component wins) and the rows past the largest count keep label 0: about 25%
      of training rows are forced to 0 (37.3% positives instead of ~50%).

    Test sets: ``num_test_per_task`` samples for every task (the authors' protocol, 5,000;
    the default of the ``"authors"`` generator), or else ``num_test`` samples shared among
    the tasks in proportion to n_t.
    """
    components, weights, sizes, rng = _mixture_parameters(
        num_tasks, num_components, dimension, alpha, seed, generator
    )
    tasks = list(
        _draw_tasks(
            components, weights, sizes, rng, generator, noise_level, num_test, num_test_per_task
        )
    )
    features = [x for x, _, _ in tasks]
    labels = [y for _, y, _ in tasks]
    return MixtureTasks(features, labels, [n for _, _, n in tasks], components, weights)


def iter_mixture_tasks(
    num_tasks: int = 300,
    num_components: int = 3,
    dimension: int = 150,
    alpha: float = 0.4,
    noise_level: float = 0.1,
    num_test: int = 5000,
    seed: int = 12345,
    generator: Generator = "corrected",
    num_test_per_task: int | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """The tasks of :func:`generate_mixture_tasks` one at a time: (features float32,
    labels int64, n_t). The first k tasks do not depend on how many are taken."""
    components, weights, sizes, rng = _mixture_parameters(
        num_tasks, num_components, dimension, alpha, seed, generator
    )
    yield from _draw_tasks(
        components, weights, sizes, rng, generator, noise_level, num_test, num_test_per_task
    )


def _mixture_parameters(
    num_tasks: int, num_components: int, dimension: int, alpha: float, seed: int, generator: str
):
    """(θ*, π*, n, rng) drawn in the chosen generator's order."""
    if num_tasks < 1 or num_components < 1 or dimension < 1:
        raise ValueError("num_tasks, num_components and dimension must be >= 1.")
    if not alpha > 0:  # NaN too
        raise ValueError(f"alpha must be > 0, got {alpha}.")
    if generator not in ("corrected", "authors"):
        raise ValueError(f"generator must be 'corrected' or 'authors', got {generator!r}.")
    concentration = alpha * np.ones(num_components)
    if generator == "authors":
        rng = np.random.RandomState(seed)
        sizes = np.minimum(rng.lognormal(4, 2, num_tasks).astype(int) + 50, 1000)
        weights = np.stack([rng.dirichlet(concentration) for _ in range(num_tasks)])
        components = rng.uniform(-1.0, 1.0, size=(num_components, dimension))
        return components, weights, sizes, rng
    rng = np.random.default_rng(seed)
    components = rng.uniform(-1.0, 1.0, size=(num_components, dimension))
    weights = rng.dirichlet(concentration, size=num_tasks)
    sizes = np.minimum(rng.lognormal(4.0, 2.0, size=num_tasks).astype(int) + 50, 1000)
    return components, weights, sizes, rng


def _draw_tasks(
    components: np.ndarray,
    weights: np.ndarray,
    sizes: np.ndarray,
    rng,
    generator: str,
    noise_level: float,
    num_test: int,
    num_test_per_task: int | None,
) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """Every task's training then test samples, drawn from ``rng`` after the parameters."""
    num_tasks, (num_components, dimension) = len(sizes), components.shape
    if generator == "authors":
        per_task = 5000 if num_test_per_task is None else num_test_per_task
        for t in range(num_tasks):
            parts = [
                _authors_draw(rng, n, weights[t], components, noise_level)
                for n in (int(sizes[t]), per_task)
            ]
            x = np.concatenate([p[0] for p in parts]).astype(np.float32)
            y = np.concatenate([p[1] for p in parts]).astype(np.int64)
            yield x, y, int(sizes[t])
        return
    if num_test_per_task is not None:
        test_sizes = np.full(num_tasks, num_test_per_task)
    else:
        test_sizes = np.maximum(1, np.round(num_test * sizes / sizes.sum())).astype(int)
    for t in range(num_tasks):
        n = int(sizes[t] + test_sizes[t])
        x = rng.uniform(-1.0, 1.0, size=(n, dimension))
        z = rng.choice(num_components, size=n, p=weights[t])
        logits = np.einsum("nd,nd->n", x, components[z]) + noise_level * rng.standard_normal(n)
        yield x.astype(np.float32), (logits >= 0).astype(np.int64), int(sizes[t])  # σ ≥ 1/2


def _authors_draw(
    rng: np.random.RandomState,
    n: int,
    weights: np.ndarray,
    components: np.ndarray,
    noise_level: float,
) -> tuple[np.ndarray, np.ndarray]:
    """One call of the authors' ``generate_data``: their draws, in their order, including
    the component loop that relabels rows from index 0 each time (see
    :func:`generate_mixture_tasks`) and sklearn's ``shuffle`` (a permutation drawn from the
    same stream)."""
    counts = rng.multinomial(n, weights)
    x = rng.uniform(-1.0, 1.0, size=(n, components.shape[1]))
    y = np.zeros(n)
    for m, count in enumerate(counts):
        noise = rng.normal(size=count, scale=noise_level)
        y[:count] = np.round(1.0 / (1.0 + np.exp(-(x[:count] @ components[m] + noise))))
    order = np.arange(n)
    rng.shuffle(order)
    return x[order], y[order]


class SyntheticMixtureDataModule(InMemoryFederatedDataModule):
    """FedEM's synthetic benchmark: ``num_tasks`` clients, binary labels, a linear model
    per component (use ``Classifier`` with ``nn.Linear(dimension, 2)``, or
    ``MixtureClassifier`` for FedEM). Each client's training samples are split into train
    and validation by ``val_fraction``; its test samples come from the same mixture.

    Args:
        generator: ``"corrected"`` or ``"authors"`` (the authors' data exactly, as Table 2
            of the paper used it; see :func:`generate_mixture_tasks`).
        num_test: test samples shared among the clients in proportion to their size,
            unless ``num_test_per_task`` gives every client its own (the paper: 5,000,
            the ``"authors"`` default).
        unseen_fraction: the last clients held out as unseen (the paper's unseen-clients
            version uses 20%).
    """

    def __init__(
        self,
        num_tasks: int = 300,
        num_components: int = 3,
        dimension: int = 150,
        alpha: float = 0.4,
        noise_level: float = 0.1,
        num_test: int = 5000,
        val_fraction: float = 0.0,
        unseen_fraction: float = 0.0,
        seed: int = 12345,
        batch_size: int = 128,
        eval_batch_size: int | None = 1024,
        generator: Generator = "corrected",
        num_test_per_task: int | None = None,
    ) -> None:
        self._args = arguments(locals())
        super().__init__(None, batch_size, eval_batch_size)
        self.hold_out(unseen_fraction)
        self.save_hyperparameters()

    @property
    def tasks(self):
        """The generated mixture (its components, weights and every task's data)."""
        self._data()
        return self._tasks

    def read_clients(self):
        """Generate the tasks and split each one's training samples into train and val."""
        h = self._args
        self._tasks = tasks = generate_mixture_tasks(
            h.num_tasks, h.num_components, h.dimension, h.alpha, h.noise_level, h.num_test,
            h.seed, h.generator, h.num_test_per_task,
        )  # fmt: skip
        clients, seed = [], h.seed
        fractions = (1 - h.val_fraction, h.val_fraction)
        for t, (x, y) in enumerate(zip(tasks.features, tasks.labels)):
            n = tasks.train_sizes[t]
            fit, val = split_fractions(np.arange(n), fractions, seed + 31 * t)
            parts = {"train": fit, "val": val, "test": np.arange(n, len(y))}
            clients.append(
                {k: (torch.from_numpy(x[i]), torch.from_numpy(y[i])) for k, i in parts.items()}
            )
        return clients, None
