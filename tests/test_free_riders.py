"""Free-rider attacks (Fraboni et al. AISTATS 2021; thesis ch. 6, Alg. 8) and detection."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fl import FederatedStrategy, UniformSampler
from lightning_fl.callbacks import FedAvg, FedProx, FreeRiderDetector, FreeRiders
from tests.helpers import make_trainer, max_abs_diff, params_of, tiny_clients, tiny_datamodule
from tests.helpers import tiny_module as _tiny_module

ROUNDS = 3


def _fit(callbacks, rounds=ROUNDS, lr=0.1, num_clients=5, **kw):
    module = _tiny_module(lr)
    trainer = make_trainer(FederatedStrategy(local_steps=3, seed=2), rounds, callbacks, **kw)
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=num_clients))
    return module, trainer


def _fair_total(num_clients=5):
    return sum(len(c["train"][1]) for c in tiny_clients(num_clients=num_clients))


@pytest.mark.parametrize("riders", [1, 5, 45])
def test_plain_free_riders_scale_the_fair_updates_by_their_share(riders):
    """Plain free-riders send Δ = 0 with weight M_k/N, so FedAvg becomes
    θ ← θ + Σ_j (M_j/N) Δ_j: FedAvg with η_g = N_fair/N, exactly."""
    fair = _fair_total()
    declared = round(fair / 5)
    n = fair + riders * declared
    reference, _ = _fit([FedAvg(server_lr=fair / n)])
    attack = FreeRiders(riders, "plain")
    attacked, _ = _fit([FedAvg(), attack])
    assert max_abs_diff(params_of(reference), params_of(attacked)) < 1e-7
    assert attack.free_rider_share == pytest.approx(riders * declared / n)
    assert all(float(u.abs().max()) == 0.0 for u in attack.updates.values())


def test_disguised_free_riders_add_noise_of_the_prescribed_scale():
    """With lr = 0 the fair clients send Δ = 0, so θ^{t+1} − θ^t = Σ_k (M_k/N) φ(t) ε_k: its
    entries have std (M/N)·φ(t)·√K, with φ(0) = 10⁻³ and φ(t) = coef·σ·t^{−γ} afterwards."""
    riders, coef, gamma = 4, 3.0, 0.5
    attack = FreeRiders(riders, "disguised", declared_samples=1000, coef=coef, gamma=gamma)
    module = _tiny_module(0.0)
    torch.manual_seed(0)
    module.network = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6, 3000))
    module.network.append(torch.nn.Linear(3000, 3))
    history = []

    from lightning.pytorch import Callback

    class Record(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            history.append(torch.cat([p.detach().flatten() for p in pl_module.parameters()]))

    trainer = make_trainer(
        FederatedStrategy(local_steps=1, seed=2), 3, [FedAvg(), attack, Record()]
    )
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=5))
    history.append(torch.cat([p.detach().flatten() for p in module.parameters()]))
    share = 1000 / (_fair_total() + riders * 1000)
    steps = [history[k + 1] - history[k] for k in range(3)]
    assert float(steps[0].std()) == pytest.approx(share * 1e-3 * riders**0.5, rel=0.03)
    sigma = float(steps[0].pow(2).mean().sqrt())  # the thesis's fitted zero-mean std
    assert attack.sigma == pytest.approx(sigma, rel=1e-5)
    for t in (1, 2):
        expected = share * coef * sigma * t ** (-gamma) * riders**0.5
        assert float(steps[t].std()) == pytest.approx(expected, rel=0.03)


def test_sigma_can_be_read_as_the_authors_mean_absolute_increment():
    attack = FreeRiders(2, "disguised", sigma_estimate="mean_abs")
    module, _ = _fit([FedAvg(), attack], rounds=2)
    assert attack.sigma is not None and attack.sigma > 0
    # the mean |Δ| of a Gaussian is sqrt(2/π) of its std: different from the "std" estimate
    other = FreeRiders(2, "disguised", sigma_estimate="std")
    _fit([FedAvg(), other], rounds=2)
    assert attack.sigma != pytest.approx(other.sigma, rel=1e-3)


def test_free_riders_work_with_fedprox():
    _, trainer = _fit([FedAvg(), FedProx(mu=1.0), FreeRiders(5, "disguised")])
    assert trainer.current_epoch == ROUNDS


def test_detector_flags_plain_free_riders_without_false_alarms():
    detector = FreeRiderDetector()
    _, trainer = _fit([FedAvg(), FreeRiders(3, "plain"), detector])
    assert sorted(detector.flagged) == [5, 6, 7]
    assert trainer.callback_metrics["free_riders/detection_rate"].item() == 1.0
    assert trainer.callback_metrics["free_riders/false_alarm_rate"].item() == 0.0


def test_detector_catches_disguised_free_riders_on_shared_descent_directions():
    detector = FreeRiderDetector()
    _, trainer = _fit([FedAvg(), FreeRiders(2, "disguised"), detector], rounds=4)
    assert trainer.callback_metrics["free_riders/detection_rate"].item() == 1.0
    assert trainer.callback_metrics["free_riders/false_alarm_rate"].item() == 0.0


def test_resume_keeps_sigma_and_is_exact(tmp_path):
    def attack():
        return FreeRiders(3, "disguised", coef=3.0)

    full, _ = _fit([FedAvg(), attack()], rounds=4)
    checkpoint = ModelCheckpoint(tmp_path, "{epoch}", save_top_k=-1, every_n_epochs=1)
    _fit([FedAvg(), attack(), checkpoint], rounds=2, enable_checkpointing=True)
    module = _tiny_module(0.1, seed=7)
    resumed = attack()
    trainer = make_trainer(FederatedStrategy(local_steps=3, seed=2), 4, [FedAvg(), resumed])
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=5),
                ckpt_path=str(tmp_path / "epoch=1.ckpt"), weights_only=True)  # fmt: skip
    assert max_abs_diff(params_of(full), params_of(module)) == 0.0


def test_bad_free_rider_settings_are_refused():
    with pytest.raises(ValueError, match="declared_samples must be >= 0"):
        FreeRiders(2, declared_samples=-5)
    with pytest.raises(ValueError, match="num_free_riders must be >= 0"):
        FreeRiders(-1)
    with pytest.raises(ValueError, match="mode must be 'plain' or 'disguised'"):
        FreeRiders(1, "sneaky")
    with pytest.raises(ValueError, match="declared_samples = 0 gives the free-riders no weight"):
        _fit([FedAvg(), FreeRiders(2, declared_samples=0)], rounds=1)
    module = _tiny_module(0.1)
    trainer = make_trainer(FederatedStrategy(sampler=UniformSampler(2), local_steps=1), 1,
                           [FedAvg(), FreeRiders(1)])  # fmt: skip
    with pytest.raises(ValueError, match="FreeRiders cannot be combined with UniformSampler"):
        trainer.fit(module, datamodule=tiny_datamodule(num_clients=5))


def test_the_recipes_documented_flags_reach_the_free_riders(tmp_path):
    """recipes/robustness/digits_free_riders.yaml documents
    ``--trainer.callbacks.init_args.mode plain``: LightningCLI applies it to the last
    callback, which must be FreeRiders (it was ModelCheckpoint, whose ``mode`` it broke)."""
    from pathlib import Path

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_fl.callbacks import FreeRiders
    from lightning_fl.cli import run

    recipe = Path(__file__).resolve().parents[1] / "recipes/robustness/digits_free_riders.yaml"
    cli = run(
        ["fit", "--config", str(recipe), "--trainer.max_epochs", "1",
         "--trainer.callbacks.init_args.mode", "plain", "--trainer.callbacks.init_args.gamma",
         "2.0", "--trainer.default_root_dir", str(tmp_path),
         "--trainer.logger.init_args.save_dir", str(tmp_path)]
    )  # fmt: skip
    (riders,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, FreeRiders)]
    assert (riders.mode, riders.gamma) == ("plain", 2.0)
    (checkpoint,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    assert checkpoint.mode == "min"


def test_zero_free_riders_leave_fedavg_exactly_as_it_is():
    """K = 0 is the attack's lower end: the fair clients keep M_j/N_fair, the model is plain
    FedAvg's to the bit, and the share is 0."""
    reference, _ = _fit([FedAvg()])
    attack = FreeRiders(0, "disguised", coef=3.0)
    attacked, _ = _fit([FedAvg(), attack])
    assert max_abs_diff(params_of(reference), params_of(attacked)) == 0.0
    assert attack.free_rider_share == 0.0 and attack.updates == {}


