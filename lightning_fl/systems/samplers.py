"""Client samplers and their unbiased aggregation weights.

Fraboni et al., "A General Theory for Client Sampling in Federated Learning"
(FL-IJCAI'22; Fraboni thesis Ch. 2, App. A.1, Tab. 2.1). The server update is
θ^{t+1} = θ^t + η_g Σ_i ω_i(S_t)(θ_i^{t+1} − θ^t) (thesis eq. 2.3, Alg. 9), and a
scheme is unbiased when E[ω_i(S_t)] = p_i (Def. 2.1).

A sampler is a plain object: ``sample(round_idx, seed, p)`` is a pure function of
its arguments, so resumed runs and all ranks draw the same participants.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Literal

import torch

from lightning_fl.engine.seeding import (
    cumulative_weights,
    generator,
    multinomial_draws,
    randperm_prefix,
)
from lightning_fl.engine.traits import Trait, Traits
from lightning_fl.systems.ca_fed import AvailabilityEstimator, LossFilter, truncate


@dataclass(frozen=True)
class Participation:
    """The clients of one round, in training order, and their aggregation weights ω_i."""

    clients: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.clients) != len(self.weights):
            raise ValueError("Participation needs one weight per client.")


class ClientSampler:
    """Base class. Subclasses implement :meth:`_draw` returning ``{client: ω_i}``."""

    #: What it does that the composition rules read (:mod:`lightning_fl.engine.traits`).
    #: A sampler is assumed to leave clients out, a random number of them, with no known
    #: inclusion probability, until it withdraws the trait (``None``).
    traits: ClassVar[Traits] = {
        Trait.LEAVES_CLIENTS_OUT: "",
        Trait.DRAWS_A_RANDOM_NUMBER_OF_CLIENTS: "",
        Trait.UNKNOWN_INCLUSION_PROBABILITY: "",
    }

    def __init__(self, renormalize: bool = False) -> None:
        #: Opt-in for the biased "original FedAvg" weights ω_i / Σ_j ω_j.
        self.renormalize = renormalize

    def sample(self, round_idx: int, seed: int, p: torch.Tensor) -> Participation:
        """Choose the participants of ``round_idx`` given target weights ``p`` (Σ p = 1).

        Clients with p_i = 0 (for instance clients without training data) are never drawn.
        """
        p = self._checked(p)
        weights = self._draw(p, generator(seed, "sampler", round_idx))
        clients = tuple(sorted(weights))
        omega = [weights[c] for c in clients]
        if self.renormalize:
            total = sum(omega)
            omega = [w / total for w in omega]
        return Participation(clients, tuple(omega))

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        raise NotImplementedError

    def _checked(self, p: torch.Tensor) -> torch.Tensor:
        """``p`` checked (:func:`_check_target_weights`) once for the tensor a fit passes
        every round, not at every round: the population's weights are fixed for a fit."""
        if p is not getattr(self, "_target_in", None):
            self._target_in, self._target = p, _check_target_weights(p)
            self._derived: dict[str, Any] = {}
        return self._target

    def _derived_from(self, p: torch.Tensor, name: str, compute: Any) -> Any:
        """``compute(p)``, kept while the fit passes the same checked ``p``: what a draw
        needs of the whole population (the eligible clients, the cumulative weights) is
        computed once, so that a round costs what its draws cost."""
        cache = self._derived if p is getattr(self, "_target", None) else {}
        if name not in cache:
            cache[name] = compute(p)
        return cache[name]

    def check(self, num_eligible: int) -> None:
        """Raise a clear error when this sampler cannot work with ``num_eligible`` clients."""

    #: True for samplers that must see the round's client updates (:meth:`observe`).
    needs_updates = False
    #: True for samplers that must see the current model's loss on each available client
    #: before they draw (CA-Fed): the strategy then sets :attr:`losses` before
    #: :meth:`sample`, a function ``losses(clients) -> tensor`` of one batch's loss each.
    needs_losses = False
    losses: Any = None

    def observe(self, clients: tuple[int, ...], updates: torch.Tensor, num_clients: int) -> None:
        """The narrow input of samplers with ``needs_updates``: after each round, the
        participants' flattened updates θ_i^{t+1} − θ^t (one row per client, the rows of
        every rank gathered by the round's all-reduce)."""

    def round_metrics(self) -> dict[str, float]:
        """Per-round values the strategy logs after each round (e.g. ``fl/excluded``)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class FullParticipation(ClientSampler):
    """Every client with p_i > 0 takes part, with ω_i = p_i (Tab. 2.1, first row)."""

    traits = {
        Trait.LEAVES_CLIENTS_OUT: None,
        Trait.DRAWS_A_RANDOM_NUMBER_OF_CLIENTS: None,
        Trait.UNKNOWN_INCLUSION_PROBABILITY: None,
    }

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        return {i: float(p[i]) for i in torch.nonzero(p > 0).flatten().tolist()}


class _FixedSizeSampler(ClientSampler):
    def __init__(self, clients_per_round: int, renormalize: bool = False) -> None:
        super().__init__(renormalize)
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}.")
        self.clients_per_round = clients_per_round

    def check(self, num_eligible: int) -> None:
        if self.clients_per_round > num_eligible:
            raise ValueError(
                f"clients_per_round={self.clients_per_round} but only {num_eligible} clients "
                f"have training data; set clients_per_round <= {num_eligible}."
            )


class UniformSampler(_FixedSizeSampler):
    """m clients uniformly without replacement; ω_i = (n/m)·p_i for each sampled i.

    Tab. 2.1, "Uniform": E[ω_i] = (m/n)(n/m)p_i = p_i. n counts the clients with
    p_i > 0. The weights sum to 1 only when p_i = 1/n.

    Two of four clients, so ω_i = (4/2)·p_i (here 0.8 + 0.4 ≠ 1):

    >>> import torch
    >>> p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    >>> UniformSampler(2).sample(0, seed=0, p=p)
    Participation(clients=(1, 3), weights=(0.4, 0.8))
    """

    traits = {
        Trait.DRAWS_A_RANDOM_NUMBER_OF_CLIENTS: None,
        Trait.UNKNOWN_INCLUSION_PROBABILITY: None,
    }

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        eligible = self._derived_from(p, "eligible", lambda w: torch.nonzero(w > 0).flatten())
        n, m = len(eligible), self.clients_per_round
        self.check(n)
        # torch.randperm(n, generator=gen)[:m], drawn in O(m) (seeding.randperm_prefix)
        chosen = eligible[randperm_prefix(n, m, gen.initial_seed())].tolist()
        return {i: n / m * float(p[i]) for i in chosen}


class MDSampler(_FixedSizeSampler):
    """MD: m i.i.d. draws with P(l_k = i) = p_i; ω_i = (number of draws of i)/m.

    Tab. 2.1, "MD" (multinomial distribution, with replacement). A client drawn twice
    trains once and counts twice. The weights always sum to 1.

    Three draws; client 1 drawn twice in round 2 counts 2/3:

    >>> import torch
    >>> p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    >>> MDSampler(3).sample(2, seed=0, p=p)
    Participation(clients=(1, 3), weights=(0.6666666666666666, 0.3333333333333333))
    """

    def check(self, num_eligible: int) -> None:
        """Draws with replacement: any m works."""

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        m = self.clients_per_round
        # torch.multinomial(p, m, replacement=True, generator=gen), drawn in O(m log n)
        cumulative = self._derived_from(p, "cumulative", cumulative_weights)
        draws = multinomial_draws(cumulative, m, gen.initial_seed()).tolist()
        return {i: count / m for i, count in Counter(draws).items()}


class PoissonSampler(ClientSampler):
    """Each client with p_i > 0 takes part independently with probability q; ω_i = p_i/q.

    E[ω_i] = q·p_i/q = p_i (Fraboni thesis Def. 2.1). A round may have no participants,
    and its size is random (about qn). The sampling of DP-FedAvg (McMahan et al. 2018,
    Alg. 1: "sample users with probability q"), for which privacy accounting is tightest.
    One uniform draw per client a round, a tensor operation over the population.

    >>> import torch
    >>> PoissonSampler(0.5).sample(0, seed=0, p=torch.full((4,), 0.25))
    Participation(clients=(0,), weights=(0.5,))
    """

    traits = {Trait.UNKNOWN_INCLUSION_PROBABILITY: None}

    def __init__(self, rate: float, renormalize: bool = False) -> None:
        super().__init__(renormalize)
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate}.")
        self.rate = float(rate)

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        # host: the draw is bookkeeping of the sampler, on a CPU generator
        chosen = torch.nonzero((torch.rand(len(p), generator=gen, dtype=torch.float64)
                                < self.rate) & (p > 0)).flatten().tolist()  # fmt: skip
        return {i: float(p[i]) / self.rate for i in chosen}


class SamplerWrapper(ClientSampler):
    """A sampler that changes who may be drawn and asks ``sampler`` for the draw; its
    checks, narrow inputs (``needs_updates`` and :meth:`observe`, ``needs_losses`` and
    :attr:`losses`), per-round metrics and state are ``sampler``'s."""

    traits = {  # the wrapped sampler's hold (the chain is checked together)
        Trait.LEAVES_CLIENTS_OUT: None,
        Trait.DRAWS_A_RANDOM_NUMBER_OF_CLIENTS: None,
        Trait.UNKNOWN_INCLUSION_PROBABILITY: None,
    }

    def __init__(self, sampler: ClientSampler) -> None:
        super().__init__(sampler.renormalize)
        self.sampler = sampler

    @property
    def needs_updates(self) -> bool:  # type: ignore[override]
        return self.sampler.needs_updates

    @property
    def needs_losses(self) -> bool:  # type: ignore[override]
        return getattr(self.sampler, "needs_losses", False)

    @property
    def losses(self) -> Any:  # type: ignore[override]
        return self.sampler.losses

    @losses.setter
    def losses(self, function: Any) -> None:
        self.sampler.losses = function

    def check(self, num_eligible: int) -> None:
        self.sampler.check(num_eligible)

    def observe(self, clients: tuple[int, ...], updates: torch.Tensor, num_clients: int) -> None:
        self.sampler.observe(clients, updates, num_clients)

    def round_metrics(self) -> dict[str, float]:
        return self.sampler.round_metrics()

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class ExcludedClients(SamplerWrapper):
    """Incomplete participation (SAFARI's setting, seed paper 004 §5): ``excluded``
    clients never take part, and ``sampler`` chooses among the others with the target
    weights renormalized over them. ``excluded`` is a list of client ids, or a number s of
    clients drawn once from the run's seed.
    """

    traits = {Trait.LEAVES_CLIENTS_OUT: "", Trait.UNKNOWN_INCLUSION_PROBABILITY: ""}

    def __init__(self, sampler: ClientSampler, excluded: int | list[int] = 0) -> None:
        super().__init__(sampler)
        if isinstance(excluded, int) and excluded < 0:
            raise ValueError(f"excluded must be >= 0, got {excluded}.")
        self.excluded = excluded

    def excluded_clients(self, num_clients: int, seed: int) -> list[int]:
        if not isinstance(self.excluded, int):
            return sorted(self.excluded)
        if self.excluded >= num_clients:
            raise ValueError(
                f"excluded={self.excluded} clients but only {num_clients} exist; at least one "
                "must take part: lower excluded."
            )
        order = torch.randperm(num_clients, generator=generator(seed, "excluded"))
        return sorted(order[: self.excluded].tolist())

    def sample(self, round_idx: int, seed: int, p: torch.Tensor) -> Participation:
        p = _check_target_weights(p).clone()
        p[self.excluded_clients(len(p), seed)] = 0.0
        if float(p.sum()) == 0:
            raise ValueError("Every client with training data is excluded: lower excluded.")
        return self.sampler.sample(round_idx, seed, p / p.sum())

    def check(self, num_eligible: int) -> None:
        count = self.excluded if isinstance(self.excluded, int) else len(self.excluded)
        self.sampler.check(num_eligible - count)


