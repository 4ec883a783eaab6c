"""The compiled vectorized step (FederatedStrategy(vectorize=True, compile=...)) equals the
eager vectorized path, is deterministic, reports its compile time, and refuses what it
cannot compile.

The comparisons use the "aot_eager" backend, which traces and functionalizes the step as
inductor does but generates no code (seconds instead of a minute on 2 cores); one test
runs inductor itself. Unequal clients (4..40 samples, batch 4, two local epochs) give
chunks whose rows run out of batches and short last batches, so the graphs see several
row counts and batch sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_fl import Classifier, FederatedStrategy, UniformSampler
from lightning_fl.callbacks import SCAFFOLD, FedEM, FedProx
from lightning_fl.engine.vectorized import VectorizationError
from tests.helpers import HIDDEN, IN, OUT, make_trainer, max_abs_diff, params_of, tiny_datamodule


def _module(dropout: float = 0.0, **optim) -> Classifier:
    torch.manual_seed(1)
    optim.setdefault("lr", 0.1)
    net = nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Dropout(dropout), nn.Linear(HIDDEN, OUT)
    )
    return Classifier(network=net, **optim)


def _fit(compile, callbacks=(), rounds: int = 3, module=None, steps=None, **kw):
    strategy = FederatedStrategy(
        sampler=UniformSampler(6), local_epochs=None if steps else 2, local_steps=steps,
        seed=3, vectorize=True, compile=compile,
    )  # fmt: skip
    module = module or _module()
    trainer = make_trainer(strategy, rounds, list(callbacks), **kw)
    trainer.fit(module, datamodule=tiny_datamodule())
    return module, trainer


@pytest.mark.parametrize(
    "name, callbacks, optim",
    [
        ("sgd", list, {}),
        ("momentum + fedprox", lambda: [FedProx(mu=0.5)], {"momentum": 0.9}),
        ("scaffold", lambda: [SCAFFOLD()], {}),
    ],
)
def test_compiled_step_equals_the_eager_vectorized_path(name, callbacks, optim):
    """To 1e-5 after three rounds: the gradient terms, optimizer and aggregation run on
    the compiled gradients as on the eager ones (a wrong row, a dropped client or a
    gradient of the summed loss scaled by the rows would be far off)."""
    eager, _ = _fit(False, callbacks(), module=_module(**optim))
    compiled, trainer = _fit("aot_eager", callbacks(), module=_module(**optim))
    assert max_abs_diff(params_of(eager), params_of(compiled)) <= 1e-5
    assert max_abs_diff(params_of(compiled), params_of(_module(**optim))) > 1e-2  # it trained
    assert trainer.strategy.vectorized.compile_seconds > 0


def test_a_parameter_the_loss_does_not_use_stays_put_when_compiled():
    """The compiled gradients are zeros for a parameter the loss does not use; the set-up
    probe finds it, and it is left alone as on the eager path (with momentum and weight
    decay a zero gradient would move it)."""
    from tests.test_vectorized import _spare_module

    eager, _ = _fit(False, module=_spare_module("sgd"))
    compiled, trainer = _fit("aot_eager", module=_spare_module("sgd"))
    assert max_abs_diff(params_of(eager), params_of(compiled)) <= 1e-5
    spare = [name for name, _ in compiled.named_parameters()].index("network.spare.weight")
    assert trainer.strategy.vectorized.step.unused == {spare, spare + 1}  # weight, bias
    assert torch.equal(compiled.network.spare.weight, _spare_module("sgd").network.spare.weight)


def test_compiled_runs_are_deterministic_and_log_the_compile_time(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    a, trainer = _fit("aot_eager", logger=CSVLogger(tmp_path), rounds=2)
    b, _ = _fit("aot_eager", rounds=2)
    assert all(torch.equal(x, y) for x, y in zip(params_of(a), params_of(b)))
    logged = trainer.callback_metrics["fl/compile_seconds"]
    assert float(logged) == pytest.approx(trainer.strategy.vectorized.compile_seconds)


def test_inductor_compiles_the_step_and_equals_the_eager_path():
    """The default backend, which generates code (tens of seconds on 2 cores: one local
    step of full batches, so that one graph is compiled)."""
    eager, _ = _fit(False, rounds=2, steps=1)
    compiled, trainer = _fit(True, rounds=2, steps=1)
    assert max_abs_diff(params_of(eager), params_of(compiled)) <= 1e-5
    assert trainer.strategy.vectorized.step.compiled.backend == "inductor"


def test_the_progress_bar_shows_the_chunk_and_the_compile_time():
    from lightning_fl.engine.progress import FederatedProgressBar

    seen = []

    class Spy(FederatedProgressBar):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(self.get_metrics(trainer, pl_module))
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    _fit("aot_eager", [Spy()], rounds=1, enable_progress_bar=True)
    assert seen and all({"clients", "step", "compile"} <= set(m) for m in seen)
    assert seen[0]["clients"].endswith("/6") and seen[0]["step"].startswith("1/")


@pytest.mark.parametrize("kind", ["dropout", "batchnorm", "fedem"])
def test_what_cannot_be_compiled_is_refused_at_setup(kind):
    if kind == "dropout":
        module, callbacks, match = _module(dropout=0.3), [], "nn.Dropout with p=0.3"
    elif kind == "batchnorm":
        net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Linear(HIDDEN, OUT))
        module, callbacks, match = Classifier(network=net), [], "BatchNorm1d"
    else:
        from lightning_fl import MLP, MixtureClassifier

        module = MixtureClassifier(MLP(IN, (HIDDEN,), OUT), num_components=2, lr=0.1)
        callbacks, match = [FedEM()], "FedEM installs"
    with pytest.raises(VectorizationError, match=match) as err:
        _fit("aot_eager", callbacks, rounds=1, module=module)
    assert "compile=False" in str(err.value)


def test_compile_without_vectorize_is_refused():
    with pytest.raises(ValueError, match="set vectorize=True"):
        FederatedStrategy(compile=True)


def test_compile_time_counts_the_first_call_of_each_shape_and_the_gradients_are_per_client(
    monkeypatch,
):
    """CompiledGradients with torch.compile replaced by the identity and a clock that
    ticks 1.5 s per reading: of six calls, the first of (2 rows, key a), (3 rows, key a)
    and (2 rows, key b) are timed, so 4.5 s; each row's gradient is that client's own,
    by hand, for a loss Σ_j w_j·x of the trainable parameters 0 and 2 (parameter 1 is
    frozen and only shifts the loss)."""
    import lightning_fl.engine.compiled as compiled

    ticks = iter(1.5 * k for k in range(100))
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, backend: fn)
    monkeypatch.setattr(compiled.time, "perf_counter", lambda: next(ticks))

    def client_loss(params, buffers, batch):
        loss = (params[0] * batch).sum() + 3 * (params[2] * batch).sum() + params[1].sum()
        return loss, {"acc": loss * 0}

    gradients = compiled.CompiledGradients(client_loss, trainable=[0, 2])
    for rows, key in [(2, "a"), (2, "a"), (3, "a"), (3, "a"), (2, "b"), (2, "a")]:
        params = [torch.ones(rows, 4), torch.full((rows, 1), 7.0), torch.zeros(rows, 4)]
        batch = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)
        loss, metrics, grads = gradients(params, [], batch, key)
        assert torch.equal(grads[0], batch) and torch.equal(grads[1], 3 * batch)
        assert torch.equal(loss, batch.sum(1) + 7.0) and metrics["acc"].shape == (rows,)
    assert gradients.seconds == 4.5


def test_compile_seconds_count_the_first_call_of_each_new_shape_only(monkeypatch):
    """With a clock that advances 1 s per reading, calls of (2 rows, key a), again (2, a),
    (3 rows, a) and (2, b) time three first calls: 3 s, not the 4 calls' 4 s."""
    from types import SimpleNamespace

    from lightning_fl.engine import compiled

    ticks = iter(range(100))
    monkeypatch.setattr(compiled, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))

    def client_loss(params, buffers, batch):
        loss = ((batch @ params[0]) ** 2).sum()
        return loss, {"loss": loss}

    gradients = compiled.CompiledGradients(client_loss, trainable=[0], backend="eager")
    for rows, key in [(2, "a"), (2, "a"), (3, "a"), (2, "b")]:
        params = [torch.ones(rows, 3)]
        losses, _, grads = gradients(params, [], torch.ones(rows, 4, 3), key)
        assert losses.shape == (rows,) and grads[0].shape == (rows, 3)
        assert torch.equal(grads[0], torch.full((rows, 3), 24.0))  # 2·Σ_b (x_b·θ)·x_b = 2·4·3
    assert gradients.seconds == 3
