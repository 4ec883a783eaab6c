"""Vectorized clients (FederatedStrategy(vectorize=True)) equal the sequential path.

Every comparison trains the same problem twice, client by client and all clients
together, and compares the global model after several rounds: unequal clients (4..40
samples, batch 4, so unequal batch counts under local_epochs and smaller last batches),
dropout, sampling, chunks, each supported callback and optimizer.
"""

from __future__ import annotations

import glob

import pytest
import torch
from torch import nn

from lightning_fl import Classifier, FederatedStrategy, UniformSampler
from lightning_fl import FederatedTask as FederatedTaskBase
from lightning_fl.callbacks import (
    APFL,
    DPSGD,
    SCAFFOLD,
    Ditto,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedProx,
    FedYogi,
    Local,
    PFedMe,
    Pooled,
    ServerReference,
)
from lightning_fl.callbacks.base import FederatedCallback
from lightning_fl.engine.vectorized import VectorizationError
from tests.helpers import (
    HIDDEN,
    IN,
    OUT,
    make_trainer,
    max_abs_diff,
    params_of,
    tiny_clients,
    tiny_datamodule,
)


def _network(dropout: float = 0.3) -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Dropout(dropout), nn.Linear(HIDDEN, OUT)
    )


def _module(dropout: float = 0.3, **optim) -> Classifier:
    torch.manual_seed(1)
    optim.setdefault("lr", 0.1)
    return Classifier(network=_network(dropout), **optim)


def _fit(vectorize: bool, callbacks=(), rounds: int = 3, chunk=None, module=None, **kw):
    strategy_kw = {
        "sampler": UniformSampler(6),
        "local_epochs": 2,
        "seed": 3,
        "vectorize": vectorize,
        "max_vectorized_clients": chunk,
    }
    strategy_kw.update(kw.pop("strategy", {}))
    datamodule = kw.pop("datamodule", tiny_datamodule)()
    module = module or _module()
    trainer = make_trainer(FederatedStrategy(**strategy_kw), rounds, list(callbacks), **kw)
    trainer.fit(module, datamodule=datamodule)
    return module, trainer


def _epoch_metrics(trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items() if "_step" not in k}


CALLBACKS = {
    "fedavg": lambda: [FedAvg()],
    "fedavg_uniform_server_lr": lambda: [FedAvg(weighting="uniform", server_lr=0.7)],
    "fedavgm": lambda: [FedAvgM(server_lr=1.0, beta=0.9)],
    "fedadam": lambda: [FedAdam(server_lr=0.05)],
    "fedyogi": lambda: [FedYogi(server_lr=0.05)],
    "fedadagrad": lambda: [FedAdagrad(server_lr=0.05)],
    "fedprox": lambda: [FedProx(mu=0.5)],
    "scaffold": lambda: [SCAFFOLD()],
    "local": lambda: [Local()],
    "pooled": lambda: [Pooled()],
}


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_each_supported_callback_equals_the_sequential_path(name):
    seq, seq_trainer = _fit(False, CALLBACKS[name]())
    vec, vec_trainer = _fit(True, CALLBACKS[name]())
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5
    expected = _epoch_metrics(seq_trainer)
    assert expected.keys() == _epoch_metrics(vec_trainer).keys()
    for key, value in _epoch_metrics(vec_trainer).items():
        assert value == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    if name == "local":  # each client's own model is stored, not only the global one
        store_seq = seq_trainer.strategy.client_store.state_dict()
        store_vec = vec_trainer.strategy.client_store.state_dict()
        assert store_seq.keys() == store_vec.keys() and store_seq
        for client, entry in store_seq.items():
            a, b = entry["local_model"], store_vec[client]["local_model"]
            assert float((a - b).abs().max()) <= 1e-5


OPTIMIZERS = {
    "sgd": {"lr": 0.1},
    "momentum_weight_decay": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    "adam": {"lr": 0.01, "optimizer": "adam", "weight_decay": 0.01},
    "lr_schedule": {"lr": 0.1, "momentum": 0.5, "lr_decay": 0.7},
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizer_equals_the_sequential_path(name):
    seq, _ = _fit(False, [FedProx(mu=0.1)], module=_module(**OPTIMIZERS[name]))
    vec, _ = _fit(True, [FedProx(mu=0.1)], module=_module(**OPTIMIZERS[name]))
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5


class _TorchOptimizer(Classifier):
    """A Classifier whose optimizer is given as a torch class and keyword arguments."""

    def __init__(self, optimizer_class, **kw) -> None:
        super().__init__(network=_network(), lr=kw.get("lr", 0.1))
        self.optimizer_class, self.optimizer_kw = optimizer_class, kw

    def configure_optimizers(self):
        return self.optimizer_class(self.parameters(), **self.optimizer_kw)


@pytest.mark.parametrize(
    "optimizer_class, kw",
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.3}),
        (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "betas": (0.8, 0.99)}),
        (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.05, "amsgrad": True}),
        (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.3, "decoupled_weight_decay": True}),
        (torch.optim.SGD, {"lr": 0.02, "momentum": 0.5, "weight_decay": 0.1, "maximize": True}),
        (torch.optim.SGD, {"lr": 0.02, "maximize": True}),  # stateless: rows added in place
        (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.2}),
    ],
    ids=[
        "nesterov",
        "dampening",
        "adamw",
        "adam-amsgrad-l2",
        "adam-decoupled",
        "sgd-maximize",
        "sgd-plain-maximize",
        "sgd-weight-decay",
    ],  # fmt: skip
)
def test_torch_optimizer_settings_equal_the_sequential_path(optimizer_class, kw):
    """Every option is torch.optim's own (the stacked optimizer calls its functional
    rules): amsgrad and maximize, which no hand-written rule implemented, included.
    Float round-off is relative: maximize drives the weights to hundreds."""
    runs = []
    for vectorize in (False, True):
        torch.manual_seed(1)
        runs.append(_fit(vectorize, module=_TorchOptimizer(optimizer_class, **kw))[0])
    scale = max(1.0, max(float(p.abs().max()) for p in params_of(runs[0])))
    assert max_abs_diff(params_of(runs[0]), params_of(runs[1])) <= 1e-5 * scale


