"""Topology design (Marfoq, Xu, Neglia, Vidal, NeurIPS 2020; thesis §2.1): the cycle-time
tables, side by side with the paper's, and DPASGD trained over each overlay against
rounds and simulated wall-clock time.

    python benchmarks/topology.py [--seeds 0 1 2] [--rounds 60] [--target 0.85]

1. Tables 2.5 (sub-iNaturalist, ResNet-18: 44,961,717 bits as the authors' code counts
   it, 25.4 ms per step, 10 Gbps access links), its s = 5 and s = 10 appendix tables, and
   Table 2.6 (iNaturalist, ResNet-50: 161.06 Mbit, 946.7 ms per step, 1 Gbps access), for
   the five networks; core links 1 Gbps. These need no training: they are the simulator's
   output. Also the time to build every overlay of Ebone (87 silos) on one core.
2. recipes/topology/digits_gaia_{star,mst,delta_mbst,ring}.yaml for each seed: rounds and
   simulated time until the validation accuracy first reaches --target, and the curves.

Writes benchmarks/results/topology.md and topology_training.png.
"""

from __future__ import annotations

import argparse
import csv
import glob
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lightning_fl.systems.topology import (
    NETWORKS,
    DelayModel,
    SiloNetwork,
    build_overlay,
    matcha_cycle_time,
)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OVERLAYS = ("star", "mst", "delta_mbst", "ring")
LABELS = {"star": "STAR", "mst": "MST", "delta_mbst": "δ-MBST", "ring": "RING"}
NAMES = {"gaia": "Gaia", "amazon_us": "AWS NA", "geantdistance": "Géant",
         "exodus": "Exodus", "ebone": "Ebone"}  # fmt: skip

# (title, model bits, ms per step, local steps, access bit/s, paper rows:
#  STAR, MATCHA, MATCHA⁺, MST, δ-MBST, RING)
TABLES = [
    ("Table 2.5: sub-iNaturalist, ResNet-18, access 10 Gbps, s = 1", 44961717, 25.4, 1, 1e10, {
        "gaia": (391, 228, 228, 138, 138, 118), "amazon_us": (288, 124, 124, 90, 90, 81),
        "geantdistance": (634, 452, 106, 101, 101, 109), "exodus": (912, 593, 142, 145, 145, 103),
        "ebone": (902, 580, 123, 122, 122, 95)}),
    ("App. Table 1: sub-iNaturalist, s = 5", 44961717, 25.4, 5, 1e10, {
        "gaia": (492.4, 329.3, 329.3, 239.7, 239.8, 219.7),
        "amazon_us": (389.8, 226.0, 226.0, 191.3, 191.3, 182.9),
        "geantdistance": (736.0, 553.8, 207.4, 202.6, 202.6, 210.6),
        "exodus": (1013.4, 695.0, 243.8, 246.9, 246.9, 205.5),
        "ebone": (1003.2, 681.6, 224.9, 223.2, 223.2, 196.9)}),
    ("App. Table 2: sub-iNaturalist, s = 10", 44961717, 25.4, 10, 1e10, {
        "gaia": (619.4, 456.4, 456.4, 366.7, 366.7, 346.7),
        "amazon_us": (516.8, 353.2, 353.2, 318.3, 318.3, 309.9),
        "geantdistance": (609.0, 680.8, 334.7, 329.6, 329.6, 337.6),
        "exodus": (1140.4, 822.0, 370.9, 373.9, 373.9, 332.5),
        "ebone": (1130.2, 808.6, 352.1, 350.4, 350.4, 323.9)}),
    ("Table 2.6: iNaturalist, ResNet-50, access 1 Gbps, s = 1", 161.06e6, 946.7, 1, 1e9, {
        "gaia": (4444, 2721, 2721, 1498, 1363, 1156),
        "amazon_us": (7785, 4384, 4384, 1441, 1297, 1119),
        "geantdistance": (13585, 4912, 1894, 1944, 1464, 1196),
        "exodus": (26258, 6180, 1825, 2078, 1481, 1194),
        "ebone": (28753, 8045, 1933, 2448, 1481, 1178)}),
]  # fmt: skip

