"""The sender side of the ``tcp`` backend (a mixin of
:class:`~pdgrpc.transport.tcp.TcpTransport`): a write's ops go out as ``WRITE`` frames
gathered straight from the source tensors (device memory through
:mod:`~pdgrpc.transport.tcp_device`), spread over the peer's connections, then the
metadata row as one ``META`` frame; the receiver's ``ACK``/``NACK`` ends the room."""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from pdgrpc.errors import ConfigError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport.base import MemoryRegion, Peer, WriteOp, WriteOps, check_source_ops
from pdgrpc.transport.receiver import Refusal
from pdgrpc.transport.rooms import RoomStates
from pdgrpc.transport.tcp_conn import (
    HEADER, MAX_FRAME_PAYLOAD, META, OP, OP_DTYPE, WRITE, _Conn, _frame_buffers, frame_chunks,
)
from pdgrpc.transport.tcp_device import TcpDevice


class _Link:
    """The sender's connections to one peer instance."""

    def __init__(self, peer: Peer, conns: list[_Conn]) -> None:
        self.peer = peer
        self.conns = conns
        self.next = 0
        self.rooms: set[int] = set()
        self.sent: dict[int, int] = {}
        self.alive = True

    def conn(self) -> _Conn:
        c = self.conns[self.next % len(self.conns)]
        self.next += 1
        return c



class TcpSender:
    """Sender half of :class:`~pdgrpc.transport.tcp.TcpTransport` (which sets these)."""

    rooms: RoomStates
    _regions: dict[int, MemoryRegion]
    _views: dict[int, memoryview]
    _dev: TcpDevice
    _links: dict[str, _Link]
    _room_link: dict[int, str]

    def _ensure_loop(self) -> None:
        raise NotImplementedError

    async def write(
        self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None
    ) -> None:
        self._ensure_loop()
        self._check_src(ops, metadata)
        self.rooms.create(room, KVPoll.TRANSFERRING)
        link = self._links.get(peer.instance_id)
        if link is None or not link.alive:
            self.rooms.fail(room, f"peer {peer.instance_id} is not connected (failed or never connected)")
            return
        self._room_link[room] = peer.instance_id
        link.rooms.add(room)
        sent = link.sent.get(room, 0)
        views = self._views
        arr = WriteOps.of(ops).array
        staged = self._dev.touches(arr[:, 0])  # device sources go through pinned buffers (tcp_device)
        sent += await self._dev.write(link.conn, room, arr) if staged else 0
        for chunk in () if staged else frame_chunks(arr):
            table = np.zeros(len(chunk), dtype=OP_DTYPE)
            table["region"] = chunk[:, 2]
            table["offset"] = chunk[:, 3]
            table["length"] = chunk[:, 4]
            total = int(chunk[:, 4].sum())
            hdr = HEADER.pack(WRITE, len(chunk), room, total, 0)
            link.conn().send_later(functools.partial(_frame_buffers, hdr, table, chunk, views))
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

    def _on_ack(self, conn: _Conn, room: int) -> None:
        if self._room_link.get(room) == conn.peer_id:
            self.rooms.set(room, KVPoll.SUCCESS)

    def _on_nack(self, conn: _Conn, room: int, reason: str, refusal: Refusal | None) -> None:
        if self._room_link.get(room) == conn.peer_id:
            self.rooms.fail(room, f"receiver rejected the transfer: {reason}", refusal)

