"""Handshakes waiting for their Prefill RPC, and Prefill RPCs waiting for their handshake.

The router sends the request to prefill and decode at once, so decode's Handshake for a
room may arrive *before* the Prefill RPC for it (decode allocates fast, prefill may be
queued). The mailbox keeps such early handshakes, bounded in number (``capacity``) and in
age (``ttl_s``): a handshake whose Prefill never comes (the router gave up) must not pin
memory forever. A handshake that arrives while the Prefill RPC is already waiting is
handed over at once.

A room gets at most one handshake per *key* (the sending decode TP rank; 0 for a TP 1
decode): a second one with the same key is refused, which is what catches two decodes
racing for one room. A TP prefill rank waits for several handshakes per room (one from
every decode rank it writes to); the driver calls :meth:`Mailbox.wait` once per handshake.
Every handshake of a room may carry a ``group`` value (the decode TP size): a later one
with another value is refused with :class:`GroupMismatch`.

Bounds: at most ``capacity`` early handshakes are held, and at most ``per_peer`` of them
come from one peer (the caller's identity), so one client cannot fill the mailbox for the
others. Each handshake counts, not each room: a room's handshakes are keyed by their
unverified proofs, so a peer could otherwise pile up any number under one room. What they
hold is bounded the same way in bytes (``capacity_bytes``, ``per_peer_bytes``; the caller
says what each one holds): a handshake's descriptor may be padded up to the message limit. A refused handshake is never stored (:meth:`Mailbox.refuse`): it reaches a Prefill
RPC already claiming its room, else it is dropped, and it takes no key, so it cannot block
the room's real handshake.

:meth:`Mailbox.claimed` lets a handshake's answer wait until a Prefill RPC claims its room
(bounded by the caller's timeout), so the decode learns that its prefill showed up.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Callable, Generic, TypeVar

from pdgrpc.errors import StateError

__all__ = ["DuplicateHandshake", "GroupMismatch", "Mailbox", "MailboxFull"]

T = TypeVar("T")


class DuplicateHandshake(StateError):
    """A room got a second handshake (same key) while the first one is still pending or in use."""


class MailboxFull(StateError):
    """Too many early handshakes are waiting for their Prefill RPC."""


class GroupMismatch(StateError):
    """A room's handshakes disagree on their ``group`` value (the decode TP size)."""

    def __init__(self, room: int, first: object, got: object) -> None:
        super().__init__(f"room {room}: an earlier handshake said {first}, this one {got}")
        self.first = first
        self.got = got


class _Claim(Generic[T]):
    """A room a Prefill RPC waits for: handshakes delivered and not yet taken."""

    def __init__(self) -> None:
        self.items: collections.deque[T] = collections.deque()
        self.waiter: asyncio.Future[T] | None = None


