"""Secure aggregation that survives dropped sites: Bonawitz et al., "Practical Secure
Aggregation for Privacy-Preserving Machine Learning" (CCS 2017), §4 and Fig. 4 (the
semi-honest protocol, with the signed keys of the active variant's Round 0).

One instance sums one round's values over the sites that are still there:

- **Round 0, AdvertiseKeys** (:meth:`DoubleMaskingSite.advertise`): each site u draws two
  X25519 key pairs, (c_u^PK, c_u^SK) for its encrypted channels to the other sites and
  (s_u^PK, s_u^SK) for its pairwise masks, and sends both public keys, signed with its
  site signing key where the sites have them (:mod:`.key_signatures`). U₁: who advertised.
- **Round 1, ShareKeys** (:meth:`DoubleMaskingSite.share_keys`): u draws its self-mask
  seed b_u, splits s_u^SK and b_u into t-of-|U₁| Shamir shares over GF(2^521 − 1)
  (:func:`shamir_split`), and sends each site v its pair of shares, encrypted with
  AES-GCM under a key of KA(c_u^SK, c_v^PK): the relay carries them unread. U₂: who sent
  shares.
- **Round 2, MaskedInputCollection** (:meth:`DoubleMaskingSite.masked_input`): y_u = x_u +
  PRG(b_u) + Σ_{v ∈ U₂, v > u} PRG(s_{u,v}) − Σ_{v ∈ U₂, v < u} PRG(s_{u,v}) in Z_{2^64}
  (fixed point, :mod:`.pairwise_masking`), s_{u,v} = KA(s_u^SK, s_v^PK). U₃: the sites
  whose y the relay keeps (a site that sent y_u and then dropped may be left out: its
  y_u stays masked by PRG(b_u), which nobody reconstructs).
- **Round 4, Unmasking** (:meth:`DoubleMaskingSite.unmask`): each site of U₄ ⊆ U₃ sends,
  for each v ∈ U₂ \\ U₃ (dropped), its share of s_v^SK, and for each u ∈ U₃, its share of
  b_u, never both for one site (a request that asks for both is refused). With at least
  t of them, :func:`unmasked_total` rebuilds the dropped sites' pairwise masks and the
  survivors' self-masks and returns Σ_{u ∈ U₃} x_u, exactly.

The threshold t (``min_sites``) is both the fewest sites a round completes with and the
size of a coalition that could rebuild a site's secrets: t > n/2 keeps a relay that lies
about who dropped from getting both of one site's secrets from honest sites (the paper's
Thm 6.2 setting). Each round is a fresh instance (new keys and seeds), so a site that
dropped rejoins the next round as any other. Round 3 (ConsistencyCheck) of the active
protocol is not built: a relay that shows sites different U₃ lists is not detected.

>>> shares = shamir_split(123456789, threshold=3, holders=[0, 1, 2, 3, 4])
>>> shamir_join({v: shares[v] for v in (4, 0, 2)})
123456789
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_fl.systems.key_signatures import SiteSignatures, agree_verdicts
from lightning_fl.systems.pairwise_masking import (
    Limbs,
    add,
    carry_sum,
    decode,
    encode,
    negate,
    pad,
    pair_key,
    public_bytes,
)

#: The field of the shares: GF(P), P = 2^521 − 1 (a Mersenne prime above any 256-bit key).
PRIME = 2**521 - 1


class DroppedSitesError(RuntimeError):
    """Fewer sites than the threshold are left, or a request would unmask a site."""


def shamir_split(secret: int, threshold: int, holders: Sequence[int]) -> dict[int, int]:
    """Shamir's t-of-n shares of ``secret`` (< P): f(x) = secret + Σ_{j<t} a_j x^j with
    random a_j, holder v's share f(v + 1)."""
    if not 1 <= threshold <= len(holders):
        raise ValueError(f"threshold must be in [1, {len(holders)}], got {threshold}.")
    coefficients = [secret] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for holder in holders:
        x, value = holder + 1, 0
        for coefficient in reversed(coefficients):
            value = (value * x + coefficient) % PRIME
        shares[holder] = value
    return shares


def shamir_join(shares: dict[int, int]) -> int:
    """The secret of ``shares`` (holder → share): Lagrange's interpolation at 0."""
    secret = 0
    for holder, share in shares.items():
        x, numerator, denominator = holder + 1, 1, 1
        for other in shares:
            if other != holder:
                numerator = numerator * -(other + 1) % PRIME
                denominator = denominator * (x - (other + 1)) % PRIME
        secret = (secret + share * numerator * pow(denominator, -1, PRIME)) % PRIME
    return secret


def _private_from_int(value: int) -> Any:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    return X25519PrivateKey.from_private_bytes(value.to_bytes(32, "little"))


def _private_int(private: Any) -> int:
    from cryptography.hazmat.primitives import serialization

    raw = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())  # fmt: skip
    return int.from_bytes(raw, "little")


def self_mask(seed: int, round_idx: int, size: int) -> Limbs:
    """PRG(b_u): ChaCha20's keystream under the 32-byte seed b_u, as 64-bit limbs."""
    return pad(seed.to_bytes(32, "little"), round_idx, size)


