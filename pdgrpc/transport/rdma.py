"""``rdma``: KV pages over UCX (its C API, see :mod:`.ucx`), straight into the destination tensors.

Endpoints are created from the peer's **UCX worker address**, which travels in the
descriptor (``Descriptor.endpoint``). That lets UCX choose the best path per peer: shared
memory between processes on one host (sysv/posix eager, cma zero-copy rendezvous) and
RDMA verbs between hosts when UCX was built with them. Endpoint error handling is off
(it would force UCX off the fast shared-memory transports), so peer death is detected by
:mod:`pdgrpc.transport.liveness` (a heartbeat side channel whose address is
``Descriptor.liveness``) and routed into :meth:`RdmaTransport.fail_peer`, which cancels
the pending UCX requests of that peer.

Wire format: :mod:`.rdma_wire`. This class holds the UCX worker, the liveness channel and
the registered regions (:mod:`.rdma_regions`), and delegates to a sender
(:mod:`.rdma_send`) and a receiver (:mod:`.rdma_recv`: authorization, metadata last).

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
  (:mod:`pdgrpc.transport.ucx_quiet`);
* ``write_ahead`` (1; 0: off): ``prepare_write`` sends its WRITEs at once, so the
  receiver checks them and posts its receives while the sender's data is computed
  (``WRITE_AHEAD`` in :mod:`pdgrpc.transport.rdma_wire`); off, the WRITEs go with the data;
* ``pack`` (auto; always, never) and ``pack_max`` (256 MiB): a data message of many
  ranges in GPU memory travels as one contiguous device buffer, gathered before the
  send and scattered after the receive, within ``pack_max`` bytes of such buffers per
  side (:mod:`pdgrpc.transport.rdma_pack`); ``always`` packs host memory too.

UCX reads its usual ``UCX_*`` variables; nothing is forced. Leave ``UCX_MM_SEG_SIZE`` at
its default: raised to 64K, UCX 1.21 completes every iov receive over shared memory as
truncated (the rooms fail cleanly, "did not arrive intact", but none succeeds; see
docs/transports.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import struct
import time
from typing import Any, Awaitable, Callable, Sequence

from pdgrpc.errors import ConfigError, TransportError
from pdgrpc.transport.ucx import UCS_ERR_CANCELED, UCS_OK, UcxWorker
from pdgrpc.transport.base import BadDescriptor, Descriptor, MemoryRegion, Peer, RoomGrant, Transport, WriteOp
from pdgrpc.transport.liveness import Liveness
from pdgrpc.transport.rdma_pack import PACK_MAX, Pack, Packer
from pdgrpc.transport.rdma_recv import RdmaReceiver
from pdgrpc.transport.rdma_regions import Regions
from pdgrpc.transport.rdma_send import RdmaSender
from pdgrpc.transport.rdma_wire import (
    CLOSE_SEND_GRACE_S, CTRL_BUF, CTRL_POSTED, KIND_CTRL, KIND_MASK, KIND_REPLY, MAX_OPS_PER_WRITE, SWEEP_S, ctrl_tag,
)
from pdgrpc.transport.rooms import after_acks

log = logging.getLogger("pdgrpc.transport.rdma")


class RdmaTransport(Transport):
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
        pack: str = "auto",
        pack_max: int = PACK_MAX,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ConfigError(
                f"rdma transport: unknown option(s) {', '.join(sorted(unknown))}; known: zero_copy_min, contiguous_min, iov_max, "
                "connect_timeout, liveness_interval, liveness_lease, host, progress_spin_s, quiet_sends, write_ahead, "
                "pack, pack_max"
            )
        if zero_copy_min < 1 or not 1 <= iov_max <= MAX_OPS_PER_WRITE:
            raise ConfigError(f"rdma: need zero_copy_min >= 1 and 1 <= iov_max <= {MAX_OPS_PER_WRITE}, got {zero_copy_min}, {iov_max}")
        if connect_timeout <= 0:
            raise ConfigError(f"rdma: connect_timeout must be > 0, got {connect_timeout}")
        if contiguous_min < 0:
            raise ConfigError(f"rdma: contiguous_min must be >= 0 (0: never), got {contiguous_min}")
        if progress_spin_s < 0:
            raise ConfigError(f"rdma: progress_spin_s must be >= 0, got {progress_spin_s}")
        if quiet_sends not in (0, 1):  # True, False, or the 0 / 1 of --option quiet_sends=N
            raise ConfigError(f"rdma: quiet_sends must be 1 (on) or 0 (off), got {quiet_sends!r}")
        if write_ahead not in (0, 1):
            raise ConfigError(f"rdma: write_ahead must be 1 (on) or 0 (off), got {write_ahead!r}")
        mode = Pack.parse(pack)
        # raises TransportUnavailable (with the install hint)
        self._worker = UcxWorker(spin_s=progress_spin_s, quiet_sends=bool(quiet_sends), on_progress=self._sweep_soon)
        self._liveness = Liveness(self.instance_id, self._on_lost, info=self._worker.address, host=host,
                                  interval=liveness_interval, lease=liveness_lease, key=self.auth_key,
                                  credential_for=self.credential_for, writers=self.writers)
        self._regions = Regions()
        self._packer = packer = Packer(self._regions, mode, int(pack_max))
        self._sender = RdmaSender(
            self._worker, self.rooms, self._regions, self._liveness, instance_id=self.instance_id,
            require_credential=self.require_credential, fail_peer=self.fail_peer,
            zero_copy_min=int(zero_copy_min), contiguous_min=int(contiguous_min) or None, iov_max=int(iov_max),
            connect_timeout=float(connect_timeout), write_ahead=bool(write_ahead), packer=packer)
        self._receiver = RdmaReceiver(self._worker, self.rooms, self._regions, self._liveness,
                                      instance_id=self.instance_id, verify_proof=self.verify_proof,
                                      room_writers=self.room_writers, packer=packer)
        # the write path's steps, bound once
        self._plan = self._sender.plan
        self._announce = self._sender.announce
        self._send_planned = self._sender.send_planned
        self._send_announced = self._sender.send_announced
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closed = False
        self._sweeper: asyncio.TimerHandle | None = None
        self._swept = 0  # stray messages dropped from UCX's unexpected queue
        self._swept_warned = False
        self._ctrl_bufs: list[ctypes.Array[ctypes.c_char]] = []
        self._ctrl_posted = {KIND_CTRL: 0, KIND_REPLY: 0}  # control receives posted now, per kind

    # -- diagnostics (its parts, for tests) -------------------------------------------
    @property
    def sender(self) -> RdmaSender:
        return self._sender

    @property
    def receiver(self) -> RdmaReceiver:
        return self._receiver

    @property
    def worker(self) -> UcxWorker:
        return self._worker

    @property
    def pending_requests(self) -> int:
        """UCX requests this transport still waits on, besides the always-posted control
        receives (a diagnostic: 0 on an idle transport, and again once a failed peer's
        requests were cancelled — receives by ``ucp_request_cancel``, sends by a forced
        endpoint close or, for rendezvous sends UCX keeps, by abandoning them)."""
        return max(0, self._worker.inflight_requests - sum(self._ctrl_posted.values()))

    @property
    def packed_bytes(self) -> int:
        """Bytes of packed data-message buffers alive now, both directions (a diagnostic:
        back to 0 once every transfer finished; :mod:`pdgrpc.transport.rdma_pack`)."""
        return self._packer.in_use

    def receives_posted(self, room: int) -> int:
        """Data receives posted for ``room`` that have not completed (a diagnostic: a
        write announced ahead by ``prepare_write`` has them up before its bytes exist)."""
        return self._receiver.receives_posted(room)

    @property
    def stray_messages(self) -> int:
        """Messages dropped from UCX's unexpected queue that were for nobody here (a kind
        the protocol does not use, or data of no connection): see ``RdmaReceiver.sweep``."""
        return self._swept

    @property
    def worker_address(self) -> bytes:
        """This instance's UCX worker address (what peers create endpoints from)."""
        return self._worker.address

    # -- start and the control inbox ----------------------------------------------------
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

    def _sweep_soon(self) -> None:
        """UCX did something: a stray message may have arrived, so sweep within SWEEP_S.
        Nothing arrives at a worker that does not progress, so an idle one never sweeps
        (and never wakes for it); the receives a sweep posts progress in turn, so a
        queue holding more than SWEEP_MAX is swept again."""
        if self._sweeper is None and not self._closed and self._loop is not None:
            self._sweeper = self._loop.call_later(SWEEP_S, self._sweep_tick)

    def _sweep_tick(self) -> None:
        self._sweeper = None
        if self._closed:
            return
        dropped = self._receiver.sweep()
        if dropped:
            self._swept += dropped
            if not self._swept_warned:
                self._swept_warned = True
                log.warning("rdma: dropped %d stray UCX messages that no connection of this transport sent "
                            "(counted in stray_messages; warned once)", dropped)

    def _post_ctrl(self, kind: int, buf: ctypes.Array[ctypes.c_char]) -> None:
        """Keep a control receive of ``kind`` posted into ``buf``: CTRL messages go to the
        receiver, REPLY messages to the sender."""
        if self._closed:
            return
        address = ctypes.addressof(buf)
        handle = self._receiver.on_ctrl if kind == KIND_CTRL else self._sender.on_reply

        def done(status: int, length: int, tag: int) -> None:
            # A sender's ACK and a receiver's metadata row are handled here, each on the
            # way to an ACK, so the message is copied out of the buffer once and handled
            # at once. The receive goes up again after the ACKs that handling led to,
            # except in a burst that has taken half the posted receives: then at once,
            # since the burst's other messages wait in UCX until a receive is posted.
            self._ctrl_posted[kind] -= 1
            if status == UCS_ERR_CANCELED or self._closed:
                return
            if status == UCS_OK:
                try:
                    handle(ctypes.string_at(address, length))
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

    # -- the contract --------------------------------------------------------------------
    async def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        self._ensure_started()
        for r in regions:
            self._receiver.add_region(self._regions.add(r))
        await self._liveness.start()
        return Descriptor(self.name, self.instance_id, self._worker.address,
                          tuple(r.info for r in self._regions.by_id.values()), self._liveness.address).to_bytes()

    async def connect(self, descriptor: bytes) -> Peer:
        self._ensure_started()
        d = Descriptor.from_bytes(descriptor)
        if d.backend != self.name:
            raise BadDescriptor(f"descriptor is for transport {d.backend!r}, this is {self.name!r}")
        return await self._sender.connect(d)

    def advertise(self, grant: RoomGrant) -> None:
        if self._closed:
            raise TransportError("rdma transport is closed")
        self._receiver.advertise(grant)

    async def write(self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None) -> None:
        self._ensure_started()
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
        self._ensure_started()
        plans = self._plan(room, ops, metadata)
        announced = self._announce(peer, room, plans)
        send_planned, send_announced = self._send_planned, self._send_announced

        async def send() -> None:
            if announced is None:
                send_planned(peer, room, plans, metadata)
            else:
                send_announced(peer, room, announced, metadata)

        return send

    async def drain(self, room: int, timeout: float) -> bool:
        return await self._sender.drain(room, timeout)

    def release(self, room: int) -> None:
        self._receiver.release(room)
        self._sender.release(room)
        self.rooms.discard(room)

    def writer_gone(self, writer_id: str) -> bool:
        """The writer proved itself on a liveness link, every such link ended from its side
        (EOF: its process is gone), its UCX endpoints here were force-closed and every
        receive posted for it completed, was cancelled, or was abandoned as one only the
        dead writer could complete (RdmaReceiver.holds_nothing_of): nothing of it can
        still land."""
        return self.writers.gone(writer_id) and self._receiver.holds_nothing_of(writer_id, time.monotonic())

    def _on_lost(self, instance_id: str, reason: str) -> None:
        self._sender.peer_lost(instance_id, reason)
        self.fail_peer(instance_id, f"peer {instance_id} lost: {reason}")

    def fail_peer(self, instance_id: str, reason: str) -> None:
        self._sender.drop_peer(instance_id, reason)
        self._receiver.drop_peer(instance_id, reason)

    async def close(self) -> None:
        if self._closed:
            return
        self.rooms.fail_all("rdma transport closed")
        # Sends already handed to UCX finish (bounded) while the peers still see us alive.
        if self._started and self._loop is asyncio.get_running_loop():
            await self._sender.settle(CLOSE_SEND_GRACE_S)
        self._sender.close("rdma transport closed")
        self._receiver.close("rdma transport closed")
        await self._liveness.close()
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self._worker.close()
        self._ctrl_bufs.clear()
        self._receiver.clear()
        # UCX's worker and context (and their file descriptors) go away when the last
        # Python object pointing at them does; completion closures form reference
        # cycles, so collect them now rather than at some later GC.
        gc.collect()
