"""Every offline recipe family run far enough to reach the code that runs late or only with
an option: a forgetting request, free-riders, DP noise, gossip, asynchronous returns,
clustering, stream caches, kNN-Per's datastore, the evaluation reports (issue 35).

Two rounds reach only what runs first. These runs are short but each reaches its late path,
and each checks that it did (the request executed, the riders' updates made, the noise
accounted, the clock advanced, ...). They run on the CPU in the suite and on CUDA in the GPU
test mode (``make test-gpu``), where a tensor left on the host fails them.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers import ACCELERATOR

ROOT = Path(__file__).resolve().parents[1]
# by path: an installed package named `benchmarks` shadows the repository's folder
SPEC = importlib.util.spec_from_file_location("recipe_runs", ROOT / "benchmarks/recipe_runs.py")
recipe_runs = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(recipe_runs)
sys.modules.setdefault("recipe_runs", recipe_runs)  # recipes name its callbacks by class path
callback_of = recipe_runs.callback_of
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


def init_args(config: dict, class_name: str) -> dict:
    """The init_args of the recipe's callback ``class_name``."""
    (entry,) = [
        c for c in config["trainer"]["callbacks"] if c["class_path"].endswith(f".{class_name}")
    ]
    return entry.setdefault("init_args", {})


def run_late(recipe: str, rounds: int, edit: Callable[[dict], None] | None = None):
    """Fit ``recipes/<recipe>`` for ``rounds`` rounds on the test mode's accelerator after
    ``edit(config)``, without checkpoints (benchmarks/recipe_runs.run_recipe); the final
    model is tested. Returns the CLI and the rows of its metrics.csv."""

    def edited(config: dict) -> None:
        config["trainer"].update(accelerator=ACCELERATOR, max_epochs=rounds)
        if edit is not None:
            edit(config)

    cli, rows = recipe_runs.run_recipe(ROOT / "recipes" / recipe, edited)
    expected = "cuda" if ACCELERATOR == "gpu" else "cpu"
    assert next(cli.model.parameters()).device.type == expected
    assert any(r.get("test_acc") for r in rows), "the final model was not tested"
    assert cli.trainer.checkpoint_callbacks == []  # not even Lightning's default, every round
    return cli, rows


