"""Free-rider attacks (Fraboni, Vidal, Lorenzi, AISTATS 2021; thesis ch. 6) on the embedded
digits, against the fair-only variability band.

    python benchmarks/free_riders.py [--inits 8] [--rounds 100] [--epochs 5]
    python benchmarks/free_riders.py --ninety [--inits 4]
    python benchmarks/free_riders.py --dataset fashion_mnist [--inits 5] [--algorithms fedavg]

--dataset fashion_mnist (issue 23): recipes/fashion_mnist/free_riders.yaml, the authors'
MNIST setting on Fashion-MNIST (5 fair clients of 600 training and 300 test images,
logistic regression, lr 1e-3, batch 100, E = 5) with their E = 5 budgets (get_n_iter: 200
rounds iid, 300 shards, ×2 with 5 free-riders, ×3 with 45). Writes
benchmarks/results/free_riders_fashion_mnist.md and .png.

--ninety (issue 26 item 6): 45 free-riders (90% of the declared samples) under the
thesis's E = 20 budgets (the authors' get_n_iter: 100 rounds iid, 150 shards, 3× with 45
free-riders), plain and disguised σ with γ ∈ {0.5, 1, 2}, FedAvg, against the fair-only
band at the same E; reports the round at which the fair clients' training loss first
enters the band, if it does. Writes benchmarks/results/free_riders_90.md.

recipes/robustness/digits_free_riders.yaml's setting (5 fair clients, logistic
regression, batch 100, lr 0.01) for iid and shards (4 label shards per client) splits,
FedAvg and FedProx (μ = 1): the fair-only run repeated over --inits initializations gives
the band (min–max of the final test accuracy and training loss); then 1, 5 and 45
free-riders (1/6, 50% and 90% of the declared samples), plain, disguised σ and 3σ
(γ = 1), each from the first initialization. Reports the final test accuracy and
federated training loss of the fair clients, whether the accuracy lies in the band, and
the detector's rates. Writes benchmarks/results/free_riders.md and free_riders.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from recipe_runs import run_recipe, write_keeping_reading

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "digits": ROOT / "recipes" / "robustness" / "digits_free_riders.yaml",
    "fashion_mnist": ROOT / "recipes" / "fashion_mnist" / "free_riders.yaml",
}
RESULTS = ROOT / "benchmarks" / "results"
ATTACKS = [("plain", 1.0), ("disguised", 1.0), ("disguised", 3.0)]
#: the authors' get_n_iter: 2× the rounds with 5 free-riders, 3× with 45
ROUND_FACTOR = {0: 1, 1: 1, 5: 2, 45: 3}


#: the authors' get_n_iter at E = 20 for MNIST: rounds without free-riders
THESIS_E20_ROUNDS = {"iid": 100, "shards": 150}
#: the authors' get_n_iter at E = 5 for MNIST: rounds without free-riders
THESIS_E5_ROUNDS = {"iid": 200, "shards": 300}


def fit(
    split: str, prox: bool, riders: int, mode: str, coef: float, init: int, args,
    gamma: float = 1.0, rounds: int | None = None,
) -> dict:  # fmt: skip
    def edit(config):
        trainer = config["trainer"]
        trainer["max_epochs"] = (rounds or args.rounds[split]) * ROUND_FACTOR[riders]
        trainer["strategy"]["init_args"]["local_epochs"] = args.epochs
        data = config["data"]["init_args"]
        data["partition"] = "shards" if split == "shards" else "iid"
        data["shards_per_client"] = 4
        callbacks = trainer["callbacks"]
        attack, detector = (next(c for c in callbacks if c["class_path"].endswith(name))
                            for name in (".FreeRiders", ".FreeRiderDetector"))  # fmt: skip
        attack["init_args"].update(num_free_riders=riders, mode=mode, coef=coef, gamma=gamma)
        if riders == 0:
            callbacks.remove(detector)
        if prox:
            callbacks.append({"class_path": "lightning_fl.callbacks.FedProx",
                              "init_args": {"mu": 1.0}})  # fmt: skip
        config["seed_everything"] = init  # the initialization; data and batches stay fixed

    cli, rows = run_recipe(RECIPES[args.dataset], edit)
    losses = [(int(r["epoch"]), float(r["fl/federated_loss"])) for r in rows
              if r.get("fl/federated_loss")]  # fmt: skip
    last = {k: float(v) for r in rows for k, v in r.items() if v}
    return {
        "acc": float(cli.trainer.callback_metrics["test_acc"]),
        "loss": losses[-1][1],
        "curve": losses,
        "detect": last.get("free_riders/detection_rate"),
        "false": last.get("free_riders/false_alarm_rate"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inits", type=int, default=8)
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds without free-riders (default: 100 on digits; the "
        "authors' 200 iid and 300 shards on fashion_mnist)",
    )
    parser.add_argument("--dataset", choices=sorted(RECIPES), default="digits")
    parser.add_argument(
        "--algorithms", nargs="+", choices=["fedavg", "fedprox"], default=["fedavg", "fedprox"]
    )
    parser.add_argument(
        "--attacks",
        nargs="+",
        choices=["plain", "disguised1", "disguised3"],
        default=["plain", "disguised1", "disguised3"],
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--ninety", action="store_true", help="issue 26 item 6 (see above)")
    parser.add_argument(
        "--budget-probe",
        action="store_true",
        help="fair-only runs of share × budget rounds (iid, initialization 0)",
    )
    args = parser.parse_args()
    fashion = args.dataset == "fashion_mnist"
    args.rounds = ({"iid": args.rounds, "shards": args.rounds} if args.rounds
                   else THESIS_E5_ROUNDS if fashion else {"iid": 100, "shards": 100})  # fmt: skip
    attacks = [a for a, key in zip(ATTACKS, ("plain", "disguised1", "disguised3"))
               if key in args.attacks]  # fmt: skip
    torch.set_num_threads(1)
    if args.budget_probe:
        budget_probe(args)
        return
    if args.ninety:
        ninety(args)
        return
    title = ("Fashion-MNIST (the authors' MNIST setting; the dataset differs)" if fashion
             else "digits")  # fmt: skip
    rounds = " and ".join(f"{r} rounds {split}" for split, r in args.rounds.items())
    lines = [f"# Free-riders on {title}: 5 fair clients, logistic regression",
             "", f"`python benchmarks/free_riders.py --dataset {args.dataset}`: E = "
             f"{args.epochs} local epochs, {rounds} (2× with 5 free-riders, 3× with 45, as "
             f"the authors' get_n_iter), fair-only band over {args.inits} initializations "
             "(min–max). Accuracy and loss are the fair clients' (test accuracy, "
             "federated training loss Σ p_j L_j). Detection: share of free-riders flagged / "
             "share of fair clients flagged in the last round.", "",
             "| split | algorithm | free-riders | attack | test acc | in band | train loss | "
             "detected / false alarms |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    curves = {}
    for split in ("iid", "shards"):
        for prox in [a == "fedprox" for a in args.algorithms]:
            name = "FedProx (μ = 1)" if prox else "FedAvg"
            band = [fit(split, prox, 0, "plain", 1.0, init, args) for init in range(args.inits)]
            low, high = min(r["acc"] for r in band), max(r["acc"] for r in band)
            loss_low, loss_high = min(r["loss"] for r in band), max(r["loss"] for r in band)
            lines.append(f"| {split} | {name} | 0 (band) | — | {low:.3f}–{high:.3f} | — | "
                         f"{loss_low:.3f}–{loss_high:.3f} | — |")  # fmt: skip
            print(lines[-1], flush=True)
            curves[(split, prox, 0, "band")] = band
            for riders in (1, 5, 45):
                for mode, coef in attacks:
                    run = fit(split, prox, riders, mode, coef, 0, args)
                    label = "plain" if mode == "plain" else f"disguised {coef:g}σ"
                    inside = "yes" if low - 1e-9 <= run["acc"] <= high + 1e-9 else "no"
                    lines.append(
                        f"| {split} | {name} | {riders} | {label} | {run['acc']:.3f} | {inside} "
                        f"| {run['loss']:.3f} | {run['detect']:.2f} / {run['false']:.2f} |"
                    )
                    print(lines[-1], flush=True)
                    curves[(split, prox, riders, label)] = [run]
    stem = "free_riders" if not fashion else "free_riders_fashion_mnist"
    _plot(curves, stem)
    lines += ["", f"![training loss of the fair clients]({stem}.png)", ""]
    text = write_keeping_reading(RESULTS / f"{stem}.md", "\n".join(lines) + "\n")
    print(text)


def budget_probe(args) -> None:
    """A plain free-rider returns the global model, so FedAvg's step is the fair clients'
    average update times their declared share: a run is worth (share × budget) fair-only
    rounds. Prints those fair-only runs beside the free-rider runs they should equal."""
    base = args.rounds["iid"]
    for label, riders, rounds, fair_rounds in (
        ("1 free-rider", 1, base, round(5 / 6 * base)),
        ("45 free-riders", 45, base, round(0.1 * 3 * base)),
    ):  # fmt: skip
        attacked = fit("iid", False, riders, "plain", 1.0, 0, args, rounds=rounds)
        fair = fit("iid", False, 0, "plain", 1.0, 0, args, rounds=fair_rounds)
        print(f"| {label}, {rounds * ROUND_FACTOR[riders]} rounds | {attacked['acc']:.3f} | "
              f"{attacked['loss']:.3f} |\n| fair only, {fair_rounds} rounds | {fair['acc']:.3f} "
              f"| {fair['loss']:.3f} |", flush=True)  # fmt: skip
    longer = fit("iid", False, 1, "plain", 1.0, 0, args, rounds=round(6 / 5 * base))
    print(f"| 1 free-rider, {round(6 / 5 * base)} rounds | {longer['acc']:.3f} | "
          f"{longer['loss']:.3f} |", flush=True)  # fmt: skip


def ninety(args) -> None:
    """45 free-riders under the thesis's E = 20 budgets (see the module docstring)."""
    args.epochs = 20
    lines = ["# Free-riders at 90% under the thesis's budgets (digits, 5 fair clients)", "",
             "`python benchmarks/free_riders.py --ninety`: E = 20 local epochs, FedAvg; "
             f"fair-only band over {args.inits} initializations at the authors' E = 20 "
             "budget (100 rounds iid, 150 shards); 45 free-riders (90% of the declared "
             "samples) over 3× that budget, plain and disguised σ·t^−γ. 'Enters the band': "
             "the first evaluated round (every 5) at which the fair clients' federated "
             "training loss is at most the band's highest final loss.", "",
             "| split | run | rounds | final test acc | acc in band | final train loss | "
             "enters the loss band at round |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for split in ("iid", "shards"):
        rounds = THESIS_E20_ROUNDS[split]
        band = [fit(split, False, 0, "plain", 1.0, i, args, rounds=rounds)
                for i in range(args.inits)]  # fmt: skip
        low, high = min(r["acc"] for r in band), max(r["acc"] for r in band)
        loss_low, loss_high = min(r["loss"] for r in band), max(r["loss"] for r in band)
        lines.append(f"| {split} | fair only (band) | {rounds} | {low:.3f}–{high:.3f} | — | "
                     f"{loss_low:.3f}–{loss_high:.3f} | — |")  # fmt: skip
        for mode, gamma in (("plain", 1.0), ("disguised", 0.5), ("disguised", 1.0),
                            ("disguised", 2.0)):  # fmt: skip
            run = fit(split, False, 45, mode, 1.0, 0, args, gamma=gamma, rounds=rounds)
            label = "45 plain" if mode == "plain" else f"45 disguised σ, γ = {gamma:g}"
            inside = "yes" if low - 1e-9 <= run["acc"] <= high + 1e-9 else "no"
            enters = next((k for k, v in run["curve"] if v <= loss_high), None)
            lines.append(
                f"| {split} | {label} | {3 * rounds} | {run['acc']:.3f} | {inside} | "
                f"{run['loss']:.3f} | {enters if enters is not None else 'never'} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    (RESULTS / "free_riders_90.md").write_text(text)
    print(text)


def _plot(curves: dict, stem: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, split in zip(axes, ("iid", "shards")):
        if (split, False, 0, "band") not in curves:
            continue
        band = curves[(split, False, 0, "band")]
        rounds = [k for k, _ in band[0]["curve"]]
        lows = [min(r["curve"][i][1] for r in band) for i in range(len(rounds))]
        highs = [max(r["curve"][i][1] for r in band) for i in range(len(rounds))]
        ax.fill_between(rounds, lows, highs, alpha=0.3, color="grey", label="fair only")
        for riders in (1, 5, 45):
            for label in ("plain", "disguised 1σ"):
                if (split, False, riders, label) not in curves:
                    continue
                (run,) = curves[(split, False, riders, label)]
                style = dict(ls="-" if label == "plain" else "--", label=f"{riders} {label}")
                ax.plot([k for k, _ in run["curve"]], [v for _, v in run["curve"]], **style)
        ax.set_title(f"FedAvg, {split}")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fair clients' training loss")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=110)


if __name__ == "__main__":
    main()
