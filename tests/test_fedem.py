"""FedEM (Alg. 7) and D-FedEM (Alg. 8): the E-step by hand, M = 1 equals FedAvg, the
Trainer equals a hand-written FedEM loop, and π survives checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_fl import MLP, FederatedStrategy, MixtureClassifier
from lightning_fl.callbacks import FedEM, GossipAveraging
from lightning_fl.callbacks.fedem import STORE_KEY, e_step, update_mixture_weights
from lightning_fl.callbacks.gossip import erdos_renyi, metropolis_weights
from lightning_fl.datamodules import InMemoryFederatedDataModule
from lightning_fl.engine.seeding import derive_seed
from tests.helpers import (
    HIDDEN,
    IN,
    OUT,
    client_batches,
    make_trainer,
    max_abs_diff,
    params_of,
    tiny_clients,
    tiny_datamodule,
    tiny_module,
)

LR, STEPS, SEED, BATCH = 0.1, 3, 7, 4


def mixture(m: int = 2, seed: int = 1, lr: float = LR) -> MixtureClassifier:
    torch.manual_seed(seed)
    return MixtureClassifier(MLP(IN, (HIDDEN,), OUT), num_components=m, lr=lr)


def test_e_step_and_mixture_weights_match_a_case_computed_by_hand():
    module = MixtureClassifier(torch.nn.Linear(1, 2, bias=False), num_components=2)
    with torch.no_grad():
        module.network[0].weight.copy_(torch.tensor([[1.0], [0.0]]))  # logits (x, 0)
        module.network[1].weight.copy_(torch.tensor([[0.0], [2.0]]))  # logits (0, 2x)
    x = torch.tensor([[1.0], [-1.0], [0.5]])
    y = torch.tensor([0, 1, 1])
    prior = [0.25, 0.75]

    def ce(logits, label):
        return math.log(sum(math.exp(v) for v in logits)) - logits[label]

    expected_q = []
    for (xi,), yi in zip(x.tolist(), y.tolist()):
        losses = [ce([xi, 0.0], yi), ce([0.0, 2 * xi], yi)]
        joint = [p * math.exp(-loss) for p, loss in zip(prior, losses)]
        expected_q.append([j / sum(joint) for j in joint])
    expected_pi = [sum(q[m] for q in expected_q) / 3 for m in range(2)]

    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    q = e_step(module, loader, torch.log(torch.tensor(prior)))
    assert torch.allclose(q, torch.tensor(expected_q), atol=1e-6)
    assert torch.allclose(update_mixture_weights(q), torch.tensor(expected_pi), atol=1e-6)


def _fit(module, callbacks, rounds=3, dm=None, **kw):
    strategy = FederatedStrategy(local_steps=STEPS, seed=SEED)
    trainer = make_trainer(strategy, rounds, callbacks, **kw)
    trainer.fit(module, datamodule=dm or tiny_datamodule(BATCH))
    return trainer


def test_one_component_mixture_trains_like_fedavg():
    """Plumbing only (with M = 1, q ≡ 1 and π ≡ 1): the q-weighted loss, the frozen copy
    and the aggregation of a one-component mixture reduce to FedAvg. FedEM itself is
    checked against Alg. 7 below."""
    fedem = mixture(m=1)
    _fit(fedem, [FedEM()])
    fedavg = tiny_module(LR, seed=1)
    _fit(fedavg, [])
    assert max_abs_diff(params_of(fedem), params_of(fedavg)) < 1e-6


def _reference_fedem(rounds: int, m: int = 2, history: list | None = None):
    """Alg. 7 written out: E-step with θ^{k−1} and π^{k−1}, π update, J SGD steps on the
    q-weighted loss, θ_m^k = Σ_t (n_t/n) θ_{m,t}^k. ``history`` receives each round's π."""
    clients = tiny_clients()
    components = mixture(m).network
    theta = params_of(components)
    counts = torch.tensor([len(c["train"][1]) for c in clients], dtype=torch.float64)
    p = counts / counts.sum()
    pis = {c: torch.full((m,), 1.0 / m) for c in range(len(clients))}
    for r in range(rounds):
        new_theta = [torch.zeros_like(t) for t in theta]
        for c, data in enumerate(clients):
            with torch.no_grad():
                for q, t in zip(components.parameters(), theta):
                    q.copy_(t)
            x, y = data["train"]
            with torch.no_grad():
                losses = torch.stack(
                    [F.cross_entropy(h(x), y, reduction="none") for h in components], 1
                )
            joint = pis[c] * torch.exp(-losses)  # π_m exp(−ℓ_im)
            q_all = joint / joint.sum(1, keepdim=True)
            pis[c] = q_all.mean(0)
            _local_steps(components, x, y, q_all, r, c, LR)
            for acc, prm in zip(new_theta, components.parameters()):
                acc += float(p[c]) * prm.detach()
        theta = new_theta
        if history is not None:
            history.append(dict(pis))
    return theta, pis


