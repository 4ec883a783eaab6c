"""The strategy's rounds equal hand-written FL loops, to float round-off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_fl import FederatedStrategy, MDSampler, UniformSampler
from lightning_fl.callbacks import SCAFFOLD, FedAdagrad, FedAdam, FedAvg, FedAvgM, FedProx, FedYogi
from lightning_fl.callbacks.baselines import STORE_KEY as LOCAL_KEY
from lightning_fl.callbacks.baselines import Local
from lightning_fl.engine.plugins import FederatedCallback
from lightning_fl.engine.seeding import derive_seed
from tests.helpers import (
    client_batches,
    local_sgd,
    make_trainer,
    max_abs_diff,
    params_of,
    tiny_clients,
    tiny_datamodule,
    tiny_module,
)

ROUNDS, STEPS, LR, SEED, BATCH = 5, 5, 0.1, 3, 4


def run_strategy(sampler, callbacks, rounds=ROUNDS, steps=STEPS, **strategy_kw):
    module = tiny_module(LR)
    strategy = FederatedStrategy(sampler=sampler, local_steps=steps, seed=SEED, **strategy_kw)
    make_trainer(strategy, rounds, callbacks).fit(module, datamodule=tiny_datamodule(BATCH))
    return params_of(module)


def sample_weights(clients, weighting="samples"):
    counts = torch.tensor([len(c["train"][1]) for c in clients], dtype=torch.float64)
    return (
        counts / counts.sum()
        if weighting == "samples"
        else torch.full_like(counts, 1 / len(counts))
    )


def reference(
    sampler, server_step, loss_extra=None, weighting="samples", lr_at=None, clip=None, shift=0.0
):
    """Hand-written FedAvg-style loop: θ ← server_step(θ, Σ ω_i (θ_i − θ), r), local SGD at
    learning rate ``lr_at(r)`` with optional gradient-norm clipping, from θ + ``shift``."""
    clients = tiny_clients()
    net = tiny_module(LR).network
    p = sample_weights(clients, weighting)
    theta = params_of(net)
    for r in range(ROUNDS):
        part = sampler.sample(r, SEED, p)
        delta = [torch.zeros_like(t) for t in theta]
        for c, w in zip(part.clients, part.weights):
            with torch.no_grad():
                for q, t in zip(net.parameters(), theta):
                    q.copy_(t + shift)
            extra = None if loss_extra is None else loss_extra(theta)
            lr = LR if lr_at is None else lr_at(r)
            local_sgd(
                net, clients[c]["train"], STEPS, lr, BATCH, SEED, r, c, loss_extra=extra,
                clip_norm=clip,
            )  # fmt: skip
            for d, q, t in zip(delta, net.parameters(), theta):
                d += w * (q.detach() - t)
        theta = server_step(theta, delta, r)
    return theta


@pytest.mark.parametrize("sampler", [UniformSampler(3), MDSampler(3)], ids=["uniform", "md"])
def test_fedavg_equals_hand_written_loop(sampler):
    ours = run_strategy(sampler, [FedAvg()])
    ref = reference(sampler, lambda t, d, r: [a + b for a, b in zip(t, d)])
    assert max_abs_diff(ours, ref) <= 1e-6


def test_fedavg_uniform_weighting_and_server_lr():
    sampler = UniformSampler(3)
    ours = run_strategy(sampler, [FedAvg(weighting="uniform", server_lr=0.5)])
    ref = reference(
        sampler, lambda t, d, r: [a + 0.5 * b for a, b in zip(t, d)], weighting="uniform"
    )
    assert max_abs_diff(ours, ref) <= 1e-6


def test_gradient_clipping_and_per_round_lr_schedule_keep_working():
    """Trainer(gradient_clip_val) and an ``interval: epoch`` scheduler act per step and per
    round exactly as in a hand-written loop with clip_grad_norm_ and lr_r = lr·γ^r."""
    sampler, gamma, clip = UniformSampler(3), 0.5, 0.05
    module = tiny_module(LR)
    module.hparams.lr_decay = gamma
    strategy = FederatedStrategy(sampler=sampler, local_steps=STEPS, seed=SEED)
    make_trainer(strategy, ROUNDS, [FedAvg()], gradient_clip_val=clip).fit(
        module, datamodule=tiny_datamodule(BATCH)
    )
    theta = reference(
        sampler, lambda t, d, r: [a + b for a, b in zip(t, d)], lr_at=lambda r: LR * gamma**r,
        clip=clip,
    )  # fmt: skip
    assert max_abs_diff(params_of(module), theta) <= 1e-6


@pytest.mark.parametrize("vectorize", [False, True])
@pytest.mark.parametrize("mu", [0.5, 1.0])
def test_fedprox_equals_proximal_loss_by_autograd(mu, vectorize):
    """Sequential and vectorized, at μ = 0.5 and at μ = 1 (a value a rule could mistake
    for "off")."""
    sampler = UniformSampler(3)
    ours = run_strategy(sampler, [FedProx(mu)], vectorize=vectorize)

    def prox(theta):
        anchor = [t.clone() for t in theta]
        return lambda net: (
            mu / 2 * sum(((q - a) ** 2).sum() for q, a in zip(net.parameters(), anchor))
        )

    ref = reference(sampler, lambda t, d, r: [a + b for a, b in zip(t, d)], loss_extra=prox)
    assert max_abs_diff(ours, ref) <= 1e-6


@pytest.mark.parametrize("vectorize", [False, True])
def test_fedprox_anchors_each_client_to_the_model_it_starts_from(vectorize):
    """Under Local, every client starts from, and is pulled toward, its own model of the
    previous round (θ^0 the first time), never the unchanging global model: the clients
    the sampler draws again in later rounds tell the two anchors apart."""
    sampler, mu = UniformSampler(3), 1.0
    strategy = FederatedStrategy(sampler=sampler, local_steps=STEPS, seed=SEED, vectorize=vectorize)
    trainer = make_trainer(strategy, ROUNDS, [Local(), FedProx(mu)])
    trainer.fit(tiny_module(LR), datamodule=tiny_datamodule(BATCH))
    clients = tiny_clients()
    net = tiny_module(LR).network
    theta0 = params_of(net)
    own = {}
    p = sample_weights(clients)
    drawn_again = 0
    for r in range(ROUNDS):
        for c in sampler.sample(r, SEED, p).clients:
            drawn_again += c in own
            start = own.get(c, theta0)
            with torch.no_grad():
                for q, t in zip(net.parameters(), start):
                    q.copy_(t)

            def prox(net, anchor=start):
                return mu / 2 * sum(((q - a) ** 2).sum() for q, a in zip(net.parameters(), anchor))

            local_sgd(net, clients[c]["train"], STEPS, LR, BATCH, SEED, r, c, loss_extra=prox)
            own[c] = params_of(net)
    assert drawn_again >= 2  # the setting separates the anchors
    for c, theta in own.items():
        stored = trainer.strategy.client_store.get(c, LOCAL_KEY)
        flat = torch.cat([t.flatten() for t in theta])
        assert (stored[: len(flat)] - flat).abs().max() <= 1e-6


class _ShiftedStart(FederatedCallback):
    """A user's callback that moves every client's starting model by a constant."""

    def on_client_start(self, trainer, pl_module, client, state) -> None:
        with torch.no_grad():
            for p in trainer.strategy.fit.tensors.params:
                p.add_(0.05)


@pytest.mark.parametrize("shift_first", [False, True], ids=["fedprox-first", "shift-first"])
def test_fedprox_reads_its_anchor_after_every_callbacks_client_start(shift_first):
    """Whatever the order of the Trainer's callbacks, the anchor is the model the client
    starts its steps from (here θ^t + 0.05), not θ^t."""
    sampler, mu = UniformSampler(3), 1.0
    callbacks = [FedProx(mu), _ShiftedStart()]
    ours = run_strategy(sampler, callbacks[::-1] if shift_first else callbacks)

    def prox(theta):
        anchor = [t + 0.05 for t in theta]
        return lambda net: (
            mu / 2 * sum(((q - a) ** 2).sum() for q, a in zip(net.parameters(), anchor))
        )

    theta = reference(sampler, lambda t, d, r: [a + b for a, b in zip(t, d)], prox, shift=0.05)
    assert max_abs_diff(ours, theta) <= 1e-5  # float32 round-off; anchored at θ^t: 0.19


@pytest.mark.parametrize("v0", [None, 0.0])
def test_fedadam_equals_reddi_algorithm_2(v0):
    """v_{−1} = τ² (Alg. 2's smallest start) by default, 0 as in FLamby's FedOpt (τ large
    enough that the two starts give different models)."""
    eta, b1, b2, tau, sampler = 0.05, 0.9, 0.99, 0.05, UniformSampler(3)
    adam_cb = FedAdam(server_lr=eta, beta1=b1, beta2=b2, tau=tau, initial_second_moment=v0)
    ours = run_strategy(sampler, [adam_cb])
    m, v = {}, {}
    start = tau**2 if v0 is None else v0

    def adam(theta, delta, r):
        out = []
        for i, (t, d) in enumerate(zip(theta, delta)):
            m[i] = b1 * m.get(i, torch.zeros_like(d)) + (1 - b1) * d
            v[i] = b2 * v.get(i, torch.full_like(d, start)) + (1 - b2) * d * d
            out.append(t + eta * m[i] / (v[i].sqrt() + tau))
        return out

    assert max_abs_diff(ours, reference(sampler, adam)) <= 1e-6


@pytest.mark.parametrize("name", ["yogi", "adagrad", "avgm"])
def test_other_server_optimizers_follow_their_equations(name):
    eta, b1, b2, tau, sampler = 0.05, 0.9, 0.99, 1e-3, UniformSampler(3)
    callback = {
        "yogi": FedYogi(server_lr=eta, beta1=b1, beta2=b2, tau=tau),
        "adagrad": FedAdagrad(server_lr=eta, beta1=b1, beta2=b2, tau=tau),
        "avgm": FedAvgM(server_lr=eta, beta=b1),
    }[name]
    ours = run_strategy(sampler, [callback])
    m, v = {}, {}

    def step(theta, delta, r):
        out = []
        for i, (t, d) in enumerate(zip(theta, delta)):
            if name == "avgm":
                m[i] = b1 * m.get(i, torch.zeros_like(d)) + d
                out.append(t + eta * m[i])
                continue
            m[i] = b1 * m.get(i, torch.zeros_like(d)) + (1 - b1) * d
            prev = v.get(i, torch.full_like(d, tau**2))
            if name == "yogi":
                v[i] = prev - (1 - b2) * d * d * torch.sign(prev - d * d)
            else:
                v[i] = prev + d * d
            out.append(t + eta * m[i] / (v[i].sqrt() + tau))
        return out

    assert max_abs_diff(ours, reference(sampler, step)) <= 1e-6


def _scaffold_by_hand(clients, rounds, steps, participants, control_weight, local=False):
    """Karimireddy et al. Alg. 1 with option II and η_g = 1, from tiny_module's weights:
    ``participants(r)`` gives round r's (client, aggregation weight) pairs and
    ``control_weight(i)`` line 17's weight of client i's control change. Returns x; with
    ``local``, no aggregation: each client starts from its own last model (x the first
    time), and the clients' models are returned, {client: y_i}."""
    net = tiny_module(LR).network
    x = params_of(net)
    c = [torch.zeros_like(t) for t in x]
    c_i = {i: [torch.zeros_like(t) for t in x] for i in range(len(clients))}
    own = {}
    for r in range(rounds):
        dy = [torch.zeros_like(t) for t in x]
        dc = [torch.zeros_like(t) for t in x]
        for i, w in participants(r):
            start = own.get(i, x) if local else x
            with torch.no_grad():
                for q, t in zip(net.parameters(), start):
                    q.copy_(t)
            correction = [cc - ci for cc, ci in zip(c, c_i[i])]  # y ← y − η(g − c_i + c)
            k = local_sgd(net, clients[i]["train"], steps, LR, BATCH, SEED, r, i,
                          grad_extra=correction)  # fmt: skip
            y = own[i] = params_of(net)
            new_ci = [ci - cc + (s - yy) / (k * LR) for ci, cc, s, yy in zip(c_i[i], c, start, y)]
            for a, yy, xx in zip(dy, y, x):
                a += w * (yy - xx)
            for b, nc, oc in zip(dc, new_ci, c_i[i]):
                b += control_weight(i) * (nc - oc)
            c_i[i] = new_ci
        x = x if local else [xx + d for xx, d in zip(x, dy)]
        c = [cc + d for cc, d in zip(c, dc)]
    return own if local else x


@pytest.mark.parametrize(
    ("weighting", "control_weighting", "steps"),
    [("uniform", "uniform", STEPS), ("samples", "target", STEPS), ("samples", "target", 1)],
)
def test_scaffold_equals_karimireddy_algorithm_1_option_2(weighting, control_weighting, steps):
    """Alg. 1 with option II; "target" replaces line 17's 1/N by the clients' p_i (unequal
    sample counts here), keeping c = Σ p_i c_i; K = 1 local step too (c_i⁺ from a single
    step)."""
    sampler = UniformSampler(3)
    ours = run_strategy(
        sampler,
        [SCAFFOLD(control_weighting=control_weighting), FedAvg(weighting=weighting)],
        steps=steps,
    )

    clients = tiny_clients()
    n = len(clients)
    p = sample_weights(clients, weighting)
    assert weighting == "uniform" or len(set(p.tolist())) > 1  # the two rules differ

    def participants(r):
        part = sampler.sample(r, SEED, p)
        return zip(part.clients, part.weights)

    def control_weight(i):
        return 1 / n if control_weighting == "uniform" else float(p[i])

    x = _scaffold_by_hand(clients, ROUNDS, steps, participants, control_weight)
    assert max_abs_diff(ours, x) <= 1e-6


@pytest.mark.parametrize("vectorize", [False, True])
def test_scaffold_beside_local_takes_each_clients_update_from_its_own_start(vectorize):
    """Under Local each client starts from its own last model, so c_i⁺ = c_i − c +
    (y_i^start − y_i)/(Kη) takes that start, not the global model, which never moves: the
    update the other callbacks see is the client's own (Local's ``transform_update``).
    Clients drawn again in later rounds tell the two apart."""
    sampler = UniformSampler(3)
    strategy = FederatedStrategy(sampler=sampler, local_steps=STEPS, seed=SEED, vectorize=vectorize)
    trainer = make_trainer(strategy, ROUNDS, [Local(), SCAFFOLD()])
    trainer.fit(tiny_module(LR), datamodule=tiny_datamodule(BATCH))
    clients = tiny_clients()
    p = sample_weights(clients)

    def participants(r):
        part = sampler.sample(r, SEED, p)
        return zip(part.clients, part.weights)

    own = _scaffold_by_hand(clients, ROUNDS, STEPS, participants, lambda i: 1 / 10, local=True)
    for c, theta in own.items():
        stored = trainer.strategy.client_store.get(c, LOCAL_KEY)
        flat = torch.cat([t.flatten() for t in theta])
        assert (stored[: len(flat)] - flat).abs().max() <= 1e-5, c


def test_scaffold_beside_gossip_takes_each_clients_update_from_its_mixed_start():
    """GossipAveraging over a ring (weights 1/3 to itself and each neighbour): client t
    starts from its own mix of the last round's models, not the strategy's global model
    (their sample-weighted mean), and SCAFFOLD's c_i⁺ takes its update from that start."""
    from lightning_fl.callbacks import GossipAveraging

    n = 10
    ring = [[1 / 3 if (s - t) % n in (0, 1, n - 1) else 0.0 for t in range(n)] for s in range(n)]
    strategy = FederatedStrategy(local_steps=STEPS, seed=SEED)
    gossip = GossipAveraging(mixing_matrix=ring, step_scale="none")
    module = tiny_module(LR)
    make_trainer(strategy, 3, [gossip, SCAFFOLD()]).fit(module, datamodule=tiny_datamodule(BATCH))
    clients = tiny_clients()
    net = tiny_module(LR).network
    starts = [params_of(net)] * n
    c = [torch.zeros_like(t) for t in starts[0]]
    c_i = {i: [torch.zeros_like(t) for t in c] for i in range(n)}
    for r in range(3):
        ends, dc = [], [torch.zeros_like(t) for t in c]
        for i in range(n):
            with torch.no_grad():
                for q, t in zip(net.parameters(), starts[i]):
                    q.copy_(t)
            correction = [cc - ci for cc, ci in zip(c, c_i[i])]
            k = local_sgd(net, clients[i]["train"], STEPS, LR, BATCH, SEED, r, i,
                          grad_extra=correction)  # fmt: skip
            y = params_of(net)
            new_ci = [
                ci - cc + (s - yy) / (k * LR) for ci, cc, s, yy in zip(c_i[i], c, starts[i], y)
            ]
            for b, nc, oc in zip(dc, new_ci, c_i[i]):
                b += (nc - oc) / n
            c_i[i] = new_ci
            ends.append(y)
        starts = [[sum(ring[s][t] * ends[s][j] for s in range(n)) for j in range(len(c))]
                  for t in range(n)]  # fmt: skip
        c = [cc + d for cc, d in zip(c, dc)]
    sizes = torch.tensor([float(len(cl["train"][1])) for cl in clients])
    share = sizes / sizes.sum()
    average = [sum(float(share[t]) * starts[t][j] for t in range(n)) for j in range(len(c))]
    assert max_abs_diff(params_of(module), average) <= 1e-5


def test_scaffold_controls_live_in_the_client_store():
    module = tiny_module(LR)
    strategy = FederatedStrategy(sampler=UniformSampler(3), local_steps=STEPS, seed=SEED)
    make_trainer(strategy, 2, [SCAFFOLD()]).fit(module, datamodule=tiny_datamodule(BATCH))
    stored = strategy.client_store.clients()
    assert 3 <= len(stored) <= 6
    d = sum(q.numel() for q in module.parameters())
    assert strategy.client_store.nbytes() == 4 * d * len(stored)


def test_local_steps_vs_local_epochs_batches():
    module = tiny_module(LR)
    strategy = FederatedStrategy(local_epochs=2, seed=SEED)
    trainer = make_trainer(strategy, 1, [FedAvg()])
    trainer.fit(module, datamodule=tiny_datamodule(BATCH))
    counts = [len(c["train"][1]) for c in tiny_clients()]
    assert strategy.current_round.schedule.num_batches == tuple(2 * -(-n // BATCH) for n in counts)
    assert trainer.global_step == sum(strategy.current_round.schedule.num_batches)


def test_keep_optimizer_state_restores_momentum():
    """With keep_optimizer_state, a client's momentum survives to its next round, which
    changes the trajectory; without it every round starts from a fresh optimizer."""

    def run(keep: bool):
        module = tiny_module(LR)
        module.hparams.momentum = 0.9
        strategy = FederatedStrategy(local_steps=2, seed=SEED, keep_optimizer_state=keep)
        make_trainer(strategy, 2, [FedAvg()]).fit(module, datamodule=tiny_datamodule(BATCH))
        return strategy, params_of(module)

    kept, kept_params = run(True)
    fresh, fresh_params = run(False)
    saved = kept.client_store.get(0, "optimizer_0")
    assert saved and "momentum_buffer" in saved[0]
    assert fresh.client_store.get(0, "optimizer_0") is None
    assert max_abs_diff(kept_params, fresh_params) > 1e-6


@pytest.mark.parametrize("keep", [False, True], ids=["fresh", "kept"])
def test_momentum_by_hand_reset_for_every_client_or_kept_per_client(keep):
    """SGD with momentum 0.9 (torch's rule: b ← g at a buffer's first step, then
    b ← 0.9 b + g; θ ← θ − η b), 3 rounds of 3 steps over the three unequal clients:
    every client starts each round without a buffer, or, with keep_optimizer_state, from
    the buffer its own previous round left (never another client's)."""
    rounds, steps, momentum = 3, 3, 0.9
    module = tiny_module(LR)
    module.hparams.momentum = momentum
    strategy = FederatedStrategy(local_steps=steps, seed=SEED, keep_optimizer_state=keep)
    make_trainer(strategy, rounds, [FedAvg()]).fit(module, datamodule=tiny_datamodule(BATCH))

    clients = tiny_clients()
    net = tiny_module(LR).network
    weights = sample_weights(clients)
    theta = params_of(net)
    buffers: dict[int, list[torch.Tensor]] = {}
    for r in range(rounds):
        delta = [torch.zeros_like(t) for t in theta]
        for c in range(len(clients)):
            with torch.no_grad():
                for q, t in zip(net.parameters(), theta):
                    q.copy_(t)
            buffer = buffers.get(c) if keep else None
            torch.manual_seed(derive_seed(SEED, "client", r, c))
            batches = client_batches(clients[c]["train"], BATCH, SEED, r, c)
            for _, (x, y) in zip(range(steps), batches):
                net.zero_grad()
                F.cross_entropy(net(x), y).backward()
                grads = [q.grad.detach() for q in net.parameters()]
                if buffer is None:
                    buffer = [g.clone() for g in grads]
                else:
                    buffer = [momentum * b + g for b, g in zip(buffer, grads)]
                with torch.no_grad():
                    for q, b in zip(net.parameters(), buffer):
                        q -= LR * b
            buffers[c] = buffer
            for d, q, t in zip(delta, net.parameters(), theta):
                d += weights[c] * (q.detach() - t)
        theta = [t + d for t, d in zip(theta, delta)]
    assert max_abs_diff(params_of(module), theta) <= 1e-6


def test_fedprox_with_mu_zero_is_fedavg_and_a_negative_mu_is_refused():
    """μ = 0 is allowed and is FedAvg, to the bit (the proximal term is not added at all);
    μ < 0 is refused."""
    sampler = UniformSampler(3)
    plain = run_strategy(sampler, [])
    zero = run_strategy(UniformSampler(3), [FedProx(0.0)])
    assert max_abs_diff(plain, zero) == 0.0
    with pytest.raises(ValueError, match="mu is -0.1, not ≥ 0"):
        FedProx(-0.1)


def test_the_flat_update_helpers_by_hand():
    """flatten / unflatten / add_flat_ over tensors of three shapes (offsets 0, 6, 7),
    add_flat_ casting a float64 vector to each tensor's dtype; all_finite finds a NaN or an
    Inf in the last tensor only, holds for no tensors at all, and for large finite entries
    whose norm overflows float32 (the vectorized path keeps such an update too)."""
    from lightning_fl.engine.tensors import add_flat_, all_finite, flatten, unflatten

    like = [torch.zeros(2, 3), torch.zeros(1), torch.zeros(2, dtype=torch.float64)]
    flat = torch.arange(1.0, 10.0, dtype=torch.float64)
    parts = unflatten(flat, like)
    assert [p.shape for p in parts] == [(2, 3), (1,), (2,)]
    assert parts[0].tolist() == [[1, 2, 3], [4, 5, 6]] and parts[1].tolist() == [7]
    assert parts[2].tolist() == [8, 9] and torch.equal(flatten(parts), flat)
    tensors = [torch.full((2, 3), 0.5), torch.full((1,), -1.0), torch.ones(2, dtype=torch.float64)]
    add_flat_(tensors, flat)
    assert tensors[0].dtype == torch.float32
    assert tensors[0].tolist() == [[1.5, 2.5, 3.5], [4.5, 5.5, 6.5]]
    assert tensors[1].tolist() == [6.0] and tensors[2].tolist() == [9.0, 10.0]
    assert all_finite([]) is True and all_finite(tensors) is True
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert all_finite([torch.ones(3), torch.tensor([1.0, bad])]) is False
    assert all_finite([torch.ones(2), torch.full((4,), 1e20), torch.tensor([3e38])]) is True


def test_scaffold_uniform_control_weights_count_only_clients_with_data():
    """Line 17's 1/N under uniform control weighting, with a sixth client that has no
    training data: N counts the 5 clients that can take part (one of them with a single
    sample), not 6 (full participation, 3 rounds, unequal clients, FedAvg by size)."""
    from lightning_fl import FullParticipation
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    clients = tiny_clients()[:5]
    clients[4] = {k: (v[0][:1], v[1][:1]) if k == "train" else v for k, v in clients[4].items()}
    empty = {k: (v[0][:0], v[1][:0]) if k == "train" else v for k, v in clients[0].items()}
    module = tiny_module(LR)
    strategy = FederatedStrategy(sampler=FullParticipation(), local_steps=STEPS, seed=SEED)
    callbacks = [SCAFFOLD(control_weighting="uniform"), FedAvg()]
    with pytest.warns(UserWarning, match="no training data"):
        make_trainer(strategy, 3, callbacks).fit(
            module, datamodule=InMemoryFederatedDataModule([*clients, empty], batch_size=BATCH)
        )

    p = sample_weights(clients)
    every_client = [(i, float(p[i])) for i in range(5)]
    x = _scaffold_by_hand(clients, 3, STEPS, lambda r: every_client, lambda i: 1 / 5)
    assert max_abs_diff(params_of(module), x) <= 1e-6


def test_target_weights_by_sample_count_and_uniform_over_clients_with_data():
    """p_i = n_i / n, or 1/|{i: n_i > 0}| (``weighting="uniform"``): a client without
    training data weighs 0 either way, and one with a single sample counts as any other."""
    counts = [3, 0, 1, 4]
    assert FedAvg().target_weights(counts).tolist() == [0.375, 0.0, 0.125, 0.5]
    uniform = FedAvg(weighting="uniform").target_weights(counts).tolist()
    assert uniform == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3], abs=1e-15)
