"""The receiving side of the ``tcp`` backend: the connections peers opened to this
transport. Each must prove its writer's identity in its HELLO before anything else; then
a data frame is authorized from its header and op table by
:class:`~pdgrpc.transport.receiver.Receiver` before its payload is read, and the payload
is scattered straight into the granted pages (device memory through
:mod:`~pdgrpc.transport.tcp_device`), or, for a metadata row, kept aside until the room's
pages are in."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from typing import Callable, Iterable, Mapping

import numpy as np

from pdgrpc.errors import UnauthorizedWrite
from pdgrpc.transport import peerauth
from pdgrpc.transport.receiver import Receiver, Refusal, RoomGrant
from pdgrpc.transport.regions import RegionInfo
from pdgrpc.transport.rooms import RoomStates
from pdgrpc.transport.tcp_conn import Conn
from pdgrpc.transport.tcp_device import TcpDevice
from pdgrpc.transport.tcp_limits import AcceptGate
from pdgrpc.transport.tcp_wire import ACK, CHALLENGE, HEADER, HELLO_OK, HELLO_REFUSED, META, NACK, OP_DTYPE, WRITE, merge_adjacent

__all__ = ["TcpReceiver"]

log = logging.getLogger("pdgrpc.transport.tcp")

VerifyProof = Callable[[bytes, bytes, str, bytes], bool]


class TcpReceiver:
    """Accepted connections of one ``tcp`` transport and the rooms written through them.

    ``views`` are the host regions' bytes and ``device`` stages the device regions (both
    filled as regions are registered); ``gate`` counts accepted connections; ``writers``
    tracks proven connections per writer and ``room_writers`` whom each room admits; ``verify_proof`` checks a HELLO's proof of
    identity for this instance ``instance_id``."""

    def __init__(self, rooms: RoomStates, views: Mapping[int, memoryview], device: TcpDevice, gate: AcceptGate,
                 writers: peerauth.WriterTable, room_writers: peerauth.RoomWriters, instance_id: str,
                 verify_proof: VerifyProof, name: str) -> None:
        self._rooms = rooms
        self._core = Receiver(rooms, room_writers)
        self._lookup = self._core.get
        self._views = views
        self._device = device
        self._gate = gate
        self._writers = writers
        self._instance_id = instance_id
        self._verify_proof = verify_proof
        self._name = name
        self.connections: set[Conn] = set()

    # -- set-up ------------------------------------------------------------------------
    def add_region(self, info: RegionInfo) -> None:
        self._core.add_region(info)

    def region_infos(self) -> Iterable[RegionInfo]:
        return self._core.regions.infos.values()

    def accepted(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, address: str) -> None:
        """A connection the listener accepted (admitted by the gate, socket tuned): it
        gets a CHALLENGE, which its HELLO must answer."""
        conn = Conn(sock, loop, self, remote=address)
        self.connections.add(conn)
        for old, limit in self._gate.admit(conn, address):
            log.warning("tcp: closing a connection from %s that has not proven who it is: a new one takes its place (%s)",
                        address or "a local peer", limit)
            old.close()
        conn.nonce = peerauth.new_nonce()
        conn.send([HEADER.pack(CHALLENGE, 0, 0, len(conn.nonce), 0), conn.nonce])

    # -- rooms ---------------------------------------------------------------------------
    def advertise(self, grant: RoomGrant) -> None:
        self._core.advertise(grant)

    def release(self, room: int) -> None:
        if self._core.release(room) is not None:
            for conn in self.connections:
                conn.rooms.discard(room)

    def fail_peer(self, instance_id: str, reason: str) -> None:
        """Close the writer ``instance_id``'s connections and fail the rooms it wrote to."""
        for conn in [c for c in self.connections if c.peer_id == instance_id]:
            conn.close()
            self.connections.discard(conn)
        self._rooms.fail_all(reason, self._core.rooms_of(instance_id), peer_lost=True)

    def close(self) -> None:
        for conn in list(self.connections):
            conn.close()
        self.connections.clear()
        self._core.clear()

    # -- frames (ConnEvents) ---------------------------------------------------------------
    def hello(self, conn: Conn, text: str) -> None:
        """``"<sender id> <this id> <proof hex>"``: the connection takes the sender's
        identity only if the proof answers its CHALLENGE with the credential this
        receiver issued to that sender (:mod:`pdgrpc.transport.peerauth`) and the sender
        is under ``max_connections_per_peer``. Otherwise HELLO_REFUSED (naming why) and
        close: nothing else changes."""
        if conn.peer_id is not None:
            return conn.protocol_error("unexpected HELLO")
        sender, expected, answer = (text.split(" ") + ["", ""])[:3]
        if expected != self._instance_id or not sender:
            return _refuse(conn, f"this is instance {self._instance_id}, not {expected!r}")
        try:
            proof = bytes.fromhex(answer)
        except ValueError:
            proof = b""
        if not self._verify_proof(b"tcp", conn.nonce, sender, proof):
            log.warning("tcp: refusing a connection from %s claiming to be %s: its proof of identity does not verify",
                        conn.remote or "a local peer", sender)
            return _refuse(conn, f"the proof of identity for {sender!r} does not verify (no credential from "
                                 "this receiver's control plane)")
        refusal = self._gate.prove(conn, sender)
        if refusal is not None:
            log.warning("tcp: refusing a connection from %s: %s", sender, refusal)
            return _refuse(conn, refusal)
        conn.peer_id = sender
        self._writers.opened(sender)
        conn.send([HEADER.pack(HELLO_OK, 0, 0, 0, 0)])

    def data_frame(self, conn: Conn, ftype: int, room: int, table: bytearray, payload_len: int, aux: int) -> None:
        ops = np.frombuffer(table, dtype=OP_DTYPE)
        if (ops["offset"] > 2**62).any() or (ops["length"] > 2**62).any() or int(ops["length"].sum()) != payload_len:
            return conn.protocol_error("frame payload length does not match its op table")
        regions = ops["region"].astype(np.int64)
        offsets = ops["offset"].astype(np.int64)
        lengths = ops["length"].astype(np.int64)
        core = self._core
        try:
            rr = core.accept(room, conn.peer_id or "", regions, offsets, lengths, metadata=ftype == META)
        except UnauthorizedWrite as exc:
            conn.send_control(NACK, room, str(exc), int(exc.refusal))
            conn.discard(payload_len, conn.next_frame)
            return
        conn.rooms.add(room)
        views = self._views
        if ftype == WRITE and self._device.touches(regions):
            return self._device.receive(conn, lambda: core.get(room) is rr, *merge_adjacent(regions, offsets, lengths),
                                        functools.partial(core.landed, room, rr, payload_len))
        if ftype == WRITE:
            # every op was authorized above; adjacent ones are filled as one buffer
            regions, offsets, lengths = merge_adjacent(regions, offsets, lengths)
            bufs = [views[r][o : o + n] for r, o, n in zip(regions.tolist(), offsets.tolist(), lengths.tolist())]
            ends = np.cumsum(lengths).tolist()

            def landed() -> None:
                core.landed(room, rr, payload_len)
                conn.next_frame()

            conn.receive_payload(bufs, landed, ends, room=room, ref=rr, lookup=self._lookup)
        else:
            r, o, n = int(regions[0]), int(offsets[0]), int(lengths[0])
            staged = bytearray(n)  # one small row, kept aside until the pages are in

            def commit() -> None:
                views[r][o : o + n] = staged

            def staged_in() -> None:
                ack = functools.partial(conn.send, [HEADER.pack(ACK, 0, room, 0, 0)])
                core.stage_metadata(room, rr, aux, commit=commit, ack=ack)
                conn.next_frame()

            conn.receive_payload([memoryview(staged)], staged_in, [n], room=room, ref=rr, lookup=self._lookup)

    def ack(self, conn: Conn, room: int) -> None:
        conn.protocol_error("ACK on a connection to the receiver")

    def nack(self, conn: Conn, room: int, reason: str, refusal: Refusal | None) -> None:
        conn.protocol_error("NACK on a connection to the receiver")

    def closed(self, conn: Conn, by_peer: bool) -> None:
        self._gate.release(conn, conn.peer_id)
        self.connections.discard(conn)
        if conn.peer_id is not None:
            self._writers.closed(conn.peer_id, by_peer=by_peer)

    def lost(self, conn: Conn, reason: str) -> None:
        # Only a proven connection has rooms or a peer (peer_id is set after the proof).
        # Its loss fails the rooms written through it; once the writer has no proven
        # connection left and ended them itself, it is gone: all its rooms fail.
        peer = conn.peer_id
        rooms = [r for r in conn.rooms if self._core.get(r) is not None]
        if peer is not None and self._writers.gone(peer):
            rooms += self._core.rooms_of(peer)
        self._rooms.fail_all(f"{self._name} connection from {peer} lost: {reason}", rooms, peer_lost=True)


def _refuse(conn: Conn, reason: str) -> None:
    conn.send_control(HELLO_REFUSED, 0, reason)
    conn.loop.call_soon(conn.close)
