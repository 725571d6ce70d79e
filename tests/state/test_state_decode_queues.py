"""The decode queues: dp-rank resolution, prealloc, the gated transfer poll, commit, aborts,
quarantine and deadlines, driven the way the decode server drives them."""

from __future__ import annotations

import random

import pytest
import torch

from pdgrpc.errors import ConfigError, StateError
from pdgrpc.state import decode_transfers
from pdgrpc.state import (
    AbortReason,
    Aborted,
    Committed,
    DecodeDeadlines,
    DecodeQueues,
    DecodeState,
    DpConfig,
    KVPoll,
    MetadataBuffers,
    MetadataRow,
    NewRequest,
    QueryDpRanks,
    SendHandshake,
    identity_reduce,
)

DL = DecodeDeadlines(resolve_dp_rank_s=1, allocate_s=2, bootstrap_s=3, waiting_for_input_s=4, transferring_s=5, abort_lease_s=6)


def make(num_slots: int = 4, num_pages: int = 16, query_interval_s: float = 0.05) -> tuple[DecodeQueues, MetadataBuffers]:
    b = MetadataBuffers(num_slots)
    return DecodeQueues(b, num_pages, deadlines=DL, query_interval_s=query_interval_s), b


def admit(q: DecodeQueues, room: int, now: float = 0.0, pages: int = 2, fake: bool = False) -> SendHandshake:
    q.add(NewRequest(room, "p:1", pages, dp_rank=0, fake=fake), now)
    (hs,) = q.prealloc(now)
    return hs


def test_happy_path_commits_first_token_and_frees_the_slot() -> None:
    q, b = make()
    hs = admit(q, 42)
    assert hs == SendHandshake(42, "p:1", 0, 0, (0, 1)) and q.state_of(42) is DecodeState.BOOTSTRAPPING
    q.on_local_status(42, KVPoll.WAITING_FOR_INPUT)
    assert q.poll_transfers(0.1, identity_reduce) == [] and q.state_of(42) is DecodeState.WAITING_FOR_INPUT
    q.on_local_status(42, KVPoll.TRANSFERRING)
    assert q.poll_transfers(0.2) == [] and q.state_of(42) is DecodeState.TRANSFERRING
    b.write_row(hs.slot, MetadataRow(7, cached_tokens=3, top_logprobs_values=(-0.25,), top_logprobs_indices=(7,)), 42)
    q.on_local_status(42, KVPoll.SUCCESS)
    (out,) = q.poll_transfers(0.3)
    assert isinstance(out, Committed) and out.room == 42 and out.pages == (0, 1)
    assert out.row is not None and (out.row.output_id, out.row.cached_tokens) == (7, 3)
    assert out.row.top_logprobs_values[0] == -0.25 and out.row.top_logprobs_indices[0] == 7
    assert b.room(hs.slot) == 0 and q.slots.num_free == 4 and q.state_of(42) is None
    assert q.pages.num_free == 14  # the engine holds the pages...
    q.release_pages(out.pages)
    assert q.is_idle()  # ...until it is done with them


def test_kv_success_waits_for_the_metadata_row() -> None:
    q, b = make()
    hs = admit(q, 42)
    q.on_local_status(42, KVPoll.SUCCESS)
    for t in (0.1, 0.2, 0.3):
        assert q.poll_transfers(t) == [] and q.state_of(42) is DecodeState.TRANSFERRING
    b.write_row(hs.slot, MetadataRow(7), 42)
    assert [type(o) for o in q.poll_transfers(0.4)] == [Committed]


def test_landed_row_without_kv_success_does_not_commit() -> None:
    q, b = make()
    hs = admit(q, 42)
    b.write_row(hs.slot, MetadataRow(7), 42)
    q.on_local_status(42, KVPoll.TRANSFERRING)
    assert q.poll_transfers(0.1) == []


def test_fake_transfer_skips_the_gate() -> None:
    q, _ = make()
    admit(q, 42, fake=True)
    q.on_local_status(42, KVPoll.SUCCESS)
    (out,) = q.poll_transfers(0.1)
    assert isinstance(out, Committed) and out.row is None


