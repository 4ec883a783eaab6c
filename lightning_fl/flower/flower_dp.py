"""Flower's central-DP wrappers around the server-side mode's
:class:`~lightning_fl.flower.server_side.FederatedServer` (issue 77; README, "Two server
models"): ``DifferentialPrivacyServerSideFixedClipping`` (the server clips each reply's
update to norm C) or ``DifferentialPrivacyClientSideFixedClipping`` with Flower's
``fixedclipping_mod`` on the nodes (each node clips its own, :func:`dp_mod`); either adds
N(0, (zC/m)²) to every entry of the aggregated model (McMahan et al., ICLR 2018, the
Gaussian mechanism with uniform weights).

They compose where their calibration holds, and are refused at set-up otherwise
(:func:`check`, :func:`wrap`):

- the noise's scale zC/m is the sensitivity of a mean of m clipped updates: every
  participant's weight must be 1/m, with m fixed (``FedAvg(weighting="uniform")`` with
  ``FullParticipation`` over the clients that have data, or ``UniformSampler`` of m);
  the server checks each round's weights before sending anything
  (``FederatedServer.equal_weights``), where sample-weighted FedAvg or a Poisson round
  would under-noise. lightning_fl's own ``DPFedAvg(noise="central")`` covers the other
  cases (bounded weights, Poisson sampling, adaptive clipping, ε);
- the wrappers clip every array a node replies and the mod needs one array and one
  config record: plugins with declared round sums or server state (SCAFFOLD) are refused;
- a second DP mechanism (DPFedAvg) and secure aggregation (the wrappers read each reply)
  are refused.

Flower's wrappers draw their noise from NumPy's global generator, which the recipe's seed
sets on the server (Lightning's ``seed_everything``): any site holding the recipe could
draw it again. :func:`wrap` replaces that generator's state with one from the server's
operating system (:func:`secret_numpy_state`) before the first round.

**Adaptive clipping** (``dp-clipping`` = ``server-adaptive`` or ``client-adaptive``, the
latter with Flower's ``adaptiveclipping_mod`` on the nodes): Flower's
``DifferentialPrivacy{Server,Client}SideAdaptiveClipping``, C ← C·exp(−η_C(b̃ − γ)) with
the noise multiplier z_Δ = (z⁻² − (2σ_b)⁻²)^−½ (Andrew et al., NeurIPS 2021, Alg. 1),
as flwr 1.42 computes it, which differs from the paper twice: its b̃ is the noised
fraction of *clipped* updates (the paper's is of unclipped ones, so the norm moves the
other way: a round that clips more than γ lowers C), and it updates C before it noises
the round (the paper noises with the C that clipped). :func:`wrap` says so in a warning;
lightning_fl's ``DPFedAvg(target_quantile=γ)`` follows the paper.

**Local DP** (run config ``local-dp-epsilon`` > 0): Flower's ``LocalDpMod`` on every node
clips its update to ``local-dp-clipping-norm`` and adds N(0, s²·2 ln(1.25/δ)/ε²) to each
entry it replies (the Gaussian mechanism of (ε, δ) for sensitivity s, a client's own
guarantee each round: no accountant composes it over rounds), drawn from NumPy's global
generator after the node's training, whose state :func:`local_dp_mod` first replaces
with the node's operating system's entropy (the training left it where the recipe's seed
put it). Refused beside a central wrapper, DPFedAvg, secagg (the mod needs the clear
reply) and plugins with round sums or server state (:func:`check_local`).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp.mod import LocalDpMod, adaptiveclipping_mod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from lightning_fl.engine.plugins import Aggregator, FederatedCallback
from lightning_fl.engine.traits import Trait, traits_of
from lightning_fl.systems.samplers import ClientSampler

logger = logging.getLogger(__name__)

Clipping = Literal["server", "client", "server-adaptive", "client-adaptive"]

WRAPPERS = {
    "server": DifferentialPrivacyServerSideFixedClipping,
    "client": DifferentialPrivacyClientSideFixedClipping,
    "server-adaptive": DifferentialPrivacyServerSideAdaptiveClipping,
    "client-adaptive": DifferentialPrivacyClientSideAdaptiveClipping,
}

#: the mod the nodes apply for each client-side wrapper
NODE_MODS = {"client": fixedclipping_mod, "client-adaptive": adaptiveclipping_mod}

#: a train message's config entry naming the node's clipping mod (a :data:`NODE_MODS` key)
MOD_KEY = "lightning_fl.clipping-mod"

#: what :func:`wrap` warns of an adaptive wrapper (the module's docstring)
ADAPTIVE_DIRECTION = (
    "%s (flwr's adaptive clipping) moves C by the fraction of clipped updates, where "
    "Andrew et al. (2021, Alg. 1) move it by the fraction of unclipped ones, and noises a "
    "round with the C it has just updated: C falls while more than γ of the updates are "
    "clipped. DPFedAvg(target_quantile=γ) follows the paper."
)


class FlowerDPError(ValueError):
    """Flower's DP wrappers with a recipe whose weights or plugins they do not fit."""


