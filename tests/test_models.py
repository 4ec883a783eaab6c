"""The networks and the task module (``lightning_fl/models.py``), pinned by values computed
independently: parameter counts worked out layer by layer from each paper's architecture,
MobileNet-v2 against torchvision's published count, the round means and evaluation sums
by hand, the optimizers and schedules each setting builds."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_fl import models
from lightning_fl.engine.round_metrics import RoundMetricSums, gather_sums
from lightning_fl.models import (
    MLP,
    BinaryClassifier,
    CharLSTM,
    CifarCNN,
    Classifier,
    CoxRegression,
    DigitsCNN,
    FemnistCNN,
    InvertedResidual,
    LeNet5,
    MnistCNN,
    MobileNetV2,
    SifuFashionCNN,
)
from lightning_fl.survival import concordance_index, cox_partial_likelihood_loss


def _count(network: nn.Module) -> int:
    return sum(p.numel() for p in network.parameters())


def _conv(cin, cout, k):
    return cin * cout * k * k + cout


def _linear(fin, fout):
    return fin * fout + fout


@pytest.mark.parametrize(
    ("build", "shape", "parameters", "outputs"),
    [
        (lambda: MLP(64, (32, 16), 10), (3, 64),
         _linear(64, 32) + _linear(32, 16) + _linear(16, 10), 10),
        (lambda: MLP(20, (), 1), (3, 20), _linear(20, 1), 1),
        (lambda: MnistCNN(), (3, 1, 28, 28),
         _conv(1, 16, 5) + _conv(16, 32, 5) + _linear(512, 64) + _linear(64, 10), 10),
        # the authors' CNN_FashionMNIST (SIFU code): 824,458 parameters
        (lambda: SifuFashionCNN(), (3, 784),
         _conv(1, 32, 3) + _conv(32, 64, 3) + _linear(3136, 256) + _linear(256, 10), 10),
        # LeNet-5 with a padded first convolution: the classic 61,706
        (lambda: LeNet5(), (3, 784),
         _conv(1, 6, 5) + _conv(6, 16, 5) + _linear(400, 120) + _linear(120, 84)
         + _linear(84, 10), 10),
        (lambda: DigitsCNN(), (3, 64), _conv(1, 16, 3) + _conv(16, 32, 3) + _linear(512, 10), 10),
        # Reddi et al.'s EMNIST CNN: 1,206,590 parameters for 62 classes
        (lambda: FemnistCNN(), (3, 1, 28, 28),
         _conv(1, 32, 3) + _conv(32, 64, 3) + _linear(9216, 128) + _linear(128, 62), 62),
        (lambda: CifarCNN(), (3, 3, 32, 32),
         _conv(3, 32, 5) + _conv(32, 64, 5) + _linear(1600, 512) + _linear(512, 10), 10),
    ],
)  # fmt: skip
def test_each_network_has_the_papers_layers(build, shape, parameters, outputs):
    network = build()  # built in the test, where the mutation runner's coverage sees it
    assert _count(network) == parameters
    assert network.eval()(torch.randn(shape)).shape == (3, outputs)


def test_the_published_parameter_counts():
    """Counts the papers and libraries print: FedEM's CIFAR-10 CNN (d = 3,353,034),
    torchvision's ``mobilenet_v2()`` (3,504,872 for 1,000 classes), LeNet-5, SIFU's CNN."""
    assert _count(CifarCNN(10, hidden=2048)) == 3_353_034
    assert _count(MobileNetV2(1000)) == 3_504_872
    assert _count(MobileNetV2(10)) == 3_504_872 - _linear(1280, 1000) + _linear(1280, 10)
    assert _count(LeNet5()) == 61_706
    assert _count(SifuFashionCNN()) == 824_458
    assert _count(FemnistCNN()) == 1_206_590


def test_char_lstm_counts_and_its_final_state():
    """Embedding, two LSTM layers (4 gates, two biases each), the head; the final state
    seen by the identity hook is [h_n; c_n] of every layer, 2·layers·hidden per sequence,
    and the logits are the head's on the last step's output."""
    network = CharLSTM(vocab_size=11, embed_dim=5, hidden=7, layers=2)
    lstm = 4 * 7 * (5 + 7) + 2 * 4 * 7 + 4 * 7 * (7 + 7) + 2 * 4 * 7
    assert _count(network) == 11 * 5 + lstm + _linear(7, 11)
    seen = []
    network.final_state.register_forward_hook(lambda m, i, o: seen.append(o))
    x = torch.randint(0, 11, (3, 6))
    logits = network(x)
    out, (h_n, c_n) = network.lstm(network.embedding(x))
    assert torch.equal(logits, network.head(out[:, -1]))
    expected = torch.stack(
        [torch.cat([h_n[0, b], h_n[1, b], c_n[0, b], c_n[1, b]]) for b in range(3)]
    )
    assert torch.equal(seen[0], expected)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(32.0, 32), (16.0, 16), (18.0, 24), (11.2, 16), (3.0, 8), (1280.0, 1280), (52.0, 56),
     (8 / 0.9, 8)],  # exactly 10% lost (0.9 · 8.89 = 8.0): kept
)  # fmt: skip
def test_make_divisible_by_hand(value, expected):
    """torchvision's rule: the nearest multiple of 8 (halves up), at least 8, raised by 8
    when rounding lost more than 10% (18 → 16 is 11% less: 24; 11.2 → 8: 16), not when it
    lost exactly 10%."""
    assert models._make_divisible(value) == expected


def test_mobilenet_blocks_residuals_and_initialization():
    """A block keeps a residual only at stride 1 with equal widths; t = 1 has no expansion
    convolution; widths scale with ``width_mult`` (the head never below 1280); torchvision's
    initialization: He-normal over fan-out for convolutions, N(0, 0.01²) and zero biases
    for the classifier, unit/zero batch norms."""
    torch.manual_seed(0)
    block = InvertedResidual(8, 8, 1, 6).eval()
    x = torch.randn(2, 8, 5, 5)
    assert torch.allclose(block(x), x + block.block(x))
    for cin, cout, stride in ((8, 8, 2), (8, 16, 1)):
        other = InvertedResidual(cin, cout, stride, 6).eval()
        assert not other.residual
        assert torch.equal(other(x), other.block(x))
    assert len(InvertedResidual(8, 8, 1, 1).block) == 3
    assert len(InvertedResidual(8, 8, 1, 6).block) == 4
    network = MobileNetV2(10)
    residuals = [m.residual for m in network.features if isinstance(m, InvertedResidual)]
    # (t, c, n, s): only the repeats of each setting keep their shape
    assert residuals == [False, False, True, False, True, True, False, True, True, True,
                         False, True, True, False, True, True, False]  # fmt: skip
    assert network.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    # a total stride of 32 (stem 2, then 2, 2, 2, 1, 2, 1): ImageNet's 224×224 → 7×7
    assert network.features(torch.randn(1, 3, 224, 224)).shape == (1, 1280, 7, 7)
    half = MobileNetV2(10, width_mult=0.5)
    assert half.features[0][0].out_channels == 16 and half.classifier[1].in_features == 1280
    widths = [m.block[-1].num_features for m in half.features if isinstance(m, InvertedResidual)]
    assert sorted(set(widths)) == [8, 16, 32, 48, 80, 160]  # c · 0.5, to multiples of 8
    assert MobileNetV2(10, width_mult=1.5).classifier[1].in_features == 1920
    assert network.classifier[0].p == 0.2
    head = network.features[-1][0].weight  # 1×1, 320 → 1280: fan-out 1280
    assert head.std().item() == pytest.approx(math.sqrt(2 / 1280), rel=0.02)
    linear = network.classifier[1]
    assert linear.weight.std().item() == pytest.approx(0.01, rel=0.05)
    assert abs(linear.weight.mean().item()) < 1e-3
    assert not linear.bias.any()
    norms = [m for m in network.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(bool((m.weight == 1).all() and (m.bias == 0).all()) for m in norms)


def test_optimizers_and_schedules_each_setting_builds():
    network = MLP(4, (3,), 2)
    sgd = Classifier(network, lr=0.3, momentum=0.5, weight_decay=0.01).configure_optimizers()
    assert isinstance(sgd, torch.optim.SGD)
    assert (sgd.defaults["lr"], sgd.defaults["momentum"], sgd.defaults["weight_decay"]) == (
        0.3, 0.5, 0.01,
    )  # fmt: skip
    adam = Classifier(network, lr=0.2, optimizer="adam", weight_decay=0.02).configure_optimizers()
    assert isinstance(adam, torch.optim.Adam)
    assert (adam.defaults["lr"], adam.defaults["weight_decay"]) == (0.2, 0.02)
    decayed = Classifier(network, lr=0.1, lr_decay=0.7).configure_optimizers()
    scheduler = decayed["lr_scheduler"]["scheduler"]
    assert isinstance(scheduler, torch.optim.lr_scheduler.ExponentialLR)
    assert scheduler.gamma == 0.7 and decayed["lr_scheduler"]["interval"] == "epoch"
    stepped = Classifier(network, lr=0.1, lr_milestones=[2, 5], lr_gamma=0.5)
    scheduler = stepped.configure_optimizers()["lr_scheduler"]["scheduler"]
    assert isinstance(scheduler, torch.optim.lr_scheduler.MultiStepLR)
    assert dict(scheduler.milestones) == {2: 1, 5: 1} and scheduler.gamma == 0.5
    with pytest.raises(ValueError, match="optimizer must be 'sgd' or 'adam', got 'rmsprop'"):
        Classifier(network, optimizer="rmsprop")


def test_round_means_are_batch_weighted_in_step_order():
    """Σ value·B / Σ B over a round's steps, scalars with integer sizes and a vectorized
    step's per-client values with a size tensor alike; integer values become floats; the
    sums are cleared once taken."""
    means = models._RoundMeans()
    means.add("loss", torch.tensor(0.5), 4)
    means.add("loss", torch.tensor([1.0, 2.0]), torch.tensor([2, 6]))
    means.add("acc", torch.tensor(1, dtype=torch.int64), 3)
    means.add("acc", torch.tensor(0, dtype=torch.int64), 1)
    sums = means.pop_sums()
    total, count = sums["loss"]
    assert (total.item(), count.item()) == (0.5 * 4 + 1.0 * 2 + 2.0 * 6, 12)
    assert total.dtype == torch.float32 and count.dtype == torch.float32
    assert [v.item() for v in sums["acc"]] == [3.0, 4.0]
    assert sums["acc"][0].dtype == torch.float32  # integer values become floats
    assert means.pop_sums() == {}
    means.add("loss", torch.tensor(0.1, dtype=torch.float64), 3)
    total, count = means.pop_sums()["loss"]
    assert total.dtype == torch.float64 and total.item() == 0.1 * 3  # doubles kept


def test_round_means_accumulate_sequentially_in_float32():
    """The running sum is in step order and in float32, as Lightning's reduction: a large
    first value swallows small ones that a pairwise or double sum would keep."""
    means = models._RoundMeans()
    values = [1e8, *([1.0] * 16)]
    for v in values:
        means.add("loss", torch.tensor(v), 1)
    total, _ = means.pop_sums()["loss"]
    sequential = torch.tensor(0.0)
    for v in values:
        sequential = sequential + torch.tensor(v)
    assert total.item() == sequential.item() == 1e8
    assert sum(values) != 1e8


def test_evaluation_sums_accumulate_value_times_size():
    sums: dict = {}
    models._accumulate(sums, "val_loss", torch.tensor(0.25), 4)
    models._accumulate(sums, "val_loss", torch.tensor(1.5), 2)
    models._accumulate(sums, "val_acc", torch.tensor(1, dtype=torch.int64), 3)
    total, count = sums["val_loss"]
    assert (total.item(), count.item()) == (0.25 * 4 + 1.5 * 2, 6)
    assert count.dtype == torch.int64
    assert sums["val_acc"][0].dtype == torch.float32 and sums["val_acc"][0].item() == 3.0
    models._accumulate(sums, "val_f64", torch.tensor(0.1, dtype=torch.float64), 3)
    assert sums["val_f64"][0].dtype == torch.float64  # kept in double, not cast to float32
    assert sums["val_f64"][0].item() == 0.1 * 3


def test_sums_over_ranks_in_rank_order(monkeypatch):
    """Every rank's (total, count) added; a key only some ranks logged is still returned
    with the others' sums, so that every rank logs the same keys."""
    gathered = [
        {"loss": (1.0, 2.0), "acc": (0.5, 1.0)},
        {"loss": (3.0, 4.0)},
        {},
    ]

    class ThreeRanks:
        def gather_present(self, mine, absent):
            assert absent == {}  # a site that dropped logged nothing
            assert mine == {"loss": (3.0, 4.0)}
            assert all(type(v) is float for v in mine["loss"])  # plain floats, not tensors
            return gathered

    mine = {"loss": (torch.tensor(3.0), torch.tensor(4.0))}
    added = gather_sums(mine, ThreeRanks(), torch.device("cpu"))
    assert {k: (t.item(), c.item()) for k, (t, c) in added.items()} == {
        "loss": (4.0, 6.0), "acc": (0.5, 1.0),
    }  # fmt: skip
    assert added["loss"][0].dtype == torch.get_default_dtype()


