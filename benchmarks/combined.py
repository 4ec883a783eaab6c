"""Cross-system recipes (recipes/combined/, issue 24), each beside the runs that leave one
of its systems out, on the embedded digits; writes benchmarks/results/combined.md.

    python benchmarks/combined.py [--seeds 0 1 2]

No paper ran these combinations, so there is no published number to print beside ours:
the columns are the combination and its ablations, on the same data, seeds and budget.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_runs import callback_of, run_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "combined"


def _callbacks(config: dict) -> list[dict]:
    return config["trainer"]["callbacks"]


def _drop(name: str) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        config["trainer"]["callbacks"] = [
            c for c in _callbacks(config) if name not in c["class_path"]
        ]

    return edit


def _classifier(config: dict) -> None:
    """The mixture's network as a plain Classifier (FedEM's ablation: FedAvg)."""
    init = config["model"]["init_args"]
    config["model"] = {"class_path": "lightning_fl.Classifier",
                       "init_args": {"lr": init["lr"], "network": init["network"]}}  # fmt: skip
    _drop("FedEM")(config)


def _both(*edits: Callable[[dict], None]) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        for e in edits:
            e(config)

    return edit


def _selector(name: str) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        config["trainer"]["strategy"]["init_args"]["sampler"]["init_args"]["selector"] = name

    return edit


def _cache(rule: str) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        config["data"]["init_args"]["cache"] = rule

    return edit


def _no_request(config: dict) -> None:
    for c in _callbacks(config):
        if c["class_path"].endswith("Unlearning"):
            c["init_args"]["requests"] = {}


def _method(method: str) -> Callable[[dict], None]:
    def edit(config: dict) -> None:
        for c in _callbacks(config):
            if c["class_path"].endswith("Unlearning"):
                c["init_args"]["method"] = method

    return edit


def _metric(rows: list[dict], name: str) -> float | None:
    values = [float(r[name]) for r in rows if r.get(name) not in (None, "")]
    return values[-1] if values else None


def _seeded(recipe: str, edit: Callable[[dict], None], seeds: list[int], extra=()) -> dict:
    """Mean over seeds of test accuracy (weighted, p10) and the recipe's own metrics."""
    names = ["test_acc", "test_acc/p10", *extra]
    values: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    for seed in seeds:
        cli, rows = run_recipe(RECIPES / f"{recipe}.yaml", edit, seed=seed)
        for n in names:
            value = cli.trainer.callback_metrics.get(n)
            value = float(value) if value is not None else _metric(rows, n)
            if value is not None:
                values[n].append(value)
        if recipe == "knn_per_sifu" and "forgotten" in extra:
            unlearning = callback_of(cli, "Unlearning")
            values.setdefault("restart", []).append(
                unlearning.done_requests[0]["restart_round"] if unlearning.done_requests else -1
            )
    out = {n: statistics.mean(v) for n, v in values.items() if v}
    out["seconds"] = (time.perf_counter() - start) / len(seeds)
    return out


def _two_processes(seeds: list[int]) -> list[str]:
    """scaffold_similarity_2proc on 2 processes and on 1: the same model."""
    lines = []
    for seed in seeds:
        weights, accs, secs = {}, {}, {}
        for devices in ("2", "1"):
            with tempfile.TemporaryDirectory() as workdir:
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
                start = time.perf_counter()
                result = subprocess.run(
                    [sys.executable, "-m", "lightning_fl.cli", "fit", "--config",
                     str(RECIPES / "scaffold_similarity_2proc.yaml"), "--trainer.devices", devices,
                     "--seed_everything", str(seed), "--trainer.strategy.init_args.seed", str(seed),
                     "--data.init_args.seed", str(seed), "--trainer.enable_progress_bar", "false",
                     "--trainer.default_root_dir", workdir,
                     "--trainer.logger.init_args.save_dir", workdir],
                    env=env, capture_output=True, text=True, check=True,
                )  # fmt: skip
                secs[devices] = time.perf_counter() - start
                (ckpt,) = glob.glob(f"{workdir}/**/last.ckpt", recursive=True)
                weights[devices] = torch.load(ckpt, weights_only=True)["state_dict"]
                line = next(
                    x for x in result.stdout.splitlines() if x.strip().startswith("test_acc ")
                )
                accs[devices] = float(line.split()[-1])
        diff = max(float((weights["1"][k] - weights["2"][k]).abs().max()) for k in weights["1"])
        lines.append(f"| {seed} | {100 * accs['2']:.2f} | {100 * accs['1']:.2f} | {diff:.1e} | "
                     f"{secs['2']:.1f} | {secs['1']:.1f} |")  # fmt: skip
    return lines


