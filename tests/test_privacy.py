"""Reference-data privacy: membership-inference attacks, WERM (client- and server-held
reference data), DP-SGD, and the Purchase100/Texas100 file formats."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_fl import MLP, Classifier, FederatedStrategy, WERMClassifier
from lightning_fl.callbacks import DPSGD, MembershipInference, ServerReference
from lightning_fl.datamodules import (
    ReferenceDataModule,
    load_purchase100,
    load_texas100,
)
from lightning_fl.datamodules.privacy import generate_purchase_like
from lightning_fl.systems.membership import attack_signals, best_threshold, membership_inference
from tests.helpers import make_trainer, max_abs_diff, params_of


def _data(n=600, d=10, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    rule = torch.randn(d, classes, generator=g)
    x = torch.randn(n, d, generator=g)
    y = (x @ rule + 0.8 * torch.randn(n, classes, generator=g)).argmax(1)
    return x.numpy(), y.numpy()


def _dm(reference="client", num_clients=1, split=(0.4, 0.3, 0.0, 0.3), **kw):
    x, y = _data(**kw)
    return ReferenceDataModule(
        x, y, num_clients=num_clients, split=split, reference=reference, batch_size=16
    )


# ------------------------------------------------------------------ attacks
def test_modified_entropy_and_signals_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    label = torch.tensor([0])
    s = attack_signals(probs, label)
    mentr = -(0.3) * math.log(0.7) - 0.2 * math.log(0.8) - 0.1 * math.log(0.9)
    entropy = -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1))
    assert float(s["modified_entropy"]) == pytest.approx(-mentr)
    assert float(s["entropy"]) == pytest.approx(-entropy)
    assert float(s["confidence"]) == pytest.approx(0.7)
    assert float(s["loss"]) == pytest.approx(math.log(0.7))
    assert float(s["correctness"]) == 1.0


def test_best_threshold_separates_separable_scores():
    members = torch.tensor([0.9, 0.8, 0.7], dtype=torch.float64)
    others = torch.tensor([0.1, 0.2, 0.75], dtype=torch.float64)
    t = best_threshold(members, others)
    # "member iff score >= 0.8" and ">= 0.7" both reach the best balanced accuracy, 5/6
    assert t in (0.8, 0.7)
    assert best_threshold(members, others - 1.0) == 0.7  # separable: every member above


def test_attack_on_a_model_that_never_saw_the_data_is_chance():
    torch.manual_seed(0)
    net = MLP(10, (32,), 4)
    x, y = _data(n=4000, seed=3)
    with torch.no_grad():
        probs = torch.softmax(net(torch.from_numpy(x)), 1)
    labels = torch.from_numpy(y)
    result = membership_inference(probs[:2000], labels[:2000], probs[2000:], labels[2000:])
    for attack, accuracy in result.accuracy.items():
        assert abs(accuracy - 0.5) < 0.05, (attack, accuracy)


def test_attack_on_an_overfit_model_is_far_above_chance():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(400, 10, generator=g)
    y = torch.randint(0, 4, (400,), generator=g)  # random labels: only memorization helps
    net = MLP(10, (256,), 4)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(400):
        optimizer.zero_grad()
        F.cross_entropy(net(x[:200]), y[:200]).backward()
        optimizer.step()
    with torch.no_grad():
        probs = torch.softmax(net(x), 1)
    result = membership_inference(probs[:200], y[:200], probs[200:], y[200:])
    assert result.accuracy["confidence"] > 0.8
    assert result.accuracy["loss"] > 0.8
    assert result.best > 0.8


# ------------------------------------------------------------------ WERM
def _fit(module, dm, callbacks=(), rounds=2, **kw):
    trainer = make_trainer(FederatedStrategy(local_epochs=1, seed=3), rounds, list(callbacks), **kw)
    trainer.fit(module, datamodule=dm)
    return trainer


def test_werm_with_w_zero_equals_erm_on_the_training_data():
    torch.manual_seed(0)
    werm = WERMClassifier(MLP(10, (16,), 4), w=0.0, lr=0.1)
    _fit(werm, _dm("client", num_clients=3))
    torch.manual_seed(0)
    erm = Classifier(MLP(10, (16,), 4), lr=0.1)
    _fit(erm, _dm("none", num_clients=3))
    assert max_abs_diff(params_of(werm), params_of(erm)) == 0.0


def test_werm_with_w_one_trains_only_on_reference_data():
    torch.manual_seed(0)
    module = WERMClassifier(MLP(10, (16,), 4), w=1.0)
    g = torch.Generator().manual_seed(0)
    train = (torch.randn(5, 10, generator=g), torch.randint(0, 4, (5,), generator=g))
    ref = (torch.randn(7, 10, generator=g), torch.randint(0, 4, (7,), generator=g))
    loss, _ = module.loss_and_metrics({"train": train, "reference": ref})
    grads = torch.autograd.grad(loss, list(module.parameters()))
    expected = torch.autograd.grad(
        F.cross_entropy(module(ref[0]), ref[1]), list(module.parameters())
    )
    for a, b in zip(grads, expected):
        assert torch.equal(a, b)
    # and w in between is the weighted sum of the two gradients
    module.hparams.w = 0.3
    loss, _ = module.loss_and_metrics({"train": train, "reference": ref})
    mixed = torch.autograd.grad(loss, list(module.parameters()))
    on_train = torch.autograd.grad(
        F.cross_entropy(module(train[0]), train[1]), list(module.parameters())
    )
    for m, t, r in zip(mixed, on_train, expected):
        assert torch.allclose(m, 0.7 * t + 0.3 * r, atol=1e-7)


def test_werm_weight_out_of_range_is_refused():
    with pytest.raises(ValueError, match="w must be in"):
        WERMClassifier(w=1.5)


def test_server_reference_with_w_zero_is_fedavg_and_with_w_one_only_server_data():
    torch.manual_seed(0)
    plain = Classifier(MLP(10, (16,), 4), lr=0.1)
    _fit(plain, _dm("server", num_clients=3))
    torch.manual_seed(0)
    zero = Classifier(MLP(10, (16,), 4), lr=0.1)
    _fit(zero, _dm("server", num_clients=3), [ServerReference(w=0.0)])
    assert max_abs_diff(params_of(plain), params_of(zero)) == 0.0

    torch.manual_seed(0)
    one = Classifier(MLP(10, (16,), 4), lr=0.1)
    dm = _dm("server", num_clients=3)
    _fit(one, dm, [ServerReference(w=1.0)], rounds=1)
    # one pass of plain SGD over the server's reference data from the initial model
    net = _server_steps_by_hand(dm)
    assert max_abs_diff(params_of(one), params_of(net)) < 1e-6


def test_server_reference_steps_at_the_rounds_learning_rate_not_the_hyper_parameter():
    """An lr schedule (here: the optimizer's rate set to 0.1 while ``hparams.lr`` says
    0.5) applies to the server's steps as to the clients': the server's one pass is the
    hand-written one at 0.1."""
    import lightning.pytorch as pl

    class RateAtFitStart(pl.Callback):  # before the first round
        def on_fit_start(self, trainer, pl_module):
            trainer.optimizers[0].param_groups[0]["lr"] = 0.1

    torch.manual_seed(0)
    one = Classifier(MLP(10, (16,), 4), lr=0.5)
    dm = _dm("server", num_clients=3)
    _fit(one, dm, [RateAtFitStart(), ServerReference(w=1.0)], rounds=1)
    net = _server_steps_by_hand(dm)
    assert max_abs_diff(params_of(one), params_of(net)) < 1e-6


def _dropout_network() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4)
    )


def _server_steps_by_hand(dm, steps: int | None = None, dropout: bool = False) -> torch.nn.Module:
    """Round 0's server steps from the initial model (seed 0), lr 0.1, batches of 16 of its
    reference data shuffled by (3, "server_reference", 0): one pass, or ``steps`` batches
    cycled over passes. With ``dropout``, :func:`_dropout_network`, whose masks the server
    draws from its own seed (3, "server_reference", 0), as a client does from its own."""
    from lightning_fl.engine.schedule import cycle_batches
    from lightning_fl.engine.seeding import derive_seed, generator

    torch.manual_seed(0)
    net = _dropout_network() if dropout else MLP(10, (16,), 4)
    if dropout:
        torch.manual_seed(derive_seed(3, "server_reference", 0))
    loader = torch.utils.data.DataLoader(
        dm.server_reference(), batch_size=16, shuffle=True,
        generator=generator(3, "server_reference", 0),
    )  # fmt: skip
    for x, y in loader if steps is None else cycle_batches(loader, steps):
        grads = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
        with torch.no_grad():
            for p, gr in zip(net.parameters(), grads):
                p -= 0.1 * gr
    return net


# ------------------------------------------------------------------ evaluation callback
def test_membership_inference_reports_the_triad(tmp_path):
    torch.manual_seed(0)
    module = WERMClassifier(MLP(10, (64,), 4), w=0.5, lr=0.2)
    dm = _dm("client", num_clients=2)
    trainer = _fit(module, dm, [MembershipInference()], rounds=3, default_root_dir=str(tmp_path))
    results = trainer.test(module, datamodule=dm, verbose=False)[0]
    for key in ("test_acc", "mia/train/best", "mia/reference/best", "mia/train/modified_entropy"):
        assert key in results
    assert 0.0 <= results["mia/train/best"] <= 1.0
    assert (tmp_path / "membership_inference.csv").exists()


@pytest.mark.parametrize("w", [0.0, 1.0])
def test_mia_train_and_reference_attack_their_own_data(w):
    """Random labels, so only memorization helps the attacks. WERM with w = 0 trains on
    the training data alone, w = 1 on the reference data alone: the attack on the data the
    model saw succeeds, the attack on the data it never saw is near chance."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(600, 10)).astype("float32"), rng.integers(0, 4, 600)
    torch.manual_seed(0)
    dm = ReferenceDataModule(
        x, y, num_clients=1, split=(0.4, 0.3, 0.0, 0.3), reference="client", batch_size=32
    )
    module = WERMClassifier(MLP(10, (128,), 4), w=w, lr=0.01, optimizer="adam")
    strategy = FederatedStrategy(local_epochs=1, seed=3, keep_optimizer_state=True)
    trainer = make_trainer(strategy, 25, [MembershipInference(stages=("test",))])
    trainer.fit(module, datamodule=dm)
    results = trainer.test(module, datamodule=dm, verbose=False)[0]
    seen, unseen = ("train", "reference") if w == 0.0 else ("reference", "train")
    assert results[f"mia/{seen}/loss"] > 0.75
    assert abs(results[f"mia/{unseen}/loss"] - 0.5) < 0.1


