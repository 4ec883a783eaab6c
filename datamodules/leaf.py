"""LEAF benchmark datasets from LEAF's JSON output (Caldas et al., "LEAF: A Benchmark for
Federated Settings", 2018).

Every file is ``{"users": [...], "num_samples": [...], "user_data": {user: {"x", "y"}}}``,
under ``train/`` and ``test/`` (LEAF's ``preprocess.sh -t sample``) or ``all_data/`` (split
here per user). Produce the files with LEAF's own ``preprocess.sh``; this module reads them.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from lightning_fl.datamodules.partition import split_fractions
from lightning_fl.engine.data_contract import FederatedDataModule, Split, arguments

LeafName = Literal["femnist", "shakespeare", "sent140", "celeba", "synthetic"]

#: LEAF's Shakespeare vocabulary (models/utils/language_utils.py): 80 characters.
SHAKESPEARE_LETTERS = (
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
)
FEMNIST_PIXELS = 28 * 28
CELEBA_SIZE = 84


def read_leaf_file(path: str | Path) -> dict[str, dict[str, list]]:
    """``{user: {"x": [...], "y": [...]}}`` of one LEAF JSON file, checked against its
    ``users`` and ``num_samples``."""
    path = Path(path)
    try:
        content = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable LEAF JSON file ({err}).") from err
    missing = [k for k in ("users", "num_samples", "user_data") if k not in content]
    if missing:
        raise ValueError(f"{path}: missing key(s) {', '.join(missing)} of LEAF's format.")
    users, counts, data = content["users"], content["num_samples"], content["user_data"]
    if len(users) != len(counts):
        raise ValueError(f"{path}: {len(users)} users but {len(counts)} num_samples entries.")
    out = {}
    for user, count in zip(users, counts):
        entry = data.get(user)
        if entry is None or "x" not in entry or "y" not in entry:
            raise ValueError(f"{path}: user {user!r} has no user_data with x and y.")
        if not len(entry["x"]) == len(entry["y"]) == count:
            raise ValueError(
                f"{path}: user {user!r} has num_samples {count} but {len(entry['x'])} x and "
                f"{len(entry['y'])} y."
            )
        out[user] = {"x": list(entry["x"]), "y": list(entry["y"])}
    return out


def read_leaf_folder(folder: str | Path) -> dict[str, dict[str, list]]:
    """All ``*.json`` files of a folder, in sorted order; a user's samples are concatenated."""
    folder = Path(folder)
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"{folder}: no LEAF .json files. Run LEAF's preprocess.sh first.")
    users: dict[str, dict[str, list]] = {}
    for f in files:
        for user, entry in read_leaf_file(f).items():
            slot = users.setdefault(user, {"x": [], "y": []})
            slot["x"] += entry["x"]
            slot["y"] += entry["y"]
    return users


def _sent140_words(text: str) -> list[str]:
    """LEAF's ``split_line``: words and the punctuation marks .,!?; as tokens."""
    return re.findall(r"[\w']+|[.,!?;]", text)


