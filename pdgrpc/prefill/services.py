"""gRPC servicers of a prefill worker: PrefillService (worker level) and HandshakeService.

Thin adapters: they call :class:`~pdgrpc.prefill.worker.PrefillWorker` and turn its
:class:`~pdgrpc.prefill.errors.RequestFailed` into the RPC status.

:class:`WirePrefillServicer` is what the controller and each worker serve PrefillService
as: a ``Prefill`` whose ``bootstrap_room`` is out of range, or without its
``room_secret``, is refused with INVALID_ARGUMENT naming the field; what is behind it
trusts the room. The controller's own link to its workers, and smg's prefill leg calling
the controller in-process (its protocol carries no secret: both legs derive one from smg's
request id, :mod:`pdgrpc.gateway.requests`), do not pass through it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, AsyncIterator, Callable, NoReturn, Protocol

import grpc

from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.prefill.link import FirstToken
from pdgrpc.prefill.statuses import Refusal, ending
from pdgrpc.rpc.open_calls import DEFAULT_PER_CLIENT, OpenCalls, TooManyOpenCalls
from pdgrpc.rpc import tracing
from pdgrpc.rpc.security import peer_identity
from pdgrpc.serving.convert import room_from_proto
from pdgrpc.serving.kv_events import KvEventFeed, serve_kv_events
from pdgrpc.serving.room_proof import secret_problem
from pdgrpc.serving.logs import request_event
from pdgrpc.v1 import handshake_pb2, handshake_pb2_grpc, prefill_pb2, prefill_pb2_grpc

if TYPE_CHECKING:
    from pdgrpc.prefill.worker import PrefillWorker

__all__ = ["HANDSHAKE_SERVICE", "PREFILL_SERVICE", "HandshakeServicer", "WirePrefillServicer", "WorkerPrefillServicer", "abort_with"]

log = logging.getLogger("pdgrpc.prefill")

PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
HANDSHAKE_SERVICE = handshake_pb2.DESCRIPTOR.services_by_name["HandshakeService"].full_name


async def abort_with(context: grpc.aio.ServicerContext, exc: RequestFailed) -> NoReturn:
    await context.abort(exc.code, exc.message)
    raise AssertionError("unreachable")  # context.abort raises


class WorkerPrefillServicer:
    """One worker's PrefillService behind the checks (a :class:`PrefillHandlers`)."""

    def __init__(self, worker: PrefillWorker, kv_events: KvEventFeed) -> None:
        self.worker = worker
        self.kv_events = kv_events  # this rank's prefix cache's log

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext, first_token: FirstToken | None = None
    ) -> prefill_pb2.PrefillResponse:
        try:
            return await self.worker.prefill(request, first_token)
        except RequestFailed as exc:
            await abort_with(context, exc)

    async def GetStats(self, request: prefill_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.GetStatsResponse:
        return prefill_pb2.GetStatsResponse(stats=self.worker.stats())

    async def SubscribeKvEvents(self, request: prefill_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[prefill_pb2.KvEventBatch]:
        async for b in serve_kv_events(self.kv_events, request, context):
            yield b


class PrefillHandlers(Protocol):
    """What serves PrefillService behind the checks: ``Prefill`` tells ``first_token``
    the first output token once sampled (``PrefillStream`` sends it ahead)."""

    async def Prefill(  # noqa: N802
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext, first_token: FirstToken | None = None
    ) -> prefill_pb2.PrefillResponse: ...

    async def GetStats(self, request: prefill_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.GetStatsResponse: ...  # noqa: N802

    def SubscribeKvEvents(self, request: prefill_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[prefill_pb2.KvEventBatch]: ...  # noqa: N802


class PerClientPrefill:
    """``inner``'s ``Prefill`` while its client (:func:`~pdgrpc.rpc.security.peer_identity`)
    has fewer than ``max_per_client`` open (:class:`~pdgrpc.rpc.open_calls.OpenCalls`:
    each open call holds a room); ``refused`` counts one that has not. smg's prefill legs
    come through here too, counted as smg's."""

    def __init__(self, inner: PrefillHandlers, refused: Callable[[], None], max_per_client: int = DEFAULT_PER_CLIENT) -> None:
        self.inner = inner
        self.refused = refused
        self.open_calls = OpenCalls(max_per_client, "Prefill", "--max-prefills-per-client")

    async def Prefill(  # noqa: N802
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext, first_token: FirstToken | None = None
    ) -> prefill_pb2.PrefillResponse:
        client = peer_identity(context)  # its certificate's name under mTLS, else its host
        try:
            self.open_calls.acquire(client)
        except TooManyOpenCalls as exc:
            self.refused()
            request_event(log, request.bootstrap_room, "refused", status="RESOURCE_EXHAUSTED", message=str(exc))
            await abort_with(context, ending(Refusal.OVERLOADED, str(exc)))
        try:
            return await self.inner.Prefill(request, context, first_token)
        finally:
            self.open_calls.release(client)


class WirePrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """PrefillService over gRPC: ``inner``'s, once a ``Prefill`` carries its
    ``room_secret`` (:func:`pdgrpc.serving.room_proof.secret_problem`), counted per
    client (:attr:`per_client`); ``refused`` counts one that is not taken."""

    def __init__(self, inner: PrefillHandlers, refused: Callable[[], None],
                 max_per_client: int = DEFAULT_PER_CLIENT) -> None:
        self.inner = inner
        self.refused = refused
        self.per_client = PerClientPrefill(inner, refused, max_per_client)

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        await self._check(request, context)
        return await self.per_client.Prefill(request, context)

    async def PrefillStream(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> None:  # type: ignore[override]  # grpc.aio allows a context.write() streaming handler that returns None
        await self._check(request, context)
        writes: list[asyncio.Future[None]] = []

        def first_token(token: int) -> None:
            if not writes:
                writes.append(asyncio.ensure_future(context.write(prefill_pb2.PrefillUpdate(token_ids=[token]))))

        try:
            reply = await self.per_client.Prefill(request, context, first_token)
        finally:
            # The first token goes out before the stream ends, however it ends.
            if writes:
                await asyncio.wait(writes)
                if not writes[0].cancelled():
                    writes[0].exception()  # a caller gone meanwhile: the end says so
        await context.write(prefill_pb2.PrefillUpdate(reply=reply))

    async def _check(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> None:
        """Refuse a request whose room or secret is malformed, naming the field."""
        try:
            room_from_proto(request.bootstrap_room)
            problem = secret_problem(bytes(request.room_secret))
            if problem is not None:
                raise ending(Refusal.BAD_REQUEST, problem)
        except RequestFailed as exc:
            self.refused()
            request_event(log, request.bootstrap_room, "rejected", reason=exc.message)
            await abort_with(context, exc)

    async def GetStats(self, request: prefill_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.GetStatsResponse:
        return await self.inner.GetStats(request, context)

    async def SubscribeKvEvents(self, request: prefill_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[prefill_pb2.KvEventBatch]:
        async for b in self.inner.SubscribeKvEvents(request, context):
            yield b


class HandshakeServicer(handshake_pb2_grpc.HandshakeServiceServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Handshake(self, request: handshake_pb2.HandshakeRequest, context: grpc.aio.ServicerContext) -> handshake_pb2.HandshakeResponse:
        span = tracing.server("handshake", context.invocation_metadata()) if tracing.enabled else None
        try:
            room_from_proto(request.bootstrap_room)
            return await self.worker.handshake_claimed(request, peer_identity(context))
        except RequestFailed as exc:
            if span is not None:
                span.end(exc.message)
                span = None
            await abort_with(context, exc)
        finally:
            if span is not None:
                span.end()

    async def AbortRoom(self, request: handshake_pb2.AbortRoomRequest, context: grpc.aio.ServicerContext) -> handshake_pb2.AbortRoomResponse:
        try:
            was_active = await self.worker.abort_room(
                room_from_proto(request.bootstrap_room), request.reason, bytes(request.room_proof), peer_identity(context)
            )
        except RequestFailed as exc:
            await abort_with(context, exc)
        return handshake_pb2.AbortRoomResponse(was_active=was_active)

    async def WatchRoom(self, request: handshake_pb2.WatchRoomRequest, context: grpc.aio.ServicerContext) -> handshake_pb2.WatchRoomResponse:
        """Deprecated (the decode asks the bootstrap): answered at once, never FAILED."""
        try:
            live = self.worker.watching(room_from_proto(request.bootstrap_room))
        except RequestFailed as exc:
            await abort_with(context, exc)
        return handshake_pb2.WatchRoomResponse(
            outcome=handshake_pb2.ROOM_OUTCOME_PENDING if live else handshake_pb2.ROOM_OUTCOME_NOT_FAILED
        )
