"""Secure aggregation (issue 67; Bonawitz et al. 2017, §4): pairwise masks that cancel in
the sum, exact fixed-point arithmetic in two 32-bit limbs, and on 3 processes what each
rank puts on the wire: its raw terms without the plugin, uniform masked limbs with it, and
the same model either way."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_fl.callbacks import SecureAggregation
from lightning_fl.systems import pairwise_masking as masking
from lightning_fl.systems.pairwise_masking import (
    LIMB,
    PairwiseMasks,
    add,
    carry_sum,
    decode,
    encode,
    negate,
    pad,
)
from tests.helpers import torchrun

TWO_64 = 2**64


def _limbs(values: list[int]) -> masking.Limbs:
    return (torch.tensor([v % TWO_64 % LIMB for v in values], dtype=torch.int64),
            torch.tensor([v % TWO_64 // LIMB for v in values], dtype=torch.int64))  # fmt: skip


def _ints(limbs: masking.Limbs) -> list[int]:
    return [int(lo) + int(hi) * LIMB for lo, hi in zip(*limbs)]


def test_limb_arithmetic_is_arithmetic_mod_2_64():
    """Against Python's integers: sums and negations of values across the whole ring
    (both ends, zero, carries out of the low limb and out of the ring)."""
    rng = random.Random(3)
    edges = [0, 1, LIMB - 1, LIMB, TWO_64 - 1, TWO_64 // 2, TWO_64 // 2 - 1]
    a = edges + [rng.randrange(TWO_64) for _ in range(200)]
    b = list(reversed(edges)) + [rng.randrange(TWO_64) for _ in range(200)]
    assert _ints(add(_limbs(a), _limbs(b))) == [(x + y) % TWO_64 for x, y in zip(a, b)]
    assert _ints(negate(_limbs(a))) == [(-x) % TWO_64 for x in a]
    three = [_limbs(a), _limbs(b), _limbs(list(range(len(a))))]
    summed = (sum(t[0] for t in three), sum(t[1] for t in three))  # as the all-reduce sums
    expected = [(x + y + i) % TWO_64 for i, (x, y) in enumerate(zip(a, b))]
    assert _ints(carry_sum(summed)) == expected


def test_the_fixed_point_encoding_round_trips_and_refuses_what_does_not_fit():
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.5e-10, -(2.0**29), 2.0**29 - 2.0**-20, 0.1])
    lo, hi = encode(values, 32)
    expected = [round(float(v) * 2**32) % TWO_64 for v in values.double()]
    assert _ints((lo, hi)) == expected
    back = decode(lo, hi, 32)
    assert torch.equal(back, torch.round(values.double() * 2**32) / 2**32)
    assert float((back - values.double()).abs().max()) <= 2**-33
    assert decode(*encode(torch.tensor([-7.25]), 2), 2).tolist() == [-7.25]
    with pytest.raises(ValueError, match=r"magnitude 1.07e\+09 does not fit .*fraction_bits=32"):
        encode(torch.tensor([1.0, -(2.0**30)]), 32)
    with pytest.raises(ValueError, match="does not fit"):
        encode(torch.tensor([float("nan")]), 32)
    for bad in (-1, 53):
        with pytest.raises(ValueError, match=r"fraction_bits must be in \[0, 52\]"):
            SecureAggregation(bad)


def test_pads_are_a_keyed_stream_of_the_round():
    key, other = bytes(range(32)), bytes(32)
    first = _ints(pad(key, 4, 1000))
    assert first == _ints(pad(key, 4, 1000)) and first[:10] == _ints(pad(key, 4, 10))
    assert first != _ints(pad(key, 5, 1000)) and first != _ints(pad(other, 4, 1000))
    high = sum(v >= TWO_64 // 2 for v in first)
    assert 420 < high < 580  # the top bit of 1,000 uniform draws
    lo, hi = pad(key, 4, 1000)
    assert int((lo == hi).sum()) == 0  # two independent words, not one twice
    assert 420 < int((lo >= LIMB // 2).sum()) < 580


def _sites(world_size: int, fraction_bits: int = 32) -> list[PairwiseMasks]:
    """Every site's masks, with a real key agreement whose exchange is in memory."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import x25519

    private = [x25519.X25519PrivateKey.generate() for _ in range(world_size)]
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    publics = [p.public_key().public_bytes(*raw) for p in private]
    sites = []
    for rank in range(world_size):
        drawn = iter([private[rank]])
        generate = x25519.X25519PrivateKey.generate
        x25519.X25519PrivateKey.generate = staticmethod(lambda drawn=drawn: next(drawn))
        try:
            sites.append(PairwiseMasks.agree(rank, world_size, lambda key: publics, fraction_bits))
        finally:
            x25519.X25519PrivateKey.generate = generate
    return sites


def _near_zero(high: torch.Tensor) -> torch.Tensor:
    return (high < 256) | (high >= LIMB - 256)


