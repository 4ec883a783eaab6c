"""Bad input gets a clear error naming the problem and the fix, or the documented handling."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_fl import AsyncSchedule, FederatedStrategy, NonFiniteUpdateError, UniformSampler
from lightning_fl.callbacks import (
    APFL,
    DPSGD,
    AsynchronousFL,
    Ditto,
    FedAdam,
    FedAvg,
    FedProx,
    FedRep,
    FineTune,
    KNNPer,
    PFedMe,
)
from lightning_fl.datamodules import InMemoryFederatedDataModule, dirichlet_partition
from tests.helpers import (
    local_sgd,
    make_trainer,
    max_abs_diff,
    params_of,
    tiny_clients,
    tiny_datamodule,
    tiny_module,
)


def test_more_clients_per_round_than_clients():
    trainer = make_trainer(FederatedStrategy(sampler=UniformSampler(11), local_steps=1), 1)
    with pytest.raises(ValueError, match="clients_per_round=11 but only 10 clients"):
        trainer.fit(tiny_module(), datamodule=tiny_datamodule())


@pytest.mark.parametrize("alpha", [0.0, -1.0])
def test_dirichlet_alpha_must_be_positive(alpha):
    with pytest.raises(ValueError, match="alpha must be > 0"):
        dirichlet_partition([0, 1, 2, 3], 2, alpha, seed=0)


def _clients_with_empty(indices):
    clients = tiny_clients()
    for c in indices:
        x, y = clients[c]["train"]
        clients[c]["train"] = (x[:0], y[:0])
    return clients


def test_client_without_training_data_is_skipped_with_a_warning():
    dm = InMemoryFederatedDataModule(_clients_with_empty([0, 4]), batch_size=4)
    strategy = FederatedStrategy(local_steps=2)
    with pytest.warns(UserWarning, match=r"Skipping 2 client\(s\) with no training data: \[0, 4\]"):
        make_trainer(strategy, 2, [FedAvg()]).fit(tiny_module(), datamodule=dm)
    assert 0 not in strategy.current_round.schedule.clients
    assert len(strategy.current_round.schedule.clients) == 8


def test_every_client_empty_is_an_error():
    dm = InMemoryFederatedDataModule(_clients_with_empty(range(10)), batch_size=4)
    with pytest.raises(ValueError, match="Every client has an empty training set"):
        make_trainer(FederatedStrategy(local_steps=1), 1).fit(tiny_module(), datamodule=dm)


def _poisoned_datamodule():
    clients = tiny_clients()
    x, y = clients[3]["train"]
    clients[3]["train"] = (torch.full_like(x, math.nan), y)
    return InMemoryFederatedDataModule(clients, batch_size=4)


def test_nan_update_is_dropped_and_training_goes_on():
    module = tiny_module()
    strategy = FederatedStrategy(local_steps=2, max_consecutive_bad_rounds=10)
    with pytest.warns(UserWarning, match="client 3 sent an update with NaN or Inf"):
        trainer = make_trainer(strategy, 3, [FedAvg()])
        trainer.fit(module, datamodule=_poisoned_datamodule())
    assert strategy.current_round.state.dropped == [3]
    assert trainer.callback_metrics["fl/dropped_updates"] == 1
    assert all(torch.isfinite(p).all() for p in params_of(module))


def test_nan_update_equals_round_without_that_client_weight():
    """A dropped update contributes nothing; the others keep their weights ω_i = n_i/n
    (not renormalized): θ¹ = θ⁰ + Σ_{i≠3} ω_i Δ_i, computed by hand."""
    poisoned = tiny_module()
    strategy = FederatedStrategy(local_steps=2, seed=0)
    with pytest.warns(UserWarning, match="NaN or Inf"):
        make_trainer(strategy, 1, [FedAvg()]).fit(poisoned, datamodule=_poisoned_datamodule())
    assert strategy.current_round.state.accepted == [c for c in range(10) if c != 3]

    clients = tiny_clients()
    counts = torch.tensor([len(c["train"][1]) for c in clients], dtype=torch.float64)
    weights = counts / counts.sum()
    net = tiny_module().network
    theta = params_of(net)
    expected = [t.clone() for t in theta]
    for c in range(10):
        if c == 3:
            continue
        with torch.no_grad():
            for q, t in zip(net.parameters(), theta):
                q.copy_(t)
        local_sgd(net, clients[c]["train"], 2, 0.1, 4, 0, 0, c)
        for e, q, t in zip(expected, net.parameters(), theta):
            e += float(weights[c]) * (q.detach() - t)
    assert max_abs_diff(params_of(poisoned), expected) <= 1e-6


def test_consecutive_bad_rounds_stop_training():
    strategy = FederatedStrategy(local_steps=2, max_consecutive_bad_rounds=2)
    with (
        pytest.warns(UserWarning),
        pytest.raises(NonFiniteUpdateError, match="2 consecutive rounds"),
    ):
        make_trainer(strategy, 5, [FedAvg()]).fit(tiny_module(), datamodule=_poisoned_datamodule())


def test_two_aggregators_are_refused():
    trainer = make_trainer(FederatedStrategy(local_steps=1), 1, [FedAvg(), FedAdam()])
    with pytest.raises(ValueError, match="Exactly one aggregator callback.*FedAvg, FedAdam"):
        trainer.fit(tiny_module(), datamodule=tiny_datamodule())


def test_gradient_accumulation_is_refused():
    trainer = make_trainer(FederatedStrategy(local_steps=1), 1, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match="accumulate_grad_batches=1"):
        trainer.fit(tiny_module(), datamodule=tiny_datamodule())


def test_plain_datamodule_is_refused():
    class Plain(pl.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 6)))

    with pytest.raises(TypeError, match="needs a lightning_fl.datamodules.FederatedDataModule"):
        make_trainer(FederatedStrategy(local_steps=1), 1).fit(tiny_module(), datamodule=Plain())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"local_steps": 1, "local_epochs": 1}, "either local_steps or local_epochs"),
        ({"local_steps": 0}, "local_steps must be >= 1"),
        ({"max_consecutive_bad_rounds": 0}, "max_consecutive_bad_rounds must be >= 1"),
        ({"local_steps": None, "local_epochs": 0}, r"local_epochs must be >= 1, got 0\."),
        ({"num_threads": 0}, r"num_threads must be 'auto', None or an int >= 1, got 0\."),
        ({"num_threads": "2"}, r"num_threads must be 'auto', None or an int >= 1, got '2'\."),
        ({"max_vectorized_clients": 0}, r"max_vectorized_clients must be >= 1 or None, got 0\."),
        ({"vectorize": True, "local_steps_per_training_step": 0},
         r"local_steps_per_training_step must be >= 1 or None, got 0\."),
        ({"vectorize": True, "local_steps_per_training_step": 2.0},
         r"local_steps_per_training_step must be >= 1 or None, got 2\.0\."),
    ],
)  # fmt: skip
def test_impossible_strategy_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FederatedStrategy(**kwargs)


def test_each_strategy_bound_is_accepted_at_its_edge():
    """The smallest valid value of every bound above, and both ways of leaving one unset."""
    FederatedStrategy(local_steps=1, max_consecutive_bad_rounds=1, num_threads=1,
                      max_vectorized_clients=1)  # fmt: skip
    FederatedStrategy(local_steps=None, local_epochs=1, num_threads=None)
    FederatedStrategy(vectorize=True, local_steps_per_training_step=None, num_threads="auto")


def test_manual_optimization_is_supported_and_matches_automatic():
    class Manual(type(tiny_module())):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
            self.manual_backward(loss)
            opt.step()

    auto = tiny_module()
    make_trainer(FederatedStrategy(sampler=UniformSampler(3), local_steps=3), 2, [FedAvg()]).fit(
        auto, datamodule=tiny_datamodule()
    )
    torch.manual_seed(1)
    manual = Manual(network=type(auto.network)(6, (8,), 3), lr=0.1)
    strategy = FederatedStrategy(sampler=UniformSampler(3), local_steps=3)
    make_trainer(strategy, 2, [FedAvg()]).fit(manual, datamodule=tiny_datamodule())
    assert all(torch.equal(a, b) for a, b in zip(params_of(auto), params_of(manual)))
    assert any(not torch.equal(a, b) for a, b in zip(params_of(auto), params_of(tiny_module())))


@pytest.mark.parametrize("vectorize", [False, True])
def test_an_exploding_loss_warns_once_and_a_healthy_run_does_not(vectorize):
    """Sequential clients and vectorized ones (a vector of the clients' losses per step)
    are watched alike."""
    import warnings

    from lightning_fl.engine.divergence import DivergenceWarning

    exploding = FederatedStrategy(local_steps=3, max_consecutive_bad_rounds=10, vectorize=vectorize)
    with pytest.warns(DivergenceWarning, match="diverging. Lower the learning rate") as record:
        make_trainer(exploding, 3).fit(tiny_module(lr=1e6), datamodule=tiny_datamodule())
    (warned,) = [w for w in record if issubclass(w.category, DivergenceWarning)]
    # shown at the engine's line that ends the round, not in Lightning's loop
    assert Path(warned.filename).name == "driver.py"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        make_trainer(FederatedStrategy(local_steps=3, vectorize=vectorize), 3).fit(
            tiny_module(), datamodule=tiny_datamodule()
        )


def test_divergence_is_watched_afresh_each_fit_and_through_a_dict_loss():
    """A second fit on the same Trainer warns again (the monitor is reset at each fit's
    start: its first loss and its warning are the fit's); a training_step that returns
    ``{"loss": ...}`` is watched as one that returns the tensor."""
    from lightning_fl.engine.divergence import DivergenceWarning

    class DictLoss(type(tiny_module())):
        def training_step(self, batch, batch_idx):
            return {"loss": super().training_step(batch, batch_idx)}

    strategy = FederatedStrategy(local_steps=3, max_consecutive_bad_rounds=10)
    trainer = make_trainer(strategy, 3)
    with pytest.warns(DivergenceWarning, match="diverging"):
        trainer.fit(tiny_module(lr=1e6), datamodule=tiny_datamodule())
    trainer.fit_loop.max_epochs = 6
    with pytest.warns(DivergenceWarning, match="Round 3: "):
        trainer.fit(tiny_module(lr=1e6), datamodule=tiny_datamodule())
    torch.manual_seed(1)
    dict_loss = DictLoss(network=type(tiny_module().network)(6, (8,), 3), lr=1e6)
    with pytest.warns(DivergenceWarning, match="diverging"):
        make_trainer(FederatedStrategy(local_steps=3, max_consecutive_bad_rounds=10), 3).fit(
            dict_loss, datamodule=tiny_datamodule()
        )


def test_a_first_training_loss_of_exactly_zero_is_the_fits_reference():
    """The driver hands the monitor every step's loss, one of exactly 0 included: a fit
    whose first step's loss is 0 has no reference (nothing is "100× 0") and does not
    warn, though it then diverges at lr = 10⁶; the zero step counts in round 0's mean."""
    import warnings

    from lightning_fl.engine.divergence import DivergenceWarning

    class ZeroFirst(type(tiny_module())):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return 0 * loss if self.trainer.global_step == 0 else loss

    torch.manual_seed(1)
    module = ZeroFirst(network=type(tiny_module().network)(6, (8,), 3), lr=1e6)
    strategy = FederatedStrategy(local_steps=3, max_consecutive_bad_rounds=10)
    observed = []
    observe = strategy.divergence.observe
    strategy.divergence.observe = lambda loss: observed.append(float(loss)) or observe(loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        make_trainer(strategy, 3).fit(module, datamodule=tiny_datamodule())
    assert strategy.divergence.first == 0.0 and observed[0] == 0.0
    assert len(observed) == 3 * 3 * 10 and max(observed) > 1e3  # every step, diverging


def test_the_divergence_threshold_is_the_rounds_mean_over_every_step_by_hand():
    """A fresh monitor, factor 100: the first step's loss (the first entry of a vector of
    clients' losses) is the reference; a round's mean counts every step of every client
    and restarts each round; a mean of exactly 100 × first does not warn, one above does,
    and only once per fit."""
    import warnings

    from lightning_fl.engine.divergence import DivergenceMonitor, DivergenceWarning

    monitor = DivergenceMonitor(factor=100.0)
    monitor.observe(torch.tensor([2.0, 500.0]))  # first = 2: threshold 200
    monitor.observe(torch.tensor(98.0))  # round 0: (2 + 500 + 98) / 3 = 200, not above
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        monitor.end_round(0)
    monitor.observe(torch.tensor(399.0))
    monitor.observe(torch.tensor([4.0, 1.0]))  # round 1: 404 / 3 = 134.7, not above
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        monitor.end_round(1)
    monitor.observe(torch.tensor([600.0, 3.0]))  # round 2: 603 / 3 = 201 > 200
    monitor.observe(torch.tensor(0.0))
    with pytest.warns(DivergenceWarning, match=r"Round 2: the mean training loss is 201, 100×"):
        monitor.end_round(2)
    monitor.observe(torch.tensor(1e6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        monitor.end_round(3)  # warned once already
    monitor.reset()  # a new fit: the reference and the warning start over
    monitor.observe(torch.tensor(1.0))
    monitor.observe(torch.tensor(300.0))
    with pytest.warns(DivergenceWarning, match=r"Round 0: the mean training loss is 150"):
        monitor.end_round(0)
    monitor.reset()  # a first loss of 0 is no reference: nothing is "100× 0"
    monitor.observe(torch.tensor(0.0))
    monitor.observe(torch.tensor(5.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DivergenceWarning)
        monitor.end_round(0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: tiny_module(lr=math.nan), "lr is NaN: give a finite number ≥ 0, e.g. lr=0.05."),
        (lambda: tiny_module(lr=-math.inf), "lr is minus infinite: give a finite number ≥ 0"),
        (lambda: tiny_module(lr=-0.1), "lr is -0.1, not ≥ 0: give a finite number ≥ 0"),
        (lambda: FedAvg(server_lr=0.0), "server_lr is 0.0, not > 0: give a finite number > 0"),
        (lambda: FedAvg(server_lr=math.inf), "server_lr is infinite: give a finite number > 0"),
        (lambda: FedAdam(server_lr=math.nan), "server_lr is NaN: give a finite number > 0"),
        (lambda: FedAvg(server_lr="1"), "server_lr is str '1', not a number"),
        (lambda: AsynchronousFL(AsyncSchedule(), server_lr=-1.0), "server_lr is -1.0, not > 0"),
    ],
)
def test_non_finite_rates_are_refused_by_name(make, message):
    """A NaN rate used to train rounds of NaN updates and stop on "Lower the learning
    rate" (issue 38)."""
    with pytest.raises(ValueError) as raised:
        make()
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FineTune(lr=0.0), "lr is 0.0, not > 0"),
        (lambda: FineTune(lr=math.nan), "lr is NaN"),
        (lambda: Ditto(lam=math.nan), "lam is NaN: give a finite number ≥ 0"),
        (lambda: Ditto(lam=-0.1), "lam is -0.1, not ≥ 0"),
        (lambda: Ditto(personal_lr=0.0), "personal_lr is 0.0, not > 0"),
        (lambda: APFL(local_lr=math.inf), "local_lr is infinite"),
        (lambda: APFL(alpha_lr=math.nan), "alpha_lr is NaN"),
        (lambda: APFL(alpha=math.nan), "alpha must be in [0, 1]"),
        (lambda: APFL(alpha=1.01), "alpha must be in [0, 1]"),
        (lambda: FedRep(head_lr=-0.01), "head_lr is -0.01, not > 0"),
        (lambda: PFedMe(personal_lr=0.0), "personal_lr is 0.0, not > 0"),
        (lambda: PFedMe(lam=0.0), "lam is 0.0, not > 0"),
        (lambda: PFedMe(lam=math.nan), "lam is NaN"),
        (lambda: PFedMe(inner_steps=0), "inner_steps must be >= 1, got 0"),
        (lambda: FedProx(mu=math.nan), "mu is NaN: give a finite number ≥ 0"),
        (lambda: DPSGD(noise_multiplier=math.nan), "noise_multiplier is NaN"),
        (lambda: DPSGD(max_grad_norm=0.0), "max_grad_norm is 0.0, not > 0"),
        (lambda: KNNPer(scale=math.nan), "scale is NaN"),
    ],
)
def test_personalization_and_proximal_rates_are_refused_by_name(make, message):
    """A NaN or non-positive rate or weight of a client-side algorithm (and DP-SGD's noise
    and clip, kNN-Per's σ): its value and the argument's name (NaN passed the comparisons
    these arguments were checked with)."""
    with pytest.raises(ValueError) as raised:
        make()
    assert str(raised.value).startswith(message)


def test_personalization_settings_at_both_ends_of_their_ranges():
    """λ = 0 (Ditto: the personal model trains alone), μ = 0 (FedProx is FedAvg), α at 0
    and at 1 (APFL) and a single inner step (pFedMe) are valid."""
    assert Ditto(lam=0.0).lam == 0.0 and FedProx(mu=0.0).mu == 0.0
    assert APFL(alpha=0.0).alpha == 0.0 and APFL(alpha=1.0).alpha == 1.0
    assert PFedMe(inner_steps=1).inner_steps == 1  # one proximal step finds θ̂


def test_zero_momentum_and_weight_decay_are_valid():
    from lightning_fl import Classifier

    assert Classifier(lr=0.1, momentum=0.0, weight_decay=0.0).hparams.momentum == 0.0
    with pytest.raises(ValueError, match="momentum is -0.5, not ≥ 0"):
        Classifier(lr=0.1, momentum=-0.5)


def test_server_optimizer_settings_at_both_ends_of_their_ranges():
    """β ∈ [0, 1) for FedAvgM, β1 and β2 ∈ [0, 1) each for the adaptive optimizers, τ > 0
    and a starting second moment ≥ 0: each end accepted or refused as its range says, one
    bad value at a time."""
    from lightning_fl.callbacks import FedAvgM, FedYogi

    assert FedAvgM(beta=0.0).beta == 0.0
    for beta in (1.0, -0.1):
        with pytest.raises(ValueError, match=f"beta must be in \\[0, 1\\), got {beta}"):
            FedAvgM(beta=beta)
    assert FedAdam(beta1=0.0, beta2=0.0, initial_second_moment=0.0).initial_second_moment == 0.0
    assert FedYogi(tau=0.5).initial_second_moment == 0.25  # v_{-1} = τ² by default
    for kwargs in ({"beta1": 1.0}, {"beta2": 1.0}, {"beta1": -0.1}, {"beta2": -0.1}):
        with pytest.raises(ValueError, match="beta1 and beta2 must be in"):
            FedAdam(**kwargs)
    for tau in (0.0, -1e-3):
        with pytest.raises(ValueError, match=f"tau must be > 0, got {tau}"):
            FedAdam(tau=tau)
    with pytest.raises(ValueError, match="initial_second_moment must be >= 0"):
        FedAdam(initial_second_moment=-1e-9)


class _BadRoundCounts(pl.Callback):
    """Records the engine's count of consecutive bad rounds after each round."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.counts.append(trainer.strategy.engine.consecutive_bad_rounds)


def _rounds_sampler(rounds: list[list[int]]):
    from lightning_fl.systems.samplers import ClientSampler, Participation

    class Scheduled(ClientSampler):
        def sample(self, round_idx, seed, p):
            clients = rounds[round_idx]
            return Participation(tuple(clients), tuple(float(p[c]) for c in clients))

    return Scheduled()


@pytest.mark.parametrize(
    ("rounds", "counts", "stops"),
    [
        ([[3, 0], [1, 2], [3, 4], [5], [3, 6]], [1, 0, 1, 0, 1], False),  # clean rounds between
        ([[3, 0], [3, 1], [2], [3], [3]], [1, 2], True),  # two in a row: the limit
        ([[1], [3], [3, 4], [2]], [0, 1, 2], True),
    ],
)  # fmt: skip
def test_a_clean_round_resets_the_count_of_bad_rounds(rounds, counts, stops):
    """max_consecutive_bad_rounds = 2 with client 3 poisoned and the participants fixed
    per round: bad rounds separated by clean ones never stop training, two in a row do."""
    recorder = _BadRoundCounts()
    strategy = FederatedStrategy(sampler=_rounds_sampler(rounds), local_steps=1,
                                 max_consecutive_bad_rounds=2)  # fmt: skip
    trainer = make_trainer(strategy, len(rounds), [FedAvg(), recorder])
    with pytest.warns(UserWarning, match="client 3 sent an update with NaN or Inf"):
        if stops:
            with pytest.raises(NonFiniteUpdateError, match="2 consecutive rounds"):
                trainer.fit(tiny_module(), datamodule=_poisoned_datamodule())
        else:
            trainer.fit(tiny_module(), datamodule=_poisoned_datamodule())
    # a round that stops training raises before its round end is recorded
    assert recorder.counts + ([2] if stops else []) == counts
    assert strategy.engine.consecutive_bad_rounds == counts[-1]


@pytest.mark.parametrize("alpha", [0.0, math.nan])
def test_the_synthetic_mixtures_dirichlet_alpha_is_refused_at_zero_and_nan(alpha):
    from lightning_fl.datamodules.synthetic import generate_mixture_tasks

    with pytest.raises(ValueError, match=f"alpha must be > 0, got {alpha}"):
        generate_mixture_tasks(num_tasks=3, num_components=2, dimension=4, alpha=alpha)