def test_fedem_through_the_trainer_equals_algorithm_7():
    module = mixture(2)
    trainer = _fit(module, [FedEM()], rounds=3)
    theta, pis = _reference_fedem(3)
    assert max_abs_diff(params_of(module.network), theta) < 1e-5
    store = trainer.strategy.client_store
    for c, pi in pis.items():
        assert torch.allclose(store.get(c, STORE_KEY), pi, atol=1e-5)


def test_fedem_state_survives_checkpoint_and_resume(tmp_path):
    full = mixture(2)
    full_trainer = _fit(full, [FedEM()], rounds=4)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
    _fit(mixture(2), [FedEM(), ckpt_cb], rounds=2, enable_checkpointing=True)
    ckpt = tmp_path / "epoch=1.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert STORE_KEY in saved["callbacks"]["_RoundDriver"]["client_store"][0]
    resumed = mixture(2, seed=99)
    strategy = FederatedStrategy(local_steps=STEPS, seed=SEED)
    trainer = make_trainer(strategy, 4, [FedEM()])
    trainer.fit(resumed, datamodule=tiny_datamodule(BATCH), ckpt_path=str(ckpt), weights_only=True)
    for a, b in zip(params_of(full), params_of(resumed)):
        assert torch.equal(a, b)
    for c in range(10):
        assert torch.equal(
            full_trainer.strategy.client_store.get(c, STORE_KEY),
            trainer.strategy.client_store.get(c, STORE_KEY),
        )


def test_unseen_client_gets_one_e_step_from_uniform_and_is_reported_apart():
    clients = tiny_clients()
    dm = InMemoryFederatedDataModule(clients, batch_size=BATCH)
    dm.unseen_clients = [8, 9]
    module = mixture(2)
    callback = FedEM()
    trainer = _fit(module, [callback], rounds=2, dm=dm)
    assert all(trainer.strategy.client_store.get(c, STORE_KEY) is None for c in (8, 9))
    results = trainer.test(module, datamodule=dm, verbose=False)[0]
    assert "test_acc/unseen/weighted" in results and "test_acc/weighted" in results
    # the plain epoch metric excludes the unseen clients
    assert abs(results["test_acc"] - results["test_acc/weighted"]) < 1e-6

    callback.on_client_evaluation_start(trainer, module, 9)
    # by hand: q_im ∝ (1/2)·exp(−ℓ(h_m(x_i), y_i)) with the global components, π = mean q
    x, y = clients[9]["train"]
    with torch.no_grad():
        losses = torch.stack(
            [F.cross_entropy(h(x), y, reduction="none") for h in module.network], 1
        )
    joint = 0.5 * torch.exp(-losses.double())
    expected = (joint / joint.sum(1, keepdim=True)).mean(0)
    assert torch.allclose(module.log_mixture_weights.exp().double(), expected, atol=1e-6)


def test_metropolis_weights_are_symmetric_and_doubly_stochastic():
    adjacency = erdos_renyi(12, 0.5, seed=3)
    w = metropolis_weights(adjacency)
    assert torch.allclose(w, w.T)
    assert torch.allclose(w.sum(0), torch.ones(12, dtype=w.dtype))
    assert bool((w >= 0).all()) and bool((w[~adjacency & ~torch.eye(12, dtype=bool)] == 0).all())


def test_d_fedem_equals_local_steps_then_gossip():
    """One D-FedEM round (Alg. 8) with a given W: FedEM's local step at lr·T·n_t/n from
    the common initialization, then θ_t = Σ_s W_st θ_s."""
    clients = tiny_clients(num_clients=3)
    dm = InMemoryFederatedDataModule(clients, batch_size=BATCH)
    w = [[0.5, 0.25, 0.25], [0.25, 0.75, 0.0], [0.25, 0.0, 0.75]]
    module = mixture(2)
    trainer = _fit(module, [FedEM(), GossipAveraging(mixing_matrix=w)], rounds=1, dm=dm)
    counts = [len(c["train"][1]) for c in clients]
    # compare through the store against an explicit mix of independently trained halves
    theta_half = []
    for c in range(3):
        alone = mixture(2)
        ref = _one_client_fedem(alone, clients[c], c, LR * 3 * counts[c] / sum(counts))
        theta_half.append(ref)
    for t in range(3):
        expected = sum(w[s][t] * theta_half[s] for s in range(3))
        assert torch.allclose(
            trainer.strategy.client_store.get(t, "gossip_model"), expected, atol=1e-5
        )


