"""Staging device memory through pinned host buffers, pipelined, for byte-stream
transports (``tcp``): a socket only reads and writes host memory.

Sender (:func:`stage_out`): the bytes to send are cut into pieces of at most one buffer
(:func:`split_pieces`). For each piece a free buffer is taken from the
:class:`StagingPool`, the device-to-host copy of the piece into it is *started*
(``copy_out``, asynchronous on a GPU), and every piece whose copy has finished is handed
to ``send`` in order. So the copy of piece ``k + 1`` runs while piece ``k`` is on the
wire. ``send`` gets a ``release`` callback that returns the buffer once the socket took
its bytes. Back-pressure: with every buffer copied-into or queued on the socket, the
sender first hands over the oldest copy, then waits for the socket to release a buffer;
at most ``pool.count`` buffers of bytes are ever staged.

Receiver (:class:`StagedReceive`): the socket reads a piece into a free buffer; once it
is in, the host-to-device copy of it starts (``copy_in``) and the socket goes on reading
the next piece into the next buffer, so the copy of piece ``k`` overlaps the receive of
``k + 1``. A buffer is reused only after its copy finished. When every piece is in and
every copy finished, the bytes count as landed (only then, so a metadata row that waits
for them is never committed early).

The copy functions are injected (:mod:`pdgrpc.transport.devcopy` has the CUDA ones and
their CPU twins), so the ordering, overlap and back-pressure rules here are tested on
CPU tensors.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch

from pdgrpc.device import ChunkReady
from pdgrpc.errors import TransportError

__all__ = ["Piece", "StagedReceive", "StagingPool", "split_pieces", "stage_out"]

PIECE_BYTES = 4 << 20  # one staging buffer: big enough to amortize a copy launch, small enough to overlap
POOL_BUFFERS = 4  # buffers per direction and transport instance


class Piece(NamedTuple):
    """Byte ranges ``(region, offset, length)`` of local regions that travel back to back
    in one staging buffer (``nbytes`` <= its size)."""

    regions: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


CopyFn = Callable[[Piece, torch.Tensor], ChunkReady]
"""Starts copying a piece between the device regions and a staging buffer (flat uint8,
at least ``piece.nbytes``); returns the signal that the copy finished."""


def split_pieces(regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, piece_bytes: int) -> Iterator[Piece]:
    """The ranges, in order, cut into pieces of at most ``piece_bytes`` bytes; a range
    that does not fit the rest of a piece is split across pieces."""
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes must be > 0, got {piece_bytes}")
    regions, offsets, lengths = (np.asarray(a, dtype=np.int64) for a in (regions, offsets, lengths))
    total = int(lengths.sum())
    if total == 0:
        return
    cuts = np.arange(piece_bytes, total, piece_bytes, dtype=np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    # split every range at each cut that falls strictly inside it
    bounds = np.union1d(np.concatenate((starts, cuts)), [total])
    bounds = bounds[bounds < total]
    idx = np.searchsorted(ends, bounds, side="right")  # the range each new sub-range lies in
    sub_len = np.diff(np.append(bounds, total))
    sub_off = offsets[idx] + (bounds - starts[idx])
    sub_reg = regions[idx]
    piece_of = bounds // piece_bytes
    edges = np.flatnonzero(np.diff(piece_of)) + 1
    for a, b in zip([0, *edges.tolist()], [*edges.tolist(), len(bounds)]):
        yield Piece(sub_reg[a:b], sub_off[a:b], sub_len[a:b])


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A page-locked host buffer (the CUDA allocator's), for fast asynchronous copies."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class StagingPool:
    """``count`` staging buffers of ``piece_bytes``; :meth:`acquire` waits for a free one.
    ``alloc(nbytes)`` makes a buffer (pinned host memory on a GPU host), lazily."""

    def __init__(self, count: int = POOL_BUFFERS, piece_bytes: int = PIECE_BYTES,
                 alloc: Callable[[int], torch.Tensor] = pinned_empty) -> None:
        if count < 1 or piece_bytes < 1:
            raise ValueError(f"StagingPool needs count >= 1 and piece_bytes >= 1, got {count}, {piece_bytes}")
        self.count = count
        self.piece_bytes = piece_bytes
        self._alloc = alloc
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._free: collections.deque[int] = collections.deque(range(count))
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._pending: list[tuple[int, ChunkReady]] = []  # released once their copy is done
        self.closed = False
        self.high_water = 0  # most buffers ever taken at once (tests, metrics)

    @property
    def free_count(self) -> int:
        self._sweep()
        return len(self._free)

    def buffer(self, i: int) -> torch.Tensor:
        b = self._buffers[i]
        if b is None:
            b = self._buffers[i] = self._alloc(self.piece_bytes)
        return b

    def release_after(self, i: int, ready: ChunkReady) -> None:
        """Return buffer ``i`` once a copy still using it finished (checked whenever a
        buffer is wanted; :meth:`acquire` with none free waits for the oldest such copy)."""
        if ready.done():
            self.release(i)
        else:
            self._pending.append((i, ready))

    def reclaim_oldest(self) -> bool:
        """Wait for the oldest copy still holding a buffer and return that buffer; False
        when no copy holds one. The wait blocks: it is one piece's copy, and the socket
        must not stop reading while a frame is half in."""
        if not self._pending:
            return False
        i, ready = self._pending.pop(0)
        _spin(ready)
        self.release(i)
        return True

    def try_acquire(self) -> int | None:
        if self.closed:
            raise TransportError("staging pool is closed")
        self._sweep()
        if not self._free:
            return None
        i = self._free.popleft()
        self.high_water = max(self.high_water, self.count - len(self._free))
        return i

    def _sweep(self) -> None:
        """Free the buffers whose copies finished. Each copy is asked once: one that
        finishes between two looks would otherwise be neither free nor pending."""
        if self._pending:
            running = []
            for i, ready in self._pending:
                if ready.done():
                    self._free.append(i)
                else:
                    running.append((i, ready))
            self._pending = running

    async def acquire(self) -> int:
        while True:
            i = self.try_acquire()
            if i is not None:
                return i
            if self._pending:  # a copy holds a buffer, which is free once the copy finished
                await self._pending[0][1].wait()
                continue
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut

    def release(self, i: int) -> None:
        if i in self._free:
            raise ValueError(f"staging buffer {i} released twice")
        self._free.append(i)
        self._wake()

    def close(self) -> None:
        """Fail every waiter (and later acquire): the connection or transport is gone."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return


