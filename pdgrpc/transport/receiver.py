"""The receiver core every byte-moving backend shares: what a room was granted, whether a
write may land (the grant check), how many bytes landed, and when the
metadata row may be committed (only after every KV byte the sender wrote before it).
A write of a few ops is checked op by op, a longer one in one numpy pass; both give the
same verdicts and messages.

A backend drives it with plain calls and moves the bytes itself; nothing here does I/O::

    core = Receiver(transport.rooms)
    core.add_region(info)                         # register()
    core.advertise(RoomGrant.of(room, pages, slot))
    rr = core.accept(room, peer_id, regions, offsets, lengths)   # raises UnauthorizedWrite
    ... receive the payload into the authorized bytes ...
    core.landed(rr, nbytes)                       # may commit the row and call ack()
    core.stage_metadata(rr, kv_bytes_before, commit=copy_row, ack=send_ack)

A refused write raises :class:`~pdgrpc.errors.UnauthorizedWrite` carrying a
:class:`Refusal`; the room (if tracked) has already failed with the same refusal, and
the backend drops the payload and tells the sender (``NACK`` with the refusal's code).
The sender's room then fails with that :class:`Refusal` in its
:class:`~pdgrpc.transport.rooms.RoomStatus`, so callers decide on the enum, never on
the text.
"""

from __future__ import annotations

import bisect
import enum
from typing import Any, Callable

import numpy as np

from pdgrpc.errors import ConfigError, Refusal, UnauthorizedWrite
from pdgrpc.kvpoll import KVPoll
from pdgrpc.transport.grant import RoomGrant
from pdgrpc.transport.peerauth import RoomWriters
from pdgrpc.transport.regions import RegionInfo, RegionKind
from pdgrpc.transport.rooms import RoomStates, after_reactions

__all__ = ["MessageType", "Receiver", "ReceiveRoom", "Refusal", "RegionTable", "RoomGrant"]


class MessageType(enum.IntEnum):
    """Message types of the built-in wire protocols (tcp frames, rdma control messages)."""

    HELLO = 1  # sender -> receiver: instance ids (and backend data)
    HELLO_OK = 2
    HELLO_REFUSED = 3
    WRITE = 4  # pages for a room: op table, then payload
    META = 5  # the room's metadata row, with the KV bytes written before it
    ACK = 6  # receiver -> sender: the metadata row landed
    NACK = 7  # receiver -> sender: the room failed there (a refusal code, then the reason)
    PING = 8  # either way: still alive (tcp heartbeat)
    CHALLENGE = 9  # receiver -> sender, first on a connection: the nonce its HELLO must answer


_HUGE = 1 << 62  # offsets and lengths above this are outside any region (and would overflow int64 sums)
# Writes of at most this many ops are checked op by op in Python; longer ones in one numpy
# pass. Right after a wake-up (cold caches) a numpy pass has a large fixed cost whatever
# its length, so a metadata row or a contiguous write's few dozen runs are cheaper one by one.
_FEW_OPS = 64


