"""FederatedStrategy: one Lightning epoch is one communication round.

Round t (DESIGN.md, "One round is one Lightning epoch"):
1. the sampler chooses the participants S_t and their weights ω_i from (seed, t);
2. the round's batches are each participant's local batches in turn;
3. at a client's first batch the global weights θ^t are loaded in place, its optimizer
   state is reset (or restored) and the callbacks apply its persistent state; the user's
   ``training_step``, backward and optimizer step run unchanged;
4. after its last optimizer step, its update Δ_i = θ_i − θ^t is folded into Σ ω_i Δ_i;
5. after the last participant, the one aggregator callback writes θ^{t+1};
6. validation and test run client by client.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import pickle
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader

from lightning_fl.callbacks.aggregation import FedAvg
from lightning_fl.callbacks.base import (
    POOLED_CLIENT,
    SERVER_CLIENT,
    Aggregator,
    FederatedCallback,
    RoundState,
)
from lightning_fl.datamodules.base import FederatedDataModule, FederatedLoader
from lightning_fl.engine import composition
from lightning_fl.engine.client_store import ClientStore
from lightning_fl.engine.divergence import DivergenceMonitor
from lightning_fl.engine.evaluation import ClientMetricCapture, summarize, write_client_metrics_csv
from lightning_fl.engine.outputs import append_csv, run_dir
from lightning_fl.engine.rounds import ClientSchedule, EvalRounds, TrainRounds
from lightning_fl.engine.seeding import derive_seed, generator, seed_global_rng
from lightning_fl.engine.tensors import (
    FederatedTensors,
    TensorList,
    all_finite,
    flatten,
    unflatten,
    zeros_like,
)
from lightning_fl.engine.vectorized import (
    ClientChunk,
    StackedOptimizer,
    VectorizationError,
    VectorizedStep,
    check_callback,
    check_module,
    chunk_positions,
)
from lightning_fl.systems.samplers import ClientSampler, FullParticipation, Participation

#: Pseudo-client of the idle batches that give every rank a round of the same length.
PADDING = -2
#: The round sum that carries the participants' updates to a sampler that needs them.
SAMPLER_UPDATES = "sampler_updates"
#: Below this many parameters, ``num_threads="auto"`` uses one CPU thread per process.
SMALL_MODEL_PARAMETERS = 1_000_000


class NonFiniteUpdateError(RuntimeError):
    """Too many consecutive rounds had NaN or Inf client updates."""


class FederationMismatchError(ValueError):
    """A checkpoint is resumed with a federation (clients, sample counts, partition seed)
    other than the one it was made with."""


class CheckpointReadError(RuntimeError):
    """A checkpoint file could not be read (truncated, not a checkpoint, or refused by
    ``weights_only`` loading)."""

    @classmethod
    def of(cls, path: Any, err: BaseException) -> CheckpointReadError:
        """The error for ``path``, whose loading raised ``err``: the file, what is wrong
        and what to do, without torch's advice to load it with ``weights_only=False``."""
        if isinstance(err, pickle.UnpicklingError) or "weights_only" in str(err):
            what = "not a checkpoint, or one holding objects that safe weights_only loading refuses"
        else:
            text = str(err).strip()
            what = text.splitlines()[0] if text else type(err).__name__
            what = what.split(". ")[0]
        return cls(
            f"{path}: cannot be read as a checkpoint ({what}). It may be truncated (an "
            "interrupted save or copy) or not a Lightning checkpoint of this library: "
            "resume from another one, e.g. the previous round's."
        )


@dataclass
class RoundPlan:
    """One round of this rank: its clients in order (``schedule``), their loaders, the
    hooks' state and, with vectorized clients, the chunks of schedule positions that train
    together. ``steps`` is the schedule of Lightning steps: one per client batch, or one
    per chunk step (idle steps for a rank with fewer, as a trailing PADDING entry)."""

    schedule: ClientSchedule
    loaders: list[DataLoader]
    state: RoundState
    steps: ClientSchedule
    chunks: list[tuple[int, ...]] | None = None


