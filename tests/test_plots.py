"""The figures a run writes are ones a user would keep (issue 38): every PNG of a recipe
opens at a readable size, every title fits its axes, the client axes have integer ticks,
the participation figure shows the weights, and the metrics are drawn against rounds (and
against simulated time where there is a clock)."""

from __future__ import annotations

import csv
import glob
from pathlib import Path

import pytest

from lightning_fl import plots
from tests.test_cli_and_logging import ROOT, _fit

matplotlib = pytest.importorskip("matplotlib")
RECIPES = {
    "quickstart": ("quickstart.yaml", 2),
    "fedbuff": ("asynchronous/digits_fedbuff.yaml", 4),  # a clock: fl/time
    "fedem": ("personalization/digits_fedem.yaml", 2),  # seen and unseen clients
}


@pytest.fixture
def checked_titles(monkeypatch):
    """Every figure's titles as saved, each with whether it lies inside its axes and the
    figure: checked when the figure is closed, after the real ``_save`` wrote it."""
    seen: list[tuple[str, str, bool]] = []
    save = plots._save

    def checking_save(plt, fig, path, dpi):
        class Closing:  # the pyplot module, but its close checks the figure first
            def __getattr__(self, name):
                return getattr(plt, name)

            def close(self, figure):
                renderer = figure.canvas.get_renderer()
                for ax in figure.axes:
                    if ax.get_title():
                        title = ax.title.get_window_extent(renderer)
                        box, whole = ax.get_window_extent(renderer), figure.bbox
                        fits = box.x0 - 2 <= title.x0 and title.x1 <= box.x1 + 2
                        fits = fits and whole.x0 <= title.x0 and title.x1 <= whole.x1
                        seen.append((Path(path).name, ax.get_title(), fits))
                plt.close(figure)

        return save(Closing(), fig, path, dpi)

    monkeypatch.setattr(plots, "_save", checking_save)
    return seen


@pytest.mark.parametrize("name", RECIPES)
def test_every_png_a_recipe_writes_is_readable(name, tmp_path, checked_titles):
    recipe, rounds = RECIPES[name]
    _fit(ROOT / "recipes" / recipe, tmp_path, "--trainer.max_epochs", str(rounds))
    pngs = sorted(glob.glob(str(tmp_path / "**/*.png"), recursive=True))
    names = {Path(p).name for p in pngs}
    assert {"metrics.png", "participation.png", "clients_test_acc.png"} <= names
    for png in pngs:
        image = matplotlib.image.imread(png)
        height, width = image.shape[:2]
        assert height >= 300 and width >= 400, (png, image.shape)
        assert image[..., :3].std() > 0.05, png  # not blank
    assert checked_titles and all(fits for *_, fits in checked_titles), checked_titles
    drawn = {png for png, *_ in checked_titles}
    assert names <= drawn  # every figure went through the check


def test_a_long_title_is_wrapped_to_fit(tmp_path, checked_titles):
    runs = {"seen": {c: 0.1 * c for c in range(8)}}
    plots.plot_client_distributions(runs, str(tmp_path / "d.png"), metric="x" * 12 + " y" * 40)
    ((_, title, fits),) = checked_titles
    assert fits and "\n" in title


def test_the_participation_figure_shows_weights_on_integer_client_ticks(tmp_path, monkeypatch):
    path = tmp_path / "participation.csv"
    rows = [(r, c, w) for r in range(3) for c, w in ((1, 0.25), (4, 0.75))] + [(3, 7, 1.0)]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["round", "client", "weight", "dropped"])
        writer.writerows((r, c, w, 0) for r, c, w in rows)
    captured = {}
    real = plots._save

    def keep(plt, fig, target, dpi):
        fig.canvas.draw()
        captured["ticks"] = [
            [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
            for ax in fig.axes[:2]
        ]
        captured["weights"] = sorted(fig.axes[1].collections[0].get_array().tolist())
        captured["colorbar"] = fig.axes[2].get_ylabel()
        return real(plt, fig, target, dpi)

    monkeypatch.setattr(plots, "_save", keep)
    plots.plot_participation(str(path), str(tmp_path / "p.png"))
    for labels in captured["ticks"]:
        assert labels and all(label.lstrip("−-").isdigit() for label in labels if label)
    assert captured["weights"] == sorted(w for *_, w in rows)
    assert captured["colorbar"] == "aggregation weight"


def test_the_metrics_figure_reads_one_value_per_round(tmp_path):
    """read_round_metrics keeps each epoch's last value, drops *_step columns and the
    final test row (no epoch)."""
    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,step,train_loss_step,train_loss_epoch,val_acc,fl/time,test_acc\n"
        "0,4,0.9,,,,\n0,9,,0.8,0.5,1.5,\n1,14,0.7,,,,\n1,19,,0.6,0.7,3.0,\n,19,,,,,0.71\n"
    )
    curves = plots.read_round_metrics(str(path))
    assert curves["train_loss_epoch"] == {0: 0.8, 1: 0.6}
    assert curves["val_acc"] == {0: 0.5, 1: 0.7} and curves["fl/time"] == {0: 1.5, 1: 3.0}
    assert "train_loss_step" not in curves and "test_acc" not in curves
    assert plots.plot_metrics_over_rounds(str(path), str(tmp_path / "m.png"))
