"""Asynchronous FL (Fraboni et al. JMLR 2023; thesis ch. 4): the schemes' limits, event
counts, staleness against a hand-written event loop, unbiased TIME-BASED weights, resume."""

from __future__ import annotations

import copy
import csv
from fractions import Fraction

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fl import (
    AsyncSchedule,
    Classifier,
    ClientTimes,
    FedBuffSchedule,
    FederatedStrategy,
    FedFixSchedule,
    SyncSchedule,
    UniformSampler,
)
from lightning_fl.callbacks import AsynchronousFL, FedAvg, FedProx
from lightning_fl.systems.asynchrony import async_aggregations, exact
from tests.helpers import (
    local_sgd,
    make_trainer,
    max_abs_diff,
    params_of,
    tiny_clients,
    tiny_datamodule,
    tiny_module,
)

F0, F80 = ClientTimes(0.0), ClientTimes(80.0)
LR, STEPS, SEED = 0.1, 3, 4


def _clients_with_one_sample_then_one_without_data() -> list[dict]:
    """Four tiny clients, client 1 cut to one training sample, and a fifth, client 4,
    with no training data."""
    clients = tiny_clients(num_clients=4)
    x, y = clients[1]["train"]
    clients[1] = {**clients[1], "train": (x[:1], y[:1])}
    empty = {k: (v[0][:0], v[1][:0]) if k == "train" else v for k, v in clients[0].items()}
    return [*clients, empty]


def _fit(callbacks, rounds, num_clients=6, batch_size=4, strategy=None, **kw):
    module = tiny_module(LR)
    trainer = make_trainer(
        strategy or FederatedStrategy(local_steps=STEPS, seed=SEED), rounds, callbacks, **kw
    )
    trainer.fit(module, datamodule=tiny_datamodule(batch_size, num_clients=num_clients))
    return module, trainer


# ---- the limits the thesis states ------------------------------------------------------


@pytest.mark.parametrize(
    "schedule",
    [SyncSchedule(F0), FedFixSchedule(1.0, F0), FedFixSchedule(1.7, F0), FedBuffSchedule(6, F0),
     FedBuffSchedule(6, F0, restart="on_send"), SyncSchedule(F80), FedFixSchedule(1.0, F80)],
    ids=["sync", "fedfix-1", "fedfix-1.7", "fedbuff-M", "fedbuff-M-on-send", "sync-F80",
         "fedfix-1-F80"],
)  # fmt: skip
def test_schemes_that_reduce_to_synchronous_fedavg_equal_it_exactly(schedule):
    """FedFix with Δt ≥ max τ, FedBuff with c = M under F0, and sync under any times: every
    client from the current model with d_i = p_i, exactly FedAvg with full participation."""
    fedavg, _ = _fit([FedAvg()], 4)
    ours, trainer = _fit([AsynchronousFL(schedule)], 4)
    assert max_abs_diff(params_of(fedavg), params_of(ours)) == 0.0
    assert trainer.callback_metrics["fl/staleness"].item() == 0.0


def test_fedfix_half_period_under_f0_is_fedavg_with_server_lr_2_every_other_aggregation():
    """Thesis §4.4: Δt = 0.5 under F0 gives d_i = 2 p_i, every other aggregation empty.
    Full-batch local steps make the data order irrelevant (round indices differ)."""
    fedavg, _ = _fit([FedAvg(server_lr=2.0)], 2, batch_size=64)
    fedfix, trainer = _fit([AsynchronousFL(FedFixSchedule(0.5, F0))], 4, batch_size=64)
    assert max_abs_diff(params_of(fedavg), params_of(fedfix)) < 1e-6
    assert trainer.callback_metrics["fl/time"].item() == pytest.approx(2.0)
    schedule = FedFixSchedule(0.5, F0)
    schedule.reset(6, 0)
    sizes = []
    for _ in range(6):
        event = schedule.plan()
        sizes.append(len(event.clients))
        schedule.commit(event)
    assert sizes == [0, 6, 0, 6, 0, 6]


# ---- event counts ----------------------------------------------------------------------