class _Doubling(nn.Module):
    """A network whose output is not its input: the tasks must apply it."""

    def forward(self, x):
        return 2 * x


def test_binary_classifier_and_cox_regression_by_hand():
    """BCE on one logit, accuracy at p = 0.5 (a logit of exactly 0 predicts 0); Cox's loss
    and C-index read events from the target's first column and times from its second."""
    binary = BinaryClassifier(_Doubling())
    logits = torch.tensor([[2.0], [-1.0], [0.0], [0.5]])
    y = torch.tensor([1, 0, 0, 0])
    loss, metrics = binary.loss_and_metrics((logits / 2, y))
    p = torch.sigmoid(logits.reshape(-1))
    target = y.float()
    expected = -(target * p.log() + (1 - target) * (1 - p).log()).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["acc"].item() == 0.75  # predicted 1, 0, 0, 1
    cox = CoxRegression(_Doubling())
    scores = torch.tensor([[0.3], [1.2], [-0.4], [0.9], [0.1]])
    events = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    times = torch.tensor([5.0, 2.0, 7.0, 1.0, 3.0])
    loss, metrics = cox.loss_and_metrics((scores / 2, torch.stack([events, times], 1)))
    s = scores.reshape(-1)
    assert loss.item() == pytest.approx(cox_partial_likelihood_loss(s, events, times).item())
    assert metrics["cindex"].item() == pytest.approx(concordance_index(times, s, events))
    assert loss.item() != pytest.approx(cox_partial_likelihood_loss(s, times, events).item())