class Mailbox(Generic[T]):
    """Room -> handshake(s) rendezvous on one event loop."""

    def __init__(
        self, capacity: int = 4096, ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic, per_peer: int | None = None,
        capacity_bytes: int | None = None, per_peer_bytes: int | None = None,
    ) -> None:
        self.capacity = capacity
        self.per_peer = per_peer if per_peer is not None else capacity
        self.capacity_bytes = capacity_bytes
        self.per_peer_bytes = per_peer_bytes if per_peer_bytes is not None else capacity_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        # room -> (when its first arrived, its early handshakes with the peer that sent each and their bytes)
        self._early: collections.OrderedDict[int, tuple[float, list[tuple[T, str, int]]]] = collections.OrderedDict()
        self._held = 0  # early handshakes in _early
        self._held_bytes = 0  # and what they hold
        self._by_peer: collections.Counter[str] = collections.Counter()  # peer -> its early handshakes
        self._bytes_by_peer: collections.Counter[str] = collections.Counter()  # peer -> what they hold
        self._claims: dict[int, _Claim[T]] = {}  # rooms a Prefill RPC has claimed
        self._keys: dict[int, tuple[object, set[object]]] = {}  # room -> (group, keys delivered)
        self._claim_waiters: dict[int, list[asyncio.Future[None]]] = {}  # room -> answers waiting for its claim

    def __len__(self) -> int:
        """Early handshakes held (after dropping expired ones)."""
        self._expire()
        return self._held

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._early:
            room, (t, _) = next(iter(self._early.items()))
            if t >= cutoff:
                break
            self._take_early(room)
            if room not in self._claims:
                self._keys.pop(room, None)

    def group(self, room: int) -> object:
        """The group value of ``room``'s first handshake (None when none is held)."""
        entry = self._keys.get(room)
        return None if entry is None else entry[0]

    def _unpeer(self, items: list[tuple[T, str, int]]) -> None:
        """``items`` leave the mailbox: their peers' counts go down."""
        self._held -= len(items)
        for _, peer, nbytes in items:
            self._held_bytes -= nbytes
            self._bytes_by_peer[peer] -= nbytes
            self._by_peer[peer] -= 1
            if self._by_peer[peer] <= 0:
                del self._by_peer[peer]
                del self._bytes_by_peer[peer]

    def _take_early(self, room: int) -> list[T] | None:
        """Remove ``room``'s early handshakes; None when it has none."""
        early = self._early.pop(room, None)
        if early is None:
            return None
        self._unpeer(early[1])
        return [item for item, _, _ in early[1]]

    def refuse(self, room: int, failure: T) -> bool:
        """A refused handshake: hand ``failure`` to the Prefill RPC that claimed ``room``
        (returns True), unless one is already queued for it; else drop it (False). Never
        stored, never takes a key."""
        claim = self._claims.get(room)
        if claim is None:
            return False
        if claim.waiter is not None and not claim.waiter.done():
            claim.waiter.set_result(failure)
            return True
        if claim.items:
            return False
        claim.items.append(failure)
        return True

    def deliver(self, room: int, handshake: T, key: object = 0, group: object = None, peer: str = "", nbytes: int = 0) -> bool:
        """Hand ``handshake`` to the Prefill RPC waiting for ``room`` (returns True), or keep
        it until one comes (False). ``peer``: who sent it (counted against ``per_peer``);
        ``nbytes``: what it holds (against ``per_peer_bytes``). Raises
        :class:`DuplicateHandshake` / :class:`MailboxFull` / :class:`GroupMismatch`."""
        self._expire()
        entry = self._keys.get(room)
        if entry is not None:
            if key in entry[1]:
                raise DuplicateHandshake(f"room {room}: a handshake for this room was already received")
            if group is not None and entry[0] is not None and group != entry[0]:
                raise GroupMismatch(room, entry[0], group)
        claim = self._claims.get(room)
        if claim is None:
            if self._held >= self.capacity:
                raise MailboxFull(
                    f"room {room}: {self._held} handshakes already wait for their Prefill RPC (capacity {self.capacity})"
                )
            if self._by_peer[peer] >= self.per_peer:
                raise MailboxFull(
                    f"room {room}: {self._by_peer[peer]} handshakes from this peer already wait for their Prefill RPC "
                    f"(limit {self.per_peer} per peer)"
                )
            if self.capacity_bytes is not None and self._held_bytes + nbytes > self.capacity_bytes:
                raise MailboxFull(
                    f"room {room}: the handshakes waiting for their Prefill RPC hold {self._held_bytes} bytes; this one "
                    f"{nbytes} more (limit {self.capacity_bytes} bytes)"
                )
            if self.per_peer_bytes is not None and self._bytes_by_peer[peer] + nbytes > self.per_peer_bytes:
                raise MailboxFull(
                    f"room {room}: the handshakes from this peer waiting for their Prefill RPC hold "
                    f"{self._bytes_by_peer[peer]} bytes; this one {nbytes} more (limit {self.per_peer_bytes} bytes per peer)"
                )
        if entry is None:
            entry = (group, set())
        elif entry[0] is None and group is not None:
            entry = (group, entry[1])
        entry[1].add(key)
        self._keys[room] = entry
        if claim is not None:
            if claim.waiter is not None and not claim.waiter.done():
                claim.waiter.set_result(handshake)
            else:
                claim.items.append(handshake)
            return True
        if room in self._early:
            self._early[room][1].append((handshake, peer, nbytes))
        else:
            self._early[room] = (self._clock(), [(handshake, peer, nbytes)])
        self._held += 1
        self._held_bytes += nbytes
        self._by_peer[peer] += 1
        self._bytes_by_peer[peer] += nbytes
        return False

    def claim(self, room: int) -> _Claim[T]:
        """Claim ``room`` for its Prefill RPC (idempotent): early handshakes move to it, and
        from now on a refused handshake for the room reaches it. :meth:`done` ends it."""
        self._expire()
        claim = self._claims.get(room)
        if claim is None:
            claim = self._claims[room] = _Claim()
            early = self._take_early(room)
            if early is not None:
                claim.items.extend(early)
            self._keys.setdefault(room, (None, set()))
            for waiter in self._claim_waiters.pop(room, ()):
                if not waiter.done():
                    waiter.set_result(None)
        return claim

    async def claimed(self, room: int, timeout: float) -> bool:
        """Whether a Prefill RPC claims ``room`` now or within ``timeout`` seconds."""
        if room in self._claims:
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._claim_waiters.setdefault(room, [])
        waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    self._claim_waiters.pop(room, None)

    async def wait(self, room: int, timeout: float) -> T:
        """The next handshake for ``room`` (early or arriving within ``timeout`` seconds);
        raises ``TimeoutError`` when none comes. The first call claims the room; call
        :meth:`done` when the room is finished."""
        claim = self.claim(room)
        if claim.items:
            return claim.items.popleft()
        if claim.waiter is not None:
            raise DuplicateHandshake(f"room {room}: another Prefill RPC already waits for this room's handshake")
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        claim.waiter = fut
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            claim.waiter = None

    def sift(self, room: int, keep: Callable[[T], bool], first: Callable[[T], bool] = lambda _: False) -> int:
        """Drop ``room``'s early handshakes that fail ``keep`` and move those that pass
        ``first`` to the front (in arrival order otherwise); returns how many were dropped.
        Their keys stay taken (the driver keys them so that this never blocks another); the
        room's group is forgotten when any is dropped (a dropped one may have set it; those
        kept, being checked only now, were delivered without one)."""
        entry = self._early.get(room)
        if entry is None:
            return 0
        items = entry[1]
        kept: list[tuple[T, str, int]] = []
        gone: list[tuple[T, str, int]] = []
        for i in items:
            (kept if keep(i[0]) else gone).append(i)
        kept.sort(key=lambda i: not first(i[0]))
        dropped = len(gone)
        self._unpeer(gone)
        items[:] = kept
        keys = self._keys.get(room)
        if dropped and keys is not None:
            self._keys[room] = (None, keys[1])
        return dropped

    def holds(self, room: int) -> bool:
        """Whether ``room`` has early handshakes kept or a Prefill RPC claiming it."""
        return room in self._claims or room in self._early

    def discard(self, room: int) -> bool:
        """Forget early handshakes for ``room`` (decode aborted before Prefill came)."""
        if self._take_early(room) is None:
            return False
        if room not in self._claims:
            self._keys.pop(room, None)
        return True

    def done(self, room: int) -> None:
        """The room is finished: new handshakes for it may come (room ids are random, so
        in practice this only frees memory)."""
        self._claims.pop(room, None)
        self._keys.pop(room, None)
