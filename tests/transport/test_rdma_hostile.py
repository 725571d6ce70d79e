"""The rdma receiver against forged input (issue 16's audit): a forged liveness hello
naming the real sender, then a close, must not drop the real sender; control messages
from the future are kept only up to a bound."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.base import Descriptor, RoomGrant
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.peerproc import Layout

from tests.eventually import eventually_async

pytest.importorskip("libucx", reason="the rdma backend needs the UCX libraries of the ucx extra: pip install 'pdgrpc[ucx]'")
pytestmark = pytest.mark.timeout(120)

LAYOUT = Layout(layers=2, pages=16, slots=4)


async def _pair():  # -> (recv, send, send_regions, peer, recv descriptor)
    recv_regions, _ = LAYOUT.build(None)
    send_regions, _ = LAYOUT.build(7)
    recv, send = registry.create("rdma"), registry.create("rdma")
    desc = await recv.register(recv_regions)
    await send.register(send_regions)
    peer = await send.connect(desc)
    return recv, send, send_regions, peer, desc


def _forged_liveness_hello(address: str, claimed_id: str, info: bytes) -> socket.socket:
    host, _, port = address.rpartition(":")
    s = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
    raw = claimed_id.encode()
    s.sendall(b"PDGL" + len(raw).to_bytes(2, "big") + raw + len(info).to_bytes(2, "big") + info)
    return s


async def test_a_forged_liveness_hello_then_close_does_not_drop_the_real_sender() -> None:
    recv, send, send_regions, peer, desc = await _pair()
    try:
        pairs = region_pairs(send_regions, peer.descriptor.regions)
        meta = metadata_op(send_regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 1)
        room = 41
        recv.advertise(RoomGrant.of(room, [2, 3], slot=1))
        await send.write(peer, room, page_ops(pairs, [0], [2]))
        await eventually_async(lambda: recv.poll(room) is KVPoll.TRANSFERRING, what="pages arriving")
        links = len(recv._liveness.links)
        # The sender's instance id and worker address are public (descriptor, GetWorkers).
        forged = _forged_liveness_hello(Descriptor.from_bytes(desc).liveness, send.instance_id, send.worker_address)
        await eventually_async(lambda: len(recv._liveness.links) == links + 1, what="the forged link accepted")
        forged.close()
        await eventually_async(lambda: len(recv._liveness.links) == links, what="the forged link gone")
        assert recv.poll(room) is KVPoll.TRANSFERRING
        await send.write(peer, room, page_ops(pairs, [1], [3]), metadata=meta)
        assert (await recv.wait(room, 30)).state is KVPoll.SUCCESS
        assert (await send.wait(room, 30)).state is KVPoll.SUCCESS
        # and later rooms too (the audit saw every later request fail)
        recv.advertise(RoomGrant.of(room + 1, [4], slot=2))
        meta2 = metadata_op(send_regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 2)
        await send.write(peer, room + 1, page_ops(pairs, [0], [4]), metadata=meta2)
        assert (await send.wait(room + 1, 30)).state is KVPoll.SUCCESS
    finally:
        await send.close()
        await recv.close()


async def test_control_messages_from_the_future_are_kept_only_up_to_a_bound() -> None:
    from pdgrpc.transport.rdma_wire import COMMON, EARLY_MAX, WRITE

    recv, send, send_regions, peer, desc = await _pair()
    try:
        [conn] = recv._recv_conns.values()
        for k in range(2 * EARLY_MAX):  # what a forger with the (guessable) conn id can send
            recv._on_ctrl(COMMON.pack(WRITE, conn.conn_id, conn.next_seq + 5 + k) + b"\0" * 64)
        assert len(conn.early) <= EARLY_MAX
        pairs = region_pairs(send_regions, peer.descriptor.regions)
        recv.advertise(RoomGrant.of(9, [2], slot=0))
        meta = metadata_op(send_regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 0)
        await send.write(peer, 9, page_ops(pairs, [0], [2]), metadata=meta)
        assert (await send.wait(9, 30)).state is KVPoll.SUCCESS
    finally:
        await send.close()
        await recv.close()