def test_song_mittal_thresholds_are_per_class():
    """Members are more confident than non-members within each class, but class 1's
    members are less confident than class 0's non-members: only class-dependent
    thresholds separate them perfectly."""
    n = 80
    labels = torch.tensor([0, 1] * (n // 2))
    member_conf = torch.where(labels == 0, 0.9, 0.5)
    nonmember_conf = torch.where(labels == 0, 0.8, 0.4)

    def probs(conf):  # two classes: the true one gets conf
        onehot = F.one_hot(labels, 2).float()
        return onehot * conf[:, None] + (1 - onehot) * (1 - conf[:, None])

    m, nm = probs(member_conf), probs(nonmember_conf)
    per_class = membership_inference(m, labels, nm, labels, attacks=("confidence",))
    single = membership_inference(m, labels, nm, labels, attacks=("confidence",), per_class=False)
    assert per_class.accuracy["confidence"] == 1.0
    assert single.accuracy["confidence"] <= 0.8


def test_membership_inference_attacks_the_server_reference_data(tmp_path):
    torch.manual_seed(0)
    module = Classifier(MLP(10, (32,), 4), lr=0.1)
    dm = _dm("server", num_clients=2)
    trainer = _fit(module, dm, [ServerReference(w=0.5), MembershipInference(stages=("test",))],
                   default_root_dir=str(tmp_path))  # fmt: skip
    results = trainer.test(module, datamodule=dm, verbose=False)[0]
    rows = list(csv.DictReader(open(tmp_path / "membership_inference.csv")))
    # each client attacks its training data; the server, client id -1, its reference data
    assert [(r["data"], r["client"]) for r in rows] == [("reference", "-1"), ("train", "0"),
                                                        ("train", "1")]  # fmt: skip
    assert results["mia/reference/best"] == pytest.approx(float(rows[0]["best"]), abs=1e-6)
    mean = (float(rows[1]["best"]) + float(rows[2]["best"])) / 2
    assert results["mia/train/best"] == pytest.approx(mean, abs=1e-6)


# ------------------------------------------------------------------ DP-SGD
def test_dp_sgd_gradient_is_clipped_per_sample_and_noised():
    torch.manual_seed(0)
    module = Classifier(MLP(10, (8,), 4))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 10, generator=g), torch.randint(0, 4, (6,), generator=g)
    dp = DPSGD(noise_multiplier=0.0, max_grad_norm=0.5)
    private = dp.private_gradient(module, x, y, sigma=0.0)
    params = dict(module.named_parameters())
    expected = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(6):
        grads = torch.autograd.grad(
            F.cross_entropy(module(x[i : i + 1]), y[i : i + 1]), list(params.values())
        )
        norm = torch.sqrt(sum(gr.pow(2).sum() for gr in grads))
        factor = min(1.0, 0.5 / (float(norm) + 1e-6))
        for (n, _), gr in zip(params.items(), grads):
            expected[n] += factor * gr / 6
    for n in params:
        assert torch.allclose(private[n], expected[n], atol=1e-6)
    torch.manual_seed(5)
    noisy = dp.private_gradient(module, x, y, sigma=2.0)
    torch.manual_seed(5)
    noise = {n: torch.normal(0.0, 2.0 * 0.5, size=p.shape) for n, p in params.items()}
    for n in params:
        assert torch.allclose(noisy[n], expected[n] + noise[n] / 6, atol=1e-6)


@pytest.mark.parametrize("rows", [False, True])
def test_clipping_scales_each_gradient_by_hand_down_to_norms_below_its_guard(rows):
    """clip_C(g) = g · min(1, C / (‖g‖ + 10⁻⁶)) over all parameters: gradients of norm
    5 (scaled to C = 0.5), 0.5 (scaled by 0.5 / (0.5 + 10⁻⁶)) and 10⁻⁷ (below the guard:
    kept as it is), summed; with ``rows``, the same per client row."""
    dp = DPSGD(noise_multiplier=0.0, max_grad_norm=0.5)
    g = torch.tensor([[3.0, 4.0], [0.3, 0.4], [6e-8, 8e-8]], dtype=torch.float64)
    factors = [0.5 / (5 + 1e-6), 0.5 / (0.5 + 1e-6), 1.0]
    expected = sum(f * row for f, row in zip(factors, g))
    columns = [g[:, :1], g[:, 1:]]  # two parameters: the norm is over both
    if rows:  # two client rows: the samples, and the samples reversed
        columns = [torch.stack([c, c.flip(0)]) for c in columns]
    clipped = torch.cat(dp.clipped_sum(columns, rows=rows), dim=-1)
    assert torch.allclose(clipped, expected.expand_as(clipped), rtol=0, atol=1e-12)


def test_a_reused_dpsgd_accounts_with_each_fits_own_client_sizes():
    """One DPSGD over two fits: the second's clients hold 18, 11 and 1 training samples
    (the first's 4, 11 and 18), so its rates are B/n of the second fit's sizes, with B
    the largest batch seen: 4/18, 4/11, and 1/1 for the one-sample client; ε as the
    accountant's for 2 rounds of 2 steps."""
    from opacus.accountants import RDPAccountant

    from lightning_fl import FullParticipation
    from lightning_fl.datamodules import InMemoryFederatedDataModule
    from tests.helpers import tiny_clients, tiny_datamodule, tiny_module

    dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0)
    clients = tiny_clients(3)[::-1]
    clients[2]["train"] = tuple(t[:1] for t in clients[2]["train"])
    for dm in (tiny_datamodule(num_clients=3), InMemoryFederatedDataModule(clients, 4)):
        strategy = FederatedStrategy(sampler=FullParticipation(), local_steps=2, seed=3)
        trainer = make_trainer(strategy, 2, [dp])
        trainer.fit(tiny_module(), datamodule=dm)
    store = trainer.strategy.client_store
    for client, rate in enumerate((4 / 18, 4 / 11, 1.0)):
        assert store.get(client, "dp_train_steps") == 4
        accountant = RDPAccountant()
        accountant.history = [(1.1, rate, 4)]
        assert dp.epsilon(store, client, "train") == pytest.approx(accountant.get_epsilon(1e-5))


