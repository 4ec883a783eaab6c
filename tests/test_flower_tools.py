"""The deployment's command-line helpers without Flower's processes (issue 77): the
SuperNode wrapper's refusals against local TLS and plain servers, and a run's outcome as
an exit status from what ``flwr ls`` and ``flwr log`` print. tests/test_flower.py runs
both against a real SuperLink."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lightning_fl.flower import run_status, supernode

pytest.importorskip("cryptography", reason="lightning-fl[flower] is not installed")


class Server:
    """A loopback server that answers each connection with ``answer`` (after a TLS
    handshake with ``context``, if given), then closes it."""

    def __init__(self, answer: bytes, context: ssl.SSLContext | None = None) -> None:
        self.answer, self.context = answer, context
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            try:
                if self.context is not None:
                    connection = self.context.wrap_socket(connection, server_side=True)
                connection.recv(1024)
                connection.sendall(self.answer)
            except (OSError, ssl.SSLError):
                pass
            finally:
                connection.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture(scope="module")
def creds(tmp_path_factory) -> tuple[Path, Path]:
    from lightning_fl.flower.credentials import write_credentials

    root = tmp_path_factory.mktemp("creds")
    write_credentials(root / "federation", ["usa"])
    write_credentials(root / "stranger", [])
    return root / "federation", root / "stranger"


def _tls(folder: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "server.pem", folder / "server.key")
    return context


def test_the_supernode_wrapper_names_each_refusal_before_flower_starts(creds):
    """Against a TLS SuperLink: the federation's authority passes, another authority and
    --insecure are refused naming the cause; against a plain one, TLS is refused; a
    missing authority file is named; a SuperLink that does not answer yet is left to the
    SuperNode's retries (None)."""
    federation, stranger = creds
    tls = Server(b"HTTP/1.1 404 Not Found\r\n\r\n", _tls(federation))
    plain = Server(b"HTTP/1.1 404 Not Found\r\n\r\n")
    try:
        assert supernode.preflight(tls.address, str(federation / "ca.crt"), False) is None
        other = supernode.preflight(tls.address, str(stranger / "ca.crt"), False)
        assert other.startswith(f"the SuperLink at {tls.address} presents a certificate that "
                                f"{stranger / 'ca.crt'} did not sign")  # fmt: skip
        insecure = supernode.preflight(tls.address, None, True)
        assert insecure.startswith(f"the SuperLink at {tls.address} speaks TLS, and this "
                                   "SuperNode was started without it (--insecure)")  # fmt: skip
        assert supernode.preflight(plain.address, None, True) is None
        no_tls = supernode.preflight(plain.address, str(federation / "ca.crt"), False)
        assert no_tls.startswith(f"the SuperLink at {plain.address} does not speak TLS")
        port = tls.address.rsplit(":", 1)[1]
        named = supernode.preflight(f"localhost:{port}", str(federation / "ca.crt"), False)
        assert named == (
            f"the SuperLink's certificate at localhost:{port} does not name "
            "localhost: connect with the address its certificate was made for."
        )
        assert supernode.preflight(f":{port}", str(federation / "ca.crt"), False) is None
        missing = supernode.preflight(tls.address, "/nowhere/ca.crt", False)
        assert missing.startswith("--root-certificates /nowhere/ca.crt is not a readable")
        assert supernode.preflight(tls.address, None, False) is None  # Flower says it
    finally:
        tls.close()
        plain.close()
    assert supernode.preflight(tls.address, str(federation / "ca.crt"), False) is None


FAKE = """import signal, sys, time
if "--help" in sys.argv:
    print("usage: flower-supernode [-h] ...", flush=True)
    sys.exit(0)
print("Starting Flower SuperNode", flush=True)
mode = sys.argv[sys.argv.index("--mode") + 1]
if mode == "unregistered":
    print("[code: 2004] Failed to activate SuperNode.", flush=True)
    sys.exit(1)
if mode == "stuck":
    print("[code: 2004] Failed to activate SuperNode.", flush=True)
    time.sleep(60)
if mode == "serve":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    time.sleep(60)
if mode == "die":  # SIGTERM's default: killed by it
    time.sleep(60)
sys.exit(int(mode))
"""