def pairwise_mask(private: Any, other_public: bytes, rank: int, other: int, round_idx: int,
                  size: int) -> Limbs:  # fmt: skip
    """What site ``rank`` adds for the pair (rank, other): +PRG(s) after, −PRG(s) before."""
    stream = pad(pair_key(private, other_public, rank, other), round_idx, size)
    return stream if other > rank else negate(stream)


class DoubleMaskingSite:
    """Site ``rank``'s side of one round's instance, among ``world_size`` sites, with the
    threshold ``min_sites`` (see the module's docstring)."""

    def __init__(self, rank: int, world_size: int, min_sites: int, fraction_bits: int = 32):
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        if not 1 <= min_sites <= world_size:
            raise ValueError(f"min_sites must be in [1, {world_size}], got {min_sites}.")
        self.rank, self.world_size, self.min_sites = rank, world_size, min_sites
        self.fraction_bits = fraction_bits
        self._channel, self._mask = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        self._seed = int.from_bytes(secrets.token_bytes(32), "little")  # b_u
        self._publics: dict[int, tuple[bytes, bytes]] = {}
        self._held: dict[int, tuple[int, int]] = {}  # u -> (share of s_u^SK, share of b_u)

    def advertise(self) -> tuple[bytes, bytes]:
        """Round 0: (c_u^PK, s_u^PK)."""
        return public_bytes(self._channel), public_bytes(self._mask)

    def _cipher(self, other: int) -> Any:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        key = pair_key(self._channel, self._publics[other][0], self.rank, other)
        return AESGCM(key)

    def share_keys(self, adverts: dict[int, tuple[bytes, bytes]]) -> dict[int, bytes]:
        """Round 1: the encrypted pair of shares for each site of U₁ (``adverts``)."""
        if len(adverts) < self.min_sites:
            raise DroppedSitesError(_too_few(len(adverts), self.min_sites, "advertised keys"))
        self._publics = dict(adverts)
        holders = sorted(adverts)
        key_shares = shamir_split(_private_int(self._mask), self.min_sites, holders)
        seed_shares = shamir_split(self._seed, self.min_sites, holders)
        out = {}
        for other in holders:
            plain = key_shares[other].to_bytes(66, "little") + seed_shares[other].to_bytes(
                66, "little"
            )
            nonce = secrets.token_bytes(12)
            sealed = self._cipher(other).encrypt(nonce, plain, _aad(self.rank, other))
            out[other] = nonce + sealed
        return out

    def receive_shares(self, sealed: dict[int, bytes]) -> None:
        """Round 1's end: decrypt the shares each site of U₂ sent this site."""
        for other, blob in sealed.items():
            plain = self._cipher(other).decrypt(blob[:12], blob[12:], _aad(other, self.rank))
            self._held[other] = (int.from_bytes(plain[:66], "little"),
                                 int.from_bytes(plain[66:], "little"))  # fmt: skip

    def masked_input(self, values: Tensor, round_idx: int) -> Limbs:
        """Round 2: y_u, masked by PRG(b_u) and the pairwise masks with U₂ (the sites whose
        shares this site holds)."""
        if len(self._held) < self.min_sites:
            raise DroppedSitesError(_too_few(len(self._held), self.min_sites, "shared keys"))
        size = values.numel()
        masked = add(encode(values.detach().flatten().cpu(), self.fraction_bits),
                     self_mask(self._seed, round_idx, size))  # fmt: skip
        for other in self._held:
            if other != self.rank:
                masked = add(masked, pairwise_mask(self._mask, self._publics[other][1],
                                                   self.rank, other, round_idx, size))  # fmt: skip
        return masked

    @property
    def shared_with(self) -> list[int]:
        """U₂ as this site saw it: the sites whose shares it holds."""
        return sorted(self._held)

    def unmask(self, survivors: Sequence[int]) -> dict[str, dict[int, int]]:
        """Round 4: shares of b_u for each u of U₃ (``survivors``) and of s_v^SK for each v
        of U₂ \\ U₃; refused when U₃ is below the threshold, or names a site outside U₂."""
        survivors = sorted(set(survivors))
        if len(survivors) < self.min_sites:
            raise DroppedSitesError(_too_few(len(survivors), self.min_sites, "masked inputs"))
        unknown = [u for u in survivors if u not in self._held]
        if unknown:
            raise DroppedSitesError(
                f"site {self.rank} was asked to unmask sites {unknown}, which shared no keys "
                "with it this round: it reveals nothing (a relay that lists sites that never "
                "took part would learn both secrets of one site)."
            )
        dropped = sorted(set(self._held) - set(survivors))
        return {"seeds": {u: self._held[u][1] for u in survivors},
                "keys": {v: self._held[v][0] for v in dropped}}  # fmt: skip


