"""The sending side of the ``tcp`` backend: its connections to each peer instance, and
writes. A write's ops go out as ``WRITE`` frames gathered straight from the source
tensors (device memory through :mod:`~pdgrpc.transport.tcp_device`), spread over the
peer's connections, then the metadata row as one ``META`` frame; the receiver's
``ACK``/``NACK`` ends the room."""

from __future__ import annotations

import asyncio
import functools
from typing import Awaitable, Callable, Iterator, Mapping, Sequence

from pdgrpc.errors import ConfigError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport.descriptor import Descriptor, Peer
from pdgrpc.transport.receiver import Refusal
from pdgrpc.transport.regions import MemoryRegion, WriteOp, WriteOps, check_source_ops
from pdgrpc.transport.rooms import RoomStates
from pdgrpc.transport.tcp_conn import Conn, ConnEvents
from pdgrpc.transport.tcp_device import TcpDevice
from pdgrpc.transport.tcp_wire import HEADER, MAX_FRAME_PAYLOAD, META, OP, WRITE, frame_buffers, frame_chunks, op_table

__all__ = ["Dial", "TcpSender"]

# Open one connection to the peer described, handshake done, reporting to the events given.
Dial = Callable[[Descriptor, ConnEvents], Awaitable[Conn]]


class _Link:
    """The sender's connections to one peer instance."""

    def __init__(self, peer: Peer, conns: list[Conn]) -> None:
        self.peer = peer
        self.conns = conns
        self.next = 0
        self.rooms: set[int] = set()
        self.sent: dict[int, int] = {}
        self.alive = True

    def conn(self) -> Conn:
        c = self.conns[self.next % len(self.conns)]
        self.next += 1
        return c


