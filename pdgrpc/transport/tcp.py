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
fails. Each connection starts with a ``HELLO`` naming both instance ids, so a restarted
peer listening on the same port is never mistaken for the old one.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import functools
import ipaddress
import itertools
import socket
import struct
from typing import Any, Callable, Sequence

import numpy as np
import torch

from pdgrpc.errors import ConfigError, PeerFailure, TransportError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.errors import UnauthorizedWrite
from pdgrpc.transport.base import (
    BadDescriptor,
    Descriptor,
    MemoryRegion,
    Peer,
    RegionKind,
    RoomGrant,
    Transport,
    WriteOp,
    WriteOps,
    check_source_ops,
)
from pdgrpc.transport.receiver import MessageType, Receiver, Refusal

HEADER = struct.Struct("<B3xIQQQ")
OP = struct.Struct("<H6xQQ")
OP_DTYPE = np.dtype({"names": ["region", "offset", "length"], "formats": ["<u2", "<u8", "<u8"],
                     "offsets": [0, 8, 16], "itemsize": 24})  # same layout as OP
_KIND_NONE, _KIND_KV, _KIND_META = 0, 1, 2
HELLO, HELLO_OK, HELLO_REFUSED, WRITE, META, ACK, NACK = (
    MessageType.HELLO, MessageType.HELLO_OK, MessageType.HELLO_REFUSED, MessageType.WRITE, MessageType.META,
    MessageType.ACK, MessageType.NACK)
