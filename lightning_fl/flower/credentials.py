"""Certificates and node keys for a Flower federation, for a trial on one's own machines.

    python -m lightning_fl.flower.credentials OUT --sites usa hungary switzerland \\
        [--host 127.0.0.1 --host superlink.example.org]

writes into OUT:

- ``ca.crt`` (every party's trust root) and ``ca.key`` (the authority's key: keep it off
  the servers);
- ``server.pem`` and ``server.key``: the SuperLink's TLS certificate, valid for each
  ``--host`` (IP address or DNS name), and its key;
- ``<site>.key`` and ``<site>.pub``: each site's node key pair (EC P-384, OpenSSH
  format), the private key for the site's SuperNode (``--auth-supernode-private-key``),
  the public key for the federation's operator (``flwr supernode register``).

A real federation uses its institutions' own authority and each site generates its own
key pair, sending only the ``.pub`` file; this command is the one-machine rehearsal.
Private keys are written with mode 0600. Needs ``cryptography`` (``lightning-fl[flower]``).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path


def write_credentials(out: Path, sites: Sequence[str], hosts: Sequence[str] = ("127.0.0.1",),
                      days: int = 30) -> None:  # fmt: skip
    """The files listed in the module's docstring, under ``out``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = _certificate("lightning-fl federation CA", ca_key.public_key(), ca_key,
                           "lightning-fl federation CA", [], days, authority=True)  # fmt: skip
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = _certificate("superlink", server_key.public_key(), ca_key,
                               "lightning-fl federation CA", hosts, days)  # fmt: skip
    pem = serialization.Encoding.PEM
    (out / "ca.crt").write_bytes(ca_cert.public_bytes(pem))
    (out / "server.pem").write_bytes(server_cert.public_bytes(pem))
    _write_private(out / "ca.key", _pem_private(ca_key))
    _write_private(out / "server.key", _pem_private(server_key))
    for site in sites:
        key = ec.generate_private_key(ec.SECP384R1())
        _write_private(out / f"{site}.key", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption()))  # fmt: skip
        public = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        (out / f"{site}.pub").write_bytes(public + f" {site}\n".encode())


def _certificate(subject: str, public_key, signing_key, issuer: str, hosts: Sequence[str],
                 days: int, authority: bool = False):  # fmt: skip
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=authority, path_length=None), critical=True)
    )
    if hosts:
        names = [_host_name(h) for h in hosts]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _host_name(host: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _pem_private(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip


def _write_private(path: Path, data: bytes) -> None:
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_fl.flower.credentials",
        description="Certificates and node keys for a Flower federation (a trial).",
    )
    parser.add_argument("out", type=Path, help="the folder to write into")
    parser.add_argument("--sites", nargs="+", required=True, help="the recipe's site names")
    parser.add_argument("--host", action="append", default=None,
                        help="the SuperLink's address as sites dial it (repeatable; "
                        "default 127.0.0.1)")  # fmt: skip
    parser.add_argument("--days", type=int, default=30, help="validity (default 30)")
    args = parser.parse_args(argv)
    write_credentials(args.out, args.sites, args.host or ["127.0.0.1"], args.days)
    print(f"wrote ca.crt, server.pem, server.key and a key pair per site into {args.out}")


if __name__ == "__main__":
    main()
