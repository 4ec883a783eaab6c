"""Personalization baselines against hand-written references on tiny cases: FedAvg+,
Ditto, APFL, FedRep, pFedMe and Clustered FL."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_fl import FederatedStrategy
from lightning_fl.callbacks import APFL, ClusteredFL, Ditto, FedAvg, FedRep, FineTune, PFedMe
from lightning_fl.callbacks.clustered import complete_linkage_bipartition
from lightning_fl.datamodules import InMemoryFederatedDataModule
from lightning_fl.engine.seeding import derive_seed, generator
from lightning_fl.engine.tensors import unflatten
from tests.helpers import (
    local_sgd,
    make_trainer,
    max_abs_diff,
    params_of,
    tiny_clients,
    tiny_datamodule,
    tiny_module,
)

LR, STEPS, SEED, BATCH = 0.1, 3, 4, 4


def _one_client(index: int = 3) -> tuple[dict, InMemoryFederatedDataModule]:
    data = tiny_clients()[index]
    return data, InMemoryFederatedDataModule([data], batch_size=BATCH)


def _fit(module, callbacks, dm, rounds=1, **kw):
    trainer = make_trainer(FederatedStrategy(local_steps=STEPS, seed=SEED), rounds, callbacks, **kw)
    trainer.fit(module, datamodule=dm)
    return trainer


class _loader:  # noqa: N801 - used as the loader factory it replaces
    """Passes over ``data`` as a TensorDataset's loader makes them: each pass one randperm
    of the generator seeded with ``parts`` (or the samples in order), cut into batches."""

    def __init__(self, data, *parts, shuffle=True) -> None:
        self.data, self.shuffle = data, shuffle
        self.generator = generator(SEED, *parts)

    def __iter__(self):
        n = len(self.data[0])
        order = torch.randperm(n, generator=self.generator) if self.shuffle else torch.arange(n)
        for start in range(0, n, BATCH):
            yield [t[order[start : start + BATCH]] for t in self.data]


def _grads(net, params, x, y):
    return torch.autograd.grad(F.cross_entropy(net(x), y), params)


def _ditto_passes(net, params, train, anchor, lam, lr, epochs, *parts):
    """Ditto's personal update by hand, in place on ``params``: ``epochs`` passes of
    v ← v − η_p(∇F(v) + λ(v − anchor)) over the batches seeded by ``parts``."""
    loader = _loader(train, *parts)
    for _ in range(epochs):
        for x, y in loader:
            grads = _grads(net, params, x, y)
            with torch.no_grad():
                for p, g, w in zip(params, grads, anchor):
                    p -= lr * (g + lam * (p - w))


def _strategy_batches(data, round_idx=0, client=0):
    """The batches of the strategy's local steps for one client (and its torch seed)."""
    torch.manual_seed(derive_seed(SEED, "client", round_idx, client))
    out = []
    while len(out) < STEPS:
        for b in _loader(data["train"], "data", round_idx, client):
            out.append(b)
            if len(out) == STEPS:
                break
    return out


def test_finetune_evaluates_each_client_after_one_local_pass():
    module = tiny_module(LR)
    dm = tiny_datamodule(BATCH)
    trainer = _fit(module, [FineTune(lr=0.05)], dm, rounds=2)
    trainer.test(module, datamodule=dm, verbose=False)
    per_client = trainer.strategy.evaluation.capture.per_client["test_acc"]
    for c, data in enumerate(tiny_clients()):
        net = tiny_module(LR).network
        net.load_state_dict(module.network.state_dict())
        for x, y in _loader(data["train"], "finetune", c):
            grads = _grads(net, list(net.parameters()), x, y)
            with torch.no_grad():
                for p, g in zip(net.parameters(), grads):
                    p -= 0.05 * g
        x, y = data["test"]
        with torch.no_grad():
            accuracy = float((net(x).argmax(1) == y).float().mean())
        assert per_client[c][0] == pytest.approx(accuracy, abs=1e-6)
    # the global model itself is untouched by fine-tuning
    assert trainer.strategy.fit.tensors.params[0] is next(module.parameters())


def test_ditto_personal_model_follows_its_proximal_update():
    data, dm = _one_client()
    module = tiny_module(LR)
    w0 = params_of(module)
    trainer = _fit(module, [Ditto(lam=0.5, personal_lr=0.05, personal_epochs=2)], dm)
    net = tiny_module(LR).network
    params = list(net.parameters())
    with torch.no_grad():
        for p, w in zip(params, w0):
            p.copy_(w)
    _ditto_passes(net, params, data["train"], w0, 0.5, 0.05, 2, "ditto", 0, 0)
    stored = trainer.strategy.client_store.get(0, Ditto.key)
    assert torch.allclose(stored, torch.cat([p.detach().reshape(-1) for p in params]), atol=1e-6)


def _apfl_step(net, batch, v, w, alpha, local_lr, alpha_lr):
    """One APFL step by hand (Alg. 1) on ``batch``: the gradient at v̄ = αv + (1−α)w moves
    v by local_lr·α, the one at w moves w by LR, and (with ``alpha_lr``, adaptive α) α by
    −alpha_lr·⟨v − w, ∇f(v̄)⟩ clipped to [0, 1]; all from their values before the step."""
    params, (x, y) = list(net.parameters()), batch
    with torch.no_grad():
        for p, a, b in zip(params, v, w):
            p.copy_(alpha * a + (1 - alpha) * b)
    g_mix = _grads(net, params, x, y)
    with torch.no_grad():
        for p, b in zip(params, w):
            p.copy_(b)
    g_w = _grads(net, params, x, y)
    new_alpha = alpha
    if alpha_lr is not None:
        slope = sum(float(((a - b) * g).sum()) for a, b, g in zip(v, w, g_mix))
        new_alpha = min(1.0, max(0.0, alpha - alpha_lr * slope))
    v = [a - local_lr * alpha * g for a, g in zip(v, g_mix)]
    w = [b - LR * g for b, g in zip(w, g_w)]
    return v, w, new_alpha