def benchmark_module(name: str):
    """benchmarks/<name>.py, imported as the scripts import each other (by bare name)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def logged(rows: list[dict], name: str) -> list[float]:
    return [float(r[name]) for r in rows if r.get(name)]


@pytest.mark.parametrize("method", ["sifu", "dp"])
def test_a_forgetting_request_executes(method):
    """SIFU's forgetting step (its ζ bound, the lineage's fork) and the DP baseline's noise,
    after a request at round 2 of 3."""

    def edit(config):
        args = init_args(config, "Unlearning")
        args.update(method=method, requests={2: [0, 10, 20]}, on_target=None, evaluate_every=1)

    cli, rows = run_late("robustness/digits_sifu.yaml", 3, edit)
    unlearning = callback_of(cli, "Unlearning")
    assert [r["round"] for r in unlearning.done_requests] == [2]
    assert unlearning.done_requests[0]["clients"] == [0, 10, 20]
    assert len(logged(rows, "unlearning/forgotten_acc")) >= 1


def test_a_run_saved_in_progress_resumes_to_the_uninterrupted_result(tmp_path, capsys):
    """benchmarks/recipe_runs.ProgressCheckpoint, as benchmarks/unlearning.py uses it: a
    SIFU run with a request at the third round, saved every 3 rounds, stops after 5 (its one save
    after round 3); resumed from that save to round 6, it ends where the run that never
    stopped does, to the bit, with the same request done. Every round is a valid period;
    zero is refused."""
    saved = tmp_path / "progress.ckpt"

    def edit(rounds: int, save: bool):
        def edited(config: dict) -> None:
            config["trainer"].update(accelerator=ACCELERATOR, max_epochs=rounds)
            args = init_args(config, "Unlearning")
            args.update(method="sifu", requests={2: [0, 10, 20]}, on_target=None)
            if save:
                config["trainer"]["callbacks"].append({
                    "class_path": "recipe_runs.ProgressCheckpoint",
                    "init_args": {"path": str(saved), "every": 3, "show": ["unlearning/branch"]},
                })  # fmt: skip

        return edited

    recipe = ROOT / "recipes" / "robustness" / "digits_sifu.yaml"
    full, _ = recipe_runs.run_recipe(recipe, edit(6, False))
    recipe_runs.run_recipe(recipe, edit(5, True))
    printed = [line for line in capsys.readouterr().out.splitlines() if "saved" in line]
    assert printed == ["round 3: saved progress.ckpt; unlearning/branch 1.0000"]  # forked
    checkpoint = torch.load(saved, weights_only=True)
    assert checkpoint["epoch"] == 2 and not list(tmp_path.glob("*.saving"))
    resumed, rows = recipe_runs.run_recipe(recipe, edit(6, False), args=["--ckpt_path", str(saved)])
    assert min(int(r["epoch"]) for r in rows if r.get("epoch")) == 3  # from round 4 on
    ours = [p.detach() for p in resumed.model.parameters()]
    assert all(torch.equal(a, p.detach()) for a, p in zip(ours, full.model.parameters()))
    requests = callback_of(resumed, "Unlearning").done_requests
    assert requests == callback_of(full, "Unlearning").done_requests and len(requests) == 1
    assert recipe_runs.ProgressCheckpoint(str(saved), 1).every == 1
    with pytest.raises(ValueError, match="every must be >= 1"):
        recipe_runs.ProgressCheckpoint(str(saved), 0)


def test_free_riders_make_their_updates_on_the_models_device():
    cli, rows = run_late("robustness/digits_free_riders.yaml", 3)
    riders = callback_of(cli, "FreeRiders")
    device = next(cli.model.parameters()).device
    assert riders.updates and all(u.device == device for u in riders.updates.values())
    assert riders.sigma is not None and riders.sigma > 0  # estimated after round 0
    assert len(logged(rows, "free_riders/detection_rate")) == 3


@pytest.mark.skipif(not FASHION_MNIST.exists(), reason="needs Debian's dataset-fashion-mnist")
def test_the_fashion_mnist_free_riders_recipe_runs():
    """One of the two recipes that failed on a GPU (issue 35)."""
    cli, rows = run_late("fashion_mnist/free_riders.yaml", 2)
    assert callback_of(cli, "FreeRiders").updates


def test_dp_sgd_noise_is_accounted():
    _, rows = run_late("privacy/tabular_dpsgd.yaml", 2)
    epsilons = logged(rows, "dp/epsilon")
    assert len(epsilons) == 2 and 0 < epsilons[0] < epsilons[1]


def test_gossip_advances_its_clock():
    _, rows = run_late("topology/digits_gaia_ring.yaml", 3)
    times = logged(rows, "fl/time")
    assert len(times) == 3 and times[0] < times[1] < times[2]


def test_fedbuff_aggregates_stale_returns():
    _, rows = run_late("asynchronous/digits_fedbuff.yaml", 6)
    assert max(logged(rows, "fl/staleness")) > 0  # returns computed on older models


def test_clustered_fl_reaches_its_split_test():
    def edit(config):
        init_args(config, "ClusteredFL").update(warmup_rounds=1, eps1=10.0, eps2=0.0)

    cli, rows = run_late("personalization/digits_clustered.yaml", 3, edit)
    clusters = len(callback_of(cli, "ClusteredFL").clusters)
    assert clusters > 1  # ε1 = 10, ε2 = 0: it splits
    assert logged(rows, "clustered_fl/num_clusters")[-1] == clusters


def test_similarity_sampling_clusters_the_updates():
    cli, _ = run_late("clustered_sampling_similarity.yaml", 3)
    sampler = cli.trainer.strategy.sampler
    assert sampler.gradients is not None and bool(sampler.gradients.abs().sum() > 0)


def test_stream_caches_are_refreshed():
    _, rows = run_late("streams/digits_cache_rules.yaml", 3)
    assert len(logged(rows, "streams/discrepancy")) == 3


def test_knn_per_builds_its_datastores():
    cli, rows = run_late("personalization/digits_knn_per.yaml", 2)
    knn = callback_of(cli, "KNNPer")
    assert knn.datastore_sizes and min(knn.datastore_sizes.values()) > 0
    assert logged(rows, "knn_per/lambda_mean")


def test_a_vectorized_run_with_the_federation_on_the_device():
    """The packed federation's chunks (engine/packed.py) on the training device."""

    def edit(config):
        config["trainer"]["strategy"]["init_args"].update(vectorize=True, data_on_device=True)

    cli, _ = run_late("quickstart.yaml", 2, edit)
    packed = cli.trainer.strategy.fit.packed
    assert packed is not None and packed.device == next(cli.model.parameters()).device
    assert torch.isfinite(torch.tensor(float(cli.trainer.callback_metrics["test_acc"])))


