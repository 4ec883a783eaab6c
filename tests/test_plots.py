"""The figures a run writes are ones a user would keep (issue 38): every PNG of a recipe
opens at a readable size, every title fits its axes, the client axes have integer ticks,
the participation figure shows the weights, and the metrics are drawn against rounds (and
against simulated time where there is a clock)."""

from __future__ import annotations

import csv
import glob
import math
from pathlib import Path

import pytest

from lightning_fl import plots
from tests.helpers import line_data
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


def test_the_metrics_figure_by_hand(tmp_path, drawn):
    """One panel per kind, training and validation together (``_epoch`` dropped from the
    labels), the namespaced metrics after them; bookkeeping columns, the final test and
    the weighted means (equal to the plain mean) left out; rounds without training (a
    resumed run's first row) not drawn; the second row against ``fl/time``."""
    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,step,train_loss_epoch,val_loss,val_acc,fl/participants,fl/time,"
        "fl/federated_loss,val_acc/weighted,test_acc\n"
        "0,4,0.9,1.0,0.5,3,1.5,0.8,0.51,\n"
        "1,9,0.6,0.7,0.7,3,4.0,0.5,0.69,\n"
        "2,9,,,0.9,,,,,\n"
        "3,9,0.4,,,,,,,\n"
        ",9,,,,,,,,0.71\n"
    )
    assert plots.plot_metrics_over_rounds(str(path), str(tmp_path / "m.png")) == str(
        tmp_path / "m.png"
    )
    fig = drawn["m.png"]
    assert drawn["m.png:dpi"] == 110
    assert tuple(fig.get_size_inches()) == pytest.approx((4.2 * 3 + 1, 3.4 * 2))
    top, bottom = fig.axes[:3], fig.axes[3:]
    assert all(any(g.get_visible() for g in ax.get_xgridlines()) for ax in fig.axes)
    assert [ax.get_ylabel() for ax in top] == ["acc", "loss", "fl/federated_loss"]
    assert [ax.get_title().replace("\n", " ") for ax in top] == [
        "acc against rounds", "loss against rounds", "fl/federated_loss against rounds"
    ]  # fmt: skip
    assert [ax.get_title().replace("\n", " ") for ax in bottom] == [
        f"{k} against simulated time" for k in ("acc", "loss", "fl/federated_loss")
    ]
    assert line_data(top[0]) == {"val_acc": ([0, 1], [0.5, 0.7])}
    assert line_data(top[1]) == {
        "train_loss": ([0, 1, 3], [0.9, 0.6, 0.4]), "val_loss": ([0, 1], [1.0, 0.7])
    }  # fmt: skip
    clock_x, clock_y = line_data(bottom[1])["train_loss"]  # round 3 has no simulated time
    assert clock_x[:2] == [1.5, 4.0] and math.isnan(clock_x[2]) and clock_y == [0.9, 0.6, 0.4]
    assert {ax.get_xlabel() for ax in top} == {"round"}
    assert {ax.get_xlabel() for ax in bottom} == {"simulated time (fl/time)"}
    assert all(ax.get_legend() is not None for ax in fig.axes)
    ticks = [t.get_text() for t in top[0].get_xticklabels() if t.get_text()]
    assert ticks and all(t.lstrip("−-").isdigit() for t in ticks)  # whole rounds
    assert top[0].get_lines()[0].get_marker() == "."


def test_equal_curves_are_drawn_once_under_both_names(tmp_path, drawn):
    """val_acc/uniform equals val_acc (clients of one size): one line labelled with both,
    not one hidden under the other; a curve that differs in one round stays apart."""
    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,step,train_loss_epoch,val_acc,val_acc/uniform,val_acc/p10\n"
        "0,4,0.9,0.5,0.5,0.5\n"
        "1,9,0.6,0.7,0.7,0.6\n"
    )
    plots.plot_metrics_over_rounds(str(path), str(tmp_path / "m.png"))
    accuracy = next(ax for ax in drawn["m.png"].axes if ax.get_ylabel() == "acc")
    assert line_data(accuracy) == {
        "val_acc = val_acc/uniform": ([0, 1], [0.5, 0.7]),
        "val_acc/p10": ([0, 1], [0.5, 0.6]),
    }