class LeafDataModule(FederatedDataModule):
    """One client per LEAF user.

    Args:
        root: the dataset's ``data`` folder holding ``train/`` and ``test/`` (or ``all_data/``).
        dataset: which LEAF dataset the JSON holds; it decides how x and y are encoded.
        user_fraction: keep a random (seeded) fraction of the users.
        min_samples: drop users with fewer training samples.
        test_fraction: used only with ``all_data/``: each user's samples are split at random.
        val_fraction: each user's training samples held out for validation.
        image_root: CelebA's ``img_align_celeba`` folder (images are read with Pillow and
            resized to 84×84 RGB, as LEAF's model does).
        max_words: Sent140 sequence length (LEAF: 25); the vocabulary is the training words.
        max_users: keep only the first ``max_users`` users (in file order, after the other
            filters), as the asynchronous-FL experiments take "the first M users".
    """

    def __init__(
        self,
        root: str,
        dataset: LeafName = "femnist",
        user_fraction: float = 1.0,
        min_samples: int = 0,
        test_fraction: float = 0.1,
        val_fraction: float = 0.0,
        seed: int = 0,
        image_root: str | None = None,
        max_words: int = 25,
        max_users: int | None = None,
        batch_size: int = 32,
        eval_batch_size: int | None = 256,
    ) -> None:
        self._args = arguments(locals())
        super().__init__(batch_size, eval_batch_size)
        if max_users is not None and max_users < 1:
            raise ValueError(f"max_users must be >= 1, got {max_users}.")
        if not 0 < user_fraction <= 1:
            raise ValueError(f"user_fraction must be in (0, 1], got {user_fraction}.")
        self.root, self.dataset, self.image_root = Path(root), dataset, image_root
        self.max_words = max_words
        self._read: tuple[list[str], list[dict[str, dict[str, list]]], dict | None] | None = None
        self.save_hyperparameters()

    def setup(self, stage: str | None = None) -> None:
        """Read the users' JSON files (once)."""
        self._users()

    @property
    def users(self) -> list[str]:
        """The kept users, one client each, in order."""
        return self._users()[0]

    @property
    def _raw(self) -> list[dict[str, dict[str, list]]]:
        return self._users()[1]

    @property
    def vocabulary(self) -> dict[str, int] | None:
        """Sent140's vocabulary of the training words (word → index; 0 pads); None else."""
        return self._users()[2]

    def _users(self) -> tuple[list[str], list[dict[str, dict[str, list]]], dict | None]:
        if self._read is None:
            self.prepare_data()
            self._read = self._read_users()
        return self._read

    def _read_users(self) -> tuple[list[str], list[dict[str, dict[str, list]]], dict | None]:
        """Read the splits, keep the users that pass the filters and split each one's
        training samples into train and validation."""
        h = self._args
        min_samples, user_fraction, seed = h.min_samples, h.user_fraction, h.seed
        splits = self._read_splits(self.root, h.test_fraction, seed)
        users = [u for u in splits["train"] if len(splits["train"][u]["y"]) >= min_samples]
        if user_fraction < 1:
            rng = np.random.default_rng(seed)
            keep = max(1, round(user_fraction * len(users)))
            users = [users[i] for i in sorted(rng.choice(len(users), keep, replace=False))]
        if not users:
            raise ValueError(f"{self.root}: no user has >= {min_samples} training samples.")
        users = users[: h.max_users]
        raw: list[dict[str, dict[str, list]]] = []
        for i, user in enumerate(users):
            train = splits["train"][user]
            fit, val = split_fractions(
                np.arange(len(train["y"])), (1 - h.val_fraction, h.val_fraction), seed + i
            )
            pick = lambda d, idx: {"x": [d["x"][j] for j in idx], "y": [d["y"][j] for j in idx]}  # noqa: E731
            test = splits["test"].get(user, {"x": [], "y": []})
            raw.append({"train": pick(train, fit), "val": pick(train, val), "test": test})
        vocabulary = None
        if self.dataset == "sent140":
            counts = Counter(w for r in raw for x in r["train"]["x"] for w in _sent140_words(x[4]))
            vocabulary = {w: i + 1 for i, w in enumerate(sorted(counts))}  # 0 = padding
        return users, raw, vocabulary

    @staticmethod
    def _read_splits(root: Path, test_fraction: float, seed: int) -> dict[str, dict]:
        if (root / "train").is_dir():
            test = read_leaf_folder(root / "test") if (root / "test").is_dir() else {}
            return {"train": read_leaf_folder(root / "train"), "test": test}
        if not (root / "all_data").is_dir():
            raise FileNotFoundError(
                f"{root}: expected train/ and test/ (or all_data/) folders of LEAF JSON files."
            )
        splits: dict[str, dict] = {"train": {}, "test": {}}
        for i, (user, entry) in enumerate(read_leaf_folder(root / "all_data").items()):
            idx = np.arange(len(entry["y"]))
            tr, te = split_fractions(idx, (1 - test_fraction, test_fraction), seed + i)
            for name, part in (("train", tr), ("test", te)):
                splits[name][user] = {
                    "x": [entry["x"][j] for j in part],
                    "y": [entry["y"][j] for j in part],
                }
        return splits

    @property
    def num_clients(self) -> int:
        return len(self.users)

    def client_dataset(self, client: int, split: Split) -> Dataset | None:
        self.check_owned(client)
        raw = self._raw[client][split]
        if not raw["y"]:
            return None
        return TensorDataset(self._encode_x(raw["x"], client), self._encode_y(raw["y"]))

    def _encode_x(self, xs: list, client: int) -> torch.Tensor:
        name = self.dataset
        if name == "femnist":
            bad = [len(x) for x in xs if len(x) != FEMNIST_PIXELS]
            if bad:
                raise ValueError(
                    f"{self.root}: user {self.users[client]!r} has a FEMNIST image of "
                    f"{bad[0]} pixels; expected 28x28 = {FEMNIST_PIXELS}."
                )
            return torch.tensor(xs, dtype=torch.float32).view(-1, 1, 28, 28)
        if name == "shakespeare":
            return torch.tensor([[max(SHAKESPEARE_LETTERS.find(c), 0) for c in x] for x in xs])
        if name == "sent140":
            rows = []
            for x in xs:
                ids = [
                    self.vocabulary.get(w, len(self.vocabulary) + 1) for w in _sent140_words(x[4])
                ]
                rows.append((ids + [0] * self.max_words)[: self.max_words])
            return torch.tensor(rows)
        if name == "celeba":
            return torch.stack([self._celeba_image(x) for x in xs])
        return torch.tensor(xs, dtype=torch.float32)  # synthetic

    def _encode_y(self, ys: list) -> torch.Tensor:
        if self.dataset == "shakespeare":
            return torch.tensor([max(SHAKESPEARE_LETTERS.find(y), 0) for y in ys])
        return torch.tensor([int(y) for y in ys])

    def _celeba_image(self, name: str) -> torch.Tensor:
        from PIL import Image

        if self.image_root is None:
            raise ValueError("CelebA needs image_root= the img_align_celeba folder.")
        path = Path(self.image_root) / name
        try:
            with Image.open(path) as img:
                img = img.convert("RGB").resize((CELEBA_SIZE, CELEBA_SIZE))
                pixels = np.asarray(img, dtype=np.float32) / 255.0
        except OSError as err:
            raise ValueError(f"{path}: cannot read the CelebA image ({err}).") from err
        return torch.from_numpy(pixels).permute(2, 0, 1)