def test_classifier_loss_and_accuracy_by_hand():
    classifier = Classifier(_Doubling())
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 3.0, 0.0], [1.0, 0.0, 0.0]])
    y = torch.tensor([0, 2, 0])
    loss, metrics = classifier.loss_and_metrics((logits / 2, y))
    expected = -torch.log_softmax(logits, 1)[torch.arange(3), y].mean()
    assert loss.item() == pytest.approx(expected.item())
    assert metrics["acc"].item() == pytest.approx(2 / 3)
    assert Classifier.batch_size_of((logits, y)) == 3


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lr": -0.1}, "lr is -0.1, not ≥ 0: give a finite number ≥ 0, e.g. lr=0.05."),
        ({"momentum": float("nan")},
         "momentum is NaN: give a finite number ≥ 0, e.g. momentum=0.9."),
        ({"weight_decay": -1}, "weight_decay is -1, not ≥ 0: give a finite number ≥ 0, e.g. "
         "weight_decay=0.0001."),
        ({"lr_decay": 0.0},
         "lr_decay is 0.0, not > 0: give a finite number > 0, e.g. lr_decay=0.99."),
    ],
)  # fmt: skip
def test_the_task_refuses_each_bad_optimizer_setting(settings, message):
    with pytest.raises(ValueError) as refused:
        Classifier(MLP(4, (3,), 2), **settings)
    assert str(refused.value) == message
    Classifier(MLP(4, (3,), 2), lr=0.0, momentum=0.0, weight_decay=0.0)  # zeros are valid


