"""Issue 40's probe: is SIFU's divergence after the second request of Fashion-MNIST seed 1
the draw of its restart noise, or the restart model itself?

SIFU restarts retraining from a model of its lineage plus N(0, σ²) noise on every
parameter (Fraboni et al. AISTATS 2024, Alg. 1; thesis §5.4, eq. 5.21; σ = 0.1, Tab. D.1).
Seed 1's run diverged within five rounds of its second restart (issue 40). From the fit
saved at the end of that seed's first retraining (the second request pending; made once
under outputs/unlearning/), the second request is applied again with other noise draws
(``Unlearning``'s seed, which draws only the restart noise: the training's seeds are
unchanged) and without noise, and each is followed for ``--rounds`` rounds: the largest
mean training loss of the sampled clients in a round, their mean training accuracy over
the last 5 rounds (on their local batches, one class each), and the remaining clients'
training accuracy at the phase's first check (round 20). Writes
benchmarks/results/sifu_restart_probe.md.

    python benchmarks/sifu_restart_probe.py [--seed 1] [--draws 101 ... 112] [--rounds 21]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import unlearning as protocol
from recipe_runs import run_recipe, write_keeping_reading

from lightning_fl.callbacks import Unlearning

TARGET, SIGMA = 0.9, 0.1  # App. D.4's stopping accuracy, Tab. D.1's σ for Fashion-MNIST
CHECK = "unlearning/remaining_train_acc"  # the protocol's check: every 20 rounds of a phase


def checkpoint_before_second_request(seed: int, edit) -> Path:
    """The fit at the end of the first retraining, made once from the shared training."""
    path = protocol.SHARED / f"probe-{protocol.recipe_hash()}-seed{seed}-before-w2.ckpt"
    if not path.exists():
        shared = protocol.shared_training(seed, TARGET, SIGMA, edit)
        stop = {"class_path": "recipe_runs.PhaseCheckpoint",
                "init_args": {"path": str(path), "phases": 2}}  # fmt: skip
        run_recipe(protocol.RECIPE, lambda c: edit(c, "sifu", [stop]), seed,
                   ["--ckpt_path", str(shared)])  # fmt: skip
    return path


def restart(seed: int, draw: int | None, rounds: int, checkpoint: Path, edit) -> list[dict]:
    """The second request applied with the noise of ``draw`` (None: no noise), then
    ``rounds`` rounds; the metrics rows of those rounds."""
    first = torch.load(checkpoint, weights_only=True, map_location="cpu")["epoch"] + 1

    def edit_draw(config):
        edit(config, "sifu")
        config["trainer"]["max_epochs"] = first + rounds
        unlearning = next(c for c in config["trainer"]["callbacks"]
                          if c["class_path"].endswith(".Unlearning"))  # fmt: skip
        unlearning["init_args"]["seed"] = seed if draw is None else draw

    noise = Unlearning._noise
    if draw is None:
        Unlearning._noise = lambda self, std, round_idx, like: torch.zeros_like(like)
    try:
        _, rows = run_recipe(protocol.RECIPE, edit_draw, seed, ["--ckpt_path", str(checkpoint)])
    finally:
        Unlearning._noise = noise
    return [r for r in rows if int(r["epoch"]) >= first]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--draws", type=int, nargs="+", default=list(range(101, 113)))
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    protocol.use_dataset("fashion_mnist")
    torch.set_num_threads(1)
    edit = protocol.recipe_edit("sifu", args.seed, TARGET, SIGMA)
    checkpoint = checkpoint_before_second_request(args.seed, edit)
    lines = [
        "# SIFU's second restart on Fashion-MNIST: noise draws",
        "",
        f"`python benchmarks/sifu_restart_probe.py --seed {args.seed}`: from seed "
        f"{args.seed}'s fit at the end of its first retraining, the second request (class 1) "
        f"is applied with other draws of the restart noise N(0, {SIGMA}²) and without it, "
        f"then {args.rounds} rounds. Diverged: a round's mean training loss above 10 "
        "(0.2 without noise).",
        "",
        "| noise draw | largest round loss | local train acc, last 5 rounds | remaining-client "
        "acc at the phase's check of round 20 | diverged |",
        "|---|---|---|---|---|",
    ]
    for draw in [args.seed, *args.draws, None]:
        rows = restart(args.seed, draw, args.rounds, checkpoint, edit)
        losses = [float(r["train_loss_epoch"]) for r in rows if r.get("train_loss_epoch")]
        accuracies = [float(r["train_acc_epoch"]) for r in rows if r.get("train_acc_epoch")]
        checks = [float(r[CHECK]) for r in rows if r.get(CHECK)]
        remaining = f"{checks[-1]:.3f}" if checks else "no check"
        name = "none (σ = 0)" if draw is None else f"seed {draw}"
        name += " (the run's)" if draw == args.seed else ""
        lines.append(f"| {name} | {max(losses):.3g} | {statistics.mean(accuracies[-5:]):.3f} | "
                     f"{remaining} | {'yes' if max(losses) > 10 else 'no'} |")  # fmt: skip
        print(lines[-1], flush=True)
    out = protocol.RESULTS / "sifu_restart_probe.md"
    write_keeping_reading(out, "\n".join(lines))
    print(f"Wrote {out}")


if __name__ == "__main__":
    main()
