"""Federated unlearning (SIFU, Fraboni et al. AISTATS 2024; thesis ch. 5): the threshold,
the cheap sensitivity, Thm 5.1 on a quadratic loss, Alg. 7's branch bookkeeping, the
limits σ → 0 and σ → ∞, baselines, resume, and what a removed client still costs."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fl import Classifier, FederatedStrategy, FullParticipation, UniformSampler
from lightning_fl.callbacks import FedAvg, StopAtTarget, Unlearning
from lightning_fl.datamodules import InMemoryFederatedDataModule
from lightning_fl.engine.tensors import flatten
from lightning_fl.systems.samplers import ExcludedClients
from lightning_fl.systems.unlearning import BranchHistory, sensitivity_threshold
from tests.helpers import (
    make_trainer,
    max_abs_diff,
    params_of,
    tiny_clients,
    tiny_datamodule,
    tiny_module,
)


def _fit(callbacks, rounds, sampler=None, dm=None, module=None, **kw):
    module = module or tiny_module(0.1)
    strategy = FederatedStrategy(sampler=sampler or UniformSampler(4), local_steps=3, seed=3)
    trainer = make_trainer(strategy, rounds, callbacks, **kw)
    trainer.fit(module, datamodule=dm or tiny_datamodule(num_clients=8))
    return module, trainer


def test_threshold_of_eq_5_13():
    assert sensitivity_threshold(10, 0.01, 0.05) == pytest.approx(0.1609, abs=1e-4)
    assert sensitivity_threshold(10, 0.01, 0.1) == pytest.approx(0.3218, abs=1e-4)


def test_cheap_sensitivity_is_the_difference_of_two_fedavg_aggregations():
    """(p_c/(1 − p_c))‖θ_c^{n+1} − θ^{n+1}‖ = ‖Δ(I, θ^n) − Δ(I∖{c}, θ^n)‖ (App. D.2.5),
    with identical importance and full participation."""
    unlearning = Unlearning()
    _fit([FedAvg("uniform"), unlearning], 1, sampler=FullParticipation())
    deltas = unlearning._deltas
    clients = sorted(deltas)
    everyone = torch.stack([deltas[c] for c in clients]).double().mean(0)
    for c in clients:
        without = torch.stack([deltas[i] for i in clients if i != c]).double().mean(0)
        expected = float((everyone - without).norm())
        assert unlearning.history.psi[0][1][c] == pytest.approx(expected, rel=1e-5, abs=1e-9)


class _Quadratic(Classifier):
    """Least squares on one-hot targets: a quadratic loss, as Thm 5.1 assumes."""

    def loss_and_metrics(self, batch):
        x, y = batch
        out = self(x)
        loss = 0.5 * (out - F.one_hot(y, out.shape[-1]).to(out)).pow(2).sum(-1).mean()
        return loss, {"acc": (out.argmax(-1) == y).float().mean()}


def test_theorem_5_1_sensitivity_bounds_the_model_difference_on_a_quadratic_loss():
    """‖FedAvg(I, n) − FedAvg(I∖{c}, n)‖ ≤ Ψ(n, c), with η ≤ 1/σ_max(H)."""

    def quadratic():
        torch.manual_seed(1)
        return _Quadratic(network=torch.nn.Linear(6, 3), lr=0.02)

    rounds, c = 6, 2
    unlearning = Unlearning()
    with_c, _ = _fit([FedAvg("uniform"), unlearning], rounds, FullParticipation(),
                     module=quadratic())  # fmt: skip
    without_c, _ = _fit([FedAvg("uniform")], rounds, ExcludedClients(FullParticipation(), [c]),
                        module=quadratic())  # fmt: skip
    gap = float((flatten(params_of(with_c)) - flatten(params_of(without_c))).norm())
    psi = unlearning.history.psi[0][rounds][c]
    assert 0 < gap <= psi


def test_branch_bookkeeping_of_algorithm_7_on_a_hand_made_table():
    """Ψ* = 1. Branch 0: client 0 passes Ψ* after round 2, client 1 after round 4."""
    history = BranchHistory(3, threshold=1.0)
    for row in ([0.5, 0.2, 0], [0.9, 0.5, 0], [1.5, 0.8, 0], [2.0, 1.0, 0], [2.5, 1.2, 0]):
        history.psi[0].append(np.array(row, dtype=float))
    assert history.fork_point([0]) == (0, 2)  # W_1 = {0}: T_1 = 2
    assert history.fork([0]) == (0, 2) and history.lineage == [(0, 2)]
    for row in ([0, 0.3, 0.1], [0, 0.6, 0.4]):  # branch 1: client 1 stays within Ψ*
        history.psi[1].append(np.array(row, dtype=float))
    # W_2 = {1}: Ψ_0(2, {1}) = 0.8 <= Ψ* at the node, so stay on branch 1, up to its end
    assert history.fork([1]) == (1, 2) and history.lineage == [(0, 2), (1, 2)]
    history.psi[2].append(np.array([0, 0, 3.0]))
    # W_3 = {2}: Ψ_0(2, {2}) = 0 and Ψ_1(2, {2}) = 0.4, fine; branch 2 is over: T = 0
    assert history.fork([2]) == (2, 0) and history.lineage == [(0, 2), (1, 2), (2, 0)]
    # a node that violates: client 0 in branch 0 beyond its node is cut back there
    history2 = BranchHistory(2, threshold=1.0)
    history2.psi[0] += [np.array([0.4, 0.0]), np.array([1.2, 0.1])]
    history2.fork([1])  # node (0, 2)
    assert history2.fork_point([0]) == (0, 1)  # Ψ_0(2, {0}) = 1.2 > Ψ*: back to branch 0


def test_sifu_with_tiny_noise_is_scratch_and_with_huge_noise_perturbs_the_last_model():
    tiny = Unlearning("sifu", sigma=1e-12, requests={4: [0, 1]})
    _fit([FedAvg(), tiny], 6)
    assert tiny.done_requests[0]["branch"] == 0 and tiny.done_requests[0]["restart_round"] == 0
    huge = Unlearning("sifu", sigma=1e6, requests={4: [0, 1]})
    _fit([FedAvg(), huge], 6)
    assert huge.done_requests[0]["restart_round"] == 4  # the last model, as LAST


def test_scratch_restarts_from_the_initial_model_and_removed_clients_never_return():
    from lightning.pytorch import Callback

    participants, first_batch = [], {}

    class Watch(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.current_epoch == 3 and batch_idx == 0:
                first_batch["model"] = flatten(params_of(pl_module))

        def on_train_epoch_end(self, trainer, pl_module):
            participants.append(trainer.strategy.current_round.state.participation.clients)

    scratch = Unlearning("scratch", requests={3: [0, 5]})
    _fit([FedAvg(), scratch, Watch()], 8)
    assert torch.equal(first_batch["model"], scratch.initial)
    assert set().union(*participants[:3]) & {0, 5}
    assert not set().union(*participants[3:]) & {0, 5}
    assert scratch.removed == [0, 5]


def test_removed_clients_training_data_is_never_read_after_the_request():
    from lightning.pytorch import Callback

    from tests.helpers import tiny_clients

    reads: list[tuple[int, int, str]] = []
    epoch = {"now": 0}

    class Recording(InMemoryFederatedDataModule):
        def client_dataset(self, client, split):
            reads.append((epoch["now"], client, split))
            return super().client_dataset(client, split)

    class Clock(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            epoch["now"] = trainer.current_epoch

    dm = Recording(tiny_clients(num_clients=8), batch_size=4)
    _fit([FedAvg(), Unlearning("sifu", requests={3: [0, 5]}), Clock()], 7, dm=dm,
         limit_val_batches=None)  # fmt: skip
    after = [(c, s) for e, c, s in reads if e >= 3 and c in (0, 5) and s == "train"]
    before = [(c, s) for e, c, s in reads if e < 3 and c in (0, 5) and s == "train"]
    assert before and not after


def test_fine_tuning_keeps_the_model_and_last_perturbs_it_by_the_overall_sensitivity():
    from lightning.pytorch import Callback

    from lightning_fl.systems.unlearning import noise_for_sensitivity

    def run(method):
        seen = {}

        class Watch(Callback):
            def on_train_epoch_end(self, trainer, pl_module):
                if trainer.current_epoch == 2:
                    seen["end_of_2"] = flatten(params_of(pl_module))

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trainer.current_epoch == 3 and batch_idx == 0:
                    seen["start_of_3"] = flatten(params_of(pl_module))

        unlearning = Unlearning(method, sigma=0.05, requests={3: [2]})
        _fit([FedAvg(), unlearning, Watch()], 4)
        return unlearning, seen["start_of_3"] - seen["end_of_2"]

    _, kept = run("fine_tuning")
    assert float(kept.abs().max()) == 0.0
    last, jump = run("last")
    psi = max(float(row.max()) for row in last.history.psi[0])
    std = noise_for_sensitivity(psi, 10.0, 0.01)
    assert float(jump.std()) == pytest.approx(std, rel=0.35)


def test_last_perturbs_each_request_by_the_largest_sensitivity_of_the_branch_it_ends():
    """LAST over two requests (rounds 3 and 6, clients of unequal size, 4 of 8 sampled): at
    each request the model jumps by exactly N(0, σ_L² I)'s draw, σ_L from the largest Ψ of
    the branch the request ends (the authors' ``metric[r - 1]``: branch 0, then branch 1,
    not the whole history nor the new branch), drawn from the request's own stream."""
    from lightning.pytorch import Callback

    from lightning_fl.engine.seeding import generator
    from lightning_fl.systems.unlearning import noise_for_sensitivity

    seen = {}

    class Watch(Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            seen[("end", trainer.current_epoch)] = flatten(params_of(pl_module)).double()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                seen[("start", trainer.current_epoch)] = flatten(params_of(pl_module)).double()

    last = Unlearning("last", requests={3: [2], 6: [5, 1]}, seed=11)
    _fit([FedAvg(), last, Watch()], 8)
    psi = [max(float(row.max()) for row in branch) for branch in last.history.psi]
    assert len(psi) == 3 and psi[0] != psi[1]
    for k, round_idx in enumerate((3, 6)):
        jump = seen[("start", round_idx)] - seen[("end", round_idx - 1)]
        std = noise_for_sensitivity(psi[k], 10.0, 0.01)
        draw = torch.randn(jump.numel(), generator=generator(11, "unlearning", round_idx, k),
                           dtype=torch.float64)  # fmt: skip
        assert float((jump - std * draw).abs().max()) < 1e-5 * max(1.0, std)


def test_dp_baseline_clips_every_update():
    dp = Unlearning("dp", clip=1e-3, requests={2: [1]})
    module, _ = _fit([FedAvg(), dp], 3)
    assert all(float(d.norm()) <= 1e-3 * (1 + 1e-5) for d in dp._deltas.values())


def test_fedaccum_shadow_model_excludes_the_future_removal_set():
    fedaccum = Unlearning("fedaccum", requests={3: [0, 1]})
    _fit([FedAvg(), fedaccum], 5, sampler=FullParticipation())
    assert fedaccum.done_requests and not fedaccum.shadows  # used at the request


def test_sequential_protocol_on_target_records_each_phase():
    stop = StopAtTarget("unlearning/remaining_train_acc", target=0.5, min_rounds=2, max_rounds=5)
    unlearning = Unlearning("sifu", requests=[[0], [1]], on_target=stop)
    _, trainer = _fit([FedAvg(), unlearning], 40)
    assert len(unlearning.phase_rounds) == 3 and unlearning.removed == [0, 1]
    assert all(2 <= r <= 5 for r in unlearning.phase_rounds)
    assert trainer.current_epoch == sum(unlearning.phase_rounds)
    # each check is logged (the branch too): the last one, of the phase that ended the run
    assert float(trainer.callback_metrics["unlearning/branch"]) == 2.0
    assert float(trainer.callback_metrics["unlearning/remaining_train_acc"]) >= 0.5 or (
        unlearning.phase_rounds[-1] == 5
    )


@pytest.mark.parametrize("method", ["sifu", "fedaccum"])
def test_resume_keeps_branches_versions_and_removed_clients(tmp_path, method):
    """Resumed between the two requests, the run ends where the uninterrupted one does:
    SIFU's branches and kept versions, FEDACCUM's shadow for the second removal set."""

    def callbacks():
        return [FedAvg(), Unlearning(method, sigma=0.5, requests={2: [0], 4: [3]})]

    full, _ = _fit(callbacks(), 6)
    checkpoint = ModelCheckpoint(tmp_path, "{epoch}", save_top_k=-1, every_n_epochs=1)
    _fit([*callbacks(), checkpoint], 3, enable_checkpointing=True)
    module = tiny_module(0.1, seed=42)
    strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=3, seed=3)
    trainer = make_trainer(strategy, 6, callbacks())
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=8),
                ckpt_path=str(tmp_path / "epoch=2.ckpt"), weights_only=True)  # fmt: skip
    assert max_abs_diff(params_of(full), params_of(module)) == 0.0


