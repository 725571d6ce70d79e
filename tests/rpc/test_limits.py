"""pdgrpc.rpc.limits on live servers: undecodable requests are INVALID_ARGUMENT, messages
over the size limit are refused by gRPC, and the router refuses an over-long prompt
before it forwards anything (audit of issue 16)."""

from __future__ import annotations

from typing import AsyncIterator

import grpc
import pytest

from pdgrpc.bootstrap.service import BootstrapServer, start_bootstrap_server
from pdgrpc.router.service import GenerateServicer, PrefillBackend, RouterConfig, service_names
from pdgrpc.rpc.limits import MAX_MESSAGE_BYTES, MAX_REQUEST_ID_CHARS
from pdgrpc.rpc.server import RpcServer, start_server
from pdgrpc.v1 import bootstrap_pb2, generate_pb2, generate_pb2_grpc, prefill_pb2, prefill_pb2_grpc

# Nothing listens here: a request the router forwarded would fail UNAVAILABLE, not
# INVALID_ARGUMENT naming the limit.
NOWHERE = "127.0.0.1:9"


@pytest.fixture
async def router() -> AsyncIterator[RpcServer]:
    servicer = GenerateServicer(RouterConfig((PrefillBackend(NOWHERE, NOWHERE),), (NOWHERE,), max_prompt_tokens=64))
    (name,) = service_names()
    server = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, s))])
    try:
        yield server
    finally:
        await server.stop(0)
        await servicer.close()


@pytest.fixture
async def bootstrap() -> AsyncIterator[BootstrapServer]:
    server = await start_bootstrap_server()
    try:
        yield server
    finally:
        await server.stop(0)


def _string_field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