def test_reports_move_forward_only_and_late_failures_are_ignored() -> None:
    q, b = make(num_slots=1)
    hs = admit(q, 42)
    b.write_row(hs.slot, MetadataRow(7), 42)
    q.on_local_status(42, KVPoll.SUCCESS)
    q.on_local_status(42, KVPoll.TRANSFERRING)  # late, lower: ignored
    (out,) = q.poll_transfers(0.1)
    assert isinstance(out, Committed)
    q.release_pages(out.pages)
    hs2 = admit(q, 43, now=0.2)
    assert hs2.slot == hs.slot
    q.on_local_status(42, KVPoll.FAILED)  # a FAILED for the committed room: must not hit 43
    q.on_local_status(999, KVPoll.FAILED)  # never known
    assert q.poll_transfers(0.3) == [] and q.state_of(43) is DecodeState.BOOTSTRAPPING


def test_transport_failure_aborts_and_quarantines_until_ack() -> None:
    q, _ = make(num_slots=1, num_pages=2)
    admit(q, 42)
    q.on_local_status(42, KVPoll.FAILED)
    (out,) = q.poll_transfers(0.1)
    assert isinstance(out, Aborted) and out.reason is AbortReason.TRANSFER_FAILED and out.awaiting_ack
    assert out.state == "BOOTSTRAPPING" and "transfer failed in state BOOTSTRAPPING" in out.message
    q.add(NewRequest(43, "p:1", 2, dp_rank=0), 0.2)
    assert q.prealloc(0.2) == [] and q.is_quarantined(42)  # slot and pages held for 42's writer
    assert q.poll_transfers(0.3) == [] and q.prealloc(0.3) == []
    assert q.on_abort_ack(42) and not q.on_abort_ack(777)
    assert q.poll_transfers(0.4) == []  # releases at this poll
    assert not q.is_quarantined(42)
    (hs,) = q.prealloc(0.4)
    assert hs.room == 43


def test_a_dead_peer_aborts_as_peer_failure() -> None:
    """The issue: "A peer's death is counted as peer_failure". The transport says why the
    room failed (its peer is gone); the abort carries it, quarantined like any other."""
    q, _ = make(num_slots=2, num_pages=4)
    admit(q, 42)
    admit(q, 43)
    q.on_local_status(42, KVPoll.FAILED, AbortReason.PEER_FAILURE)
    q.on_local_status(43, KVPoll.FAILED)  # no reason given: a transfer error
    a, b = q.poll_transfers(0.1)
    assert isinstance(a, Aborted) and a.reason is AbortReason.PEER_FAILURE and a.awaiting_ack
    assert "peer failed in state BOOTSTRAPPING" in a.message and q.is_quarantined(42)
    assert isinstance(b, Aborted) and b.reason is AbortReason.TRANSFER_FAILED


def test_local_poll_may_name_the_failure() -> None:
    q, _ = make()
    admit(q, 42)
    (out,) = q.poll_transfers(0.1, identity_reduce, local_poll=lambda room: (KVPoll.FAILED, AbortReason.PEER_FAILURE))
    assert isinstance(out, Aborted) and out.reason is AbortReason.PEER_FAILURE


def test_quarantine_lease_expires_without_ack() -> None:
    q, _ = make(num_slots=1, num_pages=2)
    admit(q, 42)
    q.cancel(42, 1.0, "client disconnected")
    (out,) = q.poll_transfers(1.0)
    assert isinstance(out, Aborted) and out.reason is AbortReason.CANCELLED and "client disconnected" in out.message
    q.poll_transfers(1.0 + DL.abort_lease_s)
    assert q.is_quarantined(42)  # lease not over yet
    q.poll_transfers(1.0 + DL.abort_lease_s + 0.01)
    assert not q.is_quarantined(42) and q.is_idle()


def test_cancel_before_handshake_is_immediate() -> None:
    q, _ = make(num_slots=1)
    admit(q, 1)
    q.add(NewRequest(2, "p:1", 2, dp_rank=0), 0.0)
    assert q.prealloc(0.0) == [] and q.state_of(2) is DecodeState.WAITING_FOR_MEMORY
    out = q.cancel(2, 0.5)
    assert isinstance(out, Aborted) and not out.awaiting_ack and out.state == "WAITING_FOR_MEMORY"
    assert q.state_of(2) is None and q.cancel(2, 0.6) is None  # idempotent