@pytest.mark.parametrize("adaptive", [False, True])
def test_apfl_local_model_and_alpha_follow_algorithm_1(adaptive):
    data, dm = _one_client()
    module = tiny_module(LR)
    w = [t.clone() for t in params_of(module)]
    trainer = _fit(
        module, [APFL(alpha=0.3, local_lr=0.07, adaptive_alpha=adaptive, alpha_lr=0.02)], dm
    )
    net = tiny_module(LR).network
    v, alpha = [t.clone() for t in w], 0.3
    for batch in _strategy_batches(data):
        v, w, alpha = _apfl_step(net, batch, v, w, alpha, 0.07, 0.02 if adaptive else None)
    store = trainer.strategy.client_store
    assert torch.allclose(
        store.get(0, APFL.v_key), torch.cat([t.reshape(-1) for t in v]), atol=1e-6
    )
    assert store.get(0, APFL.alpha_key) == pytest.approx(alpha, abs=1e-9)
    assert max_abs_diff(params_of(module), w) < 1e-6


def test_fedrep_trains_the_head_then_the_body_and_keeps_the_global_head():
    data, dm = _one_client()
    module = tiny_module(LR)
    start = params_of(module)
    trainer = _fit(module, [FedRep(head_epochs=2, head_lr=0.05)], dm)
    net = tiny_module(LR).network
    params = list(net.parameters())
    head, body = params[2:], params[:2]  # MLP(6, (8,), 3): the last Linear is the head
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    loader = _loader(data["train"], "fedrep", 0, 0)
    for _ in range(2):
        for x, y in loader:
            grads = _grads(net, head, x, y)
            with torch.no_grad():
                for p, g in zip(head, grads):
                    p -= 0.05 * g
    for x, y in _strategy_batches(data):
        grads = _grads(net, body, x, y)
        with torch.no_grad():
            for p, g in zip(body, grads):
                p -= LR * g
    final = params_of(module)
    assert max_abs_diff(final[:2], [p.detach() for p in body]) < 1e-6  # body aggregated
    assert max_abs_diff(final[2:], start[2:]) == 0.0  # the global head never moves
    stored = trainer.strategy.client_store.get(0, FedRep.key)
    assert torch.allclose(stored, torch.cat([p.detach().reshape(-1) for p in head]), atol=1e-6)


def test_pfedme_local_and_personal_models_follow_algorithm_1():
    data, dm = _one_client()
    module = tiny_module(LR)
    w = [t.clone() for t in params_of(module)]
    lam, eta_p, k = 2.0, 0.05, 2
    trainer = _fit(module, [PFedMe(lam=lam, personal_lr=eta_p, inner_steps=k)], dm)
    net = tiny_module(LR).network
    params = list(net.parameters())
    theta = None
    for x, y in _strategy_batches(data):
        theta = [t.clone() for t in w]
        for _ in range(k):
            with torch.no_grad():
                for p, t in zip(params, theta):
                    p.copy_(t)
            grads = _grads(net, params, x, y)
            theta = [t - eta_p * (g + lam * (t - b)) for t, g, b in zip(theta, grads, w)]
        w = [b - LR * lam * (b - t) for b, t in zip(w, theta)]
    assert max_abs_diff(params_of(module), w) < 1e-6
    stored = trainer.strategy.client_store.get(0, PFedMe.key)
    assert torch.allclose(stored, torch.cat([t.reshape(-1) for t in theta]), atol=1e-6)


@pytest.mark.parametrize("setting", [{"momentum": 0.9}, {"optimizer": "adam"}])
def test_pfedme_refuses_momentum_and_another_optimizer(setting):
    """pFedMe's local step needs plain SGD: momentum, or Adam (whose groups have no
    momentum entry), is refused."""
    module = tiny_module(LR)
    module.hparams.update(setting)
    with pytest.raises(ValueError, match="plain SGD"):
        _fit(module, [PFedMe()], tiny_datamodule(BATCH))


def test_complete_linkage_bipartition_by_hand():
    # two groups {0, 1, 2} and {3, 4}, with 2 far from everyone but its own group
    s = torch.tensor(
        [[1.0, 0.9, 0.5, -0.8, -0.9],
         [0.9, 1.0, 0.6, -0.7, -0.8],
         [0.5, 0.6, 1.0, -0.2, -0.3],
         [-0.8, -0.7, -0.2, 1.0, 0.95],
         [-0.9, -0.8, -0.3, 0.95, 1.0]]
    )  # fmt: skip
    assert sorted(map(sorted, complete_linkage_bipartition(s))) == [[0, 1, 2], [3, 4]]
    assert complete_linkage_bipartition(s[:2, :2]) == ([0], [1])  # two clients: one each


def test_cosine_similarities_by_hand():
    """Rows of norms 5, 2, 1 and a zero update (similarity 0 with everyone)."""
    from lightning_fl.callbacks.clustered import cosine_similarities

    updates = torch.tensor([[3.0, 4.0], [0.0, 2.0], [-1.0, 0.0], [0.0, 0.0]])
    expected = [[1.0, 0.8, -0.6, 0.0], [0.8, 1.0, 0.0, 0.0], [-0.6, 0.0, 1.0, 0.0],
                [0.0, 0.0, 0.0, 0.0]]  # fmt: skip
    assert torch.allclose(cosine_similarities(updates), torch.tensor(expected), atol=1e-7)


def test_clustered_fl_without_a_split_equals_fedavg():
    """Client 0 holds one training sample: it belongs to the cluster like any other."""

    def datamodule():
        clients = tiny_clients()
        clients[0]["train"] = tuple(t[:1] for t in clients[0]["train"])
        return InMemoryFederatedDataModule(clients, batch_size=BATCH)

    clustered = tiny_module(LR)
    _fit(clustered, [ClusteredFL(eps1=0.0)], datamodule(), rounds=3)
    fedavg = tiny_module(LR)
    _fit(fedavg, [FedAvg()], datamodule(), rounds=3)
    assert max_abs_diff(params_of(clustered), params_of(fedavg)) < 1e-6


def test_clustered_fl_separates_clients_with_conflicting_labels():
    g = torch.Generator().manual_seed(0)
    rule = torch.randn(6, 3, generator=g)
    clients = []
    for c in range(8):  # the same inputs and rule; the second group's labels are permuted
        x = torch.randn(250, 6, generator=g)
        y = (x @ rule).argmax(1)
        y = (y + 1) % 3 if c >= 4 else y
        clients.append({"train": (x[:200], y[:200]), "val": (x[200:], y[200:])})
    dm = InMemoryFederatedDataModule(clients, batch_size=200)  # full-batch local steps
    callback = ClusteredFL(eps1=10.0, eps2=0.0, warmup_rounds=0)
    module = tiny_module(LR)
    _fit(module, [callback], dm, rounds=1)
    assert sorted(map(sorted, callback.clusters)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_fedrep_refuses_a_model_without_a_body():
    from lightning_fl import Classifier

    module = Classifier(torch.nn.Linear(6, 3), lr=LR)
    with pytest.raises(ValueError, match="shared body"):
        _fit(module, [FedRep()], tiny_datamodule(BATCH))


def test_multi_step_learning_rate_divides_at_the_milestones():
    from lightning_fl import MLP, Classifier

    module = Classifier(MLP(6, (8,), 3), lr=0.1, lr_milestones=[1, 2], lr_gamma=0.1)
    trainer = _fit(module, [], tiny_datamodule(BATCH), rounds=3)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001)
    with pytest.raises(ValueError, match="lr_decay or lr_milestones"):
        Classifier(lr_decay=0.9, lr_milestones=[1])


