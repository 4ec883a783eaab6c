"""The Flower transport's protocol without Flower's processes (issue 67): sites
(:class:`FlowerSite`, one thread each) answer the server's loop (:func:`run_steps`, the
ServerApp's own) through their mailboxes and the ClientApp's courier
(:func:`_through_mailbox`), as on a SuperNode. tests/test_flower.py runs the real thing."""

from __future__ import annotations

import io
import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="lightning-fl[flower] is not installed")

from lightning_fl.engine import collectives  # noqa: E402
from lightning_fl.engine.silo_checkpoints import SiloCheckpointError  # noqa: E402
from lightning_fl.flower import FlowerRunStopped, FlowerSite, apps, wire  # noqa: E402
from lightning_fl.flower.apps import (  # noqa: E402
    RunSettings,
    SiteFailure,
    StepRelay,
    _through_mailbox,
    run_steps,
)

NAMES = ["usa", "hungary", "switzerland"]


class SiteKilled(Exception):
    """Raised by :func:`kill` to end a site's thread as a killed process ends."""


def kill(site: FlowerSite) -> None:
    """What SIGKILL does to a site's process: its sockets close, nothing is answered."""
    if site._open is not None:
        site._open.close()
    site._listener.close()
    site._listener = None
    raise SiteKilled


class Federation:
    """``programs[r]`` runs as site ``NAMES[r]`` in a thread; the server's loop runs in the
    caller's thread. ``received`` records every answer the server decodes, per step."""

    def __init__(self, tmp: Path, programs, node_order=(2, 0, 1), min_sites=None) -> None:
        self.tmp, self.programs, self.min_sites = tmp, programs, min_sites
        self.nodes = {100 + r: r for r in node_order}  # node id -> rank, not in rank order
        self.results: dict[str, object] = {}
        self.errors: dict[str, BaseException] = {}
        self.received: list[dict[int, object]] = []

    def _site(self, rank: int) -> None:
        name = NAMES[rank]
        site = FlowerSite(mailbox=str(self.tmp / "{silo}.sock"), timeout=20,
                          min_sites=self.min_sites)  # fmt: skip
        site.open(rank, len(self.programs), name)
        try:
            self.results[name] = self.programs[rank](site, rank)
        except SiteKilled:
            return
        except BaseException as err:  # a site's failure, as the strategy reports it
            self.errors[name] = err
            collectives.close_transport(site, err)
            return
        site.close()

    def ask(self, receivers, request, timeout, first):
        nodes = list(self.nodes) if receivers is None else receivers

        def one(node):
            path = str(self.tmp / f"{NAMES[self.nodes[node]]}.sock")
            frame = self.request_for(self.nodes[node], request)
            try:
                return node, wire.decode(_through_mailbox(path, frame, timeout,
                                                          10.0 if first else 0.0))  # fmt: skip
            except OSError as err:
                return node, str(err)

        with ThreadPoolExecutor(len(nodes)) as pool:
            answers = dict(pool.map(one, nodes))
        self.received.append(answers)
        return answers

    def request_for(self, rank: int, request: bytes) -> bytes:
        """What the server sends site ``rank`` for ``request``: the request itself (an
        honest server; a malicious relay overrides this)."""
        return request

    def run(self) -> int:
        threads = [threading.Thread(target=self._site, args=(r,)) for r in range(len(NAMES))]
        for thread in threads:
            thread.start()
        try:
            return run_steps(RunSettings(sites=len(NAMES), step_timeout=20), self.ask)
        finally:
            for thread in threads:
                thread.join(timeout=30)


