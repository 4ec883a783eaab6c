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


#: The simulation recipes; heart_silos.yaml (4 processes) runs in tests/test_silos.py and
#: heart_flower.yaml (3 sites on Flower) in tests/test_flower.py.
FLAMBY_RECIPES = sorted(
    p
    for p in (ROOT / "recipes" / "flamby").glob("*.yaml")
    if "silos" not in p.stem and "flower" not in p.stem
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
                assert local.models.load(strategy.client_store, c, strategy.fit.tensors)
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


@pytest.mark.parametrize(
    "counts, train_fraction, seed",
    [((7, 7, 7, 3), 0.5, 0), ((5, 4, 4, 4, 2), 0.66, 43), ((9, 6, 3), 0.3, 5), ((2, 2, 2), 0.5, 1)],
)
def test_stratified_split_breaks_remainder_ties_as_scikit_learn(counts, train_fraction, seed):
    """Classes whose proportional shares leave equal remainders: the ties are broken at
    random from the split's own RandomState, over several rounds of ties, as
    scikit-learn's ``_approximate_mode`` (both draws, the train counts and the test counts
    of what is left)."""
    sklearn = pytest.importorskip("sklearn.model_selection")
    y = np.repeat(np.arange(len(counts)), counts)
    np.random.default_rng(seed).shuffle(y)
    ours = train_test_indices(y, len(y), train_fraction, seed)
    theirs = sklearn.train_test_split(
        np.arange(len(y)), test_size=1 - train_fraction, train_size=train_fraction,
        random_state=seed, stratify=y,
    )  # fmt: skip
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))


HEART_CENTERS_ALL = ("cleveland", "hungarian", "switzerland", "va")


def _heart_copy(folder: Path, centers=HEART_CENTERS_ALL) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in centers:
        shutil.copy(HEART / f"processed.{name}.data", folder)
    return folder


@needs_heart
def test_heart_columns_dummies_and_both_normalizations_by_hand():
    """Columns 0, 1, 3, 4, 5, 7, 8, 9 of the complete rows, then the dummies of column 2
    (levels 2, 3, 4) and 6 (levels 1, 2), the label 1{column 13 > 0}; each center's
    features standardized with its training rows' mean and unbiased std (+ 1e-9, FLamby's:
    a feature constant on a center's training rows reads 0), the pooled version with the
    pooled training rows'."""
    from lightning_fl.datamodules.flamby import read_heart_center

    dm = FedHeartDiseaseDataModule(root=str(HEART))
    tables = heart_disease_tables(HEART)  # read once: only the train masks are used
    pooled_train, raw_by_center = [], []
    for c, name in enumerate(HEART_CENTERS_ALL):
        table = read_heart_center(HEART / f"processed.{name}.data")
        table = table[~np.isnan(np.delete(table, [10, 11, 12], axis=1)).any(axis=1)]
        raw = np.concatenate(
            [table[:, [0, 1, 3, 4, 5, 7, 8, 9]]]
            + [(table[:, [col]] == np.array(levels)).astype(float) for col, levels in
               ((2, (2.0, 3.0, 4.0)), (6, (1.0, 2.0)))],
            axis=1,
        )  # fmt: skip
        train = tables[c]["train"]
        mean, std = raw[train].mean(0), raw[train].std(0, ddof=1)
        x, y = dm.client_dataset(c, "test")[:]
        np.testing.assert_allclose(
            x.numpy(), (raw[~train] - mean) / (std + 1e-9), rtol=1e-5, atol=1e-5
        )
        assert y.tolist() == (table[~train, 13] > 0).astype(float).tolist()
        pooled_train.append(raw[train])
        raw_by_center.append(raw[~train])
    reference = np.concatenate(pooled_train)
    expected = (np.concatenate(raw_by_center) - reference.mean(0)) / (
        reference.std(0, ddof=1) + 1e-9
    )
    np.testing.assert_allclose(dm.pooled["test"][0].numpy(), expected, rtol=1e-5, atol=1e-5)
    unnormalized = FedHeartDiseaseDataModule(root=str(HEART), normalize=False)
    np.testing.assert_allclose(
        unnormalized.pooled["test"][0].numpy(), np.concatenate(raw_by_center)
    )
    assert dm.hparams["normalize"] is True