def test_dp_sgd_without_noise_or_clipping_is_werms_sgd_between_the_ends():
    """At σ = 0 and a bound no gradient reaches, DP-SGD's step on WERM's batches is the
    (1 − w, w) mix of the two sources' mean gradients: at w = 0.3, 2 rounds of 3 steps on
    3 clients equal WERM trained without DP-SGD."""
    models = []
    for callbacks in ([], [DPSGD(noise_multiplier=0.0, max_grad_norm=1e9)]):
        torch.manual_seed(0)
        module = WERMClassifier(MLP(10, (16,), 4), w=0.3, lr=0.1)
        trainer = make_trainer(FederatedStrategy(local_steps=3, seed=3), 2, callbacks)
        trainer.fit(module, datamodule=_dm("client", num_clients=3))
        models.append(params_of(module))
    assert max_abs_diff(*models) < 1e-6


def test_dp_sgd_training_reports_epsilon_for_both_datasets():
    from opacus.accountants import RDPAccountant

    torch.manual_seed(0)
    module = WERMClassifier(MLP(10, (16,), 4), w=0.5, lr=0.1)
    dm = _dm("client", num_clients=1)
    dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0, reference_noise_multiplier=2.0)
    trainer = _fit(module, dm, [dp], rounds=2)
    store = trainer.strategy.client_store
    steps = store.get(0, "dp_train_steps")
    assert steps == 2 * math.ceil(240 / 16)
    accountant = RDPAccountant()
    accountant.history = [(1.1, 16 / 240, steps)]
    assert dp.epsilon(store, 0, "train") == pytest.approx(accountant.get_epsilon(1e-5))
    assert dp.epsilon(store, 0, "reference") < dp.epsilon(store, 0, "train")  # more noise
    assert float(trainer.callback_metrics["dp/epsilon"]) == pytest.approx(dp.epsilon(store, 0))