def test_an_optimizer_over_some_parameters_leaves_the_others_as_the_sequential_path():
    """The optimizer holds the last layer only: the first layer is never stepped (it has
    a gradient, which no one applies) on either path, and the trained layer agrees."""

    class HeadOnly(Classifier):
        def configure_optimizers(self):
            return torch.optim.SGD(self.network[-1].parameters(), lr=0.1, momentum=0.5)

    runs = []
    for vectorize in (False, True):
        torch.manual_seed(1)
        runs.append(_fit(vectorize, module=HeadOnly(network=_network()))[0])
    torch.manual_seed(1)
    untouched = _network()[0]
    for module in runs:
        assert torch.equal(module.network[0].weight, untouched.weight)
    assert max_abs_diff(params_of(runs[0]), params_of(runs[1])) <= 1e-5


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_is_per_client(algorithm):
    kw = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": algorithm}
    seq, _ = _fit(False, **kw)
    vec, _ = _fit(True, **kw)
    unclipped, _ = _fit(True)
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5
    assert max_abs_diff(params_of(vec), params_of(unclipped)) > 1e-3  # clipping acted


def test_chunks_equal_one_chunk_and_local_steps_work():
    strategy = {"local_steps": 5, "local_epochs": None}
    whole, _ = _fit(True, strategy=strategy)
    for chunk in (1, 4):
        chunked, _ = _fit(True, chunk=chunk, strategy=strategy)
        assert max_abs_diff(params_of(whole), params_of(chunked)) <= 1e-6
    seq, _ = _fit(False, strategy=strategy)
    assert max_abs_diff(params_of(whole), params_of(seq)) <= 1e-5


@pytest.mark.parametrize("fused", [3, None])
def test_several_local_steps_per_training_step_equal_one(fused):
    """A Lightning step that runs 3 (or all) local steps of a chunk trains exactly what
    one local step per Lightning step trains: unequal clients (masked rows and short last
    batches under local_epochs), dropout, chunks of 4, SCAFFOLD's correction; the epoch
    metrics are the same, and Lightning counts its own steps."""
    kw = {"chunk": 4, "rounds": 3}
    one, one_trainer = _fit(True, [SCAFFOLD()], **kw)
    several, trainer = _fit(
        True, [SCAFFOLD()], strategy={"local_steps_per_training_step": fused}, **kw
    )
    assert all(torch.equal(a, b) for a, b in zip(params_of(one), params_of(several)))
    assert _epoch_metrics(trainer) == pytest.approx(_epoch_metrics(one_trainer), abs=1e-6)
    if fused is None:  # one Lightning step per chunk: 2 chunks (6 clients, 4 + 2) a round
        assert trainer.global_step == 3 * 2
    else:
        assert one_trainer.global_step > trainer.global_step >= one_trainer.global_step / 3
    seq, _ = _fit(False, [SCAFFOLD()], rounds=3)
    assert max_abs_diff(params_of(seq), params_of(several)) <= 1e-5


def test_several_local_steps_per_training_step_need_round_schedules():
    """(The sequential path's fused steps: tests/test_fused_steps.py.)"""
    with pytest.raises(ValueError, match="must be >= 1 or None"):
        FederatedStrategy(vectorize=True, local_steps_per_training_step=0)

    class PerStepSchedule(Classifier):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": decay, "interval": "step"},
            }

    torch.manual_seed(1)
    with pytest.raises(VectorizationError, match="StepLR learning-rate scheduler steps every"):
        _fit(True, rounds=1, module=PerStepSchedule(network=_network()))


def test_the_progress_bar_shows_the_local_steps_of_each_training_step():
    """With 3 local steps per Lightning step, the bar shows the span each step covers:
    1–3, 4–6, ... of the chunk's local steps."""
    from lightning_fl.engine.progress import FederatedProgressBar

    seen = []

    class Spy(FederatedProgressBar):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(self.get_metrics(trainer, pl_module)["step"])
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    strategy = FederatedStrategy(
        sampler=UniformSampler(6), local_steps=7, seed=3, vectorize=True,
        local_steps_per_training_step=3,
    )  # fmt: skip
    make_trainer(strategy, 1, [Spy()], enable_progress_bar=True).fit(
        _module(dropout=0.0), datamodule=tiny_datamodule()
    )
    assert seen == ["1–3/7", "4–6/7", "7/7"]


def test_the_progress_bar_shows_the_round_client_and_local_step_of_sequential_rounds():
    """Without vectorization the postfix is ``client i/m`` and ``step k/K`` (both from 1),
    the description ``Round r/R`` (from 0, as Lightning's epochs), and outside training
    neither key."""
    from lightning_fl.engine.progress import FederatedProgressBar

    seen = []

    class Spy(FederatedProgressBar):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            metrics = self.get_metrics(trainer, pl_module)
            bar = self.train_progress_bar
            seen.append((bar.desc, metrics["client"], metrics["step"], bar.total))
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    strategy, spy, module = (
        FederatedStrategy(sampler=UniformSampler(3), local_steps=2, seed=3),
        Spy(),
        _module(dropout=0.0),
    )
    trainer = make_trainer(strategy, 2, [spy], enable_progress_bar=True)
    trainer.fit(module, datamodule=tiny_datamodule())
    steps = [(f"{i}/3", f"{k}/2") for i in (1, 2, 3) for k in (1, 2)]
    assert seen == [(f"Round {r}/1: ", c, k, 6) for r in (0, 1) for c, k in steps]
    assert not {"client", "step"} & set(spy.get_metrics(trainer, module))  # after training


def test_dropout_masks_follow_the_clients_seeds():
    """With dropout the run still equals the sequential one, and differs from a run
    without dropout: the masks are drawn, per client, as the sequential path draws them."""
    seq, _ = _fit(False)
    vec, _ = _fit(True)
    no_dropout, _ = _fit(True, module=_module(dropout=0.0))
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5
    assert max_abs_diff(params_of(vec), params_of(no_dropout)) > 1e-3


class _MixedDropout(nn.Module):
    """Every kind of ``nn.Dropout`` a step can meet: p = 0 (no mask), an active p = 0.3,
    one the network keeps in eval mode during training (never masks), and p = 1 (all
    zeros, on a side branch so that training still moves)."""

    def __init__(self) -> None:
        super().__init__()
        self.zero, self.active = nn.Dropout(0.0), nn.Dropout(0.3)
        self.kept_off, self.all_off = nn.Dropout(0.5), nn.Dropout(1.0)
        self.body, self.head, self.side = (
            nn.Linear(IN, HIDDEN),
            nn.Linear(HIDDEN, OUT),
            nn.Linear(IN, OUT),
        )

    def train(self, mode: bool = True) -> _MixedDropout:
        super().train(mode)
        self.kept_off.eval()
        return self

    def forward(self, x):
        h = self.kept_off(self.active(torch.relu(self.body(self.zero(x)))))
        return self.head(h) + self.side(self.all_off(x))


