"""Every run time the README and the recipe headers quote comes from one measured file,
benchmarks/results/run_times.json, with the machine that gave it (issue 38): they cannot
disagree."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("run_times", ROOT / "benchmarks/run_times.py")
run_times = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(run_times)
DATA = json.loads(run_times.RESULTS.read_text())
#: a time claim: a number and a unit of time
CLAIM = re.compile(r"\b\d+(\.\d+)?\s?(s|sec|seconds|min|minutes|hours?)\b")


def test_the_readme_table_is_rendered_from_the_measurements():
    readme = run_times.README.read_text()
    assert run_times.readme_block(DATA) in readme, (
        "re-render: python benchmarks/run_times.py --write"
    )
    assert DATA["machine"] and DATA["date"] and "quickstart.yaml" in DATA["runs"]
    assert "setup" in DATA["runs"]


def test_every_measured_recipe_quotes_its_time_in_its_header():
    for name, entry in DATA["runs"].items():
        if name == "setup":
            continue
        header = [
            ln for ln in (ROOT / "recipes" / name).read_text().splitlines() if ln.startswith("#")
        ]
        quoted = [ln for ln in header if ln.startswith(run_times.HEADER)]
        assert quoted == [run_times.header_line(entry, DATA)], name


def test_no_recipe_header_quotes_a_time_of_its_own():
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        for line in path.read_text().splitlines():
            if line.startswith("#") and not line.startswith(run_times.HEADER):
                assert not CLAIM.search(line), f"{path.relative_to(ROOT)}: {line}"


def test_the_readme_quotes_no_run_time_outside_the_table():
    """The quickstart lines and the Recipes section point to the table instead."""
    readme = run_times.README.read_text()
    start, end = readme.index(run_times.BEGIN), readme.index(run_times.END)
    outside = readme[:start] + readme[end:]
    recipes = outside[outside.index("## Recipes") : outside.index("## Implemented systems")]
    top = outside[: outside.index("## A Trainer script")]
    for text in (top, recipes):
        found = [m.group(0) for m in CLAIM.finditer(text)]
        assert not found, found


def test_the_phrasing_of_a_time():
    assert run_times.say({"seconds": 17.8, "per": "run"}) == "17.8 s for the whole run"
    assert run_times.say({"seconds": 0.52, "per": "round"}) == "0.52 s a round"
    assert run_times.say({"seconds": 281, "per": "setup"}) == "about 5 min to set up"


def test_a_recipe_measured_alone_carries_its_own_date(tmp_path, monkeypatch):
    """`run_times.py --only X` re-measures X and stamps X with today's date: the table's
    date stays that of the others, which were not measured again; a full run dates the
    whole table and no entry."""
    results = tmp_path / "run_times.json"
    runs = {"a.yaml": {"seconds": 1.0, "per": "run"}, "b.yaml": {"seconds": 2.0, "per": "run"}}
    results.write_text(json.dumps({"machine": "m", "date": "2026-01-01", "runs": runs}))
    written = []
    monkeypatch.setattr(run_times, "RESULTS", results)
    monkeypatch.setattr(run_times, "write", written.append)
    monkeypatch.setattr(run_times, "measure", lambda name: {"seconds": 3.0, "per": "round"})
    monkeypatch.setattr(run_times.time, "strftime", lambda fmt: "2026-02-02")
    monkeypatch.setattr(run_times, "whole_runs", lambda: ["a.yaml"])
    monkeypatch.setattr(run_times, "PER_ROUND", {"b.yaml": (1, 2)})
    monkeypatch.setattr("sys.argv", ["run_times.py", "--only", "b.yaml"])
    run_times.main()
    alone = written[-1]
    assert alone["date"] == "2026-01-01" and alone["runs"]["a.yaml"] == {
        "seconds": 1.0,
        "per": "run",
    }
    assert alone["runs"]["b.yaml"] == {"seconds": 3.0, "per": "round", "date": "2026-02-02"}
    assert "| `b.yaml` | 3 s a round (2026-02-02) |" in run_times.readme_block(alone)
    assert "| `a.yaml` | 1 s for the whole run |" in run_times.readme_block(alone)
    monkeypatch.setattr("sys.argv", ["run_times.py"])
    run_times.main()
    whole = json.loads(results.read_text())
    assert whole["date"] == "2026-02-02"
    assert all("date" not in entry for entry in whole["runs"].values())