def test_sums_lists_and_broadcasts_are_in_rank_order_whatever_the_nodes_order(tmp_path):
    """Unequal tensors of three sites, SuperNodes known in another order: the sum is the
    exact sum, the gather lists values by rank, the broadcast is rank 1's, and a site's
    tensor keeps its dtype and shape (int64 limbs wrap around as two's complement)."""
    values = [torch.tensor([1.5, -2.0, 3.25]), torch.tensor([0.25, 4.0, -1.0]),
              torch.tensor([10.0, 0.5, 0.125])]  # fmt: skip
    limbs = [torch.tensor([2**62, 5]), torch.tensor([2**62, -7]), torch.tensor([2**62, 1])]

    def program(site: FlowerSite, rank: int):
        names = site.all_gather_object({"name": NAMES[rank], "rank": rank})
        summed = values[rank].clone()
        site.all_reduce(summed)
        wrapped = limbs[rank].clone()
        site.all_reduce(wrapped)
        chosen = torch.full((2,), float(rank))
        site.broadcast(chosen, src=1)
        return names, summed, wrapped, chosen

    federation = Federation(tmp_path, [program] * 3)
    steps = federation.run()
    assert not federation.errors, federation.errors
    assert steps == 4  # four collectives, then every site is done
    expected_sum = values[0] + values[1] + values[2]
    for name in NAMES:
        names, summed, wrapped, chosen = federation.results[name]
        assert names == [{"name": n, "rank": r} for r, n in enumerate(NAMES)]
        assert torch.equal(summed, expected_sum)
        assert wrapped.tolist() == [-(2**62), -1]  # 3·2^62 wraps to -2^62 in int64
        assert chosen.tolist() == [1.0, 1.0]
    assert not list(tmp_path.glob("*.sock"))  # each site removed its mailbox


def test_a_failing_site_stops_the_run_naming_it_and_the_others_say_why(tmp_path):
    """hungary raises in its second collective: the server's loop raises naming hungary
    and the error, and usa and switzerland stop with the server's reason."""

    def program(site: FlowerSite, rank: int):
        site.all_gather_object(rank)
        if NAMES[rank] == "hungary":
            raise ValueError("center file unreadable")
        site.all_reduce(torch.ones(2))

    federation = Federation(tmp_path, [program] * 3)
    with pytest.raises(SiteFailure, match="site 'hungary' failed: ValueError: center file"):
        federation.run()
    for name in ("usa", "switzerland"):
        error = federation.errors[name]
        assert isinstance(error, FlowerRunStopped)
        assert "site 'hungary' failed: ValueError: center file unreadable" in str(error)


def test_the_server_names_the_site_at_fault_not_the_sites_that_report_it(tmp_path):
    """Every site compares the sites' recipes (or checkpoints) and stops together; each
    error names the site at fault (``SiteFault.site``), here switzerland, which the first
    site reports first: the server names switzerland, with its own report, and every
    reporter. Sites that fail without naming one keep the first failure's name."""

    def program(site: FlowerSite, rank: int):
        site.all_gather_object(rank)
        reason = "switzerland's checkpoint is of round 2" if rank == 2 else "its is of round 2"
        raise SiloCheckpointError(reason, site="switzerland")

    federation = Federation(tmp_path, [program] * 3)
    expected = ("site 'switzerland' is at fault (reported by 'usa', 'hungary', 'switzerland'):"
                " SiloCheckpointError: switzerland's checkpoint is of round 2")  # fmt: skip
    with pytest.raises(SiteFailure) as failure:
        federation.run()
    assert str(failure.value) == expected
    answers = [{"site": n, "rank": r, "op": "failed", "payload": f"E{r}"}
               for r, n in enumerate(NAMES)]  # fmt: skip
    answers[1]["at_fault"] = "usa"
    assert apps._failure(answers) == "site 'usa' failed: E0"  # only one names a site
    for answer in answers:
        answer["at_fault"] = "hungary"
    assert apps._failure(answers[:1]) == "site 'hungary' is at fault (reported by 'usa'): E0"


def test_sites_at_different_collectives_are_refused_naming_each(tmp_path):
    def program(site: FlowerSite, rank: int):
        if rank == 2:
            site.all_gather_object("x")
        else:
            site.all_reduce(torch.ones(1))

    federation = Federation(tmp_path, [program] * 3)
    with pytest.raises(SiteFailure, match="'usa': sum, 'hungary': sum, 'switzerland': gather"):
        federation.run()


