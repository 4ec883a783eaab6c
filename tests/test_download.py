"""Fetching published files into a cache (``datamodules/download.py``), in process: from
``file://`` URLs, so nothing leaves the machine. The datamodules' download tests replace
``download`` itself; these test it."""

from __future__ import annotations

import hashlib
import warnings

import pytest

from lightning_fl.datamodules.download import ChecksumError, download, file_digest, verify


@pytest.fixture
def published(tmp_path):
    """A 'published' file of 2.5 MiB (several read chunks) and its sha256 and md5."""
    source = tmp_path / "server" / "archive.bin"
    source.parent.mkdir()
    source.write_bytes(bytes(range(256)) * (10 * 1024) + b"tail")
    data = source.read_bytes()
    return source, hashlib.sha256(data).hexdigest(), hashlib.md5(data).hexdigest()


def test_digests_read_in_chunks_equal_hashlib_on_the_whole_file(published):
    source, sha256, md5 = published
    assert file_digest(source) == sha256 and file_digest(str(source), "md5") == md5
    verify(source, sha256)
    with pytest.raises(ChecksumError) as refused:
        verify(source, "0" * 64)
    assert str(refused.value) == (
        f"{source}: sha256 is {sha256}, expected {'0' * 64}. The file is corrupt or not the "
        "published version; delete it and download it again."
    )


def test_a_download_lands_verified_in_a_new_folder(published, tmp_path):
    source, sha256, md5 = published
    destination = tmp_path / "cache" / "deeper" / "archive.bin"
    assert download(source.as_uri(), str(destination), md5, algorithm="md5") == destination
    assert destination.read_bytes() == source.read_bytes()
    assert sorted(p.name for p in destination.parent.iterdir()) == ["archive.bin"]
    source.write_bytes(b"changed on the server")  # a verified copy is not fetched again
    assert download(source.as_uri(), destination, md5, algorithm="md5") == destination
    assert file_digest(destination, "md5") == md5


def test_a_kept_copy_is_checked_and_a_bad_download_replaces_nothing(published, tmp_path):
    source, sha256, _ = published
    destination = tmp_path / "cache" / "archive.bin"
    destination.parent.mkdir()
    destination.write_bytes(b"corrupt")
    with pytest.raises(ChecksumError, match="sha256 is"):
        download(source.as_uri(), destination, sha256)
    destination.unlink()
    with pytest.raises(ChecksumError):
        download(source.as_uri(), destination, "f" * 64)
    assert list(destination.parent.iterdir()) == []  # no partial file, no temporary left
    with pytest.raises(ConnectionError) as failed:
        download((tmp_path / "nowhere.bin").as_uri(), destination, sha256)
    assert str(failed.value).startswith(f"Could not download {(tmp_path / 'nowhere.bin').as_uri()}")
    assert str(failed.value).endswith(
        f"Download it by hand into {destination.parent}, or point the datamodule's root at a copy."
    )
    assert list(destination.parent.iterdir()) == []


def test_a_source_without_a_checksum_is_kept_and_its_digest_given(published, tmp_path):
    source, sha256, _ = published
    destination = tmp_path / "archive.bin"
    words = f"publishes no checksum; the downloaded file's sha256 is {sha256}"
    with pytest.warns(UserWarning, match=words):
        download(source.as_uri(), destination, None)
    assert file_digest(destination) == sha256
    destination.write_bytes(b"edited")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert download(source.as_uri(), destination, None).read_bytes() == b"edited"


@pytest.mark.parametrize("name", ["cifar", "heart", "tcga", "fashion_mnist", "emnist"])
def test_a_mistyped_root_is_refused_before_any_download_and_is_not_created(
    name, tmp_path, monkeypatch
):
    import urllib.request

    from lightning_fl.datamodules import (
        CifarDataModule,
        EmnistDataModule,
        FashionMnistDataModule,
        FedHeartDiseaseDataModule,
        FedTcgaBrcaDataModule,
    )

    def no_network(*args, **kwargs):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    typo = tmp_path / "dataa" / "typo"
    make = {"cifar": CifarDataModule, "heart": FedHeartDiseaseDataModule,
            "tcga": FedTcgaBrcaDataModule, "fashion_mnist": FashionMnistDataModule,
            "emnist": EmnistDataModule}[name]  # fmt: skip
    with pytest.raises(FileNotFoundError, match=r"is not a folder, so nothing was downloaded"):
        make(root=str(typo), download=True).prepare_data()
    assert not (tmp_path / "dataa").exists()
