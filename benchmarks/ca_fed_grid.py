"""CA-Fed against AdaFed with (η, η̄) tuned per selector on the thesis's grid (issue 26
item 2; Marfoq thesis §2.2.6.1, App. D.7, Fig. 2.11, 2.14, 2.15), on LEAF
Synthetic(0.5, 0.5) with recipes/participation/synthetic_ca_fed.yaml's setting.

    python benchmarks/ca_fed_grid.py [--part grid seeds estimators spatial] [--seeds 1 2 3 4]

- ``grid``: every (η, η̄) of the grid for each selector on seed 0, chosen by the final
  validation accuracy (20% of each client's training data, as the thesis does on MNIST).
  The thesis's Synthetic grid is η ∈ {2, 1, 0.3, 0.1, 0.03, 0.01} × η̄ ∈ {8, …, 1}; here
  η ≥ 0.03 for both selectors (η = 0.03 was added when AdaFed's best cell lay on the
  η = 0.1 edge); η = 0.01 is left out (2 cores).
- ``seeds``: the selectors at their tuned rates over ``--seeds`` (test accuracy).
- ``estimators``: CA-Fed with Beta-prior estimates of (π, λ) after t′ rounds of history
  (Fig. 2.14; the thesis: MNIST, T = 50; here Synthetic, T = 200), against oracle CA-Fed.
- ``normalized``: issue 40's probe. CA-Fed's kept weights α_k/π_k go to the server
  unnormalized, in the authors' code (arodio/CA-Fed ``clients_sampler.py``) and here, so
  the server step Σ_{kept} q_k swings with the number of available clients; AdaFed
  rescales them to sum to 1. CA-Fed with ``normalize_weights=True``: at CA-Fed's tuned
  rates, then tuned itself on the grid's η ≤ 0.3 rows on seed 0, each over ``--seeds``,
  beside CA-Fed and AdaFed rerun at their tuned rates with the same code (part
  ``probe-seeds``: the rows above predate the one-randperm-per-pass shuffle of commit
  94804d9, which changed every run's batch order).
- ``spatial``: 10 clusters of 10 clients, one chain per cluster, clusters 0–4 π = 0.9,
  λ = 0, clusters 5–9 π = 0.1, λ = c/10 (Fig. 2.15; the thesis: MNIST, T = 100; here
  Synthetic, T = 200), each selector at its tuned rates.

Clients are trained under vmap (``vectorize=True``, equal to the sequential path to float
round-off; 25% faster here). Every run is appended to benchmarks/results/ca_fed_grid.jsonl
(a rerun skips the runs it holds); benchmarks/results/ca_fed_grid.md is rewritten from it
after each part.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from participation import ROOT, TABLE_4, run
from recipe_runs import write_keeping_reading

RESULTS = ROOT / "benchmarks" / "results"
JOURNAL = RESULTS / "ca_fed_grid.jsonl"
DATA = str(ROOT / "outputs" / "data" / "synthetic_0.5_0.5")
ROUNDS = 200
SELECTORS = ("ca_fed", "adafed", "unbiased")
LOCAL_RATES = (2.0, 1.0, 0.3, 0.1, 0.03)
SERVER_RATES = (8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0)
HISTORIES = (10, 100, 1000, 10000)
NORMALIZED_LOCAL_RATES = (0.3, 0.1, 0.03)  # the rows around both selectors' tuned cells
PAPER = {"ca_fed - adafed": 1.56, "spatial": 0.6}  # points, Fig. 2.11 and 2.15


def spatial_availability() -> dict:
    return {
        "class_path": "lightning_fl.MarkovAvailability",
        "init_args": {
            "pi": [0.9] * 5 + [0.1] * 5,
            "lam": [0.0] * 5 + [c / 10 for c in range(5, 10)],
            "clusters": [k // 10 for k in range(100)],
        },
    }


def journal() -> list[dict]:
    if not JOURNAL.exists():
        return []
    return [json.loads(line) for line in JOURNAL.read_text().splitlines() if line.strip()]


def measured(part: str, selector: str, seed: int, rates, extra=None) -> dict:
    key = {"part": part, "selector": selector, "seed": seed, "rates": list(rates),
           "extra": extra}  # fmt: skip
    for row in journal():
        if all(row.get(k) == v for k, v in key.items()):
            return row
    sampler_args = {}
    if part == "spatial":
        sampler_args["availability"] = spatial_availability()
    if part == "estimators" and extra is not None:
        sampler_args.update(estimate=True, history=extra)
    if part.startswith("normalized"):
        sampler_args["normalize_weights"] = True
    result = run(
        selector, seed, ROUNDS, DATA, rates=tuple(rates), sampler_args=sampler_args, vectorize=True
    )
    row = {**key, **result}
    with JOURNAL.open("a") as out:
        out.write(json.dumps(row) + "\n")
    print(row, flush=True)
    return row


def tuned(selector: str, part: str = "grid") -> tuple[float, float]:
    """The ``part`` cell with the best final validation accuracy on seed 0 (Table 4's rates
    until the grid has run)."""
    cells = [r for r in journal() if r["part"] == part and r["selector"] == selector]
    if not cells:
        return TABLE_4[selector]
    return tuple(max(cells, key=lambda r: r["validation"])["rates"])


def mean(rows: list[dict], field: str) -> float:
    return statistics.mean(r[field] for r in rows)


def report() -> str:
    rows = journal()
    lines = [
        "# CA-Fed against AdaFed, (η, η̄) tuned per selector (issue 26 item 2)", "",
        f"`python benchmarks/ca_fed_grid.py` (see its docstring): LEAF Synthetic(0.5, 0.5), "
        f"100 clients, {ROUNDS} rounds, 2 local steps, oracle π and λ unless said, κ̄² = 1.",
        "",
    ]  # fmt: skip
    grid = [r for r in rows if r["part"] == "grid"]
    if grid:
        lines += ["## The grid (seed 0, final validation accuracy)", ""]
        for selector in SELECTORS:
            cells = {tuple(r["rates"]): r["validation"] for r in grid if r["selector"] == selector}
            if not cells:
                continue
            best = max(cells, key=cells.get)
            lines += [f"**{selector}** (best η = {best[0]:g}, η̄ = {best[1]:g}; Table 4: "
                      f"{TABLE_4[selector][0]:g} / {TABLE_4[selector][1]:g})", "",
                      "| η \\ η̄ | " + " | ".join(f"{s:g}" for s in SERVER_RATES) + " |",
                      "|---|" + "---|" * len(SERVER_RATES)]  # fmt: skip
            for lr in LOCAL_RATES:
                values = [cells.get((lr, s)) for s in SERVER_RATES]
                if all(v is None for v in values):
                    continue
                lines.append(f"| {lr:g} | " + " | ".join(
                    "" if v is None else (f"**{v:.4f}**" if (lr, s) == best else f"{v:.4f}")
                    for v, s in zip(values, SERVER_RATES)) + " |")  # fmt: skip
            lines.append("")
    seeds = [r for r in rows if r["part"] == "seeds"]
    if seeds:
        lines += ["## Tuned rates over seeds (test accuracy)", "",
                  "| selector | η / η̄ | seeds | final acc (mean ± sd) | time-averaged val acc "
                  "| clients per round |", "|---|---|---|---|---|---|"]  # fmt: skip
        finals = {}
        for selector in SELECTORS:
            rates = list(tuned(selector))
            mine = [r for r in seeds if r["selector"] == selector and r["rates"] == rates]
            if not mine:
                continue
            values = [r["final"] for r in mine]
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            finals[selector] = statistics.mean(values)
            lr, server = mine[0]["rates"]
            lines.append(f"| {selector} | {lr:g} / {server:g} | {len(mine)} | "
                         f"{finals[selector]:.4f} ± {sd:.4f} | {mean(mine, 'average'):.4f} | "
                         f"{mean(mine, 'clients'):.1f} |")  # fmt: skip
        if "ca_fed" in finals and "adafed" in finals:
            gap = 100 * (finals["ca_fed"] - finals["adafed"])
            lines += ["", f"CA-Fed minus AdaFed: **{gap:+.2f} points** (the thesis, Fig. 2.11: "
                      f"{PAPER['ca_fed - adafed']:+.2f} on Synthetic, 10 runs).", ""]  # fmt: skip
    estimators = [r for r in rows if r["part"] == "estimators"]
    if estimators:
        lines += ["## Estimated π and λ after t′ rounds of history (CA-Fed, tuned rates)", "",
                  "| t′ | seeds | final acc | clients per round |",
                  "|---|---|---|---|"]  # fmt: skip
        rates = list(tuned("ca_fed"))
        for history in sorted({r["extra"] for r in estimators}, key=lambda h: h or 0):
            mine = [r for r in estimators if r["extra"] == history and r["rates"] == rates]
            if not mine:
                continue
            label = "oracle" if history is None else f"{history}"
            lines.append(f"| {label} | {len(mine)} | {mean(mine, 'final'):.4f} | "
                         f"{mean(mine, 'clients'):.1f} |")  # fmt: skip
        lines.append("")
    normalized = [r for r in rows if r["part"].startswith("normalized")]
    if normalized:
        lines += _normalized_report(rows)
    spatial = [r for r in rows if r["part"] == "spatial"]
    if spatial:
        lines += [
            "## Spatially correlated availability (10 clusters, tuned rates)",
            "",
            "| selector | seeds | final acc | clients per round |",
            "|---|---|---|---|",
        ]
        for selector in SELECTORS:
            rates = list(tuned(selector))
            mine = [r for r in spatial if r["selector"] == selector and r["rates"] == rates]
            if mine:
                lines.append(f"| {selector} | {len(mine)} | {mean(mine, 'final'):.4f} | "
                             f"{mean(mine, 'clients'):.1f} |")  # fmt: skip
        lines += ["", f"The thesis (Fig. 2.15, MNIST): CA-Fed {PAPER['spatial']:+.1f} points "
                  "over AdaFed.", ""]  # fmt: skip
    return "\n".join(lines) + "\n"


def _normalized_report(rows: list[dict]) -> list[str]:
    lines = ["## Probe: CA-Fed with its kept weights normalized per round (issue 40)", "",
             "| CA-Fed weights | η / η̄ | seeds | final acc (mean ± sd) | time-averaged val acc "
             "| clients per round |", "|---|---|---|---|---|---|"]  # fmt: skip
    variants = [("AdaFed (for reference)", "probe-seeds", tuned("adafed")),
                ("α/π, as the authors' code", "probe-seeds", tuned("ca_fed")),
                ("normalized, at CA-Fed's tuned rates", "normalized-seeds", tuned("ca_fed")),
                ("normalized, tuned on its own grid", "normalized-seeds",
                 tuned("ca_fed", "normalized-grid"))]  # fmt: skip
    for label, part, rates in variants:
        selector = "adafed" if label.startswith("AdaFed") else "ca_fed"
        mine = [r for r in rows if r["part"] == part and r["selector"] == selector
                and r["rates"] == list(rates)]  # fmt: skip
        if not mine:
            continue
        values = [r["final"] for r in mine]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        lines.append(f"| {label} | {rates[0]:g} / {rates[1]:g} | {len(mine)} | "
                     f"{statistics.mean(values):.4f} ± {sd:.4f} | {mean(mine, 'average'):.4f} | "
                     f"{mean(mine, 'clients'):.1f} |")  # fmt: skip
    grid = {tuple(r["rates"]): r["validation"] for r in rows if r["part"] == "normalized-grid"}
    if grid:
        lines += ["", "Normalized CA-Fed's grid (seed 0, final validation accuracy):", "",
                  "| η \\ η̄ | " + " | ".join(f"{s:g}" for s in SERVER_RATES) + " |",
                  "|---|" + "---|" * len(SERVER_RATES)]  # fmt: skip
        for lr in LOCAL_RATES:
            values = [grid.get((lr, s)) for s in SERVER_RATES]
            if any(v is not None for v in values):
                lines.append(f"| {lr:g} | " + " | ".join(
                    "" if v is None else f"{v:.4f}" for v in values) + " |")  # fmt: skip
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", default=["grid", "seeds", "estimators", "spatial"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--selectors", nargs="+", default=list(SELECTORS))
    parser.add_argument("--local-rates", type=float, nargs="+", default=list(LOCAL_RATES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    for part in args.part:
        for selector in args.selectors:
            if part == "grid":
                for lr in args.local_rates:
                    for server in SERVER_RATES:
                        measured("grid", selector, 0, (lr, server))
            elif part == "seeds":
                for seed in [0, *args.seeds]:
                    measured("seeds", selector, seed, tuned(selector))
            elif part == "spatial":
                for seed in args.seeds[:2]:
                    measured("spatial", selector, seed, tuned(selector))
        if part == "normalized":
            for seed in [0, *args.seeds]:
                for selector in ("ca_fed", "adafed"):
                    measured("probe-seeds", selector, seed, tuned(selector))
            for seed in [0, *args.seeds]:
                measured("normalized-seeds", "ca_fed", seed, tuned("ca_fed"))
            for lr in NORMALIZED_LOCAL_RATES:
                for server in SERVER_RATES:
                    measured("normalized-grid", "ca_fed", 0, (lr, server))
            for seed in [0, *args.seeds]:
                rates = tuned("ca_fed", "normalized-grid")
                measured("normalized-seeds", "ca_fed", seed, rates)
        if part == "estimators":
            for seed in args.seeds[:2]:
                for history in (None, *HISTORIES):
                    measured("estimators", "ca_fed", seed, tuned("ca_fed"), history)
        write_keeping_reading(RESULTS / "ca_fed_grid.md", report())
    print(report())


if __name__ == "__main__":
    main()