def test_a_site_whose_process_is_gone_is_named_at_once(tmp_path):
    """After the first step, a mailbox nobody listens on is a stopped site: the courier
    says so without waiting (at the first step it waits site-start-timeout)."""
    path = tmp_path / "gone.sock"
    with pytest.raises(OSError, match="has no site process at its mailbox .*gone.sock: its"):
        _through_mailbox(str(path), b"", 5.0, 0.0)
    relay = StepRelay(1)
    answers = {7: {"rank": 0, "site": "usa", "op": "sum", "payload": torch.ones(1)}}
    relay.combine(0, answers)
    with pytest.raises(SiteFailure, match=r"site 'usa' \(SuperNode 7\) has no site process"):
        relay.combine(1, {7: "has no site process at its mailbox /x.sock"})


def test_sums_of_other_shapes_and_wrong_ranks_are_refused():
    relay = StepRelay(2)
    a = {"rank": 0, "site": "usa", "op": "sum", "payload": torch.ones(3)}
    b = {"rank": 1, "site": "hungary", "op": "sum", "payload": torch.ones(4)}
    with pytest.raises(SiteFailure, match=r"site 'hungary' sends a \(4,\) torch.float32 sum"):
        relay.combine(0, {1: a, 2: b})
    twice = {**b, "rank": 0, "payload": torch.ones(3)}
    with pytest.raises(SiteFailure, match=r"answer as ranks \[0, 0\]"):
        relay.combine(0, {1: a, 2: twice})
    with pytest.raises(SiteFailure, match="no 'sites'"):
        RunSettings.read({})
    assert RunSettings.read({"sites": 3, "step-timeout": 5}) == RunSettings(3, 5.0, 120.0)
    assert RunSettings.read({"sites": 1, "step-timeout": 0.5}).sites == 1  # both ends allowed
    for bad in ({"sites": 0}, {"sites": 2, "step-timeout": 0}):
        with pytest.raises(SiteFailure, match="sites must be >= 1 and step-timeout > 0"):
            RunSettings.read(bad)


