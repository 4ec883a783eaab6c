"""FederatedStrategy's decisions that only a fit makes (``lightning_fl/engine/strategy.py``),
each pinned in a small in-process fit: the default aggregator, the batch transfer it skips,
where the training data lives (``data_on_device``) and what the log says about it, the
sampler's check against the clients with data, the federation a fit reads and validation
reuses, the optimizer hooks of idle and vectorized steps, the backward dispatch it skips,
the summary at teardown and the silo mode's checks. The mutation runner (issue 39) sees
these, which the process-level tests (torchrun, the command line) hide from it."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision

from lightning_fl import FederatedStrategy, UniformSampler
from lightning_fl.callbacks import SCAFFOLD, FedAvg, Pooled
from lightning_fl.datamodules import InMemoryFederatedDataModule
from lightning_fl.engine import packed as packed_module
from lightning_fl.engine import setup_checks, silo_checkpoints
from lightning_fl.engine.packed import TooLarge
from lightning_fl.engine.tensors import FederatedTensors
from tests.helpers import (
    IN,
    local_sgd,
    make_trainer,
    max_abs_diff,
    params_of,
    tiny_clients,
    tiny_datamodule,
    tiny_module,
    torchrun,
)
from tests.strategy_two_processes import OptimizerSteps


def _fit(strategy: FederatedStrategy, rounds: int = 1, datamodule=None, module=None,
         callbacks=(), **trainer_options) -> pl.Trainer:  # fmt: skip
    trainer = make_trainer(strategy, rounds, list(callbacks), **trainer_options)
    trainer.fit(module or tiny_module(), datamodule=datamodule or tiny_datamodule())
    return trainer


@pytest.fixture
def log(monkeypatch):
    """The strategy's info lines and warnings, as ``("info" | "warn", text)``."""
    said: list[tuple[str, str]] = []
    for module in (packed_module, setup_checks):
        monkeypatch.setattr(module, "rank_zero_info", lambda m: said.append(("info", m)))
    monkeypatch.setattr(packed_module, "rank_zero_warn", lambda m: said.append(("warn", m)))
    return said


def test_before_set_up_nothing_is_read_and_the_tensors_are_refused():
    strategy = FederatedStrategy()
    assert strategy.fit is None and strategy.training_client is None
    assert strategy.current_round is None
    _fit(strategy)
    assert isinstance(strategy.fit.tensors, FederatedTensors)
    assert strategy.fit.federation.training_counts.tolist() == [4 + (c * 7) % 37 for c in range(10)]


def test_fedavg_is_installed_when_no_aggregator_is_given():
    """Without an aggregator the run averages with FedAvg, installed among the callbacks
    (its hooks run): the model equals the run given ``FedAvg()``."""
    default, given = tiny_module(), tiny_module()
    trainer = _fit(FederatedStrategy(local_steps=2, seed=4), 3, module=default)
    assert [type(cb) for cb in trainer.callbacks if isinstance(cb, FedAvg)] == [FedAvg]
    _fit(FederatedStrategy(local_steps=2, seed=4), 3, module=given, callbacks=[FedAvg()])
    assert max_abs_diff(params_of(default), params_of(given)) == 0.0
    assert max_abs_diff(params_of(default), params_of(tiny_module())) > 0.0


class _TransferCounting(type(tiny_module())):
    """A module that overrides a batch transfer hook (and counts its calls)."""

    calls = 0

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        type(self).calls += 1
        return super().transfer_batch_to_device(batch, device, dataloader_idx)


def test_batch_transfer_is_skipped_only_on_the_cpu_without_transfer_hooks():
    """On the CPU a batch is handed on as it is (the same list), unless the module
    overrides a transfer hook; to another device it is always moved."""
    plain = FederatedStrategy()
    _fit(plain)
    batch = [torch.zeros(2, IN), torch.zeros(2, dtype=torch.long)]
    assert plain.batch_to_device(batch) is batch
    moved = plain.batch_to_device(batch, torch.device("meta"))
    assert moved is not batch and moved[0].device.type == "meta"
    hooked = FederatedStrategy(local_steps=3)
    _TransferCounting.calls = 0
    module = _TransferCounting(network=tiny_module().network, lr=0.1)
    _fit(hooked, module=module)
    assert _TransferCounting.calls == 10 * 3  # every step of every client
    assert hooked.batch_to_device(batch) is not batch
    assert _TransferCounting.calls == 10 * 3 + 1