def test_the_dp_clip_probe_finds_the_round_the_target_is_reached_and_applies_its_clip():
    """benchmarks/dp_clip_probe.py on the digits recipe: at C = 1 DP's training reaches 0.5
    at the recipe's 50-round minimum; at C = 0.001 the clipped updates barely move the
    model, so the same target is not reached in 60 rounds (None, not a capped 61)."""
    dp_clip_probe = benchmark_module("dp_clip_probe")
    dp_clip_probe.protocol.use_dataset("digits", ACCELERATOR)
    wide = dp_clip_probe.first_phase(1.0, 0, 60, target=0.5)
    narrow = dp_clip_probe.first_phase(0.001, 0, 60, target=0.5)
    assert wide["reached"] == 50 and wide["checks"][-1][0] == 50 <= len(wide["checks"])
    assert wide["checks"][-1][1] >= 0.5
    assert narrow["reached"] is None and len(narrow["checks"]) == 60
    assert max(a for _, a in narrow["checks"]) < 0.5


def test_the_unlearning_table_lists_every_seed_the_journal_finished(tmp_path):
    """benchmarks/unlearning.py's Journal.seeds: the seeds of finished runs at a target and
    σ (any σ with None) with given requests, under the current cap and recipe settings, so
    that a run of one seed and one method rewrites the table with all of them."""
    unlearning = benchmark_module("unlearning")
    unlearning.use_dataset("fashion_mnist")
    settings, cap, one = unlearning.recipe_hash(), unlearning.MAX_ROUNDS, [[0, 10]]
    keys = [
        ["sifu", 0, 0.9, 0.1, None, cap, settings],
        ["scratch", 3, 0.9, 0.1, None, cap, settings],
        ["dp", 5, 0.9, 0.05, None, cap, settings],  # another σ
        ["last", 6, 0.8, 0.1, None, cap, settings],  # another target
        ["sifu", 7, 0.9, 0.1, None, cap + 1, settings],  # another cap
        ["sifu", 8, 0.9, 0.1, None, cap, "0123456789"],  # another recipe
        ["sifu", 9, 0.9, 0.002, one, cap, settings],  # a sweep run
    ]
    path = tmp_path / "journal.jsonl"
    path.write_text("".join(json.dumps({"key": json.dumps(k)}) + "\n" for k in keys))
    journal = unlearning.Journal(path)
    assert journal.seeds(0.9, 0.1) == {0, 3}
    assert journal.seeds(0.9, 0.05) == {5}
    assert journal.seeds(0.9, None, one) == {9} and journal.seeds(0.9, 0.1, one) == set()


