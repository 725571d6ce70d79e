"""The ``tcp`` backend's device (CUDA) regions: KV pages staged through pinned host
buffers (:mod:`pdgrpc.transport.staging`), since a socket reads and writes host memory.

:class:`TcpDevice` is the narrow hook the sender and the receiver call:

* ``add(region)`` at registration: keeps each region's flat bytes; says whether the region
  is device memory (no memoryview of it exists then). Metadata rows must be host memory.
* ``write(...)`` when a write's source ranges touch a device region: the ranges are cut
  into staging pieces, each piece gathered device-to-host into a pinned buffer while the
  previous one is on the wire, and sent as ordinary ``WRITE`` frames (at most
  ``MAX_OPS_PER_FRAME`` ops each). The wire format is unchanged: a host peer cannot tell.
* ``receive(...)`` when an authorized frame's destination touches a device region: the
  payload is read one piece at a time into a pinned buffer of that connection, each
  piece's host-to-device copy overlapping the read of the next; the frame's bytes count
  as landed once every copy finished. A room released mid-frame gets no further copies
  (the rest of the frame is read and dropped); copies already queued run on the device's
  current stream, ahead of anything later queued there (see :mod:`pdgrpc.transport.devcopy`).
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from pdgrpc.device import call_when
from pdgrpc.errors import ConfigError
from pdgrpc.transport.devcopy import gather_into, scatter_from
from pdgrpc.transport.memkind import MemoryKind, memory_kind
from pdgrpc.transport.regions import MemoryRegion, RegionKind
from pdgrpc.transport.staging import (
    PIECE_BYTES, POOL_BUFFERS, Piece, StagedReceive, StagingPool, pinned_empty, split_pieces, stage_out,
)
from pdgrpc.transport.tcp_conn import Conn
from pdgrpc.transport.tcp_wire import HEADER, MAX_OPS_PER_FRAME, WRITE, op_table

__all__ = ["TcpDevice"]


class TcpDevice:
    """Device regions of one tcp transport instance and their staging buffers."""

    def __init__(self, piece_bytes: int = PIECE_BYTES, buffers: int = POOL_BUFFERS,
                 alloc: Callable[[int], torch.Tensor] = pinned_empty) -> None:
        self.piece_bytes = piece_bytes
        self.buffers = buffers
        self.alloc = alloc
        self.flats: dict[int, torch.Tensor] = {}  # every registered region's bytes
        self.device_ids: set[int] = set()
        self._out: StagingPool | None = None
        self._table = np.zeros(0, dtype=bool)  # region id -> is device memory

    def add(self, region: MemoryRegion) -> bool:
        """Keep ``region``'s bytes; True when it is device memory."""
        flat = region.tensor.detach().reshape(-1)
        self.flats[region.region_id] = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
        if memory_kind(region.tensor) is MemoryKind.HOST:
            return False
        if region.kind is RegionKind.METADATA:
            raise ConfigError(
                f"tcp transport: metadata region {region.label} must be host memory (metadata rows stay on the host), "
                f"got a tensor on {region.tensor.device}"
            )
        self.device_ids.add(region.region_id)
        table = np.zeros(max(len(self._table), region.region_id + 1), dtype=bool)
        table[: len(self._table)] = self._table
        table[region.region_id] = True
        self._table = table
        return True

    @property
    def send_high_water(self) -> int:
        """Most staging buffers the sender held at once so far."""
        return 0 if self._out is None else self._out.high_water

    def touches(self, region_ids: np.ndarray) -> bool:
        """Whether any of ``region_ids`` is a device region (vectorized)."""
        if not self.device_ids or not len(region_ids):
            return False
        ids = np.asarray(region_ids, dtype=np.int64)
        inside = ids < len(self._table)
        return bool(self._table[ids[inside]].any())

    # -- sender ------------------------------------------------------------------------
    async def write(self, conn_for: Callable[[], Conn], room: int, arr: np.ndarray) -> int:
        """Send the ops ``arr`` (rows of :class:`~pdgrpc.transport.regions.WriteOps`) as
        staged ``WRITE`` frames; returns the payload bytes queued."""
        if self._out is None:
            self._out = StagingPool(self.buffers, self.piece_bytes, self.alloc)
        dst = split_pieces(arr[:, 2], arr[:, 3], arr[:, 4], self.piece_bytes)

        def send(piece: Piece, view: memoryview, release: Callable[[], None]) -> None:
            d = next(dst)  # pieces go out in order, and both sides cut at the same byte counts
            conn = conn_for()
            if conn.closed:
                return release()
            conn.on_close.append(release)
            at = 0
            n = len(d.lengths)
            for a in range(0, n, MAX_OPS_PER_FRAME):
                b = min(n, a + MAX_OPS_PER_FRAME)
                table = op_table(d.regions[a:b], d.offsets[a:b], d.lengths[a:b])
                size = int(d.lengths[a:b].sum())
                bufs = [memoryview(HEADER.pack(WRITE, b - a, room, size, 0)), memoryview(table).cast("B"),  # type: ignore[arg-type]
                        view[at : at + size]]
                at += size
                conn.send(bufs, functools.partial(_sent, conn, release) if b == n else None)

        src = split_pieces(arr[:, 0], arr[:, 1], arr[:, 4], self.piece_bytes)
        return await stage_out(src, self._out, functools.partial(gather_into, self.flats), send)

    # -- receiver ----------------------------------------------------------------------
    def receive(self, conn: Conn, still_granted: Callable[[], bool], regions: np.ndarray, offsets: np.ndarray,
                lengths: np.ndarray, landed: Callable[[], None]) -> None:
        """Read the current frame's payload (destination ranges ``regions``/``offsets``/
        ``lengths``, already authorized) through this connection's staging buffers into
        the device regions; ``landed()`` once every byte is in device memory. While
        ``still_granted()`` is false (the room was released) nothing more is copied."""
        if conn.staging is None:
            pool = conn.staging = StagingPool(self.buffers, self.piece_bytes, self.alloc)
            conn.on_close.append(pool.close)
        pieces = list(split_pieces(regions, offsets, lengths, self.piece_bytes))
        rx = StagedReceive(pieces, conn.staging, functools.partial(scatter_from, self.flats))
        remaining = int(np.asarray(lengths).sum())

        def next_piece() -> None:
            try:
                view = rx.next_buffer()
            except Exception as exc:  # e.g. pinned memory could not be allocated
                rx.abandon()
                return conn.lose(f"tcp: staging a frame into device memory failed: {exc!r}")
            conn.expect([view], functools.partial(got_piece, len(view)), [len(view)])

        def got_piece(n: int) -> None:
            nonlocal remaining
            remaining -= n
            if not still_granted():  # released mid-frame: drop the rest, copy nothing more
                rx.abandon()
                return conn.discard(remaining, conn.next_frame) if remaining else conn.next_frame()
            try:
                rx.piece_received()
            except Exception as exc:  # the copy into device memory could not be queued
                rx.abandon()
                return conn.lose(f"tcp: copying a frame into device memory failed: {exc!r}")
            if not rx.all_received:
                return next_piece()
            conn.next_frame()
            # A connection that closes before the copies finished stops the wait: its frame never lands.
            call_when(lambda: rx.reap_all() or conn.closed, lambda: landed() if rx.reap_all() else None)

        if not pieces:
            conn.next_frame()
            return landed()
        next_piece()


def _sent(conn: Conn, release: Callable[[], None]) -> None:
    try:
        conn.on_close.remove(release)
    except ValueError:
        pass
    release()