@pytest.mark.parametrize(
    ("data_on_device", "vectorize", "packed"),
    [("auto", False, False), ("auto", True, True), (True, False, True), (False, True, False)],
)
def test_where_the_training_data_lives_and_what_the_log_says(log, data_on_device, vectorize,
                                                             packed):  # fmt: skip
    """``"auto"`` packs the federation on the device for vectorized (or GPU) runs only;
    True packs a sequential CPU run too; False never packs. A packed run says its size."""
    strategy = FederatedStrategy(local_steps=1, vectorize=vectorize, data_on_device=data_on_device)
    _fit(strategy)
    total = sum(4 + (c * 7) % 37 for c in range(10))
    if packed:
        assert len(strategy.fit.packed.columns[0]) == total
        size = total * (IN * 4 + 8) / 2**20  # float32 features, int64 labels
        assert log == [("info", f"lightning_fl: the training data ({total} samples, "
                                f"{size:.1f} MiB) is packed on cpu.")]  # fmt: skip
    else:
        assert strategy.fit.packed is None and log == []


def test_why_data_is_not_packed_is_a_warning_only_when_the_user_can_act(log, monkeypatch):
    """Too large for the device: a warning (every step crosses from the host); any other
    reason: a warning when the user asked for ``data_on_device=True``, else an info line;
    the pooled baseline and silo mode never pack."""
    reasons = iter([TooLarge("it needs 9 GiB"), "not plain TensorDatasets",
                    "not plain TensorDatasets"])  # fmt: skip
    monkeypatch.setattr(packed_module, "pack_federation", lambda *a: (None, next(reasons)))
    stays = "lightning_fl: the training data stays with the datamodule's loaders: "
    for data_on_device in ("auto", "auto", True):
        strategy = FederatedStrategy(local_steps=1, vectorize=True, data_on_device=data_on_device)
        _fit(strategy)
        assert strategy.fit.packed is None
    assert log == [
        ("warn", stays + "it needs 9 GiB. Free device memory, or set data_on_device=False "
                         "to silence this."),
        ("info", stays + "not plain TensorDatasets."),
        ("warn", stays + "not plain TensorDatasets. Set data_on_device='auto' to silence this."),
    ]  # fmt: skip
    log.clear()
    pooled = FederatedStrategy(local_steps=1, data_on_device=True)
    _fit(pooled, callbacks=[Pooled()])
    silo = FederatedStrategy(local_steps=1, data_on_device=True, silos=True)
    _fit(silo)
    assert pooled.fit.packed is None and silo.fit.packed is None
    assert log == [("info", "lightning_fl: silo mode: the training data stays with its silo.")]


def _clients_with(sizes: list[int]) -> InMemoryFederatedDataModule:
    """Clients with ``sizes`` training samples (and validation data)."""
    clients = tiny_clients(len(sizes))
    for client, n in zip(clients, sizes):
        x, y = client["train"]
        client["train"] = (x[:n], y[:n])
    return InMemoryFederatedDataModule(clients, batch_size=4)


class _FitStarted(pl.Callback):
    """Whether the strategy's set-up passed (the fit's hooks start, then Lightning sets up
    the data, which draws the first round's clients)."""

    started = False

    def on_fit_start(self, trainer, pl_module) -> None:
        self.started = True


def test_the_sampler_is_checked_against_the_clients_with_training_data():
    """Four clients have training data (one of them a single sample), one has none: a
    sampler of 4 clients a round trains, one of 5 is refused naming 4; the pooled baseline
    trains one virtual client and checks nothing."""
    sizes = [5, 1, 0, 7, 3]
    _fit(
        FederatedStrategy(sampler=UniformSampler(4), local_steps=1), datamodule=_clients_with(sizes)
    )
    fit = _FitStarted()
    with pytest.raises(ValueError, match="clients_per_round=5 but only 4 clients have training"):
        _fit(FederatedStrategy(sampler=UniformSampler(5), local_steps=1),
             datamodule=_clients_with(sizes), callbacks=[fit])  # fmt: skip
    assert not fit.started  # refused at set-up, not by the first round's draw
    _fit(FederatedStrategy(sampler=UniformSampler(5), local_steps=1),
         datamodule=_clients_with(sizes), callbacks=[Pooled()])  # fmt: skip