@dataclass(frozen=True)
class FlowerDP:
    """Which of Flower's wrappers, its z and C (the initial C of adaptive clipping), and
    adaptive clipping's γ, η_C and σ_b (run config ``dp-clipping`` = ``server``,
    ``client``, ``server-adaptive`` or ``client-adaptive``, ``dp-noise-multiplier``,
    ``dp-clipping-norm``, ``dp-target-clipped-quantile``, ``dp-clip-norm-lr``,
    ``dp-clipped-count-stddev``, 0 for Flower's default m/20)."""

    clipping: Clipping
    noise_multiplier: float
    clipping_norm: float
    target_clipped_quantile: float = 0.5
    clip_norm_lr: float = 0.2
    clipped_count_stddev: float | None = None

    @classmethod
    def read(cls, run_config: dict[str, Any]) -> FlowerDP | None:
        """None without ``dp-clipping``."""
        clipping = str(run_config.get("dp-clipping", ""))
        if not clipping:
            return None
        if clipping not in WRAPPERS:
            raise FlowerDPError(
                f"dp-clipping={clipping!r}: give 'server' or 'client' (Flower's fixed-clipping "
                "wrappers, the client's with fixedclipping_mod), or 'server-adaptive' or "
                "'client-adaptive' (its adaptive-clipping wrappers)."
            )
        z = float(run_config.get("dp-noise-multiplier", 0.0))
        norm = float(run_config.get("dp-clipping-norm", 0.0))
        if not z > 0 or not norm > 0:
            raise FlowerDPError(
                f"dp-clipping={clipping} needs dp-noise-multiplier > 0 and dp-clipping-norm > 0 "
                f"in the run config (got {z:g} and {norm:g})."
            )
        quantile = float(run_config.get("dp-target-clipped-quantile", 0.5))
        rate = float(run_config.get("dp-clip-norm-lr", 0.2))
        count_std = float(run_config.get("dp-clipped-count-stddev", 0.0))
        if not 0 <= quantile <= 1 or not rate > 0 or count_std < 0:
            raise FlowerDPError(
                f"dp-clipping={clipping} needs dp-target-clipped-quantile in [0, 1], "
                f"dp-clip-norm-lr > 0 and dp-clipped-count-stddev >= 0 (got {quantile:g}, "
                f"{rate:g} and {count_std:g})."
            )
        return cls(clipping, z, norm, quantile, rate, count_std or None)  # type: ignore[arg-type]

    @property
    def wrapper(self) -> str:
        return WRAPPERS[self.clipping].__name__

    @property
    def adaptive(self) -> bool:
        return self.clipping.endswith("adaptive")