class FederatedStrategy(DDPStrategy):
    """Simulates federated rounds, in one process or over several (``devices=N``,
    ``num_nodes``, torchrun, SLURM: Lightning's launchers and ``torch.distributed``).

    The model is never wrapped in DistributedDataParallel. Rank k owns the clients with
    ``client % world_size == k``, trains the round's participants it owns and keeps their
    client state; ranks with fewer local batches get idle batches so that every rank steps
    through rounds of the same length. Each round ends with one all-reduce of the weighted
    update sums (gloo on CPU, NCCL on GPU). With one process no process group is created.

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
            per Lightning step, with ``torch.func`` over stacked client models
            (:mod:`lightning_fl.engine.vectorized`: what a module must satisfy, which optimizers
            and callbacks are supported). Equal to the sequential run to float round-off.
        max_vectorized_clients: with ``vectorize``, train at most this many clients
            together (a round is split into chunks) to bound memory; None: all of this
            rank's participants.
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
        max_vectorized_clients: int | None = None,
        allow_new_federation: bool = False,
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
        if local_steps is not None and local_epochs is not None:
            raise ValueError("Give either local_steps or local_epochs, not both.")
        if local_steps is None and local_epochs is None:
            local_epochs = 1
        for name, value in (("local_steps", local_steps), ("local_epochs", local_epochs)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if max_consecutive_bad_rounds < 1:
            raise ValueError("max_consecutive_bad_rounds must be >= 1.")
        if num_threads not in (None, "auto") and not (
            isinstance(num_threads, int) and num_threads >= 1
        ):
            raise ValueError(
                f"num_threads must be 'auto', None or an int >= 1, got {num_threads!r}."
            )
        if max_vectorized_clients is not None and max_vectorized_clients < 1:
            raise ValueError(
                f"max_vectorized_clients must be >= 1 or None, got {max_vectorized_clients}."
            )
        self.allow_new_federation = allow_new_federation
        self.num_threads = num_threads
        self.vectorize = vectorize
        self.max_vectorized_clients = max_vectorized_clients
        self._vectorized: VectorizedStep | None = None
        self._chunk: ClientChunk | None = None
        self.current_chunk: tuple[int, int] | None = None  # (chunk, step)
        self._transfer_needed = True  # set at setup: does a hook change batch transfer?
        self._idle = False  # the current training step trains nobody (see optimizer_step)
        self._direct_hooks: dict[str, bool] = {}
        self.sampler = sampler or FullParticipation()
        self.local_steps = local_steps
        self.local_epochs = local_epochs
        self.seed = seed
        self.keep_optimizer_state = keep_optimizer_state
        self.max_consecutive_bad_rounds = max_consecutive_bad_rounds
        self.client_store = ClientStore()
        self.current_round: RoundPlan | None = None
        self.current_client: tuple[int, int] | None = None  # (position, local step)
        self.consecutive_bad_rounds = 0
        self.metric_capture = ClientMetricCapture()
        self.divergence = DivergenceMonitor()
        self._federated_tensors: FederatedTensors | None = None
        self._eval: dict[str, Any] = {}
        self._warned_empty = False
        self._warned_skipped = False
        self._skipped_now = 0
        self._train_counts: list[int] = []

    # ------------------------------------------------------------------ Lightning glue
    @property
    def _single_process(self) -> bool:
        return self.num_nodes * self.num_processes <= 1

    def _configure_launcher(self) -> None:
        if self._single_process:
            self._launcher = None
        else:
            super()._configure_launcher()

    def setup_distributed(self) -> None:
        if self._single_process and not dist.is_initialized():
            self.set_world_ranks()
        else:
            super().setup_distributed()

    def configure_ddp(self) -> None:
        """Never wrap the model in DistributedDataParallel: ranks train different clients."""

    def owner(self, client: int) -> int:
        """The rank that trains ``client`` and keeps its state: a stable assignment."""
        return client % self.world_size

    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        trainer = model.trainer
        if not any(isinstance(cb, _RoundDriver) for cb in trainer.callbacks):
            trainer.callbacks.insert(0, _RoundDriver(self))

        def order(cb: pl.Callback) -> int:  # Lightning runs per-step hooks in list order
            if isinstance(cb, _RoundDriver):
                return 0
            return 1 if getattr(cb, "replaces_gradient", False) else 2

        trainer.callbacks.sort(key=order)  # stable
        for i, cb in enumerate(trainer.callbacks):
            if type(cb) is TQDMProgressBar:
                from lightning_fl.engine.progress import FederatedProgressBar

                trainer.callbacks[i] = FederatedProgressBar(
                    refresh_rate=cb.refresh_rate, leave=cb._leave
                )

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
        self._transfer_needed = _overrides_transfer(self.lightning_module)
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
        self._federated_tensors = FederatedTensors(self.lightning_module)
        aggregator = self.aggregator  # validates the callbacks early
        composition.check(self, trainer)
        if fitting:
            counts = self._train_counts = self._training_counts()  # once per fit, not per round
            if not aggregator.pools_clients:
                self.sampler.check(sum(1 for n in counts if n > 0))
        if fitting:
            self._direct_hooks = self._find_direct_hooks(trainer)
        if fitting and self.vectorize:
            self._setup_vectorized(trainer)
        if self._datamodule().num_clients < self.world_size:
            raise ValueError(
                f"{self.world_size} processes but only {self._datamodule().num_clients} "
                "clients: every rank must own at least one client; use fewer devices."
            )

    def _setup_vectorized(self, trainer: pl.Trainer) -> None:
        """Check that the module, optimizer and callbacks can train clients together."""
        module = self.lightning_module
        check_module(module)
        for cb in trainer.callbacks:
            check_callback(cb)
        from lightning.pytorch.plugins.precision import Precision

        if type(self.precision_plugin) is not Precision:
            raise VectorizationError(
                f"vectorize=True runs in 32-bit precision; got "
                f"{type(self.precision_plugin).__name__}. Use Trainer(precision='32-true'), "
                "or vectorize=False."
            )
        if len(trainer.optimizers) != 1:
            raise VectorizationError(
                f"vectorize=True needs exactly one optimizer, got {len(trainer.optimizers)}. "
                "Return one from configure_optimizers, or use vectorize=False."
            )
        tensors = self.federated_tensors
        optimizer = StackedOptimizer(trainer.optimizers[0], tensors.params)
        callbacks = self._ordered_callbacks("on_before_vectorized_optimizer_step")

        def gradient_terms(rows: list[int], params: TensorList, grads: list) -> None:
            state = self.current_round.state
            for cb in callbacks:
                cb.on_before_vectorized_optimizer_step(trainer, module, rows, params, grads, state)

        clip = None
        if trainer.gradient_clip_val:
            algorithm = "value" if trainer.gradient_clip_algorithm == "value" else "norm"
            clip = (float(trainer.gradient_clip_val), algorithm)
        self._vectorized = VectorizedStep(
            module, tensors.param_names, tensors.buffer_names, optimizer, gradient_terms, clip
        )
        dm = self._datamodule()
        dm.set_round(0)  # a stream's caches hold data from the first round on
        with_data = [c for c, n in enumerate(self._train_counts) if n > 0]
        empty = set(dm.clients_without_data_now(with_data))
        first = next((c for c in with_data if c not in empty), None)
        if first is not None and not self.aggregator.pools_clients:
            loader = dm.client_dataloader(
                dm.client_dataset(first, "train"), "train", generator(self.seed, "probe")
            )
            self._vectorized.check_runs(self.batch_to_device(next(iter(loader))))

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
        if not isinstance(dataloader, FederatedLoader):
            return dataloader
        if dataloader.split == "train":
            return TrainRounds(self)
        return EvalRounds(dataloader.datamodule, dataloader.split, self)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        plan = self.current_round
        if plan.chunks is not None:
            chunk, step = plan.steps.locate(batch_idx)
            self.current_chunk = (chunk, step)
            self._idle = True  # Lightning's optimizer step: the chunk trains in training_step
            if step == 0 and chunk < len(plan.chunks):
                self.start_chunk(chunk)
            return
        pos, step = plan.schedule.locate(batch_idx)
        self.current_client = (pos, step)
        self._idle = self._is_padding(pos)
        if step == 0 and not self._idle:
            self.start_client(pos)

    def _is_padding(self, pos: int) -> bool:
        return self.current_round.schedule.clients[pos] == PADDING

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's step, except on idle batches: a zero loss tied to no parameter, so the
        optimizer step that follows finds no gradient and changes nothing. With vectorized
        clients, the chunk's step runs here and Lightning's optimizer step is idle too."""
        plan = self.current_round
        if plan is not None and plan.chunks is not None and self.current_chunk is not None:
            if self.current_chunk[0] < len(plan.chunks):
                try:
                    self._vectorized_step(args[0] if args else kwargs["batch"])
                except StopIteration as err:  # Lightning would end the epoch silently
                    raise RuntimeError("a vectorized step raised StopIteration") from err
            return torch.zeros((), device=self.root_device, requires_grad=True)
        if self.current_client is not None and self._is_padding(self.current_client[0]):
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

    def _find_direct_hooks(self, trainer: pl.Trainer) -> dict[str, bool]:
        """Which of Lightning's per-step paths may skip their hook dispatch: those whose
        hooks no callback and not the module override, with the plain 32-bit precision
        (and, for the optimizer step, no gradient clipping). The dispatch of a dozen empty
        hooks costs more per step than a small model's arithmetic; skipping it changes
        nothing else."""
        from lightning.pytorch.plugins.precision import Precision

        module = self.lightning_module
        plain = type(self.precision_plugin) is Precision and module.automatic_optimization

        def untouched(module_hooks: tuple[str, ...], callback_hooks: tuple[str, ...]) -> bool:
            if any(getattr(type(module), h) is not getattr(pl.LightningModule, h)
                   for h in module_hooks):  # fmt: skip
                return False
            return not any(
                getattr(type(cb), h) is not getattr(pl.Callback, h)
                for cb in trainer.callbacks
                for h in callback_hooks
            )

        no_clipping = not trainer.gradient_clip_val
        return {
            "backward": plain
            and untouched(
                ("on_before_backward", "backward", "on_after_backward"),
                ("on_before_backward", "on_after_backward"),
            ),
            "optimizer_step": plain
            and no_clipping
            and untouched(
                ("on_before_optimizer_step", "configure_gradient_clipping"),
                ("on_before_optimizer_step",),
            ),
        }

    def _vectorized_step(self, batch: dict[str, Any]) -> None:
        """One local step of the chunk's clients that still have batches."""
        losses, metrics, sizes = self._vectorized(self._chunk, batch["rows"], batch["batches"])
        self.lightning_module._log_vectorized_training_step(losses, metrics, sizes)
        self.divergence.observe(losses)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._client_eval_step(super().validation_step, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._client_eval_step(super().test_step, args, kwargs)

    def _client_eval_step(self, step: Any, args: tuple, kwargs: dict) -> Any:
        batch_idx = _batch_idx(args, kwargs)
        self._switch_eval_client(batch_idx)
        output = step(*args, **kwargs)
        if batch_idx == self._eval["schedule"].total - 1:
            # Close the last client now: Lightning syncs (in place) the logged sums over
            # ranks before the epoch-end hooks run.
            self.end_client_evaluation()
        return output

    # ------------------------------------------------------------------ rounds
    def _datamodule(self) -> FederatedDataModule:
        return self.lightning_module.trainer.datamodule

    @property
    def training_counts(self) -> list[int]:
        """Training samples per client in this fit (unseen clients count 0)."""
        return list(self._train_counts)

    def _training_counts(self) -> list[int]:
        """Training samples per client; unseen (held-out) clients count 0."""
        dm = self._datamodule()
        counts = dm.sample_counts("train")
        for c in dm.unseen_clients:
            counts[c] = 0
        if sum(counts) == 0:
            raise ValueError(
                "Every client has an empty training set: there is nothing to train on. "
                "Check the datamodule's split fractions and data path."
            )
        return counts

    def begin_round(self, round_idx: int) -> RoundPlan:
        """Choose the participants of ``round_idx`` and build their loaders."""
        dm = self._datamodule()
        dm.set_round(round_idx)
        counts = self._train_counts
        unseen = set(dm.unseen_clients)
        empty = [c for c, n in enumerate(counts) if n == 0 and c not in unseen]
        if empty and not self._warned_empty:
            self._warned_empty = True
            warnings.warn(
                f"Skipping {len(empty)} client(s) with no training data: {empty[:10]}"
                + ("..." if len(empty) > 10 else ""),
                stacklevel=2,
            )
        aggregator = self.aggregator
        p = aggregator.target_weights(counts)
        if self.sampler.needs_losses:
            self.sampler.losses = lambda clients: self._probe_losses(clients, round_idx)
        participation = aggregator.participation(round_idx, self.seed, p, self.sampler)
        participation = self._skip_clients_without_data(dm, participation, round_idx)

        def make_loader(c: int) -> DataLoader:
            if c == POOLED_CLIENT:
                ds = dm.pooled_dataset("train")
            elif c == SERVER_CLIENT:
                ds = dm.server_dataset()
            else:
                ds = dm.client_dataset(c, "train")
            return dm.client_dataloader(ds, "train", generator(self.seed, "data", round_idx, c))

        # Only this rank's participants need loaders, unless local_epochs makes the other
        # ranks' batch counts depend on their loaders' lengths.
        mine = [i for i, c in enumerate(participation.clients) if self.owner(c) == self.global_rank]
        needed = mine if self.local_steps is not None else range(len(participation.clients))
        built = {i: make_loader(participation.clients[i]) for i in needed}

        def num_batches(i: int) -> int:
            if participation.clients[i] == SERVER_CLIENT:
                return 1  # the server's round is one SGD step (SAFARI, Alg. 1 line 10)
            if self.local_steps is not None:
                return self.local_steps
            return self._num_batches(built[i])

        batches = [num_batches(i) for i in range(len(participation.clients))]
        per_rank: list[list[int]] = [[] for _ in range(self.world_size)]
        for c, n in zip(participation.clients, batches):
            per_rank[self.owner(c)].append(n)
        local_clients = [participation.clients[i] for i in mine]
        local_batches = [batches[i] for i in mine]
        loaders = [built[i] for i in mine]
        chunks = None
        if self.vectorize:
            chunks = chunk_positions(range(len(mine)), self.max_vectorized_clients)
            steps = [max(local_batches[p] for p in chunk) for chunk in chunks]
            step_counts = [self._chunked_steps(counts) for counts in per_rank]
            step_ids = list(range(len(chunks)))
            if max(step_counts) > sum(steps):
                step_ids.append(PADDING)
                steps.append(max(step_counts) - sum(steps))
            step_schedule = ClientSchedule(tuple(step_ids), tuple(steps))
        elif max(map(sum, per_rank)) > sum(local_batches):
            local_clients.append(PADDING)
            local_batches.append(max(map(sum, per_rank)) - sum(local_batches))
        model = self.federated_tensors
        global_tensors = model.clone()
        state = RoundState(
            round_idx=round_idx,
            participation=participation,
            global_tensors=global_tensors,
            update_sum=zeros_like(global_tensors),
            model=model,
            store=self.client_store,
            num_clients=dm.num_clients,
            sample_counts=counts,
            target_weights=p,
            local_steps={c: n for c, n in zip(local_clients, local_batches) if c != PADDING},
        )
        if self.sampler.needs_updates:  # rows of every rank, summed by the round's all-reduce
            size = sum(t.numel() for t in global_tensors)
            rows = torch.zeros(len(participation.clients), size, device=self.root_device)
            state.extra_sums[SAMPLER_UPDATES] = [rows]
        schedule = ClientSchedule(tuple(local_clients), tuple(local_batches))
        if chunks is None:
            self.current_round = RoundPlan(schedule, loaders, state, steps=schedule)
        else:
            self.current_round = RoundPlan(schedule, loaders, state, step_schedule, chunks)
        self._call("on_round_start", state)
        if not participation.clients and aggregator.aggregates_empty_rounds:
            self.end_round()  # nothing to train: the aggregation still happens (its clock)
        return self.current_round

    def _skip_clients_without_data(
        self, dm: FederatedDataModule, participation: Participation, round_idx: int
    ) -> Participation:
        """Drop the participants with no training data this round (a stream client outside
        its window): their update counts as zero, the others' weights are kept (the
        data-streams analysis's convention for absent clients). Counted in
        ``fl/skipped_empty``; the first time, a warning names them."""
        empty = set(dm.clients_without_data_now(participation.clients))
        self._skipped_now = len(empty)
        if not empty:
            return participation
        if not self._warned_skipped:
            self._warned_skipped = True
            warnings.warn(
                f"Round {round_idx}: clients {sorted(empty)[:10]} have no training data this "
                "round (outside their arrival window) and are skipped; fl/skipped_empty "
                "counts them every round.",
                stacklevel=2,
            )
        kept = [(c, w) for c, w in zip(participation.clients, participation.weights)
                if c not in empty]  # fmt: skip
        return Participation(tuple(c for c, _ in kept), tuple(w for _, w in kept))

    @torch.no_grad()
    def _probe_losses(self, clients: list[int], round_idx: int) -> list[float]:
        """The current global model's training loss on one batch of each of ``clients``
        (CA-Fed's report from every available client, thesis Alg. 6): each rank computes
        its own clients', summed over ranks. The batch is the first of a loader shuffled
        with (seed, "loss_probe", round, client)."""
        dm, module = self._datamodule(), self.lightning_module
        losses = torch.zeros(len(clients), dtype=torch.float64, device=self.root_device)
        for i, client in enumerate(clients):
            if self.owner(client) != self.global_rank:
                continue
            loader = dm.client_dataloader(
                dm.client_dataset(client, "train"), "train",
                generator(self.seed, "loss_probe", round_idx, client),
            )  # fmt: skip
            batch = self.batch_to_device(next(iter(loader)))
            losses[i] = float(module.loss_and_metrics(batch)[0])
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(losses)
        return losses.cpu().tolist()

    def _chunked_steps(self, batches: list[int]) -> int:
        """Lightning steps of a rank whose clients have ``batches`` local batches each, with
        vectorized clients: the longest client of every chunk."""
        chunks = chunk_positions(range(len(batches)), self.max_vectorized_clients)
        return sum(max(batches[p] for p in chunk) for chunk in chunks)

    def _num_batches(self, loader: DataLoader) -> int:
        """Batches of ``local_epochs`` passes over a client's loader."""
        try:
            return self.local_epochs * len(loader)
        except TypeError as err:
            raise TypeError(
                "local_epochs needs client loaders with a length; use local_steps for "
                "iterable-style client datasets."
            ) from err

    def start_client(self, pos: int) -> None:
        state = self.current_round.state
        client = self.current_round.schedule.clients[pos]
        self.federated_tensors.load_(state.global_tensors)
        seed_global_rng(derive_seed(self.seed, "client", state.round_idx, client), self.root_device)
        trainer = self.lightning_module.trainer
        for i, optimizer in enumerate(trainer.optimizers):
            optimizer.state.clear()
            saved = (
                self.client_store.get(client, f"optimizer_{i}")
                if self.keep_optimizer_state
                else None
            )
            if saved is not None:
                optimizer.load_state_dict(
                    {"state": saved, "param_groups": optimizer.state_dict()["param_groups"]}
                )
        self._call("on_client_start", client, state)

    def start_chunk(self, index: int) -> None:
        """Vectorized clients: start every client of chunk ``index`` as the sequential path
        does (global weights, seeded RNG, ``on_client_start``), and stack their models."""
        plan, state = self.current_round, self.current_round.state
        positions = plan.chunks[index]
        clients = [plan.schedule.clients[pos] for pos in positions]
        starts, generators, saved = [], [], []
        for pos, client in zip(positions, clients):
            self.start_client(pos)
            starts.append(self.federated_tensors.clone())
            seed = derive_seed(self.seed, "client", state.round_idx, client)
            generators.append(torch.Generator(device=self.root_device).manual_seed(seed))
            kept = self.keep_optimizer_state
            saved.append(self.client_store.get(client, "optimizer_0") if kept else None)
        tensors = self.federated_tensors
        self._chunk = ClientChunk(clients, starts, tensors.num_params, generators)
        self._vectorized.optimizer.reset(self._chunk.params, saved)
        self._call("on_vectorized_clients_start", clients, state)
        trainer, module = self.lightning_module.trainer, self.lightning_module
        contexts, tensors = [], []
        for cb in self._ordered_callbacks("vectorized_client_state"):
            stacked = cb.vectorized_client_state(trainer, module, clients, state)
            if stacked is not None:
                contexts.append(lambda rows, cb=cb: cb.vectorized_client_context(module, rows))
                tensors.append(stacked)
        self._vectorized.client_contexts, self._vectorized.client_state = contexts, tensors

    def finish_chunk(self, index: int) -> None:
        """Vectorized clients: finish every client of chunk ``index`` as the sequential path
        does, its trained model loaded into the module."""
        chunk = self._chunk
        for row, pos in enumerate(self.current_round.chunks[index]):
            self.federated_tensors.load_(chunk.row(row))
            optimizer_state = None
            if self.keep_optimizer_state:
                optimizer_state = [self._vectorized.optimizer.state_of(row)]
            self.finish_client(pos, optimizer_state)
        self._chunk = None

    def finish_client(self, pos: int, optimizer_states: list[dict] | None = None) -> None:
        """Fold the client's update into the weighted sum (after its last optimizer step).
        ``optimizer_states``: the client's optimizer states to keep (default: those of the
        module's optimizers)."""
        state = self.current_round.state
        client = self.current_round.schedule.clients[pos]
        update = self.federated_tensors.minus(state.global_tensors)
        trainer, module = self.lightning_module.trainer, self.lightning_module
        for cb in self.federated_callbacks:
            update = cb.transform_update(trainer, module, client, update, state)
        if not all_finite(update):
            state.dropped.append(client)
            warnings.warn(
                f"Round {state.round_idx}: client {client} sent an update with NaN or Inf; "
                "it is dropped from this round.",
                stacklevel=2,
            )
            return
        torch._foreach_add_(state.update_sum, update, alpha=state.weight_of(client))
        state.accepted.append(client)
        if SAMPLER_UPDATES in state.extra_sums:
            row = state.participation.clients.index(client)
            state.extra_sums[SAMPLER_UPDATES][0][row] = flatten(update)
        if self.keep_optimizer_state:
            if optimizer_states is None:
                optimizer_states = [
                    copy.deepcopy(optimizer.state_dict()["state"])
                    for optimizer in trainer.optimizers
                ]
            for i, optimizer_state in enumerate(optimizer_states):
                self.client_store.set(client, f"optimizer_{i}", optimizer_state)
        self._call("on_client_end", client, update, state)

    def end_round(self) -> RoundState:
        """Aggregate, load θ^{t+1} into the module, and run the round-end hooks."""
        state = self.current_round.state
        dropped = self._all_reduce_round(state)
        self.consecutive_bad_rounds = self.consecutive_bad_rounds + 1 if dropped else 0
        if self.consecutive_bad_rounds >= self.max_consecutive_bad_rounds:
            raise NonFiniteUpdateError(
                f"{self.consecutive_bad_rounds} consecutive rounds had NaN/Inf client updates "
                f"(last: clients {state.dropped}). Lower the learning rate, clip gradients "
                "(Trainer(gradient_clip_val=...)) or check the data; raise "
                "max_consecutive_bad_rounds to tolerate more."
            )
        self.aggregator.aggregate(self.lightning_module.trainer, self.lightning_module, state)
        self.federated_tensors.load_(state.global_tensors)
        if SAMPLER_UPDATES in state.extra_sums:
            rows = state.extra_sums[SAMPLER_UPDATES][0]
            sent = torch.nonzero(rows.any(dim=1)).flatten().tolist()  # not dropped
            clients = tuple(state.participation.clients[i] for i in sent)
            self.sampler.observe(clients, rows[sent], state.num_clients)
        self._call("on_round_end", state)
        return state

    def _all_reduce_round(self, state: RoundState) -> int:
        """Sum the weighted updates, the callbacks' round sums and the number of dropped
        updates over all ranks in one all-reduce; returns the total dropped."""
        if not (dist.is_initialized() and self.world_size > 1):
            return len(state.dropped)
        sums = [state.update_sum, *state.extra_sums.values()]
        dropped = torch.tensor([float(len(state.dropped))], device=self.root_device)
        buffer = torch.cat([flatten(s) for s in sums] + [dropped])
        dist.all_reduce(buffer)
        offset = 0
        for part in sums:
            size = sum(t.numel() for t in part)
            torch._foreach_copy_(part, unflatten(buffer[offset : offset + size], part))
            offset += size
        return int(buffer[-1].item())

    def _call(self, hook: str, *args: Any) -> None:
        """Run ``hook`` on every federated callback, the aggregator first: it decides
        which model a client starts from (a cluster's, a gossip neighbour's, its own).
        Evaluation observers (membership inference) run before everyone in the client
        evaluation hooks: at the start they see the global model, at the end the
        personalized one."""
        trainer, module = self.lightning_module.trainer, self.lightning_module
        for cb in self._ordered_callbacks(hook):
            getattr(cb, hook)(trainer, module, *args)

    def _ordered_callbacks(self, hook: str) -> list[FederatedCallback]:
        """The federated callbacks in the order ``hook`` runs on them (see :meth:`_call`)."""
        evaluation = hook.startswith("on_client_evaluation")

        def order(cb: FederatedCallback) -> int:
            if evaluation and cb.evaluation_observer:
                return 0  # observers see the model before and after personalization
            return 1 if isinstance(cb, Aggregator) else 2

        return sorted(self.federated_callbacks, key=order)  # stable

    # ------------------------------------------------------------------ evaluation
    def begin_evaluation(
        self, schedule: ClientSchedule, sizes: dict[int, int] | None = None
    ) -> None:
        personalizes = any(
            type(cb).on_client_evaluation_start is not FederatedCallback.on_client_evaluation_start
            and not cb.evaluation_observer
            for cb in self.federated_callbacks
        )
        self._eval = {
            "schedule": schedule,
            "open": None,
            "global": self.federated_tensors.clone() if personalizes else None,
            "sizes": sizes or {},
        }
        self.metric_capture.reset()

    def _switch_eval_client(self, batch_idx: int) -> None:
        pos, step = self._eval["schedule"].locate(batch_idx)
        if step == 0:
            self.end_client_evaluation()
            client = self._eval["schedule"].clients[pos]
            self._eval["open"] = client
            self._call("on_client_evaluation_start", client)

    def end_client_evaluation(self) -> None:
        client = self._eval.get("open")
        if client is None:
            return
        trainer = self.lightning_module.trainer
        unseen = client in set(self._datamodule().unseen_clients)
        module = self.lightning_module
        sums = module.pop_evaluation_sums() if hasattr(module, "pop_evaluation_sums") else None
        self.metric_capture.close_client(
            trainer._results, client, exclude=unseen, module_sums=sums,
            num_samples=self._eval["sizes"].get(client),
        )  # fmt: skip
        self._call("on_client_evaluation_end", client)
        if self._eval["global"] is not None:
            self.federated_tensors.load_(self._eval["global"])
        self._eval["open"] = None

    # ------------------------------------------------------------------ checkpoint state
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """Lightning's loading, with errors that name the file."""
        try:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        except FileNotFoundError:
            raise
        except Exception as err:  # noqa: BLE001 - torch raises several types for bad files
            raise CheckpointReadError.of(checkpoint_path, err) from err

    def federated_state_dict(self) -> dict[str, Any]:
        store = self.client_store.state_dict()
        if dist.is_initialized() and self.world_size > 1:  # every rank's clients, in one file
            parts: list[Any] = [None] * self.world_size
            dist.all_gather_object(
                parts, {c: {k: _to_cpu(v) for k, v in e.items()} for c, e in store.items()}
            )
            store = {c: e for part in parts for c, e in part.items()}
        return {
            "round": self.lightning_module.trainer.current_epoch,
            "seed": self.seed,
            "federation": self._federation(),
            "client_store": store,
            "sampler": self.sampler.state_dict(),
            "consecutive_bad_rounds": self.consecutive_bad_rounds,
        }

    def _federation(self) -> dict[str, Any]:
        """What identifies the federation a checkpoint belongs to: the datamodule's class,
        its number of clients, every client's training sample count, and its partition
        seed (the datamodule's ``seed`` hyper-parameter, where it has one)."""
        dm = self._datamodule()
        hparams = getattr(dm, "hparams", {}) or {}
        return {
            "datamodule": type(dm).__name__,
            "num_clients": dm.num_clients,
            "train_counts": self._training_counts(),
            "partition_seed": hparams.get("seed"),
        }

    def _check_federation(self, saved: dict[str, Any] | None) -> None:
        """Refuse to resume a checkpoint of another federation (see ``allow_new_federation``)."""
        if saved is None:
            return
        now = self._federation()
        differ = [k for k in ("datamodule", "num_clients", "partition_seed") if saved[k] != now[k]]
        before, after = saved["train_counts"], now["train_counts"]
        if saved["num_clients"] == now["num_clients"] and before != after:
            changed = [c for c, (a, b) in enumerate(zip(before, after)) if a != b]
            differ.append(f"train_counts (clients {changed[:10]})")
        if not differ:
            return
        said = "; ".join(
            f"{k}: saved {saved[k]!r}, now {now[k]!r}" if k in saved else k for k in differ
        )
        if not self.allow_new_federation:
            raise FederationMismatchError(
                f"The checkpoint was made with another federation ({said}): its client "
                "state, sampler and stream state belong to those clients. Resume with the "
                "datamodule settings it was made with, or pass "
                "FederatedStrategy(allow_new_federation=True) to keep only what fits."
            )
        warnings.warn(
            f"Resuming on another federation ({said}): client state of clients that no "
            "longer exist is dropped (allow_new_federation=True).",
            stacklevel=2,
        )

    def load_federated_state_dict(self, state: dict[str, Any]) -> None:
        self._check_federation(state.get("federation"))
        num_clients = self._datamodule().num_clients
        if state.get("seed", self.seed) != self.seed:
            warnings.warn(
                f"Resuming with seed {self.seed} from a checkpoint made with seed "
                f"{state['seed']}: the resumed run will differ from the original.",
                stacklevel=2,
            )
        self.client_store.load_state_dict(
            {
                c: e
                for c, e in state["client_store"].items()
                if self.owner(int(c)) == self.global_rank and int(c) < num_clients
            }
        )
        self.sampler.load_state_dict(state["sampler"])
        self.consecutive_bad_rounds = state["consecutive_bad_rounds"]


class _RoundDriver(pl.Callback):
    """Installed by FederatedStrategy: finishes clients
    after their last optimizer step, logs round summaries and carries the federated state
    in checkpoints."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.divergence.reset()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        strategy: FederatedStrategy = trainer.strategy
        plan = strategy.current_round
        if plan.chunks is not None:
            chunk, step = plan.steps.locate(batch_idx)
            if step == plan.steps.num_batches[chunk] - 1:
                if chunk < len(plan.chunks):
                    strategy.finish_chunk(chunk)
                if chunk == len(plan.steps.clients) - 1:
                    strategy.end_round()
                    strategy.divergence.end_round(plan.state.round_idx)
            return
        schedule = plan.schedule
        pos, step = strategy.current_client  # located by the strategy's batch start
        padding = strategy._idle
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not padding and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            strategy.divergence.observe(loss)
        if step == schedule.num_batches[pos] - 1:
            if not padding:
                strategy.finish_client(pos)
            if pos == len(schedule.clients) - 1:
                strategy.end_round()
                strategy.divergence.end_round(strategy.current_round.state.round_idx)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = trainer.strategy.current_round.state
        pl_module.log("fl/round", float(state.round_idx), on_epoch=True)
        pl_module.log("fl/participants", float(len(state.participation.clients)), on_epoch=True)
        pl_module.log("fl/dropped_updates", float(len(state.dropped)), on_epoch=True)
        for name, value in trainer.strategy.sampler.round_metrics().items():
            pl_module.log(name, value, on_epoch=True)
        dm = trainer.datamodule
        if type(dm).clients_without_data_now is not FederatedDataModule.clients_without_data_now:
            skipped = float(trainer.strategy._skipped_now)
            pl_module.log("fl/skipped_empty", skipped, on_epoch=True)
        if trainer.is_global_zero and trainer.loggers:
            _append_participation(os.path.join(run_dir(trainer), "participation.csv"), state)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = os.path.join(run_dir(trainer), "participation.csv") if trainer.loggers else None
        if (
            trainer.is_global_zero
            and path is not None
            and os.path.exists(path)
            and importlib.util.find_spec("matplotlib") is not None
        ):
            from lightning_fl.plots import plot_participation

            try:
                plot_participation(path, os.path.join(run_dir(trainer), "participation.png"))
            except ValueError:  # only virtual clients (pooled baseline, server rounds)
                pass

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, pl_module, "test")

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy: FederatedStrategy = trainer.strategy
        strategy.end_client_evaluation()
        if trainer.sanity_checking:
            return
        capture = strategy.metric_capture
        per_client = {k: dict(v) for k, v in capture.per_client.items() if v}
        summed = set(capture.summed_names)
        if dist.is_initialized() and trainer.world_size > 1:
            parts: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(parts, (per_client, summed))
            per_client = {}
            for part, names in parts:
                summed |= names
                for name, values in part.items():
                    per_client.setdefault(name, {}).update(values)
        unseen = set(trainer.datamodule.unseen_clients)
        for name, values in per_client.items():
            groups = {
                name: {c: v for c, v in values.items() if c not in unseen},
                f"{name}/unseen": {c: v for c, v in values.items() if c in unseen},
            }
            for prefix, group in groups.items():
                if not group:
                    continue
                summary = summarize(group, name)
                for key, value in summary.items():
                    # the same on every rank: syncing only averages equal values
                    pl_module.log(f"{prefix}/{key}", value, sync_dist=True)
                if name in summed and prefix == name:
                    # a FederatedTask's metric, summed per client instead of logged every
                    # batch: its epoch value is the seen clients' sample-weighted mean, from
                    # every rank's clients (no count averaging over ranks)
                    pl_module.log(name, summary["weighted"], sync_dist=True, prog_bar=True)
        if per_client and trainer.is_global_zero:
            # no trainer.log_dir here: it is a collective, and only rank 0 writes
            log_dir = run_dir(trainer)
            path = os.path.join(log_dir, "client_metrics.csv")
            write_client_metrics_csv(path, stage, trainer.current_epoch, per_client)
            if stage == "test" and importlib.util.find_spec("matplotlib") is not None:
                from lightning_fl.plots import plot_client_distributions

                for name, values in per_client.items():
                    groups = {
                        "seen": {c: v for c, (v, _) in values.items() if c not in unseen},
                        "unseen": {c: v for c, (v, _) in values.items() if c in unseen},
                    }
                    groups = {k: g for k, g in groups.items() if g}
                    target = os.path.join(log_dir, f"clients_{name}.png")
                    plot_client_distributions(groups, target, metric=name)
        for logger in trainer.loggers if trainer.is_global_zero else []:
            if isinstance(logger, WandbLogger):
                import wandb

                logger.experiment.log(
                    {
                        f"{name}/clients": wandb.Histogram([v for v, _ in values.values()])
                        for name, values in per_client.items()
                    }
                    | {"trainer/global_step": trainer.global_step},
                )

    def __init__(self, strategy: FederatedStrategy) -> None:
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.federated_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.strategy.load_federated_state_dict(state_dict)


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


def _to_cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else value


_TRANSFER_HOOKS = ("transfer_batch_to_device", "on_after_batch_transfer")


def _overrides_transfer(module: pl.LightningModule) -> bool:
    """Whether the module or its datamodule changes how batches reach the device."""
    datamodule = module.trainer.datamodule if module._trainer is not None else None
    pairs = [(module, pl.LightningModule), (datamodule, pl.LightningDataModule)]
    return any(
        getattr(type(obj), hook) is not getattr(base, hook)
        for obj, base in pairs
        if obj is not None
        for hook in _TRANSFER_HOOKS
    )


def _batch_idx(args: tuple, kwargs: dict) -> int:
    return kwargs["batch_idx"] if "batch_idx" in kwargs else args[1]