@needs_heart
@pytest.mark.parametrize("rank", [0, 1])
def test_heart_silo_reads_its_own_centers_from_its_own_folder(tmp_path, rank):
    """Silo ``rank`` of 2 holds centers ``rank`` and ``rank + 2``, reads only their files
    from ``root`` with ``{rank}`` replaced, and serves them exactly as the full module
    does; the other centers stay empty."""
    from lightning_fl.engine.data_contract import SiloError

    mine = [rank, rank + 2]
    _heart_copy(tmp_path / str(rank), [HEART_CENTERS_ALL[c] for c in mine])
    silo = FedHeartDiseaseDataModule(root=str(tmp_path / "{rank}"))
    silo.enter_silo(rank, 2)
    whole = FedHeartDiseaseDataModule(root=str(HEART))
    for c in mine:
        for split in ("train", "test"):
            got, want = silo.client_dataset(c, split)[:], whole.client_dataset(c, split)[:]
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(SiloError):
        silo.client_dataset(1 - rank, "train")
    (tmp_path / str(rank) / f"processed.{HEART_CENTERS_ALL[rank + 2]}.data").unlink()
    again = FedHeartDiseaseDataModule(root=str(tmp_path / "{rank}"))
    again.enter_silo(rank, 2)
    with pytest.raises(FileNotFoundError, match=f"missing processed.{HEART_CENTERS_ALL[rank + 2]}"):
        again.setup()


@needs_heart
def test_heart_download_fetches_only_the_missing_files(tmp_path, monkeypatch):
    from lightning_fl.datamodules import flamby

    urls = {
        f"processed.{n}.data": (HEART / f"processed.{n}.data").as_uri() for n in HEART_CENTERS_ALL
    }
    monkeypatch.setattr(flamby, "HEART_URLS", urls)
    _heart_copy(tmp_path / "root", ["va"])
    dm = FedHeartDiseaseDataModule(root=str(tmp_path / "root"), download=True)
    assert dm.sample_counts("train") == [199, 172, 30, 85]
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == sorted(urls)
    monkeypatch.setattr(flamby, "CACHE", tmp_path / "cache")
    assert FedHeartDiseaseDataModule().root == tmp_path / "cache" / "fed_heart_disease"


