"""The receiver side of the ``rdma`` backend: HELLOs, WRITE and META control
messages, posting receives straight into the granted bytes, ACK/NACK replies. The rules
(grant check, byte accounting, metadata last) are :mod:`pdgrpc.transport.receiver`'s.

Receiver-side authorization: a ``WRITE`` is checked op by op against the room's
:class:`~pdgrpc.transport.base.RoomGrant` *before* any receive is posted. Only then are
receives posted, with iov entries pointing into exactly the granted destination bytes.
If any op is not allowed the room fails with the reason, the sender is NACKed, and the
write's data messages are received into a small scratch buffer (so they do not pile up
in UCX's unexpected queue) and dropped: nothing lands in the pool.

Metadata last: the row is kept aside (in its control message) and copied into the slot
only once every data message of the room that the sender wrote before it has landed;
then the room is ``SUCCESS`` on the receiver and the ``ACK`` makes it ``SUCCESS`` on the
sender. Control messages are processed in per-connection sequence order.

Release: a released room's not-yet-matched receives are cancelled (and drained to
scratch), so a late write cannot land in pages reused by another request. A receive
that UCX already matched finishes into the pages it was authorized for (a network
transfer in flight cannot be recalled); the decode side reuses an aborted request's
pages only after the sender acknowledged the abort or its lease expired (DESIGN.md).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import logging
import struct
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch

from pdgrpc.device import call_when
from pdgrpc.errors import UnauthorizedWrite
from pdgrpc.transport.ucx import (
    FULL_MASK, UCS_ERR_CANCELED, UCS_ERR_MESSAGE_TRUNCATED, UCS_OK, Pieces, UcxError, UcxWorker,
)
from pdgrpc.transport.base import RegionInfo, RoomGrant
from pdgrpc.transport.peerauth import RoomWriters
from pdgrpc.transport.rdma_pack import Packer
from pdgrpc.transport.rdma_regions import Regions
from pdgrpc.transport.rdma_wire import (
    ACK, COMMON, CONN_BITS, DROPPED_MAX, EARLY_MAX, HELLO, HELLO_BODY, HELLO_CHANNEL, HELLO_OK, HELLO_OK_BODY,
    HELLO_REFUSED, KIND_DATA, KIND_MASK, KIND_REPLY, KIND_SHIFT, META, META_BODY, NACK, NACK_BODY, OP_DTYPE, ROOM_BODY,
    SCRATCH, SWEEP_MAX, WRITE, WRITE_AHEAD, WRITE_BODY, ctrl_tag, data_tag, new_id, new_key,
)
from pdgrpc.transport.receiver import ReceiveRoom, Receiver, Refusal
from pdgrpc.transport.rooms import RoomStates

log = logging.getLogger("pdgrpc.transport.rdma")

# How long receives of a dead writer's dropped connection may stay UCX's before they are
# abandoned (RdmaReceiver.holds_nothing_of): many progress rounds, well inside the 2 s in
# which a decode frees a dead prefill's room.
DEAD_WRITER_DRAIN_S = 0.2


class ProvenLink(Protocol):
    """A liveness link on which a peer proved its identity."""

    @property
    def nonce(self) -> bytes: ...


class RecvLiveness(Protocol):
    """What the receiver needs of the liveness channel (:class:`~pdgrpc.transport.liveness.Liveness`)."""

    def proven_link(self, peer_instance_id: str, info: bytes) -> ProvenLink | None: ...


class RecvConn:
    """Receiver side of one connection (from one sender instance)."""

    def __init__(self, conn_id: int, sender_id: str, sender_local: int, reply_key: int, ep: Any) -> None:
        self.conn_id = conn_id
        self.key = new_key()  # sent in HELLO_OK; every WRITE / META must carry it
        self.sender_id = sender_id
        self.sender_local = sender_local  # the sender's id for this connection (in replies)
        self.reply_key = reply_key  # the sender's key (its HELLO), in every reply
        self.ep = ep
        self.next_seq = 1
        self.early: dict[int, bytes] = {}  # control messages that arrived out of order
        self.early_dropped = False  # one warning per connection
        self.rooms: set[int] = set()
        self.tokens: set[int] = set()
        self.dropped_at = 0.0  # time.monotonic() when this side dropped it (a draining conn's)


class RecvRoom:
    """What rdma keeps per open room besides the receiver core's state."""

    def __init__(self, core: ReceiveRoom) -> None:
        self.core = core
        self.pending: dict[int, int] = {}  # conn id -> data receives outstanding
        self.tokens: set[int] = set()
        self.nacked = False
        self.released = False


