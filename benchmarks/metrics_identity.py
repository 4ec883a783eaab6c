"""Byte-identity of metrics files across a refactor (issues 27 and 37).

A refactor of the engine must not move a single logged number. This script runs a fixed set
of recipes, one per family of the engine's paths (sequential, vectorized, stateful clients,
personalization, unlearning, asynchrony, privacy, gossip, streams, clustered sampling), for
three rounds each, and copies every run's ``metrics.csv`` into one folder; two folders from
before and after a change are then compared byte for byte.

    python benchmarks/metrics_identity.py /tmp/before    # on the commit before the change
    python benchmarks/metrics_identity.py /tmp/after     # on the change
    python benchmarks/metrics_identity.py --compare /tmp/before /tmp/after

Wall-clock columns would differ from run to run; no recipe here logs one (``fl/time`` is the
simulated clock, a function of the seed).
"""

from __future__ import annotations

import argparse
import filecmp
import glob
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RECIPES = [
    "quickstart.yaml",
    "quickstart_vectorized.yaml",
    "scaffold.yaml",
    "fedadam.yaml",
    "clustered_sampling_similarity.yaml",
    "personalization/digits_fedem.yaml",
    "personalization/digits_apfl.yaml",
    "robustness/digits_sifu.yaml",
    "asynchronous/digits_fedbuff.yaml",
    "privacy/tabular_dpsgd.yaml",
    "topology/digits_gaia_ring.yaml",
    "streams/digits_cache_rules.yaml",
    "combined/knn_per_sifu.yaml",
]


def record(folder: Path, rounds: int = 3) -> None:
    """Run every recipe for ``rounds`` rounds and copy its metrics.csv into ``folder``."""
    from lightning_fl.cli import run

    folder.mkdir(parents=True, exist_ok=True)
    for recipe in RECIPES:
        with tempfile.TemporaryDirectory() as workdir:
            run(["fit", "--config", str(ROOT / "recipes" / recipe),
                 "--trainer.max_epochs", str(rounds), "--trainer.enable_progress_bar", "false",
                 "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", workdir,
                 "--trainer.logger.init_args.save_dir", workdir])  # fmt: skip
            (metrics,) = glob.glob(f"{workdir}/**/metrics.csv", recursive=True)
            shutil.copy(metrics, folder / (recipe.replace("/", "__") + ".csv"))
        print(f"recorded {recipe}", flush=True)


def compare(before: Path, after: Path) -> int:
    """Print one line per recipe (identical or differs) and return the number that differ."""
    differ = 0
    for recipe in RECIPES:
        name = recipe.replace("/", "__") + ".csv"
        same = filecmp.cmp(before / name, after / name, shallow=False)
        differ += not same
        print(f"{'identical' if same else 'DIFFERS  '}  {recipe}")
    print(f"{len(RECIPES) - differ} of {len(RECIPES)} metrics files byte-identical")
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.compare:
        return min(compare(*args.folders), 1)
    record(args.folders[0], args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
