"""Idle sockets on a decode's data-plane listeners cannot keep its prefill out.

A real tcp transport listening on 127.0.0.1 with its default limits: sockets that
connect and never prove who they are (from the prefill's own address, and from three
more loopback addresses) do not block a new proven prefill->decode connection, and its
transfer lands; the idle ones are closed, and not one of them stays past the
receiver's budget for unproven connections. The same for rdma's liveness listener, with
sockets that trickle bytes.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import registry
from pdgrpc.transport.base import RoomGrant
from pdgrpc.transport.descriptor import Descriptor
from pdgrpc.transport.liveness import MAX_UNPROVEN_LINKS, Liveness
from pdgrpc.transport.liveness import Liveness
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.tcp_limits import TcpLimits
from pdgrpc.transport.testing.peer import Layout

from tests.eventually import eventually_async

pytestmark = pytest.mark.timeout(60)

LAYOUT = Layout(layers=2, pages=16, slots=4)
IDLE_PER_ADDRESS = 256
ADDRESSES = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]


async def test_idle_sockets_do_not_block_a_proven_prefill_connection() -> None:
    recv = registry.create("tcp")  # the defaults a decode runs with
    desc = await recv.register(LAYOUT.build(None)[0])
    host, _, port = Descriptor.from_bytes(desc).endpoint.decode().rpartition(":")
    idle: list[socket.socket] = []
    send = registry.create("tcp")
    try:
        loop = asyncio.get_running_loop()
        for source in ADDRESSES:  # the prefill's own address first
            for _ in range(IDLE_PER_ADDRESS):
                s = socket.socket()
                idle.append(s)
                s.bind((source, 0))
                s.setblocking(False)
                await loop.sock_connect(s, (host, int(port)))
        unproven_cap = TcpLimits().max_unproven_connections
        await eventually_async(lambda: len(recv.receiver.connections) <= unproven_cap, 10.0,
                               what="the receiver keeps no more idle sockets than its budget")
        regions, _ = LAYOUT.build(5)
        await send.register(regions)
        peer = await send.connect(desc)  # the prefill, from 127.0.0.1 too
        recv.advertise(RoomGrant.of(5, [1], slot=0))
        pairs = region_pairs(regions, peer.descriptor.regions)
        meta = metadata_op(regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 0)
        await send.write(peer, 5, page_ops(pairs, [0], [1]), metadata=meta)
        assert (await send.wait(5, 30)).state is KVPoll.SUCCESS
        assert (await recv.wait(5, 30)).state is KVPoll.SUCCESS
        assert len(recv.receiver.connections) <= unproven_cap + 1
    finally:
        for s in idle:
            s.close()
        await send.close()
        await recv.close()


async def test_trickling_sockets_do_not_block_a_proven_liveness_link() -> None:
    # rdma's liveness links: sockets that trickle a byte at a time (never a whole hello)
    # are closed once the lease passes, and a new proven link still gets in meanwhile.
    listener = Liveness("decode-live", lambda peer, why: None, interval=0.1, lease=0.6)
    watcher = Liveness("prefill-live", lambda peer, why: None, interval=0.1, lease=0.6, info=b"prefill")
    host, _, port = (await listener.start()).rpartition(":")
    loop = asyncio.get_running_loop()
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE_PER_ADDRESS):
            s = socket.socket()
            idle.append(s)
            s.setblocking(False)
            await loop.sock_connect(s, (host, int(port)))
        for i in range(10):  # 1 s of a hello that never ends, past the 0.6 s lease
            for s in idle:
                try:
                    s.send(b"PDGL\xff\xff" if i == 0 else b"x")
                except OSError:
                    pass
            await asyncio.sleep(0.1)
        assert await watcher.watch("decode-live", f"{host}:{port}") == b""  # proven, answered
        assert listener.proven_link("prefill-live", b"prefill") is not None
        assert len(listener.links) <= MAX_UNPROVEN_LINKS + 1
    finally:
        for s in idle:
            s.close()
        await watcher.close()
        await listener.close()