class RdmaReceiver:
    """Accepts writes from senders over UCX into advertised rooms; owns this instance's
    incoming connections."""

    def __init__(self, worker: UcxWorker, rooms: RoomStates, regions: Regions, liveness: RecvLiveness, *,
                 instance_id: str, verify_proof: Callable[[bytes, bytes, str, bytes], bool],
                 room_writers: RoomWriters, packer: Packer) -> None:
        self._worker = worker
        self._rooms = rooms
        self._by_region = regions.by_id
        self._ptr_table = regions.ptrs
        self._liveness = liveness
        self._instance_id = instance_id
        self._verify_proof = verify_proof
        self._packer = packer
        self._recv = Receiver(rooms, room_writers)
        self._recv_conns: dict[int, RecvConn] = {}
        self._recv_rooms: dict[int, RecvRoom] = {}
        self._draining: list[RecvConn] = []  # dropped connections whose receives have not all completed
        self._untrack: dict[int, Callable[[], None]] = {}  # data receive token -> its bookkeeping's undo
        self._dropped: collections.OrderedDict[int, int] = collections.OrderedDict()  # conn id -> key (bounded)
        self._scratch = torch.empty(SCRATCH, dtype=torch.uint8)

    @property
    def connections(self) -> list[RecvConn]:
        """The live connections (a diagnostic)."""
        return list(self._recv_conns.values())

    def receives_posted(self, room: int) -> int:
        """Data receives posted for ``room`` that have not completed."""
        rr = self._recv_rooms.get(room)
        return 0 if rr is None else sum(rr.pending.values())

    def add_region(self, info: RegionInfo) -> None:
        self._recv.add_region(info)

    def advertise(self, grant: RoomGrant) -> None:
        self._recv_rooms[grant.room] = RecvRoom(self._recv.advertise(grant))

    def release(self, room: int) -> None:
        """Forget ``room``: its receives not yet matched are cancelled and each sender
        still writing it is told (NACK), so nothing more lands in its pages."""
        rr = self._recv_rooms.pop(room, None)
        self._recv.release(room)
        if rr is None:
            return
        rr.released = True
        if rr.tokens:
            # Not-yet-matched receives are cancelled (their callbacks then see
            # UCS_ERR_CANCELED), so a late write can never land in pages that now
            # belong to someone else; the sender learns at once that it can stop.
            for token in list(rr.tokens):
                self._worker.cancel(token)
            open_room = room in self._rooms and not self._rooms.status(room).state.is_terminal
            why = self._rooms.release_reason(room)
            for conn_id in rr.pending:
                conn = self._recv_conns.get(conn_id)
                if conn is not None and open_room:
                    self._nack(conn, room, f"room {room} was released by the receiver" + (f": {why}" if why else ""),
                               Refusal.UNKNOWN_ROOM)

    def _reply(self, conn: RecvConn, typ: int, body: bytes) -> None:
        msg = COMMON.pack(typ, conn.sender_local, 0, conn.reply_key) + body
        buf = ctypes.create_string_buffer(msg, len(msg))
        token_box: list[int] = []

        def done(status: int, length: int, tag: int) -> None:
            if token_box:
                conn.tokens.discard(token_box[0])

        try:
            token_box.append(self._worker.send(conn.ep, [(ctypes.addressof(buf), len(msg))], ctrl_tag(KIND_REPLY), done, buf))
            conn.tokens.add(token_box[0])
        except UcxError as exc:
            log.warning("rdma: reply to sender %s failed: %s", conn.sender_id, exc)

    def _nack(self, conn: RecvConn | None, room: int, reason: str, refusal: Refusal | None = None) -> None:
        rr = self._recv_rooms.get(room)
        if rr is not None:
            if rr.nacked:
                return
            rr.nacked = True
        if conn is not None:
            self._reply(conn, NACK, NACK_BODY.pack(room, int(refusal or 0)) + reason.encode()[:4096])

    def on_ctrl(self, msg: bytes) -> None:
        """A control message from a sender (HELLO, WRITE, META)."""
        typ, conn_id, seq, key = COMMON.unpack_from(msg)
        if typ == HELLO:
            self._on_hello(conn_id, key, msg[COMMON.size :])
            return
        conn = self._recv_conns.get(conn_id)
        if conn is None or key != conn.key:
            # A dropped connection (its peer was failed): drain its payload so it cannot
            # linger, answer nothing. Anything else (an unknown id, a wrong key: a
            # forger guessing) is dropped without a trace.
            if conn is None and typ == WRITE and self._dropped.get(conn_id) == key:
                self._drain_write(conn_id, msg)
            return
        if seq != conn.next_seq:
            # Messages can overtake one another (eager vs rendezvous); keep those from
            # the near future, a bounded number: anything beyond is not a live sender's.
            if conn.next_seq < seq <= conn.next_seq + EARLY_MAX and len(conn.early) < EARLY_MAX:
                conn.early[seq] = msg
            elif seq > conn.next_seq and not conn.early_dropped:
                conn.early_dropped = True
                log.warning("rdma: connection %d from %s: control message %d dropped (more than %d ahead of %d)",
                            conn.conn_id, conn.sender_id, seq, EARLY_MAX, conn.next_seq)
            return
        while True:
            conn.next_seq += 1
            if typ == WRITE:
                self._on_write(conn, msg)
            elif typ == META:
                self._on_meta(conn, msg)
            nxt = conn.early.pop(conn.next_seq, None)
            if nxt is None or conn.conn_id not in self._recv_conns:
                return
            msg = nxt
            typ = msg[0]

    def _on_hello(self, sender_local: int, reply_key: int, body: bytes) -> None:
        ns, nt, na = HELLO_BODY.unpack_from(body)
        off = HELLO_BODY.size
        sender_id = body[off : off + ns].decode()
        target = body[off + ns : off + ns + nt].decode()
        addr = body[off + ns + nt : off + ns + nt + na]
        proof = body[off + ns + nt + na :]
        link = self._liveness.proven_link(sender_id, addr)
        if link is None:
            # Only a sender whose proven liveness link is up, announcing this same worker
            # address, gets an endpoint (and a reply); anything else is dropped.
            log.warning("rdma: HELLO from %s ignored: no proven liveness link announcing its worker address", sender_id)
            return
        if not self._verify_proof(HELLO_CHANNEL, link.nonce, sender_id, proof):
            log.warning("rdma: HELLO from %s ignored: its proof of identity does not verify", sender_id)
            return
        try:
            ep = self._worker.endpoint(addr)
        except UcxError as exc:
            log.warning("rdma: cannot answer HELLO from %s: %s", sender_id, exc)
            return
        conn_id = new_id(CONN_BITS, self._recv_conns.keys() | self._dropped.keys())
        conn = RecvConn(conn_id, sender_id, sender_local, reply_key, ep)
        if target != self._instance_id:
            self._reply(conn, HELLO_REFUSED, f"this is instance {self._instance_id}, not {target}".encode())
            self._worker.drop_endpoint(ep)  # the reply is flushed by the bounded close
            return
        self._recv_conns[conn_id] = conn
        rid = self._instance_id.encode()
        self._reply(conn, HELLO_OK, HELLO_OK_BODY.pack(conn_id, len(rid), conn.key) + rid)

    @staticmethod
    def _parse_write(msg: bytes) -> tuple[int, int, list[int], np.ndarray, int]:
        """(room, first data seq, ops per data message, op table, flags) of a WRITE."""
        room, first, n_msgs, n_ops, flags = WRITE_BODY.unpack_from(msg, COMMON.size)
        off = COMMON.size + WRITE_BODY.size
        if n_msgs > n_ops or len(msg) < off + 4 * n_msgs + OP_DTYPE.itemsize * n_ops:
            raise ValueError("WRITE is shorter than its op table")
        counts = np.frombuffer(msg, dtype="<u4", count=n_msgs, offset=off).tolist()
        off += 4 * n_msgs
        if sum(counts) != n_ops or (n_msgs and min(counts) == 0):
            raise ValueError("WRITE op table does not match its counts")
        ops = np.frombuffer(msg, dtype=OP_DTYPE, count=n_ops, offset=off)
        return room, first, counts, ops, flags

    def _drain(self, conn_id: int, tag_or_seq: int) -> None:
        """Receive (and drop) one data message into scratch: keeps UCX's unexpected
        queue from filling with payload nobody will take; the pool is never touched."""
        def done(status: int, length: int, tag: int) -> None:
            pass

        with contextlib.suppress(UcxError):
            tag = tag_or_seq if tag_or_seq >> KIND_SHIFT == KIND_DATA else data_tag(conn_id, tag_or_seq)
            self._worker.recv([(self._scratch.data_ptr(), SCRATCH)], tag, FULL_MASK, done, self._scratch)

    def sweep(self) -> int:
        """Receive into scratch (and drop) what sits in UCX's unexpected queue for nobody:
        messages of a kind this protocol does not use, and data messages of no
        connection, live or recently dropped. Anything that reaches the worker's address
        can send such messages, and UCX keeps each one (up to its eager size) until a
        receive takes it. A data message of a live connection may be waiting for its
        WRITE; the sweep stops at the first one and tries again next time. Returns how
        many were dropped."""
        def done(status: int, length: int, tag: int) -> None:
            pass

        known = self._recv_conns.keys() | self._dropped.keys()
        dropped = 0
        for kind in (0, *range(KIND_DATA + 1, 16), KIND_DATA):
            while dropped < SWEEP_MAX and (tag := self._worker.probe(kind << KIND_SHIFT, KIND_MASK)) is not None:
                if kind == KIND_DATA and (tag >> 32) & ((1 << CONN_BITS) - 1) in known:
                    break
                try:
                    self._worker.recv([(self._scratch.data_ptr(), SCRATCH)], tag, FULL_MASK, done, self._scratch)
                except UcxError:
                    return dropped
                dropped += 1
        return dropped

    def _drain_write(self, conn_id: int, msg: bytes) -> None:
        with contextlib.suppress(struct.error, ValueError):
            _room, first, counts, _ops, _flags = self._parse_write(msg)
            for i in range(len(counts)):
                self._drain(conn_id, first + i)

    def _on_write(self, conn: RecvConn, msg: bytes) -> None:
        room, first, counts, ops, flags = self._parse_write(msg)
        try:
            # Announced ahead (WRITE_AHEAD): the receives go up now, during the sender's
            # compute; the room turns TRANSFERRING with the data: when the row, sent right
            # behind the data, arrives, or when bytes land, whichever comes first.
            self._recv.accept(room, conn.sender_id, ops["region"], ops["offset"], ops["length"],
                              start=not flags & WRITE_AHEAD)
        except UnauthorizedWrite as exc:
            for i in range(len(counts)):
                self._drain(conn.conn_id, first + i)
            self._nack(conn, room, str(exc), exc.refusal)
            return
        rr = self._recv_rooms[room]
        conn.rooms.add(room)
        # iov rows {destination address, length}: every byte goes straight into the
        # granted pages, which the receiver core has just authorized.
        iov = np.empty((len(ops), 2), dtype=np.uint64)
        iov[:, 0] = self._ptr_table[ops["region"].astype(np.int64)] + ops["offset"]
        iov[:, 1] = ops["length"]
        if len(counts) == len(ops):
            # One op per message (runs of contiguous_min bytes and up): one batch of
            # plain (address, length) receives that completes as one.
            runs = iov.tolist()
            self._post_runs(conn, room, rr, runs, [data_tag(conn.conn_id, first + i) for i in range(len(runs))])
            return
        per_msg = np.asarray(counts, dtype=np.int64)
        sizes = np.add.reduceat(iov[:, 1], np.cumsum(per_msg) - per_msg).tolist()
        k = 0
        for i, c in enumerate(counts):
            tag = data_tag(conn.conn_id, first + i)
            dst = ops[k : k + c]
            buf = self._packer.receive_buffer(dst["region"], sizes[i]) if self._packer.wants(dst["region"]) else None
            if buf is None:
                self._post_data(conn, room, rr, iov[k : k + c], sizes[i], tag, iov)
            else:
                regions, offsets, lengths = (dst[f].astype(np.int64) for f in ("region", "offset", "length"))
                self._post_packed(conn, room, rr, buf, regions, offsets, lengths, tag)
            k += c

    def _post_data(self, conn: RecvConn, room: int, rr: RecvRoom, pieces: Pieces, nbytes: int,
                   tag: int, keep: Any) -> None:
        def post(untrack: Callable[[], None]) -> int:
            def done(status: int, length: int, _tag: int) -> None:
                untrack()
                if landed := self._arrived(conn, room, rr, status, length, nbytes, tag):
                    self._recv.landed(room, rr.core, landed)

            return self._worker.recv(pieces, tag, FULL_MASK, done, keep)

        self._track_receives(conn, room, rr, 1, post)

    def _post_packed(self, conn: RecvConn, room: int, rr: RecvRoom, buf: torch.Tensor, regions: np.ndarray,
                     offsets: np.ndarray, lengths: np.ndarray, tag: int) -> None:
        """Receive one packed message (rdma_pack) into ``buf``, then scatter it into the
        granted ranges; its bytes land once the scatter finished."""
        nbytes = buf.numel()
        given = False

        def give_back() -> None:  # once: the scatter finished, or the receive ended or was abandoned
            nonlocal given
            if not given:
                given = True
                self._packer.give_back(nbytes)

        def post(untrack: Callable[[], None]) -> int:
            def done(status: int, length: int, _tag: int) -> None:
                untrack()
                landed = self._arrived(conn, room, rr, status, length, nbytes, tag)
                if not landed or rr.released:  # nothing arrived, or the pages are no longer this room's
                    give_back()
                    return

                def scattered() -> None:
                    give_back()
                    if not rr.released:
                        self._recv.landed(room, rr.core, landed)

                call_when(self._packer.scatter(buf, regions, offsets, lengths).done, scattered)

            return self._worker.recv([(buf.data_ptr(), nbytes)], tag, FULL_MASK, done, buf)

        token = self._track_receives(conn, room, rr, 1, post)
        if token is None:
            give_back()
        elif (undo := self._untrack.get(token)) is not None:
            def undo_and_give_back() -> None:  # abandoned (_abandon): no completion comes
                undo()
                give_back()

            self._untrack[token] = undo_and_give_back

    def _post_runs(self, conn: RecvConn, room: int, rr: RecvRoom, runs: Sequence[Sequence[int]],
                   tags: list[int]) -> None:
        """Receive one contiguous message per run, as one batch (:meth:`_post_data`'s
        rules, with one completion for all of them)."""
        def post(untrack: Callable[[], None]) -> int:
            def done(results: list[tuple[int, int]]) -> None:
                untrack()
                total = 0
                for (_addr, nbytes), tag, (status, length) in zip(runs, tags, results):
                    landed = self._arrived(conn, room, rr, status, length, nbytes, tag)
                    if landed is None:
                        return
                    total += landed
                if total:
                    self._recv.landed(room, rr.core, total)

            return self._worker.recv_batch(runs, tags, done, None)

        self._track_receives(conn, room, rr, len(runs), post)

    def _track_receives(self, conn: RecvConn, room: int, rr: RecvRoom, count: int,
                        post: Callable[[Callable[[], None]], int]) -> int | None:
        """Post ``count`` data receives through ``post(untrack)``, keeping their token with
        the connection and room until the completion calls ``untrack()``; returns the
        token, or None when UCX refused the receive, which fails the room."""
        token_box: list[int] = []

        def untrack() -> None:
            self._untrack.pop(token_box[0], None)
            conn.tokens.discard(token_box[0])
            rr.tokens.discard(token_box[0])
            rr.pending[conn.conn_id] -= count

        rr.pending[conn.conn_id] = rr.pending.get(conn.conn_id, 0) + count
        try:
            token = post(untrack)
        except UcxError as exc:
            rr.pending[conn.conn_id] -= count
            self._rooms.fail(room, f"cannot post a UCX receive for room {room}: {exc}")
            return None
        token_box.append(token)
        self._untrack[token] = untrack
        conn.tokens.add(token)
        rr.tokens.add(token)
        return token

    def _arrived(self, conn: RecvConn, room: int, rr: RecvRoom, status: int, length: int, nbytes: int,
                 tag: int) -> int | None:
        """One data message's outcome: the bytes that landed; 0 for a cancelled one (the
        sender's message still comes, so a released room's is drained); None when it
        did not arrive intact, which fails the room and NACKs the sender."""
        if status == UCS_OK and length == nbytes:
            return nbytes
        if status == UCS_ERR_CANCELED:
            if rr.released and conn.conn_id in self._recv_conns:
                self._drain(conn.conn_id, tag)
            return 0
        why = "truncated" if status == UCS_ERR_MESSAGE_TRUNCATED else f"UCX status {status}"
        reason = f"payload for room {room} did not arrive intact ({why}, {length}/{nbytes} bytes)"
        self._rooms.fail(room, reason)
        self._nack(conn, room, reason)
        return None

    def _on_meta(self, conn: RecvConn, msg: bytes) -> None:
        room, kv_bytes, region_id, offset, length = META_BODY.unpack_from(msg, COMMON.size)
        row = msg[COMMON.size + META_BODY.size :]
        try:
            core = self._recv.accept(room, conn.sender_id, [region_id], [offset], [length], metadata=True)
            if len(row) != length:
                raise self._recv.refuse(room, Refusal.MALFORMED, f"metadata row of {len(row)} bytes announced as {length}")
        except UnauthorizedWrite as exc:
            self._nack(conn, room, str(exc), exc.refusal)
            return
        conn.rooms.add(room)
        region = self._by_region[region_id]  # [offset, offset + length) authorized above

        def commit() -> None:  # every page the sender wrote before the row has landed: now the row
            if region.info.memory == "host":
                ctypes.memmove(region.ptr + offset, row, len(row))
            else:  # device memory: a pointer the CPU must not write through
                region.flat[offset : offset + len(row)].copy_(torch.frombuffer(bytearray(row), dtype=torch.uint8))

        self._recv.stage_metadata(room, core, kv_bytes, commit=commit,
                                  ack=functools.partial(self._ack, conn.conn_id, room))

    def _ack(self, conn_id: int, room: int) -> None:
        conn = self._recv_conns.get(conn_id)
        if conn is not None:  # not lost meanwhile (its endpoint would be gone)
            self._reply(conn, ACK, ROOM_BODY.pack(room))

    def drop_peer(self, instance_id: str, reason: str) -> None:
        """Fail the rooms ``instance_id`` writes here and drop its connections."""
        for conn in [c for c in self._recv_conns.values() if c.sender_id == instance_id]:
            self._drop(conn, reason)

    def _drop(self, conn: RecvConn, reason: str, *, peer_lost: bool = True) -> None:
        self._recv_conns.pop(conn.conn_id, None)
        self._dropped[conn.conn_id] = conn.key
        while len(self._dropped) > DROPPED_MAX:
            self._dropped.popitem(last=False)
        for room in list(conn.rooms):
            self._rooms.fail(room, reason, peer_lost=peer_lost)
        for token in list(conn.tokens):
            self._worker.cancel(token)  # tag receives: UCX cancels these for real
        self._worker.drop_endpoint(conn.ep, force=peer_lost)
        conn.ep = None
        conn.dropped_at = time.monotonic()
        self._draining = [c for c in self._draining if c.tokens] + ([conn] if conn.tokens else [])

    def holds_nothing_of(self, writer_id: str, now: float) -> bool:
        """Asked once ``writer_id`` is gone (every proven link ended from its side: its
        process exited): no connection from it is up and no receive posted for it is
        still UCX's, so nothing of it can still land.

        A receive its connection's drop did not end within :data:`DEAD_WRITER_DRAIN_S` is
        abandoned. With error handling off, UCX does not cancel a receive already matched
        to a message whose sender died in the middle of it, and keeps it for good; what
        would complete it can only come from the dead sender, while whatever the sender
        had already handed over (shared-memory queues, socket buffers) lands in the
        progress rounds of that wait."""
        if any(c.sender_id == writer_id for c in self._recv_conns.values()):
            return False
        for conn in self._draining:
            if conn.sender_id == writer_id and now - conn.dropped_at >= DEAD_WRITER_DRAIN_S:
                self._abandon(conn, now - conn.dropped_at)
        self._draining = [c for c in self._draining if c.tokens]
        return not any(c.sender_id == writer_id for c in self._draining)

    def _abandon(self, conn: RecvConn, age: float) -> None:
        """Stop waiting for what UCX still holds of the dropped ``conn`` (see
        :meth:`holds_nothing_of`); each data receive's bookkeeping is undone as its
        completion would have."""
        if not conn.tokens:
            return
        log.warning("rdma: abandoning %d receive(s) of dead writer %s that UCX kept %.1f s after its connection "
                    "was dropped (matched to messages it died sending)", len(conn.tokens), conn.sender_id, age)
        for token in list(conn.tokens):
            self._worker.abandon(token)
            if (undo := self._untrack.get(token)) is not None:
                undo()
        conn.tokens.clear()

    def close(self, reason: str) -> None:
        """Drop every connection (flushed: the peers are fine)."""
        for conn in list(self._recv_conns.values()):
            self._drop(conn, reason, peer_lost=False)

    def clear(self) -> None:
        """Forget every room (once the worker is closed: no completion comes any more)."""
        self._recv_rooms.clear()
        self._untrack.clear()
        self._recv.clear()
