"""The sweep's figure and command line in process (``lightning_fl/sweep.py``): the
trade-off figure by value, and ``main`` from a sweep file to its rows, with a stand-in for
the runs (test_cli_and_logging runs the real WERM sweep)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_fl import sweep
from tests.helpers import line_data

ROWS = [
    {"value": 0.5, "test_acc": 0.9, "mia/train/best": 0.7, "mia/reference/best": 0.6},
    {"value": 0.75, "test_acc": 0.8, "mia/train/best": 0.6, "mia/reference/best": 0.55},
    {"value": 1.0, "test_acc": 0.7, "mia/train/best": 0.52, "mia/reference/best": 0.5},
]
SPEC = {
    "base": "recipes/privacy/tabular_werm.yaml",
    "parameter": "model.init_args.w",
    "values": [0.5, 0.75, 1.0],
    "metrics": ["test_acc", "mia/train/best", "mia/reference/best"],
}


def test_the_tradeoff_figure_by_hand(tmp_path, drawn):
    """Left: every metric against w; right: the utility (the first metric) against each
    privacy metric, each point labelled with its w, and chance (0.5) marked."""
    path = sweep.plot_tradeoff(ROWS, SPEC, tmp_path / "new" / "tradeoff.png")
    assert path == tmp_path / "new" / "tradeoff.png" and path.exists()
    fig, dpi = drawn["tradeoff.png"], drawn["tradeoff.png:dpi"]
    left, right = fig.axes
    w = [0.5, 0.75, 1.0]
    assert line_data(left) == {
        "test_acc": (w, [0.9, 0.8, 0.7]),
        "mia/train/best": (w, [0.7, 0.6, 0.52]),
        "mia/reference/best": (w, [0.6, 0.55, 0.5]),
    }
    assert [line.get_marker() for line in left.get_lines()] == ["o"] * 3
    assert left.get_xlabel() == "w"
    assert [t.get_text() for t in left.get_legend().get_texts()] == SPEC["metrics"]
    assert all(g.get_visible() for g in left.get_xgridlines())
    assert left.get_xgridlines()[0].get_alpha() == 0.3
    lines = line_data(right)
    assert lines["mia/train/best"] == ([0.7, 0.6, 0.52], [0.9, 0.8, 0.7])
    assert lines["mia/reference/best"] == ([0.6, 0.55, 0.5], [0.9, 0.8, 0.7])
    chance = right.get_lines()[-1]
    assert chance.get_label() == "chance (0.5)" and list(chance.get_xdata()) == [0.5, 0.5]
    assert (chance.get_color(), chance.get_linestyle()) == ("grey", ":")
    notes = [(t.get_text(), tuple(t.xy), t.get_fontsize()) for t in right.texts]
    assert notes == [
        ("0.5", (0.7, 0.9), 7),
        ("0.75", (0.6, 0.8), 7),
        ("1", (0.52, 0.7), 7),
        ("0.5", (0.6, 0.9), 7),
        ("0.75", (0.55, 0.8), 7),
        ("1", (0.5, 0.7), 7),
    ]
    assert (right.get_xlabel(), right.get_ylabel()) == ("membership-inference accuracy", "test_acc")
    assert [t.get_text() for t in right.get_legend().get_texts()] == [
        "mia/train/best",
        "mia/reference/best",
        "chance (0.5)",
    ]
    assert all(g.get_visible() for g in right.get_xgridlines())
    assert fig._suptitle.get_text() == "tabular_werm: trade-off over w"
    assert tuple(fig.get_size_inches()) == (10, 4) and dpi == 120


def _stand_in(calls: list) -> object:
    """A stand-in for ``lightning_fl.cli.run``: records its arguments and "logs"
    test_acc = 1 − w/2 and mia/best = 0.5 + w/10 (float32, as metrics are)."""

    def run(args):
        calls.append(args)
        w = float(args[args.index("--model.init_args.w") + 1])
        logged = {"test_acc": torch.tensor(1.0 - w / 2), "mia/best": torch.tensor(0.5 + w / 10)}
        return SimpleNamespace(trainer=SimpleNamespace(callback_metrics=logged))

    return run


def test_a_sweep_runs_each_value_in_its_own_folder_and_writes_what_they_logged(
    tmp_path, monkeypatch, capsys
):
    """A stand-in for the runs: each value's arguments (its folder, the setting, the extra
    options last) and the metrics it logged reach sweep.csv row by row; a metric no run
    logged, a sweep file without its keys and one without values are refused by name."""
    import csv as csv_module

    calls = []
    monkeypatch.setattr(sweep, "run", _stand_in(calls))
    output = tmp_path / "a" / "sweep"  # created with its parents
    spec = {"base": "recipes/x.yaml", "parameter": "model.init_args.w", "values": [0.2, 0.8],
            "metrics": ["test_acc", "mia/best"], "output": str(output)}  # fmt: skip
    rows = sweep.run_sweep(spec, ["--trainer.max_epochs", "2"])
    assert rows == [
        {"value": 0.2, "test_acc": pytest.approx(0.9), "mia/best": pytest.approx(0.52)},
        {"value": 0.8, "test_acc": pytest.approx(0.6), "mia/best": pytest.approx(0.58)},
    ]
    printed = capsys.readouterr().out.splitlines()  # each value's row as it ends
    assert [line.split(",")[0] for line in printed] == ["{'value': 0.2", "{'value': 0.8"]
    folder = str(output / "w=0.8")
    assert calls[1] == ["fit", "--config", "recipes/x.yaml", "--model.init_args.w", "0.8",
                        "--trainer.default_root_dir", folder,
                        "--trainer.logger.init_args.save_dir", folder,
                        "--trainer.max_epochs", "2"]  # fmt: skip
    with open(output / "sweep.csv") as handle:
        written = list(csv_module.DictReader(handle))
    assert [float(r["test_acc"]) for r in written] == pytest.approx([0.9, 0.6])
    assert (output / "tradeoff.png").exists()
    spec["metrics"] = ["test_acc", "mia/train/best"]
    with pytest.raises(KeyError, match=r"w=0.2 logged no 'mia/train/best': choose 'metrics'"):
        sweep.run_sweep(spec)
    path = tmp_path / "sweep.yaml"
    path.write_text("base: a.yaml\nparameter: model.init_args.w\n")
    with pytest.raises(ValueError, match=r"a sweep needs \['metrics', 'values'\]"):
        sweep.load_sweep(str(path))  # as the command line gives it
    path.write_text("base: a.yaml\nparameter: p\nvalues: []\nmetrics: [m]\n")
    with pytest.raises(ValueError, match="'values' is empty"):
        sweep.load_sweep(path)


def test_main_runs_the_sweep_file_with_the_extra_options(tmp_path, monkeypatch):
    calls = []
    fake_run = _stand_in(calls)
    monkeypatch.setattr(sweep, "run", fake_run)
    path = tmp_path / "sweep.yaml"
    path.write_text(
        f"base: a.yaml\nparameter: model.init_args.w\nvalues: [0.4, 1.0]\n"
        f"metrics: [test_acc, mia/best]\noutput: {tmp_path / 'out'}\n"
    )
    sweep.main(["--config", str(path), "--trainer.max_epochs", "2"])
    assert [c[-2:] for c in calls] == [["--trainer.max_epochs", "2"]] * 2
    assert (tmp_path / "out" / "sweep.csv").read_text().splitlines() == [
        "value,test_acc,mia/best",
        "0.4,0.800000011920929,0.5400000214576721",  # float32 0.8 and 0.54
        "1.0,0.5,0.6000000238418579",
    ]
    path.write_text(
        f"base: a.yaml\nparameter: seed_everything\nvalues: [1, 2]\n"
        f"metrics: [test_acc]\noutput: {tmp_path / 'top'}\n"
    )
    monkeypatch.setattr(sweep, "run", lambda args: fake_run([*args, "--model.init_args.w", "0"]))
    sweep.main(["--config", str(path)])  # a top-level setting, integer values
    folders = [c[c.index("--trainer.default_root_dir") + 1] for c in calls[2:]]
    assert folders == [str(tmp_path / "top" / f"seed_everything={v}") for v in (1, 2)]
    lines = (tmp_path / "top" / "sweep.csv").read_text().splitlines()
    assert lines == ["value,test_acc", "1.0,1.0", "2.0,1.0"]
    with pytest.raises(SystemExit):
        sweep.main([])  # --config is required