def test_the_wire_never_runs_code():
    """A frame is read with torch.load(weights_only=True): a pickle that would call a
    function is refused, and plain values come back equal."""

    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    hostile = io.BytesIO()
    pickle.dump({"op": "gather", "payload": Exploit()}, hostile, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        wire.decode(hostile.getvalue())
    value = {"rank": 1, "op": "gather", "payload": [("a", 1.5), {"b": torch.arange(3)}]}
    decoded = wire.decode(wire.encode(value))
    assert decoded["payload"][0] == ("a", 1.5)
    assert torch.equal(decoded["payload"][1]["b"], torch.arange(3))


def test_with_secure_aggregation_the_server_receives_only_masked_limbs(tmp_path):
    """Three sites agree on pairwise keys through the server (public keys only) and send
    their round sums masked (Bonawitz et al. 2017, §4): every tensor the server receives
    differs from that site's own encoding in every limb, and the sum the sites get back
    decodes to the sum of their values (fixed point, 2^-32)."""
    pytest.importorskip("cryptography")
    from lightning_fl.systems.pairwise_masking import PairwiseMasks, encode

    generator = torch.Generator().manual_seed(3)
    values = [torch.randn(40, generator=generator, dtype=torch.float64) for _ in NAMES]

    def program(site: FlowerSite, rank: int):
        masks = PairwiseMasks.agree(rank, 3, site.all_gather_object)
        return masks.sum(values[rank].clone(), 2, site.all_reduce)

    federation = Federation(tmp_path, [program] * 3)
    federation.run()
    assert not federation.errors, federation.errors
    total = values[0] + values[1] + values[2]
    for name in NAMES:
        assert torch.allclose(federation.results[name], total, atol=3 * 2.0**-32)
    sums = [step for step in federation.received if next(iter(step.values()))["op"] == "sum"]
    assert len(sums) == 1
    for node, answer in sums[0].items():
        rank = federation.nodes[node]
        own = torch.cat(encode(values[rank], 32))
        sent = answer["payload"].flatten()
        assert sent.dtype == torch.int64 and sent.numel() == own.numel()
        assert not (sent == own).any(), NAMES[rank]


def test_the_mailbox_is_the_users_alone_replaces_a_stale_one_and_times_out_clearly(tmp_path):
    """The socket is created mode 0600 (a stale one from a killed site is replaced); a
    second open (a test after the fit) keeps it; a site without a server's message for
    ``timeout`` seconds stops, naming its mailbox; timeouts must be positive."""
    import stat

    stale = tmp_path / "usa" / "usa.sock"
    stale.parent.mkdir()
    stale.write_text("left by a killed site")
    site = FlowerSite(mailbox=str(tmp_path / "{silo}" / "{silo}.sock"), timeout=0.3)
    site.open(0, 2, "usa")
    assert stat.S_ISSOCK(stale.stat().st_mode)
    assert stat.S_IMODE(stale.stat().st_mode) == 0o600
    listener = site._listener
    site.open(0, 2, "usa")
    assert site._listener is listener
    with pytest.raises(FlowerRunStopped, match=r"site 'usa' had no message .* for 0 s .*usa.sock"):
        site.all_reduce(torch.ones(1))
    site.close()
    assert not stale.exists()
    assert FlowerSite(timeout=1e-3).timeout == 1e-3
    longest = "m" * 102 + ".sock"  # 107 bytes, relative: bound as written
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        fits = FlowerSite(mailbox=longest)
        fits.open(0, 1, "usa")
        fits._stopped = True  # nothing to answer
        fits.close()
        with pytest.raises(OSError, match=r"is 108 bytes; a Unix socket's path is at most 107"):
            FlowerSite(mailbox="m" + longest).open(0, 1, "usa")
        with pytest.raises(OSError, match="is 108 bytes"):
            _through_mailbox("m" + longest, b"", 1.0, 0.0)
    finally:
        os.chdir(cwd)
    with pytest.raises(ValueError, match="timeout must be positive"):
        FlowerSite(timeout=0)


class KeySwappingRelay(Federation):
    """A server that relays the key agreement dishonestly: to ``victims`` it hands its own
    X25519 public key in place of site ``swapped``'s (to ``swapped`` itself, in place of
    every other site's: a man in the middle), keeping the signatures that came with the
    real keys."""

    def __init__(self, tmp: Path, programs, swapped: int, victims: tuple[int, ...]) -> None:
        super().__init__(tmp, programs)
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        from lightning_fl.systems.pairwise_masking import public_bytes

        self.private = X25519PrivateKey.generate()
        self.public = public_bytes(self.private)
        self.swapped, self.victims, self.swaps = swapped, victims, 0

    def request_for(self, rank: int, request: bytes) -> bytes:
        value = wire.decode(request)
        offers = value.get("result")
        is_keys = (
            isinstance(offers, list)
            and len(offers) == len(NAMES)
            and all(
                isinstance(o, bytes) or (isinstance(o, tuple) and isinstance(o[0], bytes))
                for o in offers
            )
        )
        if not is_keys or rank not in self.victims:
            return request
        self.swaps += 1
        for other, offer in enumerate(offers):  # the victim's view of the others' keys
            if (other == self.swapped) != (rank == self.swapped):
                offers[other] = (self.public, offer[1]) if isinstance(offer, tuple) else self.public
        return wire.encode(value)

    def unmask(self, sent: torch.Tensor, site_public: bytes, round_idx: int) -> torch.Tensor:
        """Site ``swapped``'s values from what it sent: the relay holds the keys the site
        believes it shares with the other sites, so it subtracts the site's whole mask."""
        from lightning_fl.systems.pairwise_masking import (
            PairwiseMasks,
            add,
            carry_sum,
            decode,
            negate,
            pair_key,
        )

        keys = {other: pair_key(self.private, site_public, other, self.swapped)
                for other in range(len(NAMES)) if other != self.swapped}  # fmt: skip
        size = sent.numel() // 2
        mask = PairwiseMasks(self.swapped, keys).mask(torch.zeros(size), round_idx)
        return decode(*add(carry_sum((sent[:size], sent[size:])), negate(mask)), 32)


def _masked_sum_program(values, signatures=None):
    from lightning_fl.systems.pairwise_masking import PairwiseMasks

    def program(site: FlowerSite, rank: int):
        signed = signatures(rank) if signatures else None
        masks = PairwiseMasks.agree(rank, 3, site.all_gather_object, signatures=signed)
        return masks.sum(values[rank].clone(), 2, site.all_reduce)

    return program


def _site_signatures(tmp_path):
    """Each site's signing keys (the credentials command's node keys, written under
    ``tmp_path/creds``), by rank."""
    from lightning_fl.flower.credentials import write_credentials
    from lightning_fl.systems.key_signatures import SiteSignatures

    creds = tmp_path / "creds"
    write_credentials(creds, NAMES)

    def signatures(rank):
        return SiteSignatures.from_files(str(creds / "{silo}.key"), str(creds / "{silo}.pub"),
                                         NAMES, rank)  # fmt: skip

    return signatures


def _values():
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(30, generator=generator, dtype=torch.float64) for _ in NAMES]