def _local_steps(components, x, y, q_all, round_idx, client, lr):
    """Alg. 7's LocalSolver: STEPS SGD steps on Σ_m q_im ℓ_im / |batch|, in the strategy's
    data order and torch seed for (round, client)."""
    torch.manual_seed(derive_seed(SEED, "client", round_idx, client))
    done = 0
    while done < STEPS:
        for xb, yb, qb in client_batches((x, y, q_all), BATCH, SEED, round_idx, client):
            loss_m = torch.stack(
                [F.cross_entropy(h(xb), yb, reduction="none") for h in components], 1
            )
            grads = torch.autograd.grad((qb * loss_m).sum(1).mean(), list(components.parameters()))
            with torch.no_grad():
                for prm, g in zip(components.parameters(), grads):
                    prm -= lr * g
            done += 1
            if done == STEPS:
                break


def _one_client_fedem(module, data, client, lr):
    components = module.network
    x, y = data["train"]
    m = len(components)
    with torch.no_grad():
        losses = torch.stack([F.cross_entropy(h(x), y, reduction="none") for h in components], 1)
    q_all = torch.softmax(torch.log(torch.full((m,), 1.0 / m)) - losses, 1)
    _local_steps(components, x, y, q_all, 0, client, lr)
    return torch.cat([p.detach().reshape(-1) for p in components.parameters()])


def test_components_start_from_independent_draws_and_uniform_weights_by_hand():
    """Component 0 is the network itself; components 1 and 2 are copies whose every layer
    drew fresh weights, in order, from the global stream (a bare nn.Linear included); π
    starts uniform, so a fresh module predicts log(Σ_m softmax(h_m(x)) / M)."""
    import copy

    for make in (lambda: MLP(4, (5,), 3), lambda: torch.nn.Linear(4, 3)):
        torch.manual_seed(0)
        network = make()
        original = copy.deepcopy(network)
        torch.manual_seed(5)
        mixture = MixtureClassifier(network, num_components=3)
        torch.manual_seed(5)
        expected = [original]
        for _ in range(2):
            component = copy.deepcopy(original)
            for layer in component.modules():
                if hasattr(layer, "reset_parameters"):
                    layer.reset_parameters()
            expected.append(component)
        assert mixture.network[0] is network
        for got, want in zip(mixture.network, expected, strict=True):
            for a, b in zip(got.parameters(), want.parameters(), strict=True):
                assert torch.equal(a, b)
        first = [next(c.parameters()) for c in mixture.network]
        assert not torch.equal(first[1], first[0]) and not torch.equal(first[2], first[1])
        x = torch.randn(6, 4)
        probs = torch.stack([c(x).softmax(-1) for c in expected]).mean(0)
        with torch.no_grad():
            assert torch.allclose(mixture(x), probs.log(), atol=1e-6)


def test_the_em_surrogate_is_the_training_loss_only():
    """With responsibilities q set: in training, Σ_m q_im ℓ_m(x_i, y_i) averaged over the
    batch; in evaluation, the mixture's negative log-likelihood, as without q."""
    torch.manual_seed(2)
    mixture = MixtureClassifier(MLP(4, (5,), 3), num_components=2)
    mixture.log_mixture_weights = torch.tensor([0.3, 0.7]).log()
    x, y = torch.randn(5, 4), torch.tensor([0, 2, 1, 1, 0])
    q = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5], [1.0, 0.0], [0.3, 0.7]])
    mixture.responsibilities = lambda x_, y_: q
    with torch.no_grad():
        losses = torch.stack(
            [F.cross_entropy(c(x), y, reduction="none") for c in mixture.network], 1
        )
        probs = sum(w * c(x).softmax(-1) for w, c in zip((0.3, 0.7), mixture.network))
        nll = F.nll_loss(probs.log(), y)
        mixture.train()
        surrogate, _ = mixture.loss_and_metrics((x, y))
        assert torch.allclose(surrogate, (q * losses).sum(1).mean(), atol=1e-6)
        mixture.eval()
        evaluated, metrics = mixture.loss_and_metrics((x, y))
        assert torch.allclose(evaluated, nll, atol=1e-6)
        right = (probs.argmax(-1) == y).float().mean()
        assert 0 < right < 1 and float(metrics["acc"]) == float(right)
        mixture.train()
        mixture.responsibilities = None
        assert torch.allclose(mixture.loss_and_metrics((x, y))[0], nll, atol=1e-6)


