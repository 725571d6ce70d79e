"""The ``tcp`` backend's wire format (described in the :mod:`pdgrpc.transport.tcp` module
docstring): the frame header and op table, the limits a frame must respect, and the
gather lists that send a frame's payload straight from the source tensors."""

from __future__ import annotations

import struct
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from pdgrpc.errors import ConfigError
from pdgrpc.transport.receiver import MessageType

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
MAX_CONTROL_BYTES = 64 * 1024  # hello bodies and reasons; anything larger is a protocol error
# Replies (ACK, NACK, PING) a receiver queues for a writer past what its socket took: a
# writer reads them as they come, so more waiting means it reads none, and each one it
# provokes would otherwise cost the receiver memory. Past it, a protocol error.
MAX_UNREAD_REPLY_BYTES = 1 << 20
_STRIDED_MIN = 128  # slices in one region before a strided numpy view pays off (it has a fixed cost)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable flat byte memoryview over a contiguous CPU tensor's storage."""
    if tensor.device.type != "cpu":
        raise ConfigError(f"tcp transport needs CPU tensors, got one on {tensor.device}")
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def merge_adjacent(regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
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


def op_table(regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A frame's op table (destination side) as ``OP_DTYPE`` rows."""
    table = np.zeros(len(lengths), dtype=OP_DTYPE)
    table["region"], table["offset"], table["length"] = regions, offsets, lengths
    return table


def frame_buffers(hdr: bytes, table: np.ndarray, chunk: np.ndarray,
                  views: Mapping[int, memoryview]) -> tuple[list[memoryview], list[int]]:
    """Header, op table and the source slices of one WRITE frame (gather list, adjacent
    slices merged), with cumulative sizes."""
    regions, offsets, lengths = merge_adjacent(chunk[:, 0], chunk[:, 1], chunk[:, 4])
    bufs: list[Any] = [memoryview(hdr), memoryview(table).cast("B")]  # type: ignore[arg-type]
    if len(lengths) < _STRIDED_MIN:
        bufs += [views[r][o : o + n] for r, o, n in zip(regions.tolist(), offsets.tolist(), lengths.tolist())]
    else:
        _add_slices(bufs, regions, offsets, lengths, views)
    ends = np.cumsum(np.concatenate(([len(hdr), table.nbytes], lengths))).tolist()
    return bufs, ends


def _add_slices(bufs: list[Any], regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                views: Mapping[int, memoryview]) -> None:
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
