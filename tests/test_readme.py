"""The README's Python snippets run as written (shortened to one round) and are seeded:
two runs print the same numbers."""

from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import pytest

ROOT = Path(__file__).resolve().parents[1]
REAL_TRAINER = pl.Trainer
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _run(code: str, tmp_path: Path, monkeypatch) -> dict:
    results: list = []

    class ShortTrainer(REAL_TRAINER):
        def __init__(self, *args, **kwargs):
            kwargs.update(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False)
            super().__init__(*args, **kwargs)

        def test(self, *args, **kwargs):
            kwargs["verbose"] = False
            results.append(super().test(*args, **kwargs))
            return results[-1]

    monkeypatch.setattr(pl, "Trainer", ShortTrainer)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    return {"namespace": namespace, "results": results}


def test_readme_has_the_snippets():
    assert len(SNIPPETS) == 5


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index, tmp_path, monkeypatch):
    out = _run(SNIPPETS[index], tmp_path, monkeypatch)
    if index == 0:  # seeded: the same numbers every time
        again = _run(SNIPPETS[index], tmp_path / "again", monkeypatch)
        assert out["results"] == again["results"] and out["results"][0][0]["test_acc"] > 0.1
    if index == 2:
        assert out["namespace"]["datamodule"].num_clients == 8


def test_the_systems_table_names_tests_and_recipes_that_exist():
    """Every `tests/...::name` and every recipe in the README's systems table exists."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Implemented systems") : text.index("## Data")]
    current_file = None
    checked = 0
    for cell in re.findall(r"`([^`]+)`", table):
        if cell.startswith("tests/"):
            path, _, name = cell.partition("::")
            current_file = ROOT / path
            assert current_file.exists(), cell
        elif cell.startswith("::") and current_file is not None:
            name = cell[2:]
        else:
            if cell.endswith(".yaml") and "*" not in cell and "{" not in cell:
                assert (ROOT / "recipes" / cell).exists(), cell
                checked += 1
            continue
        if name:
            assert f"def {name}(" in current_file.read_text(), cell
            checked += 1
    assert checked > 20
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    for row in rows:  # system | paper | recipe | test: a row split or merged by an edit
        cells = re.sub(r"`[^`]*`", "code", row).strip("|").split(" | ")
        assert len(cells) == 4, row[:120]
