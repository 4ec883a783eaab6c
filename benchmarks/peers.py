"""lightning_fl beside the loop a user would write, and beside the peers (issue 78, item 5).

    python benchmarks/peers.py --setup-peers /tmp/peers   # pfl and Flower, a venv apart
    python benchmarks/peers.py [--shapes issue small cnn population] [--repeats 3]
        [--rounds 8] [--peers /tmp/peers/bin/python] [--runners ...] [--before CHECKOUT]
    python benchmarks/peers.py --check [--peers /tmp/peers/bin/python]  # the same update

The workload (issue 78): the same FedAvg computation in every framework. A federation of
clients with lognormal sizes (median 40 samples, σ 0.6, clipped to 10..400), 32 features,
10 classes with label skew (each client's labels from a Dirichlet(0.5) draw; a sample is
its class's mean plus unit noise); an MLP 32-64-10; one local epoch of batches of 10, SGD
at lr 0.05; the round's update Σ_i ω_i (θ_i − θ) with the uniform sampler's unbiased
weights ω_i = (n/m)·p_i, p_i the client's share of the samples (Fraboni et al., Tab. 2.1).

Shapes: ``issue`` (1,000 clients, 100 a round), ``small`` (20 clients, 10 a round: the
fixed cost of a round), ``cnn`` (lightning_fl's MnistCNN on 1×28×28 inputs, 20 of 200
clients a round), ``population`` (the population recipe's tiny clients: Sent140's counts,
an MLP 4-16-2, batches of 4, lr 0.1; 100 of 10,000 clients a round). Each framework runs
in a fresh process at one CPU thread; the table gives the median over ``--repeats``
interleaved repeats of the median round time (the first round, which builds and warms
up, excluded), and its ratio to the plain per-client PyTorch loop of the same repeat.
Every runner trains the same clients each round (lightning_fl's uniform sampler's draw,
computed once and handed to each).

The runners:

- ``plain``: the per-client loop a user writes in ten minutes: one ``deepcopy``-free
  model, its parameters loaded from θ, ``torch.randperm`` batches, ``torch.optim.SGD``;
- ``vectorized``, ``vectorized_all``: ``FederatedStrategy(vectorize=True)`` with one
  local step per Lightning step (the default) and every local step in one
  (``local_steps_per_training_step=None``);
- ``sequential``: ``FederatedStrategy()``, one client after another, one local step per
  Lightning step; ``sequential_fused``: all of a client's local steps in one Lightning
  step (``local_steps_per_training_step=None``);
- ``pfl`` (``--peers``): pfl-research's ``FederatedAveraging`` in its
  ``SimulatedBackend``, weighted by data points, the central update by SGD at lr 1;
- ``flower`` (``--peers``): Flower's simulation (Ray) with the Message API's ``FedAvg``,
  one SuperNode per client of a round (each message names its client), the ClientApp
  running the plain loop's epoch.

The peers live in a virtual environment of their own (``--setup-peers``: the CPU torch
wheel first, then ``pfl[pytorch]`` and ``flwr[simulation]``): pfl pins
``dp-accounting<0.6``, and neither belongs in CI.

``--check`` runs every client of the ``small`` federation for 3 rounds in each runner
and prints the largest difference of the final weights from the plain loop's with the
same sample order (lightning_fl's per-(round, client) permutations for lightning_fl's
runners; the data's own order for pfl, which does not shuffle, and Flower): float32
round-off, about 1e-7.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = str(Path(__file__).resolve().parent)
RESULTS = Path(HERE) / "results" / "peers.md"
RUNNERS = ("plain", "vectorized_all", "vectorized", "sequential_fused", "sequential")
PEERS = ("pfl", "flower")


@dataclass(frozen=True)
class Shape:
    """A workload: the federation, the network and the local training."""

    clients: int
    per_round: int
    network: str = "mlp"  # "mlp": features-hidden-classes; "cnn": MnistCNN on 1×28×28
    features: int = 32
    classes: int = 10
    hidden: int = 64
    batch: int = 10
    lr: float = 0.05
    sizes: tuple[float, float, int, int] = (40.0, 0.6, 10, 400)  # lognormal median, σ, clip


SHAPES = {
    "issue": Shape(1000, 100),
    "small": Shape(20, 10),
    # a CNN on 28×28 images (lightning_fl's MnistCNN), 20 of 200 clients a round
    "cnn": Shape(200, 20, network="cnn", features=28 * 28),
    # the population recipe's tiny clients: Sent140's counts (2.42 ± 4.71 a user, LEAF
    # Table 1: lognormal median e^0.10, σ 1.25), an MLP 4-16-2, batches of 4, lr 0.1
    "population": Shape(
        10_000,
        100,
        features=4,
        classes=2,
        hidden=16,
        batch=4,
        lr=0.1,
        sizes=(float(np.exp(0.101)), 1.251, 1, 400),
    ),  # fmt: skip
}


def federation(shape: Shape, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The clients' (x, y): lognormal sizes, Dirichlet(0.5) label skew; a sample is its
    class's mean plus unit noise (images: 1×28×28)."""
    rng = np.random.default_rng(seed)
    median, sigma, low, high = shape.sizes
    sizes = np.clip(np.ceil(rng.lognormal(np.log(median), sigma, shape.clients)), low, high)
    means = rng.normal(0, 1, (shape.classes, shape.features))
    clients = []
    for n in sizes.astype(int):
        labels = rng.choice(shape.classes, n, p=rng.dirichlet([0.5] * shape.classes))
        x = torch.tensor(means[labels] + rng.normal(0, 1, (n, shape.features)))
        x = x.float().view(n, 1, 28, 28) if shape.network == "cnn" else x.float()
        clients.append((x, torch.tensor(labels)))
    return clients


