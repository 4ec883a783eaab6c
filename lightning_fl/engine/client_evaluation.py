"""Validation and test client by client (docs/architecture.md, "One round is one Lightning
epoch", step 6), and the epoch's report over clients.

Each client's batches run with its personalized model where a callback keeps one (the
callbacks' ``on_client_evaluation_start``), and the global model is restored after it.
At each client boundary the metric capture reads the client's own means; at the epoch's
end every rank's clients are gathered, summarized (weighted and uniform means, bottom
decile, seen and unseen clients apart), logged, and written to ``client_metrics.csv``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger

from lightning_fl.engine import collectives
from lightning_fl.engine.bulk import collector_paused
from lightning_fl.engine.cohort import cohort_standard_errors
from lightning_fl.engine.context import FitContext
from lightning_fl.engine.evaluation import (
    ClientMetricCapture,
    summarize,
    write_client_metrics_csv,
)
from lightning_fl.engine.outputs import run_dir
from lightning_fl.engine.plugins import FederatedCallback
from lightning_fl.engine.round_engine import RoundEngine
from lightning_fl.engine.schedule import ClientSchedule
from lightning_fl.engine.segment_evaluation import SegmentEvaluation

#: {metric: {client: (mean, num_samples)}}
PerClient = dict[str, dict[int, tuple[float, float]]]


class ClientEvaluation:
    """One evaluation epoch of a fit's rank: which client's batches run now, and the
    capture of each client's metrics. ``global_tensors`` is the global model kept while
    personalized models are evaluated (None when no callback personalizes). The client
    evaluation hooks run through ``engine`` (:meth:`RoundEngine.call`: its hook order)."""

    def __init__(self, fit: FitContext, engine: RoundEngine) -> None:
        self.fit, self.engine = fit, engine
        self.capture = ClientMetricCapture()
        self.schedule: ClientSchedule | None = None
        self.open_client: int | None = None
        self.global_tensors: list | None = None
        self.sizes: dict[int, int] = {}
        self.segments: SegmentEvaluation | None = None
        self.population: int | None = None
        self.unseen: frozenset[int] = frozenset()
        #: the last epoch's gathered per-client values: (stage, per_client, unseen)
        self.last_report: tuple[str, PerClient, set[int]] | None = None

    def begin(
        self,
        schedule: ClientSchedule,
        sizes: dict[int, int] | None = None,
        segments: SegmentEvaluation | None = None,
        population: int | None = None,
    ) -> None:
        """Start an epoch over ``schedule`` (``sizes``: each client's sample count); with
        ``segments``, the epoch's steps are groups of clients evaluated together; with
        ``population``, the clients are a cohort drawn from that many."""
        self.segments, self.population = segments, population
        self.unseen = self.fit.federation.unseen_set
        personalizes = any(
            type(cb).on_client_evaluation_start is not FederatedCallback.on_client_evaluation_start
            and not cb.evaluation_observer
            for cb in self.fit.plugins.callbacks
        )
        self.schedule, self.open_client, self.sizes = schedule, None, sizes or {}
        self.global_tensors = self.fit.tensors.clone() if personalizes else None
        self.capture.reset()

    def step(self, step: Any, args: tuple, kwargs: dict) -> Any:
        """Run the module's evaluation ``step``, switching clients at their first batch;
        a rank without clients to evaluate has one idle batch, which runs nothing."""
        if self.segments is not None:
            batch = kwargs["batch"] if "batch" in kwargs else args[0]
            self.segments.run(batch)
            return None
        if self.schedule.total == 0:
            return None
        batch_idx = kwargs["batch_idx"] if "batch_idx" in kwargs else args[1]
        pos, local_step = self.schedule.locate(batch_idx)
        if local_step == 0:
            self.end_client()
            self.open_client = self.schedule.clients[pos]
            self.engine.call("on_client_evaluation_start", self.open_client)
        output = step(*args, **kwargs)
        if batch_idx == self.schedule.total - 1:
            # Close the last client now: Lightning syncs (in place) the logged sums over
            # ranks before the epoch-end hooks run.
            self.end_client()
        return output

    @property
    def personalizes(self) -> bool:
        """Whether a callback personalizes the evaluated model (the global one is kept
        and restored after each client)."""
        return self.global_tensors is not None

    def end_client(self) -> None:
        """Capture the open client's metrics, run ``on_client_evaluation_end`` and restore
        the global model."""
        client = self.open_client
        if client is None:
            return
        module = self.fit.module
        unseen = client in self.unseen
        sums = module.pop_evaluation_sums() if hasattr(module, "pop_evaluation_sums") else None
        self.capture.close_client(
            module.trainer._results, client, exclude=unseen, module_sums=sums,
            num_samples=self.sizes.get(client),
        )  # fmt: skip
        self.engine.call("on_client_evaluation_end", client)
        if self.global_tensors is not None:
            self.fit.tensors.load_(self.global_tensors)
        self.open_client = None

    def report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """The epoch's report: every rank's clients summarized and logged (seen and
        unseen apart), ``client_metrics.csv`` and W&B histograms written by rank 0."""
        with collector_paused():  # a full pass's report holds a row per client
            self._report(trainer, pl_module, stage)

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.end_client()
        if trainer.sanity_checking:
            return
        if self.segments is not None:
            for name, values in self.segments.per_client(stage, self.schedule.clients).items():
                self.capture.per_client[name].update(values)
                self.capture.summed_names.add(name)
        per_client, summed = self._gather(trainer)
        unseen = set(self.unseen)
        _log_summaries(pl_module, per_client, summed, unseen, self._populations(unseen))
        self.last_report = (stage, per_client, unseen)
        if per_client and trainer.is_global_zero:
            # no trainer.log_dir here: it is a collective, and only rank 0 writes
            path = os.path.join(run_dir(trainer), "client_metrics.csv")
            write_client_metrics_csv(path, stage, trainer.current_epoch, per_client)
        for logger in trainer.loggers if trainer.is_global_zero else []:
            if isinstance(logger, WandbLogger):
                _log_histograms(logger, trainer, per_client)

    def _populations(self, unseen: set[int]) -> dict[str, int] | None:
        """The clients a cohort stands for, seen and unseen: those with data in the split
        (``population``), shared in the unseen clients' proportion."""
        if self.population is None:
            return None
        total = self.fit.datamodule.num_clients
        unseen_share = round(self.population * len(unseen) / total) if total else 0
        return {"seen": self.population - unseen_share, "unseen": max(unseen_share, 1)}

    def _gather(self, trainer: pl.Trainer) -> tuple[PerClient, set[str]]:
        """Every rank's per-client values and the names of the summed metrics (a site that
        dropped evaluates none of its clients)."""
        capture = self.capture
        per_client = {k: dict(v) for k, v in capture.per_client.items() if v}
        summed = set(capture.summed_names)
        if (group := collectives.across_ranks(trainer.world_size)) is not None:
            parts = group.gather_present((per_client, sorted(summed)), ({}, []))
            per_client = {}
            for part, names in parts:
                summed |= set(names)
                for name, values in part.items():
                    per_client.setdefault(name, {}).update(values)
        return per_client, summed


def _log_summaries(
    pl_module: pl.LightningModule,
    per_client: PerClient,
    summed: set[str],
    unseen: set[int],
    populations: dict[str, int] | None = None,
) -> None:
    """Every metric's summary over the seen and the unseen clients; with ``populations``
    (a cohort's: the number of clients it stands for, ``"seen"`` and ``"unseen"``), also
    the cohort estimates' standard errors."""
    for name, values in per_client.items():
        groups = {
            name: {c: v for c, v in values.items() if c not in unseen},
            f"{name}/unseen": {c: v for c, v in values.items() if c in unseen},
        }
        for prefix, group in groups.items():
            if not group:
                continue
            summary = summarize(group, name)
            if populations is not None:
                population = populations["seen" if prefix == name else "unseen"]
                errors = cohort_standard_errors(
                    [v for v, _ in group.values()], [n for _, n in group.values()], population
                )  # undefined (NaN) for a group of one client: not logged
                summary |= {k: v for k, v in errors.items() if not math.isnan(v)}
            for key, value in summary.items():
                # the same on every rank: syncing only averages equal values
                pl_module.log(f"{prefix}/{key}", value, sync_dist=True)
            if name in summed and prefix == name:
                # a FederatedTask's metric, summed per client instead of logged every
                # batch: its epoch value is the seen clients' sample-weighted mean, from
                # every rank's clients (no count averaging over ranks)
                pl_module.log(name, summary["weighted"], sync_dist=True, prog_bar=True)


def _log_histograms(logger: WandbLogger, trainer: pl.Trainer, per_client: PerClient) -> None:
    import wandb

    logger.experiment.log(
        {
            f"{name}/clients": wandb.Histogram([v for v, _ in values.values()])
            for name, values in per_client.items()
        }
        | {"trainer/global_step": trainer.global_step},
    )