def test_masks_cancel_in_the_sum_and_hide_each_sites_terms():
    """Three sites of different magnitudes: the masked limbs sum to the exact fixed-point
    sum; each site's limbs differ from its own encoding everywhere and are spread over the
    ring (its raw high limbs are all within 256 of 0 mod 2^32); two sites' limbs without the third's
    decode to nothing near their sum (the third's pads are missing)."""
    sites = _sites(3)
    assert [sorted(s.keys) for s in sites] == [[1, 2], [0, 2], [0, 1]]
    assert sites[0].keys[1] == sites[1].keys[0] != sites[0].keys[2]
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(500, generator=g) * scale for scale in (0.01, 1.0, 30.0)]
    sent = [site.mask(v, round_idx=7) for site, v in zip(sites, values)]
    total = carry_sum((sum(s[0] for s in sent), sum(s[1] for s in sent)))
    exact = sum(torch.round(v.double() * 2**32) for v in values) / 2**32
    assert torch.equal(decode(*total, 32), exact)
    for site_sent, v in zip(sent, values):
        raw_lo, raw_hi = encode(v, 32)
        assert not bool((site_sent[0] == raw_lo).any() or (site_sent[1] == raw_hi).any())
        assert bool(_near_zero(raw_hi).all())  # |x| < 256: the high limb is near 0 mod 2^32
        assert float(_near_zero(site_sent[1]).float().mean()) < 0.01
    partial = carry_sum((sent[0][0] + sent[1][0], sent[0][1] + sent[1][1]))
    assert float((decode(*partial, 32) - (values[0] + values[1]).double()).abs().min()) > 1.0


def test_one_process_masks_nothing():
    assert SecureAggregation().sum_over_ranks(torch.ones(3), 0) is None


@pytest.mark.parametrize("min_sites, refused", [(2, True), (3, False), (4, False)])
def test_min_sites_at_or_below_half_the_sites_is_refused(min_sites, refused):
    """With sites that may drop, the threshold must exceed half of them (4 sites: 2 is
    refused, 3 runs the double-masking protocol; 4, every site, the pairwise masks)."""
    from types import SimpleNamespace

    from lightning_fl.engine import collectives

    class Dropping(collectives.Collectives):
        def all_reduce(self, tensor):
            raise AssertionError("no collective at set-up")

        def all_gather_object(self, value):
            return [value] * 4  # the pairwise masks' key agreement, every site at once

        def broadcast(self, tensor, src=0):
            raise AssertionError("no collective at set-up")

        def min_sites(self, world_size):
            return min_sites

    collectives.install(Dropping())
    trainer = SimpleNamespace(global_rank=1, world_size=4)
    secure = SecureAggregation()
    try:
        if refused:
            with pytest.raises(ValueError, match=r"min_sites=2 of 4 sites: .*at least 3\."):
                secure.on_fit_start(trainer, None)
        else:
            secure.on_fit_start(trainer, None)
            if min_sites < 4:  # the double-masking protocol's threshold, every round
                assert secure._dropping.min_sites == 3 and secure._masks is None
            else:  # every site answers: the pairwise masks, agreed once
                assert secure._dropping is None and set(secure._masks.keys) == {0, 2, 3}
    finally:
        collectives.install(None)


def test_on_three_processes_the_wire_carries_masked_limbs_and_the_model_is_the_same(tmp_path):
    """tests/secure_wire.py: SCAFFOLD on 3 processes for 3 rounds. Without the plugin, each
    rank's round all-reduce sends its own terms (the issue: a ring all-reduce passes chunks
    of them verbatim); with it, each rank sends 2 int64 limbs a value, none equal to its
    own terms' encoding, spread over the ring; the sum of what the ranks sent decodes to
    the sum of their terms; and the model equals the plain run's to float round-off."""
    torchrun("tests.secure_wire", str(tmp_path), timeout=300, nproc=3)
    runs = {
        (name, rank): torch.load(tmp_path / f"{name}_rank{rank}.pt", weights_only=True)
        for name in ("plain", "secure")
        for rank in range(3)
    }
    size = runs["plain", 0]["sent"][0].numel()  # the first round's buffer: its sums
    for rank in range(3):
        plain = [t for t in runs["plain", rank]["sent"] if t.numel() == size]
        assert len(plain) == 3 and plain[0].dtype == torch.float32  # raw terms, 3 rounds
        secure = runs["secure", rank]
        masked = [t for t in secure["sent"] if t.dtype == torch.int64 and t.numel() == 2 * size]
        assert len(masked) == 3 and not any(t.numel() == size for t in secure["sent"])
        for sent, own in zip(masked, secure["own"]):
            raw_lo, raw_hi = encode(own, 32)
            assert not bool((sent[:size] == raw_lo).any() or (sent[size:] == raw_hi).any())
            assert float(_near_zero(sent[size:]).float().mean()) < 0.05
    for round_idx in range(3):
        sent = [[t for t in runs["secure", r]["sent"] if t.dtype == torch.int64
                 and t.numel() == 2 * size][round_idx] for r in range(3)]  # fmt: skip
        summed = carry_sum((sum(t[:size] for t in sent), sum(t[size:] for t in sent)))
        own = sum(runs["secure", r]["own"][round_idx].double() for r in range(3))
        assert float((decode(*summed, 32) - own).abs().max()) <= 3 * 2**-33
    for rank in range(3):
        a, b = runs["plain", rank]["params"], runs["secure", rank]["params"]
        assert max(float((x - y).abs().max()) for x, y in zip(a, b)) <= 1e-6
        assert all(torch.equal(x, y) for x, y in zip(b, runs["secure", 0]["params"]))
