"""Fault injection for tests: a :class:`Transport` wrapper that makes a receiver see its
metadata rows late, or see one row with a wrong ``bootstrap_room``.

:class:`FaultyTransport` delegates every hook and attribute to the wrapped transport;
only what the *receiver* side reports changes (rooms this instance advertised):

``delay_metadata_s`` (> 0)
    A room whose inner status becomes ``SUCCESS`` is reported (``status``, ``poll``,
    ``wait``) as ``TRANSFERRING`` until ``delay_metadata_s`` seconds after the wrapper
    first observed the inner ``SUCCESS`` (in any of those calls): the decode sees the
    metadata "late". ``wait`` honours the delay: it returns once the delayed ``SUCCESS``
    is visible (or at its timeout). ``FAILED`` is never delayed.

``corrupt_nth_room`` (N > 0)
    The N-th advertised room (counting successful ``advertise`` calls from 1), at the
    moment the wrapper first observes its inner ``SUCCESS``, gets the ``bootstrap_room``
    field of its metadata row overwritten -- once -- in the registered metadata region
    (:data:`~pdgrpc.transport.pages.METADATA_REGION_ID`, the grant's slot) with another
    non-zero value (``room ^ 1``; ``room + 1`` where that would be 0). The field is the
    row's last one (:class:`~pdgrpc.state.metadata.MetadataLayout`): an int64 at
    ``row_bytes - FIELD_ALIGN``, which is what
    :meth:`~pdgrpc.state.metadata.MetadataBuffers.room_column` reads; ``room_offset``
    overrides that for rows of another layout. Rooms corrupted so far are listed in
    :attr:`FaultyTransport.corrupted_rooms`. A room that fails, is released first or has
    no slot is not corrupted.

A test harness: nothing in the servers loads it by itself. A test loads a subclass through
the transport registry's ``module:Class`` names (``--transport tests.e2e.faulty:...``),
whose constructor picks the inner backend and the faults; see ``tests/e2e/faulty.py``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Sequence

import torch

from pdgrpc.errors import ConfigError
from pdgrpc.kvpoll import KVPoll
from pdgrpc.state.metadata import FIELD_ALIGN
from pdgrpc.transport.base import MemoryRegion, Peer, RoomGrant, RoomStates, RoomStatus, Transport, WriteOp
from pdgrpc.transport.pages import METADATA_REGION_ID

__all__ = ["FaultyTransport"]

_ROOM_BYTES = 8  # bootstrap_room is an int64

log = logging.getLogger("pdgrpc.transport.testing.faults")


class _Room:
    __slots__ = ("ordinal", "slot", "seen_success")

    def __init__(self, ordinal: int, slot: int | None) -> None:
        self.ordinal = ordinal
        self.slot = slot
        self.seen_success: float | None = None  # monotonic time the inner SUCCESS was first observed


class FaultyTransport(Transport):
    """See the module docstring. ``inner`` is used as is (register it through the
    wrapper, or before wrapping: both work)."""

    def __init__(self, inner: Transport, *, delay_metadata_s: float = 0.0, corrupt_nth_room: int = 0,
                 room_offset: int | None = None) -> None:
        # no super().__init__(): instance_id and rooms are the inner transport's
        if isinstance(delay_metadata_s, bool) or not isinstance(delay_metadata_s, (int, float)) \
                or not math.isfinite(delay_metadata_s) or delay_metadata_s < 0:
            raise ConfigError(f"FaultyTransport: delay_metadata_s must be a number >= 0, got {delay_metadata_s!r}")
        if isinstance(corrupt_nth_room, bool) or not isinstance(corrupt_nth_room, int) or corrupt_nth_room < 0:
            raise ConfigError(f"FaultyTransport: corrupt_nth_room must be an int >= 0, got {corrupt_nth_room!r}")
        if room_offset is not None and room_offset < 0:
            raise ConfigError(f"FaultyTransport: room_offset must be >= 0, got {room_offset}")
        self._inner = inner
        self.delay_metadata_s = float(delay_metadata_s)
        self.corrupt_nth_room = corrupt_nth_room
        self._room_offset = room_offset
        self.corrupted_rooms: list[int] = []
        self._meta: MemoryRegion | None = None
        self._advertised = 0
        self._recv: dict[int, _Room] = {}

    # -- delegated attributes ---------------------------------------------------------
    @property
    def inner(self) -> Transport:
        return self._inner

    # Read-only views of the inner transport's attributes, by design (the wrapper has
    # no state of its own to set; nothing assigns these on a Transport after __init__),
    # hence the ignores: mypy wants an override of a writable attribute to be writable.
    @property
    def name(self) -> str:  # type: ignore[override]  # noqa: D401 - the inner backend's name
        return self._inner.name

    @property
    def moves_bytes(self) -> bool:  # type: ignore[override]
        return self._inner.moves_bytes

    @property
    def instance_id(self) -> str:  # type: ignore[override]
        return self._inner.instance_id

    @property
    def rooms(self) -> RoomStates:  # type: ignore[override]
        return self._inner.rooms

    def __getattr__(self, attr: str) -> Any:
        # only reached for attributes this class does not define: anything else a
        # caller reads from the backend (options, endpoints, ...)
        if attr.startswith("__") or attr == "_inner":
            raise AttributeError(attr)
        return getattr(self._inner, attr)

    def __repr__(self) -> str:
        return (f"FaultyTransport({self._inner!r}, delay_metadata_s={self.delay_metadata_s}, "
                f"corrupt_nth_room={self.corrupt_nth_room})")

    # -- hooks ------------------------------------------------------------------------
    async def register(self, regions: Sequence[MemoryRegion]) -> bytes:
        desc = await self._inner.register(regions)
        for r in regions:
            if r.region_id == METADATA_REGION_ID:
                self._meta = r
        return desc

    async def connect(self, descriptor: bytes) -> Peer:
        return await self._inner.connect(descriptor)

    def set_credential(self, receiver_id: str, credential: bytes) -> None:
        self._inner.set_credential(receiver_id, credential)

    def issue_credential(self, writer_id: str) -> bytes:
        return self._inner.issue_credential(writer_id)

    def writer_gone(self, writer_id: str) -> bool:
        return self._inner.writer_gone(writer_id)

    def advertise(self, grant: RoomGrant) -> None:
        self._inner.advertise(grant)
        self._advertised += 1
        self._recv[grant.room] = _Room(self._advertised, grant.slot)

    async def write(
        self, peer: Peer, room: int, ops: Sequence[WriteOp], *, metadata: WriteOp | None = None
    ) -> None:
        await self._inner.write(peer, room, ops, metadata=metadata)

    def poll(self, room: int) -> KVPoll:
        return self.status(room).state

    def status(self, room: int) -> RoomStatus:
        return self._view(room, self._inner.status(room))

    async def wait(self, room: int, timeout: float) -> RoomStatus:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        while True:
            st = self.status(room)
            left = deadline - loop.time()
            if st.state.is_terminal or left <= 0:
                return st
            rr = self._recv.get(room)
            if rr is not None and rr.seen_success is not None:  # inner SUCCESS, held back
                await asyncio.sleep(min(left, rr.seen_success + self.delay_metadata_s - time.monotonic()))
            else:
                await self._inner.wait(room, left)

    def release(self, room: int) -> None:
        self._recv.pop(room, None)
        self._inner.release(room)

    def fail_peer(self, instance_id: str, reason: str) -> None:
        self._inner.fail_peer(instance_id, reason)

    async def drain(self, room: int, timeout: float) -> bool:
        return await self._inner.drain(room, timeout)

    async def close(self) -> None:
        await self._inner.close()

    # -- faults -----------------------------------------------------------------------
    def _view(self, room: int, st: RoomStatus) -> RoomStatus:
        rr = self._recv.get(room)
        if rr is None or st.state is not KVPoll.SUCCESS:
            return st
        now = time.monotonic()
        if rr.seen_success is None:
            rr.seen_success = now
            if self.corrupt_nth_room and rr.ordinal == self.corrupt_nth_room:
                self._corrupt(room, rr)
        if now - rr.seen_success < self.delay_metadata_s:
            return RoomStatus(KVPoll.TRANSFERRING)
        return st

    def _corrupt(self, room: int, rr: _Room) -> None:
        region = self._meta
        if region is None or rr.slot is None:
            log.warning("pdgrpc transport test faults: room %d has no metadata row to corrupt", room)
            return
        row_bytes = region.item_bytes
        off = self._room_offset if self._room_offset is not None else row_bytes - FIELD_ALIGN
        if not 0 <= off <= row_bytes - _ROOM_BYTES:
            raise ConfigError(f"FaultyTransport: room field at {off} does not fit a {row_bytes} B metadata row")
        flat = region.tensor.detach().reshape(-1).view(torch.uint8)
        start = rr.slot * row_bytes + off
        field = flat[start : start + _ROOM_BYTES]
        old = int(field.cpu().clone().view(torch.int64)[0])
        new = old ^ 1 or old + 1
        field.copy_(torch.tensor([new], dtype=torch.int64).view(torch.uint8).to(field.device))
        self.corrupted_rooms.append(room)
        log.warning("pdgrpc transport test faults: room %d slot %d: bootstrap_room %d overwritten with %d",
                    room, rr.slot, old, new)
