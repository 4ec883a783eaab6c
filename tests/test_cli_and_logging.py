"""The recipes run end to end through the ``lightning-fl`` CLI; CSV and offline W&B logging."""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_fl.cli import run
from tests.helpers import ACCELERATOR

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
SHORT = ["--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false"]


def _fit(recipe: Path, tmp_path: Path, *extra: str):
    return run(
        ["fit", "--config", str(recipe), "--trainer.default_root_dir", str(tmp_path),
         "--trainer.logger.init_args.save_dir", str(tmp_path), *SHORT,
         "--trainer.accelerator", ACCELERATOR, *extra]
    )  # fmt: skip


#: Server momentum β = 0.9 moves the second round by 1.9 Δ_1 + Δ_2 and overshoots: the
#: digits recipe's test accuracy reads 0.19 after two rounds, 0.62 after three.
ROUNDS_TO_LEARN = {"fedavgm": 3}


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_learns_in_two_rounds(recipe, tmp_path):
    """Two rounds of every core recipe (three with server momentum) lift digits' test
    accuracy well above chance (0.1; the slowest, FedAdagrad, reaches 0.32), and the plain
    test_acc is the sample-weighted mean over clients."""
    rounds = ROUNDS_TO_LEARN.get(recipe.stem, 2)
    cli = _fit(
        recipe, tmp_path, "--trainer.limit_test_batches", "2", "--trainer.max_epochs", str(rounds)
    )
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.current_epoch == rounds
    assert float(metrics["test_acc"]) > 0.25
    assert float(metrics["test_acc"]) == pytest.approx(float(metrics["test_acc/weighted"]))


PERSONALIZATION = sorted((ROOT / "recipes" / "personalization").glob("*.yaml"))


@pytest.mark.parametrize("recipe", PERSONALIZATION, ids=[r.stem for r in PERSONALIZATION])
def test_every_personalization_recipe_reports_seen_and_unseen_clients(recipe, tmp_path):
    """One round of each recipe: the seen and the unseen clients' summaries are the
    sample-weighted means of their rows in client_metrics.csv, and the plot is saved."""
    extra = ["--data.init_args.num_tasks", "10"] if recipe.stem.startswith("synthetic") else []
    cli = _fit(recipe, tmp_path, *extra, "--trainer.max_epochs", "1")
    metrics = cli.trainer.callback_metrics
    unseen = set(cli.datamodule.unseen_clients)
    assert unseen and len(unseen) < cli.datamodule.num_clients
    (clients_csv,) = glob.glob(str(tmp_path / "**/client_metrics.csv"), recursive=True)
    rows = [
        r for r in csv.DictReader(open(clients_csv))
        if r["stage"] == "test" and r["metric"] == "test_acc"
    ]  # fmt: skip
    assert {int(r["client"]) for r in rows} == set(range(cli.datamodule.num_clients))
    for key, group in (("test_acc/weighted", False), ("test_acc/unseen/weighted", True)):
        part = [r for r in rows if (int(r["client"]) in unseen) == group]
        total = sum(float(r["num_samples"]) for r in part)
        mean = sum(float(r["value"]) * float(r["num_samples"]) for r in part) / total
        assert float(metrics[key]) == pytest.approx(mean, abs=1e-5)
    assert float(metrics["test_acc"]) == pytest.approx(float(metrics["test_acc/weighted"]))
    assert glob.glob(str(tmp_path / "**/clients_test_acc.png"), recursive=True)