MAX_OPS_PER_FRAME = 512  # keeps a frame's iovec list under IOV_MAX (1024)
_IOV_BATCH = 256  # buffers per sendmsg/recvmsg_into call (bounded work per syscall)
_IOV_BYTES = 4 << 20
MAX_CONTROL_BYTES = 64 * 1024  # hello bodies and reasons; anything larger is a protocol error
_SCRATCH = 1 << 20
_READS_PER_CALLBACK = 64  # bound how long one busy socket holds the event loop
_STRIDED_MIN = 128  # slices in one region before a strided numpy view pays off (~10 us fixed cost)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable flat byte memoryview over a contiguous CPU tensor's storage."""
    if tensor.device.type != "cpu":
        raise ConfigError(f"tcp transport needs CPU tensors, got one on {tensor.device}")
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def _merge_adjacent(regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coalesce consecutive ``(region, offset, length)`` byte ranges that continue one
    another in the same region into one range (vectorized). The payload of a frame is
    the ops' bytes back to back, so one side's adjacent ranges can travel as one buffer
    whatever the other side's layout: a head-sliced transfer has one op per page, but
    its receiver's (TP 1 -> TP 2) or its sender's (TP 2 -> TP 1) pages are contiguous."""
    if len(lengths) < 2:
        return regions, offsets, lengths
    new = np.empty(len(lengths), dtype=bool)
    new[0] = True
    np.not_equal(regions[1:], regions[:-1], out=new[1:])
    new[1:] |= offsets[1:] != offsets[:-1] + lengths[:-1]
    if new.all():
        return regions, offsets, lengths
    starts = np.flatnonzero(new)
    return regions[starts], offsets[starts], np.add.reduceat(lengths, starts)


def _frame_buffers(hdr: bytes, table: np.ndarray, chunk: np.ndarray,
                   views: dict[int, memoryview]) -> tuple[list[memoryview], list[int]]:
    """Header, op table and the source slices of one WRITE frame (gather list, adjacent
    slices merged), with cumulative sizes."""
    regions, offsets, lengths = _merge_adjacent(chunk[:, 0], chunk[:, 1], chunk[:, 4])
    bufs: list[Any] = [memoryview(hdr), memoryview(table).cast("B")]  # type: ignore[arg-type]
    if len(lengths) < _STRIDED_MIN:
        bufs += [views[r][o : o + n] for r, o, n in zip(regions.tolist(), offsets.tolist(), lengths.tolist())]
    else:
        _add_slices(bufs, regions, offsets, lengths, views)
    ends = np.cumsum(np.concatenate(([len(hdr), table.nbytes], lengths))).tolist()
    return bufs, ends


def _add_slices(bufs: list[Any], regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                views: dict[int, memoryview]) -> None:
    """Append the byte slices ``views[region][offset : offset + length]`` to ``bufs``.
    Each same-region group of equal-length slices at a constant stride (a head-sliced
    transfer's source: one block per page) of at least ``_STRIDED_MIN`` slices becomes
    the rows of one strided numpy view, about half the cost per slice of slicing a
    memoryview."""
    cut = np.flatnonzero(regions[1:] != regions[:-1]) + 1
    for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(regions)]):
        r = int(regions[a])
        if b - a >= _STRIDED_MIN:
            n, o = int(lengths[a]), offsets[a:b]
            step = int(o[1] - o[0])
            if step >= n and (lengths[a:b] == n).all() and (o[1:] - o[:-1] == step).all():
                # numpy checks that the strided extent lies inside the region's buffer
                bufs.extend(np.ndarray((b - a, n), np.uint8, views[r], int(o[0]), (step, 1)))
                continue
        v = views[r]
        bufs += [v[o : o + n] for o, n in zip(offsets[a:b].tolist(), lengths[a:b].tolist())]


class _Conn:
    """One socket, driven by event-loop reader/writer callbacks (no tasks, no threads)."""

    def __init__(self, owner: "TcpTransport", sock: socket.socket, peer_id: str | None) -> None:
        self.owner = owner
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = owner._loop
        self.peer_id = peer_id
        self.closed = False
        self.hello: asyncio.Future[str] = self.loop.create_future()
        # Outgoing frames: (buffers, cumulative sizes), or a callable that builds them
        # only when the socket can take the frame -- a scattered transfer is ~100k page
        # slices, and holding them all as live memoryviews makes the garbage
        # collector's work grow with the queue.
        self._frames: collections.deque[Any] = collections.deque()
        self._fidx = 0  # first buffer of the head frame not fully sent
        self._fpos = 0  # bytes of the head frame sent
        self._writing = False
        self._hdr = bytearray(HEADER.size)
        self._iovs: list[memoryview] = []
        self._ends: list[int] = []
        self._total = 0
        self._pos = 0
        self._idx = 0
        self._on_done: Callable[[], None] = self._got_header
        self._guard_room: int | None = None  # room whose granted pages we are filling
        self._guard_ref: object = None
        self.loop.add_reader(self.fd, self._on_readable)
        self._expect_header()

    # -- reading -------------------------------------------------------------------
    def _expect(self, bufs: list[memoryview], on_done: Callable[[], None], ends: list[int] | None = None) -> None:
        """Read into ``bufs`` in order, then call ``on_done``. ``ends`` (cumulative
        sizes) lets progress be tracked with a bisect instead of a per-buffer loop."""
        if ends is None:
            bufs = [b for b in bufs if len(b)]
            ends = list(itertools.accumulate(len(b) for b in bufs))
        self._iovs = bufs
        self._ends = ends
        self._total = ends[-1] if ends else 0
        self._pos = 0
        self._idx = 0
        self._on_done = on_done

    def _expect_header(self) -> None:
        self._guard_room = None
        self._expect([memoryview(self._hdr)], self._got_header, [HEADER.size])

    def _expect_discard(self, nbytes: int, then: Callable[[], None]) -> None:
        self._guard_room = None
        scratch = self.owner._scratch_view()
        bufs = []
        while nbytes > 0:
            n = min(nbytes, len(scratch))
            bufs.append(scratch[:n])
            nbytes -= n
        self._expect(bufs, then)

    def _on_readable(self) -> None:
        for _ in range(_READS_PER_CALLBACK):
            if self.closed:
                return
            while self._pos == self._total:  # zero-length expectation: done at once
                self._on_done()
                if self.closed:
                    return
            if self._guard_room is not None and self.owner._recv.get(self._guard_room) is not self._guard_ref:
                # The room was released mid-payload: its pages may already belong to
                # another request, so drop the rest of this frame's bytes.
                self._expect_discard(self._total - self._pos, self._expect_header)
            iovs, ends, i = self._iovs, self._ends, self._idx
            skip = self._pos - (ends[i - 1] if i else 0)
            first = iovs[i][skip:] if skip else iovs[i]
            try:
                if i + 1 == len(iovs):
                    n = self.sock.recv_into(first)
                else:
                    n = self.sock.recvmsg_into([first, *iovs[i + 1 : i + _IOV_BATCH]])[0]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.lose(f"connection error: {exc!r}")
                return
            if n == 0:
                self.lose("connection closed by peer")
                return
            self._pos += n
            if self._pos < self._total:
                self._idx = bisect.bisect_right(ends, self._pos, i)
            else:
                self._on_done()

    def _got_header(self) -> None:
        ftype, n_ops, room, payload_len, aux = HEADER.unpack(self._hdr)
        if ftype in (WRITE, META):
            if self.peer_id is None:
                return self.lose("data frame before HELLO")
            if n_ops == 0 or n_ops > MAX_OPS_PER_FRAME:
                return self.lose(f"bad op count {n_ops}")
            table = bytearray(n_ops * OP.size)
            self._expect(
                [memoryview(table)], lambda: self.owner._on_data_frame(self, ftype, room, table, payload_len, aux)
            )
        elif ftype in (HELLO, HELLO_REFUSED, NACK):
            if payload_len > MAX_CONTROL_BYTES:
                return self.lose(f"control frame of {payload_len} bytes")
            body = bytearray(payload_len)
            self._expect([memoryview(body)], lambda: self._got_control(ftype, room, bytes(body), aux))
        elif ftype == HELLO_OK:
            if not self.hello.done():
                self.hello.set_result("")
            self._expect_header()
        elif ftype == ACK:
            self.owner._on_ack(self, room)
            self._expect_header()
        else:
            self.lose(f"unknown frame type {ftype}")

    def _got_control(self, ftype: int, room: int, body: bytes, aux: int = 0) -> None:
        text = body.decode("utf-8", "replace")
        if ftype == HELLO:
            self.owner._on_hello(self, text)
        elif ftype == HELLO_REFUSED:
            if not self.hello.done():
                self.hello.set_exception(PeerFailure(f"peer refused the connection: {text}"))
            return self.lose(f"peer refused the connection: {text}")
        elif ftype == NACK:
            self.owner._on_nack(self, room, text, Refusal.from_code(aux))
        if not self.closed:
            self._expect_header()

    def receive_payload(self, room: int, ref: object, views: list[memoryview], then: Callable[[], None],
                        ends: list[int] | None = None) -> None:
        self._expect(views, then, ends)
        self._guard_room, self._guard_ref = room, ref

    # -- writing -------------------------------------------------------------------
    def send(self, bufs: Sequence[bytes | memoryview]) -> None:
        if self.closed:
            return
        views = [b if type(b) is memoryview else memoryview(b) for b in bufs]
        self._frames.append((views, list(itertools.accumulate(len(b) for b in views))))
        if not self._writing:
            self._flush()

    def send_later(self, make: Callable[[], tuple[list[memoryview], list[int]]]) -> None:
        """Queue a frame whose buffers (and their cumulative sizes) ``make()`` builds
        when the socket is ready for it."""
        if self.closed:
            return
        self._frames.append(make)
        if not self._writing:
            self._flush()

    def send_control(self, ftype: int, room: int, text: str, aux: int = 0) -> None:
        body = text.encode()[:MAX_CONTROL_BYTES]
        self.send([HEADER.pack(ftype, 0, room, len(body), aux), body])

    def _flush(self) -> None:
        frames = self._frames
        while frames:
            head = frames[0]
            if callable(head):
                head = frames[0] = head()
            bufs, ends = head
            i, pos = self._fidx, self._fpos
            skip = pos - (ends[i - 1] if i else 0)
            j = min(i + _IOV_BATCH, len(bufs))
            batch = [bufs[i][skip:] if skip else bufs[i], *bufs[i + 1 : j]]
            try:
                n = self.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.lose(f"send failed: {exc!r}")
                return
            pos += n
            if pos == ends[-1]:
                frames.popleft()
                self._fidx = self._fpos = 0
                continue
            self._fpos = pos
            self._fidx = bisect.bisect_right(ends, pos, i)
            if pos < ends[j - 1]:
                break  # the socket took less than offered: wait until it is writable
        if frames and not self._writing:
            self.loop.add_writer(self.fd, self._flush)
            self._writing = True
        elif not frames and self._writing:
            self.loop.remove_writer(self.fd)
            self._writing = False

    # -- teardown ------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        if self._writing:
            self.loop.remove_writer(self.fd)
        self._frames.clear()
        self._iovs = []
        self.sock.close()
        if not self.hello.done():
            self.hello.set_exception(PeerFailure("connection closed during handshake"))
            self.hello.exception()  # mark retrieved: nobody may be waiting any more

    def lose(self, reason: str) -> None:
        if self.closed:
            return
        self.close()
        self.owner._on_conn_lost(self, reason)


class _Link:
    """The sender's connections to one peer instance."""

    def __init__(self, peer: Peer, conns: list[_Conn]) -> None:
        self.peer = peer
        self.conns = conns
        self.next = 0
        self.rooms: set[int] = set()
        self.sent: dict[int, int] = {}
        self.alive = True

    def conn(self) -> _Conn:
        c = self.conns[self.next % len(self.conns)]
        self.next += 1
        return c


class TcpTransport(Transport):
    """Options: ``host`` to listen on (default 127.0.0.1), ``port`` (0: any),
    ``connections`` per peer (default 1), ``connect_timeout`` seconds (default 5),
    ``sockbuf`` socket buffer bytes (default 4 MiB; 0 keeps the OS default)."""

    name = "tcp"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        connections: int = 1,
        connect_timeout: float = 5.0,
        sockbuf: int = 4 << 20,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigError(f"{self.name} transport: unknown option(s) {sorted(unknown)}")
        if connections < 1:
            raise ConfigError(f"{self.name} transport: connections must be >= 1, got {connections}")
        super().__init__()
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
        # region id -> kind / size, for checking the source side of a write in one pass
        self._kind_lut = np.zeros(1 << 16, dtype=np.int8)
        self._nbytes_lut = np.zeros(1 << 16, dtype=np.int64)
        self._recv = Receiver(self.rooms)
        self._links: dict[str, _Link] = {}
        self._connecting: dict[str, asyncio.Future[None]] = {}
        self._room_link: dict[int, str] = {}
        self._incoming: set[_Conn] = set()
        self._scratch: memoryview | None = None
        self._closed = False

    # -- overridable socket plumbing (a unix-socket variant swaps these) -------------
    def _listen(self) -> tuple[socket.socket, bytes]:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self._sockbuf:  # before listen: accepted sockets inherit it (and the window scale)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._sockbuf)
        s.bind((self._host, self._port))
        s.listen(128)
        host, port = s.getsockname()[:2]
        return s, f"{host}:{port}".encode()

    def _address(self, endpoint: bytes) -> tuple[int, Any]:
        """``(family, sockaddr)`` for a peer's endpoint bytes (no DNS: no threads)."""
        host, _, port = endpoint.decode().rpartition(":")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
            return (socket.AF_INET6 if ip.version == 6 else socket.AF_INET), (str(ip), int(port))
        except ValueError:
            raise BadDescriptor(f"tcp endpoint {endpoint!r} is not 'ip:port'") from None

    def _tune(self, sock: socket.socket) -> None:
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
        elif self._bound_loop is not loop:
            raise TransportError(f"{self.name} transport is bound to another event loop")
        if self._closed:
            raise TransportError(f"{self.name} transport is closed")

    async def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        self._ensure_loop()
        for r in regions:
            if r.region_id in self._regions and self._regions[r.region_id] is not r:
                raise ConfigError(f"region_id {r.region_id} ({r.name!r}) is already registered")
            self._views[r.region_id] = byte_view(r.tensor)
            self._regions[r.region_id] = r
            self._recv.add_region(r.info())
            self._kind_lut[r.region_id] = _KIND_META if r.kind is RegionKind.METADATA else _KIND_KV
            self._nbytes_lut[r.region_id] = r.nbytes
        if self._listener is None:
            try:
                lsock, self._endpoint = self._listen()
            except OSError as exc:
                raise TransportError(f"{self.name} transport cannot listen: {exc}") from None
            lsock.setblocking(False)
            self._listener = lsock
            self._loop.add_reader(lsock.fileno(), self._on_accept)
        return self._descriptor().to_bytes()

    def _on_accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                sock.setblocking(False)
                self._tune(sock)
            except OSError:
                sock.close()  # the peer sees the connection drop and fails its own rooms
                continue
            self._incoming.add(_Conn(self, sock, None))

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
        family, addr = self._address(d.endpoint)
        where = d.endpoint.decode(errors="replace")
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:  # e.g. out of file descriptors
            raise TransportError(f"cannot create a socket for {self.name} peer at {where}: {exc}") from None
        try:
            sock.setblocking(False)
            self._tune(sock)
            await asyncio.wait_for(self._loop.sock_connect(sock, addr), self._connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            raise PeerFailure(f"cannot connect to {self.name} peer {d.instance_id} at {where}: {exc!r}") from None
        conn = _Conn(self, sock, None)
        conn.send_control(HELLO, 0, f"{self.instance_id} {d.instance_id}")
        try:
            await asyncio.wait_for(asyncio.shield(conn.hello), self._connect_timeout)
        except asyncio.TimeoutError:
            conn.close()
            raise PeerFailure(f"{self.name} peer at {where} did not answer the handshake") from None
        except PeerFailure:
            conn.close()
            raise
        return conn

    # -- receiver ----------------------------------------------------------------------
    def advertise(self, grant: RoomGrant) -> None:
        self._recv.advertise(grant)

    def _on_hello(self, conn: _Conn, text: str) -> None:
        sender, _, expected = text.partition(" ")
        if expected != self.instance_id or not sender:
            conn.send_control(HELLO_REFUSED, 0, f"this is instance {self.instance_id}, not {expected!r}")
            self._loop.call_soon(conn.close)
            return
        conn.peer_id = sender
        conn.send([HEADER.pack(HELLO_OK, 0, 0, 0, 0)])

    def _on_data_frame(self, conn: _Conn, ftype: int, room: int, table: bytearray, payload_len: int, aux: int) -> None:
        ops = np.frombuffer(table, dtype=OP_DTYPE)
        if (ops["offset"] > 2**62).any() or (ops["length"] > 2**62).any() or int(ops["length"].sum()) != payload_len:
            return conn.lose("frame payload length does not match its op table")
        regions = ops["region"].astype(np.int64)
        offsets = ops["offset"].astype(np.int64)
        lengths = ops["length"].astype(np.int64)
        try:
            rr = self._recv.accept(room, conn.peer_id or "", regions, offsets, lengths, metadata=ftype == META)
        except UnauthorizedWrite as exc:
            conn.send_control(NACK, room, str(exc), int(exc.refusal))
            conn._expect_discard(payload_len, conn._expect_header)
            return
        views = self._views
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

    # -- sender ------------------------------------------------------------------------
    async def write(
        self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None
    ) -> None:
        self._ensure_loop()
        self._check_src(ops, metadata)
        self.rooms.create(room, KVPoll.TRANSFERRING)
        link = self._links.get(peer.instance_id)
        if link is None or not link.alive:
            self.rooms.fail(room, f"peer {peer.instance_id} is not connected (failed or never connected)")
            return
        self._room_link[room] = peer.instance_id
        link.rooms.add(room)
        sent = link.sent.get(room, 0)
        views = self._views
        arr = WriteOps.of(ops).array
        for i in range(0, len(arr), MAX_OPS_PER_FRAME):
            chunk = arr[i : i + MAX_OPS_PER_FRAME]
            table = np.zeros(len(chunk), dtype=OP_DTYPE)
            table["region"] = chunk[:, 2]
            table["offset"] = chunk[:, 3]
            table["length"] = chunk[:, 4]
            total = int(chunk[:, 4].sum())
            hdr = HEADER.pack(WRITE, len(chunk), room, total, 0)
            link.conn().send_later(functools.partial(_frame_buffers, hdr, table, chunk, views))
            sent += total
        link.sent[room] = sent
        if metadata is not None:
            m = metadata
            link.conn().send(
                [
                    HEADER.pack(META, 1, room, m.length, sent),
                    OP.pack(m.dst_region, m.dst_offset, m.length),
                    views[m.src_region][m.src_offset : m.src_offset + m.length],
                ]
            )

    def _check_src(self, ops: Sequence[WriteOp], metadata: WriteOp | None) -> None:
        wops = WriteOps.of(ops)
        a = wops.array
        if len(a):
            # one pass over the region lookup tables (check_source_ops scans the ops once
            # per region: ~1.5 ms for a head-sliced transfer's ~25k ops); it still
            # names the first offender when anything is wrong
            rid = a[:, 0]
            ok = bool(((rid >= 0) & (rid < len(self._kind_lut))).all())
            if ok:
                end = a[:, 1] + a[:, 4]
                ok = not ((self._kind_lut[rid] == _KIND_NONE) | (a[:, 1] < 0) | (a[:, 3] < 0) | (a[:, 4] <= 0)
                          | (end > self._nbytes_lut[rid])).any()
            if not ok:
                check_source_ops(wops, self._regions)
        if metadata is not None:
            check_source_ops([metadata], self._regions)

    def _on_ack(self, conn: _Conn, room: int) -> None:
        if self._room_link.get(room) == conn.peer_id:
            self.rooms.set(room, KVPoll.SUCCESS)

    def _on_nack(self, conn: _Conn, room: int, reason: str, refusal: Refusal | None) -> None:
        if self._room_link.get(room) == conn.peer_id:
            self.rooms.fail(room, f"receiver rejected the transfer: {reason}", refusal)

    # -- both sides --------------------------------------------------------------------
    def _on_conn_lost(self, conn: _Conn, reason: str) -> None:
        self._incoming.discard(conn)
        peer = conn.peer_id
        if peer is None:
            return
        self.fail_peer(peer, f"{self.name} peer {peer} lost: {reason}")

    def _drop_link(self, link: _Link, reason: str) -> None:
        link.alive = False
        if self._links.get(link.peer.instance_id) is link:
            del self._links[link.peer.instance_id]
        for c in link.conns:
            c.close()
        self.rooms.fail_all(reason, link.rooms)
        for room in link.rooms:
            if self._room_link.get(room) == link.peer.instance_id:
                del self._room_link[room]

    def release(self, room: int) -> None:
        self.rooms.discard(room)
        self._recv.release(room)
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
        self.rooms.fail_all(reason, self._recv.rooms_of(instance_id))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for link in list(self._links.values()):
            self._drop_link(link, f"{self.name} transport closed")
        for conn in list(self._incoming):
            conn.close()
        self._incoming.clear()
        self.rooms.fail_all(f"{self.name} transport closed")
        self._recv.clear()

    def _scratch_view(self) -> memoryview:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH))
        return self._scratch