def test_clustered_fl_after_a_split_trains_each_cluster_from_its_own_model_by_hand():
    """Three rounds of full-batch gradient steps on 4 clients with conflicting labels,
    against a loop written by hand: round 0 splits {0, 1} from {2, 3} (both models
    start from the round's FedAvg step); in rounds 1 and 2 each client starts from its
    cluster's model (different from the global one in round 2), each cluster moves by its
    members' sample-weighted mean update, and the global model is the clusters' models
    weighted by their sample counts."""
    import copy

    g = torch.Generator().manual_seed(3)
    rule = torch.randn(6, 3, generator=g)
    clients, sizes = [], [40, 60, 50, 30]  # unequal: the weights matter
    for c, n in enumerate(sizes):
        x = torch.randn(n, 6, generator=g)
        y = (x @ rule).argmax(1)
        y = (y + 1) % 3 if c >= 2 else y
        clients.append({"train": (x, y), "val": (x[:5], y[:5])})
    dm = InMemoryFederatedDataModule(clients, batch_size=100)  # one full batch per step
    module = tiny_module(LR)
    reference = copy.deepcopy(module.network)
    callback = ClusteredFL(eps1=10.0, eps2=0.0, warmup_rounds=0)
    trainer = make_trainer(FederatedStrategy(local_steps=1, seed=SEED), 3, [callback])
    trainer.fit(module, datamodule=dm)
    assert sorted(map(sorted, callback.clusters)) == [[0, 1], [2, 3]]

    def flat(net):
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def step(theta, c):  # one full-batch SGD step of client c from theta: the update
        net = copy.deepcopy(reference)
        torch.nn.utils.vector_to_parameters(theta.clone(), net.parameters())
        x, y = clients[c]["train"]
        loss = F.cross_entropy(net(x), y)
        grads = torch.autograd.grad(loss, list(net.parameters()))
        return -LR * torch.cat([gr.reshape(-1) for gr in grads])

    theta0 = flat(reference)
    n = torch.tensor(sizes, dtype=torch.float32)
    start = theta0 + sum(n[c] / n.sum() * step(theta0, c) for c in range(4))
    models = {}
    for members in ([0, 1], [2, 3]):
        total = n[members].sum()
        model = start
        for _ in range(2):  # rounds 1 and 2: from the cluster's own model, which differ
            model = model + sum(n[c] / total * step(model, c) for c in members)
        models[tuple(members)] = model
    global_model = sum(n[list(k)].sum() / n.sum() * m for k, m in models.items())
    for members, model in zip(callback.clusters, callback.models):
        assert torch.allclose(model[: len(theta0)], models[tuple(sorted(members))], atol=1e-6)
    assert torch.allclose(flat(module.network), global_model, atol=1e-6)


def test_complete_linkage_differs_from_single_linkage_and_breaks_ties_by_index():
    """Distances |x_i − x_j| on a line (similarity = −distance): x = (0, 1, 2.1, 3.3) is a
    chain that single linkage would cut as {0, 1, 2} | {3}; complete linkage (the
    largest pairwise distance between two clusters) cuts it {0, 1} | {2, 3}. Three points
    at 0, 1, 2 tie: the first pair in index order merges, so {0, 1} | {2}."""

    def similarity(x):
        x = torch.tensor(x, dtype=torch.float64)
        return -(x[:, None] - x[None, :]).abs()

    chain = complete_linkage_bipartition(similarity([0.0, 1.0, 2.1, 3.3]))
    assert sorted(map(sorted, chain)) == [[0, 1], [2, 3]]
    assert sorted(map(sorted, complete_linkage_bipartition(similarity([0.0, 1.0, 2.0])))) == [
        [0, 1],
        [2],
    ]
    with pytest.raises(ValueError, match="at least 2 clients"):
        complete_linkage_bipartition(similarity([0.0]))


def test_ditto_over_three_rounds_and_clients_of_unequal_size_by_hand():
    """Clients of 11, 18 and 25 samples, three rounds, λ and η_p away from 1: each personal
    model v_k persists from round to round (it starts from w^0 only once), its proximal
    anchor is the global model of the round it trains in, and its batches are reshuffled
    per round; the global model is FedAvg's weighted by size, untouched by Ditto. One
    client over one round would let a personal model restarted from w^t, or anchored on
    w^0, pass."""
    clients = tiny_clients()[1:4]
    dm = InMemoryFederatedDataModule(clients, batch_size=BATCH)
    module = tiny_module(LR)
    w = params_of(module)
    trainer = _fit(module, [Ditto(lam=0.3, personal_lr=0.04, personal_epochs=2)], dm, rounds=3)

    net = tiny_module(LR).network
    params = list(net.parameters())
    personal = [[t.clone() for t in w] for _ in clients]
    sizes = torch.tensor([float(len(c["train"][0])) for c in clients])
    for r in range(3):
        ends = []
        for c, data in enumerate(clients):
            with torch.no_grad():
                for p, t in zip(params, w):
                    p.copy_(t)
            local_sgd(net, data["train"], STEPS, LR, BATCH, SEED, r, c)
            ends.append(params_of(net))
            with torch.no_grad():
                for p, v in zip(params, personal[c]):
                    p.copy_(v)
            _ditto_passes(net, params, data["train"], w, 0.3, 0.04, 2, "ditto", r, c)
            personal[c] = params_of(net)
        share = sizes / sizes.sum()
        w = [sum(float(s) * e[i] for s, e in zip(share, ends)) for i in range(len(w))]
    assert max_abs_diff(params_of(module), w) < 1e-5
    store = trainer.strategy.client_store
    for c in range(3):
        flat = torch.cat([t.reshape(-1) for t in personal[c]])
        assert torch.allclose(store.get(c, Ditto.key), flat, atol=1e-5), c


