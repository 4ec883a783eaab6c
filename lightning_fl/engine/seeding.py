"""Seeds derived from (seed, purpose, round, client): never from a global RNG state.

Every random choice of a round is a pure function of the run's seed and the round
index, so a resumed run and every rank make the same choice.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch


def derive_seed(seed: int, purpose: str, *keys: int) -> int:
    """A 63-bit seed mixed from ``seed``, a purpose tag and integer keys (round, client)."""
    tag = zlib.crc32(purpose.encode())
    state = np.random.SeedSequence(
        [int(seed) & 0xFFFFFFFF, tag, *(int(k) & 0xFFFFFFFF for k in keys)]
    )
    return int(state.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


# numpy's SeedSequence constants (numpy/random/bit_generator.pyx), for derive_seeds
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R, _XSHIFT, _MASK32 = 0xCA01F9DD, 0x4973F715, 16, 0xFFFFFFFF
_POOL_SIZE = 4


def derive_seeds(
    seed: int, purpose: str, *keys: int, last: Sequence[int] | np.ndarray
) -> np.ndarray:
    """``[derive_seed(seed, purpose, *keys, k) for k in last]`` in a few array operations:
    numpy's ``SeedSequence`` mixing (its pool of 4 words, ``hashmix`` and ``mix``) run over
    every ``k`` at once. Equal to :func:`derive_seed` bit for bit; one call for a round's
    1,000 clients costs about 0.5 ms against about 37 µs per client for the loop."""
    mask = np.uint64(_MASK32)
    last_words = np.asarray(last, dtype=np.int64).astype(np.uint64) & mask
    count = len(last_words)
    head = [int(seed) & _MASK32, zlib.crc32(purpose.encode()), *(int(k) & _MASK32 for k in keys)]
    entropy = [np.full(count, word, dtype=np.uint64) for word in head] + [last_words]
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ np.uint64(hash_const)
        hash_const = (hash_const * _MULT_A) & _MASK32
        value = (value * np.uint64(hash_const)) & mask
        return value ^ (value >> np.uint64(_XSHIFT))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result = (np.uint64(_MIX_MULT_L) * x - np.uint64(_MIX_MULT_R) * y) & mask
        return result ^ (result >> np.uint64(_XSHIFT))

    zero = np.zeros(count, dtype=np.uint64)
    pool = [hashmix(entropy[i] if i < len(entropy) else zero) for i in range(_POOL_SIZE)]
    for src in range(_POOL_SIZE):
        for dst in range(_POOL_SIZE):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(_POOL_SIZE, len(entropy)):
        for dst in range(_POOL_SIZE):
            pool[dst] = mix(pool[dst], hashmix(entropy[src]))
    words, hash_const = [], _INIT_B  # generate_state(2, uint64): the first 64-bit word
    for i in range(2):
        value = pool[i] ^ np.uint64(hash_const)
        hash_const = (hash_const * _MULT_B) & _MASK32
        value = (value * np.uint64(hash_const)) & mask
        words.append(value ^ (value >> np.uint64(_XSHIFT)))
    return ((words[0] | (words[1] << np.uint64(32))) >> np.uint64(1)).astype(np.int64)


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
