"""SAFARI (seed paper 004, Alg. 1) and incomplete participation: q = 1 is FedAvg, q = 0 is
SGD on the server's data, round types follow Bernoulli(q) drawn from (seed, round), and
excluded clients never train."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_fl import Classifier, ExcludedClients, FederatedStrategy, UniformSampler
from lightning_fl.callbacks import SAFARI, FedAvg
from lightning_fl.callbacks.base import SERVER_CLIENT
from lightning_fl.datamodules import InMemoryFederatedDataModule
from tests.helpers import (
    client_batches,
    make_trainer,
    max_abs_diff,
    params_of,
    tiny_clients,
    tiny_module,
)

LR, ROUNDS, SEED = 0.1, 6, 4


def _server_data():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(30, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def _dm():
    return InMemoryFederatedDataModule(tiny_clients(), batch_size=4, server=_server_data())


def _fit(callbacks, sampler=None, **kw):
    module = tiny_module(LR)
    strategy = FederatedStrategy(sampler=sampler or UniformSampler(3), local_steps=2, seed=SEED)
    trainer = make_trainer(strategy, ROUNDS, callbacks, **kw)
    participants = []
    trainer.callbacks.append(_Recorder(participants))
    trainer.fit(module, datamodule=_dm())
    return params_of(module), participants


class _Recorder(pl.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_epoch_end(self, trainer, pl_module):
        self.out.append(trainer.strategy.current_round.state.participation.clients)


def test_q_one_is_fedavg():
    safari, _ = _fit([SAFARI(q=1.0)])
    fedavg, _ = _fit([FedAvg(weighting="uniform")])
    assert max_abs_diff(safari, fedavg) == 0.0


def test_q_zero_is_sgd_on_the_server_data():
    """One SGD step per round on a server minibatch (batches shuffled from
    (seed, round, server)), at the server learning rate."""
    ours, rounds = _fit([SAFARI(q=0.0, server_lr=0.05)])
    assert rounds == [(SERVER_CLIENT,)] * ROUNDS
    net = tiny_module(LR).network
    x, y = _server_data()
    for r in range(ROUNDS):
        bx, by = next(client_batches((x, y), 4, SEED, r, SERVER_CLIENT))
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(bx), by).backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.05 * p.grad
    assert max_abs_diff(ours, params_of(net)) <= 1e-6


def test_round_types_follow_bernoulli_q_from_seed_and_round():
    safari = SAFARI(q=0.5)
    _, rounds = _fit([safari])
    expected = [safari.is_server_round(r, SEED) for r in range(ROUNDS)]
    assert [c == (SERVER_CLIENT,) for c in rounds] == expected
    assert any(expected) and not all(expected)
    draws = [SAFARI(q=0.7).is_server_round(r, 0) for r in range(4000)]
    assert abs(sum(draws) / 4000 - 0.3) < 0.03


def test_excluded_clients_never_train_and_the_rest_share_the_weights():
    sampler = ExcludedClients(UniformSampler(3), excluded=4)
    excluded = set(sampler.excluded_clients(10, SEED))
    assert len(excluded) == 4
    _, rounds = _fit([FedAvg(weighting="uniform")], sampler)
    assert all(not excluded & set(c) for c in rounds)
    p = torch.full((10,), 0.1, dtype=torch.float64)
    part = sampler.sample(0, SEED, p)
    assert part.weights == pytest.approx((1 / 3,) * 3)  # (n'/m)·p'_i, n' = 6 clients left


def test_bad_safari_settings_are_refused():
    with pytest.raises(ValueError, match="q must be in"):
        SAFARI(q=1.5)
    for bad in (0.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="server_lr .*: give a finite number > 0"):
            SAFARI(q=0.5, server_lr=bad)
    with pytest.raises(ValueError, match="excluded=10 clients but only 10"):
        ExcludedClients(UniformSampler(2), excluded=10).sample(0, 0, torch.full((10,), 0.1))
    module = tiny_module(LR)
    trainer = make_trainer(FederatedStrategy(local_steps=1), 1, [SAFARI(q=0.5)])
    no_server = InMemoryFederatedDataModule(tiny_clients(), batch_size=4)
    with pytest.raises(ValueError, match="needs server data"):
        trainer.fit(module, datamodule=no_server)
    adam = Classifier(network=tiny_module(LR).network, lr=0.01, optimizer="adam")
    trainer = make_trainer(FederatedStrategy(local_steps=1), 1, [SAFARI(q=0.5)])
    with pytest.raises(TypeError, match="server round is an SGD step: use the SGD optimizer"):
        trainer.fit(adam, datamodule=_dm())


def test_safari_with_q_one_needs_neither_server_data_nor_sgd():
    """q = 1 never takes a server step: it trains without server data and with Adam, as
    FedAvg does (the two checks above are for q < 1 only)."""
    runs = []
    for callbacks in ([SAFARI(q=1.0)], [FedAvg(weighting="uniform")]):
        torch.manual_seed(1)
        adam = Classifier(network=tiny_module(LR).network, lr=0.01, optimizer="adam")
        strategy = FederatedStrategy(sampler=UniformSampler(3), local_steps=2, seed=SEED)
        no_server = InMemoryFederatedDataModule(tiny_clients(), batch_size=4)
        make_trainer(strategy, 2, callbacks).fit(adam, datamodule=no_server)
        runs.append(params_of(adam))
    assert max_abs_diff(*runs) == 0.0


def test_digits_server_samples_are_held_out_before_the_split():
    from lightning_fl.datamodules import DigitsDataModule

    dm = DigitsDataModule(num_clients=10, partition="iid", server_samples=100, seed=0)
    assert len(dm.server_dataset()) == 100
    clients = sum(sum(dm.sample_counts(s)) for s in ("train", "val", "test"))
    assert clients == 1797 - 100
    assert DigitsDataModule(num_clients=10, partition="iid", seed=0).server_dataset() is None
    with pytest.raises(ValueError, match="server_samples must be in"):
        DigitsDataModule(server_samples=5000).setup()


def test_safari_recipe_runs_and_mixes_server_rounds(tmp_path):
    """The Table 1 recipe, shortened: 6 rounds at q = 0.5 take both kinds of round, the
    excluded clients never appear in participation.csv, and it learns."""
    import csv
    from pathlib import Path

    from lightning_fl.cli import run

    root = Path(__file__).resolve().parents[1]
    cli = run(
        ["fit", "--config", str(root / "recipes" / "participation" / "safari.yaml"),
         "--trainer.max_epochs", "6", "--trainer.limit_val_batches", "0",
         "--trainer.default_root_dir", str(tmp_path),
         "--trainer.logger.init_args.save_dir", str(tmp_path)]
    )  # fmt: skip
    (path,) = tmp_path.rglob("participation.csv")
    rows = list(csv.DictReader(open(path)))
    clients = [int(r["client"]) for r in rows]
    assert SERVER_CLIENT in clients and any(c >= 0 for c in clients)
    excluded = set(cli.trainer.strategy.sampler.excluded_clients(10, 0))
    assert len(excluded) == 4 and not excluded & set(clients)
    assert float(cli.trainer.callback_metrics["test_acc"]) > 0.2


def test_mixed_rounds_interleave_fedavg_and_server_sgd_by_hand(tmp_path):
    """q = 0.5 with η_s = 0.05 ≠ the clients' 0.1: each round is, as drawn, either the
    uniform average of 3 sampled clients' 2 local steps (hand-written FedAvg) or one SGD
    step on a server minibatch at η_s, never the one scaled like the other; each round's
    kind is logged as safari/server_round."""
    import copy
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from tests.helpers import local_sgd

    safari = SAFARI(q=0.5, server_lr=0.05)
    ours, rounds = _fit([safari], logger=CSVLogger(tmp_path, name="safari"))
    kinds = [safari.is_server_round(r, SEED) for r in range(ROUNDS)]
    assert any(kinds) and not all(kinds) and all(type(k) is bool for k in kinds)
    (metrics,) = tmp_path.glob("safari/*/metrics.csv")
    rows = [row for row in csv.DictReader(open(metrics)) if row.get("safari/server_round")]
    logged = {int(row["epoch"]): float(row["safari/server_round"]) for row in rows}
    assert logged == {r: float(kind) for r, kind in enumerate(kinds)}
    net = tiny_module(LR).network
    clients = tiny_clients()
    x, y = _server_data()
    sampler = UniformSampler(3)
    for r, server in enumerate(kinds):
        if server:
            bx, by = next(client_batches((x, y), 4, SEED, r, SERVER_CLIENT))
            net.zero_grad()
            torch.nn.functional.cross_entropy(net(bx), by).backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.05 * p.grad
            continue
        part = sampler.sample(r, SEED, torch.full((10,), 0.1, dtype=torch.float64))
        assert rounds[r] == part.clients
        start = [p.detach().clone() for p in net.parameters()]
        total = [torch.zeros_like(p) for p in start]
        for c, w in zip(part.clients, part.weights):
            local = copy.deepcopy(net)
            local_sgd(local, clients[c]["train"], 2, LR, 4, SEED, r, c)
            for t, p, s in zip(total, local.parameters(), start):
                t += w * (p.detach() - s)
        with torch.no_grad():
            for p, s, t in zip(net.parameters(), start, total):
                p.copy_(s + t)
    assert max_abs_diff(ours, params_of(net)) <= 1e-6
