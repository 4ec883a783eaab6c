"""Where a round's time goes: FedAvg and FedEM on FedEM's synthetic task, one thread.

    python benchmarks/round_time.py [--rounds 5] [--num-test 300000] [--profile] [--out FILE]

300 clients (FedEM's synthetic mixture: d = 150, M = 3, linear models), batch 128, one
local epoch per round, full participation. It times every training round (and reports the
median), one evaluation pass over every client's test data, and with ``--profile``
writes the top cProfile lines of a training round and of an evaluation pass. The test set
is ``--num-test`` samples shared by the clients in proportion to their size (FedEM's own
protocol gives every client 5,000: ``--num-test 1500000``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_fl import Classifier, FederatedStrategy, MixtureClassifier
from lightning_fl.callbacks import FedAvg, FedEM
from lightning_fl.datamodules import SyntheticMixtureDataModule

ROOT = Path(__file__).resolve().parents[1]


class RoundTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.times.append(time.perf_counter() - self._start)


def build(method: str):
    pl.seed_everything(0, verbose=False)
    network = torch.nn.Linear(150, 2)
    if method == "fedem":
        return MixtureClassifier(network, num_components=3, lr=0.3), FedEM()
    return Classifier(network=network, lr=0.3), FedAvg()


def measure(method: str, dm, rounds: int, profile: bool, workdir: str) -> dict:
    model, callback = build(method)
    timer = RoundTimer()
    trainer = pl.Trainer(
        max_epochs=rounds,
        strategy=FederatedStrategy(local_epochs=1, seed=0),
        callbacks=[callback, timer],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=workdir,
        logger=pl.loggers.CSVLogger(workdir, name=method),
    )
    trainer.fit(model, datamodule=dm)
    start = time.perf_counter()
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    evaluation = time.perf_counter() - start
    result = {
        "round_median": statistics.median(timer.times[1:] or timer.times),
        "evaluation": evaluation,
        "test_acc": metrics["test_acc"],
    }
    if profile:
        for name, run in (
            ("train", lambda: trainer.fit(model, datamodule=dm)),
            ("eval", lambda: trainer.test(model, datamodule=dm, verbose=False)),
        ):
            if name == "train":
                trainer.fit_loop.max_epochs = rounds + 1
            profiler = cProfile.Profile()
            profiler.enable()
            run()
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
            result[f"profile_{name}"] = text.getvalue()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-test", type=int, default=300_000)
    parser.add_argument("--methods", nargs="+", default=["fedavg", "fedem"])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dm = SyntheticMixtureDataModule(num_tasks=300, num_test=args.num_test, batch_size=128)
    lines = [
        f"300 clients, {sum(dm.sample_counts('train'))} training and "
        f"{sum(dm.sample_counts('test'))} test samples, {args.rounds} rounds, one thread.",
        "",
        "| method | training per round (median, s) | one evaluation pass (s) | test_acc |",
        "|---|---|---|---|",
    ]
    profiles = []
    for method in args.methods:
        with tempfile.TemporaryDirectory() as workdir:
            r = measure(method, dm, args.rounds, args.profile, workdir)
        lines.append(
            f"| {method} | {r['round_median']:.3f} | {r['evaluation']:.3f} | {r['test_acc']:.4f} |"
        )
        print(lines[-1], flush=True)
        for name in ("train", "eval"):
            if f"profile_{name}" in r:
                profiles += [f"### {method}: one {name} pass", "```", r[f"profile_{name}"], "```"]
    text = "\n".join(lines + [""] + profiles) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
