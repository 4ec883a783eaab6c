"""Plugins compose (issue 24; docs/architecture.md "Plugins compose").

The matrix: every pair of plugins of tests/composition.py either trains two rounds with
its invariants holding (finite model; the sampler's declared weights; a resume equal to
the uninterrupted run; vectorized equal to sequential) or is refused before any
training with an error naming both plugins; every rule of the refusal table is used.
Then the silent defects a new user found, each with the test that failed before its fix.
"""

from __future__ import annotations

import warnings
from functools import cache

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fl import (
    AvailableClients,
    FederatedStrategy,
    FullParticipation,
    MarkovAvailability,
    UniformSampler,
)
from lightning_fl.callbacks import Ditto, FedAvg, Unlearning
from lightning_fl.callbacks.catalog import package_plugins, refusal_table
from lightning_fl.engine.composition import TRAIT_RULES, WAY_TRAITS, CompositionError
from lightning_fl.engine.federated_state import FederationMismatchError
from lightning_fl.engine.traits import Trait, traits_of_class
from lightning_fl.systems.samplers import ExcludedClients
from tests import composition
from tests.helpers import make_trainer, max_abs_diff, params_of, tiny_datamodule, tiny_module

composition.quiet()


@cache
def _alone(name: str) -> composition.Outcome:
    return composition.run((name,))


@cache
def _matrix() -> dict[tuple[str, str], composition.Outcome]:
    return {pair: composition.run(pair) for pair in composition.pairs()}


def test_every_plugin_trains_alone():
    for plugin in composition.PLUGINS:
        outcome = _alone(plugin.name)
        assert outcome.status == "ok", (plugin.name, outcome.message)


def test_every_pair_trains_or_is_refused_at_setup_naming_both_plugins():
    for (a, b), outcome in _matrix().items():
        assert outcome.status in ("ok", "refused"), (a, b, outcome.message)
        if outcome.status == "refused":
            assert composition.names_plugin(outcome.message, a), (a, b, outcome.message)
            assert composition.names_plugin(outcome.message, b), (a, b, outcome.message)
            assert len(outcome.message.splitlines()) == 1, outcome.message


#: The traits only ways of running have (their rules are checked on 2 processes below, and
#: in silo mode by tests/test_silos.py and tests/test_distributed_dp.py).
WAYS_ONLY = {trait for traits in WAY_TRAITS.values() for trait in traits}


def test_every_rule_refuses_some_pair_of_the_matrix():
    messages = [o.message for o in _matrix().values() if o.status == "refused"]
    for rule in TRAIT_RULES:
        if not WAYS_ONLY & {rule.first, rule.second}:
            assert any(rule.reason in m for m in messages), rule


def test_every_trait_is_read_by_a_rule_and_declared_by_a_plugin_or_a_way_of_running():
    """A trait no rule reads, or one that no plugin of the package (nor a way of running)
    declares, is a misspelt or forgotten rule."""
    traits = {value for name, value in vars(Trait).items() if name.isupper()}
    read = {trait for rule in TRAIT_RULES for trait in (rule.first, rule.second)}
    assert read == traits
    declared = set().union(*(traits_of_class(cls) for cls in package_plugins()))
    assert traits <= declared | WAYS_ONLY


def test_every_pair_the_rules_refuse_is_refused_by_them_and_no_other_pair_is():
    """Each rule against every plugin of the matrix by the traits written by hand
    (tests/composition.py): a pair is refused with the reason of the first rule (in
    :data:`TRAIT_RULES`' order) that one plugin's and the other's traits meet, and a pair
    no rule meets is never refused with a rule's reason (vectorized pairs, refused by the
    vectorization rules, aside)."""
    reasons = {rule.reason for rule in TRAIT_RULES}
    predicted = 0
    for (a, b), outcome in _matrix().items():
        if "vectorize" in (a, b):
            continue
        rule = next(
            (
                r
                for r in TRAIT_RULES
                for one, other in ((a, b), (b, a))
                if r.first in composition.TRAITS_BY_HAND[one]
                and r.second in composition.TRAITS_BY_HAND[other]
            ),
            None,
        )
        if rule is None:
            assert not any(reason in outcome.message for reason in reasons), (a, b)
        else:
            predicted += 1
            assert outcome.status == "refused" and rule.reason in outcome.message, (a, b)
    assert predicted == 133  # of the 955 pairs (every listed plugin the matrix has)