def test_quickstart_console_script_writes_per_client_metrics(tmp_path):
    exe = Path(sys.executable).with_name("lightning-fl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lightning_fl.cli"]
    subprocess.run(
        [*cmd, "fit", "--config", str(ROOT / "recipes/quickstart.yaml"),
         "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir",
         str(tmp_path), *SHORT],
        check=True, cwd=tmp_path, capture_output=True,
    )  # fmt: skip
    (metrics_csv,) = glob.glob(str(tmp_path / "**/metrics.csv"), recursive=True)
    header = open(metrics_csv).readline()
    for key in ("val_acc", "val_acc/uniform", "val_acc/p10", "fl/participants", "test_acc"):
        assert key in header
    (clients_csv,) = glob.glob(str(tmp_path / "**/client_metrics.csv"), recursive=True)
    rows = list(csv.DictReader(open(clients_csv)))
    val_rows = [r for r in rows if r["stage"] == "val" and r["metric"] == "val_acc"]
    assert {r["round"] for r in val_rows} == {"0", "1"}
    assert len({r["client"] for r in val_rows}) == 20
    assert glob.glob(str(tmp_path / "**/last.ckpt"), recursive=True)
    (participation_csv,) = glob.glob(str(tmp_path / "**/participation.csv"), recursive=True)
    rows = list(csv.DictReader(open(participation_csv)))
    assert [r["round"] for r in rows] == ["0"] * 10 + ["1"] * 10  # 10 of 20 clients a round
    assert len({r["client"] for r in rows if r["round"] == "0"}) == 10


def _console(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lightning-fl")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lightning_fl.cli"]
    return subprocess.run([*cmd, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainer.strategy.init_args.local_steps", "0"], "local_steps must be >= 1, got 0."),
        (["--trainer.max_epochs", "abc"], "trainer.max_epochs: expected int or NoneType"),
        (["--trainer.strategy.init_args.lcal_steps", "3"], "Option 'lcal_steps' is not accepted"),
        (
            ["--model.init_args.lr", "nan"],
            "model.init_args.lr: expected float, got 'nan' (NaN "
            "and infinities are refused: give a finite number)",
        ),
        (["--model.init_args.lr", "inf"], "expected float, got 'inf' (NaN and infinities"),
        (["--model.init_args.lr", ".nan"], "lr is NaN: give a finite number ≥ 0, e.g. lr=0.05."),
        (
            ["--trainer.max_epoch", "1"],
            "unrecognized arguments: --trainer.max_epoch 1: options are spelled in full",
        ),  # not max_epochs: abbreviations are refused
    ],
)
def test_cli_errors_end_with_one_short_line(tmp_path, args, message, capsys, monkeypatch):
    """The console script's ``main`` (in this process: the console script itself starts in
    the tests above and below)."""
    from lightning_fl.cli import main

    quickstart = str(ROOT / "recipes/quickstart.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-fl"])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", quickstart, *args])
    assert exit_info.value.code != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1]
    assert len(lines) <= 3, lines  # no traceback, no usage, no Namespace dump
    with warnings.catch_warnings(), pytest.raises(BaseException) as traced:
        main(["fit", "--config", quickstart, *args, "--traceback"])
    assert not isinstance(traced.value, SystemExit) or "usage:" in capsys.readouterr().err


def test_cli_offers_fit_validate_test_but_not_predict(tmp_path):
    result = _console(tmp_path, "predict", "--config", str(ROOT / "recipes/quickstart.yaml"))
    assert result.returncode != 0 and "invalid choice: 'predict'" in result.stderr


def test_quickstart_recipe_tip_runs(tmp_path):
    """The quickstart header's command for the Local baseline works as written."""
    tip = [
        ln for ln in (ROOT / "recipes/quickstart.yaml").read_text().splitlines() if "fit --" in ln
    ]
    assert tip[-1] == "#   lightning-fl fit --config recipes/local.yaml"
    cli = _fit(ROOT / "recipes/local.yaml", tmp_path, "--trainer.max_epochs", "1")
    assert cli.trainer.current_epoch == 1