def unmasked_total(
    masked: dict[int, Limbs], unmasking: dict[int, dict[str, dict[int, int]]],
    mask_publics: dict[int, bytes], round_idx: int, min_sites: int, fraction_bits: int = 32,
) -> Tensor:  # fmt: skip
    """Σ_{u ∈ U₃} x_u from the kept masked inputs (``masked``: U₃), the unmasking shares of
    U₄ (``unmasking``: at least ``min_sites``) and the sites' mask public keys (U₂'s,
    ``mask_publics``): the survivors' self-masks and the dropped sites' pairwise masks
    rebuilt and taken out (Bonawitz et al. 2017, Fig. 4, Round 4, server side)."""
    survivors = sorted(masked)
    total = masked[survivors[0]]
    for u in survivors[1:]:
        total = add(total, masked[u])
    return unmasked_sum(total, survivors, unmasking, mask_publics, round_idx, min_sites,
                        fraction_bits)  # fmt: skip


def unmasked_sum(
    total: Limbs, survivors: Sequence[int], unmasking: dict[int, dict[str, dict[int, int]]],
    mask_publics: dict[int, bytes], round_idx: int, min_sites: int, fraction_bits: int = 32,
) -> Tensor:  # fmt: skip
    """:func:`unmasked_total` from Σ_{u ∈ U₃} y_u already added (``total``, e.g. by a relay
    that only adds) and the list of U₃ (``survivors``)."""
    if len(unmasking) < min_sites:
        raise DroppedSitesError(_too_few(len(unmasking), min_sites, "unmasking answers"))
    survivors = sorted(survivors)
    size = total[0].numel()
    for u in survivors:
        seed = shamir_join({w: answer["seeds"][u] for w, answer in unmasking.items()})
        total = add(total, negate(self_mask(seed, round_idx, size)))
    for v in sorted(set(mask_publics) - set(survivors)):
        key = _private_from_int(shamir_join({w: a["keys"][v] for w, a in unmasking.items()}))
        for u in survivors:  # u added the mask of pair (u, v); v's side never arrived
            theirs = pairwise_mask(key, mask_publics[u], v, u, round_idx, size)
            total = add(total, theirs)  # v's side of the pair is −(u's side)
    return decode(*total, fraction_bits)


def sum_surviving_sites(
    values: Tensor, round_idx: int, site: DoubleMaskingSite,
    gather_present: Callable[[Any, Any], list[Any]],
    sum_present: Callable[[Tensor], frozenset[int]], signatures: SiteSignatures | None = None,
) -> tuple[Tensor, frozenset[int]]:  # fmt: skip
    """One round of the protocol through a relay that only adds and lists (the steps of
    the module's docstring, each a collective of the sites still there): ``gather_present``
    (every site's value in rank order, ``None`` for one that dropped) and ``sum_present``
    (a sum over the sites still there, in place, returning the ranks missing). Returns
    Σ_{u ∈ U₃} x_u in ``values``' dtype and device, and the ranks whose ``values`` are not
    in it (every rank outside U₃). With ``signatures`` each site signs its two public keys
    and a key that does not verify stops every site, naming its site."""
    channel, mask = site.advertise()
    signature = signatures.sign(site.rank, channel + mask) if signatures is not None else None
    offers = gather_present((channel + mask, signature), None)
    if signatures is not None:
        agree_verdicts(signatures.forged(offers), signatures.names, site.rank,
                       lambda verdict: gather_present(verdict, []))  # fmt: skip
    adverts = {r: (o[0][:32], o[0][32:]) for r, o in enumerate(offers) if o is not None}
    inboxes = gather_present(site.share_keys(adverts), None)
    site.receive_shares({u: box[site.rank] for u, box in enumerate(inboxes)
                         if box is not None and site.rank in box})  # fmt: skip
    lo, hi = site.masked_input(values, round_idx)
    sent = torch.cat([lo, hi]).to(values.device)
    missing = sum_present(sent)
    survivors = sorted(set(site.shared_with) - set(missing))
    answers = gather_present(site.unmask(survivors), None)
    unmasking = {w: answer for w, answer in enumerate(answers) if answer is not None}
    size = values.numel()
    total = carry_sum((sent[:size].cpu(), sent[size:].cpu()))
    publics = {u: adverts[u][1] for u in site.shared_with}
    summed = unmasked_sum(total, survivors, unmasking, publics, round_idx, site.min_sites,
                          site.fraction_bits)  # fmt: skip
    outside = frozenset(range(site.world_size)) - frozenset(survivors)
    return summed.to(device=values.device, dtype=values.dtype).view_as(values), outside


def _aad(sender: int, receiver: int) -> bytes:
    return f"lightning_fl double masking shares {sender}->{receiver}".encode()


def _too_few(have: int, need: int, what: str) -> str:
    return (
        f"{have} sites {what}, fewer than min_sites={need}: the round cannot complete without "
        "revealing a site; wait for more sites, or lower min_sites (no lower than a majority)."
    )


__all__ = [
    "PRIME",
    "DoubleMaskingSite",
    "DroppedSitesError",
    "shamir_join",
    "shamir_split",
    "sum_surviving_sites",
    "unmasked_sum",
    "unmasked_total",
]
