"""Figures saved next to a run's CSV files (matplotlib, the ``plots`` extra).

- the metrics against rounds (and against simulated time, where the run has a clock);
- per-client metric distributions, one run or several (FedAvg against personalized);
- kNN-Per's λ_t against the local dataset size (Marfoq thesis Fig. 3.3/3.9);
- participation counts per client and the participants of every round with their weights.

Every title is wrapped to the figure's width when saved.

:class:`FederatedPlots` is the callback that draws a run's figures in its folder beside the
CSV files. :class:`~lightning_fl.FederatedStrategy` installs it by default (switch it off
with ``FederatedStrategy(enable_plots=False)``, or give your own instance to set what it
draws). Without matplotlib (the ``plots`` extra), it draws nothing.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import textwrap
from collections.abc import Mapping, Sequence

import lightning.pytorch as pl

from lightning_fl.engine.outputs import run_dir


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - the plots extra is installed in CI
        raise ImportError("Plots need matplotlib: pip install 'lightning-fl[plots]'.") from err
    return plt


def _save(plt, fig, path: str, dpi: int) -> str:
    _wrap_titles(fig)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _wrap_titles(fig) -> None:
    """Wrap every axes title onto as many lines as its axes' width needs."""
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        title = ax.title
        text = title.get_text().replace("\n", " ")
        if not text:
            continue
        width = ax.get_window_extent(renderer).width
        for columns in range(len(text), 8, -4):
            title.set_text("\n".join(textwrap.wrap(text, columns)))
            if title.get_window_extent(renderer).width <= width:
                break


def _integer_ticks(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


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
    labels = list(runs)
    data = [np.array(list(runs[name].values())) for name in labels]
    if sum(len(v) for v in data) > MANY_CLIENTS:
        return _client_histograms(plt, labels, data, path, metric)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 + 1.3 * len(runs)), 4))
    ax.boxplot(data, showfliers=False)
    for i, values in enumerate(data, start=1):
        jitter = np.random.default_rng(i).uniform(-0.12, 0.12, len(values))
        ax.scatter(i + jitter, values, s=10, alpha=0.6, color="C0", label="a client")
        ax.hlines(np.quantile(values, 0.1), i - 0.3, i + 0.3, colors="red", linestyles="dashed",
                  label="10th percentile")  # fmt: skip
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=30, ha="right")
    ax.set_ylabel(f"per-client {metric}")
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[:2], names[:2], fontsize="small", loc="best")
    ax.set_title(f"{metric} of every client ({sum(len(v) for v in data)} clients)")
    return _save(plt, fig, path, 120)


#: Above this many clients, per-client figures are histograms, not a mark per client.
MANY_CLIENTS = 1000


