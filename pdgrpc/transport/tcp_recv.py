"""The receiver side of the ``tcp`` backend (a mixin of
:class:`~pdgrpc.transport.tcp.TcpTransport`): a data frame is authorized from its header
and op table by :class:`~pdgrpc.transport.receiver.Receiver` before its payload is read,
then the payload is scattered straight into the granted pages (device memory through
:mod:`~pdgrpc.transport.tcp_device`), or, for a metadata row, kept aside until the
room's pages are in."""

from __future__ import annotations

import functools

import numpy as np

from pdgrpc.errors import UnauthorizedWrite
from pdgrpc.transport.base import RoomGrant
from pdgrpc.transport.receiver import Receiver
from pdgrpc.transport.tcp_conn import ACK, HEADER, META, NACK, OP_DTYPE, WRITE, _Conn, _merge_adjacent
from pdgrpc.transport.tcp_device import TcpDevice


class TcpReceiver:
    """Receiver half of :class:`~pdgrpc.transport.tcp.TcpTransport` (which sets these)."""

    _recv: Receiver
    _views: dict[int, memoryview]
    _dev: TcpDevice

    def advertise(self, grant: RoomGrant) -> None:
        self._recv.advertise(grant)


    def _on_data_frame(self, conn: _Conn, ftype: int, room: int, table: bytearray, payload_len: int, aux: int) -> None:
        ops = np.frombuffer(table, dtype=OP_DTYPE)
        if (ops["offset"] > 2**62).any() or (ops["length"] > 2**62).any() or int(ops["length"].sum()) != payload_len:
            return conn.protocol_error("frame payload length does not match its op table")
        regions = ops["region"].astype(np.int64)
        offsets = ops["offset"].astype(np.int64)
        lengths = ops["length"].astype(np.int64)
        try:
            rr = self._recv.accept(room, conn.peer_id or "", regions, offsets, lengths, metadata=ftype == META)
        except UnauthorizedWrite as exc:
            conn.send_control(NACK, room, str(exc), int(exc.refusal))
            conn._expect_discard(payload_len, conn._expect_header)
            return
        conn.rooms.add(room)
        views = self._views
        if ftype == WRITE and self._dev.touches(regions):
            return self._dev.receive(conn, lambda: self._recv.get(room) is rr, *_merge_adjacent(regions, offsets, lengths),
                                     functools.partial(self._recv.landed, room, rr, payload_len))
        if ftype == WRITE:
            # every op was authorized above; adjacent ones are filled as one buffer
            regions, offsets, lengths = _merge_adjacent(regions, offsets, lengths)
            bufs = [views[r][o : o + n] for r, o, n in zip(regions.tolist(), offsets.tolist(), lengths.tolist())]
            ends = np.cumsum(lengths).tolist()

            def landed() -> None:
                self._recv.landed(room, rr, payload_len)
                conn._expect_header()

            conn.receive_payload(room, rr, bufs, landed, ends)
        else:
            r, o, n = int(regions[0]), int(offsets[0]), int(lengths[0])
            staged = bytearray(n)  # one small row, kept aside until the pages are in

            def commit() -> None:
                views[r][o : o + n] = staged

            def staged_in() -> None:
                ack = functools.partial(conn.send, [HEADER.pack(ACK, 0, room, 0, 0)])
                self._recv.stage_metadata(room, rr, aux, commit=commit, ack=ack)
                conn._expect_header()

            conn.receive_payload(room, rr, [memoryview(staged)], staged_in)

