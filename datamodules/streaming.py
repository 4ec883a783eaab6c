"""Clients whose training data arrives over rounds (Marfoq et al., "Federated learning for
data streams", AISTATS 2023; Wang, Bian, Xu, "On the local cache update rules in streaming
federated learning"): every round a fresh client receives ``rate`` samples it has never
seen from its stream and updates its cache with a rule (FIFO, current batch, SRSR, DRSR);
historical clients always hold their whole dataset."""

from __future__ import annotations

import warnings
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from lightning_fl.datamodules.in_memory import InMemoryFederatedDataModule
from lightning_fl.engine.data_contract import FederatedDataModule, Split
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.streams import (
    Cache,
    CurrentBatchCache,
    FIFOCache,
    FixedCache,
    SelectiveReplacementCache,
    discrepancy,
)

CacheRule = Literal["current", "fifo", "srsr", "drsr", "lazy"]


def _check_stream(
    historical: int,
    rate: int,
    cache: str,
    capacity: int,
    theta: float,
    rounds: int,
    drift: int,
    drift_concentration: float,
    recycle: bool,
    fresh_rounds: int | None,
) -> None:
    """Refuse settings of :class:`StreamingDataModule` that cannot describe a stream,
    naming the fix."""
    if fresh_rounds is not None and not 1 <= fresh_rounds <= rounds:
        raise ValueError(f"fresh_rounds must be in [1, rounds = {rounds}], got {fresh_rounds}.")
    if drift < 0:
        raise ValueError(f"drift must be >= 0 short-term distributions, got {drift}.")
    if not drift_concentration > 0:
        raise ValueError(f"drift_concentration must be > 0, got {drift_concentration}.")
    if recycle and not drift:
        raise ValueError(
            "recycle applies to drifting streams: set drift (e.g. 10 short-term "
            "distributions) or leave recycle false."
        )
    if rate < 1:
        raise ValueError(f"the arrival rate must be >= 1 sample per round, got {rate}.")
    if capacity < rate:
        raise ValueError(
            f"cache capacity {capacity} is smaller than the batch of {rate} samples a "
            "client receives per round: raise capacity to at least rate."
        )
    if cache not in ("current", "fifo", "srsr", "drsr", "lazy"):
        raise ValueError(f"cache must be current, fifo, srsr, drsr or lazy; got {cache!r}.")
    if historical < 0:
        raise ValueError(f"historical must be >= 0 clients, got {historical}.")
    if cache == "srsr" and not 0 <= theta <= 1:
        raise ValueError(f"SRSR theta must be in [0, 1], got {theta}.")


