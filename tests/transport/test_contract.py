"""The contract's data types: grants, descriptors (untrusted bytes from a peer), the room
states (how states move), page lists -> ops. What a grant lets land: test_receiver.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdgrpc.errors import ConfigError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport.base import (
    BadDescriptor,
    Descriptor,
    MemoryRegion,
    RegionInfo,
    RegionKind,
    RoomGrant,
    RoomStates,
    UnknownRoom,
    WriteOp,
    WriteOps,
    after_acks,
    after_reactions,
)
from pdgrpc.transport.pages import (
    METADATA_REGION_ID,
    kv_regions,
    metadata_op,
    metadata_region,
    page_ops,
    page_runs,
    region_pairs,
)

PB = 4096
KV = RegionInfo(0, "layer0.k", RegionKind.KV, 32 * PB, PB)
META = RegionInfo(METADATA_REGION_ID, "metadata", RegionKind.METADATA, 8 * 256, 256)


# -- grants ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [({"room": 5, "pages": [-1]}, "pages"), ({"room": 5, "pages": [1], "slot": -2}, "slot")],
)
def test_grant_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=f"RoomGrant.{field}"):
        RoomGrant.of(**kwargs)


# -- descriptors ----------------------------------------------------------------------
def test_descriptor_round_trip() -> None:
    d = Descriptor("tcp", "abc123", b"127.0.0.1:5555", (KV, META), liveness="127.0.0.1:6666")
    assert Descriptor.from_bytes(d.to_bytes()) == d
    assert d.region(METADATA_REGION_ID) == META and d.region(99) is None
    assert d.require_region(METADATA_REGION_ID) == META
    with pytest.raises(BadDescriptor, match="no region 99"):
        d.require_region(99)


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"", "magic"),
        (b"hello world", "magic"),
        (b"PDGT{not json", "malformed"),
        (b'PDGT{"v": 99}', "version"),
        (b'PDGT{"v": 1, "backend": "tcp"}', "malformed"),
        (b'PDGT{"v":1,"backend":"tcp","instance_id":"","endpoint":"","regions":[]}', "instance_id"),
        (b'PDGT{"v":1,"backend":"tcp","instance_id":"a","endpoint":"","regions":[[0,"k","kv",10,4,""]]}', "multiple"),
        (b'PDGT{"v":1,"backend":"tcp","instance_id":"a","endpoint":"",'
         b'"regions":[[0,"k","kv",8,4,""],[0,"k","kv",8,4,""]]}', "twice"),
        (b'PDGT{"v":1,"backend":"tcp","instance_id":"a","endpoint":"","regions":[[0,"k","weird",8,4,""]]}', "malformed"),
    ],
)
def test_bad_descriptors_are_refused_clearly(raw: bytes, why: str) -> None:
    with pytest.raises(BadDescriptor, match=why):
        Descriptor.from_bytes(raw)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_the_error_tree(raw: bytes) -> None:
    try:
        Descriptor.from_bytes(b"PDGT" + raw)
    except BadDescriptor:
        pass


# -- room table -----------------------------------------------------------------------
def test_room_states_move_forward_failed_wins_terminal_sticks() -> None:
    t = RoomStates()
    t.create(1, KVPoll.WAITING_FOR_INPUT)
    assert t.set(1, KVPoll.TRANSFERRING)
    assert not t.set(1, KVPoll.WAITING_FOR_INPUT)  # never backwards
    assert t.status(1).state is KVPoll.TRANSFERRING
    assert t.fail(1, "peer died")
    assert not t.set(1, KVPoll.SUCCESS)  # terminal sticks
    assert t.status(1) .reason == "peer died"
    t.create(2, KVPoll.TRANSFERRING)
    t.set(2, KVPoll.SUCCESS)
    assert not t.fail(2, "late")  # a finished room stays finished
    assert not t.set(3, KVPoll.FAILED)  # untracked rooms are ignored
    t.discard(1)
    with pytest.raises(UnknownRoom):
        t.status(1)


def test_transfer_started_is_when_the_room_first_moved_bytes() -> None:
    import time

    t = RoomStates()
    t.create(1, KVPoll.WAITING_FOR_INPUT)
    assert t.transfer_started(1) is None  # advertised, nothing arrived yet
    before = time.monotonic()
    t.set(1, KVPoll.TRANSFERRING)
    started = t.transfer_started(1)
    assert started is not None and before <= started <= time.monotonic()
    t.set(1, KVPoll.SUCCESS)
    assert t.transfer_started(1) == started  # the first byte's time, not the last one's
    t.create(2, KVPoll.WAITING_FOR_INPUT)
    t.set(2, KVPoll.SUCCESS)  # a backend that skips TRANSFERRING still gets a time
    assert t.transfer_started(2) is not None
    t.discard(1)
    assert t.transfer_started(1) is None and t.transfer_started(99) is None


async def test_room_wait_is_bounded_and_wakes_on_terminal() -> None:
    import asyncio

    t = RoomStates()
    t.create(1, KVPoll.TRANSFERRING)
    assert (await t.wait(1, 0.01)).state is KVPoll.TRANSFERRING  # timed out, not terminal
    asyncio.get_running_loop().call_later(0.01, t.set, 1, KVPoll.SUCCESS)
    assert (await t.wait(1, 10)).state is KVPoll.SUCCESS


async def test_a_room_waiter_resumes_on_the_loop_turn_after_the_update() -> None:
    # The sender's wait() returns on the loop's next turn after the ACK's update: every
    # further turn lets the transport's progress task run a UCX round first (~10 us
    # each on a host whose caches the transfer just flushed).
    import asyncio

    t = RoomStates()
    t.create(1, KVPoll.TRANSFERRING)
    got: list[KVPoll] = []

    async def waiter() -> None:
        got.append((await t.wait(1, 10)).state)

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)  # waiting now
    t.set(1, KVPoll.SUCCESS)
    await asyncio.sleep(0)
    assert got == [KVPoll.SUCCESS]
    await task


async def test_room_waiters_that_time_out_or_are_cancelled_leave_nothing_behind() -> None:
    import asyncio

    t = RoomStates()
    t.create(1, KVPoll.TRANSFERRING)
    for _ in range(100):
        assert (await t.wait(1, 0)).state is KVPoll.TRANSFERRING
    task = asyncio.ensure_future(t.wait(1, 10))
    await asyncio.sleep(0)
    assert t.waited_on == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert t.waited_on == 0  # nothing kept per wait that ended without the room finishing
    # a discarded room wakes its waiters, who find it gone
    task = asyncio.ensure_future(t.wait(1, 10))
    await asyncio.sleep(0)
    t.discard(1)
    with pytest.raises(UnknownRoom):
        await task
    assert t.waited_on == 0


def test_listeners_hear_each_room_turn_terminal_once_and_a_broken_one_harms_nothing(caplog: pytest.LogCaptureFixture) -> None:
    t = RoomStates()
    heard: list[int] = []

    def broken(room: int) -> None:
        raise RuntimeError("listener bug")

    t.add_listener(broken)
    t.add_listener(heard.append)
    for room in (1, 2, 3):
        t.create(room, KVPoll.WAITING_FOR_INPUT)
    t.set(1, KVPoll.TRANSFERRING)
    assert heard == []  # not terminal
    assert t.set(1, KVPoll.SUCCESS) and heard == [1]
    assert not t.fail(1, "late") and heard == [1]  # terminal sticks: no second call
    assert t.fail(2, "peer died") and heard == [1, 2]
    assert not t.set(4, KVPoll.SUCCESS) and heard == [1, 2]  # untracked
    assert t.status(2).reason == "peer died"  # the broken listener did not stop the update
    assert "listener bug" in caplog.text and "room 1" in caplog.text


async def test_after_reactions_runs_after_what_a_listener_scheduled_and_what_that_woke() -> None:
    # The decode's shape: a listener schedules a poll, the poll commits and wakes the task
    # that sends the first token; a receiver's ACK (after_reactions) must come after both.
    import asyncio

    loop = asyncio.get_running_loop()
    t = RoomStates()
    order: list[str] = []
    first_token: asyncio.Future[None] = loop.create_future()

    async def stream() -> None:
        await first_token
        order.append("token sent")

    def poll() -> None:
        order.append("committed")
        first_token.set_result(None)

    task = asyncio.ensure_future(stream())
    await asyncio.sleep(0)  # the stream waits for its token
    t.add_listener(lambda room: loop.call_soon(poll))
    t.create(7, KVPoll.TRANSFERRING)
    t.set(7, KVPoll.SUCCESS)
    after_reactions(order.append, "ack")
    for _ in range(5):
        await asyncio.sleep(0)
    await task
    assert order == ["committed", "token sent", "ack"]


async def test_after_acks_runs_after_every_ack_queued_before_it_or_in_the_same_turn() -> None:
    # A receiver's row re-posts its control receive mid-transfer, before the data's
    # landing queues the ACK; both come from one progress round (one loop turn). The
    # re-post, and a batch's frees queued right after the ACK, wait for the ACK.
    import asyncio

    order: list[str] = []
    after_acks(order.append, "row's receive re-posted")
    after_reactions(order.append, "ack")
    after_acks(order.append, "requests freed")
    for _ in range(5):
        await asyncio.sleep(0)
    assert order == ["ack", "row's receive re-posted", "requests freed"]


# -- regions and page lists -------------------------------------------------------------
def test_memory_region_validation() -> None:
    with pytest.raises(ConfigError, match="contiguous"):
        MemoryRegion(0, torch.zeros(4, 8).t())
    with pytest.raises(ConfigError, match="region_id"):
        MemoryRegion(70000, torch.zeros(4))
    r = MemoryRegion(3, torch.zeros(10, 16, 2, 64, dtype=torch.float16))
    assert (r.nbytes, r.item_bytes) == (10 * 4096, 4096)


def test_page_runs_coalesce_where_both_sides_advance() -> None:
    assert page_runs([1, 2, 3, 7, 8, 9], [5, 6, 9, 10, 11, 12]) == [(1, 5, 2), (3, 9, 1), (7, 10, 3)]
    assert page_runs([], []) == []
    with pytest.raises(ConfigError, match="differ in length"):
        page_runs([1, 2], [1])


def _pools(layers: int, pages: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (pages, 16, 2, 64)
    return [torch.zeros(shape, dtype=torch.float16) for _ in range(layers)], [
        torch.zeros(shape, dtype=torch.float16) for _ in range(layers)
    ]


def test_contiguous_pages_are_one_write_per_region() -> None:
    regions = kv_regions(*_pools(24, 64))
    ops = page_ops(region_pairs(regions, regions), range(10, 42), range(0, 32))
    assert isinstance(ops, WriteOps) and len(ops) == 48
    first = ops[0]
    assert first == WriteOp(0, 10 * 4096, 0, 0, 32 * 4096)
    assert {op.dst_region for op in ops} == set(range(48))
    assert ops.nbytes == 48 * 32 * 4096


def test_scattered_pages_give_one_op_per_page_per_region() -> None:
    regions = kv_regions(*_pools(2, 64))
    ops = page_ops(region_pairs(regions, regions), [5, 1, 9], [0, 2, 4])
    assert list(ops) == [
        WriteOp(r, s * 4096, r, d * 4096, 4096) for r in range(4) for s, d in ((5, 0), (1, 2), (9, 4))
    ]


def test_page_size_mismatch_is_refused() -> None:
    a = kv_regions(*_pools(1, 8))
    b = kv_regions([torch.zeros(8, 32, 2, 64, dtype=torch.float16)], [torch.zeros(8, 32, 2, 64, dtype=torch.float16)])
    with pytest.raises(ConfigError, match="page size differs"):
        page_ops(region_pairs(a, b), [0], [0])
    with pytest.raises(ConfigError, match="no KV region"):
        region_pairs(kv_regions(*_pools(2, 8)), a)


def test_metadata_op_targets_one_row() -> None:
    src = metadata_region(torch.zeros(4, 32, dtype=torch.int64))
    op = metadata_op(src, 1, src.info(), 3)
    assert op == WriteOp(METADATA_REGION_ID, 256, METADATA_REGION_ID, 768, 256)
