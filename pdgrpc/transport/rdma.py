"""``rdma``: KV pages over UCX (its C API, see :mod:`._ucx`), straight into the destination tensors.

Endpoints are created from the peer's **UCX worker address**, which travels in the
descriptor (``Descriptor.endpoint``). That lets UCX choose the best path per peer: shared
memory between processes on one host (sysv/posix eager, cma zero-copy rendezvous) and
RDMA verbs between hosts when UCX was built with them. Endpoint error handling is off
(it would force UCX off the fast shared-memory transports), so peer death is detected by
:mod:`pdgrpc.transport.liveness` (a heartbeat side channel whose address is
``Descriptor.liveness``) and routed into :meth:`RdmaTransport.fail_peer`, which cancels
the pending UCX requests of that peer.

Wire format: :mod:`.rdma_wire`. Receiver side (authorization, metadata last): :mod:`.rdma_recv`.

Peer failure: the liveness channel closes within milliseconds when a peer process dies
(its kernel closes the socket) and misses heartbeats if a host hangs; either way every
non-terminal room of that peer fails, its pending UCX requests are cancelled, its
endpoint is dropped, and the next ``connect`` builds a fresh one. Connections are keyed
by the peer's instance id (a fresh id per process start), so a restarted peer never
gets a cached endpoint.

Options (seconds, bytes, counts):

* ``zero_copy_min`` (16 MiB): a data message closes once its ops reach this size;
* ``contiguous_min`` (256 KiB; 0: never): an op of at least this many bytes travels as
  a contiguous message of its own. On one host UCX moves it with one ``process_vm_readv``
  by the receiver (cma); an iov message goes as copy-in copy-out through shared memory,
  which needs both processes on a core at once and collapses on a busy host;
* ``iov_max`` (4096): ops per data message; ``connect_timeout`` (5);
* ``liveness_interval`` / ``liveness_lease`` (0.5 / 5): a peer that dies is noticed in
  milliseconds (its kernel closes the liveness socket); the lease catches a hung peer
  and must outlast the longest time either side's loop can be busy;
* ``host`` (127.0.0.1): the liveness listen address, advertised to peers;
* ``progress_spin_s`` (0): busy-polling after the last completion while a transfer is
  pending; on a host whose cores are all busy any spin steals the peer's CPU;
* ``quiet_sends`` (1; 0: off): while a large write's data is being read, the sender
  polls once per loop tick instead of asking to be woken for every message the
  receiver has read, which spares the receiver one wake-up signal per message
  (:mod:`pdgrpc.transport._ucx_quiet`);
* ``write_ahead`` (1; 0: off): ``prepare_write`` sends its WRITEs at once, so the
  receiver checks them and posts its receives while the sender's data is computed
  (``WRITE_AHEAD`` in :mod:`pdgrpc.transport.rdma_wire`); off, the WRITEs go with the data.

UCX reads its usual ``UCX_*`` variables; nothing is forced. Leave ``UCX_MM_SEG_SIZE`` at
its default: raised to 64K, UCX 1.21 completes every iov receive over shared memory as
truncated (the rooms fail cleanly, "did not arrive intact", but none succeeds; see
docs/transports.md).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import gc
import logging
import struct
import time
from typing import Any, Sequence

import numpy as np
import torch

from pdgrpc.errors import ConfigError, PeerFailure, TransportError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport._ucx import UCS_ERR_CANCELED, UCS_OK, UcxError, UcxWorker
from pdgrpc.transport.base import (
    BadDescriptor, Descriptor, MemoryRegion, Peer, RegionInfo, Transport,
)
from pdgrpc.transport import peerauth
from pdgrpc.transport.liveness import Liveness
from pdgrpc.transport.rdma_recv import RdmaReceiver
from pdgrpc.transport.rdma_send import RdmaSender
from pdgrpc.transport.rdma_wire import (
    COMMON, CTRL_BUF, CTRL_POSTED, HELLO, HELLO_BODY, HELLO_OK, HELLO_OK_BODY, HELLO_REFUSED, KIND_CTRL, KIND_MASK,
    KIND_REPLY, MAX_OPS_PER_WRITE, SWEEP_S, NACK, NACK_BODY, ROOM_BODY, SCRATCH, ACK, CLOSE_SEND_GRACE_S, HELLO_CHANNEL, ctrl_tag,
    RecvConn, RecvRoom, Region, SendConn, SendRoom, new_id,
)
from pdgrpc.transport.receiver import Receiver, Refusal
from pdgrpc.transport.rooms import after_acks

log = logging.getLogger("pdgrpc.transport.rdma")


class RdmaTransport(RdmaSender, RdmaReceiver, Transport):
    """The ``rdma`` backend (UCX). See the module docstring."""

    name = "rdma"

    def __init__(
        self,
        *,
        zero_copy_min: int = 16 << 20,
        contiguous_min: int = 256 << 10,
        iov_max: int = 4096,
        connect_timeout: float = 5.0,
        liveness_interval: float = 0.5,
        liveness_lease: float = 5.0,
        host: str = "127.0.0.1",
        progress_spin_s: float = 0.0,
        quiet_sends: bool | int = True,
        write_ahead: bool | int = True,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ConfigError(
                f"rdma transport: unknown option(s) {', '.join(sorted(unknown))}; known: zero_copy_min, contiguous_min, iov_max, "
                "connect_timeout, liveness_interval, liveness_lease, host, progress_spin_s, quiet_sends, write_ahead"
            )
        if zero_copy_min < 1 or not 1 <= iov_max <= MAX_OPS_PER_WRITE:
            raise ConfigError(f"rdma: need zero_copy_min >= 1 and 1 <= iov_max <= {MAX_OPS_PER_WRITE}, got {zero_copy_min}, {iov_max}")
        if connect_timeout <= 0:
            raise ConfigError(f"rdma: connect_timeout must be > 0, got {connect_timeout}")
        if contiguous_min < 0:
            raise ConfigError(f"rdma: contiguous_min must be >= 0 (0: never), got {contiguous_min}")
        self._zc_min = int(zero_copy_min)
        self._contiguous_min = int(contiguous_min) or None
        self._iov_max = int(iov_max)
        self._connect_timeout = float(connect_timeout)
        if progress_spin_s < 0:
            raise ConfigError(f"rdma: progress_spin_s must be >= 0, got {progress_spin_s}")
        if quiet_sends not in (0, 1):  # True, False, or the 0 / 1 of --option quiet_sends=N
            raise ConfigError(f"rdma: quiet_sends must be 1 (on) or 0 (off), got {quiet_sends!r}")
        if write_ahead not in (0, 1):
            raise ConfigError(f"rdma: write_ahead must be 1 (on) or 0 (off), got {write_ahead!r}")
        self._write_ahead = bool(write_ahead)
        # raises TransportUnavailable (with the install hint)
        self._worker = UcxWorker(spin_s=progress_spin_s, quiet_sends=bool(quiet_sends))
        self._liveness = Liveness(self.instance_id, self._on_lost, info=self._worker.address, host=host,
                                  interval=liveness_interval, lease=liveness_lease, key=self.auth_key,
                                  credential_for=self.credential_for, writers=self.writers)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._regions: dict[int, Region] = {}
        # region id -> base address / size in bytes (-1: not registered), for vectorised lookups
        self._ptr_table = np.zeros(1 << 16, dtype=np.uint64)
        self._size_table = np.full(1 << 16, -1, dtype=np.int64)
        self._infos: dict[int, RegionInfo] = {}
        self._started = False
        self._closed = False
        # sender side
        self._send_conns: dict[str, SendConn] = {}  # peer instance id -> connection
        self._send_by_local: dict[int, SendConn] = {}
        self._connecting: dict[str, asyncio.Future[None]] = {}
        self._lost_while_connecting: dict[str, str] = {}
        self._send_rooms: dict[int, SendRoom] = {}
        # receiver side
        self._recv_conns: dict[int, RecvConn] = {}
        self._recv_rooms: dict[int, RecvRoom] = {}
        self._draining: list[RecvConn] = []
        self._recv = Receiver(self.rooms)
        self._dropped: collections.OrderedDict[int, int] = collections.OrderedDict()  # conn id -> key
        self._sweeper: asyncio.TimerHandle | None = None
        self._swept = 0  # stray messages dropped from UCX's unexpected queue
        self._swept_warned = False
        self._scratch = torch.empty(SCRATCH, dtype=torch.uint8)
        self._ctrl_bufs: list[ctypes.Array[ctypes.c_char]] = []
        self._ctrl_posted = {KIND_CTRL: 0, KIND_REPLY: 0}  # control receives posted now, per kind

    # -- descriptor ----------------------------------------------------------------------
    @property
    def pending_requests(self) -> int:
        """UCX requests this transport still waits on, besides the always-posted control
        receives (a diagnostic: 0 on an idle transport, and again once a failed peer's
        requests were cancelled — receives by ``ucp_request_cancel``, sends by a forced
        endpoint close or, for rendezvous sends UCX keeps, by abandoning them)."""
        return max(0, self._worker.inflight_requests - sum(self._ctrl_posted.values()))

    def receives_posted(self, room: int) -> int:
        """Data receives posted for ``room`` that have not completed (a diagnostic: a
        write announced ahead by ``prepare_write`` has them up before its bytes exist)."""
        rr = self._recv_rooms.get(room)
        return 0 if rr is None else sum(rr.pending.values())

    @property
    def stray_messages(self) -> int:
        """Messages dropped from UCX's unexpected queue that were for nobody here (a kind
        the protocol does not use, or data of no connection): see ``_sweep``."""
        return self._swept

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
                    buf = ctypes.create_string_buffer(CTRL_BUF)
                    self._ctrl_bufs.append(buf)
                    self._post_ctrl(kind, buf)
            self._sweeper = loop.call_later(SWEEP_S, self._sweep_tick)

    def _sweep_tick(self) -> None:
        if self._closed:
            return
        dropped = self._sweep()
        if dropped:
            self._swept += dropped
            if not self._swept_warned:
                self._swept_warned = True
                log.warning("rdma: dropped %d stray UCX messages that no connection of this transport sent "
                            "(counted in stray_messages; warned once)", dropped)
        self._sweeper = self._loop.call_later(SWEEP_S, self._sweep_tick) if self._loop is not None else None

    def _post_ctrl(self, kind: int, buf: ctypes.Array[ctypes.c_char]) -> None:
        if self._closed:
            return
        address = ctypes.addressof(buf)

        def done(status: int, length: int, tag: int) -> None:
            # A sender's ACK and a receiver's row are handled here, each on the way to an
            # ACK: on a host whose caches the data just flushed every object touched
            # costs, so the message is one copy out of the buffer, and the receive goes up
            # again after the ACK; at once in a burst
            # that has taken half of them, whose messages wait in UCX until it does.
            self._ctrl_posted[kind] -= 1
            if status == UCS_ERR_CANCELED or self._closed:
                return
            if status == UCS_OK:
                try:
                    (self._on_ctrl if kind == KIND_CTRL else self._on_reply)(ctypes.string_at(address, length))
                except (struct.error, ValueError, UnicodeDecodeError) as exc:
                    log.warning("rdma: dropped a malformed control message: %r", exc)
            else:
                log.warning("rdma: control receive failed with UCX status %d", status)
            if self._ctrl_posted[kind] >= CTRL_POSTED // 2:
                after_acks(self._post_ctrl, kind, buf)
            else:
                self._post_ctrl(kind, buf)

        self._worker.recv([(address, CTRL_BUF)], ctrl_tag(kind), KIND_MASK, done, buf, background=True)
        self._ctrl_posted[kind] += 1

    async def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        self._ensure_started()
        for r in regions:
            if r.region_id in self._regions:
                raise ConfigError(f"region_id {r.region_id} ({r.name!r}) is already registered")
            reg = self._regions[r.region_id] = Region(r)
            self._ptr_table[r.region_id] = reg.ptr
            self._size_table[r.region_id] = reg.info.nbytes
            self._infos[r.region_id] = reg.info
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

    async def _handshake(self, d: Descriptor) -> SendConn:
        # Liveness first: a dead peer's port refuses at once, before any UCX endpoint
        # is pointed at a worker that no longer exists, and the live peer tells us its
        # worker address, which must be the descriptor's.
        cred = self.require_credential(d.instance_id)
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
        conn = SendConn(new_id(32, self._send_by_local), d, ep)
        self._send_by_local[conn.local_id] = conn
        conn.hello = asyncio.get_running_loop().create_future()
        sid, tid = self.instance_id.encode(), d.instance_id.encode()
        addr = self._worker.address
        # Bound to the proven liveness link: the proof answers that link's challenge.
        proof = peerauth.proof(cred, HELLO_CHANNEL,
                               self._liveness.challenge_of(d.instance_id), self.instance_id, d.instance_id)
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
                self._drop_send_conn(conn)
                self._liveness.unwatch(d.instance_id)

    # -- replies (sender) ----------------------------------------------------------------
    def _on_reply(self, msg: bytes) -> None:
        typ, local_id, _seq, key = COMMON.unpack_from(msg)
        conn = self._send_by_local.get(local_id)
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
            self.rooms.set(room, KVPoll.SUCCESS)
        elif typ == NACK:
            _, code = NACK_BODY.unpack_from(body)
            reason = body[NACK_BODY.size :].decode(errors="replace")
            self.rooms.fail(room, f"receiver rejected room {room}: {reason}", Refusal.from_code(code))

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

    def _drop_send_conn(self, conn: SendConn, reason: str = "connection dropped", *, peer_lost: bool = True) -> None:
        conn.dead = True
        self._send_by_local.pop(conn.local_id, None)
        for room in list(conn.rooms):
            self.rooms.fail(room, reason, peer_lost=peer_lost)
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
        if self._sweeper is not None:
            self._sweeper.cancel()
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