def test_dropout_of_every_kind_equals_the_sequential_path():
    """Only the dropouts that mask sequentially get masks: a dropout kept in eval mode, or
    of p = 0, draws none (a mask there would change the run), and p = 1 zeros its input."""

    def module():
        torch.manual_seed(1)
        return Classifier(network=_MixedDropout(), lr=0.1)

    seq, _ = _fit(False, module=module())
    vec, _ = _fit(True, module=module())
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5
    assert max_abs_diff(params_of(vec), params_of(module())) > 1e-3


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adam"])
def test_kept_optimizer_state_equals_the_sequential_path(optimizer):
    """keep_optimizer_state over 4 rounds of 6 of 10 clients: the stacked optimizer loads
    each returning client's saved state and saves it back as torch.optim does (SGD: the
    momentum buffer only; Adam: its step count and both moments)."""

    def module():
        if optimizer == "adam":
            return _TorchOptimizer(torch.optim.Adam, lr=0.01)
        return _module(momentum=0.9)

    kw = {"strategy": {"keep_optimizer_state": True}, "rounds": 4}
    if optimizer == "adam":  # one step a round: a first-time client saves a count of 1
        kw["strategy"].update(local_steps=1, local_epochs=None)
    torch.manual_seed(1)
    seq, seq_trainer = _fit(False, module=module(), **kw)
    torch.manual_seed(1)
    vec, vec_trainer = _fit(True, module=module(), **kw)
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5
    a = seq_trainer.strategy.client_store.state_dict()
    b = vec_trainer.strategy.client_store.state_dict()
    assert a.keys() == b.keys()
    names = {"momentum_buffer"} if optimizer != "adam" else {"step", "exp_avg", "exp_avg_sq"}
    for client in a:
        sa, sb = a[client]["optimizer_0"], b[client]["optimizer_0"]
        assert sa.keys() == sb.keys()
        for index in sa:
            assert sa[index].keys() == sb[index].keys() == names
            for name in names:
                assert sa[index][name].dtype == sb[index][name].dtype, (client, index, name)
                diff = sa[index][name] - sb[index][name]
                assert float(diff.abs().max()) <= 1e-5, (client, index, name)


def test_resume_is_exact(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    full, _ = _fit(True, [SCAFFOLD()], rounds=4)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    _fit(True, [SCAFFOLD(), checkpoint], rounds=2, enable_checkpointing=True)
    (ckpt,) = glob.glob(str(tmp_path / "epoch=1.ckpt"))
    resumed = _module()
    strategy = FederatedStrategy(sampler=UniformSampler(6), local_epochs=2, seed=3, vectorize=True)
    trainer = make_trainer(strategy, 4, [SCAFFOLD()])
    trainer.fit(resumed, datamodule=tiny_datamodule(), ckpt_path=ckpt, weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(params_of(full), params_of(resumed)))


class _ItemLoss(Classifier):
    def loss_and_metrics(self, batch):
        loss, metrics = super().loss_and_metrics(batch)
        if loss.item() > 100:  # data-dependent Python control flow
            loss = loss * 0
        return loss, metrics


class _StepHook(Classifier):
    def on_before_optimizer_step(self, optimizer) -> None:
        pass


class _AfterBackward(__import__("lightning").pytorch.Callback):
    def on_after_backward(self, trainer, pl_module) -> None:
        pass


class _Unvectorized(FederatedCallback):
    not_vectorized_because = "it is a test's callback that says it cannot"


def _bad(kind: str):
    if kind == "batchnorm":
        norm = nn.BatchNorm1d(HIDDEN, momentum=None)  # a cumulative average
        net = nn.Sequential(nn.Linear(IN, HIDDEN), norm, nn.Linear(HIDDEN, OUT))
        return Classifier(network=net), []
    if kind == "dropout2d":
        return Classifier(network=nn.Sequential(nn.Linear(IN, OUT), nn.Dropout1d(0.2))), []
    if kind == "item":
        return _ItemLoss(network=_network()), []
    if kind == "hook":
        return _StepHook(network=_network()), []
    if kind == "callback":
        return _module(), [_Unvectorized()]
    if kind == "plain_callback":
        return _module(), [_AfterBackward()]
    if kind == "rmsprop":
        return _TorchOptimizer(torch.optim.RMSprop, lr=0.01), []
    raise AssertionError(kind)


MESSAGES = {
    "batchnorm": "BatchNorm1d with momentum=None",
    "dropout2d": "Dropout1d",
    "item": "cannot run under torch.func.vmap",
    "hook": "overrides on_before_optimizer_step",
    "callback": "_Unvectorized does not support vectorized clients: it is a test's",
    "plain_callback": "overrides on_after_backward",
    "rmsprop": "RMSprop",
}


@pytest.mark.parametrize("kind", list(MESSAGES))
def test_refusals_name_the_problem_and_the_fix(kind):
    module, callbacks = _bad(kind)
    with pytest.raises(VectorizationError, match=MESSAGES[kind]) as err:
        _fit(True, callbacks, rounds=1, module=module)
    assert "vectorize=False" in str(err.value)


def test_a_module_without_loss_and_metrics_is_refused():
    import lightning.pytorch as pl

    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(IN, OUT)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(VectorizationError, match="not a lightning_fl.FederatedTask"):
        _fit(True, rounds=1, module=Plain())


def test_mixed_precision_is_refused():
    with pytest.raises(VectorizationError, match="32-bit precision"):
        _fit(True, rounds=1, precision="bf16-mixed")


def test_max_vectorized_clients_must_be_positive():
    with pytest.raises(ValueError, match="max_vectorized_clients must be >= 1"):
        FederatedStrategy(vectorize=True, max_vectorized_clients=0)


def test_fedem_equals_the_sequential_path():
    """FedEM's per-client state (the E-step prior π^{k−1} of the per-batch q, and π^k in the
    training accuracy) reaches the vmapped loss through the callback's client context."""
    from lightning_fl import MLP, MixtureClassifier
    from lightning_fl.callbacks import FedEM

    runs = []
    for vectorize in (False, True):
        torch.manual_seed(1)
        module = MixtureClassifier(MLP(IN, (HIDDEN,), OUT), num_components=3, lr=0.1)
        _, trainer = _fit(vectorize, [FedEM()], module=module, chunk=4)
        store = trainer.strategy.client_store.state_dict()
        runs.append((params_of(module), store, _epoch_metrics(trainer)))
    (seq, seq_store, seq_metrics), (vec, vec_store, vec_metrics) = runs
    assert max_abs_diff(seq, vec) <= 1e-5
    assert seq_store.keys() == vec_store.keys() and seq_store
    for client, entry in seq_store.items():
        assert torch.allclose(entry["fedem_pi"], vec_store[client]["fedem_pi"], atol=1e-5)
    for key, value in vec_metrics.items():
        assert value == pytest.approx(seq_metrics[key], rel=1e-5, abs=1e-6), key


def _sgd_with_momentum():
    return _module(dropout=0.0, momentum=0.9, weight_decay=0.01)


def _adamw():
    torch.manual_seed(1)
    return _TorchOptimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)


