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
are ChaCha20 keystreams of (pair key, round). Where the sites are separate institutions
(silo mode) each site signs its public key with its site signing key and checks the
others' against the recipe's ``site_keys`` (:mod:`lightning_fl.systems.key_signatures`):
a relay that substitutes a key stops the run on every site, naming the site.

Where the transport lets sites drop (``FlowerSite(min_sites=m)``, m below the number of
sites), each round runs instead the protocol that survives them
(:mod:`lightning_fl.systems.double_masking`, Bonawitz et al. 2017, Fig. 4, threshold m):
fresh keys, Shamir shares of each site's mask key and self-mask seed, double-masked
inputs, and an unmasking that rebuilds a dropped site's pairwise masks from the others'
shares. The round's total is then exactly the sum over the sites whose masked input
arrived; a site that dropped before sending it is missing from it (its clients' updates
count as dropped), and its input is never unmasked. Four relay steps a round instead of
one. m must exceed half the sites (refused otherwise): m is also the size of a group
whose shares rebuild a site's secrets. One process: nothing crosses, nothing to mask.
Not masked: the set-up's sample counts, the training and evaluation metrics, and what
other plugins gather (those that read each client's update are refused with it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch

from lightning_fl.engine import collectives
from lightning_fl.engine.plugins import FederatedCallback, RoundTotal
from lightning_fl.engine.traits import Trait
from lightning_fl.systems.double_masking import DoubleMaskingSite, sum_surviving_sites
from lightning_fl.systems.key_signatures import SiteSignatures
from lightning_fl.systems.pairwise_masking import PairwiseMasks


class SecureAggregation(FederatedCallback):
    """Masks each rank's part of the round's sums (``pip install "lightning-fl[secure]"``).

    Args:
        fraction_bits: F of the fixed-point encoding round(x · 2^F): a resolution of
            2^−F, for sums of magnitude below 2^(62 − F) (default 32: 2.3e-10, 2.1e9).
        signing_key: this site's private signing key (Ed25519 or ECDSA, OpenSSH or PEM;
            ``{silo}`` is replaced by the site's name), e.g. its Flower node key
            ``creds/{silo}.key``. Needed, with ``site_keys``, in silo mode on several sites.
        site_keys: every site's public signing key, ``{silo}`` replaced by each site's name
            (``creds/{silo}.pub``): the keys the sites agreed on out of band (the Flower
            node keys registered with the SuperLink serve).
    """

    traits = {Trait.HIDES_EACH_UPDATE: ""}

    vectorized_client_hooks = False

    def __init__(
        self, fraction_bits: int = 32, signing_key: str | None = None,
        site_keys: str | None = None,
    ) -> None:  # fmt: skip
        if not 0 <= fraction_bits <= 52:
            raise ValueError(f"fraction_bits must be in [0, 52], got {fraction_bits}.")
        if (signing_key is None) != (site_keys is None):
            raise ValueError(
                "SecureAggregation signs keys with both signing_key (this site's private key) "
                "and site_keys (every site's public key): give both, or neither."
            )
        self.fraction_bits = fraction_bits
        self.signing_key, self.site_keys = signing_key, site_keys
        self._masks: PairwiseMasks | None = None
        self._dropping: _DroppingSites | None = None
        self._all_reduce: Callable[[torch.Tensor], None] | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Agree on each pair of ranks' key (several processes; every rank at once), or,
        where the transport lets sites drop, keep what each round's instance of the
        protocol that survives them needs."""
        self._masks = self._dropping = None
        rank, world_size = trainer.global_rank, trainer.world_size
        if (group := collectives.across_ranks(world_size)) is None:
            return
        signatures = self.signatures(rank, world_size)
        if (min_sites := group.min_sites(world_size)) < world_size:
            if 2 * min_sites <= world_size:
                raise ValueError(
                    f"SecureAggregation with min_sites={min_sites} of {world_size} sites: a "
                    "server that claims sites dropped could then obtain both secrets of a "
                    "site from two groups of min_sites sites and unmask its input. Set "
                    f"FlowerSite(min_sites=...) to at least {world_size // 2 + 1}."
                )
            self._dropping = _DroppingSites(rank, world_size, min_sites, group, signatures)
            return
        self._masks = PairwiseMasks.agree(rank, world_size, group.all_gather_object,
                                          self.fraction_bits, signatures)  # fmt: skip
        self._all_reduce = group.all_reduce

    def signatures(self, rank: int, world_size: int) -> SiteSignatures | None:
        """The sites' signing keys, read from ``signing_key`` and ``site_keys``; None
        without them outside silo mode (a trusted cluster); refused without them, or
        without site names, where the sites are separate institutions."""
        silos = self.view is not None and self.view.config.silos
        names = self.view.site_names if self.view is not None else None
        if self.signing_key is None:
            if silos and world_size > 1:
                raise ValueError(
                    "SecureAggregation between separate sites (silo mode) needs signed keys, "
                    "or whoever relays them can unmask a site: set signing_key="
                    "'creds/{silo}.key' and site_keys='creds/{silo}.pub' (each site's node "
                    "key pair: python -m lightning_fl.flower.credentials creds --sites ...)."
                )
            return None
        if names is None:
            raise ValueError(
                "SecureAggregation(signing_key=..., site_keys=...) finds each site's key by "
                "its name: list the sites, FederatedStrategy(silos=[...names])."
            )
        return SiteSignatures.from_files(self.signing_key, self.site_keys, names, rank)

    def sum_over_ranks(self, buffer: torch.Tensor, round_idx: int) -> RoundTotal | None:
        if self._dropping is not None:
            d = self._dropping
            site = DoubleMaskingSite(d.rank, d.world_size, d.min_sites, self.fraction_bits)
            return RoundTotal(*sum_surviving_sites(buffer, round_idx, site, d.group.gather_present,
                                                   d.group.sum_present, d.signatures))  # fmt: skip
        if self._masks is None:
            return None
        return RoundTotal(self._masks.sum(buffer, round_idx, self._all_reduce))


@dataclass(frozen=True)
class _DroppingSites:
    """What each round's instance of the double-masking protocol needs (a transport with
    ``min_sites`` below the number of sites)."""

    rank: int
    world_size: int
    min_sites: int
    group: collectives.Collectives
    signatures: SiteSignatures | None