def _client_histograms(plt, labels: list[str], data: list, path: str, metric: str) -> str:
    """Per-client ``metric`` of many clients: one step histogram per run, its 10th
    percentile marked."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, values) in enumerate(zip(labels, data)):
        color = f"C{i}"
        ax.hist(values, bins=50, histtype="step", color=color, label=f"{label} ({len(values):,})")
        ax.axvline(np.quantile(values, 0.1), color=color, linestyle="dashed")
    ax.set_xlabel(f"per-client {metric} (dashed: 10th percentile)")
    ax.set_ylabel("clients")
    ax.legend(fontsize="small", loc="best")
    ax.set_title(f"{metric} of every client ({sum(len(v) for v in data):,} clients)")
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
    weights = np.array([float(r["weight"]) for r in rows])
    counts = np.bincount(clients)
    plt = _pyplot()
    fig, (bars, raster) = plt.subplots(1, 2, figsize=(11, 3.8))
    if len(counts) <= MANY_CLIENTS:
        bars.bar(np.arange(len(counts)), counts, width=0.9)
        bars.set_xlabel("client")
        bars.set_ylabel("rounds taken part in")
        bars.set_title("participation of every client")
    else:  # a histogram over the clients, not a bar a client
        taken = counts[counts > 0]
        bars.hist(taken, bins=np.arange(1, taken.max() + 2) - 0.5)
        bars.set_xlabel("rounds taken part in")
        bars.set_ylabel("clients")
        bars.set_title(f"{len(taken):,} clients took part (of ids 0–{len(counts) - 1:,})")
    size = max(2.0, min(30.0, 3000.0 / max(len(rows), 1)))
    dots = raster.scatter(rounds, clients, c=weights, s=size, marker="s", cmap="viridis")
    fig.colorbar(dots, ax=raster, label="aggregation weight")
    raster.set_xlabel("round")
    raster.set_ylabel("client")
    raster.set_title("participants of every round and their weights")
    for axis in (bars.xaxis, bars.yaxis, raster.xaxis, raster.yaxis):
        _integer_ticks(axis)
    return _save(plt, fig, path, 110)


#: the most panels of the metrics figure (the training and validation kinds first)
MAX_PANELS = 6


def _panel_of(name: str) -> tuple[int, str]:
    """(order, panel) of a metric: train_loss_epoch and val_loss/p90 share "loss";
    a namespaced metric (fl/federated_loss, dp/epsilon) has its own panel, after them."""
    base = name.split("/")[0].removesuffix("_epoch")
    for prefix in ("train_", "val_"):
        if base.startswith(prefix):
            return 0, base[len(prefix) :]
    return 1, name


#: metrics.csv columns that are bookkeeping, not curves
_NOT_CURVES = ("epoch", "step", "fl/round", "fl/participants", "fl/dropped_updates", "fl/time")


def read_round_metrics(metrics_csv: str) -> dict[str, dict[int, float]]:
    """``{column: {round: value}}`` of a run's metrics.csv: each epoch-level column's last
    value in each round (a round is an epoch); step-level columns (``*_step``) and the test
    of the final model (rows without an epoch's training) are left out."""
    with open(metrics_csv) as handle:
        rows = list(csv.DictReader(handle))
    curves: dict[str, dict[int, float]] = {}
    for row in rows:
        if not row.get("epoch"):
            continue
        for name, value in row.items():
            if value not in ("", None) and not name.endswith("_step") and name != "epoch":
                curves.setdefault(name, {})[int(row["epoch"])] = float(value)
    return curves


def plot_metrics_over_rounds(metrics_csv: str, path: str) -> str | None:
    """The run's metrics against rounds, one panel per kind (loss, accuracy, ...: the
    training, validation and per-client summaries of each together), and a second row
    against simulated time where the run logs ``fl/time`` (asynchrony, gossip). None when
    the run logged no per-round metric."""
    curves = read_round_metrics(metrics_csv)
    clock = curves.get("fl/time")
    trained = {r for name in ("train_loss_epoch", "fl/round") for r in curves.get(name, {})}
    kinds: dict[str, dict[str, dict[int, float]]] = {}
    for name, values in sorted(curves.items(), key=lambda item: _panel_of(item[0])):
        points = {r: v for r, v in values.items() if r in trained}  # not the final test
        skip = name.startswith("test_") or name.endswith("/weighted")  # = the plain mean
        if name in _NOT_CURVES or skip or not points:
            continue
        kinds.setdefault(_panel_of(name)[1], {})[name.removesuffix("_epoch")] = points
    kinds = dict(list(kinds.items())[:MAX_PANELS])
    if not kinds:
        return None
    plt = _pyplot()
    rows = 2 if clock else 1
    fig, axes = plt.subplots(
        rows, len(kinds), figsize=(4.2 * len(kinds) + 1, 3.4 * rows), squeeze=False
    )
    for column, (kind, lines) in enumerate(kinds.items()):
        lines = _merged_equal_curves(lines)
        for row in range(rows):
            ax = axes[row][column]
            for label, points in lines.items():
                steps = sorted(points)
                xs = steps if row == 0 else [clock.get(r, float("nan")) for r in steps]
                ax.plot(xs, [points[r] for r in steps], marker="." if len(steps) < 30 else "",
                        label=label)  # fmt: skip
            ax.set_xlabel("round" if row == 0 else "simulated time (fl/time)")
            if row == 0:
                _integer_ticks(ax.xaxis)
            ax.set_ylabel(kind)
            ax.set_title(f"{kind} against {'rounds' if row == 0 else 'simulated time'}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="x-small")
    return _save(plt, fig, path, 110)


def _merged_equal_curves(lines: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    """Curves with the same points drawn once, labelled ``a = b``: a curve drawn over an
    equal one would hide it (``val_acc`` and ``val_acc/uniform`` of equal-size clients)."""
    merged: dict[tuple, list[str]] = {}
    for label, points in lines.items():
        merged.setdefault(tuple(sorted(points.items())), []).append(label)
    return {" = ".join(labels): dict(points) for points, labels in merged.items()}


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


class FederatedPlots(pl.Callback):
    """At the end of a fit, ``metrics.png`` (the metrics against rounds, and against
    simulated time where the run has a clock, from ``metrics.csv``) and
    ``participation.png`` (participation counts per client and the participants of every
    round with their aggregation weights, from ``participation.csv``); after every test
    epoch, ``clients_{metric}.png``: the distribution of each metric over clients, seen
    and unseen clients apart (the papers' per-client accuracy histograms).

    Args:
        participation: draw the participation figure.
        client_distributions: draw the per-client metric distributions.
        metrics: draw the metrics against rounds (needs a CSVLogger's metrics.csv).
    """

    def __init__(
        self, participation: bool = True, client_distributions: bool = True, metrics: bool = True
    ) -> None:
        self.participation = participation
        self.client_distributions = client_distributions
        self.metrics = metrics

    @staticmethod
    def _can_draw(trainer: pl.Trainer) -> bool:
        return trainer.is_global_zero and importlib.util.find_spec("matplotlib") is not None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (trainer.loggers and self._can_draw(trainer)):
            return
        folder = run_dir(trainer)
        if self.metrics:
            for logger in trainer.loggers:
                logger.save()  # a CSVLogger writes its pending rows
            path = os.path.join(folder, "metrics.csv")
            if os.path.exists(path):
                plot_metrics_over_rounds(path, os.path.join(folder, "metrics.png"))
        path = os.path.join(folder, "participation.csv")
        if not (self.participation and os.path.exists(path)):
            return
        try:
            plot_participation(path, os.path.join(folder, "participation.png"))
        except ValueError:  # only virtual clients (pooled baseline, server rounds)
            pass

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = getattr(trainer.strategy, "evaluation", None)
        report = report.last_report if report is not None else None
        if not (self.client_distributions and report and self._can_draw(trainer)):
            return
        stage, per_client, unseen = report
        if stage != "test" or trainer.sanity_checking:
            return
        for name, values in per_client.items():
            groups = {
                "seen": {c: v for c, (v, _) in values.items() if c not in unseen},
                "unseen": {c: v for c, (v, _) in values.items() if c in unseen},
            }
            groups = {k: g for k, g in groups.items() if g}
            target = os.path.join(run_dir(trainer), f"clients_{name}.png")
            plot_client_distributions(groups, target, metric=name)
