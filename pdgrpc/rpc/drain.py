"""Graceful drain: a server stops taking requests, lets the running ones finish, then stops.

Every pdgrpc server (:func:`pdgrpc.rpc.server.start_server`) has one :class:`Drain`. Its
gate wraps the handlers of the calls that start a request -- the methods named
``Prefill``, ``PrefillStream``, ``Decode`` and ``Generate`` (:data:`ENTRY_METHODS`), smg's
protocol included
-- and counts them while they run. Everything else (health, the decode's ``Handshake`` and
``AbortRoom`` to a prefill worker, bootstrap queries, ``GetStats``) stays open, because the
requests in flight still need it.

Draining (:meth:`RpcServer.drain <pdgrpc.rpc.server.RpcServer.drain>`, on SIGTERM or the
``DrainService.Drain`` RPC):

1. health turns NOT_SERVING and the discovery lease is revoked, so routers stop choosing
   this server;
2. a new entry call ends UNAVAILABLE (``draining``): the router sends it to another
   instance, as it does for a server that is gone;
3. the server waits until every entry call in flight ended -- a prefill's ``Prefill``
   (or ``PrefillStream``) returns once the decode acknowledged the room's KV, a decode's ``Decode`` once its
   generation finished -- and then refuses for :data:`LINGER_S` more, bounded by
   ``--drain-timeout``. A gRPC server that stops cancels, unseen by its handlers, every
   call that reaches it meanwhile; a client that sends its next request the moment its
   last one ends (a router's closed-loop clients do) gets the refusal instead;
4. calls still running then end UNAVAILABLE naming ``drain_timeout`` (their handlers'
   ``finally`` releases what they hold: the decode aborts the room and quarantines its
   pages), and the server stops.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
from typing import Any, AsyncIterator, Callable, Coroutine

import grpc

from pdgrpc.argtypes import seconds
from pdgrpc.reasons import ServerAbortReason
from pdgrpc.rpc.errors import reason_metadata
from pdgrpc.rpc.limits import HandlerWrapper
from pdgrpc.v1 import drain_pb2, drain_pb2_grpc

__all__ = ["DEFAULT_DRAIN_TIMEOUT_S", "ENTRY_METHODS", "LINGER_S", "Drain", "DrainServicer", "add_drain_arguments", "SERVICE_NAME"]

log = logging.getLogger("pdgrpc.rpc")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# The calls that start a request; a draining server refuses new ones and waits for these.
ENTRY_METHODS = frozenset({"Prefill", "PrefillStream", "Decode", "Generate"})
# Seconds a draining server goes on refusing once no entry call runs (and once it started
# draining), before it stops: long enough for a caller's next request after its last
# reply, short next to a restart.
LINGER_S = 0.5
SERVICE_NAME = drain_pb2.DESCRIPTOR.services_by_name["DrainService"].full_name


def add_drain_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--drain-timeout``."""
    p.add_argument(
        "--drain-timeout", type=seconds, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="SECONDS",
        help="on SIGTERM/SIGINT or a DrainService.Drain call: health turns NOT_SERVING, new Prefill/Decode/Generate "
        "calls end UNAVAILABLE, and the server waits this long at most for the calls in flight to finish; those "
        "still running then end UNAVAILABLE (drain_timeout) (default: %(default)s)",
    )


def _is_entry(method: str) -> bool:
    return method.rpartition("/")[2] in ENTRY_METHODS