def test_full_pools_make_requests_wait_in_order_without_crashing() -> None:
    q, b = make(num_slots=2, num_pages=3)
    q.add(NewRequest(1, "p", 2, dp_rank=0), 0.0)
    q.add(NewRequest(2, "p", 1, dp_rank=0), 0.0)
    q.add(NewRequest(3, "p", 1, dp_rank=0), 0.0)  # would fit a page but no slot
    assert [h.room for h in q.prealloc(0.0)] == [1, 2]
    assert q.prealloc(0.0) == [] and q.state_of(3) is DecodeState.WAITING_FOR_MEMORY
    b.write_row(q.slot_of(1), MetadataRow(1), 1)  # type: ignore[arg-type]
    q.on_local_status(1, KVPoll.SUCCESS)
    (out,) = q.poll_transfers(0.1)
    assert isinstance(out, Committed)
    assert q.prealloc(0.1) == []  # a slot is back, but the engine still holds 1's pages
    q.release_pages(out.pages)
    assert [h.room for h in q.prealloc(0.2)] == [3]


def test_head_of_line_waits_for_pages_so_ranks_stay_identical() -> None:
    q, _ = make(num_slots=4, num_pages=3)
    q.add(NewRequest(1, "p", 2, dp_rank=0), 0.0)
    q.add(NewRequest(2, "p", 3, dp_rank=0), 0.0)
    q.add(NewRequest(3, "p", 1, dp_rank=0), 0.0)
    assert [h.room for h in q.prealloc(0.0)] == [1]  # 2 needs 3 pages; 3 does not overtake it


def test_dp_rank_query_path() -> None:
    q, _ = make(query_interval_s=0.5)
    dp = DpConfig(dp_size=2, follow_bootstrap_room=False)
    q.add(NewRequest(10, "p:1", 1, dp=dp), 0.0)
    q.add(NewRequest(11, "p:1", 1, dp=dp), 0.0)
    assert q.state_of(10) is DecodeState.RESOLVING_DP_RANK and q.prealloc(0.0) == []
    assert q.poll_dp_ranks(0.0) == [QueryDpRanks("p:1", (10, 11))]
    assert q.poll_dp_ranks(0.1) == []
    assert q.on_dp_ranks("p:1", {10: 1, 11: None}, 0.2) == 1
    (hs,) = q.prealloc(0.2)
    assert (hs.room, hs.dp_rank) == (10, 1)
    assert q.poll_dp_ranks(0.6) == [QueryDpRanks("p:1", (11,))]
    (out,) = q.tick(0.0 + DL.resolve_dp_rank_s + 0.01)  # 11 never becomes known
    assert out.room == 11 and out.reason is AbortReason.RESOLVE_DP_RANK_TIMEOUT and "RESOLVING_DP_RANK" in out.message
    assert q.poll_dp_ranks(5.0) == []  # no query for an aborted room


def test_strict_follow_bootstrap_room_computes_the_rank() -> None:
    q, _ = make()
    q.add(NewRequest(10, "p", 1, dp=DpConfig(dp_size=4)), 0.0)
    (hs,) = q.prealloc(0.0)
    assert hs.dp_rank == 2 and q.poll_dp_ranks(0.0) == []


@pytest.mark.parametrize(
    "reach, reason",
    [
        (KVPoll.BOOTSTRAPPING, AbortReason.BOOTSTRAP_TIMEOUT),
        (KVPoll.WAITING_FOR_INPUT, AbortReason.WAITING_FOR_INPUT_TIMEOUT),
        (KVPoll.TRANSFERRING, AbortReason.TRANSFER_TIMEOUT),
        (KVPoll.SUCCESS, AbortReason.TRANSFER_TIMEOUT),  # KV done, metadata never lands: not stuck forever
    ],
)
def test_transfer_stage_deadlines(reach: KVPoll, reason: AbortReason) -> None:
    q, _ = make()
    admit(q, 42, now=0.0)
    q.on_local_status(42, reach)
    assert q.poll_transfers(0.0) == []
    limit = {KVPoll.BOOTSTRAPPING: DL.bootstrap_s, KVPoll.WAITING_FOR_INPUT: DL.waiting_for_input_s}.get(reach, DL.transferring_s)
    assert q.poll_transfers(limit) == []
    (out,) = q.poll_transfers(limit + 0.01)
    assert isinstance(out, Aborted) and out.reason is reason and out.state in out.message


