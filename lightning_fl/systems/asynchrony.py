"""Asynchronous FL on a simulated clock (Fraboni, Vidal, Kameni, Lorenzi, JMLR 2023;
Fraboni thesis ch. 4).

Client i needs time T_i for its local work and upload (:class:`ClientTimes`). A schedule
decides when the server aggregates and whose updates it then holds (thesis Alg. 4):

- :class:`SyncSchedule`: synchronous FedAvg, Δt = max_i T_i;
- :class:`AsyncSchedule`: aggregate each time one client returns;
- :class:`FedFixSchedule`: aggregate every fixed Δt with everything received since;
- :class:`FedBuffSchedule`: aggregate once c clients have returned (Nguyen et al. 2022).

A schedule is a plain seeded object whose state (each client's return time, the model
version ρ_i it trains from, the clock) is saved in checkpoints. :meth:`plan` names the next
aggregation without changing anything; :meth:`commit` applies it. Times are in the unit of
T_i (the thesis's "time units").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import numpy as np

from lightning_fl.engine.seeding import derive_seed

Restart = Literal["at_aggregation", "on_send"]


def exact(value: float | int | str | Fraction) -> Fraction:
    """A time as an exact rational: a float is read as the decimal it prints as (0.1 is
    1/10), so that times given in decimals add up exactly (0.1 + 0.2 == 0.3)."""
    if isinstance(value, Fraction):
        return value
    return Fraction(repr(float(value))) if isinstance(value, float) else Fraction(value)


class ClientTimes:
    """T_i, the time client i needs to compute and send its update.

    Args:
        heterogeneity: X of the thesis's time scenario "FX" (§4.5.1; the authors'
            ``get_tau_i``): τ_i = 1 − i·(X/100)/(M − 1), so F0 is identical hardware and
            F80 makes the fastest client 5× faster than the slowest. Ignored if ``times``
            is given.
        times: the mean time τ_i of every client, instead of a scenario.
        distribution: ``"fixed"`` (T_i = τ_i, the thesis's experiments) or
            ``"exponential"`` (T_i ~ Exp with mean τ_i, drawn anew each time a client
            starts, seeded by (seed, client, start count)).
    """

    def __init__(
        self,
        heterogeneity: float = 0.0,
        times: Sequence[float] | None = None,
        distribution: Literal["fixed", "exponential"] = "fixed",
    ) -> None:
        if not 0.0 <= heterogeneity < 100.0:
            raise ValueError(
                f"heterogeneity X must be in [0, 100) (F0 … F99), got {heterogeneity}: at 100 "
                "the fastest client would need no time."
            )
        if distribution not in ("fixed", "exponential"):
            raise ValueError(
                f"distribution must be 'fixed' or 'exponential', got {distribution!r}."
            )
        if times is not None:
            bad = [t for t in times if not (isinstance(t, (int, float)) and t > 0)]
            if bad or not len(times):
                raise ValueError(
                    f"times must be positive, one per client; got {list(times)[:5]}: give every "
                    "client a time > 0."
                )
        self.heterogeneity, self.distribution = heterogeneity, distribution
        self.times = None if times is None else [float(t) for t in times]

    def exact_means(self, num_clients: int) -> list[Fraction]:
        """τ_i for every client, exactly: τ_i = 1 − i·X/(100(M − 1)) as a rational (the
        authors' ``get_tau_i``), or the given times read as decimals."""
        if self.times is not None:
            if len(self.times) != num_clients:
                raise ValueError(
                    f"times has {len(self.times)} values but there are {num_clients} clients: "
                    "give one time per client."
                )
            return [exact(t) for t in self.times]
        if num_clients == 1:
            return [Fraction(1)]
        x = exact(self.heterogeneity) / 100
        return [1 - i * x / (num_clients - 1) for i in range(num_clients)]

    def means(self, num_clients: int) -> np.ndarray:
        """τ_i for every client, as floats (for the aggregation weights)."""
        return np.array([float(t) for t in self.exact_means(num_clients)])

    def draw(self, client: int, start: int, seed: int, means: list[Fraction]) -> Fraction:
        """T_i of ``client``'s ``start``-th piece of work, exactly (an exponential draw is
        the exact value of the float drawn)."""
        if self.distribution == "fixed":
            return means[client]
        rng = np.random.default_rng(derive_seed(seed, "client_time", client, start))
        return Fraction(float(rng.exponential(float(means[client]))))


@dataclass(frozen=True)
class Aggregation:
    """One server aggregation: at ``time`` (exact), the updates of ``clients`` (in order),
    each computed from the global model version ``versions[k]`` (ρ_i(n))."""

    time: Fraction
    clients: tuple[int, ...]
    versions: tuple[int, ...]


class Schedule:
    """Base class: the simulated clock of one run. Subclasses implement :meth:`_returning`
    (who is aggregated, and when) and say whether participants restart at the aggregation
    (receiving θ^{n+1}) or as soon as they send (receiving the current θ^n).

    Time is exact: every time is a rational (:class:`fractions.Fraction`), so equal times
    are equal (ties go to the lower client index), an event at the budget counts, and
    nothing drifts over 10⁵ aggregations. Checkpoints store times as ``"p/q"`` strings."""

    restart: Restart = "at_aggregation"

    def __init__(self, times: ClientTimes | None = None) -> None:
        self.times = times or ClientTimes()
        self.num_clients = 0
        self.seed = 0

    # ---- state ---------------------------------------------------------------------
    def reset(self, num_clients: int, seed: int) -> None:
        """Every client starts on θ^0 at time 0."""
        self.num_clients, self.seed = num_clients, seed
        self.exact_means = self.times.exact_means(num_clients)
        self.means = np.array([float(t) for t in self.exact_means])
        self.starts = np.zeros(num_clients, dtype=np.int64)
        self.version = np.zeros(num_clients, dtype=np.int64)
        self.ready = [self.times.draw(i, 0, seed, self.exact_means) for i in range(num_clients)]
        self.now, self.round = Fraction(0), 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_clients": self.num_clients, "seed": self.seed, "now": str(self.now),
            "round": self.round, "starts": self.starts.tolist(),
            "version": self.version.tolist(), "ready": [str(t) for t in self.ready],
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset(int(state["num_clients"]), int(state["seed"]))
        self.now, self.round = _time(state["now"]), int(state["round"])
        self.starts = np.asarray(state["starts"], dtype=np.int64)
        self.version = np.asarray(state["version"], dtype=np.int64)
        self.ready = [_time(t) for t in state["ready"]]

    # ---- events --------------------------------------------------------------------
    def plan(self) -> Aggregation:
        """The next aggregation n = ``self.round``; changes nothing."""
        time, clients = self._returning()
        clients = tuple(sorted(clients))
        return Aggregation(time, clients, tuple(int(self.version[i]) for i in clients))

    def commit(self, event: Aggregation) -> None:
        """Apply ``event``: its clients start new work, the clock moves to its time."""
        for i in event.clients:
            if self.restart == "at_aggregation":
                begin, version = event.time, self.round + 1
            elif self.ready[i] >= event.time:  # its send closed the round
                begin, version = event.time, self.round + 1
            else:  # sent at its return time and got the model current then, θ^n
                begin, version = self.ready[i], self.round
            self.starts[i] += 1
            self.version[i] = version
            draw = self.times.draw(i, int(self.starts[i]), self.seed, self.exact_means)
            self.ready[i] = begin + draw
        self.now, self.round = event.time, self.round + 1

    def _returning(self) -> tuple[float, list[int]]:
        raise NotImplementedError

    def needed_versions(self) -> set[int]:
        """Model versions some in-flight client still trains from."""
        return set(self.version.tolist())

    # ---- weights -------------------------------------------------------------------
    def time_based_weights(self, p: np.ndarray) -> np.ndarray:
        """d_i that make the aggregation unbiased over a window (thesis Thm 4.3)."""
        raise NotImplementedError

    def identical_weights(self) -> np.ndarray:
        """The same d_i for every client (the thesis's IDENTICAL)."""
        raise NotImplementedError

    def _fresh_copy(self) -> Schedule:
        """This schedule's configuration restarted at time 0 (for dry runs)."""
        dry = type(self).__new__(type(self))
        dry.__dict__.update(self.__dict__)
        dry.reset(self.num_clients, self.seed)
        return dry

    def participation_frequency(self, aggregations: int = 10_000) -> np.ndarray:
        """The fraction of aggregations each client takes part in, from a dry run of this
        schedule (a copy; the run's own state is untouched)."""
        dry = self._fresh_copy()
        counts = np.zeros(self.num_clients)
        for _ in range(aggregations):
            event = dry.plan()
            counts[list(event.clients)] += 1
            dry.commit(event)
        return counts / aggregations

    def count_until(self, budget: float) -> tuple[int, np.ndarray]:
        """(aggregations, updates per client) until simulated time ``budget`` (an event
        at the budget counts), on a copy."""
        dry = self._fresh_copy()
        counts = np.zeros(self.num_clients, dtype=np.int64)
        n, budget = 0, exact(budget)
        while True:
            event = dry.plan()
            if event.time > budget:
                return n, counts
            counts[list(event.clients)] += 1
            dry.commit(event)
            n += 1


class SyncSchedule(Schedule):
    """Synchronous FedAvg: every client, Δt = max_i T_i (thesis Tab. 4.2, first row);
    d_i = p_i."""

    def _returning(self) -> tuple[Fraction, list[int]]:
        return max(self.ready), list(range(self.num_clients))

    def time_based_weights(self, p: np.ndarray) -> np.ndarray:
        return p.copy()

    def identical_weights(self) -> np.ndarray:
        return np.full(self.num_clients, 1.0 / self.num_clients)


class AsyncSchedule(Schedule):
    """Asynchronous FedAvg: one aggregation each time one client returns (ties: the lowest
    client index first); d_i = [Σ_j 1/τ_j]·τ_i·p_i (eq. 4.36; the ceiling printed in Tab.
    4.2 is a typo, and the authors' code has none). IDENTICAL is d_i = 1."""

    restart: Restart = "at_aggregation"

    def _returning(self) -> tuple[Fraction, list[int]]:
        first = min(range(self.num_clients), key=lambda i: (self.ready[i], i))  # ties: index
        return self.ready[first], [first]

    def time_based_weights(self, p: np.ndarray) -> np.ndarray:
        return float(np.sum(1.0 / self.means)) * self.means * p

    def identical_weights(self) -> np.ndarray:
        return np.ones(self.num_clients)


class FedFixSchedule(Schedule):
    """FedFix(Δt): aggregation n at (n + 1)·Δt with every client whose update arrived
    since the previous one; d_i = ⌈τ_i/Δt⌉·p_i (eq. 4.40). IDENTICAL is d_i = 1/M.

    Args:
        period: Δt > 0.
        restart: ``"at_aggregation"`` (the thesis and its code: a client that has sent
            waits for the aggregation and restarts on θ^{n+1}) or ``"on_send"`` (it
            restarts at once on the current θ^n; an update finished before the
            aggregation waits for it, so a client sends at most one update per
            aggregation).
    """

    def __init__(
        self, period: float, times: ClientTimes | None = None, restart: Restart = "at_aggregation"
    ) -> None:
        super().__init__(times)
        if not period > 0:
            raise ValueError(f"FedFix period Δt must be > 0, got {period}.")
        if restart not in ("at_aggregation", "on_send"):
            raise ValueError(f"restart must be 'at_aggregation' or 'on_send', got {restart!r}.")
        self.period, self.restart = float(period), restart

    def _returning(self) -> tuple[Fraction, list[int]]:
        time = (self.round + 1) * exact(self.period)
        return time, [i for i in range(self.num_clients) if self.ready[i] <= time]

    def time_based_weights(self, p: np.ndarray) -> np.ndarray:
        period = exact(self.period)
        return np.array([math.ceil(t / period) for t in self.exact_means], dtype=float) * p

    def identical_weights(self) -> np.ndarray:
        return np.full(self.num_clients, 1.0 / self.num_clients)


class FedBuffSchedule(Schedule):
    """FedBuff(c) (Nguyen et al. 2022): aggregate once c clients have returned, at the
    c-th return time (ties: lowest index). The thesis gives no closed form: IDENTICAL is
    d_i = 1/c (the authors' plotted runs), TIME-BASED is p_i divided by the fraction of
    aggregations client i takes part in (the authors' code), measured on a dry run.

    Args:
        buffer_size: c, at most the number of clients.
        restart: ``"at_aggregation"`` (the thesis's code and figures: returned clients
            wait for the aggregation) or ``"on_send"`` (Nguyen et al. and FLSim: a client
            restarts as soon as it has sent, on the current model; the client whose
            update fills the buffer gets the new one).
    """

    def __init__(
        self,
        buffer_size: int,
        times: ClientTimes | None = None,
        restart: Restart = "at_aggregation",
    ) -> None:
        super().__init__(times)
        if isinstance(buffer_size, bool) or int(buffer_size) < 1:
            raise ValueError(f"FedBuff buffer_size c must be >= 1, got {buffer_size}.")
        if restart not in ("at_aggregation", "on_send"):
            raise ValueError(f"restart must be 'at_aggregation' or 'on_send', got {restart!r}.")
        self.buffer_size, self.restart = int(buffer_size), restart

    def reset(self, num_clients: int, seed: int) -> None:
        if self.buffer_size > num_clients:
            raise ValueError(
                f"FedBuff buffer_size c = {self.buffer_size} but only {num_clients} clients "
                f"train: set buffer_size <= {num_clients}."
            )
        super().reset(num_clients, seed)

    def _returning(self) -> tuple[Fraction, list[int]]:
        order = sorted(range(self.num_clients), key=lambda i: (self.ready[i], i))
        order = order[: self.buffer_size]  # the first c returns, ties by index
        return max(self.ready[i] for i in order), order

    def time_based_weights(self, p: np.ndarray) -> np.ndarray:
        frequency = self.participation_frequency()
        return np.where(frequency > 0, p / np.maximum(frequency, 1e-300), 0.0)

    def identical_weights(self) -> np.ndarray:
        return np.full(self.num_clients, 1.0 / self.buffer_size)


def async_aggregations(num_clients: int, times: ClientTimes, budget: float) -> float:
    """The closed form Σ_i T/τ_i of asynchronous aggregations in time T (Tab. 4.2),
    counting each client's returns ⌊T/τ_i⌋ exactly."""
    means, budget = times.exact_means(num_clients), exact(budget)
    return float(sum(math.floor(budget / t) for t in means))


def _time(value: str | float) -> Fraction:
    """A checkpoint's time: ``"p/q"``, or a float of a checkpoint made before exact time."""
    return Fraction(value) if isinstance(value, str) else exact(value)
