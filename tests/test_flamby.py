"""FLamby-style natural splits: real files from ../shared/data, malformed input, Cox/C-index."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fl.cli import run
from lightning_fl.datamodules import (
    FedHeartDiseaseDataModule,
    FedTcgaBrcaDataModule,
    NaturalSplitDataModule,
)
from lightning_fl.datamodules.download import ChecksumError
from lightning_fl.datamodules.flamby import heart_disease_tables, train_test_indices
from lightning_fl.survival import concordance_index, cox_partial_likelihood_loss

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
HEART, TCGA = SHARED / "fed_heart_disease", SHARED / "fed_tcga_brca"
needs_heart = pytest.mark.skipif(not HEART.exists(), reason=f"real data not found at {HEART}")
needs_tcga = pytest.mark.skipif(not TCGA.exists(), reason=f"real data not found at {TCGA}")


@needs_heart
def test_heart_disease_matches_flamby_counts_and_normalization():
    dm = FedHeartDiseaseDataModule(root=str(HEART))
    assert dm.sample_counts("train") == [199, 172, 30, 85]
    assert dm.sample_counts("test") == [104, 89, 16, 45]
    assert sum(dm.sample_counts("train")) + sum(dm.sample_counts("test")) == 740
    x, y = dm.client_dataset(0, "train")[:]
    assert x.shape == (199, 13) and set(y.tolist()) == {0.0, 1.0}
    assert torch.allclose(x.mean(0), torch.zeros(13), atol=1e-5)
    assert torch.allclose(x.std(0), torch.ones(13), atol=1e-4)
    assert len(dm.pooled_dataset("train")) == 486  # FLamby's get_nb_max_rounds constant


@needs_heart
def test_heart_split_equals_scikit_learn_train_test_split():
    sklearn = pytest.importorskip("sklearn.model_selection")
    for table in heart_disease_tables(HEART):
        y = table["y"]
        stratify = y if min(np.bincount(y)) > 2 else None  # FLamby: Switzerland has 1 negative
        train, _ = sklearn.train_test_split(
            np.arange(len(y)), test_size=1 - 0.66, train_size=0.66, random_state=43,
            shuffle=True, stratify=stratify,
        )  # fmt: skip
        assert set(np.flatnonzero(table["train"])) == set(train)


@pytest.mark.parametrize("stratify", [False, True])
@pytest.mark.parametrize("n", [10, 47, 100])
def test_split_reimplementation_is_bit_exact(stratify, n):
    sklearn = pytest.importorskip("sklearn.model_selection")
    y = (np.arange(n) % 3 == 0).astype(int) if stratify else None
    ours = train_test_indices(y, n, 0.66, 43)
    theirs = sklearn.train_test_split(
        np.arange(n), test_size=1 - 0.66, train_size=0.66, random_state=43, stratify=y
    )
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))


@needs_tcga
def test_tcga_brca_matches_flamby_split():
    dm = FedTcgaBrcaDataModule(root=str(TCGA))
    assert dm.num_clients == 6
    assert sum(dm.sample_counts("train")) == 866 == len(dm.pooled_dataset("train"))
    assert len(dm.pooled_dataset("test")) == 222
    x, target = dm.client_dataset(0, "test")[:]
    assert x.shape[1] == 39 and target.shape[1] == 2
    assert set(target[:, 0].tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("n", [12, 300])
def test_cox_loss_equals_flamby_loop_formulation(n):
    """With ties (300 samples over 3 times: large enough that an unstable sort reorders
    them), a tied sample's risk set is every sample before it in input order."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(n, generator=g)
    events = (torch.rand(n, generator=g) > 0.4).float()
    times = torch.randint(0, 6 if n < 100 else 3, (n,), generator=g).float()  # with ties
    order = sorted(range(n), key=lambda i: -times[i].item())  # stable, as Python's sorted
    s, e = scores[order], events[order]
    expected = torch.zeros(n)
    for i in range(n):
        expected[i] = torch.logsumexp(s[: i + 1] - s[i], dim=0) * e[i]
    assert torch.allclose(cox_partial_likelihood_loss(scores, events, times), expected.mean())


def test_concordance_index_by_hand():
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    e = torch.tensor([1.0, 1.0, 0.0, 1.0])
    # comparable pairs: (0,1) (0,2) (0,3) (1,2) (1,3); the censored 2 is never first
    assert concordance_index(t, torch.tensor([4.0, 3.0, 2.0, 1.0]), e) == 1.0
    assert concordance_index(t, torch.tensor([1.0, 2.0, 3.0, 4.0]), e) == 0.0
    assert concordance_index(t, torch.tensor([1.0, 1.0, 1.0, 1.0]), e) == 0.5
    c = concordance_index(t, torch.tensor([4.0, 3.0, 5.0, 1.0]), e)
    assert type(c) is float and c == 3 / 5
    tied = torch.tensor([2.0, 2.0])
    assert concordance_index(tied, torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0])) == 1.0