# MATCHA and MATCHA⁺ from the authors' code (graph_utils.utils.get_matcha_cycle_time of
# github.com/omarfoq/communication-in-cross-silo-fl, on each table's setting; networkx 2.5,
# cvxpy 1.5.4 with its default solver, numpy 1.26). Their function divides the sum of
# 1000 rounds by 999; these are its printed values.
AUTHORS_CODE = {
    "Table 2.5": {"gaia": (227.82, 227.82), "amazon_us": (124.03, 124.03),
                  "geantdistance": (452.68, 107.91), "exodus": (593.12, 145.67),
                  "ebone": (579.93, 122.47)},
    "App. Table 1": {"gaia": (329.52, 329.52), "amazon_us": (225.73, 225.73),
                     "geantdistance": (554.38, 209.61), "exodus": (694.82, 247.37),
                     "ebone": (681.63, 224.17)},
    "App. Table 2": {"gaia": (456.65, 456.65), "amazon_us": (352.86, 352.86),
                     "geantdistance": (681.51, 336.74), "exodus": (821.95, 374.5),
                     "ebone": (808.76, 351.3)},
    "Table 2.6": {"gaia": (2004.21, 2004.21), "amazon_us": (2765.64, 2765.64),
                  "geantdistance": (4217.99, 1762.85), "exodus": (7493.18, 2009.63),
                  "ebone": (8044.9, 1932.85)},
}  # fmt: skip


