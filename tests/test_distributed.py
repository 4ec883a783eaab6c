"""Several processes: the same recipe on 2 gloo processes equals the 1-process run, resumes
exactly, and a crashed rank ends the run with a clear error instead of a hang.

The 2-process runs of the recipes share one torchrun launch (tests/recipes_distributed.py:
Python's and Lightning's start-up, about 10 s a process here, is paid once), and their
1-process references run in the test's own process; the crash tests start through
Lightning's own launcher (``--trainer.devices 2``), as a user does."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.recipes_distributed import run_file

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
SCAFFOLD = str(ROOT / "recipes" / "scaffold.yaml")


def _cli(
    workdir: Path, *args: str, timeout: int = 600, test: bool = False
) -> subprocess.CompletedProcess:
    """``lightning-fl fit`` in a new process (Lightning's own launcher starts the others)."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lightning_fl.cli", "fit", *args,
         "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(workdir),
         "--trainer.logger.init_args.save_dir", str(workdir),
         "--test_after_fit", str(test).lower()],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _one_process(workdir: Path, *args: str) -> None:
    """``lightning-fl fit`` on 1 process, in this one (one thread, as each rank has)."""
    from unittest import mock

    from lightning_fl.cli import run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mock.patch.object(sys, "argv", ["lightning-fl"]):  # not pytest's arguments
            options = ["--trainer.devices", "1", "--trainer.enable_progress_bar", "false",
                       "--trainer.default_root_dir", str(workdir),
                       "--trainer.logger.init_args.save_dir", str(workdir)]  # fmt: skip
            run(["fit", *args, *options], exit_on_error=False)
    finally:
        torch.set_num_threads(threads)


def _checkpoint(folder: Path) -> dict:
    return torch.load(run_file(folder, "last.ckpt"), weights_only=True)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return _checkpoint(folder)["state_dict"]


def _client_rows(folder: Path) -> list[list[str]]:
    """client_metrics.csv's rows, sorted."""
    return sorted(
        line.strip().split(",")
        for line in open(run_file(folder, "client_metrics.csv")).readlines()[1:]
    )


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def _recipe(*parts: str) -> str:
    return str(ROOT.joinpath("recipes", *parts))


SIMILARITY = _recipe("clustered_sampling_similarity.yaml")
NO_TEST = ("--test_after_fit", "false")
EVERY_CLIENT = ("--trainer.strategy.init_args.sampler", "lightning_fl.FullParticipation")
POISON = ("--trainer.callbacks+=tests.helpers.PoisonedUpdates",
          "--trainer.callbacks.init_args.clients", "[0]")  # fmt: skip
