"""Secure aggregation that survives dropped sites (issue 76; Bonawitz et al. 2017, Fig. 4):
Shamir's shares rebuild a secret from any t of them and from no fewer; with a site that
drops after sending its masked input the relay's total is exactly the survivors' sum and
that site's input stays masked; a site never reveals both secrets of one site; a dropped
site takes part in the next round's instance."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("cryptography")

from lightning_fl.systems.double_masking import (  # noqa: E402
    PRIME,
    DoubleMaskingSite,
    DroppedSitesError,
    pairwise_mask,
    self_mask,
    shamir_join,
    shamir_split,
    unmasked_total,
)
from lightning_fl.systems.pairwise_masking import add, carry_sum, decode, encode, negate  # noqa: E402

SITES, MIN_SITES = 5, 3


def test_any_t_shares_rebuild_the_secret_and_fewer_do_not():
    rng = random.Random(4)
    for secret in (0, 1, PRIME - 1, rng.randrange(2**256)):
        shares = shamir_split(secret, 3, list(range(5)))
        for held in ([0, 1, 2], [4, 2, 3], [1, 3, 4], [0, 1, 2, 3, 4]):
            assert shamir_join({h: shares[h] for h in held}) == secret
        assert shamir_join({h: shares[h] for h in (0, 1)}) != secret or secret == 0
    with pytest.raises(ValueError, match=r"threshold must be in \[1, 2\]"):
        shamir_split(5, 3, [0, 1])
    assert shamir_split(7, 1, [0, 1, 2]) == {0: 7, 1: 7, 2: 7}  # t = 1: the secret itself


def _values():
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(50, generator=generator, dtype=torch.float64) for _ in range(SITES)]


def _instance(round_idx, values, shared=range(SITES), sent=range(SITES)):
    """One round: every site advertises; the sites in ``shared`` send shares; those in
    ``sent`` send their masked input (what the relay receives, by site)."""
    sites = [DoubleMaskingSite(r, SITES, MIN_SITES) for r in range(SITES)]
    adverts = {r: sites[r].advertise() for r in range(SITES)}
    outboxes = {r: sites[r].share_keys(adverts) for r in shared}
    for v in shared:
        sites[v].receive_shares({u: outboxes[u][v] for u in shared})
    masked = {u: sites[u].masked_input(values[u], round_idx) for u in sent}
    return sites, adverts, masked


@pytest.mark.parametrize("kept_late_input", [False, True])
def test_a_site_dropped_after_its_masked_input_leaves_the_survivors_exact_sum(kept_late_input):
    """Site 3 sends y_3 and dies before unmasking. Left out of U₃ (the relay's choice for a
    site that is gone), the total is Σ over the 4 others, equal to a round without site
    3; kept in U₃, Σ over all 5. Either way the relay, holding y_3 and what it was sent,
    cannot strip y_3's self-mask: PRG(b_3) was never rebuilt when s_3 was."""
    values = _values()
    sites, adverts, masked = _instance(2, values)
    survivors = [0, 1, 2, 4] + ([3] if kept_late_input else [])
    kept = {u: masked[u] for u in survivors}
    answers = {w: sites[w].unmask(survivors) for w in (0, 1, 2, 4)}  # site 3 is gone
    total = unmasked_total(kept, answers, {u: a[1] for u, a in adverts.items()}, 2, MIN_SITES)
    expected = sum(values[u] for u in survivors)
    assert torch.allclose(total, expected, atol=SITES * 2.0**-32)
    if not kept_late_input:
        # the relay rebuilds s_3 (to cancel 3's pairs) and strips 3's pairwise masks from y_3
        from lightning_fl.systems.double_masking import _private_from_int

        key = _private_from_int(shamir_join({w: a["keys"][3] for w, a in answers.items()}))
        stripped = masked[3]
        for other in range(SITES):
            if other != 3:
                stripped = add(stripped, negate(pairwise_mask(key, adverts[other][1], 3, other,
                                                              2, 50)))  # fmt: skip
        own = encode(values[3], 32)
        assert not bool((stripped[0] == own[0]).any() or (stripped[1] == own[1]).any())
        assert all(3 not in a["seeds"] for a in answers.values())  # b_3 never revealed


