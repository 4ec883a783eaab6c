"""Rounds that complete without a site that drops, and the site rejoining (issue 76):
three sites, each its own process running a real fit (tests/flower_dropout_site.py)
through ``FlowerSite(min_sites=2)``, the server's loop (:func:`run_steps`, the
ServerApp's own) in this process, reaching each site through its mailbox as the
ClientApp's courier does. Hungary's process SIGKILLs itself in round 1; usa and
switzerland go on; hungary is started again from its last checkpoint and rejoins at the
end of round 2, without the others restarting. All three end with the model of a
1-process simulation in which hungary's clients' updates are dropped in rounds 1 and 2
(θ^{t+1} = θ^t + Σ_{i arrived} ω_i Δ_i, the weights of the others unchanged)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("flwr", reason="lightning-fl[flower] is not installed")
pytest.importorskip("cryptography")

from lightning_fl import FederatedStrategy  # noqa: E402
from lightning_fl.callbacks import FederatedCallback  # noqa: E402
from lightning_fl.flower import wire  # noqa: E402
from lightning_fl.flower.apps import RunSettings, _through_mailbox, run_steps  # noqa: E402
from tests.flower_dropout_site import CLIENTS, KILL_ROUND, NAMES, ROUNDS  # noqa: E402
from tests.helpers import ROOT, make_trainer, params_of, tiny_datamodule, tiny_module  # noqa: E402

KILLED = 1
AWAY = {KILL_ROUND, KILL_ROUND + 1}  # the rounds without hungary


class DroppedIn(FederatedCallback):
    """Simulation's stand-in for a site that is gone: in ``rounds``, the updates of
    ``clients`` are NaN, which the engine drops (not renormalized)."""

    def __init__(self, clients: set[int], rounds: set[int]) -> None:
        self.clients, self.rounds = clients, rounds

    def transform_update(self, trainer, pl_module, client, update, state):
        if client in self.clients and state.round_idx in self.rounds:
            return [torch.full_like(u, float("nan")) for u in update]
        return update


def _simulation_without_the_killed_site() -> list[torch.Tensor]:
    owned = {c for c in range(CLIENTS) if c % len(NAMES) == KILLED}
    strategy = FederatedStrategy(local_steps=3, seed=5, max_consecutive_bad_rounds=ROUNDS + 1)
    trainer = make_trainer(strategy, ROUNDS, [DroppedIn(owned, AWAY)])
    module = tiny_module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dropped updates' warnings
        trainer.fit(module, datamodule=tiny_datamodule(num_clients=CLIENTS))
    return params_of(module)


def _relay(root: str, nodes: dict[int, int], received: list) -> int:
    """The server's loop over the sites' mailboxes (node 100 + rank)."""

    def ask(receivers, request, timeout, first):
        def one(node):
            path = os.path.join(root, f"{NAMES[nodes[node]]}.sock")
            try:
                answer = _through_mailbox(path, request, timeout, 90.0 if first else 0.0)
                return node, wire.decode(answer)
            except OSError as err:
                return node, str(err)

        asked = list(nodes) if receivers is None else receivers
        with ThreadPoolExecutor(len(asked)) as pool:
            answers = dict(pool.map(one, asked))
        received.append(answers)
        return answers

    return run_steps(RunSettings(sites=len(NAMES), step_timeout=90), ask)


def _site(root, rank: int, mode: str, role: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tests.flower_dropout_site", str(root), str(rank), mode,
               *([role] if role else [])]  # fmt: skip
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


@pytest.mark.parametrize("mode", ["secure", "plain"])
def test_a_killed_site_leaves_the_others_going_and_rejoins_two_rounds_later(tmp_path, mode):
    from lightning_fl.flower.credentials import write_credentials

    write_credentials(tmp_path / "creds", NAMES)
    sites = [_site(tmp_path, r, mode, "kill" if r == KILLED else None) for r in range(3)]
    received: list = []
    with ThreadPoolExecutor(1) as pool:
        relay = pool.submit(_relay, str(tmp_path), {100 + r: r for r in range(3)}, received)
        killed_output = sites[KILLED].communicate(timeout=120)[0]
        assert sites[KILLED].returncode == -9, killed_output[-3000:]
        deadline = time.monotonic() + 120
        while not (tmp_path / "waiting").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        sites[KILLED] = _site(tmp_path, KILLED, mode, "rejoin")
        try:
            relay.result(timeout=240)
        finally:
            outputs = [site.communicate(timeout=120)[0] for site in sites]
            print("\n\n".join(f"--- {n}\n{o[-4000:]}" for n, o in zip(NAMES, outputs)))
    for rank, site in enumerate(sites):
        assert site.returncode == 0, (NAMES[rank], outputs[rank][-3000:])
    for rank in (0, 2):
        assert "site 'hungary' dropped before its part of the round's sum" in outputs[rank]
    assert (
        "site 'hungary' rejoins the run after round 2 (its own checkpoint is of round 0)"
        in (outputs[KILLED])
    )
    assert "site 'hungary' rejoins the run at round 3." in outputs[0]
    expected = _simulation_without_the_killed_site()
    for name in NAMES:
        final = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert max(float((a - b).abs().max()) for a, b in zip(final, expected)) < 1e-6, name
    usa = tmp_path / "usa" / "logs" / "version_0"
    with open(usa / "participation.csv") as f:  # every participant, and whether dropped
        rows = [(int(r["round"]), int(r["client"]), int(r["dropped"])) for r in csv.DictReader(f)]
    assert rows == [(t, c, int(c % 3 == KILLED and t in AWAY)) for t in range(ROUNDS)
                    for c in range(CLIENTS)]  # fmt: skip
    with open(usa / "metrics.csv") as f:
        logged = {int(float(r["fl/round"])): float(r["fl/dropped_updates"])
                  for r in csv.DictReader(f) if r.get("fl/dropped_updates")}  # fmt: skip
    assert logged == {t: 2.0 * (t in AWAY) for t in range(ROUNDS)}
    dropped_at = next(i for i, step in enumerate(received) if isinstance(step.get(101), str))
    back_at = next(i for i, step in enumerate(received) if i > dropped_at and 101 in step)
    assert back_at > dropped_at + 1  # hungary was not asked while it was away
