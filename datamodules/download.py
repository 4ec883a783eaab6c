"""Fetching published data files into a cache, verified by checksum.

Tests never call :func:`download`; they use fixtures written in the real formats.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.request
from pathlib import Path


class ChecksumError(ValueError):
    """A file's checksum differs from the published one."""


def file_digest(path: str | os.PathLike, algorithm: str = "sha256") -> str:
    digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: str | os.PathLike, expected: str, algorithm: str = "sha256") -> None:
    """Raise :class:`ChecksumError` naming ``path`` when its digest is not ``expected``."""
    actual = file_digest(path, algorithm)
    if actual != expected:
        raise ChecksumError(
            f"{path}: {algorithm} is {actual}, expected {expected}. The file is corrupt or "
            "not the published version; delete it and download it again."
        )


def download(
    url: str, destination: str | os.PathLike, expected: str, algorithm: str = "sha256"
) -> Path:
    """Download ``url`` to ``destination`` unless a verified copy is already there.

    The file is written to a temporary name and moved in place only after its checksum
    matches, so a failed or corrupt download never replaces good data.
    """
    destination = Path(destination)
    if destination.exists():
        verify(destination, expected, algorithm)
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=destination.parent, delete=False) as tmp:
        try:
            with urllib.request.urlopen(url, timeout=60) as response:  # noqa: S310 -- fixed URLs
                shutil.copyfileobj(response, tmp)
        except OSError as err:
            os.unlink(tmp.name)
            raise ConnectionError(
                f"Could not download {url} to {destination} ({err}). Download it by hand "
                f"into {destination.parent}, or point the datamodule's root at a copy."
            ) from err
    try:
        verify(tmp.name, expected, algorithm)
    except ChecksumError:
        os.unlink(tmp.name)
        raise
    os.replace(tmp.name, destination)
    return destination