def cycle_time_tables() -> list[str]:
    lines = []
    for title, bits, compute, steps, access, paper in TABLES:
        model = DelayModel(bits, compute, steps)
        code = AUTHORS_CODE.get(title.split(":")[0], {})
        lines += [f"### {title}", "",
                  "Cycle time in ms, ours (paper); MATCHA and MATCHA⁺ as ours (authors' "
                  "code; paper), with C_b = 0.5, Misra–Gries matchings and the SDP's "
                  "activation probabilities (eq. 5), over 1000 rounds; MATCHA⁺ draws its "
                  "matchings from the underlay's links. The authors' code divides by 999 "
                  "rounds: ours × 1.001 is its value.", "",
                  "| network | silos | STAR | MATCHA | MATCHA⁺ | MST | δ-MBST | RING |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name in NETWORKS:
            network = SiloNetwork.from_underlay(name, access_bps=access)
            star, mst, mbst, ring = (
                build_overlay(o, network, model).cycle_time(network, model) for o in OVERLAYS
            )
            matcha = matcha_cycle_time(network, model)
            matcha_plus = matcha_cycle_time(network, model, base="underlay")
            ours = (star, matcha, matcha_plus, mst, mbst, ring)
            cells = [f"{o:.1f} ({p})" for o, p in zip(ours, paper[name])]
            for k, ref in zip((1, 2), code.get(name, ("–", "–"))):
                cells[k] = f"{ours[k]:.1f} ({ref}; {paper[name][k]})"
            lines.append(f"| {NAMES[name]} | {network.num_silos} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


NOTES = """Where the numbers differ from the paper's:
- **STAR, MST, RING**: within 0.6 ms everywhere (rounding of the paper's integers), except
  RING on Exodus (104.5 vs 103 ms at s = 1) and Géant at s = 5 (208.3 vs 210.6): Christofides
  tours differ with the tie-breaking of the minimum matching.
- **MST on Exodus**: many silo pairs have equal delays (zero-distance links). Kruskal's
  tie-breaking (networkx's default, the authors' code) gives the paper's 2078 ms in Table
  2.6; Prim's gives another minimum tree with a degree-9 silo (2410 ms). We use Kruskal.
- **δ-MBST** on Gaia and AWS NA in Table 2.6 is 3-5 ms *below* the paper (1360 vs 1363,
  1292 vs 1297): our Algorithm 3 candidate "Hamiltonian path of the MST cube" is a true
  path of T³ (Sekanina's construction), which wins there; the authors' code calls
  networkx's tournament `hamiltonian_path`, valid only on tournaments. Their δ = 2 Prim
  tree gives exactly the paper's 1363 and 1297.
- **Géant, s = 10, STAR**: the paper's 609.0 ms is below its own s = 5 value (736.0). STAR's
  round has one computation, so s = 10 adds 5 × 25.4 = 127 ms to the s = 5 value:
  736.0 + 127 = 863.0, which is ours. We read the paper's value as a typo.
- **MATCHA**: the SDP of MATCHA's eq. 5 (cvxpy) on Misra–Gries's Δ + 1 matchings, both
  built in the order the authors' code builds its graphs, and numpy's seed-0 Bernoulli
  draws: every one of the 40 cells is within 0.05% of the authors' code once their
  division by 999 rounds is undone (ours × 1000/999; 35 within 0.02%, the rest on
  Exodus's complete G_c, where the SDP solvers' last digits differ), well inside the 1%
  asked. At 10 Gbps (Table 2.5 and the appendix tables) that is also the paper's value
  within 0.5%, except MATCHA⁺ on Géant and Exodus, where the paper's 106 and 142 ms are
  below the authors' own code (107.9, 145.7). At 1 Gbps (Table 2.6) the paper's MATCHA
  cells are what the code gives for Ebone only (8045 and 1933 ms). Gaia's and AWS NA's
  2721 and 4384 ms are the time of a round with *every* matching active (2718.8 and
  4379.7 ms, i.e. C_b = 1), and Géant's and Exodus's fit no single budget (the probe
  below). We read Table 2.6's MATCHA cells as made by runs the repository does not keep.
  The uniform p = C_b (``probabilities="uniform"``, no cvxpy) gives 2039.9 ms on Gaia.
  MATCHA⁺ is drawn from the underlay's links as the thesis describes (the authors' code
  labels the two the other way round).
"""


def budget_probe() -> list[str]:
    """Table 2.6's MATCHA and MATCHA⁺ against the budget C_b: which budget gives the
    paper's cells."""
    model = DelayModel(161.06e6, 946.7)
    paper = dict(TABLES[-1][-1])
    budgets = (0.25, 0.5, 0.75, 1.0)
    lines = ["Probe: Table 2.6's MATCHA / MATCHA⁺ (ms) against the budget C_b, ours, with the "
             "paper's cell last.", "",
             "| network | " + " | ".join(f"C_b = {b:g}" for b in budgets) + " | paper |",
             "|---|" + "---|" * (len(budgets) + 1)]  # fmt: skip
    for name in NETWORKS:
        network = SiloNetwork.from_underlay(name, access_bps=1e9)
        cells = [
            f"{matcha_cycle_time(network, model, budget=b):.0f} / "
            f"{matcha_cycle_time(network, model, budget=b, base='underlay'):.0f}"
            for b in budgets
        ]
        lines.append(f"| {NAMES[name]} | " + " | ".join(cells)
                     + f" | {paper[name][1]} / {paper[name][2]} |")  # fmt: skip
    return [*lines, ""]


def build_time_ebone() -> float:
    torch.set_num_threads(1)
    start = time.perf_counter()
    network = SiloNetwork.from_underlay("ebone")
    model = DelayModel(44961717, 25.4)
    for overlay in OVERLAYS:
        build_overlay(overlay, network, model).cycle_time(network, model)
    return time.perf_counter() - start


def train(overlay: str, seed: int, rounds: int) -> list[tuple[int, float, float]]:
    """(round, fl/time in ms, val_acc) for each round of one recipe run."""
    from lightning_fl.cli import run

    recipe = ROOT / "recipes" / "topology" / f"digits_gaia_{overlay}.yaml"
    with tempfile.TemporaryDirectory() as workdir:
        run(["fit", "--config", str(recipe), "--seed_everything", str(seed),
             "--trainer.strategy.init_args.seed", str(seed), "--data.init_args.seed", str(seed),
             "--trainer.max_epochs", str(rounds), "--test_after_fit", "false",
             "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
             "--trainer.default_root_dir", workdir,
             "--trainer.logger.init_args.save_dir", workdir])  # fmt: skip
        (path,) = glob.glob(f"{workdir}/**/metrics.csv", recursive=True)
        rows = list(csv.DictReader(open(path)))
    times = {int(r["epoch"]): float(r["fl/time"]) for r in rows if r.get("fl/time")}
    accs = {int(r["epoch"]): float(r["val_acc"]) for r in rows if r.get("val_acc")}
    return [(k, times[k], accs[k]) for k in sorted(times) if k in accs]


def first_reaching(curve: list[tuple[int, float, float]], target: float) -> tuple[float, float]:
    for k, t, acc in curve:
        if acc >= target:
            return k + 1, t
    return float("nan"), float("nan")


def training(seeds: list[int], rounds: int, target: float) -> list[str]:
    curves = {o: [train(o, s, rounds) for s in seeds] for o in OVERLAYS}
    lines = [
        f"### DPASGD on digits over the Gaia silos (11 clients, Dirichlet 0.5, 5 local steps, "
        f"4.6 ms per step, 10 Gbps access), seeds {seeds}", "",
        f"Rounds and simulated time until the validation accuracy first reaches {target}; "
        "mean over seeds. `python benchmarks/topology.py`.", "",
        "| overlay | cycle time (ms) | rounds to target | time to target (s) | "
        f"final val acc (round {rounds}) |",
        "|---|---|---|---|---|",
    ]  # fmt: skip
    for overlay in OVERLAYS:
        reached = [first_reaching(c, target) for c in curves[overlay]]
        k = statistics.mean(r[0] for r in reached)
        t = statistics.mean(r[1] for r in reached) / 1e3
        final = statistics.mean(c[-1][2] for c in curves[overlay])
        per_round = curves[overlay][0][-1][1] / rounds
        lines.append(f"| {LABELS[overlay]} | {per_round:.1f} | {k:.1f} | {t:.2f} | {final:.3f} |")
    _plot(curves, target)
    return lines + ["", "![accuracy against rounds and simulated time](topology_training.png)"]


def _plot(curves: dict, target: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (by_round, by_time) = plt.subplots(1, 2, figsize=(10, 3.8))
    for overlay, runs in curves.items():
        run0 = runs[0]
        style = dict(label=LABELS[overlay], ls="--" if overlay == "mst" else "-")
        by_round.plot([k + 1 for k, _, _ in run0], [a for _, _, a in run0], **style)
        by_time.plot([t / 1e3 for _, t, _ in run0], [a for _, _, a in run0], **style)
    for ax, xlabel in ((by_round, "round"), (by_time, "simulated time (s)")):
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation accuracy")
        ax.grid(alpha=0.3)
    by_time.legend()
    fig.suptitle("DPASGD over Gaia overlays (digits, first seed)")
    fig.tight_layout()
    fig.savefig(RESULTS / "topology_training.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args()
    lines = ["# Topology design: cycle times and training against simulated time", ""]
    lines += cycle_time_tables()
    lines += [NOTES]
    lines += budget_probe()
    lines += [f"Building all overlays of Ebone (87 silos) and their cycle times on one core: "
              f"{build_time_ebone():.2f} s.", ""]  # fmt: skip
    if not args.skip_training:
        lines += training(args.seeds, args.rounds, args.target)
    text = "\n".join(lines) + "\n"
    (RESULTS / "topology.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