def test_pairs_that_train_keep_their_invariants():
    """Finite models; a resume mid-run equals the run without interruption (exactly);
    vectorized clients equal sequential ones (to float round-off)."""
    checked = {"resume": 0, "vectorize": 0}
    for (a, b), outcome in _matrix().items():
        if outcome.status != "ok":
            continue
        assert all(bool(p.isfinite().all()) for p in outcome.params), (a, b)
        for rows in outcome.weights:
            _, clients, weights = rows
            assert len(set(clients)) == len(clients), (a, b, rows)
            assert all(w >= 0 and w == w for w in weights), (a, b, rows)
        for mode in ("resume", "vectorize"):
            if mode not in (a, b):
                continue
            other = b if a == mode else a
            reference = _alone(other).params
            diff = max_abs_diff(outcome.params, reference)
            assert diff <= (0.0 if mode == "resume" else 1e-5), (a, b, diff)
            checked[mode] += 1
    assert checked["resume"] >= 30 and checked["vectorize"] >= 10, checked


#: Plugins that do not change who takes part or with which weight.
_NEUTRAL = {"FedAvg", "FedAvgM", "FedAdam", "FedYogi", "FedAdagrad", "SCAFFOLD", "FedProx",
            "FedEM", "KNNPer", "Ditto", "APFL", "FedRep", "PFedMe", "FineTune", "DPSGD",
            "MembershipInference", "vectorize", "resume"}  # fmt: skip
_PLAIN_SAMPLERS = (
    "FullParticipation",
    "UniformSampler",
    "MDSampler",
    "SampleSizeClusteredSampler",
    "FixedClustersSampler",
    "ExcludedClients",
)


def test_participants_and_weights_are_the_samplers_whatever_the_other_plugin():
    """ω_i(S_t) of each round equal the sampler's own draw from (seed, t) and the
    aggregator's target weights p_i = n_i/Σn (weights as declared)."""
    counts = torch.tensor(
        [len(d["train"][1]) for d in composition._clients()[0]], dtype=torch.float64
    )
    p = counts / counts.sum()
    for (a, b), outcome in _matrix().items():
        if a not in _PLAIN_SAMPLERS or b not in _NEUTRAL or outcome.status != "ok":
            continue
        sampler = composition.build((a,)).sampler
        for round_idx, clients, weights in outcome.weights:
            expected = sampler.sample(round_idx, 0, p)
            assert clients == expected.clients, (a, b, round_idx)
            assert weights == pytest.approx(expected.weights, abs=1e-12), (a, b, round_idx)


def test_the_readme_shows_the_refusal_table():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert refusal_table() in readme, (
        "regenerate it: python -m lightning_fl.callbacks.catalog refusals"
    )


# ---- the defects of issue 24 -----------------------------------------------------------


def _ca_fed():
    availability = MarkovAvailability([0.9] * 4 + [0.3] * 4, [0.8, 0.0] * 4)
    return AvailableClients(availability, "ca_fed", kappa2=0.0)


def _fit(sampler, rounds=4, callbacks=(), **trainer_kw):
    module = tiny_module()
    strategy = FederatedStrategy(sampler=sampler, local_steps=2, seed=1)
    trainer = make_trainer(strategy, rounds, list(callbacks), **trainer_kw)
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=8))
    return module, trainer


def test_wrappers_forward_ca_feds_loss_probes():
    """CA-Fed behind ExcludedClients (excluding nobody) is CA-Fed: the same model, and the
    losses of every available client were probed (before, the wrapper dropped
    needs_losses and the first round failed)."""
    plain, wrapped = _ca_fed(), ExcludedClients(_ca_fed(), [])
    assert wrapped.needs_losses and not ExcludedClients(UniformSampler(2), []).needs_losses
    a, _ = _fit(plain)
    b, _ = _fit(wrapped)
    assert max_abs_diff(params_of(a), params_of(b)) == 0
    assert torch.equal(plain.filter.estimate, wrapped.sampler.filter.estimate)
    assert bool((wrapped.sampler.filter.estimate > 0).all())
    # behind the unlearning wrapper too, with a request on the way
    unlearning = Unlearning("fine_tuning", requests={2: [6]})
    sampler = _ca_fed()
    _fit(sampler, callbacks=[FedAvg(), unlearning])
    assert unlearning.removed == [6] and sampler.filter.estimate is not None