@pytest.mark.parametrize("make_module", [_sgd_with_momentum, _adamw])
def test_gossip_averaging_equals_the_sequential_path(make_module):
    """Every row starts from its client's own model and steps at its client's rate
    (n_t/n)·T·η (the stacked optimizer's lr_scale, Alg. 8): the personal models and the
    global average equal the sequential run's over 3 rounds, with unequal clients in
    chunks of 4 (masked rows index the scale) under SGD with momentum and under AdamW
    with decoupled weight decay. Dropping the scale fails it."""
    from lightning_fl import FullParticipation
    from lightning_fl.callbacks import GossipAveraging

    runs = []
    for vectorize in (False, True):
        module = make_module()
        _, trainer = _fit(vectorize, [GossipAveraging(edge_probability=0.6, seed=1)], chunk=4,
                          module=module, strategy={"sampler": FullParticipation()})  # fmt: skip
        runs.append((params_of(module), trainer.strategy.client_store.state_dict()))
    (seq, seq_store), (vec, vec_store) = runs
    assert max_abs_diff(seq, vec) <= 1e-5
    assert seq_store.keys() == vec_store.keys() and len(seq_store) > 4
    for client, entry in seq_store.items():
        (key,) = [k for k in entry if "gossip" in k]
        assert float((entry[key] - vec_store[client][key]).abs().max()) <= 1e-5, client


def test_decentralized_fedem_equals_the_sequential_path():
    """D-FedEM (Alg. 8: FedEM with GossipAveraging): every client starts from its own
    mixture, so each row's E-step responsibilities come from its own frozen θ^{k−1}, not
    from the last started client's (which gave a 1e-3 difference in chunks of 4)."""
    from lightning_fl import MLP, FullParticipation
    from lightning_fl.callbacks import FedEM, GossipAveraging
    from lightning_fl.systems.mixture import MixtureClassifier

    runs = []
    for vectorize in (False, True):
        torch.manual_seed(1)
        module = MixtureClassifier(MLP(IN, (HIDDEN,), OUT), num_components=3, lr=0.1)
        callbacks = [GossipAveraging(edge_probability=0.6, seed=1), FedEM()]
        _, trainer = _fit(vectorize, callbacks, module=module, chunk=4,
                          strategy={"sampler": FullParticipation()})  # fmt: skip
        runs.append((params_of(module), trainer.strategy.client_store.state_dict()))
    (seq, seq_store), (vec, vec_store) = runs
    assert max_abs_diff(seq, vec) <= 1e-5
    for client, entry in seq_store.items():
        for key, value in entry.items():
            assert float((value - vec_store[client][key]).abs().max()) <= 1e-5, (client, key)


def test_fedrep_equals_the_sequential_path():
    """Each client's head is trained when it starts; the chunk trains the bodies with the
    head frozen (left out of the stacked optimizer's step, its momentum included): the
    global body and every stored head equal the sequential run's over 3 rounds, in
    chunks of 4. Stepping the frozen head fails it."""
    from lightning_fl.callbacks import FedRep

    runs = []
    for vectorize in (False, True):
        module = _module(dropout=0.0, momentum=0.9)
        _, trainer = _fit(vectorize, [FedRep(head_epochs=2, head_lr=0.05)], module=module,
                          chunk=4)  # fmt: skip
        runs.append((params_of(module), trainer.strategy.client_store.state_dict()))
    (seq, seq_store), (vec, vec_store) = runs
    assert max_abs_diff(seq, vec) <= 1e-5
    assert seq_store.keys() == vec_store.keys() and len(seq_store) >= 6
    for client, entry in seq_store.items():
        for a, b in zip(entry["fedrep_head"], vec_store[client]["fedrep_head"], strict=True):
            assert float((a - b).abs().max()) <= 1e-5, client


@pytest.mark.parametrize("adaptive", [False, True])
def test_apfl_equals_the_sequential_path(adaptive):
    """APFL (Alg. 1): each row's v steps at its own v̄ = αv + (1−α)w on its own batch, w
    before its step, with dropout masks drawn after the user step's, and (adaptive) its
    own α: the global model, every stored v and α equal the sequential run's over 3
    rounds, with unequal clients in chunks of 4. Mixing with the last row's α, or taking
    the gradient at w, fails it."""
    runs = []
    for vectorize in (False, True):
        module = _module(momentum=0.5)
        callbacks = [APFL(alpha=0.3, local_lr=0.07, adaptive_alpha=adaptive, alpha_lr=0.05)]
        _, trainer = _fit(vectorize, callbacks, module=module, chunk=4)
        runs.append((params_of(module), trainer.strategy.client_store.state_dict()))
    (seq, seq_store), (vec, vec_store) = runs
    assert max_abs_diff(seq, vec) <= 1e-5
    assert seq_store.keys() == vec_store.keys() and len(seq_store) >= 6
    alphas = set()
    for client, entry in seq_store.items():
        assert float((entry[APFL.v_key] - vec_store[client][APFL.v_key]).abs().max()) <= 1e-5
        assert vec_store[client][APFL.alpha_key] == pytest.approx(entry[APFL.alpha_key], abs=1e-6)
        alphas.add(round(entry[APFL.alpha_key], 6))
    assert (len(alphas) > 1) == adaptive  # each client's own α moves


def test_pfedme_equals_the_sequential_path():
    """pFedMe (Alg. 1): the K inner steps toward θ̂ run for every row at once, new dropout
    masks at each, and w steps along λ(w − θ̂): the global model and every stored θ̂ equal
    the sequential run's over 3 rounds, with unequal clients in chunks of 4. Keeping the
    user step's gradient, or drawing the inner steps' masks from another generator,
    fails it."""
    runs = []
    for vectorize in (False, True):
        module = _module()
        callbacks = [PFedMe(lam=5.0, personal_lr=0.05, inner_steps=3)]
        _, trainer = _fit(vectorize, callbacks, module=module, chunk=4)
        runs.append((params_of(module), trainer.strategy.client_store.state_dict()))
    (seq, seq_store), (vec, vec_store) = runs
    assert max_abs_diff(seq, vec) <= 1e-5
    assert seq_store.keys() == vec_store.keys() and len(seq_store) >= 6
    for client, entry in seq_store.items():
        diff = (entry[PFedMe.key] - vec_store[client][PFedMe.key]).abs().max()
        assert float(diff) <= 1e-5, client


