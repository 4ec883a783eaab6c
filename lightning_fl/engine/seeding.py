"""Seeds derived from (seed, purpose, round, client): never from a global RNG state.

Every random choice of a round is a pure function of the run's seed and the round
index, so a resumed run and every rank make the same choice.
"""

from __future__ import annotations

import functools
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


# ---------------------------------------------------------------- draws in O(drawn)
# A round of a population of 10⁶ clients must not cost a pass over the population to draw
# 100 of them. torch's CPU generator is a 32-bit Mersenne Twister seeded with the low 32
# bits of its seed, and its randperm and multinomial (with replacement) are short loops
# over that stream; the functions below replay those loops for the drawn entries only,
# with NumPy's MT19937 giving the same stream. The first use checks them against torch on
# small cases, and falls back to torch's own (O(n)) calls if a torch release draws
# otherwise.


def _stream(seed: int) -> np.random.MT19937:
    """NumPy's MT19937 in the state of ``torch.Generator().manual_seed(seed)``."""
    bits = np.random.MT19937(0)
    bits._legacy_seeding(int(seed) & 0xFFFFFFFF)
    return bits


def randperm_prefix(n: int, count: int, seed: int) -> list[int]:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:count]`` in
    O(count) (:func:`_replayed_randperm`, or torch's own call if this torch draws
    otherwise)."""
    # host: a draw of client ids from a CPU generator, as the samplers make it
    if _replays_torch():
        return _replayed_randperm(n, count, seed)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:count].tolist()


def multinomial_draws(cumulative: np.ndarray, count: int, seed: int) -> np.ndarray:
    """``torch.multinomial(p, count, replacement=True, generator=
    torch.Generator().manual_seed(seed))`` in O(count · log n), given ``cumulative`` =
    :func:`cumulative_weights` of the float64 ``p`` (:func:`_replayed_multinomial`, or
    torch's own call if this torch draws otherwise)."""
    # host: a draw of client ids from a CPU generator, as the samplers make it
    if _replays_torch():
        return _replayed_multinomial(cumulative, count, seed)
    p = torch.from_numpy(np.diff(cumulative, prepend=0.0))
    generator = torch.Generator().manual_seed(seed)
    return torch.multinomial(p, count, replacement=True, generator=generator).numpy()


def cumulative_weights(p: torch.Tensor) -> np.ndarray:
    """torch's multinomial's cumulative distribution of the float64 ``p``: the running sum
    in order, divided by the total, the last entry set to 1."""
    # host: a sampler's bookkeeping of the target weights
    cumulative = np.cumsum(p.detach().cpu().double().numpy())
    cumulative /= cumulative[-1]
    cumulative[-1] = 1.0
    return cumulative


def _replayed_randperm(n: int, count: int, seed: int) -> list[int]:
    """torch's Fisher–Yates (for n below 2³²/20) swaps position i with i + (a 32-bit draw
    mod (n − i)), so the first ``count`` positions are final after ``count`` steps; the
    swapped-away values are kept in a dict."""
    count = min(count, n)
    steps = np.arange(count, dtype=np.uint64)
    partners = (_stream(seed).random_raw(count) % (np.uint64(n) - steps) + steps).tolist()
    moved: dict[int, int] = {}
    out = []
    for i, j in enumerate(partners):
        here, there = moved.get(i, i), moved.get(j, j)
        moved[j] = here
        out.append(there)
    return out


def _replayed_multinomial(cumulative: np.ndarray, count: int, seed: int) -> np.ndarray:
    """Each draw is a 53-bit uniform from two 32-bit words (the first the high one) and
    the first index whose cumulative weight reaches it, as torch's CPU kernel draws."""
    words = _stream(seed).random_raw(2 * count).reshape(count, 2)
    bits = ((words[:, 0] << np.uint64(32)) | words[:, 1]) & np.uint64((1 << 53) - 1)
    return np.searchsorted(cumulative, bits.astype(np.float64) * 2.0**-53, side="left")


@functools.cache
def _replays_torch() -> bool:
    """Whether the replays give this torch's draws (checked once, on small cases)."""
    # host: CPU draws compared with CPU draws
    p = torch.rand(50, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    p[::4] = 0
    p /= p.sum()
    cumulative = cumulative_weights(p)
    for n, seed in [(n, s) for n in (1, 2, 7, 1000) for s in (0, 3, 2**40 + 11)]:
        permutation = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        draws = torch.multinomial(p, 20, True, generator=torch.Generator().manual_seed(seed))
        if _replayed_randperm(n, 10, seed) != permutation[:10].tolist():
            return False
        if _replayed_multinomial(cumulative, 20, seed).tolist() != draws.tolist():
            return False
    return True