@pytest.mark.parametrize("vectorize", [False, True])
def test_ditto_anchors_a_stale_client_on_the_model_it_received(vectorize):
    """Under AsynchronousFL (F80's unequal times, 8 aggregations, server step 0.5), a
    client's personal model is pulled toward the stale w^ρ it was sent and trained from
    (Alg. 1's w^t), not the server's current model, which has moved on meanwhile."""
    from lightning_fl import AsyncSchedule, ClientTimes
    from lightning_fl.callbacks import AsynchronousFL

    m, rounds, lam, lr_p = 4, 8, 0.3, 0.04
    times = ClientTimes(80.0).means(m)
    clients = tiny_clients(num_clients=m)
    module = tiny_module(LR)
    w0 = params_of(module)
    callbacks = [
        Ditto(lam=lam, personal_lr=lr_p, personal_epochs=2),
        AsynchronousFL(AsyncSchedule(ClientTimes(80.0)), "identical", server_lr=0.5),
    ]
    strategy = FederatedStrategy(local_steps=STEPS, seed=SEED, vectorize=vectorize)
    trainer = make_trainer(strategy, rounds, callbacks)
    trainer.fit(module, datamodule=tiny_datamodule(BATCH, num_clients=m))

    net = tiny_module(LR).network
    params = list(net.parameters())
    history, theta = {0: w0}, w0
    ready, received, personal, stale = list(times), [0] * m, {}, 0
    for n in range(rounds):
        i = min(range(m), key=lambda k: (ready[k], k))
        sent = history[received[i]]
        stale += received[i] < n
        with torch.no_grad():
            for p, t in zip(params, sent):
                p.copy_(t)
        local_sgd(net, clients[i]["train"], STEPS, LR, BATCH, SEED, n, i)
        theta = [t + 0.5 * (e - s) for t, e, s in zip(theta, params_of(net), sent)]
        with torch.no_grad():
            for p, v in zip(params, personal.get(i, w0)):
                p.copy_(v)
        _ditto_passes(net, params, clients[i]["train"], sent, lam, lr_p, 2, "ditto", n, i)
        personal[i] = params_of(net)
        history[n + 1], ready[i], received[i] = theta, ready[i] + times[i], n + 1
    assert stale >= 3  # the setting separates w^ρ from the current model
    assert max_abs_diff(params_of(module), theta) < 1e-5
    store = trainer.strategy.client_store
    for c, v in personal.items():
        flat = torch.cat([t.reshape(-1) for t in v])
        assert torch.allclose(store.get(c, Ditto.key), flat, atol=1e-5), c


def test_ditto_starts_a_late_clients_personal_model_from_w0_not_from_its_first_rounds_w():
    """Partial participation, rounds {0, 1}, {1, 2}, {0, 2} at weights 0.6 / 0.4: client 2
    first trains in round 1, and its personal model starts from w^0 (Alg. 1's v_k^0), with
    the round's w^1 as its proximal anchor; a start from w^1 differs."""
    from lightning_fl.systems.samplers import ClientSampler, Participation

    schedule = [(0, 1), (1, 2), (0, 2)]

    class Scripted(ClientSampler):
        def sample(self, round_idx, seed, p):
            return Participation(schedule[round_idx], (0.6, 0.4))

    clients = tiny_clients()[1:4]
    dm = InMemoryFederatedDataModule(clients, batch_size=BATCH)
    module = tiny_module(LR)
    w = params_of(module)
    trainer = make_trainer(
        FederatedStrategy(sampler=Scripted(), local_steps=STEPS, seed=SEED), 3,
        [Ditto(lam=0.3, personal_lr=0.04, personal_epochs=2)],
    )  # fmt: skip
    trainer.fit(module, datamodule=dm)

    net = tiny_module(LR).network
    params = list(net.parameters())
    personal = [[t.clone() for t in w] for _ in clients]  # every v_k^0 is w^0
    for r, participants in enumerate(schedule):
        step = [torch.zeros_like(t) for t in w]
        for c, share in zip(participants, (0.6, 0.4)):
            with torch.no_grad():
                for p, t in zip(params, w):
                    p.copy_(t)
            local_sgd(net, clients[c]["train"], STEPS, LR, BATCH, SEED, r, c)
            step = [s + share * (e - t) for s, e, t in zip(step, params_of(net), w)]
            with torch.no_grad():
                for p, v in zip(params, personal[c]):
                    p.copy_(v)
            _ditto_passes(net, params, clients[c]["train"], w, 0.3, 0.04, 2, "ditto", r, c)
            personal[c] = params_of(net)
        w = [t + s for t, s in zip(w, step)]
    assert max_abs_diff(params_of(module), w) < 1e-5
    for c in range(3):
        flat = torch.cat([t.reshape(-1) for t in personal[c]])
        assert torch.allclose(trainer.strategy.client_store.get(c, Ditto.key), flat, atol=1e-5), c


@pytest.mark.parametrize("vectorize", [False, True])
def test_apfl_over_three_rounds_and_clients_of_unequal_size_by_hand(vectorize):
    """Clients of 11, 18 and 25 samples, three rounds, adaptive α: each client's v and α
    carry over from its last participation (α moves away from its start, so a reset to
    ``alpha`` or a v restarted from w^t shows), every step mixes with the client's own w
    before its step, and the global model is FedAvg's weighted by size. Sequential and
    vectorized clients against the same hand loop."""
    clients = tiny_clients()[1:4]
    dm = InMemoryFederatedDataModule(clients, batch_size=BATCH)
    module = tiny_module(LR)
    global_w = params_of(module)
    apfl = APFL(alpha=0.4, local_lr=0.06, adaptive_alpha=True, alpha_lr=0.5)
    trainer = make_trainer(
        FederatedStrategy(local_steps=STEPS, seed=SEED, vectorize=vectorize), 3, [apfl]
    )
    trainer.fit(module, datamodule=dm)

    net = tiny_module(LR).network
    state = [([t.clone() for t in global_w], 0.4) for _ in clients]
    sizes = torch.tensor([float(len(c["train"][0])) for c in clients])
    for r in range(3):
        ends = []
        for c, data in enumerate(clients):
            w, (v, alpha) = [t.clone() for t in global_w], state[c]
            for batch in _strategy_batches(data, r, c):
                v, w, alpha = _apfl_step(net, batch, v, w, alpha, 0.06, 0.5)
            state[c] = (v, alpha)
            ends.append(w)
        share = sizes / sizes.sum()
        global_w = [sum(float(s) * e[i] for s, e in zip(share, ends)) for i in range(len(ends[0]))]
    assert max_abs_diff(params_of(module), global_w) < 1e-5
    store = trainer.strategy.client_store
    assert len({round(a, 6) for _, a in state} | {0.4}) == 4  # every α moved, each its own way
    for c, (v, alpha) in enumerate(state):
        flat = torch.cat([t.reshape(-1) for t in v])
        assert torch.allclose(store.get(c, APFL.v_key), flat, atol=1e-5), c
        assert store.get(c, APFL.alpha_key) == pytest.approx(alpha, abs=1e-6), c