#: Each case's arguments; on 2 processes they run in one torchrun launch (the fixture
#: below), on 1 process in the test that compares.
CASES: dict[str, list[str]] = {
    "quickstart": ["--config", QUICKSTART, "--trainer.max_epochs", "5", *NO_TEST],
    "similarity": ["--config", SIMILARITY, "--trainer.max_epochs", "5", *NO_TEST],
    "scaffold": ["--config", SCAFFOLD, "--trainer.limit_val_batches", "0",
                 "--trainer.max_epochs", "4", *NO_TEST],
    "scaffold_first": ["--config", SCAFFOLD, "--trainer.limit_val_batches", "0",
                       "--trainer.max_epochs", "2", *NO_TEST],
    "scaffold_resumed": ["--config", SCAFFOLD, "--trainer.limit_val_batches", "0",
                         "--trainer.max_epochs", "4", "--ckpt_path", "@last.ckpt:scaffold_first",
                         *NO_TEST],
    # each rank vectorizes its own clients in chunks of 3, so ranks take different numbers
    # of steps and pad
    "scaffold_vectorized": ["--config", SCAFFOLD, "--trainer.limit_val_batches", "0",
                            "--trainer.max_epochs", "4", *NO_TEST,
                            "--trainer.strategy.init_args.vectorize", "true",
                            "--trainer.strategy.init_args.max_vectorized_clients", "3"],
    "digits_fedem": ["--config", _recipe("personalization", "digits_fedem.yaml"),
                     "--trainer.max_epochs", "3", "--test_after_fit", "true"],
    "digits_knn_per": ["--config", _recipe("personalization", "digits_knn_per.yaml"),
                       "--trainer.max_epochs", "3", "--test_after_fit", "true"],
    "gaia_ring": ["--config", _recipe("topology", "digits_gaia_ring.yaml"),
                  "--trainer.max_epochs", "3", *NO_TEST],
    "fedfix": ["--config", _recipe("asynchronous", "digits_fedfix.yaml"),
               "--trainer.max_epochs", "6", *NO_TEST],
    "async": ["--config", _recipe("asynchronous", "digits_async.yaml"),
              "--trainer.max_epochs", "6", *NO_TEST],
    # client 0's update is NaN in rounds 1 and 3 (clean rounds between) and, in the
    # second case, 1 and 2 with at most 2 bad rounds in a row: the rank without client 0
    # must drop nothing yet count the other rank's drop, and stop with it
    "nan_apart": ["--config", QUICKSTART, "--trainer.max_epochs", "5", *NO_TEST, *EVERY_CLIENT,
                  *POISON, "--trainer.callbacks.init_args.rounds", "[1, 3]"],
    "nan_in_a_row": ["--config", QUICKSTART, "--trainer.max_epochs", "5", *NO_TEST,
                     *EVERY_CLIENT, *POISON, "--trainer.callbacks.init_args.rounds", "[1, 2]",
                     "--trainer.strategy.init_args.max_consecutive_bad_rounds", "2"],
    "one_client": ["--config", QUICKSTART, "--data.init_args.num_clients", "1",
                   "--data.init_args.partition", "iid", *NO_TEST,
                   "--trainer.strategy.init_args.sampler", "lightning_fl.FullParticipation"],
}  # fmt: skip


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Every case on 2 gloo processes, in one torchrun launch: (root, {case: outcome})."""
    import json

    from tests.helpers import torchrun

    root = tmp_path_factory.mktemp("two_processes")
    (root / "cases.json").write_text(json.dumps(CASES))
    result = torchrun("tests.recipes_distributed", str(root), str(root / "cases.json"),
                      timeout=900)  # fmt: skip
    return root, json.loads((root / "outcomes.json").read_text()), result.stderr


def _two(two_processes, case: str) -> Path:
    root, outcomes, _ = two_processes
    assert outcomes[case] == "ok", (case, outcomes[case])
    return root / case


@pytest.mark.parametrize("case", ["quickstart", "similarity"])
def test_two_processes_equal_one_process(two_processes, tmp_path, case):
    """The similarity sampler's G_i reach both ranks through the round's all-reduce, so both
    draw the same clients."""
    dirs = {"1": tmp_path, "2": _two(two_processes, case)}
    _one_process(tmp_path, *CASES[case])
    one, two = _weights(dirs["1"]), _weights(dirs["2"])
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    logged = {d: list(csv.DictReader(open(run_file(f, "metrics.csv")))) for d, f in dirs.items()}
    # the plain val_acc is the gathered weighted mean, not a count-averaged sync
    plain = {
        d: [float(r["val_acc"]) for r in rows if r.get("val_acc")] for d, rows in logged.items()
    }
    assert plain["1"] and plain["1"] == pytest.approx(plain["2"], abs=1e-6)
    # the round's training mean is over every rank's clients
    train = {
        d: [float(r["train_loss_epoch"]) for r in rows if r.get("train_loss_epoch")]
        for d, rows in logged.items()
    }
    assert len(train["1"]) == 5 and train["1"] == pytest.approx(train["2"], rel=1e-5)
    rows = {d: _client_rows(folder) for d, folder in dirs.items()}
    assert [r[:4] + r[5:] for r in rows["1"]] == [r[:4] + r[5:] for r in rows["2"]]
    for a, b in zip(rows["1"], rows["2"]):  # every client's metric, gathered from both ranks
        assert float(a[4]) == pytest.approx(float(b[4]), rel=1e-4, abs=1e-6)


@pytest.fixture(scope="module")
def scaffold_one_process(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("scaffold_one_process")
    _one_process(folder, *CASES["scaffold"])
    return folder


def test_scaffold_on_two_processes_equals_one_and_resumes_exactly(
    two_processes, scaffold_one_process
):
    """SCAFFOLD's c_i live in the client store and Σ Δc_i rides the round's all-reduce:
    the model and the server control equal the 1-process run; resuming is exact."""
    full = _two(two_processes, "scaffold")
    one, two = _weights(scaffold_one_process), _weights(full)
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    controls = []
    for folder in (scaffold_one_process, full):
        callbacks = _checkpoint(folder)["callbacks"]
        (key,) = [k for k in callbacks if k.startswith("SCAFFOLD")]
        controls.append(callbacks[key]["server_control"])
    assert max(float((a - b).abs().max()) for a, b in zip(*controls)) <= 1e-5
    assert max(float(c.abs().max()) for c in controls[0]) > 0  # the controls did move
    first = _two(two_processes, "scaffold_first")
    saved = _checkpoint(first)["callbacks"]["_RoundDriver"]["client_store"]
    assert saved and {c % 2 for c in saved} == {0, 1}  # both ranks' clients in one file
    resumed = _weights(_two(two_processes, "scaffold_resumed"))
    two = _weights(full)
    assert all(torch.equal(two[k], resumed[k]) for k in two)


def test_vectorized_clients_on_two_processes_equal_the_sequential_run(
    two_processes, scaffold_one_process
):
    """Each rank vectorizes its own clients, in chunks of 3 (so ranks take different
    numbers of steps and pad): SCAFFOLD's model equals the 1-process sequential run."""
    one = _weights(scaffold_one_process)
    two = _weights(_two(two_processes, "scaffold_vectorized"))
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5


