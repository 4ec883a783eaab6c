"""Personalization on CPU: every recipe of recipes/personalization/ for one dataset, with
the papers' protocol (sample-weighted mean over clients, bottom decile, unseen clients).

    python benchmarks/personalization.py --dataset digits [--methods fedavg fedem ...]

Writes benchmarks/results/personalization_<dataset>.md (the table), the per-client test
accuracy distributions (FedAvg against the personalized methods) as
personalization_<dataset>_clients.png, and kNN-Per's λ_t against the local dataset size as
personalization_<dataset>_lambda.png.
"""

from __future__ import annotations

import argparse
import glob
import shutil
import sys
import tempfile
import time
from pathlib import Path

from lightning_fl.cli import run
from lightning_fl.plots import plot_client_distributions, plot_lambda_vs_size, read_client_metrics

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
METHODS = ["fedavg", "local", "fedavg_plus", "fedem", "d_fedem", "knn_per", "ditto", "apfl",
           "fedrep", "clustered", "pfedme"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", default="digits", choices=["digits", "synthetic"])
    parser.add_argument("--methods", nargs="+", default=METHODS)
    args = parser.parse_args()
    command = " ".join(sys.argv)
    sys.argv = sys.argv[:1]  # the runs take their arguments from the recipes only
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows, distributions = [], {}
    work = Path(tempfile.mkdtemp(prefix="personalization-"))
    for method in args.methods:
        recipe = ROOT / "recipes" / "personalization" / f"{args.dataset}_{method}.yaml"
        if not recipe.exists():
            print(f"skip {method}: no {recipe.name}")
            continue
        out = work / method
        start = time.perf_counter()
        cli = run(
            ["fit", "--config", str(recipe), "--trainer.default_root_dir", str(out),
             "--trainer.logger.init_args.save_dir", str(out),
             "--trainer.enable_progress_bar", "false"]
        )  # fmt: skip
        seconds = time.perf_counter() - start
        m = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
        row = (method, m["test_acc/weighted"], m["test_acc/p10"],
               m.get("test_acc/unseen/weighted", float("nan")), seconds)  # fmt: skip
        rows.append(row)
        print("| {} | {:.4f} | {:.4f} | {:.4f} | {:.1f} |".format(*row), flush=True)
        (clients_csv,) = glob.glob(str(out / "**/client_metrics.csv"), recursive=True)
        seen = cli.datamodule.seen_clients()
        distributions[method] = read_client_metrics(clients_csv, "test_acc", clients=seen)
        lambdas = glob.glob(str(out / "**/knn_per_lambdas.csv"), recursive=True)
        if lambdas:
            plot_lambda_vs_size(
                lambdas[0], str(RESULTS / f"personalization_{args.dataset}_lambda.png")
            )
            shutil.copy(lambdas[0], RESULTS / f"personalization_{args.dataset}_lambda.csv")
    plot_client_distributions(
        distributions, str(RESULTS / f"personalization_{args.dataset}_clients.png")
    )
    with open(RESULTS / f"personalization_{args.dataset}.md", "w") as handle:
        handle.write(f"# Personalization on {args.dataset} (`{command}`)\n\n")
        handle.write("Test accuracy of the seen clients (sample-weighted mean, 10th percentile) ")
        handle.write("and of the unseen (held-out) clients; wall time of fit + test.\n\n")
        handle.write(
            "| method | weighted | p10 | unseen weighted | seconds |\n|---|---:|---:|---:|---:|\n"
        )
        for row in rows:
            handle.write("| {} | {:.4f} | {:.4f} | {:.4f} | {:.1f} |\n".format(*row))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
