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

This module makes the sockets and the connections, and ends them; the rest lives in
:mod:`~pdgrpc.transport.tcp_conn` (frames on one connection),
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
from pdgrpc.transport.base import BadDescriptor, Descriptor, MemoryRegion, Peer, Transport
from pdgrpc.transport import peerauth
from pdgrpc.transport.receiver import Receiver
from pdgrpc.transport.tcp_device import TcpDevice
from pdgrpc.transport.tcp_limits import RESOURCE_ERRNOS, AcceptGate, TcpLimits, on_hello, tend
from pdgrpc.transport.tcp_conn import CHALLENGE, HEADER, HELLO, SCRATCH_BYTES, _Conn, byte_view
from pdgrpc.transport.tcp_recv import TcpReceiver
from pdgrpc.transport.tcp_send import TcpSender, _Link

__all__ = ["TcpTransport", "byte_view"]

log = logging.getLogger("pdgrpc.transport.tcp")


class TcpTransport(TcpSender, TcpReceiver, Transport):
    """Options: ``host`` to listen on (default 127.0.0.1), ``port`` (0: any),
    ``connections`` per peer (default 1), ``connect_timeout`` seconds (default 5),
    ``sockbuf`` socket buffer bytes (default 4 MiB; 0 keeps the OS default), and the
    bounds of :class:`~pdgrpc.transport.tcp_limits.TcpLimits`: ``hello_timeout``,
    ``max_connections``, ``max_connections_per_address`` (before the proof),
    ``max_connections_per_peer`` (proven), ``heartbeat_interval`` and
    ``heartbeat_lease`` (a peer that sends nothing, not even its heartbeat, for the lease
    is lost: a hung process fails its rooms within it)."""

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
        max_connections_per_peer: int = TcpLimits.max_connections_per_peer,
        heartbeat_interval: float = TcpLimits.heartbeat_interval,
        heartbeat_lease: float = TcpLimits.heartbeat_lease,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigError(f"{self.name} transport: unknown option(s) {sorted(unknown)}")
        if connections < 1:
            raise ConfigError(f"{self.name} transport: connections must be >= 1, got {connections}")
        self._limits = TcpLimits(hello_timeout, max_connections, max_connections_per_address,
                                 heartbeat_interval, heartbeat_lease, max_connections_per_peer)
        super().__init__()
        self._gate = AcceptGate(self._limits)
        self._tick_handle: asyncio.TimerHandle | None = None
        self._last_tick = time.monotonic()
        self._host = host
        self._port = port
        self._nconn = connections
        self._connect_timeout = connect_timeout
        self._sockbuf = sockbuf
        self._bound_loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._endpoint = b""
        self._regions: dict[int, MemoryRegion] = {}
        self._views: dict[int, memoryview] = {}
        self._dev = TcpDevice()
        self._recv = Receiver(self.rooms)
        self._links: dict[str, _Link] = {}
        self._connecting: dict[str, asyncio.Future[None]] = {}
        self._room_link: dict[int, str] = {}
        self._incoming: set[_Conn] = set()
        self._scratch: memoryview | None = None
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
        return Descriptor(self.name, self.instance_id, self._endpoint, tuple(self._recv.regions.infos.values()))

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
            if not self._dev.add(r):  # device memory is staged (tcp_device); host memory is read in place
                self._views[r.region_id] = byte_view(r.tensor)
            self._regions[r.region_id] = r
            self._recv.add_region(r.info())
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
            refusal = self._gate.admit(address)
            if refusal is not None:
                log.warning("tcp: refusing a connection from %s: %s", address or "a local peer", refusal)
                sock.close()
                continue
            try:
                sock.setblocking(False)
                self.tune_socket(sock)
            except OSError:
                self._gate.release(address)
                sock.close()  # the peer sees the connection drop and fails its own rooms
                continue
            conn = _Conn(self, sock, None, remote=address)
            self._incoming.add(conn)
            conn.nonce = peerauth.new_nonce()
            conn.send([HEADER.pack(CHALLENGE, 0, 0, len(conn.nonce), 0), conn.nonce])

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
        conns = [*self._incoming, *(c for link in self._links.values() for c in link.conns)]
        for c in conns if judge else ():
            tend(c, lim, now)
        self._tick_handle = self._loop.call_later(lim.heartbeat_interval, self._tick)

    async def connect(self, descriptor: bytes) -> Peer:
        self._ensure_loop()
        d = Descriptor.from_bytes(descriptor)
        if d.backend != self.name:
            raise BadDescriptor(f"descriptor is for transport {d.backend!r}, this is {self.name!r}")
        link = self._links.get(d.instance_id)
        if link is not None and link.alive:
            return link.peer
        pending = self._connecting.get(d.instance_id)
        if pending is not None:
            await asyncio.shield(pending)
            return await self.connect(descriptor)
        # A different instance at the same endpoint is a restarted peer: the old
        # connection (if any survived) must not be used again.
        for old in [lk for lk in self._links.values() if lk.peer.descriptor.endpoint == d.endpoint]:
            self._drop_link(old, f"peer at {d.endpoint.decode(errors='replace')} restarted as {d.instance_id}")
        fut = self._loop.create_future()
        self._connecting[d.instance_id] = fut
        conns: list[_Conn] = []
        try:
            for _ in range(self._nconn):
                conns.append(await self._open(d))
            peer = Peer(d.instance_id, d)
            link = _Link(peer, conns)
            for c in conns:
                c.peer_id = d.instance_id
            self._links[d.instance_id] = link
            return peer
        except BaseException:
            for c in conns:
                c.close()
            raise
        finally:
            del self._connecting[d.instance_id]
            fut.set_result(None)

    async def _open(self, d: Descriptor) -> _Conn:
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
        conn = _Conn(self, sock, None)
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

    # -- receiver: the HELLO (data frames: tcp_recv) -----------------------------------
    def _on_hello(self, conn: _Conn, text: str) -> None:
        on_hello(self, conn, text)

    # -- both sides --------------------------------------------------------------------
    def _on_conn_lost(self, conn: _Conn, reason: str) -> None:
        peer = conn.peer_id
        if conn.remote is not None:
            # Only a proven connection has rooms or a peer (peer_id is set after the
            # proof). Its loss fails the rooms written through it; once the writer has no
            # proven connection left and ended them itself, it is gone: all its rooms fail.
            rooms = [r for r in conn.rooms if self._recv.get(r) is not None]
            if peer is not None and self.writers.gone(peer):
                rooms += self._recv.rooms_of(peer)
            self.rooms.fail_all(f"{self.name} connection from {peer} lost: {reason}", rooms, peer_lost=True)
            return
        if peer is not None:  # our own connection to a peer we handshaked with
            self.fail_peer(peer, f"{self.name} peer {peer} lost: {reason}")

    def _drop_link(self, link: _Link, reason: str, *, peer_lost: bool = True) -> None:
        link.alive = False
        if self._links.get(link.peer.instance_id) is link:
            del self._links[link.peer.instance_id]
        for c in link.conns:
            c.close()
        self.rooms.fail_all(reason, link.rooms, peer_lost=peer_lost)
        for room in link.rooms:
            if self._room_link.get(room) == link.peer.instance_id:
                del self._room_link[room]

    def release(self, room: int) -> None:
        self.rooms.discard(room)
        if self._recv.release(room) is not None:
            for conn in self._incoming:
                conn.rooms.discard(room)
        iid = self._room_link.pop(room, None)
        if iid is not None and iid in self._links:
            link = self._links[iid]
            link.rooms.discard(room)
            link.sent.pop(room, None)

    def fail_peer(self, instance_id: str, reason: str) -> None:
        link = self._links.get(instance_id)
        if link is not None:
            self._drop_link(link, reason)
        for conn in [c for c in self._incoming if c.peer_id == instance_id]:
            conn.close()
            self._incoming.discard(conn)
        self.rooms.fail_all(reason, self._recv.rooms_of(instance_id), peer_lost=True)

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
        for link in list(self._links.values()):
            self._drop_link(link, f"{self.name} transport closed", peer_lost=False)
        for conn in list(self._incoming):
            conn.close()
        self._incoming.clear()
        self.rooms.fail_all(f"{self.name} transport closed")
        self._recv.clear()

    def _scratch_view(self) -> memoryview:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        return self._scratch
