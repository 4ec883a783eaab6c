"""The plugin contract: what the engine calls and what a plugin may read.

- :class:`RoundState`: what the hooks of one round see (θ^t, the weighted update sum, the
  participants and their weights, the client store, the round's sample counts and local
  steps);
- :class:`FederatedCallback`: a Lightning ``Callback`` plus the round hooks the engine
  calls, and the capability flags the engine and the composition check read
  (``supports_vectorized_clients``, ``requires_task_loss``, ``replaces_gradient``, ...;
  ``keeps_client_state`` and ``client_state_in_store`` derived from the declarations);
- :class:`Aggregator`: the one callback that writes θ^{t+1}, and :class:`FedAvg`, the
  default one;
- the pseudo-clients :data:`POOLED_CLIENT` and :data:`SERVER_CLIENT`.

The engine imports this module and never the plugins of ``lightning_fl.callbacks``; users
import these names from ``lightning_fl.callbacks`` (or ``lightning_fl``), as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple, Protocol

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_fl.checks import require_rate
from lightning_fl.engine.client_store import ClientStore
from lightning_fl.engine.tensors import TensorList, flatten, unflatten, zeros_like
from lightning_fl.engine.traits import Trait, Traits, traits_of_class  # noqa: F401 (Trait: re-exported)
from lightning_fl.systems.samplers import ClientSampler, Participation

if TYPE_CHECKING:
    from lightning_fl.engine.tensors import FederatedTensors


#: The round's ``extra_sums`` entry of one row per participant: its flattened update, then
#: a 1 once it is accepted (a zero update is sent, a dropped one is not). Kept when the
#: sampler (``needs_updates``) or the aggregator (``needs_client_updates``) reads them; each
#: rank fills its own clients' rows and the round's all-reduce gathers them by summing.
CLIENT_UPDATES = "client_updates"


class ChunkView(Protocol):
    """The chunk of vectorized clients training now (``RoundState.chunk``)."""

    #: client ids, one per row
    clients: list[int]
    #: whether every row started from the same model (θ^t)
    shared_start: bool

    @property
    def params(self) -> TensorList:
        """The rows' parameters, stacked (dimension 0: the rows)."""

    @property
    def generators(self) -> list[torch.Generator]:
        """Each row's generator, seeded with (seed, round, client)."""


class StepView(Protocol):
    """The step that trains the chunk (``RoundState.vectorized_step``)."""

    #: the rows' stacked batch of this local step
    batch: Any
    #: each stepped row's generator (DP noise: the sequential path's draws)
    generators: list[torch.Generator]

    def gradients_at(self, chunk: ChunkView, rows: list[int], params: TensorList) -> TensorList:
        """The rows' gradients at ``params``, with the dropout masks the sequential path
        would draw next (a second gradient per local step)."""

    def scale_lr(self, factors: list[float]) -> None:
        """Multiply row i's learning rate by ``factors[i]`` in this chunk's steps."""


class RoundTotal(NamedTuple):
    """A round's sums added over the ranks (``total``) and the ranks whose part is not in
    it (``missing``: sites that dropped, on a transport that lets them)."""

    total: torch.Tensor
    missing: frozenset[int] = frozenset()