def test_the_metrics_figure_without_a_clock_and_at_most_six_panels(tmp_path, drawn):
    names = [f"val_m{i}" for i in range(8)]
    path = tmp_path / "metrics.csv"
    path.write_text(
        "epoch,fl/round," + ",".join(names) + "\n"
        + "".join(f"{r},{r}," + ",".join(str(r + i) for i in range(8)) + "\n" for r in range(30))
    )  # fmt: skip
    plots.plot_metrics_over_rounds(str(path), str(tmp_path / "m.png"))
    fig = drawn["m.png"]
    assert [ax.get_ylabel() for ax in fig.axes] == [f"m{i}" for i in range(6)]
    assert line_data(fig.axes[2])["val_m2"] == (list(range(30)), [r + 2.0 for r in range(30)])
    assert fig.axes[0].get_lines()[0].get_marker() in ("", "None")  # 30 rounds or more
    assert tuple(fig.get_size_inches()) == pytest.approx((4.2 * 6 + 1, 3.4))
    empty = tmp_path / "empty.csv"
    empty.write_text("epoch,step,fl/round,test_acc\n0,4,0,\n,4,,0.5\n")
    assert plots.plot_metrics_over_rounds(str(empty), str(tmp_path / "e.png")) is None
    assert not (tmp_path / "e.png").exists()


def test_panel_order_by_hand():
    assert plots._panel_of("train_loss_epoch") == (0, "loss")
    assert plots._panel_of("val_loss/p90") == (0, "loss")
    assert plots._panel_of("val_acc") == (0, "acc")
    assert plots._panel_of("fl/federated_loss") == (1, "fl/federated_loss")
    assert plots._panel_of("dp/epsilon") == (1, "dp/epsilon")


def test_client_metrics_read_from_the_last_round(tmp_path):
    path = tmp_path / "client_metrics.csv"
    rows = [(0, 0, "test", "test_acc", 0.1), (0, 1, "test", "test_acc", 0.2),
            (3, 0, "test", "test_acc", 0.5), (3, 2, "test", "test_acc", 0.7),
            (3, 1, "val", "test_acc", 0.9), (3, 1, "test", "test_loss", 2.0),
            (10, 1, "val", "val_acc", 0.3)]  # fmt: skip
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["round", "client", "stage", "metric", "value"])
        writer.writerows(rows)
    assert plots.read_client_metrics(str(path)) == {0: 0.5, 2: 0.7}
    assert plots.read_client_metrics(str(path), clients=[2, 5]) == {2: 0.7}
    assert plots.read_client_metrics(str(path), "val_acc", "val") == {1: 0.3}
    with pytest.raises(ValueError, match="has no 'val' rows for metric 'test_loss'"):
        plots.read_client_metrics(str(path), "test_loss", "val")


