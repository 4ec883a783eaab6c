"""What one step of a Flower run carries, and how it is framed.

A step's request (server → site) is ``{"step": k, "result": R, "absent": [ranks]}`` (R:
the result of the site's previous collective, ``None`` at step 0; ``absent``: the sites
the server dropped, see ``FlowerSite(min_sites=...)``) or ``{"stop": reason}``; a site's
answer is ``{"rank": r, "site": name, "op": op, "payload": P}``, ``op`` one of ``"sum"``
(P a tensor), ``"gather"`` (P a plain value), ``"done"`` or ``"failed"`` (P the reason),
with ``"min_sites": m`` where the step may complete without a site that drops.
Values are encoded with ``torch.save`` and read with ``torch.load(weights_only=True)``:
tensors, numbers, strings, bytes and containers of them, never code. On the mailbox's
socket each encoded value is one frame: its length (8 bytes, big-endian), then its bytes.
"""

from __future__ import annotations

import io
import os
import socket
from typing import Any

#: the longest path a Unix socket takes, in bytes (Linux's sun_path, less its final NUL)
LONGEST_MAILBOX = 107


def check_mailbox(path: str) -> str:
    """``path``, refused when the kernel cannot bind or reach a socket there."""
    size = len(os.fsencode(path))
    if size > LONGEST_MAILBOX:
        raise OSError(
            f"the mailbox path {path} is {size} bytes; a Unix socket's path is at most "
            f"{LONGEST_MAILBOX}: choose a shorter FlowerSite(mailbox=...) and SuperNode "
            "--node-config mailbox (a relative path counts as written)"
        )
    return path


def encode(value: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def decode(data: bytes) -> Any:
    """A value :func:`encode` wrote; anything else (code included) is refused."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def send_frame(connection: socket.socket, data: bytes) -> None:
    connection.sendall(len(data).to_bytes(8, "big") + data)


def read_frame(connection: socket.socket) -> bytes:
    size = int.from_bytes(_read_exactly(connection, 8), "big")
    return _read_exactly(connection, size)


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = connection.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the other end closed the mailbox connection mid-frame")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
