"""What every pdgrpc gRPC server bounds, and how it refuses what it cannot read.

* :data:`MAX_MESSAGE_BYTES`: the largest message a server (or a pdgrpc client) accepts.
  It is sized to the largest legitimate message, with room to spare:

  - a 65,536-room ``RegisterDpRanks``/``QueryDpRanks`` batch (the bootstrap's default
    ``--max-batch``), about 1 MiB each way;
  - a ``HandshakeRequest`` naming every page of a 1 Mi-page decode pool, about 3 MiB
    (packed varints);
  - a prompt at a long-context engine's limit (128 Ki tokens as ``input_ids``, or as UTF-8
    text), under 1 MiB.

  A larger message is refused by gRPC itself with ``RESOURCE_EXHAUSTED`` before pdgrpc
  parses a byte of it. The audit of issue 16 sent a 16 M-token ``Generate`` (about 64 MiB)
  that the router parsed and forwarded under the old 64 MiB limit.
* :class:`UndecodableIsInvalidArgument`: a request that does not parse (garbage bytes,
  invalid UTF-8 in a ``string`` field) gets ``INVALID_ARGUMENT`` naming the message type,
  not grpc's ``UNKNOWN``/``INTERNAL``.
* :func:`peer_host`: the caller's host, the key of per-client caps.
"""

from __future__ import annotations

import inspect
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

__all__ = ["MAX_MESSAGE_BYTES", "UndecodableIsInvalidArgument", "peer_host"]

MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def peer_host(context: grpc.aio.ServicerContext) -> str:
    """The caller's host (``127.0.0.1``, ``::1``, a unix socket path), without its port:
    one client's calls share it whatever connection they use."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]") or rest
    return peer


class UndecodableIsInvalidArgument(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Parses each unary request itself, so a request that does not parse ends
    ``INVALID_ARGUMENT: <method>: the request is not a valid <type>: <why>``."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = details.method
        name = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
        what = name.full_name if name is not None else "request message"

        async def request(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                return parse(raw)
            except Exception as exc:  # any parser failure is the caller's bytes
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid {what}: {exc}")

        out = handler.response_serializer
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary
            if not inspect.iscoroutinefunction(inner_uu):
                return handler

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await inner_uu(await request(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=out)
        inner_us = handler.unary_stream
        if inner_us is None:
            return handler
        if inspect.isasyncgenfunction(inner_us):

            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for item in inner_us(await request(raw, context), context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=out)
        if inspect.iscoroutinefunction(inner_us):  # a handler writing with context.write()

            async def unary_stream_writer(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await inner_us(await request(raw, context), context)

            return grpc.unary_stream_rpc_method_handler(unary_stream_writer, response_serializer=out)
        return handler
