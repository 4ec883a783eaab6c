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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from flwr.app import Context, Message
from flwr.clientapp.mod import fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from lightning_fl.engine.plugins import Aggregator, FederatedCallback
from lightning_fl.engine.traits import Trait, traits_of
from lightning_fl.systems.samplers import ClientSampler

WRAPPERS = {
    "server": DifferentialPrivacyServerSideFixedClipping,
    "client": DifferentialPrivacyClientSideFixedClipping,
}


class FlowerDPError(ValueError):
    """Flower's DP wrappers with a recipe whose weights or plugins they do not fit."""


@dataclass(frozen=True)
class FlowerDP:
    """Which of Flower's wrappers, and its z and C (run config ``dp-clipping`` =
    ``server`` or ``client``, ``dp-noise-multiplier``, ``dp-clipping-norm``)."""

    clipping: Literal["server", "client"]
    noise_multiplier: float
    clipping_norm: float

    @classmethod
    def read(cls, run_config: dict[str, Any]) -> FlowerDP | None:
        """None without ``dp-clipping``."""
        clipping = str(run_config.get("dp-clipping", ""))
        if not clipping:
            return None
        if clipping not in WRAPPERS:
            raise FlowerDPError(
                f"dp-clipping={clipping!r}: give 'server' (Flower's "
                "DifferentialPrivacyServerSideFixedClipping) or 'client' (its client-side "
                "wrapper with fixedclipping_mod)."
            )
        z = float(run_config.get("dp-noise-multiplier", 0.0))
        norm = float(run_config.get("dp-clipping-norm", 0.0))
        if not z > 0 or not norm > 0:
            raise FlowerDPError(
                f"dp-clipping={clipping} needs dp-noise-multiplier > 0 and dp-clipping-norm > 0 "
                f"in the run config (got {z:g} and {norm:g})."
            )
        return cls(clipping, z, norm)  # type: ignore[arg-type]

    @property
    def wrapper(self) -> str:
        return WRAPPERS[self.clipping].__name__


def check(
    dp: FlowerDP,
    aggregator: Aggregator,
    sampler: ClientSampler,
    plugins: list[FederatedCallback],
    secure: bool,
) -> None:
    """Refuse, naming both and the fix, what the wrapper's calibration or clipping does
    not fit (the module's docstring)."""
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
    for plugin in plugins:
        if plugin.declared_round_sums() or plugin.declared_server_state():
            raise FlowerDPError(
                f"{name} clips every array a node replies, and {type(plugin).__name__} sends "
                "round sums or server state with the model: drop one of them."
            )
    if secure:
        raise FlowerDPError(
            f"{name} reads each node's reply, and secagg hides them: drop one of them."
        )


def participants(sampler: ClientSampler, clients_with_data: int) -> int:
    """m: the participants of every round (a fixed-size sampler's ``clients_per_round``,
    else every client with data: full participation)."""
    return int(getattr(sampler, "clients_per_round", clients_with_data))


def wrap(dp: FlowerDP, server: Any, clients_with_data: int) -> Strategy:
    """``server`` inside Flower's wrapper, with m participants a round, each of weight
    1/m (checked by the server every round), and NumPy's global generator secret."""
    m = participants(server.sampler, clients_with_data)
    server.equal_weights = (m, dp.wrapper)
    secret_numpy_state()
    return WRAPPERS[dp.clipping](server, dp.noise_multiplier, dp.clipping_norm, m)


def secret_numpy_state() -> None:
    """Replace NumPy's global Mersenne Twister state with 624 words of the operating
    system's entropy (what Flower's DP wrappers draw their noise from)."""
    key = np.frombuffer(os.urandom(624 * 4), dtype=np.uint32)
    np.random.set_state(("MT19937", key, 624, 0, 0.0))


def dp_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The ClientApp's mod: Flower's ``fixedclipping_mod`` for the ``train`` messages that
    carry a clipping norm (``DifferentialPrivacyClientSideFixedClipping``'s), else
    nothing."""
    configs = message.content.config_records
    if message.metadata.message_type == "train" and any(
        KEY_CLIPPING_NORM in record for record in configs.values()
    ):
        return fixedclipping_mod(message, context, call_next)
    return call_next(message, context)


__all__ = ["FlowerDP", "FlowerDPError", "check", "dp_mod", "secret_numpy_state", "wrap"]