def test_deadline_clock_restarts_when_the_state_advances() -> None:
    q, b = make()
    hs = admit(q, 42, now=0.0)
    q.on_local_status(42, KVPoll.WAITING_FOR_INPUT)
    q.poll_transfers(2.9)  # just inside bootstrap_s=3
    assert q.deadline_of(42) == 2.9 + DL.waiting_for_input_s
    assert q.poll_transfers(6.8) == []
    b.write_row(hs.slot, MetadataRow(1), 42)
    q.on_local_status(42, KVPoll.SUCCESS)
    assert [type(o) for o in q.poll_transfers(6.85)] == [Committed]


def test_allocation_deadline() -> None:
    q, _ = make(num_slots=1)
    admit(q, 1)
    q.add(NewRequest(2, "p", 1, dp_rank=0), 0.0)
    assert q.tick(DL.allocate_s) == []
    (out,) = q.tick(DL.allocate_s + 0.01)
    assert out.reason is AbortReason.ALLOCATE_TIMEOUT and "WAITING_FOR_MEMORY" in out.message


def test_local_poll_injection() -> None:
    q, b = make()
    hs = admit(q, 42)
    b.write_row(hs.slot, MetadataRow(5), 42)
    asked: list[int] = []

    def local_poll(room: int) -> KVPoll:
        asked.append(room)
        return KVPoll.SUCCESS

    (out,) = q.poll_transfers(0.1, identity_reduce, local_poll=local_poll)
    assert asked == [42] and isinstance(out, Committed)


def test_poll_tensor_has_the_same_shape_when_idle() -> None:
    q, _ = make(num_slots=5)
    empty = q.prepare_poll(0.0)
    admit(q, 42)
    busy = q.prepare_poll(0.0)
    assert empty.shape == busy.shape == (4, 5) and empty.dtype == busy.dtype == torch.int64
    with pytest.raises(StateError, match="shape"):
        q.finish_poll(torch.zeros(4, 3, dtype=torch.int64), 0.0)


def test_one_rank_polls_without_the_poll_tensor_but_a_collective_always_builds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    many = 20
    q, b = make(num_slots=many + 2, num_pages=64)
    built: list[float] = []
    real = q.prepare_poll
    monkeypatch.setattr(q, "prepare_poll", lambda now, local_poll=None: built.append(now) or real(now, local_poll))
    assert q.poll_transfers(0.1) == [] and built == []  # one rank, idle
    reduced: list[torch.Tensor] = []
    assert q.poll_transfers(0.2, lambda t: reduced.append(t) or t) == [] and built == [0.2] and len(reduced) == 1
    hs = admit(q, 42)
    b.write_row(hs.slot, MetadataRow(7), 42)
    q.on_local_status(42, KVPoll.SUCCESS)
    assert [type(o) for o in q.poll_transfers(0.3)] == [Committed] and built == [0.2]  # slot by slot
    for room in range(100, 100 + many):
        q.add(NewRequest(room, "p:1", 2, dp_rank=0), 0.4)
    assert len(q.prealloc(0.4)) == many
    assert q.poll_transfers(0.5) == [] and built == [0.2]  # many in flight: still no tensor
    assert q.poll_transfers(0.6, identity_reduce) == [] and built == [0.2, 0.6]