def test_bad_unlearning_requests_are_refused():
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        Unlearning(epsilon=0)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        Unlearning(delta=1.0)
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        Unlearning(sigma=-0.1)
    with pytest.raises(ValueError, match=r"clients \[12\] that do not exist"):
        _fit([FedAvg(), Unlearning(requests={1: [12]})], 2)
    with pytest.raises(ValueError, match=r"Clients \[0\] were already removed"):
        _fit([FedAvg(), Unlearning(requests={1: [0], 2: [0]})], 3)
    with pytest.raises(ValueError, match="would remove every client"):
        _fit([FedAvg(), Unlearning(requests={1: list(range(8))})], 2)


def _notes_of(callbacks, rounds, capsys):
    with pytest.warns(UserWarning) as warned:
        _, trainer = _fit(callbacks, rounds)
    said = capsys.readouterr().out
    notes = trainer.strategy.summary.notes
    assert [str(w.message) for w in warned if "Unlearning:" in str(w.message)] == notes
    assert all(f"Note: {note}\n" in said for note in notes)  # the summary repeats them
    return notes


def test_a_protocol_that_ends_before_its_first_request_says_so(capsys):
    """SIFU's recipe at --trainer.max_epochs 10 (< min_rounds 50) ended at chance accuracy
    with no request run and no word about it (issue 38)."""
    stop = StopAtTarget("unlearning/remaining_train_acc", target=0.99, min_rounds=3)
    notes = _notes_of([FedAvg(), Unlearning(requests=[[0], [1]], on_target=stop)], 3, capsys)
    assert notes == [
        "Unlearning: the run stops after max_epochs=3 rounds, before on_target's "
        "min_rounds=3, so none of its 2 forgetting requests will run: raise max_epochs "
        "above 3, or lower min_rounds."
    ]


def test_scheduled_requests_after_the_last_round_say_so(capsys):
    notes = _notes_of([FedAvg(), Unlearning(requests={1: [0], 3: [1], 5: [2]})], 3, capsys)
    assert notes == [
        "Unlearning: the requests of rounds [3, 5] come after the run's last round (2), so "
        "they will not run: raise max_epochs above 5, or schedule them earlier."
    ]


def test_requests_left_when_the_run_ends_say_so(capsys):
    """Long enough to start, but the target is never reached: the end says so."""
    stop = StopAtTarget("unlearning/remaining_train_acc", target=1.01, min_rounds=1)
    unlearning = Unlearning(requests=[[0], [1]], on_target=stop)
    notes = _notes_of([FedAvg(), unlearning], 3, capsys)
    assert unlearning.done_requests == []
    assert notes == [
        "Unlearning: 2 forgetting request(s) did not run before the run ended after round 2 "
        "(0 ran): raise max_epochs, or on_target's max_rounds."
    ]


