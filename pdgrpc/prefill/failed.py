"""Rooms whose prefill failed on this worker, and the decodes' watches on rooms (no I/O).

smg sends a request to its prefill and its decode at once and, when the prefill leg
fails, neither aborts nor cancels the decode leg: the decode would hold the room's slot
and pages until its waiting deadline. So a prefill worker says so itself:

* :class:`FailedRooms` remembers each room whose Prefill failed here (refused, compute
  error, broken transfer, aborted), bounded in number and in age. A Handshake for such a
  room is refused with ABORTED, which the decode maps to failing the request at once.
* A decode whose KV has not landed soon after its handshake was accepted holds a
  ``WatchRoom`` call (:meth:`FailedRooms.watch`); it is answered the moment the room ends
  here: FAILED (with the prefill's reason) or NOT_FAILED.

A room is recorded only once its driver stopped and its sends drained, so a FAILED answer
also means that nothing of the room can still land in the decode's pages. An entry keeps
the room's secret: a watch or a handshake that does not prove it learns nothing.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from typing import Callable

import grpc

from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.serving.room_proof import verify, watch_message
from pdgrpc.v1 import handshake_pb2

__all__ = ["Failure", "FailedRooms", "TooManyWatches"]


class TooManyWatches(Exception):
    """More watches are held than the worker allows."""


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a room's prefill failed here."""

    code: grpc.StatusCode
    reason: str
    secret: bytes = dataclasses.field(default=b"", repr=False)  # the room's PrefillRequest.room_secret


class FailedRooms:
    """Room -> :class:`Failure` for the last ``capacity`` failures younger than ``ttl_s``,
    and the watches waiting on rooms (at most ``max_watches`` at once)."""

    def __init__(self, capacity: int = 4096, ttl_s: float = 60.0, max_watches: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.max_watches = max_watches
        self._clock = clock
        self._failed: collections.OrderedDict[int, tuple[float, Failure]] = collections.OrderedDict()
        self._watches: dict[int, list[asyncio.Future[None]]] = {}
        self._watching = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._failed)

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._failed:
            room, (t, _) = next(iter(self._failed.items()))
            if t >= cutoff and len(self._failed) <= self.capacity:
                break
            del self._failed[room]

    def get(self, room: int) -> Failure | None:
        self._expire()
        entry = self._failed.get(room)
        return None if entry is None else entry[1]

    def record(self, room: int, failure: Failure) -> None:
        """``room``'s prefill failed: remember it and answer its watches."""
        self._failed.pop(room, None)
        self._failed[room] = (self._clock(), failure)
        self._expire()
        self.ended(room)

    def ended(self, room: int) -> None:
        """``room`` ended here (failed or not): its watches answer now."""
        for fut in self._watches.pop(room, ()):
            if not fut.done():
                fut.set_result(None)

    @staticmethod
    def proves(failure: Failure | None, secret: bytes, room: int, proof: bytes) -> bool:
        """Whether ``proof`` is a watch proof for ``room`` under the room's secret (the
        failure's, else ``secret``; no secret: anything goes)."""
        key = failure.secret if failure is not None else secret
        return not key or verify(key, watch_message(room), proof)

    async def answer(
        self, room: int, proof: bytes, secret: bytes, live: Callable[[], bool], max_wait_s: float
    ) -> handshake_pb2.WatchRoomResponse:
        """``WatchRoom`` for ``room``: FAILED when it failed here, else wait (up to
        ``max_wait_s``) while ``live()`` (its Prefill runs, or its handshake waits for one)
        and answer PENDING or NOT_FAILED. ``secret``: the room's, when its Prefill runs.
        Raises :class:`RequestFailed`: PERMISSION_DENIED for a proof that does not verify,
        RESOURCE_EXHAUSTED past ``max_watches``."""
        denied = RequestFailed(
            grpc.StatusCode.PERMISSION_DENIED, f"room {room}: room_proof does not verify under the room's secret (WatchRoom refused)"
        )
        if not self.proves(self.get(room), secret, room, proof):
            raise denied
        if self.get(room) is None and max_wait_s > 0 and live():
            try:
                await self.watch(room, max_wait_s)
            except TooManyWatches as exc:
                raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"room {room}: {exc}") from None
        failure = self.get(room)
        if failure is None:
            outcome = handshake_pb2.ROOM_OUTCOME_PENDING if live() else handshake_pb2.ROOM_OUTCOME_NOT_FAILED
            return handshake_pb2.WatchRoomResponse(outcome=outcome)
        if not self.proves(failure, b"", room, proof):
            raise denied
        return handshake_pb2.WatchRoomResponse(
            outcome=handshake_pb2.ROOM_OUTCOME_FAILED, reason=failure.reason[:1000], code=failure.code.value[0]
        )

    async def watch(self, room: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``room`` to end here; True when it ended."""
        if self._watching >= self.max_watches:
            raise TooManyWatches(f"{self._watching} WatchRoom calls are held on this worker (limit {self.max_watches})")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watches.setdefault(room, []).append(fut)
        self._watching += 1
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self._watching -= 1
            futs = self._watches.get(room)
            if futs is not None and fut in futs:
                futs.remove(fut)
                if not futs:
                    del self._watches[room]
