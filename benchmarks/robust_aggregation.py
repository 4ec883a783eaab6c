"""Robust aggregators against Byzantine clients (issue 69): final test accuracy of each
aggregator with 0%, 10% and 20% attackers of each kind, beside FedAvg's, on digits and
Fashion-MNIST.

    python benchmarks/robust_aggregation.py [--datasets digits fashion_mnist] [--rounds 30]

20 clients (iid; 70% of each client's samples train, 30% test), full participation, one
local epoch of SGD (batch 16, lr 0.1) on an MLP with 32 hidden units, ``--rounds`` rounds.
Aggregators: FedAvg; coordinate-wise median and trimmed mean with β = 0.2 (Yin et al.
2018); Krum and Multi-Krum with f = 4 and 10 selected (Blanchard et al. 2017); centered
clipping with τ ∈ {1, 0.1} and one iteration (Karimireddy et al. 2021). Attacks: sign flipping
(−4Δ), scaled updates (10Δ) and Gaussian updates (σ = 1), from a fixed 10% (2) or 20% (4)
of the clients. Test accuracy is the sample-weighted mean over all clients, attackers
included (their test data is honest). Writes benchmarks/results/robust_aggregation.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from privacy_federations import DATASETS, federation, fit_and_test, machine, module

from lightning_fl.callbacks import (
    CenteredClipping,
    CoordinateMedian,
    FedAvg,
    GaussianUpdates,
    Krum,
    ScaledUpdates,
    SignFlipping,
    TrimmedMean,
)

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "robust_aggregation.md"
CLIENTS, LR = 20, 0.1
AGGREGATORS = {
    "FedAvg": FedAvg,
    "median": CoordinateMedian,
    "trimmed mean β=0.2": lambda: TrimmedMean(beta=0.2),
    "Krum f=4": lambda: Krum(num_byzantine=4),
    "Multi-Krum f=4, m=10": lambda: Krum(num_byzantine=4, num_selected=10),
    "centered clipping τ=1": lambda: CenteredClipping(tau=1.0),
    "centered clipping τ=0.1": lambda: CenteredClipping(tau=0.1),
}
ATTACKS = {
    "sign flip −4Δ": lambda f: SignFlipping(f, scale=4.0),
    "scaled 10Δ": lambda f: ScaledUpdates(f, scale=10.0),
    "Gaussian σ=1": lambda f: GaussianUpdates(f, std=1.0),
}
FRACTIONS = (0.1, 0.2)
#: A defence fails where its accuracy is this far below FedAvg's without attackers.
FAILURE_GAP = 0.1


def accuracy(dataset: str, aggregator, attack, rounds: int) -> float:
    callbacks = [aggregator()] + ([attack] if attack is not None else [])
    data = federation(dataset, CLIENTS, batch_size=16, split=(0.7, 0.0, 0.0, 0.3))
    metrics = fit_and_test(module(dataset, LR), data, callbacks, rounds, local_epochs=1,
                           vectorize=True)  # fmt: skip
    return metrics["test_acc"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    columns = ["none"] + [f"{a} {int(f * 100)}%" for a in ATTACKS for f in FRACTIONS]
    lines = [
        "# Robust aggregation against Byzantine clients",
        "",
        f"`python benchmarks/robust_aggregation.py --rounds {args.rounds}` on {machine()}. "
        f"{CLIENTS} clients (iid), full participation, one local epoch (batch 16, lr {LR}), "
        f"MLP 32 hidden units, {args.rounds} rounds; final test accuracy (sample-weighted "
        "over all clients). Attackers: a fixed 10% (2) or 20% (4) of the clients.",
        "",
    ]
    for dataset in args.datasets:
        lines += [f"## {dataset}", "", "| aggregator | " + " | ".join(columns) + " |",
                  "|---|" + "---|" * len(columns)]  # fmt: skip
        table = {}
        for name, aggregator in AGGREGATORS.items():
            cells = [accuracy(dataset, aggregator, None, args.rounds)]
            for make in ATTACKS.values():
                for fraction in FRACTIONS:
                    cells.append(accuracy(dataset, aggregator, make(fraction), args.rounds))
            table[name] = cells
            line = f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |"
            print(dataset, line, flush=True)
            lines.append(line)
        clean = table["FedAvg"][0]
        failures = [
            f"{name} under {column} ({cell:.3f})"
            for name, cells in table.items()
            for column, cell in zip(columns, cells)
            if cell < clean - FAILURE_GAP
        ]
        lines += ["", f"Fails (more than {FAILURE_GAP} below FedAvg without attackers, "
                  f"{clean:.3f}): " + ("; ".join(failures) or "none") + ".", ""]  # fmt: skip
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