def test_dp_sgd_accounts_with_the_nominal_batch_size_when_batches_do_not_divide_n():
    """240 training samples in batches of 64: the last batch has 48. The accountant must
    see the rate 64/240 of the full batches, not 48/240 (which under-reports ε)."""
    from opacus.accountants import RDPAccountant

    torch.manual_seed(0)
    x, y = _data()
    dm = ReferenceDataModule(
        x, y, num_clients=1, split=(0.4, 0.3, 0.0, 0.3), reference="client", batch_size=64
    )
    module = WERMClassifier(MLP(10, (16,), 4), w=0.5, lr=0.1)
    dp = DPSGD(noise_multiplier=1.1, max_grad_norm=1.0)
    trainer = _fit(module, dm, [dp], rounds=2)
    store = trainer.strategy.client_store
    steps = store.get(0, "dp_train_steps")
    assert steps == 2 * math.ceil(240 / 64)
    for source, n in (("train", 240), ("reference", 180)):
        accountant = RDPAccountant()
        accountant.history = [(1.1, 64 / n, store.get(0, f"dp_{source}_steps"))]
        assert dp.epsilon(store, 0, source) == pytest.approx(accountant.get_epsilon(1e-5))


# ------------------------------------------------------------------ data files
def _purchase_rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(rng.integers(1, 101))] + rng.integers(0, 2, 600).tolist() for _ in range(n)]


def test_purchase100_reads_the_published_format(tmp_path):
    rows = _purchase_rows(5)
    path = tmp_path / "dataset_purchase"
    path.write_text("\n".join(",".join(map(str, r)) for r in rows) + "\n")
    x, y = load_purchase100(path)
    assert x.shape == (5, 600) and x.dtype == np.float32
    assert y.tolist() == [r[0] - 1 for r in rows]
    path.write_text("3,0,1\n")
    with pytest.raises(ValueError, match="line 1: expected 601"):
        load_purchase100(path)


def test_texas100_reads_the_published_format(tmp_path):
    folder = tmp_path / "texas" / "100"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    feats = rng.integers(0, 2, (4, 6169))
    (folder / "feats").write_text("\n".join(",".join(map(str, r)) for r in feats) + "\n")
    (folder / "labels").write_text("1\n100\n7\n42\n")
    x, y = load_texas100(tmp_path)
    assert x.shape == (4, 6169) and y.tolist() == [0, 99, 6, 41]
    (folder / "labels").write_text("1\n2\n")
    with pytest.raises(ValueError, match="2 labels for 4 rows"):
        load_texas100(tmp_path)
    with pytest.raises(FileNotFoundError, match="extract dataset_texas.tgz"):
        load_texas100(tmp_path / "missing")


def test_membership_inference_attacks_global_and_personalized_models():
    from lightning_fl.callbacks import FineTune

    torch.manual_seed(0)
    module = Classifier(MLP(10, (32,), 4), lr=0.1)
    dm = _dm("none", num_clients=2)
    trainer = _fit(module, dm, [FineTune(lr=0.5, epochs=3), MembershipInference(stages=("test",))])
    results = trainer.test(module, datamodule=dm, verbose=False)[0]
    assert "mia/train/best" in results and "mia_personal/train/best" in results
    # fine-tuning on the training data makes the personalized model leak more
    assert results["mia_personal/train/loss"] > results["mia/train/loss"]


def test_werm_classifier_trains_in_a_plain_lightning_trainer():
    import lightning.pytorch as pl
    from torch.utils.data import TensorDataset

    from lightning_fl.datamodules import WERMDataset, paired_loader

    x, y = _data(n=120)
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    train, reference = torch.utils.data.random_split(
        data, [80, 40], torch.Generator().manual_seed(0)
    )
    loader = paired_loader(
        WERMDataset(train, reference), batch_size=16, generator=torch.Generator().manual_seed(0)
    )
    module = WERMClassifier(MLP(10, (16,), 4), w=0.3)
    trainer = pl.Trainer(
        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    assert trainer.global_step == 2 * 5
    assert "train_reference_acc" in trainer.callback_metrics


def test_a_plain_classifier_with_paired_batches_gets_a_clear_error():
    with pytest.raises(TypeError, match="WERMClassifier"):
        _fit(Classifier(MLP(10, (16,), 4)), _dm("client"))


def _brute_threshold(members: list[float], others: list[float]) -> float:
    """The highest threshold t (∞ first) maximizing ½·P(member ≥ t) + ½·P(other < t),
    by trying every score."""
    best_t, best = float("inf"), 0.5
    for t in sorted(set(members) | set(others), reverse=True):
        accuracy = 0.5 * sum(m >= t for m in members) / len(members)
        accuracy += 0.5 * sum(o < t for o in others) / len(others)
        if accuracy > best:
            best_t, best = t, accuracy
    return best_t


def test_best_threshold_breaks_ties_toward_the_higher_threshold():
    """Ties between cuts go to the higher threshold (fewer predicted members); equal
    scores cannot be cut apart; with no better cut than predicting nobody, ∞."""
    cases = [([0.9, 0.8, 0.7], [0.1, 0.2, 0.75]), ([0.6, 0.6, 0.3], [0.5]),
             ([0.1], [0.9]), ([0.4, 0.2, 0.2, 0.9], [0.2, 0.3, 0.1]),
             # a cut inside the tie at 0.5 (the member first) would score 1.0 and
             # return 0.5 (0.667 in truth); the best real cut is 0.9 (0.75)
             ([0.9, 0.5], [0.5, 0.5, 0.0]),
             # one member, two non-members: the rates are per set (1/1 and 1/2), so the
             # cut at 0.5 (0.75) beats predicting nobody (0.5)
             ([0.5], [0.9, 0.1])]  # fmt: skip
    expected = [0.8, 0.6, float("inf"), 0.4, 0.9, 0.5]
    for (members, others), value in zip(cases, expected):
        assert _brute_threshold(members, others) == value
        m, o = torch.tensor(members, dtype=torch.float64), torch.tensor(others)
        threshold = best_threshold(m, o.double())
        assert type(threshold) is float and threshold == value


def test_membership_inference_on_unbalanced_classes_by_hand():
    """9 members and 6 non-members over 3 classes of unequal sizes: both sets subsampled
    to 6 by the seeded permutations, thresholds fitted on the first 3 of each (per class
    where the class has both members and non-members there, else the global one) and
    scored on the last 3, for the confidence attack, against a brute-force reference.
    Class 1's members are less confident than class 0's non-members, so per-class
    thresholds help (2/3 against 1/2); the fit half's non-members are all of class 1, so
    classes 0 and 2 fall back to the global threshold. With seed 2, a class has members
    but no non-members in the fit half: it too falls back (a threshold fitted on its
    members alone scores 5/6, not 1). Yeom's loss attack keeps one global
    threshold either way: log F_y is monotone in F_y, so it scores as confidence does
    without classes (1/2)."""
    from lightning_fl.engine.seeding import generator

    g = torch.Generator().manual_seed(1)
    member_labels = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 2])
    other_labels = torch.tensor([0, 0, 1, 1, 1, 0])
    member_conf = 0.5 + 0.5 * torch.rand(9, generator=g, dtype=torch.float64)
    other_conf = 0.3 + 0.5 * torch.rand(6, generator=g, dtype=torch.float64)
    member_conf = torch.where(member_labels == 1, member_conf - 0.3, member_conf)
    other_conf = torch.where(other_labels == 1, other_conf - 0.3, other_conf)
    found = {}

    def probs(conf, labels):  # three classes: the true one gets conf, the others split
        onehot = F.one_hot(labels, 3).double()
        return onehot * conf[:, None] + (1 - onehot) * ((1 - conf[:, None]) / 2)

    for seed, per_class in ((3, True), (3, False), (2, True)):
        members = probs(member_conf, member_labels)
        others = probs(other_conf, other_labels)
        attacks = ("confidence", "loss")
        result = membership_inference(members, member_labels, others, other_labels, seed=seed,
                                      attacks=attacks, per_class=per_class)  # fmt: skip
        if seed == 3:
            assert result.accuracy["loss"] == pytest.approx(1 / 2)
        perm = generator(seed, "membership", 6)
        m_idx = torch.randperm(9, generator=perm)[:6].tolist()
        o_idx = torch.randperm(6, generator=perm)[:6].tolist()
        m = [(float(member_conf[i]), int(member_labels[i])) for i in m_idx]
        o = [(float(other_conf[i]), int(other_labels[i])) for i in o_idx]
        default = _brute_threshold([s for s, _ in m[:3]], [s for s, _ in o[:3]])

        def threshold(label, m=m, o=o, default=default, per_class=per_class):
            fit_m = [s for s, c in m[:3] if c == label]
            fit_o = [s for s, c in o[:3] if c == label]
            if not per_class or not fit_m or not fit_o:
                return default
            return _brute_threshold(fit_m, fit_o)

        tpr = sum(s >= threshold(c) for s, c in m[3:]) / 3
        tnr = sum(s < threshold(c) for s, c in o[3:]) / 3
        assert result.accuracy["confidence"] == pytest.approx(0.5 * (tpr + tnr))
        fit_classes = ({c for _, c in m[:3]}, {c for _, c in o[:3]})
        assert fit_classes[1] == {1} if seed == 3 else fit_classes[0] - fit_classes[1]
        found[seed, per_class] = result.accuracy["confidence"]
    assert found == pytest.approx({(3, True): 2 / 3, (3, False): 1 / 2, (2, True): 1.0})