def test_a_reference_batch_pair_is_refused_by_a_plain_task():
    with pytest.raises(TypeError, match="Train a lightning_fl.WERMClassifier"):
        Classifier(MLP(4, (3,), 2))._step({"train": None, "reference": None}, "train")


def test_a_task_validates_under_a_plain_lightning_trainer(tmp_path):
    """Outside FederatedStrategy the task logs with ``self.log``: the epoch's value is the
    batch-size-weighted mean over batches of unequal sizes (Lightning's mean reduction)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    task = Classifier(MLP(5, (4,), 3))
    x, y = torch.randn(10, 5), torch.randint(0, 3, (10,))
    loader = DataLoader(TensorDataset(x, y), batch_size=4)  # batches of 4, 4 and 2
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, accelerator="cpu")  # fmt: skip
    (results,) = trainer.validate(task, loader, verbose=False)
    with torch.no_grad():
        losses = [
            torch.nn.functional.cross_entropy(task(x[i : i + 4]), y[i : i + 4]) for i in (0, 4, 8)
        ]
        correct = (task(x).argmax(1) == y).float().sum()
    sizes = torch.tensor([4.0, 4.0, 2.0])
    assert results["val_loss"] == pytest.approx(float((torch.stack(losses) * sizes).sum() / 10))
    assert results["val_acc"] == pytest.approx(float(correct / 10))
    assert set(results) == {"val_loss", "val_acc"}


def _logged_run(folder, vectorize: bool, every: int):
    """4 of the tiny clients, 3 local steps, 2 rounds, a CSVLogger writing every ``every``
    steps: the trainer and the rows of its metrics.csv."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_fl import FederatedStrategy, UniformSampler
    from tests.helpers import make_trainer, tiny_datamodule, tiny_module

    strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=3, seed=0,
                                 vectorize=vectorize)  # fmt: skip
    trainer = make_trainer(strategy, 2, logger=CSVLogger(folder), log_every_n_steps=every)
    trainer.fit(tiny_module(), datamodule=tiny_datamodule())
    with open(folder / "lightning_logs" / "version_0" / "metrics.csv") as handle:
        return trainer, list(csv.DictReader(handle))