def generate_synthetic(
    num_users: int, alpha: float, beta: float, seed: int, dim: int = 60, num_classes: int = 10
) -> dict[str, dict[str, list]]:
    """Synthetic(α, β) of Li et al., "Federated Optimization in Heterogeneous Networks"
    (FedProx, MLSys 2020, §5.1), the generator LEAF distributes for its Synthetic dataset.

    User k: n_k = ⌊lognormal(4, 2)⌋ + 50 samples; u_k ~ N(0, α), B_k ~ N(0, β);
    W_k ~ N(u_k, 1)^{d×C}, b_k ~ N(u_k, 1)^C; v_k ~ N(B_k, 1)^d; x ~ N(v_k, Σ) with
    Σ = diag(j^{−1.2}); y = argmax softmax(x W_k + b_k). α controls how much the local
    models differ, β how much the local inputs differ.
    """
    rng = np.random.RandomState(seed)
    sizes = rng.lognormal(4, 2, num_users).astype(int) + 50
    mean_w = rng.normal(0, alpha, num_users)
    shift = rng.normal(0, beta, num_users)
    cov = np.diag(np.power(np.arange(1, dim + 1), -1.2))
    users = {}
    for k in range(num_users):
        w = rng.normal(mean_w[k], 1, (dim, num_classes))
        b = rng.normal(mean_w[k], 1, num_classes)
        v = rng.normal(shift[k], 1, dim)
        x = rng.multivariate_normal(v, cov, sizes[k])
        y = np.argmax(x @ w + b, axis=1)
        users[f"f_{k:05d}"] = {"x": x.round(6).tolist(), "y": y.tolist()}
    return users