def test_server_reference_equals_the_sequential_path():
    """WERM with the reference data at the server: the server trains at round start with
    its own seeded dropout masks (not whatever the previous round's last client left in
    the global RNG, which differs between the paths), then the clients train together:
    the global model equals the sequential run's over 3 rounds."""
    from tests.composition import tiny_reference_federation

    runs = []
    for vectorize in (False, True):
        module = _module()
        _fit(vectorize, [ServerReference(w=0.3)], module=module, chunk=4,
             datamodule=tiny_reference_federation)  # fmt: skip
        runs.append(params_of(module))
    assert max_abs_diff(*runs) <= 1e-5


def test_apfl_with_batchnorm_is_refused_under_vectorize():
    net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Linear(HIDDEN, OUT))
    torch.manual_seed(1)
    with pytest.raises(VectorizationError, match="running statistics .*GroupNorm"):
        _fit(True, [APFL()], rounds=1, module=Classifier(network=net))


def test_clipping_by_norm_leaves_rows_under_the_value_alone():
    """Per-row total norm: a row over the value is scaled to it, a row under it is left
    as it is (a clip value that clips every client cannot tell the two apart), down to a
    row whose norm, 10⁻⁷, is below the 10⁻⁶ in the coefficient value/(norm + 10⁻⁶)."""
    from lightning_fl.engine.stacked_optimizer import clip_gradients_

    a = torch.tensor([[3.0, 0.0], [0.3, 0.0], [6e-8, 0.0]])  # rows: clients 0, 1 and 2
    b = torch.tensor([[[0.0, 4.0]], [[0.0, 0.4]], [[0.0, 8e-8]]])  # norms 5, 0.5 and 1e-7
    grads = [a.clone(), b.clone()]
    clip_gradients_(grads, 1.0, "norm")
    scale = 1.0 / (5.0 + 1e-6)
    assert torch.allclose(grads[0][0], a[0] * scale) and torch.allclose(grads[1][0], b[0] * scale)
    assert torch.equal(grads[0][1:], a[1:]) and torch.equal(grads[1][1:], b[1:])
    grads = [a.clone(), b.clone()]
    clip_gradients_(grads, 0.35, "value")
    assert torch.allclose(grads[0], torch.tensor([[0.35, 0.0], [0.3, 0.0], [6e-8, 0.0]]))
    assert torch.allclose(grads[1], torch.tensor([[[0.0, 0.35]], [[0.0, 0.35]], [[0.0, 8e-8]]]))


@pytest.mark.parametrize("kind, momentum", [("sgd", 0.9), ("sgd", 1.0), ("adam", None)])
def test_a_client_row_that_never_stepped_has_no_optimizer_state(kind, momentum):
    """Row 0 loads a saved state (SGD's momentum buffer, at momentum 0.9 and at its upper
    end 1; Adam's 3 steps and moments), row 1
    has none and has not stepped: row 0's state comes back as it was saved, and row 1's
    is empty, as torch.optim keeps no state for a parameter it never stepped."""
    from lightning_fl.engine.stacked_optimizer import StackedOptimizer

    param = torch.nn.Parameter(torch.zeros(3))
    if kind == "sgd":
        optimizer = torch.optim.SGD([param], lr=0.1, momentum=momentum)
        saved = {0: {"momentum_buffer": torch.tensor([1.0, 2.0, 3.0])}}
    else:
        optimizer = torch.optim.Adam([param], lr=0.1)
        saved = {0: {"step": torch.tensor(3.0), "exp_avg": torch.tensor([1.0, 2.0, 3.0]),
                     "exp_avg_sq": torch.tensor([4.0, 5.0, 6.0])}}  # fmt: skip
    stacked = StackedOptimizer(optimizer, [param])
    stacked.reset([torch.zeros(2, 3)], [saved, None])
    assert stacked.state_of(1) == {}
    row = stacked.state_of(0)
    assert row.keys() == saved.keys() and row[0].keys() == saved[0].keys()
    assert all(torch.equal(row[0][name], value) for name, value in saved[0].items())


@pytest.mark.parametrize("prox_mu", [None, 0.5])
def test_dpsgd_equals_the_sequential_path_noise_included(prox_mu):
    """Per-sample clipping inside each client row and each client's noise from its own
    (seed, round, client) generator: the same model as client by client (a noise drawn
    from a shared generator, or clipping over the whole chunk, would differ by the noise
    scale), the same privacy accounting, and a model that differs from no noise."""

    def run(vectorize, sigma=0.5):
        callbacks = [DPSGD(noise_multiplier=sigma, max_grad_norm=0.5)]
        callbacks += [] if prox_mu is None else [FedProx(mu=prox_mu)]
        return _fit(vectorize, callbacks, module=_module(dropout=0.0))

    (seq, seq_trainer), (vec, vec_trainer) = run(False), run(True)
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5
    no_noise, _ = run(True, sigma=0.0)
    assert max_abs_diff(params_of(vec), params_of(no_noise)) > 1e-2
    a = seq_trainer.strategy.client_store.state_dict()
    b = vec_trainer.strategy.client_store.state_dict()
    for client in a:
        for key in ("dp_train_steps", "dp_train_rate", "dp_train_sigma"):
            assert a[client][key] == b[client][key], (client, key)
    assert float(seq_trainer.callback_metrics["dp/epsilon"]) == pytest.approx(
        float(vec_trainer.callback_metrics["dp/epsilon"])
    )


def _opted_in():
    from lightning_fl import ClientTimes, FedBuffSchedule, FullParticipation
    from lightning_fl.callbacks import (
        SAFARI,
        AsynchronousFL,
        ClusteredFL,
        FineTune,
        FreeRiderDetector,
        FreeRiders,
        KNNPer,
        MembershipInference,
        Unlearning,
    )
    from tests.composition import tiny_federation  # it has server data, for SAFARI

    full = {"sampler": FullParticipation()}
    return {
        # clients start from stale model versions: FedBuff with buffer 3, heterogeneous times
        "asynchronous": (lambda: [AsynchronousFL(FedBuffSchedule(3, ClientTimes(50.0)))], full),
        "ditto": (lambda: [Ditto(lam=0.1, personal_lr=0.05)], {}),
        "finetune": (lambda: [FineTune(lr=0.05)], {}),
        "knn_per": (lambda: [KNNPer(k=2, backend="torch")], {}),
        "free_riders": (lambda: [FreeRiders(2, "disguised"), FreeRiderDetector()], full),
        "unlearning": (lambda: [Unlearning("sifu", sigma=0.1, requests={2: [0]})], {}),
        "safari": (lambda: [SAFARI(q=0.5)], {"datamodule": tiny_federation}),  # server: -3
        "clustered": (lambda: [ClusteredFL(eps1=10.0, eps2=0.0, warmup_rounds=1)], full),
        "membership": (lambda: [MembershipInference()], {}),
    }


