"""Determinism given a seed, and client-by-client evaluation summaries."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torchmetrics import Metric

from lightning_fl import FederatedStrategy, UniformSampler
from lightning_fl.callbacks import FedAvg, Local, Pooled
from lightning_fl.engine.evaluation import lower_is_better, summarize
from tests.helpers import (
    IN,
    OUT,
    make_trainer,
    params_of,
    tiny_clients,
    tiny_datamodule,
    tiny_module,
)


def _run(seed: int, rounds: int = 3):
    module = tiny_module()
    strategy = FederatedStrategy(sampler=UniformSampler(3), local_steps=3, seed=seed)
    participants = []

    class Record(FedAvg):
        def on_round_start(self, trainer, pl_module, state):
            participants.append(state.participation.clients)

    make_trainer(strategy, rounds, [Record()]).fit(module, datamodule=tiny_datamodule())
    return params_of(module), participants


def test_same_seed_same_run_and_other_seed_other_participants():
    a, parts_a = _run(7)
    b, parts_b = _run(7)
    assert parts_a == parts_b
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    _, parts_c = _run(8)
    assert parts_a != parts_c


def test_global_rng_state_does_not_change_the_run():
    a, _ = _run(7)
    torch.manual_seed(999)
    torch.rand(10)
    b, _ = _run(7)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _per_client_accuracy(net, clients, split="val"):
    accs, sizes = [], []
    with torch.no_grad():
        for c in clients:
            x, y = c[split]
            accs.append(float((net(x).argmax(1) == y).float().mean()))
            sizes.append(len(y))
    return torch.tensor(accs, dtype=torch.float64), torch.tensor(sizes, dtype=torch.float64)


def test_validation_reports_weighted_uniform_and_bottom_decile():
    module = tiny_module()
    trainer = make_trainer(FederatedStrategy(local_steps=3), 2, [FedAvg()], limit_val_batches=None)
    trainer.fit(module, datamodule=tiny_datamodule())
    accs, sizes = _per_client_accuracy(module.network, tiny_clients())
    metrics = trainer.callback_metrics
    assert abs(float(metrics["val_acc"]) - float((accs * sizes).sum() / sizes.sum())) < 1e-6
    assert abs(float(metrics["val_acc/uniform"]) - float(accs.mean())) < 1e-6
    assert abs(float(metrics["val_acc/p10"]) - float(torch.quantile(accs, 0.1))) < 1e-6
    assert "val_loss/p90" in metrics and "val_loss/p10" not in metrics


def test_summarize_by_hand():
    values = {0: (1.0, 1.0), 1: (0.0, 3.0), 2: (0.5, 4.0)}
    s = summarize(values)
    assert abs(s["weighted"] - (1 + 0 + 2) / 8) < 1e-12
    assert abs(s["uniform"] - 0.5) < 1e-12
    assert abs(s["p10"] - 0.1) < 1e-12  # linear interpolation between 0.0 and 0.5


def test_bottom_decile_is_the_worst_clients_for_losses_too():
    values = {0: (1.0, 1.0), 1: (0.0, 3.0), 2: (0.5, 4.0)}
    loss = summarize(values, "test_loss")
    assert "p10" not in loss and abs(loss["p90"] - 0.9) < 1e-12  # the highest losses
    assert "p90" not in summarize(values, "test_acc")
    assert lower_is_better("val_loss") and lower_is_better("train_error")
    assert not lower_is_better("test_acc") and not lower_is_better("test_cindex")
    # the name's end decides: "err" inside a word (inter-rater agreement) is not an error
    assert not lower_is_better("val_interrater_kappa") and lower_is_better("val/cls_err")


def test_local_evaluates_each_client_with_its_own_model():
    module = tiny_module()
    strategy = FederatedStrategy(local_steps=3)
    trainer = make_trainer(strategy, 2, [Local()], limit_val_batches=None)
    initial = params_of(module)
    trainer.fit(module, datamodule=tiny_datamodule())
    assert all(torch.equal(a, b) for a, b in zip(initial, params_of(module)))  # global untouched
    clients = tiny_clients()
    accs = []
    for c in range(len(clients)):
        net = tiny_module().network
        flat = strategy.client_store.get(c, "local_model")
        torch.nn.utils.vector_to_parameters(flat, net.parameters())
        accs.append(_per_client_accuracy(net, [clients[c]])[0].item())
    assert abs(float(trainer.callback_metrics["val_acc/uniform"]) - sum(accs) / len(accs)) < 1e-6


def test_pooled_trains_one_client_on_the_union():
    module = tiny_module()
    strategy = FederatedStrategy(local_steps=5)
    make_trainer(strategy, 1, [Pooled()]).fit(module, datamodule=tiny_datamodule())
    schedule = strategy.current_round.schedule
    assert schedule.clients == (-1,) and schedule.num_batches == (5,)
    total = sum(len(c["train"][1]) for c in tiny_clients())
    assert len(strategy.current_round.loaders[0].dataset) == total


def test_local_cross_evaluate_scores_every_model_on_every_client():
    """FLamby's Local i: model i on client j's whole test set; the diagonal is the usual
    Local number."""
    module = tiny_module()
    strategy = FederatedStrategy(local_steps=3)
    local = Local()
    trainer = make_trainer(strategy, 2, [local], limit_val_batches=None)
    trainer.fit(module, datamodule=tiny_datamodule())
    initial = params_of(module)
    grid = local.cross_evaluate(trainer, "val")["acc"]
    clients = tiny_clients()
    assert grid.shape == (len(clients), len(clients))
    for i in range(len(clients)):
        net = tiny_module().network
        torch.nn.utils.vector_to_parameters(
            strategy.client_store.get(i, "local_model"), net.parameters()
        )
        accs, _ = _per_client_accuracy(net, clients)
        assert torch.allclose(grid[i].double(), accs, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(initial, params_of(module)))  # restored


def test_cpu_threads_one_for_small_models_unless_the_user_chose(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        for setting, expected in (("auto", 1), (2, 2)):
            torch.set_num_threads(3)
            strategy = FederatedStrategy(local_steps=1, num_threads=setting)
            make_trainer(strategy, 1).fit(tiny_module(), datamodule=tiny_datamodule())
            assert torch.get_num_threads() == expected
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own choice is kept
        torch.set_num_threads(3)
        make_trainer(FederatedStrategy(local_steps=1), 1).fit(
            tiny_module(), datamodule=tiny_datamodule()
        )
        assert torch.get_num_threads() == 3
        with pytest.raises(ValueError, match="num_threads"):
            FederatedStrategy(num_threads=0)
    finally:
        torch.set_num_threads(before)


class _PlainValidation(pl.LightningModule):
    """Lightning's methods only: a loss and a higher-is-better score logged in
    ``validation_step`` (no ``loss_and_metrics``, no ``acc``), beside a max-reduced value
    and a per-step one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.network = torch.nn.Linear(IN, OUT)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.network(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.network(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_confidence", logits.softmax(-1).max(-1).values.mean())
        # neither is a mean over the epoch: never reported per client
        self.log("val_peak", logits.max(), reduce_fx="max")
        self.log("val_batch_loss", F.cross_entropy(logits, y), on_step=True, on_epoch=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_plain_modules_logged_values_are_reported_per_client_by_hand():
    """Every value a plain LightningModule logs is reported client by client: each
    client's sample-weighted mean over its validation batches of 2 and 1 samples (so a
    mean of batch means would differ), summarized as weighted and uniform means, p90 for
    the loss and p10 for the score; clients 8 and 9 are unseen and reported apart. No
    family is made up: no accuracy, no p10 of the loss, no p90 of the score."""
    dm = tiny_datamodule(batch_size=2)
    dm.unseen_clients = [8, 9]
    module = _PlainValidation()
    strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=2, seed=5)
    trainer = make_trainer(strategy, 3, [FedAvg()], limit_val_batches=None)
    trainer.fit(module, datamodule=dm)
    stage, per_client, unseen = trainer.strategy.evaluation.last_report
    assert stage == "val" and unseen == {8, 9}
    expected = {"val_loss": {}, "val_confidence": {}}
    with torch.no_grad():
        for c, client in enumerate(tiny_clients()):
            x, y = client["val"]
            logits = module.network(x)
            loss = F.cross_entropy(logits, y, reduction="none")
            expected["val_loss"][c] = (float(loss.mean()), len(y))
            expected["val_confidence"][c] = (float(logits.softmax(-1).max(-1).values.mean()), 3)
    assert set(per_client) == set(expected)
    for name, values in expected.items():
        assert set(per_client[name]) == set(range(10))
        for c, (value, count) in values.items():
            assert per_client[name][c][0] == pytest.approx(value, rel=1e-5)
            assert per_client[name][c][1] == count
    metrics = trainer.callback_metrics
    seen = {c: v for c, v in expected["val_loss"].items() if c < 8}
    assert float(metrics["val_loss/uniform"]) == pytest.approx(
        sum(v for v, _ in seen.values()) / 8, rel=1e-5
    )
    losses = torch.tensor([v for v, _ in seen.values()], dtype=torch.float64)
    assert float(metrics["val_loss/p90"]) == pytest.approx(float(torch.quantile(losses, 0.9)))
    unseen_mean = (expected["val_loss"][8][0] + expected["val_loss"][9][0]) / 2
    assert float(metrics["val_loss/unseen/uniform"]) == pytest.approx(unseen_mean, rel=1e-5)
    # Lightning's own epoch value of what the module logs: the seen clients' batches only
    # (the unseen clients' are taken back out of its sums)
    seen_weighted = sum(v * n for v, n in seen.values()) / sum(n for _, n in seen.values())
    assert float(metrics["val_loss"]) == pytest.approx(seen_weighted, rel=1e-5)
    assert "val_confidence/p10" in metrics
    absent = {"val_acc", "val_acc/uniform", "val_loss/p10", "val_confidence/p90"}
    assert not absent & set(metrics)


def test_local_models_persist_across_rounds_and_cross_evaluate_skips_what_is_missing():
    """Local over 3 rounds with 2 of 4 clients a round: each client's model is K local
    steps per participation from its own previous model (from θ^0 the first time), by
    hand; cross_evaluate leaves NaN the row of a client that never trained and the
    column of a client without test data."""
    from lightning_fl.datamodules import InMemoryFederatedDataModule
    from tests.helpers import local_sgd

    clients = tiny_clients()[:4]
    x, y = clients[2]["test"]
    clients[2]["test"] = (x[:0], y[:0])  # client 2 has no test data
    module = tiny_module(0.1)
    start = params_of(module)
    sampler = UniformSampler(2)
    strategy = FederatedStrategy(sampler=sampler, local_steps=3, seed=3)
    local = Local()
    trainer = make_trainer(strategy, 3, [local])
    trainer.fit(module, datamodule=InMemoryFederatedDataModule(clients, batch_size=4))

    models, p = {}, torch.full((4,), 0.25, dtype=torch.float64)
    for r in range(3):
        for c in sampler.sample(r, 3, p).clients:
            net = tiny_module(0.1).network
            with torch.no_grad():
                for q, t in zip(net.parameters(), models.get(c, start)):
                    q.copy_(t)
            local_sgd(net, clients[c]["train"], 3, 0.1, 4, 3, r, c)
            models[c] = params_of(net)
    assert sorted(models) == [0, 1, 2]  # draws (1, 2), (0, 1), (1, 2): client 3 never trains
    for c, expected in models.items():
        stored = strategy.client_store.get(c, "local_model")
        assert torch.allclose(stored, torch.cat([t.reshape(-1) for t in expected]), atol=1e-6)
    grid = local.cross_evaluate(trainer, "test")["acc"]
    for i in range(4):
        for j in range(4):
            if i not in models or j == 2:
                assert grid[i, j].isnan(), (i, j)
                continue
            net = tiny_module(0.1).network
            torch.nn.utils.vector_to_parameters(torch.cat([t.reshape(-1) for t in models[i]]),
                                                net.parameters())  # fmt: skip
            xt, yt = clients[j]["test"]
            with torch.no_grad():
                accuracy = float((net(xt).argmax(1) == yt).float().mean())
            assert float(grid[i, j]) == pytest.approx(accuracy, abs=1e-6), (i, j)


def test_lower_is_better_answers_a_bool():
    assert lower_is_better("val/loss") is True and lower_is_better("val_acc") is False


def test_a_client_with_one_validation_sample_is_reported_and_one_without_is_not():
    """Client 0 has one validation sample, client 1 none (FederatedTask sums, counted per
    client): client 0's loss is its one sample's, weighted 1; client 1 is in no family."""
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    clients = tiny_clients(4)
    clients[0]["val"] = tuple(t[:1] for t in clients[0]["val"])
    clients[1]["val"] = tuple(t[:0] for t in clients[1]["val"])
    dm = InMemoryFederatedDataModule(clients, batch_size=4)
    module = tiny_module()
    trainer = make_trainer(FederatedStrategy(local_steps=2, seed=3), 1, [FedAvg()],
                           limit_val_batches=None)  # fmt: skip
    trainer.fit(module, datamodule=dm)
    per_client = trainer.strategy.evaluation.last_report[1]
    x, y = clients[0]["val"]
    with torch.no_grad():
        expected = float(F.cross_entropy(module.network(x), y))
    for name, values in per_client.items():
        assert set(values) == {0, 2, 3}, name
        assert values[0][1] == 1, name
    assert per_client["val_loss"][0][0] == pytest.approx(expected, rel=1e-6)


class _SignedShift(Metric):
    """Σ over samples of (+1, −1) for label 0 and (−1, +1) otherwise: a summed vector
    state whose entries cancel, nonzero for a client with data; its value is the first
    entry."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("shift", torch.zeros(2), dist_reduce_fx="sum")

    def update(self, y: torch.Tensor) -> None:
        sign = torch.where(y == 0, 1.0, -1.0).sum()
        self.shift += torch.stack([sign, -sign])

    def compute(self) -> torch.Tensor:
        return self.shift[0]


class _TorchmetricsValidation(pl.LightningModule):
    """A macro accuracy (a summed-state torchmetrics Metric) in validation and test, and a
    running maximum (a max-reduced state, which cannot be split per client) in test."""

    def __init__(self) -> None:
        from torchmetrics import MaxMetric
        from torchmetrics.classification import MulticlassAccuracy

        super().__init__()
        torch.manual_seed(4)
        self.network = torch.nn.Linear(IN, OUT)
        self.val_macro = MulticlassAccuracy(num_classes=OUT, average="macro")
        self.test_macro = MulticlassAccuracy(num_classes=OUT, average="macro")
        self.test_top = MaxMetric()
        self.test_shift = _SignedShift()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.network(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_macro.update(self.network(x), y)
        self.log("val_macro", self.val_macro, on_epoch=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self.network(x)
        self.test_macro.update(logits, y)
        self.test_top.update(logits.max())
        self.log("test_macro", self.test_macro, on_epoch=True)
        self.log("test_top", self.test_top, on_epoch=True)
        self.test_shift.update(y)
        self.log("test_shift", self.test_shift, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_torchmetrics_values_per_client_in_every_epoch_and_stage_apart():
    """Three validation epochs (Lightning resets the metric between them): each client's
    macro accuracy in the last one is the metric of its own data under the final model,
    not a difference against the previous epoch's state. Testing afterwards reports only
    the test families; the max-reduced metric is warned about once, reported pooled over
    every client's data, and never per client."""
    from torchmetrics.classification import MulticlassAccuracy

    from lightning_fl.datamodules import InMemoryFederatedDataModule

    clients = tiny_clients(5)
    for c, size in enumerate((1, 2, 3, 3, 2)):  # validation sets of unequal sizes
        clients[c]["val"] = tuple(t[:size] for t in clients[c]["val"])
    dm = InMemoryFederatedDataModule(clients, batch_size=4)
    module = _TorchmetricsValidation()
    trainer = make_trainer(FederatedStrategy(local_steps=2, seed=5), 3, [FedAvg()],
                           limit_val_batches=None)  # fmt: skip
    trainer.fit(module, datamodule=dm)
    stage, per_client, _ = trainer.strategy.evaluation.last_report
    assert stage == "val" and set(per_client) == {"val_macro"}
    values = []
    with torch.no_grad():
        for c, client in enumerate(clients):
            x, y = client["val"]
            reference = MulticlassAccuracy(num_classes=OUT, average="macro")
            values.append((float(reference(module.network(x), y)), len(y)))
            assert per_client["val_macro"][c] == pytest.approx(values[-1], abs=1e-6), c
    # weighted by each client's validation samples (a Metric does not count them)
    weighted = sum(v * n for v, n in values) / sum(n for _, n in values)
    assert float(trainer.callback_metrics["val_macro/weighted"]) == pytest.approx(weighted)
    # the module's own value stays the Metric's, pooled over every client's data
    with torch.no_grad():
        x = torch.cat([c["val"][0] for c in clients])
        y = torch.cat([c["val"][1] for c in clients])
        pooled = float(MulticlassAccuracy(num_classes=OUT, average="macro")(module.network(x), y))
    assert pooled != pytest.approx(weighted, abs=1e-3)
    assert float(trainer.callback_metrics["val_macro"]) == pytest.approx(pooled, abs=1e-6)
    with pytest.warns(UserWarning, match="test_top: MaxMetric has states reduced by max") as w:
        trainer.test(module, datamodule=dm, verbose=False)
    assert sum("cannot be split per client" in str(r.message) for r in w) == 1
    stage, per_client, _ = trainer.strategy.evaluation.last_report
    assert stage == "test" and set(per_client) == {"test_macro", "test_shift"}
    for c, client in enumerate(clients):  # a share whose entries sum to 0 is not empty
        y = client["test"][1]
        shift = float((y == 0).sum() - (y != 0).sum())
        assert per_client["test_shift"][c] == pytest.approx((shift, len(y)), abs=1e-6), c
    with torch.no_grad():
        top = max(float(module.network(c["test"][0]).max()) for c in clients)
    assert float(trainer.callback_metrics["test_top"]) == pytest.approx(top, rel=1e-6)


def test_client_metrics_csv_rows_by_hand(tmp_path):
    """Rows in client order, values to 8 significant digits, sample counts as integers;
    the header is written once."""
    from lightning_fl.engine.evaluation import write_client_metrics_csv

    path = str(tmp_path / "client_metrics.csv")
    write_client_metrics_csv(path, "val", 2, {"val_loss": {3: (0.123456789, 4.0), 1: (2.0, 7.0)}})
    write_client_metrics_csv(path, "test", 3, {"test_acc": {0: (0.5, 3.0)}})
    assert open(path).read().splitlines() == [
        "stage,round,metric,client,value,num_samples",
        "val,2,val_loss,1,2,7",
        "val,2,val_loss,3,0.12345679,4",
        "test,3,test_acc,0,0.5,3",
    ]


def test_a_capture_reset_forgets_clients_and_families_not_evaluated_again():
    """Module sums of clients 0 and 1, then a reset and client 0 alone (a stream's client
    outside its window is not evaluated): nothing of client 1 or of the first epoch's
    family is left. A client whose sums count no sample is not recorded."""
    from lightning_fl.engine.evaluation import ClientMetricCapture

    capture = ClientMetricCapture()
    for client, (total, count) in enumerate([(3.0, 2.0), (5.0, 4.0)]):
        sums = {"val_loss": (torch.tensor(total), torch.tensor(count))}
        capture.close_client({}, client, module_sums=sums)
    assert dict(capture.per_client) == {"val_loss": {0: (1.5, 2.0), 1: (1.25, 4.0)}}
    capture.reset()
    capture.close_client({}, 0, module_sums={"val_acc": (torch.tensor(1.0), torch.tensor(4.0))})
    capture.close_client({}, 2, module_sums={"val_acc": (torch.tensor(0.0), torch.tensor(0.0))})
    assert dict(capture.per_client) == {"val_acc": {0: (0.25, 4.0)}}
    assert capture.summed_names == {"val_acc"}


def test_a_batch_limit_that_cuts_a_client_reports_the_batches_it_ran():
    """``limit_test_batches=5`` over clients of 3 test samples in batches of 2: clients 0
    and 1 run both their batches, client 2 its first only, and is reported on those 2
    samples when the epoch ends (its last batch never came); clients 3–9 are absent."""
    module = tiny_module()
    trainer = make_trainer(FederatedStrategy(local_steps=1), 1, [], limit_test_batches=5)
    trainer.test(module, datamodule=tiny_datamodule(batch_size=2), verbose=False)
    per_client = trainer.strategy.evaluation.last_report[1]
    clients = tiny_clients()
    with torch.no_grad():
        for c, size in ((0, 3), (1, 3), (2, 2)):
            x, y = (t[:size] for t in clients[c]["test"])
            expected = float(F.cross_entropy(module.network(x), y))
            assert per_client["test_loss"][c] == pytest.approx((expected, size), rel=1e-6), c
    assert set(per_client["test_loss"]) == {0, 1, 2}


class _SilentValidation(_PlainValidation):
    """Validates without logging anything."""

    def validation_step(self, batch, batch_idx):
        self.network(batch[0])


def test_no_client_metrics_file_when_no_client_logged_anything(tmp_path):
    trainer = make_trainer(FederatedStrategy(local_steps=1, seed=5), 1, [FedAvg()],
                           limit_val_batches=None, default_root_dir=str(tmp_path))  # fmt: skip
    trainer.fit(_SilentValidation(), datamodule=tiny_datamodule(num_clients=3))
    assert trainer.strategy.evaluation.last_report[1] == {}
    assert not list(tmp_path.rglob("client_metrics.csv"))


def test_each_client_evaluation_starts_and_ends_once_in_client_order():
    """The client evaluation hooks' contract: per evaluated client, one start, then one end,
    before the next client starts (a callback that counts or restores state relies on
    it), also for the last client, which the last batch and the epoch's end both close."""
    from lightning_fl.callbacks.base import FederatedCallback

    events = []

    class Record(FederatedCallback):
        def on_client_evaluation_start(self, trainer, pl_module, client):
            events.append(("start", client))

        def on_client_evaluation_end(self, trainer, pl_module, client):
            events.append(("end", client))

    trainer = make_trainer(FederatedStrategy(local_steps=1), 1, [Record()])
    trainer.test(tiny_module(), datamodule=tiny_datamodule(num_clients=4), verbose=False)
    assert events == [(kind, c) for c in range(4) for kind in ("start", "end")]


def test_the_round_summaries_and_no_run_files_without_a_logger(tmp_path, capsys):
    """After three rounds of 4 sampled clients of 10: ``fl/round`` 2, ``fl/participants`` 4,
    ``fl/dropped_updates`` 0; no ``fl/skipped_empty`` (the datamodule never skips a client)
    nor ``fl/compile_seconds`` (nothing compiled); without a logger no participation.csv."""
    strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=2, seed=3)
    trainer = make_trainer(strategy, 3, [FedAvg()], default_root_dir=str(tmp_path))
    trainer.fit(tiny_module(), datamodule=tiny_datamodule())
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("fl/")}
    assert metrics == {"fl/round": 2.0, "fl/participants": 4.0, "fl/dropped_updates": 0.0}
    assert not list(tmp_path.rglob("participation.csv"))
    assert f"Outputs: {tmp_path}" in capsys.readouterr().out  # a Trainer script says it too


