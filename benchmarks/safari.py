"""SAFARI against FedAvg under incomplete participation (seed paper 004, Table 1) on the
embedded digits or on Fashion-MNIST.

    python benchmarks/safari.py [--seeds 0 1 2] [--q 0.5] [--dataset digits|fashion_mnist]

recipes/participation/safari.yaml's setting (10 clients holding p classes each, s = 4
never take part, 5 of the other 6 per round, multinomial logistic regression, SGD
lr 0.1, batch 64, one local epoch, 150 rounds) for server sets of 50, 100, 500 and 1000
digits and p ∈ {10, 5, 2, 1}: the test accuracy of SAFARI minus that of FedAvg (the same
run with q = 1), in points, mean over seeds, beside the paper's MNIST Table 1. Then
SAFARI's accuracy against q for p = 1 and 1000 server digits. Writes
benchmarks/results/safari_q<q>.md. ``--dataset fashion_mnist`` runs
recipes/fashion_mnist/safari.yaml instead: the paper's own sizes (10 clients of about
6,000 images, logistic regression on 784 pixels) on Fashion-MNIST, written to
safari_fashion_mnist_q<q>.md. ``--grid`` runs FedAvg's p × s grid on the digits instead
(safari_fedavg_grid.md).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from recipe_runs import write_keeping_reading

from lightning_fl.cli import run

ROOT = Path(__file__).resolve().parents[1]
SIZES, CLASSES = [50, 100, 500, 1000], [10, 5, 2, 1]
PAPER = {  # Table 1, MNIST, s = 4: SAFARI − FedAvg in points, "-" = no difference
    50: ["-", "-", "4.15", "12.75"],
    100: ["-", "-", "6.55", "22.19"],
    500: ["-", "-", "10.29", "29.12"],
    1000: ["-", "-", "10.88", "31.42"],
}


RECIPES = {
    "digits": ROOT / "recipes" / "participation" / "safari.yaml",
    "fashion_mnist": ROOT / "recipes" / "fashion_mnist" / "safari.yaml",
}


def accuracy(server: int, classes: int, q: float, seed: int, dataset: str = "digits") -> float:
    with tempfile.TemporaryDirectory() as workdir:
        cli = run(
            ["fit", "--config", str(RECIPES[dataset]),
             "--seed_everything", str(seed), "--trainer.strategy.init_args.seed", str(seed),
             "--data.init_args.seed", str(seed), "--data.init_args.server_samples", str(server),
             "--data.init_args.shards_per_client", str(classes),
             "--trainer.callbacks.init_args.q", str(q), "--trainer.limit_val_batches", "0",
             "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
             "--trainer.default_root_dir", workdir,
             "--trainer.logger.init_args.save_dir", workdir]
        )  # fmt: skip
    return 100 * float(cli.trainer.callback_metrics["test_acc"])


def fedavg_grid(seeds: list[int]) -> None:
    """FedAvg's test accuracy for p classes per client × s clients that never take part
    (the issue's p × s grid; no server data), written to safari_fedavg_grid.md."""
    from recipe_runs import run_recipe

    lines = ["FedAvg on digits, recipes/participation/safari.yaml with FedAvg instead of SAFARI "
             f"and no server data: test accuracy (%), mean over seeds {seeds}. p = classes per "
             "client, s = clients that never take part (5 of the 10 − s others per round).", "",
             "| s | " + " | ".join(f"p = {p}" for p in CLASSES) + " |",
             "|---|" + "---|" * len(CLASSES)]  # fmt: skip
    for excluded in (0, 2, 4, 5):
        cells = []
        for classes in CLASSES:
            values = []
            for seed in seeds:

                def edit(config, s=excluded, p=classes, seed=seed):
                    sampler = config["trainer"]["strategy"]["init_args"]["sampler"]
                    sampler["init_args"]["excluded"] = s
                    config["trainer"]["callbacks"][0] = {
                        "class_path": "lightning_fl.callbacks.FedAvg"
                    }
                    config["data"]["init_args"].update(
                        server_samples=0, shards_per_client=p, seed=seed
                    )
                    config["trainer"]["limit_val_batches"] = 0

                cli, _ = run_recipe(ROOT / "recipes" / "participation" / "safari.yaml", edit, seed)
                values.append(100 * float(cli.trainer.callback_metrics["test_acc"]))
            cells.append(f"{statistics.mean(values):.2f}")
        lines.append(f"| {excluded} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    out = ROOT / "benchmarks" / "results" / "safari_fedavg_grid.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--q", type=float, default=0.5)
    parser.add_argument("--grid", action="store_true", help="only FedAvg's p × s grid")
    parser.add_argument("--dataset", choices=list(RECIPES), default="digits")
    args = parser.parse_args()
    data = "digits" if args.dataset == "digits" else "Fashion-MNIST images"

    def acc(server: int, classes: int, q: float, seed: int) -> float:
        return accuracy(server, classes, q, seed, args.dataset)

    if args.grid:
        fedavg_grid(args.seeds)
        return
    torch.set_num_threads(1)
    lines = [
        f"SAFARI (q = {args.q}) minus FedAvg, test accuracy in points, {args.dataset}, s = 4, "
        f"mean over seeds {args.seeds}; `python benchmarks/safari.py --dataset {args.dataset} "
        f"--q {args.q}`. Paper (MNIST) in brackets; p = classes per client (shards of one "
        "class each).",
        "",
        f"| server {data} | " + " | ".join(f"p = {p}" for p in CLASSES) + " |",
        "|---|" + "---|" * len(CLASSES),
    ]
    fedavg_row = []
    for size in SIZES:
        cells = []
        for j, classes in enumerate(CLASSES):
            diffs, base = [], []
            for seed in args.seeds:
                fedavg = acc(size, classes, 1.0, seed)
                diffs.append(acc(size, classes, args.q, seed) - fedavg)
                base.append(fedavg)
            cells.append(f"{statistics.mean(diffs):+.2f} ({PAPER[size][j]})")
            if size == SIZES[-1]:
                fedavg_row.append(f"{statistics.mean(base):.2f}")
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += [
        "",
        f"FedAvg's own accuracy with 1000 server {data} held out: "
        + ", ".join(f"p = {p}: {a}" for p, a in zip(CLASSES, fedavg_row)),
        "",
    ]
    lines += [f"SAFARI against q (p = 1, 1000 server {data}, mean over seeds):", "",
              "| q | test accuracy |", "|---|---|"]  # fmt: skip
    for q in [1.0, 0.95, 0.9, 0.75, 0.5, 0.0]:
        mean = statistics.mean(acc(1000, 1, q, seed) for seed in args.seeds)
        lines.append(f"| {q} | {mean:.2f} |")
        print(lines[-1], flush=True)
    suffix = "" if args.dataset == "digits" else f"_{args.dataset}"
    out = ROOT / "benchmarks" / "results" / f"safari{suffix}_q{args.q}.md"
    write_keeping_reading(out, "\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
