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
from lightning_fl.callbacks import DPSGD, FedProx
from lightning_fl.engine import strategy as strategy_module
from lightning_fl.engine.driver import RoundDriver
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
    monkeypatch.setattr(strategy_module.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return calls


def _set_threads(num_threads, device="cpu", parameters=10, processes=1):
    stand_in = SimpleNamespace(root_device=torch.device(device), num_threads=num_threads,
                               model=_Parameters(parameters), num_processes=processes)  # fmt: skip
    FederatedStrategy._set_cpu_threads(stand_in)


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
    monkeypatch.setattr(strategy_module.os, "cpu_count", lambda: None)
    _set_threads("auto", parameters=1_000_000, processes=3)  # unknown: one core, one thread
    monkeypatch.setattr(strategy_module.os, "cpu_count", lambda: 2)
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
    the others in their order; Lightning's bar replaced by the federated one (switched off
    without a terminal, as under pytest) with its settings; the plots callback last, once."""
    prox, dp, checkpoint = FedProx(0.1), DPSGD(noise_multiplier=1.0), ModelCheckpoint()
    bar = TQDMProgressBar(refresh_rate=7, leave=True)
    callbacks = _connected(prox, bar, dp, checkpoint)
    kinds = [type(cb) for cb in callbacks]
    assert kinds == [RoundDriver, DPSGD, FedProx, FederatedProgressBar, ModelCheckpoint,
                     FederatedPlots]  # fmt: skip
    assert callbacks[1] is dp and callbacks[2] is prox and callbacks[4] is checkpoint
    federated_bar = callbacks[3]
    assert federated_bar.refresh_rate == 7 and federated_bar._leave is True
    assert not federated_bar.is_enabled
    driver, plots = RoundDriver(), FederatedPlots()
    again = _connected(plots, prox, driver)
    assert again == [driver, plots, prox]
    assert [type(cb) for cb in _connected(prox, enable_plots=False)] == [RoundDriver, FedProx]
