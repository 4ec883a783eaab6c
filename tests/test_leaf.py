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


def test_user_fraction_draws_users_without_replacement_kept_in_file_order(tmp_path):
    """``user_fraction``: ``default_rng(seed).choice(n, round(f n), replace=False)``, then
    file order. Seed 0 draws users 4, 5, 3 of 6 (with replacement it would draw 5, 3, 3)."""
    _write(tmp_path, _femnist_users(n_users=6))
    users = [f"f{k:04d}_{k:02d}" for k in range(6)]
    assert LeafDataModule(str(tmp_path), "femnist", user_fraction=0.5, seed=0).users == [
        users[3],
        users[4],
        users[5],
    ]
    # a fraction that rounds to one user keeps one (seed 0 draws user 4 of 6 first)
    assert LeafDataModule(str(tmp_path), "femnist", user_fraction=0.1, seed=0).num_clients == 1
    assert LeafDataModule(str(tmp_path), "femnist", user_fraction=1.0).users == users
    assert LeafDataModule(str(tmp_path), "femnist", max_users=1).users == users[:1]
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"user_fraction must be in \(0, 1\]"):
            LeafDataModule(str(tmp_path), "femnist", user_fraction=bad)


def test_hyperparameters_are_saved(tmp_path):
    _write(tmp_path, _femnist_users())
    dm = LeafDataModule(str(tmp_path), "femnist", min_samples=2, max_users=2)
    assert dm.hparams["dataset"] == "femnist" and dm.hparams["max_users"] == 2


def test_a_silo_opens_only_its_own_users(tmp_path):
    from lightning_fl.engine.data_contract import SiloError

    _write(tmp_path, _femnist_users())
    dm = LeafDataModule(str(tmp_path), "femnist")
    dm.enter_silo(1, 2)
    assert len(dm.client_dataset(1, "train")) == 6
    with pytest.raises(SiloError, match="client 0's data is held by silo 0"):
        dm.client_dataset(0, "train")


def test_leaf_files_of_a_folder_concatenate_in_sorted_order(tmp_path):
    """A user split over two files gets the samples of ``a.json`` before those of
    ``b.json``, whatever order the folder lists them in; paths may be strings, and
    ``users`` is written as LEAF's list."""
    from lightning_fl.datamodules.leaf import read_leaf_file, read_leaf_folder

    folder = tmp_path / "train"
    for i in (7, 3, 11, 0, 5, 9, 1, 10, 2, 8, 4, 6):  # the listing order is the file system's
        write_leaf_json(str(folder / f"{i:02d}.json"), {"u": {"x": [[float(i)]], "y": [i]}})
    assert json.loads((folder / "00.json").read_text())["users"] == ["u"]
    assert read_leaf_file(str(folder / "05.json")) == {"u": {"x": [[5.0]], "y": [5]}}
    assert read_leaf_folder(str(folder)) == {
        "u": {"x": [[float(i)] for i in range(12)], "y": list(range(12))}
    }


def test_shakespeare_letters_outside_the_vocabulary_encode_as_index_0(tmp_path):
    """LEAF's ``letter_to_index``: ``max(find(c), 0)``, so "~" (not among the 80 letters)
    reads as index 0, the newline's, and the newline stays 0."""
    line = "~\n" + "a" * 78
    _write(tmp_path, {"ROMEO": {"x": [line], "y": ["~"]}, "JULIET": {"x": [line], "y": ["\n"]}})
    dm = LeafDataModule(str(tmp_path), "shakespeare")
    x, y = dm.client_dataset(0, "train")[:]
    assert x[0, :3].tolist() == [0, 0, SHAKESPEARE_LETTERS.index("a")] and y.tolist() == [0]
    assert dm.client_dataset(1, "train")[:][1].tolist() == [0]


def test_celeba_pixels_are_scaled_to_the_unit_interval(tmp_path):
    from PIL import Image

    images = tmp_path / "img"
    images.mkdir()
    Image.new("RGB", (84, 84), (255, 51, 0)).save(images / "a.png")
    _write(tmp_path / "data", {"celeb": {"x": ["a.png"], "y": [0]}})
    dm = LeafDataModule(str(tmp_path / "data"), "celeba", image_root=str(images))
    x = dm.client_dataset(0, "train")[:][0]
    assert torch.allclose(x[0, :, 0, 0], torch.tensor([1.0, 0.2, 0.0]))


def test_synthetic_alpha_beta_by_hand():
    """FedProx §5.1's Synthetic(α, β), drawn in the generator's order from
    ``RandomState(seed)``: n_k = ⌊lognormal(4, 2)⌋ + 50, u_k ~ N(0, α), B_k ~ N(0, β),
    W_k, b_k ~ N(u_k, 1), v_k ~ N(B_k, 1), x ~ N(v_k, diag(j^-1.2)), y = argmax(x W_k + b_k).

    u_k shifts every logit of a sample by the same u_k (1 + Σx): only the draws it takes
    matter, so a mean other than 0 for u_k draws the same labels."""
    alpha, beta, seed, n_users = 0.7, 1.3, 5, 3
    users = generate_synthetic(n_users, alpha, beta, seed, dim=6, num_classes=4)
    rng = np.random.RandomState(seed)
    n = np.floor(rng.lognormal(4, 2, n_users)) + 50
    u, shift = rng.normal(0, alpha, n_users), rng.normal(0, beta, n_users)
    sigma = np.diag([1.0, 2**-1.2, 3**-1.2, 4**-1.2, 5**-1.2, 6**-1.2])
    for k, (name, entry) in enumerate(users.items()):
        w = u[k] + rng.standard_normal((6, 4))
        b = u[k] + rng.standard_normal(4)
        v = shift[k] + rng.standard_normal(6)
        x = rng.multivariate_normal(v, sigma, int(n[k]))
        assert name == f"f_{k:05d}" and len(entry["x"]) == n[k]
        np.testing.assert_array_equal(entry["x"], x.round(6))  # written to 6 decimals
        assert entry["y"] == [int(np.argmax(row @ w + b)) for row in x]