def test_event_counts_for_20_clients_under_f80_in_5000_time_units():
    for schedule, expected in ((SyncSchedule(F80), 5000), (FedFixSchedule(0.5, F80), 10000)):
        schedule.reset(20, 0)
        assert schedule.count_until(5000)[0] == expected
    schedule = AsyncSchedule(F80)
    schedule.reset(20, 0)
    count, per_client = schedule.count_until(5000)
    assert count == async_aggregations(20, F80, 5000) == 206530
    assert per_client[-1] / per_client[0] == pytest.approx(5.0)  # fastest sends 5× more


def test_fx_times_are_the_authors_evenly_spaced_times():
    assert ClientTimes(80).means(5).tolist() == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert ClientTimes(0).means(3).tolist() == [1.0, 1.0, 1.0]
    assert ClientTimes(80).means(2).tolist() == [1.0, 0.2]  # both ends of the range
    assert ClientTimes(80).means(1).tolist() == [1.0]  # one client: no spacing to divide
    assert ClientTimes(80).means(2).dtype == np.float64
    draws = [ClientTimes(50, distribution="exponential").draw(1, k, 0, np.array([1.0, 0.5]))
             for k in range(20000)]  # fmt: skip
    assert np.mean(draws) == pytest.approx(0.5, rel=0.03)


# ---- staleness against a hand-written event loop ----------------------------------------


def _hand_written_async(clients, rounds, weights_of, times, lr_g=1.0, mu=0.0):
    """Async FedAvg by hand: each aggregation takes the earliest return (lowest index on
    ties); that client's K steps start from the model it last received, with FedProx's
    (μ/2)‖θ − θ^ρ‖² toward that model when ``mu`` > 0."""
    torch.manual_seed(1)  # tiny_module's initialization
    start = tiny_module(LR)
    theta = [p.detach().clone() for p in start.network.parameters()]
    history = {0: [t.clone() for t in theta]}
    ready = list(times)
    received = [0] * len(clients)
    for n in range(rounds):
        i = min(range(len(clients)), key=lambda k: (ready[k], k))
        net = copy.deepcopy(start.network)
        with torch.no_grad():
            for p, v in zip(net.parameters(), history[received[i]]):
                p.copy_(v)
        anchor = history[received[i]]

        def prox(net, anchor=anchor):
            return mu / 2 * sum(((q - a) ** 2).sum() for q, a in zip(net.parameters(), anchor))

        local_sgd(
            net, clients[i]["train"], STEPS, LR, 4, SEED, n, i, loss_extra=prox if mu else None
        )
        delta = [p.detach() - v for p, v in zip(net.parameters(), anchor)]
        theta = [t + lr_g * weights_of[i] * d for t, d in zip(theta, delta)]
        history[n + 1] = [t.clone() for t in theta]
        ready[i] += times[i]
        received[i] = n + 1
    return theta


@pytest.mark.parametrize("weights", ["time_based", "identical"])
def test_async_updates_come_from_the_stale_model_each_client_received(weights):
    rounds, m = 9, 4
    times = ClientTimes(80).means(m)
    clients = tiny_clients(num_clients=m)
    counts = np.array([len(c["train"][1]) for c in clients], dtype=float)
    p = counts / counts.sum()
    d = np.sum(1 / times) * times * p if weights == "time_based" else np.ones(m)
    expected = _hand_written_async(clients, rounds, d, times, lr_g=0.5)
    callback = AsynchronousFL(AsyncSchedule(F80), weights, server_lr=0.5)
    ours, _ = _fit([callback], rounds, num_clients=m)
    assert max_abs_diff(expected, params_of(ours)) < 1e-6
    assert len(callback.models) <= m  # only the versions in flight are kept


