"""FLamby benchmark: every recipe of recipes/flamby/ over 5 seeds.

    python benchmarks/flamby.py [--data ../shared/data] [--seeds 0 1 2 3 4] [--out FILE.md]

For each (dataset, strategy) it reports mean ± std over seeds of two numbers: the test
metric averaged uniformly over the clients' test sets, and the metric of the final global
model on the pooled test set (accuracy for Fed-Heart-Disease, C-index for Fed-TCGA-BRCA).
For Local the "global" model is the untouched initial one, so only the first column is
meaningful.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from lightning_fl.cli import run

ROOT = Path(__file__).resolve().parents[1]
DATASETS = {"heart": ("fed_heart_disease", "acc"), "tcga": ("fed_tcga_brca", "cindex")}
ORDER = ["fedavg", "fedprox", "scaffold", "fedadam", "fedyogi", "fedadagrad", "local", "pooled"]


def one_run(recipe: Path, data_root: Path, seed: int, workdir: str) -> tuple[float, float]:
    dataset, metric = DATASETS[recipe.stem.split("_")[0]]
    cli = run(
        ["fit", "--config", str(recipe), "--seed_everything", str(seed),
         "--trainer.strategy.init_args.seed", str(seed),
         "--data.init_args.root", str(data_root / dataset),
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--trainer.default_root_dir", workdir, "--trainer.logger.init_args.save_dir", workdir]
    )  # fmt: skip
    per_client = float(cli.trainer.callback_metrics[f"test_{metric}/uniform"])
    with torch.no_grad():
        _, pooled = cli.model.loss_and_metrics(cli.datamodule.pooled_dataset("test")[:])
    return per_client, float(pooled[metric])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "flamby.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        "| dataset | strategy | client-averaged test metric | pooled test metric |",
        "|---|---|---|---|",
    ]
    for prefix in args.datasets:
        for name in ORDER:
            recipe = ROOT / "recipes" / "flamby" / f"{prefix}_{name}.yaml"
            with tempfile.TemporaryDirectory() as workdir:
                results = [one_run(recipe, args.data, s, workdir) for s in args.seeds]
            cells = []
            for column in zip(*results):
                spread = statistics.stdev(column) if len(column) > 1 else 0.0
                cells.append(f"{statistics.mean(column):.4f} ± {spread:.4f}")
            lines.append(f"| {prefix} | {name} | {cells[0]} | {cells[1]} |")
            print(lines[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    header = f"FLamby benchmark, seeds {args.seeds} (mean ± std)\n\n"
    args.out.write_text(header + "\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
