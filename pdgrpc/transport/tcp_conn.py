"""One ``tcp`` connection: a non-blocking socket driven by event-loop reader/writer
callbacks (no tasks, no threads). It reads frames (:mod:`~pdgrpc.transport.tcp_wire`),
answers the handshake futures itself and hands every other frame to the
:class:`ConnEvents` it was built with: the receiver's for accepted connections, the
sender's for its own."""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import socket
import time
from typing import Any, Callable, Protocol, Sequence

from pdgrpc.errors import PeerFailure
from pdgrpc.transport.receiver import Refusal
from pdgrpc.transport.tcp_wire import (
    ACK, CHALLENGE, HEADER, HELLO, HELLO_OK, HELLO_REFUSED, MAX_CONTROL_BYTES, MAX_FRAME_PAYLOAD, MAX_OPS_PER_FRAME,
    MAX_UNREAD_REPLY_BYTES, META, NACK, OP, PING, WRITE,
)

__all__ = ["Conn", "ConnEvents"]

log = logging.getLogger("pdgrpc.transport.tcp")

_IOV_BATCH = 256  # buffers per sendmsg/recvmsg_into call (bounded work per syscall)
_READS_PER_CALLBACK = 64  # bound how long one busy socket holds the event loop
_SCRATCH_BYTES = 1 << 20  # discard buffer for refused or released payload
_scratch: list[memoryview] = []  # bytes read there are never looked at, so one serves every connection


def _scratch_view() -> memoryview:
    if not _scratch:
        _scratch.append(memoryview(bytearray(_SCRATCH_BYTES)))
    return _scratch[0]


class ConnEvents(Protocol):
    """What a connection reports: its frames (each side answers those meant for it and
    calls :meth:`Conn.protocol_error` for the others), its close (any way, once) and,
    after that, its loss (peer gone, error, protocol error)."""

    def data_frame(self, conn: Conn, ftype: int, room: int, table: bytearray, payload_len: int, aux: int) -> None:
        """A WRITE or META frame's header and op table arrived; its payload is next."""

    def hello(self, conn: Conn, text: str) -> None: ...
    def ack(self, conn: Conn, room: int) -> None: ...
    def nack(self, conn: Conn, room: int, reason: str, refusal: Refusal | None) -> None: ...
    def closed(self, conn: Conn, by_peer: bool) -> None: ...
    def lost(self, conn: Conn, reason: str) -> None: ...