@pytest.mark.parametrize("name", ["asynchronous", "ditto", "finetune", "knn_per", "free_riders",
                                  "unlearning", "safari", "clustered", "membership"])  # fmt: skip
def test_callbacks_without_per_step_hooks_equal_the_sequential_path(name):
    """Callbacks that act at client start and end, at aggregation or at evaluation train
    their clients vectorized as sequentially: the global model after 5 rounds and the
    (personalized) test metrics are equal (AsynchronousFL's clients start from stale
    versions; Ditto trains its personal models at client end; SIFU forgets at round 2)."""
    make, strategy = _opted_in()[name]
    data = strategy.pop("datamodule", tiny_datamodule)
    runs = []
    for vectorize in (False, True):
        steps = {"local_steps": 3, "local_epochs": None, **strategy}
        module, trainer = _fit(vectorize, make(), 5, module=_module(dropout=0.0), strategy=steps,
                               datamodule=data)  # fmt: skip
        trainer.test(module, datamodule=data(), verbose=False)
        runs.append((params_of(module), _epoch_metrics(trainer)))
    (seq, seq_metrics), (vec, vec_metrics) = runs
    assert max_abs_diff(seq, vec) <= 1e-5
    tested = {k: v for k, v in seq_metrics.items() if k.startswith("test")}
    assert tested
    for key, value in tested.items():
        assert vec_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def _no_single_batches():
    """Unequal clients (4..12 samples, batch 4: short batches of 2 and 3, clients that run
    out of batches) but no batch of one sample, which BatchNorm cannot train on."""
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    clients = tiny_clients(6)
    for client, n in zip(clients, (8, 6, 12, 7, 10, 4)):
        x, y = client["train"]
        client["train"] = (x[:n], y[:n])
    return InMemoryFederatedDataModule(clients, batch_size=4)


def test_batchnorm_keeps_per_client_running_statistics():
    """BatchNorm's running mean and variance are stacked buffers, one row per client,
    updated in place inside vmap (rows that ran out of batches keep theirs): the global
    model, the aggregated statistics and the test metrics equal the sequential run's."""
    runs = []
    for vectorize in (False, True):
        torch.manual_seed(1)
        net = nn.Sequential(
            nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)
        )
        module = Classifier(network=net, lr=0.1)
        _, trainer = _fit(vectorize, module=module, rounds=3, datamodule=_no_single_batches)
        trainer.test(module, datamodule=_no_single_batches(), verbose=False)
        norm = module.network[1]
        runs.append((params_of(module), [norm.running_mean.clone(), norm.running_var.clone()],
                     _epoch_metrics(trainer)))  # fmt: skip
    (seq, seq_stats, seq_metrics), (vec, vec_stats, vec_metrics) = runs
    assert max_abs_diff(seq, vec) <= 1e-5
    assert max_abs_diff(seq_stats, vec_stats) <= 1e-5
    assert float(seq_stats[1].sub(1).abs().max()) > 1e-3  # the statistics moved
    for key, value in seq_metrics.items():
        if key.startswith("test"):
            assert vec_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def _triple(name: str):
    from lightning_fl import FullParticipation
    from lightning_fl.callbacks import DPSGD, FedEM, GossipAveraging

    gossip = {"sampler": FullParticipation()}
    return {
        # each row starts from its own gossip model; v starts there too
        "gossip+apfl": ([GossipAveraging(edge_probability=0.6, seed=1),
                         APFL(alpha=0.3, local_lr=0.07, adaptive_alpha=True)], gossip, None),
        # the inner loop's anchor is each row's own w
        "gossip+pfedme": ([GossipAveraging(edge_probability=0.6, seed=1),
                           PFedMe(lam=5.0, personal_lr=0.05, inner_steps=2)], gossip, None),
        # DP-SGD's replaced gradient, then SCAFFOLD's correction, in the sequential order
        "scaffold+dpsgd": ([SCAFFOLD(), DPSGD(noise_multiplier=0.5, max_grad_norm=0.5)], {},
                           _module(dropout=0.0)),
        # FedEM's per-row responsibilities beside FedProx's proximal term
        "fedem+fedprox": ([FedEM(), FedProx(mu=0.3)], {}, "mixture"),
    }[name]  # fmt: skip


@pytest.mark.parametrize("name", ["gossip+apfl", "gossip+pfedme", "scaffold+dpsgd",
                                  "fedem+fedprox"])  # fmt: skip
def test_stateful_triples_equal_the_sequential_path(name):
    """Two plugins that each keep per-client state or change the step, plus vectorized
    clients: the composition matrix checks pairs, and the D-FedEM bug (a shared frozen
    θ^{k−1}) showed only with three. The global model and every client-store tensor equal
    the sequential run's over 3 rounds, in chunks of 4."""
    from lightning_fl import MLP
    from lightning_fl.systems.mixture import MixtureClassifier

    runs = []
    for vectorize in (False, True):
        callbacks, strategy, module = _triple(name)
        if module == "mixture":
            torch.manual_seed(1)
            module = MixtureClassifier(MLP(IN, (HIDDEN,), OUT), num_components=2, lr=0.1)
        module = module or _module()
        _, trainer = _fit(vectorize, callbacks, module=module, chunk=4, strategy=strategy)
        runs.append((params_of(module), trainer.strategy.client_store.state_dict()))
    (seq, seq_store), (vec, vec_store) = runs
    assert max_abs_diff(seq, vec) <= 1e-5
    assert seq_store.keys() == vec_store.keys() and seq_store
    for client, entry in seq_store.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                diff = float((value - vec_store[client][key]).abs().max())
                assert diff <= 1e-5, (client, key, diff)


def _streams():
    from lightning_fl.datamodules import StreamingDataModule

    return StreamingDataModule(tiny_datamodule(), rate=3, capacity=6, cache="fifo", rounds=3)


def _one_sample_after_an_empty_client():
    """Client 0 without training data, client 1 with a single sample."""
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    clients = tiny_clients(2)
    for client, n in zip(clients, (0, 1)):
        x, y = client["train"]
        client["train"] = (x[:n], y[:n])
    return InMemoryFederatedDataModule(clients, batch_size=4)


@pytest.mark.parametrize("datamodule", [tiny_datamodule, _streams,
                                        _one_sample_after_an_empty_client])  # fmt: skip