def test_unsigned_a_relay_that_swaps_keys_reads_a_sites_values(tmp_path):
    """The fault of issue 76 shown: with unsigned keys a relay that hands its own key to
    the sites in hungary's place and to hungary in theirs (a man in the middle) subtracts
    hungary's mask from what hungary sends and reads its values exactly."""
    pytest.importorskip("cryptography")
    values = _values()
    relay = KeySwappingRelay(tmp_path, [_masked_sum_program(values)] * 3, swapped=1,
                             victims=(0, 1, 2))  # fmt: skip
    relay.run()
    gathers = [s for s in relay.received if next(iter(s.values()))["op"] == "gather"]
    sums = [s for s in relay.received if next(iter(s.values()))["op"] == "sum"]
    node = next(n for n, r in relay.nodes.items() if r == 1)
    hungary_public = gathers[0][node]["payload"]
    read = relay.unmask(sums[0][node]["payload"].flatten(), hungary_public, 2)
    assert torch.allclose(read, values[1], atol=2.0**-32)


def test_signed_a_swapped_key_stops_every_site_naming_it(tmp_path):
    """With site signing keys (the Flower node keys of the credentials command) the same
    relay, swapping hungary's key towards usa and switzerland only, is detected: every
    site stops with one error naming hungary, before any value is masked."""
    pytest.importorskip("cryptography")
    from lightning_fl.systems.key_signatures import KeyAuthenticationError

    signatures = _site_signatures(tmp_path)
    values = _values()
    honest = Federation(tmp_path, [_masked_sum_program(values, signatures)] * 3)
    honest.run()
    assert not honest.errors, honest.errors
    assert torch.allclose(honest.results["usa"], sum(values), atol=3 * 2.0**-32)

    relay = KeySwappingRelay(tmp_path, [_masked_sum_program(values, signatures)] * 3,
                             swapped=1, victims=(0, 2))  # fmt: skip
    with pytest.raises(Exception):  # noqa: B017 (the server's loop stops on the failed sites)
        relay.run()
    assert relay.swaps == 2
    assert set(relay.errors) == set(NAMES), relay.errors
    for name, error in relay.errors.items():
        assert isinstance(error, KeyAuthenticationError), (name, error)
        assert "key of site 'hungary' (rank 1) is not signed" in str(error)
        assert "found by usa, switzerland" in str(error)
    assert not [s for s in relay.received if next(iter(s.values()))["op"] == "sum"]


