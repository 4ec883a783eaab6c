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


def test_cox_loss_equals_flamby_loop_formulation():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(12, generator=g)
    events = (torch.rand(12, generator=g) > 0.4).float()
    times = torch.randint(0, 6, (12,), generator=g).float()  # with ties
    order = sorted(range(12), key=lambda i: -times[i].item())  # stable, as Python's sorted
    s, e = scores[order], events[order]
    expected = torch.zeros(12)
    for i in range(12):
        expected[i] = torch.logsumexp(s[: i + 1] - s[i], dim=0) * e[i]
    assert torch.allclose(cox_partial_likelihood_loss(scores, events, times), expected.mean())


def test_concordance_index_by_hand():
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    e = torch.tensor([1.0, 1.0, 0.0, 1.0])
    # comparable pairs: (0,1) (0,2) (0,3) (1,2) (1,3); the censored 2 is never first
    assert concordance_index(t, torch.tensor([4.0, 3.0, 2.0, 1.0]), e) == 1.0
    assert concordance_index(t, torch.tensor([1.0, 2.0, 3.0, 4.0]), e) == 0.0
    assert concordance_index(t, torch.tensor([1.0, 1.0, 1.0, 1.0]), e) == 0.5
    assert concordance_index(t, torch.tensor([4.0, 3.0, 5.0, 1.0]), e) == 3 / 5
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
        FedHeartDiseaseDataModule(root=str(tmp_path))
    (tmp_path / "processed.va.data").unlink()
    with pytest.raises(FileNotFoundError, match="missing processed.va.data.*download=True"):
        FedHeartDiseaseDataModule(root=str(tmp_path))


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
        NaturalSplitDataModule(str(tmp_path / "all.csv"), ["label"], center_column="site")
    with pytest.raises(ValueError, match="no column 'target'"):
        NaturalSplitDataModule(str(tmp_path / "all.csv"), ["target"], center_column="hospital")


FLAMBY_RECIPES = sorted((ROOT / "recipes" / "flamby").glob("*.yaml"))


@pytest.mark.parametrize("recipe", FLAMBY_RECIPES, ids=[r.stem for r in FLAMBY_RECIPES])
def test_flamby_recipes_run_shortened(recipe, tmp_path):
    root = HEART if recipe.stem.startswith("heart") else TCGA
    if not root.exists():
        pytest.skip(f"real data not found at {root}")
    args = ["fit", "--config", str(recipe), "--data.init_args.root", str(root),
            "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(tmp_path),
            "--trainer.logger.init_args.save_dir", str(tmp_path)]  # fmt: skip
    if "pooled" not in recipe.stem:
        args += ["--trainer.strategy.init_args.local_steps", "5"]
    cli = run(args)
    metric = "test_acc" if recipe.stem.startswith("heart") else "test_cindex"
    assert 0.0 <= float(cli.trainer.callback_metrics[metric]) <= 1.0