def test_a_loss_that_cannot_run_under_vmap_is_refused_before_the_first_round(datamodule):
    """The setup probe runs the vmapped loss on the first client with data (a stream's
    caches hold data from round 0 on, so it is moved there first; a client of one sample
    has data, one of none is passed over): the refusal comes before any round starts, not
    in the first step."""
    import lightning.pytorch as pl

    rounds_started = []

    class Recorder(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            rounds_started.append(trainer.current_epoch)

    module, _ = _bad("item")
    with pytest.raises(VectorizationError, match=MESSAGES["item"]):
        _fit(True, [Recorder()], rounds=1, module=module, datamodule=datamodule,
             strategy={"local_steps": 2, "local_epochs": None, "sampler": None})  # fmt: skip
    assert rounds_started == []


def test_a_stream_trains_vectorized_as_sequentially():
    seq, _ = _fit(False, datamodule=_streams, strategy={"local_steps": 2, "local_epochs": None})
    vec, _ = _fit(True, datamodule=_streams, strategy={"local_steps": 2, "local_epochs": None})
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5
    assert max_abs_diff(params_of(vec), params_of(_module())) > 1e-3  # it trained


def test_unpacked_batches_of_several_shapes_log_the_sequential_metrics():
    """Without packed data (``data_on_device=False``) a vectorized step groups its clients
    by batch shape (last batches of 4..40 samples in fours differ): each group's batch size
    weighs its losses, so the round's metrics equal the sequential path's."""
    seq, seq_trainer = _fit(False)
    vec, vec_trainer = _fit(True, strategy={"data_on_device": False})
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5
    expected = _epoch_metrics(seq_trainer)
    for key, value in _epoch_metrics(vec_trainer).items():
        assert value == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key


def test_a_round_leaves_the_global_rng_as_the_sequential_path_does():
    """The sequential path seeds the global RNG at each client's start; a model without
    dropout draws nothing from it, so a round leaves it seeded with its last client's
    seed. Vectorized clients started together seed it once, with that seed: a callback
    that draws from it at the round's end draws the same numbers."""
    import lightning.pytorch as pl

    class Draw(pl.Callback):
        def __init__(self):
            self.draws = []

        def on_train_epoch_end(self, trainer, pl_module):
            self.draws.append(torch.rand(3))

    runs = []
    for vectorize in (False, True):
        draw = Draw()
        _fit(vectorize, [draw], module=_module(dropout=0.0), chunk=4)
        runs.append(torch.stack(draw.draws))
    assert len(runs[0]) == 3 and torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0][0], runs[0][1])  # each round's last client differs


class _WithSpare(nn.Module):
    """A network with a layer its forward never uses (an auxiliary head, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _network(dropout=0.0)
        self.spare = nn.Linear(3, 3)

    def forward(self, x):
        return self.net(x)


def _spare_module(optimizer: str) -> Classifier:
    torch.manual_seed(1)
    if optimizer == "adamw":
        module = _TorchOptimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        module.network = _WithSpare()
        return module
    return Classifier(network=_WithSpare(), lr=0.1, momentum=0.9, weight_decay=0.1)


SPARE_CASES = {
    "sgd_momentum_decay": ("sgd", lambda: [], {}),
    "adamw": ("adamw", lambda: [], {}),
    "fedprox": ("sgd", lambda: [FedProx(mu=0.5)], {}),
    "clipped": ("sgd", lambda: [], {"gradient_clip_val": 0.05}),
    "dpsgd": ("sgd", lambda: [DPSGD(noise_multiplier=0.5, max_grad_norm=0.5)], {}),
}


@pytest.mark.parametrize("case", list(SPARE_CASES))
def test_a_parameter_the_loss_does_not_use_is_left_alone_as_sequentially(case):
    """The sequential path gives an unused parameter no gradient, and torch's optimizer
    leaves it alone: no weight decay, no momentum, no proximal term. Vectorized clients
    do the same (a zero gradient would decay it and move it by FedProx's term); DP-SGD
    gives it its noise on both paths."""
    optimizer, callbacks, kw = SPARE_CASES[case]
    seq, _ = _fit(False, callbacks(), module=_spare_module(optimizer), **kw)
    vec, _ = _fit(True, callbacks(), module=_spare_module(optimizer), **kw)
    start = _spare_module(optimizer).network.spare.weight
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5
    moved = float((vec.network.spare.weight - start).abs().max())
    assert moved > 1e-2 if case == "dpsgd" else moved == 0.0
    assert (
        max_abs_diff(params_of(vec.network.net), params_of(_spare_module(optimizer).network.net))
        > 1e-3
    )


PADDED = {
    "fedavg": (lambda: [FedAvg()], {}),
    "fedprox_adam": (lambda: [FedProx(mu=0.5)], {"optimizer": "adam", "lr": 0.01}),
    "scaffold_momentum": (lambda: [SCAFFOLD()], {"momentum": 0.5}),
    "apfl": (lambda: [APFL(alpha=0.3, local_lr=0.07, adaptive_alpha=True, alpha_lr=0.05)], {}),
    "pfedme": (lambda: [PFedMe(lam=5.0, personal_lr=0.05, inner_steps=2)], {}),
    "ditto": (lambda: [Ditto(lam=0.1, personal_lr=0.05)], {}),
}


@pytest.mark.parametrize("name", list(PADDED))
def test_padded_short_batches_equal_the_sequential_path(name):
    """Without dropout a Classifier gives per-sample losses, so a step's short batches
    (4..40 samples, batch 4, 2 local epochs) are padded into one vmapped call: the global
    model, every client's stored state and the epoch metrics (the padding weighted out of
    the loss, the accuracy and the batch sizes) equal the sequential run's over 3 rounds,
    in chunks of 4, for SCAFFOLD, FedProx and the personalization plugins (APFL and
    pFedMe take second gradients at the padded batch)."""
    make_callbacks, optim = PADDED[name]
    runs = []
    for vectorize in (False, True):
        module = _module(0.0, **optim)
        _, trainer = _fit(vectorize, make_callbacks(), module=module, chunk=4)
        runs.append((module, trainer))
    (seq, seq_trainer), (vec, vec_trainer) = runs
    assert vec_trainer.strategy.vectorized.pads_short_batches
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5
    seq_store = seq_trainer.strategy.client_store.state_dict()
    vec_store = vec_trainer.strategy.client_store.state_dict()
    assert seq_store.keys() == vec_store.keys()
    for client, entry in seq_store.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert float((value - vec_store[client][key]).abs().max()) <= 1e-5, key
    expected = _epoch_metrics(seq_trainer)
    assert expected.keys() == _epoch_metrics(vec_trainer).keys()
    for key, value in _epoch_metrics(vec_trainer).items():
        assert value == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key


def _conv_module() -> Classifier:
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Unflatten(1, (1, 2, 3)), nn.Conv2d(1, 2, 2, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(2 * 3 * 4, OUT),
    )  # fmt: skip
    return Classifier(network=net, lr=0.1)


class _MixesSamples(nn.Module):
    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


def _mixing_module() -> Classifier:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(IN, HIDDEN), _MixesSamples(), nn.Linear(HIDDEN, OUT))
    return Classifier(network=net, lr=0.1)


def _conv_mixing_module() -> Classifier:
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Unflatten(1, (1, 2, 3)), nn.Conv2d(1, 2, 2, padding=1), _MixesSamples(),
        nn.Flatten(), nn.Linear(2 * 3 * 4, OUT),
    )  # fmt: skip
    return Classifier(network=net, lr=0.1)


@pytest.mark.parametrize(
    ("make", "stacked"),
    [(lambda: _module(0.0), True), (_conv_module, True), (_mixing_module, False),
     (_conv_mixing_module, True)],
    ids=["mlp", "conv", "mixes_samples", "conv_mixes_samples"],
)  # fmt: skip
def test_the_stacked_layers_run_without_vmap_and_equal_the_sequential_path(
    make, stacked, monkeypatch
):
    """With per-sample layers (Linear, Conv2d) the vectorized steps run the task's layers
    on the clients' batches laid end to end, never vmap: FedProx over 3 rounds (2 local
    epochs of unequal clients, padded short batches) equals the sequential run. A layer
    that mixes a batch's samples is found by the set-up probe: the steps stay vmapped,
    short batches are not padded (the padding would enter the mix), the log says why, and
    the run is as exact. A network with a convolution runs client by client on the CPU,
    each client's block cut to its own samples: there a layer that mixes samples sees its
    client's alone, and the padded run is exact."""
    from lightning_fl.engine import vectorized, vectorized_step

    said, vmapped = [], []
    monkeypatch.setattr(vectorized, "rank_zero_info", said.append)
    real_vmap = vectorized_step.vmap
    monkeypatch.setattr(
        vectorized_step, "vmap", lambda *a, **k: vmapped.append(1) or real_vmap(*a, **k)
    )
    runs = []
    for vectorize in (False, True):
        module = make()
        _, trainer = _fit(vectorize, [FedProx(mu=0.5)], module=module, chunk=4)
        runs.append((module, trainer))
    (seq, _), (vec, vec_trainer) = runs
    step = vec_trainer.strategy.vectorized.step
    assert (step.stacked_layers is not None) == stacked
    if stacked:
        assert step.stacked_layers.client_by_client == ("conv" in make.__name__)
    assert vec_trainer.strategy.vectorized.pads_short_batches == stacked
    assert (len(vmapped) == 1) == stacked  # the set-up's check_runs only
    assert max_abs_diff(params_of(seq), params_of(vec)) <= 1e-5
    lines = [m for m in said if "stay under vmap" in m]
    assert len(lines) == (0 if stacked else 1)