@dataclass
class RoundState:
    """What the hooks of one round see.

    ``global_tensors`` is θ^t (parameters first, then floating buffers; the first
    ``num_params`` entries are parameters). ``update_sum`` accumulates Σ_i ω_i Δ_i over
    the accepted client updates Δ_i = θ_i^{t+1} − θ^t.

    θ^t is not always the model a client starts from: the aggregator's ``on_client_start``
    may load another (AsynchronousFL the stale θ^ρ the client was sent, ClusteredFL its
    cluster's, Local and GossipAveraging the client's own). A callback that needs the
    client's starting model (FedProx's and Ditto's anchors) reads the module in its own
    ``on_client_start``, which runs after the aggregator's. Such an aggregator's
    ``transform_update`` turns the strategy's θ_i − θ^t into the client's own update
    θ_i − θ_i^start, which is what every later ``transform_update`` and ``on_client_end``
    receives (SCAFFOLD's control variate reads it).
    """

    round_idx: int
    participation: Participation
    global_tensors: TensorList
    update_sum: TensorList
    model: FederatedTensors
    store: ClientStore
    num_clients: int
    #: every client's training sample count (the federation's read-only int64 array)
    sample_counts: np.ndarray
    target_weights: torch.Tensor
    #: Other per-round sums that must be added over all ranks with the updates (one
    #: all-reduce per round), registered by callbacks in ``on_round_start``.
    extra_sums: dict[str, TensorList] = field(default_factory=dict)
    accepted: list[int] = field(default_factory=list)
    #: This rank's participants whose update was dropped (NaN/Inf).
    dropped: list[int] = field(default_factory=list)
    #: Dropped updates of every rank, set at the round's end (``fl/dropped_updates``).
    dropped_count: int = 0
    #: Local optimizer steps each of this rank's participants takes this round (K, or
    #: E passes over its batches).
    local_steps: dict[int, int] = field(default_factory=dict)
    #: Vectorized clients, in their hooks: the chunk training now (``clients`` by row,
    #: their starting ``params``, ``generators``, ``shared_start``) and the step that
    #: trains it (its ``optimizer`` and ``lr_scale``, the stacked ``batch``,
    #: ``gradients_at``); the last chunk's after it.
    chunk: ChunkView | None = field(default=None, init=False, repr=False, compare=False)
    vectorized_step: StepView | None = field(default=None, init=False, repr=False, compare=False)
    _rows: dict[int, int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_params(self) -> int:
        return self.model.num_params

    @property
    def global_params(self) -> TensorList:
        return self.global_tensors[: self.num_params]

    def scale_local_lr(self, factors: Sequence[float]) -> None:
        """Vectorized clients, in ``on_vectorized_clients_start``: multiply the local
        learning rate of the chunk's row i by ``factors[i]`` in its optimizer steps (gossip's
        T·n_t/n), as a sequential client's optimizer hook would."""
        if self.vectorized_step is None:
            raise RuntimeError("scale_local_lr is for vectorized clients' chunks only.")
        self.vectorized_step.scale_lr([float(f) for f in factors])

    def round_sum(self, plugin: FederatedCallback, name: str) -> TensorList:
        """``plugin``'s declared round sum ``name`` (:meth:`FederatedCallback.add_round_sum`)."""
        return self.extra_sums[plugin.round_sum_key(name)]

    def round_rows(self, plugin: FederatedCallback, name: str) -> torch.Tensor:
        """``plugin``'s declared per-participant rows ``name``
        (:meth:`FederatedCallback.add_round_rows`): row :meth:`row_of` is the client's."""
        return self.extra_sums[plugin.round_sum_key(name)][0]

    def weight_of(self, client: int) -> float:
        """ω of ``client`` (its first draw, for a client drawn several times)."""
        return self.participation.weights[self.row_of(client)]

    def row_of(self, client: int) -> int:
        """The position of ``client``'s first draw in the participation."""
        return self._first_rows()[client]

    def rows_of(self, clients: list[int]) -> list[int]:
        """:meth:`row_of` of each of ``clients``."""
        rows = self._first_rows()
        return [rows[c] for c in clients]

    def weights_of(self, clients: list[int]) -> list[float]:
        """:meth:`weight_of` of each of ``clients``."""
        weights = self.participation.weights
        return [weights[row] for row in self.rows_of(clients)]

    def received_updates(self) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
        """The accepted participants of every rank (in participation order), their updates
        as the rows of a (k × d) tensor (flattened as
        :func:`~lightning_fl.engine.tensors.flatten` does) and their weights ω_i; after
        the round's all-reduce, when the aggregator has ``needs_client_updates``."""
        rows = self.extra_sums[CLIENT_UPDATES][0]
        sent = torch.nonzero(rows[:, -1]).flatten()
        clients = tuple(self.participation.clients[i] for i in sent.tolist())
        weights = torch.tensor(self.participation.weights, dtype=torch.float64,
                               device=rows.device)[sent]  # fmt: skip
        return clients, rows[sent, :-1], weights

    def _first_rows(self) -> dict[int, int]:
        if self._rows is None:
            self._rows = {}
            for row, c in enumerate(self.participation.clients):
                self._rows.setdefault(c, row)
        return self._rows


class EvaluationView(Protocol):
    """What a plugin may ask of the per-client evaluation in progress
    (``PluginView.evaluation``)."""

    @property
    def personalizes(self) -> bool:
        """Whether clients are evaluated with personalized models (the global model is
        restored after each)."""

    def end_client(self) -> None:
        """Close the open client: its metrics, ``on_client_evaluation_end``, the global
        model restored (nothing when no client is open)."""


@dataclass(frozen=True)
class PluginView:
    """What a plugin reads of its fit outside a round's state (the evaluation hooks, the
    fit's start and end), given to every federated callback at the strategy's set-up as
    ``self.view`` (read-only: the engine owns each value)."""

    #: per-client state of the clients this rank owns (:class:`ClientStore`)
    store: ClientStore
    #: every client's training sample count (the federation's read-only int64 array)
    sample_counts: np.ndarray
    #: the module's parameters and floating buffers, as the flat list the rounds move
    tensors: FederatedTensors
    #: the strategy's federated settings (``seed``, ``local_steps``, ...)
    config: Any
    #: the fit's one aggregator (its target weights p_i, its server step size)
    aggregator: Aggregator
    #: the recipe's site names in rank order (``FederatedStrategy(silos=[...])``), or None
    site_names: tuple[str, ...] | None = None
    #: the per-client evaluation (membership inference asks whether it personalizes, and
    #: closes the open client before its report)
    evaluation: EvaluationView | None = None


class FederatedCallback(pl.Callback):
    """Base class of the algorithms that plug into a round. Every hook is optional.

    Hooks read the round through the :class:`RoundState` they receive, and the rest of
    the fit through ``self.view`` (a :class:`PluginView`, set at the strategy's set-up)."""

    #: the fit's read-only view, set at the strategy's set-up (None before)
    view: PluginView | None = None
    #: What it does that the composition rules read (:mod:`lightning_fl.engine.traits`):
    #: ``{Trait.X: fix}``, inherited, ``None`` withdrawing a base's; settings add more
    #: with :meth:`add_trait`.
    traits: ClassVar[Traits] = {}

    #: An observer only measures the model in the client evaluation hooks (membership
    #: inference): it runs first there, seeing the global model at the start and the
    #: personalized one at the end, and does not make the strategy keep a global copy.
    evaluation_observer: bool = False
    #: Whether the callback works with ``FederatedStrategy(vectorize=True)``, where a
    #: round's clients train together: per-client hooks run as usual, and per-step work
    #: goes in :meth:`on_before_vectorized_optimizer_step`. Unsupported callbacks are
    #: refused at setup.
    supports_vectorized_clients: bool = False
    #: Why a callback that does not support vectorized clients cannot: the refusal at
    #: setup says it.
    not_vectorized_because: str = ""
    #: Per-client state the callback keeps between rounds without declaring it
    #: (:meth:`add_client_state`), an explicit opt-in: ``"store"`` (all of it in the client
    #: store, under keys it writes itself, read when a client starts and written when it
    #: ends: it moves with the client, as declared state does) or ``"owner"`` (some of it
    #: in the callback itself: each client trains on the rank that owns it). None: the
    #: callback keeps no per-client state but what it declares.
    undeclared_client_state: Literal["store", "owner"] | None = None
    #: Whether the callback computes the module's loss outside ``training_step`` (local
    #: training of a personal model, evaluation on training data) through its
    #: ``loss_and_metrics(batch)``; a module without it is refused at setup.
    requires_task_loss: bool = False
    #: The module's methods the callback calls besides Lightning's hooks and
    #: ``loss_and_metrics``, as signatures (``"criterion(logits, target) -> loss"``);
    #: checked at setup and listed in the README's plugin table.
    module_methods: tuple[str, ...] = ()
    #: The module class the callback needs, by name (``"MixtureClassifier"``), if any.
    module_type: str | None = None
    #: Whether the callback replaces the batch's gradient in ``on_before_optimizer_step``
    #: (DP-SGD's clipped and noised gradient). The strategy runs such callbacks' hooks
    #: before the others', so that terms the others add to the gradient (FedProx's
    #: μ(θ − θ^t), SCAFFOLD's c − c_i) are added to the replaced gradient, not lost.
    replaces_gradient: bool = False

    #: Whether, under ``vectorize=True``, the strategy must run this callback's client
    #: hooks (``on_client_start``, ``transform_update``, ``on_client_end``) client by
    #: client. None (default): when it overrides one of them. False: they have no effect
    #: on vectorized clients (FedProx's anchor is read only by its sequential per-step
    #: hook). When no callback needs them, a chunk's clients start and finish together in
    #: O(1) Python calls (``VectorizedClients``), not O(clients).
    vectorized_client_hooks: bool | None = None

    # -- declared state (issue 68), on the model of torchmetrics' ``Metric.add_state`` --

    def add_client_state(
        self, name: str, key: str | None = None, like: Literal["params"] | None = None
    ) -> None:
        """Declare ``name``: a tensor each client that has taken part keeps between rounds
        (SCAFFOLD's c_i), read and written in the client hooks with :meth:`client_state`
        and :meth:`set_client_state`. It lives in the engine's client store under ``key``
        (default ``"<Class>.<name>"``), and from the declaration the engine derives the
        rest: the flags (``keeps_client_state``, ``client_state_in_store``: the entry
        moves to the rank that trains the client and back), its silo shard and its
        checkpoint entries (the store's, participants only).

        ``like="params"``: the state is a list of tensors shaped like the model's
        parameters, zero for a client that has none yet; it is kept flattened (one
        tensor) and handed back as the list.

        >>> class Counts(FederatedCallback):
        ...     def __init__(self):
        ...         self.add_client_state("seen", key="counts_seen")
        >>> plugin = Counts()
        >>> plugin.client_state_in_store, plugin.client_state_key("seen")
        (True, 'counts_seen')
        """
        self._declared_state("client")[name] = key or f"{type(self).__name__}.{name}"
        if like is not None:
            self._declared_state("client like")[name] = _check_like(like)

    @property
    def keeps_client_state(self) -> bool:
        """Whether the callback keeps per-client state between rounds (on the rank that
        owns the client): declared (:meth:`add_client_state`) or opted into
        (:attr:`undeclared_client_state`). Only when no callback does may several
        processes split each round's participants by their steps instead of by owner."""
        return bool(self._declared_state("client")) or self.undeclared_client_state is not None

    @property
    def client_state_in_store(self) -> bool:
        """Whether all of that state lives in the client store, so that a client may
        train on another rank than its owner: the strategy moves its entries there for
        the round and back at the round's end, and several processes still split the
        participants by their steps."""
        return self.keeps_client_state and self.undeclared_client_state != "owner"

    def declared_client_state(self) -> dict[str, str]:
        """The declared client state: name -> its client store key."""
        return dict(self._declared_state("client"))

    def client_state_key(self, name: str) -> str:
        """The client store key of the declared client state ``name``."""
        return self._declared_state("client")[name]

    def client_state(self, store: ClientStore, client: int, name: str) -> Any:
        """``client``'s declared state ``name``, or None before it has one (zeros like the
        parameters, on their device, for state declared ``like="params"``)."""
        stored = store.get(client, self.client_state_key(name))
        if name not in self._declared_state("client like"):
            return stored
        params = self.view.tensors.params
        return zeros_like(params) if stored is None else unflatten(stored, params)

    def set_client_state(self, store: ClientStore, client: int, name: str, value: Any) -> None:
        """Keep ``value`` as ``client``'s declared state ``name`` (a list of tensors,
        flattened, for state declared ``like="params"``)."""
        if name in self._declared_state("client like"):
            value = flatten(value)
        store.set(client, self.client_state_key(name), value)

    def add_round_sum(
        self,
        name: str,
        shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        bound: float | None = None,
    ) -> None:
        """Declare ``name``: a sum over a round's clients that every rank adds to (SCAFFOLD's
        Σ Δc_i, DP-FedAvg's count of clipped updates). The engine creates it at zero before
        ``on_round_start`` (like the model's parameters, or one tensor of ``shape``, in the
        parameters' dtype or ``dtype``, on their device), adds it over the ranks in the
        round's one all-reduce, and the hooks read it with ``state.round_sum(self, name)``.
        ``bound``: the largest magnitude of an entry one client adds, where one is known
        (a count: 1), which a secure sum's fixed range must hold."""
        self._declared_state("sum")[name] = shape
        if dtype is not None:
            self._declared_state("sum_dtype")[name] = dtype
        if bound is not None:
            self._declared_state("sum_bound")[name] = bound

    def round_sum_bound(self, name: str) -> float | None:
        """The declared bound of one client's entries of round sum ``name`` (None: none)."""
        return self._declared_state("sum_bound").get(name)

    def add_round_rows(self, name: str) -> None:
        """Declare ``name``: one row per participant of the round (in participation order,
        ``state.row_of(client)``), each as long as the flattened global tensors (gossip's
        half-step models). The engine creates the rows at zero before ``on_round_start``;
        each rank fills its own clients' rows, and the round's all-reduce adds them, so
        that every rank holds every row after it. Hooks read them with
        ``state.round_rows(self, name)``."""
        self._declared_state("rows")[name] = None

    def declared_round_rows(self) -> list[str]:
        """The declared per-participant rows (:meth:`add_round_rows`)."""
        return list(self._declared_state("rows"))

    def round_sum_dtype(self, name: str) -> torch.dtype | None:
        """The dtype declared for round sum ``name`` (None: the parameters')."""
        return self._declared_state("sum_dtype").get(name)

    def round_sum_key(self, name: str) -> str:
        """The round state's ``extra_sums`` key of the declared round sum (or rows)
        ``name``."""
        return f"{type(self).__name__}.{name}"

    def overridden_hooks(self, hooks: Sequence[str]) -> tuple[str, ...]:
        """The hooks of ``hooks`` that this plugin's class overrides (what it does, read
        from its class rather than from a table of class names)."""
        return tuple(h for h in hooks
                     if getattr(type(self), h) is not getattr(FederatedCallback, h))  # fmt: skip

    def declared_round_sums(self) -> dict[str, tuple[int, ...] | None]:
        """The declared round sums and their shapes (None: like the parameters)."""
        return dict(self._declared_state("sum"))

    def add_server_state(
        self,
        name: str,
        default: Any = None,
        stateful: bool = False,
        like: Literal["params"] | None = None,
    ) -> None:
        """Declare attribute ``name`` (set to ``default`` now) as server state: the
        callback's checkpoint entry, saved by :meth:`state_dict` and restored by
        :meth:`load_state_dict` (SCAFFOLD's c, DP-FedAvg's clip norm).

        ``like="params"``: a list of tensors shaped like the model's parameters, which the
        engine sets to zeros on their device before the first round (unless a checkpoint
        restored it).

        ``stateful``: the attribute holds an object with its own ``state_dict`` and
        ``load_state_dict`` (an asynchronous schedule, a simulated clock): its state is
        saved, and loaded into the object in place. An object the callback builds only at
        set-up (None when the checkpoint is loaded) gets the loaded state from
        :meth:`restore_server_state`, called once it exists.

        >>> class Clocked(FederatedCallback):
        ...     def __init__(self):
        ...         self.add_server_state("rounds", 0)
        ...         self.add_server_state("clock", stateful=True)  # built at set-up
        >>> saved = Clocked()
        >>> saved.rounds, saved.clock = 3, torch.optim.SGD([torch.zeros(1)], lr=0.5)
        >>> resumed = Clocked()
        >>> resumed.load_state_dict(saved.state_dict())
        >>> resumed.rounds, resumed.clock
        (3, None)
        >>> resumed.clock = torch.optim.SGD([torch.zeros(1)], lr=0.1)
        >>> resumed.restore_server_state("clock").param_groups[0]["lr"]
        0.5
        """
        setattr(self, name, default)
        self._declared_state("server")[name] = stateful
        if like is not None:
            self._declared_state("server like")[name] = _check_like(like)

    def declared_server_state(self) -> list[str]:
        """The names of the declared server state (:meth:`add_server_state`)."""
        return list(self._declared_state("server"))

    def server_state_like_params(self) -> list[str]:
        """The declared server state shaped like the parameters (``like="params"``)."""
        return list(self._declared_state("server like"))

    def state_dict(self) -> dict[str, Any]:
        """The declared server state (:meth:`add_server_state`); a stateful object's own
        ``state_dict()``."""
        saved = {}
        for name, stateful in self._declared_state("server").items():
            value = getattr(self, name)
            saved[name] = value.state_dict() if stateful and value is not None else value
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the declared server state; a name missing from ``state_dict`` (a
        checkpoint of an earlier release) keeps its value, and the state of a stateful
        object not built yet waits for :meth:`restore_server_state`."""
        self._restored = True
        for name, stateful in self._declared_state("server").items():
            if name not in state_dict:
                continue
            if not stateful:
                setattr(self, name, state_dict[name])
            elif getattr(self, name) is None:
                self._declared_state("loaded")[name] = state_dict[name]
            elif state_dict[name] is not None:
                getattr(self, name).load_state_dict(state_dict[name])

    @property
    def restored(self) -> bool:
        """Whether a checkpoint's state was loaded into this callback (a resumed fit)."""
        return self.__dict__.get("_restored", False)

    def restore_server_state(self, name: str) -> Any:
        """Stateful server state ``name``, built now, with the state a checkpoint loaded
        before it existed (if any); returns it."""
        loaded = self._declared_state("loaded").pop(name, None)
        if loaded is not None:
            getattr(self, name).load_state_dict(loaded)
        return getattr(self, name)

    def _declared_state(self, kind: str) -> dict[str, Any]:
        """The declarations of one kind ("client", "client like", "sum", "rows", "server",
        "server like", "loaded", "trait"), by name."""
        return self.__dict__.setdefault("_state_declarations", {}).setdefault(kind, {})

    def add_trait(self, trait: str, fix: str) -> None:
        """Declare ``trait`` (a :class:`Trait`), with ``fix``: how a user keeps this plugin
        where a composition rule refuses the trait (a refusal names it).

        >>> class Noisy(FederatedCallback):
        ...     def __init__(self):
        ...         self.add_trait(Trait.DRAWS_SERVER_RANDOMNESS, "Noisy(where='sites')")
        >>> Noisy().declared_traits()
        {'draws server-side randomness': "Noisy(where='sites')"}
        """
        self._declared_state("trait")[trait] = fix

    def declared_traits(self) -> dict[str, str]:
        """The declared traits, each with this plugin's fix: its class's (``traits``) and
        those its settings added (:meth:`add_trait`)."""
        return {**traits_of_class(type(self)), **self._declared_state("trait")}

    def wrap_sampler(self, sampler: ClientSampler) -> ClientSampler:
        """The fit's sampler as this callback needs it: ``sampler`` itself (default), or a
        :class:`~lightning_fl.systems.samplers.SamplerWrapper` around it that changes who
        may be drawn (unlearning's removed clients). Asked once per fit, at set-up, in the
        Trainer's callback order; the strategy's own ``sampler`` is left as given."""
        return sampler

    def on_round_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: RoundState
    ) -> None:
        """After the participants are chosen, before the first client trains."""

    def on_client_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, client: int, state: RoundState
    ) -> None:
        """After the global weights are loaded into the module for ``client`` and, for
        the other callbacks, after the aggregator's ``on_client_start``, which may load the
        model this client starts from instead (see :class:`RoundState`)."""

    def transform_update(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        client: int,
        update: TensorList,
        state: RoundState,
    ) -> TensorList:
        """May change the update a client sends (DP noise, attacks, compression). The
        aggregator's runs first (it makes the update the client's own Δ_i: against its
        cluster's model, its stale model), then the others' in the Trainer's order."""
        return update

    def on_client_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        client: int,
        update: TensorList,
        state: RoundState,
    ) -> None:
        """After an accepted update is folded into ``state.update_sum``."""

    def on_before_round_sum(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: RoundState
    ) -> None:
        """After this rank's last client of the round, before its part of the round's sums
        (``state.update_sum``, the declared round sums) is summed over the ranks: a site
        adds its share of distributed DP noise here."""

    def sum_over_ranks(self, buffer: torch.Tensor, round_idx: int) -> RoundTotal | None:
        """The round's sums (the weighted update sum, the declared round sums, the count
        of dropped updates: one flat ``buffer``) summed over the ranks in place of the
        engine's plain all-reduce, with the ranks whose part is not in it (sites that
        dropped), or None to leave that to the engine (every plugin but
        :class:`~lightning_fl.callbacks.SecureAggregation`)."""
        return None

    def on_round_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: RoundState
    ) -> None:
        """After aggregation; ``state.global_tensors`` holds θ^{t+1}."""

    def on_server_start(self, rounds: int | None) -> None:
        """Flower's server-side mode (:mod:`lightning_fl.flower.server_side`): the server's
        instance, before its first round, where there is no trainer and so no
        :meth:`on_fit_start`; ``rounds`` is the run's number of rounds (``max_epochs``)."""

    def round_metrics(self) -> dict[str, float]:
        """What the plugin reports of the round it just aggregated, by name (DPFedAvg's
        ``dp/epsilon``): it logs them itself in a fit; the server-side mode's server puts
        them in its round's ``MetricRecord``. Default: none."""
        return {}

    def on_vectorized_clients_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        clients: list[int],
        state: RoundState,
    ) -> None:
        """Vectorized clients: before ``clients`` (row i is ``clients[i]``) train together,
        after each one's :meth:`on_client_start`."""

    def vectorized_client_state(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        clients: list[int],
        state: RoundState,
    ) -> list[torch.Tensor] | None:
        """Vectorized clients: per-client tensors the module's loss needs (stacked, row i
        for ``clients[i]``; FedEM's mixture weights), passed through vmap to
        :meth:`vectorized_client_context`. None: nothing."""
        return None

    def vectorized_client_context(
        self, pl_module: pl.LightningModule, tensors: list[torch.Tensor]
    ) -> AbstractContextManager:
        """Inside the vmapped loss: make the module use one client's ``tensors`` (from
        :meth:`vectorized_client_state`) and restore it on exit."""
        return nullcontext()

    def on_before_vectorized_optimizer_step(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        rows: list[int],
        params: TensorList,
        grads: list[torch.Tensor | None],
        state: RoundState,
    ) -> None:
        """Vectorized clients: the counterpart of ``on_before_optimizer_step``. ``params``
        and ``grads`` are stacked over the clients at chunk ``rows`` (dimension 0);
        change ``grads`` in place. A parameter the optimizer does not train, or the loss
        does not use, has no gradient (None) and is not stepped, as on the sequential path;
        a callback that gives it one (DP-SGD's noise) assigns its entry of ``grads``. A
        term that depends on the data reads the rows' stacked batch and per-client
        generators from ``state.vectorized_step`` (``batch``, ``generators``; DP-SGD) and
        the chunk from ``state.chunk``."""

    def on_client_evaluation_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, client: int
    ) -> None:
        """Before ``client``'s held-out batches: load a personalized model here."""

    def on_client_evaluation_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, client: int
    ) -> None:
        """After ``client``'s held-out batches: restore the global model here."""


