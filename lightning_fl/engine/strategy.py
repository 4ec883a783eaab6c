"""FederatedStrategy: one Lightning epoch is one communication round.

Round t (docs/architecture.md, "One round is one Lightning epoch"; :mod:`lightning_fl.engine` maps
where each step lives):
1. the sampler chooses the participants S_t and their weights ω_i from (seed, t)
   (:mod:`.planning`);
2. the round's batches are each participant's local batches in turn (:mod:`.rounds`);
3. at a client's first batch the global weights θ^t are loaded in place, its optimizer
   state is reset (or restored) and the callbacks apply its persistent state; the user's
   ``training_step``, backward and optimizer step run unchanged (:mod:`.round_engine`);
4. after its last optimizer step, its update Δ_i = θ_i − θ^t is folded into Σ ω_i Δ_i
   (:mod:`.driver` calls the engine);
5. after the last participant, the one aggregator callback writes θ^{t+1};
6. validation and test run client by client (:mod:`.client_evaluation`).
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_fl.engine import (
    collectives,
    fit_callbacks,
    fused_steps,
    processes,
    segment_evaluation,
    setup_checks,
)
from lightning_fl.engine.client_evaluation import ClientEvaluation
from lightning_fl.engine.client_store import ClientStore
from lightning_fl.engine.cohort import fit_cohort
from lightning_fl.engine.context import FederatedConfig, Federation, FitContext, Ranks
from lightning_fl.engine.data_contract import FederatedLoader
from lightning_fl.engine.divergence import DivergenceMonitor
from lightning_fl.engine.fast_paths import direct_hooks, overrides_transfer
from lightning_fl.engine.federated_state import CheckpointReadError
from lightning_fl.engine.fused_steps import FusedLocalSteps
from lightning_fl.engine.outputs import RunSummary
from lightning_fl.engine.packed import PackedFederation, check_data_on_device, pack_for_fit
from lightning_fl.engine.planning import RoundPlan
from lightning_fl.engine.plugins import PluginView
from lightning_fl.engine.processes import SMALL_MODEL_PARAMETERS
from lightning_fl.engine.round_engine import NonFiniteUpdateError, RoundEngine
from lightning_fl.engine.rounds import EvalRounds, TrainRounds
from lightning_fl.engine.silo_checkpoints import SiloShards
from lightning_fl.engine.silo_sites import SiloSites, join_silos
from lightning_fl.engine.tensors import FederatedTensors
from lightning_fl.engine.training_steps import TrainingSteps
from lightning_fl.engine.vectorized import VectorizedClients
from lightning_fl.systems.samplers import ClientSampler, FullParticipation

__all__ = ["FederatedStrategy", "NonFiniteUpdateError", "SMALL_MODEL_PARAMETERS"]


class FederatedStrategy(DDPStrategy):
    """Simulates federated rounds, in one process or over several (``devices=N``,
    ``num_nodes``, torchrun, SLURM: Lightning's launchers and ``torch.distributed``).

    The Lightning-facing part: launch, set-up, Lightning's per-step hooks and checkpoint
    I/O. The round's work is done by the objects it holds: ``engine`` (planning and the
    client life cycle: :class:`~lightning_fl.engine.round_engine.RoundEngine`),
    ``vectorized`` (chunks of clients trained together), ``evaluation`` (clients' held-out
    metrics), ``steps`` (what each training step does); the
    :class:`~lightning_fl.engine.driver.RoundDriver` callback ends clients and rounds and
    carries the federated state in checkpoints. The model is never wrapped in
    DistributedDataParallel: rank k owns the clients with ``client % world_size == k``
    and trains them, or a share of the participants balanced by their steps when no
    plugin keeps client state (:mod:`lightning_fl.engine.planning`); each round ends with
    one all-reduce of the weighted update sums.

    Args:
        sampler: chooses the participants of each round (default: every client).
        local_steps: local optimizer steps per client and round (K), cycling the client's
            data; exclusive with ``local_epochs``.
        local_epochs: local passes over the client's data per round (E).
        seed: the only source of the run's FL randomness: participants, client data order
            and the global torch RNG at each client start are derived from (seed, round,
            client), which makes resumed runs exact.
        keep_optimizer_state: keep each client's optimizer state across its rounds
            (stored in the client store) instead of resetting it every round.
        max_consecutive_bad_rounds: a client update with NaN or Inf is dropped and logged;
            after this many consecutive rounds with a dropped update, training stops.
        vectorize: train a round's participants together with ``torch.func`` over
            stacked client models (:mod:`lightning_fl.engine.vectorized`: what a module
            must satisfy, which optimizers and callbacks are supported). Equal to the
            sequential run to float round-off.
        compile: with ``vectorize``, compile the step's per-client loss and gradients
            (:mod:`lightning_fl.engine.compiled`): True uses inductor, a string names
            another backend; the compile time is logged apart (``fl/compile_seconds``).
        max_vectorized_clients: with ``vectorize``, train at most this many clients
            together (a round is split into chunks) to bound memory; None: all of this
            rank's participants.
        local_steps_per_training_step: how many local steps of a chunk's clients (with
            ``vectorize``), or of one client (the sequential path), one Lightning training
            step runs (None: all), paying Lightning's per-step machinery (about 0.4 ms on a
            CPU) once for them; the result is the same. ``trainer.global_step`` counts
            Lightning steps. On the sequential path each local step still runs the module's
            ``training_step``, Lightning's backward and optimizer step (their hooks and
            gradient clipping); refused where a callback or the module reads every batch's
            start or end (``on_train_batch_start``/``_end``), or a learning-rate scheduler
            steps every Lightning step (:mod:`lightning_fl.engine.fused_steps`).
        num_threads: CPU threads per process (CPU runs only). ``"auto"`` (default): one
            for models under 1M parameters, the cores divided among the processes above,
            ``OMP_NUM_THREADS`` when set (:func:`~lightning_fl.engine.processes.set_cpu_threads`
            says why); an int sets it; None leaves torch's setting.
        allow_new_federation: resume a checkpoint whose federation (datamodule class,
            clients, their counts, partition seed) differs, dropping the state of clients
            that no longer exist. Default: refuse (:class:`FederationMismatchError`).
        silos: silo mode (README, "Deploying across silos"): client c lives on rank
            c % world_size, each rank opens only its own clients' data and keeps their
            state in its own checkpoint shard (:mod:`lightning_fl.engine.silo_checkpoints`).
            A list names the sites in the clients' order: a site's rank is its name's
            place (:mod:`lightning_fl.engine.silo_sites`).
        silo: this process's site among named ``silos`` (default: ``LIGHTNING_FL_SILO``).
        enable_plots: install :class:`~lightning_fl.callbacks.FederatedPlots` (the figures
            in the run's folder) unless the Trainer has one.
        data_on_device: pack the training data once into tensors on the training device
            (:mod:`lightning_fl.engine.packed`; the same batches, drawn by index).
            ``"auto"`` (default): with ``vectorize`` or on an accelerator, when the data is
            in memory and takes at most half of the free device memory (the log says which
            path a fit takes and why); True: always, warning when it cannot; False: never.
        eval_clients: validation during a fit evaluates a seeded cohort of this many
            clients (:mod:`lightning_fl.engine.cohort`), logged with standard errors
            (``val_acc/se``); None (default), ``validate`` and ``test``: every client.
        vectorize_evaluation: evaluate many clients in one step
            (:mod:`lightning_fl.engine.segment_evaluation` says when it can). ``"auto"``
            (default): when it can and the first batch agrees with a plain call; True:
            refuse, naming the reason, when it cannot; False: client by client.
        first_round: the round index of the fit's first epoch (default 0): a fit that
            trains one round of a longer run, as a Flower ClientApp's fits do in the
            server-side mode (:mod:`lightning_fl.flower.server_side`); its clients' seeds
            and batches are those of that round.
        secret_randomness: draw the noise that protects privacy (DPSGD's, DPFedAvg's)
            from the operating system's secret generator
            (:mod:`lightning_fl.systems.privacy_noise`), not from ``seed``: a fit that is
            one site's part of a deployment (a Flower ClientApp's in the server-side
            mode). Always so with ``silos``; default False (a simulation, reproducible).
        training_counts: every client's training count, given rather than read from the
            datamodule (which then checks its own clients' against them): a fit whose
            datamodule opens only its own client, as a Flower ClientApp's in the
            server-side mode does, with the server's counts (the target weights p_i).
    """

    strategy_name = "federated"
    #: FederatedTask modules sum evaluation metrics per client (logged at its boundaries)
    collects_evaluation_sums = True
    #: what the engine of the current fit reads, and its objects (built at set-up)
    fit: FitContext | None = None
    engine: RoundEngine | None = None
    vectorized: VectorizedClients | None = None
    evaluation: ClientEvaluation | None = None
    _transfer_needed = True  # set at set-up: does a hook change batch transfer?
    steps: TrainingSteps | None = None

    def __init__(
        self,
        sampler: ClientSampler | None = None,
        local_steps: int | None = None,
        local_epochs: int | None = None,
        seed: int = 0,
        keep_optimizer_state: bool = False,
        max_consecutive_bad_rounds: int = 3,
        timeout: timedelta | float = timedelta(minutes=10),
        num_threads: int | Literal["auto"] | None = "auto",
        vectorize: bool = False,
        compile: bool | str = False,
        max_vectorized_clients: int | None = None,
        local_steps_per_training_step: int | None = 1,
        allow_new_federation: bool = False,
        silos: bool | list[str] = False,
        silo: str | None = None,
        transport: collectives.Transport | None = None,
        enable_plots: bool = True,
        data_on_device: bool | Literal["auto"] = "auto",
        eval_clients: int | None = None,
        vectorize_evaluation: bool | Literal["auto"] = "auto",
        first_round: int = 0,
        secret_randomness: bool = False,
        training_counts: list[int] | None = None,
        **lightning_options: Any,
    ) -> None:
        super().__init__(timeout=processes.as_timedelta(timeout), **lightning_options)
        self.sampler = sampler or FullParticipation()  # the fit's: ``fit.plugins.sampler``
        #: the federated settings the engine reads, frozen (and checked: FederatedConfig)
        self.config = FederatedConfig(
            seed=seed, local_steps=local_steps, local_epochs=local_epochs,
            keep_optimizer_state=keep_optimizer_state,
            max_consecutive_bad_rounds=max_consecutive_bad_rounds, vectorize=vectorize,
            compile=compile, max_vectorized_clients=max_vectorized_clients,
            local_steps_per_training_step=local_steps_per_training_step,
            allow_new_federation=allow_new_federation, eval_clients=eval_clients,
            vectorize_evaluation=vectorize_evaluation, silos=bool(silos),
            first_round=first_round, secret_randomness=bool(silos) or secret_randomness,
            training_counts=None if training_counts is None else tuple(training_counts),
        )  # fmt: skip
        self.sites = SiloSites.named(silos, silo, transport)
        self.transport = transport  # None: torch.distributed (engine/collectives.py)
        self.num_threads = processes.check_num_threads(num_threads)
        self.data_on_device = check_data_on_device(data_on_device)
        self.enable_plots = enable_plots
        #: per-client state of the clients this rank owns (the plugins' store)
        self.client_store = ClientStore()
        self.divergence = DivergenceMonitor()
        self.summary = RunSummary()  # the notes and the folder a run names when it ends
        self._direct_hooks: dict[str, bool] = {}

    # ------------------------------------------------------------------ read-only views
    @property
    def current_round(self) -> RoundPlan | None:
        """The round in progress on this rank (its schedule, loaders and hooks' state)."""
        return self.engine.current_round if self.engine is not None else None

    @property
    def training_client(self) -> int | None:
        """The client whose local step runs now (the sequential path), None outside one."""
        current = self.engine.current_client if self.engine is not None else None
        return None if current is None else self.current_round.schedule.clients[current[0]]

    def owner(self, client: int) -> int:
        """The rank that trains ``client`` and keeps its state: a stable assignment."""
        return client % self.world_size

    # ------------------------------------------------------------------ launch and set-up
    @property
    def _single_process(self) -> bool:
        return self.num_nodes * self.num_processes <= 1

    def _configure_launcher(self) -> None:
        if self._single_process:
            self._launcher = None
        else:
            super()._configure_launcher()

    def setup_distributed(self) -> None:
        """Lightning's process group, one of this torchrun attempt's own after a restart
        (:func:`~lightning_fl.engine.processes.restarted_worker_store`), destroyed when
        the interpreter exits (:func:`~lightning_fl.engine.processes.destroy_group_at_exit`)."""
        if self.transport is not None or (self._single_process and not dist.is_initialized()):
            self.set_world_ranks()  # no process group: one process, or a transport's sites
            if self.transport is not None:
                collectives.open_transport(self.transport, self.global_rank, self.world_size,
                                           self.sites.name)  # fmt: skip
            return
        if (store := processes.restarted_worker_store(self.world_size, self._timeout)) is not None:
            self.set_world_ranks()  # Lightning's set-up, with a store of this attempt's own
            self._process_group_backend = self._get_process_group_backend()
            _init_dist_connection(
                self.cluster_environment, self._process_group_backend, store=store,
                timeout=self._timeout,
            )  # fmt: skip
        else:
            super().setup_distributed()
        processes.destroy_group_at_exit()

    def set_world_ranks(self) -> None:
        """Lightning's ranks; with named silos, a site's rank is its name's place in the
        recipe (:mod:`lightning_fl.engine.silo_sites`), whatever the launcher's was."""
        super().set_world_ranks()
        if self.sites is not None:
            self.sites.assign_rank(self.cluster_environment, self.world_size, self.num_nodes)

    def setup_environment(self) -> None:
        """Lightning's (the process group), then, in silo mode, the sites' names and
        recipes checked together, and the datamodule told which silo this process is,
        before Lightning calls its ``prepare_data`` and ``setup``."""
        super().setup_environment()
        site = self.sites.name if self.sites is not None else None
        self._shards = SiloShards(self.config.silos, self.global_rank, self.world_size, site)
        if self.config.silos:
            ranks = Ranks(self.world_size, self.global_rank)
            join_silos(self.lightning_module.trainer, self.config, self.sites, ranks)

    def configure_ddp(self) -> None:
        """Never wrap the model in DistributedDataParallel: ranks train different clients."""

    def connect(self, model: pl.LightningModule) -> None:
        """Lightning's, then the fit's callbacks completed and ordered
        (:func:`~lightning_fl.engine.fit_callbacks.install`)."""
        super().connect(model)
        fit_callbacks.install(model.trainer.callbacks, self.enable_plots)

    def setup(self, trainer: pl.Trainer) -> None:
        processes.set_cpu_threads(
            self.num_threads, self.model, self.num_processes, self.root_device
        )
        self._transfer_needed = overrides_transfer(self.lightning_module)
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if (group := collectives.across_ranks(self.world_size)) is not None:
            collectives.broadcast_module(self.model, group)  # every rank starts from rank 0's
        setup_checks.check_trainer(trainer)
        self._setup_federated(trainer, fitting)

    def _setup_federated(self, trainer: pl.Trainer, fitting: bool) -> None:
        """The fit's plugins (checked together), federation (a validation or test after a
        fit on the same datamodule keeps the fit's) and context, the engine's objects, and
        what the callbacks are given (the driver its objects, every plugin the view)."""
        # imported here, so that `python -m lightning_fl.engine.composition` (the README's
        # refusal table) runs without runpy's warning about a module imported twice
        from lightning_fl.engine import composition

        plugins = fit_callbacks.plugins(trainer.callbacks, self.sampler)
        composition.check(
            trainer, plugins.sampler, self.config.vectorize, self.world_size, self.config.silos
        )
        ranks, last = Ranks(self.world_size, self.global_rank), self.fit
        if not fitting and last is not None and last.datamodule is trainer.datamodule:
            federation, packed = last.federation, last.packed  # the last fit's, read once
        else:
            given = self.config.training_counts
            federation, packed = Federation(trainer.datamodule, fitting, ranks, given), None
        if fitting:
            packed = self._prepare_fit(trainer, federation, plugins.aggregator.pools_clients)
            if not plugins.aggregator.pools_clients:
                plugins.sampler.check(int(np.count_nonzero(federation.training_counts)))
        tensors = FederatedTensors(self.lightning_module)
        self.fit = FitContext(
            config=self.config, trainer=trainer, module=self.lightning_module,
            device=self.root_device, ranks=ranks,
            tensors=tensors, store=self.client_store, plugins=plugins,
            federation=federation, packed=packed, to_device=self.batch_to_device,
            divergence=self.divergence,
            site_names=self.sites.names if self.sites is not None else None,
        )  # fmt: skip
        self.engine = RoundEngine(self.fit)
        self.vectorized = VectorizedClients(self.fit, self.engine)
        self.evaluation = ClientEvaluation(self.fit, self.engine)
        fused = FusedLocalSteps(self.backward, self.local_optimizer_step, self.divergence.observe)
        self.steps = TrainingSteps(self.engine, self.vectorized, self.root_device, fused)
        fit_callbacks.driver(trainer.callbacks).attach(
            self.fit, self.engine, self.vectorized, self.evaluation
        )
        view = PluginView(self.client_store, federation.training_counts, tensors, self.config,
                          plugins.aggregator, self.fit.site_names, self.evaluation)  # fmt: skip
        for cb in plugins.callbacks:
            cb.view = view
        if self.config.vectorize_evaluation is True:  # refuses, naming the reason
            self._segment_evaluation()
        setup_checks.check_federation(
            trainer.datamodule, self.world_size, self.config.vectorize_evaluation
        )
        if fitting and self.config.vectorize:
            self.vectorized.setup()
        elif fitting:
            fused_steps.check(trainer, self.config.local_steps_per_training_step)

    def _prepare_fit(
        self, trainer: pl.Trainer, federation: Federation, pools_clients: bool
    ) -> PackedFederation | None:
        """A fit's own set-up: validation only where there is data, a new cohort at each
        validation, Lightning's per-step hooks that may be skipped, the SIGTERM check once
        a round. Returns the packed training data (None: the datamodule's loaders)."""
        setup_checks.skip_validation_without_data(trainer, federation)
        if self.config.eval_clients is not None:
            # a new cohort at every validation: Lightning asks for the loaders again
            trainer.reload_dataloaders_every_n_epochs = 1
        self._direct_hooks = direct_hooks(trainer, self.precision_plugin)
        processes.check_sigterm_once_per_round(trainer, self.world_size)
        if pools_clients:
            return None
        counts, config = federation.training_counts, self.config
        return pack_for_fit(trainer.datamodule, counts, self.root_device, self.data_on_device,
                            config.vectorize, config.silos)  # fmt: skip

    def on_exception(self, exception: BaseException) -> None:
        """A site's fit stopped on an error: its transport tells the others why."""
        super().on_exception(exception)
        collectives.close_transport(self.transport, exception)

    def teardown(self) -> None:
        """Lightning's teardown, then the run's summary (rank 0): its notes and folder."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        super().teardown()
        if trainer is not None and self.summary.automatic:
            self.summary.say(trainer)

    # ------------------------------------------------------------------ Lightning's steps
    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        """Lightning's batch transfer, skipped on a CPU run when the module overrides
        none of its hooks (their dispatch costs more than a small model's step)."""
        device = device or self.root_device
        if device.type == "cpu" and not self._transfer_needed:
            return batch  # (on_before_batch_transfer is called by the loop, not here)
        return super().batch_to_device(batch, device, dataloader_idx)

    def process_dataloader(self, dataloader: object) -> object:
        """A federated loader becomes the round's iterable: every participant's training
        batches, or every owned client's held-out batches."""
        if not isinstance(dataloader, FederatedLoader):
            return dataloader
        if dataloader.split == "train":
            return TrainRounds(self.fit, self.engine.begin_round)
        trainer = self.lightning_module.trainer
        cohort, population = fit_cohort(
            self.fit.federation, dataloader.split, self.config, trainer.current_epoch,
            trainer.state.fn == TrainerFn.FITTING,
        )  # fmt: skip
        return EvalRounds(
            self.fit.federation, dataloader.split, self.fit.ranks, self.evaluation, cohort,
            self._segment_evaluation(dataloader.split), population,
        )  # fmt: skip

    def _segment_evaluation(self, split: str | None = None) -> Any:
        """The factory of vectorized evaluation epochs of ``split`` (None: of any, at
        set-up, without its batch limit), or None."""
        trainer = self.lightning_module.trainer
        limit = None
        if split is not None:
            limit = trainer.limit_test_batches if split == "test" else trainer.limit_val_batches
        return segment_evaluation.factory(
            self.config.vectorize_evaluation,
            self.lightning_module,
            self.fit.plugins.callbacks,
            batch_limit=limit,
        )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Locate the batch in the round; at a client's (or chunk's) first batch, start it."""
        super().on_train_batch_start(batch, batch_idx)
        self.steps.locate(batch_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The batch's step (:class:`~lightning_fl.engine.training_steps.TrainingSteps`):
        the user's, a vectorized chunk's, or none on a rank's idle batches."""
        batch = args[0] if args else kwargs["batch"]

        def user_step(one: Any) -> Any:  # the module's training_step on the batch ``one``
            if args:
                return super(FederatedStrategy, self).training_step(one, *args[1:], **kwargs)
            return super(FederatedStrategy, self).training_step(**{**kwargs, "batch": one})

        return self.steps.run(batch, user_step)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step; on idle steps (``steps.idle``) only the closure runs,
        with no clipping or ``on_before_optimizer_step`` on gradient-less parameters."""
        if self.steps.idle and self.lightning_module.trainer.training:
            return closure()
        return self.local_optimizer_step(optimizer, closure, model, **kwargs)

    def local_optimizer_step(
        self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any
    ) -> Any:
        """Lightning's optimizer step of a local step (its hooks and clipping); without
        their dispatch where nothing overrides them."""
        if self._direct_hooks.get("optimizer_step"):
            return optimizer.step(closure=closure, **kwargs)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any):
        """Lightning's backward; when nothing overrides its hooks, without their dispatch."""
        if self._direct_hooks.get("backward"):
            self.pre_backward(closure_loss)
            closure_loss.backward(*args, **kwargs)
            return closure_loss.detach()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.evaluation.step(super().validation_step, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.evaluation.step(super().test_step, args, kwargs)

    # ------------------------------------------------------------------ checkpoint I/O
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Lightning's saving (rank 0 writes the file); in silo mode every rank first
        writes its own clients' store to its shard beside it."""
        self._shards.save(checkpoint, filepath)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's removal (rank 0); in silo mode every rank removes its shard."""
        self._shards.remove(filepath)
        super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """Lightning's loading, with errors that name the file; in silo mode each rank
        adds its own shard (:mod:`lightning_fl.engine.silo_checkpoints`). A resumed fit
        then keeps the checkpoint's run folder
        (:meth:`~lightning_fl.engine.driver.RoundDriver.adopt_run_folder`)."""
        read = partial(CheckpointReadError.reading, load=super().load_checkpoint,
                       weights_only=weights_only)  # fmt: skip
        checkpoint = self._shards.load(checkpoint_path, read)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            fit_callbacks.driver(trainer.callbacks).adopt_run_folder(
                trainer, checkpoint_path, checkpoint
            )
        return checkpoint