@pytest.mark.parametrize("rank", [1, 0])
def test_crashed_rank_is_reported_and_nothing_hangs(tmp_path, rank):
    """Through Lightning's own launcher (``--trainer.devices 2``), as a user starts it."""
    # The process group's timeout covers the rendezvous too: on a loaded 2-core machine
    # the second process may take over 20 s to import Lightning and connect (CI saw a
    # DistNetworkError instead of the injected failure), so it is generous; a hang would
    # still end within it.
    result = _cli(
        tmp_path, "--config", QUICKSTART, "--trainer.max_epochs", "3", "--trainer.devices", "2",
        "--trainer.strategy.init_args.timeout", "120",
        "--trainer.callbacks+=tests.helpers.CrashOnRank",
        "--trainer.callbacks.init_args.rank", str(rank), timeout=400,
    )  # fmt: skip
    assert result.returncode != 0
    assert f"injected failure on rank {rank}" in result.stdout + result.stderr


def test_round_metrics_are_logged_synced(two_processes):
    """The FL layer's and the Classifier's round metrics hold the same value on every rank
    and are logged with sync_dist: Lightning has no "recommended to use sync_dist" to say."""
    _, _, stderr = two_processes
    assert "It is recommended to use `self.log(" not in stderr


def test_a_nan_update_on_one_rank_is_dropped_on_both_and_stops_both(two_processes, tmp_path):
    """Client 0 (on one rank only) sends NaN in rounds 1 and 3: both ranks log one dropped
    update in exactly those rounds and end with the 1-process run's model; NaN in rounds 1
    and 2 with max_consecutive_bad_rounds = 2 stops both ranks at round 2 (no hang)."""
    _, outcomes, _ = two_processes
    assert (
        "2 consecutive rounds had NaN/Inf client updates (last: clients"
        in (outcomes["nan_in_a_row"])
    )
    two = _two(two_processes, "nan_apart")
    _one_process(tmp_path, *CASES["nan_apart"])
    one_w, two_w = _weights(tmp_path), _weights(two)
    assert max(float((one_w[k] - two_w[k]).abs().max()) for k in one_w) <= 1e-5
    for folder in (tmp_path, two):
        rows = list(csv.DictReader(open(run_file(folder, "metrics.csv"))))
        dropped = {int(r["epoch"]): float(r["fl/dropped_updates"])
                   for r in rows if r.get("fl/dropped_updates")}  # fmt: skip
        assert dropped == {0: 0.0, 1: 1.0, 2: 0.0, 3: 1.0, 4: 0.0}, folder


def test_more_processes_than_clients_is_refused(two_processes):
    _, outcomes, _ = two_processes
    assert "2 processes but only 1 clients" in outcomes["one_client"]