class RegionTable:
    """The registered regions as lookup tables indexed by region id, so a write's ops are
    checked against a grant in one vectorised pass (one numpy round per write, not per
    region: a model has dozens of KV regions)."""

    def __init__(self) -> None:
        self.infos: dict[int, RegionInfo] = {}
        self._kind = np.zeros(1 << 16, dtype=np.int8)  # 0 none, 1 KV, 2 metadata
        self._nbytes = np.zeros(1 << 16, dtype=np.int64)
        self._item = np.ones(1 << 16, dtype=np.int64)
        self._few: dict[int, tuple[int, int, int]] = {}  # region id -> (kind, nbytes, item bytes)

    def add(self, info: RegionInfo) -> None:
        self.infos[info.region_id] = info
        self._few[info.region_id] = (2 if info.kind is RegionKind.METADATA else 1, info.nbytes, info.item_bytes)
        self._kind[info.region_id] = 2 if info.kind is RegionKind.METADATA else 1
        self._nbytes[info.region_id] = info.nbytes
        self._item[info.region_id] = info.item_bytes

    def authorize(self, grant: RoomGrant, regions: Any, offsets: Any, lengths: Any, *, metadata: bool = False) -> None:
        """Raise :class:`~pdgrpc.errors.UnauthorizedWrite` unless every op
        ``(regions[i], offsets[i], lengths[i])`` (destination side) lands inside what
        ``grant`` allows: page bytes (``metadata=False``) only in KV regions and the
        granted pages, a row (``metadata=True``) only in a metadata region's granted
        slot. The first offending op is named in the message."""
        if len(regions) <= _FEW_OPS:
            self._authorize_few(grant, _as_list(regions), _as_list(offsets), _as_list(lengths), metadata)
            return
        regions = np.asarray(regions).astype(np.int64)
        offs_in, lens_in = np.asarray(offsets), np.asarray(lengths)
        if len(regions) == 0:
            return
        huge = (offs_in > _HUGE) | (lens_in > _HUGE) | (offs_in < 0)
        offs = np.where(huge, 0, offs_in).astype(np.int64)
        lens = np.where(huge, 0, lens_in).astype(np.int64)
        rid_ok = (regions >= 0) & (regions < len(self._kind))
        rids = np.where(rid_ok, regions, 0)
        kind = np.where(rid_ok, self._kind[rids], 0)
        want = 2 if metadata else 1
        item = self._item[rids]
        first = offs // item
        last = (offs + np.maximum(lens, 1) - 1) // item
        bad = huge | (kind != want) | (lens <= 0) | (offs + lens > self._nbytes[rids])
        if metadata:
            slot = -1 if grant.slot is None else grant.slot
            bad |= (first != slot) | (last != first)
        else:
            starts, ends = grant.runs_array()
            if len(starts):
                idx = np.searchsorted(starts, first, side="right") - 1
                bad |= (idx < 0) | (last >= ends[np.maximum(idx, 0)])
            else:
                bad |= True
        if not bad.any():
            return
        j = int(bad.argmax())
        refusal, text = self._why(grant, int(regions[j]), int(offs_in[j]), int(lens_in[j]), metadata)
        raise UnauthorizedWrite(refusal, text)

    def _authorize_few(self, grant: RoomGrant, regions: list[int], offsets: list[int], lengths: list[int],
                       metadata: bool) -> None:
        """:meth:`authorize` op by op, with the same verdicts and messages."""
        want = 2 if metadata else 1
        slot = -1 if grant.slot is None else grant.slot
        starts, ends = grant.runs_lists()
        few = self._few
        for rid, off, n in zip(regions, offsets, lengths):
            entry = few.get(rid)
            if entry is not None and entry[0] == want and off >= 0 and n > 0 and off + n <= entry[1]:
                first, last = off // entry[2], (off + n - 1) // entry[2]
                if metadata:
                    if first == slot and last == first:
                        continue
                else:
                    i = bisect.bisect_right(starts, first) - 1
                    if i >= 0 and last < ends[i]:
                        continue
            refusal, text = self._why(grant, int(rid), int(off), int(n), metadata)
            raise UnauthorizedWrite(refusal, text)

    def _why(self, grant: RoomGrant, rid: int, off: int, n: int, metadata: bool) -> tuple[Refusal, str]:
        """The refusal and its message for one op the vectorised check refused."""
        info = self.infos.get(rid)
        if info is None:
            return Refusal.UNKNOWN_REGION, f"destination region {rid} is not registered here"
        if (info.kind is RegionKind.METADATA) != metadata:
            what = "metadata row" if metadata else "page"
            return Refusal.WRONG_KIND, f"{what} write into {info.kind.value} region {info.name!r}"
        if off < 0 or n <= 0 or off + n > info.nbytes:
            return Refusal.OUTSIDE_REGION, f"bytes [{off}, {off + n}) outside region {info.name!r} of {info.nbytes} bytes"
        first, last = off // info.item_bytes, (off + n - 1) // info.item_bytes
        if metadata:
            if grant.slot is None:
                return Refusal.WRONG_SLOT, (
                    f"room {grant.room} was granted no metadata slot (write into {info.name!r} slot {first})")
            return Refusal.WRONG_SLOT, (
                f"metadata write into slots {first}..{last} of {info.name!r}; room {grant.room} was granted slot {grant.slot}")
        pages = np.arange(first, last + 1)
        missing = pages[~np.isin(pages, np.asarray(grant.pages, dtype=np.int64))]
        bad = int(missing[0]) if len(missing) else first
        return Refusal.OUTSIDE_GRANT, f"page {bad} of {info.name!r} is outside the pages granted to room {grant.room}"


