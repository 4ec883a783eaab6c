"""Shared test helpers: a tiny federated problem and a hand-written FL reference loop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_fl import MLP, Classifier, FederatedStrategy
from lightning_fl.callbacks.base import FederatedCallback
from lightning_fl.datamodules import InMemoryFederatedDataModule
from lightning_fl.engine.seeding import derive_seed, generator

IN, HIDDEN, OUT = 6, 8, 3
#: "gpu" in the GPU test mode (``pytest --accelerator gpu``, tests/conftest.py), else "cpu"
ACCELERATOR = os.environ.get("LIGHTNING_FL_TEST_ACCELERATOR", "cpu")


def tiny_clients(num_clients: int = 10, seed: int = 0) -> list[dict]:
    """Clients of unequal sizes (4..40 training samples) with a shared linear rule plus noise."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(IN, OUT, generator=g)
    clients = []
    for c in range(num_clients):
        n = 4 + (c * 7) % 37
        x = torch.randn(n + 6, IN, generator=g) + 0.3 * c
        y = (x @ w + 0.5 * torch.randn(n + 6, OUT, generator=g)).argmax(1)
        clients.append(
            {
                "train": (x[:n], y[:n]),
                "val": (x[n : n + 3], y[n : n + 3]),
                "test": (x[n + 3 :], y[n + 3 :]),
            }
        )
    return clients


def tiny_datamodule(batch_size: int = 4, **kw) -> InMemoryFederatedDataModule:
    return InMemoryFederatedDataModule(tiny_clients(**kw), batch_size=batch_size)


def tiny_module(lr: float = 0.1, seed: int = 1) -> Classifier:
    torch.manual_seed(seed)
    return Classifier(network=MLP(IN, (HIDDEN,), OUT), lr=lr)


def make_trainer(strategy: FederatedStrategy, rounds: int, callbacks=(), **kw) -> pl.Trainer:
    """A quiet Trainer on the test mode's accelerator (the CPU unless ``--accelerator
    gpu``); files it writes (per-client CSVs) go to a temporary folder
    unless ``default_root_dir`` is given. No figures (a third of a small test's time): the
    plot tests run recipes."""
    strategy.enable_plots = False
    options = dict(
        default_root_dir=os.path.join(  # one folder per pytest-xdist worker
            tempfile.gettempdir(),
            "lightning-fl-tests",
            os.environ.get("PYTEST_XDIST_WORKER", "main"),
        ),
        max_epochs=rounds,
        strategy=strategy,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        accelerator=ACCELERATOR,
    )
    options.update(kw)
    return pl.Trainer(**options)


#: the repository root (the working directory of the launches below)
ROOT = Path(__file__).resolve().parents[1]


def torchrun(
    module: str, *args: str, timeout: int, env: dict[str, str] | None = None, nproc: int = 2
):
    """``python -m torch.distributed.run --nproc_per_node nproc -m module args`` from the
    repository root, on a free port, one thread a rank: the completed process (its output
    captured), asserted to have succeeded."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
         "--master_port", str(port), "-m", module, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def line_data(ax) -> dict[str, tuple[list, list]]:
    """A matplotlib axes' lines: label → (x values, y values)."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for line in ax.get_lines()}  # fmt: skip


def params_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in module.parameters()]


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def client_batches(
    data: tuple[torch.Tensor, ...], batch_size: int, seed: int, round_idx: int, client: int
):
    """A client's training batches of a round, written out: pass after pass, one
    ``torch.randperm(n)`` of the generator seeded with (seed, "data", round, client), cut
    into batches of ``batch_size`` (the last one short). Endless: take what you need."""
    g = generator(seed, "data", round_idx, client)
    n = len(data[0])
    while True:
        order = torch.randperm(n, generator=g)
        for start in range(0, n, batch_size):
            index = order[start : start + batch_size]
            yield [t[index] for t in data]


def local_sgd(
    net: torch.nn.Module,
    data: tuple[torch.Tensor, torch.Tensor],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    round_idx: int,
    client: int,
    loss_extra=None,
    grad_extra=None,
    clip_norm: float | None = None,
) -> int:
    """K plain SGD steps over the client's data, reshuffling after each pass (hand-written)."""
    torch.manual_seed(derive_seed(seed, "client", round_idx, client))
    done = 0
    while done < steps:
        for x, y in client_batches(data, batch_size, seed, round_idx, client):
            for p in net.parameters():
                p.grad = None
            loss = F.cross_entropy(net(x), y)
            if loss_extra is not None:
                loss = loss + loss_extra(net)
            loss.backward()
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(list(net.parameters()), clip_norm)
            with torch.no_grad():
                for i, p in enumerate(net.parameters()):
                    g = p.grad if grad_extra is None else p.grad + grad_extra[i]
                    p -= lr * g
            done += 1
            if done == steps:
                break
    return done


class CrashOnRank(pl.Callback):
    """Raises on one rank at the start of one round (for the crash-reporting test)."""

    def __init__(self, rank: int = 1, round_idx: int = 1) -> None:
        self.rank, self.round_idx = rank, round_idx

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank and trainer.current_epoch == self.round_idx:
            raise RuntimeError(f"injected failure on rank {self.rank}")


class PoisonedUpdates(FederatedCallback):
    """Replaces the updates of ``clients`` in ``rounds`` with NaN (the dropped-update
    tests; on several processes each rank poisons the clients it trains)."""

    def __init__(self, rounds: list[int], clients: list[int]) -> None:
        self.rounds, self.clients = set(rounds), set(clients)

    def transform_update(self, trainer, pl_module, client, update, state):
        if state.round_idx in self.rounds and client in self.clients:
            return [torch.full_like(u, float("nan")) for u in update]
        return update


def weights_over_rounds(sampler, p: torch.Tensor, rounds: int, seed: int = 0) -> torch.Tensor:
    """ω_i(S_t) of ``sampler`` for rounds 0..rounds−1: [rounds, n], 0 for absent clients."""
    omega = torch.zeros(rounds, len(p), dtype=torch.float64)
    for t in range(rounds):
        part = sampler.sample(t, seed, p)
        omega[t, list(part.clients)] = torch.tensor(part.weights, dtype=torch.float64)
    return omega


class CallCounter(pl.Callback):
    """Python function calls (``sys.setprofile`` "call" events) during round 1's training
    epoch and its validation epoch, by (file, function)."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def _count(self, frame, event, arg) -> None:
        if event == "call":
            self.calls[(frame.f_code.co_filename, frame.f_code.co_name)] += 1

    def _start(self, trainer) -> None:
        if trainer.current_epoch == 1:
            sys.setprofile(self._count)

    def _stop(self, *_) -> None:
        sys.setprofile(None)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._start(trainer)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._start(trainer)

    on_train_epoch_end = on_validation_epoch_end = _stop
