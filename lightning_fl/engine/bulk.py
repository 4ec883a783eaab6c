"""Python-side work over every client of a large population at once (packing 10⁵
clients' tensors, reporting their metrics)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while 10⁵ clients' small objects (tensor
    views, per-client rows) are made: they form no cycles, and the collector's full passes
    over every live object cost more than the work itself (packing 10⁵ clients of 4
    samples: 1.5 s of 1.9 s). Restored on exit, as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