def test_a_protocol_that_runs_its_requests_says_nothing(capsys, recwarn):
    _, trainer = _fit([FedAvg(), Unlearning(requests={1: [0], 2: [1]})], 3)
    assert trainer.strategy.summary.notes == []
    assert not [w for w in recwarn if "Unlearning:" in str(w.message)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"requests": [[0]]}, "requests is a list of client sets, which are forgotten one after "
         "another each time training reaches a target, but no on_target was given: add "
         "on_target=StopAtTarget(...), or give requests as {round: [clients]}."),
        ({"requests": {3: [0]}, "on_target": StopAtTarget("unlearning/remaining_train_acc", 0.9)},
         "requests is {round: [clients]}, but on_target forgets client sets each time training "
         "reaches its target: give requests as a list of client sets, or drop on_target."),
    ],
)  # fmt: skip
def test_a_request_of_the_wrong_shape_names_the_problem_and_the_fix(kwargs, message):
    with pytest.raises(ValueError) as refused:
        Unlearning(**kwargs)
    assert str(refused.value) == message


def test_the_dp_baselines_noise_and_clipping_by_hand():
    """The DP baseline's round noise s = (2C/M)·sqrt(2 ln(1.25/δ))/ε at C = 0.5, M = 4,
    δ = 0.01, ε = 10 (by hand: 0.25 · sqrt(2 · 4.8283137) / 10 = 0.0776878), and its
    clipping of an update of norm 5 to norm C; a smaller update is left alone."""
    from lightning_fl.systems.forgetting import DPBaseline

    dp = DPBaseline(clip=0.5, epsilon=10.0, delta=0.01)
    assert dp.round_noise_std(4) == pytest.approx(0.0776878, abs=1e-7)
    assert dp.round_noise_std(0) == pytest.approx(4 * 0.0776878, abs=1e-6)  # M ≥ 1
    clipped = dp.transform_update([torch.tensor([3.0]), torch.tensor([4.0])])
    assert [float(u) for u in clipped] == pytest.approx([0.3, 0.4])
    small = [torch.tensor([0.1]), torch.tensor([0.2])]
    assert dp.transform_update(small) is small


def test_fedaccum_shadows_reaggregate_without_their_removal_set_by_hand():
    """The authors' server step on the shadow, θ_F ← (1 − η_g)θ_F + η_g Σ_{i∉F} ω̃_i θ_i with
    θ_i = θ^t + Δ_i, over two rounds at η_g = 0.5 from global models θ^t that are not the
    shadow (a shadow that only accumulates the kept Δ_i, or ignores η_g, differs). Shadow
    F = {1}: Δ_0 = (1, 0), Δ_2 = (2, 2) with ω = 0.2, 0.5 renormalized over the kept
    clients; shadow F = {0, 1, 2} keeps nobody and stays; a request restarts from its own
    shadow and removes it."""
    from lightning_fl.systems.forgetting import FedAccum, ForgettingRequest

    method = FedAccum()
    method.prepare(torch.zeros(2, dtype=torch.float64), [(1,), (0, 1, 2)])
    deltas = {0: torch.tensor([1.0, 0.0]), 1: torch.tensor([0.0, 1.0]), 2: torch.tensor([2.0, 2.0])}
    weights = {0: 0.2, 1: 0.3, 2: 0.5}
    method.after_round(torch.tensor([3.0, -1.0]), deltas, weights, server_lr=0.5)
    # kept model (3, -1) + (1.2, 1.0)/0.7; the shadow moves half way to it from (0, 0)
    first = [0.5 * (3 + 1.2 / 0.7), 0.5 * (-1 + 1.0 / 0.7)]
    assert method.shadows[(1,)].tolist() == pytest.approx(first)
    second_deltas = {0: torch.tensor([0.0, 2.0]), 2: torch.tensor([1.0, -1.0])}
    method.after_round(torch.tensor([1.0, 1.0]), second_deltas, weights, server_lr=0.5)
    kept = [1 + 0.5 / 0.7, 1 + (0.4 - 0.5) / 0.7]
    expected = [f + 0.5 * (k - f) for f, k in zip(first, kept)]
    assert method.shadows[(1,)].tolist() == pytest.approx(expected)
    assert method.shadows[(0, 1, 2)].tolist() == [0.0, 0.0]
    request = ForgettingRequest([1], [], torch.zeros(2), None, None)
    start, node = method.restart(request)
    assert start.tolist() == pytest.approx(expected) and node is None
    assert list(method.shadows) == [(0, 1, 2)]
    with pytest.raises(ValueError, match=r"no shadow model without \[1\]"):
        method.restart(request)


def _request(clients, removed=(), current=None, history=None, versions=None):
    """A ForgettingRequest of seed 3, drawn at round 6 as the run's second request."""
    from lightning_fl.systems.forgetting import ForgettingRequest

    current = torch.tensor([1.0, 2.0]) if current is None else current
    return ForgettingRequest(list(clients), list(removed), current, history, versions,
                             seed=3, draw=(6, 1))  # fmt: skip


def _noise_by_hand(std):
    """N(0, std² I) of ``_request``'s draw: (seed 3, "unlearning", round 6, request 1)."""
    from lightning_fl.engine.seeding import generator

    g = generator(3, "unlearning", 6, 1)
    return (std * torch.randn(2, generator=g, dtype=torch.float64)).float()


def test_each_method_restarts_from_its_own_model_by_hand():
    """SIFU: θ_ζ^T + N(0, σ²) (the request's seeded draw, by hand) at node (ζ, T);
    SCRATCH: θ_0^0, not another kept round; LAST: θ + N with σ_L from Ψ_max; FINE-TUNING
    and DP: θ itself."""
    from types import SimpleNamespace

    from lightning_fl.systems.forgetting import DPBaseline, FineTuning, Last, Scratch, Sifu
    from lightning_fl.systems.unlearning import ModelVersions, noise_for_sensitivity

    versions = ModelVersions()
    for key, value in {(0, 0): 0.0, (0, 1): 1.0, (1, 0): 2.0, (1, 3): 5.0}.items():
        versions.keep(key, torch.full((2,), value))
    history = SimpleNamespace(fork_point=lambda clients: (1, 3), max_sensitivity=lambda: 0.4)
    versions.restart_model = lambda h, branch, t, clients: (t, versions.models[(branch, t)])
    request = _request([4], history=history, versions=versions)
    start, node = Sifu(sigma=0.05).restart(request)
    assert torch.equal(start, torch.full((2,), 5.0) + _noise_by_hand(0.05)) and node == (1, 3)
    start, node = Scratch().restart(request)
    assert start.tolist() == [0.0, 0.0] and node == (0, 0)
    std = noise_for_sensitivity(0.4, 10.0, 0.01)
    start, node = Last(10.0, 0.01).restart(request)
    assert torch.equal(start, torch.tensor([1.0, 2.0]) + _noise_by_hand(std)) and node is None
    for method in (FineTuning(), DPBaseline(0.5, 10.0, 0.01)):
        start, node = method.restart(request)
        assert start is request.current and node is None


def test_fedaccum_refuses_two_processes_keys_its_shadows_by_the_sorted_set_and_checkpoints_them():
    """FEDACCUM reads every update: 2 processes are refused, 1 is fine. A request of client
    1 after client 9's finds the shadow of {1, 9} (the sorted set, whatever order the
    requests came in). Its shadows survive a state_dict round trip, keys included."""
    from lightning_fl.systems.forgetting import FedAccum

    method = FedAccum()
    method.check(1)
    with pytest.raises(ValueError, match="use devices=1"):
        method.check(2)
    method.prepare(torch.zeros(2), [(9,), (1, 9), ()])
    method.shadows[(1, 9)] = torch.tensor([3.0, 4.0])
    restored = FedAccum()
    restored.load_state_dict(method.state_dict())
    assert sorted(restored.shadows) == [(), (1, 9), (9,)]
    assert all(torch.equal(restored.shadows[k], method.shadows[k]) for k in method.shadows)
    start, _ = restored.restart(_request([1], removed=[9]))
    assert start.tolist() == [3.0, 4.0]