def test_the_default_declared_size_is_the_fair_mean_rounded_to_the_nearest_sample():
    """Fair clients of 4, 18 and 25 samples: the mean 15.67 declares 16 samples a rider
    (not 15, the mean cut down, nor the fraction itself), so two plain riders take
    32/79 of the weight and FedAvg runs with η_g = 47/79."""
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    def fit(callbacks):
        module = _tiny_module(0.1)
        clients = [tiny_clients(num_clients=4)[c] for c in (0, 2, 3)]
        assert [len(c["train"][1]) for c in clients] == [4, 18, 25]
        trainer = make_trainer(FederatedStrategy(local_steps=3, seed=2), ROUNDS, callbacks)
        trainer.fit(module, datamodule=InMemoryFederatedDataModule(clients, batch_size=4))
        return module

    attack = FreeRiders(2, "plain")
    attacked = fit([FedAvg(), attack])
    reference = fit([FedAvg(server_lr=47 / 79)])
    assert attack.free_rider_share == 32 / 79
    assert max_abs_diff(params_of(reference), params_of(attacked)) < 1e-7


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(coef=-1.0), "coef and gamma must be >= 0"),
        (dict(gamma=-0.5), "coef and gamma must be >= 0"),
        (dict(coef=float("nan")), "coef and gamma must be >= 0"),
        (dict(gamma=float("nan")), "coef and gamma must be >= 0"),
    ],
)
def test_a_negative_or_nan_coef_or_gamma_alone_is_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        FreeRiders(2, "disguised", **settings)