@pytest.mark.parametrize("vectorize", [False, True])
def test_fedprox_pulls_a_stale_client_toward_the_model_it_received(vectorize):
    """FedProx's anchor under asynchrony is θ^ρ, the stale model the client started from,
    not the server's current θ^n (Li et al. 2020 eq. 2: the model the client received):
    with F80's unequal times, clients return several aggregations after they were sent."""
    rounds, m, mu = 9, 4, 1.0
    times = ClientTimes(80).means(m)
    clients = tiny_clients(num_clients=m)
    expected = _hand_written_async(clients, rounds, np.ones(m), times, lr_g=0.5, mu=mu)
    callbacks = [FedProx(mu=mu), AsynchronousFL(AsyncSchedule(F80), "identical", server_lr=0.5)]
    strategy = FederatedStrategy(local_steps=STEPS, seed=SEED, vectorize=vectorize)
    ours, _ = _fit(callbacks, rounds, num_clients=m, strategy=strategy)
    assert max_abs_diff(expected, params_of(ours)) < 1e-6


# ---- unbiasedness (Thm 4.3) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "identical"),
    [(AsyncSchedule(F80), 1.0), (FedFixSchedule(0.3, F80), 1 / 7), (FedBuffSchedule(3, F80), 1 / 3),
     (FedBuffSchedule(3, ClientTimes(60), restart="on_send"), 1 / 3), (SyncSchedule(F80), 1 / 7)],
    ids=["async", "fedfix", "fedbuff", "fedbuff-on-send", "sync"],
)  # fmt: skip
def test_time_based_weights_average_to_p_over_a_window(schedule, identical):
    """(1/W) Σ_n ω_i(n) → p_i over the window, where ω_i(n) = 1(i ∈ S_n) d_i; IDENTICAL
    is d_i = 1 (async), 1/c (FedBuff), 1/M (sync, FedFix)."""
    m = 7
    schedule.reset(m, 0)
    p = np.arange(1, m + 1, dtype=float)
    p /= p.sum()
    d = schedule.time_based_weights(p)
    total, n = np.zeros(m), 10_000
    for _ in range(n):
        event = schedule.plan()
        total[list(event.clients)] += d[list(event.clients)]
        schedule.commit(event)
    assert total / n == pytest.approx(p, abs=2e-3)
    assert schedule.identical_weights().tolist() == [identical] * m


# ---- resume, several schemes ----------------------------------------------------------


@pytest.mark.parametrize(
    "make", [lambda: AsyncSchedule(F80),
             lambda: FedBuffSchedule(3, ClientTimes(70, distribution="exponential"), "on_send")],
    ids=["async", "fedbuff-exponential-on-send"],
)  # fmt: skip
def test_resume_with_clients_in_flight_is_exact(make, tmp_path):
    full, full_trainer = _fit([AsynchronousFL(make())], 10)
    checkpoint = ModelCheckpoint(tmp_path, "{epoch}", save_top_k=-1, every_n_epochs=1)
    _fit([AsynchronousFL(make()), checkpoint], 4, enable_checkpointing=True)
    saved = torch.load(tmp_path / "epoch=3.ckpt", weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if "AsynchronousFL" in k]
    assert len(set(state["schedule"]["version"])) > 1  # clients in flight on several versions
    module = tiny_module(LR, seed=99)
    trainer = make_trainer(FederatedStrategy(local_steps=STEPS, seed=SEED), 10,
                           [AsynchronousFL(make())])  # fmt: skip
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=6),
                ckpt_path=str(tmp_path / "epoch=3.ckpt"), weights_only=True)  # fmt: skip
    assert max_abs_diff(params_of(full), params_of(module)) == 0.0
    assert trainer.callback_metrics["fl/time"] == full_trainer.callback_metrics["fl/time"]


def test_updates_per_client_are_written_beside_the_logs_and_only_with_a_logger(tmp_path):
    """Asynchronous FedAvg sends one update per aggregation: the counts in
    updates_per_client.csv add up to the rounds, the fastest client (τ = 0.2) sending the
    most; without a logger nothing is written."""
    from lightning.pytorch.loggers import CSVLogger

    callback = AsynchronousFL(AsyncSchedule(F80))
    _fit([callback], 12, num_clients=5, logger=CSVLogger(tmp_path, name="async"))
    (path,) = tmp_path.glob("async/version_0/updates_per_client.csv")
    rows = list(csv.DictReader(open(path)))
    counts = [int(r["updates"]) for r in rows]
    assert [int(r["client"]) for r in rows] == [0, 1, 2, 3, 4]
    assert sum(counts) == 12 and counts == callback.updates_per_client().tolist()
    assert counts[4] == max(counts) > counts[0]
    _fit(
        [AsynchronousFL(AsyncSchedule(F80))], 2, num_clients=5, default_root_dir=tmp_path / "quiet"
    )
    assert not list((tmp_path / "quiet").rglob("updates_per_client.csv"))


