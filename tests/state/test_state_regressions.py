"""Regression tests, one per failure mode a peer shipped (DESIGN.md, "Known failure modes").

Each scenario runs twice: with pdgrpc's guard (the test that protects users), and with the
guard removed by monkeypatching (``..._detects_missing_guard``), which must produce the
failure. The second half proves the first can fail: if a refactor made the scenario stop
exercising the guard, the "missing guard" twin would start passing vacuously and fail.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdgrpc.kvpoll import KVPoll
from pdgrpc.state import (
    AbortReason,
    Aborted,
    Committed,
    DecodeQueues,
    MetadataBuffers,
    MetadataRow,
    NewRequest,
    decode_transfers,
    metadata,
    pages,
)
from state_sim import Cluster, Violation, token_of


# -- stale room after slot reuse ----------------------------------------------------------
def stale_room_scenario() -> list[Committed | Aborted]:
    """One slot. Room A commits; room B reuses the slot and its KV finishes before its
    metadata row lands (the TCP race behind the peers' ~3% false aborts)."""
    b = MetadataBuffers(1)
    q = DecodeQueues(b, 4)
    q.add(NewRequest(111, "p", 1, dp_rank=0), 0.0)
    (hs,) = q.prealloc(0.0)
    b.write_row(hs.slot, MetadataRow(token_of(111)), 111)
    q.on_local_status(111, KVPoll.SUCCESS)
    outs = q.poll_transfers(0.1)
    q.add(NewRequest(222, "p", 1, dp_rank=0), 0.2)
    (hs2,) = q.prealloc(0.2)
    assert hs2.slot == hs.slot
    q.on_local_status(222, KVPoll.SUCCESS)  # KV done, row not landed yet
    outs += q.poll_transfers(0.3)
    b.write_row(hs2.slot, MetadataRow(token_of(222)), 222)
    outs += q.poll_transfers(0.4)
    return outs


def test_stale_room_after_slot_reuse() -> None:
    outs = stale_room_scenario()
    assert [(type(o).__name__, o.room) for o in outs] == [("Committed", 111), ("Committed", 222)]
    assert isinstance(outs[1], Committed) and outs[1].row is not None and outs[1].row.output_id == token_of(222)


def test_stale_room_after_slot_reuse_detects_missing_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metadata.MetadataBuffers, "clear_room", lambda self, slot: None)  # free() no longer zeroes
    outs = stale_room_scenario()
    assert isinstance(outs[1], Aborted) and outs[1].reason is AbortReason.METADATA_CORRUPTION
    assert "found 111" in outs[1].message


# -- gate applied after the reduce instead of before ---------------------------------------
def gate_order_scenario(gate_after_reduce: bool) -> Cluster:
    """Two TP ranks; KV is done on both, the metadata row has landed on rank 0 only."""
    c = Cluster(2, gate_after_reduce=gate_after_reduce)
    c.add(5)
    c.prealloc()
    for r in range(2):
        c.report(r, 5, KVPoll.SUCCESS)
    c.land(0, 5)
    c.poll()
    return c


def test_gate_before_reduce_keeps_ranks_in_lock_step() -> None:
    c = gate_order_scenario(gate_after_reduce=False)
    c.check()
    assert c.pops == [[], []]  # nobody pops until rank 1's row lands...
    c.land(1, 5)
    c.poll()
    c.check()
    assert c.pops == [[("commit", 5, 0)]] * 2  # ...then both pop it at the same poll


def test_gate_after_reduce_detects_missing_guard() -> None:
    c = gate_order_scenario(gate_after_reduce=True)
    assert c.pops == [[("commit", 5, 0)], []]  # rank 0 popped, rank 1 did not: a hang in production
    with pytest.raises(Violation, match="popped different sequences"):
        c.check()