def test_an_unlearning_row_by_hand_with_capped_phases():
    """benchmarks/unlearning.method_row: per-phase means over seeds, ≥ on a phase any seed
    ran to the cap, on the total only when a retraining phase (not the first) is capped."""
    unlearning = benchmark_module("unlearning")
    runs = [([870, 10_000, 48, 50], [0.1, 0.5, 0.3]), ([900, 9_000, 10_000, 54], [0.2, 0.4, 0.5])]
    row, entry = unlearning.method_row("LAST", runs, 10_000)
    assert row == "| LAST | 885 | ≥9500 / ≥5024 / 52 | ≥14576 | 0.150 / 0.450 / 0.400 |"
    assert entry[0] == [9500, 5024, 52] and entry[2] == [True, True, False]
    assert entry[1] == pytest.approx([0.15, 0.45, 0.4], abs=1e-12)
    row, entry = unlearning.method_row("DP", [([10_000, 52, 59, 51], [0.08, 0.44, 0.22])], 10_000)
    assert row == "| DP | ≥10000 | 52 / 59 / 51 | 162 | 0.080 / 0.440 / 0.220 |"
    assert entry[2] == [False, False, False]


def test_the_unlearning_figure_hatches_capped_phases_on_a_log_scale(tmp_path, monkeypatch):
    """benchmarks/unlearning.py's Fig. 5.2: a method whose phase ran to the cap (LAST's, in
    the thesis) is hatched in both panels, only in that phase, and the rounds go on a log
    scale; without a capped phase the scale stays linear and nothing is hatched."""
    import matplotlib.pyplot as plt

    unlearning = benchmark_module("unlearning")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    last = ([10_000, 10_000, 51], [0.1, 0.5, 0.3], [True, True, False])
    figure = {"SCRATCH": ([572, 618, 322], [0.0, 0.0, 0.0], [False] * 3), "LAST": last}
    unlearning._plot(figure, tmp_path / "capped.png", 10_000)
    del figure["LAST"]
    unlearning._plot(figure, tmp_path / "uncapped.png", 10_000)
    (capped, uncapped) = figures
    for fig, scale, hatched in ((capped, "log", [None] * 3 + ["//", "//", None]),
                                (uncapped, "linear", [None] * 3)):  # fmt: skip
        rounds_ax, forgotten_ax = fig.axes
        assert rounds_ax.get_yscale() == scale and forgotten_ax.get_yscale() == "linear"
        for ax in fig.axes:
            assert [bar.get_hatch() for bar in ax.patches] == hatched
    assert "hatched: at the cap" in capped.axes[0].get_ylabel()
    assert (tmp_path / "capped.png").stat().st_size > 0


def test_the_sigma_sweep_figure_opens_the_markers_of_capped_sigmas(tmp_path, monkeypatch):
    """benchmarks/unlearning.py's Fig. D.2: a σ whose retraining ran to the cap (SIFU as
    LAST, at large σ) gets an open marker at its own σ in both panels, and only it; the
    rounds then go on a log scale, and stay linear without a capped σ."""
    import matplotlib.pyplot as plt

    unlearning = benchmark_module("unlearning")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    finished = [(0.01, 574, 0.0), (0.1, 184, 0.0), (0.5, 10_000, 0.25), (1.0, 10_001, 0.5)]
    unlearning._plot_sweep(finished, 574, tmp_path / "capped.png", 10_000)
    unlearning._plot_sweep(finished[:2], 574, tmp_path / "uncapped.png", 10_000)
    (capped, uncapped) = figures
    rounds_ax, forgotten_ax = capped.axes
    assert rounds_ax.get_yscale() == "log" and forgotten_ax.get_yscale() == "linear"
    for ax, values in ((rounds_ax, [10_000, 10_001]), (forgotten_ax, [0.25, 0.5])):
        opened = [line for line in ax.get_lines() if line.get_markerfacecolor() == "white"]
        assert [list(line.get_xdata()) for line in opened] == [[0.5, 1.0]]
        assert [list(line.get_ydata()) for line in opened] == [values]
    assert "open: at the cap" in rounds_ax.get_ylabel()
    assert uncapped.axes[0].get_yscale() == "linear"
    assert not [line for line in uncapped.axes[0].get_lines()
                if line.get_markerfacecolor() == "white"]  # fmt: skip


