"""Handshakes waiting for their Prefill RPC, and Prefill RPCs waiting for their handshake.

The router sends the request to prefill and decode at once, so decode's Handshake for a
room may arrive *before* the Prefill RPC for it (decode allocates fast, prefill may be
queued). The mailbox keeps such early handshakes, bounded in number (``capacity``) and in
age (``ttl_s``): a handshake whose Prefill never comes (the router gave up) must not pin
memory forever. A handshake that arrives while the Prefill RPC is already waiting is
handed over at once.

A room gets at most one handshake (TP 1 decode): a second one is refused, which is what
catches two decodes racing for one room.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Callable, Generic, TypeVar

from pdgrpc.errors import StateError

__all__ = ["DuplicateHandshake", "Mailbox", "MailboxFull"]

T = TypeVar("T")


class DuplicateHandshake(StateError):
    """A room got a second handshake while the first one is still pending or in use."""


class MailboxFull(StateError):
    """Too many early handshakes are waiting for their Prefill RPC."""


class Mailbox(Generic[T]):
    """Room -> handshake rendezvous on one event loop."""

    def __init__(self, capacity: int = 4096, ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._early: collections.OrderedDict[int, tuple[float, T]] = collections.OrderedDict()
        self._waiting: dict[int, asyncio.Future[T]] = {}
        self._claimed: set[int] = set()  # rooms whose handshake was handed to a Prefill RPC

    def __len__(self) -> int:
        """Early handshakes held (after dropping expired ones)."""
        self._expire()
        return len(self._early)

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._early:
            room, (t, _) = next(iter(self._early.items()))
            if t >= cutoff:
                break
            del self._early[room]

    def deliver(self, room: int, handshake: T) -> bool:
        """Hand ``handshake`` to the Prefill RPC waiting for ``room`` (returns True), or keep
        it until one comes (False). Raises :class:`DuplicateHandshake` / :class:`MailboxFull`."""
        self._expire()
        if room in self._early or room in self._claimed:
            raise DuplicateHandshake(f"room {room}: a handshake for this room was already received")
        fut = self._waiting.get(room)
        if fut is not None and not fut.done():
            fut.set_result(handshake)
            self._claimed.add(room)
            return True
        if len(self._early) >= self.capacity:
            raise MailboxFull(
                f"room {room}: {len(self._early)} handshakes already wait for their Prefill RPC (capacity {self.capacity})"
            )
        self._early[room] = (self._clock(), handshake)
        return False

    async def wait(self, room: int, timeout: float) -> T:
        """The handshake for ``room`` (early or arriving within ``timeout`` seconds); raises
        ``TimeoutError`` when none comes. Call :meth:`done` when the room is finished."""
        self._expire()
        early = self._early.pop(room, None)
        if early is not None:
            self._claimed.add(room)
            return early[1]
        if room in self._waiting:
            raise DuplicateHandshake(f"room {room}: another Prefill RPC already waits for this room's handshake")
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting[room] = fut
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._waiting.pop(room, None)

    def discard(self, room: int) -> bool:
        """Forget an early handshake for ``room`` (decode aborted before Prefill came)."""
        return self._early.pop(room, None) is not None

    def done(self, room: int) -> None:
        """The room is finished: a new handshake for it may come (room ids are random, so
        in practice this only frees memory)."""
        self._claimed.discard(room)
