"""Signed key agreement: a party between the sites cannot substitute a site's public key.

Bonawitz et al. 2017 (§4, "Practical Secure Aggregation", the actively secure variant of
Fig. 4, Round 0 "AdvertiseKeys") have each user sign its Diffie-Hellman public keys with a
signing key whose public half every other user knows from a public-key infrastructure;
without it the server, or whoever relays the keys, can hand each site a key of its own and
read every pad (a man in the middle).

Here each site signs ``(context, rank, name, public key)`` with its site signing key (an
Ed25519 or ECDSA key, e.g. the Flower node key of ``python -m lightning_fl.flower.credentials``,
OpenSSH or PEM), and checks every other site's signature against the public keys the
recipe names (``site_keys``, one file per site). The context (the protocol's name and the
number of sites) binds a signature to this use; the rank and name bind it to its site, so
that one site's signed key cannot be replayed as another's. A key that is unsigned, or
whose signature does not verify, is reported by every site that sees it; the sites then
compare what they found (:func:`agree_verdicts`) and every site stops, naming the site.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: What a site's signature covers besides its rank, name and key: this use of the key.
CONTEXT = b"lightning_fl secure aggregation key agreement v1"


class KeyAuthenticationError(RuntimeError):
    """A site's key-agreement public key that is unsigned or signed by another key."""


def load_private_key(path: str | Path) -> Any:
    """A site's private signing key (OpenSSH or PEM, unencrypted): Ed25519 or ECDSA."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = _read(path, "signing_key")
    try:
        if b"OPENSSH PRIVATE KEY" in data:
            key = serialization.load_ssh_private_key(data, password=None)
        else:
            key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as error:
        raise ValueError(
            f"signing_key {path} is not an unencrypted OpenSSH or PEM private key ({error}): "
            "give the site's node key, e.g. from python -m lightning_fl.flower.credentials."
        ) from None
    _check_kind(key, path, "signing_key")
    return key


def load_public_key(path: str | Path) -> Any:
    """A site's public signing key (an OpenSSH ``.pub`` line or PEM): Ed25519 or ECDSA."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = _read(path, "site_keys")
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(data)
        else:
            key = serialization.load_ssh_public_key(b" ".join(data.split()[:2]))
    except (ValueError, TypeError, IndexError, UnsupportedAlgorithm) as error:
        raise ValueError(
            f"site key {path} is not an OpenSSH or PEM public key ({error}): give each "
            "site's .pub file, e.g. from python -m lightning_fl.flower.credentials."
        ) from None
    _check_kind(key, path, "site_keys")
    return key


def _read(path: str | Path, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise FileNotFoundError(
            f"{option}: cannot read {path} ({error.strerror}): check the path (its {{silo}} "
            "is replaced by each site's name)."
        ) from None


def _check_kind(key: Any, path: str | Path, option: str) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    kinds = (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey,
             ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey)  # fmt: skip
    if not isinstance(key, kinds):
        raise ValueError(
            f"{option} {path} is a {type(key).__name__}: use an Ed25519 or ECDSA key "
            "(the Flower node keys are ECDSA P-384)."
        )


def signed_message(world_size: int, rank: int, name: str, public: bytes) -> bytes:
    """What site ``rank`` (``name``) signs for its key-agreement key ``public``."""
    return b"\0".join([CONTEXT, str(world_size).encode(), str(rank).encode(), name.encode(),
                       public])  # fmt: skip


def sign(key: Any, message: bytes) -> bytes:
    """``key``'s signature of ``message`` (Ed25519, or ECDSA with SHA-384)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(message, ec.ECDSA(hashes.SHA384()))
    return key.sign(message)


def verifies(key: Any, signature: Any, message: bytes) -> bool:
    """Whether ``signature`` is ``key``'s of ``message`` (a missing one does not)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    if not isinstance(signature, bytes) or not signature:
        return False
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, message, ec.ECDSA(hashes.SHA384()))
        else:
            key.verify(signature, message)
    except InvalidSignature:
        return False
    return True


class SiteSignatures:
    """This site's signing key (``own``) and every site's public signing key
    (``site_keys``, in rank order), with the sites' ``names``."""

    def __init__(self, own: Any, site_keys: Sequence[Any], names: Sequence[str]) -> None:
        if len(site_keys) != len(names):
            raise ValueError(f"{len(site_keys)} site keys for {len(names)} sites.")
        self.own, self.site_keys, self.names = own, list(site_keys), list(names)

    @classmethod
    def from_files(cls, signing_key: str, site_keys: str, names: Sequence[str],
                   rank: int) -> SiteSignatures:  # fmt: skip
        """The keys of the templates ``signing_key`` and ``site_keys`` (``{silo}`` is
        replaced by a site's name); refused when this site's own public key is not the
        one the recipe lists for it."""
        own = load_private_key(signing_key.replace("{silo}", names[rank]))
        publics = [load_public_key(site_keys.replace("{silo}", name)) for name in names]
        probe = signed_message(len(names), rank, names[rank], b"probe")
        if not verifies(publics[rank], sign(own, probe), probe):
            listed = site_keys.replace("{silo}", names[rank])
            raise ValueError(
                f"site {names[rank]!r}: its signing key does not match its public key in "
                f"the recipe's site keys ({listed}): give this site's own key pair."
            )
        return cls(own, publics, names)

    def sign(self, rank: int, public: bytes) -> bytes:
        """This site's signature of its key-agreement key ``public``."""
        return sign(self.own, signed_message(len(self.names), rank, self.names[rank], public))

    def forged(self, offers: Sequence[tuple[bytes, bytes | None] | None]) -> list[int]:
        """The ranks whose offered ``(public key, signature)`` does not verify (``None``:
        a site that dropped, which offered nothing)."""
        world = len(self.names)
        return [
            rank
            for rank, offer in enumerate(offers)
            if offer is not None
            and not verifies(
                self.site_keys[rank],
                offer[1],
                signed_message(world, rank, self.names[rank], offer[0]),
            )  # fmt: skip
        ]


def agree_verdicts(forged: list[int], names: Sequence[str], rank: int,
                   exchange: Callable[[Any], list[Any]]) -> None:  # fmt: skip
    """Every site tells the others which sites' keys it found forged (one exchange), and
    every site stops, naming them, if any site found one."""
    verdicts = exchange(sorted(forged))
    verdicts[rank] = sorted(forged)  # its own, whatever a relay returned for it
    bad = sorted({int(r) for verdict in verdicts for r in verdict})
    if bad:
        who = ", ".join(f"{names[r]!r} (rank {r})" for r in bad)
        seen = ", ".join(names[s] for s, verdict in enumerate(verdicts) if verdict)
        raise KeyAuthenticationError(
            f"SecureAggregation: the key-agreement key of site {who} is not signed by its "
            f"signing key (found by {seen}): a party between the sites substituted it, or "
            "the site signs with another key than the recipe's site_keys. Every site stops: "
            "check the relay and that every site lists the same site_keys."
        )


__all__ = [
    "KeyAuthenticationError",
    "SiteSignatures",
    "agree_verdicts",
    "load_private_key",
    "load_public_key",
    "signed_message",
]