def _authors_checks(curve: list[float], stop: float, minimum: int = 50) -> tuple[list[int], int]:
    """The SIFU authors' loop (FL/simu_unlearning.py, SIFU branch of
    Accenture/Labs-Federated-Learning), accuracies in percent: the rounds t at which the
    model after t rounds is checked, and the round the phase stops at."""
    period, checked = 20, []
    for t in range(len(curve)):
        if t % period == 0:
            acc = curve[t]
            checked.append(t)
            if acc >= stop and t >= minimum:
                return checked, t
            elif acc >= stop - 0.5:
                period = 1
            elif acc >= stop - 1.0:
                period = min(period, 2)
            elif acc >= stop - 2.5:
                period = min(period, 5)
            elif acc >= stop - 5.0:
                period = min(period, 10)
    return checked, len(curve)


def _our_checks(stop: StopAtTarget, curve: list[float]) -> tuple[list[int], int]:
    """StopAtTarget driven as Unlearning drives it: the model a phase starts from is
    observed, then each due round is checked, and the phase ends when reached."""
    stop.start_phase()
    stop.observe(curve[0])
    checked = [0]
    for rounds in range(1, len(curve)):
        if not stop.due(rounds):
            continue
        checked.append(rounds)
        if stop.reached(curve[rounds], rounds):
            return checked, rounds
        stop.observe(curve[rounds])
    return checked, len(curve)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_authors_check_schedule_by_hand(seed):
    """The Fashion-MNIST recipe's schedule (every 20 rounds; 10, 5, 2, 1 within 5, 2.5, 1,
    0.5 points) checks the same rounds and stops at the same one as the authors' loop, on
    noisy curves that cross every gap, some of them touching a gap's edge exactly."""
    rng = np.random.default_rng(seed)
    t = np.arange(400)
    percent = 91 * (1 - np.exp(-t / (40 + 20 * seed))) + rng.normal(0, 1.0, t.size)
    percent = np.round(percent * 2) / 2  # half points: values land on the gaps' edges
    near = [(0.05, 10), (0.025, 5), (0.01, 2), (0.005, 1)]
    recipe_schedule = StopAtTarget("acc", 0.9, min_rounds=50, check_every=20, check_near=near)
    authors = _authors_checks(percent.tolist(), 90.0)
    ours = _our_checks(recipe_schedule, (percent / 100).tolist())
    assert ours == authors
    assert len(set(np.diff(authors[0]))) >= 3  # the period did change, more than once


def test_a_check_schedule_restarts_each_phase_and_stops_at_the_cap():
    stop = StopAtTarget("acc", target=0.9, max_rounds=45, check_every=20, check_near=[(0.1, 3)])
    assert [r for r in range(1, 50) if stop.due(r)] == [20, 40, 45, 46, 47, 48, 49]
    stop.observe(0.8)  # 0.9 - 0.1: on the gap's edge counts as near
    assert stop.period == 3 and stop.state_dict() == {"period": 3}
    stop.observe(0.1)  # far again: the period never grows back within a phase
    assert stop.period == 3
    stop.start_phase()
    assert stop.period == 20
    low = StopAtTarget("loss", target=0.2, mode="min", check_every=4, check_near=[(0.05, 1)])
    low.observe(0.26)
    assert low.period == 4
    low.observe(0.25)
    assert low.period == 1
    with pytest.raises(ValueError, match="Need check_every >= 1"):
        StopAtTarget("acc", 0.9, check_every=0)
    with pytest.raises(ValueError, match="gap >= 0, every >= 1"):
        StopAtTarget("acc", 0.9, check_near=[(0.1, 0)])


class _CheckpointAfterPhase(pl.Callback):
    """Save the fit and stop it when the first phase ends (after Unlearning's round end)."""

    def __init__(self, unlearning: Unlearning, path) -> None:
        self.unlearning, self.path = unlearning, path

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if len(self.unlearning.phase_rounds) == 1 and not trainer.should_stop:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def _protocol(method: str, checkpoint=None, after_phase=None, every_round=None, forgotten=False):
    stop = StopAtTarget("unlearning/remaining_train_acc", target=0.6, min_rounds=3,
                        max_rounds=12, check_every=6, check_near=[(0.2, 2), (0.05, 1)])  # fmt: skip
    unlearning = Unlearning(
        method, sigma=0.3, requests=[[0, 5], [1], [6]], on_target=stop, evaluate_forgotten=forgotten
    )
    callbacks = [FedAvg(), unlearning]
    if after_phase is not None:
        callbacks.append(_CheckpointAfterPhase(unlearning, after_phase))
    if every_round is not None:
        callbacks.append(ModelCheckpoint(every_round, "{epoch}", save_top_k=-1, every_n_epochs=1))
    module = tiny_module(0.1, seed=0 if checkpoint is None else 42)
    strategy = FederatedStrategy(sampler=UniformSampler(4), local_steps=3, seed=3)
    trainer = make_trainer(strategy, 60, callbacks, enable_checkpointing=every_round is not None)
    trainer.fit(module, datamodule=tiny_datamodule(num_clients=8), ckpt_path=checkpoint,
                weights_only=True if checkpoint else None)  # fmt: skip
    return module, unlearning


@pytest.mark.parametrize("method", ["scratch", "last"])
def test_the_training_before_the_first_request_is_shared_by_the_methods_that_train_alike(
    method, tmp_path
):
    """The benchmark trains once per seed and resumes SIFU, SCRATCH, FINE-TUNING and LAST
    from the end of that first phase, as the authors' code does: the resumed run is the
    run that never stopped, to the bit, whichever of them made the checkpoint. The phases
    end off the 6-round grid (SCRATCH's second at 10 after a check came near, LAST's at
    min_rounds after the model the phase starts from was observed near the target)."""
    full, alone = _protocol(method)
    assert alone.phase_rounds == {"scratch": [6, 10, 6, 6], "last": [6, 3, 3, 3]}[method]
    shared = tmp_path / "shared.ckpt"
    _, first = _protocol("sifu", after_phase=shared)
    assert first.phase_rounds == [6]
    resumed, again = _protocol(method, checkpoint=str(shared))
    assert max_abs_diff(params_of(full), params_of(resumed)) == 0.0
    assert again.phase_rounds == alone.phase_rounds
    assert again.done_requests == alone.done_requests


def test_a_resume_within_a_phase_keeps_the_check_period(tmp_path):
    """Round 7 of SCRATCH's second phase (epoch 12): the check at its round 6 came within
    0.05 of the target, so checks are every round and the phase ends at 10; a resume that
    forgot the period would check at 12 instead."""
    full, alone = _protocol("scratch", every_round=tmp_path, forgotten=True)
    saved = torch.load(tmp_path / "epoch=12.ckpt", weights_only=True)["callbacks"]
    (state,) = [s for k, s in saved.items() if "Unlearning" in k]
    assert state["on_target"] == {"period": 1} and state["phase_start"] == 6
    resumed, again = _protocol(
        "scratch", checkpoint=str(tmp_path / "epoch=12.ckpt"), forgotten=True
    )
    assert again.phase_rounds == alone.phase_rounds == [6, 10, 6, 6]
    assert max_abs_diff(params_of(full), params_of(resumed)) == 0.0
    # the accuracy on the forgotten clients at each phase's end: none before the first
    # request, the final model's at the last; a resume in the third phase (epoch 18) takes
    # the second phase's from the checkpoint
    assert math.isnan(alone.phase_forgotten_acc[0]) and len(alone.phase_forgotten_acc) == 4
    assert again.phase_forgotten_acc[1:] == alone.phase_forgotten_acc[1:]
    _, late = _protocol("scratch", checkpoint=str(tmp_path / "epoch=18.ckpt"), forgotten=True)
    assert late.phase_forgotten_acc[1:] == alone.phase_forgotten_acc[1:]
    clients = tiny_clients(num_clients=8)
    x = torch.cat([clients[c]["train"][0] for c in (0, 5, 1, 6)])
    y = torch.cat([clients[c]["train"][1] for c in (0, 5, 1, 6)])
    with torch.no_grad():
        by_hand = float((full.network(x).argmax(1) == y).double().mean())
    assert alone.phase_forgotten_acc[3] == pytest.approx(by_hand, abs=1e-9)
    assert len(set(alone.phase_forgotten_acc[1:])) == 3  # three different values