Send = Callable[[Piece, memoryview, Callable[[], None]], None]
"""Queue a piece's staged bytes on the socket; call the release callback once it took them."""


async def stage_out(pieces: Iterator[Piece] | list[Piece], pool: StagingPool, copy_out: CopyFn, send: Send) -> int:
    """Send ``pieces`` through ``pool`` (see the module docstring); returns bytes sent."""
    inflight: collections.deque[tuple[Piece, int, ChunkReady]] = collections.deque()
    sent = 0

    async def hand_over_oldest() -> None:
        nonlocal sent
        piece, i, ready = inflight.popleft()
        if not ready.done():
            await ready.wait()
        view = memoryview(pool.buffer(i).numpy()).cast("B")[: piece.nbytes]  # type: ignore[arg-type]
        sent += piece.nbytes
        send(piece, view, _once(pool.release, i))

    try:
        for piece in pieces:
            while pool.free_count == 0 and inflight:  # every buffer busy: the oldest copy goes out first
                await hand_over_oldest()
            i = await pool.acquire()  # none free: the socket still holds them all
            try:
                ready = copy_out(piece, pool.buffer(i))
            except BaseException:
                pool.release(i)
                raise
            inflight.append((piece, i, ready))
            while inflight and inflight[0][2].done():
                await hand_over_oldest()
        while inflight:
            await hand_over_oldest()
    finally:
        for _, i, ready in inflight:  # cancelled or failed: buffers whose copies were never sent
            pool.release_after(i, ready)
    return sent


def _once(fn: Callable[[int], None], i: int) -> Callable[[], None]:
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            fn(i)

    return call


class StagedReceive:
    """One frame's payload received through ``pool`` into device regions (see the module
    docstring). The driver (a socket reader) asks :meth:`next_buffer` for where the next
    piece's bytes go, calls :meth:`piece_received` when they are in, and once
    :attr:`all_received`, polls :meth:`reap_all` until every copy finished."""

    def __init__(self, pieces: list[Piece], pool: StagingPool, copy_in: CopyFn) -> None:
        self.pieces = pieces
        self.pool = pool
        self.copy_in = copy_in
        self._next = 0
        self._current: int | None = None
        self._copying: collections.deque[ChunkReady] = collections.deque()  # this frame's copies, oldest first

    @property
    def all_received(self) -> bool:
        return self._next == len(self.pieces) and self._current is None

    def next_buffer(self) -> memoryview:
        if self._current is not None or self._next >= len(self.pieces):
            raise TransportError("StagedReceive.next_buffer: no piece is expected now")
        i = self.pool.try_acquire()
        while i is None:  # every buffer is under a copy into the device, this frame's or an earlier one's
            if not self.pool.reclaim_oldest():
                raise TransportError("staging pool exhausted: no copy holds a buffer")
            i = self.pool.try_acquire()
        try:
            buf = self.pool.buffer(i)
        except BaseException:
            self.pool.release(i)
            raise
        self._current = i
        n = self.pieces[self._next].nbytes
        return memoryview(buf.numpy()).cast("B")[:n]  # type: ignore[arg-type]

    def piece_received(self) -> None:
        i = self._current
        if i is None:
            raise TransportError("StagedReceive.piece_received: no piece was being received")
        piece = self.pieces[self._next]
        self._current = None
        self._next += 1
        try:
            ready = self.copy_in(piece, self.pool.buffer(i))
        except BaseException:
            self.pool.release(i)
            raise
        self.pool.release_after(i, ready)  # the pool hands the buffer out again once the copy finished
        self._copying.append(ready)

    def reap_all(self) -> bool:
        """True once every piece is in and every copy of this frame finished."""
        while self._copying and self._copying[0].done():
            self._copying.popleft()
        return not self._copying and self._current is None

    def abandon(self) -> None:
        """Stop here (the room was released, or the connection is gone): the buffer a piece
        was being read into goes back now, those of copies still running once they finish."""
        if self._current is not None:
            self.pool.release(self._current)
            self._current = None
        self._copying.clear()
        self._next = len(self.pieces)


def _spin(ready: ChunkReady) -> None:
    ready.synchronize()
    while not ready.done():
        pass