def test_clients_with_one_sample_take_part_and_clients_without_data_do_not():
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    clients = _clients_with_one_sample_then_one_without_data()
    callback = AsynchronousFL(SyncSchedule())
    trainer = make_trainer(FederatedStrategy(local_steps=STEPS, seed=SEED), 1, [callback])
    trainer.fit(tiny_module(LR), datamodule=InMemoryFederatedDataModule(clients, batch_size=4))
    assert callback.clients == [0, 1, 2, 3]
    # uniform target weights leave out the client without data: sync's d_i = p_i = 1/4
    uniform = AsynchronousFL(SyncSchedule(), weighting="uniform")
    trainer = make_trainer(FederatedStrategy(local_steps=STEPS, seed=SEED), 1, [uniform])
    trainer.fit(tiny_module(LR), datamodule=InMemoryFederatedDataModule(clients, batch_size=4))
    assert uniform.d.tolist() == pytest.approx([0.25] * 4, abs=1e-15)


def test_fedbuff_with_time_based_weights_optimizes_the_target_weights():
    """Eq. 4.10: q_i ∝ (participation frequency)·d_i = p_i when d_i = p_i / frequency."""
    callback = AsynchronousFL(FedBuffSchedule(2, F80))
    _fit([callback], 1, num_clients=5)
    counts = torch.tensor([len(c["train"][1]) for c in tiny_clients(num_clients=5)])
    p = (counts.double() / counts.sum()).tolist()
    assert callback.surrogate_weights().tolist() == pytest.approx(p, rel=1e-9)


def test_time_budget_stops_training():
    _, trainer = _fit([AsynchronousFL(SyncSchedule(F80), time_budget=1)], 50)
    assert trainer.current_epoch == 1  # the first aggregation, at t = 1, is at the budget
    decimals = SyncSchedule(ClientTimes(times=[0.1, 0.3, 0.2, 0.1, 0.1, 0.1]))
    _, trainer = _fit([AsynchronousFL(decimals, time_budget=0.6)], 50)
    assert trainer.current_epoch == 2  # at 0.3 and 0.6, exactly (0.6 < 6/10 in floats)
    _, trainer = _fit([AsynchronousFL(decimals, time_budget=0.3)], 50)
    assert trainer.current_epoch == 1  # the first, at 3/10, is within a budget of 0.3
    _, trainer = _fit([AsynchronousFL(SyncSchedule(F80), time_budget=3.5)], 50)
    assert trainer.current_epoch == 3
    assert trainer.callback_metrics["fl/time"].item() == 3.0


def test_surrogate_weights_follow_update_frequency_with_identical_weights():
    """IDENTICAL async optimizes Σ q_i L_i with q_i ∝ 1/τ_i (thesis eq. 4.10)."""
    callback = AsynchronousFL(AsyncSchedule(F80), "identical")
    _fit([callback], 1, num_clients=5)
    q = callback.surrogate_weights()
    inverse = 1 / ClientTimes(80).means(5)
    assert q == pytest.approx(inverse / inverse.sum(), abs=1e-3)
    _fit([callback], 1, num_clients=3)  # the same callback in a new fit: computed again
    inverse = 1 / ClientTimes(80).means(3)
    assert callback.surrogate_weights() == pytest.approx(inverse / inverse.sum(), abs=1e-3)


# ---- bad input -------------------------------------------------------------------------


