"""Telling a room's decode that its prefill failed: the one failure channel.

smg sends a request to its prefill and its decode at once and does not cancel the decode
leg when the prefill leg fails. The controller is the authority on a room's fate: it
dispatched the room, it gets every worker's answer and sees a worker die. So
:class:`FailureNotices` records every failure of a room the controller answers with its
bootstrap, under the room's tag (:func:`pdgrpc.serving.room_proof.failure_tag`,
:mod:`pdgrpc.bootstrap.failures`), where the decode's held query finds it. Without the
room's secret nobody can compute the tag.

Recording with an external bootstrap is one RPC in the background (at most
:data:`MAX_IN_FLIGHT` at once; more are dropped, logged: the decode then waits for its
own deadline).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.failures import MAX_REASON_CHARS
from pdgrpc.bootstrap.service import BootstrapServicer
from pdgrpc.errors import PdgrpcError, RequestFailed
from pdgrpc.serving.room_proof import failure_tag
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import prefill_pb2

__all__ = ["FailureNotices", "MAX_IN_FLIGHT", "NotForwarded", "notices_for"]

log = logging.getLogger("pdgrpc.prefill")

MAX_IN_FLIGHT = 256  # RecordRoomFailures calls in flight to an external bootstrap (count)


class NotForwarded(RequestFailed):
    """A failure of a request the controller sent to no worker (its link was closed)."""


class FailureNotices:
    """Tells the decode of each room whose prefill failed (see the module doc). Records
    go to the embedded bootstrap in-process (``local``) or to an external one over gRPC
    (``remote``)."""

    def __init__(
        self,
        *,
        local: Callable[[list[bpb.RoomFailure]], object] | None = None,
        remote: Callable[[list[bpb.RoomFailure]], Awaitable[object]] | None = None,
    ) -> None:
        self._local = local
        self._remote = remote
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0  # rooms told (count)

    def failed(self, request: prefill_pb2.PrefillRequest, failure: RequestFailed, forwarded: bool = False) -> None:
        """``request`` fails with ``failure``'s status and message: tell its decode. ``forwarded``: a
        worker got the request, so its writes may still land until it acknowledges the
        decode's AbortRoom (or is gone)."""
        room, secret = request.bootstrap_room, bytes(request.room_secret)
        message = failure.message[:MAX_REASON_CHARS]
        self.sent += 1
        if not secret:
            return  # no tag without a secret: a decode without one cannot ask either
        key = bpb.RoomFailureKey(bootstrap_room=room, tag=failure_tag(secret, room))
        records = [bpb.RoomFailure(key=key, code=failure.code.value[0], reason=message, never_forwarded=not forwarded)]
        if self._local is not None:
            self._local(records)
        elif self._remote is not None:
            if len(self._tasks) >= MAX_IN_FLIGHT:
                log.warning("room=%d: %d failure records in flight to the bootstrap; this one is dropped", room, len(self._tasks))
                return
            task = asyncio.ensure_future(self._send(room, self._remote, records))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, room: int, remote: Callable[[list[bpb.RoomFailure]], Awaitable[object]], records: list[bpb.RoomFailure]) -> None:
        try:
            await remote(records)
        except (PdgrpcError, grpc.RpcError, asyncio.TimeoutError) as exc:
            log.warning("room=%d: recording its failure with the bootstrap failed (its decode waits for its deadline): %s", room, exc)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def notices_for(embedded: BootstrapServicer | None, external: str) -> FailureNotices:
    """Notices whose records go to the ``embedded`` bootstrap in-process, else over gRPC
    to the bootstrap at ``external``."""
    if embedded is not None:
        b = embedded
        return FailureNotices(local=lambda records: b.failures.record(records, b.clock()))
    return FailureNotices(remote=BootstrapClient(external).record_room_failures)
