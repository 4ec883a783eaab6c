"""lightning_fl beside the loop a user would write, and beside the peers (issue 78, item 5).

    python benchmarks/peers.py [--shapes issue small] [--repeats 3] [--rounds 8]
    python benchmarks/peers.py --check        # the frameworks compute the same update

The workload (issue 78): the same FedAvg computation in every framework. A federation of
clients with lognormal sizes (mean 47 samples, clipped to 10..400), 32 features, 10
classes with label skew (each client's labels from a Dirichlet(0.5) draw; a sample is its
class's mean plus unit noise); an MLP 32-64-10; one local epoch of batches of 10, SGD at
lr 0.05; the round's update Σ_i ω_i (θ_i − θ) with the uniform sampler's unbiased weights
ω_i = (n/m)·p_i, p_i the client's share of the samples (Fraboni et al., Tab. 2.1).

Shapes: ``issue`` (1,000 clients, 100 a round), ``small`` (20 clients, 10 a round: the
fixed cost of a round). Each framework runs in a fresh process at one CPU thread; the
table gives the median over ``--repeats`` interleaved repeats of the median round time
(the first round, which builds and warms up, excluded), and its ratio to the plain
per-client PyTorch loop of the same repeat.

The runners:

- ``plain``: the per-client loop a user writes in ten minutes: one ``deepcopy``-free
  model, its parameters loaded from θ, ``torch.randperm`` batches, ``torch.optim.SGD``;
- ``vectorized``, ``vectorized_all``: ``FederatedStrategy(vectorize=True)`` with one
  local step per Lightning step (the default) and every local step in one
  (``local_steps_per_training_step=None``);
- ``sequential``: ``FederatedStrategy()``, one client after another, one local step per
  Lightning step; ``sequential_fused``: all of a client's local steps in one Lightning
  step (``local_steps_per_training_step=None``).

``--check`` runs every client of a 20-client federation for 3 rounds in each runner, the
plain loop shuffling with lightning_fl's per-(round, client) generators, and prints the
largest difference of the final weights (float32 round-off: about 1e-7).

pfl-research and Flower's simulation are not installed here (pfl pins
``dp-accounting<0.6``, and neither belongs in CI); their figures in
``benchmarks/results/peers.md`` are the issue's, measured on this machine's twin.
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

RESULTS = Path(__file__).resolve().parent / "results" / "peers.md"
RUNNERS = ("plain", "vectorized_all", "vectorized", "sequential_fused", "sequential")


@dataclass(frozen=True)
class Shape:
    clients: int
    per_round: int
    features: int = 32
    classes: int = 10
    hidden: int = 64
    batch: int = 10
    lr: float = 0.05


SHAPES = {"issue": Shape(1000, 100), "small": Shape(20, 10)}


def federation(shape: Shape, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The clients' (x, y): lognormal sizes, Dirichlet(0.5) label skew."""
    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(np.log(40), 0.6, shape.clients), 10, 400).astype(int)
    means = rng.normal(0, 1, (shape.classes, shape.features))
    clients = []
    for n in sizes:
        labels = rng.choice(shape.classes, n, p=rng.dirichlet([0.5] * shape.classes))
        x = means[labels] + rng.normal(0, 1, (n, shape.features))
        clients.append((torch.tensor(x, dtype=torch.float32), torch.tensor(labels)))
    return clients


def model(shape: Shape) -> torch.nn.Module:
    from lightning_fl import MLP

    torch.manual_seed(0)
    return MLP(shape.features, (shape.hidden,), shape.classes)


def cohorts(shape: Shape, rounds: int, sizes: np.ndarray, seed: int = 0) -> list[list[int]]:
    """The clients of each round, as lightning_fl's UniformSampler draws them."""
    from lightning_fl import UniformSampler

    p = torch.tensor(sizes / sizes.sum(), dtype=torch.float64)
    sampler = UniformSampler(shape.per_round)
    return [list(sampler.sample(r, seed=seed, p=p).clients) for r in range(rounds)]


def run_plain(shape: Shape, rounds: int, every_client: bool, same_order: bool) -> dict:
    """FedAvg by hand: for each sampled client, load θ, one epoch of SGD, add ω_i Δ_i."""
    from lightning_fl.engine.seeding import generator

    clients = federation(shape)
    sizes = np.array([len(y) for _, y in clients])
    net = model(shape)
    params = list(net.parameters())
    global_ = [p.detach().clone() for p in params]
    cohort = [list(range(len(clients)))] * rounds if every_client else None
    cohort = cohort or cohorts(shape, rounds, sizes)
    times = []
    rng = torch.Generator().manual_seed(0)
    for r in range(rounds):
        start = time.perf_counter()
        members = cohort[r]
        scale = 1.0 if every_client else len(clients) / len(members)
        total = [torch.zeros_like(g) for g in global_]
        for c in members:
            x, y = clients[c]
            with torch.no_grad():
                for p, g in zip(params, global_):
                    p.copy_(g)
            optimizer = torch.optim.SGD(params, lr=shape.lr)
            gen = generator(0, "data", r, c) if same_order else rng
            order = torch.randperm(len(y), generator=gen)
            for i in range(0, len(y), shape.batch):
                index = order[i : i + shape.batch]
                optimizer.zero_grad()
                F.cross_entropy(net(x[index]), y[index]).backward()
                optimizer.step()
            weight = scale * sizes[c] / sizes.sum()
            with torch.no_grad():
                for t, p, g in zip(total, params, global_):
                    t.add_(p - g, alpha=weight)
        with torch.no_grad():
            for g, t in zip(global_, total):
                g.add_(t)
        times.append(time.perf_counter() - start)
    return {"times": times, "weights": [g.tolist() for g in global_]}


