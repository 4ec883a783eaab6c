"""Pairwise-masked sums: the sites' round sums without any site's own term on the wire.

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning"
(CCS 2017), §4, the masking with one-time pads of its first protocol ("Masking with
One-Time Pads", eq. in §4.1: y_u = x_u + Σ_{v>u} PRG(s_{u,v}) − Σ_{v<u} PRG(s_{v,u})
mod R). Each pair of sites (u, v) agrees on a secret s_{u,v} by Diffie-Hellman (X25519;
only public keys cross the network), and site u sends y_u: its fixed-point encoded values
plus the pads it shares with the sites after it, minus those it shares with the sites
before it, in Z_{2^64}. Each y_u is uniform in Z_{2^64} to anyone without the pads, and
the pads cancel in Σ_u y_u = Σ_u x_u.

What this leaves out of the paper's protocol: secret-sharing the keys so that the sum
survives a site that drops mid-round (its pads would not cancel: the round fails, as a
plain collective does). The public keys are signed by the sites' signing keys where the
recipe names them (:mod:`lightning_fl.systems.key_signatures`: a relay that substitutes a
key is detected); unsigned, a party that can rewrite the messages at key agreement can
read the pads.

Encoding. A value x becomes q = round(x · 2^F) (``fraction_bits`` F = 32 by default: a
resolution of 2.3e-10, |sum| < 2^31), a 64-bit two's complement integer held as two 32-bit
limbs in int64 tensors, so that every addition, the all-reduce's included, is exact and
never overflows (W sites' limbs sum to less than W · 2^32).

>>> lo, hi = encode(torch.tensor([1.5, -2.25]), fraction_bits=2)
>>> lo.tolist(), hi.tolist()  # 6 and −9 = 2^64 − 9 in two limbs
([6, 4294967287], [0, 4294967295])
>>> decode(*add((lo, hi), encode(torch.tensor([0.25, 0.25]), 2)), fraction_bits=2).tolist()
[1.75, -2.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fl.systems.key_signatures import SiteSignatures, agree_verdicts

#: One limb: 32 bits, held in int64 so that sums of limbs never overflow.
LIMB = 2**32
_LOW = LIMB - 1

Limbs = tuple[Tensor, Tensor]


def encode(values: Tensor, fraction_bits: int) -> Limbs:
    """``round(values · 2^fraction_bits)`` as (low, high) 32-bit limbs of its 64-bit two's
    complement; refused when a value does not fit in 2^(62 − fraction_bits)."""
    scaled = torch.round(values.double() * 2.0**fraction_bits)
    if not bool(torch.isfinite(scaled).all()) or float(scaled.abs().max()) >= 2.0**62:
        largest = float(values.double().abs().max())
        raise ValueError(
            f"a value of magnitude {largest:.3g} does not fit the fixed-point encoding of "
            f"SecureAggregation(fraction_bits={fraction_bits}) (at most "
            f"{2.0 ** (62 - fraction_bits):.3g}): lower fraction_bits."
        )
    q = scaled.to(torch.int64)
    return q & _LOW, (q >> 32) & _LOW


def decode(lo: Tensor, hi: Tensor, fraction_bits: int) -> Tensor:
    """The float64 values of (low, high) limbs of 64-bit two's complement integers."""
    signed_hi = torch.where(hi >= LIMB // 2, hi - LIMB, hi)
    return (signed_hi * LIMB + lo).double() / 2.0**fraction_bits


def add(a: Limbs, b: Limbs) -> Limbs:
    """``a + b`` mod 2^64, limb by limb with the carry."""
    lo = a[0] + b[0]
    return lo & _LOW, (a[1] + b[1] + (lo >> 32)) & _LOW


def negate(a: Limbs) -> Limbs:
    """``−a`` mod 2^64 (two's complement: the limbs' complement, plus one)."""
    return add(((~a[0]) & _LOW, (~a[1]) & _LOW), (torch.ones_like(a[0]), torch.zeros_like(a[1])))


def carry_sum(summed: Limbs) -> Limbs:
    """Limbs that were summed as plain integers (each < W · 2^32) brought back to limbs
    of the sum mod 2^64."""
    return summed[0] & _LOW, (summed[1] + (summed[0] >> 32)) & _LOW


def pad(key: bytes, round_idx: int, size: int) -> Limbs:
    """PRG(s_{u,v}) for round ``round_idx``: ``size`` uniform 64-bit values, as limbs, from
    ChaCha20's keystream under ``key`` with the round as its nonce."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    nonce = round_idx.to_bytes(16, "little")
    stream = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
    words = np.frombuffer(stream.update(bytes(8 * size)), dtype="<u4").reshape(size, 2)
    low = torch.from_numpy(words[:, 0].astype(np.int64))  # host: keystream, moved by sum()
    high = torch.from_numpy(words[:, 1].astype(np.int64))  # host: keystream, moved by sum()
    return low, high


def public_bytes(private: Any) -> bytes:
    """The 32 raw bytes of an X25519 private key's public key (what crosses the network)."""
    from cryptography.hazmat.primitives import serialization

    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    return private.public_key().public_bytes(*raw)


def pair_key(private: Any, other_public: bytes, rank: int, other: int) -> bytes:
    """s_{u,v}: the 32-byte key site ``rank`` (X25519 key ``private``) shares with site
    ``other`` (public key ``other_public``): HKDF-SHA256 of their Diffie-Hellman secret,
    bound to the pair of ranks."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    secret = private.exchange(X25519PublicKey.from_public_bytes(other_public))
    pair = f"lightning_fl pairwise mask {min(rank, other)} {max(rank, other)}"
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=pair.encode()).derive(secret)


class PairwiseMasks:
    """Site ``rank``'s pads with each other site: ``keys[v]`` is the 32-byte key it shares
    with site v (derived from their X25519 secret)."""

    def __init__(self, rank: int, keys: dict[int, bytes], fraction_bits: int = 32) -> None:
        self.rank, self.keys, self.fraction_bits = rank, keys, fraction_bits

    @classmethod
    def agree(
        cls, rank: int, world_size: int, exchange: Callable[[Any], list[Any]],
        fraction_bits: int = 32, signatures: SiteSignatures | None = None,
    ) -> PairwiseMasks:  # fmt: skip
        """Draw this site's X25519 key pair, send its public key to every site
        (``exchange``: every site's value, in rank order) and derive the key it shares with
        each (HKDF-SHA256 of the Diffie-Hellman secret). With ``signatures`` each site
        sends its key with its signature, checks every other's, and every site stops,
        naming the site, when one is forged (:func:`~.key_signatures.agree_verdicts`)."""
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        private = X25519PrivateKey.generate()
        public = public_bytes(private)
        if signatures is None:
            publics = exchange(public)
        else:
            offers = exchange((public, signatures.sign(rank, public)))
            agree_verdicts(signatures.forged(offers), signatures.names, rank, exchange)
            publics = [offer[0] for offer in offers]
        keys = {other: pair_key(private, publics[other], rank, other)
                for other in range(world_size) if other != rank}  # fmt: skip
        return cls(rank, keys, fraction_bits)

    def mask(self, values: Tensor, round_idx: int) -> Limbs:
        """What this site sends for ``values`` in ``round_idx``: their encoding plus the pads
        shared with the sites after it, minus those shared with the sites before it."""
        masked = encode(values.detach().flatten().cpu(), self.fraction_bits)
        for other, key in self.keys.items():
            shared = pad(key, round_idx, values.numel())
            masked = add(masked, shared if other > self.rank else negate(shared))
        return masked

    def sum(self, values: Tensor, round_idx: int, all_reduce: Callable[[Tensor], None]) -> Tensor:
        """Σ over sites of ``values`` (each site calls this with its own), through
        ``all_reduce`` (a sum over sites, in place) of masked limbs only; returned in
        ``values``' dtype and device."""
        lo, hi = self.mask(values, round_idx)
        sent = torch.cat([lo, hi]).to(values.device)
        all_reduce(sent)
        size = values.numel()
        total = carry_sum((sent[:size].cpu(), sent[size:].cpu()))
        summed = decode(*total, self.fraction_bits)
        return summed.to(device=values.device, dtype=values.dtype).view_as(values)
