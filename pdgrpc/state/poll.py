"""How per-rank and per-report transfer states combine.

Two rules, both load-bearing (see DESIGN.md, "Poll states"):

* **Across ranks: MIN.** A room is only as far along as its least advanced tensor-parallel
  rank, and FAILED (0) on any rank fails the room everywhere.
* **Over time: forward only, FAILED wins.** A transport may report states out of order
  (a late TRANSFERRING after SUCCESS); the room keeps the most advanced one. FAILED
  replaces anything, and nothing replaces FAILED. A report for a room that is no longer
  tracked (already committed, aborted and freed) is ignored: a late FAILED must not fail
  a new request that happens to reuse the same slot or pages.
"""

from __future__ import annotations

from typing import Iterable

from pdgrpc.errors import StateError
from pdgrpc.kvpoll import KVPoll

__all__ = ["KVPoll", "RoomStatusTable", "advance", "advance_code", "combine"]


def combine(states: Iterable[KVPoll | int]) -> KVPoll:
    """MIN over the states of one room on every rank. An empty input is a bug, not SUCCESS."""
    lowest: int | None = None
    for s in states:
        v = int(s)
        if lowest is None or v < lowest:
            lowest = v
    if lowest is None:
        raise StateError("combine() needs at least one rank's state")
    return KVPoll(lowest)


def advance_code(cur: int, rep: int) -> int:
    """:func:`advance` on raw codes (the decode queues' per-event hot path)."""
    if cur == 0 or rep == 0:
        return 0
    return cur if cur >= rep else rep


def advance(current: KVPoll | int, reported: KVPoll | int) -> KVPoll:
    """The state a room moves to when ``reported`` arrives while it is in ``current``."""
    return _BY_CODE[advance_code(int(current), int(reported))]


_BY_CODE = tuple(KVPoll)


class RoomStatusTable:
    """Latest known status per tracked room (a transport's per-room bookkeeping).

    ``track`` starts a room at BOOTSTRAPPING; ``report`` applies :func:`advance`;
    ``untrack`` forgets it, after which reports for it are ignored.
    """

    def __init__(self) -> None:
        self._status: dict[int, KVPoll] = {}

    def track(self, room: int) -> None:
        if room in self._status:
            raise StateError(f"room {room} is already tracked")
        self._status[room] = KVPoll.BOOTSTRAPPING

    def untrack(self, room: int) -> KVPoll | None:
        return self._status.pop(room, None)

    def report(self, room: int, status: KVPoll) -> KVPoll | None:
        """Apply a report. Returns the room's new status, or None if the room is untracked."""
        cur = self._status.get(room)
        if cur is None:
            return None
        new = advance(cur, status)
        self._status[room] = new
        return new

    def get(self, room: int) -> KVPoll | None:
        return self._status.get(room)

    def __contains__(self, room: object) -> bool:
        return room in self._status

    def __len__(self) -> int:
        return len(self._status)