Weighting = Literal["samples", "uniform"]

#: Client id of the single virtual client of the pooled (centralized) baseline.
POOLED_CLIENT = -1
#: Client id of the server when it trains on its own data (SAFARI's server rounds).
SERVER_CLIENT = -3


class Aggregator(FederatedCallback):
    """The one callback that turns the weighted update sum into the new global model.

    Args:
        weighting: the target weights p_i of the federated objective Σ p_i L_i:
            ``"samples"`` gives p_i = n_i/Σn_j, ``"uniform"`` gives p_i = 1/n over the
            clients that have training data (Fraboni thesis eq. 1.1).
    """

    #: True for the centralized baseline: the strategy trains one client holding all data.
    pools_clients: bool = False
    #: True if a round without participants is still aggregated (an asynchronous server
    #: whose clock moves, DP noise that is added whoever took part); otherwise such a
    #: round is skipped (no server step).
    aggregates_empty_rounds: bool = False
    #: True if :meth:`aggregate` reads every accepted update, not only their weighted sum
    #: (robust aggregation): :meth:`RoundState.received_updates` then holds them.
    needs_client_updates: bool = False

    def __init__(self, weighting: Weighting = "samples") -> None:
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting must be 'samples' or 'uniform', got {weighting!r}.")
        self.weighting = weighting

    def participation(
        self, round_idx: int, seed: int, p: torch.Tensor, sampler: ClientSampler
    ) -> Participation:
        """Who trains in ``round_idx``: the sampler's draw, or the one pooled client of
        the centralized baseline. A pure function of (seed, round) for exact resumes."""
        if self.pools_clients:
            return Participation((POOLED_CLIENT,), (1.0,))
        return sampler.sample(round_idx, seed, p)

    def target_weights(self, sample_counts: Sequence[int] | np.ndarray) -> torch.Tensor:
        """p_i of every client from the training counts n_i (one tensor operation):
        n_i / Σ n_j, or 1/|{j : n_j > 0}| for the clients with data under
        ``weighting="uniform"``.

        >>> FedAvg().target_weights([10, 30, 0, 60]).tolist()
        [0.1, 0.3, 0.0, 0.6]
        >>> uniform = FedAvg(weighting="uniform").target_weights([10, 30, 0, 60])
        >>> [round(w, 4) for w in uniform.tolist()]
        [0.3333, 0.3333, 0.0, 0.3333]
        """
        # host: p is bookkeeping of the sample counts, read by the samplers on the host
        counts = torch.from_numpy(np.array(sample_counts, dtype=np.float64))
        if self.weighting == "uniform":
            counts = (counts > 0).double()
        return counts / counts.sum()

    #: the hooks that act beside the clients, on the rank that trains them
    CLIENT_SIDE_HOOKS = ("on_client_start", "on_client_end", "transform_update",
                         "on_round_start", "on_before_round_sum", "on_round_end")  # fmt: skip

    def client_side_hooks(self) -> tuple[str, ...]:
        """The hooks by which this aggregator, as configured, acts beside its clients (on
        the rank that trains them, before the server receives their updates): where an
        aggregator runs on a server (Flower's server-side mode) its ``transform_update``
        runs on the nodes, and one with any other is refused. Default: every hook of
        :data:`CLIENT_SIDE_HOOKS` its class overrides; an aggregator whose overrides act
        only in some configurations says which."""
        return self.overridden_hooks(self.CLIENT_SIDE_HOOKS)

    def reads_each_update(self) -> bool:
        """Whether this aggregator, as configured, reads each client's update on the
        server (what secure aggregation hides): a robust rule's rows, or a
        :meth:`receive_update` that acts. Default: it needs the rows or its class
        overrides :meth:`receive_update`; one whose override acts only in some
        configurations says which."""
        overrides = type(self).receive_update is not Aggregator.receive_update
        return self.needs_client_updates or overrides

    def receive_update(self, client: int, update: TensorList, state: RoundState) -> TensorList:
        """What the server does with ``client``'s update as it arrives, after every
        callback's :meth:`~FederatedCallback.transform_update` (what the client sent, an
        attack's included) and before it is weighted into the sum: the server-side
        clipping of user-level DP. Default: the update as sent."""
        return update

    def aggregate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: RoundState
    ) -> None:
        """Write θ^{t+1} into ``state.global_tensors`` in place."""
        raise NotImplementedError


