"""Figures of a federated run, saved in its folder beside the CSV files.

Installed by default by :class:`~lightning_fl.FederatedStrategy` (switch it off with
``FederatedStrategy(enable_plots=False)``, or give your own instance to set where it
draws). Needs matplotlib (the ``plots`` extra); without it, nothing is drawn.
"""

from __future__ import annotations

import importlib.util
import os

import lightning.pytorch as pl

from lightning_fl.engine.outputs import run_dir


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
                from lightning_fl.plots import plot_metrics_over_rounds

                plot_metrics_over_rounds(path, os.path.join(folder, "metrics.png"))
        path = os.path.join(folder, "participation.csv")
        if not (self.participation and os.path.exists(path)):
            return
        from lightning_fl.plots import plot_participation

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
        from lightning_fl.plots import plot_client_distributions

        for name, values in per_client.items():
            groups = {
                "seen": {c: v for c, (v, _) in values.items() if c not in unseen},
                "unseen": {c: v for c, (v, _) in values.items() if c in unseen},
            }
            groups = {k: g for k, g in groups.items() if g}
            target = os.path.join(run_dir(trainer), f"clients_{name}.png")
            plot_client_distributions(groups, target, metric=name)
