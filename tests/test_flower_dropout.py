"""Rounds that complete without a site that drops (issue 76): three sites, each its own
process running a real fit (tests/flower_dropout_site.py) through ``FlowerSite``, the
server's loop (:func:`run_steps`, the ServerApp's own) in this process, reaching each
site through its mailbox as the ClientApp's courier does. Hungary's process SIGKILLs
itself in round 1; usa and switzerland finish the 4 rounds, and their model equals a
1-process simulation in which hungary's clients' updates are dropped from round 1 on
(θ^{t+1} = θ^t + Σ_{i arrived} ω_i Δ_i, the weights of the others unchanged)."""

from __future__ import annotations

import os
import subprocess
import sys
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
from tests.flower_dropout_site import CLIENTS, NAMES, ROUNDS  # noqa: E402
from tests.helpers import ROOT, make_trainer, params_of, tiny_datamodule, tiny_module  # noqa: E402

KILLED, KILL_ROUND = 1, 1


class DroppedFrom(FederatedCallback):
    """Simulation's stand-in for a site that is gone: from ``round_idx`` on, the updates of
    ``clients`` are NaN, which the engine drops (not renormalized)."""

    def __init__(self, clients: set[int], round_idx: int) -> None:
        self.clients, self.round_idx = clients, round_idx

    def transform_update(self, trainer, pl_module, client, update, state):
        if client in self.clients and state.round_idx >= self.round_idx:
            return [torch.full_like(u, float("nan")) for u in update]
        return update


def _simulation_without_the_killed_site() -> list[torch.Tensor]:
    owned = {c for c in range(CLIENTS) if c % len(NAMES) == KILLED}
    strategy = FederatedStrategy(local_steps=3, seed=5, max_consecutive_bad_rounds=ROUNDS + 1)
    trainer = make_trainer(strategy, ROUNDS, [DroppedFrom(owned, KILL_ROUND)])
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


@pytest.mark.parametrize("mode", ["secure", "plain"])
def test_a_site_killed_mid_run_leaves_the_others_the_simulation_without_it(tmp_path, mode):
    from lightning_fl.flower.credentials import write_credentials

    write_credentials(tmp_path / "creds", NAMES)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    sites = []
    for rank in range(len(NAMES)):
        kill = [str(KILL_ROUND)] if rank == KILLED else []
        command = [sys.executable, "-m", "tests.flower_dropout_site", str(tmp_path), str(rank),
                   mode, *kill]  # fmt: skip
        sites.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    received: list = []
    try:
        _relay(str(tmp_path), {100 + r: r for r in range(len(NAMES))}, received)
    finally:
        outputs = [site.communicate(timeout=120)[0] for site in sites]
    assert sites[KILLED].returncode == -9
    for rank, site in enumerate(sites):
        if rank != KILLED:
            assert site.returncode == 0, outputs[rank][-3000:]
            assert "site 'hungary' dropped before its part of the round's sum" in outputs[rank]
    expected = _simulation_without_the_killed_site()
    for name in ("usa", "switzerland"):
        final = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert max(float((a - b).abs().max()) for a, b in zip(final, expected)) < 1e-6, name
    dropped_at = next(i for i, step in enumerate(received) if isinstance(step.get(101), str))
    assert all(101 not in step for step in received[dropped_at + 1 :])