@pytest.mark.parametrize(("vectorize", "steps"), [(False, 24), (True, 6)])
def test_step_values_are_logged_at_the_loggers_interval(vectorize, steps, tmp_path):
    """``train_loss_step`` at every second Lightning step (``log_every_n_steps=2``: the
    steps k with (k + 1) % 2 = 0): 4 clients × 3 local steps × 2 rounds = 24 sequential
    steps, or 3 × 2 vectorized steps of the 4 clients together."""
    trainer, rows = _logged_run(tmp_path, vectorize, every=2)
    assert trainer.global_step == steps
    logged = [int(r["step"]) for r in rows if r.get("train_loss_step")]
    assert logged == list(range(1, steps, 2))


def _functional_references():
    """Each network written again as functions of its own parameters (in registration
    order), from the architectures in the docstrings and the papers."""
    pool, relu = torch.nn.functional.max_pool2d, torch.relu
    conv, linear = torch.nn.functional.conv2d, torch.nn.functional.linear

    def sifu(x, w):  # the authors' CNN_FashionMNIST: two 3×3 convolutions, padding 1
        h = pool(relu(conv(x.view(-1, 1, 28, 28), w[0], w[1], padding=1)), 2)
        h = pool(relu(conv(h, w[2], w[3], padding=1)), 2).flatten(1)
        return linear(relu(linear(h, w[4], w[5])), w[6], w[7])

    def lenet(x, w):  # LeNet-5, first convolution padded by 2
        h = pool(relu(conv(x.view(-1, 1, 28, 28), w[0], w[1], padding=2)), 2)
        h = pool(relu(conv(h, w[2], w[3])), 2).flatten(1)
        return linear(relu(linear(relu(linear(h, w[4], w[5])), w[6], w[7])), w[8], w[9])

    def conv_pool_twice(x, w):  # MnistCNN and McMahan's CIFAR CNN alike
        h = pool(relu(conv(x, w[0], w[1])), 2)
        h = pool(relu(conv(h, w[2], w[3])), 2).flatten(1)
        return linear(relu(linear(h, w[4], w[5])), w[6], w[7])

    def digits(x, w):
        h = relu(conv(x.view(-1, 1, 8, 8), w[0], w[1], padding=1))
        h = pool(relu(conv(h, w[2], w[3], padding=1)), 2).flatten(1)
        return linear(h, w[4], w[5])

    def femnist(x, w):  # eval mode: dropout is the identity
        h = relu(conv(x.view(-1, 1, 28, 28), w[0], w[1]))
        h = pool(relu(conv(h, w[2], w[3])), 2).flatten(1)
        return linear(relu(linear(h, w[4], w[5])), w[6], w[7])

    return [
        (SifuFashionCNN, (2, 784), sifu), (LeNet5, (2, 784), lenet),
        (MnistCNN, (2, 1, 28, 28), conv_pool_twice), (DigitsCNN, (2, 64), digits),
        (FemnistCNN, (2, 1, 28, 28), femnist), (CifarCNN, (2, 3, 32, 32), conv_pool_twice),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(6))
