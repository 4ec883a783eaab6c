"""Where the randomness that protects privacy comes from.

Noise that protects a client's or a site's contribution is only as good as its secrecy: a
party that can draw the same noise again subtracts it. Two sources:

- :class:`SeededNoise`, a simulation's: the noise is a function of the recipe's seed, a
  purpose tag and integer keys (the round, the client, the rank), so a run is reproducible
  and a resume exact. **Whoever holds the recipe can draw it again**: it protects nothing
  across parties, only the simulated mechanism's statistics are right. Its tags are
  ``"dp_fedavg"`` (central noise, keys: the round), ``"dp_fedavg_local"`` (round, client),
  ``"dp_fedavg_distributed"`` (round, rank), ``"dp_count"`` (round: the count of
  unclipped updates, central) and ``"dp_count_distributed"`` (round, rank).
- :class:`SecretNoise`, a deployment's (``FederatedStrategy(silos=...)``: sites that are
  separate institutions): uniform bits from the operating system's cryptographic
  generator (``os.urandom``), drawn anew at every call on the site that adds the noise.
  Nothing in the recipe, the checkpoint or the released model determines it; two runs of
  the same recipe draw different noise, and a resume draws fresh noise.

Gaussians are drawn from uniforms by the Box–Muller transform
(z = √(−2 ln u₁) cos 2πu₂, with u₁ ∈ (0, 1] and u₂ ∈ [0, 1) of 53 random bits each).

>>> a = SeededNoise(7).normal(4, "dp_fedavg", 3)
>>> bool(torch.equal(a, SeededNoise(7).normal(4, "dp_fedavg", 3)))  # the seed reveals it
True
>>> bool(torch.equal(SecretNoise().normal(4), SecretNoise().normal(4)))  # nothing does
False
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from lightning_fl.engine.seeding import generator


class NoiseSource(Protocol):
    """Draws standard normal float64 noise, or a stream of uniforms, for a purpose tag and
    integer keys."""

    #: Whether the draws are a function of the recipe (a simulation's).
    reproducible: bool

    def normal(self, size: int, purpose: str, *keys: int) -> torch.Tensor: ...

    def uniforms(self, purpose: str, *keys: int) -> Callable[[int], np.ndarray]: ...


class SeededNoise:
    """Noise of (seed, purpose, keys): a simulation's, reproducible by anyone with the
    seed (see the module's docstring)."""

    reproducible = True

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def normal(self, size: int, purpose: str, *keys: int) -> torch.Tensor:
        # host: a CPU generator draws the same noise on every rank and device
        return torch.randn(size, generator=generator(self.seed, purpose, *keys),
                           dtype=torch.float64)  # fmt: skip

    def uniforms(self, purpose: str, *keys: int) -> Callable[[int], np.ndarray]:
        """A stream of uniforms in [0, 1): successive calls continue one generator of
        (seed, purpose, keys)."""
        stream = generator(self.seed, purpose, *keys)
        # host: uniforms of a CPU generator, for the samplers of the integer mechanism
        return lambda size: torch.rand(size, generator=stream, dtype=torch.float64).numpy()


class SecretNoise:
    """Noise from the operating system's cryptographic generator: the purpose and keys are
    ignored, nothing makes a draw again (see the module's docstring)."""

    reproducible = False

    def normal(self, size: int, purpose: str = "", *keys: int) -> torch.Tensor:
        first, second = secret_uniforms(size), secret_uniforms(size)
        radius = np.sqrt(-2.0 * np.log1p(-first))  # 1 − u₁ ∈ (0, 1]: no log(0)
        # host: noise drawn on the site's CPU, moved where it is added
        return torch.from_numpy(radius * np.cos(2.0 * math.pi * second))

    def uniforms(self, purpose: str = "", *keys: int) -> Callable[[int], np.ndarray]:
        return secret_uniforms


def secret_uniforms(size: int) -> np.ndarray:
    """``size`` uniform float64 values in [0, 1) of 53 bits each, from ``os.urandom``."""
    words = np.frombuffer(os.urandom(8 * size), dtype="<u8")
    return (words >> np.uint64(11)).astype(np.float64) * 2.0**-53


def secret_generator(device: torch.device | str) -> torch.Generator:
    """A torch generator on ``device`` seeded with 63 bits of the operating system's
    entropy, for noise drawn where a :class:`NoiseSource` cannot serve (DP-SGD's per-step
    noise on the model's device). torch's generator is not a cryptographic one; its seed
    never leaves the site."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


def noise_source(secret: bool, seed: int) -> NoiseSource:
    """:class:`SecretNoise` for sites that are separate parties (``secret``), else the
    simulation's :class:`SeededNoise` of ``seed``."""
    return SecretNoise() if secret else SeededNoise(seed)


__all__ = [
    "NoiseSource",
    "SecretNoise",
    "SeededNoise",
    "noise_source",
    "secret_generator",
    "secret_uniforms",
]