@pytest.mark.parametrize("vectorize", [False, True])
def test_fedrep_over_three_rounds_and_clients_of_unequal_size_by_hand(vectorize):
    """Clients of 11, 18 and 25 samples, three rounds: each client's head carries over
    from its last round (a head restarted from the global head each round shows), the body
    trains under the client's own head, and only the bodies are averaged, by size."""
    clients = tiny_clients()[1:4]
    dm = InMemoryFederatedDataModule(clients, batch_size=BATCH)
    module = tiny_module(LR)
    start = params_of(module)
    trainer = make_trainer(
        FederatedStrategy(local_steps=STEPS, seed=SEED, vectorize=vectorize),
        3,
        [FedRep(head_epochs=2, head_lr=0.05)],
    )
    trainer.fit(module, datamodule=dm)

    net = tiny_module(LR).network
    params = list(net.parameters())
    body_of, head_of = params[:2], params[2:]  # MLP(6, (8,), 3): the last Linear is the head
    body, heads = start[:2], [start[2:] for _ in clients]
    sizes = torch.tensor([float(len(c["train"][0])) for c in clients])
    for r in range(3):
        bodies = []
        for c, data in enumerate(clients):
            with torch.no_grad():
                for p, t in zip(params, body + heads[c]):
                    p.copy_(t)
            loader = _loader(data["train"], "fedrep", r, c)
            for _ in range(2):
                for x, y in loader:
                    grads = _grads(net, head_of, x, y)
                    with torch.no_grad():
                        for p, g in zip(head_of, grads):
                            p -= 0.05 * g
            for x, y in _strategy_batches(data, r, c):
                grads = _grads(net, body_of, x, y)
                with torch.no_grad():
                    for p, g in zip(body_of, grads):
                        p -= LR * g
            heads[c] = [p.detach().clone() for p in head_of]
            bodies.append([p.detach().clone() for p in body_of])
        share = sizes / sizes.sum()
        body = [sum(float(s) * b[i] for s, b in zip(share, bodies)) for i in range(2)]
    final = params_of(module)
    assert max_abs_diff(final[:2], body) < 1e-5
    assert max_abs_diff(final[2:], start[2:]) == 0.0
    store = trainer.strategy.client_store
    for c in range(3):
        flat = torch.cat([t.reshape(-1) for t in heads[c]])
        assert torch.allclose(store.get(c, FedRep.key), flat, atol=1e-5), c


@pytest.mark.parametrize("fedrep_first", [True, False])
def test_fedrep_heads_stay_personal_under_gossip_in_either_callback_order(fedrep_first):
    """Decentralized FedRep: GossipAveraging mixes every client's whole model, heads
    included, but each seen client is tested with its gossip body and its own FedRep head,
    whatever the callbacks' order (the aggregator's hooks run first, so FedRep's head is
    loaded over the mixed one). 3 clients of unequal size, an explicit W with different
    rows, 3 rounds: the bodies differ per client, and so do the heads."""
    from lightning_fl.callbacks.gossip import STORE_KEY, GossipAveraging

    W3 = [[0.5, 0.3, 0.2], [0.3, 0.4, 0.3], [0.2, 0.3, 0.5]]  # noqa: N806 - the paper's W

    clients = tiny_clients()[1:4]
    dm = InMemoryFederatedDataModule(clients, batch_size=BATCH)
    module = tiny_module(LR)
    fedrep, gossip = FedRep(head_epochs=1, head_lr=0.05), GossipAveraging(mixing_matrix=W3)
    trainer = _fit(module, [fedrep, gossip] if fedrep_first else [gossip, fedrep], dm, rounds=3)
    trainer.test(module, datamodule=dm, verbose=False)
    losses = trainer.strategy.evaluation.capture.per_client["test_loss"]
    w, store = params_of(module), trainer.strategy.client_store
    models = [_stored(store, c, STORE_KEY, w) for c in range(3)]
    heads = [_stored(store, c, FedRep.key, w[2:]) for c in range(3)]
    pairs = ((0, 1), (0, 2), (1, 2))
    assert min(max_abs_diff(models[a][:2], models[b][:2]) for a, b in pairs) > 1e-4
    for c in range(3):
        assert max_abs_diff(models[c][2:], heads[c]) > 1e-4, c  # the mixed head is not used
        expected = _test_loss(models[c][:2] + heads[c], clients[c])
        assert losses[c][0] == pytest.approx(expected, rel=1e-5), c


def test_complete_linkage_lists_each_cluster_in_index_order():
    """On a line at 0, 1.5, 10, 0.2: {0, 3} merge first, then client 1 joins them, so
    the merged cluster is [0, 1, 3] (members in index order), not [0, 3, 1]."""
    x = torch.tensor([0.0, 1.5, 10.0, 0.2], dtype=torch.float64)
    assert complete_linkage_bipartition(-(x[:, None] - x[None, :]).abs()) == ([0, 1, 3], [2])


@pytest.mark.parametrize("eps", [{"eps1": -0.1}, {"eps2": -0.1}])
def test_clustered_fl_refuses_a_negative_threshold(eps):
    with pytest.raises(ValueError, match="eps1 and eps2 must be >= 0"):
        ClusteredFL(**eps)


def test_clustered_fl_refuses_partial_participation():
    """A sampler of the user's own, which declares nothing: assumed to leave clients out,
    it is refused at set-up by the trait rule."""
    from lightning_fl.systems.samplers import ClientSampler

    class FirstThree(ClientSampler):
        def _draw(self, p, gen):
            return {i: 1 / 3 for i in range(3)}

    strategy = FederatedStrategy(sampler=FirstThree(), local_steps=1, seed=SEED)
    trainer = make_trainer(strategy, 1, [ClusteredFL()])
    with pytest.raises(ValueError, match="ClusteredFL cannot be combined with FirstThree: "
                       "ClusteredFL needs every client of a fixed federation in every round "
                       "and FirstThree leaves clients out"):  # fmt: skip
        trainer.fit(tiny_module(LR), datamodule=tiny_datamodule(BATCH))


