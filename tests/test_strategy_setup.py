"""FederatedStrategy's own set-up decisions in process (``lightning_fl/engine/strategy.py``):
how many CPU threads a run takes and which callbacks it installs, in which order. Every
trainer test runs these; here each decision is pinned by hand, so that the mutation runner
(issue 39) can measure them without a training run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from torch import nn

from lightning_fl import FederatedStrategy
from lightning_fl.callbacks import DPSGD, CoordinateMedian, FedAvg, FedProx, TrimmedMean
from lightning_fl.engine import processes, setup_checks
from lightning_fl.engine import strategy as strategy_module
from lightning_fl.engine.driver import RoundDriver
from lightning_fl.engine.processes import set_cpu_threads
from lightning_fl.engine.progress import FederatedProgressBar
from lightning_fl.plots import FederatedPlots
from tests.helpers import tiny_module


class _Parameters(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(count))


@pytest.fixture
def threads(monkeypatch):
    """The values ``torch.set_num_threads`` was called with; 16 cores, no OMP_NUM_THREADS."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(processes.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return calls


def _set_threads(num_threads, device="cpu", parameters=10, processes=1):
    model = _Parameters(parameters)
    set_cpu_threads(num_threads, model, processes, torch.device(device))


def test_cpu_threads_by_hand(threads, monkeypatch):
    """``num_threads``: an int is applied; None leaves torch alone; ``"auto"`` takes 1
    thread for a model under 10⁶ parameters (the small models' steps are faster on one)
    and the cores shared among the processes from 10⁶ on; a GPU run or OMP_NUM_THREADS
    leaves torch alone."""
    _set_threads(3)
    _set_threads(None)
    _set_threads(3, device="meta")  # not the CPU: nothing to set
    _set_threads("auto", parameters=999_999)
    _set_threads("auto", parameters=1_000_000, processes=3)  # 16 // 3
    _set_threads("auto", parameters=1_000_000, processes=0)  # at least one process
    assert threads == [3, 1, 5, 16]
    monkeypatch.setattr(processes.os, "cpu_count", lambda: None)
    _set_threads("auto", parameters=1_000_000, processes=1)  # unknown: one core, one thread
    monkeypatch.setattr(processes.os, "cpu_count", lambda: 2)
    _set_threads("auto", parameters=1_000_000, processes=4)  # fewer cores than processes
    assert threads[4:] == [1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    _set_threads("auto", parameters=1_000_000)
    assert len(threads) == 6


def _connected(*callbacks, enable_plots=True):
    strategy = FederatedStrategy(enable_plots=enable_plots)
    module = tiny_module()
    module.trainer = SimpleNamespace(callbacks=list(callbacks))
    strategy.connect(module)
    return module.trainer.callbacks


def test_connect_installs_the_driver_first_and_orders_the_gradient_callbacks():
    """The round driver first, then the callbacks that replace the gradient (DP-SGD), then
    the others in their order; FedAvg when no aggregator is given (one when one is);
    Lightning's bar replaced by the federated one (switched off without a terminal, as
    under pytest) with its settings; the plots callback last, once."""
    prox, dp, checkpoint = FedProx(0.1), DPSGD(noise_multiplier=1.0), ModelCheckpoint()
    bar = TQDMProgressBar(refresh_rate=7, leave=True)
    callbacks = _connected(prox, bar, dp, checkpoint)
    kinds = [type(cb) for cb in callbacks]
    assert kinds == [RoundDriver, DPSGD, FedProx, FederatedProgressBar, ModelCheckpoint,
                     FedAvg, FederatedPlots]  # fmt: skip
    assert callbacks[1] is dp and callbacks[2] is prox and callbacks[4] is checkpoint
    federated_bar = callbacks[3]
    assert federated_bar.refresh_rate == 7 and federated_bar._leave is True
    assert not federated_bar.is_enabled
    driver, plots, median = RoundDriver(), FederatedPlots(), CoordinateMedian()
    again = _connected(plots, prox, median, driver)
    assert again == [driver, plots, prox, median]
    assert [type(cb) for cb in _connected(prox, enable_plots=False)] == [
        RoundDriver, FedProx, FedAvg
    ]  # fmt: skip
    with pytest.raises(ValueError, match="Exactly one aggregator .* got FedAvg, TrimmedMean"):
        _connected(FedAvg(), TrimmedMean(0.1))


def test_constructor_settings_by_hand():
    """A timeout in seconds becomes a timedelta (a timedelta is kept); without local_steps
    or local_epochs a client makes one pass; compile needs vectorize; data_on_device is
    True, False or "auto"."""
    from datetime import timedelta

    assert FederatedStrategy(timeout=90)._timeout == timedelta(seconds=90)
    assert FederatedStrategy(timeout=timedelta(minutes=2))._timeout == timedelta(seconds=120)
    default = FederatedStrategy(local_steps=None, local_epochs=None)
    assert (default.config.local_steps, default.config.local_epochs) == (None, 1)
    with pytest.raises(ValueError, match="compile=True compiles the vectorized step"):
        FederatedStrategy(compile=True)
    FederatedStrategy(compile=True, vectorize=True)
    for valid in (True, False, "auto"):
        assert FederatedStrategy(data_on_device=valid).data_on_device == valid
    with pytest.raises(ValueError, match="data_on_device must be True, False or 'auto', got 'yes'"):
        FederatedStrategy(data_on_device="yes")


def test_a_restarted_torchrun_worker_meets_in_its_attempts_own_keys(monkeypatch):
    """Under torchrun's agent store, a restarted worker's process group uses keys prefixed
    with its attempt (the failed attempt's addresses stay in the store); the first attempt,
    or a worker without the agent's store, uses Lightning's default rendezvous."""
    from datetime import timedelta

    made = []
    monkeypatch.setattr(processes.dist, "TCPStore",
                        lambda *args, **kw: made.append((args, kw)) or "agent")  # fmt: skip
    monkeypatch.setattr(processes.dist, "PrefixStore", lambda prefix, store: (prefix, store))
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    timeout = timedelta(seconds=30)
    for attempt, agent in (("0", "True"), ("2", "False"), ("2", None)):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        if agent is None:
            monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        else:
            monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", agent)
        assert processes.restarted_worker_store(4, timeout) is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert processes.restarted_worker_store(4, timeout) == (
        "/lightning_fl/attempt_2",
        "agent",
    )
    assert made == [(("node0", 29500, 4), {"is_master": False, "timeout": timeout})]


def test_validation_is_skipped_only_when_no_client_has_validation_data():
    def trainer(limit):
        return SimpleNamespace(limit_val_batches=limit)

    without, with_data = (SimpleNamespace(has_validation_data=lambda v=v: v) for v in (False, True))
    for limit, federation, expected in ((1.0, without, 0), (5, with_data, 5), (0, without, 0)):
        run = trainer(limit)
        setup_checks.skip_validation_without_data(run, federation)
        assert run.limit_val_batches == expected


def test_the_sigterm_flag_is_broadcast_once_per_round_on_several_processes():
    """Lightning broadcasts rank 0's SIGTERM flag before every step; on several processes
    the strategy lets the first step of each round do it (every rank at the same step), and
    leaves one process alone."""
    broadcasts = []
    loop = SimpleNamespace(
        _broadcast_sigterm_tensor=lambda: broadcasts.append(trainer.current_epoch)
    )
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop), current_epoch=0)
    processes.check_sigterm_once_per_round(trainer, 2)
    for epoch in (0, 0, 0, 1, 1, 2, 2, 2):
        trainer.current_epoch = epoch
        loop._broadcast_sigterm_tensor()
    assert broadcasts == [0, 1, 2]
    original = loop._broadcast_sigterm_tensor
    processes.check_sigterm_once_per_round(trainer, 1)
    assert loop._broadcast_sigterm_tensor is original  # one process: left as it is