def network(shape: Shape) -> torch.nn.Module:
    """The network as a user writes it in plain torch: the same layers, in the same order,
    as lightning_fl's ``MLP`` and ``MnistCNN``, so that one seed gives them one θ⁰."""
    nn = torch.nn
    torch.manual_seed(0)
    if shape.network == "cnn":
        features = nn.Sequential(
            nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        head = nn.Sequential(
            nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, shape.classes)
        )
        return nn.Sequential(features, head)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(shape.features, shape.hidden), nn.ReLU(),
        nn.Linear(shape.hidden, shape.classes),
    )  # fmt: skip


def lightning_fl_network(shape: Shape) -> torch.nn.Module:
    from lightning_fl import MLP, MnistCNN

    torch.manual_seed(0)
    if shape.network == "cnn":
        return MnistCNN(shape.classes)
    return MLP(shape.features, (shape.hidden,), shape.classes)


def cohorts(shape: Shape, rounds: int, every_client: bool) -> list[list[int]]:
    """The clients of each round, as lightning_fl's UniformSampler draws them (every
    client with ``every_client``)."""
    if every_client:
        return [list(range(shape.clients))] * rounds
    from lightning_fl import UniformSampler

    sizes = np.array([len(y) for _, y in federation(shape)])
    p = torch.tensor(sizes / sizes.sum(), dtype=torch.float64)
    sampler = UniformSampler(shape.per_round)
    return [list(sampler.sample(r, seed=0, p=p).clients) for r in range(rounds)]


def batch_order(n: int, order: str, r: int, c: int, rng: torch.Generator) -> torch.Tensor:
    """A client's sample order for one epoch: ``seeded`` is lightning_fl's per-(round,
    client) draw, ``none`` the data's own order (pfl's), ``random`` one shared generator."""
    if order == "none":
        return torch.arange(n)
    if order == "seeded":
        from lightning_fl.engine.seeding import generator

        return torch.randperm(n, generator=generator(0, "data", r, c))
    return torch.randperm(n, generator=rng)


def local_epoch(net, x, y, shape: Shape, order: torch.Tensor) -> None:
    """One epoch of SGD over (x, y) in ``order``: the loop every peer's client runs."""
    optimizer = torch.optim.SGD(net.parameters(), lr=shape.lr)
    for i in range(0, len(y), shape.batch):
        index = order[i : i + shape.batch]
        optimizer.zero_grad()
        F.cross_entropy(net(x[index]), y[index]).backward()
        optimizer.step()


def run_plain(shape: Shape, cohort: list[list[int]], every_client: bool, order: str) -> dict:
    """FedAvg by hand: for each sampled client, load θ, one epoch of SGD, add ω_i Δ_i."""
    clients = federation(shape)
    sizes = np.array([len(y) for _, y in clients])
    net = network(shape)
    params = list(net.parameters())
    global_ = [p.detach().clone() for p in params]
    times = []
    rng = torch.Generator().manual_seed(0)
    for r, members in enumerate(cohort):
        start = time.perf_counter()
        scale = 1.0 if every_client else len(clients) / len(members)
        total = [torch.zeros_like(g) for g in global_]
        for c in members:
            x, y = clients[c]
            with torch.no_grad():
                for p, g in zip(params, global_):
                    p.copy_(g)
            local_epoch(net, x, y, shape, batch_order(len(y), order, r, c, rng))
            weight = scale * sizes[c] / sizes.sum()
            with torch.no_grad():
                for t, p, g in zip(total, params, global_):
                    t.add_(p - g, alpha=weight)
        with torch.no_grad():
            for g, t in zip(global_, total):
                g.add_(t)
        times.append(time.perf_counter() - start)
    return {"times": times, "weights": [g.tolist() for g in global_]}


