"""One source for every run time the README and the recipe headers quote (issue 38).

Each entry is measured as a user meets it: ``lightning-fl fit --config <recipe>`` in a fresh
process (imports and set-up included), a whole run, or, for protocols of hundreds or
thousands of rounds, the time of one round (the difference of two short runs, so that
start-up cancels out); ``setup`` is `make install` in a fresh folder. The figures, with the
machine that gave them, go to ``benchmarks/results/run_times.json``; ``--write`` then
renders the README's "Run times" table and every measured recipe's ``# Run time:`` header
line from that file, and tests/test_run_times.py checks that they agree with it.

    python benchmarks/run_times.py                 # measure every entry (about 15 minutes)
    python benchmarks/run_times.py --only quickstart combined/knn_per_sifu.yaml
    python benchmarks/run_times.py --setup          # also time `make install` (minutes)
    python benchmarks/run_times.py --write          # re-render from the JSON file alone
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "run_times.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- run times: benchmarks/run_times.py -->", "<!-- end of run times -->"
HEADER = "# Run time: "

#: recipe -> rounds of the two runs whose difference is a round's time (long protocols)
PER_ROUND = {
    "fashion_mnist/sifu.yaml": (20, 40),  # one check of the target (every 20 rounds) per 20
    "robustness/digits_sifu.yaml": (2, 12),
    "paper/fedavg_synthetic.yaml": (2, 7),
    "paper/local_synthetic.yaml": (2, 7),
    "paper/fedem_synthetic.yaml": (2, 7),
}


def whole_runs() -> list[str]:
    """The recipes measured as whole runs: the top-level ones, the cross-system ones, the
    digits personalization ones and the small paper variants."""
    recipes = ROOT / "recipes"
    names = [p.name for p in sorted(recipes.glob("*.yaml"))]
    patterns = ("combined/*.yaml", "personalization/digits_*.yaml", "paper/*_small.yaml",
                "population/*.yaml")  # fmt: skip
    for pattern in patterns:
        names += [p.relative_to(recipes).as_posix() for p in sorted(recipes.glob(pattern))]
    return [n for n in names if "2proc" not in n]


def timed_fit(recipe: str, *extra: str) -> float:
    """Seconds of ``lightning-fl fit --config recipes/<recipe> ...`` in a fresh process."""
    exe = Path(sys.executable).with_name("lightning-fl")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "lightning_fl.command"]
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        subprocess.run(
            [*command, "fit", "--config", str(ROOT / "recipes" / recipe),
             "--trainer.default_root_dir", folder, "--trainer.logger.init_args.save_dir", folder,
             "--trainer.enable_progress_bar", "false", *extra],
            cwd=folder, check=True, capture_output=True,
            env={**os.environ, "WANDB_MODE": "offline"},
        )  # fmt: skip
        return time.perf_counter() - start


def measure(recipe: str) -> dict:
    if recipe in PER_ROUND:
        low, high = PER_ROUND[recipe]
        seconds = [timed_fit(recipe, "--trainer.max_epochs", str(r), "--test_after_fit", "false")
                   for r in (low, high)]  # fmt: skip
        return {"seconds": round((seconds[1] - seconds[0]) / (high - low), 2), "per": "round"}
    return {"seconds": round(timed_fit(recipe), 1), "per": "run"}


def measure_setup() -> dict:
    """`make install` (the virtual environment, torch's CPU wheel, this package) in a fresh
    copy of the Makefile and pyproject, as on a fresh clone."""
    with tempfile.TemporaryDirectory() as folder:
        for name in ("Makefile", "pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, folder)
        for package in ("lightning_fl", "callbacks", "datamodules"):
            shutil.copytree(ROOT / package, Path(folder) / package)
        start = time.perf_counter()
        subprocess.run(["make", "install"], cwd=folder, check=True, capture_output=True)
        return {"seconds": round(time.perf_counter() - start), "per": "setup"}


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"{os.cpu_count()} cores of {model}, torch {torch.__version__}"


def say(entry: dict) -> str:
    """``12.3 s`` or ``about 4 min``, and what it measures."""
    seconds = entry["seconds"]
    amount = f"{seconds:g} s" if seconds < 100 else f"about {round(seconds / 60)} min"
    return {"run": f"{amount} for the whole run", "round": f"{amount} a round",
            "setup": f"{amount} to set up"}[entry["per"]]  # fmt: skip


def readme_block(data: dict) -> str:
    rows = [BEGIN, "", f"Measured on {data['machine']} ({data['date']}), one run at a time",
            "(`python benchmarks/run_times.py`; expect ±30% from load on a shared machine):", "",
            "| what | time |", "|---|---|"]  # fmt: skip
    for name, entry in data["runs"].items():
        what = "`make install` on a fresh clone" if name == "setup" else f"`{name}`"
        when = f" ({entry['date']})" if "date" in entry else ""  # measured alone, later
        rows.append(f"| {what} | {say(entry)}{when} |")
    return "\n".join([*rows, "", END])


def header_line(entry: dict, data: dict) -> str:
    return f"{HEADER}{say(entry)} on {data['machine']} (benchmarks/run_times.py)."


def write(data: dict) -> None:
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    README.write_text(text[:start] + readme_block(data) + text[end:])
    for name, entry in data["runs"].items():
        if name == "setup":
            continue
        path = ROOT / "recipes" / name
        lines = [ln for ln in path.read_text().splitlines() if not ln.startswith(HEADER)]
        at = next(i for i, ln in enumerate(lines) if not ln.startswith("#"))
        for i, line in enumerate(lines[:at]):  # before the header's command line, if any
            if re.match(r"#\s+lightning-fl ", line):
                at = i
                break
        lines.insert(at, header_line(entry, data))
        path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="measure these recipes only (and keep the rest)")
    parser.add_argument("--setup", action="store_true", help="also time `make install`")
    parser.add_argument("--write", action="store_true", help="only re-render from the JSON")
    args = parser.parse_args()
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": {}}
    if not args.write:
        names = args.only or ["quickstart.yaml", *PER_ROUND, *whole_runs()]
        today = time.strftime("%Y-%m-%d")
        data["machine"] = machine()
        if not args.only:  # a full run dates the table; --only keeps the others' date
            data["date"] = today
        for name in dict.fromkeys(names):
            data["runs"][name] = measure(name)
            if data.get("date") != today:  # --only: the table's date stays the others'
                data["runs"][name]["date"] = today
            print(f"{name}: {say(data['runs'][name])}", flush=True)
        if args.setup:
            data["runs"]["setup"] = measure_setup()
            print(f"setup: {say(data['runs']['setup'])}", flush=True)
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    write(data)


if __name__ == "__main__":
    main()