def test_the_phase_checkpoint_saves_the_whole_fit_at_the_end_of_the_first_phase(tmp_path):
    """benchmarks/recipe_runs.PhaseCheckpoint, which makes the training the unlearning
    methods share: it stops the fit when the first phase reaches its target (here 0.3,
    reached at the recipe's 50-round minimum) and saves it with the callbacks' state (the
    Unlearning history the methods resume from), not only the weights."""
    saved = tmp_path / "shared.ckpt"

    def edit(config: dict) -> None:
        config["trainer"].update(accelerator=ACCELERATOR, max_epochs=200)
        args = init_args(config, "Unlearning")
        args["on_target"]["init_args"]["target"] = 0.3
        config["trainer"]["callbacks"].append(
            {"class_path": "recipe_runs.PhaseCheckpoint", "init_args": {"path": str(saved)}}
        )

    cli, _ = recipe_runs.run_recipe(ROOT / "recipes" / "robustness" / "digits_sifu.yaml", edit)
    assert callback_of(cli, "Unlearning").phase_rounds == [50] and cli.trainer.current_epoch == 50
    checkpoint = torch.load(saved, weights_only=True)
    (state,) = [s for k, s in checkpoint["callbacks"].items() if "Unlearning" in k]
    assert checkpoint["epoch"] == 49 and state["phase_rounds"] == [50]


def test_an_unfinished_unlearning_run_is_named_by_its_saved_seeds(tmp_path, monkeypatch):
    """benchmarks/unlearning.unfinished_cell: a method or σ no seed has finished lists the
    seeds saved mid-run for exactly its key (method, seed, target, σ, requests), so that
    LAST's 10⁴-round phases read as unfinished, not as never run."""
    unlearning = benchmark_module("unlearning")
    unlearning.use_dataset("fashion_mnist")
    monkeypatch.setattr(unlearning, "SHARED", tmp_path)
    one = [[0, 10]]
    for key in (("last", 0, 0.9, 0.1, None), ("last", 3, 0.9, 0.1, None),
                ("sifu", 0, 0.9, 0.2, one), ("dp", 1, 0.8, 0.1, None)):  # fmt: skip
        unlearning.progress_path(unlearning.run_key(*key)).touch()
    cell = unlearning.unfinished_cell
    assert cell("last", [0, 1, 2, 3], 0.9, 0.1) == "unfinished: seeds 0, 3 saved mid-run"
    assert cell("last", [1, 3], 0.9, 0.1) == "unfinished: seed 3 saved mid-run"
    assert cell("sifu", [0], 0.9, 0.2, one) == "unfinished: seed 0 saved mid-run"
    assert cell("sifu", [0], 0.9, 0.2) == "not run yet"  # the main protocol, not the sweep
    assert cell("dp", [0, 1, 2, 3], 0.9, 0.1) == "not run yet"  # saved at another target
    assert cell("scratch", [0, 1, 2, 3], 0.9, 0.1) == "not run yet"


