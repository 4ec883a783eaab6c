"""FEM-OMD for classifiers (Marfoq thesis §4.4.5.2, Alg. 17) against FedOMD on a digits
stream with 4 class subsets as the mixture components.

    python benchmarks/fem_omd_digits.py [--rounds 1000] [--seeds 0 1 2]

The thesis's MNIST protocol scaled to the embedded digits: the 10 classes split into m = 4
subsets ({0,1,2}, {3,4,5}, {6,7}, {8,9}: the thesis does not say which), C = 10 clients,
each round π*_{t,c} ~ Dir(0.1), n = 6 training samples ~ Multinomial(n, π*) from the
subsets' training pool and n' = 1 test sample from their test pool (75/25 split of the
1,797 images; draws with replacement, since the pool is smaller than T·C·n), a two-layer
fully connected network (64-64-10). Metric (eq. 4.47): R'_{T,c} = Σ_t [Acc(h*, S'_{t,c}) −
Acc(h_{t,c}, S'_{t,c})], h* trained on the whole training pool; the average over clients
R̄'_T / T is printed, and the curves (smoothed with discount 0.7, as Fig. 4.10) are
plotted. FEM-OMD: K = 1, η_ω = 0.05, η_π = sqrt(log m / T) (the theory's rate with G = 1);
also without line 12's running average (ablation). FedOMD: one local step, lr 0.05,
λ = 1e-4. Writes benchmarks/results/fem_omd_digits.md and .png.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lightning_fl import MLP
from lightning_fl.datamodules.digits import load_digits
from lightning_fl.plots import plot_curves
from lightning_fl.systems.fem_omd import FedOMD, FemOmdClassifier

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
SUBSETS = ((0, 1, 2), (3, 4, 5), (6, 7), (8, 9))
CLIENTS, N_TRAIN, N_TEST = 10, 6, 1


def make_network() -> torch.nn.Module:
    return MLP(64, (64,), 10)


def pools(seed: int):
    x, y = load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    cut = int(0.75 * len(y))
    train, test = order[:cut], order[cut:]
    by_subset = {
        split: [idx[np.isin(y[idx], subset)] for subset in SUBSETS]
        for split, idx in (("train", train), ("test", test))
    }
    return torch.from_numpy(x), torch.from_numpy(y), by_subset


def optimum(x, y, train_idx, seed: int) -> torch.nn.Module:
    """h*: the same network trained on the whole training pool (full batch, Adam)."""
    torch.manual_seed(seed)
    net = make_network()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    for _ in range(300):
        optimizer.zero_grad()
        F.cross_entropy(net(x[train_idx]), y[train_idx]).backward()
        optimizer.step()
    return net


def draw(rng, weights, count, pool_by_subset):
    counts = rng.multinomial(count, weights)
    return np.concatenate(
        [rng.choice(pool, size=k, replace=True) for pool, k in zip(pool_by_subset, counts) if k]
    )


def run(rounds: int, seed: int) -> dict[str, np.ndarray]:
    x, y, by_subset = pools(seed)
    train_idx = np.concatenate(by_subset["train"])
    best = optimum(x, y, train_idx, seed)
    m = len(SUBSETS)
    weight_lr = math.sqrt(math.log(m) / rounds)
    algorithms = {
        "FEM-OMD": FemOmdClassifier(make_network, m, CLIENTS, 0.05, weight_lr, seed=seed),
        "FEM-OMD, no running average": FemOmdClassifier(
            make_network, m, CLIENTS, 0.05, weight_lr, seed=seed, running_average=False
        ),
        "FedOMD": FedOMD(make_network, lr=0.05, l2=1e-4, seed=seed),
    }  # fmt: skip
    rng = np.random.default_rng(seed + 100)
    regret = {name: np.zeros((rounds, CLIENTS)) for name in algorithms}
    for t in range(rounds):
        truth = rng.dirichlet(np.full(m, 0.1), size=CLIENTS)
        train = [draw(rng, truth[c], N_TRAIN, by_subset["train"]) for c in range(CLIENTS)]
        test = [draw(rng, truth[c], N_TEST, by_subset["test"]) for c in range(CLIENTS)]
        with torch.no_grad():
            best_acc = [float((best(x[i]).argmax(1) == y[i]).float().mean()) for i in test]
        for name, alg in algorithms.items():
            for c in range(CLIENTS):  # play, then receive
                acc = float(
                    (alg.predict_proba(c, x[test[c]]).argmax(1) == y[test[c]]).float().mean()
                )
                regret[name][t, c] = best_acc[c] - acc
            alg.step([(x[i], y[i]) for i in train])
    return {name: np.cumsum(r, axis=0).mean(axis=1) for name, r in regret.items()}


def smoothed(values: np.ndarray, discount: float = 0.7) -> np.ndarray:
    out, running = np.empty_like(values), values[0]
    for i, v in enumerate(values):
        running = discount * running + (1 - discount) * v
        out[i] = running
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    runs = [run(args.rounds, seed) for seed in args.seeds]
    names = list(runs[0])
    mean = {name: np.mean([r[name] for r in runs], axis=0) for name in names}
    checkpoints = [t for t in (10, 100, 300, 1000, 3000) if t <= args.rounds]
    lines = [
        "# FEM-OMD for classifiers against FedOMD on a digits stream (Alg. 17)", "",
        f"`python benchmarks/fem_omd_digits.py --rounds {args.rounds} --seeds "
        f"{' '.join(map(str, args.seeds))}`: m = 4 class subsets, C = {CLIENTS}, "
        f"n = {N_TRAIN}, n' = {N_TEST}, π* ~ Dir(0.1) each round (see the script's "
        "docstring). Average regret R̄'_T / T in accuracy (h* minus the played model), mean "
        f"over {len(args.seeds)} seeds; lower is better, and a curve falling towards 0 is "
        "the sub-linear regime.", "",
        "| algorithm | " + " | ".join(f"T = {t}" for t in checkpoints) + " |",
        "|---|" + "---|" * len(checkpoints),
    ]  # fmt: skip
    for name in names:
        row = " | ".join(f"{mean[name][t - 1] / t:.3f}" for t in checkpoints)
        lines.append(f"| {name} | {row} |")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fem_omd_digits.md").write_text(text)
    print(text)
    curves = {name: smoothed(mean[name]) for name in names}
    path = str(RESULTS / "fem_omd_digits.png")
    plot_curves({"": curves}, path, "time step t", "average regret R̄'_t (accuracy)")


if __name__ == "__main__":
    main()