def test_clustered_fl_aggregates_a_cluster_without_updates_by_hand():
    """Clusters {0, 1} and {2, 3, 4} with counts 5, 7 | 3, 4, 6; this round only the second
    cluster's clients sent updates (the first's were dropped): the first cluster keeps its
    model, the second moves by its members' count-weighted mean update (no split: ε1 = 0),
    and the global model is the clusters' models weighted by their total counts 12 and 13.
    The round's updates are not kept past aggregation."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    callback = ClusteredFL(eps1=0.0, eps2=0.0, warmup_rounds=0)
    models = [torch.randn(5, generator=g), torch.randn(5, generator=g)]
    callback.clusters, callback.models = [[0, 1], [2, 3, 4]], [m.clone() for m in models]
    updates = {c: torch.randn(5, generator=g) for c in (2, 3, 4)}
    callback._updates = {c: u.clone() for c, u in updates.items()}
    state = SimpleNamespace(
        sample_counts=[5, 7, 3, 4, 6], round_idx=3, global_tensors=[torch.zeros(3), torch.zeros(2)]
    )
    callback.aggregate(None, None, state)
    moved = models[1] + (3 * updates[2] + 4 * updates[3] + 6 * updates[4]) / 13
    assert callback.clusters == [[0, 1], [2, 3, 4]]
    assert torch.allclose(callback.models[0], models[0]) and torch.allclose(
        callback.models[1], moved
    )
    expected = (12 * models[0] + 13 * moved) / 25
    assert torch.allclose(torch.cat(state.global_tensors), expected, atol=1e-6)
    assert callback._updates == {}


def test_clustered_fl_evaluates_each_client_with_its_cluster_and_an_unseen_one_by_its_val_loss():
    """Groups {0, 1} and {2, 3} with conflicting labels split in round 1 (warm-up 1), after
    a round evaluated with the one model (the unseen client then takes it). At the end each
    seen client's validation loss is its cluster's model's; unseen client 4, whose
    validation data follow the second group and its training data the first, joins the
    cluster of lowest loss on its validation data (the second; its training data would
    choose the first). Unseen client 5 has no validation data: tested, it joins the
    cluster of lowest loss on its training data (the second group's)."""
    g = torch.Generator().manual_seed(3)
    rule = torch.randn(6, 3, generator=g)

    def group(n, second):
        x = torch.randn(n, 6, generator=g)
        y = (x @ rule).argmax(1)
        return x, (y + 1) % 3 if second else y

    clients = [{"train": group(n, c >= 2), "val": group(7, c >= 2)} for c, n in
               enumerate([40, 60, 50, 30])]  # fmt: skip
    clients.append({"train": group(20, False), "val": group(9, True)})
    clients.append({"train": group(20, True), "val": group(0, True), "test": group(6, True)})
    dm = InMemoryFederatedDataModule(clients, batch_size=100)
    dm.unseen_clients = [4, 5]
    callback = ClusteredFL(eps1=10.0, eps2=0.0, warmup_rounds=1)
    strategy = FederatedStrategy(local_steps=3, seed=SEED)
    trainer = make_trainer(strategy, 3, [callback], limit_val_batches=None)
    module = tiny_module(0.5)
    trainer.fit(module, datamodule=dm)
    assert callback.clusters == [[0, 1], [2, 3]]
    net = tiny_module().network

    def loss(cluster, data):
        torch.nn.utils.vector_to_parameters(callback.models[cluster], net.parameters())
        with torch.no_grad():
            return float(F.cross_entropy(net(data[0]), data[1]))

    per_client = trainer.strategy.evaluation.last_report[1]["val_loss"]
    for c in range(4):
        assert per_client[c][0] == pytest.approx(loss(c // 2, clients[c]["val"]), rel=1e-5)
    assert loss(1, clients[4]["val"]) < loss(0, clients[4]["val"])
    assert loss(0, clients[4]["train"]) < loss(1, clients[4]["train"])
    assert per_client[4][0] == pytest.approx(loss(1, clients[4]["val"]), rel=1e-5)
    trainer.test(module, datamodule=dm, verbose=False)
    tested = trainer.strategy.evaluation.last_report[1]["test_loss"]
    assert loss(1, clients[5]["train"]) < loss(0, clients[5]["train"])
    assert tested[5][0] == pytest.approx(loss(1, clients[5]["test"]), rel=1e-5)
    # Unseen client 4 again, its validation data in batches of unequal sizes, 8 samples of
    # the second group then 1 of the first: the lowest total loss is the second cluster's,
    # which a sum of batch means, weighted or divided by batch sizes, would not choose.
    big, lone, test = group(8, True), group(1, False), group(6, True)
    clients[4] = {"train": clients[4]["train"], "test": test,
                  "val": tuple(torch.cat(pair) for pair in zip(big, lone))}  # fmt: skip
    unequal = InMemoryFederatedDataModule(clients, batch_size=8)
    unequal.unseen_clients = [4, 5]
    totals = [8 * loss(c, big) + loss(c, lone) for c in (0, 1)]
    means = [loss(c, big) + loss(c, lone) for c in (0, 1)]
    divided = [loss(c, big) / 8 + loss(c, lone) for c in (0, 1)]
    assert totals[1] < totals[0] and means[0] < means[1] and divided[0] < divided[1]
    trainer.test(module, datamodule=unequal, verbose=False)
    tested = trainer.strategy.evaluation.last_report[1]["test_loss"]
    assert tested[4][0] == pytest.approx(loss(1, test), rel=1e-5)


def test_finetune_leaves_validation_to_the_global_model_outside_its_stages():
    """FineTune's default stages are ("test",): during fit, every client is validated with
    the global model itself (no fine-tuning pass)."""
    module = tiny_module(LR)
    trainer = _fit(module, [FineTune(lr=0.5)], tiny_datamodule(BATCH), rounds=2,
                   limit_val_batches=None)  # fmt: skip
    per_client = trainer.strategy.evaluation.last_report[1]["val_loss"]
    with torch.no_grad():
        for c, data in enumerate(tiny_clients()):
            x, y = data["val"]
            expected = float(F.cross_entropy(module.network(x), y))
            assert per_client[c][0] == pytest.approx(expected, rel=1e-6), c


def test_ditto_evaluates_seen_clients_with_their_personal_models_and_trains_an_unseen_one():
    """Clients 0-2 are tested with the personal models Ditto stored for them; client 3 is
    unseen: its personal model trains from the final global model w^T, anchored on w^T,
    for personal_epochs passes of its own batches (λ = 0.3, η_p = 0.04), before its test."""

    def seen(w, store, c):  # the client's stored personal model
        return _stored(store, c, Ditto.key, w)

    callback = Ditto(lam=0.3, personal_lr=0.04, personal_epochs=2)
    w, reported, data, store = _unseen_client_test_loss(callback, seen)
    net = tiny_module(LR).network
    params = list(net.parameters())
    with torch.no_grad():
        for p, t in zip(params, w):
            p.copy_(t)
    _ditto_passes(net, params, data["train"], w, 0.3, 0.04, 2, "ditto", -1, 3)
    assert reported == pytest.approx(_test_loss([p.detach() for p in params], data), rel=1e-5)
    assert store.get(3, Ditto.key) is None  # an unseen client's model is not kept


def _unseen_client_test_loss(callback, seen_model):
    """Fit 2 rounds on 4 clients of which client 3 is unseen, then test: the seen clients'
    reported test losses must be those of ``seen_model(w^T, store, client)``, their
    personalized models. Returns w^T, client 3's reported test loss, its data and the
    client store."""
    clients = tiny_clients()[1:5]
    dm = InMemoryFederatedDataModule(clients, batch_size=BATCH)
    dm.unseen_clients = [3]
    module = tiny_module(LR)
    trainer = _fit(module, [callback], dm, rounds=2)
    trainer.test(module, datamodule=dm, verbose=False)
    losses = trainer.strategy.evaluation.capture.per_client["test_loss"]
    w, store = params_of(module), trainer.strategy.client_store
    for c in range(3):
        expected = _test_loss(seen_model(w, store, c), clients[c])
        assert losses[c][0] == pytest.approx(expected, rel=1e-5), c
    return w, losses[3][0], clients[3], store


def _stored(store, client, key, like):
    return unflatten(store.get(client, key), like)


def _test_loss(values, data) -> float:
    net = tiny_module(LR).network
    with torch.no_grad():
        for p, v in zip(net.parameters(), values):
            p.copy_(v)
        x, y = data["test"]
        return float(F.cross_entropy(net(x), y))


def test_apfl_adapts_an_unseen_clients_local_model_with_the_global_one_frozen():
    """Seen clients are tested with α_c v_c + (1 − α_c) w^T from the store. Unseen client: v and α
    start from w^T and α = 0.3; adapt_epochs = 2 passes of APFL's v (and adaptive α) steps
    against the frozen w^T; tested with α v + (1 − α) w^T."""
    callback = APFL(alpha=0.3, local_lr=0.07, adaptive_alpha=True, alpha_lr=0.02, adapt_epochs=2)

    def seen(w, store, c):  # α_c v_c + (1 − α_c) w^T, each client's own α
        alpha, v = store.get(c, APFL.alpha_key), _stored(store, c, APFL.v_key, w)
        return [alpha * a + (1 - alpha) * b for a, b in zip(v, w)]

    w, reported, data, _ = _unseen_client_test_loss(callback, seen)
    net = tiny_module(LR).network
    v, alpha = [t.clone() for t in w], 0.3
    loader = _loader(data["train"], "apfl", -1, 3)
    for _ in range(2):
        for batch in loader:
            v, _, alpha = _apfl_step(net, batch, v, w, alpha, 0.07, 0.02)
    mixed = [alpha * a + (1 - alpha) * b for a, b in zip(v, w)]
    assert reported == pytest.approx(_test_loss(mixed, data), rel=1e-5)


def test_fedrep_trains_an_unseen_clients_head_on_the_frozen_global_body():
    """Seen clients are tested with their stored heads on w^T's body. Unseen client: head_epochs = 1
    pass of SGD (head_lr = 0.05) on the head of w^T, the body frozen; tested with w^T's body and
    that head."""

    def seen(w, store, c):  # w^T's body, the client's own head
        return w[:2] + _stored(store, c, FedRep.key, w[2:])

    w, reported, data, _ = _unseen_client_test_loss(FedRep(head_epochs=1, head_lr=0.05), seen)
    net = tiny_module(LR).network
    params = list(net.parameters())
    with torch.no_grad():
        for p, t in zip(params, w):
            p.copy_(t)
    head = params[2:]  # MLP(6, (8,), 3): the last Linear is the head
    for x, y in _loader(data["train"], "fedrep", -1, 3):
        grads = _grads(net, head, x, y)
        with torch.no_grad():
            for p, g in zip(head, grads):
                p -= 0.05 * g
    assert reported == pytest.approx(_test_loss([p.detach() for p in params], data), rel=1e-5)


def test_pfedme_runs_one_local_pass_for_an_unseen_client_and_tests_its_last_personal_model():
    """Seen clients are tested with their stored θ̂. Unseen client: one pass over its batches from
    w^T, each finding θ̂ by K = 2 proximal steps (η_p = 0.05, λ = 2) and moving w ← w − ηλ(w −
    θ̂) at the module's η = 0.1; tested with the last θ̂."""
    lam, eta_p = 2.0, 0.05

    def seen(w, store, c):  # the client's last θ̂
        return _stored(store, c, PFedMe.key, w)

    callback = PFedMe(lam=lam, personal_lr=eta_p, inner_steps=2)
    w, reported, data, _ = _unseen_client_test_loss(callback, seen)
    net = tiny_module(LR).network
    params = list(net.parameters())
    theta = None
    for x, y in _loader(data["train"], "pfedme", -1, 3):
        theta = [t.clone() for t in w]
        for _ in range(2):
            with torch.no_grad():
                for p, t in zip(params, theta):
                    p.copy_(t)
            grads = _grads(net, params, x, y)
            theta = [t - eta_p * (g + lam * (t - b)) for t, g, b in zip(theta, grads, w)]
        w = [b - LR * lam * (b - t) for b, t in zip(w, theta)]
    assert reported == pytest.approx(_test_loss(theta, data), rel=1e-5)


@pytest.mark.parametrize(
    ("eps1", "eps2", "round_idx", "splits"),
    [
        (0.75, 1.5, 20, True),  # mean 0.5 < ε1, max 2 > ε2, 3 clients, round 20 ≥ warm-up 20
        (0.5, 0.0, 20, False),  # ‖mean‖ = ε1 exactly: not below it
        (1.0, 2.0, 20, False),  # max ‖Δθ_i‖ = ε2 exactly: not above it
        (0.75, 1.5, 19, False),  # before the warm-up's end
    ],
)
def test_clustered_fl_split_criterion_at_its_boundaries_by_hand(eps1, eps2, round_idx, splits):
    """Updates (2, 0), (−2, 0), (0, 1) with counts 1, 1, 2 (weights 1/4, 1/4, 1/2, exact in
    binary): ‖Σ w_i Δθ_i‖ = ‖(0, 0.5)‖ = 0.5 and max ‖Δθ_i‖ = 2. The split is strict in both
    thresholds (Sattler et al. Alg. 1) and needs more than 2 clients: here 3."""
    from types import SimpleNamespace

    callback = ClusteredFL(eps1=eps1, eps2=eps2, warmup_rounds=20)
    callback.clusters, callback.models = [[0, 1, 2]], [torch.zeros(2)]
    callback._updates = {0: torch.tensor([2.0, 0.0]), 1: torch.tensor([-2.0, 0.0]),
                         2: torch.tensor([0.0, 1.0])}  # fmt: skip
    state = SimpleNamespace(sample_counts=[1, 1, 2], round_idx=round_idx,
                            global_tensors=[torch.zeros(2)])  # fmt: skip
    callback.aggregate(None, None, state)
    expected = [[0, 2], [1]] if splits else [[0, 1, 2]]  # cos(0, 2) = 0 > cos(0, 1) = −1
    assert callback.clusters == expected
    assert all(torch.equal(m, torch.tensor([0.0, 0.5])) for m in callback.models)


def test_clustered_fl_uniform_weighting_averages_a_clusters_updates_plainly():
    """weighting="uniform" (the authors' code): the cluster moves by the plain mean of its
    members' updates whatever their counts (1 and 3 here), and the global model is still
    the clusters' models weighted by their total counts."""
    from types import SimpleNamespace

    callback = ClusteredFL(eps1=0.0, weighting="uniform")
    callback.clusters, callback.models = [[0, 1], [2]], [torch.zeros(2), torch.ones(2)]
    callback._updates = {0: torch.tensor([1.0, 0.0]), 1: torch.tensor([0.0, 3.0]),
                         2: torch.tensor([1.0, 1.0])}  # fmt: skip
    state = SimpleNamespace(sample_counts=[1, 3, 4], round_idx=0, global_tensors=[torch.zeros(2)])
    callback.aggregate(None, None, state)
    assert torch.equal(callback.models[0], torch.tensor([0.5, 1.5]))
    assert torch.equal(callback.models[1], torch.tensor([2.0, 2.0]))
    assert torch.equal(state.global_tensors[0], torch.tensor([1.25, 1.75]))  # (4·m0 + 4·m1)/8


def test_fedrep_aggregates_the_bodys_buffers_and_never_moves_the_global_head():
    """A body with BatchNorm: the updates carry its running statistics after the
    parameters; only the head's parameters are zeroed, so the buffers are averaged like
    the body and the global head stays at its initial value."""
    from lightning_fl import Classifier

    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                              torch.nn.Linear(8, 3))  # fmt: skip
    module = Classifier(network=net, lr=LR)
    head = [p.detach().clone() for p in net[3].parameters()]
    _fit(
        module, [FedRep(head_epochs=1, head_lr=0.05)], tiny_datamodule(64), rounds=2
    )  # no batch of 1
    assert all(torch.equal(a, b) for a, b in zip(head, net[3].parameters()))
    assert not torch.equal(net[1].running_mean, torch.zeros(8))


@pytest.mark.parametrize("name", ["ditto", "apfl", "fedrep", "pfedme"])
def test_an_unseen_client_without_training_data_is_tested_with_the_global_model(name):
    """Client 3 is unseen and has no training data, only test data: there is nothing to
    adapt on, so each algorithm tests it with w^T itself."""
    callback = {
        "ditto": lambda: Ditto(lam=0.3, personal_lr=0.04),
        "apfl": lambda: APFL(alpha=0.3, local_lr=0.07),
        "fedrep": lambda: FedRep(head_epochs=1, head_lr=0.05),
        "pfedme": lambda: PFedMe(lam=2.0, personal_lr=0.05, inner_steps=2),
    }[name]()
    clients = tiny_clients()[1:5]
    clients[3]["train"] = tuple(t[:0] for t in clients[3]["train"])
    dm = InMemoryFederatedDataModule(clients, batch_size=BATCH)
    dm.unseen_clients = [3]
    module = tiny_module(LR)
    trainer = _fit(module, [callback], dm, rounds=2)
    trainer.test(module, datamodule=dm, verbose=False)
    reported = trainer.strategy.evaluation.capture.per_client["test_loss"][3][0]
    assert reported == pytest.approx(_test_loss(params_of(module), clients[3]), rel=1e-6)


def test_ditto_logs_the_global_models_metrics_beside_the_personalized_ones():
    """Ditto leaves the global model FedAvg's, so its ``*_global_*`` report (weighted,
    uniform and 10th-percentile accuracy, 90th-percentile loss, over clients of unequal
    size) equals a FedAvg run's plain one, at validation and test; its personalized
    values differ (v moved away from w)."""

    def fit(callbacks):
        trainer = _fit(tiny_module(), callbacks, tiny_datamodule(), rounds=3,
                       limit_val_batches=None)  # fmt: skip
        validation = {k: float(v) for k, v in trainer.callback_metrics.items()}
        trainer.test(trainer.lightning_module, datamodule=tiny_datamodule(), verbose=False)
        test = {k: float(v) for k, v in trainer.callback_metrics.items()}
        return validation | test

    plain = fit([FedAvg()])
    ditto = fit([Ditto(lam=0.01, personal_lr=0.3, personal_epochs=3)])
    for stage in ("val", "test"):
        for name, summaries in (("acc", ("weighted", "uniform", "p10")),
                                ("loss", ("weighted", "uniform", "p90"))):  # fmt: skip
            for summary in summaries:
                got = ditto[f"{stage}_global_{name}/{summary}"]
                expected = plain[f"{stage}_{name}/{summary}"]
                assert got == pytest.approx(expected, abs=1e-6), (stage, name, summary)
            assert ditto[f"{stage}_global_{name}"] == pytest.approx(plain[f"{stage}_{name}"],
                                                                    abs=1e-6)  # fmt: skip
        assert abs(ditto[f"{stage}_loss"] - plain[f"{stage}_loss"]) > 1e-3
    quiet = fit([Ditto(lam=0.01, personal_lr=0.3, personal_epochs=3, log_global=False)])
    assert not any("_global_" in k for k in quiet)