class StreamingDataModule(FederatedDataModule):
    """A data stream per client over a static federated datamodule.

    Client c's stream is a seeded permutation of ``source``'s training samples of c; at
    round t it receives the next ``rate`` of them (B_m^(t), never seen before) and updates
    its cache of ``capacity`` samples with ``cache``. The first ``historical`` clients are
    historical: their cache is their whole training set, at every round (P1 §5). The
    training dataset of a client is its cache at the current round (set by the strategy
    through :meth:`set_round`); validation and test data are the source's.

    The caches are a deterministic function of (seed, round): they are replayed from
    round 0, so resumed runs and every rank see the same caches, and nothing needs saving.
    When a stream runs out, the client receives nothing new (its cache keeps its content,
    warned once).

    ``sample_counts("train")`` are the samples each client collects over the ``rounds``
    horizon (P1's N_m: the dataset for historical clients, rate·T for fresh ones), so
    that ``weighting="samples"`` gives P1's Uniform weights p_m = n_m.

    Args:
        source: the clients' data (in memory: TensorDatasets are indexed directly).
        historical: the number of historical clients (the first ones).
        rate: b_m, the samples a fresh client receives per round.
        cache: ``"current"`` (C_m = b_m, P1's fresh clients), ``"fifo"``, ``"srsr"``
            (with ``theta``), ``"drsr"`` or ``"lazy"`` (the first batches, kept for good).
        capacity: C_m (default: ``rate``); at least ``rate``.
        theta: SRSR's θ ∈ [0, 1].
        rounds: the horizon T of the counts N_m.
        drift: if > 0, a non-stationary label stream (P2's setting, :func:`drifting_order`)
            with this many short-term label distributions per client; 0: a stationary
            stream (a random order).
        drift_concentration: the Dirichlet concentration α of the short-term label
            distributions u^j ~ Dir(α) (the paper does not give how it draws them; 0.5:
            concentrated, often one class at a time; larger: closer to the client's
            long-term distribution).
        recycle: with ``drift``, a stationary stream over the whole ``rounds`` horizon
            (the cache-rule paper's, whose long-term distribution is the chain's
            stationary law): a class whose samples have all been streamed starts again
            from a new permutation of them, so every round's labels follow the current
            u^j. False: draws of an exhausted class go to the classes that still have
            samples, and the stream ends with the client's data.
        seed: the streams' and caches' seed.
        fresh_rounds: if set, every fresh client is available for this many consecutive
            rounds only (P1's FEMNIST: 1, Shakespeare: 2): its whole training set arrives
            in that many equal parts, one per round, each replacing the last (its cache is
            the current part), starting at a round drawn uniformly in [0, rounds −
            fresh_rounds] from (seed, client); outside its window it has no data and is
            skipped. ``rate``, ``cache`` and ``capacity`` do not apply to such clients.
        full_batch: a client's training loader yields its whole cache as one batch, so
            that each local step is a full-batch gradient step on the cache (P2's local
            training; ``local_steps`` is the number of GD steps). Default: minibatches of
            the source's ``batch_size`` (P1).
    """

    traits = {
        Trait.NEEDS_EVERY_CLIENTS_DATA: "",
        Trait.HAS_NO_SERVER_DATA: "",
        Trait.HAS_NO_SERVER_REFERENCE: "",
    }

    def __init__(
        self,
        source: FederatedDataModule,
        historical: int = 0,
        rate: int = 10,
        cache: CacheRule = "current",
        capacity: int | None = None,
        theta: float = 2 / 3,
        rounds: int = 100,
        drift: int = 0,
        drift_concentration: float = 0.5,
        recycle: bool = False,
        seed: int = 0,
        full_batch: bool = False,
        fresh_rounds: int | None = None,
    ) -> None:
        super().__init__(source.batch_size, source.eval_batch_size)
        capacity = rate if capacity is None else capacity
        _check_stream(historical, rate, cache, capacity, theta, rounds, drift,
                      drift_concentration, recycle, fresh_rounds)  # fmt: skip
        self.full_batch, self.fresh_rounds = full_batch, fresh_rounds
        self.drift_concentration, self.recycle = drift_concentration, recycle
        self.source, self.historical, self.rate = source, historical, rate
        self.cache_rule, self.capacity, self.theta = cache, capacity, theta
        self.rounds, self.seed, self.drift = rounds, seed, drift
        self._round = -1
        self._caches: list[Cache | None] = []
        self._streams: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []
        self._warned = False

    def prepare_data(self) -> None:
        self.source.prepare_data()

    def setup(self, stage: str | None = None) -> None:
        """The source's set-up (its data read), and the check of ``historical`` against
        its number of clients."""
        self.source.setup(stage)
        if self.historical > self.source.num_clients:
            raise ValueError(
                f"historical must be in [0, {self.source.num_clients}], got {self.historical}."
            )

    @property
    def unseen_clients(self) -> list[int]:
        """The source's unseen clients."""
        return self.source.unseen_clients

    @property
    def num_clients(self) -> int:
        return self.source.num_clients

    @property
    def fresh_clients(self) -> list[int]:
        return list(range(self.historical, self.num_clients))

    def _new_cache(self) -> Cache:
        if self.cache_rule == "current":
            return CurrentBatchCache(self.capacity)
        if self.cache_rule == "fifo":
            return FIFOCache(self.capacity)
        if self.cache_rule == "lazy":
            return FixedCache(self.capacity)
        theta = None if self.cache_rule == "drsr" else self.theta
        return SelectiveReplacementCache(self.capacity, theta)

    def _setup_streams(self) -> None:
        self._streams, self._labels, self._caches = [], [], []
        for c in range(self.num_clients):
            data = self.source.client_dataset(c, "train")
            size = 0 if data is None else len(data)
            labels = _labels(data, size)
            rng = np.random.default_rng([self.seed, 7, c])
            # a historical client holds its whole training set: only fresh streams recycle
            length = self.rounds * self.rate if self.recycle and c >= self.historical else None
            order = rng.permutation(size) if not self.drift else drifting_order(
                labels, self.drift, self.rate, rng, self.drift_concentration, length
            )  # fmt: skip
            self._streams.append(order)
            self._labels.append(labels)
            self._caches.append(None if c < self.historical else self._new_cache())
        self._round = -1

    def set_round(self, round_idx: int) -> None:
        if not self._streams or round_idx < self._round:
            self._setup_streams()
        while self._round < round_idx:
            self._round += 1
            for c in self.fresh_clients:
                self._advance(c, self._round)

    def window(self, client: int) -> tuple[int, int]:
        """[first, last + 1) rounds of a fresh client with ``fresh_rounds``."""
        rng = np.random.default_rng([self.seed, 13, client])
        start = int(rng.integers(0, self.rounds - self.fresh_rounds + 1))
        return start, start + self.fresh_rounds

    def _window_ids(self, client: int, round_idx: int) -> np.ndarray:
        start, stop = self.window(client)
        if not start <= round_idx < stop:
            return np.zeros(0, dtype=np.int64)
        return np.array_split(self._streams[client], self.fresh_rounds)[round_idx - start]

    def clients_without_data_now(self, clients) -> list[int]:
        return [c for c in clients if 0 <= c < self.num_clients and len(self.cache_ids(c)) == 0]

    def _advance(self, client: int, round_idx: int) -> None:
        if self.fresh_rounds is not None:
            return  # windowed clients: cache_ids reads the window
        stream = self._streams[client]
        batch = stream[round_idx * self.rate : (round_idx + 1) * self.rate]
        if len(batch) == 0:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"Client {client}'s stream ran out at round {round_idx}: it keeps its "
                    "cache. Lower rate or rounds, or give it more data.",
                    stacklevel=3,
                )
            return
        rng = np.random.default_rng([self.seed, 11, client, round_idx])
        self._caches[client].update(batch, self._labels[client][batch], rng)

    def cache_ids(self, client: int) -> np.ndarray:
        """The indices (into the source's training set of ``client``) in its cache now."""
        if client < self.historical:
            return np.arange(len(self._streams[client]))
        if self.fresh_rounds is not None:
            return self._window_ids(client, max(self._round, 0))
        return self._caches[client].ids

    def client_dataset(self, client: int, split: Split) -> Dataset | None:
        if split != "train":
            return self.source.client_dataset(client, split)
        if not self._streams:
            self.set_round(0)
        data = self.source.client_dataset(client, "train")
        if data is None:
            return None
        ids = torch.from_numpy(np.sort(self.cache_ids(client)))
        if isinstance(data, TensorDataset):
            return TensorDataset(*(t[ids] for t in data.tensors))
        return Subset(data, ids.tolist())

    def training_batch_size(self, dataset: Dataset) -> int:
        if self.full_batch and len(dataset) > 0:
            return len(dataset)  # the whole cache as one batch
        return self.batch_size

    def sample_counts(self, split: Split = "train") -> list[int]:
        if split != "train":
            return self.source.sample_counts(split)
        if not self._streams:
            self._setup_streams()
        return [
            len(s)
            if c < self.historical or self.fresh_rounds is not None
            else min(len(s), self.rate * self.rounds)
            for c, s in enumerate(self._streams)
        ]

    def cache_discrepancy(self, num_classes: int) -> float:
        """ψ_t = Σ_k Σ_r (v_t^{k,r} − π^{k,r})² over the fresh clients, with π^k the label
        distribution of client k's whole stream (P2's long-term distribution)."""
        if self.fresh_rounds is not None:
            raise ValueError("cache_discrepancy needs streaming caches, not fresh_rounds.")
        cached, target = [], []
        for c in self.fresh_clients:
            labels = self._labels[c]
            target.append(np.bincount(labels, minlength=num_classes) / max(len(labels), 1))
            cached.append(self._caches[c].label_distribution(num_classes))
        return discrepancy(np.array(cached), np.array(target)) if cached else 0.0

    def pooled_dataset(self, split: Split = "train") -> Dataset:
        return self.source.pooled_dataset(split)