def run_pfl(shape: Shape, cohort: list[list[int]]) -> dict:
    """pfl-research's FedAvg in its SimulatedBackend: the cohort's users through a
    ``FederatedDataset`` whose sampler yields them in order, weighted by data points
    (Σ n_i Δ_i / Σ n_i), applied by a central SGD at lr 1; pfl trains each user on its
    data in order (no shuffling)."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    clients = federation(shape)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = network(shape)

        def forward(self, x):
            return self.net(x)

        def loss(self, x, y, eval=False):
            return F.cross_entropy(self.net(x), y)

        def metrics(self, x, y, eval=False):
            return {}

    queue = iter([c for members in cohort for c in members])
    dataset = FederatedDataset(lambda c: Dataset(raw_data=list(clients[c])), lambda: next(queue))
    net = Net()
    model = PyTorchModel(
        net, local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
    )  # fmt: skip
    stamps = [time.perf_counter()]

    class RoundTimes(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            stamps.append(time.perf_counter())
            return False, Metrics()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=len(cohort), evaluation_frequency=10**9,
            train_cohort_size=len(cohort[0]), val_cohort_size=0,
        ),
        backend=SimulatedBackend(
            training_data=dataset, val_data=None, postprocessors=[WeightByDatapoints()]
        ),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=1, local_learning_rate=shape.lr, local_batch_size=shape.batch
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=shape.batch),
        callbacks=[RoundTimes()],
    )  # fmt: skip
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"times": times, "weights": [p.detach().tolist() for p in net.net.parameters()]}


_FLOWER_CLIENTS: dict[str, list] = {}


def flower_train(msg, context):
    """The Flower ClientApp's train handler: the client named in the message's config
    loads θ, runs one epoch of the plain loop and replies its weights and sample count.
    A module-level function, so that Ray's workers import it rather than unpickle it."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    torch.set_num_threads(1)
    config = msg.content["config"]
    shape = SHAPES[str(config["shape"])]
    if str(config["shape"]) not in _FLOWER_CLIENTS:  # once per worker process
        _FLOWER_CLIENTS[str(config["shape"])] = federation(shape)
    clients = _FLOWER_CLIENTS[str(config["shape"])]
    c, r = int(config["client"]), int(config["round"])
    x, y = clients[c]
    net = network(shape)
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    local_epoch(
        net, x, y, shape, batch_order(len(y), str(config["order"]), r, c, torch.Generator())
    )
    content = RecordDict(
        {"arrays": ArrayRecord(net.state_dict()), "metrics": MetricRecord({"num-examples": len(y)})}
    )
    return Message(content=content, reply_to=msg)