def test_checks_are_scheduled_from_every_two_rounds_on():
    """Fewer checks than every round (and the start model's observation that comes with
    them) from ``check_every = 2`` on; ``check_every = 1`` checks every round."""
    every = {n: StopAtTarget("unlearning/remaining_train_acc", 0.9, check_every=n) for n in (1, 2)}
    assert (every[1].scheduled, every[2].scheduled) == (False, True)


def test_the_check_period_is_restored_only_when_both_sides_have_a_target():
    """A checkpoint's check period is loaded into a callback with a target when the
    checkpoint has one too; one without it leaves the callback's period as it is; a
    callback without a target takes a checkpoint with one and has nothing to restore."""

    def callback(period: int | None = None) -> Unlearning:
        if period is None:
            return Unlearning(requests={3: [0]})
        stop = StopAtTarget("unlearning/remaining_train_acc", 0.9, check_every=4)
        stop.period = period
        return Unlearning(requests=[[0]], on_target=stop)

    saved = callback(period=1).state_dict()
    target = callback(period=2)
    target.load_state_dict(saved)
    assert target.on_target.period == 1
    target = callback(period=2)
    target.load_state_dict(callback().state_dict())
    assert target.on_target.period == 2
    plain = callback()
    plain.load_state_dict(saved)
    assert plain.on_target is None and plain.queue == [[0]]  # the checkpoint's requests


def test_the_remaining_clients_are_those_with_training_data_one_sample_included():
    """Client 0 has no training data and client 1 one sample: a request for clients 2 and
    3 leaves client 1 and is served; the DP baseline sizes its noise on the federation's
    clients with data, before and after the request (3: the authors' server computes it
    once from its M); a request that would leave only client 0 is refused."""
    clients = tiny_clients(4)
    clients[0]["train"] = tuple(t[:0] for t in clients[0]["train"])
    clients[1]["train"] = tuple(t[:1] for t in clients[1]["train"])

    def fit(requests):
        unlearning = Unlearning("dp", requests=requests)
        sizes, noise_std = [], unlearning.forgetting.round_noise_std
        unlearning.forgetting.round_noise_std = lambda m: sizes.append(m) or noise_std(m)
        dm = InMemoryFederatedDataModule(clients, batch_size=4)
        _fit([FedAvg(), unlearning], 4, sampler=FullParticipation(), dm=dm)
        return unlearning, sizes

    served, sizes = fit({2: [2, 3]})
    assert served.removed == [2, 3] and sizes == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="The request would remove every client"):
        fit({2: [1, 2, 3]})


def test_a_method_change_after_a_request_or_to_a_method_that_trains_otherwise_is_refused(
    tmp_path,
):
    shared = tmp_path / "shared.ckpt"
    _protocol("sifu", after_phase=shared)
    with pytest.raises(ValueError, match=r"method 'sifu' -> 'dp'"):
        _protocol("dp", checkpoint=str(shared))
    state = torch.load(shared, weights_only=True)
    (key,) = [k for k in state["callbacks"] if "Unlearning" in k]
    state["callbacks"][key]["done_requests"] = [{"round": 3, "clients": [0, 5]}]
    torch.save(state, tmp_path / "after_request.ckpt")
    with pytest.raises(ValueError, match=r"method 'sifu' -> 'scratch'.*only before any request"):
        _protocol("scratch", checkpoint=str(tmp_path / "after_request.ckpt"))


def test_the_threshold_and_the_noise_refuse_what_has_no_privacy_meaning():
    """Ψ* and σ(Ψ) are asked directly (LAST, the benchmark's table), not only through the
    callback, and refuse ε ≤ 0 and δ outside (0, 1) themselves; by hand at ε = 10,
    δ = 0.01: sqrt(2 ln 125) = 3.107511, so Ψ* = 0.1 · 10/3.107511 and σ(0.5) = 0.155376."""
    from lightning_fl.systems.unlearning import noise_for_sensitivity

    assert sensitivity_threshold(10, 0.01, 0.1) == pytest.approx(0.321801, rel=1e-5)
    assert noise_for_sensitivity(0.5, 10, 0.01) == pytest.approx(0.155376, rel=1e-5)
    for bad in ({"epsilon": 0.0, "delta": 0.01}, {"epsilon": 10.0, "delta": 1.0}):
        match = "epsilon must be > 0" if bad["epsilon"] == 0 else r"delta must be in \(0, 1\)"
        with pytest.raises(ValueError, match=match):
            sensitivity_threshold(bad["epsilon"], bad["delta"], 0.1)
        with pytest.raises(ValueError, match=match):
            noise_for_sensitivity(0.5, bad["epsilon"], bad["delta"])
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        sensitivity_threshold(10, 0.01, -0.1)
    # both ends of what is allowed: a small ε, δ near 0 and near 1, σ = 0
    assert sensitivity_threshold(0.5, 0.01, 0.1) == pytest.approx(0.05 / 3.107511, rel=1e-6)
    assert sensitivity_threshold(1.0, 0.999, 0.0) == 0.0
    assert noise_for_sensitivity(0.5, 0.25, 0.5) == pytest.approx(2.707457, rel=1e-6)
    assert noise_for_sensitivity(0.5, 0.25, 1e-9) == pytest.approx(12.944932, rel=1e-6)


def test_a_fork_cuts_the_kept_rounds_of_its_branch_back_to_its_node():
    """Ψ* = 1, increments recorded round by round (record keeps each client's latest
    round within Ψ*): client 0 passes Ψ* after round 2, clients 1 and 2 never. A request
    for client 0 forks at (0, 2); rounds 3 and 4 of branch 0 are no longer anyone's
    ancestor, so every client's kept round of branch 0 is cut back to at most 2 and only
    θ_0^0, θ_0^2 and the new branch's start are needed (not θ_0^4)."""
    from lightning_fl.systems.unlearning import ModelVersions

    history = BranchHistory(3, threshold=1.0)
    for increments in ([0.5, 0.1, 0.0], [0.5, 0.1, 0.0], [0.5, 0.1, 0.0], [0.5, 0.1, 0.0]):
        history.record(np.array(increments))
    assert history.best[0].tolist() == [2, 4, 4]
    versions = ModelVersions()
    for n in range(5):
        versions.keep((0, n), f"theta_0^{n}")
    assert history.fork([0]) == (0, 2)
    assert history.best[0].tolist() == [2, 2, 2] and history.best[1].tolist() == [0, 0, 0]
    versions.keep((1, 0), "theta_1^0")
    versions.prune(history, remaining=[1, 2])
    assert sorted(versions.models) == [(0, 0), (0, 2), (1, 0)]
    history.record(np.array([0.0, 1.5, 0.2]))  # branch 1, round 1: client 1 passes Ψ*
    assert history.best[1].tolist() == [1, 0, 1]


def test_the_history_takes_one_shot_iterables_of_clients():
    """fork_point, fork and the versions' needed/prune take any iterable of clients, a
    generator too (read once), with the same answers as for lists: here a fork point on
    an earlier lineage node, where the clients are read for several nodes."""
    from lightning_fl.systems.unlearning import ModelVersions

    def build():
        history = BranchHistory(3, threshold=1.0)
        for increments in ([0.5, 0.1, 0.0], [0.7, 0.1, 0.0], [0.5, 0.1, 0.0]):
            history.record(np.array(increments))
        history.fork([2])  # node (0, 3): client 2 never passed Ψ*
        history.record(np.array([0.2, 0.3, 0.0]))
        return history

    listed, once = build(), build()
    assert once.fork_point(c for c in [0, 1]) == listed.fork_point([0, 1]) == (0, 1)
    assert once.last_within(0, (c for c in [0, 1]), 3) == listed.last_within(0, [0, 1], 3) == 1
    versions = ModelVersions()
    versions.models = {(0, n): n for n in range(4)} | {(1, 0): "b", (1, 1): "c"}
    assert versions.needed(once, (c for c in [0, 1])) == versions.needed(listed, [0, 1])
    assert versions.needed(listed, [0, 1]) == {(0, 0), (0, 1), (0, 3), (1, 0), (1, 1)}