@pytest.mark.parametrize("w", [0.0, 0.25, 1.0])
def test_werm_loss_and_metrics_by_hand_at_both_ends_and_between(w):
    """(1 − w)·CE(train) + w·CE(reference), each mean over its batch; a term of weight 0
    is not computed, so its accuracy is not reported (w = 0: no ``reference_acc``, exactly
    ERM; w = 1: no ``acc``)."""
    torch.manual_seed(0)
    module = WERMClassifier(network=torch.nn.Linear(3, 2), w=w)
    g = torch.Generator().manual_seed(1)
    x, x_ref = torch.randn(5, 3, generator=g), torch.randn(4, 3, generator=g)
    y, y_ref = torch.tensor([0, 1, 1, 0, 1]), torch.tensor([1, 1, 0, 0])
    loss, metrics = module.loss_and_metrics({"train": (x, y), "reference": (x_ref, y_ref)})
    with torch.no_grad():
        logits, ref_logits = module.network(x), module.network(x_ref)
        expected = (1 - w) * F.cross_entropy(logits, y) + w * F.cross_entropy(ref_logits, y_ref)
        acc = float((logits.argmax(-1) == y).float().mean())
        ref_acc = float((ref_logits.argmax(-1) == y_ref).float().mean())
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert set(metrics) == {"acc", "reference_acc"} - ({"acc"} if w == 1 else set()) - (
        {"reference_acc"} if w == 0 else set()
    )
    if "acc" in metrics:
        assert float(metrics["acc"]) == acc
    if "reference_acc" in metrics:
        assert float(metrics["reference_acc"]) == ref_acc
    # the logged means weigh a step by its training samples (5), not its reference ones (4)
    assert module.batch_size_of({"train": (x, y), "reference": (x_ref, y_ref)}) == 5
    assert module.batch_size_of((x_ref, y_ref)) == 4


def test_membership_inference_at_the_smallest_sizes():
    """Two members and three non-members (size 2: one of each to fit, one to score) is
    the smallest attack: separable confidences give 1.0; the other way round, no cut
    beats predicting nobody (∞), which scores 0.5; one member is refused, naming both
    counts."""
    probs_high = torch.tensor([[0.9, 0.1], [0.1, 0.9]], dtype=torch.float64)
    probs_low = torch.tensor([[0.2, 0.8], [0.8, 0.2], [0.2, 0.8]], dtype=torch.float64)
    labels_m, labels_n = torch.tensor([0, 1]), torch.tensor([0, 1, 0])
    result = membership_inference(
        probs_high, labels_m, probs_low, labels_n, attacks=("correctness", "confidence"),
        per_class=False,
    )  # fmt: skip
    # members are predicted right (correctness 1 counts as "member"), non-members wrong
    assert result.accuracy == {"correctness": 1.0, "confidence": 1.0}
    assert all(type(value) is float for value in result.accuracy.values())
    flipped = membership_inference(
        probs_low[:2], labels_m, torch.cat([probs_high, probs_high[:1]]), labels_n,
        attacks=("confidence",), per_class=False,
    )  # fmt: skip
    assert flipped.accuracy == {"confidence": 0.5}  # the fitted cut predicts nobody
    # a score equal to the fitted threshold is "member": with seed 0 the permutations put
    # non-member 0 (0.2) in the fit half and non-member 1 (0.9) in the scored half, so the
    # threshold is 0.9 and the scored non-member, exactly at it, is called a member
    at_threshold = membership_inference(
        probs_high, labels_m, torch.cat([probs_low[:1], probs_high[1:]]), labels_n[:2],
        attacks=("confidence",), per_class=False,
    )  # fmt: skip
    assert at_threshold.accuracy == {"confidence": 0.5}
    with pytest.raises(ValueError, match="at least 2 members and 2 non-members, got 1 and 3"):
        membership_inference(probs_high[:1], labels_m[:1], probs_low, labels_n)


