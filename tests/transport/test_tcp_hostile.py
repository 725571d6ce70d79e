"""The tcp receiver against a hostile client on its listener (issue 16's audit): malformed
frames close that connection and harm no one else; frames are bounded; a claimed
identity never fails the real peer's rooms."""

from __future__ import annotations

import asyncio

import pytest

from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.base import RoomGrant
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.peerproc import Layout
from pdgrpc.transport.receiver import MessageType
from pdgrpc.transport.tcp_conn import HEADER, MAX_FRAME_PAYLOAD

from tests.eventually import eventually_async
from tests.transport.raw_tcp import RawClient

pytestmark = pytest.mark.timeout(120)

LAYOUT = Layout(layers=2, pages=16, slots=4)


class Pair:
    """A receiver and a well-behaved sender in this process, both tcp."""

    async def __aenter__(self) -> "Pair":
        self.recv_regions, _ = LAYOUT.build(seed=None)
        self.send_regions, _ = LAYOUT.build(seed=5)
        self.recv = registry.create("tcp")
        self.send = registry.create("tcp")
        self.descriptor = await self.recv.register(self.recv_regions)
        await self.send.register(self.send_regions)
        self.peer = await self.send.connect(self.descriptor)
        self.next_room = 100
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.send.close()
        await self.recv.close()

    async def transfer(self) -> KVPoll:
        """One room, two pages and the row, from the real sender; its receiver state."""
        room = self.next_room = self.next_room + 1
        self.recv.advertise(RoomGrant.of(room, [2, 3], slot=1))
        pairs = region_pairs(self.send_regions, self.peer.descriptor.regions)
        meta = metadata_op(self.send_regions[-1], 0, self.peer.descriptor.region(METADATA_REGION_ID), 1)
        await self.send.write(self.peer, room, page_ops(pairs, [0, 1], [2, 3]), metadata=meta)
        st = await self.recv.wait(room, 30)
        self.recv.release(room)
        await self.send.wait(room, 30)
        self.send.release(room)
        return st.state


MALFORMED = {
    "unknown frame type": lambda c: c.send(HEADER.pack(99, 0, 0, 0, 0)),
    "data frame before HELLO": lambda c: c.write_frame(7, [(0, 0, 16)]),
    "control frame over 64 KiB": lambda c: c.send(HEADER.pack(MessageType.HELLO, 0, 0, 1 << 20, 0)),
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
async def test_a_malformed_frame_closes_only_that_connection(what: str) -> None:
    async with Pair() as p:
        client = RawClient(p.descriptor)
        try:
            await MALFORMED[what](client)
            assert await client.closed_by_peer(), what
        finally:
            client.close()
        assert await p.transfer() is KVPoll.SUCCESS


@pytest.mark.parametrize("payload", [MAX_FRAME_PAYLOAD + 1, 1 << 40, 1 << 62], ids=["cap+1", "2^40", "2^62"])
async def test_a_frame_announcing_more_than_the_cap_is_refused_without_reading_it(payload: int) -> None:
    # The audit's 56-byte frame: one op announcing 2^62 bytes for a room that does not
    # exist. The receiver must close the connection (naming the limit in its log), not
    # plan to discard the payload, and keep serving the real peer.
    async with Pair() as p:
        client = RawClient(p.descriptor)
        try:
            assert await client.hello() == MessageType.HELLO_OK
            await client.write_frame(12345, [(0, 0, payload)])
            assert await client.closed_by_peer()
        finally:
            client.close()
        assert await p.transfer() is KVPoll.SUCCESS
        assert await asyncio.wait_for(asyncio.sleep(0), 1) is None  # the loop is free


async def test_a_connection_claiming_the_real_peers_id_cannot_fail_it() -> None:
    # The audit: claim the prefill's instance id (public through GetWorkers) in HELLO,
    # then disconnect. The receiver must not take that for the real peer's death.
    async with Pair() as p:
        room = 77
        p.recv.advertise(RoomGrant.of(room, [2, 3], slot=1))
        pairs = region_pairs(p.send_regions, p.peer.descriptor.regions)
        await p.send.write(p.peer, room, page_ops(pairs, [0], [2]))  # pages in flight, no row yet
        while p.recv.poll(room) is KVPoll.WAITING_FOR_INPUT:
            await asyncio.sleep(0.001)
        for _ in range(3):
            imposter = RawClient(p.descriptor)
            assert await imposter.hello(claimed_id=p.send.instance_id) == MessageType.HELLO_OK
            imposter.close()
        await eventually_async(lambda: len(p.recv._incoming) == 1, what="the receiver saw the imposters go")
        assert p.recv.poll(room) is KVPoll.TRANSFERRING
        meta = metadata_op(p.send_regions[-1], 0, p.peer.descriptor.region(METADATA_REGION_ID), 1)
        await p.send.write(p.peer, room, page_ops(pairs, [1], [3]), metadata=meta)
        assert (await p.recv.wait(room, 30)).state is KVPoll.SUCCESS
        assert (await p.send.wait(room, 30)).state is KVPoll.SUCCESS
        assert await p.transfer() is KVPoll.SUCCESS