def test_each_network_computes_its_papers_function(index):
    """Padding and pooling change no parameter count: the outputs against the network
    written as functions of its own weights."""
    build, shape, reference = _functional_references()[index]
    torch.manual_seed(index)
    network = build().eval()
    x = torch.rand(shape)
    weights = [p.detach() for p in network.parameters()]
    assert torch.allclose(network(x), reference(x, weights), atol=1e-6)


def test_vectorized_step_values_are_the_clients_batch_weighted_means(tmp_path):
    """A vectorized step logs Σ_i B_i·loss_i / Σ_i B_i over its clients, the same clients'
    losses the sequential path logs one by one (every batch here holds 4 samples, so the
    mean is plain); a round's ``train_loss_epoch`` is the mean of its steps' values."""
    logged = {}
    for vectorize in (False, True):
        trainer, logged[vectorize] = _logged_run(tmp_path / str(vectorize), vectorize, every=1)
        last = [float(r["train_loss_epoch"]) for r in logged[vectorize] if r["train_loss_epoch"]]
        # ``train_loss`` (callback_metrics only: what checkpoints and early stopping read)
        assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(last[-1])
        assert "train_loss" not in logged[vectorize][0]  # not a logger column
    steps = [float(r["train_loss_step"]) for r in logged[False] if r["train_loss_step"]]
    fused = [float(r["train_loss_step"]) for r in logged[True] if r["train_loss_step"]]
    assert len(steps) == 24 and len(fused) == 6
    for round_idx in range(2):
        for k in range(3):  # client i's k-th step is sequential step 12·round + 3·i + k
            clients = [steps[12 * round_idx + 3 * i + k] for i in range(4)]
            assert fused[3 * round_idx + k] == pytest.approx(sum(clients) / 4, rel=1e-5)
    for vectorize, per_round in ((False, 12), (True, 3)):
        values = steps if not vectorize else fused
        epochs = [float(r["train_loss_epoch"]) for r in logged[vectorize] if r["train_loss_epoch"]]
        expected = [sum(values[per_round * r : per_round * (r + 1)]) / per_round for r in (0, 1)]
        assert epochs == pytest.approx(expected, rel=1e-5)


def test_the_tasks_default_networks():
    """Classifier: MLP 64-64-10; BinaryClassifier: FLamby Fed-Heart-Disease's Linear(13, 1);
    CoxRegression: Fed-TCGA-BRCA's Linear(39, 1)."""
    assert [(m.in_features, m.out_features) for m in Classifier().network.modules()
            if isinstance(m, nn.Linear)] == [(64, 64), (64, 10)]  # fmt: skip
    for task, features in ((BinaryClassifier(), 13), (CoxRegression(), 39)):
        assert (task.network.in_features, task.network.out_features) == (features, 1)


