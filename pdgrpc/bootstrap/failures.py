"""Rooms whose prefill failed in the prefill's controller, kept for their decodes (no I/O).

A prefill leg the controller refuses before any worker sees it (no live dp rank, a
refused dispatch, a failed dp-rank registration) leaves no worker that knows the room,
so none can refuse the decode's handshake or answer its ``WatchRoom``; behind a gateway
that does not cancel the decode leg (smg), the decode would wait for its own deadline.
The controller records the failure here (``RecordRoomFailures``) and the decode asks
(``QueryRoomFailures``) while its dp-rank query or its handshake gets no answer.

A record is keyed by its tag, an HMAC under the room's secret
(:func:`pdgrpc.serving.room_proof.failure_tag`). Without the secret a caller cannot
compute a tag its decode asks for, so it can neither fail a room nor learn that a room
failed; a record it makes up is never found and only takes a place in the table. Bounded:
the last ``capacity`` records younger than ``ttl_s`` (the oldest go first).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

from pdgrpc.bootstrap.errors import InvalidBootstrapRequest
from pdgrpc.serving.room_proof import SECRET_BYTES
from pdgrpc.v1 import bootstrap_pb2 as pb

__all__ = ["MAX_BATCH", "MAX_REASON_CHARS", "RoomFailures"]

MAX_BATCH = 1024  # records or keys per call (bootstrap.proto)
MAX_REASON_CHARS = 1000  # characters of a reason kept
TAG_BYTES = SECRET_BYTES  # an HMAC-SHA256


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
        if k.bootstrap_room == 0:
            raise InvalidBootstrapRequest(f"{what}[{i}].bootstrap_room must not be 0")
        if len(k.tag) != TAG_BYTES:
            raise InvalidBootstrapRequest(f"{what}[{i}].tag must be {TAG_BYTES} bytes, got {len(k.tag)}")
    return out


class RoomFailures:
    """Tag -> failure record, the last ``capacity`` younger than ``ttl_s`` seconds."""

    def __init__(self, capacity: int = 4096, ttl_s: float = 60.0) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._records: collections.OrderedDict[bytes, _Record] = collections.OrderedDict()

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
        for f in failures:
            tag = bytes(f.key.tag)
            self._records.pop(tag, None)
            self._records[tag] = _Record(f.key.bootstrap_room, f.code, f.reason[:MAX_REASON_CHARS], f.never_forwarded, now)
        self._expire(now)
        return len(failures)

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