def test_bad_asynchronous_settings_get_clear_errors():
    with pytest.raises(ValueError, match=r"period Δt must be > 0"):
        FedFixSchedule(0.0)
    for bad in (0, True):
        with pytest.raises(ValueError, match=f"buffer_size c must be >= 1, got {bad}"):
            FedBuffSchedule(bad)
    with pytest.raises(ValueError, match=r"heterogeneity X must be in \[0, 100\)"):
        ClientTimes(100)
    with pytest.raises(ValueError, match=r"heterogeneity X must be in \[0, 100\)"):
        ClientTimes(-5)
    for bad in ([1.0, 0.0], [1.0, "2"], []):
        with pytest.raises(ValueError, match="times must be positive, one per client"):
            ClientTimes(times=bad)
    with pytest.raises(ValueError, match="time_budget must be > 0"):
        AsynchronousFL(SyncSchedule(), time_budget=0)
    with pytest.raises(ValueError, match=r"buffer_size c = 9 but only 6 clients"):
        _fit([AsynchronousFL(FedBuffSchedule(9))], 1)
    with pytest.raises(ValueError, match="allows no aggregation: the first one ends at t = 1"):
        _fit([AsynchronousFL(SyncSchedule(F80), time_budget=0.5)], 3)
    with pytest.raises(ValueError, match="times has 2 values but there are 6 clients"):
        _fit([AsynchronousFL(SyncSchedule(ClientTimes(times=[1.0, 2.0])))], 1)
    strategy = FederatedStrategy(local_steps=1, sampler=UniformSampler(2))
    with pytest.raises(ValueError, match="AsynchronousFL cannot be combined with UniformSampler"):
        _fit([AsynchronousFL(AsyncSchedule())], 1, strategy=strategy)


def test_federated_objective_logs_the_p_weighted_client_losses():
    import torch.nn.functional as F

    from lightning_fl.callbacks import FederatedObjective

    callback = AsynchronousFL(AsyncSchedule(F80), "identical")
    module, trainer = _fit([callback, FederatedObjective()], 3, num_clients=5)
    clients = tiny_clients(num_clients=5)
    with torch.no_grad():
        losses = torch.tensor([float(F.cross_entropy(module(c["train"][0]), c["train"][1]))
                               for c in clients], dtype=torch.float64)  # fmt: skip
    counts = torch.tensor([len(c["train"][1]) for c in clients], dtype=torch.float64)
    p = counts / counts.sum()
    metrics = trainer.callback_metrics
    assert metrics["fl/federated_loss"].item() == pytest.approx(float(p @ losses), rel=1e-5)
    spread = float(p @ (losses - p @ losses) ** 2) ** 0.5
    assert metrics["fl/client_loss_std"].item() == pytest.approx(spread, rel=1e-4)
    q = torch.as_tensor(callback.surrogate_weights())
    assert metrics["fl/surrogate_loss"].item() == pytest.approx(float(q @ losses), rel=1e-5)
    assert callback.updates_per_client().sum() == 3  # one update per async aggregation


def test_fedbuff_on_send_events_by_hand():
    """FedBuff(c = 2) with fixed times (1, 3, 3) and restart on send, three aggregations
    worked out by hand: an aggregation happens at the c-th return; a client that sent
    before it restarted at its own return on the model current then (θ^n), the client
    whose update filled the buffer restarts on θ^{n+1}; ties go to the lower index."""
    schedule = FedBuffSchedule(2, ClientTimes(times=[1.0, 3.0, 3.0]), restart="on_send")
    schedule.reset(3, seed=0)
    events = []
    for _ in range(3):
        event = schedule.plan()
        events.append((event.time, event.clients, event.versions))
        schedule.commit(event)
    assert events == [
        (3.0, (0, 1), (0, 0)),  # client 0 sent at 1 and restarted then on θ^0
        (3.0, (0, 2), (0, 0)),  # client 0 again (1 + 1 = 2), client 2 (3, index after 1)
        (6.0, (0, 1), (1, 1)),  # client 0 restarted at 2 on θ^1; client 1 at 3 on θ^1
    ]


# ---- exact simulated time (issue 26, item 1) -------------------------------------------