@dataclass(frozen=True)
class LocalDP:
    """Flower's ``LocalDpMod`` on every node (run config ``local-dp-clipping-norm``,
    ``local-dp-sensitivity``, ``local-dp-epsilon``, ``local-dp-delta``)."""

    clipping_norm: float
    sensitivity: float
    epsilon: float
    delta: float

    @classmethod
    def read(cls, run_config: dict[str, Any]) -> LocalDP | None:
        """None unless ``local-dp-epsilon`` > 0."""
        epsilon = float(run_config.get("local-dp-epsilon", 0.0))
        if not epsilon > 0:
            return None
        norm = float(run_config.get("local-dp-clipping-norm", 0.0))
        sensitivity = float(run_config.get("local-dp-sensitivity", 0.0))
        delta = float(run_config.get("local-dp-delta", 0.0))
        if not norm > 0 or not sensitivity > 0 or not 0 < delta < 1:
            raise FlowerDPError(
                f"local-dp-epsilon={epsilon:g} needs local-dp-clipping-norm > 0, "
                f"local-dp-sensitivity > 0 and local-dp-delta in (0, 1) in the run config "
                f"(got {norm:g}, {sensitivity:g} and {delta:g})."
            )
        return cls(norm, sensitivity, epsilon, delta)

    @property
    def noise_std(self) -> float:
        """s·√(2 ln(1.25/δ))/ε: the Gaussian mechanism's σ (Dwork and Roth 2014, Thm 3.22),
        as ``LocalDpMod`` computes it."""
        return self.sensitivity * math.sqrt(2 * math.log(1.25 / self.delta)) / self.epsilon


def _check_arrays(name: str, plugins: Sequence[FederatedCallback], integers: Sequence[str]):
    """Flower's clipping and noise act on every array of a reply: refuse plugins whose
    round sums or server state travel with the model, and integer entries."""
    for plugin in plugins:
        if plugin.declared_round_sums() or plugin.declared_server_state():
            raise FlowerDPError(
                f"{name} clips every array a node replies, and {type(plugin).__name__} sends "
                "round sums or server state with the model: drop one of them."
            )
    if integers:
        raise FlowerDPError(
            f"{name} scales and noises every entry of the model, and {list(integers)} hold "
            "integers (a BatchNorm's num_batches_tracked): use a model without integer "
            "buffers, or drop it."
        )


def check(
    dp: FlowerDP,
    aggregator: Aggregator,
    sampler: ClientSampler,
    plugins: list[FederatedCallback],
    secure: bool,
    integers: Sequence[str] = (),
) -> None:
    """Refuse, naming both and the fix, what the wrapper's calibration or clipping does
    not fit (the module's docstring); ``integers``: the model's integer entries."""
    name = dp.wrapper
    if Trait.BOUNDS_THE_SUMS_SENSITIVITY in traits_of(aggregator):  # its own clip and noise
        raise FlowerDPError(
            f"{name} and {type(aggregator).__name__} both clip and noise the updates: keep "
            "one (drop dp-clipping, or aggregate with FedAvg)."
        )
    varies = {Trait.DRAWS_A_RANDOM_NUMBER_OF_CLIENTS, Trait.UNKNOWN_INCLUSION_PROBABILITY}
    if aggregator.weighting != "uniform" or varies & set(traits_of(sampler)):
        raise FlowerDPError(
            f"{name} scales its noise to m clients of weight 1/m each, and "
            f"{type(aggregator).__name__}(weighting={aggregator.weighting!r}) with "
            f"{type(sampler).__name__} weighs them otherwise: set weighting='uniform' with "
            "FullParticipation or UniformSampler, or use DPFedAvg(noise='central')."
        )
    _check_arrays(name, plugins, integers)
    if secure:
        raise FlowerDPError(
            f"{name} reads each node's reply, and secagg hides them: drop one of them."
        )