def test_reference_batches_cycle_on_their_own_seeded_order_by_hand():
    """20 training samples in batches of 4 (5 batches) and 7 reference samples in batches
    of 3 (3 a pass): the training batches are a plain loader's with the same generator;
    the reference batches are a shuffled loader's seeded with derive_seed(seed,
    "reference"), reshuffled when it runs out after 3; no generator means reference seed 0. An
    empty reference set is refused, one sample is enough."""
    from torch.utils.data import TensorDataset

    from lightning_fl.datamodules.reference import WERMDataset, paired_loader
    from lightning_fl.engine.data_contract import batch_loader
    from lightning_fl.engine.seeding import derive_seed

    train = TensorDataset(torch.arange(20.0)[:, None], torch.arange(20))
    reference = TensorDataset(torch.arange(100.0, 107.0)[:, None], torch.arange(7))
    dataset = WERMDataset(train, reference)

    def expected(seed):
        plain = batch_loader(train, 4, True, torch.Generator().manual_seed(seed))
        derived = torch.Generator().manual_seed(derive_seed(seed, "reference"))
        ref = batch_loader(reference, 3, True, derived)
        first, second = list(ref), list(ref)  # the second pass is reshuffled
        refs = first + second[:2]
        return [b[1].tolist() for b in plain], [b[1].tolist() for b in refs]

    def got(generator):
        batches = list(paired_loader(dataset, 4, 3, generator))
        return ([b["train"][1].tolist() for b in batches],
                [b["reference"][1].tolist() for b in batches])  # fmt: skip

    for seed in (7, 8):
        assert got(torch.Generator().manual_seed(seed)) == expected(seed)
    assert got(None)[1] == expected(0)[1]  # the training order is then the global stream's
    assert expected(7)[1] != expected(8)[1]
    assert sorted(sum(expected(7)[1][:3], [])) == list(range(7))  # one pass: every sample
    with pytest.raises(ValueError, match="reference dataset is empty"):
        WERMDataset(train, TensorDataset(torch.zeros(0, 1), torch.zeros(0)))
    assert len(WERMDataset(train, TensorDataset(torch.zeros(1, 1), torch.zeros(1)))) == 20


def test_membership_inference_per_epoch_per_stage_and_per_client(tmp_path):
    """The validate stage reports at each validation (CSV rows "val"), a test-only attack
    stays out of validation, the results are cleared per epoch (a callback reused on 2
    clients, then 1), a client with exactly 2 training and 2 test samples is attacked, and no
    ``mia_personal`` values appear without personalization; with FineTune, both clients'
    personalized models are attacked before the report."""
    import csv

    from lightning_fl.callbacks import FineTune
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    torch.manual_seed(0)
    module = Classifier(MLP(10, (32,), 4), lr=0.1)
    two = _dm("none", num_clients=2, split=(0.5, 0.0, 0.2, 0.3))  # validation data, no reference
    _fit(module, two)
    test_only = MembershipInference(stages=("test",))
    trainer = make_trainer(
        FederatedStrategy(seed=3), 1, [test_only], limit_val_batches=None,
        default_root_dir=str(tmp_path / "none"),
    )  # fmt: skip
    trainer.validate(module, datamodule=two, verbose=False)
    assert not list((tmp_path / "none").rglob("membership_inference.csv"))  # nothing to write
    assert test_only.results == {} and not any(
        k.startswith("mia") for k in trainer.callback_metrics
    )
    attack = MembershipInference(stages=("validate",))
    x, y = _data(n=12)
    tiny = [{"train": (torch.tensor(x[:2]), torch.tensor(y[:2])),
             "val": (torch.tensor(x[8:10]), torch.tensor(y[8:10])),
             "test": (torch.tensor(x[6:8]), torch.tensor(y[6:8]))}]  # fmt: skip
    for dm, clients in ((two, [0, 1]), (InMemoryFederatedDataModule(tiny, 4), [0])):
        trainer = make_trainer(
            FederatedStrategy(seed=3), 1, [attack], limit_val_batches=None,
            default_root_dir=str(tmp_path / str(len(clients))),
        )  # fmt: skip
        trainer.validate(module, datamodule=dm, verbose=False)
        assert sorted(attack.results) == [("mia", "train", c) for c in clients]
        if len(clients) == 1:  # by hand: the attacks on the model's softmax outputs
            split = tiny[0]
            with torch.no_grad():
                member, nonmember = (
                    torch.softmax(module(split[k][0]), dim=1) for k in ("train", "test")
                )
            expected = membership_inference(
                member, split["train"][1], nonmember, split["test"][1], seed=attack.seed
            )
            assert attack.results[("mia", "train", 0)] == dict(
                expected.accuracy, best=expected.best, auc=expected.best_auc
            )
        assert "mia/train/best" in trainer.callback_metrics
        (path,) = (tmp_path / str(len(clients))).rglob("membership_inference.csv")
        rows = list(csv.DictReader(open(path)))
        assert [(r["stage"], r["model"], int(r["client"])) for r in rows] == [
            ("val", "mia", c) for c in clients
        ]
    one_test = [dict(tiny[0], test=(tiny[0]["test"][0][:1], tiny[0]["test"][1][:1]))]
    trainer = make_trainer(
        FederatedStrategy(seed=3), 1, [attack], limit_val_batches=None,
        default_root_dir=str(tmp_path / "too_few"),
    )  # fmt: skip
    trainer.validate(module, datamodule=InMemoryFederatedDataModule(one_test, 4), verbose=False)
    assert attack.results == {}
    assert not list((tmp_path / "too_few").rglob("membership_inference.csv"))
    personal = MembershipInference(stages=("test",))
    trainer = make_trainer(
        FederatedStrategy(seed=3), 1, [FineTune(lr=0.5, epochs=1), personal],
        default_root_dir=str(tmp_path / "personal"),
    )  # fmt: skip
    trainer.test(module, datamodule=two, verbose=False)
    (path,) = (tmp_path / "personal").rglob("membership_inference.csv")
    rows = [(r["model"], int(r["client"])) for r in csv.DictReader(open(path))]
    assert rows == [("mia", 0), ("mia", 1), ("mia_personal", 0), ("mia_personal", 1)]
    trainer = make_trainer(FederatedStrategy(seed=3), 1, [FineTune(lr=0.5, epochs=1), personal])
    trainer.test(module, datamodule=InMemoryFederatedDataModule(tiny, 4), verbose=False)
    assert sorted(personal.results) == [("mia", "train", 0), ("mia_personal", "train", 0)]