class _Ranks:
    """Three ranks' collectives as rank 0 sees them: a gather returns ``others`` after
    this rank's value, and records what was gathered."""

    def __init__(self, others: list) -> None:
        self.others, self.gathered = others, []

    def gather_present(self, mine, absent):
        self.gathered.append(mine)
        return [mine, *self.others]


def test_training_metrics_ride_the_rounds_sum_after_one_gather_of_their_names():
    """Round 0 agrees on the names (a gather of names, no values); every later round's
    part is [flag, Σv·B, ΣB per name in sorted order, zeros for a name this rank did not
    log], and the round's totals are what the sum brings. A rank that logs a name outside
    them flags it, and that round is gathered instead; a half-precision sum carries none."""
    t = torch.tensor
    rounds = iter([
        {"loss": (t(3.0), t(4.0))},
        {"loss": (t(5.0), t(2.0)), "acc": (t(1.0), t(2.0))},
        {"loss": (t(1.0), t(1.0)), "f1": (t(0.5), t(1.0))},
        {"loss": (t(7.0), t(7.0))},
    ])  # fmt: skip
    sums = RoundMetricSums(lambda: next(rounds))
    ranks = _Ranks([["acc", "loss"], []])  # rank 1 logged acc too; rank 2 nothing
    part = sums.part(ranks, torch.device("cpu"), torch.float32)
    assert ranks.gathered == [["loss"]] and sums.names == ("acc", "loss")
    assert part.tolist() == [0.0, 0.0, 0.0, 3.0, 4.0]
    sums.take(torch.tensor([0.0, 0.0, 0.0, 10.0, 12.0]))  # acc: nobody's count
    totals = sums.totals(ranks, torch.device("cpu"))
    assert {k: (t.item(), c.item()) for k, (t, c) in totals.items()} == {"loss": (10.0, 12.0)}
    assert len(ranks.gathered) == 1  # no gather once the names are agreed
    part = sums.part(ranks, torch.device("cpu"), torch.float32)
    assert part.tolist() == [0.0, 1.0, 2.0, 5.0, 2.0]
    sums.take(torch.tensor([0.0, 0.5, 1.0, 9.0, 8.0]))  # one sample's acc is kept
    totals = sums.totals(ranks, torch.device("cpu"))
    assert {k: (t.item(), c.item()) for k, (t, c) in totals.items()} == {
        "acc": (0.5, 1.0), "loss": (9.0, 8.0)}  # fmt: skip
    # a name outside the agreed ones: flagged, and the round's values gathered
    ranks.others = [{"loss": (2.0, 2.0)}, {}]
    part = sums.part(ranks, torch.device("cpu"), torch.float32)
    assert part[0].item() == 1.0
    sums.take(torch.tensor([1.0, 0.0, 0.0, 3.0, 3.0]))
    totals = sums.totals(ranks, torch.device("cpu"))
    assert ranks.gathered[-1] == {"loss": (1.0, 1.0), "f1": (0.5, 1.0)}
    assert {k: (t.item(), c.item()) for k, (t, c) in totals.items()} == {
        "loss": (3.0, 3.0), "f1": (0.5, 1.0)}  # fmt: skip
    assert sums.part(ranks, torch.device("cpu"), torch.bfloat16) is None  # gathered instead
    assert sums.totals(None, torch.device("cpu"))["loss"][0].item() == 7.0  # one process


def test_the_agreed_names_are_sorted_whatever_the_order_the_ranks_list_them():
    """Every rank must lay the sum out alike: the names sorted, not in a set's order
    (string hashing differs between processes)."""
    names = ["d", "a", "c", "b", "e", "h", "g", "f"]
    sums = RoundMetricSums(lambda: {})
    sums.part(_Ranks([names[:4], names[4:]]), torch.device("cpu"), torch.float64)
    assert sums.names == tuple(sorted(names))