def test_a_site_dropped_before_its_masked_input_is_cancelled_from_the_others_masks():
    values = _values()
    sites, adverts, masked = _instance(0, values, sent=[0, 1, 2, 4])
    answers = {w: sites[w].unmask([0, 1, 2, 4]) for w in (0, 2, 4)}  # exactly t answer
    total = unmasked_total(masked, answers, {u: a[1] for u, a in adverts.items()}, 0, MIN_SITES)
    assert torch.allclose(total, values[0] + values[1] + values[2] + values[4], atol=4 * 2.0**-32)


def test_the_sum_of_the_masked_inputs_alone_is_noise_and_the_self_masks_are_needed():
    values = _values()
    sites, adverts, masked = _instance(1, values)
    lo, hi = masked[0]
    for u in range(1, SITES):
        lo, hi = lo + masked[u][0], hi + masked[u][1]
    summed = carry_sum((lo, hi))  # the pairwise masks cancel, the self-masks do not
    assert not torch.allclose(decode(*summed, 32), sum(values), atol=1.0)
    for u in range(SITES):
        summed = add(summed, negate(self_mask(sites[u]._seed, 1, 50)))
    assert torch.allclose(decode(*summed, 32), sum(values), atol=SITES * 2.0**-32)


def test_too_few_sites_and_requests_that_would_unmask_are_refused():
    values = _values()
    sites, adverts, masked = _instance(0, values)
    with pytest.raises(DroppedSitesError, match=r"2 sites masked inputs, fewer than min_sites=3"):
        sites[0].unmask([0, 1])
    outsider = DoubleMaskingSite(0, SITES, MIN_SITES)
    outsider.advertise()
    with pytest.raises(DroppedSitesError, match=r"asked to unmask sites \[0, 1, 2\]"):
        outsider.unmask([0, 1, 2])
    answers = {w: sites[w].unmask([0, 1, 2, 3, 4]) for w in (0, 1)}
    with pytest.raises(DroppedSitesError, match="2 sites unmasking answers"):
        unmasked_total(masked, answers, {u: a[1] for u, a in adverts.items()}, 0, MIN_SITES)
    lonely = DoubleMaskingSite(0, SITES, MIN_SITES)
    with pytest.raises(DroppedSitesError, match="2 sites advertised keys"):
        lonely.share_keys({0: lonely.advertise(), 1: adverts[1]})
    with pytest.raises(ValueError, match=r"min_sites must be in \[1, 5\]"):
        DoubleMaskingSite(0, SITES, 6)
    assert DoubleMaskingSite(0, SITES, 1).min_sites == 1


def test_exactly_min_sites_complete_a_round():
    """Three of five sites (the threshold) share keys, mask and unmask: the boundary of
    every count check."""
    values = _values()
    sites, adverts, masked = _instance(3, values, shared=[0, 2, 4], sent=[0, 2, 4])
    three = {u: adverts[u] for u in (0, 2, 4)}
    assert set(DoubleMaskingSite(1, SITES, MIN_SITES).share_keys(three)) == {0, 2, 4}
    answers = {w: sites[w].unmask([0, 2, 4]) for w in (0, 2, 4)}
    publics = {u: adverts[u][1] for u in (0, 2, 4)}
    total = unmasked_total(masked, answers, publics, 3, MIN_SITES)
    assert torch.allclose(total, values[0] + values[2] + values[4], atol=3 * 2.0**-32)


def test_a_dropped_site_takes_part_in_the_next_rounds_instance():
    """Round r without site 3 (it shared nothing), round r + 1 with every site: each round
    is a fresh instance, so the rejoining site needs nothing from the round it missed."""
    values = _values()
    sites, adverts, masked = _instance(5, values, shared=[0, 1, 2, 4], sent=[0, 1, 2, 4])
    answers = {w: sites[w].unmask([0, 1, 2, 4]) for w in (0, 1, 4)}
    total = unmasked_total(masked, answers, {u: adverts[u][1] for u in (0, 1, 2, 4)}, 5,
                           MIN_SITES)  # fmt: skip
    assert torch.allclose(total, sum(values) - values[3], atol=4 * 2.0**-32)
    sites, adverts, masked = _instance(6, values)
    answers = {w: sites[w].unmask(list(range(SITES))) for w in range(SITES)}
    total = unmasked_total(masked, answers, {u: a[1] for u, a in adverts.items()}, 6, MIN_SITES)
    assert torch.allclose(total, sum(values), atol=SITES * 2.0**-32)
