"""Run one recipe over a grid of one setting and plot the results: the utility / privacy
trade-off curves of WERM (Kaplan et al., PETS 2024) over its weight w.

    lightning-fl-sweep --config recipes/privacy/tabular_werm_sweep.yaml

A sweep file names the base recipe, the setting and its values, and the metrics to plot::

    base: recipes/privacy/tabular_werm.yaml
    parameter: model.init_args.w
    values: [0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    metrics: [test_acc, mia/train/best, mia/reference/best]
    output: outputs/privacy/tabular_werm_sweep

It writes ``sweep.csv`` (one row per value) and ``tradeoff.png`` in ``output``.
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path
from typing import Any

import yaml

from lightning_fl.cli import run


def load_sweep(path: str | os.PathLike) -> dict[str, Any]:
    spec = yaml.safe_load(Path(path).read_text())
    missing = {"base", "parameter", "values", "metrics"} - set(spec or {})
    if missing:
        raise ValueError(f"{path}: a sweep needs {sorted(missing)} (see lightning_fl.sweep).")
    if not spec["values"]:
        raise ValueError(f"{path}: 'values' is empty; list the values of {spec['parameter']}.")
    return spec


def run_sweep(spec: dict[str, Any], extra: list[str] | None = None) -> list[dict[str, float]]:
    output = Path(spec.get("output", "outputs/sweep"))
    output.mkdir(parents=True, exist_ok=True)
    rows = []
    for value in spec["values"]:
        folder = output / f"{spec['parameter'].rsplit('.', 1)[-1]}={value}"
        cli = run(
            ["fit", "--config", str(spec["base"]), f"--{spec['parameter']}", str(value),
             "--trainer.default_root_dir", str(folder),
             "--trainer.logger.init_args.save_dir", str(folder), *(extra or [])]
        )  # fmt: skip
        metrics = cli.trainer.callback_metrics
        row = {"value": float(value)}
        for name in spec["metrics"]:
            if name not in metrics:
                raise KeyError(
                    f"The run with {spec['parameter']}={value} logged no {name!r}: choose "
                    f"'metrics' among {sorted(metrics)}."
                )
            row[name] = float(metrics[name])
        rows.append(row)
        print(row, flush=True)
    with open(output / "sweep.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_tradeoff(rows, spec, output / "tradeoff.png")
    return rows


def plot_tradeoff(rows: list[dict[str, float]], spec: dict[str, Any], path: Path) -> Path:
    """Left: every metric against the swept value. Right: utility (the first metric)
    against each privacy metric, the points labelled by the swept value."""
    from lightning_fl.plots import _pyplot, _save

    plt = _pyplot()
    name = spec["parameter"].rsplit(".", 1)[-1]
    utility, *privacy = spec["metrics"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    values = [r["value"] for r in rows]
    for metric in spec["metrics"]:
        left.plot(values, [r[metric] for r in rows], marker="o", label=metric)
    left.set_xlabel(name)
    left.legend()
    left.grid(alpha=0.3)
    for metric in privacy:
        xs, ys = [r[metric] for r in rows], [r[utility] for r in rows]
        right.plot(xs, ys, marker="o", label=metric)
        for x, y, v in zip(xs, ys, values):
            right.annotate(f"{v:g}", (x, y), fontsize=7)
    right.axvline(0.5, color="grey", linestyle=":", label="chance (0.5)")
    right.set_xlabel("membership-inference accuracy")
    right.set_ylabel(utility)
    right.legend()
    right.grid(alpha=0.3)
    fig.suptitle(f"{Path(spec['base']).stem}: trade-off over {name}")
    _save(plt, fig, str(path), dpi=120)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="the sweep YAML")
    args, extra = parser.parse_known_args(argv)
    run_sweep(load_sweep(args.config), extra)


if __name__ == "__main__":
    main()