def _tcga_copy(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("brca.csv", "train_test_split.csv"):
        shutil.copy(TCGA / name, folder)
    return folder


@needs_tcga
def test_tcga_checks_its_files_at_setup_and_its_groups(tmp_path):
    from lightning_fl.datamodules.flamby import tcga_brca_tables

    root = _tcga_copy(tmp_path / "root")
    assert sorted(tcga_brca_tables(str(root))) == ["0", "1", "2", "3", "4", "5", "pooled"]
    (root / "train_test_split.csv").write_text(
        (root / "train_test_split.csv").read_text().replace("train_0", "test_0", 1)
    )
    with pytest.raises(ChecksumError, match="train_test_split.csv: sha256 is"):
        FedTcgaBrcaDataModule(root=str(root)).setup()
    (root / "train_test_split.csv").unlink()
    with pytest.raises(FileNotFoundError, match="missing train_test_split.csv"):
        FedTcgaBrcaDataModule(root=str(root)).setup()
    dm = FedTcgaBrcaDataModule(batch_size=3)
    assert dm.hparams["batch_size"] == 3 and dm.root.name == "fed_tcga_brca"


def test_tcga_split_file_needs_its_three_columns(tmp_path):
    from lightning_fl.datamodules.flamby import tcga_brca_tables

    header = ",".join(["pid", *[f"c{i}" for i in range(39)], "E", "T"])
    (tmp_path / "brca.csv").write_text(header + "\nA," + ",".join(["1"] * 41) + "\n")
    (tmp_path / "train_test_split.csv").write_text("pid,fold,fold2,site\nA,train,train_0,x\n")
    assert tcga_brca_tables(tmp_path)["0"]["train"][0].shape == (1, 39)  # more columns: fine
    (tmp_path / "train_test_split.csv").write_text("pid,fold,region\nA,train,train_0\n")
    with pytest.raises(ValueError, match="expected columns pid, fold, fold2"):
        tcga_brca_tables(tmp_path)


def _natural(path, **options):
    return NaturalSplitDataModule(str(path), ["label"], **options)


def test_natural_split_centers_by_hand(tmp_path):
    """Each center's rows split with ``train_test_indices`` (stratified when every label
    has more than 2 rows), normalized with its training rows; the pooled data are the
    centers' in order; ``centers`` fixes the clients' order."""
    from lightning_fl.datamodules.flamby import _normalize

    rng = np.random.default_rng(1)
    labels = {"b": [0] * 6 + [1] * 6 + [2] * 3, "a": [0] * 7 + [1] * 2 + [2] * 5}
    lines = ["site,f1,f2,label"]
    for site, ys in labels.items():
        lines += [f"{site},{rng.normal():.5f},{rng.normal() * 3:.5f},{y}" for y in ys]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    dm = _natural(tmp_path / "t.csv", center_column="site", test_fraction=0.4, seed=3,
                  centers=("b", "a"))  # fmt: skip
    assert dm.center_names == ["b", "a"] and dm.num_clients == 2
    pooled = {"train": [], "test": []}
    for c, site in enumerate(("b", "a")):
        rows = [line.split(",") for line in lines[1:] if line.startswith(site)]
        x = np.array([[float(r[1]), float(r[2])] for r in rows])
        y = np.array([int(r[3]) for r in rows])
        stratify = y if site == "b" else None  # center a has 2 rows of label 1
        train, test = train_test_indices(stratify, len(y), 0.6, 3)
        for split, idx in (("train", train), ("test", test)):
            got_x, got_y = dm.client_dataset(c, split)[:]
            np.testing.assert_allclose(got_x.numpy(), _normalize(x[idx], x[train]), rtol=1e-6)
            assert got_y.tolist() == y[idx].tolist()
            pooled[split].append(got_y)
    assert dm.pooled["test"][1].tolist() == torch.cat(pooled["test"]).tolist()
    with pytest.raises(ValueError, match=r"test_fraction must be in \(0, 1\)"):
        _natural(tmp_path / "t.csv", test_fraction=1.0)
    with pytest.raises(ValueError, match="name every center once"):
        _natural(tmp_path / "t.csv", center_column="site", centers=["a"]).setup()


def test_natural_split_stratifies_only_labels_with_more_than_two_rows(tmp_path):
    """Labels of 1 and 2 (not 0 and 1): ``bincount`` of labels shifted to start at 0; a
    label with exactly 2 rows turns stratification off, 3 rows keep it on."""
    for rows_of_two, stratified in ((2, False), (3, True)):
        ys = [1] * 8 + [2] * rows_of_two
        lines = ["f1,label"] + [f"{i * 1.5:.1f},{y}" for i, y in enumerate(ys)]
        (tmp_path / "c.csv").write_text("\n".join(lines) + "\n")
        dm = _natural(tmp_path, test_fraction=0.3, seed=2, normalize=False)
        y = np.array(ys)
        train, _ = train_test_indices(y if stratified else None, len(ys), 0.7, 2)
        assert dm.client_dataset(0, "train")[:][1].tolist() == y[train].tolist()


def test_natural_split_regression_targets_and_files_in_sorted_order(tmp_path):
    """Two target columns: float targets, no stratification. A folder's files are read in
    sorted order, whatever the file system lists first."""
    for name in ("m", "c", "q", "a", "k", "e", "o", "g", "i"):
        lines = ["f1,t1,t2"] + [f"{i},{i * 0.5},{len(name) + i}" for i in range(6)]
        (tmp_path / f"{name}.csv").write_text("\n".join(lines) + "\n")
    dm = NaturalSplitDataModule(str(tmp_path), ["t1", "t2"], normalize=False, test_fraction=0.5)
    assert dm.center_names == sorted("mcqakeogi")
    x, target = dm.client_dataset(0, "train")[:]
    assert target.dtype == torch.float32 and target[:, 0].tolist() == (x[:, 0] * 0.5).tolist()


def test_natural_split_silo_reads_its_own_center_files(tmp_path):
    """In silo mode, silo r of 2 reads ``path`` with ``{rank}`` → r and only its centers'
    files; their tensors equal the full module's on the same files."""
    from lightning_fl.engine.data_contract import SiloError

    names = ["north", "south", "east"]
    for rank in (0, 1):
        (tmp_path / f"silo{rank}").mkdir()
    full = tmp_path / "all"
    full.mkdir()
    for c, name in enumerate(names):
        lines = ["f1,f2,label"] + [f"{i * (c + 1)},{(i % 3) - c},{i % 2}" for i in range(10)]
        for folder in (tmp_path / f"silo{c % 2}", full):
            (folder / f"{name}.csv").write_text("\n".join(lines) + "\n")
    whole = _natural(full, centers=names)
    silo = _natural(tmp_path / "silo{rank}", centers=names)
    silo.enter_silo(0, 2)
    assert silo.num_clients == 3 and silo.center_names == names
    for c in (0, 2):
        got, want = silo.client_dataset(c, "train")[:], whole.client_dataset(c, "train")[:]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(SiloError):
        silo.client_dataset(1, "train")
    unnamed = _natural(tmp_path / "silo{rank}")
    unnamed.enter_silo(1, 2)
    with pytest.raises(ValueError, match="needs centers="):
        unnamed.setup()
    table = _natural(tmp_path / "silo0" / "north.csv", centers=names)
    table.enter_silo(0, 2)
    with pytest.raises(ValueError, match="north.csv: in silo mode path is the folder"):
        table.setup()


@pytest.mark.parametrize("positives, stratified", [(0, False), (2, False), (3, True), (5, True)])
def test_heart_split_stratifies_centers_with_both_labels_and_more_than_two_of_each(
    tmp_path, positives, stratified
):
    """FLamby stratifies a center's 66/34 split by label only when both labels have more
    than 2 rows (Switzerland has 1 negative); a center of one label is split at random."""
    from lightning_fl.datamodules.flamby import HEART_LEVELS

    rows = [
        f"{50 + i},1,{1 + i % 4},120,200,0,{i % 3},150,0,1.0,2,0,3,{int(i < positives)}"
        for i in range(14)
    ]
    (tmp_path / "processed.x.data").write_text("\n".join(rows) + "\n")
    (table,) = heart_disease_tables(tmp_path, ["x"], HEART_LEVELS)
    y = (np.arange(14) < positives).astype(np.int64)
    train, _ = train_test_indices(y if stratified else None, 14, 0.66, 43)
    assert table["y"].tolist() == y.tolist()
    assert np.flatnonzero(table["train"]).tolist() == sorted(train)


def test_heart_values_must_be_numbers_and_roots_may_be_strings(tmp_path):
    from lightning_fl.datamodules.flamby import HEART_LEVELS, read_heart_center

    row = "50,1,2,120,200,0,1,150,0,1.0,2,0,3,1"
    (tmp_path / "processed.x.data").write_text(f"{row}\n{row.replace('120', 'high')}\n")
    with pytest.raises(ValueError, match=r"processed.x.data, line 2: not a number"):
        read_heart_center(tmp_path / "processed.x.data")
    (tmp_path / "processed.x.data").write_text(f"{row}\n" * 6)
    (table,) = heart_disease_tables(str(tmp_path), ["x"], HEART_LEVELS)
    assert table["x"].shape == (6, 13)


def test_natural_split_orders_centers_by_name_and_owns_its_list(tmp_path):
    """Centers of a table are sorted by name (here "b" comes first in the file); a
    ``centers`` list changed after construction does not change the module."""
    _table(tmp_path / "t.csv", centers=("b", "a", "c"))
    assert _natural(tmp_path / "t.csv", center_column="hospital").center_names == ["a", "b", "c"]
    centers = ["c", "a", "b"]
    dm = _natural(tmp_path / "t.csv", center_column="hospital", centers=centers)
    centers.append("d")
    assert dm.num_clients == 3 and dm.center_names == ["c", "a", "b"]