class _Regularized(Classifier):
    """A loss with a term of its own: its inherited per-sample losses no longer mean to it."""

    def loss_and_metrics(self, batch):
        loss, metrics = super().loss_and_metrics(batch)
        return loss + 0.5 * self.network[0].weight.square().sum(), metrics


def test_a_task_whose_sample_losses_disagree_is_not_padded_and_still_exact(monkeypatch):
    """The set-up probe compares the per-sample means with loss_and_metrics: a subclass
    that adds a term to one of them trains its short batches as steps of their own (and
    still equals the sequential run), and the log says why."""
    from lightning_fl.engine import vectorized

    said = []
    monkeypatch.setattr(vectorized, "rank_zero_info", said.append)
    runs = []
    for vectorize in (False, True):
        torch.manual_seed(1)
        module = _Regularized(network=_network(0.0), lr=0.1)
        _, trainer = _fit(vectorize, [FedAvg()], module=module, chunk=4)
        runs.append((module, trainer))
    assert not runs[1][1].strategy.vectorized.pads_short_batches
    assert max_abs_diff(params_of(runs[0][0]), params_of(runs[1][0])) <= 1e-5
    (line,) = [m for m in said if "sample_losses_and_metrics" in m]
    assert "_Regularized.sample_losses_and_metrics does not give loss_and_metrics" in line
    assert line.endswith("Fix or remove it to pad them.")


class _MeanOnly(FederatedTaskBase):
    """A task with loss_and_metrics only."""

    def loss_and_metrics(self, batch):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y), {}


def _batchnorm_module() -> Classifier:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Linear(HIDDEN, OUT))
    return Classifier(network=net, lr=0.1)


@pytest.mark.parametrize(
    ("module", "callbacks"),
    [
        (lambda: _module(0.3), lambda: [FedAvg()]),  # dropout: masks of the batch's shape
        (_batchnorm_module, lambda: [FedAvg()]),  # the batch's statistics
        (lambda: _module(0.0), lambda: [DPSGD(noise_multiplier=0.5, max_grad_norm=1.0)]),
        (lambda: _MeanOnly(_network(0.0), lr=0.1), lambda: [FedAvg()]),  # no per-sample loss
    ],
    ids=["dropout", "batchnorm", "dpsgd", "no_sample_losses"],
)
def test_what_would_see_the_padding_turns_it_off(module, callbacks, monkeypatch):
    """Turned off at once, before the probe: nothing to log about the task."""
    from lightning_fl.engine import vectorized

    said = []
    monkeypatch.setattr(vectorized, "rank_zero_info", said.append)
    _, trainer = _fit(True, callbacks(), rounds=1, module=module(), datamodule=_no_single_batches)
    assert not trainer.strategy.vectorized.pads_short_batches
    assert not [m for m in said if "sample_losses_and_metrics" in m]


def test_the_built_in_tasks_per_sample_losses_mean_to_their_loss_and_metrics():
    """Classifier's and BinaryClassifier's per-sample losses and accuracies, averaged,
    are their batch's (7 samples, some right and some wrong)."""
    from lightning_fl import BinaryClassifier

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, IN, generator=g)
    tasks = [
        (_module(0.0), torch.randint(0, OUT, (7,), generator=g)),
        (BinaryClassifier(nn.Linear(IN, 1)), torch.randint(0, 2, (7, 1), generator=g)),
    ]
    for task, y in tasks:
        loss, metrics = task.loss_and_metrics((x, y))
        losses, per_sample = task.sample_losses_and_metrics((x, y))
        assert losses.shape == (7,) and per_sample["acc"].shape == (7,)
        assert float(losses.mean()) == pytest.approx(float(loss), rel=1e-6)
        assert float(per_sample["acc"].mean()) == pytest.approx(float(metrics["acc"]))
        assert 0 < float(metrics["acc"]) < 1