def test_server_reference_needs_the_servers_data_only_when_it_has_weight():
    """w = 0: nothing of the server's is read (a datamodule without server data trains as
    FedAvg); w > 0 on such a datamodule: a clear error naming the fix."""
    from tests.helpers import tiny_datamodule, tiny_module

    _fit(tiny_module(), tiny_datamodule(), [ServerReference(w=0.0)], rounds=1)
    with pytest.raises(TypeError, match=r"has no server_reference\(\): use reference='server'"):
        _fit(tiny_module(), tiny_datamodule(), [ServerReference(w=0.5)], rounds=1)


def test_server_steps_draw_their_dropout_masks_from_the_servers_own_seed():
    """w = 1 on a network with dropout: the round's model is the server's steps by hand,
    with masks drawn from the server's seed, not from what the last client's steps left
    in the global generator."""
    dm = _dm("server", num_clients=3)
    torch.manual_seed(0)
    one = Classifier(_dropout_network(), lr=0.1)
    _fit(one, dm, [ServerReference(w=1.0)], rounds=1)
    net = _server_steps_by_hand(dm, dropout=True)
    assert max_abs_diff(params_of(one), params_of(net)) < 1e-6
    assert max_abs_diff(params_of(one), params_of(_server_steps_by_hand(dm))) > 1e-3


def test_server_reference_with_local_steps_cycles_its_batches_by_hand():
    """w = 1 and K = 15 local steps: the server's 15 steps cycle its shuffled reference
    batches (more than one pass of batches of 16), the round's model is theirs alone."""
    dm = _dm("server", num_clients=3)
    torch.manual_seed(0)
    one = Classifier(MLP(10, (16,), 4), lr=0.1)
    trainer = make_trainer(FederatedStrategy(local_steps=15, seed=3), 1, [ServerReference(w=1.0)])
    trainer.fit(one, datamodule=dm)
    assert 16 * 15 > len(dm.server_reference())  # the steps wrap around to a second pass
    net = _server_steps_by_hand(dm, steps=15)
    assert max_abs_diff(params_of(one), params_of(net)) < 1e-6


def test_dp_epsilon_at_no_noise_unit_noise_and_below_one(tmp_path):
    """σ = 0 is ε = ∞; σ = 1 is Opacus's finite ε; a large σ gives ε < 1, still logged;
    with WERM at w = 0 the reference data takes no noisy step and no ε."""
    from opacus.accountants import RDPAccountant

    from lightning_fl.engine.client_store import ClientStore

    dp, store = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0), ClientStore()
    store.set(0, "dp_train_steps", 5)
    store.set(0, "dp_train_rate", 0.1)
    store.set(0, "dp_train_sigma", 1.0)
    accountant = RDPAccountant()
    accountant.history = [(1.0, 0.1, 5)]
    assert dp.epsilon(store, 0) == pytest.approx(accountant.get_epsilon(1e-5))
    store.set(0, "dp_train_sigma", 0.0)
    assert dp.epsilon(store, 0) == float("inf")
    torch.manual_seed(0)
    module = WERMClassifier(MLP(10, (16,), 4), w=0.0, lr=0.1)
    quiet = DPSGD(noise_multiplier=20.0, max_grad_norm=1.0)
    trainer = _fit(module, _dm("client", num_clients=1), [quiet], rounds=1)
    epsilon = float(trainer.callback_metrics["dp/epsilon"])
    assert 0 < epsilon < 1 and epsilon == pytest.approx(
        quiet.epsilon(trainer.strategy.client_store, 0)
    )
    assert trainer.strategy.client_store.get(0, "dp_reference_steps") is None
    assert "dp/epsilon_reference" not in trainer.callback_metrics


def test_werm_saves_w_with_the_optimizer_settings():
    module = WERMClassifier(MLP(10, (16,), 4), w=0.3, lr=0.2, momentum=0.5)
    assert {k: module.hparams[k] for k in ("w", "lr", "momentum")} == {
        "w": 0.3,
        "lr": 0.2,
        "momentum": 0.5,
    }
    assert "network" not in module.hparams


def test_data_files_skip_blank_lines_read_float_text_and_check_the_label_range(tmp_path):
    rows = _purchase_rows(3)
    path = tmp_path / "dataset_purchase"
    lines = [",".join(map(str, r)) for r in rows]
    lines[0] = ",".join(f"{v}.0" for v in rows[0])  # numbers written as floats
    path.write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    x, y = load_purchase100(str(path))
    assert y.tolist() == [r[0] - 1 for r in rows] and x[0].tolist() == rows[0][1:]
    for label, ok in ((1, True), (100, True), (0, False), (101, False)):
        path.write_text(",".join(map(str, [label] + rows[0][1:])) + "\n")
        if ok:
            assert load_purchase100(path)[1].tolist() == [label - 1]
        else:
            with pytest.raises(ValueError, match="labels must be 1..100"):
                load_purchase100(path)