def test_malformed_heart_file_names_file_and_line(tmp_path):
    bad = tmp_path / "processed.cleveland.data"
    bad.write_text("63.0,1.0,1.0\n")
    from lightning_fl.datamodules.flamby import read_heart_center

    with pytest.raises(ValueError, match=r"processed.cleveland.data, line 1: expected 14 columns"):
        read_heart_center(bad)


@needs_heart
def test_checksum_mismatch_and_missing_files_name_the_file(tmp_path):
    for f in HEART.glob("*.data"):
        shutil.copy(f, tmp_path / f.name)
    with open(tmp_path / "processed.va.data", "a") as handle:
        handle.write("1,1,1,1,1,1,1,1,1,1,1,1,1,1\n")
    with pytest.raises(ChecksumError, match="processed.va.data: sha256 is"):
        FedHeartDiseaseDataModule(root=str(tmp_path)).setup()
    (tmp_path / "processed.va.data").unlink()
    with pytest.raises(FileNotFoundError, match="missing processed.va.data.*download=True"):
        FedHeartDiseaseDataModule(root=str(tmp_path)).setup()


def test_tcga_wrong_columns_names_the_file(tmp_path):
    (tmp_path / "brca.csv").write_text("pid,age,E\nA,1,0\n")
    (tmp_path / "train_test_split.csv").write_text("pid,fold,fold2\nA,train,train_0\n")
    from lightning_fl.datamodules.flamby import tcga_brca_tables

    with pytest.raises(ValueError, match="brca.csv: expected columns pid, 39 covariates, E, T"):
        tcga_brca_tables(tmp_path)


def _table(path: Path, centers=("a", "b"), n=20, with_center=True):
    rng = np.random.default_rng(0)
    lines = ["hospital,f1,f2,label" if with_center else "f1,f2,label"]
    for c in centers:
        for i in range(n):
            row = [f"{rng.normal():.4f}", f"{rng.normal():.4f}", str(i % 2)]
            lines.append(",".join(([c] if with_center else []) + row))
    path.write_text("\n".join(lines) + "\n")


def test_natural_split_from_a_table_and_from_a_folder(tmp_path):
    _table(tmp_path / "all.csv")
    dm = NaturalSplitDataModule(str(tmp_path / "all.csv"), ["label"], center_column="hospital")
    assert dm.num_clients == 2 and dm.center_names == ["a", "b"]
    assert dm.sample_counts("train") == [15, 15] and dm.sample_counts("test") == [5, 5]
    folder = tmp_path / "centers"
    folder.mkdir()
    for c in ("x", "y", "z"):
        _table(folder / f"{c}.csv", centers=(c,), with_center=False)
    dm = NaturalSplitDataModule(str(folder), ["label"])
    assert dm.center_names == ["x", "y", "z"]
    x, y = dm.client_dataset(2, "train")[:]
    assert x.shape == (15, 2) and y.dtype == torch.int64
    with pytest.raises(ValueError, match="all.csv: no center column 'site'"):
        NaturalSplitDataModule(str(tmp_path / "all.csv"), ["label"], center_column="site").setup()
    with pytest.raises(ValueError, match="no column 'target'"):
        NaturalSplitDataModule(
            str(tmp_path / "all.csv"), ["target"], center_column="hospital"
        ).setup()


def test_natural_split_refuses_to_normalize_a_center_with_one_training_row(tmp_path):
    rows = ["site,f1,f2,label", "a,1,2,0", "a,2,3,1", "a,3,1,0", "a,0,1,1", "b,5,5,1", "b,4,4,0"]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    args = (str(tmp_path / "t.csv"), ["label"])
    with pytest.raises(ValueError, match="center 'b' has 1 training row.*normalize=False"):
        NaturalSplitDataModule(*args, center_column="site", test_fraction=0.5).setup()
    dm = NaturalSplitDataModule(*args, center_column="site", test_fraction=0.5, normalize=False)
    assert torch.isfinite(dm.client_dataset(1, "train")[:][0]).all()


#: The simulation recipes; heart_silos.yaml (4 processes) runs in tests/test_silos.py.
FLAMBY_RECIPES = sorted(
    p for p in (ROOT / "recipes" / "flamby").glob("*.yaml") if "silos" not in p.stem
)