def test_a_sensitivity_equal_to_the_threshold_is_within_it():
    """Eqs. 5.17–5.18 compare Ψ ≤ Ψ*: a lineage node where the requested client's Ψ is
    exactly Ψ* is not a fork point, and a round where it is exactly Ψ* is kept."""
    history = BranchHistory(2, threshold=1.0)
    history.record(np.array([0.5, 0.0]))
    history.record(np.array([0.5, 0.0]))  # client 0: Ψ_0(2) = 1.0 = Ψ*
    assert history.best[0].tolist() == [2, 2]
    assert history.fork_point([0]) == (0, 2)  # the current branch, up to round 2
    assert history.fork([1]) == (0, 2)
    history.record(np.array([0.2, 0.0]))
    assert history.fork_point([0]) == (1, 1)  # the node (0, 2) holds Ψ = Ψ*: not exceeded


def test_restart_model_under_decay_takes_the_latest_kept_round_within_the_threshold():
    """With decay < 1 (Cor. 5.1) Ψ can fall back under Ψ*, so θ_ζ^T may not be kept: the
    restart is the latest round n ≤ T whose model is kept and whose Ψ_ζ(n, W) ≤ Ψ*. By
    hand: rounds 0..4 with Ψ(W) = 0, 0.4, 1.3, 0.9, 0.8 and Ψ* = 1; kept models at rounds
    0, 2 and 3; T = 4 is not kept, round 3 is kept and within: 3. From T = 2 (kept but
    Ψ = 1.3 > Ψ*) back to round 0."""
    from lightning_fl.systems.unlearning import ModelVersions

    history = BranchHistory(1, threshold=1.0)
    for increment, decay in ((0.4, 1.0), (1.3 - 0.4 * 0.5, 0.5), (0.9 - 1.3 * 0.5, 0.5),
                             (0.8 - 0.9 * 0.5, 0.5)):  # fmt: skip
        history.record(np.array([increment]), decay)
    assert [round(float(row[0]), 12) for row in history.psi[0]] == [0.0, 0.4, 1.3, 0.9, 0.8]
    versions = ModelVersions()
    versions.models = {(0, 0): "theta0", (0, 2): "theta2", (0, 3): "theta3"}
    assert versions.restart_model(history, 0, 4, [0]) == (3, "theta3")
    assert versions.restart_model(history, 0, 2, [0]) == (0, "theta0")
    versions.models.pop((0, 0))
    with pytest.raises(KeyError, match="No kept model of branch 0 at or before round 2"):
        versions.restart_model(history, 0, 2, [0])
    edge = BranchHistory(1, threshold=1.0)
    edge.record(np.array([1.0]))  # Ψ(1) = Ψ*: within
    versions.models = {(0, 0): "theta0", (0, 1): "theta1"}
    assert versions.restart_model(edge, 0, 1, [0]) == (1, "theta1")


def test_a_fork_on_a_branch_already_on_the_lineage_replaces_its_node():
    """Eq. 5.19 keeps the nodes of branches s < ζ_r only: forking back on branch 0, already
    on the lineage at round 2, replaces that node with (0, 1) rather than adding a second
    node of branch 0; the later branch's Ψ starts again at 0."""
    history = BranchHistory(2, threshold=1.0)
    history.record(np.array([0.4, 0.0]))
    history.record(np.array([0.8, 0.1]))  # client 0: Ψ_0 = 0.4, 1.2
    assert history.fork([1]) == (0, 2) and history.lineage == [(0, 2)]
    history.record(np.array([0.3, 0.0]))  # branch 1
    assert history.fork([0]) == (0, 1)  # Ψ_0(2, {0}) = 1.2 > Ψ*: back to branch 0, round 1
    assert history.lineage == [(0, 1)]
    assert history.branch == 2 and len(history.psi[2]) == 1
    assert history.psi[2][0].tolist() == [0.0, 0.0] and history.best[0].tolist() == [1, 1]


def test_the_dp_baseline_over_three_rounds_with_a_server_rate_and_a_removal_by_hand():
    """The DP baseline with FedAvg's η_g = 0.5, three clients of 11, 18 and 25 samples,
    client 1 forgotten at round 2: every update is clipped to C (some are, some are not),
    the size-weighted step is scaled by η_g but the noise is not (θ^{n+1} gets N(0, s²)
    once, s = (2C/M)·sqrt(2 ln(1.25/δ))/ε), M stays 3 after the request (the federation's
    clients, as the authors' server computes s once), and each round's noise is its own
    draw (seed, round, requests done)."""
    from lightning_fl.engine.seeding import generator
    from tests.helpers import local_sgd, tiny_clients

    clip, epsilon, delta, lr_g = 0.2, 50.0, 0.01, 0.5
    clients = tiny_clients()[1:4]
    module = tiny_module(0.1)
    theta = params_of(module)
    dp = Unlearning("dp", epsilon=epsilon, delta=delta, clip=clip, requests={2: [1]}, seed=7)
    strategy = FederatedStrategy(sampler=FullParticipation(), local_steps=3, seed=3)
    trainer = make_trainer(strategy, 3, [FedAvg(server_lr=lr_g), dp])
    trainer.fit(module, datamodule=InMemoryFederatedDataModule(clients, batch_size=4))

    net = tiny_module(0.1).network
    clipped = []
    for r in range(3):
        kept = [0, 1, 2] if r < 2 else [0, 2]
        sizes = torch.tensor([float(len(clients[c]["train"][0])) for c in kept])
        step = [torch.zeros_like(t) for t in theta]
        for share, c in zip(sizes / sizes.sum(), kept):
            with torch.no_grad():
                for p, t in zip(net.parameters(), theta):
                    p.copy_(t)
            local_sgd(net, clients[c]["train"], 3, 0.1, 4, 3, r, c)
            delta_c = [p.detach() - t for p, t in zip(net.parameters(), theta)]
            norm = float(torch.cat([d.reshape(-1) for d in delta_c]).norm())
            clipped.append(norm > clip)
            scale = min(1.0, clip / norm)
            step = [s + float(share) * scale * d for s, d in zip(step, delta_c)]
        std = (2 * clip / 3) * (2 * np.log(1.25 / delta)) ** 0.5 / epsilon
        draw = torch.randn(
            sum(t.numel() for t in theta),
            generator=generator(7, "unlearning", r, 0 if r < 2 else 1),
            dtype=torch.float64,
        )
        noise = (std * draw).float().split([t.numel() for t in theta])
        theta = [t + lr_g * s + n.reshape(t.shape) for t, s, n in zip(theta, step, noise)]
    assert any(clipped) and not all(clipped)
    assert max_abs_diff(params_of(module), theta) < 1e-5


def test_fedaccum_restarts_from_the_server_steps_on_its_shadow_through_the_trainer():
    """FedAvg(η_g = 0.5), full participation of 8 clients, client 2 forgotten at round 3:
    the model round 3 starts from is the shadow after rounds 0–2, computed by hand from
    each round's starting model θ^t, the clients' updates and weights as the engine saw
    them: θ_F ← θ_F + η_g(θ^t + Σ_{i≠2} ω̃_i Δ_i − θ_F), from θ^0."""
    from lightning_fl.callbacks.base import FederatedCallback

    class Record(FederatedCallback):
        def __init__(self) -> None:
            self.rounds = []

        def on_round_start(self, trainer, pl_module, state) -> None:
            self.rounds.append((flatten(state.global_tensors).clone(), {}))

        def on_client_end(self, trainer, pl_module, client, update, state) -> None:
            delta = flatten([u.detach() for u in update]).clone()
            self.rounds[-1][1][client] = (delta, state.weight_of(client))

    record = Record()
    fedaccum = Unlearning("fedaccum", requests={3: [2]})
    _fit([FedAvg(server_lr=0.5), fedaccum, record], 4, sampler=FullParticipation())
    shadow = record.rounds[0][0].clone()
    for start, updates in record.rounds[:3]:
        kept = {c: u for c, u in updates.items() if c != 2}
        total = sum(w for _, w in kept.values())
        target = start + sum((w / total) * d for d, w in kept.values())
        shadow = shadow + 0.5 * (target - shadow)
    assert torch.allclose(record.rounds[3][0], shadow, atol=1e-6)


