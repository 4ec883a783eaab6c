"""Figures saved next to a run's CSV files (matplotlib, the ``plots`` extra).

- per-client metric distributions, one run or several (FedAvg against personalized);
- kNN-Per's λ_t against the local dataset size (Marfoq thesis Fig. 3.3/3.9);
- participation counts per client and the participants of every round.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - the plots extra is installed in CI
        raise ImportError("Plots need matplotlib: pip install 'lightning-fl[plots]'.") from err
    return plt


def _save(plt, fig, path: str, dpi: int) -> str:
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def read_client_metrics(
    path: str, metric: str = "test_acc", stage: str = "test", clients: Sequence[int] | None = None
) -> dict[int, float]:
    """The last round's value of ``metric`` per client from a ``client_metrics.csv``."""
    with open(path) as handle:
        rows = [r for r in csv.DictReader(handle) if r["metric"] == metric and r["stage"] == stage]
    if not rows:
        raise ValueError(f"{path} has no {stage!r} rows for metric {metric!r}.")
    last = max(int(r["round"]) for r in rows)
    values = {int(r["client"]): float(r["value"]) for r in rows if int(r["round"]) == last}
    return values if clients is None else {c: v for c, v in values.items() if c in set(clients)}


def plot_client_distributions(
    runs: Mapping[str, Mapping[int, float]], path: str, metric: str = "test accuracy"
) -> str:
    """Per-client ``metric`` of several runs: a box plot with every client as a dot, and
    the 10th percentile marked (the papers' bottom decile)."""
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(runs), 4))
    labels = list(runs)
    data = [np.array(list(runs[name].values())) for name in labels]
    ax.boxplot(data, showfliers=False)
    for i, values in enumerate(data, start=1):
        jitter = np.random.default_rng(i).uniform(-0.12, 0.12, len(values))
        ax.scatter(i + jitter, values, s=10, alpha=0.6)
        ax.hlines(np.quantile(values, 0.1), i - 0.3, i + 0.3, colors="red", linestyles="dashed")
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=30, ha="right")
    ax.set_ylabel(f"per-client {metric}")
    ax.set_title("clients (dots), 10th percentile (red dashes)")
    return _save(plt, fig, path, 120)


def plot_lambda_vs_size(lambdas_csv: str, path: str) -> str:
    """kNN-Per's chosen λ_t against the client's datastore (local training set) size."""
    with open(lambdas_csv) as handle:
        rows = list(csv.DictReader(handle))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.scatter([int(r["datastore_size"]) for r in rows], [float(r["lambda"]) for r in rows], s=14)
    ax.set_xscale("log")
    ax.set_xlabel("local dataset size n_t")
    ax.set_ylabel("chosen λ_t")
    ax.set_ylim(-0.05, 1.05)
    return _save(plt, fig, path, 120)


def plot_participation(participation_csv: str, path: str) -> str:
    """From a run's ``participation.csv``: how many rounds each client took part in (bars)
    and who took part in which round (a raster, the availability trace of the sampled
    clients)."""
    import numpy as np

    with open(participation_csv) as handle:
        rows = [r for r in csv.DictReader(handle) if int(r["client"]) >= 0]
    if not rows:
        raise ValueError(f"{participation_csv} has no client rows.")
    rounds = np.array([int(r["round"]) for r in rows])
    clients = np.array([int(r["client"]) for r in rows])
    counts = np.bincount(clients)
    plt = _pyplot()
    fig, (bars, raster) = plt.subplots(1, 2, figsize=(11, 3.6))
    bars.bar(np.arange(len(counts)), counts, width=0.9)
    bars.set_xlabel("client")
    bars.set_ylabel("rounds taken part in")
    raster.scatter(rounds, clients, s=2, marker="s")
    raster.set_xlabel("round")
    raster.set_ylabel("client")
    raster.set_title("participants per round")
    return _save(plt, fig, path, 110)


def plot_curves(
    panels: Mapping[str, Mapping[str, Sequence[float]]], path: str, xlabel: str, ylabel: str
) -> str:
    """Line curves against steps 1, 2, ...: one panel per entry of ``panels`` (its title),
    one line per curve (its label) — regret and accuracy curves of the benchmarks."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 1, 3.5), squeeze=False)
    for ax, (title, curves) in zip(axes[0], panels.items()):
        for label, curve in curves.items():
            ax.plot(range(1, len(curve) + 1), curve, label=label)
        if title:
            ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend()
        ax.grid(alpha=0.3)
    return _save(plt, fig, path, 110)