def test_one_client_on_one_process_trains_as_its_local_sgd():
    """One client of 25 samples (ω = 1, η_g = 1): each round's global model is the
    client's after its K = 2 steps of SGD on batches of 4 drawn by that round's shuffle,
    written out by hand over three rounds."""
    only = tiny_clients(4)[3]
    module, reference = tiny_module(), tiny_module()
    _fit(FederatedStrategy(local_steps=2, seed=3), 3, module=module,
         datamodule=InMemoryFederatedDataModule([only], batch_size=4))  # fmt: skip
    for round_idx in range(3):
        local_sgd(reference.network, only["train"], 2, 0.1, 4, 3, round_idx, 0)
    assert max_abs_diff(params_of(module), params_of(reference)) <= 1e-6
    assert max_abs_diff(params_of(module), params_of(tiny_module())) > 1e-3


def test_a_fit_reads_its_federation_and_validation_reuses_the_last_fits():
    """Each fit reads the sample counts anew; validation and test with the fit's datamodule
    reuse its federation (and packed data), with another datamodule they read their own,
    and a validation before any fit works."""
    data = tiny_datamodule()
    strategy = FederatedStrategy(local_steps=1, data_on_device=True)
    trainer = _fit(strategy, datamodule=data, limit_val_batches=1.0)
    first, packed = strategy.fit.federation, strategy.fit.packed
    trainer.validate(trainer.lightning_module, datamodule=data, verbose=False)
    assert strategy.fit.federation is first and strategy.fit.packed is packed
    trainer.test(trainer.lightning_module, datamodule=data, verbose=False)
    assert strategy.fit.federation is first
    other = tiny_datamodule(num_clients=4)
    trainer.validate(trainer.lightning_module, datamodule=other, verbose=False)
    assert strategy.fit.federation is not first and strategy.fit.packed is None
    assert strategy.fit.federation.training_counts.tolist() == [4, 11, 18, 25]
    trainer.fit_loop.max_epochs = 2  # the same trainer fits a round more
    trainer.fit(trainer.lightning_module, datamodule=data)
    assert strategy.fit.federation is not first
    fresh = FederatedStrategy()
    trainer = make_trainer(fresh, 1, limit_val_batches=1.0)
    trainer.validate(tiny_module(), datamodule=tiny_datamodule(num_clients=3), verbose=False)
    assert fresh.fit.federation.training_counts.tolist() == [4, 11, 18]


def test_vectorized_steps_leave_the_modules_optimizer_alone():
    """A vectorized chunk trains in ``training_step``; Lightning's optimizer step that
    follows is idle: only its closure runs, the module's optimizer does not step (nor
    clip, nor call ``on_before_optimizer_step``) on its gradient-less parameters. A
    sequential run steps it once per local step."""
    sequential, vectorized = OptimizerSteps(), OptimizerSteps()
    _fit(FederatedStrategy(local_steps=3), 2, callbacks=[sequential])
    _fit(FederatedStrategy(local_steps=3, vectorize=True), 2, callbacks=[vectorized])
    assert (sequential.steps, vectorized.steps) == (2 * 10 * 3, 0)


class _BackwardHooks(pl.Callback):
    def __init__(self) -> None:
        self.before_backward = 0

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.before_backward += 1


def test_the_backward_and_step_skip_lightnings_dispatch_only_when_no_hook_is_overridden(
    monkeypatch,
):
    """With nothing overriding the backward hooks and no clipping, the backward and the
    optimizer step bypass the precision plugin's dispatch; a callback's
    ``on_before_backward`` or gradient clipping brings it back for that path."""
    calls = {"backward": 0, "optimizer_step": 0}
    for name in calls:
        original = getattr(Precision, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Precision, name, counted)
    _fit(FederatedStrategy(local_steps=2))
    assert calls == {"backward": 0, "optimizer_step": 0}
    hooks = _BackwardHooks()
    _fit(FederatedStrategy(local_steps=2), callbacks=[hooks])
    assert calls == {"backward": 20, "optimizer_step": 0} and hooks.before_backward == 20
    _fit(FederatedStrategy(local_steps=2), gradient_clip_val=1.0)
    assert calls == {"backward": 20, "optimizer_step": 20}


