"""The ways an unlearning request restarts training: SIFU and the baselines of its paper
(Fraboni et al., AISTATS 2024, §5 and App. D.2; Fraboni thesis ch. 5).

Each method is a small object with the one job its paper gives it:
:meth:`ForgettingMethod.restart` returns the model training continues from once a request
W_r is removed (and the node of the branch history it restarts at), and the training-time
hooks of the methods that act during training (the DP baseline's clipping and noise,
FEDACCUM's shadow models) are theirs. :class:`~lightning_fl.callbacks.Unlearning` keeps
the requests, the branch history and the kept model versions, and hands a method a
:class:`ForgettingRequest` holding what it reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_fl.engine.seeding import generator
from lightning_fl.engine.tensors import TensorList
from lightning_fl.systems.unlearning import BranchHistory, ModelVersions, noise_for_sensitivity


def seeded_noise(std: float, like: torch.Tensor, seed: int, *parts: int) -> torch.Tensor:
    """N(0, std² I) shaped like the flat ``like``, drawn in float64 from the CPU generator
    of (seed, "unlearning", *parts), so that every device draws the same noise, then moved
    to ``like``'s device and dtype: the one draw of every noise of unlearning (SIFU's and
    LAST's restarts, the DP baseline's rounds).

    >>> like = torch.zeros(3)
    >>> a, b = seeded_noise(0.5, like, 7, 2, 0), seeded_noise(0.5, like, 7, 2, 0)
    >>> torch.equal(a, b), a.dtype, torch.equal(a, seeded_noise(0.5, like, 7, 2, 1))
    (True, torch.float32, False)
    """
    g = generator(seed, "unlearning", *parts)
    # host: a CPU generator draws the same noise whatever the device; moved to like
    return (std * torch.randn(like.numel(), generator=g, dtype=torch.float64)).to(like)


@dataclass(frozen=True)
class ForgettingRequest:
    """One request as a method sees it: the clients W_r to forget, those removed before,
    the current global model θ (flat), the branch history and kept versions, and the seed
    parts of its noise (the run's seed, then the round and the request's index)."""

    clients: list[int]
    removed: list[int]
    current: torch.Tensor
    history: BranchHistory
    versions: ModelVersions
    seed: int = 0
    draw: tuple[int, ...] = ()

    def noise(self, std: float) -> torch.Tensor:
        """A draw of N(0, std² I) shaped like θ, from the request's seed
        (:func:`seeded_noise`)."""
        return seeded_noise(std, self.current, self.seed, *self.draw)


#: A restart: the flat model to continue from, and the (branch, round) node it is, or
#: None for the current node (the method keeps training the current branch's model).
Restart = tuple[torch.Tensor, tuple[int, int] | None]


class ForgettingMethod:
    """How a request restarts training; the default hooks do nothing during training."""

    name: str = ""

    def restart(self, request: ForgettingRequest) -> Restart:
        raise NotImplementedError

    def check(self, world_size: int) -> None:
        """Refuse a run this method cannot serve (at the fit's start)."""

    def prepare(self, model: torch.Tensor, removal_sets: Sequence[tuple[int, ...]]) -> None:
        """At the first fit's start, with θ_0^0 and the known removal sets F_r."""

    def round_noise_std(self, num_clients: int) -> float | None:
        """The std of the noise added to the global model after this round's aggregation
        in a federation of ``num_clients`` clients, or None for no noise."""
        return None

    def round_noise(
        self, num_clients: int, like: torch.Tensor, seed: int, *parts: int
    ) -> torch.Tensor | None:
        """The noise added to the global model after this round's aggregation (std
        :meth:`round_noise_std`, drawn by :func:`seeded_noise` from ``seed`` and
        ``parts``), or None for no noise."""
        std = self.round_noise_std(num_clients)
        return None if std is None else seeded_noise(std, like, seed, *parts)

    def transform_update(self, update: TensorList) -> TensorList:
        return update

    def after_round(
        self,
        start: torch.Tensor,
        deltas: dict[int, torch.Tensor],
        weights: dict[int, float],
        server_lr: float,
    ) -> None:
        """After aggregation, with the round's starting model θ^t, this rank's accepted
        updates Δ_i, their weights ω_i and the server's step size η_g."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`."""


class Sifu(ForgettingMethod):
    """SIFU (thesis Alg. 7; IFU, Alg. 6, for one request): restart from θ_ζ^T, the last
    kept model of the latest branch ζ_r whose sensitivity to W_r stays under Ψ* before
    round T_r (eqs. 5.17–5.19), plus N(0, σ² I) (eq. 5.13's calibration)."""

    name = "sifu"

    def __init__(self, sigma: float) -> None:
        self.sigma = sigma

    def restart(self, request: ForgettingRequest) -> Restart:
        zeta, t = request.history.fork_point(request.clients)
        t, start = request.versions.restart_model(request.history, zeta, t, request.clients)
        return start + request.noise(self.sigma), (zeta, t)


class Scratch(ForgettingMethod):
    """SCRATCH: retrain from the initial model θ_0^0 (the gold standard: no guarantee to
    prove, the most rounds)."""

    name = "scratch"

    def restart(self, request: ForgettingRequest) -> Restart:
        return request.versions.models[(0, 0)].clone(), (0, 0)


class FineTuning(ForgettingMethod):
    """FINE-TUNING: keep training the current model without the removed clients (no
    forgetting mechanism: the lower reference)."""

    name = "fine_tuning"

    def restart(self, request: ForgettingRequest) -> Restart:
        return request.current, None


class Last(ForgettingMethod):
    """LAST: the current model + N(0, σ_L² I), σ_L = Ψ_max·sqrt(2 ln(1.25/δ))/ε for the
    branch's largest sensitivity Ψ_max (thesis Thm 5.2)."""

    name = "last"

    def __init__(self, epsilon: float, delta: float) -> None:
        self.epsilon, self.delta = epsilon, delta

    def restart(self, request: ForgettingRequest) -> Restart:
        psi = request.history.max_sensitivity()
        std = noise_for_sensitivity(psi, self.epsilon, self.delta)
        return request.current + request.noise(std), None


class DPBaseline(ForgettingMethod):
    """DP: training itself is kept private, so a request keeps the current model. Every
    client update is clipped to norm C and, after every aggregation, the global model gets
    N(0, s² I) with s = (2C/M)·sqrt(2 ln(1.25/δ))/ε (the Gaussian mechanism at sensitivity
    2C/M; the authors' DP baseline). M is the federation's number of clients, fixed for the
    whole run: the authors' server computes s once, at its set-up, from its M clients
    (``FL/server.py``: ``sigma_DP = get_std(2 * model_clip / M, epsilon, M)``), and keeps it
    after every request."""

    name = "dp"

    def __init__(self, clip: float, epsilon: float, delta: float) -> None:
        self.clip, self.epsilon, self.delta = clip, epsilon, delta

    def restart(self, request: ForgettingRequest) -> Restart:
        return request.current, None

    def round_noise_std(self, num_clients: int) -> float:
        """s = (2C/M)·sqrt(2 ln(1.25/δ))/ε; C = 1, ε = 1, δ = 10⁻⁵ and M = 10 clients:
        0.2·sqrt(2 ln 125000) = 0.9690.

        >>> round(DPBaseline(clip=1.0, epsilon=1.0, delta=1e-5).round_noise_std(10), 4)
        0.969
        """
        m = max(num_clients, 1)
        return (2 * self.clip / m) * math.sqrt(2 * math.log(1.25 / self.delta)) / self.epsilon

    @torch.no_grad()
    def transform_update(self, update: TensorList) -> TensorList:
        norm = math.sqrt(sum(float(u.pow(2).sum()) for u in update))
        return update if norm <= self.clip else [u * (self.clip / norm) for u in update]


class FedAccum(ForgettingMethod):
    """FEDACCUM (the authors' code: ``FedAccum/server.py``, ``aggregation`` applied to each
    ``accum_model`` in ``compute_metric``): one shadow model per future removal set F_r,
    into which every round's server step aggregates the received local models of the
    clients not in F_r, θ_i = θ^t + Δ_i (trained from the global model θ^t):

        θ_F ← (1 − η_g) θ_F + η_g Σ_{i∉F} ω_i θ_i / Σ_{i∉F} ω_i.

    With η_g = 1 the shadow is the round's global model re-aggregated without F_r; a round
    in which only F_r's clients took part leaves it unchanged. The authors weigh the kept
    models uniformly (their clients are of equal size); here they keep their round weights
    ω_i, renormalized, which is the same there. A request restarts from its shadow. Needs
    every request known before training, and one process (it reads every update)."""

    name = "fedaccum"

    def __init__(self) -> None:
        self.shadows: dict[tuple[int, ...], torch.Tensor] = {}

    def check(self, world_size: int) -> None:
        if world_size > 1:
            raise ValueError("FEDACCUM re-aggregates every client's model: use devices=1.")

    def prepare(self, model: torch.Tensor, removal_sets: Sequence[tuple[int, ...]]) -> None:
        self.shadows = {key: model.clone() for key in removal_sets}

    def restart(self, request: ForgettingRequest) -> Restart:
        key = tuple(sorted(set(request.removed) | set(request.clients)))
        if key not in self.shadows:
            raise ValueError(
                f"FEDACCUM has no shadow model without {list(key)}: it needs every "
                "request in `requests` before training."
            )
        return self.shadows.pop(key), None

    def after_round(
        self,
        start: torch.Tensor,
        deltas: dict[int, torch.Tensor],
        weights: dict[int, float],
        server_lr: float,
    ) -> None:
        for key, shadow in self.shadows.items():
            kept = [c for c in deltas if c not in key]
            if not kept:
                continue
            # host: read back as Python floats
            omega = torch.tensor([weights[c] for c in kept], dtype=torch.float64)
            omega = omega / omega.sum()
            kept_model = start + sum(float(w) * deltas[c] for w, c in zip(omega, kept))
            self.shadows[key] = shadow + server_lr * (kept_model - shadow)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {",".join(map(str, k)): v for k, v in self.shadows.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.shadows = {tuple(int(x) for x in k.split(",") if x): v for k, v in state.items()}


#: the methods whose training before the first request is plain FedAvg with the history
#: recorded (the authors' code trains these once, under the name "train", and each
#: method's requests start from that run): a checkpoint taken before any request resumes
#: under any of them
SHARED_TRAINING = frozenset({"sifu", "scratch", "fine_tuning", "last"})


def forgetting_method(
    name: str, epsilon: float, delta: float, sigma: float, clip: float
) -> ForgettingMethod:
    """The method called ``name``, given the settings it reads."""
    methods: dict[str, Callable[[], ForgettingMethod]] = {
        "sifu": lambda: Sifu(sigma),
        "scratch": Scratch,
        "fine_tuning": FineTuning,
        "last": lambda: Last(epsilon, delta),
        "dp": lambda: DPBaseline(clip, epsilon, delta),
        "fedaccum": FedAccum,
    }
    if name not in methods:
        raise ValueError(f"method must be one of {', '.join(methods)}; got {name!r}.")
    return methods[name]()