def test_the_logged_accuracies_are_count_weighted_over_the_remaining_and_removed_clients(
    tmp_path,
):
    """Every second round (evaluate_every = 2) of 5, clients 0 and 3 removed at the start
    of round 2: after rounds 1 and 3 the logged remaining accuracy is Σ_R n_c acc_c /
    Σ_R n_c of that round's model over each remaining client's training data (a mean over
    samples in batches of 4), the removed clients' only after their removal. Client 3 has
    no training data and weighs nothing, removed or not; client 4 has one sample and
    counts in full."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from tests.helpers import tiny_clients

    class Snapshots(pl.Callback):
        def __init__(self) -> None:
            self.models = {}

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.models[trainer.current_epoch] = [
                p.detach().clone() for p in pl_module.parameters()
            ]

    clients = tiny_clients(num_clients=6)
    for c, keep in ((3, 0), (4, 1)):
        x, y = clients[c]["train"]
        clients[c] = {**clients[c], "train": (x[:keep], y[:keep])}
    snapshots = Snapshots()
    unlearning = Unlearning("sifu", requests={2: [0, 3]}, evaluate_every=2, evaluate_forgotten=True)
    module, _ = _fit([FedAvg(), unlearning, snapshots], 5, sampler=FullParticipation(),
                     dm=InMemoryFederatedDataModule(clients, batch_size=4),
                     logger=CSVLogger(tmp_path, name="accuracies"))  # fmt: skip
    (metrics,) = tmp_path.glob("accuracies/*/metrics.csv")
    rows = list(csv.DictReader(open(metrics)))
    remaining = {int(r["epoch"]): float(r["unlearning/remaining_train_acc"])
                 for r in rows if r.get("unlearning/remaining_train_acc")}  # fmt: skip
    forgotten = {int(r["epoch"]): float(r["unlearning/forgotten_acc"])
                 for r in rows if r.get("unlearning/forgotten_acc")}  # fmt: skip
    assert sorted(remaining) == [1, 3] and sorted(forgotten) == [3]

    def accuracy(epoch, group):
        with torch.no_grad():
            for p, saved in zip(module.parameters(), snapshots.models[epoch]):
                p.copy_(saved)
            right = sum(int((module(clients[c]["train"][0]).argmax(1) == clients[c]["train"][1])
                            .sum()) for c in group)  # fmt: skip
        return right / sum(len(clients[c]["train"][1]) for c in group)

    assert remaining[1] == pytest.approx(accuracy(1, range(6)), abs=1e-6)
    assert remaining[3] == pytest.approx(accuracy(3, [1, 2, 3, 4, 5]), abs=1e-6)
    assert forgotten[3] == pytest.approx(accuracy(3, [0, 3]), abs=1e-6)


@pytest.mark.parametrize(
    "settings, rounds",
    [
        # fl/round reads t − 1 after t rounds: checked at 2 (1) and 4 (3 ≥ 3)
        (dict(target=3.0, check_every=2), 4),
        # reached after 4 rounds, but not before min_rounds = 6
        (dict(target=2.5, min_rounds=6), 6),
        # never reached: max_rounds ends it, whatever the period
        (dict(target=99.0, max_rounds=5, check_every=3), 5),
        # checks at 4 (3, not within 1 of 5), 8 (7): stop at 8
        (dict(target=5.0, check_every=4, check_near=[(1.0, 1)]), 8),
        # checks at 4 (3, within 2 of 5: every round from now), 5 (4), 6 (5): stop at 6
        (dict(target=5.0, check_every=4, check_near=[(2.0, 1)]), 6),
        # mode "min": 0 ≤ 0.5 at the first check
        (dict(target=0.5, mode="min"), 1),
        # mode "min", min_rounds = 3: 2 ≤ 2.5 at round 3
        (dict(target=2.5, mode="min", min_rounds=3), 3),
        # mode "min" at its target: 2 ≤ 2 stops at round 3
        (dict(target=2.0, mode="min", min_rounds=3), 3),
        # at 4 (3): within 3 and 4 of 6, so every round (the smaller period): 5, 6, 7 (6)
        (dict(target=6.0, check_every=4, check_near=[(3.0, 1), (4.0, 3)]), 7),
    ],
)
def test_stop_at_target_on_its_own_stops_after_the_rounds_its_schedule_says(settings, rounds):
    """StopAtTarget as a plain Trainer callback (the recipes' stopping rule), monitoring
    ``fl/round`` (t − 1 after round t), so that each stop is known in advance."""
    stop = StopAtTarget("fl/round", **settings)
    trainer = make_trainer(FederatedStrategy(local_steps=1), 20, [stop])
    trainer.fit(tiny_module(), datamodule=tiny_datamodule(num_clients=3))
    assert trainer.current_epoch == rounds


def test_two_scheduled_requests_fork_the_history_twice_through_the_trainer():
    """SIFU with requests {2: [0], 5: [3, 4]} over 8 rounds: two forks (branches 0, 1, 2),
    each request's restart node on the lineage, the clients removed in order, branch 2
    holding the Ψ of rounds 5–7 (eq. 5.15: 0 for every removed client), and each new
    branch's round 0 kept as the model it restarted from."""
    unlearning = Unlearning(method="sifu", requests={2: [0], 5: [3, 4]}, sigma=0.05)
    module, trainer = _fit([FedAvg(), unlearning], rounds=8)
    history = unlearning.history
    assert history.branch == 2 and unlearning.removed == [0, 3, 4]
    done = [(d["round"], d["clients"]) for d in unlearning.done_requests]
    assert done == [(2, [0]), (5, [3, 4])]
    assert history.rounds(2) == 3 and len(history.psi[1]) == 4  # branch 1: rounds 2, 3, 4
    assert float(trainer.callback_metrics["unlearning/branch"]) == 2.0
    # the logged accuracy: the remaining clients' training accuracy, weighted by their sizes
    accuracy = float(trainer.callback_metrics["unlearning/remaining_train_acc"])
    kept = [1, 2, 5, 6, 7]
    assert accuracy == pytest.approx(
        _pooled_train_accuracy(module, tiny_clients(8), kept), abs=1e-6
    )
    assert all(float(row[[0, 3, 4]].max()) == 0.0 for row in history.psi[2])
    assert float(history.psi[2][-1].max()) > 0  # the remaining clients' Ψ grows again
    for branch in (1, 2):
        assert (branch, 0) in unlearning.versions.models


def test_a_request_made_between_fits_is_applied_at_the_next_round():
    """``request`` queues a client set for the start of the next round: made before a fit,
    it is applied in round 0 (duplicates dropped) and forks the history once."""
    unlearning = Unlearning(method="scratch")
    unlearning.request([2, 2, 5])
    _, trainer = _fit([FedAvg(), unlearning], rounds=3, sampler=FullParticipation())
    assert unlearning.removed == [2, 5]
    assert [(d["round"], d["clients"]) for d in unlearning.done_requests] == [(0, [2, 5])]
    assert unlearning.history.branch == 1


@pytest.mark.parametrize("clip", [0.0, -0.5, float("nan")])
def test_a_clip_at_or_below_zero_is_refused(clip):
    with pytest.raises(ValueError, match="clip must be > 0"):
        Unlearning(method="dp", clip=clip)


def test_the_sensitivity_is_two_aggregations_apart_with_sample_weights_and_a_server_rate():
    """η_g = 0.5 and FedAvg's sample weights p_j = n_j/n over 8 clients of unequal sizes:
    Ψ's increment for c is ‖θ^{n+1}(I) − θ^{n+1}(I∖{c})‖ = η_g‖Σ_j p_j Δ_j − Σ_{j≠c}
    p_j/(1 − p_c) Δ_j‖ (App. D.2.5), the two aggregations written out."""
    unlearning = Unlearning()
    _fit([FedAvg(server_lr=0.5), unlearning], 1, sampler=FullParticipation())
    deltas = unlearning._deltas
    clients = sorted(deltas)
    counts = torch.tensor([len(c["train"][1]) for c in tiny_clients(8)], dtype=torch.float64)
    p = counts / counts.sum()
    stacked = torch.stack([deltas[c] for c in clients]).double()
    everyone = 0.5 * (p[:, None] * stacked).sum(0)
    for c in clients:
        keep = [j for j in clients if j != c]
        without = 0.5 * (p[keep, None] / (1 - p[c]) * stacked[keep]).sum(0)
        expected = float((everyone - without).norm())
        assert unlearning.history.psi[0][1][c] == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_after_a_removal_the_sensitivity_renormalizes_the_weights_over_the_remaining_clients():
    """Client 0 removed at round 1 (SCRATCH): round 1's increments are those of FedAvg over
    the 7 remaining clients with p'_j = p_j/(1 − p_0), η_g = 0.5, written out; and with a
    single client left (two clients, one removed), its weight is 1 and its increment 0."""
    unlearning = Unlearning(method="scratch", requests={1: [0]})
    _fit([FedAvg(server_lr=0.5), unlearning], 2, sampler=FullParticipation())
    deltas = unlearning._deltas
    clients = sorted(deltas)
    assert clients == list(range(1, 8))
    counts = torch.tensor([len(c["train"][1]) for c in tiny_clients(8)], dtype=torch.float64)
    p = counts / counts[1:].sum()  # renormalized over clients 1..7
    stacked = torch.stack([deltas[c] for c in clients]).double()
    everyone = 0.5 * (p[clients, None] * stacked).sum(0)
    for i, c in enumerate(clients):
        keep = [j for j in range(len(clients)) if j != i]
        weights = p[[clients[j] for j in keep], None] / (1 - p[c])
        without = 0.5 * (weights * stacked[keep]).sum(0)
        expected = float((everyone - without).norm())
        assert unlearning.history.psi[1][1][c] == pytest.approx(expected, rel=1e-5, abs=1e-9)
    alone = Unlearning(method="scratch", requests={1: [0]})
    _fit([FedAvg(), alone], 3, sampler=FullParticipation(), dm=tiny_datamodule(num_clients=2))
    assert [float(row[1]) for row in alone.history.psi[1]] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "settings",
    [dict(min_rounds=-1), dict(min_rounds=5, max_rounds=4), dict(max_rounds=0),
     dict(check_every=0), dict(check_near=[(-0.1, 2)]), dict(check_near=[(0.1, 0)])],
)  # fmt: skip
def test_stop_at_target_refuses_each_bad_bound_alone(settings):
    with pytest.raises(ValueError, match="Need"):
        StopAtTarget("val_acc", 0.9, **settings)


