"""rdma: ``prepare_write`` announces the WRITE ahead of its bytes (``WRITE_AHEAD``), so the
receiver (a separate process) checks the grant and posts its receives while the sender
still computes; the data moves when the prepared send is called (issue 19). The room
stays WAITING_FOR_INPUT until bytes land, a refused announcement fails the room before
any byte is sent, and a room released after its announcement takes none of the late
bytes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

import pytest
import torch

from pdgrpc.errors import ConfigError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.base import MemoryRegion, Peer, Transport
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.testing.peer import Layout, PeerProcess, digest
from pdgrpc.transport.receiver import Refusal

pytest.importorskip("libucx", reason="the rdma backend needs the UCX libraries of the ucx extra: pip install 'pdgrpc[ucx]'")

WAIT_S = 30.0
LAYOUT = Layout(layers=2, pages=48, page_shape=(16, 2, 64), slots=4)  # 4 KiB pages


@contextlib.asynccontextmanager
async def _pair(seed: int = 5, **options: int) -> AsyncIterator[
        tuple[Transport, PeerProcess, dict[int, torch.Tensor], Peer, list[MemoryRegion]]]:
    """An in-process rdma sender with filled source pages, and a receiver process."""
    regions, flats = LAYOUT.build(seed)
    send = registry.create("rdma", contiguous_min=16 << 10, **options)
    await send.register(regions)
    try:
        async with PeerProcess("rdma", layout=LAYOUT) as recv:
            peer = await send.connect(recv.descriptor)
            yield send, recv, flats, peer, regions
    finally:
        await send.close()


async def _posted(recv: PeerProcess, room: int) -> int:
    """The receiver's posted data receives for ``room``, once any are up (bounded wait)."""
    for _ in range(500):
        if n := await recv.call("receives_posted", room):
            return int(n)
        await asyncio.sleep(0.01)
    return 0


def _pages_digest(flats: dict[int, torch.Tensor], pages: list[int]) -> str:
    return digest(torch.cat([flats[r].view(-1, LAYOUT.page_bytes)[pages].reshape(-1) for r in LAYOUT.kv_region_ids()]))


async def _state(recv: PeerProcess, room: int) -> KVPoll:
    [(state, _reason)] = await recv.call("status", [room])
    return KVPoll(state)


async def test_the_receives_go_up_at_prepare_and_the_bytes_read_at_send_land() -> None:
    src, dst = list(range(4, 16)) + [30, 31], list(range(20, 32)) + [2, 40]
    async with _pair() as (send, recv, flats, peer, regions):
        await recv.call("advertise", 7, dst, 1)
        ops = page_ops(region_pairs(regions, peer.descriptor.regions), src, dst)
        dmeta = peer.descriptor.require_region(METADATA_REGION_ID)
        prepared = send.prepare_write(peer, 7, ops, metadata=metadata_op(regions[-1], 0, dmeta, 1))
        # "the compute": the receiver posted its receives, and neither side calls the
        # room started yet
        assert await _posted(recv, 7) > 0
        assert await _state(recv, 7) is KVPoll.WAITING_FOR_INPUT
        assert send.poll(7) is KVPoll.WAITING_FOR_INPUT
        assert send.transfer_started(7) is None
        for r in LAYOUT.kv_region_ids():  # the bytes are computed only now
            flats[r].view(-1, LAYOUT.page_bytes)[src] += 1
        sent_at = time.monotonic()  # one clock for both processes on this host
        await prepared()
        assert (await send.wait(7, WAIT_S)).state is KVPoll.SUCCESS
        done_at = time.monotonic()
        assert send.transfer_started(7) is not None
        # the receiver's transfer began with the data, not with the announcement
        started = await recv.call("transfer_started", 7)
        assert started is not None and sent_at <= started <= done_at
        assert await _state(recv, 7) is KVPoll.SUCCESS
        assert await recv.call("digest_pages", LAYOUT.kv_region_ids(), dst) == _pages_digest(flats, src)
        assert await recv.call("receives_posted", 7) == 0


