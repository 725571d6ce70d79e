"""The ``rdma`` backend's packed data messages: a message of many ranges in GPU memory
travels as one contiguous device buffer.

UCX moves a contiguous message of GPU memory between two processes with one GPU-to-GPU
copy (``cuda_ipc``), but an iov message of GPU memory fragment by fragment through host
shared memory, a copy per fragment, so thousands of page ranges cost thousands of
copies. So a data message of several ops whose ranges
touch GPU memory is *packed*: the sender gathers its ranges into one device buffer and
sends that; the receiver receives it into one device buffer and scatters it into the
granted pages, and counts the bytes as landed only once the scatter finished. Each side
decides alone (the bytes on the wire and their order are the same either way), so a
packing peer and one that is not interoperate, host peers included.

Gathers run on a stream of their own: the pages they read are final (a prefill hands a
chunk's pages over only after its compute finished), so they need not queue behind the
engine's next chunk. Scatters run on the device's current stream, as
:mod:`pdgrpc.transport.devcopy` explains: whatever the engine later queues there (a
decode step reading the pages) runs after them.

Buffers come from torch's caching allocator, within a byte budget per transport
(``pack_max``, both directions); a message that does not fit the budget, or finds the
device full, travels as an iov message, which is slower but moves the same bytes.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import torch

from pdgrpc.device import ChunkReady, CudaChunkReady
from pdgrpc.errors import ConfigError
from pdgrpc.transport.devcopy import gather_into, scatter_from
from pdgrpc.transport.rdma_regions import Regions
from pdgrpc.transport.staging import Piece

__all__ = ["PACK_MAX", "Pack", "Packer"]

PACK_MAX = 256 << 20  # bytes of packed buffers in flight per side, by default


class Pack(enum.Enum):
    """Which data messages travel packed (the ``pack`` option)."""

    AUTO = "auto"  # those whose ranges touch GPU memory
    ALWAYS = "always"  # every message of several ops, host memory too (tests, measurements)
    NEVER = "never"  # none: every message is an iov message

    @classmethod
    def parse(cls, value: object) -> "Pack":
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"rdma: pack must be one of {', '.join(p.value for p in cls)}, got {value!r}") from None


class Packer:
    """Packed buffers of one transport instance: which messages to pack, the gathers
    and scatters, and the byte budget both sides' buffers draw from."""

    def __init__(self, regions: Regions, mode: Pack = Pack.AUTO, budget: int = PACK_MAX) -> None:
        if budget < 0:
            raise ConfigError(f"rdma: pack_max must be >= 0 bytes, got {budget}")
        self._regions = regions
        self._mode = mode
        self._budget = budget
        self.in_use = 0  # bytes of packed buffers alive now
        self._streams: dict[torch.device, Any] = {}

    def wants(self, region_ids: np.ndarray) -> bool:
        """Whether a message of several ops over ``region_ids`` travels packed."""
        if self._mode is Pack.NEVER or len(region_ids) < 2:
            return False
        if self._mode is Pack.ALWAYS:
            return True
        return self._regions.any_device and bool(self._regions.device[region_ids].any())

    def _take(self, nbytes: int) -> bool:
        if self.in_use + nbytes > self._budget:
            return False
        self.in_use += nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        """A packed buffer of ``nbytes`` is no longer used (its send or scatter finished)."""
        self.in_use -= nbytes

    def _device_of(self, region_ids: np.ndarray) -> torch.device:
        dev = self._regions.device[region_ids]
        first = int(region_ids[int(np.argmax(dev))]) if dev.any() else int(region_ids[0])
        return self._regions.by_id[first].flat.device

    def gather(self, regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
               ) -> tuple[torch.Tensor, ChunkReady] | None:
        """Start gathering the ranges into a new buffer; None when the budget is spent."""
        nbytes = int(lengths.sum())
        if not self._take(nbytes):
            return None
        device = self._device_of(regions)
        piece = Piece(regions, offsets, lengths)
        try:
            if device.type != "cuda":
                buf = torch.empty(nbytes, dtype=torch.uint8)
                return buf, gather_into(self._regions.flats, piece, buf)
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
                gather_into(self._regions.flats, piece, buf)
                return buf, CudaChunkReady(device, stream)
        except torch.OutOfMemoryError:  # the device is full: this message travels as iov
            self.give_back(nbytes)
            return None

    def receive_buffer(self, regions: np.ndarray, nbytes: int) -> torch.Tensor | None:
        """A buffer to receive a packed message of ``nbytes`` into (on the device of the
        ranges it is scattered to); None when the budget is spent."""
        if not self._take(nbytes):
            return None
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self._device_of(regions))
        except torch.OutOfMemoryError:  # the device is full: this message is received as iov
            self.give_back(nbytes)
            return None

    def scatter(self, buf: torch.Tensor, regions: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> ChunkReady:
        """Start scattering ``buf`` into the ranges, on the current stream."""
        return scatter_from(self._regions.flats, Piece(regions, offsets, lengths), buf)