def test_a_cli_run_sets_its_matmul_precision_and_warns_of_nothing_deprecated(tmp_path):
    """--float32_matmul_precision reaches torch; the saved config.yaml keeps None entries
    without jsonargparse's skip_none deprecation (issue 35)."""
    before = torch.get_float32_matmul_precision()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cli = _fit(
                ROOT / "recipes/quickstart.yaml", tmp_path, "--trainer.max_epochs", "1",
                "--float32_matmul_precision", "medium", "--test_after_fit", "false",
            )  # fmt: skip
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)
    ours = [w for w in caught if "lightning_fl" in w.filename]
    assert not [str(w.message) for w in ours if "deprecated" in str(w.message)]
    (saved,) = glob.glob(str(tmp_path / "**/config.yaml"), recursive=True)
    assert "float32_matmul_precision: medium" in Path(saved).read_text()
    assert "ckpt_path: null" in Path(saved).read_text()  # None entries kept
    assert cli.trainer.current_epoch == 1


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cli = run(
        ["fit", "--config", str(ROOT / "recipes/quickstart.yaml"), *SHORT,
         "--trainer.default_root_dir", str(tmp_path),
         "--trainer.logger", "lightning.pytorch.loggers.WandbLogger",
         "--trainer.logger.init_args.offline", "true",
         "--trainer.logger.init_args.save_dir", str(tmp_path),
         "--trainer.logger.init_args.project", "lightning-fl-test"]
    )  # fmt: skip
    import wandb

    wandb.finish()
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    (run_file,) = glob.glob(os.path.join(runs[0], "*.wandb"))
    payload = Path(run_file).read_bytes()
    for key in (b"val_acc/uniform", b"val_acc/clients", b"fl/participants", b"test_acc"):
        assert key in payload
    assert cli.trainer.current_epoch == 2
    # everything the run writes is in its own folder, beside its checkpoints
    (checkpoint,) = glob.glob(str(tmp_path / "**" / "last.ckpt"), recursive=True)
    folder = Path(checkpoint).parent.parent
    assert folder.name == cli.trainer.logger.version
    for name in ("client_metrics.csv", "clients_test_acc.png"):
        assert (folder / name).exists(), sorted(p.name for p in folder.iterdir())


PAPER = ROOT / "recipes" / "paper"
SMALL = sorted(PAPER.glob("*_small.yaml"))


def test_femnist_small_recipe_learns_as_written(tmp_path):
    """The generated stand-in data carries a signal the recipe's CNN learns: test accuracy
    far above chance (1/62) after 6 of its 10 rounds (0.100; 0.025 after 4, when the CNN
    has not started yet; 0.13 after all 10, as the recipe says: 6 keep the suite short)."""
    cli = run(
        ["fit", "--config", str(PAPER / "femnist_small.yaml"),
         "--data.init_args.root", str(tmp_path / "data"), "--trainer.default_root_dir",
         str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path),
         "--trainer.limit_val_batches", "0", "--trainer.max_epochs", "6"]
    )  # fmt: skip
    assert float(cli.trainer.callback_metrics["test_acc"]) > 0.06


@pytest.mark.parametrize("recipe", SMALL, ids=[r.stem for r in SMALL])
def test_paper_small_variants_run_on_generated_data(recipe, tmp_path):
    cli = run(
        ["fit", "--config", str(recipe), "--data.init_args.root", str(tmp_path / "data"),
         "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir",
         str(tmp_path), "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0",
         "--trainer.limit_test_batches", "2", "--trainer.enable_progress_bar", "false"]
    )  # fmt: skip
    assert 0.0 <= float(cli.trainer.callback_metrics["test_acc"]) <= 1.0
    assert any((tmp_path / "data").rglob("*"))  # the generated files in the real format


@pytest.mark.parametrize("recipe", sorted(PAPER.glob("*.yaml")), ids=lambda r: r.stem)
def test_every_paper_recipe_parses(recipe, capsys):
    """Every class and argument of the recipe resolves (jsonargparse checks init_args
    against the signatures) and --print_config exits with status 0."""
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", str(recipe), "--print_config"])
    assert exit_info.value.code == 0
    assert "class_path: lightning_fl.FederatedStrategy" in capsys.readouterr().out