@pytest.fixture
def fake_supernode(tmp_path, monkeypatch):
    """flower-supernode replaced by a script whose ``--mode`` says what it does."""
    script = tmp_path / "flower-supernode"
    script.write_text(f"#!{sys.executable}\n{FAKE}")
    script.chmod(0o755)
    monkeypatch.setattr(supernode, "supernode_executable", lambda: str(script))
    monkeypatch.setattr(supernode, "REFUSED_GRACE", 0.5)
    return script


def test_the_supernode_wrapper_passes_flowers_output_and_status_through(
    fake_supernode, capsys, monkeypatch
):
    """Its output passed through; an unregistered key said in one last line (exit 1),
    also when the SuperNode does not exit by itself; another status kept; SIGTERM passed
    on (and the handlers given back); no flower-supernode named."""
    closed = ["--superlink", "127.0.0.1:1", "--auth-supernode-private-key", "k/usa.key"]
    assert supernode.main([*closed, "--mode", "unregistered"]) == 1
    out, err = capsys.readouterr()
    assert out == "Starting Flower SuperNode\n[code: 2004] Failed to activate SuperNode.\n"
    assert err.strip().splitlines() == [
        "lightning-fl: SuperNode refused: the SuperLink does not admit this SuperNode's key "
        "(k/usa.key): register its public key there (flwr supernode register k/usa.pub "
        "<superlink> --name <site>), or start the SuperNode with the key that was registered."
    ]
    assert supernode.main([*closed, "--mode", "stuck"]) == 1  # stopped after the grace
    assert "does not admit" in capsys.readouterr().err
    assert supernode.main([*closed, "--mode", "3"]) == 3
    assert capsys.readouterr().err == ""
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    assert supernode.main([*closed, "--mode", "serve"]) == 0  # it stopped on the signal
    assert signal.getsignal(signal.SIGTERM) is before
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    assert supernode.main([*closed, "--mode", "die"]) == 128 + signal.SIGTERM  # as a shell says
    capsys.readouterr()
    assert supernode.main(["--help"]) == 0  # flower-supernode's own help, not the wrapper's
    assert capsys.readouterr().out == "usage: flower-supernode [-h] ...\n"
    monkeypatch.setattr(sys, "argv", ["supernode", "--mode", "5"])
    assert supernode.main() == 5  # the command line's own arguments
    monkeypatch.setattr(supernode, "supernode_executable", lambda: None)
    assert supernode.main(closed) == 1
    assert "flower-supernode is not installed" in capsys.readouterr().err


def test_the_supernode_wrapper_exits_1_with_one_line_and_names_the_key(
    creds, capsys, fake_supernode
):
    federation, stranger = creds
    tls = Server(b"", _tls(federation))
    try:
        code = supernode.main(["--superlink", tls.address, "--root-certificates",
                               str(stranger / "ca.crt"), "--mode", "0"])  # fmt: skip
    finally:
        tls.close()
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning-fl: SuperNode refused: the SuperLink")
    said = supernode.unregistered("creds/usa.key")
    assert said.startswith("the SuperLink does not admit this SuperNode's key (creds/usa.key): "
                           "register its public key there (flwr supernode register "
                           "creds/usa.pub <superlink>")  # fmt: skip


class FakeFlwr:
    """What ``flwr ls`` and ``flwr log`` print, in turn (``statuses``), recorded."""

    def __init__(self, statuses: list[str], log: str = "", details: str = "") -> None:
        self.statuses, self.log, self.details, self.calls = list(statuses), log, details, []

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        self.calls.append(args)
        if args[0] == "log":
            return subprocess.CompletedProcess(args, 0, self.log, "")
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        runs = [{"run-id": "42", "status": status, "status-details": self.details}]
        return subprocess.CompletedProcess(args, 0, json.dumps({"success": True, "runs": runs}), "")