def test_generated_shakespeare_lines_are_80_letters_and_their_next_letter(tmp_path):
    """The small recipes' Shakespeare, by hand: user k's text is 40 n words drawn from the
    (k mod 3)-th word on (``default_rng(seed)``, users in turn) and a full stop; sample j is
    its 80 letters from 7j, labelled with the letter after them (LEAF's next-letter task)."""
    from lightning_fl.datamodules.leaf import write_synthetic_leaf

    words = ["thou", "art", "the", "king", "my", "lord", "and", "love", "shall", "not"]
    n, seed = 30, 2
    write_synthetic_leaf(str(tmp_path), "shakespeare", num_users=4, samples=n, seed=seed)
    train = json.loads((tmp_path / "train" / "shakespeare_train.json").read_text())
    test = json.loads((tmp_path / "test" / "shakespeare_test.json").read_text())
    rng = np.random.default_rng(seed)
    assert train["users"] == ["ROLE_000", "ROLE_001", "ROLE_002", "ROLE_003"]
    for k, user in enumerate(train["users"]):
        text = " ".join(rng.choice(words[k % 3 :], 40 * n)) + "."
        expected = sorted((text[7 * j : 7 * j + 80], text[7 * j + 80]) for j in range(n))
        got = [
            (x, y)
            for part in (train, test)
            for x, y in zip(part["user_data"][user]["x"], part["user_data"][user]["y"])
        ]
        assert sorted(got) == expected
        assert len(test["user_data"][user]["y"]) == 6  # 20% held out for test


def test_generated_femnist_pixels_lie_in_the_unit_interval_and_use_every_label(tmp_path):
    from lightning_fl.datamodules.leaf import write_synthetic_leaf

    write_synthetic_leaf(tmp_path, "femnist", num_users=20, samples=40, seed=0)
    dm = LeafDataModule(str(tmp_path), "femnist")
    x = torch.cat([dm.client_dataset(c, s)[:][0] for c in range(20) for s in ("train", "test")])
    y = torch.cat([dm.client_dataset(c, s)[:][1] for c in range(20) for s in ("train", "test")])
    assert x.min() == 0 and x.max() == 1 and set(y.tolist()) == set(range(62))
    assert torch.equal(x, (x * 1e4).round() / 1e4)  # written to 4 decimals


def test_generated_leaf_writes_its_data_once_and_reads_it_back(tmp_path):
    """``GeneratedLeafDataModule`` generates into an empty root without ``prepare_data``
    being called, and reads a root that already holds data as it is."""
    from lightning_fl.datamodules.leaf import GeneratedLeafDataModule

    dm = GeneratedLeafDataModule(str(tmp_path), "femnist", num_users=3, samples=10, seed=1)
    assert dm.num_clients == 3 and dm.sample_counts("train") == [8, 8, 8]
    again = GeneratedLeafDataModule(str(tmp_path), "femnist", num_users=5, samples=20, seed=2)
    assert again.num_clients == 3
    assert torch.equal(again.client_dataset(2, "test")[:][0], dm.client_dataset(2, "test")[:][0])
    synthetic = GeneratedLeafDataModule(str(tmp_path / "s"), "synthetic", num_users=3, seed=4)
    sizes = [len(u["y"]) for u in generate_synthetic(3, 0.5, 0.5, 4).values()]
    assert [
        sum(synthetic.sample_counts(s)[k] for s in ("train", "test")) for k in range(3)
    ] == sizes


def test_all_data_splits_each_user_with_its_own_seed_by_hand(tmp_path):
    """``all_data/``: user i (in file order) keeps the samples of its own shuffle, numpy's
    default_rng(seed + i) permutation cut at round(n·(1 − test_fraction)), for training,
    and the rest for testing, each in file order; users of equal size get different
    splits."""
    n, seed, users = 12, 4, ("a", "b", "c")
    entries = {
        name: {
            "x": [[(100 * u + j) / 1000] * 784 for j in range(n)],
            "y": [j % 62 for j in range(n)],
        }
        for u, name in enumerate(users)
    }
    write_leaf_json(tmp_path / "all_data" / "all_data_0.json", entries)
    dm = LeafDataModule(str(tmp_path), "femnist", test_fraction=0.25, seed=seed)
    tests = []
    for u in range(len(users)):
        shuffled = np.random.default_rng(seed + u).permutation(n)
        expected = sorted(int(j) for j in shuffled[round(0.75 * n) :])
        x, _ = dm.client_dataset(u, "test")[:]
        got = [round(float(v) * 1000) - 100 * u for v in x[:, 0, 0, 0]]
        assert got == expected, u
        tests.append(expected)
    assert tests[0] != tests[1] != tests[2]