def test_stop_at_target_accepts_its_bounds_at_their_ends():
    stop = StopAtTarget("val_acc", 0.9, min_rounds=0, max_rounds=1, check_near=[(0.0, 1)])
    assert (stop.min_rounds, stop.max_rounds, stop.check_near) == (0, 1, [(0.0, 1)])
    assert StopAtTarget("val_acc", 0.9, min_rounds=4, max_rounds=4).max_rounds == 4


def test_the_initial_model_is_kept_and_requests_out_of_round_order_are_sorted():
    """``initial`` is θ⁰, the model the fit started from; requests given as {4: [1], 2: [0]}
    are F_1 = {0}, F_2 = {0, 1} in round order, so FEDACCUM's shadows exclude those sets."""
    start = torch.cat([p.detach().flatten() for p in tiny_module(0.1).parameters()])
    unlearning = Unlearning(method="fedaccum", requests={4: [1], 2: [0]})
    _fit([FedAvg(), unlearning], rounds=2, sampler=FullParticipation())
    assert torch.equal(unlearning.initial, start)
    assert sorted(unlearning.shadows) == [(0,), (0, 1)]


def test_the_accuracy_is_measured_every_evaluate_every_rounds():
    """``evaluate_every=3`` over 6 rounds: measured after rounds 3 and 6 (epochs 2, 5)."""
    module = tiny_module(0.1)
    logged = []
    log = module.log

    def spy(name, value, *args, **kwargs):
        if name == "unlearning/remaining_train_acc":
            logged.append(module.trainer.current_epoch)
        return log(name, value, *args, **kwargs)

    module.log = spy
    _fit([FedAvg(), Unlearning(evaluate_every=3)], rounds=6, module=module)
    assert logged == [2, 5]


@pytest.mark.parametrize("decay", [0.0, 1.5, float("nan")])
def test_a_decay_outside_0_1_is_refused(decay):
    with pytest.raises(ValueError, match="decay must be in"):
        Unlearning(decay=decay)


def test_requests_left_count_the_queue_and_the_one_pending(capsys):
    """The target (0) is reached every round: round 0 queues [0] for round 1, round 1
    forgets it and queues [1] for round 2, which never comes (max_epochs = 2): one pending
    and one still in the queue did not run, one ran."""
    stop = StopAtTarget("unlearning/remaining_train_acc", target=0.0, min_rounds=1)
    unlearning = Unlearning(requests=[[0], [1], [2]], on_target=stop)
    notes = _notes_of([FedAvg(), unlearning], 2, capsys)
    assert [d["clients"] for d in unlearning.done_requests] == [[0]]
    assert notes == [
        "Unlearning: 2 forgetting request(s) did not run before the run ended after round 1 "
        "(1 ran): raise max_epochs, or on_target's max_rounds."
    ]


def test_a_run_without_an_epoch_limit_says_at_its_end_which_scheduled_request_did_not_run(
    capsys,
):
    """``max_epochs=-1`` (no limit), stopped after 3 rounds by another callback: the
    request scheduled at round 5 is not foretold at the start (no last round to compare
    with) and is counted at the end."""
    stop = StopAtTarget("fl/round", target=2.0)
    unlearning = Unlearning(requests={5: [1]})
    with pytest.warns(UserWarning) as warned:
        _, trainer = _fit([FedAvg(), unlearning, stop], -1)
    assert trainer.current_epoch == 3
    assert trainer.strategy.summary.notes == [
        "Unlearning: 1 forgetting request(s) did not run before the run ended after round 2 "
        "(0 ran): raise max_epochs, or on_target's max_rounds."
    ]
    assert len([w for w in warned if "Unlearning:" in str(w.message)]) == 1
    capsys.readouterr()


def test_a_client_without_training_data_is_not_among_the_remaining_clients():
    """Client 3 has no training data: the logged accuracy is over clients 1, 2 and 4–7 (client
    0 forgotten at round 1), weighted by their sizes, not a NaN from client 3."""
    clients = tiny_clients(8)
    clients[3]["train"] = tuple(t[:0] for t in clients[3]["train"])
    dm = InMemoryFederatedDataModule(clients, batch_size=4)
    unlearning = Unlearning(method="scratch", requests={1: [0]})
    module, trainer = _fit([FedAvg(), unlearning], 3, sampler=FullParticipation(), dm=dm)
    accuracy = float(trainer.callback_metrics["unlearning/remaining_train_acc"])
    expected = _pooled_train_accuracy(module, clients, [1, 2, 4, 5, 6, 7])
    assert accuracy == pytest.approx(expected, abs=1e-6)


def _pooled_train_accuracy(module, clients, kept) -> float:
    """The training accuracy over the ``kept`` clients' samples pooled (each client weighted
    by its size), by hand."""
    with torch.no_grad():
        hits = [(module.network(x).argmax(1) == y) for x, y in (clients[c]["train"] for c in kept)]
    return float(torch.cat(hits).float().mean())