def test_fedem_and_knn_per_on_two_processes_equal_one_process(two_processes, tmp_path):
    """FedEM's π live in the client store; kNN-Per's λ_t are gathered from every rank:
    rank 0 writes every client's λ and datastore size, in client order, and the logged
    λ mean and π entropy are over both ranks' clients."""
    logged_means = {
        "digits_fedem": "fedem/pi_entropy_epoch",
        "digits_knn_per": "knn_per/lambda_mean",
    }
    for recipe, mean in logged_means.items():
        dirs = {"1": tmp_path / recipe, "2": _two(two_processes, recipe)}
        _one_process(dirs["1"], *CASES[recipe])
        one, two = _weights(dirs["1"]), _weights(dirs["2"])
        assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
        rows = {d: _client_rows(folder) for d, folder in dirs.items()}
        assert [r[:4] for r in rows["1"]] == [r[:4] for r in rows["2"]] and rows["1"]
        for a, b in zip(rows["1"], rows["2"]):
            assert abs(float(a[4]) - float(b[4])) < 1e-4, (a, b)
        logged = {
            d: [float(r[mean]) for r in csv.DictReader(open(run_file(f, "metrics.csv")))
                if r.get(mean)]
            for d, f in dirs.items()
        }  # fmt: skip
        assert logged["1"] and logged["1"] == pytest.approx(logged["2"], abs=1e-5), mean
    lambdas = {
        d: open(run_file(f, "knn_per_lambdas.csv")).read().splitlines()
        for d, f in {"1": tmp_path / "digits_knn_per",
                     "2": _two(two_processes, "digits_knn_per")}.items()
    }  # fmt: skip
    # seen and unseen clients, in client order (not in the gather's rank order)
    assert [row.split(",")[0] for row in lambdas["1"][1:]] == [str(c) for c in range(10)]
    assert lambdas["1"] == lambdas["2"]
    fedem = {"1": tmp_path / "digits_fedem", "2": _two(two_processes, "digits_fedem")}
    store = {
        d: _checkpoint(f)["callbacks"]["_RoundDriver"]["client_store"] for d, f in fedem.items()
    }
    assert sorted(store["1"]) == sorted(store["2"])
    for c in store["1"]:
        assert torch.allclose(store["1"][c]["fedem_pi"], store["2"][c]["fedem_pi"], atol=1e-5)


def test_dpasgd_over_a_ring_on_two_processes_equals_one_process(two_processes, tmp_path):
    """The silo models travel in the round's all-reduce; each rank keeps its own silos'."""
    dirs = {"1": tmp_path, "2": _two(two_processes, "gaia_ring")}
    _one_process(tmp_path, *CASES["gaia_ring"])
    one, two = _weights(dirs["1"]), _weights(dirs["2"])
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    saved = {d: _checkpoint(folder)["callbacks"] for d, folder in dirs.items()}
    stores = {d: saved[d]["_RoundDriver"]["client_store"] for d in saved}
    assert sorted(stores["1"]) == sorted(stores["2"]) == list(range(11))
    for c in stores["1"]:
        a, b = stores["1"][c]["gossip_model"], stores["2"][c]["gossip_model"]
        assert torch.allclose(a, b, atol=1e-5)
    (clock_one,) = [v["clock"] for k, v in saved["1"].items() if "GossipAveraging" in k]
    (clock_two,) = [v["clock"] for k, v in saved["2"].items() if "GossipAveraging" in k]
    assert clock_one == clock_two and max(clock_one["times"]) > 0


