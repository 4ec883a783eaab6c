"""The per-client store (engine/client_store.py): its entries, their size, its checkpoint
form, and the moves of client entries between ranks, on two ranks simulated by threads
that meet in a fake ``all_gather_object``."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_fl.engine import collectives
from lightning_fl.engine.client_store import ClientStore, move_client_states


def test_entries_their_bytes_and_the_checkpoint_form_by_hand():
    """10 float32 and 3 float64 values are 40 + 24 bytes (numbers and strings count
    nothing); the checkpoint form copies each client's dict and loads string client ids
    as integers."""
    store = ClientStore()
    store.set(4, "c", torch.zeros(10))
    store.set(4, "name", "head")
    store.set(1, "w", torch.zeros(3, dtype=torch.float64))
    store.set(1, "steps", 7)
    assert store.nbytes() == 64
    assert store.clients() == [1, 4] and store.get(1, "steps") == 7
    assert store.get(2, "c", "none") == "none"
    saved = store.state_dict()
    saved[4]["name"] = "changed"  # the saved form is a copy
    assert store.get(4, "name") == "head"
    again = ClientStore()
    loaded = {"4": {"name": "head"}, "1": {"steps": 7}}
    again.load_state_dict(loaded)
    loaded["4"]["name"] = "changed"
    assert again.clients() == [1, 4] and again.get(4, "name") == "head"
    assert again.pop(4) == {"name": "head"} and again.pop(4) == {}
    again.put(5, {})
    assert again.clients() == [1]  # nothing for none


def _on_two_ranks(stores, moves, monkeypatch):
    """Run move_client_states on ranks 0 and 1 at once; returns what each sent."""
    barrier, sent, rank_of = threading.Barrier(2), [None, None], threading.local()

    class TwoThreads(collectives.Collectives):
        def all_gather_object(self, obj):
            sent[rank_of.rank] = obj
            barrier.wait(timeout=10)
            parts = list(sent)
            barrier.wait(timeout=10)
            return parts

        def all_reduce(self, tensor):
            raise AssertionError("moves gather, they do not sum")

        broadcast = all_reduce

    monkeypatch.setattr(collectives, "_installed", TwoThreads())
    errors = []

    def run(rank):
        rank_of.rank = rank
        try:
            move_client_states(stores[rank], moves, rank, 2)
        except Exception as error:  # noqa: BLE001 - reported by the test
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return sent


def test_client_entries_move_between_two_ranks(monkeypatch):
    """Client 0 moves 0 → 1 and client 1 moves 1 → 0; clients 2 and 3 stay; client 5
    moves without entries. Each rank sends only what leaves it (on the CPU) and keeps only
    what it needs: the sender no longer holds a moved client."""
    stores = [ClientStore(), ClientStore()]
    stores[0].set(0, "c", torch.tensor([1.0, 2.0]))
    stores[0].set(3, "c", torch.tensor([3.0]))
    stores[1].set(1, "c", torch.tensor([4.0]))
    stores[1].set(1, "n", 2)
    stores[1].set(2, "c", torch.tensor([5.0]))
    moves = {0: (0, 1), 1: (1, 0), 2: (1, 1), 3: (0, 0), 5: (0, 1)}
    sent = _on_two_ranks(stores, moves, monkeypatch)
    assert sorted(sent[0]) == [0, 5] and sorted(sent[1]) == [1]
    assert stores[0].clients() == [1, 3] and stores[1].clients() == [0, 2]
    assert torch.equal(stores[1].get(0, "c"), torch.tensor([1.0, 2.0]))
    assert torch.equal(stores[0].get(1, "c"), torch.tensor([4.0])) and stores[0].get(1, "n") == 2
    assert torch.equal(stores[0].get(3, "c"), torch.tensor([3.0]))


def test_no_move_means_no_collective(monkeypatch):
    class Refuse(collectives.Collectives):
        def all_gather_object(self, obj):
            raise AssertionError("all_gather_object was called")

        all_reduce = broadcast = all_gather_object

    monkeypatch.setattr(collectives, "_installed", Refuse())
    store = ClientStore()
    store.set(0, "c", torch.tensor([1.0]))
    move_client_states(store, {0: (1, 1), 1: (0, 0)}, 0, 2)
    assert store.clients() == [0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the GPU test mode)")
def test_moved_entries_travel_on_the_cpu(monkeypatch):
    stores = [ClientStore(), ClientStore()]
    stores[0].set(0, "c", torch.tensor([1.0], device="cuda"))
    sent = _on_two_ranks(stores, {0: (0, 1)}, monkeypatch)
    assert sent[0][0]["c"].device.type == "cpu"
