"""Three hospitals on Flower's runtime (issue 67): a SuperLink over TLS with node
authentication, a SuperNode and a ``lightning-fl fit --silo NAME`` per site, all on
localhost, with certificates and node keys generated here. The protocol's own tests (no
Flower processes) are in tests/test_flower_relay.py."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

flwr = pytest.importorskip("flwr", reason="lightning-fl[flower] is not installed")

ROOT = Path(__file__).resolve().parents[1]
HEART = ROOT.parent / "shared" / "data" / "fed_heart_disease"
RECIPE = ROOT / "recipes" / "flamby" / "heart_flower.yaml"
#: the recipe's sites and the FLamby centers each holds (a site holds c with c % 3 = its place)
SITES = {"usa": ["cleveland", "va"], "hungary": ["hungarian"], "switzerland": ["switzerland"]}
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.skipif(not HEART.exists(), reason=f"real data not found at {HEART}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, log: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"port {port} not open after {seconds} s: {log.read_text()[-3000:]}")


class Federation:
    """The processes of one test, each in its own session (killed together at the end),
    each writing its console to ``<name>.log`` under ``logs``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.logs = tmp, tmp / "logs"
        self.logs.mkdir()
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "FLWR_HOME": str(tmp / "flwr_home"), "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(ROOT), "PATH": f"{BIN}:{os.environ['PATH']}"}  # fmt: skip
        self.env.pop("LIGHTNING_FL_SILO", None)

    def start(self, name: str, command: list[str], cwd: Path | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(command, cwd=cwd or self.tmp, env=self.env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.processes[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()

    def run(self, command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=self.tmp, env=self.env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def _start_superlink(fed: Federation, creds: Path, port: int, names: list[str]) -> None:
    """A SuperLink on ``port`` with TLS and node authentication, and ``names``' public
    keys registered with it (the README's deployment)."""
    link = fed.start("superlink", [
        str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(creds / "ca.crt"),
        "--ssl-certfile", str(creds / "server.pem"), "--ssl-keyfile", str(creds / "server.key"),
        "--enable-supernode-auth", "--port", str(port),
        "--disable-runtime-dependency-installation"])  # fmt: skip
    _wait_for_port(port, link, fed.logs / "superlink.log")
    for name in names:
        registered = fed.run([str(BIN / "flwr"), "supernode", "register",
                              str(creds / f"{name}.pub"), "local", "--name", name])  # fmt: skip
        assert "registered successfully" in registered.stdout, registered.stdout


def _site_command(tmp: Path, name: str, audit: str, mailboxes: Path, extra: list[str]) -> list[str]:
    (tmp / "audit" / audit).mkdir(parents=True)
    return [sys.executable, "-m", "tests.silo_audit", str(tmp / "sites"),
            str(tmp / "audit" / audit), "--", "fit", "--config", str(RECIPE), "--silo", name,
            "--trainer.enable_progress_bar", "false", "--test_after_fit", "false",
            "--trainer.max_epochs", "3", "--trainer.strategy.init_args.transport.init_args.mailbox",
            str(mailboxes / "{silo}.sock"), *extra]  # fmt: skip


def _simulation(tmp: Path) -> dict[str, torch.Tensor]:
    """The recipe on one process over the four centers' files: 3 rounds (in this
    process: its imports are the test's)."""
    from lightning_fl.cli import run

    out = tmp / "simulation"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = run(["fit", "--config", str(RECIPE), "--trainer.max_epochs", "3",
                   "--trainer.num_nodes", "1", "--trainer.strategy.init_args.silos", "false",
                   "--trainer.strategy.init_args.transport", "null", "--data.init_args.root",
                   str(HEART), "--test_after_fit", "false", "--trainer.enable_progress_bar",
                   "false", "--trainer.logger", "false", "--trainer.default_root_dir", str(out)],
                  exit_on_error=False)  # fmt: skip
    return {k: v.detach().clone() for k, v in cli.model.state_dict().items()}


def test_the_flower_recipe_is_flambys_scaffold_setup():
    from tests.test_flamby import _recipe_settings

    recipes = ROOT / "recipes" / "flamby"
    assert _recipe_settings(RECIPE) == _recipe_settings(recipes / "heart_scaffold.yaml")


def test_three_hospitals_over_tls_equal_the_simulation_and_a_killed_site_rejoins(tmp_path):
    """The issue's deployment, on localhost: a SuperLink with TLS and node authentication;
    a SuperNode with a wrong certificate authority, one with an unregistered key and one
    without TLS are refused, each with one last line naming the cause; three registered
    sites (each in its own folder, audited) train the heart recipe; hungary is SIGKILLed in
    round 1, and the run stops at once with a line naming it on the other sites; all three
    restarted with ``--ckpt_path last`` and the run submitted again finish round 3, in
    their run folders, and the model equals the 1-process simulation's to 1e-6. The failed
    run's status says so, naming hungary (exit 1), the second's that it completed; every
    site wrote each round and its resume."""
    from lightning_fl.flower.credentials import write_credentials

    tmp = tmp_path
    creds, stranger_ca = tmp / "creds", tmp / "other_ca"
    write_credentials(creds, [*SITES, "stranger"])
    write_credentials(stranger_ca, [])
    fed = Federation(tmp)
    mailboxes = Path(tempfile.mkdtemp(prefix="lfl", dir="/tmp"))  # a socket's path: <= 107 B
    port = _free_port()
    (tmp / "flwr_home").mkdir()
    (tmp / "flwr_home" / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n[superlink.local]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{creds / "ca.crt"}"\n'
    )
    for name, centers in SITES.items():
        folder = tmp / "sites" / name / "data" / "heart_flower" / name
        folder.mkdir(parents=True)
        for center in centers:
            shutil.copy(HEART / f"processed.{center}.data", folder)
    try:
        _start_superlink(fed, creds, port, list(SITES))
        # the README's SuperNode: flower-supernode, its refusals said in one line each
        supernode = [sys.executable, "-m", "lightning_fl.flower.supernode", "--superlink",
                     f"127.0.0.1:{port}"]  # fmt: skip
        refused = {
            "unregistered": fed.start("unregistered", [*supernode, "--root-certificates",
                str(creds / "ca.crt"), "--auth-supernode-private-key",
                str(creds / "stranger.key"), "--port", str(_free_port())]),
            "wrong_ca": fed.start("wrong_ca", [*supernode, "--root-certificates",
                str(stranger_ca / "ca.crt"), "--auth-supernode-private-key",
                str(creds / "usa.key"), "--port", str(_free_port())]),
            "no_tls": fed.start("no_tls", [*supernode, "--insecure", "--port",
                str(_free_port())]),
        }  # fmt: skip
        for name in SITES:
            mailbox = mailboxes / f"{name}.sock"
            fed.start(f"supernode_{name}", [*supernode, "--root-certificates",
                str(creds / "ca.crt"), "--auth-supernode-private-key", str(creds / f"{name}.key"),
                "--port", str(_free_port()), "--node-config", f'mailbox="{mailbox}"'],
                cwd=tmp / "sites" / name)  # fmt: skip

        def start_site(name: str, run: str, extra: list[str]) -> subprocess.Popen:
            command = _site_command(tmp, name, run, mailboxes, extra)
            return fed.start(run, command, cwd=tmp / "sites" / name)

        sites = {name: start_site(name, name, []) for name in SITES}
        causes = {
            "unregistered": "does not admit this SuperNode's key",
            "wrong_ca": "did not sign (another certificate authority)",
            "no_tls": "speaks TLS, and this SuperNode was started without it",
        }
        for name in refused:  # refused while the sites start, in one last line
            assert refused[name].wait(timeout=60) == 1, fed.log(name)
            last = fed.log(name).strip().splitlines()[-1]
            assert last.startswith("lightning-fl: SuperNode refused: ") and causes[name] in last
        submit = [str(BIN / "flwr"), "run", str(ROOT / "recipes" / "flower"), "local",
                  "--run-config", "sites=3 step-timeout=120 site-start-timeout=60",
                  "--format", "json"]  # fmt: skip
        first_run = json.loads(fed.run(submit).stdout)["run-id"]
        round_0 = tmp / "sites" / "hungary" / "outputs" / "flamby" / "heart_flower" / "version_0"
        deadline = time.monotonic() + 240
        while not (round_0 / "checkpoints" / "hungary" / "last.ckpt").exists():
            assert time.monotonic() < deadline and sites["hungary"].poll() is None, fed.log(
                "hungary"
            )
            time.sleep(0.1)
        os.killpg(sites["hungary"].pid, signal.SIGKILL)  # in round 1
        for name in ("usa", "switzerland"):
            assert sites[name].wait(timeout=180) != 0, fed.log(name)
            assert "hungary" in fed.log(name).splitlines()[-1], fed.log(name)[-2000:]
        status = [sys.executable, "-m", "lightning_fl.flower.run_status"]
        failed = fed.run([*status, first_run, "local", "--wait", "60"])
        assert failed.returncode == 1, failed
        assert failed.stdout.strip() == f"run {first_run}: finished:failed"
        assert "site 'hungary'" in failed.stderr.strip().splitlines()[-1], failed.stderr
        resumed = {name: start_site(name, f"{name}_resumed", ["--ckpt_path", "last"])
                   for name in SITES}  # fmt: skip
        second_run = json.loads(fed.run(submit).stdout)["run-id"]
        for name, process in resumed.items():
            assert process.wait(timeout=300) == 0, fed.log(f"{name}_resumed")[-3000:]
        completed = fed.run([*status, second_run, "local", "--wait", "60"])
        assert (completed.returncode, completed.stdout.strip()) == (
            0, f"run {second_run}: finished:completed"), completed  # fmt: skip
    finally:
        fed.stop_all()
        shutil.rmtree(mailboxes, ignore_errors=True)
    for name in SITES:
        runs = tmp / "sites" / name / "outputs" / "flamby" / "heart_flower"
        assert sorted(p.name for p in runs.iterdir()) == ["version_0"]
        for path in _opened(tmp, name):
            assert path.startswith(str((tmp / "sites" / name).resolve())), (name, path)
    usa = tmp / "sites" / "usa" / "outputs" / "flamby" / "heart_flower" / "version_0"
    with open(usa / "metrics.csv") as handle:
        rounds = {int(row["epoch"]) for row in csv.DictReader(handle) if row.get("epoch")}
    assert rounds == {0, 1, 2}
    for rank, name in enumerate(SITES):  # every site's console and run folder, each round
        folder = tmp / "sites" / name / "outputs" / "flamby" / "heart_flower" / "version_0"
        lines = (folder / "sites" / f"{name}.log").read_text().splitlines()
        trained = [c for c in range(4) if c % 3 == rank]
        rounds_said = [line for line in lines if ": round " in line]
        assert [line.split(": round ")[1].split(":")[0] for line in rounds_said][-3:] == [
            "0/2", "1/2", "2/2"]  # fmt: skip
        assert all(f"trained clients {trained} of 4 participants; train_loss " in line
                   for line in rounds_said)  # fmt: skip
        assert any("resumed from its checkpoint of round" in line for line in lines), lines
        assert rounds_said[-1] in fed.log(f"{name}_resumed"), name
    flower = torch.load(usa / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    simulated = _simulation(tmp)
    assert max(float((flower[k] - simulated[k]).abs().max()) for k in flower) <= 1e-6


def _opened(tmp: Path, name: str) -> list[str]:
    """Every file the site's two processes opened under the test's folder."""
    paths: list[str] = []
    for report in (tmp / "audit").glob(f"{name}*/opened_rank*.json"):
        paths += json.loads(report.read_text())
    return paths


def test_the_server_side_mode_over_tls_goes_on_without_a_killed_node(tmp_path):
    """The server-side mode as the README deploys it, on localhost: a SuperLink with TLS
    and node authentication, three registered SuperNodes (each ``--node-config
    client=N`` of the quickstart recipe cut to 3 clients, all drawn each round), the
    Flower App ``recipes/flower_server`` submitted with ``min-available-nodes=2``; client
    2's SuperNode is SIGKILLed once the server has checkpointed round 0. The rounds go on
    without it: the run completes (exit 0 of the status command), every round steps,
    client 2's update is dropped in round 1 (the server's log names each round's
    participants that did not reply within ``round-timeout``; Flower marks a node gone
    after 60 s without a heartbeat), and the final model equals lightning-fl's 1-process
    simulation with those updates dropped, to 1e-6."""
    from lightning_fl.flower import server_side
    from lightning_fl.flower.credentials import write_credentials
    from tests.test_flower_dropout import DroppedIn

    tmp, rounds = tmp_path, 2
    nodes = ["client0", "client1", "client2"]
    creds = tmp / "creds"
    write_credentials(creds, nodes)
    fed = Federation(tmp)
    port = _free_port()
    (tmp / "flwr_home").mkdir()
    (tmp / "flwr_home" / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n[superlink.local]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{creds / "ca.crt"}"\n'
    )
    recipe = ROOT / "recipes" / "quickstart.yaml"
    cut = ["--data.init_args.num_clients", "3", "--trainer.max_epochs", str(rounds),
           "--trainer.strategy.init_args.sampler.init_args.clients_per_round", "3"]  # fmt: skip
    out = tmp / "server"
    try:
        _start_superlink(fed, creds, port, nodes)
        for c, name in enumerate(nodes):
            (tmp / name).mkdir()
            fed.start(name, [sys.executable, "-m", "lightning_fl.flower.supernode",
                "--superlink", f"127.0.0.1:{port}", "--root-certificates", str(creds / "ca.crt"),
                "--auth-supernode-private-key", str(creds / f"{name}.key"), "--port",
                str(_free_port()), "--node-config", f"client={c}"], cwd=tmp / name)  # fmt: skip
        config = (f'recipe="{recipe}" out="{out}" clients=3 min-available-nodes=2 '
                  f'round-timeout=15 evaluate="" overrides="{" ".join(cut)}"')  # fmt: skip
        submitted = fed.run([str(BIN / "flwr"), "run", str(ROOT / "recipes" / "flower_server"),
                             "local", "--run-config", config, "--format", "json"])  # fmt: skip
        run = json.loads(submitted.stdout)["run-id"]
        deadline = time.monotonic() + 240
        trained = "lightning-fl: client 2: round 0/1 trained"
        # round 0 is aggregated, and client 2's console line (printed before its reply)
        # has come through its SuperNode's output pump, which the kill would cut
        while not (out / server_side.CHECKPOINT).exists() or trained not in fed.log("client2"):
            assert time.monotonic() < deadline, fed.log("client2")[-3000:]
            time.sleep(0.1)
        os.killpg(fed.processes["client2"].pid, signal.SIGKILL)
        status = [sys.executable, "-m", "lightning_fl.flower.run_status", str(run), "local"]
        completed = fed.run([*status, "--wait", "300"])
        assert (completed.returncode, completed.stdout.strip()) == (
            0, f"run {run}: finished:completed"), completed  # fmt: skip
        log = fed.run([str(BIN / "flwr"), "log", str(run), "local", "--show"]).stdout
    finally:
        fed.stop_all()
    assert log.count("Aggregated MetricRecord") == rounds, log[-3000:]  # every round's step
    said = [line.split("lightning-fl: ", 1)[1] for line in log.splitlines()
            if "lightning-fl: round " in line]  # fmt: skip
    assert [line.split(":")[0] for line in said] == ["round 0/1", "round 1/1"], log[-3000:]
    gone = said[1].split("dropped [", 1)[1].split("]")[0]  # client 2's, and any late reply
    assert said[1].startswith("round 1/1: clients [0, 1, 2]") and "2" in gone.split(", ")
    with open(out / "rounds.csv") as handle:
        assert [row["round"] for row in csv.DictReader(handle)] == ["0", "1"]
    for c in range(3):  # each node's console: its client's rounds (client 2 until it left)
        assert f"lightning-fl: client {c}: round 0/1 trained, train_loss " in fed.log(f"client{c}")
    dropped: dict[int, set[int]] = {}  # round -> its participants that did not reply
    for found in re.finditer(r"Round (\d+): clients \[([\d, ]+)\] did not reply", log):
        dropped[int(found[1])] = {int(c) for c in found[2].split(",")}
    assert 2 in dropped.get(rounds - 1, ()), log[-3000:]  # gone: not sent, or no reply
    quiet = ("--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
             "--trainer.default_root_dir", str(tmp / "simulation"))  # fmt: skip
    cli = server_side.instantiate(server_side.Settings(str(recipe), (*cut, *quiet)))
    cli.trainer.callbacks += [DroppedIn(clients, {r}) for r, clients in dropped.items()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dropped updates' warnings
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    flower = torch.load(out / "final_model.pt", weights_only=True)
    simulated = cli.model.state_dict()
    assert max(float((flower[k] - simulated[k]).abs().max()) for k in flower) <= 1e-6
