"""``rdma``: KV pages over UCX (its C API, see :mod:`._ucx`), straight into the destination tensors.

Endpoints are created from the peer's **UCX worker address**, which travels in the
descriptor (``Descriptor.endpoint``). That lets UCX choose the best path per peer: shared
memory between processes on one host (sysv/posix eager, cma zero-copy rendezvous) and
RDMA verbs between hosts when UCX was built with them. Endpoint error handling is off
(it would force UCX off the fast shared-memory transports), so peer death is detected by
:mod:`pdgrpc.transport.liveness`'s heartbeat protocol (a side channel whose address
is ``Descriptor.liveness``; implemented on raw sockets in :mod:`._ucx_liveness`) and routed into :meth:`RdmaTransport.fail_peer`, which cancels
the pending UCX requests of that peer.

Protocol (all UCX tag messages; tags are ``kind:4 | conn:28 | seq:32``)
-----------------------------------------------------------------------
``CTRL`` (to a receiver; all senders share the tag, the body says who) and ``REPLY``
(to a sender) carry small little-endian control messages, each starting with
``type u8 | pad 3 | conn u32 | seq u64``:

* ``HELLO`` (sender -> receiver): the sender's local connection id, instance ids, and
  its own worker address (for replies). ``HELLO_OK`` assigns the receiver-side
  connection id that the sender then puts in every tag; ``HELLO_REFUSED`` says why not.
* ``WRITE``: room, the sequence number of its first data message, how many ops each
  data message carries, then the op table (``region u16 | pad 6 | offset u64 |
  length u64``, destination side). The data messages (tag ``DATA | conn | seq``) follow:
  consecutive ops are batched into scatter/gather messages of about ``zero_copy_min``
  bytes and at most ``iov_max`` ops each (UCX moves large ones by zero-copy rendezvous).
* ``META``: the room, the number of KV bytes the sender wrote for the room before it,
  the destination of the metadata row, and the row itself (inline).
* ``ACK`` / ``NACK`` (receiver -> sender): the room's metadata row landed / the room
  failed on the receiver, with the reason.

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

Peer failure: the liveness channel closes within milliseconds when a peer process dies
(its kernel closes the socket) and misses heartbeats if a host hangs; either way every
non-terminal room of that peer fails, its pending UCX requests are cancelled, its
endpoint is dropped, and the next ``connect`` builds a fresh one. Connections are keyed
by the peer's instance id (a fresh id per process start), so a restarted peer never
gets a cached endpoint.

Release: a released room's not-yet-matched receives are cancelled (and drained to
scratch), so a late write cannot land in pages reused by another request. A receive
that UCX already matched finishes into the pages it was authorized for (a network
transfer in flight cannot be recalled); the decode side reuses an aborted request's
pages only after the sender acknowledged the abort or its lease expired (DESIGN.md).

Options: ``zero_copy_min`` (bytes per data message: a message is closed once the ops
in it reach this size; default 16 MiB), ``iov_max`` (ops per data message, default
4096), ``connect_timeout``
(seconds, default 5), ``liveness_interval`` / ``liveness_lease`` (seconds; defaults 0.5 /
5: a peer that *dies* is noticed in milliseconds because its kernel closes the liveness
socket; the lease only catches a hung peer or host, and must outlast the longest time
either side's event loop can be busy, e.g. hashing a large buffer on a loaded machine),
``host`` (the liveness listen address, advertised in the descriptor: use an address
peers can reach; default 127.0.0.1), ``progress_spin_s`` (how long the UCX worker keeps
busy-polling after the last completion, and only while a transfer of its own is
pending, before sleeping on its epoll descriptor; default 0: on a host whose cores are
all busy (2 cores: the peer process and the engine's compute thread) any spin steals
the CPU the other side needs, see :mod:`._ucx`). UCX itself is
configured through the usual ``UCX_*`` environment variables (``UCX_TLS`` etc.);
nothing is forced. One of them breaks this protocol: with ``UCX_MM_SEG_SIZE`` raised to
64K, UCX 1.21 completes every iov receive over shared memory as truncated. The rooms then
fail cleanly ("did not arrive intact"), but none succeeds. docs/transports.md says to leave it
at its default.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import logging
import struct
import time
from typing import Any, Awaitable, Callable, NamedTuple, Sequence

import numpy as np
import torch

from pdgrpc.errors import ConfigError, PeerFailure, TransportError, UnauthorizedWrite
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport._ucx import (
    FULL_MASK,
    UCS_ERR_CANCELED,
    UCS_ERR_MESSAGE_TRUNCATED,
    UCS_OK,
    Pieces,
    UcxError,
    UcxWorker,
)
from pdgrpc.transport.base import (
    BadDescriptor,
    Descriptor,
    MemoryRegion,
    Peer,
    RoomGrant,
    Transport,
    WriteOp,
    WriteOps,
)
from pdgrpc.transport.receiver import MessageType, Receiver, ReceiveRoom, Refusal
from pdgrpc.transport._ucx_liveness import RawLiveness

log = logging.getLogger("pdgrpc.transport.rdma")

# -- wire format ------------------------------------------------------------------------
KIND_SHIFT = 60
KIND_MASK = 0xF << KIND_SHIFT
KIND_CTRL, KIND_REPLY, KIND_DATA = 1, 2, 3
CONN_BITS = 28

HELLO, HELLO_OK, HELLO_REFUSED, WRITE, META, ACK, NACK = (
    MessageType.HELLO, MessageType.HELLO_OK, MessageType.HELLO_REFUSED, MessageType.WRITE, MessageType.META,
    MessageType.ACK, MessageType.NACK)
COMMON = struct.Struct("<B3xIQ")  # type, conn, seq
HELLO_BODY = struct.Struct("<HHI")  # len(sender id), len(target id), len(worker address)
HELLO_OK_BODY = struct.Struct("<IH2x")  # assigned conn id, len(receiver id)
WRITE_BODY = struct.Struct("<QIII4x")  # room, first data seq, n messages, n ops
# then n messages x u32 (ops in each data message), then the op table:
OP_DTYPE = np.dtype([("region", "<u2"), ("pad", "V6"), ("offset", "<u8"), ("length", "<u8")])
META_BODY = struct.Struct("<QQH6xQQ")  # room, kv bytes before, region, offset, length
ROOM_BODY = struct.Struct("<Q")
NACK_BODY = struct.Struct("<QB7x")  # room, refusal code (0: not a refused write); then the reason

CTRL_BUF = 256 * 1024  # largest control message
CTRL_POSTED = 8  # control receives kept posted per kind
MAX_OPS_PER_WRITE = 4096  # keeps a WRITE message well under CTRL_BUF
MAX_ROW = CTRL_BUF - COMMON.size - META_BODY.size
SCRATCH = 1 << 20  # drain buffer for rejected payloads
CLOSE_SEND_GRACE_S = 1.0  # close(): how long in-flight sends to live peers may finish


def ctrl_tag(kind: int) -> int:
    return kind << KIND_SHIFT


def data_tag(conn: int, seq: int) -> int:
    return (KIND_DATA << KIND_SHIFT) | (conn << 32) | (seq & 0xFFFFFFFF)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu":
        raise ConfigError(
            f"rdma transport: this build registers host memory only; got a tensor on {tensor.device}"
        )
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class _Region:
    __slots__ = ("info", "flat", "ptr")

    def __init__(self, region: MemoryRegion) -> None:
        self.flat = _flat_bytes(region.tensor)
        self.ptr = self.flat.data_ptr()
        self.info = region.info()


# -- per-connection / per-room state ----------------------------------------------------
class _SendConn:
    """Sender side of one connection (to one receiver instance)."""

    def __init__(self, local_id: int, desc: Descriptor, ep: Any) -> None:
        self.local_id = local_id
        self.desc = desc
        self.ep = ep
        self.remote_id = 0  # assigned by the receiver's HELLO_OK
        self.ctrl_seq = 0
        self.data_seq = 0
        self.hello: asyncio.Future[tuple[bool, int, str]] | None = None
        self.rooms: set[int] = set()
        self.tokens: set[int] = set()
        self.dead = False


class _RecvConn:
    """Receiver side of one connection (from one sender instance)."""

    def __init__(self, conn_id: int, sender_id: str, sender_local: int, ep: Any) -> None:
        self.conn_id = conn_id
        self.sender_id = sender_id
        self.sender_local = sender_local  # the sender's id for this connection (in replies)
        self.ep = ep
        self.next_seq = 1
        self.early: dict[int, bytes] = {}  # control messages that arrived out of order
        self.rooms: set[int] = set()
        self.tokens: set[int] = set()


class _RecvRoom:
    """What rdma keeps per open room besides the receiver core's state."""

    def __init__(self, core: ReceiveRoom) -> None:
        self.core = core
        self.pending: dict[int, int] = {}  # conn id -> data receives outstanding
        self.tokens: set[int] = set()
        self.nacked = False
        self.released = False


