"""Metadata slot allocator.

A slot is one row of :class:`~pdgrpc.state.metadata.MetadataBuffers`; the slot count bounds
the transfers in flight. The rules that prevent the peers' bugs:

* :meth:`SlotAllocator.free` **zeroes the row's room before the slot returns to the pool**,
  so the next owner never sees its predecessor's room (a "stale room" reads as corruption
  and aborts a healthy request).
* Double free and freeing a slot that was never allocated raise :class:`SlotError`.
* A full pool makes :meth:`alloc` return ``None``: the caller waits; nothing is overwritten.

Allocation order is deterministic (FIFO of freed slots): TP ranks that apply the same
alloc/free sequence hold the same slot numbers, which the lock-step poll relies on.
"""

from __future__ import annotations

import collections

from pdgrpc.errors import SlotError
from pdgrpc.state.metadata import MetadataBuffers

__all__ = ["SlotAllocator"]


class SlotAllocator:
    def __init__(self, buffers: MetadataBuffers) -> None:
        self.buffers = buffers
        self._free: collections.deque[int] = collections.deque(range(buffers.num_slots))
        self._used = bytearray(buffers.num_slots)

    def alloc(self) -> int | None:
        """A free slot (its room is 0), or None when every slot is in use."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._used[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.buffers.num_slots:
            raise SlotError(f"free({slot}): slot out of range [0, {self.buffers.num_slots})")
        if not self._used[slot]:
            raise SlotError(f"free({slot}): slot is not allocated (double free, or never allocated)")
        # Zero first: once the slot is back in the pool, its next owner's gate reads this room.
        self.buffers.clear_room(slot)
        self._used[slot] = 0
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_slots(self) -> int:
        return self.buffers.num_slots
