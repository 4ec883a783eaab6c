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

import atexit
import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _destroy_dist_connection, _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_fl.datamodules.base import FederatedDataModule, FederatedLoader
from lightning_fl.engine import segment_evaluation, silo_checkpoints
from lightning_fl.engine.client_evaluation import ClientEvaluation
from lightning_fl.engine.client_store import ClientStore
from lightning_fl.engine.cohort import draw_cohort
from lightning_fl.engine.context import FederatedConfig, Federation, FitContext, Plugins, Ranks
from lightning_fl.engine.divergence import DivergenceMonitor
from lightning_fl.engine.driver import RoundDriver
from lightning_fl.engine.evaluation import ClientMetricCapture
from lightning_fl.engine.fast_paths import direct_hooks, overrides_transfer
from lightning_fl.engine.federated_state import CheckpointReadError
from lightning_fl.engine.outputs import RunSummary
from lightning_fl.engine.packed import PackedFederation, TooLarge, pack_federation
from lightning_fl.engine.planning import RoundPlan
from lightning_fl.engine.plugins import Aggregator, FedAvg, FederatedCallback, PluginView
from lightning_fl.engine.round_engine import NonFiniteUpdateError, RoundEngine
from lightning_fl.engine.rounds import EvalRounds, TrainRounds
from lightning_fl.engine.tensors import FederatedTensors
from lightning_fl.engine.vectorized import VectorizedClients
from lightning_fl.plots import FederatedPlots
from lightning_fl.systems.samplers import ClientSampler, FullParticipation

#: Below this many parameters, ``num_threads="auto"`` uses one CPU thread per process.
SMALL_MODEL_PARAMETERS = 1_000_000

__all__ = ["FederatedStrategy", "NonFiniteUpdateError", "SMALL_MODEL_PARAMETERS"]