def test_fedem_synthetic_paper_recipe_runs_on_cpu(tmp_path):
    recipe = ROOT / "recipes" / "paper" / "fedem_synthetic.yaml"
    cli = _fit(recipe, tmp_path, "--data.init_args.num_tasks", "8", "--trainer.max_epochs", "1",
               "--trainer.accelerator", "cpu")  # fmt: skip
    assert 0.0 <= float(cli.trainer.callback_metrics["test_acc/weighted"]) <= 1.0


PRIVACY = sorted((ROOT / "recipes" / "privacy").glob("tabular_*.yaml"))
PRIVACY = [r for r in PRIVACY if not r.stem.endswith("sweep")]
TINY_TABLE = ["--data.init_args.num_samples", "400", "--trainer.max_epochs", "1"]


@pytest.mark.parametrize("recipe", PRIVACY, ids=[r.stem for r in PRIVACY])
def test_every_privacy_recipe_runs_shortened(recipe, tmp_path):
    cli = _fit(recipe, tmp_path, *TINY_TABLE)
    metrics = cli.trainer.callback_metrics
    for key in ("test_acc", "mia/train/best", "mia/reference/best"):
        assert 0.0 <= float(metrics[key]) <= 1.0


def test_the_user_level_dp_recipe_logs_epsilon_and_the_triad(tmp_path):
    """Two rounds of privacy/digits_dp_fedavg.yaml: ε of 2 rounds of 20 of 100 clients at
    z = 1 (dp-accounting), the clip norm adapted once, and the membership triad at test."""
    from lightning_fl.systems.user_dp import Sampling, epsilon

    cli = _fit(ROOT / "recipes" / "privacy" / "digits_dp_fedavg.yaml", tmp_path)
    (metrics_csv,) = glob.glob(str(tmp_path / "**/metrics.csv"), recursive=True)
    rounds = [r for r in csv.DictReader(open(metrics_csv)) if r.get("dp/epsilon")]
    assert len(rounds) == 2
    for t, row in enumerate(rounds):
        expected = epsilon(1.0, Sampling.fixed(20, 100), t + 1, 1e-5)
        assert float(row["dp/epsilon"]) == pytest.approx(expected, abs=1e-5)
    assert float(rounds[0]["dp/clip_norm"]) == 0.5 != float(rounds[1]["dp/clip_norm"])
    metrics = cli.trainer.callback_metrics  # the test's
    for key in ("test_acc", "mia/train/best"):
        assert 0.0 <= float(metrics[key]) <= 1.0