def test_reference_datamodule_splits_by_hand_and_holds_the_reference_where_asked():
    """Client c's share of the label partition (``seed``) split into (train, reference,
    val, test) with ``seed + 7919 (c + 1)``; ``reference="client"``: WERM pairs of train
    and reference; ``"server"``: the reference parts pooled at the server, none at the
    clients; the test parts pooled as the server's non-members."""
    from lightning_fl.datamodules import ReferenceDataModule
    from lightning_fl.datamodules.partition import label_partition, split_fractions

    x, y = generate_purchase_like(300, 8, 5, 0.2, seed=1)
    split, seed = (0.4, 0.3, 0.1, 0.2), 4
    args = dict(num_clients=3, partition="dirichlet", alpha=0.7, split=split, seed=seed)
    client = ReferenceDataModule(x, y, reference="client", **args)
    server = ReferenceDataModule(x, y, reference="server", **args)
    names = ("train", "reference", "val", "test")
    parts = [
        dict(zip(names, split_fractions(idx, split, seed + 7919 * (c + 1))))
        for c, idx in enumerate(label_partition(y, "dirichlet", 3, seed, 0.7))
    ]
    for c, rows in enumerate(parts):
        for name in ("val", "test"):
            assert client.client_dataset(c, name).tensors[1].tolist() == y[rows[name]].tolist()
        pair = client.client_dataset(c, "train")
        assert type(pair).__name__ == "WERMDataset"
        assert server.client_dataset(c, "reference") is None
        assert server.client_dataset(c, "train").tensors[1].tolist() == y[rows["train"]].tolist()
    pooled = [int(server.server_reference()[i][1]) for i in range(len(server.server_reference()))]
    assert pooled == [int(v) for rows in parts for v in y[rows["reference"]]]
    nonmembers = server.server_nonmembers()
    assert [int(nonmembers[i][1]) for i in range(len(nonmembers))] == [
        int(v) for rows in parts for v in y[rows["test"]]
    ]
    with pytest.raises(ValueError, match="Unknown partition 'shardz'"):
        ReferenceDataModule(x, y, partition="shardz")
    from lightning_fl.engine.data_contract import SiloError

    client.enter_silo(1, 2)
    assert client.client_dataset(1, "test") is not None
    with pytest.raises(SiloError, match="client 2's data is held by silo 0"):
        client.client_dataset(2, "test")


def test_purchase_like_table_by_hand_and_its_flip_bounds():
    """A binary prototype per class from ``default_rng(seed)``, labels, then each bit
    flipped with probability p."""
    from lightning_fl.datamodules import SyntheticPurchaseDataModule

    x, y = generate_purchase_like(50, 7, 4, 0.3, seed=2)
    rng = np.random.default_rng(2)
    prototypes = rng.integers(0, 2, size=(4, 7))
    labels = rng.integers(0, 4, size=50)
    flips = rng.random((50, 7)) < 0.3
    assert y.tolist() == labels.tolist()
    assert x.tolist() == np.where(flips, 1 - prototypes[labels], prototypes[labels]).tolist()
    assert set(np.unique(prototypes)) == {0, 1}
    for p in (0.0, 0.5):
        SyntheticPurchaseDataModule(num_samples=10, flip_probability=p)
        generate_purchase_like(10, 3, 2, p)
    for p in (-0.01, 0.51):
        with pytest.raises(ValueError, match=r"flip_probability must be in \[0, 0.5\]"):
            SyntheticPurchaseDataModule(flip_probability=p)
        with pytest.raises(ValueError, match=r"flip_probability must be in \[0, 0.5\]"):
            generate_purchase_like(10, 3, 2, p)
    dm = SyntheticPurchaseDataModule(num_samples=40, num_features=5, num_classes=3,
                                     flip_probability=0.1, data_seed=6)  # fmt: skip
    assert dm.read_table()[1].tolist() == generate_purchase_like(40, 5, 3, 0.1, 6)[1].tolist()
    assert dm.num_clients == 1 and len(dm.client_dataset(0, "test")) == 12  # 0.3 of 40


@pytest.mark.parametrize("dataset", ["purchase", "texas"])
def test_download_extracts_shokris_archive_once(tmp_path, monkeypatch, dataset):
    """``download=True`` fetches the archive into ``root`` and extracts it there; a second
    module reads the extracted files without the archive's source."""
    import tarfile

    from lightning_fl.datamodules import Purchase100DataModule, Texas100DataModule
    from lightning_fl.datamodules import privacy as module

    source = tmp_path / "source"
    rows = _purchase_rows(6, seed=3)
    if dataset == "purchase":
        source.mkdir()
        (source / "dataset_purchase").write_text("\n".join(",".join(map(str, r)) for r in rows))
        members, make = ["dataset_purchase"], Purchase100DataModule
    else:
        (source / "texas" / "100").mkdir(parents=True)
        feats = np.random.default_rng(3).integers(0, 2, (6, 6169))
        (source / "texas" / "100" / "feats").write_text(
            "\n".join(",".join(map(str, f)) for f in feats)
        )
        (source / "texas" / "100" / "labels").write_text("\n".join(str(r[0]) for r in rows))
        members, make = ["texas"], Texas100DataModule
    archive = tmp_path / f"dataset_{dataset}.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for m in members:
            tar.add(source / m, arcname=m)
    monkeypatch.setattr(module, f"{dataset.upper()}_URL", archive.as_uri())
    root = tmp_path / "root"
    if dataset == "purchase":
        with pytest.raises(FileNotFoundError, match="pass download=True"):
            make(root=str(root), num_clients=2).setup()
    dm = make(root=str(root), download=True, num_clients=2, split=(0.5, 0.0, 0.0, 0.5))
    labels = sorted(int(t) for c in range(2) for t in dm.client_dataset(c, "train").tensors[1])
    labels += [int(t) for c in range(2) for t in dm.client_dataset(c, "test").tensors[1]]
    assert sorted(labels) == sorted(r[0] - 1 for r in rows)
    assert (root / archive.name).exists()
    archive.unlink()
    (root / archive.name).unlink()  # the extracted files are enough: nothing fetched again
    again = make(root=str(root), download=True, num_clients=2, split=(0.5, 0.0, 0.0, 0.5))
    assert again.num_clients == 2


def test_roc_auc_is_the_pairwise_probability_with_ties_and_sklearns():
    """AUC = P(member > non-member) + ½ P(tie), by brute force over every pair and by
    scikit-learn's roc_auc_score, on scores with ties across and within the two sets."""
    from sklearn.metrics import roc_auc_score

    from lightning_fl.systems.membership import roc_auc

    g = torch.Generator().manual_seed(3)
    member = torch.randint(0, 6, (37,), generator=g).double()
    nonmember = torch.randint(0, 5, (23,), generator=g).double()
    pairs = [(1.0 if a > b else 0.5 if a == b else 0.0) for a in member for b in nonmember]
    brute = sum(pairs) / len(pairs)
    assert roc_auc(member, nonmember) == pytest.approx(brute, abs=1e-12)
    labels = [1] * len(member) + [0] * len(nonmember)
    sklearn = roc_auc_score(labels, torch.cat([member, nonmember]).numpy())
    assert roc_auc(member, nonmember) == pytest.approx(sklearn, abs=1e-12)
    assert roc_auc(torch.tensor([2.0, 3.0]), torch.tensor([0.0, 1.0])) == 1.0
    assert roc_auc(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0])) == 0.0