class TcpSender:
    """Links of one ``tcp`` transport to its peers, and the rooms written over them.

    ``regions`` and ``views`` are the registered regions and the host ones' bytes, and
    ``device`` stages the device regions (all filled as regions are registered);
    ``dial`` opens ``connections`` connections per peer; ``fail_peer`` is the
    transport's, called when a connection to a peer is lost."""

    def __init__(self, rooms: RoomStates, regions: Mapping[int, MemoryRegion], views: Mapping[int, memoryview],
                 device: TcpDevice, dial: Dial, connections: int, fail_peer: Callable[[str, str], None],
                 name: str) -> None:
        self._rooms = rooms
        self._regions = regions
        self._views = views
        self._device = device
        self._dial = dial
        self._nconn = connections
        self._fail_peer = fail_peer
        self._name = name
        self._links: dict[str, _Link] = {}
        self._connecting: dict[str, asyncio.Future[None]] = {}
        self._room_link: dict[int, str] = {}

    def connections(self) -> Iterator[Conn]:
        return (c for link in self._links.values() for c in link.conns)

    # -- peers ---------------------------------------------------------------------------
    async def connect(self, d: Descriptor) -> Peer:
        link = self._links.get(d.instance_id)
        if link is not None and link.alive:
            return link.peer
        pending = self._connecting.get(d.instance_id)
        if pending is not None:
            await asyncio.shield(pending)
            return await self.connect(d)
        # A different instance at the same endpoint is a restarted peer: the old
        # connection (if any survived) must not be used again.
        for old in [lk for lk in self._links.values() if lk.peer.descriptor.endpoint == d.endpoint]:
            self._drop_link(old, f"peer at {d.endpoint.decode(errors='replace')} restarted as {d.instance_id}")
        fut = asyncio.get_running_loop().create_future()
        self._connecting[d.instance_id] = fut
        conns: list[Conn] = []
        try:
            for _ in range(self._nconn):
                conns.append(await self._dial(d, self))
            peer = Peer(d.instance_id, d)
            link = _Link(peer, conns)
            for c in conns:
                c.peer_id = d.instance_id
            self._links[d.instance_id] = link
            return peer
        except BaseException:
            for c in conns:
                c.close()
            raise
        finally:
            del self._connecting[d.instance_id]
            fut.set_result(None)

    def drop(self, instance_id: str, reason: str) -> None:
        """Close the link to ``instance_id`` (if any); its rooms fail with ``reason``."""
        link = self._links.get(instance_id)
        if link is not None:
            self._drop_link(link, reason)

    def _drop_link(self, link: _Link, reason: str, *, peer_lost: bool = True) -> None:
        link.alive = False
        if self._links.get(link.peer.instance_id) is link:
            del self._links[link.peer.instance_id]
        for c in link.conns:
            c.close()
        self._rooms.fail_all(reason, link.rooms, peer_lost=peer_lost)
        for room in link.rooms:
            if self._room_link.get(room) == link.peer.instance_id:
                del self._room_link[room]

    def close(self, reason: str) -> None:
        for link in list(self._links.values()):
            self._drop_link(link, reason, peer_lost=False)

    # -- rooms ---------------------------------------------------------------------------
    async def write(self, peer: Peer, room: int, ops: Sequence[WriteOp], metadata: WriteOp | None) -> None:
        self._check_src(ops, metadata)
        self._rooms.create(room, KVPoll.TRANSFERRING)
        link = self._links.get(peer.instance_id)
        if link is None or not link.alive:
            self._rooms.fail(room, f"peer {peer.instance_id} is not connected (failed or never connected)")
            return
        self._room_link[room] = peer.instance_id
        link.rooms.add(room)
        sent = link.sent.get(room, 0)
        views = self._views
        arr = WriteOps.of(ops).array
        staged = self._device.touches(arr[:, 0])  # device sources go through pinned buffers (tcp_device)
        sent += await self._device.write(link.conn, room, arr) if staged else 0
        for chunk in () if staged else frame_chunks(arr):
            table = op_table(chunk[:, 2], chunk[:, 3], chunk[:, 4])
            total = int(chunk[:, 4].sum())
            hdr = HEADER.pack(WRITE, len(chunk), room, total, 0)
            link.conn().send_later(functools.partial(frame_buffers, hdr, table, chunk, views))
            sent += total
        link.sent[room] = sent
        if metadata is not None:
            m = metadata
            link.conn().send(
                [
                    HEADER.pack(META, 1, room, m.length, sent),
                    OP.pack(m.dst_region, m.dst_offset, m.length),
                    views[m.src_region][m.src_offset : m.src_offset + m.length],
                ]
            )

    def _check_src(self, ops: Sequence[WriteOp], metadata: WriteOp | None) -> None:
        check_source_ops(WriteOps.of(ops), self._regions)
        if metadata is not None:
            check_source_ops([metadata], self._regions)
            if metadata.length > MAX_FRAME_PAYLOAD:
                raise ConfigError(f"tcp: metadata row of {metadata.length} bytes exceeds {MAX_FRAME_PAYLOAD} bytes")

    def release(self, room: int) -> None:
        iid = self._room_link.pop(room, None)
        if iid is not None and iid in self._links:
            link = self._links[iid]
            link.rooms.discard(room)
            link.sent.pop(room, None)

    # -- frames (ConnEvents) ---------------------------------------------------------------
    def ack(self, conn: Conn, room: int) -> None:
        if self._room_link.get(room) == conn.peer_id:
            self._rooms.set(room, KVPoll.SUCCESS)

    def nack(self, conn: Conn, room: int, reason: str, refusal: Refusal | None) -> None:
        if self._room_link.get(room) == conn.peer_id:
            self._rooms.fail(room, f"receiver rejected the transfer: {reason}", refusal)

    def hello(self, conn: Conn, text: str) -> None:
        conn.protocol_error("unexpected HELLO")

    def data_frame(self, conn: Conn, ftype: int, room: int, table: bytearray, payload_len: int, aux: int) -> None:
        conn.protocol_error("data frame on a connection from the sender")

    def closed(self, conn: Conn, by_peer: bool) -> None:
        pass  # a link's connections are forgotten with the link

    def lost(self, conn: Conn, reason: str) -> None:
        peer = conn.peer_id
        if peer is not None:  # the handshake completed: the peer is gone
            self._fail_peer(peer, f"{self._name} peer {peer} lost: {reason}")