class Conn:
    """One socket, driven by event-loop reader/writer callbacks (no tasks, no threads)."""

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, events: ConnEvents, *,
                 remote: str | None = None) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = loop
        self.events = events
        self.peer_id: str | None = None  # accepted: set only once the HELLO's proof verified
        self.nonce = b""  # accepted: the challenge sent to the peer
        self.closed = False
        self.rooms: set[int] = set()  # rooms written through this (accepted) connection
        self.remote = remote  # the remote address of an accepted connection; None for our own
        self.opened = self.last_recv = self.last_sent = time.monotonic()
        self.hello: asyncio.Future[str] = loop.create_future()
        self.challenge: asyncio.Future[bytes] = loop.create_future()  # our own: the peer's nonce
        # Outgoing frames: (buffers, cumulative sizes), or a callable that builds them
        # only when the socket can take the frame -- a scattered transfer is ~100k page
        # slices, and holding them all as live memoryviews makes the garbage
        # collector's work grow with the queue.
        self._frames: collections.deque[Any] = collections.deque()
        self._queued = 0  # bytes of the built frames in _frames
        self.on_close: list[Callable[[], None]] = []  # called once when the connection closes
        self.staging: Any = None  # staging buffers of device regions (pdgrpc.transport.tcp_device)
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
        self._guard_lookup: Callable[[int], object] = _nothing
        loop.add_reader(self.fd, self._on_readable)
        self.next_frame()

    # -- reading -------------------------------------------------------------------
    def expect(self, bufs: list[memoryview], on_done: Callable[[], None], ends: list[int] | None = None) -> None:
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

    def next_frame(self) -> None:
        """Read the next frame's header."""
        self._guard_room = None
        self.expect([memoryview(self._hdr)], self._got_header, [HEADER.size])

    def discard(self, nbytes: int, then: Callable[[], None]) -> None:
        """Read ``nbytes`` and drop them, one scratch buffer at a time (O(1) memory
        whatever ``nbytes`` says), then call ``then``."""
        self._guard_room = None
        scratch = _scratch_view()
        n = min(nbytes, len(scratch))
        rest = nbytes - n
        self.expect([scratch[:n]], (lambda: self.discard(rest, then)) if rest else then, [n])

    def receive_payload(self, views: list[memoryview], then: Callable[[], None], ends: list[int], *,
                        room: int, ref: object, lookup: Callable[[int], object]) -> None:
        """Read a frame's payload into ``views`` (granted pages), then call ``then``;
        once ``lookup(room)`` is no longer ``ref`` (the room was released) the rest of
        the frame is dropped instead."""
        self.expect(views, then, ends)
        self._guard_room, self._guard_ref, self._guard_lookup = room, ref, lookup

    def _on_readable(self) -> None:
        for _ in range(_READS_PER_CALLBACK):
            if self.closed:
                return
            while self._pos == self._total:  # zero-length expectation: done at once
                self._on_done()
                if self.closed:
                    return
            if self._guard_room is not None and self._guard_lookup(self._guard_room) is not self._guard_ref:
                # The room was released mid-payload: its pages may already belong to
                # another request, so drop the rest of this frame's bytes.
                self.discard(self._total - self._pos, self.next_frame)
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
                self.lose(f"connection error: {exc!r}", by_peer=True)
                return
            if n == 0:
                self.lose("connection closed by peer", by_peer=True)
                return
            self.last_recv = time.monotonic()
            self._pos += n
            if self._pos < self._total:
                self._idx = bisect.bisect_right(ends, self._pos, i)
            else:
                self._on_done()

    def _got_header(self) -> None:
        ftype, n_ops, room, payload_len, aux = HEADER.unpack(self._hdr)
        if ftype in (WRITE, META):
            if self.peer_id is None:
                return self.protocol_error("data frame before HELLO")
            if n_ops == 0 or n_ops > MAX_OPS_PER_FRAME:
                return self.protocol_error(f"{n_ops} ops in one frame (limit {MAX_OPS_PER_FRAME})")
            if payload_len > MAX_FRAME_PAYLOAD:
                return self.protocol_error(
                    f"frame payload of {payload_len} bytes exceeds the limit of {MAX_FRAME_PAYLOAD} bytes")
            table = bytearray(n_ops * OP.size)
            self.expect(
                [memoryview(table)], lambda: self.events.data_frame(self, ftype, room, table, payload_len, aux)
            )
        elif ftype in (HELLO, HELLO_REFUSED, NACK, CHALLENGE):
            if payload_len > MAX_CONTROL_BYTES:
                return self.protocol_error(f"control frame of {payload_len} bytes (limit {MAX_CONTROL_BYTES})")
            body = bytearray(payload_len)
            self.expect([memoryview(body)], lambda: self._got_control(ftype, room, bytes(body), aux))
        elif ftype == HELLO_OK:
            if not self.hello.done():
                self.hello.set_result("")
            self.next_frame()
        elif ftype == ACK:
            self.events.ack(self, room)
            if not self.closed:
                self.next_frame()
        elif ftype == PING:
            self.next_frame()
        else:
            self.protocol_error(f"unknown frame type {ftype}")

    def _got_control(self, ftype: int, room: int, body: bytes, aux: int = 0) -> None:
        if ftype == CHALLENGE:
            if self.remote is not None or self.challenge.done():
                return self.protocol_error("unexpected CHALLENGE")
            self.challenge.set_result(body)
            return self.next_frame()
        text = body.decode("utf-8", "replace")
        if ftype == HELLO:
            self.events.hello(self, text)
        elif ftype == HELLO_REFUSED:
            for fut in (self.hello, self.challenge):
                if not fut.done():
                    fut.set_exception(PeerFailure(f"peer refused the connection: {text}"))
                    fut.exception()  # whoever awaits it still gets it
            return self.lose(f"peer refused the connection: {text}")
        elif ftype == NACK:
            self.events.nack(self, room, text, Refusal.from_code(aux))
        if not self.closed:
            self.next_frame()

    # -- writing -------------------------------------------------------------------
    def send(self, bufs: Sequence[bytes | memoryview], on_sent: Callable[[], None] | None = None) -> None:
        """Queue a frame; ``on_sent()`` once the socket took all of it (never if closed first)."""
        if self.closed:
            return
        views = [b if type(b) is memoryview else memoryview(b) for b in bufs]
        ends = list(itertools.accumulate(len(b) for b in views))
        self._frames.append((views, ends) if on_sent is None else (views, ends, on_sent))
        self._queued += ends[-1] if ends else 0
        if not self._writing:
            self._flush()
        elif self.remote is not None and self._queued > MAX_UNREAD_REPLY_BYTES:
            # An accepted connection sends only replies: its writer does not read them.
            self.protocol_error(f"the writer reads none of its replies: {self._queued} bytes of them wait "
                                f"(limit {MAX_UNREAD_REPLY_BYTES})")

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
                self._queued += head[1][-1] if head[1] else 0
            bufs, ends = head[0], head[1]
            i, pos = self._fidx, self._fpos
            skip = pos - (ends[i - 1] if i else 0)
            j = min(i + _IOV_BATCH, len(bufs))
            batch = [bufs[i][skip:] if skip else bufs[i], *bufs[i + 1 : j]]
            try:
                n = self.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.lose(f"send failed: {exc!r}", by_peer=True)
                return
            self.last_sent = time.monotonic()
            pos += n
            if pos == ends[-1]:
                frames.popleft()
                self._queued -= pos
                self._fidx = self._fpos = 0
                if len(head) > 2:  # send(..., on_sent=): the socket took the whole frame
                    head[2]()
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
    @property
    def sending(self) -> bool:
        """Frames are queued (the heartbeat waits: they count as life once they go)."""
        return bool(self._frames)

    def close(self, *, by_peer: bool = False) -> None:
        """Close the socket; ``by_peer``: the peer ended the connection (EOF, reset), so
        for a proven writer nothing more of it can arrive (peerauth.WriterTable)."""
        if self.closed:
            return
        self.closed = True
        self.events.closed(self, by_peer)
        self.loop.remove_reader(self.fd)
        if self._writing:
            self.loop.remove_writer(self.fd)
        self._frames.clear()
        self._queued = 0
        self._iovs = []
        self.sock.close()
        for cb in self.on_close:
            cb()
        for fut in (self.hello, self.challenge):
            if not fut.done():
                fut.set_exception(PeerFailure("connection closed during handshake"))
                fut.exception()  # mark retrieved: nobody may be waiting any more

    def protocol_error(self, reason: str) -> None:
        """The peer broke the wire format: log it (naming the limit or rule) and close."""
        log.warning("tcp: closing a connection from %s: %s", self.peer_id or "a peer before HELLO", reason)
        self.lose(f"protocol error: {reason}")

    def lose(self, reason: str, *, by_peer: bool = False) -> None:
        if self.closed:
            return
        self.close(by_peer=by_peer)
        self.events.lost(self, reason)


def _nothing(room: int) -> object:
    return None
