"""LEAF: fixtures written in LEAF's JSON format, the encoders and malformed input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightning_fl.datamodules import LeafDataModule, generate_synthetic, write_leaf_json
from lightning_fl.datamodules.leaf import SHAKESPEARE_LETTERS


def _femnist_users(n_users=3, n=5, pixels=784):
    rng = np.random.default_rng(0)
    return {
        f"f{k:04d}_{k:02d}": {
            "x": rng.random((n + k, pixels)).round(3).tolist(),
            "y": rng.integers(0, 62, n + k).tolist(),
        }
        for k in range(n_users)
    }


def _write(root, users_train, users_test=None):
    write_leaf_json(root / "train" / "all_train.json", users_train)
    write_leaf_json(root / "test" / "all_test.json", users_test or users_train)


def test_femnist_fixture_in_leaf_format(tmp_path):
    _write(tmp_path, _femnist_users())
    dm = LeafDataModule(str(tmp_path), "femnist", val_fraction=0.2)
    assert dm.num_clients == 3 and dm.users == ["f0000_00", "f0001_01", "f0002_02"]
    x, y = dm.client_dataset(1, "train")[:]
    assert x.shape == (5, 1, 28, 28) and y.dtype == torch.int64
    assert dm.sample_counts("val") == [1, 1, 1]


def test_user_fraction_and_min_samples(tmp_path):
    _write(tmp_path, _femnist_users(n_users=6))
    assert LeafDataModule(str(tmp_path), "femnist", min_samples=8).users == [
        "f0003_03",
        "f0004_04",
        "f0005_05",
    ]
    dm = LeafDataModule(str(tmp_path), "femnist", user_fraction=0.5, seed=1)
    assert dm.num_clients == 3
    assert dm.users == LeafDataModule(str(tmp_path), "femnist", user_fraction=0.5, seed=1).users


def test_all_data_is_split_per_user(tmp_path):
    write_leaf_json(tmp_path / "all_data" / "all_data_0.json", _femnist_users(n=20))
    dm = LeafDataModule(str(tmp_path), "femnist", test_fraction=0.25)
    assert dm.sample_counts("train") == [15, 16, 16] and dm.sample_counts("test") == [5, 5, 6]


def test_shakespeare_uses_leaf_vocabulary(tmp_path):
    users = {"ROMEO": {"x": ["To be, or not to be" + " " * 61], "y": ["!"]}}
    _write(tmp_path, users)
    dm = LeafDataModule(str(tmp_path), "shakespeare")
    x, y = dm.client_dataset(0, "train")[:]
    assert len(SHAKESPEARE_LETTERS) == 80
    assert x.shape == (1, 80) and x[0, 0] == SHAKESPEARE_LETTERS.index("T")
    assert y.tolist() == [SHAKESPEARE_LETTERS.index("!")]


def test_sent140_vocabulary_from_training_words(tmp_path):
    tweet = lambda text: ["id", "date", "NO_QUERY", "user", text]  # noqa: E731
    train = {"u1": {"x": [tweet("good day!"), tweet("bad day")], "y": ["1", "0"]}}
    test = {"u1": {"x": [tweet("unknown good")], "y": ["1"]}}
    _write(tmp_path, train, test)
    dm = LeafDataModule(str(tmp_path), "sent140", max_words=4)
    assert dm.vocabulary == {"!": 1, "bad": 2, "day": 3, "good": 4}
    x, _ = dm.client_dataset(0, "test")[:]
    assert x.tolist() == [[5, 4, 0, 0]]  # unknown word -> len(vocab) + 1, then padding


def test_celeba_reads_images_from_folder(tmp_path):
    from PIL import Image

    images = tmp_path / "img_align_celeba"
    images.mkdir()
    Image.new("RGB", (178, 218), (255, 0, 0)).save(images / "000001.jpg")
    _write(tmp_path / "data", {"celeb1": {"x": ["000001.jpg"], "y": [1]}})
    dm = LeafDataModule(str(tmp_path / "data"), "celeba", image_root=str(images))
    x, y = dm.client_dataset(0, "train")[:]
    assert x.shape == (1, 3, 84, 84) and x[0, 0].mean() > 0.9 and y.tolist() == [1]


def test_synthetic_generator_writes_leaf_format(tmp_path):
    users = generate_synthetic(num_users=4, alpha=1.0, beta=1.0, seed=3)
    assert users == generate_synthetic(num_users=4, alpha=1.0, beta=1.0, seed=3)
    assert all(len(u["x"]) >= 50 and len(u["x"][0]) == 60 for u in users.values())
    write_leaf_json(tmp_path / "train" / "s.json", users)
    dm = LeafDataModule(str(tmp_path), "synthetic")
    assert dm.num_clients == 4 and set(
        torch.cat([dm.client_dataset(c, "train")[:][1] for c in range(4)]).tolist()
    ) <= set(range(10))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.pop("num_samples"), "missing key.*num_samples"),
        (lambda c: c["num_samples"].__setitem__(0, 99), "has num_samples 99 but 5 x"),
        (lambda c: c["user_data"].pop("f0000_00"), "has no user_data"),
    ],
    ids=["missing-key", "mismatched-num-samples", "missing-user"],
)
def test_malformed_json_names_the_file(tmp_path, mutate, message):
    _write(tmp_path, _femnist_users())
    path = tmp_path / "train" / "all_train.json"
    content = json.loads(path.read_text())
    mutate(content)
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=f"all_train.json: .*{message}"):
        LeafDataModule(str(tmp_path), "femnist").setup()


def test_wrong_image_size_names_the_user(tmp_path):
    _write(tmp_path, _femnist_users(pixels=700))
    dm = LeafDataModule(str(tmp_path), "femnist")
    with pytest.raises(ValueError, match="user 'f0000_00' has a FEMNIST image of 700 pixels"):
        dm.client_dataset(0, "train")


def test_not_json_names_the_file(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not a readable LEAF JSON file"):
        LeafDataModule(str(tmp_path), "femnist").setup()


def test_generated_femnist_stand_in_carries_a_learnable_signal(tmp_path):
    """The small recipes' generated FEMNIST: a softmax regression on the pooled training
    data reaches far above chance (1/62) on the test data."""
    from lightning_fl.datamodules.leaf import write_synthetic_leaf

    write_synthetic_leaf(tmp_path, "femnist", num_users=10, samples=60)
    dm = LeafDataModule(str(tmp_path), "femnist")
    dm.setup("fit")

    def pooled(split):
        parts = [dm.client_dataset(c, split) for c in range(dm.num_clients)]
        x, y = zip(*(d[i] for d in parts for i in range(len(d))))
        return torch.stack(x), torch.as_tensor(y)

    x, y = pooled("train")
    xt, yt = pooled("test")
    torch.manual_seed(0)
    linear = torch.nn.Linear(x[0].numel(), 62)
    optimizer = torch.optim.Adam(linear.parameters(), lr=0.01)
    for _ in range(100):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(linear(x.flatten(1)), y).backward()
        optimizer.step()
    accuracy = float((linear(xt.flatten(1)).argmax(1) == yt).float().mean())
    assert accuracy > 0.5


def test_max_users_keeps_the_first_users_in_file_order(tmp_path):
    from lightning_fl.datamodules.leaf import write_synthetic_leaf

    write_synthetic_leaf(str(tmp_path), "femnist", 6, 12, 0)
    every = LeafDataModule(str(tmp_path), "femnist")
    first = LeafDataModule(str(tmp_path), "femnist", max_users=4)
    assert first.users == every.users[:4] and first.num_clients == 4
    with pytest.raises(ValueError, match="max_users must be >= 1"):
        LeafDataModule(str(tmp_path), "femnist", max_users=0)
