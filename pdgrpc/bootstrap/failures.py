"""Rooms whose prefill failed, kept for their decodes (no I/O but the held query).

This is the one way a decode learns that its prefill failed when its gateway does not
cancel the decode leg (smg). The prefill controller is the authority on a room's fate:
it dispatched it, it gets every worker's answer and sees a worker die, so it records
every failure here (``RecordRoomFailures``: refused in the controller, failed on a
worker, lost with a dead worker). The decode asks (``QueryRoomFailures``) with one held
call once its KV is late, and while its dp-rank query or its handshake gets no answer;
a held call is answered the moment one of its keys is recorded.

A record is keyed by its tag, an HMAC under the room's secret
(:func:`pdgrpc.serving.room_proof.failure_tag`). Without the secret a caller cannot
compute a tag its decode asks for, so it can neither fail a room nor learn that a room
failed; a record it makes up is never found and only takes a place in the table. Bounded:
the last ``capacity`` records younger than ``ttl_s`` (the oldest go first), and the keys
of held queries: at most ``max_held_keys`` in all and ``max_held_keys_per_caller`` of one
caller identity. Keys count, not calls: each held key costs the server its watch, and a
call may carry up to :data:`MAX_BATCH` of them. A decode holds one key per late room.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from typing import Callable, Iterable

import grpc

from pdgrpc.bootstrap.errors import InvalidBootstrapRequest
from pdgrpc.errors import ConfigError
from pdgrpc.rpc.open_calls import TooManyOpenCalls
from pdgrpc.serving.room_proof import SECRET_BYTES
from pdgrpc.state.room import as_room
from pdgrpc.v1 import bootstrap_pb2 as pb

__all__ = ["MAX_BATCH", "MAX_HELD_KEYS", "MAX_HELD_KEYS_PER_CALLER", "MAX_REASON_CHARS", "MAX_WAIT_MS", "RoomFailures"]

MAX_BATCH = 1024  # records or keys per call (bootstrap.proto)
MAX_REASON_CHARS = 1000  # characters of a reason kept
TAG_BYTES = SECRET_BYTES  # an HMAC-SHA256
MAX_WAIT_MS = 10_000  # longest a QueryRoomFailures call is held (bootstrap.proto)
MAX_HELD_KEYS = 4096  # keys of the QueryRoomFailures calls held at once
MAX_HELD_KEYS_PER_CALLER = 1024  # of those, one caller identity's: no decode spends the others' places
_FIRST_FAILURE_CODE = 1  # CANCELLED: a record names a status a prefill failed with, never OK (0)
_LAST_FAILURE_CODE = max(c.value[0] for c in grpc.StatusCode)  # UNAUTHENTICATED


@dataclasses.dataclass(frozen=True)
class _Record:
    room: int
    code: int
    reason: str
    never_forwarded: bool  # no worker got the request (RoomFailure.never_forwarded)
    at: float  # clock seconds when recorded


def _check_keys(keys: Iterable[pb.RoomFailureKey], what: str) -> list[pb.RoomFailureKey]:
    out = list(keys)
    if len(out) > MAX_BATCH:
        raise InvalidBootstrapRequest(f"{what}: {len(out)} entries is over the limit of {MAX_BATCH} per call; split it")
    for i, k in enumerate(out):
        try:
            as_room(k.bootstrap_room, f"{what}[{i}].bootstrap_room")
        except ConfigError as exc:
            raise InvalidBootstrapRequest(str(exc)) from None
        if len(k.tag) != TAG_BYTES:
            raise InvalidBootstrapRequest(f"{what}[{i}].tag must be {TAG_BYTES} bytes, got {len(k.tag)}")
    return out


class RoomFailures:
    """Tag -> failure record, the last ``capacity`` younger than ``ttl_s`` seconds."""

    def __init__(
        self, capacity: int = 4096, ttl_s: float = 60.0, max_held_keys: int = MAX_HELD_KEYS,
        max_held_keys_per_caller: int = MAX_HELD_KEYS_PER_CALLER,
    ) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.max_held_keys = max_held_keys
        self.max_held_keys_per_caller = max_held_keys_per_caller
        self._records: collections.OrderedDict[bytes, _Record] = collections.OrderedDict()
        self._watches: dict[bytes, set[asyncio.Future[None]]] = {}  # tag -> held queries
        self._held = 0  # keys of the held queries
        self._held_by: collections.Counter[str] = collections.Counter()  # caller -> its held keys

    def __len__(self) -> int:
        return len(self._records)

    def _expire(self, now: float) -> None:
        cutoff = now - self.ttl_s
        records = self._records
        while records:
            tag, rec = next(iter(records.items()))
            if rec.at >= cutoff and len(records) <= self.capacity:
                break
            del records[tag]

    def record(self, failures: Iterable[pb.RoomFailure], now: float) -> int:
        """Store ``failures`` (all or none); the number stored."""
        failures = list(failures)
        _check_keys((f.key for f in failures), "RecordRoomFailuresRequest.failures")
        for i, f in enumerate(failures):
            if not _FIRST_FAILURE_CODE <= f.code <= _LAST_FAILURE_CODE:  # the decode ends the request with it
                raise InvalidBootstrapRequest(
                    f"RecordRoomFailuresRequest.failures[{i}].code must be a gRPC status code in "
                    f"[{_FIRST_FAILURE_CODE}, {_LAST_FAILURE_CODE}], got {f.code}"
                )
        for f in failures:
            tag = bytes(f.key.tag)
            self._records.pop(tag, None)
            self._records[tag] = _Record(f.key.bootstrap_room, f.code, f.reason[:MAX_REASON_CHARS], f.never_forwarded, now)
            for fut in self._watches.pop(tag, ()):
                if not fut.done():
                    fut.set_result(None)
        self._expire(now)
        return len(failures)

    async def wait(
        self, keys: Iterable[pb.RoomFailureKey], clock: Callable[[], float], max_wait_s: float, caller: str = "",
    ) -> list[pb.RoomFailure]:
        """:meth:`query`, held up to ``max_wait_s`` while no key has a record. Raises
        :class:`~pdgrpc.rpc.open_calls.TooManyOpenCalls` when holding its keys would pass
        ``max_held_keys``, or ``max_held_keys_per_caller`` of ``caller`` (its identity)."""
        checked = _check_keys(keys, "QueryRoomFailuresRequest.keys")
        found = self.query(checked, clock())
        if found or max_wait_s <= 0 or not checked:
            return found
        n, mine = len(checked), self._held_by[caller]
        if mine + n > self.max_held_keys_per_caller:
            raise TooManyOpenCalls(
                f"QueryRoomFailuresRequest.keys: {n} keys to hold, but caller {caller or '(unknown)'} already holds {mine} "
                f"(limit {self.max_held_keys_per_caller} per caller)"
            )
        if self._held + n > self.max_held_keys:
            raise TooManyOpenCalls(
                f"QueryRoomFailuresRequest.keys: {n} keys to hold, but {self._held} keys of QueryRoomFailures calls "
                f"are held on this server (limit {self.max_held_keys})"
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        tags = [bytes(k.tag) for k in checked]
        for tag in tags:
            self._watches.setdefault(tag, set()).add(fut)
        self._held += n
        self._held_by[caller] += n
        try:
            await asyncio.wait_for(fut, max_wait_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._held -= n
            self._held_by[caller] -= n
            if self._held_by[caller] <= 0:
                del self._held_by[caller]
            for tag in tags:
                futs = self._watches.get(tag)
                if futs is not None:
                    futs.discard(fut)
                    if not futs:
                        del self._watches[tag]
        return self.query(checked, clock())

    def query(self, keys: Iterable[pb.RoomFailureKey], now: float) -> list[pb.RoomFailure]:
        """The records of ``keys`` (room and tag both match), in request order."""
        checked = _check_keys(keys, "QueryRoomFailuresRequest.keys")
        self._expire(now)
        out = []
        for k in checked:
            rec = self._records.get(bytes(k.tag))
            if rec is not None and rec.room == k.bootstrap_room:
                out.append(pb.RoomFailure(key=k, code=rec.code, reason=rec.reason, never_forwarded=rec.never_forwarded))
        return out
