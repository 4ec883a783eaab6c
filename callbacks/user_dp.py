"""User-level differential privacy: DP-FedAvg (McMahan et al., ICLR 2018, Alg. 1) with
fixed or adaptive clipping (Andrew et al., NeurIPS 2021, Alg. 1) and its accounting.

The mathematics is :mod:`lightning_fl.systems.user_dp`; this plugin places it in the
round:

1. **weights** (:meth:`DPFedAvg.target_weights`): the bounded weights w_k = min(n_k/ŵ, 1)
   (``weighting="samples"``) or w_k = 1 (``"uniform"``) become the target weights
   p_k = w_k/W, so that the sampler's unbiased ω_k (uniform without replacement:
   (n/m)p_k; Poisson: p_k/q; full participation: p_k) are w_k/(qW), the paper's
   fixed-denominator estimator f̃_f;
2. **clipping**: each update Δ_k scaled to norm at most C: by the server as the update
   arrives (``noise="central"``, :meth:`DPFedAvg.receive_update`, after any attack), or
   by the client before it sends it (``noise="local"``);
3. **noise**: N(0, σ²) on the estimate, σ = zC/(qW) (f̃_f) or 2zC/(qW_min) (f̃_c): drawn
   by the server (``noise="central"``), or split over the round's K participants, each
   adding its share N(0, σ²/K)/ω_k to what it sends, so that the weighted sum carries the
   same N(0, σ²) (``"local"``), or split over the W sites (ranks), each adding
   N(0, σ²/(W − t)) to its part of the round's sum before that part leaves the site
   (``"distributed"``: distributed DP, Kairouz, Liu, Steinke 2021, §1, with Gaussian
   shares; the sum carries N(0, σ²W/(W − t)), and any W − t sites' shares alone carry
   σ², so the guarantee holds against every coalition of t sites, who know their own
   shares, and the server). In a simulation the noise is drawn from (seed, tag, keys):
   anyone with the recipe can draw it again; when the sites are separate institutions
   (``FederatedStrategy(silos=...)``) it comes from the site's operating system
   (:mod:`lightning_fl.systems.privacy_noise`), and central noise, which every site would
   see the sum without, is refused (the trait ``draws server-side randomness``);
4. **adaptive clipping** (``target_quantile`` set): the noised fraction of unclipped
   updates b̃ = (Σ b_k + N(0, σ_b²))/(qn) moves C geometrically toward the γ-quantile of
   the norms, and the updates' noise uses z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2);
5. **accounting**: ε of the rounds so far, by dp-accounting (RDP or PLD) for the
   sampling actually used, logged as ``dp/epsilon`` every round; a run whose planned
   rounds exceed ``epsilon_budget`` is refused before it trains, unless
   ``allow_over_budget``.

**Noise in the integers** (``mechanism="discrete_gaussian"``, with distributed noise and
full participation): each site rounds each clipped, weighted contribution ω_k clip(Δ_k)
onto the grid γ = 2^−g by conditional randomized rounding and adds a share of discrete
Gaussians N_Z(0, (σ/(γ√(W − t)))²) (Kairouz, Liu, Steinke, ICML 2021, Alg. 1, without the
rotation a small modulus needs: :mod:`lightning_fl.systems.discrete_gaussian`); every
value is a multiple of γ, so sums over clients and sites, and SecureAggregation's fixed
point (``fraction_bits`` ≥ g), are exact (no floating-point artefact: Mironov 2012), and ε
is DDG's accountant (Prop. 14 with Thm 1's τ, over the n = W − t shares).

What the server sees: with central noise, each clipped update (a trusted server, the
paper's model); with local noise, each update with its share of the noise, which on its
own is a weak guarantee (σ/√K): use it under secure aggregation, where only the sum is
seen; with distributed noise, each site's part of the sum with its share, σ/√(W − t):
under :class:`~lightning_fl.callbacks.SecureAggregation` only the noised total is ever
decoded, by anyone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_fl.checks import require_rate
from lightning_fl.engine import collectives
from lightning_fl.engine.plugins import Aggregator, RoundState, Trait, Weighting
from lightning_fl.engine.tensors import (
    TensorList,
    add_flat_,
    flat_size,
    flatten,
    unflatten,
    zeros_like,
)
from lightning_fl.systems.discrete_gaussian import DEFAULT_BETA, DiscreteGaussianShares
from lightning_fl.systems.privacy_noise import NoiseSource, noise_source
from lightning_fl.systems.samplers import (
    ClientSampler,
    FullParticipation,
    Participation,
    PoissonSampler,
    UniformSampler,
)
from lightning_fl.systems.user_dp import (
    Accountant,
    Estimator,
    Sampling,
    bounded_weights,
    epsilon,
    next_clip_norm,
    noise_std,
    update_noise_multiplier,
)


def sampling_of(sampler: ClientSampler, eligible: int) -> Sampling:
    """The accountant's view of ``sampler`` over ``eligible`` clients; a sampler whose
    inclusion probabilities are not one known q is refused."""
    if getattr(sampler, "renormalize", False):
        raise ValueError(
            f"DPFedAvg needs the unbiased weights of {type(sampler).__name__}: "
            "renormalize=True divides by the sampled weights. Set renormalize=False."
        )
    if type(sampler) is FullParticipation:
        return Sampling.full()
    if type(sampler) is UniformSampler:
        return Sampling.fixed(sampler.clients_per_round, eligible)
    if type(sampler) is PoissonSampler:
        return Sampling.poisson(sampler.rate)
    raise ValueError(
        f"DPFedAvg cannot account for {type(sampler).__name__}: its noise and ε need one "
        "known inclusion probability q per round. Use UniformSampler, PoissonSampler or "
        "FullParticipation."
    )


@dataclass(frozen=True)
class Population:
    """What DP-FedAvg's noise and ε read of a fit's users (McMahan et al. 2018, Alg. 1):
    the bounded weights' total W = Σ_k w_k, the users with w_k > 0, and how a round draws
    them (``sampling``: q)."""

    total_weight: float
    eligible: int
    sampling: Sampling


class DPFedAvg(Aggregator):
    """DP-FedAvg (McMahan et al., ICLR 2018, Alg. 1): user-level differential privacy by
    clipping each client's update to norm C and adding Gaussian noise to the weighted
    average, with adaptive clipping (Andrew et al., NeurIPS 2021, Alg. 1) and ε tracked
    by dp-accounting.

    Args:
        noise_multiplier: z, the noise's std in units of the sensitivity.
        clip_norm: C (the initial C^0 with adaptive clipping).
        noise: ``"central"`` (the server clips and adds the noise), ``"local"`` (each
            client clips and adds its share) or ``"distributed"`` (the server clips, each
            site adds its share to its part of the round's sum before it is sent).
        colluding_sites: t of distributed noise: the shares are scaled so that any W − t
            of the W sites carry the whole σ², and ε (``dp/epsilon``) holds against t
            sites that pool their own shares (0: against the server and outsiders only;
            a site knows its own share). Where the transport lets sites drop
            (``FlowerSite(min_sites=m)``), W is m: any m − t of the sites that remain
            carry σ² (a round with more sites carries more noise).
        estimator: ``"fixed"`` (f̃_f, denominator qW) or ``"clipped"`` (f̃_c, denominator
            max(qW_min, Σ_{k∈C} w_k); central noise only).
        min_weight: W_min of the clipped estimator.
        example_cap: ŵ of w_k = min(n_k/ŵ, 1); None: the largest n_k.
        weighting: ``"samples"`` (w_k from the sample counts) or ``"uniform"`` (w_k = 1).
        target_quantile: γ of adaptive clipping; None keeps C fixed.
        clip_lr: η_C of adaptive clipping.
        count_std: σ_b, the noise on the count of unclipped updates; None: qn/20 (Andrew
            et al. §5, with qn the expected participants).
        server_lr: η_s.
        server_momentum: β of Δ̄ = βΔ̄ + (1 − β)Δ̃ (Andrew et al. Alg. 1; 0: none).
        delta: δ of the reported ε.
        epsilon_budget: the largest ε the planned rounds may spend; None: no limit.
        allow_over_budget: train even when the planned rounds exceed the budget.
        accountant: ``"rdp"`` or ``"pld"`` (Poisson and full participation only).
        mechanism: ``"gaussian"`` (float noise) or ``"discrete_gaussian"`` (integer noise on
            the grid 2^−``granularity_bits``: distributed noise and full participation).
        granularity_bits: g of the discrete mechanism's grid γ = 2^−g (at most
            SecureAggregation's ``fraction_bits``, so that its encoding is exact).
        rounding_beta: β of the discrete mechanism's conditional randomized rounding.
        seed: the simulated noise's seed, mixed with a tag and the round (the client for
            local noise, the rank for distributed noise); unused when the sites are
            separate institutions (silo mode), whose noise is secret.
    """

    traits = {
        Trait.NEEDS_INCLUSION_PROBABILITY: "",
        Trait.BOUNDS_THE_SUMS_SENSITIVITY: "",
        Trait.STEPS_OTHERWISE_THAN_FEDAVG: "",
        Trait.DRAWS_SERVER_RANDOMNESS: (
            "DPFedAvg(noise='distributed'): each site adds its share of the noise to its part "
            "of the round's sum before it leaves the site (with SecureAggregation, no party "
            "decodes a noiseless sum)"
        ),
    }

    supports_vectorized_clients = True
    aggregates_empty_rounds = True  # a Poisson round without participants is still noised

    def __init__(
        self,
        noise_multiplier: float = 1.0,
        clip_norm: float = 1.0,
        noise: Literal["central", "local", "distributed"] = "central",
        colluding_sites: int = 0,
        estimator: Estimator = "fixed",
        min_weight: float | None = None,
        example_cap: float | None = None,
        weighting: Weighting = "samples",
        target_quantile: float | None = None,
        clip_lr: float = 0.2,
        count_std: float | None = None,
        server_lr: float = 1.0,
        server_momentum: float = 0.0,
        delta: float = 1e-5,
        epsilon_budget: float | None = None,
        allow_over_budget: bool = False,
        accountant: Accountant = "rdp",
        mechanism: Literal["gaussian", "discrete_gaussian"] = "gaussian",
        granularity_bits: int = 24,
        rounding_beta: float = DEFAULT_BETA,
        seed: int = 0,
    ) -> None:
        super().__init__(weighting)
        self.noise_multiplier = require_rate("noise_multiplier", noise_multiplier, 1.0, True)
        self.initial_clip_norm = require_rate("clip_norm", clip_norm, 1.0)
        if noise not in ("central", "local", "distributed"):
            raise ValueError(f"noise must be 'central', 'local' or 'distributed', got {noise!r}.")
        if (
            isinstance(colluding_sites, bool)
            or not isinstance(colluding_sites, int)
            or (colluding_sites < 0)
        ):
            raise ValueError(f"colluding_sites must be an integer >= 0, got {colluding_sites!r}.")
        if colluding_sites and noise != "distributed":
            raise ValueError(
                f"colluding_sites={colluding_sites} scales the sites' shares of distributed "
                f"noise, but noise={noise!r}: set noise='distributed', or colluding_sites=0."
            )
        if estimator not in ("fixed", "clipped"):
            raise ValueError(f"estimator must be 'fixed' or 'clipped', got {estimator!r}.")
        if estimator == "clipped" and (min_weight is None or not min_weight > 0):
            raise ValueError("estimator='clipped' needs min_weight > 0 (W_min), e.g. 1.0.")
        if estimator == "clipped" and noise != "central":
            raise ValueError(
                "estimator='clipped' divides by the round's weight, known only to the server: "
                f"use noise='central', or estimator='fixed' with {noise} noise."
            )
        if target_quantile is not None and not 0 <= target_quantile <= 1:
            raise ValueError(f"target_quantile must be in [0, 1], got {target_quantile}.")
        if not 0 <= server_momentum < 1:
            raise ValueError(f"server_momentum must be in [0, 1), got {server_momentum}.")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}.")
        if accountant not in ("rdp", "pld"):
            raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}.")
        if count_std is not None:
            require_rate("count_std", count_std, 1.0)
        if example_cap is not None:
            require_rate("example_cap", example_cap, 100.0)
        self._check_mechanism(mechanism, noise, target_quantile, granularity_bits, rounding_beta)
        self.mechanism, self.granularity_bits = mechanism, granularity_bits
        self.rounding_beta = rounding_beta
        self._grid: DiscreteGaussianShares | None = None
        self.noise, self.estimator, self.min_weight = noise, estimator, min_weight
        self.colluding_sites = colluding_sites
        self.example_cap, self.target_quantile = example_cap, target_quantile
        self.clip_lr = require_rate("clip_lr", clip_lr, 0.2, allow_zero=True)
        self.count_std, self.server_lr = count_std, require_rate("server_lr", server_lr, 1.0)
        self.server_momentum, self.delta = server_momentum, delta
        self.epsilon_budget, self.allow_over_budget = epsilon_budget, allow_over_budget
        self.accountant, self.seed = accountant, seed
        self.add_server_state("clip_norm", self.initial_clip_norm)  # C_t (adaptive)
        self.add_server_state("momentum")  # the server momentum's buffer
        if target_quantile is not None:
            self.add_round_sum("unclipped", shape=(1,), bound=1.0)  # b_t's count
        self._planned_rounds: int | None = None
        self._sites, self._rank = 1, 0  # W and this site's rank, read at the fit's start
        #: W, the eligible users and q of this fit, read from its counts and sampler at
        #: its first round (None before)
        self.population: Population | None = None
        #: What the last round logged: ε, C, σ and the noised unclipped fraction.
        self.last: dict[str, float] = {}

    def declared_traits(self) -> dict[str, str]:
        """The class's traits; server-side randomness only where the server draws noise
        (central noise, or adaptive clipping's count noise with local noise)."""
        traits = super().declared_traits()
        if self.noise_multiplier == 0 or not (
            self.noise == "central" or (self.noise == "local" and self.target_quantile is not None)
        ):
            del traits[Trait.DRAWS_SERVER_RANDOMNESS]
        return traits

    @staticmethod
    def _check_mechanism(mechanism, noise, target_quantile, bits, beta) -> None:
        if mechanism not in ("gaussian", "discrete_gaussian"):
            raise ValueError(
                f"mechanism must be 'gaussian' or 'discrete_gaussian', got {mechanism!r}."
            )
        if mechanism == "gaussian":
            return
        if noise != "distributed":
            raise ValueError(
                "mechanism='discrete_gaussian' adds each site's integer share before the sum: "
                f"set noise='distributed' (got noise={noise!r})."
            )
        if target_quantile is not None:
            raise ValueError(
                "mechanism='discrete_gaussian' has no integer noise for adaptive clipping's "
                "count: set target_quantile=None (a fixed clip_norm)."
            )
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 40:
            raise ValueError(f"granularity_bits must be an integer in [1, 40], got {bits!r}.")
        if not 0 <= beta < 1:
            raise ValueError(f"rounding_beta must be in [0, 1), got {beta}.")

    @property
    def discrete(self) -> bool:
        return self.mechanism == "discrete_gaussian"

    # ------------------------------------------------------------------ weights and q
    def user_weights(self, sample_counts) -> np.ndarray:
        """w_k: 1 for each user with data (``weighting="uniform"``), else the bounded
        min(n_k/ŵ, 1) (McMahan et al. 2018, Alg. 1). Host bookkeeping of the counts."""
        counts = np.asarray(sample_counts)
        if self.weighting == "uniform":
            return (counts > 0).astype(np.float64)
        return bounded_weights(counts, self.example_cap)

    def target_weights(self, sample_counts) -> torch.Tensor:
        """p_k = w_k/W (McMahan et al. 2018, Alg. 1)."""
        w = self.user_weights(sample_counts)
        # host: p is bookkeeping of the sample counts, read by the samplers on the host
        return torch.from_numpy(w / w.sum())

    def participation(
        self, round_idx: int, seed: int, p: torch.Tensor, sampler: ClientSampler
    ) -> Participation:
        if self.population is None:
            w = self.user_weights(self.view.sample_counts)
            eligible = int(np.count_nonzero(w))
            self.population = Population(float(w.sum()), eligible, sampling_of(sampler, eligible))
            if self.discrete and self.sampling.rate != 1:
                raise ValueError(
                    f"DPFedAvg(mechanism='discrete_gaussian') accounts for full participation "
                    f"only (its accountant has no amplification by sampling), but "
                    f"{type(sampler).__name__} draws q={self.sampling.rate:.4g}: use "
                    "FullParticipation, or mechanism='gaussian'."
                )
            self._check_budget()
        return super().participation(round_idx, seed, p, sampler)

    @property
    def expected_participants(self) -> float:
        """qn: the clients a round draws on average."""
        return self.sampling.rate * self.population.eligible

    @property
    def sampling(self) -> Sampling:
        """q: how this fit's sampler draws the users (the accountant's view of it)."""
        return self.population.sampling

    @property
    def adaptive(self) -> bool:
        return self.target_quantile is not None

    @property
    def update_noise_multiplier(self) -> float:
        """The updates' noise multiplier: z, or z_Δ with adaptive clipping."""
        if not self.adaptive or self.noise_multiplier == 0:
            return self.noise_multiplier
        return update_noise_multiplier(self.noise_multiplier, self._count_std())

    def _count_std(self) -> float:
        return self.expected_participants / 20 if self.count_std is None else self.count_std

    def epsilon(self, rounds: int) -> float:
        """ε after ``rounds`` rounds at ``delta``, of the whole mechanism's multiplier z
        (with adaptive clipping, the updates' and the count's noise together)."""
        if self.discrete:
            shares = self._sites - self.colluding_sites
            share_std = self.noise_multiplier * self._sensitivity / math.sqrt(shares)
            return self._grid.epsilon(self._sensitivity, share_std, shares, rounds, self.delta)
        return epsilon(self.noise_multiplier, self.sampling, rounds, self.delta, self.accountant)

    @property
    def _sensitivity(self) -> float:
        """C/(qW): the largest norm of one client's term ω_k clip(Δ_k) of the sum."""
        return self.clip_norm / (self.sampling.rate * self.population.total_weight)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sites = trainer.world_size
        if (group := collectives.across_ranks(sites)) is not None:
            sites = group.min_sites(sites)  # the fewest sites a round completes with
        self._start(trainer.max_epochs, sites, trainer.global_rank)

    def on_server_start(self, rounds: int | None) -> None:
        """Flower's server-side mode: the server clips each update as it arrives and adds
        the noise, from its operating system's secret generator (one site: the server);
        with local noise, each node's half clips and noises its own client's update."""
        self._start(rounds, 1, 0)

    def client_side_hooks(self) -> tuple[str, ...]:
        """Local noise acts on the clients (their clipping and shares), distributed noise
        on the sites before their sums leave; central noise is the server's alone."""
        return {"central": (), "local": ("transform_update",),
                "distributed": ("on_before_round_sum",)}[self.noise]  # fmt: skip

    def reads_each_update(self) -> bool:
        """The server clips each update as it arrives with central and distributed noise;
        with local noise each client clips its own."""
        return self.noise != "local"

    def _start(self, rounds: int | None, sites: int, rank: int) -> None:
        """The fit's planned rounds, W sites and this one's rank; the population is read
        again from this fit's counts and sampler at its first round."""
        self._planned_rounds = rounds if (rounds or -1) >= 0 else None
        self.population = None
        if self.colluding_sites >= sites:
            raise ValueError(
                f"DPFedAvg(colluding_sites={self.colluding_sites}) protects against that many "
                f"sites pooling their shares, but a round of the run may have {sites} site(s), "
                f"and at least one share must stay secret: set colluding_sites to at most "
                f"{sites - 1}, or run more sites (or a higher min_sites)."
            )
        self._sites, self._rank = sites, rank
        if self.discrete:  # the exact grid sum, one flat float64 vector of multiples of γ
            dim = flat_size(self.view.tensors.tensors)
            self._grid = DiscreteGaussianShares(self.granularity_bits, self.rounding_beta, dim)
            self.add_round_sum("grid_sum", shape=(dim,), dtype=torch.float64)

    @property
    def noise_source(self) -> NoiseSource:
        """Secret noise when the sites are separate institutions (silo mode) or the server
        is a deployment's (Flower's server-side mode), else the simulation's seeded noise
        (:mod:`lightning_fl.systems.privacy_noise`)."""
        secret = self.view is not None and self.view.config.secret_randomness
        return noise_source(secret, self.seed)

    def _check_budget(self) -> None:
        if self.adaptive and self.noise_multiplier > 0:  # refuses σ_b ≤ z/2 before training
            update_noise_multiplier(self.noise_multiplier, self._count_std())
        if self.epsilon_budget is None or self.allow_over_budget:
            return
        if self._planned_rounds is None:
            raise ValueError(
                "DPFedAvg(epsilon_budget=...) needs a planned number of rounds: set "
                "Trainer(max_epochs=...), or allow_over_budget=True."
            )
        planned = self.epsilon(self._planned_rounds)
        if planned > self.epsilon_budget:
            raise ValueError(
                f"DPFedAvg: {self._planned_rounds} rounds at z={self.noise_multiplier:g} and "
                f"q={self.sampling.rate:.4g} spend ε={planned:.4g} at δ={self.delta:g}, over "
                f"the budget ε={self.epsilon_budget:g}. Train fewer rounds, raise "
                "noise_multiplier, or set allow_over_budget=True."
            )

    # ------------------------------------------------------------------ clients
    def _clipped(self, update: TensorList, state: RoundState) -> TensorList:
        """Δ·min(1, C/‖Δ‖), counting Δ as unclipped when ‖Δ‖ ≤ C."""
        norm = float(torch.linalg.vector_norm(flatten(update).double()))
        if self.adaptive and norm <= self.clip_norm:
            state.round_sum(self, "unclipped")[0] += 1
        if norm <= self.clip_norm:
            return update
        return torch._foreach_mul(update, self.clip_norm / norm)

    def transform_update(self, trainer, pl_module, client: int, update, state: RoundState):
        """Local noise: the client clips its update and adds its share of the noise,
        N(0, σ²/K)/ω_k, so that the weighted sum carries N(0, σ²)."""
        if self.noise != "local":
            return update
        update = self._clipped(update, state)
        share = self._noise_std(state) / math.sqrt(len(state.participation.clients))
        noise = self._gaussian(update, share / state.weight_of(client),
                               "dp_fedavg_local", state.round_idx, client)  # fmt: skip
        update = [u.clone() for u in update]
        add_flat_(update, noise)
        return update

    def receive_update(self, client: int, update: TensorList, state: RoundState) -> TensorList:
        """Central and distributed noise: the server clips each update as it arrives
        (after any attack)."""
        if self.noise == "local":
            return update
        clipped = self._clipped(update, state)
        if not self.discrete:
            return clipped
        values = flatten(clipped).double().cpu().numpy() * state.weight_of(client)
        uniforms = self.noise_source.uniforms("dp_rounding", state.round_idx, client)
        on_grid = self._grid.contribution(values, self._sensitivity, uniforms)
        grid_sum = state.round_sum(self, "grid_sum")[0]
        grid_sum += torch.as_tensor(on_grid, device=grid_sum.device)
        return torch._foreach_mul(update, 0.0)  # its weighted term is in the grid sum

    @torch.no_grad()
    def on_before_round_sum(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: RoundState
    ) -> None:
        """Distributed noise: this site adds its share N(0, σ²/(W − t)) to its part of
        Σ ω_k Δ_k (and N(0, σ_b²/(W − t)) to its count of unclipped updates) before the
        parts are summed over the sites."""
        if self.noise != "distributed" or self.noise_multiplier == 0:
            return
        shares = self._sites - self.colluding_sites
        sigma = self._noise_std(state) / math.sqrt(shares)
        keys = (state.round_idx, self._rank)
        if self.discrete:
            uniforms = self.noise_source.uniforms("dp_fedavg_discrete", *keys)
            grid_sum = state.round_sum(self, "grid_sum")[0]
            share = self._grid.noise_share(sigma, uniforms)  # drawn on the site's CPU
            grid_sum += torch.as_tensor(share, device=grid_sum.device)
            return
        share = self._gaussian(state.update_sum, sigma, "dp_fedavg_distributed", *keys)
        add_flat_(state.update_sum, share)
        if self.adaptive:
            count = self._count_std() / math.sqrt(shares)
            draw = self._normal(1, count, "dp_count_distributed", *keys)
            state.round_sum(self, "unclipped")[0] += float(draw[0])

    # ------------------------------------------------------------------ server
    def _noise_std(self, state: RoundState) -> float:
        return noise_std(
            self.update_noise_multiplier, self.clip_norm, self.sampling.rate,
            self.population.total_weight, self.estimator, self.min_weight,
        )  # fmt: skip

    def _gaussian(self, like: TensorList, std: float, purpose: str, *keys: int) -> torch.Tensor:
        """N(0, std²) noise of ``like``'s total size, from :attr:`noise_source`."""
        return self._normal(flat_size(like), std, purpose, *keys)

    def _normal(self, size: int, std: float, purpose: str, *keys: int) -> torch.Tensor:
        return std * self.noise_source.normal(size, purpose, *keys)

    @torch.no_grad()
    def aggregate(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, state: RoundState
    ) -> None:
        estimate = [u.double() for u in state.update_sum]
        if self.discrete:  # the clients' terms and the noise, exact on the grid
            estimate = unflatten(state.round_sum(self, "grid_sum")[0], estimate)
        if self.estimator == "clipped":
            sampled = sum(state.participation.weights)  # Σ_{k∈C} w_k / (qW)
            total = self.population.total_weight
            torch._foreach_div_(estimate, max(self.min_weight / total, sampled))
        sigma = self._noise_std(state)
        if self.noise == "central" and sigma > 0:
            add_flat_(estimate, self._gaussian(estimate, sigma, "dp_fedavg", state.round_idx))
        if self.server_momentum > 0:
            if self.momentum is None:
                self.momentum = zeros_like(estimate)
            torch._foreach_mul_(self.momentum, self.server_momentum)
            torch._foreach_add_(self.momentum, estimate, alpha=1 - self.server_momentum)
            estimate = self.momentum
        for theta, step in zip(state.global_tensors, estimate):
            theta.add_((self.server_lr * step).to(theta.dtype))
        self.last = {"clip_norm": self.clip_norm, "noise_std": sigma,
                     "epsilon": self.epsilon(state.round_idx + 1)}  # fmt: skip
        if self.adaptive:
            self._adapt_clip_norm(state)

    def _adapt_clip_norm(self, state: RoundState) -> None:
        unclipped = float(state.round_sum(self, "unclipped")[0])
        count_noise = 0.0  # distributed noise: the sites' shares are in the sum already
        if self.noise_multiplier > 0 and self.noise != "distributed":
            draw = self._normal(1, self._count_std(), "dp_count", state.round_idx)
            count_noise = float(draw[0])
        fraction = (unclipped + count_noise) / self.expected_participants
        self.last["unclipped_fraction"] = fraction
        self.clip_norm = next_clip_norm(self.clip_norm, fraction, self.target_quantile,
                                        self.clip_lr)  # fmt: skip

    def round_metrics(self) -> dict[str, float]:
        """``dp/epsilon``, ``dp/clip_norm``, ``dp/noise_std`` (and with adaptive clipping
        ``dp/unclipped_fraction``) of the last round."""
        return {f"dp/{name}": float(value) for name, value in self.last.items()}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        synced = trainer.world_size > 1  # equal on every rank
        for name, value in self.round_metrics().items():
            pl_module.log(name, value, on_epoch=True, sync_dist=synced)


__all__ = ["DPFedAvg", "sampling_of"]