def test_returns_at_the_budget_count_and_the_count_is_the_closed_form():
    """M = 10 under F80 until T = 10⁴: 212,803 asynchronous aggregations, Σ_i ⌊T/τ_i⌋
    (float time dropped the returns that fall exactly at T and counted 212,802)."""

    schedule = AsyncSchedule(ClientTimes(80))
    schedule.reset(10, 0)
    taus = [1 - Fraction(i * 4, 5 * 9) for i in range(10)]  # τ_i = 1 − i·0.8/9, by hand
    expected = sum((10_000 / t).__floor__() for t in taus)
    assert expected == 212_803
    assert schedule.count_until(10_000)[0] == expected
    assert async_aggregations(10, ClientTimes(80), 10_000) == expected


def test_simultaneous_returns_are_aggregated_in_client_order():
    """Asynchronous FedAvg under F80 with 20 clients: the n-th aggregation is the n-th
    element of {(k·τ_i, i)} sorted by time and then client index, with τ_i exact
    rationals. Many returns coincide (client 0 at 1 and client 19 at 5·τ_19 = 1);
    float times ordered them by rounding noise (client 19 before client 0)."""

    taus = [1 - Fraction(i * 4, 5 * 19) for i in range(20)]
    reference = sorted((k * t, i) for i, t in enumerate(taus) for k in range(1, 600))[:3000]
    ties = sum(1 for a, b in zip(reference, reference[1:]) if a[0] == b[0])
    assert ties > 100
    schedule = AsyncSchedule(ClientTimes(80))
    schedule.reset(20, 0)
    for time, client in reference:
        event = schedule.plan()
        assert (event.time, event.clients) == (time, (client,))
        schedule.commit(event)


def test_a_clients_k_th_piece_of_work_takes_its_k_th_draw():
    """Exponential times: client i's first work (from time 0) is draw (i, 0), the one it
    starts at the aggregation is draw (i, 1), whatever the order of events."""
    times = ClientTimes(50, distribution="exponential")
    schedule = AsyncSchedule(times)
    schedule.reset(3, 7)
    means = times.exact_means(3)
    assert schedule.ready == [times.draw(i, 0, 7, means) for i in range(3)]
    event = schedule.plan()
    schedule.commit(event)
    (i,) = event.clients
    assert schedule.ready[i] == event.time + times.draw(i, 1, 7, means)
    assert len({times.draw(i, k, 7, means) for k in range(3)}) == 3  # the draws differ


def test_a_checkpoint_with_float_times_loads_them_as_the_decimals_they_print_as():
    """Checkpoints made before exact time stored floats: 0.3 loads as 3/10, and the
    strings of newer ones as the fractions they spell."""

    schedule = AsyncSchedule(ClientTimes(times=[0.1, 0.2]))
    state = {"num_clients": 2, "seed": 0, "now": 0.3, "round": 4, "starts": [3, 1],
             "version": [3, 2], "ready": [0.4, 0.5]}  # fmt: skip
    schedule.load_state_dict(state)
    assert (schedule.now, schedule.ready) == (Fraction(3, 10), [Fraction(2, 5), Fraction(1, 2)])
    schedule.load_state_dict({**state, "now": "1/3", "ready": ["2/5", "7/15"]})
    assert (schedule.now, schedule.ready) == (Fraction(1, 3), [Fraction(2, 5), Fraction(7, 15)])
    assert [exact("1/3"), exact(0.1), exact(3), exact(Fraction(2, 7))] == [
        Fraction(1, 3), Fraction(1, 10), Fraction(3), Fraction(2, 7)]  # fmt: skip