class FedAvg(Aggregator):
    """FedAvg (McMahan et al. 2017) in the generalized form θ^{t+1} = θ^t + η_g Δ_t; the
    aggregator of a run that names none.

    With η_g = 1 and Σ ω_i = 1 this is θ^{t+1} = Σ ω_i θ_i^{t+1} (Fraboni thesis Alg. 9).
    """

    supports_vectorized_clients = True

    def __init__(self, weighting: Weighting = "samples", server_lr: float = 1.0) -> None:
        super().__init__(weighting)
        self.server_lr = require_rate("server_lr", server_lr, 1.0)

    @torch.no_grad()
    def aggregate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: RoundState
    ) -> None:
        torch._foreach_add_(state.global_tensors, state.update_sum, alpha=self.server_lr)


def zero_round_sums(
    plugins: Sequence[FederatedCallback], like: TensorList
) -> dict[str, TensorList]:
    """``plugins``' declared round sums at zero, by key: shaped like ``like`` (the
    parameters) where a sum declares no shape, else one tensor of its shape and dtype (the
    parameters' by default), on ``like``'s device."""
    totals: dict[str, TensorList] = {}
    for plugin in plugins:
        for name, shape in plugin.declared_round_sums().items():
            dtype = plugin.round_sum_dtype(name) or like[0].dtype
            totals[plugin.round_sum_key(name)] = zeros_like(like) if shape is None else [
                torch.zeros(shape, dtype=dtype, device=like[0].device)]  # fmt: skip
    return totals


def _check_like(like: str) -> str:
    if like != "params":
        raise ValueError(f"like must be 'params' (or None), got {like!r}.")
    return like
