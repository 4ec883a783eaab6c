"""Per-client evaluation metrics and their summaries.

The user's ``validation_step``/``test_step`` logs batch means with ``self.log``; Lightning
accumulates Σ value·batch_size and Σ batch_size per metric. Reading those sums at every
client boundary gives each client's own mean. The epoch value Lightning reports is then
the sample-weighted mean over clients; this module adds the uniform mean and the bottom
decile, as reported in the FedEM and kNN-Per papers. The bottom decile is always the worst
clients: the 10th percentile (``/p10``) of a metric where higher is better (accuracy,
C-index), the 90th percentile (``/p90``) of one where lower is better (a loss or an error,
see :func:`lower_is_better`).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping

import torch

from lightning_fl.outputs import append_csv


class ClientMetricCapture:
    """Collects ``{metric: {client: (mean, num_samples)}}`` for one evaluation epoch.

    Two sources: metrics a module logs with ``self.log`` (only tensor metrics logged with
    ``on_epoch=True`` and the default mean reduction are split per client; a torchmetrics
    ``Metric`` object cannot be split this way), read from Lightning's running sums at each
    client boundary; and the per-client sums a :class:`~lightning_fl.FederatedTask` keeps
    on the device instead of logging every batch (``module_sums``, their names in
    :attr:`summed_names`), whose epoch value the strategy logs once, as the seen clients'
    sample-weighted mean.
    """

    def __init__(self) -> None:
        self.per_client: dict[str, dict[int, tuple[float, float]]] = defaultdict(dict)
        self._totals: dict[str, tuple[float, float]] = {}
        #: Names of the metrics that came as module sums (logged once per epoch).
        self.summed_names: set[str] = set()

    def reset(self) -> None:
        self.per_client.clear()
        self._totals.clear()
        self.summed_names.clear()

    def close_client(
        self,
        results: Mapping,
        client: int,
        exclude: bool = False,
        module_sums: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """Record ``client``'s means; with ``exclude``, also take its batches back out of
        Lightning's epoch sums (unseen clients must not move the seen clients' mean)."""
        for key, (total, count) in (module_sums or {}).items():
            self.summed_names.add(key)
            if float(count) > 0:
                self.per_client[key][client] = (float(total / count), float(count))
        for key, metric in results.items():
            meta = getattr(metric, "meta", None)
            if meta is None or not (metric.is_tensor and meta.on_epoch and meta.is_mean_reduction):
                continue
            total, count = float(metric.value), float(metric.cumulated_batch_size)
            previous_total, previous_count = self._totals.get(key, (0.0, 0.0))
            if count > previous_count:
                mean = (total - previous_total) / (count - previous_count)
                self.per_client[meta.name][client] = (mean, count - previous_count)
            if exclude:
                metric.value = torch.full_like(metric.value, previous_total)
                metric.cumulated_batch_size = torch.full_like(
                    metric.cumulated_batch_size, int(previous_count)
                )
            else:
                self._totals[key] = (total, count)


_LOWER_IS_BETTER = re.compile(r"(loss|error|err|nll|perplexity|mse|mae)$")


def lower_is_better(name: str) -> bool:
    """True for metrics whose smaller values are better: names ending in loss, error, err,
    nll, perplexity, mse or mae (``test_loss``, ``val_error``)."""
    return bool(_LOWER_IS_BETTER.search(name.rsplit("/", 1)[-1].lower()))


def summarize(values: Mapping[int, tuple[float, float]], name: str = "") -> dict[str, float]:
    """Sample-weighted mean, uniform mean and the bottom decile over clients: ``p10`` (the
    10th percentile) when higher is better, ``p90`` when ``name`` is a loss or an error."""
    means = torch.tensor([v for v, _ in values.values()], dtype=torch.float64)
    counts = torch.tensor([n for _, n in values.values()], dtype=torch.float64)
    worst = ("p90", 0.9) if lower_is_better(name) else ("p10", 0.1)
    return {
        "weighted": float((means * counts).sum() / counts.sum()),
        "uniform": float(means.mean()),
        worst[0]: float(torch.quantile(means, worst[1])),
    }


def write_client_metrics_csv(
    path: str,
    stage: str,
    round_idx: int,
    per_client: Mapping[str, Mapping[int, tuple[float, float]]],
) -> None:
    """Append one row per (metric, client) to ``path`` (header written once)."""
    rows = (
        [stage, round_idx, name, client, f"{value:.8g}", int(count)]
        for name, values in per_client.items()
        for client, (value, count) in sorted(values.items())
    )
    append_csv(path, ["stage", "round", "metric", "client", "value", "num_samples"], rows)