async def _raw_stream(address: str, method: str, body: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in ch.unary_stream(method)(body, timeout=10):
                pass
    return ei.value


@pytest.mark.parametrize(
    "body",
    [_string_field(1, b"\xff\xfe not utf-8"), b"\xff\xff\xff\xff garbage"],
    ids=["invalid-utf8-prompt", "garbage-protobuf"],
)
async def test_undecodable_generate_is_invalid_argument(router: RpcServer, body: bytes) -> None:
    err = await _raw_stream(router.address, "/pdgrpc.v1.GenerateService/Generate", body)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert "not a valid pdgrpc.v1.GenerateRequest" in err.details()
    # The server is unharmed: a good request still gets its normal answer.
    assert (await _raw_stream(router.address, "/pdgrpc.v1.GenerateService/Generate", b"")).code() is not grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "method, body",
    [
        ("QueryDpRanks", b"\x0a\xff\xff\xff\xff"),
        ("RegisterDpRanks", b"\x0a\xff\xff\xff\xff"),  # it parses raw bytes itself
        ("GetParallelInfo", b"\x00\x00\x00"),  # found by tests/rpc/test_fuzz.py: UNKNOWN before
    ],
)
async def test_undecodable_unary_request_is_invalid_argument(bootstrap: BootstrapServer, method: str, body: bytes) -> None:
    async with grpc.aio.insecure_channel(bootstrap.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await ch.unary_unary(f"/pdgrpc.v1.BootstrapService/{method}")(body, timeout=10)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (ei.value.code(), ei.value.details())
    assert method in ei.value.details()


async def test_a_service_added_as_a_generic_handler_refuses_undecodable_requests_too() -> None:
    """Handlers are wrapped as services add them: the generic-handler way as well as the
    registered-method one (tested above through the bootstrap)."""

    async def echo(request: bootstrap_pb2.GetWorkersRequest, context: grpc.aio.ServicerContext) -> bootstrap_pb2.GetWorkersRequest:
        return request

    message = bootstrap_pb2.GetWorkersRequest
    handlers = {"Echo": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=message.FromString, response_serializer=message.SerializeToString)}
    server = await start_server([("test.Echo", lambda s: s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", handlers),)))])
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            call = ch.unary_unary("/test.Echo/Echo")
            good = message(dp_rank=3).SerializeToString()
            assert await call(good, timeout=10) == good
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call(b"\x00\x00\x00", timeout=10)
    finally:
        await server.stop(0)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (ei.value.code(), ei.value.details())
    assert "/test.Echo/Echo: the request is not a valid pdgrpc.v1.GetWorkersRequest" in (ei.value.details() or "")


async def test_message_over_the_limit_is_refused_before_parsing(router: RpcServer) -> None:
    body = _string_field(1, b"") + b"\x12" + (MAX_MESSAGE_BYTES).to_bytes(4, "little")  # just for size
    err = await _raw_stream(router.address, "/pdgrpc.v1.GenerateService/Generate", body + b"\0" * MAX_MESSAGE_BYTES)
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "req, needle",
    [
        (generate_pb2.GenerateRequest(input_ids=[1] * 65), "prompt has 65 tokens, over max_prompt_tokens=64"),
        (generate_pb2.GenerateRequest(prompt="x" * 1_000_000), "prompt has at least 1000001 tokens, over max_prompt_tokens=64"),
        (generate_pb2.GenerateRequest(prompt="x" * 64), "prompt has at least 65 tokens"),  # BOS + 64 bytes
    ],
    ids=["input-ids", "long-text", "text-at-the-limit"],
)
async def test_router_refuses_a_prompt_over_the_engine_limit_without_forwarding(
    router: RpcServer, req: generate_pb2.GenerateRequest, needle: str
) -> None:
    """Audit: a 16 M-token Generate was forwarded to prefill and decode before it was refused."""
    async with grpc.aio.insecure_channel(router.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in generate_pb2_grpc.GenerateServiceStub(ch).Generate(req, timeout=10):
                pass
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT and needle in ei.value.details(), ei.value.details()


async def test_an_over_long_request_id_is_refused_naming_it(router: RpcServer) -> None:
    """Every line a request logs, in every process it reaches, carries its request_id: one
    of megabytes would make each request write megabytes of logs."""
    async with grpc.aio.insecure_channel(router.address) as ch:
        stub = generate_pb2_grpc.GenerateServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in stub.Generate(generate_pb2.GenerateRequest(input_ids=[5], request_id="r" * 1_000_000), timeout=10):
                pass
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (ei.value.code(), ei.value.details())
        assert f"request_id: 1000000 characters, over the limit of {MAX_REQUEST_ID_CHARS}" in (ei.value.details() or "")
        # One at the limit goes on to the backends (here: nowhere, so UNAVAILABLE).
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in stub.Generate(generate_pb2.GenerateRequest(input_ids=[5], request_id="r" * MAX_REQUEST_ID_CHARS), timeout=10):
                pass
        assert ei.value.code() is grpc.StatusCode.UNAVAILABLE, (ei.value.code(), ei.value.details())


async def test_every_service_refuses_an_over_long_request_id_before_its_handler() -> None:
    """The bound holds where each message enters, whatever the service: a PrefillRequest
    from a client holding a valid credential is refused before the prefill sees it."""
    seen: list[str] = []

    async def prefill(request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        seen.append(request.request_id)
        return prefill_pb2.PrefillResponse()

    handler = grpc.unary_unary_rpc_method_handler(
        prefill, request_deserializer=prefill_pb2.PrefillRequest.FromString,
        response_serializer=prefill_pb2.PrefillResponse.SerializeToString,
    )
    generic = grpc.method_handlers_generic_handler("pdgrpc.v1.PrefillService", {"Prefill": handler})
    server = await start_server([("pdgrpc.v1.PrefillService", lambda s: s.add_generic_rpc_handlers((generic,)))])
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = prefill_pb2_grpc.PrefillServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Prefill(prefill_pb2.PrefillRequest(request_id="é" * (MAX_REQUEST_ID_CHARS + 1)), timeout=10)
            await stub.Prefill(prefill_pb2.PrefillRequest(request_id="ok"), timeout=10)
    finally:
        await server.stop(0)
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (ei.value.code(), ei.value.details())
    assert "/pdgrpc.v1.PrefillService/Prefill: request_id:" in (ei.value.details() or "")
    assert seen == ["ok"]