def test_participation_rows_hold_each_participants_weight_and_drop(tmp_path):
    """participation.csv: one row per participant (round, client, ω_i to 10 significant
    digits, 1 when its update was dropped), appended round after round under one header."""
    import csv
    from types import SimpleNamespace

    from lightning_fl.engine.driver import _append_participation

    path = str(tmp_path / "participation.csv")
    for round_idx, clients, weights, dropped in (
        (0, [4, 7, 1], [0.125, 2 / 3, 0.2083333333333], [7]),
        (1, [2], [1.0], []),
    ):
        participation = SimpleNamespace(clients=clients, weights=weights)
        state = SimpleNamespace(round_idx=round_idx, participation=participation, dropped=dropped)
        _append_participation(path, state)
    rows = [list(row.values()) for row in csv.DictReader(open(path))]
    assert rows == [
        ["0", "4", "0.125", "0"],
        ["0", "7", "0.6666666667", "1"],
        ["0", "1", "0.2083333333", "0"],
        ["1", "2", "1", "0"],
    ]


def test_clients_without_held_out_data_are_left_out_of_evaluation():
    """Client 1 has no validation split and client 2 an empty one: validation runs over
    the 8 others, each reported with its own 3 samples."""
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    clients = tiny_clients()
    del clients[1]["val"]
    clients[2]["val"] = (clients[2]["val"][0][:0], clients[2]["val"][1][:0])
    trainer = make_trainer(FederatedStrategy(seed=1), 1, limit_val_batches=None)
    trainer.validate(tiny_module(), datamodule=InMemoryFederatedDataModule(clients, 4))
    reported = trainer.strategy.evaluation.capture.per_client["val_acc"]
    assert sorted(reported) == [0, 3, 4, 5, 6, 7, 8, 9]


