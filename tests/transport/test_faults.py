"""``tests.transport.faults``: the fault-injection wrapper over a real tcp transport pair
with real KV tensors and real metadata rows (``MetadataBuffers``)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pdgrpc.errors import ConfigError, TransportError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state.metadata import MetadataBuffers, MetadataLayout, MetadataRow
from pdgrpc.transport import registry
from pdgrpc.transport.base import RoomGrant, Transport, UnknownRoom
from tests.transport.faults import FaultyTransport
from pdgrpc.transport.pages import METADATA_REGION_ID, kv_regions, metadata_op, metadata_region, page_ops, region_pairs

LAYERS, PAGES, SLOTS = 2, 16, 4
PAGE_SHAPE = (2, 4, 8)  # heads, tokens, head dim (fp16: 128 B per page)


def _pools(seed: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (PAGES, *PAGE_SHAPE)
    if seed is None:
        return ([torch.zeros(shape, dtype=torch.float16) for _ in range(LAYERS)],
                [torch.zeros(shape, dtype=torch.float16) for _ in range(LAYERS)])
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(shape, generator=g).half() for _ in range(LAYERS)],
            [torch.randn(shape, generator=g).half() for _ in range(LAYERS)])


class _Pair:
    """A tcp sender and a tcp receiver (wrapped in FaultyTransport) in this loop."""

    def __init__(self, layout: MetadataLayout | None = None, **faults) -> None:
        self.src_k, self.src_v = _pools(seed=1)
        self.dst_k, self.dst_v = _pools(seed=None)
        self.src_rows = MetadataBuffers(SLOTS, layout)
        self.dst_rows = MetadataBuffers(SLOTS, layout)
        self.src_regions = [*kv_regions(self.src_k, self.src_v), metadata_region(self.src_rows.tensor)]
        self.inner = registry.create("tcp")
        self.recv = FaultyTransport(self.inner, **faults)
        self.send = registry.create("tcp")

    async def __aenter__(self) -> "_Pair":
        desc = await self.recv.register([*kv_regions(self.dst_k, self.dst_v), metadata_region(self.dst_rows.tensor)])
        await self.send.register(self.src_regions)
        self.peer = await self.send.connect(desc)
        self.pairs = region_pairs(self.src_regions, self.peer.descriptor.regions)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.send.close()
        await self.recv.close()

    async def transfer(self, room: int, slot: int, pages: list[int]) -> None:
        """Advertise on the receiver, write pages + the row (bootstrap_room = room), and
        wait until both inner sides are SUCCESS (the receiver's *inner* transport)."""
        self.recv.advertise(RoomGrant.of(room, pages, slot))
        self.src_rows.write_row(slot, MetadataRow(output_id=1000 + room, cached_tokens=slot), room)
        mop = metadata_op(self.src_regions[-1], slot, self.peer.descriptor.region(METADATA_REGION_ID), slot)
        await self.send.write(self.peer, room, page_ops(self.pairs, pages, pages), metadata=mop)
        assert (await self.send.wait(room, 30)).state is KVPoll.SUCCESS
        assert (await self.inner.wait(room, 30)).state is KVPoll.SUCCESS

    def pages_equal(self, pages: list[int]) -> bool:
        return all(torch.equal(d[pages], s[pages]) for d, s in zip([*self.dst_k, *self.dst_v], [*self.src_k, *self.src_v]))


# ----------------------------------------------------------------------------- delay


async def test_delay_holds_success_back_then_reports_it() -> None:
    delay = 0.3
    async with _Pair(delay_metadata_s=delay) as p:
        await p.transfer(11, 0, [0, 1, 2])
        seen = time.monotonic()
        assert p.inner.poll(11) is KVPoll.SUCCESS
        # the row and pages are there, but the receiver sees the metadata "late"
        assert p.recv.status(11).state is KVPoll.TRANSFERRING
        assert p.recv.poll(11) is KVPoll.TRANSFERRING
        assert p.dst_rows.room(0) == 11 and p.pages_equal([0, 1, 2])
        # a short wait times out still TRANSFERRING
        assert (await p.recv.wait(11, 0.05)).state is KVPoll.TRANSFERRING
        while time.monotonic() - seen < delay * 0.8:
            assert p.recv.poll(11) is KVPoll.TRANSFERRING
            await asyncio.sleep(0.02)
        st = await p.recv.wait(11, 5)
        took = time.monotonic() - seen
        assert st.state is KVPoll.SUCCESS and st.reason is None
        assert delay <= took < delay + 1.0, took
        assert p.recv.poll(11) is KVPoll.SUCCESS  # and it stays SUCCESS
        # the sender side is never delayed, and a wrapped sender passes through
        assert p.send.poll(11) is KVPoll.SUCCESS


async def test_wait_returns_once_the_delayed_success_is_visible() -> None:
    """A waiter that starts before any byte arrives returns the (delayed) SUCCESS."""
    delay = 0.25
    async with _Pair(delay_metadata_s=delay) as p:
        p.recv.advertise(RoomGrant.of(21, [4, 5], 1))
        waiter = asyncio.ensure_future(p.recv.wait(21, 10))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        p.src_rows.write_row(1, MetadataRow(output_id=7), 21)
        t0 = time.monotonic()
        await p.send.write(p.peer, 21, page_ops(p.pairs, [4, 5], [4, 5]),
                           metadata=metadata_op(p.src_regions[-1], 1, p.peer.descriptor.region(METADATA_REGION_ID), 1))
        st = await asyncio.wait_for(waiter, 10)
        assert st.state is KVPoll.SUCCESS
        assert time.monotonic() - t0 >= delay
        assert p.pages_equal([4, 5]) and p.dst_rows.room(1) == 21


async def test_failed_rooms_are_not_delayed_and_released_rooms_are_forgotten() -> None:
    async with _Pair(delay_metadata_s=5.0) as p:
        p.recv.advertise(RoomGrant.of(31, [0], 0))
        assert p.recv.poll(31) is KVPoll.WAITING_FOR_INPUT
        # a write outside the grant fails the room at once, not after the delay
        await p.send.write(p.peer, 31, page_ops(p.pairs, [3], [3]))
        st = await p.recv.wait(31, 10)
        assert st.state is KVPoll.FAILED and "page 3" in (st.reason or "")
        p.recv.release(31)
        with pytest.raises(UnknownRoom):
            p.recv.poll(31)


# ----------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("layout", [None, MetadataLayout(top_k=4, hidden_size=24)], ids=["default-row", "hidden-row"])
async def test_corrupts_exactly_the_nth_rooms_room_field(layout) -> None:
    rooms = [(101, 0, [0, 1]), (102, 1, [2, 3]), (1, 2, [4]), (104, 3, [5, 6])]  # (room, slot, pages)
    async with _Pair(layout, corrupt_nth_room=3) as p:
        for room, slot, pages in rooms:
            await p.transfer(room, slot, pages)
        sent = p.src_rows.tensor.clone()
        before = p.dst_rows.tensor.clone()
        assert torch.equal(before, sent)  # every row landed as sent
        assert p.recv.corrupted_rooms == []  # nothing observed yet
        for room, _, _ in rooms:
            assert p.recv.status(room).state is KVPoll.SUCCESS  # no delay configured
        assert p.recv.corrupted_rooms == [1]
        # the third advertised room (bootstrap_room 1) reads back as 1 ^ 1 == 0 -> 2
        col = p.dst_rows.room_column()
        assert [int(x) for x in col] == [101, 102, 2, 104]
        assert p.dst_rows.room(2) == 2
        # nothing else changed: every other byte of every row, and the pages
        lay = p.dst_rows.layout
        mask = torch.ones_like(before, dtype=torch.bool)
        mask[2, lay.room_offset : lay.room_offset + 8] = False
        assert torch.equal(p.dst_rows.tensor[mask], before[mask])
        assert all(p.pages_equal(pages) for _, _, pages in rooms)
        # once: observing again does not flip it back
        for room, _, _ in rooms:
            p.recv.poll(room)
            await p.recv.wait(room, 1)
        assert p.dst_rows.room(2) == 2 and p.recv.corrupted_rooms == [1]


async def test_corruption_with_delay_happens_when_success_is_first_seen() -> None:
    async with _Pair(delay_metadata_s=0.2, corrupt_nth_room=1) as p:
        await p.transfer(77, 3, [9])
        assert p.dst_rows.room(3) == 77
        assert p.recv.poll(77) is KVPoll.TRANSFERRING  # first observation: corrupted, held back
        assert p.dst_rows.room(3) == 77 ^ 1 and p.recv.corrupted_rooms == [77]
        assert (await p.recv.wait(77, 5)).state is KVPoll.SUCCESS
        assert p.dst_rows.room(3) == 77 ^ 1


# ----------------------------------------------------------------------------- delegation


async def test_delegates_everything_else() -> None:
    inner = registry.create("tcp")
    t = FaultyTransport(inner)
    assert isinstance(t, Transport)
    assert t.inner is inner and t.name == "tcp" and t.moves_bytes is True
    assert t.instance_id == inner.instance_id and t.rooms is inner.rooms
    assert t.sender is inner.sender  # backend attributes fall through
    fake = FaultyTransport(registry.create("fake"), delay_metadata_s=0.1)
    assert fake.name == "fake" and fake.moves_bytes is False
    fake.advertise(RoomGrant.of(5, [0], 0))  # fake succeeds at once: delayed too
    assert fake.poll(5) is KVPoll.TRANSFERRING
    assert (await fake.wait(5, 5)).state is KVPoll.SUCCESS
    assert len(fake.rooms) == 1
    fake.release(5)
    assert len(fake.rooms) == 0
    peer = await fake.connect(await fake.register([]))
    await fake.write(peer, 6, [])  # a sender room, no metadata yet
    fake.fail_peer(peer.instance_id, "lease expired")
    assert fake.status(6).state is KVPoll.FAILED and "lease expired" in fake.status(6).reason
    async with t:
        await t.register(kv_regions(*_pools(None)))
    with pytest.raises(TransportError, match="tcp transport is closed"):  # closed on leaving the block
        await t.register([])
    await fake.close()


@pytest.mark.parametrize("bad", [dict(delay_metadata_s=-1), dict(delay_metadata_s="x"), dict(corrupt_nth_room=-2),
                                 dict(corrupt_nth_room=1.5), dict(delay_metadata_s=float("nan"))])
def test_bad_arguments(bad) -> None:
    with pytest.raises(ConfigError):
        FaultyTransport(registry.create("fake"), **bad)


# ----------------------------------------------------------------------------- by name


def test_a_test_loads_a_configured_wrapper_by_name_through_the_registry() -> None:
    cls = registry.load("tests.e2e.faulty:SlowCorruptingRank1")
    rank0, rank1 = cls(host="127.0.0.1", tp_rank=0), cls(host="127.0.0.1", tp_rank=1)
    assert isinstance(rank1, FaultyTransport) and rank1.name == "tcp"
    assert (rank0.delay_metadata_s, rank0.corrupt_nth_room) == (0.0, 0)
    assert (rank1.delay_metadata_s, rank1.corrupt_nth_room) == (0.2, 3)