# ----------------------------------------------------------------- sites that drop (issue 76)
def test_a_site_killed_at_a_step_that_may_miss_it_is_dropped_and_the_others_go_on(tmp_path):
    """min_sites=2 of 3: hungary's process dies at the second sum; that sum is usa's and
    switzerland's alone and names rank 1 missing, hungary is not asked again, and a
    gather lists what the caller says a missing site contributes."""

    def program(site: FlowerSite, rank: int):
        first = torch.tensor([1.0, float(rank)])
        missing_first = site.sum_present(first)
        if NAMES[rank] == "hungary":
            kill(site)
        second = torch.tensor([10.0**rank])
        missing = site.sum_present(second)
        listed = site.gather_present(NAMES[rank], absent="gone")
        return first, missing_first, second, missing, listed

    federation = Federation(tmp_path, [program] * 3, min_sites=2)
    assert federation.run() == 3  # two sums, a gather, then done
    assert not federation.errors, federation.errors
    assert "hungary" not in federation.results
    for name in ("usa", "switzerland"):
        first, missing_first, second, missing, listed = federation.results[name]
        assert first.tolist() == [3.0, 3.0] and missing_first == frozenset()
        assert second.tolist() == [101.0] and missing == frozenset({1})
        assert listed == ["usa", "gone", "switzerland"]
    hungary = next(node for node, rank in federation.nodes.items() if rank == 1)
    assert all(hungary not in step for step in federation.received[2:])
    assert isinstance(federation.received[1][hungary], str)  # why it has no answer


def test_after_a_drop_a_step_that_needs_every_site_stops_the_run_naming_the_dropped_one(
    tmp_path,
):
    def program(site: FlowerSite, rank: int):
        site.sum_present(torch.ones(1))
        if NAMES[rank] == "hungary":
            kill(site)
        site.sum_present(torch.ones(1))
        site.all_gather_object(rank)  # the set-up's kind: every site needed

    federation = Federation(tmp_path, [program] * 3, min_sites=2)
    with pytest.raises(SiteFailure, match=r"site 'hungary' .*dropped earlier, and step 2 "
                                          r"\(gather\) needs every site"):  # fmt: skip
        federation.run()
    for name in ("usa", "switzerland"):
        assert isinstance(federation.errors[name], FlowerRunStopped)


def test_a_drop_below_min_sites_or_at_a_step_that_needs_every_site_stops_the_run(tmp_path):
    def program(site: FlowerSite, rank: int):
        site.sum_present(torch.ones(1))
        if NAMES[rank] == "hungary":
            kill(site)
        site.sum_present(torch.ones(1))

    federation = Federation(tmp_path, [program] * 3)  # min_sites: every site, by default
    with pytest.raises(SiteFailure, match="2 of 3 sites remain, fewer than min_sites=3"):
        federation.run()

    def strict(site: FlowerSite, rank: int):
        site.all_reduce(torch.ones(1))
        if NAMES[rank] == "hungary":
            kill(site)
        site.all_reduce(torch.ones(1))

    federation = Federation(tmp_path, [strict] * 3, min_sites=2)
    with pytest.raises(SiteFailure, match=r"site 'hungary' \(SuperNode 101\) closed its mailbox"):
        federation.run()
    for bad in (0, True):
        with pytest.raises(ValueError, match=f"min_sites must be an integer >= 1, got {bad}"):
            FlowerSite(min_sites=bad)
    assert FlowerSite(min_sites=1).min_sites(3) == 1
    assert FlowerSite().min_sites(3) == 3  # every site, by default
    with pytest.raises(ValueError, match=r"min_sites=4\) on a run of 3 sites: set min_sites to"):
        FlowerSite(mailbox=str(tmp_path / "x.sock"), min_sites=4).open(0, 3, "usa")


def _surviving_sum_program(values, kill_at, signatures=None):
    """Two rounds of :func:`sum_surviving_sites` (min_sites=2); hungary's process dies at
    its ``kill_at``-th collective of the first round (0: it never does)."""
    from lightning_fl.systems.double_masking import DoubleMaskingSite, sum_surviving_sites

    def program(site: FlowerSite, rank: int):
        calls = [0]

        def dying(collective):
            def call(*args):
                calls[0] += 1
                if NAMES[rank] == "hungary" and calls[0] == kill_at:
                    kill(site)
                return collective(*args)

            return call

        signed = signatures(rank) if signatures else None
        rounds = []
        for round_idx in (4, 5):
            instance = DoubleMaskingSite(rank, 3, 2)
            rounds.append(sum_surviving_sites(values[rank].clone(), round_idx, instance,
                                              dying(site.gather_present),
                                              dying(site.sum_present), signed))  # fmt: skip
        return rounds

    return program


