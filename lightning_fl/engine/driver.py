"""The round driver: the callback through which Lightning's loop ends clients and rounds.

Lightning's data fetcher reads one batch ahead, so a client cannot be finished when its
loader runs out: the driver finishes it after its last optimizer step
(``on_train_batch_end``), and ends the round after the last one. It also logs the round's
summaries (``fl/round``, ``fl/participants``, ...), appends ``participation.csv``, reports
evaluation epochs over clients and carries the federated state in checkpoints.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_fl.engine import collectives
from lightning_fl.engine.client_evaluation import ClientEvaluation
from lightning_fl.engine.context import FitContext
from lightning_fl.engine.data_contract import FederatedDataModule
from lightning_fl.engine.federated_state import federated_state_dict, load_federated_state_dict
from lightning_fl.engine.outputs import append_csv, run_dir
from lightning_fl.engine.plugins import RoundState
from lightning_fl.engine.rejoin import Welcome
from lightning_fl.engine.resume import ResumedRun, next_round
from lightning_fl.engine.round_engine import RoundEngine
from lightning_fl.engine.site_log import FinishedRound, SiteLog, trained_here
from lightning_fl.engine.vectorized import VectorizedClients


class RoundDriver(pl.Callback):
    """Installed first by :class:`~lightning_fl.FederatedStrategy`, which gives it the
    fit's objects at each set-up (:meth:`attach`)."""

    def __init__(self) -> None:
        self.fit: FitContext | None = None
        self.engine: RoundEngine | None = None
        self.vectorized: VectorizedClients | None = None
        self.evaluation: ClientEvaluation | None = None
        #: a checkpoint's federated state, loaded before the fit's set-up
        self._loaded: dict[str, Any] | None = None
        #: the run folder a resumed fit continues in (engine/resume.py)
        self._resumed: ResumedRun | None = None
        #: the run's identity, drawn at its first fit and kept by its checkpoints (silo
        #: shards record it: engine/silo_checkpoints.py)
        self.run_id: str | None = None
        #: the last round's end, kept while a site is missing (a site that is back
        #: resumes from it at this round's start)
        self._welcome: Welcome | None = None
        #: in silo mode, this site's lines (engine/site_log.py), opened at the fit's start
        self._site_log: SiteLog | None = None

    def attach(
        self,
        fit: FitContext,
        engine: RoundEngine,
        vectorized: VectorizedClients,
        evaluation: ClientEvaluation,
    ) -> None:
        """Take the fit's objects, and restore a checkpoint's federated state into them:
        Lightning restores callbacks before the strategy's set-up, so the state
        :meth:`load_state_dict` received waits for them here."""
        self.fit, self.engine = fit, engine
        self.vectorized, self.evaluation = vectorized, evaluation
        if self._loaded is not None:
            load_federated_state_dict(fit, engine, self._loaded)
            self._loaded = None

    @property
    def state_key(self) -> str:
        return "_RoundDriver"  # the checkpoint key since the first release: old ones resume

    def adopt_run_folder(self, trainer: pl.Trainer, ckpt_path: str, checkpoint: dict) -> None:
        """A resumed fit keeps its run folder (engine/resume.py). Called by the strategy
        when Lightning reads the checkpoint, before it restores the callbacks."""
        self._resumed = None
        if trainer.state.fn == "fit":
            self._resumed = ResumedRun.adopt(trainer, ckpt_path, next_round(checkpoint))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fit.divergence.reset()
        silos = self.fit.config.silos
        folder = None  # a resumed fit's sites each adopted the checkpoint's run folder
        if self.run_id is None:  # every rank takes rank 0's id, and in silo mode its folder
            self.run_id = uuid.uuid4().hex
            folder = run_dir(trainer) if silos and trainer.is_global_zero else None
            if (group := collectives.across_ranks(trainer.world_size)) is not None:
                self.run_id, folder = group.all_gather_object((self.run_id, folder))[0]
        if silos:
            self._open_site_log(trainer, folder)
        if self._resumed is not None:
            self._resumed.keep_earlier_rounds(trainer)
            self._resumed = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        engine = self.engine
        plan = engine.current_round
        if plan.chunks is not None:
            self._end_chunk_step(batch_idx)
            return
        if plan.fused:  # the fused step observed its own losses
            self._end_fused_step(batch_idx)
            return
        pos, step = engine.current_client  # located by the strategy's batch start
        padding = plan.is_padding(pos)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not padding and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.fit.divergence.observe(loss)
        if step == plan.schedule.num_batches[pos] - 1:
            if not padding:
                engine.finish_client(pos)
            if pos == len(plan.schedule.clients) - 1:
                self._end_round()

    def _end_chunk_step(self, batch_idx: int) -> None:
        """Vectorized clients: finish a chunk after its last step, the round after the
        last chunk (or the rank's idle steps)."""
        plan = self.engine.current_round
        chunk, step = plan.steps.locate(batch_idx)
        if step == plan.steps.num_batches[chunk] - 1:
            if chunk < len(plan.chunks):
                self.vectorized.finish_chunk(chunk)
            if chunk == len(plan.steps.clients) - 1:
                self._end_round()

    def _end_fused_step(self, batch_idx: int) -> None:
        """Fused local steps: finish the client after its last, the round after the last
        Lightning step (a client's, or the rank's idle steps)."""
        plan = self.engine.current_round
        if self.engine.current_client is not None:
            pos, step = self.engine.current_client
            if step == plan.schedule.num_batches[pos] - 1:
                self.engine.finish_client(pos)
        if batch_idx == plan.steps.total - 1:
            self._end_round()

    def _end_round(self) -> None:
        state = self.engine.end_round()
        self.fit.divergence.end_round(state.round_idx)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self.engine.current_round.state
        # Every rank holds the same values (the round's plan, the all-reduced drop count):
        # sync_dist takes a mean of equal values, and says so to Lightning.
        sync = trainer.world_size > 1
        pl_module.log("fl/round", float(state.round_idx), on_epoch=True, sync_dist=sync)
        participants = float(len(state.participation.clients))
        pl_module.log("fl/participants", participants, on_epoch=True, sync_dist=sync)
        dropped = float(state.dropped_count)
        pl_module.log("fl/dropped_updates", dropped, on_epoch=True, sync_dist=sync)
        for name, value in self.fit.plugins.sampler.round_metrics().items():
            pl_module.log(name, value, on_epoch=True, sync_dist=sync)
        if self.vectorized.compile_seconds is not None:
            seconds = self.vectorized.compile_seconds
            pl_module.log("fl/compile_seconds", seconds, on_epoch=True, sync_dist=sync)
        dm = trainer.datamodule
        if type(dm).clients_without_data_now is not FederatedDataModule.clients_without_data_now:
            skipped = float(self.engine.planner.skipped_now)
            pl_module.log("fl/skipped_empty", skipped, on_epoch=True, sync_dist=sync)
        if trainer.is_global_zero and trainer.loggers:
            _append_participation(os.path.join(run_dir(trainer), "participation.csv"), state)
        if self._site_log is not None:
            plan = self.engine.current_round
            trained = trained_here(state.participation.clients, plan.trained_by,
                                   self.fit.ranks.rank)  # fmt: skip
            self._site_log.round_ended(
                FinishedRound(
                    state.round_idx, trained, len(state.participation.clients), state.dropped_count
                )  # fmt: skip
            )
        group = collectives.across_ranks(trainer.world_size)
        if group is not None and group.dropped:  # what a site that comes back resumes from
            self._welcome = Welcome.at_round_end(trainer, self.fit, self.run_id)

    def _open_site_log(self, trainer: pl.Trainer, folder: str | None) -> None:
        """This site's log (silo mode), in the run folder rank 0 chose (a fresh fit's
        sites agree on it with the run id), else in this site's own (a resumed fit's)."""
        rank, names = self.fit.ranks.rank, self.fit.site_names
        site = names[rank] if names else f"silo {rank}"
        path = os.path.join(folder or run_dir(trainer), "sites", f"{site}.log")
        echo = getattr(trainer.progress_bar_callback, "print", None) or _say
        self._site_log = SiteLog(site, path, trainer.max_epochs - 1, echo)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The site's first line: the round it starts at (a resumed fit's, restored
        after ``on_fit_start``)."""
        if self._site_log is not None:
            resumed = trainer.ckpt_path is not None or trainer.current_epoch > 0
            self._site_log.fit_started(self.run_id, trainer.current_epoch, resumed)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._site_log is not None:
            self._site_log.flush(trainer.callback_metrics)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the last round's line (its metrics are logged now), then welcome the
        dropped sites that are back (after the last round's collectives, before this
        round's): :mod:`lightning_fl.engine.rejoin`."""
        if self._site_log is not None:
            self._site_log.flush(trainer.callback_metrics)
        welcome, self._welcome = self._welcome, None
        if welcome is not None and (joining := welcome.group.rejoining()):
            welcome.run(joining)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.evaluation.report(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.evaluation.report(trainer, pl_module, "test")

    def state_dict(self) -> dict[str, Any]:
        return {**federated_state_dict(self.fit, self.engine), "run_id": self.run_id}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict  # restored at :meth:`attach`
        self.run_id = state_dict.get("run_id", self.run_id)


def _say(line: str) -> None:
    print(line, flush=True)


def _append_participation(path: str, state: RoundState) -> None:
    """One row per participant of the round: round, client, aggregation weight ω_i, and
    whether its update was dropped (NaN/Inf; with several processes, the drops rank 0 saw:
    every rank's are counted in ``fl/dropped_updates``). Client −1 is the pooled
    baseline's virtual client, −3 the server (SAFARI's server rounds)."""
    participation = zip(state.participation.clients, state.participation.weights)
    rows = (
        [state.round_idx, client, f"{weight:.10g}", int(client in state.dropped)]
        for client, weight in participation
    )
    append_csv(path, ["round", "client", "weight", "dropped"], rows)
