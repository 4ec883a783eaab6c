"""FLamby-style natural splits: Fed-Heart-Disease, Fed-TCGA-BRCA and any table with a
center column (du Terrail et al., "FLamby", NeurIPS 2022 Datasets & Benchmarks).

Preprocessing and train/test splits follow FLamby's dataset code exactly (the files,
their columns and their centers: the README's "FLamby reference recipes").
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from lightning_fl.datamodules.download import download, require_download_root, verify
from lightning_fl.datamodules.in_memory import ClientTensors, InMemoryFederatedDataModule
from lightning_fl.engine.data_contract import Split, arguments

CACHE = Path(os.environ.get("LIGHTNING_FL_CACHE", Path.home() / ".cache" / "lightning_fl"))

# ----------------------------------------------------------------------------- splitting


def _approximate_mode(
    class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState
) -> np.ndarray:
    """Per-class draw counts closest to proportional, ties broken at random (as scikit-learn)."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            floored[rng.choice(inds, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def train_test_indices(
    labels: np.ndarray | None, num_samples: int, train_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's ``train_test_split(arange(n), train_size=f, test_size=1-f,
    random_state=seed, shuffle=True, stratify=labels)``, reimplemented bit for bit so the
    FLamby splits are reproduced without scikit-learn (checked against it in the tests)."""
    n_test = math.ceil((1.0 - train_fraction) * num_samples)
    n_train = math.floor(train_fraction * num_samples)
    rng = np.random.RandomState(seed)
    if labels is None:
        permutation = rng.permutation(num_samples)
        return permutation[n_test : n_test + n_train], permutation[:n_test]
    classes, y_indices = np.unique(labels, return_inverse=True)
    class_counts = np.bincount(y_indices)
    class_indices = np.split(np.argsort(y_indices, kind="mergesort"), np.cumsum(class_counts)[:-1])
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train, test = [], []
    for i in range(len(classes)):
        perm = class_indices[i].take(rng.permutation(class_counts[i]), mode="clip")
        train.extend(perm[: n_i[i]])
        test.extend(perm[n_i[i] : n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)


def _normalize(x: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """(x − mean) / (std + 1e-9) with the unbiased std of ``reference`` (FLamby)."""
    return (x - reference.mean(0)) / (reference.std(0, ddof=1) + 1e-9)


def _read_csv_rows(path: Path) -> list[list[str]]:
    try:
        with open(path, newline="") as handle:
            return [row for row in csv.reader(handle) if row]
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ValueError(f"{path}: cannot be read as CSV ({err}).") from err


def _check_files(
    root: Path,
    files: dict[str, str],
    download_from: dict[str, str] | None,
    named: Path | str | None,
) -> None:
    """Raise naming the missing ``files`` of ``root``, or download them (``download_from``)
    into it; ``named``: the ``root=`` the user gave (None: the cache), which must exist."""
    missing = [name for name in files if not (root / name).exists()]
    if missing and download_from is not None:
        require_download_root(named)
        for name in missing:
            download(download_from[name], root / name, files[name])
        missing = []
    if missing:
        raise FileNotFoundError(
            f"{root}: missing {', '.join(missing)}. Pass root= the folder that holds them, or "
            "download=True to fetch them from the official source."
        )
    for name, sha in files.items():
        verify(root / name, sha)


# ----------------------------------------------------------------------------- Fed-Heart-Disease

HEART_CENTERS = ("cleveland", "hungarian", "switzerland", "va")
HEART_SHA256 = {
    "processed.cleveland.data": "a74b7efa387bc9d108d7d0115d831fe9b414b29ae7124f331b622b4efa0427c8",
    "processed.hungarian.data": "d1ad108f785768cd3d7e82dc522e6f5a61eea93cccfb3a46ee8076f73fc3d796",
    "processed.switzerland.data": (
        "834a405ccf5b66ab4056bb77794adc8df0b7125186454c0a1d002d33c6c3b314"
    ),
    "processed.va.data": "e7c93d8d0d2acdadfa4c5e8de768e2191e7f618b952e29623f1f0d5949ff6b8f",
}
HEART_URLS = {
    name: f"https://archive.ics.uci.edu/ml/machine-learning-databases/heart-disease/{name}"
    for name in HEART_SHA256
}


def read_heart_center(path: str | os.PathLike) -> np.ndarray:
    """One UCI "processed" file: 14 comma-separated columns, ``?`` for missing (NaN)."""
    path = Path(path)
    table = []
    for line_no, row in enumerate(_read_csv_rows(path), start=1):
        if len(row) != 14:
            raise ValueError(f"{path}, line {line_no}: expected 14 columns, got {len(row)}.")
        try:
            table.append([math.nan if v.strip() == "?" else float(v) for v in row])
        except ValueError as err:
            raise ValueError(f"{path}, line {line_no}: not a number ({err}).") from err
    if not table:
        raise ValueError(f"{path}: no rows.")
    return np.asarray(table, dtype=np.float64)


#: The levels of the one-hot encoded columns 2 (chest pain type) and 6 (resting ECG) after
#: the first, over the four centers' complete rows: the encoding every silo shares, so that
#: a silo encodes its own file without reading the others (tests check it against the data).
HEART_LEVELS = {2: (2.0, 3.0, 4.0), 6: (1.0, 2.0)}


def heart_disease_tables(
    root: str | os.PathLike,
    centers: Sequence[str] = HEART_CENTERS,
    levels: dict[int, Sequence[float]] | None = None,
) -> list[dict[str, np.ndarray]]:
    """FLamby's Fed-Heart-Disease preprocessing, per center of ``centers`` (Cleveland,
    Hungary, Switzerland, VA Long Beach): drop columns 10-12, drop rows with a missing value,
    binarize the label (> 0 → 1), one-hot encode columns 2 and 6 over ``levels`` (default:
    the levels of the centers read, first level dropped, as FLamby; dummies appended after
    the other columns), and a 66/34 train/test split per center, stratified by label,
    random_state 43. Opens only the files of ``centers``.

    Returns raw (unnormalized) ``x`` (n, 13), ``y`` (n,) and ``train`` (bool mask).
    """
    root = Path(root)
    tables = []
    for name in centers:
        table = np.delete(read_heart_center(root / f"processed.{name}.data"), [10, 11, 12], axis=1)
        tables.append(table[~np.isnan(table).any(axis=1)])
    if levels is None:
        levels = {c: np.unique(np.concatenate([t[:, c] for t in tables]))[1:] for c in (2, 6)}
    levels = {c: np.asarray(v, dtype=np.float64) for c, v in levels.items()}
    centers = tables
    keep = [c for c in range(10) if c not in (2, 6)]
    out = []
    for table in centers:
        dummies = [(table[:, c : c + 1] == levels[c][None, :]) for c in (2, 6)]
        x = np.concatenate([table[:, keep], *dummies], axis=1).astype(np.float32)
        y = (table[:, 10] > 0).astype(np.int64)
        stratify = y if len(np.unique(y)) > 1 and min(np.bincount(y)) > 2 else None
        train_idx, _ = train_test_indices(stratify, len(y), 0.66, 43)
        mask = np.zeros(len(y), dtype=bool)
        mask[train_idx] = True
        out.append({"x": x, "y": y, "train": mask})
    return out


class _TabularCenters(InMemoryFederatedDataModule):
    """Clients given as per-center ``{train: (x, y), test: (x, y)}`` plus a pooled version
    with its own preprocessing (FLamby normalizes pooled data with pooled statistics), both
    read by a subclass's :meth:`read_centers` at set-up or first use."""

    def __init__(self, batch_size: int, eval_batch_size: int | None) -> None:
        super().__init__(None, batch_size, eval_batch_size)
        self._pooled: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def read_centers(self) -> tuple[list[ClientTensors], dict[str, tuple[torch.Tensor, ...]]]:
        """Every center's tensors, and the pooled ones by split."""
        raise NotImplementedError

    def read_clients(self):
        clients, self._pooled = self.read_centers()
        return clients, None

    @property
    def pooled(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The pooled data by split (the centralized baseline's)."""
        self._data()
        return self._pooled

    def pooled_dataset(self, split: Split = "train") -> Dataset:
        return TensorDataset(*self.pooled[split])


class FedHeartDiseaseDataModule(_TabularCenters):
    """Fed-Heart-Disease: 4 hospitals, 740 patients, 13 features, binary label.

    Features are normalized with each center's training mean and std; the pooled dataset
    (centralized baseline) uses the pooled training statistics, as in FLamby. FLamby's
    benchmark: batch size 4, Adam lr 1e-3, logistic regression, accuracy. There is no
    validation split: evaluation is on each center's test set.

    In silo mode (``FederatedStrategy(silos=True)``), process r holds the centers c with
    c % world_size == r and opens only their files, in ``root`` with ``{rank}`` replaced by
    r and ``{silo}`` by the site's name (``root: data/heart/{silo}`` gives each site its own
    folder: :meth:`~lightning_fl.engine.data_contract.FederatedDataModule.silo_folder`); the
    one-hot encoding is :data:`HEART_LEVELS`, the same as the four files give.
    """

    def __init__(
        self,
        root: str | None = None,
        download: bool = False,
        normalize: bool = True,
        batch_size: int = 4,
        eval_batch_size: int | None = 1024,
    ) -> None:
        self._args = arguments(locals())
        super().__init__(batch_size, eval_batch_size)
        self.root = Path(root) if root else CACHE / "fed_heart_disease"
        self.save_hyperparameters()

    def _files(self) -> tuple[Path, dict[str, str]]:
        """The folder and the files (name → SHA-256) this process reads: this silo's, or all
        four."""
        if self.silo is None:
            if self.per_silo(self.root):
                self.silo_folder(self.root)  # refused, naming the setting it needs
            return self.root, HEART_SHA256
        names = [HEART_CENTERS[c] for c in range(len(HEART_CENTERS)) if self.owns(c)]
        files = {f"processed.{name}.data": HEART_SHA256[f"processed.{name}.data"] for name in names}
        return self.silo_folder(self.root), files

    def prepare_data(self) -> None:
        """Check the files, downloading the missing ones with ``download=True``."""
        root, files = self._files()
        named = root if self._args.root is not None else None  # this silo's, resolved
        _check_files(root, files, HEART_URLS if self._args.download else None, named)

    @property
    def num_clients(self) -> int:
        return len(HEART_CENTERS)

    def read_centers(self):
        """Read the four tables and normalize each center's features with its own training
        statistics (the pooled version with the pooled ones); in silo mode, this silo's
        tables only (no pooled version)."""
        self.prepare_data()
        if self.silo is not None:
            return self._read_silo(), {}
        normalize, clients = self._args.normalize, []
        tables = heart_disease_tables(self.root)
        pooled_train = np.concatenate([t["x"][t["train"]] for t in tables])
        pooled: dict[str, list] = {"train": [], "test": []}
        for t in tables:
            parts = {"train": t["train"], "test": ~t["train"]}
            center = {}
            for split, mask in parts.items():
                x = t["x"][mask]
                xc = _normalize(x, t["x"][t["train"]]) if normalize else x
                xp = _normalize(x, pooled_train) if normalize else x
                y = torch.from_numpy(t["y"][mask]).float()
                center[split] = (torch.from_numpy(xc).float(), y)
                pooled[split].append((torch.from_numpy(xp).float(), y))
            clients.append(center)
        return clients, {s: tuple(torch.cat(v) for v in zip(*p)) for s, p in pooled.items()}

    def _read_silo(self) -> list[ClientTensors]:
        """This silo's centers, each normalized with its own training statistics; the other
        centers' entries are empty (their data is not here)."""
        root, _ = self._files()
        mine = [c for c in range(len(HEART_CENTERS)) if self.owns(c)]
        tables = heart_disease_tables(root, [HEART_CENTERS[c] for c in mine], HEART_LEVELS)
        clients: list[ClientTensors] = [{} for _ in HEART_CENTERS]
        for c, t in zip(mine, tables):
            train_x = t["x"][t["train"]]
            for split, mask in (("train", t["train"]), ("test", ~t["train"])):
                x = _normalize(t["x"][mask], train_x) if self._args.normalize else t["x"][mask]
                y = torch.from_numpy(t["y"][mask]).float()
                clients[c][split] = (torch.from_numpy(x).float(), y)
        return clients


# ----------------------------------------------------------------------------- Fed-TCGA-BRCA

TCGA_SHA256 = {
    "brca.csv": "07cb53423f7d579d33cfdbf2cba57b2aee75318b85866c68ce39a75b1f1ba020",
    "train_test_split.csv": "1249c6543a4060ff0fdaf8510fc37017755836db6c9fc5e6af96057c36510990",
}
_FLAMBY_RAW = "https://raw.githubusercontent.com/owkin/FLamby/main/flamby/datasets/fed_tcga_brca"
TCGA_URLS = {
    "brca.csv": f"{_FLAMBY_RAW}/brca.csv",
    "train_test_split.csv": f"{_FLAMBY_RAW}/dataset_creation_scripts/train_test_split.csv",
}


def tcga_brca_tables(
    root: str | os.PathLike,
) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """FLamby's Fed-TCGA-BRCA: 39 covariates and (E, T) per patient; client k's train/test
    rows are those with ``fold2 == "{train,test}_k"``, the pooled ones ``fold == split``,
    in brca.csv order. Keys: ``"0".."5"`` and ``"pooled"``."""
    root = Path(root)
    rows = _read_csv_rows(root / "brca.csv")
    header, body = rows[0], rows[1:]
    if len(header) != 42 or header[0] != "pid" or header[-2:] != ["E", "T"]:
        raise ValueError(
            f"{root / 'brca.csv'}: expected columns pid, 39 covariates, E, T; got "
            f"{len(header)} columns starting {header[:2]} and ending {header[-2:]}."
        )
    split_rows = _read_csv_rows(root / "train_test_split.csv")
    if split_rows[0][:3] != ["pid", "fold", "fold2"]:
        raise ValueError(f"{root / 'train_test_split.csv'}: expected columns pid, fold, fold2.")
    fold = {r[0]: (r[1], r[2]) for r in split_rows[1:]}
    try:
        values = np.asarray([[float(v) for v in r[1:]] for r in body], dtype=np.float64)
    except ValueError as err:
        raise ValueError(f"{root / 'brca.csv'}: non-numeric covariate ({err}).") from err
    pids = [r[0] for r in body]  # patients absent from the split file are left out, as in FLamby
    out: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    groups = [str(k) for k in range(6)] + ["pooled"]
    for group in groups:
        out[group] = {}
        for split in ("train", "test"):
            if group == "pooled":
                mask = np.array([fold.get(p, ("", ""))[0] == split for p in pids])
            else:
                mask = np.array([fold.get(p, ("", ""))[1] == f"{split}_{group}" for p in pids])
            out[group][split] = (values[mask, :39], values[mask, 39:41])
    return out


class FedTcgaBrcaDataModule(_TabularCenters):
    """Fed-TCGA-BRCA: 1,088 patients in 6 regions, 39 covariates, survival (E, T).

    FLamby's benchmark: Cox model Linear(39, 1), batch size 8, Adam lr 0.1, C-index. There
    is no validation split; each client's test set is evaluated as one batch (C-index).
    """

    def __init__(
        self,
        root: str | None = None,
        download: bool = False,
        batch_size: int = 8,
        eval_batch_size: int | None = 4096,
    ) -> None:
        self._args = arguments(locals())
        super().__init__(batch_size, eval_batch_size)
        self.root = Path(root) if root else CACHE / "fed_tcga_brca"
        self.save_hyperparameters()

    def prepare_data(self) -> None:
        """Check the two files, downloading the missing ones with ``download=True``."""
        urls = TCGA_URLS if self._args.download else None
        _check_files(self.root, TCGA_SHA256, urls, self._args.root)

    def read_centers(self):
        """Read the table and FLamby's split into the 6 regions' and the pooled tensors."""
        if self.silo is not None:
            raise ValueError(
                "Fed-TCGA-BRCA ships one table of every region, which no silo may hold: "
                "split it into one CSV per region and read them with "
                "NaturalSplitDataModule(path=..., centers=[...]) in silo mode."
            )
        self.prepare_data()
        tables = tcga_brca_tables(self.root)

        def tensors(pair):
            return tuple(torch.from_numpy(a).float() for a in pair)

        clients = [
            {split: tensors(tables[str(k)][split]) for split in ("train", "test")} for k in range(6)
        ]
        return clients, {split: tensors(tables["pooled"][split]) for split in ("train", "test")}


# ----------------------------------------------------------------------------- generic


class NaturalSplitDataModule(_TabularCenters):
    """Any table with a center column becomes one client per center.

    Args:
        path: a CSV file with a header, or a folder of CSV files (one center per file, the
            center named by the file name).
        center_column: the column naming each row's center (ignored for a folder).
        target_columns: the label column(s); one integer column gives class labels.
        feature_columns: the feature columns (default: all others).
        test_fraction: per-center random test fraction (seeded, stratified when the target
            is one column of labels).
        normalize: standardize features with each center's training statistics (mean and
            unbiased std, as FLamby); a center needs at least 2 training rows for that.
        centers: every center's name, in the clients' order (default: the names found,
            sorted). Needed in silo mode (``FederatedStrategy(silos=True)``), where process
            r holds the centers c with c % world_size == r and reads only their files,
            ``<path>/<name>.csv``, with ``{rank}`` in ``path`` replaced by r and ``{silo}``
            by the site's name.
    """

    def __init__(
        self,
        path: str,
        target_columns: list[str],
        center_column: str | None = None,
        feature_columns: list[str] | None = None,
        test_fraction: float = 0.25,
        normalize: bool = True,
        seed: int = 0,
        batch_size: int = 32,
        eval_batch_size: int | None = 1024,
        centers: list[str] | None = None,
    ) -> None:
        super().__init__(batch_size, eval_batch_size)
        self.centers = None if centers is None else list(centers)
        if not 0 < test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
        self.path, self.target_columns, self.center_column = (
            Path(path),
            target_columns,
            center_column,
        )
        self.feature_columns, self.test_fraction = feature_columns, test_fraction
        self.normalize, self.seed = normalize, seed
        self._center_names: list[str] = []

    @property
    def center_names(self) -> list[str]:
        """The centers' names, in the clients' order."""
        self._data()
        return self._center_names

    @property
    def num_clients(self) -> int:
        return len(self.centers) if self.centers is not None else len(self._clients)

    def read_centers(self):
        """Read the table(s), one client per center, and split and normalize each one; in
        silo mode, this silo's centers' files only (no pooled version)."""
        if self.silo is not None:
            return self._read_silo(), {}
        groups = self._read(self.path, self.center_column)
        names = sorted(groups) if self.centers is None else self.centers
        if set(names) != set(groups):
            raise ValueError(
                f"{self.path}: centers {sorted(groups)} found, {sorted(names)} named in "
                "centers: name every center once."
            )
        self._center_names = list(names)
        pooled: dict[str, list] = {"train": [], "test": []}
        clients = []
        for name in self._center_names:
            center = self._center(name, *groups[name])
            for split in ("train", "test"):
                pooled[split].append(center[split])
            clients.append(center)
        return clients, {s: tuple(torch.cat(v) for v in zip(*p)) for s, p in pooled.items()}

    def _read_silo(self) -> list[ClientTensors]:
        """This silo's centers, each from its own file; the others' entries stay empty."""
        if self.centers is None:
            raise ValueError(
                "NaturalSplitDataModule in silo mode needs centers=[...]: every center's "
                "name in the clients' order, the same list on every silo."
            )
        folder = self.silo_folder(self.path)
        if not folder.is_dir():
            raise ValueError(
                f"{folder}: in silo mode path is the folder of this silo's center files "
                "(<name>.csv), not one table of every center."
            )
        self._center_names = list(self.centers)
        clients: list[ClientTensors] = [{} for _ in self.centers]
        for c, name in enumerate(self.centers):
            if self.owns(c):
                source = folder / f"{name}.csv"
                rows = _read_csv_rows(source)
                clients[c] = self._center(name, rows[0], rows[1:], source)
        return clients

    def _center(
        self, name: str, header: list[str], rows: list[list[str]], source: Path
    ) -> ClientTensors:
        """One center's rows as train and test tensors, normalized with its training
        statistics."""
        target_columns, center_column = self.target_columns, self.center_column
        feature_columns, test_fraction = self.feature_columns, self.test_fraction
        normalize, seed = self.normalize, self.seed
        for col in [*target_columns, *(feature_columns or [])]:
            if col not in header:
                raise ValueError(f"{source}: no column {col!r}; columns are {header}.")
        features = feature_columns or [
            h for h in header if h not in target_columns and h != center_column
        ]
        try:
            x = np.asarray([[float(r[header.index(c)]) for c in features] for r in rows])
            y = np.asarray([[float(r[header.index(c)]) for c in target_columns] for r in rows])
        except ValueError as err:
            raise ValueError(f"{source}: non-numeric value ({err}).") from err
        labels = y[:, 0].astype(np.int64) if y.shape[1] == 1 else None
        stratify = (
            labels if labels is not None and min(np.bincount(labels - labels.min())) > 2 else None
        )
        train_idx, test_idx = train_test_indices(stratify, len(rows), 1 - test_fraction, seed)
        if normalize and len(train_idx) < 2:
            raise ValueError(
                f"{source}: center {name!r} has {len(train_idx)} training row(s); "
                "per-center normalization needs at least 2 to estimate a std. Add rows, "
                "merge the center with another, or set normalize=False."
            )
        center = {}
        for split, idx in (("train", train_idx), ("test", test_idx)):
            xs = _normalize(x[idx], x[train_idx]) if normalize else x[idx]
            ys = (
                torch.from_numpy(labels[idx])
                if labels is not None
                else torch.from_numpy(y[idx]).float()
            )
            center[split] = (torch.from_numpy(xs).float(), ys)
        return center

    @staticmethod
    def _read(
        path: Path, center_column: str | None
    ) -> dict[str, tuple[list[str], list[list[str]], Path]]:
        if path.is_dir():
            files = sorted(path.glob("*.csv"))
            if not files:
                raise ValueError(f"{path}: no .csv files (one per center expected).")
            groups = {}
            for f in files:
                rows = _read_csv_rows(f)
                groups[f.stem] = (rows[0], rows[1:], f)
            return groups
        rows = _read_csv_rows(path)
        if center_column is None or center_column not in rows[0]:
            raise ValueError(f"{path}: no center column {center_column!r}; columns are {rows[0]}.")
        col = rows[0].index(center_column)
        groups: dict[str, tuple[list[str], list[list[str]], Path]] = {}
        for row in rows[1:]:
            groups.setdefault(row[col], (rows[0], [], path))[1].append(row)
        return groups
