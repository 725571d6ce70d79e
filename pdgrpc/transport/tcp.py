"""``tcp``: KV pages over plain TCP sockets, received straight into the destination
tensors.

Wire format (little-endian). Every frame starts with a fixed 32-byte header::

    type u8 | pad 3 | n_ops u32 | room u64 | payload_len u64 | aux u64

``WRITE`` and ``META`` frames follow it with an op table of ``n_ops`` 24-byte entries
(``region u16 | pad 6 | offset u64 | length u64``, destination side) and then the
payload: the ops' bytes back to back. Many ops travel in one frame, so scattered pages
still cost few messages; the sender gathers the source tensor slices with ``sendmsg``
and the receiver scatters the payload with ``recvmsg_into`` into memoryviews of the
destination tensors. Page payload never passes through an intermediate buffer. Ops
whose bytes continue one another on one side (a head-sliced transfer's whole pages on
the receiver, TP 1 -> TP 2, or on the sender, TP 2 -> TP 1) are gathered or scattered
as one buffer on that side, so one small op per page costs little more than its bytes.

The receiver authorizes a frame from its header and op table *before* reading its
payload: if any op falls outside what the room was granted, the payload is read into a
scratch buffer and dropped, the room fails with the reason, and the sender gets a
``NACK`` carrying it. A room released while its payload is arriving switches to
discarding the rest, so a late write never lands in reused pages.

Metadata ordering: a ``META`` frame carries ``aux`` = the number of KV bytes the sender
wrote for the room before it (over all connections to that peer). The receiver keeps
the small row aside and copies it into the slot only once that many KV bytes have
landed; then the room is ``SUCCESS`` and the sender gets an ``ACK``.

Liveness: a peer that exits or is killed closes its sockets (the kernel does it), which
the other side sees at once as EOF/reset; every non-terminal room involving that peer
fails. Each connection starts with the receiver's ``CHALLENGE`` (a fresh nonce) and the
sender's ``HELLO`` naming both instance ids and answering the nonce with a proof of the
credential the receiver issued to it (:mod:`pdgrpc.transport.peerauth`), so a restarted
peer listening on the same port is never mistaken for the old one, and a connection
that merely claims an instance id (ids are public) is refused and closed before it can
send a byte of data or affect anyone's rooms.

This module makes the sockets, holds the parts and ends them:
:mod:`~pdgrpc.transport.tcp_wire` (the frame format),
:mod:`~pdgrpc.transport.tcp_conn` (one connection),
:mod:`~pdgrpc.transport.tcp_send` and :mod:`~pdgrpc.transport.tcp_recv` (the two sides
of a transfer), :mod:`~pdgrpc.transport.tcp_limits` (bounds on connections) and
:mod:`~pdgrpc.transport.tcp_device` (device memory, staged).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from typing import Any, Sequence

from pdgrpc.errors import ConfigError, PeerFailure, TransportError
from pdgrpc.transport import peerauth
from pdgrpc.transport.base import BadDescriptor, Descriptor, MemoryRegion, Peer, RoomGrant, Transport, WriteOp
from pdgrpc.transport.tcp_conn import Conn, ConnEvents
from pdgrpc.transport.tcp_device import TcpDevice
from pdgrpc.transport.tcp_limits import RESOURCE_ERRNOS, AcceptGate, TcpLimits, tend
from pdgrpc.transport.tcp_recv import TcpReceiver
from pdgrpc.transport.tcp_send import TcpSender
from pdgrpc.transport.tcp_wire import HELLO, byte_view

__all__ = ["TcpTransport", "byte_view"]

log = logging.getLogger("pdgrpc.transport.tcp")


class TcpTransport(Transport):
    """Options: ``host`` to listen on (default 127.0.0.1), ``port`` (0: any),
    ``connections`` per peer (default 1), ``connect_timeout`` seconds (default 5),
    ``sockbuf`` socket buffer bytes (default 4 MiB; 0 keeps the OS default), and the
    bounds of :class:`~pdgrpc.transport.tcp_limits.TcpLimits`: ``hello_timeout``,
    ``max_connections`` and ``max_connections_per_peer`` (proven),
    ``max_connections_per_address`` and ``max_unproven_connections`` (before the
    proof: the oldest gives way to a new one), ``heartbeat_interval`` and
    ``heartbeat_lease`` (a peer that sends nothing, not even its heartbeat, for the lease
    is lost: a hung process fails its rooms within it). ``device`` (not an option: for
    tests) stages device regions in place of the default :class:`TcpDevice`.

    The work is done by :attr:`sender` (links to peers, writes) and :attr:`receiver`
    (accepted connections, grants); this class makes their sockets and delegates."""

    name = "tcp"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        connections: int = 1,
        connect_timeout: float = 5.0,
        sockbuf: int = 4 << 20,
        hello_timeout: float = TcpLimits.hello_timeout,
        max_connections: int = TcpLimits.max_connections,
        max_connections_per_address: int = TcpLimits.max_connections_per_address,
        max_unproven_connections: int = TcpLimits.max_unproven_connections,
        max_connections_per_peer: int = TcpLimits.max_connections_per_peer,
        heartbeat_interval: float = TcpLimits.heartbeat_interval,
        heartbeat_lease: float = TcpLimits.heartbeat_lease,
        device: TcpDevice | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigError(f"{self.name} transport: unknown option(s) {sorted(unknown)}")
        if connections < 1:
            raise ConfigError(f"{self.name} transport: connections must be >= 1, got {connections}")
        if device is not None and not isinstance(device, TcpDevice):
            raise ConfigError(f"{self.name} transport: device must be a TcpDevice, got {type(device).__name__}")
        self._limits = TcpLimits(hello_timeout, max_connections, max_connections_per_address, max_unproven_connections,
                                 heartbeat_interval, heartbeat_lease, max_connections_per_peer)
        super().__init__()
        self._gate = AcceptGate(self._limits)
        self._tick_handle: asyncio.TimerHandle | None = None
        self._last_tick = time.monotonic()
        self._host = host
        self._port = port
        self._connect_timeout = connect_timeout
        self._sockbuf = sockbuf
        self._bound_loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._endpoint = b""
        self._regions: dict[int, MemoryRegion] = {}
        self._views: dict[int, memoryview] = {}
        self._device = TcpDevice() if device is None else device
        self.receiver = TcpReceiver(self.rooms, self._views, self._device, self._gate, self.writers,
                                    self.room_writers, self.instance_id, self.verify_proof, self.name)
        self.sender = TcpSender(self.rooms, self._regions, self._views, self._device, self._dial, connections,
                                self.fail_peer, self.name)
        self._closed = False
    # -- socket hooks: public, for variants that make their sockets another way -------
    # (``examples/pdgrpc-unix`` overrides listen_socket and peer_address for AF_UNIX)
    def listen_socket(self) -> tuple[socket.socket, bytes]:
        """Create, bind and listen the socket peers connect to; return it and the
        endpoint bytes advertised in the descriptor (what :meth:`peer_address` parses on
        the other side). Called once, by the first :meth:`register`. Default: TCP on
        ``host:port``."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self._sockbuf:  # before listen: accepted sockets inherit it (and the window scale)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._sockbuf)
        s.bind((self._host, self._port))
        s.listen(128)
        host, port = s.getsockname()[:2]
        return s, f"{host}:{port}".encode()

    def peer_address(self, endpoint: bytes) -> tuple[int, Any]:
        """``(family, sockaddr)`` to connect to for a peer's endpoint bytes (untrusted:
        raise :class:`BadDescriptor` for anything malformed). Default: ``ip:port``, no
        DNS (no threads)."""
        host, _, port = endpoint.decode(errors="replace").rpartition(":")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
            return (socket.AF_INET6 if ip.version == 6 else socket.AF_INET), (str(ip), int(port))
        except ValueError:
            raise BadDescriptor(f"tcp endpoint {endpoint!r} is not 'ip:port'") from None

    def tune_socket(self, sock: socket.socket) -> None:
        """Set options on every connected socket, accepted or opened (already
        non-blocking). Default: ``TCP_NODELAY`` on TCP sockets, ``sockbuf`` buffers."""
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._sockbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._sockbuf)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._sockbuf)

    # -- set-up ----------------------------------------------------------------------
    def _descriptor(self) -> Descriptor:
        return Descriptor(self.name, self.instance_id, self._endpoint, tuple(self.receiver.region_infos()))

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this transport was first used on (all its I/O runs there)."""
        assert self._bound_loop is not None, "transport used before register/connect"
        return self._bound_loop

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._bound_loop is None:
            self._bound_loop = loop
            self._last_tick = time.monotonic()
            self._tick_handle = loop.call_later(self._limits.heartbeat_interval, self._tick)
        elif self._bound_loop is not loop:
            raise TransportError(f"{self.name} transport is bound to another event loop")
        if self._closed:
            raise TransportError(f"{self.name} transport is closed")

    async def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        self._ensure_loop()
        for r in regions:
            if r.region_id in self._regions and self._regions[r.region_id] is not r:
                raise ConfigError(f"region_id {r.region_id} ({r.name!r}) is already registered")
            if not self._device.add(r):  # device memory is staged (tcp_device); host memory is read in place
                self._views[r.region_id] = byte_view(r.tensor)
            self._regions[r.region_id] = r
            self.receiver.add_region(r.info())
        if self._listener is None:
            try:
                lsock, self._endpoint = self.listen_socket()
            except OSError as exc:
                raise TransportError(f"{self.name} transport cannot listen: {exc}") from None
            lsock.setblocking(False)
            self._listener = lsock
            self._loop.add_reader(lsock.fileno(), self._on_accept)
        return self._descriptor().to_bytes()

    def _on_accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in RESOURCE_ERRNOS:  # stop accepting a while: the listener stays readable
                    pause = self._gate.next_backoff()
                    log.warning("tcp: cannot accept (%s); accepting again in %.2f s", exc.strerror, pause)
                    self._loop.remove_reader(listener.fileno())
                    self._loop.call_later(pause, self._resume_accept, listener)
                return
            address = addr[0] if isinstance(addr, tuple) else ""
            try:
                sock.setblocking(False)
                self.tune_socket(sock)
            except OSError:
                sock.close()  # the peer sees the connection drop and fails its own rooms
                continue
            self.receiver.accepted(sock, self._loop, address)

    def _resume_accept(self, listener: socket.socket) -> None:
        if self._listener is listener and not self._closed:
            self._loop.add_reader(listener.fileno(), self._on_accept)

    def _tick(self) -> None:
        """Every ``heartbeat_interval``: close accepted connections that never said HELLO,
        lose connections that heard nothing for the lease, PING quiet ones."""
        if self._closed:
            return
        lim, now = self._limits, time.monotonic()
        # A late tick means this loop was busy, not that the peers went quiet: the bytes
        # they sent may be unread in the socket buffers. Judge silence on the next one.
        judge = now - self._last_tick < lim.heartbeat_lease / 2
        self._last_tick = now
        conns = [*self.receiver.connections, *self.sender.connections()]
        for c in conns if judge else ():
            tend(c, lim, now)
        self._tick_handle = self._loop.call_later(lim.heartbeat_interval, self._tick)

    async def connect(self, descriptor: bytes) -> Peer:
        self._ensure_loop()
        d = Descriptor.from_bytes(descriptor)
        if d.backend != self.name:
            raise BadDescriptor(f"descriptor is for transport {d.backend!r}, this is {self.name!r}")
        return await self.sender.connect(d)

    async def _dial(self, d: Descriptor, events: ConnEvents) -> Conn:
        """One connection to the peer ``d``, its handshake done (the sender's ``dial``)."""
        family, addr = self.peer_address(d.endpoint)
        where = d.endpoint.decode(errors="replace")
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:  # e.g. out of file descriptors
            raise TransportError(f"cannot create a socket for {self.name} peer at {where}: {exc}") from None
        try:
            sock.setblocking(False)
            self.tune_socket(sock)
            await asyncio.wait_for(self._loop.sock_connect(sock, addr), self._connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            raise PeerFailure(f"cannot connect to {self.name} peer {d.instance_id} at {where}: {exc!r}") from None
        conn = Conn(sock, self._loop, events)
        try:
            nonce = await asyncio.wait_for(asyncio.shield(conn.challenge), self._connect_timeout)
            answer = peerauth.proof(self.require_credential(d.instance_id), b"tcp", nonce, self.instance_id, d.instance_id)
            conn.send_control(HELLO, 0, f"{self.instance_id} {d.instance_id} {answer.hex()}")
            await asyncio.wait_for(asyncio.shield(conn.hello), self._connect_timeout)
        except asyncio.TimeoutError:
            conn.close()
            raise PeerFailure(f"{self.name} peer at {where} did not answer the handshake") from None
        except PeerFailure:
            conn.close()
            raise
        return conn

    # -- the contract: each side does its part ---------------------------------------------
    def advertise(self, grant: RoomGrant) -> None:
        self.receiver.advertise(grant)

    async def write(
        self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None
    ) -> None:
        self._ensure_loop()
        await self.sender.write(peer, room, ops, metadata)

    def release(self, room: int) -> None:
        self.rooms.discard(room)
        self.receiver.release(room)
        self.sender.release(room)

    def fail_peer(self, instance_id: str, reason: str) -> None:
        self.sender.drop(instance_id, reason)
        self.receiver.fail_peer(instance_id, reason)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        if self._listener is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        self.sender.close(f"{self.name} transport closed")
        self.receiver.close()
        self.rooms.fail_all(f"{self.name} transport closed")