def test_the_logged_entropy_and_the_seen_clients_test_loss_use_each_clients_own_pi():
    """Three rounds of Alg. 7 by hand give every client's π_t^3. ``fedem/pi_entropy`` is
    the mean of H(π_t) = −Σ_m π_tm log π_tm over the round's clients, and a seen client is
    tested with the mixture Σ_m π_tm softmax(h_θm(x)) of its own π (3.5): the test loss is
    the mean, over the clients' three test samples each, of that mixture's NLL."""
    module = mixture(2)
    trainer = _fit(module, [FedEM()], rounds=3)
    _, pis = _reference_fedem(3)
    entropies = [float(-(pi * pi.log()).sum()) for pi in pis.values()]
    logged = float(trainer.callback_metrics["fedem/pi_entropy"])
    assert abs(logged - sum(entropies) / len(entropies)) < 1e-6
    clients = tiny_clients()
    losses = []
    with torch.no_grad():
        for c, data in enumerate(clients):
            x, y = data["test"]
            probs = sum(w * h(x).softmax(-1) for w, h in zip(pis[c], module.network))
            losses.append(F.nll_loss(probs.log(), y))
    results = trainer.test(module, datamodule=tiny_datamodule(BATCH), verbose=False)[0]
    assert abs(results["test_loss/weighted"] - float(torch.stack(losses).mean())) < 1e-5
    # after the clients' evaluation the module is back on the uniform π
    assert torch.allclose(module.log_mixture_weights.exp(), torch.full((2,), 0.5))


def test_each_clients_training_steps_score_the_mixture_of_its_new_pi():
    """While client t trains in round k, the module's mixture weights are π_t^k, the M-step's
    result (the training accuracy is the mixture's under them): recorded at every step's
    backward, client by client (full participation, three steps each), against Alg. 7 by hand."""
    from lightning.pytorch import Callback

    seen = []

    class Record(Callback):
        def on_before_backward(self, trainer, pl_module, loss):  # inside the client's step
            seen.append(pl_module.log_mixture_weights.exp().detach().clone())

    _fit(mixture(2), [FedEM(), Record()], rounds=3)
    history = []
    _reference_fedem(3, history=history)
    expected = [history[r][c] for r in range(3) for c in range(10) for _ in range(STEPS)]
    assert len(seen) == len(expected)
    for got, want in zip(seen, expected):
        assert torch.allclose(got, want, atol=1e-5)


def test_fedem_refuses_a_module_that_is_not_a_mixture():
    trainer = make_trainer(FederatedStrategy(local_steps=1), 1, [FedEM()])
    with pytest.raises(TypeError, match="wrap your network as MixtureClassifier"):
        trainer.fit(tiny_module(LR), datamodule=tiny_datamodule(BATCH))


def test_the_entropy_of_a_round_with_one_client_is_that_clients():
    """One client in the federation: ``fedem/pi_entropy`` is H(π) of its π after the last
    round (a round's mean over one client is logged too)."""
    dm = InMemoryFederatedDataModule(tiny_clients(num_clients=2)[1:], batch_size=BATCH)
    trainer = _fit(mixture(2), [FedEM()], rounds=2, dm=dm)
    pi = trainer.strategy.client_store.get(0, STORE_KEY)
    assert float(trainer.callback_metrics["fedem/pi_entropy"]) == pytest.approx(
        float(-(pi * pi.log()).sum()), abs=1e-6
    )


def test_after_fit_the_module_predicts_with_the_uniform_mixture():
    """The global model is Σ_m softmax(h_θm)/M: no client's π stays on the module when the
    round ends, even without a validation pass (whose client evaluations reset it too)."""
    module = mixture(2)
    _fit(module, [FedEM()], rounds=2, limit_val_batches=0)
    assert torch.equal(module.log_mixture_weights.exp(), torch.full((2,), 0.5))
