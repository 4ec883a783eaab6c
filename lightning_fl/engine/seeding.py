"""Seeds derived from (seed, purpose, round, client): never from a global RNG state.

Every random choice of a round is a pure function of the run's seed and the round
index, so a resumed run and every rank make the same choice.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch


def derive_seed(seed: int, purpose: str, *keys: int) -> int:
    """A 63-bit seed mixed from ``seed``, a purpose tag and integer keys (round, client)."""
    tag = zlib.crc32(purpose.encode())
    state = np.random.SeedSequence(
        [int(seed) & 0xFFFFFFFF, tag, *(int(k) & 0xFFFFFFFF for k in keys)]
    )
    return int(state.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def generator(seed: int, purpose: str, *keys: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by :func:`derive_seed`."""
    return torch.Generator().manual_seed(derive_seed(seed, purpose, *keys))


def seed_global_rng(seed: int, device: torch.device) -> None:
    """``torch.manual_seed(seed)`` for the device the run trains on. On a CPU run with no
    accelerator initialized, only the CPU generator is seeded: ``torch.manual_seed`` also
    queues a lazy seeding of CUDA/XPU/MPS and records a stack trace for it at every call
    (about 1 ms each, once per client and round), for generators such a run never uses.
    The CPU random stream is the same either way."""
    if device.type == "cpu" and not torch.cuda.is_initialized():
        torch.random.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)