def test_decimal_times_tie_exactly_and_the_trainer_stops_at_the_budget():
    """Times 0.1 and 0.3 (decimals) meet exactly at 0.3, 0.6 and 0.9, and the returns at
    the budget T = 0.9 are aggregated: 9 + 3 + 1 + 1 = 14 aggregations, and fl/time is
    logged in float64."""
    times = ClientTimes(times=[0.1, 0.3, 0.7, 0.9, 1.1, 2.0])
    schedule = AsyncSchedule(times)
    schedule.reset(6, 0)
    assert schedule.count_until(0.9)[0] == 14 == async_aggregations(6, times, 0.9)
    assert schedule.count_until(0.9)[1].tolist() == [9, 3, 1, 1, 0, 0]  # ⌊0.9/τ_i⌋ each
    assert async_aggregations(2, ClientTimes(times=[0.1, 0.2]), 0.3) == 3 + 1  # not 2 + 1
    assert schedule.count_until(0.3)[0] == 4  # 0.1, 0.2 and both returns at 0.3 (< 0.3 as a float)
    buffered = FedBuffSchedule(2, ClientTimes(times=[0.3, 0.2, 0.9]))
    buffered.reset(3, 0)  # clients 1 then 0 return: the event lists them in index order
    assert buffered.plan().clients == (0, 1)
    event = buffered.plan()  # versions read twice: a tuple, not a one-shot generator
    assert (event.time, event.versions, event.versions) == (Fraction(3, 10), (0, 0), (0, 0))
    one = FedBuffSchedule(1, ClientTimes(times=[1.0, 1.0, 1e5]))  # c = 1 is allowed
    one.reset(3, 0)  # client 2 never returns within the 10⁴ aggregations of the dry run
    assert one.time_based_weights(np.array([0.5, 0.3, 0.2])).tolist() == [1.0, 0.6, 0.0]
    fedfix = FedFixSchedule(0.7, ClientTimes(times=[0.7, 0.9, 1.4, 2.1]))
    fedfix.reset(4, 0)  # eq. 4.40: d_i = ⌈τ_i/Δt⌉ p_i in exact decimals (2.1/0.7 > 3 in floats)
    assert fedfix.time_based_weights(np.full(4, 0.5)).tolist() == [0.5, 1.0, 1.0, 1.5]
    events = []
    for _ in range(14):
        event = schedule.plan()
        events.append((float(event.time), event.clients[0]))
        schedule.commit(event)
    assert events[2:4] == [(0.3, 0), (0.3, 1)] and events[-3:] == [(0.9, 0), (0.9, 1), (0.9, 3)]
    _, trainer = _fit([AsynchronousFL(AsyncSchedule(times), time_budget=0.9)], 50)
    assert trainer.current_epoch == 14
    assert trainer.callback_metrics["fl/time"].dtype == torch.float64
    assert trainer.callback_metrics["fl/time"].item() == 0.9


def test_exact_time_survives_a_checkpoint():
    schedule = FedBuffSchedule(3, ClientTimes(70, distribution="exponential"), "on_send")
    schedule.reset(6, 1)
    for _ in range(25):
        schedule.commit(schedule.plan())
    state = schedule.state_dict()
    assert all(isinstance(t, str) for t in state["ready"])
    restored = FedBuffSchedule(3, ClientTimes(70, distribution="exponential"), "on_send")
    restored.load_state_dict(state)
    for _ in range(25):
        a, b = schedule.plan(), restored.plan()
        assert a == b
        schedule.commit(a)
        restored.commit(b)


def _hand_written_fedbuff(clients, rounds, c, times, lr_g):
    """FedBuff(c), clients waiting for the aggregation, by hand: the n-th aggregation takes
    the c earliest returns (lowest index on ties) at the c-th return time; each sends K
    steps from the model it last received, weighted 1/c (IDENTICAL); then all c restart
    at that time on θ^{n+1}, while the others keep working on older models."""
    torch.manual_seed(1)  # tiny_module's initialization
    start = tiny_module(LR)
    theta = [p.detach().clone() for p in start.network.parameters()]
    history = {0: [t.clone() for t in theta]}
    ready, received = list(times), [0] * len(clients)
    versions = []
    for n in range(rounds):
        chosen = sorted(range(len(clients)), key=lambda k: (ready[k], k))[:c]
        now = max(ready[i] for i in chosen)
        step = [torch.zeros_like(t) for t in theta]
        for i in sorted(chosen):
            net = copy.deepcopy(start.network)
            with torch.no_grad():
                for p, v in zip(net.parameters(), history[received[i]]):
                    p.copy_(v)
            local_sgd(net, clients[i]["train"], STEPS, LR, 4, SEED, n, i)
            for s, p, v in zip(step, net.parameters(), history[received[i]]):
                s += (p.detach() - v) / c
        versions.append(sorted(received[i] for i in chosen))
        theta = [t + lr_g * s for t, s in zip(theta, step)]
        history[n + 1] = [t.clone() for t in theta]
        for i in chosen:
            ready[i], received[i] = now + times[i], n + 1
    return theta, versions