async def test_a_chunk_written_between_the_announcement_and_its_send_is_counted() -> None:
    """The final write announced first, an earlier chunk written plainly after it, then
    the prepared send: the row waits for both and every page lands."""
    first, last = list(range(0, 8)), list(range(8, 20))
    async with _pair(seed=9) as (send, recv, flats, peer, regions):
        await recv.call("advertise", 8, first + last, 0)
        pairs = region_pairs(regions, peer.descriptor.regions)
        dmeta = peer.descriptor.require_region(METADATA_REGION_ID)
        prepared = send.prepare_write(peer, 8, page_ops(pairs, last, last),
                                      metadata=metadata_op(regions[-1], 0, dmeta, 0))
        assert await _posted(recv, 8) > 0
        await send.write(peer, 8, page_ops(pairs, first, first))
        await prepared()
        assert (await send.wait(8, WAIT_S)).state is KVPoll.SUCCESS
        assert await recv.call("digest_pages", LAYOUT.kv_region_ids(), first + last) == \
            _pages_digest(flats, first + last)


async def test_a_refused_announcement_fails_the_room_before_any_byte_is_sent() -> None:
    async with _pair() as (send, recv, flats, peer, regions):
        await recv.call("advertise", 9, [0, 1, 2], 0)
        ops = page_ops(region_pairs(regions, peer.descriptor.regions), [5, 6, 7], [0, 1, 30])
        prepared = send.prepare_write(peer, 9, ops)
        st = await send.wait(9, WAIT_S)  # the NACK comes during "the compute"
        assert st.state is KVPoll.FAILED and st.refusal is Refusal.OUTSIDE_GRANT, st
        assert "page 30" in (st.reason or ""), st.reason
        await prepared()  # sends nothing now
        assert await send.drain(9, WAIT_S)
        zeros = digest(torch.zeros(2 * LAYOUT.layers * 3 * LAYOUT.page_bytes, dtype=torch.uint8))
        assert await recv.call("digest_pages", LAYOUT.kv_region_ids(), [0, 1, 30]) == zeros
        assert await recv.call("receives_posted", 9) == 0


async def test_a_room_released_after_its_announcement_takes_none_of_the_late_bytes() -> None:
    dst = list(range(10, 22))
    async with _pair() as (send, recv, flats, peer, regions):
        pairs = region_pairs(regions, peer.descriptor.regions)
        await recv.call("advertise", 10, dst, 0)
        prepared = send.prepare_write(peer, 10, page_ops(pairs, dst, dst))
        assert await _posted(recv, 10) > 0
        await recv.call("release", 10)  # the decode aborted the request meanwhile
        st = await send.wait(10, WAIT_S)
        assert st.state is KVPoll.FAILED and "released by the receiver" in (st.reason or ""), st
        await prepared()
        assert await send.drain(10, WAIT_S)
        zeros = digest(torch.zeros(2 * LAYOUT.layers * len(dst) * LAYOUT.page_bytes, dtype=torch.uint8))
        assert await recv.call("digest_pages", LAYOUT.kv_region_ids(), dst) == zeros
        # the connection goes on: the same pages, granted to the next room, fill
        send.release(10)
        await recv.call("advertise", 11, dst, 0)
        await send.write(peer, 11, page_ops(pairs, dst, dst),
                         metadata=metadata_op(regions[-1], 0, peer.descriptor.require_region(METADATA_REGION_ID), 0))
        assert (await send.wait(11, WAIT_S)).state is KVPoll.SUCCESS
        assert await recv.call("digest_pages", LAYOUT.kv_region_ids(), dst) == _pages_digest(flats, dst)


def test_write_ahead_takes_on_or_off_and_refuses_anything_else() -> None:
    with pytest.raises(ConfigError, match="write_ahead must be 1 .on. or 0 .off., got 2"):
        registry.create("rdma", write_ahead=2)


async def test_with_write_ahead_off_the_write_goes_out_with_its_data() -> None:
    src = dst = list(range(0, 10))
    async with _pair(write_ahead=0) as (send, recv, flats, peer, regions):
        await recv.call("advertise", 12, dst, 0)
        prepared = send.prepare_write(peer, 12, page_ops(region_pairs(regions, peer.descriptor.regions), src, dst),
                                      metadata=metadata_op(regions[-1], 0, peer.descriptor.require_region(METADATA_REGION_ID), 0))
        await asyncio.sleep(0.2)
        assert await recv.call("receives_posted", 12) == 0 and await _state(recv, 12) is KVPoll.WAITING_FOR_INPUT
        await prepared()
        assert (await send.wait(12, WAIT_S)).state is KVPoll.SUCCESS
        assert await recv.call("digest_pages", LAYOUT.kv_region_ids(), dst) == _pages_digest(flats, src)
