"""A site's Flower SuperNode, with Flower's refusals said in one line each:

    python -m lightning_fl.flower.supernode --superlink HOST:PORT --root-certificates ca.crt \\
        --auth-supernode-private-key usa.key ...   # flower-supernode's own options

It runs ``flower-supernode`` with the same options, its output passed through, and stops
it with one last line naming the cause and the fix where Flower's own words do not
(README, "Deploying across hospitals"):

- a SuperNode without TLS against a SuperLink that speaks it (Flower: "Server
  disconnected without sending a response", retried);
- a SuperNode whose ``--root-certificates`` is another authority than the one that
  signed the SuperLink's certificate (Flower: ``CERTIFICATE_VERIFY_FAILED``);
- a SuperNode with TLS against a SuperLink without it;
- a node key that the SuperLink has not registered (Flower: "Failed to activate
  SuperNode").

The first three are found before the SuperNode starts, by opening one connection to the
SuperLink's address (a TLS handshake with the given authority, or a plain request); a
SuperLink that does not answer yet is left to the SuperNode's own retries. The process
exits with the SuperNode's status (1 after a refusal said here), and passes SIGTERM and
SIGINT on to it; the SuperNode runs in this process's group.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Sequence

#: Flower's words for a key the SuperLink has not registered
UNREGISTERED = "Failed to activate SuperNode"
PROBE_SECONDS = 5.0


def _options(args: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--superlink", default="0.0.0.0:9092")
    parser.add_argument("--root-certificates")
    parser.add_argument("--insecure", action="store_true")
    parser.add_argument("--auth-supernode-private-key")
    return parser.parse_known_args(list(args))[0]


def preflight(address: str, root_certificates: str | None, insecure: bool) -> str | None:
    """Why a SuperNode started so would be refused by the SuperLink at ``address`` (one
    line naming the cause and the fix), or None (it may connect, or the SuperLink does
    not answer yet)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        raw = socket.create_connection((host, int(port)), timeout=PROBE_SECONDS)
    except (OSError, ValueError):
        return None  # not up yet: the SuperNode retries
    with raw:
        if insecure:
            return _plain_probe(raw, address)
        if root_certificates is None:
            return None  # Flower's own message: it needs --root-certificates or --insecure
        try:
            context = ssl.create_default_context(cafile=root_certificates)
        except (OSError, ssl.SSLError):
            return (
                f"--root-certificates {root_certificates} is not a readable PEM certificate: "
                "give the path of the federation's ca.crt."
            )
        try:
            with context.wrap_socket(raw, server_hostname=host):
                return None
        except ssl.SSLCertVerificationError as err:
            if "hostname" in str(err).lower() or "ip address mismatch" in str(err).lower():
                return (
                    f"the SuperLink's certificate at {address} does not name {host}: connect "
                    "with the address its certificate was made for."
                )
            return (
                f"the SuperLink at {address} presents a certificate that {root_certificates} "
                "did not sign (another certificate authority): start the SuperNode with the "
                "federation's ca.crt, the one the SuperLink's --ssl-ca-certfile names, as "
                "--root-certificates."
            )
        except (ssl.SSLError, OSError):
            return (
                f"the SuperLink at {address} does not speak TLS: start it with "
                "--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile (a federation across sites "
                "needs TLS and node keys), or ask its operator to."
            )


def _plain_probe(raw: socket.socket, address: str) -> str | None:
    """A plain HTTP request: a SuperLink that speaks TLS answers with a TLS alert or
    closes without an HTTP answer."""
    try:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: superlink\r\nConnection: close\r\n\r\n")
        answer = raw.recv(16)
    except OSError:
        answer = b""
    if answer.startswith(b"HTTP/"):
        return None
    return (
        f"the SuperLink at {address} speaks TLS, and this SuperNode was started without it "
        "(--insecure): start it with --root-certificates <the federation's ca.crt> and its "
        "--auth-supernode-private-key."
    )


def unregistered(key: str | None) -> str:
    public = f"{key.removesuffix('.key')}.pub" if key else "the site's .pub key"
    return (
        f"the SuperLink does not admit this SuperNode's key ({key or 'no key given'}): "
        f"register its public key there (flwr supernode register {public} <superlink> --name "
        "<site>), or start the SuperNode with the key that was registered."
    )


def main(args: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if args is None else args)
    options = _options(args)
    refusal = preflight(options.superlink, options.root_certificates, options.insecure)
    if refusal is not None:
        print(f"lightning-fl: SuperNode refused: {refusal}", file=sys.stderr, flush=True)
        return 1
    executable = supernode_executable()
    if executable is None:
        print(
            "lightning-fl: flower-supernode is not installed: pip install 'lightning-fl[flower]'.",
            file=sys.stderr,
        )
        return 1
    # in this process's group: stopping the group (kill -- -PGID) stops the SuperNode too
    process = subprocess.Popen(
        [executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    handlers = {sig: signal.signal(sig, lambda number, _: _signal(process, number))
                for sig in (signal.SIGTERM, signal.SIGINT)}  # fmt: skip
    try:
        code, refused = _supervise(process)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if refused:
        said = unregistered(options.auth_supernode_private_key)
        print(f"lightning-fl: SuperNode refused: {said}", file=sys.stderr, flush=True)
        return 1
    return 128 - code if code < 0 else code  # a signal's number as a shell reports it


#: seconds the SuperNode has to exit by itself after refusing an unregistered key
REFUSED_GRACE = 15.0


def supernode_executable() -> str | None:
    """``flower-supernode`` beside this Python, else on the PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "flower-supernode")
    return beside if os.access(beside, os.X_OK) else shutil.which("flower-supernode")


def _supervise(process: subprocess.Popen) -> tuple[int, bool]:
    """Pass the SuperNode's output through until it exits (or, after it refused a key,
    until :data:`REFUSED_GRACE` seconds); its status and whether it refused the key."""
    refused = threading.Event()
    pump = threading.Thread(target=_pass_through, args=(process.stdout, refused), daemon=True)
    pump.start()
    while process.poll() is None and not refused.wait(0.1):
        pass
    if refused.is_set():  # Flower exits by itself after this refusal; do not wait forever
        try:
            process.wait(timeout=REFUSED_GRACE)
        except subprocess.TimeoutExpired:
            _signal(process, signal.SIGTERM)
    code = process.wait()
    pump.join(timeout=2)  # a SuperExec the SuperNode started may hold the pipe: not waited
    return code, refused.is_set()


def _pass_through(output, refused: threading.Event) -> None:
    for line in output:
        sys.stdout.write(line)
        sys.stdout.flush()
        if UNREGISTERED in line:
            refused.set()


def _signal(process: subprocess.Popen, number: int) -> None:
    if process.poll() is None:
        process.send_signal(number)


if __name__ == "__main__":
    sys.exit(main())