def test_coef_and_gamma_at_zero_are_accepted_and_mean_what_they_say():
    """coef = 0: a disguised rider sends φ = 0 from round 1 on (round 0's 10⁻³ aside);
    γ = 0: no decay, φ(t) = coef·σ for every t."""
    still = FreeRiders(1, "disguised", coef=0.0)
    flat = FreeRiders(1, "disguised", coef=2.0, gamma=0.0)
    _fit([FedAvg(), still])
    _fit([FedAvg(), flat])
    assert [still.phi(t) for t in (1, 2, 5)] == [0.0, 0.0, 0.0]
    assert [flat.phi(t) for t in (0, 1, 2, 5)] == [2.0 * flat.sigma] * 4  # t⁰ = max(0, 1)⁰
    assert float(still.updates[5].abs().max()) == 0.0


@pytest.mark.parametrize("z", [0.0, -1.0, float("nan")])
def test_a_detector_threshold_at_or_below_zero_is_refused(z):
    with pytest.raises(ValueError, match="z must be > 0"):
        FreeRiderDetector(z=z)


def test_the_detector_judges_a_round_of_exactly_two_updates():
    """One fair client and one plain rider: the rider's zero update is flagged, and the fair
    client is not, though its only other update has no direction to compare with."""
    detector = FreeRiderDetector()
    _, trainer = _fit([FedAvg(), FreeRiders(1, "plain"), detector], num_clients=1)
    assert detector.flagged == [1]
    assert trainer.callback_metrics["free_riders/detection_rate"].item() == 1.0
    assert trainer.callback_metrics["free_riders/false_alarm_rate"].item() == 0.0


def test_the_detector_threshold_is_strict_and_needs_a_direction_to_compare_with():
    """d = 4: e₁ against the other update (1, 1, 1, 1) has cosine 1/2 exactly, the threshold
    z/√d of z = 1, so it is not flagged (|cos| < z/√d), and is just above it. An update whose
    others cancel (mean 0) or are all zero is not flagged: nothing to compare with."""
    e1 = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    ones = torch.ones(4, dtype=torch.float64)
    updates = {0: e1, 1: ones}
    assert not FreeRiderDetector(z=1.0)._suspicious(0, e1, updates)
    assert FreeRiderDetector(z=1.0 + 1e-9)._suspicious(0, e1, updates)
    cancelling = {0: e1, 1: ones, 2: -ones}
    assert not FreeRiderDetector(z=10.0)._suspicious(0, e1, cancelling)
    silent = {0: e1, 1: torch.zeros(4, dtype=torch.float64)}
    assert not FreeRiderDetector(z=10.0)._suspicious(0, e1, silent)
    assert FreeRiderDetector(z=10.0)._suspicious(1, silent[1], silent)


