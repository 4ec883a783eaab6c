"""Signed key agreement (issue 76; Bonawitz et al. 2017, Fig. 4 Round 0): each site signs
its X25519 key with its site signing key; a forged, unsigned or replayed key is found, and
the keys and settings a user gives are checked with errors that name the fix. The relay
that swaps keys on the wire is tests/test_flower_relay.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("cryptography")

from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa  # noqa: E402

from lightning_fl.callbacks import SecureAggregation  # noqa: E402
from lightning_fl.flower.credentials import write_credentials  # noqa: E402
from lightning_fl.systems.key_signatures import (  # noqa: E402
    KeyAuthenticationError,
    SiteSignatures,
    agree_verdicts,
    load_private_key,
    load_public_key,
)

NAMES = ["usa", "hungary", "switzerland"]


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    out = tmp_path_factory.mktemp("creds")
    write_credentials(out, NAMES)
    return out


def _signatures(creds, rank: int) -> SiteSignatures:
    return SiteSignatures.from_files(str(creds / "{silo}.key"), str(creds / "{silo}.pub"),
                                     NAMES, rank)  # fmt: skip


def test_each_sites_signed_key_verifies_and_any_other_offer_is_found(creds):
    sites = [_signatures(creds, r) for r in range(3)]
    keys = [bytes([r]) * 32 for r in range(3)]
    offers = [(keys[r], sites[r].sign(r, keys[r])) for r in range(3)]
    assert all(site.forged(offers) == [] for site in sites)
    swapped = list(offers)
    swapped[1] = (bytes(32), offers[1][1])  # another key under hungary's signature
    assert sites[0].forged(swapped) == [1]
    unsigned = list(offers)
    unsigned[2] = (keys[2], None)
    assert sites[0].forged(unsigned) == [2]
    replayed = list(offers)
    replayed[2] = offers[1]  # hungary's signed key offered as switzerland's
    assert sites[0].forged(replayed) == [2]
    other_run = SiteSignatures(sites[0].own, sites[0].site_keys + [None], NAMES + ["x"])
    assert other_run.forged([*offers, (b"", b"")])[:3] == [0, 1, 2]  # signed for 3 sites


def test_every_site_stops_on_any_sites_verdict_and_keeps_its_own():
    def exchange_hiding_verdicts(value):
        return [[], [], []]  # a relay that hides every verdict, this site's own included

    agree_verdicts([], NAMES, 0, lambda v: [[], [], []])  # nobody found anything
    with pytest.raises(KeyAuthenticationError, match=r"site 'hungary' \(rank 1\) .*found by usa"):
        agree_verdicts([1], NAMES, 0, exchange_hiding_verdicts)
    with pytest.raises(KeyAuthenticationError, match=r"'usa' \(rank 0\), 'switzerland' \(rank 2\)"):
        agree_verdicts([], NAMES, 1, lambda v: [[2], [], [0]])


def test_ed25519_and_pem_keys_sign_too(tmp_path):
    key = ed25519.Ed25519PrivateKey.generate()
    (tmp_path / "a.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))  # fmt: skip
    (tmp_path / "a.pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))  # fmt: skip
    site = SiteSignatures.from_files(str(tmp_path / "{silo}.key"), str(tmp_path / "{silo}.pub"),
                                     ["a"], 0)  # fmt: skip
    assert site.forged([(b"k" * 32, site.sign(0, b"k" * 32))]) == []
    assert site.forged([(b"j" * 32, site.sign(0, b"k" * 32))]) == [0]  # another key
    other = ed25519.Ed25519PrivateKey.generate()
    assert site.forged([(b"k" * 32, other.sign(b"k" * 32))]) == [0]  # another signer
    assert site.forged([(b"k" * 32, "a string")]) == [0]  # not a signature at all


def test_keys_that_cannot_serve_are_refused_naming_the_file_and_the_fix(creds, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"signing_key: cannot read .*nowhere.key"):
        load_private_key(tmp_path / "nowhere.key")
    (tmp_path / "junk.pub").write_text("not a key")
    with pytest.raises(ValueError, match=r"junk.pub is not an OpenSSH or PEM public key"):
        load_public_key(tmp_path / "junk.pub")
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    (tmp_path / "rsa.key").write_bytes(rsa_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))  # fmt: skip
    with pytest.raises(ValueError, match="RSAPrivateKey: use an Ed25519 or ECDSA key"):
        load_private_key(tmp_path / "rsa.key")
    (tmp_path / "rsa.pub").write_bytes(rsa_key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))  # fmt: skip
    with pytest.raises(ValueError, match="site_keys .*rsa.pub is a .*RSAPublicKey"):
        load_public_key(tmp_path / "rsa.pub")
    with pytest.raises(ValueError, match=r"site 'hungary': its signing key does not match"):
        SiteSignatures.from_files(str(creds / "usa.key"), str(creds / "{silo}.pub"), NAMES, 1)


def _plugin(silos: bool, names, **kw) -> SecureAggregation:
    plugin = SecureAggregation(**kw)
    plugin.view = SimpleNamespace(config=SimpleNamespace(silos=silos), site_names=names)
    return plugin


def test_secure_aggregation_between_separate_sites_needs_signed_keys(creds):
    with pytest.raises(ValueError, match=r"needs signed keys.*set signing_key='creds/\{silo\}"):
        _plugin(True, NAMES).signatures(0, 3)
    assert _plugin(False, None).signatures(0, 3) is None  # a trusted cluster's simulation
    assert _plugin(True, NAMES).signatures(0, 1) is None  # one site: nothing crosses
    keys = dict(signing_key=str(creds / "{silo}.key"), site_keys=str(creds / "{silo}.pub"))
    assert _plugin(True, NAMES, **keys).signatures(2, 3).names == NAMES
    with pytest.raises(ValueError, match=r"list the sites, FederatedStrategy\(silos=\[...names"):
        _plugin(True, None, **keys).signatures(0, 3)
    with pytest.raises(ValueError, match="give both, or neither"):
        SecureAggregation(signing_key="a.key")