def check_local(
    local: LocalDP,
    dp: FlowerDP | None,
    aggregator: Aggregator,
    plugins: list[FederatedCallback],
    secure: bool,
    integers: Sequence[str] = (),
) -> None:
    """Refuse what ``LocalDpMod`` does not fit: a second DP mechanism (a central wrapper,
    DPFedAvg), secagg (the mod rewrites the clear reply), plugins whose round sums or
    server state travel with the model, integer entries."""
    name = "LocalDpMod (local-dp-epsilon)"
    if dp is not None:
        raise FlowerDPError(f"{name} and {dp.wrapper} both clip and noise: keep one.")
    if Trait.BOUNDS_THE_SUMS_SENSITIVITY in traits_of(aggregator):
        raise FlowerDPError(
            f"{name} and {type(aggregator).__name__} both clip and noise the updates: keep "
            "one (drop local-dp-epsilon, or aggregate with FedAvg)."
        )
    _check_arrays(name, plugins, integers)
    if secure:
        raise FlowerDPError(
            f"{name} noises the node's clear reply, and secagg masks it: drop one of them "
            "(or use DPFedAvg(noise='local') under secagg)."
        )


def participants(sampler: ClientSampler, clients_with_data: int) -> int:
    """m: the participants of every round (a fixed-size sampler's ``clients_per_round``,
    else every client with data: full participation)."""
    return int(getattr(sampler, "clients_per_round", clients_with_data))


def wrap(dp: FlowerDP, server: Any, clients_with_data: int) -> Strategy:
    """``server`` inside Flower's wrapper, with m participants a round, each of weight
    1/m (checked by the server every round), NumPy's global generator secret, and, for a
    client-side wrapper, the nodes told which of Flower's mods to apply."""
    m = participants(server.sampler, clients_with_data)
    server.equal_weights = (m, dp.wrapper)
    if dp.clipping in NODE_MODS:
        server.train_config = {**server.train_config, MOD_KEY: dp.clipping}
    secret_numpy_state()
    wrapper = WRAPPERS[dp.clipping]
    if not dp.adaptive:
        return wrapper(server, dp.noise_multiplier, dp.clipping_norm, m)
    logger.warning(ADAPTIVE_DIRECTION, dp.wrapper)
    adaptive = (dp.target_clipped_quantile, dp.clip_norm_lr, dp.clipped_count_stddev)
    return wrapper(server, dp.noise_multiplier, m, dp.clipping_norm, *adaptive)


def secret_numpy_state() -> None:
    """Replace NumPy's global Mersenne Twister state with 624 words of the operating
    system's entropy (what Flower's DP wrappers draw their noise from)."""
    key = np.frombuffer(os.urandom(624 * 4), dtype=np.uint32)
    np.random.set_state(("MT19937", key, 624, 0, 0.0))


def dp_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The ClientApp's mod: Flower's ``fixedclipping_mod`` or ``adaptiveclipping_mod`` for
    the ``train`` messages whose config names it (a client-side wrapper's, :data:`MOD_KEY`),
    else nothing."""
    if message.metadata.message_type == "train":
        configs = message.content.config_records.values()
        named = next((record[MOD_KEY] for record in configs if MOD_KEY in record), None)
        if named is not None:
            return NODE_MODS[named](message, context, call_next)
    return call_next(message, context)


def local_dp_mod(local_of: Callable[[Context], LocalDP | None]) -> Mod:
    """The ClientApp's ``LocalDpMod`` where the run asks for it (``local_of``: the run's
    :class:`LocalDP`, read from the node's context), its noise drawn after NumPy's global
    generator is made the node's secret (the training seeded it from the recipe)."""

    def mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        local = local_of(context)
        if local is None or message.metadata.message_type != "train":
            return call_next(message, context)

        def trained_then_secret(msg: Message, ctx: Context) -> Message:
            reply = call_next(msg, ctx)
            secret_numpy_state()
            return reply

        flower = LocalDpMod(local.clipping_norm, local.sensitivity, local.epsilon, local.delta)
        return flower(message, context, trained_then_secret)

    return mod


__all__ = [
    "FlowerDP",
    "FlowerDPError",
    "LocalDP",
    "check",
    "check_local",
    "dp_mod",
    "local_dp_mod",
    "secret_numpy_state",
    "wrap",
]
