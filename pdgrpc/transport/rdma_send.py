"""The sender side of the ``rdma`` backend (a mixin of
:class:`~pdgrpc.transport.rdma.RdmaTransport`): checking a write's ops, planning its
data messages (:func:`~pdgrpc.transport.rdma_wire.plan_chunk`) and posting them, then
the metadata row, on the peer's connection."""

from __future__ import annotations

import ctypes
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from pdgrpc.errors import ConfigError, PeerFailure
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport._ucx import UCS_ERR_CANCELED, UCS_OK, Pieces, UcxError, UcxWorker
from pdgrpc.transport.base import Peer, RegionInfo, WriteOp, WriteOps, check_source_ops
from pdgrpc.transport.rdma_wire import (
    COMMON, KIND_CTRL, MAX_OPS_PER_WRITE, MAX_ROW, META, META_BODY, WRITE, WRITE_AHEAD, WRITE_BODY, Plan, Region, SendConn,
    SendRoom, ctrl_tag, data_tag, plan_chunk,
)
from pdgrpc.transport.rooms import RoomStates


class RdmaSender:
    """Sender half of :class:`~pdgrpc.transport.rdma.RdmaTransport` (which sets these)."""

    rooms: RoomStates
    _regions: dict[int, Region]
    _ptr_table: np.ndarray
    _size_table: np.ndarray  # region id -> size in bytes, -1: not registered
    _infos: dict[int, RegionInfo]
    _send_conns: dict[str, SendConn]
    _send_rooms: dict[int, SendRoom]
    _zc_min: int
    _iov_max: int
    _contiguous_min: int | None
    _write_ahead: bool
    _worker: UcxWorker

    def _ensure_started(self) -> None:
        raise NotImplementedError

    def _send_ctrl(self, conn: SendConn, msg: bytes, room_id: int | None, room: SendRoom | None) -> None:
        buf = ctypes.create_string_buffer(msg, len(msg))
        self._send(conn, [(ctypes.addressof(buf), len(msg))], ctrl_tag(KIND_CTRL), room_id, room, buf)

    def _send(self, conn: SendConn, pieces: Pieces, tag: int, room_id: int | None,
              room: SendRoom | None, keep: Any) -> None:
        self._track(conn, room_id, room, lambda finish: self._worker.send(
            conn.ep, pieces, tag, lambda status, _n, _tag: finish(status), keep))

    def _send_runs(self, conn: SendConn, runs: Sequence[Sequence[int]], tags: list[int], room_id: int,
                   room: SendRoom) -> None:
        """:meth:`_send` for one contiguous message per run, completing as one batch."""
        self._track(conn, room_id, room, lambda finish: self._worker.send_batch(
            conn.ep, runs, tags, lambda results: finish(next(
                (status for status, _ in results if status not in (UCS_OK, UCS_ERR_CANCELED)), UCS_OK)), None))

    def _track(self, conn: SendConn, room_id: int | None, room: SendRoom | None,
               post: Callable[[Callable[[int], None]], int]) -> None:
        """Post a send (or batch) through ``post(finish)``, keeping its token with the
        connection and room until ``finish(status)``; a failed send fails the room."""
        token_box: list[int] = []

        def finish(status: int) -> None:
            if token_box:
                conn.tokens.discard(token_box[0])
                if room is not None:
                    room.tokens.discard(token_box[0])
            if status not in (UCS_OK, UCS_ERR_CANCELED) and room_id is not None:
                self.rooms.fail(room_id, f"UCX send to peer {conn.desc.instance_id} failed (status {status})")

        try:
            token = post(finish)
        except UcxError as exc:
            raise PeerFailure(f"rdma peer {conn.desc.instance_id}: {exc}") from None
        token_box.append(token)
        conn.tokens.add(token)
        if room is not None:
            room.tokens.add(token)

    async def write(self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None) -> None:
        self._send_planned(peer, room, self._plan(room, ops, metadata), metadata)

    def prepare_write(
        self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None
    ) -> Callable[[], Awaitable[None]]:
        # Checking the ops against the regions and planning the data messages is numpy
        # work, slow right after a compute (cold caches); done here, while the
        # data is still being computed, the send is only the UCX calls. The WRITEs go
        # out now too (flagged WRITE_AHEAD): the receiver checks the grant and posts its
        # receives during the compute, so the data moves as soon as it is sent, as it
        # does into a receive posted in advance.
        plans = self._plan(room, ops, metadata)
        announced = self._announce(peer, room, plans)

        async def send() -> None:
            if announced is None:
                self._send_planned(peer, room, plans, metadata)
            else:
                self._send_announced(peer, room, announced, metadata)

        return send

    def _plan(self, room: int, ops: Sequence[WriteOp], metadata: WriteOp | None) -> list[Plan]:
        """Check ``ops`` (and ``metadata``) against the registered regions and plan the
        data messages; raises :class:`ConfigError` for an op outside its region."""
        self._ensure_started()
        # One row per op: src region, src offset, dst region, dst offset, length.
        try:
            # WriteOps carries its ops as one int64 array already: no per-op Python work.
            table = ops.array if isinstance(ops, WriteOps) else WriteOps.of(ops).array
        except OverflowError:
            raise ConfigError(f"rdma write for room {room}: an offset or length does not fit in 63 bits") from None
        self._check_sources(table)
        if metadata is not None:
            check_source_ops([metadata], self._infos)
        if metadata is not None and metadata.length > MAX_ROW:
            raise ConfigError(f"rdma: metadata row of {metadata.length} bytes exceeds the {MAX_ROW}-byte limit")
        return [p for i in range(0, len(table), MAX_OPS_PER_WRITE)
                if (p := plan_chunk(table[i : i + MAX_OPS_PER_WRITE], self._ptr_table, self._zc_min, self._iov_max,
                                    self._contiguous_min))]

    def _check_sources(self, table: np.ndarray) -> None:
        """:func:`check_source_ops` against the cached size table (no per-write table
        build); any op it refuses goes to the shared check, which names it."""
        src = table[:, 0]
        if len(table) and int(src.min()) >= 0 and int(src.max()) < len(self._size_table):
            size = self._size_table[src]
            if not ((size < 0) | (table[:, 1] < 0) | (table[:, 3] < 0) | (table[:, 4] <= 0)
                    | (table[:, 1] + table[:, 4] > size)).any():
                return
        check_source_ops(WriteOps(table), self._infos)

    def _room_on(self, peer: Peer, room: int, state: KVPoll) -> tuple[SendConn, SendRoom] | None:
        """The live connection to ``peer`` and ``room``'s send state on it, the room
        tracked (from ``state``); None when the room failed or is not writable now."""
        self.rooms.create(room, state)
        if state is KVPoll.TRANSFERRING:
            self.rooms.set(room, state)  # announced ahead (WAITING_FOR_INPUT) until now
        conn = self._send_conns.get(peer.instance_id)
        sroom = self._send_rooms.get(room)
        if conn is None or conn.dead:
            self.rooms.fail(room, f"no live connection to rdma peer {peer.instance_id} (connect again)")
            return None
        if sroom is None:
            sroom = self._send_rooms[room] = SendRoom(conn)
            conn.rooms.add(room)
        elif sroom.conn is not conn:
            self.rooms.fail(room, f"room {room} is already being written to another peer")
            return None
        if self.rooms.status(room).state.is_terminal:
            return None  # failed already (NACK, peer lost): nothing more is sent for it
        return conn, sroom

    def _announce(self, peer: Peer, room: int, plans: list[Plan]) -> "list[tuple[Plan, int]] | None":
        """Send ``plans``' WRITEs now, ahead of their data; returns each plan with its
        first data sequence number, or None to leave everything to the send (no live
        connection yet, or the room is already busy elsewhere: the send reports it)."""
        conn = self._send_conns.get(peer.instance_id)
        sroom = self._send_rooms.get(room)
        if not (plans and self._write_ahead) or conn is None or conn.dead or (sroom is not None and sroom.conn is not conn):
            return None
        got = self._room_on(peer, room, KVPoll.WAITING_FOR_INPUT)
        if got is None:  # failed already (a NACK, the peer lost): the send reports it
            return None
        conn, sroom = got
        try:
            return [(plan, self._send_write(conn, room, sroom, plan, WRITE_AHEAD)) for plan in plans]
        except PeerFailure as exc:
            self.rooms.fail(room, str(exc))
            return []

    def _send_planned(self, peer: Peer, room: int, plans: list[Plan], metadata: WriteOp | None) -> None:
        got = self._room_on(peer, room, KVPoll.TRANSFERRING)
        if got is None:
            return
        conn, sroom = got
        try:
            for plan in plans:
                self._send_data(conn, room, sroom, plan, self._send_write(conn, room, sroom, plan, 0))
            self._send_meta(conn, room, sroom, metadata)
        except PeerFailure as exc:
            self.rooms.fail(room, str(exc))

    def _send_announced(self, peer: Peer, room: int, announced: list[tuple[Plan, int]],
                        metadata: WriteOp | None) -> None:
        """The data of WRITEs sent ahead by :meth:`prepare_write`, then the row, on the
        connection that carried the WRITEs (a new one to the same peer has other ids)."""
        got = self._room_on(peer, room, KVPoll.TRANSFERRING)
        if got is None:
            return
        conn, sroom = got
        try:
            for plan, first in announced:
                self._send_data(conn, room, sroom, plan, first)
            self._send_meta(conn, room, sroom, metadata)
        except PeerFailure as exc:
            self.rooms.fail(room, str(exc))

    def _send_meta(self, conn: SendConn, room: int, sroom: SendRoom, metadata: WriteOp | None) -> None:
        if metadata is None:
            return
        src = self._regions[metadata.src_region]
        row = src.flat[metadata.src_offset : metadata.src_offset + metadata.length].numpy().tobytes()
        conn.ctrl_seq += 1
        msg = COMMON.pack(META, conn.remote_id, conn.ctrl_seq, conn.remote_key) + META_BODY.pack(
            room, sroom.kv_bytes, metadata.dst_region, metadata.dst_offset, metadata.length) + row
        self._send_ctrl(conn, msg, room, sroom)

    def _send_write(self, conn: SendConn, room: int, sroom: SendRoom, plan: Plan, flags: int) -> int:
        """Send ``plan``'s WRITE, counting its bytes as written before the room's row;
        returns the sequence number of its first data message."""
        conn.ctrl_seq += 1
        first = conn.data_seq
        conn.data_seq += len(plan.counts)
        msg = b"".join([
            COMMON.pack(WRITE, conn.remote_id, conn.ctrl_seq, conn.remote_key),
            WRITE_BODY.pack(room, first & 0xFFFFFFFF, len(plan.counts), plan.n_ops, flags),
            plan.table_bytes,
        ])
        self._send_ctrl(conn, msg, room, sroom)
        sroom.kv_bytes += plan.nbytes
        return first

    def _send_data(self, conn: SendConn, room: int, sroom: SendRoom, plan: Plan, first: int) -> None:
        """Send ``plan``'s data messages, numbered from ``first``."""
        if len(plan.counts) == plan.n_ops:
            # One op per message (runs of contiguous_min bytes and up): one batch of
            # plain (address, length) sends that completes as one.
            runs = plan.iov.tolist()
            self._send_runs(conn, runs, [data_tag(conn.remote_id, first + i) for i in range(len(runs))], room, sroom)
            return
        # Each message goes out as its iov rows, read in place by UCX: staging into a
        # contiguous buffer first would add a copy of every byte.
        k = 0
        for i, c in enumerate(plan.counts):
            self._send(conn, plan.iov[k : k + c], data_tag(conn.remote_id, first + i), room, sroom, plan.iov)
            k += c