@pytest.mark.parametrize("scheme", ["fedfix", "async"])
def test_asynchronous_schemes_on_two_processes_equal_one_process(two_processes, tmp_path, scheme):
    """Every rank holds the same schedule and model versions; stale clients train on their
    owner's rank. The recipes' FederatedObjective evaluates each rank's clients and sums
    the client losses over ranks: the logged objectives equal one process's."""
    _one_process(tmp_path, *CASES[scheme])
    folders = {"1": tmp_path, "2": _two(two_processes, scheme)}
    one, two = _weights(folders["1"]), _weights(folders["2"])
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
    logged = {}
    for d, folder in folders.items():
        rows = csv.DictReader(open(run_file(folder, "metrics.csv")))
        logged[d] = [(float(r["fl/federated_loss"]), float(r["fl/surrogate_loss"]))
                     for r in rows if r.get("fl/federated_loss")]  # fmt: skip
    assert len(logged["1"]) == {"fedfix": 3, "async": 1}[scheme]  # the recipes' schedules
    for a, b in zip(logged["1"], logged["2"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def _planner(world_size: int, callbacks, keep_optimizer_state=False, datamodule=None):
    from types import SimpleNamespace

    from lightning_fl import FullParticipation
    from lightning_fl.engine.context import Plugins, Ranks
    from lightning_fl.engine.planning import RoundPlanner
    from tests.helpers import tiny_datamodule

    fit = SimpleNamespace(  # the fields of a FitContext that the planner's ranks read
        ranks=Ranks(world_size, 0),
        plugins=Plugins(tuple(callbacks), callbacks[0], FullParticipation()),
        config=SimpleNamespace(keep_optimizer_state=keep_optimizer_state, silos=False),
        datamodule=datamodule or tiny_datamodule(),
    )
    return RoundPlanner(fit)


def test_participants_are_split_by_steps_when_no_plugin_keeps_client_state():
    """Longest processing time first: 10 equal clients split 5/5 whatever their ids (by
    owner, clients 0, 2, 4, 6, 8 would all train on rank 0); unequal steps end within
    one client's steps of each other; state kept in the client store (SCAFFOLD's c_i, an
    optimizer state) moves with its client, so those split by steps too; a client drawn
    twice trains on one rank; with a plugin whose state stays on its owner (gossip's
    personal models) or streams, each client trains where its state lives (its owner)."""
    from lightning_fl.callbacks import SCAFFOLD, FedAvg, FedProx, GossipAveraging
    from lightning_fl.datamodules import StreamingDataModule
    from tests.helpers import tiny_datamodule

    planner = _planner(2, [FedAvg(), FedProx(mu=0.1)])
    even = [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]
    ranks = planner.ranks(even, [5] * 10)
    assert ranks.count(0) == ranks.count(1) == 5
    steps = [9, 1, 4, 7, 3, 3, 8]
    ranks = planner.ranks(list(range(7)), steps)
    loads = [sum(s for s, r in zip(steps, ranks) if r == k) for k in (0, 1)]
    # by hand, longest first: 9 → r0, 8 → r1, 7 → r1 (8 < 9), 4 → r0, 3 → r0, 3 → r1, 1 → r0
    assert ranks == [0, 0, 0, 1, 0, 1, 1] and loads == [17, 18]
    assert _planner(2, [SCAFFOLD()]).ranks(list(range(7)), steps) == ranks
    kept = _planner(2, [FedAvg()], keep_optimizer_state=True)
    assert kept.ranks(list(range(7)), steps) == ranks
    # client 3 drawn twice (3 + 4 steps): one rank, by its total of 7; by hand: 3 (7) → r0,
    # 5 (6) → r1, 2 (5) → r1 (6 < 7), 1 (2) → r0 (7 < 11)
    assert planner.ranks([5, 3, 1, 3, 2], [6, 3, 2, 4, 5]) == [1, 0, 0, 0, 1]
    by_owner = [c % 2 for c in even]
    gossip = GossipAveraging(edge_probability=0.6, seed=1)
    assert _planner(2, [gossip]).ranks(even, [5] * 10) == by_owner
    streams = StreamingDataModule(tiny_datamodule(), rate=3, capacity=6, cache="fifo", rounds=2)
    assert _planner(2, [FedAvg()], datamodule=streams).ranks(even, [5] * 10) == by_owner


def test_ranks_pad_to_the_same_number_of_fused_training_steps():
    """With 3 local steps per Lightning step and chunks of 2, rank 0's clients of 5, 7 and
    2 steps take ⌈7/3⌉ + ⌈2/3⌉ = 4 Lightning steps and rank 1's client of 9 takes 3, so
    rank 1 gets one idle step: both ranks step through rounds of the same length."""
    from types import SimpleNamespace

    from lightning_fl.engine.planning import PADDING, RoundPlanner

    config = SimpleNamespace(
        vectorize=True, max_vectorized_clients=2, local_steps_per_training_step=3, silos=False
    )
    planner = RoundPlanner(SimpleNamespace(config=config))
    per_rank = [[5, 7, 2], [9]]
    _, steps0, chunks0 = planner._schedules([0, 2, 4], [5, 7, 2], per_rank)
    _, steps1, chunks1 = planner._schedules([1], [9], per_rank)
    assert chunks0 == [(0, 1), (2,)] and steps0.num_batches == (3, 1)
    assert chunks1 == [(0,)] and steps1.clients == (0, PADDING)
    assert steps1.num_batches == (3, 1) and steps0.total == steps1.total == 4


def test_two_nodes_through_torchruns_c10d_rendezvous_equal_one_process(tmp_path):
    """The README's multi-node command, as 2 "nodes" of 1 process on localhost: each node
    is its own torchrun, which meet through the c10d rendezvous (without
    ``--rdzv-backend c10d`` torchrun's static rendezvous makes every node believe it is node
    0: EADDRINUSE on one, a hang on the other; issue 36). The run equals 1 process."""
    import socket

    readme = (ROOT / "README.md").read_text()
    assert "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d" in readme
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path / "two_nodes"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = ["--config", QUICKSTART, "--trainer.max_epochs", "3", *NO_TEST]
    node = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "test",
        "-m", "lightning_fl.cli", "fit", *args, "--trainer.num_nodes", "2",
        "--trainer.devices", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(folder),
        "--trainer.logger.init_args.save_dir", str(folder),
        "--trainer.strategy.init_args.timeout", "120",
    ]  # fmt: skip
    nodes = [
        subprocess.Popen(
            node, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )  # fmt: skip
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=600) for process in nodes]
    for process, (_, err) in zip(nodes, outputs):
        assert process.returncode == 0, err[-3000:]
    _one_process(tmp_path / "one", *args)
    one, two = _weights(tmp_path / "one"), _weights(folder)
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5