def test_a_runs_status_is_its_exit_code_with_the_servers_reason(monkeypatch, capsys):
    log = ("INFO: step 3\nERROR: ServerApp raised an exception\n"
           "lightning_fl.flower.apps.SiteFailure: site 'hungary' (SuperNode 7) closed its "
           "mailbox without answering\nERROR: Exit Code: 201\n")  # fmt: skip
    fake = FakeFlwr(["running", "running", "finished:failed"], log)
    monkeypatch.setattr(run_status, "_flwr", fake)
    slept: list[float] = []
    monkeypatch.setattr(run_status.time, "sleep", slept.append)
    assert run_status.main(["42", "local", "--wait", "60"]) == 1
    assert slept == [2.0, 2.0]
    out, err = capsys.readouterr()
    assert out.strip() == "run 42: finished:failed"
    assert err.strip() == ("lightning-fl: run 42 failed: site 'hungary' (SuperNode 7) closed "
                           "its mailbox without answering")  # fmt: skip
    assert fake.calls[0] == ("ls", "local", "--run-id", "42", "--format", "json")
    assert [c[0] for c in fake.calls] == ["ls", "ls", "ls", "log"]
    assert fake.calls[-1] == ("log", "42", "local", "--show")

    monkeypatch.setattr(run_status, "_flwr", FakeFlwr(["finished:completed"]))
    assert run_status.main(["42"]) == 0
    assert capsys.readouterr().out.strip() == "run 42: finished:completed"

    running = FakeFlwr(["running"])
    monkeypatch.setattr(run_status, "_flwr", running)
    assert run_status.main(["42", "local"]) == 2  # no wait: not finished
    assert len(running.calls) == 1
    assert "has not finished" in capsys.readouterr().err

    stopped = FakeFlwr(["finished:stopped"], "INFO: nothing\n", details="stopped by the user")
    monkeypatch.setattr(run_status, "_flwr", stopped)
    assert run_status.main(["42", "local"]) == 1
    assert capsys.readouterr().err.strip() == "lightning-fl: run 42 stopped: stopped by the user"
    server_side = FakeFlwr(
        ["finished:failed"],
        (
            "ERROR: ServerApp raised an exception\nTraceback (most recent call last):\n"
            '  File "x.py", line 3, in serve\n'
            "lightning_fl.flower.server_side.ServerSideError: round 2: 1 nodes are connected\n"
            "ERROR: Exit Code: 201\n"
        ),
    )  # the exception, not Flower's exit code
    monkeypatch.setattr(run_status, "_flwr", server_side)
    assert run_status.main(["42", "local"]) == 1
    assert capsys.readouterr().err.strip() == (
        "lightning-fl: run 42 failed: lightning_fl.flower.server_side.ServerSideError: "
        "round 2: 1 nodes are connected")  # fmt: skip
    other = FakeFlwr(["finished:failed"], "INFO: a\nValueError: the data is gone\nINFO: b\n")
    monkeypatch.setattr(run_status, "_flwr", other)
    assert run_status.main(["42", "local"]) == 1
    assert (
        capsys.readouterr().err.strip()
        == "lightning-fl: run 42 failed: ValueError: the data is gone"
    )


def test_a_reason_that_quotes_the_mark_and_an_unreadable_listing(monkeypatch):
    log = "x SiteFailure: site 'usa' failed: SiteFailure: its own relay stopped\n"
    monkeypatch.setattr(run_status, "_flwr", FakeFlwr(["finished:failed"], log))
    assert run_status.reason(42, [], "") == "site 'usa' failed: SiteFailure: its own relay stopped"

    def broken(*args):
        return subprocess.CompletedProcess(args, 1, "not json", "a\nb\nInvalid SuperLink 'x'\n")

    monkeypatch.setattr(run_status, "_flwr", broken)
    with pytest.raises(SystemExit, match="flwr ls could not list run 42: Invalid SuperLink 'x'"):
        run_status.status(42, ["x"])
    monkeypatch.setattr(run_status, "_flwr",
                        lambda *a: subprocess.CompletedProcess(a, 2, "", ""))  # fmt: skip
    with pytest.raises(SystemExit, match="could not list run 42: exit status 2"):
        run_status.status(42, [])


def test_run_status_says_what_it_does(capsys):
    with pytest.raises(SystemExit):
        run_status.main(["--help"])
    assert "A Flower run's outcome as an exit status" in capsys.readouterr().out