def test_client_distributions_by_hand(tmp_path, drawn):
    """A box per run over its clients, every client a dot, the 10th percentile marked,
    the runs named on the x axis and the clients counted in the title."""
    import numpy as np

    runs = {"FedAvg": {c: 0.1 * c for c in range(11)}, "kNN-Per": {0: 0.9, 1: 0.3, 2: 0.6}}
    plots.plot_client_distributions(runs, str(tmp_path / "d.png"), metric="test_acc")
    ax = drawn["d.png"].axes[0]
    assert tuple(drawn["d.png"].get_size_inches()) == (4.5, 4) and drawn["d.png:dpi"] == 120
    assert [t.get_rotation() for t in ax.get_xticklabels()] == [30, 30]
    assert len(ax.get_lines()) == 2 * 6  # box, 2 whiskers, 2 caps, median: no fliers
    assert ax.get_title() == "test_acc of every client (14 clients)"
    assert ax.get_ylabel() == "per-client test_acc"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["FedAvg", "kNN-Per"]
    dots = [
        c for c in ax.collections if c.get_offsets().shape[0] > 2 and c.get_label() == "a client"
    ]
    assert sorted(dots[0].get_offsets()[:, 1].tolist()) == pytest.approx(
        [0.1 * c for c in range(11)]
    )
    jitter = np.random.default_rng(2).uniform(-0.12, 0.12, 3)  # seeded per box
    assert dots[1].get_offsets()[:, 0].tolist() == pytest.approx((2 + jitter).tolist())
    assert [d.get_sizes().tolist() for d in dots] == [[10.0], [10.0]]
    five = {f"run {k}": {0: 0.5} for k in range(5)}
    plots.plot_client_distributions(five, str(tmp_path / "five.png"))
    assert tuple(drawn["five.png"].get_size_inches()) == pytest.approx((1.6 + 1.3 * 5, 4))
    deciles = [c for c in ax.collections if c.get_label() == "10th percentile"]
    segments = [seg for c in deciles for seg in c.get_segments()]
    # numpy's linear quantile: 0.1 · 10 → the second of 0.0..1.0; 0.1 · 2 → 0.3 + 0.2 · 0.3
    assert [seg[0][1] for seg in segments] == pytest.approx([0.1, 0.36])
    ends = [x for seg in segments for x in (seg[0][0], seg[1][0])]
    assert ends == pytest.approx([0.7, 1.3, 1.7, 2.3])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a client", "10th percentile"]
    flat = [tuple(line.get_ydata()) for line in ax.get_lines() if len(line.get_ydata()) == 2]
    assert (0.5, 0.5) in flat and (0.6, 0.6) in flat  # the boxes' medians


def test_lambda_and_curve_figures_by_hand(tmp_path, drawn):
    lambdas = tmp_path / "lambdas.csv"
    lambdas.write_text("client,datastore_size,lambda\n0,12,0.25\n1,300,0.75\n")
    plots.plot_lambda_vs_size(str(lambdas), str(tmp_path / "new" / "l.png"))  # folder made
    ax = drawn["l.png"].axes[0]
    assert (tmp_path / "new" / "l.png").exists()
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("local dataset size n_t", "chosen λ_t")
    assert ax.collections[0].get_offsets().tolist() == [[12, 0.25], [300, 0.75]]
    assert ax.collections[0].get_sizes().tolist() == [14.0]
    assert tuple(drawn["l.png"].get_size_inches()) == (5, 3.5) and drawn["l.png:dpi"] == 120
    assert ax.get_position().x0 != pytest.approx(0.125)  # tight_layout moved the axes
    assert ax.get_xscale() == "log" and ax.get_ylim() == (-0.05, 1.05)
    panels = {"regret": {"a": [3.0, 2.0, 1.0], "b": [1.0, 1.0]}, "": {"c": [5.0]}}
    plots.plot_curves(panels, str(tmp_path / "c.png"), "round", "value")
    first, second = drawn["c.png"].axes
    assert line_data(first) == {"a": ([1, 2, 3], [3.0, 2.0, 1.0]), "b": ([1, 2], [1.0, 1.0])}
    assert first.get_title() == "regret" and second.get_title() == ""
    assert (first.get_xlabel(), first.get_ylabel()) == ("round", "value")
    assert tuple(drawn["c.png"].get_size_inches()) == pytest.approx((4.5 * 2 + 1, 3.5))
    assert drawn["c.png:dpi"] == 110 and first.get_legend() is not None
    assert any(g.get_visible() for g in first.get_xgridlines())


