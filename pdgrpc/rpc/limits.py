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
  parses a byte of it, so a 16 M-token ``Generate`` (about 64 MiB) never costs the router
  a parse and a forward.
* :class:`UndecodableIsInvalidArgument` (services are added to a server through it): a
  request that does not parse (garbage bytes, invalid UTF-8 in a ``string`` field) gets
  ``INVALID_ARGUMENT`` naming the message type, not grpc's ``UNKNOWN``/``INTERNAL``.
* :data:`MAX_REQUEST_ID_CHARS`: a request's ``request_id`` (a field of any request message
  that has one) is at most this long, or the request ends ``INVALID_ARGUMENT`` naming it.
  Every log line of the request, in each process it reaches, carries it; clients' ids
  (UUIDs, smg's ``cmpl-`` ids) are a few dozen characters.
* :data:`MAX_HOST_CHARS` and :data:`MAX_ADDRESS_CHARS`: a host name, and a ``host:port``
  address, that a request names for its server to dial. The server dials it, logs it and
  keeps a channel for it; a DNS name is at most 253 characters.
* :data:`MAX_ABORT_REASON_CHARS`: an abort's ``reason`` (smg's ``Abort``, a decode's
  ``AbortRoom``). The server logs it and ends the aborted call (or keeps a room's
  tombstone) with it; a few words in practice.
* :data:`MAX_NAME_CHARS`: a name one process announces to others and they keep, log and
  compare: a transport backend (``rdma``), a KV dtype (``bfloat16``), a KV layout
  (``layer_kv_page_head_dim``); a few dozen characters in practice.
* :data:`MAX_TRANSPORT_ENDPOINT_BYTES`: a worker's transport descriptor, as it registers
  with its bootstrap, which keeps it for every decode that asks. An ``rdma`` worker of a
  128-layer model describes itself in about 15 KB (a region per K and V pool); the limit
  leaves four times that, and keeps a bootstrap's largest topology
  (:data:`pdgrpc.bootstrap.registry.MAX_WORKERS` workers) under 256 MiB. A backend whose
  descriptors need more raises it.
* :data:`MAX_COMPATIBILITY_HASH_BYTES`: a compatibility hash, which peers keep and
  compare whole; pdgrpc's is a 32-byte SHA-256 digest.
"""

from __future__ import annotations

import inspect
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

import grpc

__all__ = [
    "MAX_ABORT_REASON_CHARS", "MAX_ADDRESS_CHARS", "MAX_COMPATIBILITY_HASH_BYTES", "MAX_HOST_CHARS", "MAX_MESSAGE_BYTES",
    "MAX_NAME_CHARS", "MAX_REQUEST_ID_CHARS", "MAX_TRANSPORT_ENDPOINT_BYTES", "HandlerWrapper", "Limited", "UndecodableIsInvalidArgument",
    "over_limit", "parse_or_abort",
]

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_REQUEST_ID_CHARS = 256
MAX_HOST_CHARS = 253
MAX_ADDRESS_CHARS = MAX_HOST_CHARS + len("[]:65535")
MAX_ABORT_REASON_CHARS = 1024
MAX_NAME_CHARS = 128
MAX_TRANSPORT_ENDPOINT_BYTES = 64 * 1024
MAX_COMPATIBILITY_HASH_BYTES = 64

# A field a peer sent: its name, its value, the most it may hold and the unit of both.
Limited = tuple[str, str | bytes, int, str]


def over_limit(fields: Iterable[Limited]) -> str | None:
    """``name: N unit, over the limit of L`` for the first of ``fields`` over its limit;
    None when each is within."""
    for name, value, limit, unit in fields:
        if len(value) > limit:
            return f"{name}: {len(value)} {unit}, over the limit of {limit}"
    return None


def parse_or_abort(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` parsing its own request, so that a request that does not parse ends
    ``INVALID_ARGUMENT: <method>: the request is not a valid <type>: <why>`` (grpc's own
    parsing ends it UNKNOWN). Handlers that read raw bytes, stream requests or are not
    coroutines are returned as they are."""
    if handler is None or handler.request_streaming or handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer
    name = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    what = name.full_name if name is not None else "request message"
    out = handler.response_serializer
    has_id = name is not None and "request_id" in name.fields_by_name

    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = parse(raw)
        except Exception as exc:  # any parser failure is the caller's bytes
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid {what}: {exc}")
            raise AssertionError("unreachable") from exc  # context.abort raises
        if has_id and len(request.request_id) > MAX_REQUEST_ID_CHARS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{method}: request_id: {len(request.request_id)} characters, over the limit of {MAX_REQUEST_ID_CHARS}",
            )
        return request

    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary
        if not inspect.iscoroutinefunction(inner_uu):
            return handler

        async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await inner_uu(await parsed(raw, context), context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=out)
    inner_us = handler.unary_stream
    if inner_us is None:
        return handler
    if inspect.isasyncgenfunction(inner_us):

        async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in inner_us(await parsed(raw, context), context):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=out)
    if inspect.iscoroutinefunction(inner_us):  # a handler writing with context.write()

        async def unary_stream_writer(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            return await inner_us(await parsed(raw, context), context)

        return grpc.unary_stream_rpc_method_handler(unary_stream_writer, response_serializer=out)
    return handler


HandlerWrapper = Callable[[grpc.RpcMethodHandler, str], grpc.RpcMethodHandler]
"""Makes ``(handler, "/service/method")`` into the handler the server runs."""


class _ParsingGenericHandler(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A generic handler whose handlers go through ``wrap`` (made once per method, then
    reused)."""

    _CACHED_METHODS = 1024  # a generic handler may answer any method name: bound the cache

    def __init__(self, inner: grpc.GenericRpcHandler, wrap: HandlerWrapper) -> None:
        self._inner = inner
        self._wrap = wrap
        self._made: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._inner.service(details)
        if handler is None:
            return None
        made = self._made.get(details.method)
        if made is not None and made[0] is handler:
            return made[1]
        wrapped = self._wrap(handler, details.method)
        if len(self._made) < self._CACHED_METHODS:
            self._made[details.method] = (handler, wrapped)
        return wrapped


class UndecodableIsInvalidArgument:
    """Stands for a ``grpc.aio.Server`` while services add their handlers to it (the
    ``add_..._to_server`` functions): every handler added through it parses its own
    request (:func:`parse_or_abort`), and then goes through ``outer`` when given (the
    bearer-token check of :mod:`pdgrpc.rpc.security`, which so runs before parsing).
    Handlers are wrapped once, as they are added, because a ``grpc.aio`` interceptor
    builds a coroutine chain and new handler objects on every call."""

    def __init__(self, server: grpc.aio.Server, outer: HandlerWrapper | None = None) -> None:
        self._server = server
        self._outer = outer
        # Each registered method's handler as the server runs it, by ``/service/method``
        # (what the local socket serves: pdgrpc.rpc.local).
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """``handler`` of ``method`` (``/service/name``) as the server runs it."""
        parsing = parse_or_abort(handler, method)
        return parsing if self._outer is None else self._outer(parsing, method)

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_ParsingGenericHandler(h, self.wrap) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        wrapped = {name: self.wrap(h, f"/{service}/{name}") for name, h in handlers.items()}
        self.handlers.update((f"/{service}/{name}", h) for name, h in wrapped.items())
        self._server.add_registered_method_handlers(service, wrapped)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)
