"""The receiver core (pdgrpc.transport.receiver), driven with plain calls: no loop (except
for the ACK's scheduling), no socket. What a grant lets land, the refusal a write gets,
byte accounting and the metadata-last commit."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdgrpc.errors import ConfigError, UnauthorizedWrite
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport.receiver import Receiver, Refusal, RegionTable, RoomGrant
from pdgrpc.transport.regions import RegionInfo, RegionKind
from pdgrpc.transport.rooms import RoomStates

PB = 4096
KV = RegionInfo(0, "layer0.k", RegionKind.KV, 32 * PB, PB)
META = RegionInfo(7, "metadata", RegionKind.METADATA, 8 * 256, 256)


def table(*infos: RegionInfo) -> RegionTable:
    t = RegionTable()
    for info in infos or (KV, META):
        t.add(info)
    return t


def check(g: RoomGrant, region: RegionInfo | int, offset: int, length: int) -> tuple[Refusal, str] | None:
    """One op through the vectorised check: None when allowed, else (refusal, message)."""
    rid = region if isinstance(region, int) else region.region_id
    meta = not isinstance(region, int) and region.kind is RegionKind.METADATA
    try:
        table().authorize(g, [rid], [offset], [length], metadata=meta)
    except UnauthorizedWrite as exc:
        return exc.refusal, str(exc)
    return None


# -- the grant check ------------------------------------------------------------------------
def test_grant_accepts_exactly_the_granted_pages() -> None:
    g = RoomGrant.of(7, [3, 4, 5, 9], slot=2)
    assert check(g, KV, 3 * PB, 3 * PB) is None  # pages 3..5 in one write
    assert check(g, KV, 9 * PB + 100, 50) is None  # part of a page (a head slice)
    assert check(g, KV, 3 * PB, 4 * PB) == (Refusal.OUTSIDE_GRANT, "unauthorized write: page 6 of 'layer0.k' is outside the pages granted to room 7")
    refusal, text = check(g, KV, 8 * PB, PB) or (None, "")
    assert refusal is Refusal.OUTSIDE_GRANT and "page 8" in text
    refusal, text = check(g, KV, 31 * PB, 2 * PB) or (None, "")
    assert refusal is Refusal.OUTSIDE_REGION and "outside region" in text
    refusal, text = check(g, 99, 0, 1) or (None, "")
    assert refusal is Refusal.UNKNOWN_REGION and "region 99" in text
    assert (check(g, KV, 2**63 - 1, 1) or (None,))[0] is Refusal.OUTSIDE_REGION  # no int64 overflow
    assert (check(g, KV, 3 * PB, 0) or (None,))[0] is Refusal.OUTSIDE_REGION  # empty range


def test_grant_metadata_slot() -> None:
    g = RoomGrant.of(7, [0], slot=2)
    assert check(g, META, 2 * 256, 256) is None
    for off, n in [(3 * 256, 256), (2 * 256, 257)]:  # another slot; spills into slot 3
        refusal, text = check(g, META, off, n) or (None, "")
        assert refusal is Refusal.WRONG_SLOT and "granted slot 2" in text
    refusal, text = check(RoomGrant.of(8, [0]), META, 0, 256) or (None, "")
    assert refusal is Refusal.WRONG_SLOT and "no metadata slot" in text


def test_pages_into_a_metadata_region_and_rows_into_a_kv_region_are_refused() -> None:
    g = RoomGrant.of(7, [0, 1, 2], slot=0)
    with pytest.raises(UnauthorizedWrite) as err:
        table().authorize(g, [META.region_id], [0], [256], metadata=False)
    assert err.value.refusal is Refusal.WRONG_KIND
    with pytest.raises(UnauthorizedWrite) as err:
        table().authorize(g, [KV.region_id], [0], [256], metadata=True)
    assert err.value.refusal is Refusal.WRONG_KIND


def test_the_first_offending_op_is_named() -> None:
    g = RoomGrant.of(7, [0, 1], slot=0)
    with pytest.raises(UnauthorizedWrite, match="page 5"):
        table().authorize(g, [0, 0, 0], [0, 5 * PB, 9 * PB], [PB, PB, PB])


@settings(max_examples=200, deadline=None)
@given(pages=st.sets(st.integers(0, 63), max_size=40), first=st.integers(0, 63), count=st.integers(1, 8))
def test_grant_check_matches_page_membership(pages: set[int], first: int, count: int) -> None:
    region = RegionInfo(1, "r", RegionKind.KV, 64 * PB, PB)
    t = table(region)
    allowed = first + count <= 64 and all(p in pages for p in range(first, first + count))
    try:
        t.authorize(RoomGrant.of(1, pages), np.array([1]), np.array([first * PB]), np.array([count * PB]))
        refused = False
    except UnauthorizedWrite:
        refused = True
    assert refused != allowed


_OP = st.tuples(st.sampled_from([0, 1, 7, 99, -1]), st.integers(-2 * PB, 40 * PB) | st.just(2**63 - 1),
                st.integers(-1, 3 * PB) | st.just(2**62 + 1))


@settings(max_examples=300, deadline=None)
@given(pages=st.sets(st.integers(0, 40), max_size=30), slot=st.none() | st.integers(0, 9),
       ops=st.lists(_OP, min_size=1, max_size=70), metadata=st.booleans())
def test_op_by_op_and_vectorised_checks_give_the_same_verdict(
        pages: set[int], slot: int | None, ops: list[tuple[int, int, int]], metadata: bool) -> None:
    """Writes of up to ``_FEW_OPS`` ops are checked in Python, longer ones with numpy: the
    two must accept the same writes and name the same first offending op, same refusal,
    same words."""
    import pdgrpc.transport.receiver as receiver_mod

    t = table(KV, META, RegionInfo(1, "layer0.v", RegionKind.KV, 32 * PB, PB))
    g = RoomGrant.of(3, pages, slot)
    cols = [np.array([op[i] for op in ops], dtype=np.int64) for i in range(3)]
    verdicts = []
    for few in (0, 10**6):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(receiver_mod, "_FEW_OPS", few)
            try:
                t.authorize(g, *cols, metadata=metadata)
                verdicts.append(None)
            except UnauthorizedWrite as exc:
                verdicts.append((exc.refusal, str(exc)))
    assert verdicts[0] == verdicts[1]


# -- the receiver: accept, account, commit last ------------------------------------------------
def receiver() -> Receiver:
    r = Receiver(RoomStates())
    r.add_region(KV)
    r.add_region(META)
    return r


def test_an_unknown_room_is_refused_and_nothing_is_tracked() -> None:
    r = receiver()
    with pytest.raises(UnauthorizedWrite) as err:
        r.accept(5, "peer", [0], [0], [PB])
    assert err.value.refusal is Refusal.UNKNOWN_ROOM and "not advertised" in str(err.value)
    assert 5 not in r.rooms


def test_a_refused_write_fails_the_room_with_the_typed_refusal() -> None:
    r = receiver()
    r.advertise(RoomGrant.of(5, [1], slot=0))
    with pytest.raises(UnauthorizedWrite):
        r.accept(5, "peer", [0], [2 * PB], [PB])
    st_ = r.rooms.status(5)
    assert st_.state is KVPoll.FAILED and st_.refusal is Refusal.OUTSIDE_GRANT and "page 2" in (st_.reason or "")
    with pytest.raises(UnauthorizedWrite) as err:  # and the room stays closed
        r.accept(5, "peer", [0], [PB], [PB])
    assert err.value.refusal is Refusal.ROOM_CLOSED


def test_a_released_room_says_why_it_was_released() -> None:
    r = receiver()
    r.advertise(RoomGrant.of(5, [1], slot=0))
    r.rooms.note_release(5, "the decode aborted it")
    r.release(5)
    r.rooms.discard(5)
    with pytest.raises(UnauthorizedWrite, match="the decode aborted it") as err:
        r.accept(5, "peer", [0], [PB], [PB])
    assert err.value.refusal is Refusal.UNKNOWN_ROOM


async def test_the_row_commits_only_after_every_announced_kv_byte_landed() -> None:
    r = receiver()
    events: list[str] = []
    rr = r.advertise(RoomGrant.of(5, [1, 2], slot=3))
    assert r.accept(5, "p", [0], [PB], [PB]) is rr and r.rooms.status(5).state is KVPoll.TRANSFERRING
    r.accept(5, "p", [7], [3 * 256], [256], metadata=True)
    # the row arrived before the second page: staged, not committed
    r.stage_metadata(5, rr, 2 * PB, commit=lambda: events.append("commit"), ack=lambda: events.append("ack"))
    r.landed(5, rr, PB)
    assert events == [] and r.rooms.status(5).state is KVPoll.TRANSFERRING
    r.accept(5, "p", [0], [2 * PB], [PB])
    r.landed(5, rr, PB)
    assert events == ["commit"] and r.rooms.status(5).state is KVPoll.SUCCESS
    for _ in range(3):
        await asyncio.sleep(0)
    assert events == ["commit", "ack"]  # the ACK goes after the reactions to SUCCESS
    assert r.rooms_of("p") == [5] and r.rooms_of("q") == []


def test_a_write_announced_ahead_leaves_the_room_waiting_until_its_bytes_land() -> None:
    r = receiver()
    rr = r.advertise(RoomGrant.of(5, [1, 2], slot=3))
    assert r.accept(5, "p", [0], [PB], [2 * PB], start=False) is rr  # checked, receives posted
    assert r.rooms.status(5).state is KVPoll.WAITING_FOR_INPUT and r.rooms.transfer_started(5) is None
    r.landed(5, rr, PB)  # the first run landed: the transfer started
    assert r.rooms.status(5).state is KVPoll.TRANSFERRING and r.rooms.transfer_started(5) is not None
    with pytest.raises(UnauthorizedWrite):  # refused ahead of the data, just as at write time
        r.accept(5, "p", [0], [5 * PB], [PB], start=False)
    assert r.rooms.status(5).refusal is Refusal.OUTSIDE_GRANT


def test_writes_adding_up_to_more_than_the_grant_are_refused() -> None:
    """Each granted byte is written once, so a sender cannot make the receiver hold more
    posted writes for a room than its grant (here 2 pages of one KV region)."""
    r = receiver()
    r.advertise(RoomGrant.of(5, [1, 2], slot=3))
    r.accept(5, "p", [0], [PB], [2 * PB])  # the whole grant
    with pytest.raises(UnauthorizedWrite, match="add up to 12288 KV bytes, more than the 8192") as err:
        r.accept(5, "p", [0], [2 * PB], [PB])  # page 2 again
    assert err.value.refusal is Refusal.BYTE_COUNT and r.rooms.status(5).refusal is Refusal.BYTE_COUNT
    # a many-op write is counted the same way (the vectorised path)
    r.advertise(RoomGrant.of(6, range(32)))
    r.accept(6, "p", np.zeros(100, dtype=np.uint16), np.arange(100, dtype=np.uint64) % 32 * PB,
             np.full(100, 64, dtype=np.uint64))
    with pytest.raises(UnauthorizedWrite):
        r.accept(6, "p", [0] * 2, [0, PB], [32 * PB - 6400 - PB, PB + 1])


def test_more_bytes_than_announced_fail_the_room_and_a_second_row_is_refused() -> None:
    r = receiver()
    rr = r.advertise(RoomGrant.of(5, [1, 2], slot=3))
    r.landed(5, rr, 2 * PB)
    r.stage_metadata(5, rr, PB, commit=lambda: pytest.fail("committed"), ack=lambda: None)
    assert r.rooms.status(5).refusal is Refusal.BYTE_COUNT
    rr = r.advertise(RoomGrant.of(6, [1], slot=2))
    r.stage_metadata(6, rr, PB, commit=lambda: None, ack=lambda: None)
    with pytest.raises(UnauthorizedWrite) as err:
        r.accept(6, "p", [7], [2 * 256], [256], metadata=True)
    assert err.value.refusal is Refusal.MALFORMED


def test_a_room_is_advertised_once() -> None:
    r = receiver()
    r.advertise(RoomGrant.of(5, [1]))
    with pytest.raises(ConfigError, match="room 5"):
        r.advertise(RoomGrant.of(5, [2]))


def test_a_refusal_code_from_the_wire_maps_back_or_to_none() -> None:
    assert all(Refusal.from_code(int(r)) is r for r in Refusal)
    assert Refusal.from_code(0) is None and Refusal.from_code(255) is None
