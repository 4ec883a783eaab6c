"""Seconds a round of the heart recipe across 3 sites on localhost: over Flower (the relay
mode: SuperLink with TLS and node keys, a SuperNode and a ``lightning-fl fit --silo NAME``
per site, as the README's "Deploying across hospitals" runs them; the server-side mode:
the same runtime, one SuperNode per client, the ServerApp aggregating) against silo mode
over gloo (the same 3 site processes, torch.distributed), and the 1-process simulation.

    python benchmarks/flower_rounds.py [--rounds 6]
        [--modes relay,server_side,server_side_secagg,silo,simulation]
        [--repo PATH] [--out benchmarks/results/flower.md]

A round's time is the interval between two of the first site's round lines
(``<run folder>/sites/usa.log``, engine/site_log.py), seen as they appear; the table gives
the median over rounds 1..R-1 (round 0 carries the set-up's tail) and the whole fit.
``--repo`` times another checkout of lightning_fl (a commit before a change) with this
script. Each site runs at one thread. Real data: ``../shared/data/fed_heart_disease``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
HEART = HERE.parent / "shared" / "data" / "fed_heart_disease"
SITES = {"usa": ["cleveland", "va"], "hungary": ["hungarian"], "switzerland": ["switzerland"]}
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Started processes, each in a session of its own, stopped together."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder, self.env, self.started = folder, env, []

    def start(self, name: str, command: list[str], cwd: Path, env=None) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "w")  # noqa: SIM115 - closed at exit
        process = subprocess.Popen(command, cwd=cwd, env=env or self.env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.started.append(process)
        return process

    def stop(self) -> None:
        for process in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.started:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def _round_times(log: Path, rounds: int, running: list[subprocess.Popen], limit: float):
    """When each of the first site's ``rounds`` round lines appears (monotonic seconds)."""
    seen: list[float] = []
    deadline = time.monotonic() + limit
    while len(seen) < rounds:
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in running):
            raise RuntimeError(f"{len(seen)} of {rounds} rounds seen in {log}")
        lines = log.read_text().splitlines() if log.exists() else []
        now = time.monotonic()
        seen += [now] * (sum(": round " in line for line in lines) - len(seen))
        time.sleep(0.05)
    return seen


def _site_command(recipe: Path, name: str, rounds: int, extra: list[str]) -> list[str]:
    return [str(BIN / "lightning-fl"), "fit", "--config", str(recipe), "--silo", name,
            "--trainer.max_epochs", str(rounds), "--trainer.enable_progress_bar", "false",
            "--test_after_fit", "false", *extra]  # fmt: skip


def _prepare_sites(tmp: Path) -> None:
    for name, centers in SITES.items():
        folder = tmp / name / "data" / "heart_flower" / name
        folder.mkdir(parents=True)
        for center in centers:
            shutil.copy(HEART / f"processed.{center}.data", folder)


class SecureLink:
    """A SuperLink on localhost with TLS and node authentication, and the keys of
    ``names`` registered (as the README deploys it); the processes it starts are stopped
    together (:meth:`stop`)."""

    def __init__(self, tmp: Path, repo: Path, names: list[str]) -> None:
        from lightning_fl.flower.credentials import write_credentials

        self.tmp, self.creds, self.port = tmp, tmp / "creds", _free_port()
        write_credentials(self.creds, names)
        self.env = {**os.environ, "FLWR_HOME": str(tmp / "home"), "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(repo), "PATH": f"{BIN}:{os.environ['PATH']}"}  # fmt: skip
        (tmp / "home").mkdir()
        (tmp / "home" / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.port}"\nroot-certificates = "{self.creds / "ca.crt"}"\n'
        )
        self.processes = Processes(tmp, self.env)
        creds = self.creds
        try:
            self.processes.start("superlink", [
                str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(creds / "ca.crt"),
                "--ssl-certfile", str(creds / "server.pem"), "--ssl-keyfile",
                str(creds / "server.key"), "--enable-supernode-auth", "--port", str(self.port),
                "--disable-runtime-dependency-installation"], tmp)  # fmt: skip
            time.sleep(8)
            for name in names:
                self.flwr("supernode", "register", str(creds / f"{name}.pub"), "local",
                          "--name", name)  # fmt: skip
        except BaseException:
            self.stop()
            raise

    def supernode(self, name: str, node_config: str, cwd: Path) -> subprocess.Popen:
        return self.processes.start(f"supernode_{name}", [
            str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{self.port}",
            "--root-certificates", str(self.creds / "ca.crt"), "--auth-supernode-private-key",
            str(self.creds / f"{name}.key"), "--port", str(_free_port()), "--node-config",
            node_config], cwd)  # fmt: skip

    def flwr(self, *args: str) -> None:
        subprocess.run([str(BIN / "flwr"), *args], env=self.env, cwd=self.tmp, check=True,
                       capture_output=True)  # fmt: skip

    def stop(self) -> None:
        self.processes.stop()


def relay(tmp: Path, repo: Path, rounds: int) -> list[float]:
    _prepare_sites(tmp)
    link = SecureLink(tmp, repo, list(SITES))
    mailboxes = Path(tempfile.mkdtemp(prefix="lflb", dir="/tmp"))
    try:
        mailbox_option = ["--trainer.strategy.init_args.transport.init_args.mailbox",
                          str(mailboxes / "{silo}.sock")]  # fmt: skip
        recipe = repo / "recipes" / "flamby" / "heart_flower.yaml"
        sites = []
        for name in SITES:
            link.supernode(name, f'mailbox="{mailboxes / f"{name}.sock"}"', tmp / name)
            command = _site_command(recipe, name, rounds, mailbox_option)
            sites.append(link.processes.start(name, command, tmp / name))
        link.flwr("run", str(repo / "recipes" / "flower"), "local", "--run-config",
                  "sites=3 step-timeout=300")  # fmt: skip
        log = tmp / "usa" / "outputs" / "flamby" / "heart_flower" / "version_0" / "sites"
        return _round_times(log / "usa.log", rounds, sites, 120 + 120 * rounds)
    finally:
        link.stop()
        shutil.rmtree(mailboxes, ignore_errors=True)