class FederatedStrategy(DDPStrategy):
    """Simulates federated rounds, in one process or over several (``devices=N``,
    ``num_nodes``, torchrun, SLURM: Lightning's launchers and ``torch.distributed``).

    This class is the Lightning-facing part: launch, process group, Lightning's per-step
    hooks and checkpoint I/O. The round's work is done by the objects it holds: its
    ``engine`` (:class:`~lightning_fl.engine.round_engine.RoundEngine`: planning and the
    client life cycle), ``vectorized`` (vectorized chunks), ``evaluation`` (clients'
    held-out metrics); the :class:`~lightning_fl.engine.driver.RoundDriver` callback ends
    clients and rounds and carries the federated state in checkpoints.

    The model is never wrapped in DistributedDataParallel. Rank k owns the clients with
    ``client % world_size == k`` and keeps their client state. It trains the round's
    participants it owns, or, when no plugin keeps per-client state (FedAvg, the server
    optimizers, FedProx; no kept optimizer state, no streams), a share of the participants
    balanced by their numbers of steps (``RoundPlanner.ranks``). Ranks with fewer local
    batches get idle batches so that every rank steps through rounds of the same length.
    Each round ends with one all-reduce of the weighted update sums (gloo on CPU, NCCL on
    GPU). With one process no process group is created.

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
        vectorize: train a round's participants together, one local step of every client
            per Lightning step (or ``local_steps_per_training_step``), with ``torch.func``
            over stacked client models
            (:mod:`lightning_fl.engine.vectorized`: what a module must satisfy, which optimizers
            and callbacks are supported). Equal to the sequential run to float round-off.
        compile: with ``vectorize``, compile the step's per-client loss and gradients
            with ``torch.compile`` (:mod:`lightning_fl.engine.compiled`): True uses the
            inductor backend, a string names another backend. Equal to the eager
            vectorized path to float round-off; the compile time is logged apart
            (``fl/compile_seconds``).
        max_vectorized_clients: with ``vectorize``, train at most this many clients
            together (a round is split into chunks) to bound memory; None: all of this
            rank's participants.
        local_steps_per_training_step: with ``vectorize``, how many local steps of a
            chunk's clients one Lightning training step runs (None: the chunk's whole
            local work in one). Lightning's per-step machinery (hooks, closure, progress;
            about 0.4 ms on a CPU) is then paid once per this many local steps; the
            result is the same, and the progress bar shows the local steps each Lightning
            step covers. Lightning's own step count (``trainer.global_step``,
            ``log_every_n_steps``) counts Lightning steps.
        num_threads: CPU threads per process for torch's intra-op parallelism. ``"auto"``
            (default): leave ``OMP_NUM_THREADS`` alone when it is set; otherwise one
            thread for models under 1M parameters (FL's small models run many tiny ops,
            which gain nothing from more threads, and waiting threads stall when another
            process holds a core: the quickstart takes 10.7 s with one or two threads on
            an idle 2-core machine, but 15 s with one and 41 s with two while the other
            core is busy), and the cores divided among this machine's processes for
            larger ones. An int sets it; ``None`` leaves torch's
            setting untouched. Only applied on the CPU.
        allow_new_federation: resume a checkpoint even if its federation (the
            datamodule's class, number of clients, per-client training counts, partition
            seed) differs from this run's; the stored state of clients that no longer
            exist is dropped. Default: refuse, with :class:`FederationMismatchError`.
        silos: silo mode, for a deployment across institutions (README, "Deploying across
            silos"): client c lives on rank c % world_size for the whole run (no balancing
            of participants across ranks), each rank's datamodule opens only its own
            clients' data (``FederatedDataModule.enter_silo``), their sample counts are
            shared with one collective at set-up, and checkpoints keep each silo's client
            state in its own shard (:mod:`lightning_fl.engine.silo_checkpoints`). What
            crosses ranks is the round's summed update, the metrics and the global part of
            checkpoints.
        enable_plots: install :class:`~lightning_fl.callbacks.FederatedPlots` (the
            participation and per-client figures in the run's folder) unless the Trainer
            already has one.
        data_on_device: pack the federation's training data once, at set-up, into
            contiguous tensors on the training device (:mod:`lightning_fl.engine.packed`):
            vectorized chunks then draw their batches by index, and no batch crosses
            from the host at each step. ``"auto"`` (default): with ``vectorize`` or on an
            accelerator, when the data is in memory (plain ``TensorDataset`` clients, no
            stream) and takes at most half of the device's free memory; the log says
            which path a fit takes and why. The batches are the same either way. True:
            pack for every fit, sequential CPU runs included, and warn when the data
            cannot be packed; False: never.
        eval_clients: validation during a fit evaluates a cohort of this many clients,
            drawn uniformly without replacement from the clients with validation data, a
            function of (seed, round) (:mod:`lightning_fl.engine.cohort`); the metrics
            are the cohort's, with their standard errors (``val_acc/se``,
            ``val_acc/uniform_se``). None (default): every client.
            ``trainer.validate`` and ``trainer.test`` always evaluate every client.
        vectorize_evaluation: evaluate many clients in one step, vectorized over clients,
            when the datamodule holds the split as arrays (``split_arrays``), the module
            is a :class:`~lightning_fl.FederatedTask` with the library's evaluation step,
            and no callback acts at the clients' evaluation boundaries
            (:mod:`lightning_fl.engine.segment_evaluation`). ``"auto"`` (default): when
            all that holds and the first batch agrees with a plain call; True: refuse,
            naming the reason, when it does not; False: client by client.
    """

    strategy_name = "federated"
    #: FederatedTask modules sum evaluation metrics per client instead of logging every
    #: batch; the strategy takes the sums at client boundaries and logs once per epoch.
    collects_evaluation_sums = True

    def __init__(
        self,
        sampler: ClientSampler | None = None,
        local_steps: int | None = None,
        local_epochs: int | None = None,
        seed: int = 0,
        keep_optimizer_state: bool = False,
        max_consecutive_bad_rounds: int = 3,
        timeout: timedelta | float = timedelta(minutes=10),
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        num_threads: int | Literal["auto"] | None = "auto",
        vectorize: bool = False,
        compile: bool | str = False,
        max_vectorized_clients: int | None = None,
        local_steps_per_training_step: int | None = 1,
        allow_new_federation: bool = False,
        silos: bool = False,
        enable_plots: bool = True,
        data_on_device: bool | Literal["auto"] = "auto",
        eval_clients: int | None = None,
        vectorize_evaluation: bool | Literal["auto"] = "auto",
    ) -> None:
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        _check_threads_and_data(num_threads, data_on_device)
        #: the user's sampler; the fit's, as the callbacks wrap it, is ``fit.plugins.sampler``
        self.sampler = sampler or FullParticipation()
        #: the federated settings the engine reads, frozen (and checked: FederatedConfig)
        self.config = FederatedConfig(
            seed=seed,
            local_steps=local_steps,
            local_epochs=local_epochs,
            keep_optimizer_state=keep_optimizer_state,
            max_consecutive_bad_rounds=max_consecutive_bad_rounds,
            vectorize=vectorize,
            compile=compile,
            max_vectorized_clients=max_vectorized_clients,
            local_steps_per_training_step=local_steps_per_training_step,
            allow_new_federation=allow_new_federation,
            eval_clients=eval_clients,
            vectorize_evaluation=vectorize_evaluation,
            silos=silos,
        )
        self.num_threads = num_threads
        self.enable_plots = enable_plots
        self.data_on_device = data_on_device
        #: per-client state of the clients this rank owns (the plugins' store)
        self.client_store = ClientStore()
        self.divergence = DivergenceMonitor()
        #: what the engine of the current fit reads, and its objects (built at set-up)
        self.fit: FitContext | None = None
        self.engine: RoundEngine | None = None
        self.vectorized: VectorizedClients | None = None
        self.evaluation: ClientEvaluation | None = None
        #: the notes and the folder a run names when it ends (:class:`RunSummary`)
        self.summary = RunSummary()
        self._federated_tensors: FederatedTensors | None = None
        self._transfer_needed = True  # set at setup: does a hook change batch transfer?
        self._idle = False  # the current training step trains nobody (see optimizer_step)
        self._direct_hooks: dict[str, bool] = {}

    # ------------------------------------------------------------------ what plugins read
    seed = property(lambda self: self.config.seed, doc="The run's seed (``config.seed``).")
    local_steps = property(lambda self: self.config.local_steps, doc="K (``config``).")
    local_epochs = property(lambda self: self.config.local_epochs, doc="E (``config``).")
    vectorize = property(lambda self: self.config.vectorize, doc="``config.vectorize``.")
    keep_optimizer_state = property(
        lambda self: self.config.keep_optimizer_state, doc="``config.keep_optimizer_state``."
    )
    local_steps_per_training_step = property(
        lambda self: self.config.local_steps_per_training_step,
        doc="``config.local_steps_per_training_step``.",
    )

    @property
    def packed(self) -> PackedFederation | None:
        """The fit's training data packed on the device, or None."""
        return self.fit.packed if self.fit is not None else None

    @property
    def current_round(self) -> RoundPlan | None:
        """The round in progress on this rank (its schedule, loaders and hooks' state)."""
        return self.engine.current_round if self.engine is not None else None

    @property
    def current_client(self) -> tuple[int, int] | None:
        """(schedule position, local step) of the training batch in progress."""
        return self.engine.current_client if self.engine is not None else None

    @property
    def training_client(self) -> int | None:
        """The client whose local step runs now (the sequential path), None outside one."""
        if self.current_client is None:
            return None
        return self.current_round.schedule.clients[self.current_client[0]]

    @property
    def metric_capture(self) -> ClientMetricCapture:
        """This rank's per-client metrics of the last evaluation epoch."""
        return self.evaluation.capture

    @property
    def training_counts(self) -> np.ndarray:
        """Training samples per client in this fit (unseen clients count 0), as the
        fit's :class:`~lightning_fl.engine.context.Federation` read them at set-up: a
        read-only int64 array."""
        if self.fit is None:
            return np.zeros(0, dtype=np.int64)
        return self.fit.federation.training_counts

    @property
    def federated_tensors(self) -> FederatedTensors:
        if self._federated_tensors is None:
            raise RuntimeError("FederatedStrategy is not set up yet.")
        return self._federated_tensors

    @property
    def federated_callbacks(self) -> list[FederatedCallback]:
        return [
            cb
            for cb in self.lightning_module.trainer.callbacks
            if isinstance(cb, FederatedCallback)
        ]

    @property
    def aggregator(self) -> Aggregator:
        aggregators = [cb for cb in self.federated_callbacks if isinstance(cb, Aggregator)]
        if len(aggregators) > 1:
            names = ", ".join(type(a).__name__ for a in aggregators)
            raise ValueError(
                f"Exactly one aggregator callback may decide aggregation, got {names}. "
                "Keep one of them (FedAvg is the default when none is given)."
            )
        if not aggregators:
            default = FedAvg()
            self.lightning_module.trainer.callbacks.append(default)
            return default
        return aggregators[0]

    def owner(self, client: int) -> int:
        """The rank that trains ``client`` and keeps its state: a stable assignment."""
        return client % self.world_size

    def owners(self, clients: Sequence[int]) -> list[int]:
        """:meth:`owner` of each of ``clients``."""
        world_size = self.world_size
        return [client % world_size for client in clients]

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
        """Lightning's process group (one of this torchrun attempt's own after a restart),
        destroyed when the interpreter exits, for every backend: Lightning registers that
        for NCCL only, and a Gloo group left to the interpreter's finalization aborts the
        process now and then ("terminate called without an active exception", exit -6)
        after the run has finished, which torchrun reports as a failed run
        (pytorch/pytorch#190489)."""
        if self._single_process and not dist.is_initialized():
            self.set_world_ranks()
            return
        if (store := _restarted_worker_store(self.world_size, self._timeout)) is not None:
            self.set_world_ranks()  # Lightning's set-up, with a store of this attempt's own
            self._process_group_backend = self._get_process_group_backend()
            _init_dist_connection(
                self.cluster_environment, self._process_group_backend, store=store,
                timeout=self._timeout,
            )  # fmt: skip
        else:
            super().setup_distributed()
        atexit.unregister(_destroy_dist_connection)  # once, however many fits
        atexit.register(_destroy_dist_connection)

    def setup_environment(self) -> None:
        """Lightning's (the process group), then, in silo mode, the datamodule learns which
        silo this process is, before Lightning calls its ``prepare_data`` and ``setup``."""
        super().setup_environment()
        if self.config.silos:
            datamodule = self.lightning_module.trainer.datamodule
            if not isinstance(datamodule, FederatedDataModule):
                _check_trainer(self.lightning_module.trainer)
            datamodule.enter_silo(self.global_rank, self.world_size)

    def configure_ddp(self) -> None:
        """Never wrap the model in DistributedDataParallel: ranks train different clients."""

    def connect(self, model: pl.LightningModule) -> None:
        """Install the round driver (first), the federated progress bar in place of
        Lightning's and, with ``enable_plots``, the plots callback; run the callbacks that
        replace the gradient (DP-SGD) before those that add terms to it."""
        super().connect(model)
        callbacks = model.trainer.callbacks
        if not any(isinstance(cb, RoundDriver) for cb in callbacks):
            callbacks.insert(0, RoundDriver())
        if self.enable_plots and not any(isinstance(cb, FederatedPlots) for cb in callbacks):
            callbacks.append(FederatedPlots())

        def order(cb: pl.Callback) -> int:  # Lightning runs per-step hooks in list order
            if isinstance(cb, RoundDriver):
                return 0
            return 1 if getattr(cb, "replaces_gradient", False) else 2

        callbacks.sort(key=order)  # stable
        for i, cb in enumerate(callbacks):
            if type(cb) is TQDMProgressBar:  # Lightning's default bar
                from lightning_fl.engine.progress import FederatedProgressBar

                callbacks[i] = FederatedProgressBar(refresh_rate=cb.refresh_rate, leave=cb._leave)
                if not sys.stderr.isatty():  # a bar in a file or pipe is a line per step
                    callbacks[i].disable()

    def _set_cpu_threads(self) -> None:
        """Apply ``num_threads`` (see the class docstring)."""
        if self.root_device.type != "cpu" or self.num_threads is None:
            return
        if self.num_threads != "auto":
            torch.set_num_threads(self.num_threads)
        elif not os.environ.get("OMP_NUM_THREADS"):
            size = sum(p.numel() for p in self.model.parameters())
            share = max(1, (os.cpu_count() or 1) // max(1, self.num_processes))
            torch.set_num_threads(1 if size < SMALL_MODEL_PARAMETERS else share)

    def setup(self, trainer: pl.Trainer) -> None:
        self._set_cpu_threads()
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
        if dist.is_initialized() and self.world_size > 1:
            with torch.no_grad():  # every rank starts from rank 0's model
                for tensor in [*self.model.parameters(), *self.model.buffers()]:
                    dist.broadcast(tensor.data, src=0)
        _check_trainer(trainer)
        self._setup_federated(trainer, fitting)

    def _setup_federated(self, trainer: pl.Trainer, fitting: bool) -> None:
        """The fit's plugins (checked together), federation and context, the engine's
        objects, and what the callbacks are given (the driver its objects, every plugin
        the view)."""
        self._federated_tensors = FederatedTensors(self.lightning_module)
        aggregator = self.aggregator  # validates the callbacks early
        # imported here, so that `python -m lightning_fl.engine.composition` (the README's
        # refusal table) runs without runpy's warning about a module imported twice
        from lightning_fl.engine import composition

        sampler = self.sampler
        for cb in self.federated_callbacks:
            sampler = cb.wrap_sampler(sampler)
        composition.check(
            trainer, sampler, self.config.vectorize, self.world_size, self.config.silos
        )
        plugins = Plugins(tuple(self.federated_callbacks), aggregator, sampler)
        federation, packed = self._federation(trainer.datamodule, fitting)
        if fitting:
            packed = self._prepare_fit(trainer, federation, plugins)
        self.fit = FitContext(
            config=self.config,
            trainer=trainer,
            module=self.lightning_module,
            device=self.root_device,
            ranks=Ranks(self.world_size, self.global_rank),
            tensors=self._federated_tensors,
            store=self.client_store,
            plugins=plugins,
            federation=federation,
            packed=packed,
            to_device=self.batch_to_device,
            divergence=self.divergence,
        )
        self.engine = RoundEngine(self.fit)
        self.vectorized = VectorizedClients(self.fit, self.engine)
        self.evaluation = ClientEvaluation(self.fit, self.engine)
        driver = next(cb for cb in trainer.callbacks if isinstance(cb, RoundDriver))
        driver.attach(self.fit, self.engine, self.vectorized, self.evaluation)
        view = PluginView(self.client_store, federation.training_counts,
                          self._federated_tensors, self.config, aggregator)  # fmt: skip
        for cb in plugins.callbacks:
            cb.view = view
        self._refuse_at_setup(trainer)
        if fitting and self.config.vectorize:
            self.vectorized.setup()

    def _prepare_fit(
        self, trainer: pl.Trainer, federation: Federation, plugins: Plugins
    ) -> PackedFederation | None:
        """A fit's own set-up: validation only where there is data, a new cohort at each
        validation, the training data packed, the sampler checked against the clients
        with data, Lightning's per-step hooks that may be skipped. Returns the packed
        data (None: the datamodule's loaders)."""
        self._skip_validation_without_data(trainer, federation)
        if self.config.eval_clients is not None:
            # a new cohort at every validation: Lightning asks for the loaders again
            trainer.reload_dataloaders_every_n_epochs = 1
        packed = self._pack_federation(trainer, federation.training_counts)
        if not plugins.aggregator.pools_clients:
            plugins.sampler.check(int(np.count_nonzero(federation.training_counts)))
        self._direct_hooks = direct_hooks(trainer, self.precision_plugin)
        self._check_sigterm_once_per_round(trainer)
        return packed

    def _refuse_at_setup(self, trainer: pl.Trainer) -> None:
        """What is refused at set-up rather than at a late epoch: vectorized evaluation
        that cannot run, fewer clients than processes."""
        if self.config.vectorize_evaluation is True:
            self._segment_evaluation(trainer)
            if trainer.datamodule.split_arrays("train") is None:
                raise ValueError(
                    f"vectorize_evaluation=True, but {type(trainer.datamodule).__name__} does "
                    "not hold its clients as arrays (split_arrays): use an "
                    "ArrayFederatedDataModule, or vectorize_evaluation='auto'."
                )
        if trainer.datamodule.num_clients < self.world_size:
            raise ValueError(
                f"{self.world_size} processes but only {trainer.datamodule.num_clients} "
                "clients: every rank must own at least one client; use fewer devices."
            )

    def _federation(
        self, datamodule: FederatedDataModule, fitting: bool
    ) -> tuple[Federation, PackedFederation | None]:
        """The fit's federation (its sample counts, read once) and packed data: new for a
        fit; for validation or test, the last fit's when it had this datamodule."""
        last = self.fit
        if not fitting and last is not None and last.datamodule is datamodule:
            return last.federation, last.packed
        ranks = Ranks(self.world_size, self.global_rank)
        return Federation(datamodule, require_data=fitting, ranks=ranks), None

    @staticmethod
    def _skip_validation_without_data(trainer: pl.Trainer, federation: Federation) -> None:
        """No client has a validation split: no validation loop (instead of Lightning's
        "Total length of `EvalRounds` across ranks is zero")."""
        if trainer.limit_val_batches != 0 and not federation.has_validation_data():
            rank_zero_info("No client has validation data: validation is skipped.")
            trainer.limit_val_batches = 0

    def teardown(self) -> None:
        """Lightning's teardown, then the run's summary (rank 0): its notes and folder."""
        module = self.lightning_module
        trainer = module.trainer if module is not None and module._trainer else None
        super().teardown()
        if trainer is not None and self.summary.automatic:
            self.summary.say(trainer)

    def _check_sigterm_once_per_round(self, trainer: pl.Trainer) -> None:
        """On several processes, Lightning (2.6) broadcasts rank 0's SIGTERM flag before
        every training step: a collective per local step, which makes every rank wait for
        the slowest one at each step (1.1 s of a 10-round cnn run on 2 processes, and
        each step costs the slower rank's time). Here it is broadcast at each round's
        first step only, the same step on every rank: a SIGTERM still stops every rank
        together, at the next round's start (the round's end is where a checkpoint is
        taken and a run can resume from)."""
        loop = trainer.fit_loop.epoch_loop
        broadcast = getattr(loop, "_broadcast_sigterm_tensor", None)
        if broadcast is None or self.world_size == 1:
            return
        checked = {"round": None}

        def once_per_round() -> None:
            if checked["round"] != trainer.current_epoch:
                checked["round"] = trainer.current_epoch
                broadcast()

        loop._broadcast_sigterm_tensor = once_per_round

    def _pack_federation(
        self, trainer: pl.Trainer, counts: Sequence[int]
    ) -> PackedFederation | None:
        """The packed federation (``data_on_device``), or None; says which in the log."""
        wanted = self.data_on_device
        if wanted == "auto":
            wanted = self.config.vectorize or self.root_device.type != "cpu"
        if not wanted or self.aggregator.pools_clients:
            return None
        if self.config.silos:  # packing reads every client's data
            rank_zero_info("lightning_fl: silo mode: the training data stays with its silo.")
            return None
        packed, reason = pack_federation(trainer.datamodule, list(counts), self.root_device)
        if packed is None:
            message = (
                f"lightning_fl: the training data stays with the datamodule's loaders: {reason}."
            )
            if isinstance(reason, TooLarge):  # batches cross from the host at every step
                rank_zero_warn(
                    message + " Free device memory, or set data_on_device=False to silence this."
                )
            elif self.data_on_device is True:
                rank_zero_warn(message + " Set data_on_device='auto' to silence this.")
            else:
                rank_zero_info(message)
            return None
        rank_zero_info(
            f"lightning_fl: the training data ({len(packed.columns[0])} samples, "
            f"{packed.nbytes / 2**20:.1f} MiB) is packed on {packed.device}."
        )
        return packed

    # ------------------------------------------------------------------ Lightning's steps
    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        """Lightning's batch transfer, skipped when it would change nothing: the batches
        of in-memory CPU data on a CPU run, when the module overrides none of the transfer
        hooks (their dispatch and the walk over a vectorized step's batches cost more
        than the step's arithmetic on small models)."""
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
        cohort = population = None
        if self.config.eval_clients is not None and trainer.state.fn == TrainerFn.FITTING:
            eligible = self.fit.federation.clients_with_data(dataloader.split)
            population = len(eligible)
            cohort = draw_cohort(
                eligible, self.config.eval_clients, self.config.seed, trainer.current_epoch
            )
        return EvalRounds(
            self.fit.federation, dataloader.split, self.fit.ranks, self.evaluation, cohort,
            self._segment_evaluation(trainer), population,
        )  # fmt: skip

    def _segment_evaluation(self, trainer: pl.Trainer) -> Any:
        """The factory of vectorized evaluation epochs, or None."""
        return segment_evaluation.factory(
            self.config.vectorize_evaluation, self.lightning_module, self.fit.plugins.callbacks
        )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Locate the batch in the round; at a client's (or chunk's) first batch, start it."""
        super().on_train_batch_start(batch, batch_idx)
        plan = self.engine.current_round
        if plan.chunks is not None:
            chunk, step = plan.steps.locate(batch_idx)
            self.vectorized.current = (chunk, step)
            self._idle = True  # Lightning's optimizer step: the chunk trains in training_step
            if step == 0 and chunk < len(plan.chunks):
                self.vectorized.start_chunk(chunk)
            return
        pos, step = plan.schedule.locate(batch_idx)
        self.engine.current_client = (pos, step)
        self._idle = plan.is_padding(pos)
        if step == 0 and not self._idle:
            self.engine.start_client(pos)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's step, except on idle batches: a zero loss tied to no parameter, so the
        optimizer step that follows finds no gradient and changes nothing. With vectorized
        clients, the chunk's step runs here and Lightning's optimizer step is idle too."""
        plan, current = self.engine.current_round, self.vectorized.current
        if plan is not None and plan.chunks is not None and current is not None:
            if current[0] < len(plan.chunks):
                try:
                    self.vectorized.train_step(args[0] if args else kwargs["batch"])
                except StopIteration as err:  # Lightning would end the epoch silently
                    raise RuntimeError("a vectorized step raised StopIteration") from err
            return torch.zeros((), device=self.root_device, requires_grad=True)
        client = self.engine.current_client
        if client is not None and plan.is_padding(client[0]):
            return torch.zeros((), device=self.root_device, requires_grad=True)
        return super().training_step(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step, except on idle steps (a rank's padding, or a
        vectorized step, which trains the clients itself): only the closure runs
        (training_step), with no clipping or ``on_before_optimizer_step`` on the module's
        gradient-less parameters."""
        if self._idle and self.lightning_module.trainer.training:
            return closure()
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
        if self.config.silos and silo_checkpoints.DRIVER_KEY in checkpoint.get("callbacks", {}):
            shard = silo_checkpoints.split_off_shard(checkpoint, self.global_rank, self.world_size)
            path = silo_checkpoints.shard_path(filepath, self.global_rank, self.world_size)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            torch.save(shard, path)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's removal (rank 0); in silo mode every rank removes its shard."""
        if self.config.silos:
            path = silo_checkpoints.shard_path(filepath, self.global_rank, self.world_size)
            if os.path.exists(path):
                os.remove(path)
        super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """Lightning's loading, with errors that name the file; in silo mode each rank
        adds its own shard (:mod:`lightning_fl.engine.silo_checkpoints`). A resumed fit
        then keeps the checkpoint's run folder (:meth:`RoundDriver.adopt_run_folder`)."""
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except FileNotFoundError:
            raise
        except Exception as err:  # noqa: BLE001 - torch raises several types for bad files
            raise CheckpointReadError.of(checkpoint_path, err) from err
        if self.config.silos:
            checkpoint = silo_checkpoints.merge_shard(
                checkpoint, checkpoint_path, self.global_rank, self.world_size
            )
        else:
            silo_checkpoints.check_not_sharded(checkpoint, checkpoint_path)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            driver = next(cb for cb in trainer.callbacks if isinstance(cb, RoundDriver))
            driver.adopt_run_folder(trainer, checkpoint_path, checkpoint)
        return checkpoint


def _restarted_worker_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """Under torchrun, the workers' process group meets in the agent's store, which
    outlives a restart: the keys of the failed attempt's group (every rank's address) are
    still there, and a restarted worker would read a dead rank's address ("Connection
    refused"). This attempt's keys get a prefix of its own (``TORCHELASTIC_RESTART_COUNT``);
    None outside a restarted torchrun worker."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=False, timeout=timeout,
    )  # fmt: skip
    return dist.PrefixStore(f"/lightning_fl/attempt_{attempt}", agent)


def _check_threads_and_data(num_threads: Any, data_on_device: Any) -> None:
    if num_threads not in (None, "auto") and not (
        isinstance(num_threads, int) and num_threads >= 1
    ):
        raise ValueError(f"num_threads must be 'auto', None or an int >= 1, got {num_threads!r}.")
    if data_on_device not in (True, False, "auto"):
        raise ValueError(f"data_on_device must be True, False or 'auto', got {data_on_device!r}.")


def _check_trainer(trainer: pl.Trainer) -> None:
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            "FederatedStrategy needs accumulate_grad_batches=1: client boundaries must "
            "fall on optimizer steps. Raise the datamodule's batch_size instead."
        )
    if not isinstance(trainer.datamodule, FederatedDataModule):
        raise TypeError(
            "FederatedStrategy needs a lightning_fl.datamodules.FederatedDataModule: "
            "call trainer.fit(model, datamodule=...)."
        )