class Drain:
    """The entry calls in flight and whether the server drains; see the module doc."""

    def __init__(self) -> None:
        self.draining = False
        self._calls: set[asyncio.Task[Any]] = set()
        self._expired: set[asyncio.Task[Any]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._timeout = DEFAULT_DRAIN_TIMEOUT_S
        self._quiet_from = 0.0  # loop time the drain started or an entry call last ended

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def start(self) -> None:
        """Refuse new entry calls from now on."""
        if not self.draining:
            self._quiet_from = asyncio.get_running_loop().time()
        self.draining = True

    async def wait(self, timeout: float) -> int:
        """Wait up to ``timeout`` s until no entry call has run for :data:`LINGER_S`; end
        those still running then UNAVAILABLE (``drain_timeout``) and wait for them.
        Returns how many were ended."""
        self._timeout = timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (now := loop.time()) < deadline:
            if not self._idle.is_set():
                try:
                    await asyncio.wait_for(self._idle.wait(), deadline - now)
                except asyncio.TimeoutError:
                    break
            elif now < self._quiet_from + LINGER_S:
                await asyncio.sleep(min(self._quiet_from + LINGER_S, deadline) - now)
            else:
                break
        late = list(self._calls)
        if not late:
            return 0
        log.warning("drain: %d call(s) still running after %.1f s; ending them (drain_timeout)", len(late), timeout)
        self._expired.update(late)
        for task in late:
            task.cancel()
        await asyncio.wait(late, timeout=5.0)
        return len(late)

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """``handler`` of ``method`` gated and counted when it is an entry call."""
        if handler is None or not _is_entry(method) or handler.request_streaming:
            return handler
        out = handler.response_serializer
        parse = handler.request_deserializer
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary
            if not inspect.iscoroutinefunction(inner_uu):
                return handler

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                return await self._run(context, method, lambda: inner_uu(request, context))

            return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=parse, response_serializer=out)
        inner_us = handler.unary_stream
        if inner_us is None:
            return handler
        if inspect.isasyncgenfunction(inner_us):

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                task = await self._enter(context, method)
                try:
                    async for item in inner_us(request, context):
                        yield item
                except asyncio.CancelledError:
                    await self._expire(task, context, method)
                    raise
                finally:
                    self._leave(task)

            return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=parse, response_serializer=out)
        if inspect.iscoroutinefunction(inner_us):

            async def unary_stream_writer(request: Any, context: grpc.aio.ServicerContext) -> Any:
                return await self._run(context, method, lambda: inner_us(request, context))

            return grpc.unary_stream_rpc_method_handler(unary_stream_writer, request_deserializer=parse, response_serializer=out)
        return handler

    async def _run(self, context: grpc.aio.ServicerContext, method: str, call: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        task = await self._enter(context, method)
        try:
            return await call()
        except asyncio.CancelledError:
            await self._expire(task, context, method)
            raise
        finally:
            self._leave(task)

    async def _enter(self, context: grpc.aio.ServicerContext, method: str) -> asyncio.Task[Any]:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{method}: this server is draining (shutting down); try another instance")
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        self._idle.clear()
        return task

    def _leave(self, task: asyncio.Task[Any]) -> None:
        self._calls.discard(task)
        self._expired.discard(task)
        self._quiet_from = asyncio.get_running_loop().time()
        if not self._calls:
            self._idle.set()

    async def _expire(self, task: asyncio.Task[Any], context: grpc.aio.ServicerContext, method: str) -> None:
        """A call the drain cancelled ends UNAVAILABLE naming the reason; any other
        cancellation (the client went away) stays a cancellation."""
        if task in self._expired:
            task.uncancel()
            reason = ServerAbortReason.DRAIN_TIMEOUT
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"{method}: {reason.value}: the server stopped after draining for {self._timeout:.1f} s with this call still running",
                trailing_metadata=reason_metadata(reason),
            )


class DrainServicer(drain_pb2_grpc.DrainServiceServicer):
    """``DrainService``: starts the server's drain (``start``) and reports it."""

    def __init__(self, drain: Drain, start: Callable[[float | None], float]) -> None:
        self._drain = drain
        self._start = start

    async def Drain(self, request: drain_pb2.DrainRequest, context: grpc.aio.ServicerContext) -> drain_pb2.DrainResponse:  # noqa: N802 - gRPC method name
        timeout = request.timeout_seconds if request.HasField("timeout_seconds") else None
        if timeout is not None and not timeout >= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_seconds must be >= 0, got {timeout}")
        in_flight = self._drain.in_flight
        seconds = self._start(timeout)
        return drain_pb2.DrainResponse(in_flight=in_flight, timeout_seconds=seconds)


def drain_wrapper(drain: Drain, outer: HandlerWrapper | None) -> HandlerWrapper:
    """The drain's gate inside ``outer`` (the token check runs first)."""
    if outer is None:
        return drain.wrap
    return lambda handler, method: outer(drain.wrap(handler, method), method)