def test_the_fair_mean_counts_every_client_with_data_and_only_those():
    """Clients of 4, 18, 25, 1 and 0 training samples: the four with data have mean 12
    (not 9.6 over all five, nor 15.67 without the one-sample client), so two riders
    declare 24 of 72 samples."""
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    clients = [tiny_clients(num_clients=4)[c] for c in (0, 2, 3)]
    one, empty = dict(clients[0]), dict(clients[0])
    one["train"] = tuple(t[:1] for t in clients[0]["train"])
    empty["train"] = tuple(t[:0] for t in clients[0]["train"])
    attack = FreeRiders(2, "plain")
    trainer = make_trainer(FederatedStrategy(local_steps=1, seed=2), 1, [FedAvg(), attack])
    datamodule = InMemoryFederatedDataModule([*clients, one, empty], batch_size=4)
    trainer.fit(_tiny_module(0.1), datamodule=datamodule)
    assert attack.free_rider_share == 24 / 72


def test_the_detector_rates_count_flagged_riders_and_fair_clients_apart():
    """d = 4, z = 1 (|cos| < 1/2 flagged). Fair updates (1, 1, 1, 1), (1, 1, 1, 0.9), 0 and
    (1, 1, 1, 1.1); riders 0 and (1, 1, 1, 1.2). Flagged: the two zero updates only (every
    other update's cosine with its others' mean is above 0.9), so the detection rate is
    1/2 and the false-alarm rate 1/4."""
    from types import SimpleNamespace

    fair = [[1, 1, 1, 1], [1, 1, 1, 0.9], [0, 0, 0, 0], [1, 1, 1, 1.1]]
    attack = FreeRiders(2, "plain")
    attack.updates = {4: torch.zeros(4), 5: torch.tensor([1.0, 1.0, 1.0, 1.2])}
    logged = {}
    module = SimpleNamespace(log=lambda name, value, **kw: logged.__setitem__(name, value))
    trainer = SimpleNamespace(callbacks=[attack])
    detector = FreeRiderDetector(z=1.0)
    detector.on_round_start(trainer, module, None)
    for client, update in enumerate(fair):
        detector.on_client_end(trainer, module, client, [torch.tensor(update)], None)
    detector.on_train_epoch_end(trainer, module)
    assert sorted(detector.flagged) == [2, 4]
    assert logged == {"free_riders/detection_rate": 0.5, "free_riders/false_alarm_rate": 0.25}


def test_riders_that_join_a_resumed_run_read_sigma_from_their_first_round(tmp_path):
    """Two rounds without riders, checkpointed; resumed with disguised riders for three
    more: σ is fitted to the global increment of round 2 (the riders' first, whose noise
    is 10⁻³), sqrt(mean Δ²), and the rounds after it use coef·σ·t^{−γ}."""
    from lightning.pytorch import Callback

    checkpoint = ModelCheckpoint(tmp_path, "{epoch}", save_top_k=-1, every_n_epochs=1)
    _fit([FedAvg(), checkpoint], rounds=2, enable_checkpointing=True)
    starts = []

    class Record(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            starts.append(torch.cat([p.detach().flatten() for p in pl_module.parameters()]))

    attack = FreeRiders(3, "disguised", coef=3.0)
    trainer = make_trainer(FederatedStrategy(local_steps=3, seed=2), 5, [FedAvg(), attack,
                                                                         Record()])  # fmt: skip
    trainer.fit(_tiny_module(0.1, seed=7), datamodule=tiny_datamodule(num_clients=5),
                ckpt_path=str(tmp_path / "epoch=1.ckpt"), weights_only=True)  # fmt: skip
    increment = (starts[1] - starts[0]).double()
    assert attack.sigma == pytest.approx(float(increment.pow(2).mean().sqrt()), rel=1e-5)
    assert attack.phi(4) == pytest.approx(3.0 * attack.sigma / 4)
    assert attack.phi(0) == attack.phi(1) == pytest.approx(3.0 * attack.sigma)  # max(t, 1)