class AvailableClients(ClientSampler):
    """Clients chosen among the available set A_t (CA-Fed's setting, Marfoq thesis §2.2,
    eq. 2.16): the server update is Σ_{k∈A_t} q_k Δ_k, with A_t from ``availability``
    (:mod:`lightning_fl.systems.availability`) and one of the selectors:

    - ``"unbiased"``: every available client, q_k = α_k / π_k, so that E[1{k ∈ A_t}] q_k =
      α_k under the chain's stationary law and the biased objective (2.17) is Σ α_k F_k;
    - ``"more_available"``: only clients with π_k ≥ ``min_availability`` (Guideline A),
      q_k = α_k / (π_k Σ_{j kept} α_j): unbiased for the kept clients' objective;
    - ``"adafed"`` (Tan et al. 2022): every available client, q_k ∝ α_k/π_k normalized
      over A_t;
    - ``"f3ast"`` (Ribero et al. 2022): the ``clients_per_round`` available clients with
      the largest α_k²/r_k², weights α_k/r_k, where r_k is an exponential average (rate
      ``smoothness``) of k's participation indicator, started at π_k;
    - ``"ca_fed"`` (Alg. 6): q = α/π̂, then the greedy ``get`` drops clients in order of
      decreasing |λ̂_k| and then of increasing π̂_k while the estimated error ε̂ (the
      optimization term from the filtered losses plus 4κ̄² d_TV² Γ̂) falls by at least
      ``tolerance``; κ̄² → ∞ gives Unbiased, κ̄² → 0 keeps only the clients that lower
      the optimization term. Every available client reports its loss on one batch of
      the current model (the strategy computes it: ``needs_losses``), also those CA-Fed
      excludes; :attr:`excluded` holds the available clients excluded this round.

    α is the aggregator's target weights p. π and λ are the availability model's
    (``estimate=False``, the thesis's oracle runs) or Beta-prior estimates from the
    observed sets (``estimate=True``, ``prior`` = (n, m)); with ``history`` = t′ the
    estimator first sees t′ rounds of the same chains before training starts (the thesis's
    estimator experiment, Fig. 2.14: training round t is the chains' round t′ + t). The
    weights are not normalized per round (except AdaFed's), as in the CA-Fed authors' code
    (arodio/CA-Fed, ``clients_sampler.py``: CA-Fed's allocation α_k/π_k goes to the
    aggregator as it is): the server learning rate η̄ is the aggregator's ``server_lr``.
    ``normalize_weights=True`` rescales any selector's weights to sum to 1 over the round's
    participants, as AdaFed does (issue 40's probe of CA-Fed; not the authors'). A round
    with no available client trains nobody.
    """

    SELECTORS = ("unbiased", "more_available", "adafed", "f3ast", "ca_fed")

    def __init__(
        self,
        availability: Any,
        selector: Literal["unbiased", "more_available", "adafed", "f3ast", "ca_fed"] = "unbiased",
        min_availability: float = 0.5,
        clients_per_round: int = 45,
        smoothness: float = 0.01,
        kappa2: float = 1.0,
        tolerance: float = 0.0,
        loss_beta: float = 1.0,
        estimate: bool = False,
        prior: tuple[float, float] = (1.0, 1.0),
        history: int = 0,
        normalize_weights: bool = False,
    ) -> None:
        super().__init__(renormalize=False)
        if history < 0:
            raise ValueError(
                f"history (t′, rounds observed before training) must be >= 0, got {history}."
            )
        if selector not in self.SELECTORS:
            raise ValueError(
                f"selector must be one of {', '.join(self.SELECTORS)}; got {selector!r}."
            )
        if not kappa2 >= 0:
            raise ValueError(f"kappa2 (κ̄²) must be >= 0, got {kappa2}.")
        if not 0 <= smoothness <= 1:
            raise ValueError(f"smoothness must be in [0, 1], got {smoothness}.")
        if clients_per_round < 1:
            raise ValueError(f"clients_per_round must be >= 1, got {clients_per_round}.")
        self.availability, self.selector = availability, selector
        self.min_availability, self.clients_per_round = min_availability, clients_per_round
        self.smoothness, self.kappa2, self.tolerance = smoothness, kappa2, tolerance
        self.estimate, self.history = estimate, history
        self.normalize_weights = normalize_weights or selector == "adafed"
        self.estimator = AvailabilityEstimator(prior)
        self.filter = LossFilter(loss_beta)
        self.needs_losses = selector == "ca_fed"
        #: set by the strategy before :meth:`sample` when ``needs_losses``: the loss of the
        #: current global model on one batch of each given client
        self.losses: Any = None
        self.rates: torch.Tensor | None = None
        self.excluded: tuple[int, ...] = ()

    def _activity(self, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(π, λ) per client: the model's, or the estimates; λ only for CA-Fed, the one
        selector that reads it (None for the others: a pass over the population less)."""
        if self.estimate:
            lam = self.estimator.correlation() if self.selector == "ca_fed" else None
            return self.estimator.availability(), lam
        pi = self.availability.stationary(n)
        if self.selector != "ca_fed":
            return pi, None
        lam_of = getattr(self.availability, "correlation", None)
        lam = lam_of(n) if lam_of is not None else torch.zeros(n, dtype=torch.float64)
        return pi, lam

    def _available(self, round_idx: int, seed: int, p: torch.Tensor) -> torch.Tensor:
        """A_t as sorted client ids, clients of weight 0 left out: from the model's
        ``active_clients`` when it has one (no pass over the population), else its mask."""
        n = len(p)
        active_clients = getattr(self.availability, "active_clients", None)
        if active_clients is not None:
            clients = active_clients(round_idx, seed, n)
        else:
            clients = torch.nonzero(self.availability.available(round_idx, seed, n)).flatten()
        if self._derived_from(p, "all_positive", lambda w: bool((w > 0).all())):
            return clients
        return clients[p[clients] > 0]

    def sample(self, round_idx: int, seed: int, p: torch.Tensor) -> Participation:
        p = self._checked(p)
        n = len(p)
        if self.estimate and self.estimator.rounds == 0:  # t′ rounds seen before training
            for past in range(self.history):
                self.estimator.observe_clients(self._available(past, seed, p), n)
        clients = self._available(self.history + round_idx, seed, p)
        if self.estimate:  # the oracle runs read the model's π and λ: no estimator state
            self.estimator.observe_clients(clients, n)
        if self.selector in ("unbiased", "adafed"):
            return self._every_available(p, clients, n)
        available = torch.zeros(n, dtype=torch.bool)
        available[clients] = True
        pi, lam = self._activity(n)
        q = p / pi
        self.excluded = ()
        if self.selector == "more_available":
            kept = pi >= self.min_availability
            if not bool((kept & (p > 0)).any()):
                raise ValueError(
                    f"No client has π_k >= min_availability={self.min_availability}: lower it."
                )
            q = torch.where(kept, q / p[kept].sum(), torch.zeros_like(q))
            available &= kept
        elif self.selector == "f3ast":
            q, available = self._f3ast(p, pi, available)
        elif self.selector == "ca_fed":
            q = self._ca_fed(p, pi, lam, available)
            kept = available & (q > 0)
            self.excluded = tuple(torch.nonzero(available & ~kept).flatten().tolist())
            available = kept
        if self.normalize_weights:
            total = float(q[available].sum())
            q = q / total if total > 0 else q
        clients = torch.nonzero(available).flatten().tolist()
        return Participation(tuple(clients), tuple(float(q[c]) for c in clients))

    def _every_available(self, p: torch.Tensor, clients: torch.Tensor, n: int) -> Participation:
        """Unbiased and AdaFed: every available client k, q_k = α_k/π_k (normalized over
        A_t for AdaFed), computed for the available clients only."""
        if self.estimate:
            pi = self.estimator.availability(clients)
        else:
            pi = self.availability.stationary(n)[clients]
        q = p[clients] / pi
        if self.normalize_weights:
            total = float(q.sum())
            q = q / total if total > 0 else q
        return Participation(tuple(clients.tolist()), tuple(q.tolist()))

    def _f3ast(self, p, pi, available):
        if self.rates is None:
            self.rates = pi.clone()
        self.rates = (1 - self.smoothness) * self.rates + self.smoothness * available.double()
        rates = self.rates.clamp_min(1e-12)
        score = torch.where(available, p**2 / rates**2, torch.full_like(p, -1.0))
        chosen = torch.zeros_like(available)
        count = min(self.clients_per_round, int(available.sum()))
        if count:
            chosen[torch.argsort(score, descending=True, stable=True)[:count]] = True
        return p / rates, chosen

    def _ca_fed(self, p, pi, lam, available):
        if self.losses is None:
            raise RuntimeError("CA-Fed needs the clients' losses: run it inside FederatedStrategy.")
        clients = torch.nonzero(available).flatten().tolist()
        losses = torch.zeros(len(p), dtype=torch.float64)
        if clients:
            losses[clients] = torch.as_tensor(self.losses(clients), dtype=torch.float64)
        self.filter.update(available, losses)
        gap = (self.filter.estimate - self.filter.minimum).clamp_min(0.0)
        q = torch.where(p > 0, p / pi, torch.zeros_like(p))
        eligible = [k for k in range(len(p)) if p[k] > 0]
        by_correlation = sorted(eligible, key=lambda k: (-abs(float(lam[k])), k))
        q = truncate(q, by_correlation, p, gap, pi, self.kappa2, self.tolerance)
        by_availability = sorted(eligible, key=lambda k: (float(pi[k]), k))
        return truncate(q, by_availability, p, gap, pi, self.kappa2, self.tolerance)

    def round_metrics(self) -> dict[str, float]:
        return {"fl/excluded": float(len(self.excluded))}

    def state_dict(self) -> dict[str, Any]:
        return {"availability": self.availability.state_dict(),
                "estimator": self.estimator.state_dict(), "filter": self.filter.state_dict(),
                "rates": self.rates}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "availability" not in state:  # checkpoints from before the CA-Fed selectors
            self.availability.load_state_dict(state)
            return
        self.availability.load_state_dict(state["availability"])
        self.estimator.load_state_dict(state["estimator"])
        self.filter.load_state_dict(state["filter"])
        self.rates = state["rates"]


class ClusteredSampler(_FixedSizeSampler):
    """Clustered sampling (Fraboni et al., ICML 2021; Fraboni thesis Ch. 3, §3.3): one
    client from each of m distributions W_k with P(l_k = i) = r_ki, aggregated as MD,
    ω_i = (number of draws of i)/m. It is unbiased when every row of r sums to 1 (eq. 3.7)
    and every column to m·p_i (eq. 3.8), and then Var[ω_i] = Σ_k r_ki(1 − r_ki)/m² is at
    most MD's p_i(1 − p_i)/m. Subclasses build r.
    """

    def distributions(self, p: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        """r: [m, n], float64; ``gen`` is the round's generator, for samplers whose r has
        a random part."""
        raise NotImplementedError

    def _draw(self, p: torch.Tensor, gen: torch.Generator) -> dict[int, float]:
        m = self.clients_per_round
        r = self.distributions(p, gen)
        draws = [int(torch.multinomial(r[k], 1, generator=gen)) for k in range(m)]
        return {i: count / m for i, count in Counter(draws).items()}


class SampleSizeClusteredSampler(ClusteredSampler):
    """Clustered sampling by sample size (thesis Alg. 2, ICML Alg. 1).

    Client i owns m·p_i of the m distributions' total mass. Clients are taken by
    decreasing p_i and their mass is poured into the distributions in turn, each of
    capacity 1, a client spilling into the next distribution when one is full. The masses
    are integers, as in the thesis (m·n_i sample units in distributions of capacity
    Σ n_i): p is read back as exact fractions n_i/N when it is one (sample counts give
    that), so the rows sum to 1 and the columns to m·p_i exactly. Other p are scaled to
    m·10¹⁰ units as in the authors' code, rounded by largest remainders so that they sum
    exactly (the authors truncate, which can leave 10⁻¹⁰ of a client in the next
    distribution). r is computed once and again only when p changes.
    A client is drawn at most ⌊m·p_i⌋ + 2 times; with equal p_i and m dividing the number
    of clients, the distributions are disjoint and this is uniform sampling without
    replacement.
    """

    UNITS = 10**10

    def __init__(self, clients_per_round: int, renormalize: bool = False) -> None:
        super().__init__(clients_per_round, renormalize)
        self._cache: tuple[tuple[float, ...], torch.Tensor] | None = None

    def distributions(self, p: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        key = tuple(p.tolist())
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        m, n = self.clients_per_round, len(p)
        self.check(int((p > 0).sum()))
        units, capacity = _integer_masses(p, m, self.UNITS)
        order = sorted(range(n), key=lambda i: (-units[i], i))
        filled = [[0] * n for _ in range(m)]
        k, level = 0, 0
        for i in order:
            left = units[i]
            while left > 0 and k < m:
                put = min(capacity - level, left)
                filled[k][i] += put
                level, left = level + put, left - put
                if level == capacity:
                    k, level = k + 1, 0
        r = torch.tensor(filled, dtype=torch.float64)
        r = r / r.sum(dim=1, keepdim=True)
        self._cache = (key, r)
        return r


class FixedClustersSampler(ClusteredSampler):
    """One client from each of m given clusters, with probability ∝ p_i within its
    cluster: r_ki = p_i / P_k for i in cluster k (P_k its total weight). The oracle of the
    clustered-sampling experiments (thesis §3.4: one client per digit). Unbiased (eq. 3.8)
    exactly when every cluster carries weight P_k = 1/m, which is checked.
    """

    traits = {Trait.FIXED_TO_ITS_TARGET_WEIGHTS: ""}

    def __init__(self, clusters: list[list[int]], renormalize: bool = False) -> None:
        super().__init__(len(clusters), renormalize)
        if any(not c for c in clusters) or len({i for c in clusters for i in c}) != sum(
            len(c) for c in clusters
        ):
            raise ValueError("clusters must be non-empty and disjoint lists of client ids.")
        self.clusters = [list(c) for c in clusters]

    def distributions(self, p: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        m = len(self.clusters)
        r = torch.zeros(m, len(p), dtype=torch.float64)
        for k, cluster in enumerate(self.clusters):
            r[k, cluster] = p[cluster] / p[cluster].sum()
        if not torch.allclose(r.sum(0), m * p, atol=1e-9):
            raise ValueError(
                "FixedClustersSampler is unbiased only when every cluster carries weight "
                "1/m of p; regroup the clients or use SampleSizeClusteredSampler."
            )
        return r


class SimilarityClusteredSampler(ClusteredSampler):
    """Clustered sampling by model similarity (Fraboni et al., ICML 2021, Alg. 2; thesis
    Alg. 3), recomputed every round from every client's representative gradient
    G_i = θ_i^{t+1} − θ^t of its last participation (0 before its first):

    1. ρ_ij = s(G_i, G_j), with s ``"arccos"`` (arccos of the cosine, 0 when a norm is 0),
       ``"L2"`` (Σ(G_i − G_j)², no square root) or ``"L1"`` (Σ|G_i − G_j|), as in the
       authors' code;
    2. Ward hierarchical clustering (SciPy); by default on the condensed distance matrix
       ρ, so that ρ is read as distances. ``authors_linkage=True`` calls
       ``linkage(ρ, "ward")`` on the n×n matrix itself, as the authors' code does (SciPy
       then reads its rows as observation vectors);
    3. the tree is cut into the maximal groups of weight Σ p_i ≤ 1/m (the merge heights
       replaced by the groups' weights, then ``fcluster(t=1/m)``);
    4. the m heaviest groups each open a distribution with mass m·p_i per client; the
       other groups, lightest first and their clients in a random order seeded from
       (seed, round), are poured into the distributions, lightest first, each filled to 1
       before the next (a client may be split between two).

    Clients with m·p_i ≥ 1 first get ⌊m·p_i⌋ distributions of their own. Rows sum to 1
    and columns to m·p_i (eqs. 3.7–3.8). The G_i are the sampler's state (``n × d``
    float32, in checkpoints); each round's participants' updates reach every rank through
    the round's all-reduce, so several processes draw the same clients.
    """

    needs_updates = True

    def __init__(
        self,
        clients_per_round: int,
        similarity: Literal["arccos", "L2", "L1"] = "arccos",
        authors_linkage: bool = False,
        renormalize: bool = False,
    ) -> None:
        super().__init__(clients_per_round, renormalize)
        if similarity not in ("arccos", "L2", "L1"):
            raise ValueError(f"similarity must be 'arccos', 'L2' or 'L1', got {similarity!r}.")
        self.similarity, self.authors_linkage = similarity, authors_linkage
        self.gradients: torch.Tensor | None = None

    def observe(self, clients: tuple[int, ...], updates: torch.Tensor, num_clients: int) -> None:
        if self.gradients is None or self.gradients.shape != (num_clients, updates.shape[1]):
            self.gradients = torch.zeros(num_clients, updates.shape[1])
        self.gradients[list(clients)] = updates.detach().float().cpu()

    def similarity_matrix(self) -> torch.Tensor:
        g = self.gradients.double()
        if self.similarity == "arccos":
            norms = g.norm(dim=1)
            cosine = (g @ g.T) / (norms[:, None] * norms[None, :]).clamp_min(1e-300)
            rho = torch.arccos(cosine.clamp(-1.0, 1.0))
            rho[(norms[:, None] == 0) | (norms[None, :] == 0)] = 0.0
        elif self.similarity == "L2":
            rho = torch.cdist(g, g).pow(2)
        else:
            rho = torch.cdist(g, g, p=1)
        rho.fill_diagonal_(0.0)
        return rho

    def groups(self, p: torch.Tensor) -> list[list[int]]:
        """The maximal subtrees of the Ward tree with weight ≤ 1/m (step 3)."""
        from scipy.cluster.hierarchy import fcluster, linkage
        from scipy.spatial.distance import squareform

        eligible = torch.nonzero(p > 0).flatten().tolist()
        if len(eligible) == 1:
            return [eligible]
        rho = self.similarity_matrix()[eligible][:, eligible].numpy()
        rho = (rho + rho.T) / 2
        tree = linkage(rho if self.authors_linkage else squareform(rho, checks=False), "ward")
        weights = [float(p[i]) for i in eligible]
        for row in tree:  # merge heights -> the weight of the merged group
            weights.append(weights[int(row[0])] + weights[int(row[1])])
            row[2] = weights[-1]
        labels = fcluster(tree, t=1.0 / self.clients_per_round + 1e-12, criterion="distance")
        found: dict[int, list[int]] = {}
        for client, label in zip(eligible, labels):
            found.setdefault(int(label), []).append(client)
        return list(found.values())

    def distributions(self, p: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
        m, n = self.clients_per_round, len(p)
        self.check(int((p > 0).sum()))
        if self.gradients is None:
            self.gradients = torch.zeros(n, 1)
        mass = (m * p).tolist()
        rows: list[list[float]] = []
        for i in range(n):  # clients heavier than one distribution get their own
            while mass[i] >= 1.0 - 1e-12 and len(rows) < m:
                rows.append([1.0 if j == i else 0.0 for j in range(n)])
                mass[i] = max(0.0, mass[i] - 1.0)
        rest = torch.tensor(mass, dtype=torch.float64) / m
        groups = self.groups(rest) if float(rest.sum()) > 0 else []
        groups.sort(key=lambda g: -sum(mass[i] for i in g))
        free = m - len(rows)
        kept, leftover = groups[:free], groups[free:]
        bins = [[0.0] * n for _ in kept]
        for b, group in zip(bins, kept):
            for i in group:
                b[i] = mass[i]
        leftover.sort(key=lambda g: sum(mass[i] for i in g))
        gen = gen or torch.Generator().manual_seed(0)
        order = sorted(range(len(bins)), key=lambda b: sum(bins[b]))
        position = 0
        for group in leftover:
            for j in torch.randperm(len(group), generator=gen).tolist():
                left = mass[group[j]]
                while left > 1e-15 and position < len(order):
                    b = bins[order[position]]
                    put = min(1.0 - sum(b), left)
                    b[group[j]] += put
                    left -= put
                    if sum(b) >= 1.0 - 1e-12:
                        position += 1
                if left > 1e-15:  # rounding: the last distribution takes the crumbs
                    bins[order[-1]][group[j]] += left
        r = torch.tensor(rows + bins, dtype=torch.float64)
        return r / r.sum(dim=1, keepdim=True)

    def state_dict(self) -> dict[str, Any]:
        return {"gradients": self.gradients}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gradients = state.get("gradients")


def _integer_masses(p: torch.Tensor, m: int, units: int) -> tuple[list[int], int]:
    """Integer masses m·p_i and the capacity of one distribution: exact when p holds
    fractions n_i/N (denominators up to 10⁹), else ``units`` per distribution with the
    masses rounded by largest remainders to sum to m·units exactly."""
    fractions = [Fraction(float(w)).limit_denominator(10**9) for w in p]
    if sum(fractions) == 1:
        capacity = math.lcm(*(f.denominator for f in fractions))
        if capacity <= 10**15:
            return [int(f * m * capacity) for f in fractions], capacity
    total = m * units
    shares = [float(w) / float(p.sum()) * total for w in p]
    masses = [int(x) for x in shares]
    by_remainder = sorted(range(len(p)), key=lambda i: (-(shares[i] - masses[i]), i))
    for i in by_remainder[: total - sum(masses)]:
        masses[i] += 1
    return masses, units


def _check_target_weights(p: torch.Tensor) -> torch.Tensor:
    p = torch.as_tensor(p, dtype=torch.float64)
    if p.ndim != 1 or len(p) == 0:
        raise ValueError("Target weights p must be a non-empty 1-D tensor.")
    if not torch.isfinite(p).all() or (p < 0).any():
        raise ValueError("Target weights p must be finite and non-negative.")
    if abs(float(p.sum()) - 1.0) > 1e-6:
        raise ValueError(f"Target weights p must sum to 1, got {float(p.sum())}.")
    return p
