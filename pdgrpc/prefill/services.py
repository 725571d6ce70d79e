"""gRPC servicers of a prefill worker: PrefillService (worker level) and HandshakeService.

Thin adapters: they call :class:`~pdgrpc.prefill.worker.PrefillWorker` and turn its
:class:`~pdgrpc.prefill.errors.RequestFailed` into the RPC status.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from pdgrpc.prefill.errors import RequestFailed
from pdgrpc.rpc.limits import peer_host
from pdgrpc.prefill.worker import PrefillWorker
from pdgrpc.v1 import handshake_pb2, handshake_pb2_grpc, prefill_pb2, prefill_pb2_grpc

__all__ = ["HANDSHAKE_SERVICE", "PREFILL_SERVICE", "HandshakeServicer", "WorkerPrefillServicer", "abort_with"]

PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
HANDSHAKE_SERVICE = handshake_pb2.DESCRIPTOR.services_by_name["HandshakeService"].full_name
MAX_WATCH_MS = 10_000  # longest a WatchRoom call is held (handshake.proto)


async def abort_with(context: grpc.aio.ServicerContext, exc: RequestFailed) -> NoReturn:
    await context.abort(exc.code, exc.message)
    raise AssertionError("unreachable")  # context.abort raises


class WorkerPrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        try:
            return await self.worker.prefill(request)
        except RequestFailed as exc:
            await abort_with(context, exc)

    async def GetStats(self, request: prefill_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.GetStatsResponse:
        return prefill_pb2.GetStatsResponse(stats=self.worker.stats())


class HandshakeServicer(handshake_pb2_grpc.HandshakeServiceServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Handshake(self, request: handshake_pb2.HandshakeRequest, context: grpc.aio.ServicerContext) -> handshake_pb2.HandshakeResponse:
        try:
            return self.worker.handshake(request, peer_host(context))
        except RequestFailed as exc:
            await abort_with(context, exc)

    async def AbortRoom(self, request: handshake_pb2.AbortRoomRequest, context: grpc.aio.ServicerContext) -> handshake_pb2.AbortRoomResponse:
        if request.bootstrap_room == 0:
            await abort_with(context, RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "bootstrap_room must not be 0"))
        try:
            was_active = await self.worker.abort_room(
                request.bootstrap_room, request.reason, bytes(request.room_proof), peer_host(context)
            )
        except RequestFailed as exc:
            await abort_with(context, exc)
        return handshake_pb2.AbortRoomResponse(was_active=was_active)

    async def WatchRoom(self, request: handshake_pb2.WatchRoomRequest, context: grpc.aio.ServicerContext) -> handshake_pb2.WatchRoomResponse:
        if request.bootstrap_room == 0:
            await abort_with(context, RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "bootstrap_room must not be 0"))
        try:
            return await self.worker.watch_room(
                request.bootstrap_room, bytes(request.room_proof), min(request.max_wait_ms, MAX_WATCH_MS) / 1000
            )
        except RequestFailed as exc:
            await abort_with(context, exc)