class _SendRoom:
    def __init__(self, conn: _SendConn) -> None:
        self.conn = conn
        self.kv_bytes = 0
        self.tokens: set[int] = set()


class _Plan(NamedTuple):
    """One WRITE's data messages, checked and planned (sequence numbers come at send)."""

    counts: list[int]  # ops per data message
    n_ops: int
    table_bytes: bytes  # the WRITE body after its header: counts, then the op table
    iov: np.ndarray  # (n_ops, 2) uint64 {source address, length}
    nbytes: int


class RdmaTransport(Transport):
    """The ``rdma`` backend (UCX). See the module docstring."""

    name = "rdma"

    def __init__(
        self,
        *,
        zero_copy_min: int = 16 << 20,
        iov_max: int = 4096,
        connect_timeout: float = 5.0,
        liveness_interval: float = 0.5,
        liveness_lease: float = 5.0,
        host: str = "127.0.0.1",
        progress_spin_s: float = 0.0,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ConfigError(
                f"rdma transport: unknown option(s) {', '.join(sorted(unknown))}; known: zero_copy_min, iov_max, "
                "connect_timeout, liveness_interval, liveness_lease, host, progress_spin_s"
            )
        if zero_copy_min < 1 or not 1 <= iov_max <= MAX_OPS_PER_WRITE:
            raise ConfigError(f"rdma: need zero_copy_min >= 1 and 1 <= iov_max <= {MAX_OPS_PER_WRITE}, got {zero_copy_min}, {iov_max}")
        if connect_timeout <= 0:
            raise ConfigError(f"rdma: connect_timeout must be > 0, got {connect_timeout}")
        self._zc_min = int(zero_copy_min)
        self._iov_max = int(iov_max)
        self._connect_timeout = float(connect_timeout)
        if progress_spin_s < 0:
            raise ConfigError(f"rdma: progress_spin_s must be >= 0, got {progress_spin_s}")
        self._worker = UcxWorker(spin_s=progress_spin_s)  # raises TransportUnavailable (with the install hint)
        self._liveness = RawLiveness(self.instance_id, self._on_lost, info=self._worker.address, host=host,
                                  interval=liveness_interval, lease=liveness_lease)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._regions: dict[int, _Region] = {}
        # region id -> base address / size (-1: not registered), for vectorised lookups
        self._ptr_table = np.zeros(1 << 16, dtype=np.uint64)
        self._size_table = np.full(1 << 16, -1, dtype=np.int64)
        self._started = False
        self._closed = False
        # sender side
        self._send_conns: dict[str, _SendConn] = {}  # peer instance id -> connection
        self._send_by_local: dict[int, _SendConn] = {}
        self._connecting: dict[str, asyncio.Future[None]] = {}
        self._lost_while_connecting: dict[str, str] = {}
        self._send_rooms: dict[int, _SendRoom] = {}
        self._local_ids = itertools.count(1)
        # receiver side
        self._recv_conns: dict[int, _RecvConn] = {}
        self._recv_rooms: dict[int, _RecvRoom] = {}
        self._recv = Receiver(self.rooms)
        self._conn_ids = itertools.count(1)
        self._scratch = torch.empty(SCRATCH, dtype=torch.uint8)
        self._ctrl_bufs: list[torch.Tensor] = []

    # -- descriptor ----------------------------------------------------------------------
    @property
    def pending_requests(self) -> int:
        """UCX requests this transport still waits on, besides the always-posted control
        receives (a diagnostic: 0 on an idle transport, and again once a failed peer's
        requests were cancelled — receives by ``ucp_request_cancel``, sends by a forced
        endpoint close or, for rendezvous sends UCX keeps, by abandoning them)."""
        return max(0, self._worker.inflight_requests - (2 * CTRL_POSTED if self._started and not self._closed else 0))

    @property
    def worker_address(self) -> bytes:
        """This instance's UCX worker address (what peers create endpoints from)."""
        return self._worker.address

    def _descriptor(self) -> Descriptor:
        return Descriptor(self.name, self.instance_id, self._worker.address,
                          tuple(r.info for r in self._regions.values()), self._liveness.address)

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise TransportError("rdma transport is closed")
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise TransportError("rdma transport is bound to another event loop")
        if not self._started:
            self._started = True
            self._worker.start()
            for kind in (KIND_CTRL, KIND_REPLY):
                for _ in range(CTRL_POSTED):
                    buf = torch.empty(CTRL_BUF, dtype=torch.uint8)
                    self._ctrl_bufs.append(buf)
                    self._post_ctrl(kind, buf)

    def _post_ctrl(self, kind: int, buf: torch.Tensor) -> None:
        if self._closed:
            return

        def done(status: int, length: int, tag: int) -> None:
            if status == UCS_ERR_CANCELED or self._closed:
                return
            if status == UCS_OK:
                msg = buf[:length].numpy().tobytes()
                try:
                    (self._on_ctrl if kind == KIND_CTRL else self._on_reply)(msg)
                except (struct.error, ValueError, UnicodeDecodeError) as exc:
                    log.warning("rdma: dropped a malformed control message: %r", exc)
            else:
                log.warning("rdma: control receive failed with UCX status %d", status)
            self._post_ctrl(kind, buf)

        self._worker.recv([(buf.data_ptr(), CTRL_BUF)], ctrl_tag(kind), KIND_MASK, done, buf, background=True)

    async def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        self._ensure_started()
        for r in regions:
            if r.region_id in self._regions:
                raise ConfigError(f"region_id {r.region_id} ({r.name!r}) is already registered")
            reg = self._regions[r.region_id] = _Region(r)
            self._ptr_table[r.region_id] = reg.ptr
            self._size_table[r.region_id] = reg.info.nbytes
            self._recv.add_region(reg.info)
        await self._liveness.start()
        return self._descriptor().to_bytes()

    # -- connect (sender) ----------------------------------------------------------------
    async def connect(self, descriptor: bytes) -> Peer:
        self._ensure_started()
        d = Descriptor.from_bytes(descriptor)
        if d.backend != self.name:
            raise BadDescriptor(f"descriptor is for transport {d.backend!r}, this is {self.name!r}")
        self._check_address(d.endpoint, "descriptor")
        if not d.liveness:
            raise BadDescriptor("rdma descriptor names no liveness address (needed to detect a dead peer)")
        while True:
            conn = self._send_conns.get(d.instance_id)
            if conn is not None and not conn.dead:
                return Peer(d.instance_id, conn.desc)
            pending = self._connecting.get(d.instance_id)
            if pending is None:
                break
            await asyncio.shield(pending)
            if d.instance_id not in self._send_conns:
                raise PeerFailure(f"connecting to rdma peer {d.instance_id} failed")
        # Another instance behind the same worker address or liveness port is a
        # restarted peer: its old connection must never be used again.
        for old in list(self._send_conns.values()):
            if old.desc.endpoint == d.endpoint or (d.liveness and old.desc.liveness == d.liveness):
                self.fail_peer(old.desc.instance_id, f"peer restarted as instance {d.instance_id}")
        fut = asyncio.get_running_loop().create_future()
        self._connecting[d.instance_id] = fut
        try:
            conn = await self._handshake(d)
            self._send_conns[d.instance_id] = conn
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

    async def _handshake(self, d: Descriptor) -> _SendConn:
        # Liveness first: a dead peer's port refuses at once, before any UCX endpoint
        # is pointed at a worker that no longer exists, and the live peer tells us its
        # worker address, which must be the descriptor's.
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
        conn = _SendConn(next(self._local_ids), d, ep)
        self._send_by_local[conn.local_id] = conn
        conn.hello = asyncio.get_running_loop().create_future()
        sid, tid = self.instance_id.encode(), d.instance_id.encode()
        addr = self._worker.address
        msg = COMMON.pack(HELLO, conn.local_id, 0) + HELLO_BODY.pack(len(sid), len(tid), len(addr)) + sid + tid + addr
        ok = False
        try:
            self._send_ctrl(conn, msg, None, None)
            try:
                accepted, remote_id, reason = await asyncio.wait_for(asyncio.shield(conn.hello), self._connect_timeout)
            except asyncio.TimeoutError:
                raise PeerFailure(
                    f"rdma peer {d.instance_id} did not answer the handshake within {self._connect_timeout:.1f} s"
                ) from None
            if not accepted:
                raise PeerFailure(f"rdma peer {d.instance_id} refused the connection: {reason}")
            lost = self._lost_while_connecting.get(d.instance_id)
            if lost is not None or conn.dead:
                raise PeerFailure(f"rdma peer {d.instance_id} was lost while connecting: {lost}")
            conn.remote_id = remote_id
            ok = True
            return conn
        finally:
            if not ok:
                self._drop_send_conn(conn)
                self._liveness.unwatch(d.instance_id)

    def _send_ctrl(self, conn: _SendConn, msg: bytes, room_id: int | None, room: _SendRoom | None) -> None:
        buf = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
        self._send(conn, [(buf.data_ptr(), len(msg))], ctrl_tag(KIND_CTRL), room_id, room, buf)

    def _send(self, conn: _SendConn, pieces: Pieces, tag: int, room_id: int | None,
              room: _SendRoom | None, keep: Any) -> None:
        token_box: list[int] = []

        def done(status: int, length: int, _tag: int) -> None:
            if token_box:
                conn.tokens.discard(token_box[0])
                if room is not None:
                    room.tokens.discard(token_box[0])
            if status not in (UCS_OK, UCS_ERR_CANCELED) and room_id is not None:
                self.rooms.fail(room_id, f"UCX send to peer {conn.desc.instance_id} failed (status {status})")

        try:
            token = self._worker.send(conn.ep, pieces, tag, done, keep)
        except UcxError as exc:
            raise PeerFailure(f"rdma peer {conn.desc.instance_id}: {exc}") from None
        token_box.append(token)
        conn.tokens.add(token)
        if room is not None:
            room.tokens.add(token)

    # -- write (sender) ------------------------------------------------------------------
    async def write(self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None) -> None:
        self._send_planned(peer, room, self._plan(room, ops, metadata), metadata)

    def prepare_write(
        self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None
    ) -> Callable[[], Awaitable[None]]:
        # Checking the ops against the regions and planning the data messages is numpy
        # work worth ~0.3 ms right after a compute (cold caches); done here, while the
        # data is still being computed, the send is only the UCX calls.
        plans = self._plan(room, ops, metadata)

        async def send() -> None:
            self._send_planned(peer, room, plans, metadata)

        return send

    def _plan(self, room: int, ops: Sequence[WriteOp], metadata: WriteOp | None) -> list[_Plan]:
        """Check ``ops`` (and ``metadata``) against the registered regions and plan the
        data messages; raises :class:`ConfigError` for an op outside its region."""
        self._ensure_started()
        # One row per op: src region, src offset, dst region, dst offset, length.
        try:
            # WriteOps carries its ops as one int64 array already: no per-op Python work.
            table = ops.array if isinstance(ops, WriteOps) else WriteOps.of(ops).array
        except OverflowError:
            raise ConfigError(f"rdma write for room {room}: an offset or length does not fit in 63 bits") from None
        checks = table if metadata is None else np.vstack([table, np.array(
            [[metadata.src_region, metadata.src_offset, metadata.dst_region, metadata.dst_offset, metadata.length]],
            dtype=np.int64)])
        sizes = self._size_table[checks[:, 0]]
        bad = np.flatnonzero((sizes < 0) | (checks[:, 1] + checks[:, 4] > sizes))
        if len(bad):
            r, o, _, _, n = (int(x) for x in checks[bad[0]])
            src = self._regions.get(r)
            if src is None:
                raise ConfigError(f"rdma write for room {room}: source region {r} is not registered")
            raise ConfigError(
                f"rdma write for room {room}: source bytes [{o}, {o + n}) outside region {src.info.name!r} "
                f"of {src.info.nbytes} bytes"
            )
        if metadata is not None and metadata.length > MAX_ROW:
            raise ConfigError(f"rdma: metadata row of {metadata.length} bytes exceeds the {MAX_ROW}-byte limit")
        return [p for i in range(0, len(table), MAX_OPS_PER_WRITE) if (p := self._plan_chunk(table[i : i + MAX_OPS_PER_WRITE]))]

    def _send_planned(self, peer: Peer, room: int, plans: list[_Plan], metadata: WriteOp | None) -> None:
        self.rooms.create(room, KVPoll.TRANSFERRING)
        conn = self._send_conns.get(peer.instance_id)
        sroom = self._send_rooms.get(room)
        if conn is None or conn.dead:
            self.rooms.fail(room, f"no live connection to rdma peer {peer.instance_id} (connect again)")
            return
        if sroom is None:
            sroom = self._send_rooms[room] = _SendRoom(conn)
            conn.rooms.add(room)
        elif sroom.conn is not conn:
            self.rooms.fail(room, f"room {room} is already being written to another peer")
            return
        if self.rooms.status(room).state.is_terminal:
            return  # failed already (NACK, peer lost): nothing more is sent for it
        try:
            for plan in plans:
                self._send_plan(conn, room, sroom, plan)
            if metadata is not None:
                src = self._regions[metadata.src_region]
                row = src.flat[metadata.src_offset : metadata.src_offset + metadata.length].numpy().tobytes()
                conn.ctrl_seq += 1
                msg = COMMON.pack(META, conn.remote_id, conn.ctrl_seq) + META_BODY.pack(
                    room, sroom.kv_bytes, metadata.dst_region, metadata.dst_offset, metadata.length) + row
                self._send_ctrl(conn, msg, room, sroom)
        except PeerFailure as exc:
            self.rooms.fail(room, str(exc))

    def _plan_chunk(self, table: np.ndarray) -> "_Plan | None":
        # Plan the data messages: consecutive ops share one scatter/gather message
        # until it holds ``zero_copy_min`` bytes or ``iov_max`` ops (vectorised: a new
        # message starts where an op's start offset crosses into the next
        # zero_copy_min window, or at every iov_max-th op within a window).
        # Measured here (two processes, shared memory, 2 cores): one UCX rendezvous
        # per 256 KiB-8 MiB op cost 2-3x the raw baseline at 96-384 MiB, while a
        # few large iov messages reach it (UCX zero-copies iov rendezvous too): the
        # per-message handshake, not the bytes, was the cost.
        lens = table[:, 4]
        n = len(lens)
        if n == 0:
            return None
        window = (np.cumsum(lens) - lens) // self._zc_min
        starts = np.flatnonzero(np.r_[True, window[1:] != window[:-1]])
        rank = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
        key = window * (n + 1) + rank // self._iov_max
        counts = np.diff(np.r_[np.flatnonzero(np.r_[True, key[1:] != key[:-1]]), n]).tolist()
        if not counts:
            return None
        ops = np.zeros(len(table), dtype=OP_DTYPE)
        ops["region"], ops["offset"], ops["length"] = table[:, 2], table[:, 3], table[:, 4]
        # iov rows {source address, length}, read in place by UCX
        iov = np.empty((len(table), 2), dtype=np.uint64)
        iov[:, 0] = self._ptr_table[table[:, 0]] + table[:, 1].astype(np.uint64)
        iov[:, 1] = table[:, 4]
        return _Plan(counts, len(table), np.asarray(counts, dtype="<u4").tobytes() + ops.tobytes(), iov, int(lens.sum()))

    def _send_plan(self, conn: _SendConn, room: int, sroom: _SendRoom, plan: _Plan) -> None:
        conn.ctrl_seq += 1
        first = conn.data_seq
        conn.data_seq += len(plan.counts)
        msg = b"".join([
            COMMON.pack(WRITE, conn.remote_id, conn.ctrl_seq),
            WRITE_BODY.pack(room, first & 0xFFFFFFFF, len(plan.counts), plan.n_ops),
            plan.table_bytes,
        ])
        self._send_ctrl(conn, msg, room, sroom)
        # Each message goes out as its iov rows, read in place by UCX. Measured
        # alternative (2-core host, 8k/32k tokens of scattered 4 KiB pages): gathering
        # each message into a contiguous staging buffer on the sender first (torch
        # index_select, then one contiguous zero-copy message) was 2x slower (41 vs
        # 18 ms, 92 vs 64 ms), and also scattering out of a bounce buffer on the
        # receiver 5-7x slower: UCX's iov rendezvous already copies page by page
        # without the extra pass over the bytes.
        # Also measured and not kept (same bench, old and new alternated in one
        # session, 2 cores; UCX_PROTO_INFO shows every iov message, either side, goes
        # "fragmented copy-in copy-out" over sysv, contiguous ones cma zero-copy):
        # * merging address-adjacent rows (sender by source, receiver by destination,
        #   after authorization): head-sliced 8k/32k 0.46/0.44x whole-page with it vs
        #   0.47-0.48/0.43x without -- the fragmented copy does not care how many
        #   entries feed it;
        # * staging strided head slices with one numpy strided copy per run, sent
        #   contiguously: 32k head-sliced 35 ms vs 28 ms without (the extra pass);
        # * one contiguous message per op (iov_max=1; cma zero-copy each): 8k/32k
        #   contiguous 19/62 ms vs 6.7/24 ms as iov messages;
        # * the receiver pulling with process_vm_readv itself (one-copy, iov on both
        #   sides, after authorizing), in a standalone test: 12 MiB as 48 pieces
        #   0.49 ms (UCX's iov path: ~0.8 ms), 96/384 MiB contiguous 5.9/23.8 ms (about
        #   the same as UCX), random 4 KiB pages 4.5-5.4 GB/s (the kernel pins every
        #   piece; UCX: ~8). A second, same-host-only data path for ~0.3 ms at 1k
        #   tokens was not worth its failure modes;
        # * progress_spin_s 0.5/2 ms: 1k/8k no faster (the peer loses the core).
        k = 0
        for i, c in enumerate(plan.counts):
            self._send(conn, plan.iov[k : k + c], data_tag(conn.remote_id, first + i), room, sroom, plan.iov)
            k += c
        sroom.kv_bytes += plan.nbytes

    # -- replies (sender) ----------------------------------------------------------------
    def _on_reply(self, msg: bytes) -> None:
        typ, local_id, _seq = COMMON.unpack_from(msg)
        conn = self._send_by_local.get(local_id)
        if conn is None:
            return
        body = msg[COMMON.size :]
        if typ in (HELLO_OK, HELLO_REFUSED):
            if typ == HELLO_OK:
                remote_id, n = HELLO_OK_BODY.unpack_from(body)
                rid = body[HELLO_OK_BODY.size : HELLO_OK_BODY.size + n].decode()
                ok = rid == conn.desc.instance_id
                result = (ok, remote_id, "" if ok else f"answered as instance {rid}")
            else:
                result = (False, 0, body.decode(errors="replace"))
            if conn.hello is not None and not conn.hello.done():
                conn.hello.set_result(result)
            return
        (room,) = ROOM_BODY.unpack_from(body)
        if room not in conn.rooms:
            return
        if typ == ACK:
            self.rooms.set(room, KVPoll.SUCCESS)
        elif typ == NACK:
            _, code = NACK_BODY.unpack_from(body)
            reason = body[NACK_BODY.size :].decode(errors="replace")
            self.rooms.fail(room, f"receiver rejected room {room}: {reason}", Refusal.from_code(code))

    # -- receiver --------------------------------------------------------------------
    def advertise(self, grant: RoomGrant) -> None:
        if self._closed:
            raise TransportError("rdma transport is closed")
        self._recv_rooms[grant.room] = _RecvRoom(self._recv.advertise(grant))

    def _reply(self, conn: _RecvConn, typ: int, body: bytes) -> None:
        msg = COMMON.pack(typ, conn.sender_local, 0) + body
        buf = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
        token_box: list[int] = []

        def done(status: int, length: int, tag: int) -> None:
            if token_box:
                conn.tokens.discard(token_box[0])

        try:
            token_box.append(self._worker.send(conn.ep, [(buf.data_ptr(), len(msg))], ctrl_tag(KIND_REPLY), done, buf))
            conn.tokens.add(token_box[0])
        except UcxError as exc:
            log.warning("rdma: reply to sender %s failed: %s", conn.sender_id, exc)

    def _nack(self, conn: _RecvConn | None, room: int, reason: str, refusal: Refusal | None = None) -> None:
        rr = self._recv_rooms.get(room)
        if rr is not None:
            if rr.nacked:
                return
            rr.nacked = True
        if conn is not None:
            self._reply(conn, NACK, NACK_BODY.pack(room, int(refusal or 0)) + reason.encode()[:4096])

    def _on_ctrl(self, msg: bytes) -> None:
        typ, conn_id, seq = COMMON.unpack_from(msg)
        if typ == HELLO:
            self._on_hello(conn_id, msg[COMMON.size :])
            return
        conn = self._recv_conns.get(conn_id)
        if conn is None:
            # Unknown or dropped connection (its peer was failed): drain its payload
            # so it cannot linger, answer nothing.
            if typ == WRITE:
                self._drain_write(conn_id, msg)
            return
        if seq != conn.next_seq:
            if seq > conn.next_seq:
                conn.early[seq] = msg
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

    def _on_hello(self, sender_local: int, body: bytes) -> None:
        ns, nt, na = HELLO_BODY.unpack_from(body)
        off = HELLO_BODY.size
        sender_id = body[off : off + ns].decode()
        target = body[off + ns : off + ns + nt].decode()
        addr = body[off + ns + nt : off + ns + nt + na]
        if self._liveness.peer_info(sender_id) != addr:
            # Only a sender whose liveness link is up, announcing this same worker
            # address, gets an endpoint (and a reply); anything else is dropped.
            log.warning("rdma: HELLO from %s ignored: no live liveness link announcing its worker address", sender_id)
            return
        try:
            ep = self._worker.endpoint(addr)
        except UcxError as exc:
            log.warning("rdma: cannot answer HELLO from %s: %s", sender_id, exc)
            return
        conn_id = next(self._conn_ids) & ((1 << CONN_BITS) - 1)
        conn = _RecvConn(conn_id, sender_id, sender_local, ep)
        if target != self.instance_id:
            self._reply(conn, HELLO_REFUSED, f"this is instance {self.instance_id}, not {target}".encode())
            self._worker.drop_endpoint(ep)  # the reply is flushed by the bounded close
            return
        self._recv_conns[conn_id] = conn
        rid = self.instance_id.encode()
        self._reply(conn, HELLO_OK, HELLO_OK_BODY.pack(conn_id, len(rid)) + rid)

    @staticmethod
    def _parse_write(msg: bytes) -> tuple[int, int, list[int], np.ndarray]:
        """(room, first data seq, ops per data message, op table) of a WRITE."""
        room, first, n_msgs, n_ops = WRITE_BODY.unpack_from(msg, COMMON.size)
        off = COMMON.size + WRITE_BODY.size
        if n_msgs > n_ops or len(msg) < off + 4 * n_msgs + OP_DTYPE.itemsize * n_ops:
            raise ValueError("WRITE is shorter than its op table")
        counts = np.frombuffer(msg, dtype="<u4", count=n_msgs, offset=off).tolist()
        off += 4 * n_msgs
        if sum(counts) != n_ops or (n_msgs and min(counts) == 0):
            raise ValueError("WRITE op table does not match its counts")
        ops = np.frombuffer(msg, dtype=OP_DTYPE, count=n_ops, offset=off)
        return room, first, counts, ops

    def _drain(self, conn_id: int, tag_or_seq: int) -> None:
        """Receive (and drop) one data message into scratch: keeps UCX's unexpected
        queue from filling with payload nobody will take; the pool is never touched."""
        def done(status: int, length: int, tag: int) -> None:
            pass

        with contextlib.suppress(UcxError):
            tag = tag_or_seq if tag_or_seq >> KIND_SHIFT == KIND_DATA else data_tag(conn_id, tag_or_seq)
            self._worker.recv([(self._scratch.data_ptr(), SCRATCH)], tag, FULL_MASK, done, self._scratch)

    def _drain_write(self, conn_id: int, msg: bytes) -> None:
        with contextlib.suppress(struct.error, ValueError):
            _room, first, counts, _ops = self._parse_write(msg)
            for i in range(len(counts)):
                self._drain(conn_id, first + i)

    def _on_write(self, conn: _RecvConn, msg: bytes) -> None:
        room, first, counts, ops = self._parse_write(msg)
        try:
            self._recv.accept(room, conn.sender_id, ops["region"], ops["offset"], ops["length"])
        except UnauthorizedWrite as exc:
            for i in range(len(counts)):
                self._drain(conn.conn_id, first + i)
            self._nack(conn, room, str(exc), exc.refusal)
            return
        rr = self._recv_rooms[room]
        conn.rooms.add(room)
        # iov rows {destination address, length}: every byte goes straight into the
        # granted pages, which _authorize has just checked.
        iov = np.empty((len(ops), 2), dtype=np.uint64)
        iov[:, 0] = self._ptr_table[ops["region"].astype(np.int64)] + ops["offset"]
        iov[:, 1] = ops["length"]
        k = 0
        for i, c in enumerate(counts):
            rows = iov[k : k + c]
            self._post_data(conn, room, rr, rows, int(rows[:, 1].sum()), data_tag(conn.conn_id, first + i), iov)
            k += c

    def _post_data(self, conn: _RecvConn, room: int, rr: _RecvRoom, pieces: np.ndarray, nbytes: int,
                   tag: int, keep: Any) -> None:
        token_box: list[int] = []

        def done(status: int, length: int, _tag: int) -> None:
            token = token_box[0]
            conn.tokens.discard(token)
            rr.tokens.discard(token)
            rr.pending[conn.conn_id] -= 1
            if status == UCS_ERR_CANCELED:
                if rr.released and conn.conn_id in self._recv_conns:
                    self._drain(conn.conn_id, tag)  # the sender's message still comes
                return
            if status != UCS_OK or length != nbytes:
                why = "truncated" if status == UCS_ERR_MESSAGE_TRUNCATED else f"UCX status {status}"
                reason = f"payload for room {room} did not arrive intact ({why}, {length}/{nbytes} bytes)"
                self.rooms.fail(room, reason)
                self._nack(conn, room, reason)
                return
            self._recv.landed(room, rr.core, nbytes)

        rr.pending[conn.conn_id] = rr.pending.get(conn.conn_id, 0) + 1
        try:
            token = self._worker.recv(pieces, tag, FULL_MASK, done, keep)
        except UcxError as exc:
            rr.pending[conn.conn_id] -= 1
            self.rooms.fail(room, f"cannot post a UCX receive for room {room}: {exc}")
            return
        token_box.append(token)
        conn.tokens.add(token)
        rr.tokens.add(token)

    def _on_meta(self, conn: _RecvConn, msg: bytes) -> None:
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
        flat = self._regions[region_id].flat

        def commit() -> None:  # every page the sender wrote before the row has landed: now the row
            flat[offset : offset + len(row)].copy_(torch.frombuffer(bytearray(row), dtype=torch.uint8))

        self._recv.stage_metadata(room, core, kv_bytes, commit=commit,
                                  ack=functools.partial(self._ack, conn.conn_id, room))

    def _ack(self, conn_id: int, room: int) -> None:
        conn = self._recv_conns.get(conn_id)
        if conn is not None:  # not lost meanwhile (its endpoint would be gone)
            self._reply(conn, ACK, ROOM_BODY.pack(room))

    async def drain(self, room: int, timeout: float) -> bool:
        # A receive the receiver's UCX already matched completes into the pages it was
        # authorized for even after the receiver released the room; only the sender knows
        # when its sends are over (a released room's other data is drained to scratch
        # there, so these complete too, unless the peer hangs: then the timeout).
        sroom = self._send_rooms.get(room)
        deadline = time.monotonic() + timeout
        while sroom is not None and sroom.tokens:
            if time.monotonic() >= deadline:
                return False
            self._worker.kick()
            await asyncio.sleep(0.002)
        return True

    def release(self, room: int) -> None:
        rr = self._recv_rooms.pop(room, None)
        self._recv.release(room)
        if rr is not None:
            rr.released = True
        if rr is not None and rr.tokens:
            # Not-yet-matched receives are cancelled (their callbacks then see
            # UCS_ERR_CANCELED), so a late write can never land in pages that now
            # belong to someone else; the sender learns at once that it can stop.
            for token in list(rr.tokens):
                self._worker.cancel(token)
            open_room = room in self.rooms and not self.rooms.status(room).state.is_terminal
            why = self.rooms.release_reason(room)
            for conn_id in rr.pending:
                conn = self._recv_conns.get(conn_id)
                if conn is not None and open_room:
                    self._nack(conn, room, f"room {room} was released by the receiver" + (f": {why}" if why else ""),
                               Refusal.UNKNOWN_ROOM)
        sroom = self._send_rooms.pop(room, None)
        if sroom is not None:
            sroom.conn.rooms.discard(room)
        self.rooms.discard(room)

    # -- failures ------------------------------------------------------------------------
    def _on_lost(self, instance_id: str, reason: str) -> None:
        if instance_id in self._connecting:
            self._lost_while_connecting[instance_id] = reason
        self.fail_peer(instance_id, f"peer {instance_id} lost: {reason}")

    def fail_peer(self, instance_id: str, reason: str) -> None:
        conn = self._send_conns.pop(instance_id, None)
        if conn is not None:
            self._liveness.unwatch(instance_id)
            self._drop_send_conn(conn, reason)
        for rconn in [c for c in self._recv_conns.values() if c.sender_id == instance_id]:
            self._drop_recv_conn(rconn, reason)

    def _drop_send_conn(self, conn: _SendConn, reason: str = "connection dropped", *, peer_lost: bool = True) -> None:
        conn.dead = True
        self._send_by_local.pop(conn.local_id, None)
        for room in list(conn.rooms):
            self.rooms.fail(room, reason)
        for token in list(conn.tokens):
            self._worker.cancel(token)
        if conn.hello is not None and not conn.hello.done():
            conn.hello.set_result((False, 0, reason))
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

    def _drop_recv_conn(self, conn: _RecvConn, reason: str, *, peer_lost: bool = True) -> None:
        self._recv_conns.pop(conn.conn_id, None)
        for room in list(conn.rooms):
            self.rooms.fail(room, reason)
        for token in list(conn.tokens):
            self._worker.cancel(token)  # tag receives: UCX cancels these for real
        self._worker.drop_endpoint(conn.ep, force=peer_lost)
        conn.ep = None

    async def close(self) -> None:
        if self._closed:
            return
        self.rooms.fail_all("rdma transport closed")
        # Let sends already handed to UCX finish (bounded) while the peers still see us
        # alive: a rendezvous send completes only once the receiver fetched the bytes,
        # and a receiver that notices our liveness link close first cancels its
        # receive, leaving UCX holding the send (and the worker unreleasable). The
        # receiver posts a receive (or a drain) for every data message it was told
        # about, so live peers finish these in milliseconds; a hung one costs the bound.
        if self._started and self._loop is asyncio.get_running_loop():
            deadline = time.monotonic() + CLOSE_SEND_GRACE_S
            while any(c.tokens for c in self._send_conns.values() if not c.dead) and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
        for conn in list(self._send_conns.values()):
            self._drop_send_conn(conn, "rdma transport closed", peer_lost=False)
        self._send_conns.clear()
        for rconn in list(self._recv_conns.values()):
            self._drop_recv_conn(rconn, "rdma transport closed", peer_lost=False)
        await self._liveness.close()
        self._closed = True
        await self._worker.close()
        self._ctrl_bufs.clear()
        self._send_by_local.clear()
        self._send_rooms.clear()
        self._recv_rooms.clear()
        self._recv.clear()
        # UCX's worker and context (and their file descriptors) go away when the last
        # Python object pointing at them does; completion closures form reference
        # cycles, so collect them now rather than at some later GC.
        gc.collect()