#: FLamby's flamby/config_heart_disease.json and config_tcga_brca.json (client lr, server
#: lr, FedProx μ), plus the pooled/local settings of its benchmark (Adam at the dataset's
#: LR, NUM_EPOCHS_POOLED epochs: 50 heart, 30 tcga).
FLAMBY_CONFIG = {
    "heart_fedavg": {"lr": 0.001},
    "heart_fedprox": {"lr": 0.001, "mu": 0.01},
    "heart_scaffold": {"lr": 0.001, "server_lr": 1.0},
    "heart_fedadam": {"lr": 0.01, "server_lr": 0.01, "tau": 1e-8},
    "heart_fedyogi": {"lr": 0.003162, "server_lr": 0.01, "tau": 1e-8},
    "heart_fedadagrad": {"lr": 0.003162, "server_lr": 0.316228, "tau": 1e-8},
    "heart_local": {"lr": 0.001, "optimizer": "adam", "local_epochs": 50},
    "heart_pooled": {"lr": 0.001, "optimizer": "adam", "rounds": 50},
    "tcga_fedavg": {"lr": 0.1},
    "tcga_fedprox": {"lr": 0.1, "mu": 0.1},
    "tcga_scaffold": {"lr": 0.01, "server_lr": 1.0},
    "tcga_fedadam": {"lr": 0.01, "server_lr": 0.1, "tau": 1e-8},
    "tcga_fedyogi": {"lr": 0.01, "server_lr": 0.1, "tau": 1e-8},
    "tcga_fedadagrad": {"lr": 0.01, "server_lr": 1.0, "tau": 1e-8},
    "tcga_local": {"lr": 0.1, "optimizer": "adam", "local_epochs": 30},
    "tcga_pooled": {"lr": 0.1, "optimizer": "adam", "rounds": 30},
}


def _recipe_settings(recipe: Path) -> dict:
    """The FLamby-relevant settings written in a recipe file."""
    import yaml

    config = yaml.safe_load(recipe.read_text())
    model = config["model"]["init_args"]
    found = {
        "lr": model["lr"],
        "optimizer": model.get("optimizer", "sgd"),
        "local_epochs": config["trainer"]["strategy"]["init_args"].get("local_epochs"),
        "rounds": config["trainer"]["max_epochs"],
    }
    for cb in config["trainer"]["callbacks"]:
        name, options = cb["class_path"].rsplit(".", 1)[1], cb.get("init_args", {})
        if name == "SCAFFOLD":
            assert options["control_weighting"] == "target"  # c = Σ p_i c_i, as FLamby
        elif name in ("FedAdam", "FedYogi", "FedAdagrad"):
            assert options["initial_second_moment"] == 0.0  # FLamby's FedOpt: v starts at 0
        found.update({k: v for k, v in options.items() if k in ("server_lr", "mu", "tau")})
    return found


@pytest.mark.parametrize("recipe", FLAMBY_RECIPES, ids=[r.stem for r in FLAMBY_RECIPES])
def test_flamby_recipes_use_flamby_settings_and_report_per_client_means(recipe, tmp_path):
    """The recipe's hyper-parameters are FLamby's; a shortened run's test_<metric>/uniform
    is the mean over centers of the final model (Local: each center's own model) scored
    on each whole test set."""
    settings = _recipe_settings(recipe)
    for key, value in FLAMBY_CONFIG[recipe.stem].items():
        assert settings[key] == pytest.approx(value), (recipe.stem, key)
    root = HEART if recipe.stem.startswith("heart") else TCGA
    if not root.exists():
        pytest.skip(f"real data not found at {root}")
    cli = run(
        ["fit", "--config", str(recipe), "--data.init_args.root", str(root),
         "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "1",
         "--trainer.default_root_dir", str(tmp_path),
         "--trainer.logger.init_args.save_dir", str(tmp_path), *_shortened(recipe.stem)]
    )  # fmt: skip
    metric = "acc" if recipe.stem.startswith("heart") else "cindex"
    strategy, dm, model = cli.trainer.strategy, cli.datamodule, cli.model
    local = next((cb for cb in cli.trainer.callbacks if type(cb).__name__ == "Local"), None)
    by_hand = []
    with torch.no_grad():
        for c in range(dm.num_clients):
            if local is not None:
                assert local.models.load(strategy.client_store, c, strategy.federated_tensors)
            _, metrics = model.loss_and_metrics(dm.client_dataset(c, "test")[:])
            by_hand.append(float(metrics[metric]))
    reported = float(cli.trainer.callback_metrics[f"test_{metric}/uniform"])
    assert reported == pytest.approx(sum(by_hand) / len(by_hand), abs=1e-6)


def _shortened(stem: str) -> list[str]:
    if "local" in stem:
        return ["--trainer.strategy.init_args.local_epochs", "1"]
    if "pooled" in stem:
        return []
    return ["--trainer.strategy.init_args.local_steps", "5"]