def test_a_run_saved_mid_run_shows_its_finished_phases(tmp_path):
    """benchmarks/unlearning.saved_row: a run saved mid-run (LAST's 10⁴-round phases) shows
    the phases its Unlearning record has finished, ≥ at the cap, the forgotten clients'
    accuracy after each request finished, and the round its current phase has reached
    (the save's rounds since the phase started), read from the save with weights_only."""
    unlearning = benchmark_module("unlearning")
    record = {"phase_rounds": [870, 10_000, 9_998], "phase_start": 20_868,
              "phase_forgotten_acc": [float("nan"), 0.0, 0.0625]}  # fmt: skip
    torch.save({"epoch": 20_999, "callbacks": {"Unlearning": record}}, tmp_path / "a.ckpt")
    row = unlearning.saved_row("last", 0, tmp_path / "a.ckpt", 10_000)
    assert row == ("| LAST, seed 0 (unfinished, saved mid-run) | 870 | ≥10000 / 9998 / at round "
                   "132 | | 0.000 / 0.062 / — |")  # fmt: skip
    first = {"phase_rounds": [], "phase_start": 0, "phase_forgotten_acc": []}
    torch.save({"epoch": 399, "callbacks": {"Unlearning": first}}, tmp_path / "b.ckpt")
    row = unlearning.saved_row("fine_tuning", 3, tmp_path / "b.ckpt", 10_000)
    name = "FINE-TUNING, seed 3 (unfinished, saved mid-run)"
    assert row == f"| {name} | at round 400 | — / — / — | | — / — / — |"


def test_the_unlearning_table_flags_a_seed_whose_methods_left_the_first_phase_apart(tmp_path):
    """benchmarks/unlearning.first_phase_mismatches: for each seed, the methods whose first
    phase is plain FedAvg (all but DP) grouped by their rounds to the target, listed only
    where the groups differ (runs from different machines), rounds ascending; DP's own
    noisy first phase never counts. saved_first_phase reads a save's first phase (None
    while the save is still in it)."""
    unlearning = benchmark_module("unlearning")
    first_rounds = {
        3: {"scratch": 804, "sifu": 804, "fedaccum": 804, "dp": 1558},  # agree: no line
        0: {"scratch": 870, "sifu": 859, "fine_tuning": 859, "fedaccum": 859, "last": 870},
        1: {"fine_tuning": 824, "last": 860, "scratch": 824, "sifu": 823, "dp": 1448},
        2: {"dp": 1663, "sifu": 932},  # DP differs from SIFU by design: no line
    }
    assert unlearning.first_phase_mismatches(first_rounds) == [
        "seed 0: 859 (SIFU, FINE-TUNING, FEDACCUM), 870 (SCRATCH, LAST)",
        "seed 1: 823 (SIFU), 824 (FINE-TUNING, SCRATCH), 860 (LAST)",
    ]
    assert unlearning.first_phase_mismatches({0: {"sifu": 859}, 1: {}}) == []
    record = {"phase_rounds": [860, 10_000], "phase_start": 10_860, "phase_forgotten_acc": []}
    torch.save({"epoch": 11_000, "callbacks": {"Unlearning": record}}, tmp_path / "a.ckpt")
    assert unlearning.saved_first_phase(tmp_path / "a.ckpt") == 860
    record["phase_rounds"] = []
    torch.save({"epoch": 400, "callbacks": {"Unlearning": record}}, tmp_path / "b.ckpt")
    assert unlearning.saved_first_phase(tmp_path / "b.ckpt") is None


def test_a_journaled_unlearning_run_names_its_machine(tmp_path, monkeypatch):
    """benchmarks/unlearning.Journal: a finished run's line carries the machine it ran on
    (benchmarks/run_times.machine on a CPU), beside its rounds, and a journal read back
    returns the run without running it again."""
    unlearning = benchmark_module("unlearning")
    unlearning.use_dataset("fashion_mnist")
    result = ([812, 51, 50, 50], [0.04, 0.48, 0.37], [[0, 812], [1, 51], [2, 50]])
    calls = []
    monkeypatch.setattr(unlearning, "protocol", lambda *a: calls.append(a) or result)
    path = tmp_path / "journal.jsonl"
    assert unlearning.Journal(path).protocol("fedaccum", 2, 0.9, 0.1) == result
    (entry,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert entry["machine"] == benchmark_module("run_times").machine()
    assert entry["rounds"] == result[0] and json.loads(entry["key"])[:4] == [
        "fedaccum",
        2,
        0.9,
        0.1,
    ]
    assert unlearning.Journal(path).protocol("fedaccum", 2, 0.9, 0.1) == result and len(calls) == 1
