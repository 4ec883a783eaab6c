"""Clustered sampling against MD (Fraboni et al., ICML 2021; thesis §3.4, Fig. 3.1) on the
embedded digits or on Fashion-MNIST.

    python benchmarks/clustered_sampling.py [--rounds 300] [--dataset digits|fashion_mnist]

100 clients, each holding one digit's shard (10 clients per digit; 94 hold a single
digit), m = 10 clients per round, 50 local SGD steps, lr 0.01, batch 50, an MLP
64-50-10 (the thesis: 784-50-10 on MNIST), FedAvg with p_i = 1/n. Samplers: MD, clustered
by sample size (Alg. 2), clustered by model similarity (Alg. 3, arccos) and the oracle
"one client per digit". ``--dataset fashion_mnist`` runs the thesis's own sizes
(784-50-10, 600 images of one class per client) on Fashion-MNIST instead of MNIST and
writes clustered_sampling_fashion_mnist.md/.png. Reported: the number of distinct
classes among each round's clients (the thesis: MD about 6–8, clustered 10), the
training loss (the round's mean over its local steps, rolling mean over 50 rounds) and
the final test accuracy. Writes benchmarks/results/clustered_sampling.md and .png.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from recipe_runs import write_keeping_reading

from lightning_fl import (
    MLP,
    Classifier,
    FederatedStrategy,
    FixedClustersSampler,
    MDSampler,
    SampleSizeClusteredSampler,
    SimilarityClusteredSampler,
)
from lightning_fl.callbacks import FedAvg
from lightning_fl.datamodules import DigitsDataModule, FashionMnistDataModule

ROOT = Path(__file__).resolve().parents[1]


class RoundRecorder(pl.Callback):
    def __init__(self, digit_of: list[int]) -> None:
        self.digit_of, self.distinct, self.loss, self._losses = digit_of, [], [], []
        self.val_acc: list[float] = []

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and "val_acc" in trainer.callback_metrics:
            self.val_acc.append(float(trainer.callback_metrics["val_acc"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._losses.append(outputs["loss"].detach())

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        clients = trainer.strategy.current_round.state.participation.clients
        self.distinct.append(len({self.digit_of[c] for c in clients}))
        self.loss.append(float(torch.stack(self._losses).mean()))
        self._losses.clear()


def run(name: str, sampler, dm, digit_of, rounds: int, workdir: str, inputs: int) -> dict:
    pl.seed_everything(0, verbose=False)
    model = Classifier(MLP(inputs, (50,), 10), lr=0.01)
    recorder = RoundRecorder(digit_of)
    trainer = pl.Trainer(
        max_epochs=rounds,
        strategy=FederatedStrategy(sampler=sampler, local_steps=50, seed=0),
        callbacks=[FedAvg(weighting="uniform"), recorder],
        check_val_every_n_epoch=5,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=pl.loggers.CSVLogger(workdir, name=name),
        log_every_n_steps=50,
    )
    trainer.fit(model, datamodule=dm)
    accuracy = trainer.test(model, datamodule=dm, verbose=False)[0]["test_acc"]
    return {
        "distinct": recorder.distinct,
        "loss": recorder.loss,
        "test_acc": accuracy,
        "val_acc": recorder.val_acc,
    }


def rolling(values: list[float], window: int = 50) -> list[float]:
    return [statistics.mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--dataset", choices=["digits", "fashion_mnist"], default="digits")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.dataset == "digits":
        dm = DigitsDataModule(num_clients=100, partition="shards", shards_per_client=1, seed=0)
        inputs, data, suffix = 64, "the digits", ""
    else:
        dm = FashionMnistDataModule(
            num_clients=100, partition="shards", shards_per_client=1, image=False,
            val_fraction=0.1, seed=0, batch_size=50,
        )  # fmt: skip
        inputs, data, suffix = 784, "Fashion-MNIST (the thesis: MNIST)", "_fashion_mnist"
    digit_of = []
    for c in range(100):
        labels = dm.client_dataset(c, "train")[:][1].tolist()
        digit_of.append(collections.Counter(labels).most_common(1)[0][0])
    oracle = [[c for c in range(100) if digit_of[c] == d] for d in range(10)]
    samplers = {
        "MD": MDSampler(10),
        "clustered, sample size (Alg. 2)": SampleSizeClusteredSampler(10),
        "clustered, similarity (Alg. 3)": SimilarityClusteredSampler(10),
        "oracle: one client per digit": FixedClustersSampler(oracle),
    }
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name, sampler in samplers.items():
            results[name] = run(
                name.split()[0], sampler, dm, digit_of, args.rounds, workdir, inputs
            )
            r = results[name]
            print(name, statistics.mean(r["distinct"]), rolling(r["loss"])[-1], r["test_acc"])
            r["val_mean"] = statistics.mean(r["val_acc"][-10:])
    lines = [
        f"Clustered sampling on {data}, {args.rounds} rounds; "
        f"`python benchmarks/clustered_sampling.py --dataset {args.dataset}`. 100 one-class "
        f"clients, m = 10, 50 local steps, lr 0.01, batch 50, MLP {inputs}-50-10.",
        "",
        "| sampler | distinct classes per round (mean) | training loss (last 50 rounds) "
        "| validation accuracy (mean of the last 10 checks, every 5 rounds) "
        "| final test accuracy |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {statistics.mean(r['distinct']):.2f} | {rolling(r['loss'])[-1]:.4f} "
            f"| {r['val_mean']:.4f} | {r['test_acc']:.4f} |"
        )
    out = ROOT / "benchmarks" / "results" / f"clustered_sampling{suffix}.md"
    write_keeping_reading(out, "\n".join(lines))
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, r in results.items():
        axes[0].plot(rolling(r["loss"]), label=name)
        axes[1].plot(rolling([float(d) for d in r["distinct"]], 10), label=name)
        axes[2].plot([5 * (i + 1) for i in range(len(r["val_acc"]))], r["val_acc"], label=name)
    axes[0].set(xlabel="round", ylabel="training loss (rolling mean, 50 rounds)")
    axes[1].set(xlabel="round", ylabel="distinct digits per round (rolling mean, 10)")
    axes[2].set(xlabel="round", ylabel="validation accuracy")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
