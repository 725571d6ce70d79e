"""The sender side of the ``rdma`` backend: connections to receivers (liveness first,
then a HELLO proving this instance's credential), checking a write's ops, planning its
data messages (:func:`~pdgrpc.transport.rdma_wire.plan_chunk`) and posting them, then
the metadata row; the receiver's ACK / NACK settle the room."""

from __future__ import annotations

import asyncio
import ctypes
import secrets
import time
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from pdgrpc.device import call_when
from pdgrpc.errors import ConfigError, PeerFailure
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport import peerauth
from pdgrpc.transport.ucx import UCS_ERR_CANCELED, UCS_OK, Pieces, UcxError, UcxWorker
from pdgrpc.transport.base import BadDescriptor, Descriptor, Peer, WriteOp, WriteOps, check_source_ops
from pdgrpc.transport.rdma_pack import Packer
from pdgrpc.transport.rdma_regions import Regions
from pdgrpc.transport.rdma_wire import (
    ACK, COMMON, HELLO, HELLO_BODY, HELLO_CHANNEL, HELLO_OK, HELLO_OK_BODY, HELLO_REFUSED, KIND_CTRL,
    MAX_OPS_PER_WRITE, MAX_ROW, META, META_BODY, NACK, NACK_BODY, ROOM_BODY, WRITE, WRITE_AHEAD, WRITE_BODY, Plan,
    ctrl_tag, data_tag, new_id, new_key, plan_chunk,
)
from pdgrpc.transport.receiver import Refusal
from pdgrpc.transport.rooms import RoomStates


class SendLiveness(Protocol):
    """What the sender needs of the liveness channel (:class:`~pdgrpc.transport.liveness.Liveness`)."""

    async def watch(self, peer_instance_id: str, address: str) -> bytes | None: ...

    def unwatch(self, peer_instance_id: str) -> None: ...

    def challenge_of(self, peer_instance_id: str) -> bytes: ...


class SendConn:
    """Sender side of one connection (to one receiver instance)."""

    def __init__(self, local_id: int, desc: Descriptor, ep: Any) -> None:
        self.local_id = local_id
        self.desc = desc
        self.ep = ep
        self.reply_key = new_key()  # sent in HELLO; every reply must carry it
        self.remote_id = 0  # assigned by the receiver's HELLO_OK
        self.remote_key = 0  # the receiver's key for this connection (HELLO_OK), in every WRITE / META
        self.ctrl_seq = 0
        # Data messages carry no key; their tags are DATA | conn | seq. Starting the
        # sequence at a random number leaves a forger that learned the (random)
        # connection id still 32 bits to guess.
        self.data_seq = secrets.randbits(32)
        self.hello: asyncio.Future[tuple[bool, int, int, str]] | None = None  # ok, remote id, remote key, why not
        self.rooms: set[int] = set()
        self.tokens: set[int] = set()
        self.packed: dict[int, int] = {}  # token of a packed send -> its buffer's bytes
        self.dead = False


class SendRoom:
    """A room being written, on the one connection that carries it."""

    def __init__(self, conn: SendConn) -> None:
        self.conn = conn
        self.kv_bytes = 0
        self.tokens: set[int] = set()
        self.packing = 0  # packed messages whose gather has not finished (not posted yet)


