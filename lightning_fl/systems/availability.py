"""Client availability (Rodio et al., INFOCOM 2023; Marfoq thesis §2.2): the set A_t of
clients that can take part in round t is exogenous, and samplers choose only among it.

An availability model is a plain seeded object: ``available(round_idx, seed, n)`` is a
function of (seed, round, n) alone. A Markov chain's past is cached and advanced one
round at a time from its saved state, so resumed runs and every rank see the same sets
at the cost of one step per round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_fl.engine.seeding import generator


class AlwaysAvailable:
    """Every client, every round (π_k = 1): the behaviour without an availability model."""

    def available(self, round_idx: int, seed: int, num_clients: int) -> torch.Tensor:
        return torch.ones(num_clients, dtype=torch.bool)

    def stationary(self, num_clients: int) -> torch.Tensor:
        return torch.ones(num_clients, dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class MarkovAvailability:
    """Two-state Markov chains (inactive 0, active 1), one per client or one per cluster of
    clients (spatial correlation), with stationary activity π and second eigenvalue λ
    (thesis eqs. D.226–D.228):

        P = [[1 − (1−λ)π,      (1−λ)π     ],
             [(1−λ)(1−π),  λ + (1−λ)π     ]],

    so P(active → active) − P(inactive → active) = λ, the lag-1 autocorrelation of the
    activity. A chain starts from its stationary law at round 0 and takes one step per
    round with draws seeded from (seed, round).

    The seed rules: ``available(t, seed, n)`` is a function of (seed, t, n) alone. The
    chain's state is only a cache of the walk from round 0 (so that rounds in order cost
    one step each); it is kept with the seed it was drawn with, and a call with another
    seed, an earlier round or another number of chains walks again from round 0.

    Args:
        pi: π_k per chain (or one value for all), in (0, 1).
        lam: λ_k per chain (or one value), in (−1, 1) and such that P is a probability
            matrix.
        clusters: the chain of each client (default: one chain per client).
    """

    def __init__(
        self,
        pi: float | Sequence[float],
        lam: float | Sequence[float] = 0.0,
        clusters: Sequence[int] | None = None,
    ) -> None:
        self.pi = torch.as_tensor(pi, dtype=torch.float64).flatten()
        self.lam = torch.as_tensor(lam, dtype=torch.float64).flatten()
        if ((self.pi <= 0) | (self.pi >= 1)).any():
            raise ValueError(f"Every π_k must be in (0, 1), got {self.pi.tolist()}.")
        up, down = (1 - self.lam) * self.pi, (1 - self.lam) * (1 - self.pi)  # 0→1, 1→0
        if ((up < 0) | (up > 1) | (down < 0) | (down > 1)).any():
            raise ValueError(
                "λ_k must keep P a probability matrix: (1−λ)π and (1−λ)(1−π) ∈ [0, 1]."
            )
        self.clusters = None if clusters is None else torch.as_tensor(clusters, dtype=torch.long)
        self._round: int | None = None
        self._seed: int | None = None
        self._state: torch.Tensor | None = None

    def _chains(self, num_clients: int) -> int:
        return num_clients if self.clusters is None else int(self.clusters.max()) + 1

    def _per_chain(self, values: torch.Tensor, chains: int) -> torch.Tensor:
        if len(values) == 1:
            return values.expand(chains)
        if len(values) != chains:
            raise ValueError(f"Got {len(values)} values for {chains} availability chains.")
        return values

    def stationary(self, num_clients: int) -> torch.Tensor:
        """π_k of every client."""
        pi = self._per_chain(self.pi, self._chains(num_clients))
        return pi if self.clusters is None else pi[self.clusters]

    def correlation(self, num_clients: int) -> torch.Tensor:
        """λ_k of every client (its chain's second eigenvalue)."""
        lam = self._per_chain(self.lam, self._chains(num_clients))
        return lam if self.clusters is None else lam[self.clusters]

    def available(self, round_idx: int, seed: int, num_clients: int) -> torch.Tensor:
        chains = self._chains(num_clients)
        pi = self._per_chain(self.pi, chains)
        lam = self._per_chain(self.lam, chains)
        if not self._walk_goes_on(round_idx, seed, chains):
            self._start(seed, chains)
        stay, rise = self._thresholds(pi, lam)
        while self._round < round_idx:
            self._round += 1
            draw = torch.rand(
                chains, generator=generator(seed, "availability", self._round), dtype=torch.float64
            )
            # active next with probability λ + (1−λ)π when active now, (1−λ)π when not
            self._state = torch.where(self._state, draw < stay, draw < rise)
        state = self._state
        return state if self.clusters is None else state[self.clusters]

    def _walk_goes_on(self, round_idx: int, seed: int, chains: int) -> bool:
        """Whether the cached walk leads to ``round_idx``: drawn with ``seed`` for
        ``chains`` chains, and not past that round."""
        return (
            self._state is not None
            and self._round is not None
            and self._round <= round_idx
            and self._seed == seed
            and len(self._state) == chains
        )

    def _start(self, seed: int, chains: int) -> None:
        """Round 0: each chain's stationary start, from (seed, "availability", 0)."""
        self._seed = seed
        draw = torch.rand(chains, generator=generator(seed, "availability", 0), dtype=torch.float64)
        self._round, self._state = 0, draw < self._per_chain(self.pi, chains)

    def _thresholds(
        self, pi: torch.Tensor, lam: torch.Tensor
    ) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """(λ + (1−λ)π, (1−λ)π): per chain, or two numbers when every chain shares π and
        λ (a step then makes no pass over the population to compute them)."""
        if len(self.pi) == 1 and len(self.lam) == 1:
            p, lam_ = float(self.pi[0]), float(self.lam[0])
            return lam_ + (1 - lam_) * p, (1 - lam_) * p
        return lam + (1 - lam) * pi, (1 - lam) * pi

    def state_dict(self) -> dict[str, Any]:
        return {"round": self._round, "seed": self._seed, "state": self._state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._round, self._state = state.get("round"), state.get("state")
        self._seed = state.get("seed")


class TwoClassAvailability(MarkovAvailability):
    """The availability of the CA-Fed experiments (Marfoq thesis §2.2.6.1): the first half
    of the clients is "more available" (π = 1/2 + g), the second "less available"
    (π = 1/2 − g); each half is split into a correlated part (λ = ν) and a weakly
    correlated one (λ ~ N(0, ε²), drawn with ``seed``).

    Args:
        num_clients: N (the thesis: 100).
        gap: g (0.4: π = 0.9 and 0.1).
        correlation: ν (0.9).
        noise: ε (10⁻²).
    """

    def __init__(
        self,
        num_clients: int = 100,
        gap: float = 0.4,
        correlation: float = 0.9,
        noise: float = 0.01,
        seed: int = 0,
    ) -> None:
        if not 0 < gap < 0.5:
            raise ValueError(f"gap g must be in (0, 0.5) so that π stays in (0, 1), got {gap}.")
        if num_clients < 4:
            raise ValueError(f"TwoClassAvailability needs at least 4 clients, got {num_clients}.")
        half, quarter = num_clients // 2, num_clients // 4
        pi = [0.5 + gap] * half + [0.5 - gap] * (num_clients - half)
        weak = torch.randn(num_clients, generator=generator(seed, "weak_correlation")) * noise
        lam = []
        for k in range(num_clients):
            within = k if k < half else k - half
            lam.append(correlation if within < quarter else float(weak[k]))
        super().__init__(pi, lam)


class _Calendar:
    """Pending (round, chain) changes kept in runs sorted by round; :meth:`pop` takes the
    changes of one round from the head of each run. A pushed run merges with the run
    before it while that one is at most twice its size (a log-structured merge), so a
    round that pushes k changes costs O(k log k) amortized and a pop O(log n) per run,
    whatever the number of pending changes n. Host-side bookkeeping (int64 on the CPU)."""

    def __init__(self, rounds: torch.Tensor, chains: torch.Tensor) -> None:
        self.runs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.push(rounds, chains)

    def push(self, rounds: torch.Tensor, chains: torch.Tensor) -> None:
        if len(rounds) == 0:
            return
        self.runs.append(self._sorted(rounds, chains))
        while len(self.runs) >= 2 and len(self.runs[-2][0]) <= 2 * len(self.runs[-1][0]):
            (r2, c2), (r1, c1) = self.runs.pop(), self.runs.pop()
            self.runs.append(self._sorted(torch.cat([r1, r2]), torch.cat([c1, c2])))

    def pop(self, round_idx: int) -> torch.Tensor:
        """The chains that change at ``round_idx`` (every pending round is >= it), sorted."""
        taken, kept = [], []
        for rounds, chains in self.runs:
            end = int(torch.searchsorted(rounds, round_idx, right=True))
            taken.append(chains[:end])
            if end < len(rounds):
                kept.append((rounds[end:], chains[end:]))
        self.runs = kept
        return torch.sort(torch.cat(taken)).values if taken else torch.zeros(0, dtype=torch.long)

    def pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every pending (round, chain), as one run sorted by round then chain."""
        if not self.runs:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        rounds, chains = zip(*self.runs)
        return self._sorted(torch.cat(rounds), torch.cat(chains))

    @staticmethod
    def _sorted(rounds: torch.Tensor, chains: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort(chains, stable=True)
        rounds, chains = rounds[order], chains[order]
        order = torch.argsort(rounds, stable=True)
        return rounds[order], chains[order]


class SojournMarkovAvailability(MarkovAvailability):
    """The chains of :class:`MarkovAvailability` (same π, λ, clusters and transition
    matrix P), walked by their sojourn times, so that a round costs the chains that change
    in it rather than the population (issue 66).

    A chain in state s leaves it each round with probability ℓ_s (ℓ_0 = (1−λ)π,
    ℓ_1 = (1−λ)(1−π), the off-diagonal of P), so the number of rounds it stays is
    geometric: it next changes at t + L, L = 1 + ⌊ln V / ln(1 − ℓ_s)⌋ with V uniform on
    (0, 1] (P(L > j) = (1 − ℓ_s)^j). Round 0 draws the stationary start from the same
    draw as :class:`MarkovAvailability` (the two agree at round 0), and every chain its
    first change (memoryless, so the start needs no other draw). A pending change sits in
    a calendar; round t takes its changes, flips them and draws their next changes from
    the generator (seed, "availability", t), in the order of the chain ids. With N chains
    of activity π, a round touches about 2Nπ(1−π)(1−λ) chains: about 100 for π = 10⁻⁴,
    λ = 0.5 and N = 10⁶, where :class:`MarkovAvailability` draws 10⁶ uniforms.

    The same Markov law, not the same draws: a run with this model is not the run of
    :class:`MarkovAvailability` with the same seed. ``available(t, seed, n)`` is a
    function of (seed, t, n) alone, as there (the calendar is a cache of the walk from
    round 0, checkpointed with it). :meth:`active_clients` gives the available clients as
    sorted ids without a pass over the population (unclustered chains).

    Chain 0 below has ℓ_0 = ℓ_1 = 1 (π = 1/2, λ = −1): it changes every round.

    >>> chains = SojournMarkovAvailability(pi=[0.5, 0.3], lam=[-1.0, 0.5])
    >>> [chains.available(t, seed=0, num_clients=2).tolist() for t in range(4)]
    [[False, True], [True, False], [False, False], [True, True]]
    >>> chains.active_clients(4, seed=0, num_clients=2).tolist()
    [1]
    """

    def __init__(
        self,
        pi: float | Sequence[float],
        lam: float | Sequence[float] = 0.0,
        clusters: Sequence[int] | None = None,
    ) -> None:
        super().__init__(pi, lam, clusters)
        self._calendar: _Calendar | None = None
        self._active: torch.Tensor | None = None  # sorted ids of the chains that are on
        self._log_stays: tuple[torch.Tensor, torch.Tensor] | None = None

    def _log_stay(self, chains: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ln(1 − ℓ_0), ln(1 − ℓ_1): one value each when every chain shares π and λ (no
        pass over the population), else one per chain (computed once a walk)."""
        if len(self.pi) == 1 and len(self.lam) == 1:
            pi, lam = self.pi, self.lam
        else:
            pi, lam = self._per_chain(self.pi, chains), self._per_chain(self.lam, chains)
        return torch.log1p(-(1 - lam) * pi), torch.log1p(-(1 - lam) * (1 - pi))

    def _next_changes(
        self, round_idx: int, chains: torch.Tensor, on: torch.Tensor, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rounds at which ``chains``, now in state ``on``, next change; those
        chains). A chain that cannot leave its state (ℓ_s = 0, λ = 1) has no next change."""
        log_off, log_on = self._log_stays
        if len(log_off) > 1:
            log_off, log_on = log_off[chains], log_on[chains]
        log_stay = torch.where(on, log_on, log_off)
        v = 1 - torch.rand(len(chains), generator=gen, dtype=torch.float64)  # (0, 1]
        stays = torch.floor(torch.log(v) / log_stay)  # ℓ_s = 1: −0; ℓ_s = 0: inf or nan
        changes = stays.isfinite()
        if not bool(changes.all()):
            stays, chains = stays[changes], chains[changes]
        return round_idx + 1 + stays.to(torch.long), chains

    def _walk(self, round_idx: int, seed: int, chains: int) -> torch.Tensor:
        if self._log_stays is None:
            self._log_stays = self._log_stay(chains)
        if self._calendar is None or not self._walk_goes_on(round_idx, seed, chains):
            self._start(seed, chains)
            self._log_stays = self._log_stay(chains)
            ids = torch.arange(chains)
            first = self._next_changes(
                0, ids, self._state, generator(seed, "availability_sojourns", 0)
            )
            self._calendar = _Calendar(*first)
            self._active = torch.nonzero(self._state).flatten()
        if self._active is None:
            self._active = torch.nonzero(self._state).flatten()
        while self._round < round_idx:
            self._round += 1
            changing = self._calendar.pop(self._round)
            if len(changing) == 0:
                continue
            now_on = ~self._state[changing]
            self._state[changing] = now_on
            off, on = changing[~now_on], changing[now_on]
            kept = self._active[~torch.isin(self._active, off)]
            self._active = torch.sort(torch.cat([kept, on])).values
            gen = generator(seed, "availability", self._round)
            self._calendar.push(*self._next_changes(self._round, changing, now_on, gen))
        return self._active

    def available(self, round_idx: int, seed: int, num_clients: int) -> torch.Tensor:
        self._walk(round_idx, seed, self._chains(num_clients))
        state = self._state
        return state.clone() if self.clusters is None else state[self.clusters]

    def active_clients(self, round_idx: int, seed: int, num_clients: int) -> torch.Tensor:
        """The available clients at ``round_idx``, sorted (int64 on the host): O(changes)
        a round for unclustered chains, a pass over the clients for clustered ones."""
        active = self._walk(round_idx, seed, self._chains(num_clients))
        if self.clusters is None:
            return active.clone()
        return torch.nonzero(self._state[self.clusters]).flatten()

    def state_dict(self) -> dict[str, Any]:
        rounds, chains = (None, None) if self._calendar is None else self._calendar.pending()
        return {"round": self._round, "seed": self._seed, "state": self._state,
                "change_rounds": rounds, "change_chains": chains}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        rounds, chains = state.get("change_rounds"), state.get("change_chains")
        self._calendar = None if rounds is None else _Calendar(rounds, chains)
        self._active = self._log_stays = None