def test_teardown_says_the_summary_unless_the_command_line_says_it(capsys, tmp_path):
    strategy = FederatedStrategy(local_steps=1)
    _fit(strategy, default_root_dir=str(tmp_path))
    assert capsys.readouterr().out == f"Outputs: {tmp_path}\n"
    quiet = FederatedStrategy(local_steps=1)
    quiet.summary.automatic = False
    _fit(quiet, default_root_dir=str(tmp_path))
    assert capsys.readouterr().out == ""


def test_a_refused_combination_stops_the_fit_at_set_up():
    from lightning_fl.engine.composition import CompositionError

    module = tiny_module()
    with pytest.raises(CompositionError, match=r"silos=True\) cannot be combined with Pooled"):
        _fit(FederatedStrategy(silos=True, local_steps=1), callbacks=[Pooled()], module=module)
    assert max_abs_diff(params_of(module), params_of(tiny_module())) == 0.0


class _LogRound(pl.Callback):
    """Logs the round for ModelCheckpoint to monitor (the last round is the best)."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("round", float(trainer.current_epoch))


def test_silo_mode_on_one_process_enters_its_silo_and_keeps_shards_with_checkpoints(tmp_path):
    """The datamodule learns it is silo 0 of 1 before set-up; each checkpoint gets its
    shard beside it (in a folder the strategy creates), a removed checkpoint takes its
    shard along, and a sharded checkpoint is refused outside silo mode naming the file."""
    data = tiny_datamodule()
    folder = tmp_path / "new" / "folder"
    checkpoint = ModelCheckpoint(dirpath=folder, save_top_k=1, monitor="round",
                                 mode="max", filename="r{round:.0f}",
                                 auto_insert_metric_name=False)  # fmt: skip
    _fit(FederatedStrategy(silos=True, local_steps=1), 3, datamodule=data,
         callbacks=[checkpoint, _LogRound()], enable_checkpointing=True)  # fmt: skip
    assert data.silo == (0, 1)
    assert sorted(p.name for p in folder.iterdir()) == ["r2.ckpt", "r2.ckpt.silo0-of-1"]
    shard = torch.load(folder / "r2.ckpt.silo0-of-1", weights_only=True)
    assert (shard["rank"], shard["world_size"]) == (0, 1)
    trainer = make_trainer(FederatedStrategy(local_steps=1), 4)
    with pytest.raises(silo_checkpoints.SiloCheckpointError, match="r2.ckpt: made by 1 silos"):
        trainer.fit(tiny_module(), datamodule=tiny_datamodule(), ckpt_path=str(folder / "r2.ckpt"),
                    weights_only=True)  # fmt: skip


def test_silo_mode_needs_a_federated_datamodule():
    class Plain(pl.LightningDataModule):
        pass

    trainer = make_trainer(FederatedStrategy(silos=True, local_steps=1), 1)
    with pytest.raises(TypeError, match="needs a lightning_fl.datamodules.FederatedDataModule"):
        trainer.fit(tiny_module(), datamodule=Plain())


def test_a_single_process_fit_starts_no_process_group():
    seen = []

    class Record(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen.append(torch.distributed.is_initialized())

    _fit(FederatedStrategy(local_steps=1), callbacks=[Record()])
    assert seen == [False]


def test_validation_without_data_is_skipped_and_said(log):
    clients = [{"train": c["train"]} for c in tiny_clients(3)]
    trainer = _fit(FederatedStrategy(local_steps=1),
                   datamodule=InMemoryFederatedDataModule(clients, batch_size=4),
                   limit_val_batches=1.0)  # fmt: skip
    assert trainer.limit_val_batches == 0
    assert log == [("info", "No client has validation data: validation is skipped.")]


def test_a_checkpoint_outside_silo_mode_has_no_shard(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="last")
    _fit(FederatedStrategy(local_steps=1), 2, callbacks=[checkpoint], enable_checkpointing=True)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_teardown_of_a_module_never_attached_to_a_trainer_says_nothing(capsys):
    """Lightning tears down on an exception that can come before the module has a
    trainer: nothing to summarize, and no error of its own."""
    strategy = make_trainer(FederatedStrategy(), 1).strategy  # accelerator, cluster, ...
    strategy._lightning_module = tiny_module()  # as Lightning connects it, before a trainer
    strategy.teardown()
    assert capsys.readouterr().out == ""


def test_a_64_bit_fit_trains_the_module_in_float64():
    module = tiny_module()
    _fit(FederatedStrategy(local_steps=2), 2, module=module, precision="64-true")
    assert {p.dtype for p in module.parameters()} == {torch.float64}


class _Predicting(type(tiny_module())):
    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(1)


def test_prediction_runs_on_a_plain_loader_as_lightning_does():
    """A datamodule's ``predict_dataloader`` may be a plain DataLoader: the strategy leaves
    loaders that are not federated to Lightning."""
    from torch.utils.data import DataLoader, TensorDataset

    class WithPredictions(InMemoryFederatedDataModule):
        def predict_dataloader(self):
            return DataLoader(TensorDataset(inputs), batch_size=2)

    inputs = torch.randn(5, IN, generator=torch.Generator().manual_seed(0))
    module = _Predicting(network=tiny_module().network, lr=0.1)
    trainer = make_trainer(FederatedStrategy(), 1)
    predicted = trainer.predict(module, datamodule=WithPredictions(tiny_clients(3)))
    assert torch.equal(torch.cat(predicted), module(inputs).argmax(1))


@pytest.fixture(scope="module")
def two_process_fits(tmp_path_factory) -> list[dict]:
    """tests/strategy_two_processes.py's fits on 2 processes, in one torchrun launch:
    what each rank saved, and under "at_exit" its process group's state at exit."""
    root = tmp_path_factory.mktemp("two_process_fits")
    torchrun("tests.strategy_two_processes", str(root), timeout=600)
    ranks = [torch.load(root / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for r, saved in enumerate(ranks):
        saved["at_exit"] = (root / f"rank{r}.exit").read_text()
    return ranks


def test_every_rank_destroys_its_process_group_before_the_interpreter_exits(
    two_process_fits,
):
    """A Gloo group left to the interpreter's finalization aborts a finished run now and
    then (SIGABRT, "terminate called without an active exception"), which torchrun
    reports as a failure: the strategy destroys it in an exit handler, once however many
    fits ran (this launch ran eight)."""
    assert [rank["at_exit"] for rank in two_process_fits] == ["destroyed", "destroyed"]


def test_two_processes_start_from_rank_0s_model_pad_idly_and_equal_one_process(
    two_process_fits,
):
    """Three clients of 1, 3 and 5 batches a round, split by steps: rank 0 trains client 2
    (5 steps), rank 1 clients 0 and 1 (4) and pads a step a round, on which its optimizer
    does not step. Every rank starts from rank 0's model (each built its own), the
    SIGTERM flag crosses once a round, not once a step, and SCAFFOLD's models equal the
    1-process run, sequential and vectorized (in chunks of 2: rank 1 pads its chunk's
    steps). What every rank logs (the round's training means, DP-SGD's largest ε, the
    membership-inference means) is over both ranks' clients, as on one process; each
    rank tests its own clients only."""
    from tests import strategy_two_processes as script

    ranks = two_process_fits
    expected_steps = {"sequential": (3 * 5, 3 * 4), "vectorized": (0, 0)}
    for name, vectorize in (("sequential", False), ("vectorized", True)):
        one = script.module(seed=100)
        trainer = make_trainer(script.strategy(vectorize), script.ROUNDS, [SCAFFOLD()])
        trainer.fit(one, datamodule=tiny_datamodule(num_clients=script.CLIENTS))
        for rank in ranks:
            assert max_abs_diff(params_of(one), rank[name]["params"]) <= 1e-5, name
            assert rank[name]["sigterm_broadcasts"] == script.ROUNDS, name
        assert tuple(r[name]["optimizer_steps"] for r in ranks) == expected_steps[name]
    one = script.private_fit()  # every rank logs the values of one process
    # ... and tests its own clients only: one batch each, clients 0, 2, 4 and 1, 3
    assert one.pop("test_batches") == 5
    assert [rank["logged"].pop("test_batches") for rank in ranks] == [3, 2]
    assert set(one) == {*script.FIT_LOGGED, *script.TEST_LOGGED}
    for rank in ranks:
        assert rank["logged"] == pytest.approx(one)


def test_plugins_that_sum_over_ranks_on_two_processes_equal_one_process(two_process_fits):
    """CA-Fed's loss probes and SIFU's sensitivity increments are computed on each
    client's rank and summed over ranks: the models, Ψ and SIFU's restart point equal one
    process's; FEDACCUM, which needs every client's model, is refused."""
    from tests import strategy_two_processes as script

    ranks = two_process_fits
    one = script.ca_fed_fit()
    for rank in ranks:
        assert max_abs_diff(one, rank["ca_fed"]) <= 1e-5
    one = script.unlearning_fit("sifu")
    assert one["requests"] == [{"round": 4, "clients": [0, 1], "branch": 0, "restart_round": 1}]
    for rank in ranks:
        assert max_abs_diff(one["params"], rank["sifu"]["params"]) <= 1e-5
        assert rank["sifu"]["requests"] == one["requests"]
        assert [p.shape for p in rank["sifu"]["psi"]] == [p.shape for p in one["psi"]]
        assert max_abs_diff(one["psi"], rank["sifu"]["psi"]) <= 1e-5
        assert rank["fedaccum"] == "FEDACCUM re-aggregates every client's model: use devices=1."


def test_a_torchmetrics_metric_per_client_and_pooled_on_two_processes_equals_one_process(
    two_process_fits,
):
    """Each rank computes its clients' macro accuracy from its own share of the metric's
    state (no sync with the other rank's clients); the logged value is pooled over every
    rank's seen clients: both equal one process's."""
    from tests import strategy_two_processes as script

    one = script.torchmetrics_test()
    assert sorted(one["clients"]) == list(range(6))
    for rank in two_process_fits:
        assert rank["torchmetrics"]["clients"] == {
            c: pytest.approx(v, abs=1e-6) for c, v in one["clients"].items()
        }
        assert rank["torchmetrics"]["pooled"] == pytest.approx(one["pooled"], abs=1e-6)


def test_a_plain_modules_clients_on_two_processes_equal_one_process(two_process_fits):
    """A plain LightningModule's loss, logged synced: each client's value is read on its
    rank before Lightning syncs the epoch's sums over ranks (the last client's included),
    as on one process."""
    from tests import strategy_two_processes as script

    one = script.plain_test()
    assert sorted(one) == list(range(5))
    for rank in two_process_fits:
        assert rank["plain"] == {c: pytest.approx(v, abs=1e-6) for c, v in one.items()}


def test_a_rank_without_test_data_logs_the_other_ranks_values(two_process_fits):
    """Clients 1 and 3, rank 1's, have no test data: rank 1 evaluates nobody, yet logs
    the test loss and accuracy of clients 0 and 2, as one process does."""
    from tests import strategy_two_processes as script

    one = script.idle_rank_test()
    for rank in two_process_fits:
        assert rank["idle_rank"] == pytest.approx(one, abs=1e-6)


def test_cohorts_and_vectorized_evaluation_on_two_processes_equal_one_process(
    two_process_fits,
):
    """An array federation: each rank evaluates its own clients of the round's cohort, and
    of the full pass, vectorized over them; what every rank logs (the cohort's means and
    standard errors) and every client's value equal one process's."""
    from tests import strategy_two_processes as script

    one = script.population_fit()
    assert len(one["clients"]["val_acc"]) == 9 and "val_acc/se" in one["cohort"]
    for rank in two_process_fits:
        got = rank["population"]
        assert max_abs_diff(one["params"], got["params"]) <= 1e-5
        assert got["cohort"] == pytest.approx(one["cohort"], abs=1e-6)
        for name, values in one["clients"].items():
            assert got["clients"][name].keys() == values.keys()
            for client, (value, count) in values.items():
                assert got["clients"][name][client][0] == pytest.approx(value, abs=1e-6)
                assert got["clients"][name][client][1] == count
