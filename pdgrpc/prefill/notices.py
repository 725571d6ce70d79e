"""Telling a room's decode that the prefill controller refused the room.

smg sends a request to its prefill and its decode at once and does not cancel the decode
leg when the prefill leg fails. A prefill worker that failed a room says so itself
(:mod:`pdgrpc.prefill.failed`), but a room the *controller* refuses before any worker
sees it (no live dp rank, a dead worker, a refused dispatch, a failed dp-rank
registration) is known to no worker. :class:`FailureNotices` tells the decode two ways:

* **Through a worker** where the decode finds the dp rank without a query (dp size 1,
  ``follow_bootstrap_room``, a routed rank) and that rank's workers are alive: each gets
  a FAILED frame over its link (:mod:`pdgrpc.prefill.link`) and refuses the decode's
  handshake with the controller's status, or answers its ``WatchRoom`` FAILED, as for a
  room that failed on the worker itself.
* **Through the bootstrap**, always: a record under the room's tag
  (:func:`pdgrpc.serving.room_proof.failure_tag`, :mod:`pdgrpc.bootstrap.failures`).
  The decode asks for it while its dp-rank query finds no rank, or while the workers it
  must handshake with do not answer (the rank is dead): so it learns of the failure
  even when no worker is alive. Without the room's secret nobody can compute the tag.

Recording with an external bootstrap is one RPC in the background (at most
:data:`MAX_IN_FLIGHT` at once; more are dropped, logged: the decode then waits for its
own deadline, as before).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Protocol, Sequence

import grpc

from pdgrpc.bootstrap.client import BootstrapClient
from pdgrpc.bootstrap.failures import MAX_REASON_CHARS
from pdgrpc.bootstrap.service import BootstrapServicer
from pdgrpc.errors import PdgrpcError, RequestFailed
from pdgrpc.serving.room_proof import failure_tag
from pdgrpc.state import DpConfig, resolve_locally
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import prefill_pb2

__all__ = ["FailureNotices", "MAX_IN_FLIGHT", "NotForwarded", "notices_for"]

log = logging.getLogger("pdgrpc.prefill")

MAX_IN_FLIGHT = 256  # RecordRoomFailures calls in flight to an external bootstrap (count)
MAX_SECRET_BYTES = 255  # a link frame's secret (a u8 length; room secrets are 32 bytes)


class NotForwarded(RequestFailed):
    """A failure of a request the controller sent to no worker (its link was closed)."""


class _Link(Protocol):
    def room_failed(self, room: int, code: grpc.StatusCode, message: str, secret: bytes) -> None: ...


class _Worker(Protocol):
    alive: bool

    @property
    def link(self) -> _Link | None: ...


class FailureNotices:
    """Tells the decode of each room the controller refused (see the module doc).
    ``groups()``: the workers of each dp rank. Records go to the embedded bootstrap
    in-process (``local``) or to an external one over gRPC (``remote``)."""

    def __init__(
        self,
        dp: DpConfig,
        groups: Callable[[], Sequence[Sequence[_Worker]]],
        *,
        local: Callable[[list[bpb.RoomFailure]], object] | None = None,
        remote: Callable[[list[bpb.RoomFailure]], Awaitable[object]] | None = None,
    ) -> None:
        self.dp = dp
        self._groups = groups
        self._local = local
        self._remote = remote
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0  # rooms told (count)

    def decode_rank(self, request: prefill_pb2.PrefillRequest) -> int | None:
        """The dp rank the room's decode handshakes with without asking bootstrap, if any."""
        routed = request.routed_dp_rank if request.HasField("routed_dp_rank") else None
        try:
            return resolve_locally(request.bootstrap_room, routed, self.dp)
        except PdgrpcError:
            return None  # an invalid routed rank: the decode refuses it itself

    def failed(self, request: prefill_pb2.PrefillRequest, code: grpc.StatusCode, message: str, forwarded: bool = False) -> None:
        """The controller fails ``request`` with ``code``/``message``: tell its decode.
        ``forwarded``: a worker got the request (and died), so its writes may still land."""
        room, secret = request.bootstrap_room, bytes(request.room_secret)
        message = message[:MAX_REASON_CHARS]
        self.sent += 1
        rank = self.decode_rank(request)
        groups = self._groups()
        if rank is not None and rank < len(groups) and len(secret) <= MAX_SECRET_BYTES:
            for w in groups[rank]:
                link = w.link
                if w.alive and link is not None:
                    link.room_failed(room, code, message, secret)
        if not secret:
            return  # no tag without a secret: a decode without one cannot ask either
        key = bpb.RoomFailureKey(bootstrap_room=room, tag=failure_tag(secret, room))
        records = [bpb.RoomFailure(key=key, code=code.value[0], reason=message, never_forwarded=not forwarded)]
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


def notices_for(
    dp: DpConfig, groups: Callable[[], Sequence[Sequence[_Worker]]], embedded: BootstrapServicer | None, external: str
) -> FailureNotices:
    """Notices whose records go to the ``embedded`` bootstrap in-process, else over gRPC
    to the bootstrap at ``external``."""
    if embedded is not None:
        b = embedded
        return FailureNotices(dp, groups, local=lambda records: b.failures.record(records, b.clock()))
    return FailureNotices(dp, groups, remote=BootstrapClient(external).record_room_failures)