# -- corruption injected into a slot --------------------------------------------------------
def corruption_scenario(seed: int, n: int = 200) -> tuple[dict[int, Committed | Aborted], set[int], list[tuple[int, int]]]:
    """``n`` requests over 3 TP ranks; a random third get a wrong room written into their
    slot on one random rank, at a random moment before the KV finishes or after it."""
    rng = random.Random(seed)
    tp = 3
    bufs = [MetadataBuffers(16) for _ in range(tp)]
    qs = [DecodeQueues(b, 64) for b in bufs]
    results: dict[int, Committed | Aborted] = {}
    corrupted: set[int] = set()
    emitted: list[tuple[int, int]] = []  # (room, first token) committed on any rank
    rooms = [rng.randrange(1, 1 << 63) for _ in range(n)]
    pending = list(rooms)
    now = 0.0
    while len(results) < n:
        now += 0.01
        while pending and qs[0].slots.num_free and qs[0].pages.num_free >= 2:
            room = pending.pop()
            for q in qs:
                q.add(NewRequest(room, "p", 2, dp_rank=0), now)
            hs = [q.prealloc(now) for q in qs]
            assert all(h == hs[0] for h in hs)
            slot = hs[0][0].slot
            bad = rng.random() < 0.33
            bad_rank = rng.randrange(tp)
            for r in range(tp):
                if bad and r == bad_rank:
                    wrong = rng.choice([x for x in rooms if x != room] + [rng.randrange(1, 1 << 63)])
                    bufs[r].write_row(slot, MetadataRow(token_of(wrong)), wrong)
                    corrupted.add(room)
                elif rng.random() < 0.8:
                    bufs[r].write_row(slot, MetadataRow(token_of(room)), room)
                if rng.random() < 0.9:
                    qs[r].on_local_status(room, KVPoll.SUCCESS)
        reduced = torch.stack([q.prepare_poll(now) for q in qs]).amin(0)
        for i, q in enumerate(qs):
            for out in q.finish_poll(reduced.clone(), now):
                if isinstance(out, Committed):
                    assert out.row is not None
                    emitted.append((out.room, out.row.output_id))
                    q.release_pages(out.pages)  # the engine is done with it at once
                if i == 0:
                    results[out.room] = out
        # rows and KV that were late arrive now; aborts are acked
        for room in rooms:
            for q, b in zip(qs, bufs):
                slot = q.slot_of(room)
                if slot is None:
                    continue
                if q.is_quarantined(room):
                    q.on_abort_ack(room)
                elif b.room(slot) == 0:
                    b.write_row(slot, MetadataRow(token_of(room)), room)
                else:
                    q.on_local_status(room, KVPoll.SUCCESS)
    return results, corrupted, emitted


@pytest.mark.parametrize("seed", [1, 2])
def test_corruption_injected_in_slot_detected_every_time(seed: int) -> None:
    results, corrupted, emitted = corruption_scenario(seed)
    assert len(corrupted) > 30
    assert all(token == token_of(room) for room, token in emitted)
    for room, out in results.items():
        if room in corrupted:
            assert isinstance(out, Aborted), f"corrupted room {room} was committed: its token would be emitted"
            assert out.reason is AbortReason.METADATA_CORRUPTION
            assert "bootstrap_room mismatch" in out.message
        else:
            assert isinstance(out, Committed) and out.row is not None and out.row.output_id == token_of(room)


def test_corruption_injected_in_slot_detects_missing_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    real = decode_transfers.metadata_gate

    def gate_without_room_check(state: int, landed: int, expected: int) -> tuple[int, bool]:
        gated, corrupt = real(state, landed, expected)  # keep the "not landed" half of the gate
        return (state, False) if corrupt else (gated, False)

    monkeypatch.setattr(decode_transfers, "metadata_gate", gate_without_room_check)
    results, corrupted, emitted = corruption_scenario(1)
    assert any(isinstance(results[r], Committed) for r in corrupted), "corrupted rows get committed"
    assert any(token != token_of(room) for room, token in emitted), "another request's token is emitted"


# -- a page reused while its writer was still live -----------------------------------------
def live_writer_scenario() -> tuple[Cluster, int, int]:
    """Pool of 2 pages. A is cancelled mid-transfer while its prefill still writes; B asks
    for pages; then A's writer sends a late write."""
    c = Cluster(1, num_slots=2, num_pages=2)
    a, b = 10, 20
    c.add(a, num_pages=2)
    c.prealloc()
    c.report(0, a, KVPoll.TRANSFERRING)
    c.cancel(a)
    c.poll()  # A aborted; its prefill has not acknowledged
    c.add(b, num_pages=2)
    c.prealloc()
    c.late_write(a)
    c.poll()
    return c, a, b


def test_page_reused_while_writer_live() -> None:
    c, a, b = live_writer_scenario()
    c.check()
    assert c.truth[b].slot is None  # B waits for memory...
    c.ack(a)
    c.poll()
    c.prealloc()
    assert set(c.truth[b].pages) == set(c.truth[a].pages)  # ...and gets A's pages once A's writer is gone
    c.check()
    c.quiesce()


def test_page_reused_while_writer_live_lease_expiry() -> None:
    c, a, b = live_writer_scenario()
    c.advance(c.deadlines.abort_lease_s + 1)  # the prefill never acks: the lease frees the pages
    c.poll()
    c.prealloc()
    assert c.truth[b].slot is not None
    c.check()


def test_page_reused_while_writer_live_detects_missing_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_quarantine(self: pages.PageAllocator, owner: int, pgs: tuple[int, ...]) -> None:
        self.free(pgs)
        self._quarantine[owner] = ()

    monkeypatch.setattr(pages.PageAllocator, "quarantine", no_quarantine)
    c, a, b = live_writer_scenario()
    with pytest.raises(Violation, match=r"pages \[0, 1\] given to room 20 while room 10's writer is live"):
        c.check()