def test_an_error_while_planning_the_first_round_is_not_masked():
    class Broken(UniformSampler):
        def sample(self, round_idx, seed, p):
            raise ValueError("the sampler's own message")

    with pytest.raises(ValueError, match="the sampler's own message"):
        _fit(Broken(2), rounds=1)


@pytest.mark.parametrize("decay", [1.0, 0.6])
def test_sensitivity_is_the_difference_of_two_aggregations_with_sample_weights(decay):
    """Ψ(2, c) = Σ_s decay^(1−s) ‖Δ(I, θ^s) − Δ(I∖{c}, θ^s)‖ with FedAvg's sample weights
    p_i = n_i/Σn (unequal clients) and η_g = 0.5, computed from the clients' updates of
    two rounds: removing c renormalizes the others' weights by 1/(1 − p_c); with a decay
    (Cor. 5.1) the first round's term is discounted once."""
    from lightning.pytorch import Callback

    deltas: list[dict[int, torch.Tensor]] = []

    class Keep(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            deltas.append({})

        def on_train_epoch_end(self, trainer, pl_module):
            deltas[-1].update(unlearning._deltas)

    unlearning = Unlearning(sigma=0.1, decay=decay)
    dm = tiny_datamodule(num_clients=6)
    counts = torch.tensor(dm.sample_counts("train"), dtype=torch.float64)
    assert len(set(counts.tolist())) > 3  # unequal clients: uniform p would differ
    module = tiny_module()
    strategy = FederatedStrategy(sampler=FullParticipation(), local_steps=3, seed=2)
    make_trainer(strategy, 2, [FedAvg("samples", server_lr=0.5), unlearning, Keep()]).fit(
        module, datamodule=dm
    )
    p = counts / counts.sum()
    expected = torch.zeros(6, dtype=torch.float64)
    for round_deltas in deltas:
        d = {c: v.double() for c, v in round_deltas.items()}
        everyone = 0.5 * sum(p[c] * d[c] for c in d)
        expected *= decay
        for c in d:
            without = 0.5 * sum(p[j] / (1 - p[c]) * d[j] for j in d if j != c)
            expected[c] += (everyone - without).norm()
    psi = torch.as_tensor(unlearning.history.psi[0][2])
    assert torch.allclose(psi, expected, rtol=1e-5, atol=1e-9), (psi, expected)
    uniform = torch.zeros(6, dtype=torch.float64)  # the old p = 1/|I| is far off
    for round_deltas in deltas:
        d = {c: v.double() for c, v in round_deltas.items()}
        mean = sum(p[c] * d[c] for c in d)
        uniform *= decay
        for c in d:
            uniform[c] += 0.5 * (1 / 5) * (d[c] - mean).norm()
    assert not torch.allclose(psi, uniform, rtol=0.05)


def test_resume_refuses_another_federation_unless_told(tmp_path):
    checkpoint = ModelCheckpoint(tmp_path, "saved", every_n_epochs=1)
    from lightning_fl.callbacks import Local

    first = make_trainer(
        FederatedStrategy(local_steps=1), 1, [checkpoint, Local()], enable_checkpointing=True
    )
    first.fit(tiny_module(), datamodule=tiny_datamodule(num_clients=12))
    path = str(tmp_path / "saved.ckpt")
    trainer = make_trainer(FederatedStrategy(local_steps=1), 2, [Local()])
    with pytest.raises(FederationMismatchError, match="num_clients: saved 12, now 6"):
        trainer.fit(tiny_module(), datamodule=tiny_datamodule(num_clients=6), ckpt_path=path)
    from lightning_fl.datamodules import InMemoryFederatedDataModule
    from tests.helpers import tiny_clients

    clients = tiny_clients(12)
    x, y = clients[3]["train"]
    x4, y4 = clients[4]["train"]
    clients[3]["train"] = (x[:-1], y[:-1])  # one sample moved from client 3 to client 4:
    clients[4]["train"] = (torch.cat([x4, x[-1:]]), torch.cat([y4, y[-1:]]))  # same total
    trainer = make_trainer(FederatedStrategy(local_steps=1), 2, [Local()])
    with pytest.raises(FederationMismatchError, match=r"train_counts \(clients \[3, 4\]\)"):
        trainer.fit(tiny_module(), datamodule=InMemoryFederatedDataModule(clients, batch_size=4),
                    ckpt_path=path)  # fmt: skip
    strategy = FederatedStrategy(local_steps=1, allow_new_federation=True)
    with pytest.warns(UserWarning, match="another federation"):
        make_trainer(strategy, 2, [Local()]).fit(
            tiny_module(), datamodule=tiny_datamodule(num_clients=6), ckpt_path=path
        )
    assert strategy.client_store.clients() and max(strategy.client_store.clients()) < 6


def test_resume_refuses_a_datamodule_with_another_partition_seed(tmp_path):
    from lightning_fl.datamodules import DigitsDataModule

    checkpoint = ModelCheckpoint(tmp_path, "saved", every_n_epochs=1)
    module = tiny_module()

    def digits(seed):
        return DigitsDataModule(num_clients=5, partition="iid", seed=seed, batch_size=64)

    from lightning_fl import MLP, Classifier

    def model():
        torch.manual_seed(0)
        return Classifier(network=MLP(64, (8,), 10), lr=0.1)

    make_trainer(FederatedStrategy(local_steps=1), 1, [checkpoint], enable_checkpointing=True
                 ).fit(model(), datamodule=digits(0))  # fmt: skip
    trainer = make_trainer(FederatedStrategy(local_steps=1), 2)
    with pytest.raises(FederationMismatchError, match="partition_seed: saved 0, now 1"):
        trainer.fit(model(), datamodule=digits(1), ckpt_path=str(tmp_path / "saved.ckpt"))
    del module


def test_unlearning_resumed_with_another_sigma_is_refused_and_scratch_restarts_at_zero(
    tmp_path,
):
    checkpoint = ModelCheckpoint(tmp_path, "saved", every_n_epochs=1)
    scratch = Unlearning("scratch", sigma=0.05, requests={2: [0]})
    _fit(UniformSampler(4), 3, [FedAvg(), scratch, checkpoint], enable_checkpointing=True)
    assert scratch.done_requests[0]["restart_round"] == 0
    assert scratch.done_requests[0]["branch"] == 0
    fine = Unlearning("fine_tuning", requests={2: [0]})
    _fit(UniformSampler(4), 3, [FedAvg(), fine])
    assert fine.done_requests[0]["restart_round"] == 2  # the current model, two rounds in
    module = tiny_module()
    other = Unlearning("scratch", sigma=0.1, requests={2: [0]})
    trainer = make_trainer(FederatedStrategy(sampler=UniformSampler(4), local_steps=2, seed=1),
                           5, [FedAvg(), other])  # fmt: skip
    with pytest.raises(ValueError, match=r"sigma 0.05 -> 0.1"):
        trainer.fit(module, datamodule=tiny_datamodule(num_clients=8),
                    ckpt_path=str(tmp_path / "saved.ckpt"))  # fmt: skip


def test_personalization_refuses_a_plain_module_before_any_training():
    import lightning.pytorch as pl

    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(6, 3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    steps = []

    class Count(pl.Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    trainer = make_trainer(FederatedStrategy(local_steps=1), 1, [Ditto(), Count()])
    with pytest.raises(CompositionError, match="Ditto cannot be combined with Plain"):
        trainer.fit(Plain(), datamodule=tiny_datamodule())
    assert not steps


def test_markov_availability_follows_the_seed_even_with_state():
    """The seed rules: the same chain object asked for two seeds gives each seed's own
    sets, equal to those of a fresh object."""
    chain = MarkovAvailability([0.5] * 40, [0.3] * 40)
    for t in range(5):
        chain.available(t, 0, 40)
    other = chain.available(4, 1, 40)
    fresh = MarkovAvailability([0.5] * 40, [0.3] * 40)
    assert torch.equal(other, torch.stack([fresh.available(t, 1, 40) for t in range(5)])[-1])
    again = MarkovAvailability([0.5] * 40, [0.3] * 40)
    assert not torch.equal(other, again.available(4, 0, 40))  # the seeds differ
    assert torch.equal(chain.available(2, 0, 40), again.available(2, 0, 40))


def test_a_damaged_checkpoint_fails_the_same_way_from_the_cli(tmp_path):
    from pathlib import Path

    from lightning_fl.cli import run

    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml")
    common = ["--config", recipe, "--trainer.max_epochs", "1", "--trainer.default_root_dir",
              str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path),
              "--trainer.enable_progress_bar", "false", "--test_after_fit", "false"]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(["fit", *common], exit_on_error=False)
    (last,) = Path(tmp_path).rglob("last.ckpt")
    half = tmp_path / "half.ckpt"
    half.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint\n" * 50)
    from lightning_fl.engine.federated_state import CheckpointReadError

    for bad in (half, text):
        with pytest.raises(CheckpointReadError) as info:
            run(["fit", *common, "--ckpt_path", str(bad)], exit_on_error=False)
        message = str(info.value)
        assert str(bad) in message and "resume from another one" in message
        assert "weights_only` set to `False`" not in message and "False" not in message


def test_every_plugin_on_two_processes_equals_one_process_or_is_refused(tmp_path):
    """Each plugin on 2 processes (torchrun, gloo) gives the 1-process model and logged
    metrics to float round-off, its resume included, or is refused at setup naming "2
    processes"; so does
    each plugin whose client state moves, with clients trained away from their owner
    (composition.DISTRIBUTED_RUNS)."""
    from tests.helpers import torchrun

    out = tmp_path / "outcomes.pt"
    torchrun("tests.composition_distributed", str(out), timeout=900,
             env={"COMPOSITION_ROOT": str(tmp_path)})  # fmt: skip
    outcomes = torch.load(out, weights_only=True)
    assert set(outcomes) == set(composition.DISTRIBUTED_RUNS)
    refused = []
    for name, outcome in outcomes.items():
        assert outcome["status"] in ("ok", "refused"), (name, outcome["message"])
        if outcome["status"] == "refused":
            assert composition.names_plugin(outcome["message"], name), outcome["message"]
            assert "2 processes" in outcome["message"], outcome["message"]
            refused.append(name)
            continue
        one_process = _alone(name) if "+" not in name else _matrix()[tuple(name.split("+"))]
        diff = max_abs_diff(outcome["params"], one_process.params)
        assert diff <= 1e-5, (name, diff)
        # the last round's and the test's metrics too: means over every rank's clients
        assert set(outcome["metrics"]) == set(one_process.metrics), name
        for key, value in one_process.metrics.items():
            two = outcome["metrics"][key]
            assert two == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (name, key)
    assert sorted(refused) == ["ClusteredFL", "FreeRiderDetector"]
    splits = next(r for r in TRAIT_RULES if r.second == Trait.SPLITS_CLIENTS_OVER_PROCESSES)
    for name in refused:
        assert splits.reason in outcomes[name]["message"]


# ---- torchmetrics per client -----------------------------------------------------------


def test_a_torchmetrics_metric_is_computed_per_client_and_pooled_over_seen_clients(tmp_path):
    """A module logs a torchmetrics MulticlassAccuracy (macro: not a mean of batch means):
    each client's value is the metric of its own test data, the epoch value is the metric
    pooled over the seen clients' samples (unseen clients taken out), and p10 and
    client_metrics.csv carry it."""
    import csv
    import glob

    from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

    from lightning_fl import MLP, Classifier
    from tests.helpers import HIDDEN, IN, OUT

    class WithTorchmetrics(Classifier):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.macro = MulticlassAccuracy(num_classes=OUT, average="macro")
            self.auroc = MulticlassAUROC(num_classes=OUT)  # list states: every prediction

        def test_step(self, batch, batch_idx):
            super().test_step(batch, batch_idx)
            x, y = batch
            self.macro.update(self(x), y)
            self.auroc.update(self(x).softmax(-1), y)
            self.log("test_macro_acc", self.macro, on_epoch=True)
            self.log("test_auroc", self.auroc, on_epoch=True)

    torch.manual_seed(1)
    module = WithTorchmetrics(network=MLP(IN, (HIDDEN,), OUT), lr=0.1)
    dm = tiny_datamodule(num_clients=6)
    dm.hold_out(1 / 3)
    trainer = make_trainer(FederatedStrategy(local_steps=2, seed=0), 2,
                           default_root_dir=str(tmp_path))  # fmt: skip
    trainer.fit(module, datamodule=dm)
    trainer.test(module, datamodule=dm, verbose=False)
    per_client = trainer.strategy.evaluation.capture.per_client["test_macro_acc"]
    auroc = trainer.strategy.evaluation.capture.per_client["test_auroc"]
    module.eval()
    expected, seen_x, seen_y = {}, [], []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # AUROC of a client that lacks a class
        for c in range(6):
            x, y = dm.client_dataset(c, "test").tensors
            reference = MulticlassAccuracy(num_classes=OUT, average="macro")
            expected[c] = float(reference(module(x), y))
            reference_auroc = MulticlassAUROC(num_classes=OUT)
            assert auroc[c][0] == pytest.approx(
                float(reference_auroc(module(x).softmax(-1), y)), abs=1e-6
            ), c
            if c not in dm.unseen_clients:
                seen_x.append(x)
                seen_y.append(y)
        pooled = MulticlassAccuracy(num_classes=OUT, average="macro")
        pooled = float(pooled(module(torch.cat(seen_x)), torch.cat(seen_y)))
    assert set(per_client) == set(range(6))
    for c in range(6):
        assert per_client[c][0] == pytest.approx(expected[c], abs=1e-6), c
        assert per_client[c][1] == len(dm.client_dataset(c, "test"))
    metrics = trainer.callback_metrics
    assert float(metrics["test_macro_acc"]) == pytest.approx(pooled, abs=1e-6)
    seen = torch.tensor([expected[c] for c in range(6) if c not in dm.unseen_clients])
    assert float(metrics["test_macro_acc/p10"]) == pytest.approx(
        float(torch.quantile(seen.double(), 0.1)), abs=1e-6
    )
    assert "test_macro_acc/unseen/weighted" in metrics
    (path,) = glob.glob(str(tmp_path / "**" / "client_metrics.csv"), recursive=True)
    rows = [r for r in csv.DictReader(open(path)) if r["metric"] == "test_macro_acc"]
    assert {int(r["client"]) for r in rows} == set(range(6))


@pytest.mark.parametrize("other", ["FedProx", "SCAFFOLD"])
@pytest.mark.parametrize("order", ["dp_first", "dp_last"])
def test_dp_sgd_keeps_the_terms_fedprox_and_scaffold_add_to_the_gradient(other, order):
    """With no noise and a clip no gradient reaches, DP-SGD's gradient is the plain one,
    so FedProx or SCAFFOLD with DP-SGD must equal them alone, whatever the order in which
    the callbacks are given (before, DP-SGD listed after them overwrote their terms)."""
    from lightning_fl.callbacks import DPSGD, SCAFFOLD, FedProx

    def make():
        return FedProx(mu=0.5) if other == "FedProx" else SCAFFOLD()

    def fit(callbacks):
        module = tiny_module()
        strategy = FederatedStrategy(sampler=UniformSampler(3), local_steps=3, seed=4)
        make_trainer(strategy, 3, callbacks).fit(module, datamodule=tiny_datamodule(6))
        return params_of(module)

    dp = DPSGD(noise_multiplier=0.0, max_grad_norm=1e6)
    alone = fit([make()])
    both = fit([dp, make()] if order == "dp_first" else [make(), dp])
    without = fit([DPSGD(noise_multiplier=0.0, max_grad_norm=1e6)])
    assert max_abs_diff(alone, both) <= 1e-5
    assert max_abs_diff(alone, without) > 1e-3  # the term matters here


@pytest.mark.parametrize("order", ["scale_first", "scale_last"])
def test_an_update_transform_acts_on_the_aggregators_delta_whatever_the_order(order):
    """A callback that scales every update by c, beside AsynchronousFL (whose own transform
    adds the stale client's drift θ^n − θ^ρ, making the update Δ_i(ρ)), must scale the
    whole Δ_i(ρ): the run equals AsynchronousFL alone with η_g·c, in either order. Before,
    listed first, it scaled the update before the drift was added (ServerReference with
    AsynchronousFL differed by 0.008 between the two orders)."""
    from lightning_fl import ClientTimes, FedBuffSchedule
    from lightning_fl.callbacks import AsynchronousFL
    from lightning_fl.engine.plugins import FederatedCallback

    class Scale(FederatedCallback):
        def transform_update(self, trainer, pl_module, client, update, state):
            return torch._foreach_mul(update, 0.7)

    def asynchronous(server_lr):
        return AsynchronousFL(FedBuffSchedule(2, ClientTimes(50.0)), server_lr=server_lr)

    def fit(callbacks):
        module = tiny_module()
        strategy = FederatedStrategy(local_steps=2, seed=4)
        trainer = make_trainer(strategy, 4, callbacks)
        trainer.fit(module, datamodule=tiny_datamodule(5))
        return params_of(module), float(trainer.callback_metrics["fl/staleness"])

    scaled = asynchronous(1.0)
    both, staleness = fit([Scale(), scaled] if order == "scale_first" else [scaled, Scale()])
    assert staleness > 0  # the last aggregation's updates came from stale models
    assert max_abs_diff(both, fit([asynchronous(0.7)])[0]) <= 1e-6
