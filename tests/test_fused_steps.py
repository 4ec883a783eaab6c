"""Fused local steps on the sequential path (``local_steps_per_training_step`` other than
1 without ``vectorize``): several local steps of one client per Lightning step give the
model of one step per Lightning step, bit for bit, with the plugins' per-step hooks
(FedProx's and SCAFFOLD's ``on_before_optimizer_step``), momentum and gradient clipping;
the refusals name what reads every batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch.optim.lr_scheduler import StepLR

from lightning_fl import Classifier, FederatedStrategy, UniformSampler
from lightning_fl.callbacks import DPSGD, SCAFFOLD, FedAvg, FedProx
from lightning_fl.engine.planning import PADDING, RoundPlanner
from lightning_fl.engine.rounds import TrainRounds
from lightning_fl.engine.schedule import ClientSchedule
from lightning_fl.engine.training_steps import TrainingSteps
from tests.helpers import make_trainer, params_of, tiny_datamodule, tiny_module
from tests.test_planning import SIZES
from tests.test_planning import _fit as _planning_fit


def _fit(fused, callbacks=(), module=None, rounds=3, **kw):
    module = module or tiny_module()
    strategy = FederatedStrategy(
        sampler=UniformSampler(4), local_epochs=2, seed=3, local_steps_per_training_step=fused
    )
    trainer = make_trainer(strategy, rounds, list(callbacks), **kw)
    trainer.fit(module, datamodule=tiny_datamodule())
    return module, trainer


PLUGINS = {
    "fedavg_momentum": (lambda: [FedAvg()], {"lr": 0.1, "momentum": 0.9}),
    "fedprox": (lambda: [FedProx(mu=0.5)], {}),
    "scaffold": (lambda: [SCAFFOLD()], {}),
}


@pytest.mark.parametrize("name", list(PLUGINS))
def test_fused_local_steps_give_the_one_step_models_bit_for_bit(name):
    """Unequal clients (4..40 samples, batch 4, 2 local epochs: 2 to 20 local steps),
    4 of 10 a round, 3 rounds: all of a client's steps in one Lightning step (None) and
    3 at a time give the same global model, client states and epoch metrics as one
    local step per Lightning step; ``global_step`` counts the Lightning steps."""
    make_callbacks, optim = PLUGINS[name]
    runs = {}
    for fused in (1, None, 3):
        torch.manual_seed(1)
        module = Classifier(tiny_module().network, **(optim or {"lr": 0.1}))
        _, trainer = _fit(fused, make_callbacks(), module=module)
        runs[fused] = (module, trainer)
    reference, ref_trainer = runs[1]
    for fused in (None, 3):
        module, trainer = runs[fused]
        assert all(torch.equal(a, b) for a, b in zip(params_of(reference), params_of(module)))
        first = ref_trainer.strategy.divergence.first  # each local step's loss is watched
        assert first is not None and trainer.strategy.divergence.first == first
        for key, value in ref_trainer.callback_metrics.items():
            if "_step" not in key:
                assert float(trainer.callback_metrics[key]) == pytest.approx(float(value), abs=1e-7)
        ref_store = ref_trainer.strategy.client_store.state_dict()
        store = trainer.strategy.client_store.state_dict()
        assert ref_store.keys() == store.keys()
        for client, entry in ref_store.items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, store[client][key]), (client, key)
    # the Lightning steps, by hand: the rounds' clients' ⌈2⌈n/4⌉ / k⌉
    sampler, p = UniformSampler(4), torch.tensor(SIZES, dtype=torch.float64) / sum(SIZES)
    cohorts = [sampler.sample(r, 3, p).clients for r in range(3)]
    local = [[2 * math.ceil(SIZES[c] / 4) for c in cohort] for cohort in cohorts]
    assert ref_trainer.global_step == sum(map(sum, local))
    assert runs[None][1].global_step == 12
    assert runs[3][1].global_step == sum(math.ceil(n / 3) for r in local for n in r)


class _OptimizerSteps(pl.Callback):
    """Counts the optimizer steps that Lightning's hook sees."""

    def __init__(self) -> None:
        self.count = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.count += 1


def test_every_local_step_and_no_other_calls_the_optimizer_step_hooks():
    """A fused Lightning step's own optimizer step is idle: the hooks run once per local
    step (2⌈n/4⌉ per client), as on the one-step path, not once more per Lightning step."""
    counts = []
    for fused in (1, None, 3):
        watcher = _OptimizerSteps()
        _, trainer = _fit(fused, [FedAvg(), watcher], rounds=2)
        counts.append(watcher.count)
    sampler, p = UniformSampler(4), torch.tensor(SIZES, dtype=torch.float64) / sum(SIZES)
    local = [2 * math.ceil(SIZES[c] / 4) for r in range(2) for c in sampler.sample(r, 3, p).clients]
    assert counts == [sum(local)] * 3


