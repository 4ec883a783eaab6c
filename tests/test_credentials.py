"""The Flower credentials' chain of trust without Flower or the shared data (issue 79): the
trial authority signs the SuperLink's certificate for exactly the hosts asked, a TLS client
that trusts the authority completes a handshake on loopback and one that trusts another
authority is refused, and each site's node key pair matches, is P-384 and private to its
owner. (tests/test_flower.py runs the SuperLink itself where the data is.)"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import stat
import threading

import pytest

pytest.importorskip("cryptography")

from cryptography import x509  # noqa: E402
from cryptography.exceptions import InvalidSignature  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

from lightning_fl.flower.credentials import main, write_credentials  # noqa: E402


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    out = tmp_path_factory.mktemp("creds")
    write_credentials(out, ["usa", "hungary"], hosts=["127.0.0.1", "superlink.example.org"],
                      days=7)  # fmt: skip
    stranger = tmp_path_factory.mktemp("stranger")
    write_credentials(stranger, [])
    return out, stranger


def _cert(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_the_authority_signs_the_superlink_for_exactly_the_hosts_asked(creds):
    out, stranger = creds
    ca, server = _cert(out / "ca.crt"), _cert(out / "server.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    ca.verify_directly_issued_by(ca)  # self-signed root
    server.verify_directly_issued_by(ca)
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert names.get_values_for_type(x509.DNSName) == ["superlink.example.org"]
    life = server.not_valid_after_utc - server.not_valid_before_utc
    assert life == datetime.timedelta(days=7, minutes=5)  # valid from 5 minutes ago
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).critical
    assert not server.extensions.get_extension_for_class(x509.SubjectAlternativeName).critical
    with pytest.raises(InvalidSignature):  # another authority, of the same name, did not sign it
        server.verify_directly_issued_by(_cert(stranger / "ca.crt"))
    key = serialization.load_pem_private_key((out / "server.key").read_bytes(), None)
    assert key.public_key() == server.public_key()


def test_site_keys_are_matching_p384_pairs_private_to_their_owner(creds):
    out, _ = creds
    for site in ("usa", "hungary"):
        private = serialization.load_ssh_private_key((out / f"{site}.key").read_bytes(), None)
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        assert private.curve.name == "secp384r1"
        line = (out / f"{site}.pub").read_text().split()
        assert line[0] == "ecdsa-sha2-nistp384" and line[2] == site
        public = serialization.load_ssh_public_key(" ".join(line[:2]).encode())
        assert public == private.public_key()
        for name in (f"{site}.key", "ca.key", "server.key"):
            assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name


def _handshake(creds_dir, trusted, host="127.0.0.1") -> None:
    """A TLS server with the SuperLink's certificate on a loopback port, and a client
    that trusts ``trusted`` and checks the host name; raises what the client sees."""
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(creds_dir / "server.pem", creds_dir / "server.key")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve():
        try:
            connection, _ = listener.accept()
            with server_context.wrap_socket(connection, server_side=True) as tls:
                tls.recv(1)
        except (OSError, ssl.SSLError):
            pass

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        client_context = ssl.create_default_context(cafile=str(trusted))
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with client_context.wrap_socket(raw, server_hostname=host) as tls:
                tls.sendall(b"x")
    finally:
        listener.close()
        thread.join(timeout=10)


def test_tls_on_loopback_trusts_the_authority_and_refuses_a_stranger(creds):
    out, stranger = creds
    _handshake(out, out / "ca.crt")
    with pytest.raises(ssl.SSLCertVerificationError, match="CERTIFICATE_VERIFY_FAILED"):
        _handshake(out, stranger / "ca.crt")
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch|doesn't match"):
        _handshake(out, out / "ca.crt", host="other.example.org")


def test_the_command_writes_every_file(tmp_path, capsys):
    main([str(tmp_path / "c"), "--sites", "a", "b", "--host", "10.0.0.5"])
    assert "wrote ca.crt, server.pem, server.key" in capsys.readouterr().out
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == ["a.key", "a.pub", "b.key", "b.pub", "ca.crt", "ca.key", "server.key",
                     "server.pem"]  # fmt: skip
    server = _cert(tmp_path / "c" / "server.pem")
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5")]


def test_a_new_nested_folder_and_a_rewrite_keep_private_files_private(tmp_path):
    """Written into a folder that does not exist yet (nor its parent), with no umask to
    hide a wrong mode: private keys 0600 exactly. Written again into the same folder:
    every key is new (the old files replaced, never opened for writing)."""
    import os

    out = tmp_path / "deployment" / "creds"
    old_mask = os.umask(0)
    try:
        write_credentials(out, ["usa"])
        first = (out / "usa.key").read_bytes()
        write_credentials(out, ["usa"])
    finally:
        os.umask(old_mask)
    for name in ("usa.key", "ca.key", "server.key"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    assert (out / "usa.key").read_bytes() != first


def test_the_command_needs_the_sites_and_certifies_30_days_by_default(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "none")])
    assert "--sites" in capsys.readouterr().err
    main([str(tmp_path / "c"), "--sites", "a"])
    server = _cert(tmp_path / "c" / "server.pem")
    life = server.not_valid_after_utc - server.not_valid_before_utc
    assert life == datetime.timedelta(days=30, minutes=5)