def _labels(data: Dataset | None, size: int) -> np.ndarray:
    if size == 0 or data is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(data, TensorDataset):
        return data.tensors[-1].long().numpy()
    return np.array([int(data[i][-1]) for i in range(size)], dtype=np.int64)


def drifting_order(
    labels: np.ndarray,
    states: int,
    rate: int,
    rng: np.random.Generator,
    concentration: float = 0.5,
    length: int | None = None,
) -> np.ndarray:
    """A non-stationary label stream (Wang, Bian, Xu §V, which leaves the details open; our
    choices): ``states`` short-term label distributions u^j ~ Dir(α), α =
    ``concentration``, over the client's own classes; a Markov chain over them with
    P(i → j) ∝ exp(−KL(u^i ‖ u^j)) (close distributions follow each other; the chain's
    stationary law gives the long-term distribution π = Σ_j ρ_j u^j); each round draws
    ``rate`` labels from the current u^j and takes, for each, the next unseen sample of
    that class. Returns the samples' order; when a class runs out, its draws go to the
    classes that still have samples. With ``length``: exactly that many samples, every
    label drawn from the current u^j, a class that runs out starting again from a new
    permutation of its samples (a stationary stream of any horizon)."""
    classes = np.unique(labels)
    if len(classes) == 0:
        return np.zeros(0, dtype=np.int64)
    short = rng.dirichlet(np.full(len(classes), concentration), size=states) + 1e-9
    short /= short.sum(axis=1, keepdims=True)
    kl = np.sum(short[:, None, :] * np.log(short[:, None, :] / short[None, :, :]), axis=2)
    transition = np.exp(-kl)
    transition /= transition.sum(axis=1, keepdims=True)
    pools = {int(c): list(rng.permutation(np.flatnonzero(labels == c))) for c in classes}
    order, state = [], int(rng.integers(states))
    while any(pools.values()) if length is None else len(order) < length:
        for cls in rng.choice(classes, size=rate, p=short[state]):
            if length is not None and not pools[int(cls)]:
                pools[int(cls)] = list(rng.permutation(np.flatnonzero(labels == cls)))
            pool = pools[int(cls)] or next((p for p in pools.values() if p), [])
            if pool:
                order.append(pool.pop())
        state = int(rng.choice(states, p=transition[state]))
    return np.asarray(order[:length], dtype=np.int64)


