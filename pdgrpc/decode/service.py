"""``DecodeService`` over grpc.aio: a thin adapter between RPCs and the scheduler.

``Decode`` validates the request (INVALID_ARGUMENT naming the field), admits it, then
streams what the scheduler queues for it; a failure ends the stream with the status the
scheduler chose (ABORTED, DEADLINE_EXCEEDED naming the phase, ...). However the call
ends -- normally, with an error, or cancelled by the client (the router cancels it when
the prefill side failed) -- the ``finally`` hands the room back to the scheduler, which
aborts whatever is still in flight (AbortRoom to the prefill, pages quarantined until
acked). ``GetStats`` reads the live state.

Over gRPC the service is :class:`WireDecodeServicer`: a ``Decode`` without its
``room_secret`` is refused with INVALID_ARGUMENT naming the field. In-process callers
whose protocol has no secret (smg's decode leg, :mod:`pdgrpc.gateway`) call
:class:`DecodeServicer` itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import AsyncIterator, Callable, Collection

import grpc

from pdgrpc.argtypes import check_address
from pdgrpc.decode.job import Job
from pdgrpc.decode.scheduler import DecodeScheduler
from pdgrpc.decode.shares import DEFAULT_MAX_DECODE_SHARE, PoolShares
from pdgrpc.decode.statuses import Refusal, ending
from pdgrpc.errors import EngineError, RequestFailed
from pdgrpc.rpc import tracing
from pdgrpc.rpc.drain import Drain
from pdgrpc.rpc.errors import reason_metadata
from pdgrpc.rpc.limits import MAX_ADDRESS_CHARS
from pdgrpc.rpc.open_calls import DEFAULT_PER_CLIENT, OpenCalls, TooManyOpenCalls
from pdgrpc.rpc.security import peer_identity
from pdgrpc.rpc.server import RpcServer, ServiceSpec, start_server
from pdgrpc.serving.convert import room_from_proto, sampling_from_proto
from pdgrpc.serving.kv_events import CAPABILITIES_KEY, LOCAL_PREFILL, serve_kv_events
from pdgrpc.serving.logs import request_event
from pdgrpc.serving.room_proof import secret_problem
from pdgrpc.v1 import common_pb2, decode_pb2, prefill_pb2
from pdgrpc.v1 import decode_pb2_grpc as dpb_grpc

log = logging.getLogger("pdgrpc.decode")

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name

__all__ = ["DecodeServer", "DecodeServicer", "SERVICE_NAME", "WireDecodeServicer", "start_decode_server"]


class DecodeServicer(dpb_grpc.DecodeServiceServicer):
    """``max_per_client``: most ``Decode`` calls one client (its mTLS identity, else its
    host: :func:`~pdgrpc.rpc.security.peer_identity`) may have open at
    once; one more is refused with RESOURCE_EXHAUSTED naming the limit, so no one caller
    holds the whole pool (a handful of direct calls can pin every page)."""

    def __init__(
        self, scheduler: DecodeScheduler, max_per_client: int = DEFAULT_PER_CLIENT,
        max_share: float = DEFAULT_MAX_DECODE_SHARE,
    ) -> None:
        self.scheduler = scheduler
        self.open_calls = OpenCalls(max_per_client, "Decode", "--max-decodes-per-client")
        # What one client's calls hold before their first token (pdgrpc.decode.shares).
        self.shares = PoolShares(max_share, scheduler.engine.num_pages, scheduler.buffers.num_slots)

    async def Decode(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        client = peer_identity(context)  # its certificate's name under mTLS, else its host
        try:
            self.open_calls.acquire(client)
        except TooManyOpenCalls as exc:
            await self.refuse(context, request, ending(Refusal.OVERLOADED, str(exc)))
            return  # abort() raises; not reached
        try:
            async for item in self._decode(request, context, client):
                yield item
        finally:
            self.open_calls.release(client)

    async def _decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext, client: str
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        # Until the first token is handed to gRPC; the handshake's span and the hops below are its children.
        trace = tracing.server("decode", context.invocation_metadata()) if tracing.enabled else None
        try:
            job, shared = await self._admit(request, client)
            job.trace = trace
        except RequestFailed as exc:
            if trace is not None:
                trace.end(exc.message)
            await self.refuse(context, request, exc)
            return  # abort() raises; not reached
        try:
            while True:
                item = await job.out.get()
                if shared:  # its KV landed (or it ended): its pages wait no more
                    self.shares.give_back(client, shared)
                    shared = 0
                if isinstance(item, RequestFailed):
                    await context.abort(item.code, item.message, trailing_metadata=reason_metadata(item.reason))
                    return  # abort() raises; not reached
                if trace is not None:  # handed to gRPC now (it resumes us only once written)
                    trace.hop("first_token")
                    trace.end()
                    trace = None
                yield decode_pb2.DecodeResponse(
                    token_ids=item.token_ids,
                    logprobs=item.logprobs,
                    finish_reason=item.finish_reason,
                    bytes_transferred=item.bytes_transferred,
                    transfer_seconds=item.transfer_seconds,
                    data_plane_seconds=item.data_plane_seconds,
                    cached_tokens=item.cached_tokens,
                    top_logprobs=[common_pb2.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in item.top],
                )
                # grpc resumes the generator once the message is written to the connection.
                job.first_sent.set()
                if item.finish_reason:
                    return
        finally:
            if shared:
                self.shares.give_back(client, shared)
            if trace is not None:
                trace.end("ended before the first token")
            job.first_sent.set()  # nobody waits for a stream that ended
            if not job.fate.ended:  # the client cancelled (or the stream broke): abort it
                self.scheduler.cancel(job.room, "client cancelled the Decode call")

    async def refuse(self, context: grpc.aio.ServicerContext, request: decode_pb2.DecodeRequest, failure: RequestFailed) -> None:
        """End a Decode call before its request was admitted: counted, logged, and the
        status of ``failure`` (this role's statuses come from :mod:`pdgrpc.decode.statuses`)."""
        self.scheduler.metrics.on_refused()
        request_event(log, request.bootstrap_room, "refused", status=failure.code.name, message=failure.message)
        await context.abort(failure.code, failure.message, trailing_metadata=reason_metadata(failure.reason))

    async def _admit(self, request: decode_pb2.DecodeRequest, client: str) -> tuple[Job, int]:
        """The admitted request, and the pages it holds against ``client``'s share."""
        engine = self.scheduler.engine
        room = room_from_proto(request.bootstrap_room)
        if not request.prefill_bootstrap_address and not request.local_prefill:
            raise ending(Refusal.BAD_REQUEST, "prefill_bootstrap_address is empty (host:port of the prefill's BootstrapService)")
        if len(request.prefill_bootstrap_address) > MAX_ADDRESS_CHARS:
            n = len(request.prefill_bootstrap_address)
            raise ending(Refusal.BAD_REQUEST, f"prefill_bootstrap_address: {n} characters, over the limit of {MAX_ADDRESS_CHARS}")
        if not request.local_prefill:
            # No bootstrap answers at an address that is not HOST:PORT: refused now rather
            # than dialled until the caller's deadline.
            try:
                check_address(request.prefill_bootstrap_address, "prefill_bootstrap_address")
            except ValueError as exc:
                raise ending(Refusal.BAD_REQUEST, str(exc)) from None
        if not request.HasField("sampling"):
            raise ending(Refusal.BAD_REQUEST, "sampling is not set (it must equal the one sent to the prefill)")
        ids = tuple(request.input_ids)
        max_new = int(request.sampling.max_new_tokens)
        try:
            sampling = sampling_from_proto(request.sampling)
            engine.validate_request(ids, max_new, "input_ids")
        except EngineError as exc:  # InvalidRequest among them
            raise ending(Refusal.BAD_REQUEST, str(exc)) from None
        if request.local_prefill:  # computed here: nothing waits on another process
            return self.scheduler.submit_local(room, request.request_id, ids, sampling, max_new), 0
        pages = self.scheduler.pages_for(ids, max_new)
        try:
            await self.shares.take(client, pages, self.scheduler.config.deadlines.allocate_s)
        except TooManyOpenCalls as exc:
            raise ending(Refusal.OVERLOADED, str(exc)) from None
        routed = request.routed_dp_rank if request.HasField("routed_dp_rank") else None
        try:
            job = await self.scheduler.submit(
                room, request.request_id, ids, sampling, max_new, request.prefill_bootstrap_address, routed, bytes(request.room_secret)
            )
        except BaseException:
            self.shares.give_back(client, pages)
            raise
        return job, pages

    async def GetStats(  # noqa: N802 - gRPC method name
        self, request: prefill_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.GetStatsResponse:
        # GetStatsRequest/Response are declared in prefill.proto (imported by decode.proto).
        return prefill_pb2.GetStatsResponse(stats=common_pb2.ResourceStats(**self.scheduler.stats()))

    async def SubscribeKvEvents(  # noqa: N802 - gRPC method name
        self, request: prefill_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[prefill_pb2.KvEventBatch]:
        feed = self.scheduler.kv_events
        if feed is None:
            no_cache = ending(Refusal.UNSUPPORTED, "this decode keeps no prefix cache (start it with --decode-prefix-cache, over a transport that moves KV)")
            await context.abort(no_cache.code, no_cache.message)
            return
        await context.send_initial_metadata(((CAPABILITIES_KEY, LOCAL_PREFILL),))
        async for b in serve_kv_events(feed, request, context):
            yield b


class WireDecodeServicer(dpb_grpc.DecodeServiceServicer):
    """``DecodeService`` as served over gRPC: :class:`DecodeServicer`'s, once the request
    carries its ``room_secret`` (:func:`pdgrpc.serving.room_proof.secret_problem`)."""

    def __init__(self, inner: DecodeServicer) -> None:
        self.inner = inner

    async def Decode(  # noqa: N802 - gRPC method name
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        problem = secret_problem(bytes(request.room_secret))
        if problem is not None:
            await self.inner.refuse(context, request, ending(Refusal.BAD_REQUEST, problem))
        async for item in self.inner.Decode(request, context):
            yield item

    async def GetStats(  # noqa: N802 - gRPC method name
        self, request: prefill_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.GetStatsResponse:
        return await self.inner.GetStats(request, context)

    async def SubscribeKvEvents(  # noqa: N802 - gRPC method name
        self, request: prefill_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[prefill_pb2.KvEventBatch]:
        async for b in self.inner.SubscribeKvEvents(request, context):
            yield b


@dataclasses.dataclass
class DecodeServer:
    """A running decode server: ``address``, ``scheduler``, ``stop()``."""

    rpc: RpcServer
    scheduler: DecodeScheduler

    @property
    def address(self) -> str:
        return self.rpc.address

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.rpc.stop(grace)


async def start_decode_server(
    scheduler: DecodeScheduler, host: str = "127.0.0.1", port: int = 0,
    extra: Callable[[DecodeServicer, Drain], ServiceSpec | None] | None = None,
    max_per_client: int = DEFAULT_PER_CLIENT, max_share: float = DEFAULT_MAX_DECODE_SHARE,
    gateway_listen: str | None = None, gateway_uids: Collection[int] = (),
) -> DecodeServer:
    """Start the scheduler and serve DecodeService (plus health and reflection, and
    ``extra(servicer, drain)`` when it names a service: smg's protocol, which reports the
    server's drain; ``gateway_listen``: smg's loopback listener, also for the processes of
    ``gateway_uids``). On stop, in-flight requests end UNAVAILABLE and the transport closes."""
    await scheduler.start()
    servicer = DecodeServicer(scheduler, max_per_client, max_share)
    wire = WireDecodeServicer(servicer)
    services: list[ServiceSpec] = [(SERVICE_NAME, lambda server: dpb_grpc.add_DecodeServiceServicer_to_server(wire, server))]
    drain = Drain()
    more = extra(servicer, drain) if extra is not None else None
    if more is not None:
        services.append(more)
    try:
        rpc = await start_server(
            services,
            host=host,
            port=port,
            what="pdgrpc decode",
            drain=drain,
            gateway_listen=gateway_listen,
            gateway_uids=gateway_uids,
        )
    except BaseException:
        await scheduler.close()
        raise

    async def close_scheduler() -> None:
        # Fail the streams first so grace is not spent waiting for requests that cannot finish.
        await scheduler.close()
        await asyncio.sleep(0)

    rpc.on_stop(close_scheduler)
    return DecodeServer(rpc, scheduler)