def test_a_samplers_error_is_raised_as_it_was_not_as_lightnings():
    """An error while a round is planned surfaces unchanged at the round's first batch
    (raised from iter(), Lightning's teardown would replace it)."""

    class Failing(UniformSampler):
        def sample(self, round_idx, seed, p):
            raise ValueError("the sampler's own words")

    with pytest.raises(ValueError, match="the sampler's own words"):
        make_trainer(FederatedStrategy(sampler=Failing(3)), 1).fit(
            tiny_module(), datamodule=tiny_datamodule()
        )


def test_run_outputs_folder_csv_and_notes(tmp_path):
    """A logger without ``log_dir`` (W&B's kind) puts the run's files in
    ``save_dir/name/version_N``, falling back to the Trainer's folder without a save_dir;
    ``append_csv`` creates the folder and writes one header; a note warns and is kept once."""
    import csv
    from types import SimpleNamespace

    from lightning_fl.engine.outputs import RunSummary, append_csv, run_dir

    def trainer(save_dir):
        logger = SimpleNamespace(save_dir=save_dir, name="proj", version=3)
        return SimpleNamespace(loggers=[logger], default_root_dir="/root_dir")

    assert run_dir(trainer("/saved")) == "/saved/proj/version_3"
    assert run_dir(trainer(None)) == "/root_dir/proj/version_3"
    path = tmp_path / "new" / "deeper" / "rows.csv"
    append_csv(str(path), ["a", "b"], [[1, 2]])
    append_csv(str(path), ["a", "b"], [[3, 4]])
    assert list(csv.reader(open(path))) == [["a", "b"], ["1", "2"], ["3", "4"]]
    summary = RunSummary()
    with pytest.warns(UserWarning, match="requests left undone"):
        summary.note("requests left undone")
        summary.note("requests left undone")
    assert summary.notes == ["requests left undone"]