class LogisticStreamsDataModule(InMemoryFederatedDataModule):
    """P1's Synthetic task (App. D.1.1): θ_0 ~ N(0, I_d), client m's θ_m ~ N(θ_0, ε² I_d),
    x ~ U([−1, 1]^d), y ~ Bernoulli(sigmoid(⟨x, θ_m⟩)). The first ``historical`` clients
    hold ``historical_samples`` training samples, the others ``fresh_samples`` (the stream
    a :class:`StreamingDataModule` reveals ``rate`` at a time); every client has
    ``test_samples`` test samples from its own distribution. The paper leaves ε and the
    sizes open (its Table 1 row is garbled): the defaults are ours, and say so.
    """

    def __init__(
        self,
        num_clients: int = 50,
        historical: int = 10,
        dim: int = 20,
        epsilon: float = 1.0,
        historical_samples: int = 200,
        fresh_samples: int = 200,
        test_samples: int = 100,
        seed: int = 0,
        batch_size: int = 32,
    ) -> None:
        if not 0 <= historical <= num_clients:
            raise ValueError(f"historical must be in [0, {num_clients}], got {historical}.")
        if not epsilon >= 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon}.")
        super().__init__(None, batch_size=batch_size)
        self._sizes = (num_clients, historical, historical_samples, fresh_samples, test_samples)
        self._dim, self._epsilon, self._seed = dim, epsilon, seed

    def read_clients(self):
        """Draw θ_0, every client's θ_m and its samples, from ``seed``."""
        num_clients, historical, historical_samples, fresh_samples, test_samples = self._sizes
        dim, epsilon = self._dim, self._epsilon
        g = torch.Generator().manual_seed(self._seed)
        theta0 = torch.randn(dim, generator=g)
        clients = []
        for m in range(num_clients):
            theta = theta0 + epsilon * torch.randn(dim, generator=g)
            size = historical_samples if m < historical else fresh_samples
            x = 2 * torch.rand(size + test_samples, dim, generator=g) - 1
            y = torch.bernoulli(torch.sigmoid(x @ theta), generator=g)
            clients.append({"train": (x[:size], y[:size]), "test": (x[size:], y[size:])})
        return clients, None