@pytest.mark.parametrize("pick_changed", [False, True], ids=["every-slot", "changed-slots"])
@pytest.mark.parametrize("seed", range(40))
def test_one_rank_poll_acts_exactly_like_the_tensor_poll(seed: int, pick_changed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two queues get the same random events (admissions, transport reports, metadata
    rows landing, corrupt rows, cancels, acks, time passing); one is polled as one rank
    (poll_transfers: every slot in use, or only those the tensor ops pick as changed), the
    other with prepare_poll + finish_poll. Every poll must give the same outcomes and
    leave the same states, slots and pages."""
    if pick_changed:
        monkeypatch.setattr(decode_transfers, "_SCAN_ALL_MAX", 0)
    rng = random.Random(seed)
    pair = [make(num_slots=6, num_pages=12) for _ in range(2)]
    next_room, now = 1, 0.0
    open_rooms: dict[int, int] = {}  # room -> slot, rooms that got a handshake
    for _ in range(60):
        now += rng.choice([0.0, 0.01, 0.1, 0.3, 1.5])
        op = rng.random()
        if op < 0.2:
            for _ in range(rng.randint(1, 3)):
                fake = rng.random() < 0.15
                for q, _b in pair:
                    q.add(NewRequest(next_room, "p:1", 1 + next_room % 3, dp_rank=0, fake=fake), now)
                next_room += 1
            got = [q.prealloc(now) for q, _b in pair]
            assert got[0] == got[1]
            open_rooms.update((hs.room, hs.slot) for hs in got[0])
        elif op < 0.4 and open_rooms:
            room = rng.choice(sorted(open_rooms))
            status = rng.choice([KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING, KVPoll.SUCCESS, KVPoll.FAILED])
            for q, _b in pair:
                q.on_local_status(room, status)
        elif op < 0.5 and open_rooms:
            room = rng.choice(sorted(open_rooms))
            landed = room if rng.random() < 0.8 else room + 10_000  # a corrupt row now and then
            for _q, b in pair:
                b.write_row(open_rooms[room], MetadataRow(3), landed)
        elif op < 0.65 and open_rooms:  # a transfer completes: row, then KV success
            room = rng.choice(sorted(open_rooms))
            for q, b in pair:
                b.write_row(open_rooms[room], MetadataRow(5), room)
                q.on_local_status(room, KVPoll.SUCCESS)
        elif op < 0.75 and open_rooms:
            room = rng.choice(sorted(open_rooms))
            assert pair[0][0].cancel(room, now) == pair[1][0].cancel(room, now)
        elif op < 0.85 and open_rooms:
            room = rng.choice(sorted(open_rooms))
            assert pair[0][0].on_abort_ack(room) == pair[1][0].on_abort_ack(room)
        one = pair[0][0].poll_transfers(now)
        other = pair[1][0].finish_poll(pair[1][0].prepare_poll(now), now)
        assert one == other
        for o in one:
            if isinstance(o, Committed):
                open_rooms.pop(o.room, None)
                for q, _b in pair:
                    q.release_pages(o.pages)
        a, b2 = pair[0][0], pair[1][0]
        for room in range(1, next_room):
            assert a.state_of(room) == b2.state_of(room)
        assert (a.slots.num_free, a.pages.num_free, a.pages.num_quarantined) == (b2.slots.num_free, b2.pages.num_free, b2.pages.num_quarantined)
        assert pair[0][1].room_column().tolist() == pair[1][1].room_column().tolist()


def two_ranks() -> tuple[list[DecodeQueues], list[MetadataBuffers]]:
    bufs = [MetadataBuffers(4) for _ in range(2)]
    return [DecodeQueues(b, 16, deadlines=DL) for b in bufs], bufs


def lockstep(qs: list[DecodeQueues], now: float) -> list[list[Committed | Aborted]]:
    reduced = torch.stack([q.prepare_poll(now) for q in qs]).amin(0)
    return [q.finish_poll(reduced.clone(), now) for q in qs]


def test_tp_commit_needs_every_rank() -> None:
    qs, bufs = two_ranks()
    for q in qs:
        admit(q, 42)
    for q, b in zip(qs, bufs):
        q.on_local_status(42, KVPoll.SUCCESS)
    bufs[0].write_row(0, MetadataRow(9), 42)
    assert lockstep(qs, 0.1) == [[], []]
    bufs[1].write_row(0, MetadataRow(9), 42)
    a, b = lockstep(qs, 0.2)
    assert [o.room for o in a] == [o.room for o in b] == [42]


def test_tp_reason_priority_is_the_same_on_every_rank() -> None:
    qs, bufs = two_ranks()
    for q in qs:
        admit(q, 42)
    bufs[0].write_row(0, MetadataRow(9), 4242)  # rank 0: corrupt row
    qs[1].cancel(42, 0.0)  # rank 1: cancelled
    a, b = lockstep(qs, 0.1)
    assert [o.reason for o in a] == [o.reason for o in b] == [AbortReason.METADATA_CORRUPTION]  # type: ignore[union-attr]
    assert "expected 42, found 4242 in slot 0" in a[0].message  # type: ignore[union-attr]
    assert "detected on another TP rank" in b[0].message  # type: ignore[union-attr]


def test_tp_a_dead_peer_outranks_a_transfer_error_and_a_cancel() -> None:
    """One rank's transport saw the peer die, the other only a broken transfer and a
    cancel (the router gave up on the request): every rank counts a peer failure."""
    qs, _ = two_ranks()
    for q in qs:
        admit(q, 42)
    qs[0].on_local_status(42, KVPoll.FAILED)
    qs[0].cancel(42, 0.0)
    qs[1].on_local_status(42, KVPoll.FAILED, AbortReason.PEER_FAILURE)
    a, b = lockstep(qs, 0.1)
    assert [o.reason for o in a] == [o.reason for o in b] == [AbortReason.PEER_FAILURE]  # type: ignore[union-attr]


def test_writers_gone_on_one_rank_release_nothing_until_every_rank_says_so() -> None:
    """Self-healing with TP: a quarantined room's pages are reused once every rank's
    transport confirmed its writers gone (or the prefill acked), never on one rank's word."""
    qs, _ = two_ranks()
    for q in qs:
        admit(q, 42, pages=16)
        q.on_local_status(42, KVPoll.FAILED, AbortReason.PEER_FAILURE)
    assert [type(o) for out in lockstep(qs, 0.1) for o in out] == [Aborted, Aborted]
    assert qs[0].on_writers_gone(42) and not qs[0].on_writers_gone(777)
    assert lockstep(qs, 0.2) == [[], []] and all(q.is_quarantined(42) for q in qs)
    for q in qs:
        q.add(NewRequest(43, "p:1", 16, dp_rank=0), 0.3)
        assert q.prealloc(0.3) == []  # every page still quarantined
    assert qs[1].on_writers_gone(42)
    assert lockstep(qs, 0.4) == [[], []]
    assert not any(q.is_quarantined(42) for q in qs)
    assert [[hs.room for hs in q.prealloc(0.5)] for q in qs] == [[43], [43]]


def test_writers_gone_releases_a_single_rank_at_its_next_poll() -> None:
    q, _ = make(num_slots=1, num_pages=2)
    admit(q, 42)
    q.on_local_status(42, KVPoll.FAILED, AbortReason.PEER_FAILURE)
    q.poll_transfers(0.1)
    assert q.on_writers_gone(42)
    assert q.poll_transfers(0.2) == [] and not q.is_quarantined(42) and q.is_idle()


def test_tp_desync_is_detected_instead_of_hanging() -> None:
    qs, bufs = two_ranks()
    admit(qs[0], 42)
    admit(qs[1], 43)  # a driver bug: rank 1 admitted a different request
    a, b = lockstep(qs, 0.1)
    assert [(o.room, o.reason) for o in a] == [(42, AbortReason.TP_DESYNC)]  # type: ignore[union-attr]
    assert [(o.room, o.reason) for o in b] == [(43, AbortReason.TP_DESYNC)]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "req, match",
    [
        (NewRequest(5, "p", 0), "num_pages"),
        (NewRequest(5, "p", 17), "num_pages"),
        (NewRequest(5, "p", 1, dp_rank=3), "dp_rank"),
    ],
)
def test_bad_requests_name_the_field(req: NewRequest, match: str) -> None:
    q, _ = make()
    with pytest.raises(ConfigError, match=match):
        q.add(req, 0.0)


def test_duplicate_room_is_refused() -> None:
    q, _ = make()
    q.add(NewRequest(5, "p", 1, dp_rank=0), 0.0)
    with pytest.raises(StateError, match="room 5 is already in use"):
        q.add(NewRequest(5, "p", 1, dp_rank=0), 0.0)


@pytest.mark.parametrize("field", ["bootstrap_s", "abort_lease_s"])
def test_deadline_config_validation(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        DecodeDeadlines(**{field: 0})
