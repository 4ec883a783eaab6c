"""Secure aggregation over several processes: the round's sums cross the network masked.

:class:`SecureAggregation` replaces the round's plain all-reduce of Σ_i ω_i Δ_i (and of
the plugins' declared round sums, and the count of dropped updates) with the sum of
pairwise-masked, fixed-point encoded values (Bonawitz et al. 2017, §4;
:mod:`lightning_fl.systems.pairwise_masking`). With a plain all-reduce a rank receives raw
pieces of the others' sums (gloo's ring passes chunks verbatim); with this plugin every
value a rank sends is uniform over Z_{2^64} to anyone who lacks its pads, and only the
total can be decoded. The total itself is what every rank learns, as before: with 2 sites
each recovers the other's term by subtraction; a sum hides one site among three or more.

Keys are agreed at each fit's start (X25519 public keys cross the network once); the pads
are ChaCha20 keystreams of (pair key, round). One process: nothing crosses, nothing to
mask. Not masked: the set-up's sample counts, the training and evaluation metrics, and
what other plugins gather (those that read each client's update are refused with it).
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch

from lightning_fl.engine import collectives
from lightning_fl.engine.plugins import FederatedCallback
from lightning_fl.systems.pairwise_masking import PairwiseMasks


class SecureAggregation(FederatedCallback):
    """Masks each rank's part of the round's sums (``pip install "lightning-fl[secure]"``).

    Args:
        fraction_bits: F of the fixed-point encoding round(x · 2^F): a resolution of
            2^−F, for sums of magnitude below 2^(62 − F) (default 32: 2.3e-10, 2.1e9).
    """

    keeps_client_state = False
    vectorized_client_hooks = False

    def __init__(self, fraction_bits: int = 32) -> None:
        if not 0 <= fraction_bits <= 52:
            raise ValueError(f"fraction_bits must be in [0, 52], got {fraction_bits}.")
        self.fraction_bits = fraction_bits
        self._masks: PairwiseMasks | None = None
        self._all_reduce: Callable[[torch.Tensor], None] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Agree on each pair of ranks' key (several processes; every rank at once)."""
        self._masks = None
        if (group := collectives.across_ranks(trainer.world_size)) is not None:
            self._masks = PairwiseMasks.agree(
                trainer.global_rank, trainer.world_size, group.all_gather_object,
                self.fraction_bits,
            )  # fmt: skip
            self._all_reduce = group.all_reduce

    def sum_over_ranks(self, buffer: torch.Tensor, round_idx: int) -> torch.Tensor | None:
        if self._masks is None:
            return None
        return self._masks.sum(buffer, round_idx, self._all_reduce)
