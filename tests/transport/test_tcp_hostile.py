"""The tcp receiver against a hostile client on its listener (issue 16's audit): malformed
frames close that connection and harm no one else; frames are bounded; a claimed
identity never fails the real peer's rooms."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import peerauth, registry
from pdgrpc.transport.base import RoomGrant
from pdgrpc.transport.pages import METADATA_REGION_ID, metadata_op, page_ops, region_pairs
from pdgrpc.transport.testing.peer import Layout
from pdgrpc.transport.receiver import MessageType
from pdgrpc.transport.tcp_wire import HEADER, MAX_FRAME_PAYLOAD, OP

from tests.eventually import eventually_async
from tests.transport.raw_tcp import RawClient

pytestmark = pytest.mark.timeout(120)

LAYOUT = Layout(layers=2, pages=16, slots=4)


class Pair:
    """A receiver and a well-behaved sender in this process, both tcp (``options``: the
    receiver's)."""

    def __init__(self, **options: object) -> None:
        self.options = options

    async def __aenter__(self) -> "Pair":
        self.recv_regions, _ = LAYOUT.build(seed=None)
        self.send_regions, _ = LAYOUT.build(seed=5)
        self.recv = registry.create("tcp", **self.options)
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


async def test_an_ack_sent_to_the_receiver_ends_no_room_and_closes_that_connection() -> None:
    # ACK and NACK go from a receiver to its sender; on the receiver's listener they can
    # only come from a client that means harm, and must not end the room they name.
    async with Pair() as p:
        p.recv.advertise(RoomGrant.of(55, [2], slot=1))
        client = RawClient(p.descriptor)
        try:
            await client.send(HEADER.pack(MessageType.ACK, 0, 55, 0, 0))
            assert await client.closed_by_peer(timeout=5)
        finally:
            client.close()
        assert p.recv.poll(55) is KVPoll.WAITING_FOR_INPUT
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


async def test_a_writer_that_reads_none_of_its_replies_is_closed_not_buffered() -> None:
    # Audit: a proven writer sent 57-byte frames for a room that does not exist and never
    # read its socket; the receiver queued a NACK for each (about 800 bytes of its memory
    # apiece, 300 MB for 400,000 frames). Once MAX_UNREAD_REPLY_BYTES of replies wait,
    # the receiver closes that connection; the real peer goes on.
    async with Pair(sockbuf=64 << 10) as p:  # small kernel buffers: the queue fills soon
        client = RawClient(p.descriptor)
        client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            assert await client.hello() == MessageType.HELLO_OK
            refused = HEADER.pack(MessageType.WRITE, 1, 999, 1, 0) + OP.pack(0, 0, 1) + b"x"
            # NACKs of 100,000 frames: far more than the cap and the kernel's buffers. A
            # receiver that keeps reading them takes all; one that closed resets the rest.
            closed = False
            for _ in range(10):
                try:
                    await client.send(refused * 10_000)
                except OSError:
                    closed = True
                    break
            assert closed, "the receiver read 100,000 frames whose replies were never read"
        finally:
            client.close()
        assert await p.transfer() is KVPoll.SUCCESS


IMPOSTERS = {
    # claims the id (public through GetWorkers), has no credential (the audit's HELLO)
    "no proof": lambda c, me: c.hello(claimed_id=me, credential=b""),
    # a credential this receiver issued, but to another writer
    "another writer's credential": lambda c, me: c.hello(
        claimed_id=me, credential=peerauth.known_credential(c.target, "someone-else")),
    # the real credential, answering an old nonce (a replayed HELLO)
    "replayed proof": lambda c, me: c.hello(claimed_id=me, nonce=b"\x01" * 16),
}


@pytest.mark.parametrize("how", sorted(IMPOSTERS))
async def test_a_connection_claiming_the_real_peers_id_is_refused_and_changes_nothing(how: str) -> None:
    # The audit: claim the prefill's instance id in HELLO, then disconnect. Without the
    # credential the receiver issued to that peer (over the control plane) the HELLO is
    # refused, the connection closed, and the real peer's room goes on.
    async with Pair() as p:
        room = 77
        p.recv.advertise(RoomGrant.of(room, [2, 3], slot=1))
        pairs = region_pairs(p.send_regions, p.peer.descriptor.regions)
        await p.send.write(p.peer, room, page_ops(pairs, [0], [2]))  # pages in flight, no row yet
        while p.recv.poll(room) is KVPoll.WAITING_FOR_INPUT:
            await asyncio.sleep(0.001)
        for _ in range(3):
            imposter = RawClient(p.descriptor)
            try:
                assert await IMPOSTERS[how](imposter, p.send.instance_id) == MessageType.HELLO_REFUSED
                assert await imposter.closed_by_peer()
            finally:
                imposter.close()
        await eventually_async(lambda: len(p.recv.receiver.connections) == 1, what="the receiver saw the imposters go")
        assert p.recv.poll(room) is KVPoll.TRANSFERRING
        assert not p.recv.writer_gone(p.send.instance_id)
        meta = metadata_op(p.send_regions[-1], 0, p.peer.descriptor.region(METADATA_REGION_ID), 1)
        await p.send.write(p.peer, room, page_ops(pairs, [1], [3]), metadata=meta)
        assert (await p.recv.wait(room, 30)).state is KVPoll.SUCCESS
        assert (await p.send.wait(room, 30)).state is KVPoll.SUCCESS
        assert await p.transfer() is KVPoll.SUCCESS


async def test_a_sender_without_the_receivers_credential_cannot_connect() -> None:
    # A writer in another process that never got a credential over the control plane.
    from pdgrpc.transport.testing.peer import PeerProcess

    recv = registry.create("tcp")
    desc = await recv.register(LAYOUT.build(None)[0])
    try:
        async with PeerProcess("tcp", layout=LAYOUT, seed=3) as sender:
            with pytest.raises(Exception, match="no data-plane credential"):
                await sender.call("connect", desc, b"")
            with pytest.raises(Exception, match="proof of identity"):
                await sender.call("connect", desc, b"\x00" * 32)
            assert recv.writers.open[sender.instance_id] == 0
    finally:
        await recv.close()


async def test_a_writer_whose_connections_end_is_gone_until_it_proves_itself_again() -> None:
    async with Pair() as p:
        iid = p.send.instance_id
        assert not p.recv.writer_gone(iid)
        p.send.fail_peer(p.recv.instance_id, "test: drop the connection")  # the writer closes its side
        await eventually_async(lambda: p.recv.writer_gone(iid), what="the receiver saw the writer's connection end")
        p.peer = await p.send.connect(p.descriptor)
        assert not p.recv.writer_gone(iid)
        assert await p.transfer() is KVPoll.SUCCESS


# -- bounded resources ---------------------------------------------------------------------
async def test_a_connection_that_never_says_hello_is_closed() -> None:
    recv = registry.create("tcp", hello_timeout=0.3)
    desc = await recv.register(LAYOUT.build(None)[0])
    try:
        idle = RawClient(desc)
        try:
            assert await idle.closed_by_peer(timeout=30)
        finally:
            idle.close()
    finally:
        await recv.close()


async def test_unproven_connections_give_way_and_proven_ones_are_capped_per_listener() -> None:
    recv = registry.create("tcp", max_connections=2, max_connections_per_address=3)
    desc = await recv.register(LAYOUT.build(None)[0])
    clients = [RawClient(desc) for _ in range(3)]  # not proven yet: they count for the address
    try:
        for c in clients:
            assert await c.challenge()  # accepted and served
        extra = RawClient(desc)  # a 4th unproven one from the same address
        clients.append(extra)
        assert await extra.challenge()  # served: the oldest unproven one gave way
        assert await clients[0].closed_by_peer()
        assert await clients[1].hello(claimed_id="w0") == MessageType.HELLO_OK
        assert await clients[2].hello(claimed_id="w1") == MessageType.HELLO_OK
        assert await extra.hello(claimed_id="w2") == MessageType.HELLO_REFUSED  # the 3rd proven on a listener capped at 2
        assert await extra.closed_by_peer()
        for c in clients:
            c.close()
        await eventually_async(lambda: len(recv.receiver.connections) == 0, what="the receiver saw the clients go")
        send = registry.create("tcp")
        regions, _ = LAYOUT.build(5)
        await send.register(regions)
        try:
            peer = await send.connect(desc)  # room again once the others left
            recv.advertise(RoomGrant.of(5, [1], slot=0))
            pairs = region_pairs(regions, peer.descriptor.regions)
            meta = metadata_op(regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 0)
            await send.write(peer, 5, page_ops(pairs, [0], [1]), metadata=meta)
            assert (await send.wait(5, 30)).state is KVPoll.SUCCESS
        finally:
            await send.close()
    finally:
        for c in clients:
            c.close()
        await recv.close()


async def test_proven_connections_are_capped_per_peer_not_per_address() -> None:
    # Many workers behind one host: the per-address cap counts only connections that
    # have not proven who they are; proven ones count against their own peer's cap.
    recv = registry.create("tcp", max_connections_per_address=2, max_connections_per_peer=2)
    desc = await recv.register(LAYOUT.build(None)[0])
    clients: list[RawClient] = []
    try:
        for who in ["worker-0", "worker-1", "worker-2", "worker-3", "worker-0"]:
            clients.append(RawClient(desc))
            assert await clients[-1].hello(claimed_id=who) == MessageType.HELLO_OK
        clients.append(RawClient(desc))
        assert await clients[-1].hello(claimed_id="worker-0") == MessageType.HELLO_REFUSED  # its 3rd
        assert await clients[-1].closed_by_peer()
    finally:
        for c in clients:
            c.close()
        await recv.close()


async def test_out_of_file_descriptors_the_listener_backs_off_instead_of_spinning() -> None:
    import errno
    import socket

    from pdgrpc.transport.tcp import TcpTransport

    calls = 0

    class Exhausted:  # a listener as it behaves at the fd limit: readable, accept fails
        def __init__(self, real: socket.socket) -> None:
            self.real = real

        def fileno(self) -> int:
            return self.real.fileno()

        def setblocking(self, flag: bool) -> None:
            self.real.setblocking(flag)

        def accept(self):
            nonlocal calls
            calls += 1
            raise OSError(errno.EMFILE, "Too many open files")

        def close(self) -> None:
            self.real.close()

    class AtTheLimit(TcpTransport):
        def listen_socket(self):
            real, endpoint = super().listen_socket()
            return Exhausted(real), endpoint

    recv = AtTheLimit()
    desc = await recv.register(LAYOUT.build(None)[0])
    waiting = RawClient(desc)  # keeps the listener readable
    try:
        await asyncio.sleep(0.5)  # the scenario: half a second at the fd limit
        assert 1 <= calls <= 20, f"accept tried {calls} times in 0.5 s"
    finally:
        waiting.close()
        await recv.close()


# -- heartbeat -------------------------------------------------------------------------------
async def test_a_hung_receiver_fails_the_senders_rooms_within_the_lease() -> None:
    import os
    import signal

    from pdgrpc.transport.testing.peer import PeerProcess

    options = {"heartbeat_interval": 0.1, "heartbeat_lease": 1.0}
    regions, _ = LAYOUT.build(5)
    send = registry.create("tcp", **options)
    await send.register(regions)
    recv = PeerProcess("tcp", layout=LAYOUT, options=options)
    await recv.start()
    try:
        peer = await send.connect(recv.descriptor)
        await recv.call("advertise", 21, [1, 2], 0)
        os.kill(recv.pid, signal.SIGSTOP)  # sockets stay open: only the heartbeat can tell
        pairs = region_pairs(regions, peer.descriptor.regions)
        await send.write(peer, 21, page_ops(pairs, [0, 1], [1, 2]))
        st = await send.wait(21, 30)
        assert st.state is KVPoll.FAILED and "heartbeat" in (st.reason or ""), st
        os.kill(recv.pid, signal.SIGCONT)
    finally:
        os.kill(recv.pid, signal.SIGCONT)
        await recv.stop()
        await send.close()


async def test_an_idle_connection_outlives_the_lease() -> None:
    options = {"heartbeat_interval": 0.05, "heartbeat_lease": 0.3}
    recv, send = registry.create("tcp", **options), registry.create("tcp", **options)
    regions, _ = LAYOUT.build(5)
    desc = await recv.register(LAYOUT.build(None)[0])
    await send.register(regions)
    try:
        peer = await send.connect(desc)
        await asyncio.sleep(1.0)  # the scenario: idle for three leases
        recv.advertise(RoomGrant.of(8, [1], slot=0))
        pairs = region_pairs(regions, peer.descriptor.regions)
        meta = metadata_op(regions[-1], 0, peer.descriptor.region(METADATA_REGION_ID), 0)
        await send.write(peer, 8, page_ops(pairs, [0], [1]), metadata=meta)
        assert (await send.wait(8, 30)).state is KVPoll.SUCCESS
    finally:
        await send.close()
        await recv.close()


@pytest.mark.parametrize("bad", [{"hello_timeout": 0}, {"max_connections": 0}, {"max_connections_per_address": 1.5},
                                 {"max_unproven_connections": 0}, {"heartbeat_interval": 5, "heartbeat_lease": 5}, {"heartbeat_lease": float("nan")}])
def test_bad_limits_are_refused_naming_the_option(bad: dict) -> None:
    from pdgrpc.errors import ConfigError

    with pytest.raises(ConfigError, match=sorted(bad)[0]):
        registry.create("tcp", **bad)


# -- fuzz --------------------------------------------------------------------------------------
def _fuzz_streams():
    from hypothesis import strategies as st

    def frame(ftype: int, n_ops: int, room: int, payload: int, aux: int, tail: bytes) -> bytes:
        return HEADER.pack(ftype, n_ops, room, payload, aux) + tail

    header_like = st.builds(frame, st.integers(0, 12), st.integers(0, 600), st.sampled_from([0, 1, 99, 101, 2**63]),
                            st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.binary(max_size=96))
    return st.tuples(st.booleans(), st.lists(st.one_of(header_like, st.binary(max_size=64)), max_size=4))


@pytest.mark.timeout(300)
def test_arbitrary_byte_streams_harm_nobody() -> None:
    # Random streams (after a HELLO or not) against a live receiver with an open room: no
    # exception escapes, no byte lands outside the granted pages, the real peer still works.
    import torch
    from hypothesis import given, settings

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(_fuzz_streams())
    def check(case: tuple[bool, list[bytes]]) -> None:
        say_hello, chunks = case

        async def run() -> None:
            async with Pair() as p:
                flats = {r.region_id: r.tensor.detach().reshape(-1).view(torch.uint8).clone() for r in p.recv_regions}
                p.recv.advertise(RoomGrant.of(99, [5], slot=2))  # a room the stream may aim at
                client = RawClient(p.descriptor)
                try:
                    if say_hello:
                        await client.hello()
                    for chunk in chunks:
                        await client.send(chunk)
                except OSError:
                    pass  # the receiver closed the connection mid-stream: what it should do
                finally:
                    client.close()
                await eventually_async(lambda: len(p.recv.receiver.connections) == 1, what="the fuzzing connection gone")
                assert await p.transfer() is KVPoll.SUCCESS
                for r in p.recv_regions:
                    now = r.tensor.detach().reshape(-1).view(torch.uint8)
                    ib = r.item_bytes
                    changed = {i // ib for i in torch.nonzero(now != flats[r.region_id]).flatten().tolist()}
                    # transfer() wrote pages 2, 3 and slot 1; the stream may only hit room 99's page 5, slot 2
                    allowed = {1, 2} if r.region_id == METADATA_REGION_ID else {2, 3, 5}
                    assert changed <= allowed, (r.name, sorted(changed))

        asyncio.run(run())

    check()
