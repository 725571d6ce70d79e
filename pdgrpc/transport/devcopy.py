"""Copies between registered device regions and a staging buffer, for
:mod:`pdgrpc.transport.staging`: :func:`gather_into` (device to host, the sender) and
:func:`scatter_from` (host to device, the receiver).

A piece of a scattered transfer is thousands of small byte ranges (one per page and
layer). One ``copy_`` per range would cost a launch each, so ranges of one region that
share an alignment ``unit`` (their offsets' and lengths' greatest common divisor, at
least :data:`MIN_UNIT` bytes) move as rows of the region viewed ``[-1, unit]``: one
``index_select`` (or ``index_copy_``) and one contiguous copy per region. Fewer ranges,
or odd alignments, are copied one by one.

The copies are queued on the device's current stream and a
:class:`~pdgrpc.engine.device.ChunkReady` recorded after them is returned. The receiver
uses the current stream on purpose: whatever the engine later queues on that stream
(a decode step reading the pages, a reused page being rewritten) runs after the copy, so
a copy into a released room's pages can never land on top of newer data. On the CPU the
same code runs synchronously (:data:`~pdgrpc.engine.device.READY`), which is what the
unit tests use.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import torch

from pdgrpc.engine.device import ChunkReady, chunk_ready_on
from pdgrpc.transport.staging import Piece

__all__ = ["MIN_UNIT", "gather_into", "scatter_from"]

MIN_UNIT = 64  # below this, rows are too small for an index copy to pay off
_FEW = 8  # ranges of one region copied one by one up to this many


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


def gather_into(regions: Mapping[int, torch.Tensor], piece: Piece, buf: torch.Tensor) -> ChunkReady:
    """Start copying the piece's ranges of ``regions`` (flat uint8 tensors) into
    ``buf[:piece.nbytes]``, back to back."""
    device = torch.device("cpu")
    for r, offs, lens, at in _groups(piece):
        flat = regions[r]
        device = flat.device
        n = int(lens.sum())
        plan = _rows(offs, lens, flat.numel())
        if plan is None:
            for o, k in zip(offs.tolist(), lens.tolist()):
                buf[at : at + k].copy_(flat[o : o + k], non_blocking=True)
                at += k
            continue
        unit, rows = plan
        idx = torch.from_numpy(rows).to(device, non_blocking=True)
        picked = flat.view(-1, unit).index_select(0, idx)
        buf[at : at + n].copy_(picked.view(-1), non_blocking=True)
    return chunk_ready_on(device)


def scatter_from(regions: Mapping[int, torch.Tensor], piece: Piece, buf: torch.Tensor) -> ChunkReady:
    """Start copying ``buf[:piece.nbytes]`` into the piece's ranges of ``regions``."""
    device = torch.device("cpu")
    for r, offs, lens, at in _groups(piece):
        flat = regions[r]
        device = flat.device
        n = int(lens.sum())
        plan = _rows(offs, lens, flat.numel())
        if plan is None:
            for o, k in zip(offs.tolist(), lens.tolist()):
                flat[o : o + k].copy_(buf[at : at + k], non_blocking=True)
                at += k
            continue
        unit, rows = plan
        idx = torch.from_numpy(rows).to(device, non_blocking=True)
        src = buf[at : at + n].to(device, non_blocking=True).view(-1, unit)
        flat.view(-1, unit).index_copy_(0, idx, src)
    return chunk_ready_on(device)