def _as_list(values: Any) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else [int(v) for v in values]


class ReceiveRoom:
    """One advertised room at the receiver: its grant, the peers that wrote to it, the
    KV bytes landed, and the metadata row once it arrived (committed last)."""

    __slots__ = ("grant", "peers", "received", "expected", "commit", "ack", "accepted", "capacity")

    def __init__(self, grant: RoomGrant, capacity: int = 0) -> None:
        self.grant = grant
        self.peers: set[str] = set()
        self.capacity = capacity  # KV bytes the grant holds: its pages in every KV region
        self.accepted = 0  # KV bytes of the writes accepted so far (announced, not all landed)
        self.received = 0  # KV bytes landed
        self.expected: int | None = None  # KV bytes the sender wrote before its row
        self.commit: Callable[[], None] | None = None  # copies the staged row into its slot
        self.ack: Callable[[], None] | None = None


class Receiver:
    """Grants, write authorization, byte accounting and the metadata-last commit, over a
    backend's :class:`~pdgrpc.transport.rooms.RoomStates`. See the module docstring."""

    def __init__(self, rooms: RoomStates, writers: RoomWriters | None = None) -> None:
        self.rooms = rooms
        self.writers = writers if writers is not None else RoomWriters()
        self.regions = RegionTable()
        self._open: dict[int, ReceiveRoom] = {}

    def add_region(self, info: RegionInfo) -> None:
        self.regions.add(info)

    def advertise(self, grant: RoomGrant) -> ReceiveRoom:
        if grant.room in self._open or grant.room in self.rooms:
            raise ConfigError(f"room {grant.room} is already in use by this transport; release it first")
        page_bytes = sum(i.item_bytes for i in self.regions.infos.values() if i.kind is RegionKind.KV)
        self.writers.opened(grant.room, bound=grant.bound)
        rr = self._open[grant.room] = ReceiveRoom(grant, len(grant.pages) * page_bytes)
        self.rooms.create(grant.room, KVPoll.WAITING_FOR_INPUT)
        return rr

    def get(self, room: int) -> ReceiveRoom | None:
        """The open room, or None once released (a backend compares identities to tell a
        room released mid-payload)."""
        return self._open.get(room)

    def release(self, room: int) -> ReceiveRoom | None:
        self.writers.ended(room)
        return self._open.pop(room, None)

    def clear(self) -> None:
        self._open.clear()

    def rooms_of(self, peer_id: str) -> list[int]:
        """Open rooms that ``peer_id`` wrote to."""
        return [room for room, rr in self._open.items() if peer_id in rr.peers]

    def accept(self, room: int, peer_id: str, regions: Any, offsets: Any, lengths: Any, *,
               metadata: bool = False, start: bool = True) -> ReceiveRoom:
        """Authorize one write (or, with ``metadata``, the row's single op) from
        ``peer_id`` for ``room``. Returns the room, now TRANSFERRING, when every op
        lands inside its grant; otherwise fails the room (if open) and raises
        :class:`~pdgrpc.errors.UnauthorizedWrite`. With ``start=False`` (a write
        announced ahead of its bytes) the room stays as it is until bytes land.

        A writer the room is not bound to (:class:`~pdgrpc.transport.peerauth.RoomWriters`)
        is refused as for a room that does not exist, and the room is left as it was: a
        stolen credential can neither write into it nor fail it, nor tell it from none."""
        if not self.writers.admits(room, peer_id):
            raise UnauthorizedWrite(Refusal.UNKNOWN_ROOM, self.rooms.refusal(room, reveal=False))
        rr = self._open.get(room)
        try:
            if rr is None:
                raise UnauthorizedWrite(Refusal.UNKNOWN_ROOM, self.rooms.refusal(room))
            rr.peers.add(peer_id)
            state = self.rooms.status(room).state
            if state.is_terminal:
                raise UnauthorizedWrite(Refusal.ROOM_CLOSED, f"room {room} is already {state.name}")
            if metadata and (rr.commit is not None or len(regions) != 1):
                raise UnauthorizedWrite(Refusal.MALFORMED, f"second or malformed metadata row for room {room}")
            self.regions.authorize(rr.grant, regions, offsets, lengths, metadata=metadata)
            if not metadata:
                # Every granted byte is written once (TP senders write disjoint head
                # slices), so a room's writes never add up to more than its grant: this
                # bounds what a sender can make the receiver hold posted for one room.
                rr.accepted += int(np.asarray(lengths, dtype=np.int64).sum())
                if rr.accepted > rr.capacity:
                    raise UnauthorizedWrite(Refusal.BYTE_COUNT, f"writes for room {room} add up to {rr.accepted} KV "
                                            f"bytes, more than the {rr.capacity} its grant holds")
        except UnauthorizedWrite as exc:
            if rr is not None:
                self.rooms.fail(room, str(exc), exc.refusal)
            raise
        if start:
            self.rooms.set(room, KVPoll.TRANSFERRING)
        return rr

    def refuse(self, room: int, refusal: Refusal, text: str) -> UnauthorizedWrite:
        """Fail ``room`` (if open) for a refusal the backend found itself (say, a row whose
        size disagrees with its header); returns the error to report."""
        exc = UnauthorizedWrite(refusal, text)
        if room in self._open:
            self.rooms.fail(room, str(exc), refusal)
        return exc

    def landed(self, room: int, rr: ReceiveRoom, nbytes: int) -> None:
        """``nbytes`` KV bytes of ``room`` landed in its granted pages (the room is
        TRANSFERRING from then on, if a write announced ahead left it waiting)."""
        self.rooms.set(room, KVPoll.TRANSFERRING)
        rr.received += nbytes
        self._try_commit(room, rr)

    def stage_metadata(self, room: int, rr: ReceiveRoom, kv_bytes: int, *, commit: Callable[[], None],
                       ack: Callable[[], None]) -> None:
        """The row arrived (kept aside by the backend); ``commit()`` copies it into the
        slot once ``kv_bytes`` KV bytes landed, then the room is SUCCESS and ``ack()``
        runs after the reactions to that (:func:`after_reactions`)."""
        rr.expected, rr.commit, rr.ack = kv_bytes, commit, ack
        self._try_commit(room, rr)

    def _try_commit(self, room: int, rr: ReceiveRoom) -> None:
        if self._open.get(room) is not rr or rr.expected is None or rr.commit is None:
            return
        if rr.received > rr.expected:
            self.rooms.fail(room, f"received {rr.received} KV bytes, sender announced {rr.expected}", Refusal.BYTE_COUNT)
        elif rr.received == rr.expected and not self.rooms.status(room).state.is_terminal:
            rr.commit()
            if self.rooms.set(room, KVPoll.SUCCESS) and rr.ack is not None:
                after_reactions(rr.ack)  # the receiver's own commit goes first