def run_flower(name: str, cohort: list[list[int]], order: str) -> dict:
    """Flower's simulation (Ray), the Message API's FedAvg, in its fastest setup: one
    SuperNode per client of a round, each message naming the client its node trains
    (virtual clients; with one SuperNode per client of the federation, Flower's round
    grows with the federation: 61 s on the issue's 1,000 clients). The ClientApp loads θ,
    runs the plain loop's epoch and replies its weights and sample count; FedAvg averages
    them weighted by the counts."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    shape = SHAPES[name]
    slots = max(len(members) for members in cohort)  # SuperNodes: a round's clients
    os.environ["PYTHONPATH"] = HERE  # Ray's workers import this file's ClientApp handler

    class CohortFedAvg(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            nodes = sorted(grid.get_node_ids())
            while len(nodes) < slots:
                time.sleep(0.1)
                nodes = sorted(grid.get_node_ids())
            messages = []
            for k, c in enumerate(cohort[server_round - 1]):
                record = ConfigRecord(
                    {"shape": name, "order": order, "client": c, "round": server_round - 1}
                )
                content = RecordDict({"arrays": arrays, "config": record})
                messages.append(
                    Message(content=content, message_type="train", dst_node_id=nodes[k])
                )
            return messages

    client_app = ClientApp()
    client_app.train()(flower_train)

    stamps: list[float] = []
    final: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = CohortFedAvg(fraction_evaluate=0.0, min_available_nodes=slots)
        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord(network(shape).state_dict()),
            num_rounds=len(cohort),
            evaluate_fn=lambda r, arrays: stamps.append(time.perf_counter()),
        )  # fmt: skip
        final.update(result.arrays.to_torch_state_dict())

    run_simulation(
        server_app=server_app, client_app=client_app, num_supernodes=slots,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 1}},
    )  # fmt: skip
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"times": times, "weights": [w.tolist() for w in final.values()]}


def run_lightning_fl(shape: Shape, rounds: int, every_client: bool, runner: str) -> dict:
    import lightning.pytorch as pl

    from lightning_fl import Classifier, FederatedStrategy, FullParticipation, UniformSampler
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    clients = [{"train": xy} for xy in federation(shape)]
    dm = InMemoryFederatedDataModule(clients, batch_size=shape.batch)
    module = Classifier(lightning_fl_network(shape), lr=shape.lr)
    sampler = FullParticipation() if every_client else UniformSampler(shape.per_round)
    options = {
        "plain": {},
        "sequential": {},
        "sequential_fused": {"local_steps_per_training_step": None},
        "vectorized": {"vectorize": True},
        "vectorized_all": {"vectorize": True, "local_steps_per_training_step": None},
    }[runner]
    times: list[float] = []

    class RoundTimes(pl.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, pl_module):
            times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as root:
        strategy = FederatedStrategy(
            sampler=sampler, local_epochs=1, seed=0, enable_plots=False, num_threads=1,
            **options,
        )  # fmt: skip
        trainer = pl.Trainer(
            max_epochs=rounds, strategy=strategy, callbacks=[RoundTimes()], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            accelerator="cpu", default_root_dir=root, limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(module, datamodule=dm)
    weights = [p.detach().tolist() for p in module.parameters()]
    return {"times": times, "weights": weights}


PEER_PACKAGES = ("torch==2.13.0", "pfl[pytorch]==0.6.0", "flwr[simulation]==1.42.0")


def use_tree(tree: str) -> None:
    """Import ``lightning_fl`` with its ``callbacks`` and ``datamodules`` from the checkout
    ``tree`` (a ``--before`` runner): on ``PYTHONPATH`` the tree gives ``lightning_fl``, but
    the editable install would still map the two top-level folders to this checkout."""
    import importlib.util

    import lightning_fl

    for name in ("callbacks", "datamodules"):
        folder = Path(tree) / name
        spec = importlib.util.spec_from_file_location(
            f"lightning_fl.{name}", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        setattr(lightning_fl, name, module)
        spec.loader.exec_module(module)


def run(shape: str, runner: str, every_client: bool, order: str, cohort_file: str) -> dict:
    if tree := os.environ.get("LIGHTNING_FL_TREE"):
        use_tree(tree)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning_fl", "flwr", "ray"):
        logging.getLogger(name).setLevel(logging.ERROR)
    cohort = json.loads(Path(cohort_file).read_text())
    if runner == "plain":
        return run_plain(SHAPES[shape], cohort, every_client, order)
    if runner == "pfl":
        return run_pfl(SHAPES[shape], cohort)
    if runner == "flower":
        return run_flower(shape, cohort, order)
    return run_lightning_fl(SHAPES[shape], len(cohort), every_client, runner)


@dataclass(frozen=True)
class Runner:
    """One column of the table: a runner, the interpreter that runs it (the peers' own
    virtual environment) and the checkout whose lightning_fl it imports (``--before``)."""

    name: str
    python: str = sys.executable
    tree: str | None = None

    @property
    def label(self) -> str:
        return self.name + (" (before)" if self.tree else "")

    def __call__(self, shape: str, cohort_file: str, every_client: bool, order: str) -> dict:
        command = [self.python, __file__, "--one", shape, self.name, cohort_file, order]
        command += ["--every-client"] if every_client else []
        env = None
        if self.tree:
            env = {**os.environ, "PYTHONPATH": self.tree, "LIGHTNING_FL_TREE": self.tree}
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(f"{self.label} on {shape} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def cohort_file(folder: str, shape: str, rounds: int, every_client: bool) -> str:
    path = Path(folder) / f"{shape}_{rounds}_{every_client}.json"
    path.write_text(json.dumps(cohorts(SHAPES[shape], rounds, every_client)))
    return str(path)


def largest_difference(a: list, b: list) -> float:
    return max(
        float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b, strict=True)
    )


def check(peers: str | None, rounds: int = 3) -> None:
    """Every client of the ``small`` federation, ``rounds`` rounds: the final weights of
    each runner against the plain loop's with the same sample order (lightning_fl's
    seeded one; the data's own for pfl, which does not shuffle, and Flower's check)."""
    with tempfile.TemporaryDirectory() as folder:
        every = cohort_file(folder, "small", rounds, every_client=True)
        plain = {o: Runner("plain")("small", every, True, o) for o in ("seeded", "none")}
        runs = [(Runner(name), "seeded") for name in RUNNERS[1:]]
        runs += [(Runner(name, peers), "none") for name in PEERS] if peers else []
        for runner, order in runs:
            weights = runner("small", every, True, order)["weights"]
            gap = largest_difference(plain[order]["weights"], weights)
            print(
                f"{runner.label:>16}: largest |Δθ| from the plain loop after {rounds} "
                f"rounds: {gap:.2e}"
            )


def measure(
    shapes: list[str],
    repeats: int,
    rounds: int,
    before: str | None,
    peers: str | None,
    chosen: list[str] | None = None,
) -> str:
    """The table; with ``before`` (a checkout), its runners too; with ``peers`` (a
    Python with pfl and Flower), theirs; all interleaved. ``chosen``: only these runners
    (the plain loop, the reference, always)."""
    runs = [Runner(name) for name in RUNNERS]
    runs += [
        Runner(name, tree=before) for name in RUNNERS[1:] if before and name != "sequential_fused"
    ]
    runs += [Runner(name, peers) for name in PEERS] if peers else []
    runs = [r for r in runs if r.name == "plain" or chosen is None or r.name in chosen]
    rows = []
    for shape in shapes:
        ratios: dict[Runner, list[float]] = {r: [] for r in runs}
        seconds: dict[Runner, list[float]] = {r: [] for r in runs}
        with tempfile.TemporaryDirectory() as folder:
            sampled = cohort_file(folder, shape, rounds, every_client=False)
            for _ in range(repeats):  # interleaved: the machine's noise falls on every runner
                per_round = {
                    r: statistics.median(r(shape, sampled, False, "random")["times"][1:])
                    for r in runs
                }
                for r in runs:
                    seconds[r].append(per_round[r])
                    ratios[r].append(per_round[r] / per_round[runs[0]])
        s = SHAPES[shape]
        for r in runs:
            rows.append(
                f"| {shape} ({s.per_round} of {s.clients}) | {r.label} | "
                f"{statistics.median(seconds[r]):.4f} | {statistics.median(ratios[r]):.2f} |"
            )
            print(rows[-1], flush=True)
    return "\n".join(
        ["| shape | runner | s/round | against the plain loop |", "|---|---|---|---|", *rows]
    )


def setup_peers(folder: str) -> None:
    """The peers' own virtual environment (pfl pins ``dp-accounting<0.6``; never CI's)."""
    subprocess.run([sys.executable, "-m", "venv", folder], check=True)
    pip = [str(Path(folder) / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *PEER_PACKAGES], check=True)
    print(f"peers installed: python benchmarks/peers.py --peers {folder}/bin/python")


def report(table: str, args: argparse.Namespace) -> str:
    command = f"python benchmarks/peers.py --repeats {args.repeats} --rounds {args.rounds}"
    command += f" --shapes {' '.join(args.shapes)}"
    if args.peers:
        command += " --peers <venv>/bin/python"
    if args.before:
        command += " --before <checkout of the earlier commit>"
    return (
        "# lightning_fl beside the plain loop and the peers (issue 78)\n\n"
        f"`{command}` (the peers' environment from `--setup-peers <venv>`: "
        f"{', '.join(PEER_PACKAGES)}): each runner in a fresh process at one CPU thread, "
        "the median round (the first excluded) of each repeat, the median over repeats "
        "interleaved; the ratio is to the plain loop of the same repeat. Every runner "
        "trains the same clients each round (lightning_fl's uniform sampler's draw).\n\n"
        f"{table}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--check", action="store_true")
    parser.add_argument(
        "--before", help="a checkout of an earlier commit: its runners too, interleaved"
    )
    parser.add_argument(
        "--peers", help="the Python of a virtual environment with pfl and flwr[simulation]"
    )
    parser.add_argument("--setup-peers", metavar="FOLDER", help="create that environment")
    parser.add_argument(
        "--runners", nargs="+", choices=[*RUNNERS, *PEERS], help="only these (and the plain loop)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="the table's file")
    parser.add_argument("--every-client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        shape, runner, cohorts_path, order = args.one
        sys.path.insert(0, HERE)
        import peers  # this file as a module: Ray's workers import its ClientApp handler

        print(json.dumps(peers.run(shape, runner, args.every_client, order, cohorts_path)))
    elif args.setup_peers:
        setup_peers(args.setup_peers)
    elif args.check:
        check(args.peers)
    else:
        table = measure(
            args.shapes, args.repeats, args.rounds, args.before, args.peers, args.runners
        )
        args.out.write_text(report(table, args))
        print(table)


if __name__ == "__main__":
    main()