def _row(label: str, result: dict, extra: list[str]) -> str:
    cells = [f"{100 * result['test_acc']:.2f}", f"{100 * result['test_acc/p10']:.2f}"]
    for name in extra:
        value = result.get(name)
        cells.append("–" if value is None else f"{value:.3g}")
    return f"| {label} | " + " | ".join(cells) + f" | {result['seconds']:.1f} |"


EXPERIMENTS = {
    "fedem_ca_fed": (
        "FedEM under CA-Fed availability (20 clients, π ∈ {0.9, 0.1}, λ ∈ {0.9, 0})",
        [("FedEM + CA-Fed (the recipe)", lambda c: None),
         ("FedEM + Unbiased (every available client)", _selector("unbiased")),
         ("FedAvg + CA-Fed", _classifier)],
        ["fl/excluded"],
    ),
    "knn_per_sifu": (
        "kNN-Per with a SIFU request (clients 0 and 1 forgotten at round 30)",
        [("kNN-Per + SIFU (the recipe)", lambda c: None),
         ("kNN-Per + SCRATCH", _method("scratch")),
         ("kNN-Per, no request", _no_request),
         ("SIFU without kNN-Per", _drop("KNNPer"))],
        ["unlearning/forgotten_acc"],
    ),
    "fedbuff_fedprox_dpsgd": (
        "FedBuff (c = 5, F80) with FedProx (μ = 0.1) and DP-SGD (σ = 0.8, C = 1)",
        [("FedBuff + FedProx + DP-SGD (the recipe)", lambda c: None),
         ("FedBuff + DP-SGD", _drop("FedProx")),
         ("FedBuff + FedProx", _drop("DPSGD")),
         ("FedBuff", _both(_drop("FedProx"), _drop("DPSGD")))],
        ["dp/epsilon", "fl/time"],
    ),
    "drsr_fedem": (
        "FedEM on drifting streams with DRSR caches (C = 20, B_s = 5)",
        [("FedEM + DRSR (the recipe)", lambda c: None),
         ("FedEM + FIFO", _cache("fifo")),
         ("FedAvg + DRSR", _classifier)],
        ["streams/accumulated_discrepancy"],
    ),
}  # fmt: skip


def _section(recipe: str, seeds: list[int]) -> list[str]:
    title, variants, extra = EXPERIMENTS[recipe]
    lines = [f"## {title}", "", f"`recipes/combined/{recipe}.yaml`", "",
             "| run | test_acc | p10 | " + " | ".join(extra) + " | s/run |",
             "|---|---|---|" + "---|" * len(extra) + "---|"]  # fmt: skip
    for label, edit in variants:
        lines.append(_row(label, _seeded(recipe, edit, seeds, extra), extra))
        print(lines[-1], flush=True)
    return lines + [""]


def _rerun(recipes: list[str], seeds: list[int], out: Path) -> None:
    """Replace the sections of ``recipes`` in ``out`` (the rest is kept)."""
    text = out.read_text()
    for recipe in recipes:
        title = f"## {EXPERIMENTS[recipe][0]}"
        start = text.index(title)
        end = text.index("\n## ", start + 1) + 1
        text = text[:start] + "\n".join(_section(recipe, seeds)) + "\n" + text[end:]
    out.write_text(text)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "combined.md"))
    parser.add_argument(
        "--only", nargs="+", choices=sorted(EXPERIMENTS),
        help="rerun these experiments and replace their sections in --out",
    )  # fmt: skip
    args = parser.parse_args()
    if args.only:
        _rerun(args.only, args.seeds, Path(args.out))
        return
    lines = ["# Cross-system recipes (recipes/combined/)", "",
             f"`python benchmarks/combined.py --seeds {' '.join(map(str, args.seeds))}`: the mean "
             f"over {len(args.seeds)} seeds (seed of the run, the strategy and the data split), "
             "on the embedded digits, 2-core CPU. Accuracies in %, test_acc is the "
             "sample-weighted mean over clients, p10 the 10th-percentile client. No paper "
             "ran these combinations: the rows leave one system out.", ""]  # fmt: skip
    for recipe in EXPERIMENTS:
        lines += _section(recipe, args.seeds)
    lines += ["## SCAFFOLD with similarity clustered sampling on 2 processes", "",
              "`recipes/combined/scaffold_similarity_2proc.yaml` (40 clients, 8 per round); "
              "max |Δθ| between the final models of 2 processes and 1.", "",
              "| seed | test_acc, 2 processes | test_acc, 1 process | max abs Δθ | s, 2 | s, 1 |",
              "|---|---|---|---|---|---|", *_two_processes(args.seeds), ""]  # fmt: skip
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
