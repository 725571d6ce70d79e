"""Copies between registered device regions and a staging buffer, for
:mod:`pdgrpc.transport.staging`: :func:`gather_into` (device to host, the sender) and
:func:`scatter_from` (host to device, the receiver).

A piece of a scattered transfer is thousands of small byte ranges (one per page and
layer). One ``copy_`` per range would cost a launch each, so ranges of one region that
share an alignment ``unit`` (their offsets' and lengths' greatest common divisor, at
least :data:`MIN_UNIT` bytes) move as rows of the region viewed ``[-1, unit]``: one
``index_select`` (or ``index_copy_``) and one contiguous copy per region. Fewer ranges,
or odd alignments, are copied one by one. Both directions walk the piece the same way
(:func:`_copy`); they differ only in which side of each copy is the source.

The copies are queued on the device's current stream and a
:class:`~pdgrpc.device.ChunkReady` recorded after them is returned. The receiver
uses the current stream on purpose: whatever the engine later queues on that stream
(a decode step reading the pages, a reused page being rewritten) runs after the copy, so
a copy into a released room's pages can never land on top of newer data. On the CPU the
same code runs synchronously (:data:`~pdgrpc.device.READY`), which is what the
unit tests use.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np
import torch

from pdgrpc.device import ChunkReady, chunk_ready_on
from pdgrpc.transport.staging import Piece

__all__ = ["MIN_UNIT", "gather_into", "scatter_from"]

MIN_UNIT = 64  # below this, rows are too small for an index copy to pay off
_FEW = 8  # ranges of one region copied one by one up to this many

# One range: (its bytes in the region, its bytes in the buffer).
CopyRange = Callable[[torch.Tensor, torch.Tensor], None]
# Many aligned ranges: (the region viewed [-1, unit], the ranges' row indices on its
# device, their bytes back to back in the buffer).
CopyRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def _groups(piece: Piece) -> list[tuple[int, np.ndarray, np.ndarray, int]]:
    """``(region, offsets, lengths, start in the buffer)`` runs of one region, in order."""
    regions, offsets, lengths = piece
    pos = np.concatenate(([0], np.cumsum(lengths)))
    cut = np.flatnonzero(regions[1:] != regions[:-1]) + 1
    return [(int(regions[a]), offsets[a:b], lengths[a:b], int(pos[a]))
            for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(regions)])]


def _rows(offsets: np.ndarray, lengths: np.ndarray, nbytes: int) -> tuple[int, np.ndarray] | None:
    """The alignment unit and the row indices of the ranges in a ``[-1, unit]`` view, or
    None when the ranges are few or not aligned to at least :data:`MIN_UNIT` bytes."""
    if len(offsets) <= _FEW:
        return None
    unit = math.gcd(int(np.gcd.reduce(offsets)), int(np.gcd.reduce(lengths)), nbytes)
    if unit < MIN_UNIT:
        return None
    counts = lengths // unit
    first = np.repeat(offsets // unit - (np.cumsum(counts) - counts), counts)
    return unit, first + np.arange(int(counts.sum()))


def _copy(regions: Mapping[int, torch.Tensor], piece: Piece, buf: torch.Tensor,
          one: CopyRange, rows: CopyRows) -> ChunkReady:
    """Walk the piece's ranges of ``regions`` (flat uint8 tensors) against
    ``buf[:piece.nbytes]``, back to back, copying each group with ``rows`` where it is
    aligned and ``one`` range at a time where it is not."""
    device = torch.device("cpu")
    for r, offs, lens, at in _groups(piece):
        flat = regions[r]
        device = flat.device
        plan = _rows(offs, lens, flat.numel())
        if plan is None:
            for o, k in zip(offs.tolist(), lens.tolist()):
                one(flat[o : o + k], buf[at : at + k])
                at += k
            continue
        unit, idx = plan
        rows(flat.view(-1, unit), torch.from_numpy(idx).to(device, non_blocking=True), buf[at : at + int(lens.sum())])
    return chunk_ready_on(device)


def _gather_range(region: torch.Tensor, buf: torch.Tensor) -> None:
    buf.copy_(region, non_blocking=True)


def _gather_rows(table: torch.Tensor, idx: torch.Tensor, buf: torch.Tensor) -> None:
    buf.copy_(table.index_select(0, idx).view(-1), non_blocking=True)


def _scatter_range(region: torch.Tensor, buf: torch.Tensor) -> None:
    region.copy_(buf, non_blocking=True)


def _scatter_rows(table: torch.Tensor, idx: torch.Tensor, buf: torch.Tensor) -> None:
    table.index_copy_(0, idx, buf.to(table.device, non_blocking=True).view(-1, table.shape[1]))


def gather_into(regions: Mapping[int, torch.Tensor], piece: Piece, buf: torch.Tensor) -> ChunkReady:
    """Start copying the piece's ranges of ``regions`` (flat uint8 tensors) into
    ``buf[:piece.nbytes]``, back to back."""
    return _copy(regions, piece, buf, _gather_range, _gather_rows)


def scatter_from(regions: Mapping[int, torch.Tensor], piece: Piece, buf: torch.Tensor) -> ChunkReady:
    """Start copying ``buf[:piece.nbytes]`` into the piece's ranges of ``regions``."""
    return _copy(regions, piece, buf, _scatter_range, _scatter_rows)
