"""FedEM's Table 2 on the synthetic mixture: Local, FedAvg and FedEM with the paper
recipes, beside the paper's numbers.

    python benchmarks/fedem_synthetic.py [--rounds 200] [--generator authors|corrected]

Runs recipes/paper/{local,fedavg,fedem}_synthetic.yaml (the authors' data and training
settings; ``--generator corrected`` swaps in the corrected generator) and prints the
test accuracy averaged over clients (every client has 5,000 test samples, so the
weighted and the uniform mean agree) and the bottom decile (the 10th-percentile client),
beside Table 2 of the FedEM paper (thesis Table 3.2). Writes
benchmarks/results/fedem_synthetic_<generator>.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from lightning_fl.cli import run

ROOT = Path(__file__).resolve().parents[1]
PAPER = {"local": (65.7, 58.4), "fedavg": (68.2, 58.9), "fedem": (74.7, 66.7)}
NOTES = """
Notes:
- The authors' own code, run on the same data with the same settings, gives FedEM 76.07,
  FedAvg 69.34 and Local 66.09 (as measured and reported in the issue that asked for
  this benchmark, issue 17); the published table is about 1.3 points below that code
  for FedEM and FedAvg alike.
- Bottom decile: ours is the 10th percentile of the 300 clients' accuracies on their own
  5,000 test samples. The paper does not say how its bottom decile was computed; its
  FedAvg figure (58.9) is 5.7 points below ours, its FedEM (66.7) and Local (58.4) figures
  within 2 points.
- The 'corrected' generator labels every sample by its own component (no forced zeros):
  a different, easier task whose numbers are not comparable with the paper's.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--generator", choices=["authors", "corrected"], default="authors")
    parser.add_argument("--methods", nargs="+", default=list(PAPER), choices=list(PAPER))
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = [
        "| method | ours: average | paper: average | ours: bottom decile "
        "| paper: bottom decile | time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for method in args.methods:
        recipe = ROOT / "recipes" / "paper" / f"{method}_synthetic.yaml"
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as workdir:
            cli = run(
                ["fit", "--config", str(recipe), "--trainer.max_epochs", str(args.rounds),
                 "--data.init_args.generator", args.generator,
                 "--trainer.enable_progress_bar", "false",
                 "--trainer.default_root_dir", workdir,
                 "--trainer.logger.init_args.save_dir", workdir]
            )  # fmt: skip
        seconds = time.perf_counter() - start
        metrics = cli.trainer.callback_metrics
        average, p10 = (
            100 * float(metrics["test_acc/uniform"]),
            100 * float(metrics["test_acc/p10"]),
        )
        lines.append(
            f"| {method} | {average:.2f} | {PAPER[method][0]} | {p10:.2f} | {PAPER[method][1]} "
            f"| {seconds:.0f} |"
        )
        print(lines[-1], flush=True)
    header = (
        f"FedEM paper, Table 2 (synthetic mixture), {args.rounds} rounds, generator "
        f"'{args.generator}'; `python benchmarks/fedem_synthetic.py --rounds {args.rounds} "
        f"--generator {args.generator}`. Test accuracy (%) averaged over the 300 clients "
        "and the bottom decile (10th-percentile client).\n\n"
    )
    out = ROOT / "benchmarks" / "results" / f"fedem_synthetic_{args.generator}.md"
    out.write_text(header + "\n".join(lines) + "\n" + NOTES)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
