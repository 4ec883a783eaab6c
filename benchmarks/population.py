"""A million clients on one machine (issue 66): what a round, an evaluation and opening
the data cost at N = 10³ and N = 10⁶, measured in one process, one thread.

    python benchmarks/population.py [--rounds 12] [--big 1000000] [--out FILE]

Every federation is N clients of 8 training and 4 validation samples of 4 features
(an in-memory :class:`~lightning_fl.datamodules.ArrayFederatedDataModule`), an MLP 4-8-3,
2 local steps of batch 4, 100 clients a round, seed 0. Round costs are the median of the
rounds after the first two, each configuration at N = 10³ then at N = ``--big``, in the
same process, sequential and vectorized. Then:

- a validation cohort of 1,000 clients (``eval_clients=1000``) at both sizes;
- one full validation pass over 10⁵ clients of 4 samples, vectorized over clients and
  client by client (the path before issue 66);
- opening a generated Sent140-shaped on-disk federation of ``--big`` clients and setting
  up a fit (a fresh process, its peak RSS against the data's size).

The table goes to ``benchmarks/results/population.md`` with the machine's name.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from run_times import machine  # noqa: E402

from lightning_fl import MLP, Classifier, FederatedStrategy, UniformSampler  # noqa: E402
from lightning_fl.callbacks import SCAFFOLD, FedAvg  # noqa: E402
from lightning_fl.datamodules import ArrayFederatedDataModule, ClientArrays  # noqa: E402
from lightning_fl.systems.availability import (  # noqa: E402
    MarkovAvailability,
    SojournMarkovAvailability,
)
from lightning_fl.systems.samplers import AvailableClients, MDSampler  # noqa: E402

PER_ROUND = 100


def federation(num_clients: int, train: int = 8, val: int = 4, seed: int = 0):
    """N clients of ``train`` and ``val`` samples of 4 features, 3 classes."""
    rng = np.random.default_rng(seed)

    def split(n: int) -> ClientArrays:
        x = rng.standard_normal((num_clients * n, 4), dtype=np.float32)
        y = rng.integers(0, 3, num_clients * n)
        return ClientArrays([x, y], np.arange(num_clients + 1, dtype=np.int64) * n)

    splits = {"train": split(train)} | ({"val": split(val)} if val else {})
    return ArrayFederatedDataModule(splits=splits, batch_size=4, eval_batch_size=4)


def configurations(num_clients: int) -> dict:
    """(sampler, callbacks) of each configuration the targets name. The Markov rows walk
    the same chains (π = 100/N, λ = 0.5) two ways: a draw per client each round
    (:class:`MarkovAvailability`, the authors' walk) and by sojourn times
    (:class:`SojournMarkovAvailability`)."""

    def markov(walk: type, estimate: bool = False) -> tuple:
        chains = walk(pi=PER_ROUND / num_clients, lam=0.5)
        return AvailableClients(chains, selector="unbiased", estimate=estimate), [FedAvg()]

    return {
        "FedAvg, uniform": (UniformSampler(PER_ROUND), [FedAvg()]),
        "FedAvg, MD": (MDSampler(PER_ROUND), [FedAvg()]),
        "Markov, sojourn walk; CA-Fed's Unbiased": markov(SojournMarkovAvailability),
        "Markov, sojourn walk; Unbiased with CA-Fed's estimated π̂": markov(
            SojournMarkovAvailability, estimate=True
        ),
        "Markov, a draw per chain a round; CA-Fed's Unbiased": markov(MarkovAvailability),
        "Markov, a draw per chain a round; Unbiased with CA-Fed's estimated π̂": markov(
            MarkovAvailability, estimate=True
        ),
        "SCAFFOLD, uniform": (UniformSampler(PER_ROUND), [SCAFFOLD()]),
    }


class Timer(pl.Callback):
    """Each training round's and each validation epoch's wall time."""

    def __init__(self) -> None:
        self.rounds: list[float] = []
        self.validations: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._round = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.rounds.append(time.perf_counter() - self._round)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validations.append(time.perf_counter() - self._validation)


def trainer(rounds: int, callbacks: list, workdir: str, validate: bool = False, **strategy):
    return pl.Trainer(
        max_epochs=rounds,
        strategy=FederatedStrategy(local_steps=2, seed=0, **strategy),
        callbacks=callbacks,
        limit_val_batches=None if validate else 0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=workdir,
    )


def model() -> Classifier:
    pl.seed_everything(0, verbose=False)
    return Classifier(MLP(4, (8,), 3), lr=0.1)


def round_times(dm, name: str, rounds: int, vectorize: bool, workdir: str) -> list[float]:
    """The times of rounds 3 to ``rounds`` of one fit."""
    sampler, callbacks = configurations(dm.num_clients)[name]
    timer = Timer()
    fit = trainer(rounds, [*callbacks, timer], workdir, sampler=sampler, vectorize=vectorize)
    fit.fit(model(), datamodule=dm)
    return timer.rounds[2:]


def interleaved(measure, dms: dict, repeats: int = 2) -> dict[int, float]:
    """The median of ``measure(dm)``'s times for each size, the sizes measured in turn
    ``repeats`` times (small, big, small, big): a slow spell of a shared machine then
    falls on both."""
    times: dict[int, list[float]] = {n: [] for n in dms}
    for _ in range(repeats):
        for n, dm in dms.items():
            times[n] += measure(dm)
    return {n: statistics.median(t) for n, t in times.items()}


def cohort_times(dm, rounds: int, vectorize_evaluation: bool, workdir: str) -> list[float]:
    """The validation epochs after the first, each from the moment its clients are chosen
    (the strategy's ``process_dataloader``) to its end."""
    timer = Timer()
    fit = trainer(rounds, [FedAvg(), timer], workdir, validate=True,
                  sampler=UniformSampler(PER_ROUND), eval_clients=1000,
                  vectorize_evaluation=vectorize_evaluation)  # fmt: skip
    strategy = fit.strategy
    process = strategy.process_dataloader

    def timed(dataloader):
        timer._validation = time.perf_counter()
        return process(dataloader)

    strategy.process_dataloader = timed
    fit.fit(model(), datamodule=dm)
    return timer.validations[1:]


def full_pass(dm, vectorize_evaluation: bool, workdir: str) -> float:
    fit = trainer(1, [FedAvg()], workdir, validate=True, sampler=UniformSampler(PER_ROUND),
                  vectorize_evaluation=vectorize_evaluation)  # fmt: skip
    module = model()
    fit.fit(module, datamodule=dm)
    start = time.perf_counter()
    fit.validate(module, datamodule=dm, verbose=False)
    return time.perf_counter() - start


def open_on_disk(folder: str, workdir: str) -> dict:
    """In this (fresh) process: open the federation and set up a fit, up to its first
    round; peak RSS."""
    from lightning_fl.datamodules import ArrayFederatedDataModule

    timer = Timer()
    start = time.perf_counter()
    dm = ArrayFederatedDataModule(folder, batch_size=4)
    fit = trainer(1, [FedAvg(), timer], workdir, sampler=UniformSampler(PER_ROUND))
    fit.fit(model(), datamodule=dm)
    setup = time.perf_counter() - start - sum(timer.rounds)
    data = sum(p.stat().st_size for p in Path(folder).glob("*.npy"))
    peak = peak_rss()
    return {"setup_s": setup, "round_s": timer.rounds[0], "data_bytes": data, "peak_rss": peak}


def peak_rss() -> int:
    """This process's peak resident memory in bytes: VmHWM (ru_maxrss would count the
    parent's memory at the fork that started it, as Linux keeps it across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--big", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/population.md")
    parser.add_argument("--open-only", metavar="FOLDER", help=argparse.SUPPRESS)
    parser.add_argument(
        "--quick", action="store_true",
        help="skip the client-by-client evaluations (minutes): the GPU check's budget",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp()
    if args.open_only:
        print(json.dumps(open_on_disk(args.open_only, workdir)))
        return
    sizes = (1000, args.big)
    lines = [
        f"# A million clients on one machine (issue 66)\n\nMachine: {machine()}; one thread; "
        f"`python benchmarks/population.py --rounds {args.rounds} --big {args.big}`.\n",
        "## Round cost against the population (target ≤ 1.15×)\n",
        f"N clients of 8 samples of 4 features, MLP 4-8-3, 2 local steps of 4, {PER_ROUND} "
        f"clients a round (Markov: π = {PER_ROUND}/N, λ = 0.5, about {PER_ROUND} available); "
        f"median of rounds 3–{args.rounds} of two fits at each N, the sizes in turn, in this "
        "process.\n",
        f"| configuration | path | N = {sizes[0]:,} (s) | N = {sizes[1]:,} (s) | ratio |",
        "|---|---|---|---|---|",
    ]
    dms = {n: federation(n) for n in sizes}
    for name in configurations(1000):
        for vectorize in (False, True):
            measure = partial(round_times, name=name, rounds=args.rounds,
                              vectorize=vectorize, workdir=workdir)  # fmt: skip
            cost = interleaved(measure, dms, repeats=1 if args.quick else 2)
            path = "vectorized" if vectorize else "sequential"
            lines.append(f"| {name} | {path} | {cost[sizes[0]]:.3f} | {cost[sizes[1]]:.3f} | "
                         f"{cost[sizes[1]] / cost[sizes[0]]:.2f}× |")  # fmt: skip
            print(lines[-1], flush=True)
    lines += [
        "\n## Evaluation\n",
        "A validation cohort of 1,000 clients (`eval_clients=1000`; at N = 1,000 every "
        "client), from the draw of its clients to the epoch's end, median over the "
        "validations after the first of two fits at each size (target ≤ 1.2×):\n",
        f"| evaluation | N = {sizes[0]:,} (s) | N = {sizes[1]:,} (s) | ratio |",
        "|---|---|---|---|",
    ]
    for vectorized in (True,) if args.quick else (True, False):
        measure = partial(cohort_times, rounds=8, vectorize_evaluation=vectorized,
                          workdir=workdir)  # fmt: skip
        cost = interleaved(measure, dms)
        label = "vectorized over clients" if vectorized else "client by client"
        lines.append(f"| cohort, {label} | {cost[sizes[0]]:.3f} | {cost[sizes[1]]:.3f} | "
                     f"{cost[sizes[1]] / cost[sizes[0]]:.2f}× |")  # fmt: skip
        print(lines[-1], flush=True)
    del dms
    small = federation(100_000, train=8, val=4, seed=1)
    fast = full_pass(small, True, workdir)
    slow = math.nan if args.quick else full_pass(small, False, workdir)
    lines += [
        "\nOne full validation pass over 100,000 clients of 4 samples (`trainer.validate`; "
        "target ≤ 2 s):\n",
        "| path | seconds |",
        "|---|---|",
        f"| vectorized over clients | {fast:.2f} |",
        f"| client by client | {slow:.2f} ({slow / fast:.0f}×) |",
    ]
    print("\n".join(lines[-3:]), flush=True)
    lines += opening(args.big, workdir)
    lines += READING
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


READING = [
    "\n## Reading\n",
    "- Planning, sampling and weights make no pass over the population in a round: the "
    "target weights are computed once a fit, uniform and MD draws replay torch's `randperm` "
    "and `multinomial` for the drawn clients only (`engine/seeding.py`, equal bit for bit), "
    "the Unbiased selector weighs only the available clients.",
    "- The Markov chains walked by sojourn times (`SojournMarkovAvailability`) touch the "
    "chains that change in a round (about 2Nπ(1−π)(1−λ) = 100 here) and CA-Fed's "
    "estimators count lazily from the clients whose state changed: those rows meet the "
    "target on both paths. The authors' walk (`MarkovAvailability`, a uniform per chain "
    "each round: 10⁶ float64 from torch's generator) keeps one tensor pass over N a round; "
    "the sequential round hides it, the vectorized round (about 11 ms here) does not.",
    "- The client-by-client full pass is the only evaluation path before issue 66 (one "
    "Lightning step per client batch, a loader per client); the issue measured it at "
    "43.7 s on its own federation.",
]


def opening(num_clients: int, workdir: str) -> list[str]:
    """Generate a Sent140-shaped on-disk federation, then open it in a fresh process."""
    from lightning_fl.datamodules.population import generate_population

    folder = os.path.join(workdir, "population")
    start = time.perf_counter()
    generate_population(folder, num_clients, shape="sent140", features=4, classes=2)
    generated = time.perf_counter() - start
    out = subprocess.run(
        [sys.executable, __file__, "--open-only", folder], check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    r = json.loads(out.strip().splitlines()[-1])
    limit = 1.5 * r["data_bytes"] + 0.5 * 2**30
    return [
        f"\n## Opening a {num_clients:,}-client on-disk federation (Sent140's shape)\n",
        f"Generated in {generated:.1f} s (`generate_population`); opened and set up in a "
        "fresh process (`ArrayFederatedDataModule(path)` and `trainer.fit` up to the first "
        "round; target ≤ 10 s, peak RSS ≤ 1.5× the data + 0.5 GB):\n",
        "| open + set up (s) | first round (s) | data on disk | peak RSS | RSS limit |",
        "|---|---|---|---|---|",
        f"| {r['setup_s']:.2f} | {r['round_s']:.2f} | {r['data_bytes'] / 2**20:.0f} MiB | "
        f"{r['peak_rss'] / 2**30:.2f} GiB | {limit / 2**30:.2f} GiB |",
    ]


if __name__ == "__main__":
    main()
