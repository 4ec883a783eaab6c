"""Fetching published data files into a cache, verified by checksum.

Tests never call :func:`download`; they use fixtures written in the real formats.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.request
import warnings
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


def require_download_root(root: str | os.PathLike | None) -> None:
    """Refuse to download into a ``root=`` folder that does not exist: a mistyped path is
    neither created nor downloaded into (``root=None`` downloads into the cache)."""
    if root is not None and not Path(root).is_dir():
        raise FileNotFoundError(
            f"root={str(root)!r} is not a folder, so nothing was downloaded: check the path, "
            f"or create the folder first (mkdir -p {root}), or leave root unset to download "
            "into the cache."
        )


def download(
    url: str, destination: str | os.PathLike, expected: str | None, algorithm: str = "sha256"
) -> Path:
    """Download ``url`` to ``destination`` unless a verified copy is already there.

    The file is written to a temporary name and moved in place only after its checksum
    matches, so a failed or corrupt download never replaces good data. With
    ``expected=None`` (a source that publishes no checksum) the file is kept and a warning
    gives its digest, to pin it next time.
    """
    destination = Path(destination)
    if destination.exists():
        if expected is not None:
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
    if expected is None:
        warnings.warn(
            f"{url} publishes no checksum; the downloaded file's {algorithm} is "
            f"{file_digest(tmp.name, algorithm)}. Pass it as the datamodule's sha256 to "
            "check future downloads.",
            stacklevel=2,
        )
    else:
        try:
            verify(tmp.name, expected, algorithm)
        except ChecksumError:
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, destination)
    return destination