def test_the_callback_draws_in_the_run_folder_on_rank_zero(tmp_path, drawn):
    """At the fit's end: metrics.png from metrics.csv after the loggers saved, and
    participation.png (a run with only virtual clients draws none); after a test epoch the
    per-client distributions, seen and unseen apart; nothing on another rank, nothing
    switched off, nothing during the sanity check."""
    from types import SimpleNamespace

    saved = []
    logger = SimpleNamespace(log_dir=str(tmp_path), save=lambda: saved.append(True))
    (tmp_path / "metrics.csv").write_text("epoch,train_loss_epoch\n0,0.5\n1,0.4\n")
    (tmp_path / "participation.csv").write_text("round,client,weight\n0,-1,1.0\n")
    report = ("test", {"test_acc": {0: (0.5, 3), 1: (0.7, 4), 2: (0.9, 2)}}, [2])
    strategy = SimpleNamespace(evaluation=SimpleNamespace(last_report=report))

    def trainer(rank_zero=True, sanity=False):
        return SimpleNamespace(loggers=[logger], is_global_zero=rank_zero, strategy=strategy,
                               sanity_checking=sanity, default_root_dir="/unused")  # fmt: skip

    plots.FederatedPlots().on_fit_end(trainer(), None)
    assert saved == [True] and set(drawn) == {"metrics.png", "metrics.png:dpi"}
    (tmp_path / "participation.csv").write_text("round,client,weight\n0,3,1.0\n")
    plots.FederatedPlots(metrics=False).on_fit_end(trainer(), None)
    assert "participation.png" in drawn and len(saved) == 1
    drawn.clear()
    plots.FederatedPlots(participation=False, metrics=False).on_fit_end(trainer(), None)
    assert drawn == {}
    plots.FederatedPlots().on_fit_end(trainer(rank_zero=False), None)
    plots.FederatedPlots().on_test_epoch_end(trainer(sanity=True), None)
    plots.FederatedPlots(client_distributions=False).on_test_epoch_end(trainer(), None)
    assert drawn == {}
    plots.FederatedPlots().on_test_epoch_end(trainer(), None)
    ax = drawn["clients_test_acc.png"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["seen", "unseen"]
    assert ax.get_title() == "test_acc of every client (3 clients)"


def test_the_participation_figure_by_hand(tmp_path, drawn):
    """Bars: rounds taken part in per client (0 for the clients never drawn); the raster:
    a square per (round, participant) coloured by its weight, sized for the number of
    points (30 at most); virtual clients (< 0) left out; both panels named."""
    path = tmp_path / "participation.csv"
    rows = [(0, 1, 0.25), (0, 4, 0.75), (2, 4, 1.0), (5, 0, 0.5), (5, 7, 0.5), (5, -1, 1.0)]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["round", "client", "weight"])
        writer.writerows(rows)
    plots.plot_participation(str(path), str(tmp_path / "p.png"))
    bars, raster = drawn["p.png"].axes[:2]
    assert [p.get_height() for p in bars.patches] == [1, 1, 0, 0, 2, 0, 0, 1]
    assert tuple(drawn["p.png"].get_size_inches()) == (11, 3.8) and drawn["p.png:dpi"] == 110
    assert [p.get_width() for p in bars.patches] == pytest.approx([0.9] * 8)
    assert (bars.get_xlabel(), bars.get_ylabel()) == ("client", "rounds taken part in")
    assert (raster.get_xlabel(), raster.get_ylabel()) == ("round", "client")
    assert bars.get_title() == "participation of every client"
    assert raster.get_title().replace("\n", " ") == "participants of every round and their weights"
    dots = raster.collections[0]
    assert dots.get_offsets().tolist() == [[0, 1], [0, 4], [2, 4], [5, 0], [5, 7]]
    assert dots.get_array().tolist() == [0.25, 0.75, 1.0, 0.5, 0.5]
    assert dots.get_sizes().tolist() == [30.0]
    many = tmp_path / "many.csv"
    many.write_text("round,client,weight\n" + "".join(f"{r},{c},0.1\n" for r in range(50)
                                                     for c in range(40)))  # fmt: skip
    plots.plot_participation(str(many), str(tmp_path / "many.png"))
    assert drawn["many.png"].axes[1].collections[0].get_sizes().tolist() == [2.0]
    none = tmp_path / "none.csv"
    none.write_text("round,client,weight\n0,-1,1.0\n")
    with pytest.raises(ValueError, match="has no client rows"):
        plots.plot_participation(str(none), str(tmp_path / "n.png"))
