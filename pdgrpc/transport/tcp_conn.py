"""The ``tcp`` backend's wire format and connection: one non-blocking socket driven by
event-loop reader/writer callbacks (no tasks, no threads), and the frame layout the
:mod:`pdgrpc.transport.tcp` module docstring describes."""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import socket
import struct
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch

from pdgrpc.errors import ConfigError, PeerFailure
from pdgrpc.transport.receiver import MessageType, Refusal

if TYPE_CHECKING:
    from pdgrpc.transport.tcp import TcpTransport

log = logging.getLogger("pdgrpc.transport.tcp")

HEADER = struct.Struct("<B3xIQQQ")
OP = struct.Struct("<H6xQQ")
PING_FRAME = HEADER.pack(MessageType.PING, 0, 0, 0, 0)
OP_DTYPE = np.dtype({"names": ["region", "offset", "length"], "formats": ["<u2", "<u8", "<u8"],
                     "offsets": [0, 8, 16], "itemsize": 24})  # same layout as OP
HELLO, HELLO_OK, HELLO_REFUSED, WRITE, META, ACK, NACK, PING, CHALLENGE = (
    MessageType.HELLO, MessageType.HELLO_OK, MessageType.HELLO_REFUSED, MessageType.WRITE, MessageType.META,
    MessageType.ACK, MessageType.NACK, MessageType.PING, MessageType.CHALLENGE)
MAX_OPS_PER_FRAME = 512  # keeps a frame's iovec list under IOV_MAX (1024)
MAX_FRAME_PAYLOAD = 256 << 20  # bytes of payload in one frame; a frame announcing more is a protocol error
_IOV_BATCH = 256  # buffers per sendmsg/recvmsg_into call (bounded work per syscall)
_IOV_BYTES = 4 << 20
MAX_CONTROL_BYTES = 64 * 1024  # hello bodies and reasons; anything larger is a protocol error
SCRATCH_BYTES = 1 << 20  # discard buffer for refused or released payload
_READS_PER_CALLBACK = 64  # bound how long one busy socket holds the event loop
_STRIDED_MIN = 128  # slices in one region before a strided numpy view pays off its fixed cost


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


def frame_chunks(arr: np.ndarray) -> Iterator[np.ndarray]:
    """Write ops (rows of :class:`~pdgrpc.transport.base.WriteOps`) cut into frames of at
    most ``MAX_OPS_PER_FRAME`` ops and ``MAX_FRAME_PAYLOAD`` bytes; an op longer than the
    byte limit is split into pieces that continue one another."""
    if len(arr) and int(arr[:, 4].max()) > MAX_FRAME_PAYLOAD:
        pieces = -(-arr[:, 4] // MAX_FRAME_PAYLOAD)
        rows = np.repeat(arr, pieces, axis=0)
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        k = np.arange(len(rows)) - first  # piece index within its op
        skip = k * MAX_FRAME_PAYLOAD
        rows[:, 1] += skip
        rows[:, 3] += skip
        rows[:, 4] = np.minimum(rows[:, 4] - skip, MAX_FRAME_PAYLOAD)
        arr = rows
    ends = np.cumsum(arr[:, 4])
    i, n = 0, len(arr)
    while i < n:
        base = int(ends[i - 1]) if i else 0
        j = min(i + MAX_OPS_PER_FRAME, int(np.searchsorted(ends, base + MAX_FRAME_PAYLOAD, side="right")))
        yield arr[i : max(j, i + 1)]
        i = max(j, i + 1)


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

    def __init__(self, owner: "TcpTransport", sock: socket.socket, peer_id: str | None, *,
                 remote: str | None = None) -> None:
        self.owner = owner
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = owner._loop
        self.peer_id = peer_id  # accepted: set only once the HELLO's proof verified
        self.nonce = b""  # accepted: the challenge sent to the peer
        self.closed = False
        self.rooms: set[int] = set()  # rooms written through this (accepted) connection
        self.remote = remote  # the remote address of an accepted connection; None for our own
        self.opened = self.last_recv = self.last_sent = time.monotonic()
        self.hello: asyncio.Future[str] = self.loop.create_future()
        self.challenge: asyncio.Future[bytes] = self.loop.create_future()  # our own: the peer's nonce
        # Outgoing frames: (buffers, cumulative sizes), or a callable that builds them
        # only when the socket can take the frame -- a scattered transfer is ~100k page
        # slices, and holding them all as live memoryviews makes the garbage
        # collector's work grow with the queue.
        self._frames: collections.deque[Any] = collections.deque()
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
        """Read ``nbytes`` and drop them, one scratch buffer at a time (O(1) memory
        whatever ``nbytes`` says), then call ``then``."""
        self._guard_room = None
        scratch = self.owner._scratch_view()
        n = min(nbytes, len(scratch))
        rest = nbytes - n
        self._expect([scratch[:n]], (lambda: self._expect_discard(rest, then)) if rest else then, [n])

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
            self._expect(
                [memoryview(table)], lambda: self.owner._on_data_frame(self, ftype, room, table, payload_len, aux)
            )
        elif ftype in (HELLO, HELLO_REFUSED, NACK, CHALLENGE):
            if payload_len > MAX_CONTROL_BYTES:
                return self.protocol_error(f"control frame of {payload_len} bytes (limit {MAX_CONTROL_BYTES})")
            body = bytearray(payload_len)
            self._expect([memoryview(body)], lambda: self._got_control(ftype, room, bytes(body), aux))
        elif ftype == HELLO_OK:
            if not self.hello.done():
                self.hello.set_result("")
            self._expect_header()
        elif ftype == ACK:
            self.owner._on_ack(self, room)
            self._expect_header()
        elif ftype == PING:
            self._expect_header()
        else:
            self.protocol_error(f"unknown frame type {ftype}")

    def _got_control(self, ftype: int, room: int, body: bytes, aux: int = 0) -> None:
        if ftype == CHALLENGE:
            if self.remote is not None or self.challenge.done():
                return self.protocol_error("unexpected CHALLENGE")
            self.challenge.set_result(body)
            return self._expect_header()
        text = body.decode("utf-8", "replace")
        if ftype == HELLO:
            self.owner._on_hello(self, text)
        elif ftype == HELLO_REFUSED:
            for fut in (self.hello, self.challenge):
                if not fut.done():
                    fut.set_exception(PeerFailure(f"peer refused the connection: {text}"))
                    fut.exception()  # whoever awaits it still gets it
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
    def send(self, bufs: Sequence[bytes | memoryview], on_sent: Callable[[], None] | None = None) -> None:
        """Queue a frame; ``on_sent()`` once the socket took all of it (never if closed first)."""
        if self.closed:
            return
        views = [b if type(b) is memoryview else memoryview(b) for b in bufs]
        ends = list(itertools.accumulate(len(b) for b in views))
        self._frames.append((views, ends) if on_sent is None else (views, ends, on_sent))
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
        if self.remote is not None:
            self.owner._gate.release(self.remote, self.peer_id)
            self.owner._incoming.discard(self)
            if self.peer_id is not None:
                self.owner.writers.closed(self.peer_id, by_peer=by_peer)
        self.loop.remove_reader(self.fd)
        if self._writing:
            self.loop.remove_writer(self.fd)
        self._frames.clear()
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
        self.owner._on_conn_lost(self, reason)