def run_lightning_fl(shape: Shape, rounds: int, every_client: bool, runner: str) -> dict:
    import lightning.pytorch as pl

    from lightning_fl import Classifier, FederatedStrategy, FullParticipation, UniformSampler
    from lightning_fl.datamodules import InMemoryFederatedDataModule

    clients = [{"train": xy} for xy in federation(shape)]
    dm = InMemoryFederatedDataModule(clients, batch_size=shape.batch)
    module = Classifier(model(shape), lr=shape.lr)
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


def run(shape: str, runner: str, rounds: int, every_client: bool = False) -> dict:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning_fl"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if runner == "plain":
        return run_plain(SHAPES[shape], rounds, every_client, same_order=every_client)
    return run_lightning_fl(SHAPES[shape], rounds, every_client, runner)


def in_fresh_process(
    shape: str, runner: str, rounds: int, every_client: bool, tree: str | None = None
) -> dict:
    """``runner`` in a process of its own; ``tree``: a checkout whose lightning_fl it runs
    (``--before``), in place of this one."""
    command = [sys.executable, __file__, "--one", shape, runner, str(rounds)]
    command += ["--every-client"] if every_client else []
    env = {**os.environ, "PYTHONPATH": tree} if tree else None
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def largest_difference(a: list, b: list) -> float:
    return max(
        float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b, strict=True)
    )


def check(rounds: int = 3) -> None:
    """Every client of the ``small`` federation, ``rounds`` rounds: the final weights."""
    results = {r: in_fresh_process("small", r, rounds, every_client=True) for r in RUNNERS}
    for runner in RUNNERS[1:]:
        gap = largest_difference(results["plain"]["weights"], results[runner]["weights"])
        print(f"{runner:>16}: largest |Δθ| from the plain loop after {rounds} rounds: {gap:.2e}")


def measure(shapes: list[str], repeats: int, rounds: int, before: str | None) -> str:
    """The table; with ``before`` (a checkout), its runners too, interleaved."""
    runs = [(runner, None) for runner in RUNNERS]
    if before:
        runs += [(runner, before) for runner in RUNNERS[1:] if runner != "sequential_fused"]
    rows = []
    for shape in shapes:
        ratios: dict[tuple, list[float]] = {r: [] for r in runs}
        seconds: dict[tuple, list[float]] = {r: [] for r in runs}
        for _ in range(repeats):  # interleaved: the machine's noise falls on every runner
            per_round = {}
            for runner, tree in runs:
                out = in_fresh_process(shape, runner, rounds, every_client=False, tree=tree)
                per_round[runner, tree] = statistics.median(out["times"][1:])
            for run in runs:
                seconds[run].append(per_round[run])
                ratios[run].append(per_round[run] / per_round["plain", None])
        s = SHAPES[shape]
        for run in runs:
            label = run[0] if run[1] is None else f"{run[0]} (before)"
            rows.append(
                f"| {shape} ({s.per_round} of {s.clients}) | {label} | "
                f"{statistics.median(seconds[run]):.4f} | "
                f"{statistics.median(ratios[run]):.2f} |"
            )
            print(rows[-1], flush=True)
    return "\n".join(
        ["| shape | runner | s/round | against the plain loop |", "|---|---|---|---|", *rows]
    )


ISSUE_PEERS = """The peers, as issue 78 measured them on this machine's twin (the issue's workload,
one CPU, median of 3 interleaved repeats; not rerun here: `pip install pfl-research
"flwr[simulation]"` belongs in a virtual environment of its own, never in CI):

| framework | s/round | against a plain per-client PyTorch loop |
|---|---|---|
| plain per-client loop | 0.0655 | 1.00 |
| pfl-research 0.6.0 (Apple), SimulatedBackend | 0.1091 | 1.67 |
| Flower 1.42 simulation (Ray, Message API FedAvg) | 1.2749 | 19.5 |
"""


def report(table: str, args: argparse.Namespace) -> str:
    command = f"python benchmarks/peers.py --repeats {args.repeats} --rounds {args.rounds}"
    if args.before:
        command += " --before <checkout of the earlier commit>"
    return (
        "# lightning_fl beside the plain loop (issue 78)\n\n"
        f"`{command}`: each runner in a fresh process at one CPU thread, the median round "
        "(the first excluded) of each repeat, the median over repeats interleaved; the "
        "ratio is to the plain loop of the same repeat. `python benchmarks/peers.py "
        "--check` shows the runners compute the same update (every client, 3 rounds: "
        "|Δθ| ≤ 1.5e-8 from the plain loop, 0 for the sequential paths).\n\n"
        f"{table}\n\n{ISSUE_PEERS}"
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
    parser.add_argument("--every-client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        shape, runner, rounds = args.one
        print(json.dumps(run(shape, runner, int(rounds), args.every_client)))
    elif args.check:
        check()
    else:
        table = measure(args.shapes, args.repeats, args.rounds, args.before)
        RESULTS.write_text(report(table, args))
        print(table)


if __name__ == "__main__":
    main()