class RdmaSender:
    """Writes rooms to receivers over UCX; owns this instance's outgoing connections.

    ``fail_peer`` is the transport's: a peer found restarted fails on both sides."""

    def __init__(self, worker: UcxWorker, rooms: RoomStates, regions: Regions, liveness: SendLiveness, *,
                 instance_id: str, require_credential: Callable[[str], bytes],
                 fail_peer: Callable[[str, str], None], zero_copy_min: int, contiguous_min: int | None,
                 iov_max: int, connect_timeout: float, write_ahead: bool, packer: Packer) -> None:
        self._worker = worker
        self._rooms = rooms
        self._by_region = regions.by_id
        self._infos = regions.infos
        self._ptr_table = regions.ptrs
        self._size_table = regions.sizes
        self._liveness = liveness
        self._instance_id = instance_id
        self._require_credential = require_credential
        self._fail_peer = fail_peer
        self._zc_min = zero_copy_min
        self._contiguous_min = contiguous_min
        self._iov_max = iov_max
        self._connect_timeout = connect_timeout
        self._write_ahead = write_ahead
        self._packer = packer
        self._conns: dict[str, SendConn] = {}  # peer instance id -> connection
        self._by_local: dict[int, SendConn] = {}
        self._connecting: dict[str, asyncio.Future[None]] = {}
        self._lost_while_connecting: dict[str, str] = {}
        self._send_rooms: dict[int, SendRoom] = {}

    @property
    def connections(self) -> list[SendConn]:
        """The live connections (a diagnostic)."""
        return [c for c in self._conns.values() if not c.dead]

    # -- connect -------------------------------------------------------------------------
    async def connect(self, d: Descriptor) -> Peer:
        """A connection to the receiver ``d`` describes (the cached one while it lives)."""
        self._check_address(d.endpoint, "descriptor")
        if not d.liveness:
            raise BadDescriptor("rdma descriptor names no liveness address (needed to detect a dead peer)")
        while True:
            conn = self._conns.get(d.instance_id)
            if conn is not None and not conn.dead:
                return Peer(d.instance_id, conn.desc)
            pending = self._connecting.get(d.instance_id)
            if pending is None:
                break
            await asyncio.shield(pending)
            if d.instance_id not in self._conns:
                raise PeerFailure(f"connecting to rdma peer {d.instance_id} failed")
        # Another instance behind the same worker address or liveness port is a
        # restarted peer: its old connection must never be used again.
        for old in list(self._conns.values()):
            if old.desc.endpoint == d.endpoint or (d.liveness and old.desc.liveness == d.liveness):
                self._fail_peer(old.desc.instance_id, f"peer restarted as instance {d.instance_id}")
        fut = asyncio.get_running_loop().create_future()
        self._connecting[d.instance_id] = fut
        try:
            conn = await self._handshake(d)
            self._conns[d.instance_id] = conn
            return Peer(d.instance_id, conn.desc)
        finally:
            del self._connecting[d.instance_id]
            self._lost_while_connecting.pop(d.instance_id, None)
            fut.set_result(None)

    def _check_address(self, address: bytes, what: str) -> None:
        """Cheap structural check of a UCX worker address from untrusted bytes (UCX
        asserts, killing the process, on a malformed one). The real check is that the
        live peer announces the same bytes over the liveness channel."""
        own = self._worker.address
        if not 16 <= len(address) <= 65535 or (address[0] & 0x0F) != (own[0] & 0x0F):
            raise BadDescriptor(f"{what} carries no valid UCX worker address ({len(address)} bytes)")

    async def _handshake(self, d: Descriptor) -> SendConn:
        # Liveness first: a dead peer's port refuses at once, before any UCX endpoint
        # is pointed at a worker that no longer exists, and the live peer tells us its
        # worker address, which must be the descriptor's.
        cred = self._require_credential(d.instance_id)
        info = await self._liveness.watch(d.instance_id, d.liveness)
        lost = self._lost_while_connecting.get(d.instance_id)
        if info is None or lost is not None:
            raise PeerFailure(f"rdma peer {d.instance_id} is not alive: {lost or 'liveness check failed'}")
        if info != d.endpoint:
            self._liveness.unwatch(d.instance_id)
            raise BadDescriptor(
                f"the descriptor's UCX worker address is not the one peer {d.instance_id} announces for itself"
            )
        try:
            ep = self._worker.endpoint(d.endpoint)
        except UcxError as exc:
            self._liveness.unwatch(d.instance_id)
            raise PeerFailure(f"rdma peer {d.instance_id}: {exc}") from None
        conn = SendConn(new_id(32, self._by_local), d, ep)
        self._by_local[conn.local_id] = conn
        conn.hello = asyncio.get_running_loop().create_future()
        sid, tid = self._instance_id.encode(), d.instance_id.encode()
        addr = self._worker.address
        # Bound to the proven liveness link: the proof answers that link's challenge.
        proof = peerauth.proof(cred, HELLO_CHANNEL,
                               self._liveness.challenge_of(d.instance_id), self._instance_id, d.instance_id)
        msg = (COMMON.pack(HELLO, conn.local_id, 0, conn.reply_key) + HELLO_BODY.pack(len(sid), len(tid), len(addr))
               + sid + tid + addr + proof)
        ok = False
        try:
            self._send_ctrl(conn, msg, None, None)
            try:
                accepted, remote_id, remote_key, reason = await asyncio.wait_for(asyncio.shield(conn.hello),
                                                                                  self._connect_timeout)
            except asyncio.TimeoutError:
                raise PeerFailure(
                    f"rdma peer {d.instance_id} did not answer the handshake within {self._connect_timeout:.1f} s"
                ) from None
            if not accepted:
                raise PeerFailure(f"rdma peer {d.instance_id} refused the connection: {reason}")
            lost = self._lost_while_connecting.get(d.instance_id)
            if lost is not None or conn.dead:
                raise PeerFailure(f"rdma peer {d.instance_id} was lost while connecting: {lost}")
            conn.remote_id, conn.remote_key = remote_id, remote_key
            ok = True
            return conn
        finally:
            if not ok:
                self._drop(conn)
                self._liveness.unwatch(d.instance_id)

    # -- replies -------------------------------------------------------------------------
    def on_reply(self, msg: bytes) -> None:
        """A control message from a receiver (HELLO_OK / HELLO_REFUSED, ACK, NACK)."""
        typ, local_id, _seq, key = COMMON.unpack_from(msg)
        conn = self._by_local.get(local_id)
        if conn is None or key != conn.reply_key:
            return  # not this connection's receiver (a forger that guessed the id): no effect
        body = msg[COMMON.size :]
        if typ in (HELLO_OK, HELLO_REFUSED):
            if typ == HELLO_OK:
                remote_id, n, remote_key = HELLO_OK_BODY.unpack_from(body)
                rid = body[HELLO_OK_BODY.size : HELLO_OK_BODY.size + n].decode()
                ok = rid == conn.desc.instance_id
                result = (ok, remote_id, remote_key, "" if ok else f"answered as instance {rid}")
            else:
                result = (False, 0, 0, body.decode(errors="replace"))
            if conn.hello is not None and not conn.hello.done():
                conn.hello.set_result(result)
            return
        (room,) = ROOM_BODY.unpack_from(body)
        if room not in conn.rooms:
            return
        if typ == ACK:
            self._rooms.set(room, KVPoll.SUCCESS)
        elif typ == NACK:
            _, code = NACK_BODY.unpack_from(body)
            reason = body[NACK_BODY.size :].decode(errors="replace")
            self._rooms.fail(room, f"receiver rejected room {room}: {reason}", Refusal.from_code(code))

    # -- rooms and failures --------------------------------------------------------------
    async def drain(self, room: int, timeout: float) -> bool:
        """Wait (bounded) until no send for ``room`` is pending."""
        # A receive the receiver's UCX already matched completes into the pages it was
        # authorized for even after the receiver released the room; only the sender knows
        # when its sends are over (a released room's other data is drained to scratch
        # there, so these complete too, unless the peer hangs: then the timeout).
        sroom = self._send_rooms.get(room)
        deadline = time.monotonic() + timeout
        while sroom is not None and (sroom.tokens or sroom.packing):
            if time.monotonic() >= deadline:
                return False
            self._worker.kick()
            await asyncio.sleep(0.002)
        return True

    def release(self, room: int) -> None:
        sroom = self._send_rooms.pop(room, None)
        if sroom is not None:
            sroom.conn.rooms.discard(room)

    def peer_lost(self, instance_id: str, reason: str) -> None:
        """The liveness channel lost ``instance_id``: a connect in progress to it fails."""
        if instance_id in self._connecting:
            self._lost_while_connecting[instance_id] = reason

    def drop_peer(self, instance_id: str, reason: str) -> None:
        """Fail the rooms written to ``instance_id`` and drop its connection."""
        conn = self._conns.pop(instance_id, None)
        if conn is not None:
            self._liveness.unwatch(instance_id)
            self._drop(conn, reason)

    def _drop(self, conn: SendConn, reason: str = "connection dropped", *, peer_lost: bool = True) -> None:
        conn.dead = True
        self._by_local.pop(conn.local_id, None)
        for room in list(conn.rooms):
            self._rooms.fail(room, reason, peer_lost=peer_lost)
        for token in list(conn.tokens):
            self._worker.cancel(token)
        if conn.hello is not None and not conn.hello.done():
            conn.hello.set_result((False, 0, 0, reason))
        if not peer_lost:  # our own shutdown, the peer is fine: flush and say goodbye
            self._worker.drop_endpoint(conn.ep)
            conn.ep = None
            return
        # The peer is gone or declared gone: release the endpoint without asking it.
        # Sends UCX could not cancel (rendezvous to a hung peer: with error handling
        # off, UCX keeps them) are abandoned, so nothing waits on them any more.
        self._worker.drop_endpoint(conn.ep, force=True)
        conn.ep = None
        for token in list(conn.tokens):
            self._worker.abandon(token)
        conn.tokens.clear()
        for nbytes in conn.packed.values():  # abandoned: their completions never come
            self._packer.give_back(nbytes)
        conn.packed.clear()

    async def settle(self, grace: float) -> None:
        """Let sends already handed to UCX finish, for at most ``grace`` seconds."""
        # A rendezvous send completes only once the receiver fetched the bytes, and a
        # receiver that notices our liveness link close first cancels its receive,
        # leaving UCX holding the send (and the worker unreleasable). The receiver
        # posts a receive (or a drain) for every data message it was told about, so
        # live peers finish these in milliseconds; a hung one costs the bound.
        deadline = time.monotonic() + grace
        while any(c.tokens for c in self._conns.values() if not c.dead) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)

    def close(self, reason: str) -> None:
        """Drop every connection (flushed: the peers are fine)."""
        for conn in list(self._conns.values()):
            self._drop(conn, reason, peer_lost=False)
        self._conns.clear()
        self._by_local.clear()
        self._send_rooms.clear()

    # -- writes --------------------------------------------------------------------------
    def plan(self, room: int, ops: Sequence[WriteOp], metadata: WriteOp | None) -> list[Plan]:
        """Check ``ops`` (and ``metadata``) against the registered regions and plan the
        data messages; raises :class:`ConfigError` for an op outside its region."""
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

    def announce(self, peer: Peer, room: int, plans: list[Plan]) -> "list[tuple[Plan, int]] | None":
        """Send ``plans``' WRITEs now, ahead of their data (``write_ahead``); returns each
        plan with its first data sequence number, or None to leave everything to
        :meth:`send_planned` (no live connection yet, or the room is already busy
        elsewhere: the send reports it)."""
        conn = self._conns.get(peer.instance_id)
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
            self._rooms.fail(room, str(exc))
            return []

    def send_planned(self, peer: Peer, room: int, plans: list[Plan], metadata: WriteOp | None) -> None:
        """Send ``plans``' WRITEs and data, then the metadata row."""
        got = self._room_on(peer, room, KVPoll.TRANSFERRING)
        if got is None:
            return
        conn, sroom = got
        try:
            for plan in plans:
                self._send_data(conn, room, sroom, plan, self._send_write(conn, room, sroom, plan, 0))
            self._send_meta(conn, room, sroom, metadata)
        except PeerFailure as exc:
            self._rooms.fail(room, str(exc))

    def send_announced(self, peer: Peer, room: int, announced: list[tuple[Plan, int]],
                       metadata: WriteOp | None) -> None:
        """The data of WRITEs sent ahead by :meth:`announce`, then the row, on the
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
            self._rooms.fail(room, str(exc))

    def _room_on(self, peer: Peer, room: int, state: KVPoll) -> tuple[SendConn, SendRoom] | None:
        """The live connection to ``peer`` and ``room``'s send state on it, the room
        tracked (from ``state``); None when the room failed or is not writable now."""
        self._rooms.create(room, state)
        if state is KVPoll.TRANSFERRING:
            self._rooms.set(room, state)  # announced ahead (WAITING_FOR_INPUT) until now
        conn = self._conns.get(peer.instance_id)
        sroom = self._send_rooms.get(room)
        if conn is None or conn.dead:
            self._rooms.fail(room, f"no live connection to rdma peer {peer.instance_id} (connect again)")
            return None
        if sroom is None:
            sroom = self._send_rooms[room] = SendRoom(conn)
            conn.rooms.add(room)
        elif sroom.conn is not conn:
            self._rooms.fail(room, f"room {room} is already being written to another peer")
            return None
        if self._rooms.status(room).state.is_terminal:
            return None  # failed already (NACK, peer lost): nothing more is sent for it
        return conn, sroom

    def _send_meta(self, conn: SendConn, room: int, sroom: SendRoom, metadata: WriteOp | None) -> None:
        if metadata is None:
            return
        src = self._by_region[metadata.src_region]
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
        # Each message goes out as its iov rows, read in place by UCX (staging host
        # memory into a contiguous buffer first would add a copy of every byte), or
        # packed where its ranges are in GPU memory (rdma_pack).
        k = 0
        for i, c in enumerate(plan.counts):
            tag = data_tag(conn.remote_id, first + i)
            rows = plan.table[k : k + c]
            if not (self._packer.wants(rows[:, 0]) and self._send_packed(conn, room, sroom, rows, tag)):
                self._send(conn, plan.iov[k : k + c], tag, room, sroom, plan.iov)
            k += c

    def _send_packed(self, conn: SendConn, room: int, sroom: SendRoom, rows: np.ndarray, tag: int) -> bool:
        """Gather ``rows``' source ranges into one buffer and send it once the gather
        finished; False (nothing started) when the packing budget is spent."""
        got = self._packer.gather(rows[:, 0], rows[:, 1], rows[:, 4])
        if got is None:
            return False
        buf, ready = got
        nbytes = buf.numel()
        sroom.packing += 1

        def post() -> None:
            sroom.packing -= 1
            if conn.dead or self._send_rooms.get(room) is not sroom or self._rooms.status(room).state.is_terminal:
                self._packer.give_back(nbytes)  # failed or released meanwhile: nothing more goes out
                return

            token_box: list[int] = []

            def sent(status: int, finish: Callable[[int], None]) -> None:
                if token_box and conn.packed.pop(token_box[0], None) is not None:
                    self._packer.give_back(nbytes)
                finish(status)

            try:
                token_box.append(self._track(conn, room, sroom, lambda finish: self._worker.send(
                    conn.ep, [(buf.data_ptr(), nbytes)], tag, lambda st, _n, _t: sent(st, finish), buf)))
            except PeerFailure as exc:
                self._packer.give_back(nbytes)
                self._rooms.fail(room, str(exc))
                return
            conn.packed[token_box[0]] = nbytes  # given back by its completion, or by _drop if abandoned

        call_when(ready.done, post)
        return True

    # -- UCX sends -----------------------------------------------------------------------
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
               post: Callable[[Callable[[int], None]], int]) -> int:
        """Post a send (or batch) through ``post(finish)``, keeping its token with the
        connection and room until ``finish(status)``; a failed send fails the room.
        Returns the token."""
        token_box: list[int] = []

        def finish(status: int) -> None:
            if token_box:
                conn.tokens.discard(token_box[0])
                if room is not None:
                    room.tokens.discard(token_box[0])
            if status not in (UCS_OK, UCS_ERR_CANCELED) and room_id is not None:
                self._rooms.fail(room_id, f"UCX send to peer {conn.desc.instance_id} failed (status {status})")

        try:
            token = post(finish)
        except UcxError as exc:
            raise PeerFailure(f"rdma peer {conn.desc.instance_id}: {exc}") from None
        token_box.append(token)
        conn.tokens.add(token)
        if room is not None:
            room.tokens.add(token)
        return token