def write_leaf_json(path: str | Path, users: dict[str, dict[str, list]]) -> None:
    """Write users in LEAF's JSON format (``users``, ``num_samples``, ``user_data``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    content = {
        "users": list(users),
        "num_samples": [len(u["y"]) for u in users.values()],
        "user_data": users,
    }
    path.write_text(json.dumps(content))


def write_synthetic_leaf(
    root: str | Path, dataset: LeafName, num_users: int, samples: int = 40, seed: int = 0
) -> None:
    """Small generated data in LEAF's format under ``root/{train,test}`` for the ``small``
    recipes and tests: FEMNIST-like images (class template + noise), Shakespeare-like
    80-character lines, or Synthetic(0.5, 0.5)."""
    rng = np.random.default_rng(seed)
    if dataset == "synthetic":
        users = generate_synthetic(num_users, 0.5, 0.5, seed)
    elif dataset == "femnist":
        # a learnable signal: each class is a fixed pattern of 7x7 blocks, drawn with noise
        blocks = rng.random((62, 4, 4)) < 0.5
        templates = np.kron(blocks, np.ones((7, 7))).reshape(62, FEMNIST_PIXELS)
        users = {}
        for k in range(num_users):
            y = rng.integers(0, 62, samples)
            x = np.clip(templates[y] + rng.normal(0, 0.2, (samples, FEMNIST_PIXELS)), 0, 1)
            users[f"f{k:04d}_00"] = {"x": x.round(4).tolist(), "y": y.tolist()}
    elif dataset == "shakespeare":
        words = ["thou", "art", "the", "king", "my", "lord", "and", "love", "shall", "not"]
        users = {}
        for k in range(num_users):
            text = " ".join(rng.choice(words[k % 3 :], 40 * samples)) + "."
            xs = [text[i : i + 80] for i in range(0, samples * 7, 7)]
            ys = [text[i + 80] for i in range(0, samples * 7, 7)]
            users[f"ROLE_{k:03d}"] = {"x": xs, "y": ys}
    else:
        raise ValueError(f"No generator for {dataset!r}; use femnist, shakespeare or synthetic.")
    train, test = {}, {}
    for i, (user, entry) in enumerate(users.items()):
        tr, te = split_fractions(np.arange(len(entry["y"])), (0.8, 0.2), seed + i)
        train[user] = {"x": [entry["x"][j] for j in tr], "y": [entry["y"][j] for j in tr]}
        test[user] = {"x": [entry["x"][j] for j in te], "y": [entry["y"][j] for j in te]}
    write_leaf_json(Path(root) / "train" / f"{dataset}_train.json", train)
    write_leaf_json(Path(root) / "test" / f"{dataset}_test.json", test)


class GeneratedLeafDataModule(LeafDataModule):
    """:class:`LeafDataModule` over data generated into ``root`` by :func:`write_synthetic_leaf`
    when ``root`` holds none yet (the CPU-sized ``small`` recipes)."""

    def __init__(
        self,
        root: str,
        dataset: LeafName = "femnist",
        num_users: int = 20,
        samples: int = 40,
        seed: int = 0,
        val_fraction: float = 0.0,
        batch_size: int = 32,
        eval_batch_size: int | None = 256,
    ) -> None:
        self._generate = (num_users, samples, seed)
        super().__init__(
            root, dataset, seed=seed, val_fraction=val_fraction, batch_size=batch_size,
            eval_batch_size=eval_batch_size,
        )  # fmt: skip

    def prepare_data(self) -> None:
        """Generate the data into ``root`` when it holds none yet."""
        if not (self.root / "train").is_dir():
            write_synthetic_leaf(self.root, self.dataset, *self._generate)