def server_side(tmp: Path, repo: Path, rounds: int, extra: str = "") -> list[float]:
    """The server-side mode on the same runtime (SuperLink with TLS and node keys): one
    SuperNode per client of the heart recipe (4, ``--node-config client=N``), the
    ServerApp's FederatedServer aggregating; a round ends when the server writes its
    checkpoint (``server_checkpoint.pt``). ``extra``: more run config."""
    clients = [f"client{c}" for c in range(4)]
    link = SecureLink(tmp, repo, clients)
    out = tmp / "server"
    try:
        nodes = [link.supernode(name, f"client={c}", tmp) for c, name in enumerate(clients)]
        recipe = repo / "recipes" / "flamby" / "heart_scaffold.yaml"
        config = (f'recipe="{recipe}" clients=4 out="{out}" overrides="--data.init_args.root '
                  f'{HEART} --trainer.max_epochs {rounds}" {extra}')  # fmt: skip
        link.flwr("run", str(repo / "recipes" / "flower_server"), "local", "--run-config", config)
        return _file_times(out / "server_checkpoint.pt", rounds, nodes, 120 + 120 * rounds)
    finally:
        link.stop()


def _file_times(path: Path, rounds: int, running: list[subprocess.Popen], limit: float):
    """When ``path`` is written for each of ``rounds`` rounds (monotonic seconds)."""
    seen: list[float] = []
    last = None
    deadline = time.monotonic() + limit
    while len(seen) < rounds:
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in running):
            raise RuntimeError(f"{len(seen)} of {rounds} rounds written to {path}")
        stamp = path.stat().st_mtime_ns if path.exists() else None
        if stamp is not None and stamp != last:
            seen.append(time.monotonic())
            last = stamp
        time.sleep(0.05)
    return seen


def silo(tmp: Path, repo: Path, rounds: int) -> list[float]:
    _prepare_sites(tmp)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # fmt: skip
    env.pop("LIGHTNING_FL_SILO", None)
    processes = Processes(tmp, env)
    recipe = repo / "recipes" / "flamby" / "heart_flower.yaml"
    try:
        sites = [processes.start(name, _site_command(recipe, name, rounds, [
            "--trainer.strategy.init_args.transport", "null"]), tmp / name)
            for name in SITES]  # fmt: skip
        log = tmp / "usa" / "outputs" / "flamby" / "heart_flower" / "version_0" / "sites"
        return _round_times(log / "usa.log", rounds, sites, 60 + 60 * rounds)
    finally:
        processes.stop()


def simulation(tmp: Path, repo: Path, rounds: int) -> list[float]:
    """One process over the four centers (no site log): the fit's rounds timed by a
    callback, in a child process at one thread."""
    script = (
        "import json, sys, time; import lightning.pytorch as pl\n"
        "from lightning_fl.cli import run\n"
        "class T(pl.Callback):\n"
        "    seen = []\n"
        "    def on_train_epoch_end(self, t, m): T.seen.append(time.monotonic())\n"
        "import lightning_fl.cli as c\n"
        f"run(['fit', '--config', {str(repo / 'recipes/flamby/heart_flower.yaml')!r},"
        f" '--trainer.max_epochs', '{rounds}', '--trainer.num_nodes', '1',"
        " '--trainer.strategy.init_args.silos', 'false', '--trainer.strategy.init_args.transport',"
        f" 'null', '--data.init_args.root', {str(HEART)!r}, '--test_after_fit', 'false',"
        " '--trainer.enable_progress_bar', 'false', '--trainer.callbacks+=__main__.T'],"
        " exit_on_error=False)\n"
        "print(json.dumps(T.seen))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp, env=env, text=True,
                            capture_output=True, timeout=60 + 30 * rounds)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def server_side_secagg(tmp: Path, repo: Path, rounds: int) -> list[float]:
    """The server-side mode with each round's training under Flower's SecAgg+ (its four
    stages: four messages a node and round)."""
    return server_side(tmp, repo, rounds, "secagg=true secagg-clipping-range=1.0")


MODES = {"relay": relay, "server_side": server_side, "server_side_secagg": server_side_secagg,
         "silo": silo, "simulation": simulation}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--modes", default="relay,server_side,silo,simulation")
    parser.add_argument("--repo", type=Path, default=HERE, help="the checkout to time")
    parser.add_argument("--label", default="", help="a name for the checkout in the table")
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    rows = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"flower_{mode}_") as tmp:
            start = time.monotonic()
            seen = MODES[mode](Path(tmp), args.repo.resolve(), args.rounds)
            gaps = [b - a for a, b in zip(seen, seen[1:])]
            rows.append((mode, statistics.median(gaps), seen[-1] - start))
            print(f"{mode}: {statistics.median(gaps):.2f} s/round (median of rounds 1-"
                  f"{args.rounds - 1}; gaps {[round(g, 2) for g in gaps]}), whole run "
                  f"{seen[-1] - start:.1f} s", flush=True)  # fmt: skip
    print(f"\n{platform.node()}, {os.cpu_count()} CPUs, {args.rounds} rounds, {args.label}")
    print("| mode | s/round | whole run (s) |\n|---|---|---|")
    for mode, per_round, whole in rows:
        print(f"| {mode} | {per_round:.2f} | {whole:.1f} |")


if __name__ == "__main__":
    main()