def test_fused_local_steps_keep_gradient_clipping():
    """Lightning's gradient clipping runs at every local step inside a fused step: the
    models equal the one-step path's, and differ from an unclipped run."""
    models = []
    for fused, clip in ((1, 0.05), (None, 0.05), (None, None)):
        module, _ = _fit(fused, [FedAvg()], module=tiny_module(lr=0.5), gradient_clip_val=clip)
        models.append(params_of(module))
    assert all(torch.equal(a, b) for a, b in zip(models[0], models[1]))
    assert not all(torch.equal(a, b) for a, b in zip(models[1], models[2]))


class _SkipsEveryStep(Classifier):
    """A training_step that returns None: Lightning skips the step (no gradient)."""

    def training_step(self, batch, batch_idx):
        return None


def test_a_skipped_step_is_skipped_as_lightning_skips_it():
    """A training_step returning None leaves the model as it was, fused or not."""
    start = params_of(tiny_module())
    for fused in (1, None):
        torch.manual_seed(1)
        module = _SkipsEveryStep(tiny_module().network, lr=0.1)
        _fit(fused, [FedAvg()], module=module, rounds=1)
        assert all(torch.equal(a, b) for a, b in zip(start, params_of(module)))


class _ZeroGradWatcher(pl.Callback):
    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        return None


class _EveryBatch(Classifier):
    def on_train_batch_start(self, batch, batch_idx):
        return None


class _StepSchedule(Classifier):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = {"scheduler": StepLR(optimizer, 2), "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


@pytest.mark.parametrize(
    ("callbacks", "module", "reason"),
    [
        ([DPSGD(noise_multiplier=1.0, max_grad_norm=1.0)], None,
         "the callback DPSGD overrides on_train_batch_start"),
        ([FedAvg()], _EveryBatch, "_EveryBatch overrides on_train_batch_start"),
        ([FedAvg()], _StepSchedule, "the StepLR learning-rate scheduler steps every Lightning"),
        ([FedAvg(), _ZeroGradWatcher()], None,
         "the callback _ZeroGradWatcher overrides on_before_zero_grad"),
    ],
)  # fmt: skip
def test_what_reads_every_batch_is_refused_naming_it_and_the_fix(callbacks, module, reason):
    network = tiny_module().network
    module = (module or Classifier)(network, lr=0.1)
    with pytest.raises(ValueError, match=reason) as refused:
        _fit(None, callbacks, module=module, rounds=1)
    assert str(refused.value).endswith("Set local_steps_per_training_step=1.")
    _fit(1, callbacks, module=(type(module))(tiny_module().network, lr=0.1), rounds=1)


def test_two_ranks_fuse_their_own_clients_and_pad_to_the_longer_rank():
    """The ranks split the round as with one step per batch (test_planning's ranks); each
    Lightning step is 3 local steps of one client, and the rank with fewer such steps
    ends with idle PADDING steps up to the other's total."""
    fits = [
        _planning_fit(2, rank, local_epochs=1, local_steps_per_training_step=3) for rank in (0, 1)
    ]
    plans = [RoundPlanner(fit).plan(0) for fit in fits]
    ranks = [0, 1, 0, 0, 1, 0, 1, 0, 1, 1]
    fused = {c: math.ceil(math.ceil(n / 4) / 3) for c, n in enumerate(SIZES)}
    totals = [sum(fused[c] for c in range(10) if ranks[c] == r) for r in (0, 1)]
    assert totals == [12, 10]
    for rank, plan in enumerate(plans):
        assert plan.fused and plan.chunks is None
        clients = plan.schedule.clients
        expected = [fused[c] for c in clients]
        ids = list(range(len(clients)))
        if totals[rank] < max(totals):
            ids, expected = [*ids, PADDING], [*expected, max(totals) - totals[rank]]
        assert plan.steps == ClientSchedule(tuple(ids), tuple(expected))
        assert plan.steps.total == 12
        assert plan.schedule.num_batches == tuple(math.ceil(SIZES[c] / 4) for c in clients)
    # rank 1's steps, located: a client's first Lightning step starts it and names its
    # last local step; the idle steps name no client and start none
    started = []
    engine = SimpleNamespace(
        current_round=plans[1], current_client=None, fit=fits[1],
        start_client=started.append,
    )  # fmt: skip
    steps = TrainingSteps(engine, SimpleNamespace(), torch.device("cpu"), None)
    located = []
    for batch_idx in range(12):
        steps.locate(batch_idx)
        located.append(engine.current_client)
        assert steps.idle
    clients = plans[1].schedule.clients  # 1, 4, 6, 8, 9 in some order; 3 local steps a step
    by_hand = []
    for pos, c in enumerate(clients):
        n = math.ceil(SIZES[c] / 4)
        by_hand += [(pos, min(3 * (k + 1), n) - 1) for k in range(fused[c])]
    assert located == by_hand + [None] * 2
    assert started == list(range(len(clients)))
    # and its batches: each step the client's next 3 (or what is left), then 2 idle steps
    batches = list(TrainRounds._fused_batches(plans[1], 3))
    sizes = [len(b["local_batches"]) for b in batches[:10]]
    assert sizes == [min(3, n - 3 * k) for pos, c in enumerate(clients)
                     for n in [math.ceil(SIZES[c] / 4)] for k in range(fused[c])]  # fmt: skip
    assert batches[10:] == [(), ()]