@pytest.mark.parametrize("killed", ["before its masked input", "after its masked input"])
def test_secure_aggregation_survives_a_killed_site_and_the_relay_sees_only_masked_limbs(
    tmp_path, killed
):
    """Bonawitz et al.'s protocol through the relay, signed keys, min_sites=2 of 3:
    hungary's process dies before its masked input (4th collective: offers, verdicts,
    shares, then the sum) or after it (5th: the unmasking shares). The round's total is
    the exact sum of the sites whose input arrived (usa's and switzerland's; all three
    when hungary's arrived), the next round (a fresh instance without hungary) completes,
    and no sum the relay receives is a site's own encoding in any limb."""
    pytest.importorskip("cryptography")
    from lightning_fl.systems.pairwise_masking import encode

    signatures = _site_signatures(tmp_path)
    values = _values()
    kill_at = 4 if killed == "before its masked input" else 5
    federation = Federation(tmp_path, [_surviving_sum_program(values, kill_at, signatures)] * 3,
                            min_sites=2)  # fmt: skip
    federation.run()
    assert not federation.errors, federation.errors
    first = values[0] + values[2] + (values[1] if kill_at == 5 else 0)
    for name in ("usa", "switzerland"):
        (total, missing), (after, missing_after) = federation.results[name]
        assert torch.allclose(total, first, atol=3 * 2.0**-32), name
        assert missing == (frozenset({1}) if kill_at == 4 else frozenset())
        assert torch.allclose(after, values[0] + values[2], atol=2 * 2.0**-32), name
        assert missing_after == frozenset({1})
    sums = [s for s in federation.received
            if any(not isinstance(a, str) and a["op"] == "sum" for a in s.values())]  # fmt: skip
    assert len(sums) == 2
    for step in sums:
        for node, answer in step.items():
            if isinstance(answer, str):
                continue
            own = torch.cat(encode(values[federation.nodes[node]], 32))
            assert not (answer["payload"].flatten() == own).any(), NAMES[federation.nodes[node]]


def test_the_server_admits_a_probed_site_only_as_its_own_rank_and_holds_its_answer():
    """At a step where the sites ask who rejoins, the server probes the dropped sites: one
    whose process is not back (a string), or that answers as another rank, stays
    dropped; one that answers as itself is admitted, its answer held for the next step,
    where only the others are asked."""
    from lightning_fl.flower.apps import REJOIN

    relay = StepRelay(3)

    def answer(rank, op, payload=None):
        return {"rank": rank, "site": NAMES[rank], "op": op, "payload": payload,
                "min_sites": 2}  # fmt: skip

    relay.combine(0, {100 + r: answer(r, "sum", torch.ones(1)) for r in range(3)})
    relay.combine(1, {100: answer(0, "sum", torch.ones(1)), 101: "closed its mailbox",
                      102: answer(2, "sum", torch.ones(1))})  # fmt: skip
    assert relay.absent == [1] and relay.present_nodes() == [100, 102]
    finished, result = relay.combine(2, {100: answer(0, "rejoin"), 102: answer(2, "rejoin")})
    assert (finished, result) == (False, REJOIN)
    assert relay.admit({101: "has no site process"}) == {} and relay.absent == [1]
    assert relay.admit({101: answer(2, "gather", "x")}) == {} and relay.absent == [1]
    back = answer(1, "gather", "hungary's first step")
    held = relay.admit({101: back})
    assert held == {101: back} and relay.absent == []
    assert relay.asked_next(held) == [100, 102]
    _, listed = relay.combine(3, {100: answer(0, "gather", "usa"), 102: answer(2, "gather", "ch"),
                                  **held})  # fmt: skip
    assert listed == ["usa", "hungary's first step", "ch"]