def test_fedbuff_with_a_buffer_smaller_than_the_federation_by_hand():
    """FedBuff(c = 2) of 4 clients with times (1, 3, 3, 2) and η_g = 0.7, 6 aggregations
    against the hand-written event loop: stale updates (a client aggregated on a model
    several versions old), weights 1/c, not 1/M."""
    rounds, times = 6, [1.0, 3.0, 3.0, 2.0]
    clients = tiny_clients(num_clients=4)
    expected, versions = _hand_written_fedbuff(clients, rounds, 2, times, lr_g=0.7)
    assert any(v[0] != v[1] for v in versions)  # updates of different ages in one buffer
    schedule = FedBuffSchedule(2, ClientTimes(times=times))
    ours, _ = _fit([AsynchronousFL(schedule, "identical", server_lr=0.7)], rounds,
                   num_clients=4)  # fmt: skip
    assert max_abs_diff(expected, params_of(ours)) < 1e-6


def test_federated_objective_every_third_round_and_at_the_last_by_hand(tmp_path):
    """FedAvg over 5 rounds with every_n_rounds = 3: the objective is logged after round
    2 (the third) and 4 (the last), not after 0, 1 or 3, each time as Σ p_i L_i of
    the model of that round over every client's training data in batches of 4 (a mean
    over samples, not over batches), with p_i by size, in eval mode (the network has
    dropout), the module back in training mode afterwards; a client without training data
    has p_i = 0 and adds nothing; a client with one training sample counts in full."""
    import csv

    import torch.nn.functional as F
    from lightning.pytorch.loggers import CSVLogger

    from lightning_fl.callbacks import FedAvg, FederatedObjective
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    class Snapshots(pl.Callback):
        def __init__(self) -> None:
            self.models = {}

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            assert pl_module.training  # the objective's evaluation left it as it was
            self.models[trainer.current_epoch] = copy.deepcopy(pl_module.network).eval()

    clients = _clients_with_one_sample_then_one_without_data()
    snapshots = Snapshots()
    logger = CSVLogger(tmp_path, name="objective")
    torch.manual_seed(1)
    network = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)
    )
    module = Classifier(network=network, lr=LR)
    trainer = make_trainer(FederatedStrategy(local_steps=STEPS, seed=SEED), 5,
                           [FedAvg(), FederatedObjective(every_n_rounds=3), snapshots],
                           logger=logger)  # fmt: skip
    trainer.fit(module, datamodule=InMemoryFederatedDataModule(clients, batch_size=4))
    (metrics,) = tmp_path.glob("objective/*/metrics.csv")
    rows = [r for r in csv.DictReader(open(metrics)) if r.get("fl/federated_loss")]
    logged = {int(r["epoch"]): float(r["fl/federated_loss"]) for r in rows}
    assert sorted(logged) == [2, 4]
    assert FederatedObjective(every_n_rounds=1).every_n_rounds == 1
    with pytest.raises(ValueError, match="every_n_rounds must be >= 1, got 0"):
        FederatedObjective(every_n_rounds=0)
    counts = torch.tensor([len(c["train"][1]) for c in clients[:4]], dtype=torch.float64)
    p = counts / counts.sum()
    for epoch, value in logged.items():
        with torch.no_grad():
            losses = torch.tensor(
                [float(F.cross_entropy(snapshots.models[epoch](c["train"][0]), c["train"][1]))
                 for c in clients[:4]], dtype=torch.float64)  # fmt: skip
        assert value == pytest.approx(float(p @ losses), rel=1e-5), epoch