@pytest.mark.parametrize("name", ["purchase100_werm", "texas100_werm"])
def test_download_privacy_recipes_parse(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(
            [
                "fit",
                "--config",
                str(ROOT / "recipes" / "privacy" / f"{name}.yaml"),
                "--print_config",
            ]
        )
    assert exit_info.value.code == 0
    assert "class_path: lightning_fl.FederatedStrategy" in capsys.readouterr().out


def test_werm_sweep_writes_the_tradeoff_plot(tmp_path):
    from lightning_fl.sweep import load_sweep, run_sweep

    spec = load_sweep(ROOT / "recipes" / "privacy" / "tabular_werm_sweep.yaml")
    spec["values"] = [0.5, 1.0]
    spec["output"] = str(tmp_path)
    rows = run_sweep(spec, [*TINY_TABLE, "--trainer.enable_progress_bar", "false"])
    assert [r["value"] for r in rows] == [0.5, 1.0]
    assert (tmp_path / "tradeoff.png").exists() and (tmp_path / "sweep.csv").exists()


def test_training_metrics_equal_logging_every_step(tmp_path):
    """The Classifier sums its training metrics on the device and logs them once per round
    (and the step values only at logging steps): the logger and callback_metrics hold
    the same keys and values as with self.log(..., on_step=True, on_epoch=True) at every
    step."""
    import lightning.pytorch as pl
    import torch

    from lightning_fl import FederatedStrategy
    from tests.helpers import make_trainer, tiny_datamodule, tiny_module

    class EveryStep(type(tiny_module())):
        def _log_training_step(self, loss, metrics, size):
            for name, value in (("loss", loss), *metrics.items()):
                self.log(f"train_{name}", value, on_step=True, on_epoch=True, batch_size=size)

        def on_train_epoch_end(self):
            pass

    results = []
    for cls in (type(tiny_module()), EveryStep):
        torch.manual_seed(1)
        module = cls(network=tiny_module().network, lr=0.1)
        folder = tmp_path / cls.__name__
        logger = pl.loggers.CSVLogger(folder, name="run")
        trainer = make_trainer(
            FederatedStrategy(local_steps=4, seed=0), 3, logger=logger, log_every_n_steps=3
        )
        trainer.fit(module, datamodule=tiny_datamodule())
        rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
        callback = {k: float(v) for k, v in trainer.callback_metrics.items()}
        results.append((rows, callback))
    assert results[0][0] == results[1][0]
    assert results[0][1] == results[1][1]
    assert any(r.get("train_acc_step") for r in results[0][0])


ASYNCHRONOUS = ROOT / "recipes" / "asynchronous"
TOPOLOGY = sorted((ROOT / "recipes" / "topology").glob("*.yaml"))


@pytest.mark.parametrize(
    "recipe", sorted(ASYNCHRONOUS.glob("digits_*.yaml")) + TOPOLOGY, ids=lambda r: r.stem
)
def test_simulated_time_recipes_run_and_log_fl_time(recipe, tmp_path):
    cli = _fit(recipe, tmp_path, "--trainer.max_epochs", "3", "--trainer.limit_test_batches", "2")
    assert 0.0 <= float(cli.trainer.callback_metrics["test_acc"]) <= 1.0
    (metrics_csv,) = glob.glob(str(tmp_path / "**/metrics.csv"), recursive=True)
    rows = list(csv.DictReader(open(metrics_csv)))
    times = [float(r["fl/time"]) for r in rows if r.get("fl/time")]
    assert len(times) == 3 and times == sorted(times) and times[0] > 0  # one per round
    if recipe.parent == ASYNCHRONOUS:
        assert any(float(r["fl/federated_loss"]) > 0 for r in rows if r.get("fl/federated_loss"))
        (updates,) = glob.glob(str(tmp_path / "**/updates_per_client.csv"), recursive=True)
        assert open(updates).readline().strip() == "client,updates"


@pytest.mark.parametrize("name", ["cifar10_fedfix", "shakespeare_fedfix"])
def test_asynchronous_paper_recipes_parse(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", str(ASYNCHRONOUS / f"{name}.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    assert "lightning_fl.FedFixSchedule" in capsys.readouterr().out


@pytest.mark.parametrize(
    "recipe", sorted((ROOT / "recipes" / "robustness").glob("digits_*.yaml")), ids=lambda r: r.stem
)
def test_robustness_recipes_run(recipe, tmp_path):
    cli = _fit(recipe, tmp_path, "--trainer.max_epochs", "3", "--trainer.limit_test_batches", "2")
    assert cli.trainer.current_epoch == 3
    (metrics_csv,) = glob.glob(str(tmp_path / "**/metrics.csv"), recursive=True)
    header = open(metrics_csv).readline()
    keys = {"digits_sifu": "unlearning/remaining_train_acc", "digits_free_riders": "free_riders/",
            "digits_robust_aggregation": "attack/updates"}  # fmt: skip
    assert keys[recipe.stem] in header


@pytest.mark.parametrize("name", ["mnist_sifu", "cifar10_sifu", "cifar100_sifu"])
def test_real_data_unlearning_recipes_parse(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", str(ROOT / "recipes" / "robustness" / f"{name}.yaml"),
             "--print_config"])  # fmt: skip
    assert exit_info.value.code == 0
    assert "lightning_fl.callbacks.Unlearning" in capsys.readouterr().out


def test_streams_recipe_runs_and_logs_the_cache_discrepancy(tmp_path):
    recipe = ROOT / "recipes" / "streams" / "synthetic_ours.yaml"
    cli = _fit(recipe, tmp_path, "--trainer.max_epochs", "3")
    assert 0.0 <= float(cli.trainer.callback_metrics["test_acc"]) <= 1.0
    (metrics_csv,) = glob.glob(str(tmp_path / "**/metrics.csv"), recursive=True)
    assert "streams/discrepancy" in open(metrics_csv).readline()


COMBINED = sorted((ROOT / "recipes" / "combined").glob("*.yaml"))
#: what each cross-system recipe must log besides accuracy: both systems at work
COMBINED_KEYS = {
    "drsr_fedem": "streams/discrepancy",
    "fedbuff_fedprox_dpsgd": "dp/epsilon",
    "fedem_ca_fed": "fl/excluded",
    "knn_per_sifu": "unlearning/forgotten_acc",
    "scaffold_similarity_2proc": "fl/participants",
}


@pytest.mark.parametrize("recipe", COMBINED, ids=[r.stem for r in COMBINED])
def test_combined_recipes_run_with_both_systems(recipe, tmp_path):
    """A few rounds of each cross-system recipe (one process; the SIFU request moved to
    round 1): it learns, and logs what each of its systems adds."""
    import yaml

    config = yaml.safe_load(recipe.read_text())
    config["trainer"]["devices"] = 1
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("Unlearning"):
            callback["init_args"]["requests"] = {1: [0, 1]}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    rounds = 20 if recipe.stem == "fedem_ca_fed" else 8  # few clients available at first
    cli = _fit(path, tmp_path, "--trainer.max_epochs", str(rounds))
    assert cli.trainer.current_epoch == rounds
    assert float(cli.trainer.callback_metrics["test_acc"]) > 0.25  # chance: 0.1
    (metrics_csv,) = glob.glob(str(tmp_path / "**/metrics.csv"), recursive=True)
    assert COMBINED_KEYS[recipe.stem] in open(metrics_csv).readline()
    if recipe.stem == "knn_per_sifu":
        unlearning = next(c for c in cli.trainer.callbacks if type(c).__name__ == "Unlearning")
        assert unlearning.removed == [0, 1]


def test_plots_are_a_callback_that_a_run_can_switch_off(tmp_path):
    """The figures come from the FederatedPlots callback the strategy installs: with
    enable_plots=False a run writes its CSV files and no figure; by default it draws the
    participation and per-client figures once (a user's own instance is not doubled)."""
    from lightning_fl.callbacks import FederatedPlots

    recipe = ROOT / "recipes" / "quickstart.yaml"
    off = _fit(recipe, tmp_path / "off", "--trainer.strategy.init_args.enable_plots", "false")
    assert not any(isinstance(cb, FederatedPlots) for cb in off.trainer.callbacks)
    assert glob.glob(str(tmp_path / "off/**/client_metrics.csv"), recursive=True)
    assert glob.glob(str(tmp_path / "off/**/participation.csv"), recursive=True)
    assert not glob.glob(str(tmp_path / "off/**/*.png"), recursive=True)
    on = _fit(recipe, tmp_path / "on")
    assert sum(isinstance(cb, FederatedPlots) for cb in on.trainer.callbacks) == 1
    names = {Path(p).name for p in glob.glob(str(tmp_path / "on/**/*.png"), recursive=True)}
    assert {"participation.png", "clients_test_acc.png"} <= names


SCRIPT = """
import lightning.pytorch as pl
from lightning_fl import MLP, Classifier, FederatedStrategy, UniformSampler
from lightning_fl.callbacks import FedAvg
from lightning_fl.datamodules import DigitsDataModule

pl.seed_everything(0)
datamodule = DigitsDataModule(num_clients=10, split=[0.8, 0.0, 0.2], seed=0)  # no validation
strategy = FederatedStrategy(sampler=UniformSampler(5), local_steps=2, seed=0)
trainer = pl.Trainer(max_epochs=2, strategy=strategy, callbacks=[FedAvg()])
trainer.fit(Classifier(network=MLP(64, (16,), 10)), datamodule=datamodule)
"""


def test_a_python_script_has_the_command_lines_quiet_console(tmp_path):
    """No Lightning tips, accelerator or seed lines, tensorboardX notice, progress bar
    without a terminal, or "Total length of `EvalRounds`" without a validation split; the
    last line names the run's folder (issue 38)."""
    (tmp_path / "run.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    env.pop("LIGHTNING_FL_VERBOSE", None)
    result = subprocess.run(
        [sys.executable, "run.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    console = result.stdout + result.stderr
    for noise in ("Tip:", "GPU available", "Seed set", "tensorboardX", "Total length",
                  "LeafSpec", "Round 1/1", "it/s"):  # fmt: skip
        assert noise not in console, noise
    last = result.stdout.strip().splitlines()[-1]
    assert last == f"Outputs: {tmp_path / 'lightning_logs' / 'version_0'}"
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").exists()
    header = (tmp_path / "lightning_logs/version_0/metrics.csv").read_text().splitlines()[0]
    assert "train_loss_epoch" in header and "val_" not in header  # validation skipped


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["predict"], "invalid choice: 'predict' (choose from 'fit', 'validate', 'test', 'data')"),
        (["fit", "--config", "nothere.yaml"], "--config nothere.yaml: no such file"),
        (["fit", "--traner.max_epochs", "3"], "unrecognized option --traner.max_epochs: "
         "options are spelled in full (`lightning-fl fit --help` lists them)"),
        (["fit", "--config=bad.yaml"], "--config bad.yaml: unknown top-level key 'modle': did "
         "you mean 'model'?"),
        (["fit", "--config", "broken.yaml"],
         "--config broken.yaml: not valid YAML at line 3 (expected ',' or ']'"),
        (["fit", "--config", "good.yaml", "--trainer.max_epochs", "3"], None),
        (["fit", "--config", "other.yaml"], None),  # a key it does not know: the full parser's
    ],
)  # fmt: skip
def test_the_console_script_answers_some_errors_before_importing_torch(
    argv, message, tmp_path, monkeypatch
):
    """Every error took about 12 s to appear, a typo included (issue 38): these take no
    import of torch or Lightning (lightning_fl/command.py)."""
    from lightning_fl.command import early_error

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("trainer:\n  max_epochs: 3\nmodle: {}\n")
    (tmp_path / "broken.yaml").write_text("trainer:\n max_epochs: [3\n")
    (tmp_path / "good.yaml").write_text("trainer:\n  max_epochs: 3\n")
    (tmp_path / "other.yaml").write_text("trainer: {}\nfuture_lightning_key: 1\n")
    found = early_error(argv)
    assert found == message if message is None else found.startswith(message), found


def test_help_and_early_errors_import_neither_torch_nor_lightning(tmp_path):
    code = (
        "import sys\nfrom lightning_fl.command import main\n"
        "for argv in (['--help'], ['predict'], ['fit', '--config', 'nothere.yaml']):\n"
        "    try:\n        main(argv)\n    except SystemExit as stop:\n"
        "        print(stop.code, 'torch' in sys.modules, 'lightning' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.splitlines()[-3:] == ["0 False False", "2 False False", "2 False False"]
    assert "lightning-fl fit --help" in result.stdout  # the usage names the full help
    assert result.stderr.count("error: ") == 2
