"""Per-room state every backend keeps: :class:`RoomStates` (forward-only transitions,
FAILED wins, terminal states stick) and the :class:`RoomStatus` that ``poll`` and
``status`` report."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Callable, Iterable

from pdgrpc.errors import Refusal, TransportError
from pdgrpc.kvpoll import KVPoll

log = logging.getLogger("pdgrpc.transport.base")

__all__ = ["RoomStates", "RoomStatus", "UnknownRoom", "after_acks", "after_reactions"]


class UnknownRoom(TransportError):
    """``poll``/``status`` for a room this transport does not track."""


@dataclasses.dataclass(frozen=True)
class RoomStatus:
    """A room's state; ``reason`` (text, for people) is set when FAILED, and
    ``refusal`` too when the failure is a receiver refusing a write. ``peer_lost``:
    the room failed because its peer is gone (its process or connection died, its
    heartbeat stopped, or ``fail_peer`` declared it gone), not because of a transfer
    error. Decisions use ``refusal`` and ``peer_lost``, never the text."""

    state: KVPoll
    reason: str | None = None
    refusal: Refusal | None = None
    peer_lost: bool = False


def after_reactions(callback: Callable[..., object], *args: object) -> None:
    """Run ``callback(*args)`` on the running loop once the reactions to a room that just
    turned terminal have run: a listener (:meth:`RoomStates.add_listener`) schedules its
    reaction for the loop's next turn, and what that reaction wakes (a task awaiting it)
    runs on the turn after; ``callback`` runs after both.

    For a receiver's ACK: it wakes the sender, whose reply to its own caller reaches the
    same client as the receiver's first token, competing for the same cores; the token is
    what the client waits for, so the token goes first."""
    loop = asyncio.get_running_loop()
    loop.call_soon(loop.call_soon, callback, *args)


def after_acks(callback: Callable[..., object], *args: object) -> None:
    """Run ``callback(*args)`` on the running loop after everything :func:`after_reactions`
    has queued so far, and everything it queues later in this loop turn: for housekeeping
    on the way to a receiver's ACK (freeing a batch's UCX requests, re-posting a control
    receive) that must not delay it: on a host whose caches a transfer just flushed, that
    housekeeping is slow."""
    asyncio.get_running_loop().call_soon(after_reactions, callback, *args)


def _resolve(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


class RoomStates:
    """Per-room state shared by backends: forward-only transitions, FAILED wins,
    terminal states stick, waiters wake on terminal states. Not thread-safe: touch it
    from the transport's event loop only."""

    # Release reasons kept for late writes: a bounded number, the newest (a write comes
    # late by the sender's reaction time, not by thousands of rooms).
    RELEASE_REASONS_KEPT = 4096

    def __init__(self) -> None:
        self._states: dict[int, RoomStatus] = {}
        # room -> futures of the tasks in wait(), resolved when the room turns terminal
        # or is discarded: one loop turn from the update to the waiter (an Event
        # under asyncio.wait_for takes three)
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        self._listeners: list[Callable[[int], None]] = []
        self._started: dict[int, float] = {}  # room -> time.monotonic() it reached TRANSFERRING
        self._release_reasons: collections.OrderedDict[int, str] = collections.OrderedDict()

    def add_listener(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(room)`` each time a room turns terminal (SUCCESS or FAILED),
        synchronously, from inside whatever update made it so (often the transport's own
        receive path): keep it short and schedule real work, e.g. with ``call_soon``.
        Cheaper than a task per room in :meth:`wait` when a server follows every room."""
        self._listeners.append(callback)

    def __contains__(self, room: int) -> bool:
        return room in self._states

    def __len__(self) -> int:
        return len(self._states)

    def rooms(self) -> list[int]:
        return list(self._states)

    @property
    def waited_on(self) -> int:
        """Rooms a task waits on in :meth:`wait` now. Nothing is kept per wait that ended,
        woken or not: with no task waiting, 0."""
        return len(self._waiters)

    def create(self, room: int, state: KVPoll) -> None:
        """Start tracking ``room`` (no-op if already tracked)."""
        if room not in self._states and state is KVPoll.TRANSFERRING:
            self._started[room] = time.monotonic()
        self._states.setdefault(room, RoomStatus(state))

    def transfer_started(self, room: int) -> float | None:
        """When ``room`` first reached TRANSFERRING (``time.monotonic()``): the first
        byte written (sender) or arrived (receiver). None if it has not, or is untracked."""
        return self._started.get(room)

    def set(
        self, room: int, state: KVPoll, reason: str | None = None, refusal: Refusal | None = None, *, peer_lost: bool = False
    ) -> bool:
        """Move ``room`` to ``state`` if that is forward (or FAILED). Returns whether
        the state changed. Untracked rooms are ignored (released rooms stay released)."""
        cur = self._states.get(room)
        if cur is None or cur.state.is_terminal:
            return False
        if state is not KVPoll.FAILED and state <= cur.state:
            return False
        failed = state is KVPoll.FAILED
        self._states[room] = RoomStatus(state, reason if failed else None, refusal if failed else None, failed and peer_lost)
        if state is KVPoll.TRANSFERRING or (state is KVPoll.SUCCESS and room not in self._started):
            self._started[room] = time.monotonic()
        if state.is_terminal:
            self._wake(room)
            for callback in self._listeners:
                try:
                    callback(room)
                except Exception:  # a listener's bug must not break the transport's update
                    log.exception("room %d: terminal-state listener %r failed", room, callback)
        return True

    def fail(self, room: int, reason: str, refusal: Refusal | None = None, *, peer_lost: bool = False) -> bool:
        """Fail ``room`` (see :meth:`set`); ``peer_lost``: because its peer is gone
        (:attr:`RoomStatus.peer_lost`)."""
        return self.set(room, KVPoll.FAILED, reason, refusal, peer_lost=peer_lost)

    def status(self, room: int) -> RoomStatus:
        try:
            return self._states[room]
        except KeyError:
            raise UnknownRoom(f"room {room} is not tracked by this transport") from None

    def note_release(self, room: int, reason: str) -> None:
        """Remember why ``room`` is being released, for :meth:`refusal`."""
        self._release_reasons[room] = reason
        self._release_reasons.move_to_end(room)
        while len(self._release_reasons) > self.RELEASE_REASONS_KEPT:
            self._release_reasons.popitem(last=False)

    def release_reason(self, room: int) -> str | None:
        """The reason noted for ``room``'s release, if any (and still kept)."""
        return self._release_reasons.get(room)

    def refusal(self, room: int, *, reveal: bool = True) -> str:
        """Why a receiver refuses a write for ``room``, which it does not track. A room
        released for a noted reason says so when ``reveal`` (the writer is the room's
        own): a sender whose write was a moment late then reports the cause (say, the
        decode found the metadata corrupt on another TP rank), not only that the room is
        gone. Without ``reveal`` every room reads the same, so probing learns nothing."""
        why = self.release_reason(room) if reveal else None
        text = f"room {room} is not advertised here (never, or already released)"
        return text if why is None else f"{text}; it was released because: {why}"

    def discard(self, room: int) -> None:
        self._states.pop(room, None)
        self._started.pop(room, None)
        self._wake(room)  # waiters see UnknownRoom

    def fail_all(self, reason: str, rooms: Iterable[int] | None = None, *, peer_lost: bool = False) -> None:
        for room in list(self._states if rooms is None else rooms):
            self.fail(room, reason, peer_lost=peer_lost)

    async def wait(self, room: int, timeout: float) -> RoomStatus:
        st = self.status(room)
        if st.state.is_terminal:
            return st
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(room, [])
        waiters.append(fut)
        timer = fut.get_loop().call_later(timeout, _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            if self._waiters.get(room) is waiters:  # not woken: timed out or cancelled
                waiters.remove(fut)
                if not waiters:
                    del self._waiters[room]
        return self.status(room)

    def _wake(self, room: int) -> None:
        for fut in self._waiters.pop(room, ()):
            _resolve(fut)