def test_a_killed_site_started_again_is_probed_admitted_and_welcomed(tmp_path, caplog):
    """min_sites=2 of 3: hungary dies at the second sum; at each round's start the others
    ask who rejoins (the server probes hungary's mailbox: nobody until hungary's new
    process opens it); once back, hungary's first collective is answered together with
    the others' next one, and every site sums again."""
    back = threading.Event()

    def program(site: FlowerSite, rank: int):
        site.sum_present(torch.ones(1))
        if NAMES[rank] == "hungary":
            kill(site)
        missing = site.sum_present(torch.ones(1))
        joining, asked = site.rejoining(), 1
        back.set()  # hungary's new process may start now
        while not joining:
            joining, asked = site.rejoining(), asked + 1
        listed = site.all_gather_object(f"{NAMES[rank]} welcomes")
        total = torch.ones(1)
        site.sum_present(total)
        return missing, joining, asked, listed, total

    def rejoining_hungary():
        back.wait(30)
        site = FlowerSite(mailbox=str(tmp_path / "{silo}.sock"), timeout=20, min_sites=2)
        site.open(1, 3, "hungary")
        listed = site.all_gather_object("hungary is back")
        total = torch.ones(1)
        site.sum_present(total)
        site.close()
        return listed, total

    federation = Federation(tmp_path, [program] * 3, min_sites=2)
    caplog.set_level("WARNING", logger="lightning_fl.flower.apps")
    with ThreadPoolExecutor(1) as pool:
        hungary = pool.submit(rejoining_hungary)
        federation.run()
        listed, total = hungary.result(timeout=30)
    assert not federation.errors, federation.errors
    everyone = ["usa welcomes", "hungary is back", "switzerland welcomes"]
    assert listed == everyone and total.tolist() == [3.0]
    for name in ("usa", "switzerland"):
        missing, joining, asked, listed, total = federation.results[name]
        assert missing == frozenset({1}) and joining == [1] and asked >= 2
        assert listed == everyone and total.tolist() == [3.0]
    log = caplog.text
    assert "site 'hungary' (SuperNode 101) closed its mailbox without answering" in log
    assert "dropped at step 1; the run goes on with 2 of 3 sites (min_sites=2)" in log
    assert "site 'hungary' (SuperNode 101) is back" in log


def test_the_server_counts_the_sites_left_over_several_drops_and_reads_min_sites():
    relay = StepRelay(3)

    def answer(rank, min_sites=1, **kw):
        return {"rank": rank, "site": NAMES[rank], "op": "sum", "payload": torch.ones(1),
                "min_sites": min_sites, **kw}  # fmt: skip

    relay.combine(0, {100 + r: answer(r) for r in range(3)})
    relay.combine(1, {100: answer(0), 101: "gone", 102: answer(2)})
    total = relay.combine(2, {100: answer(0), 102: "gone too"})[1]
    assert relay.absent == [1, 2] and total.tolist() == [1.0]  # usa alone, min_sites=1
    strict = StepRelay(3)
    strict.combine(0, {100 + r: answer(r, 2) for r in range(3)})
    strict.combine(1, {100: answer(0, 2), 101: "gone", 102: answer(2, 2)})
    with pytest.raises(SiteFailure, match="'switzerland' .* gone too; 1 of 3 sites remain, fewer"):
        strict.combine(2, {100: answer(0, 2), 102: "gone too"})
    mixed = StepRelay(3)
    mixed.combine(0, {100 + r: answer(r) for r in range(3)})
    plain = {"rank": 2, "site": "switzerland", "op": "sum", "payload": torch.ones(1)}
    with pytest.raises(SiteFailure, match=r"^site 'hungary' \(SuperNode 101\) gone$"):
        mixed.combine(1, {100: answer(0), 101: "gone", 102: plain})  # one site needs all
    assert RunSettings(sites=3, step_timeout=10).probe_timeout == 10
    assert RunSettings(sites=3).probe_timeout == 30