def test_a_fit_applies_its_threads_and_skips_validation_without_data():
    """Set-up runs both decisions: ``num_threads`` reaches torch, and a federation without
    validation splits gets no validation loop."""
    from lightning_fl.datamodules import InMemoryFederatedDataModule
    from tests.helpers import make_trainer, tiny_clients

    clients = [{"train": c["train"], "test": c["test"]} for c in tiny_clients(4)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # so that the strategy's 1 is seen
    try:
        trainer = make_trainer(FederatedStrategy(local_steps=1, num_threads=1), 1,
                               limit_val_batches=1.0)  # fmt: skip
        trainer.fit(tiny_module(), datamodule=InMemoryFederatedDataModule(clients, batch_size=4))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert trainer.limit_val_batches == 0


def test_set_up_of_a_restarted_worker_and_the_exit_handler_on_several_processes(
    monkeypatch,
):
    """On several processes, a restarted torchrun worker's group meets in the store of its
    attempt (Lightning's rendezvous would read the failed attempt's addresses), a first
    attempt's through Lightning's own set-up; either way, and on every fit, one exit handler
    destroys the group (Lightning registers it for NCCL only). One process sets up no
    group and registers nothing."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    calls, handlers = [], []
    monkeypatch.setattr(DDPStrategy, "setup_distributed", lambda self: calls.append("lightning"))

    def init(environment, backend, **kw) -> None:
        calls.append((backend, kw["store"]))

    monkeypatch.setattr(strategy_module, "_init_dist_connection", init)
    monkeypatch.setattr(processes.atexit, "register", handlers.append)
    monkeypatch.setattr(processes.atexit, "unregister",
                        lambda f: handlers.remove(f) if f in handlers else None)  # fmt: skip

    def set_up(count: int, store) -> FederatedStrategy:
        monkeypatch.setattr(processes, "restarted_worker_store", lambda *a: store)
        devices = [torch.device("cpu")] * count
        strategy = FederatedStrategy(
            cluster_environment=LightningEnvironment(), parallel_devices=devices
        )
        strategy.setup_distributed()
        return strategy

    set_up(1, "attempt store")
    assert calls == [] and handlers == []
    set_up(2, None)
    assert calls == ["lightning"]
    restarted = set_up(2, "attempt store")
    assert calls == ["lightning", ("gloo", "attempt store")]
    assert restarted.world_size == 2
    assert handlers == [processes._destroy_dist_connection]
