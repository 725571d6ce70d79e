"""pdgrpc.rpc.drain: a draining server refuses new requests, finishes the running ones,
then stops; past the drain timeout the running ones end UNAVAILABLE naming drain_timeout."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.server import start_server
from pdgrpc.v1 import drain_pb2, drain_pb2_grpc

SERVICE = "test.v1.WorkService"


class Work:
    """``Generate`` streams two messages, ``Prefill`` answers once, both after ``release``;
    ``Other`` (not an entry call) answers at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0
        self.ended: list[str] = []

    async def generate(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        self.started += 1
        try:
            yield b"first"
            await self.release.wait()
            yield b"second"
        finally:
            self.ended.append("generate")

    async def prefill(self, request: bytes, context: Any) -> bytes:
        self.started += 1
        try:
            await self.release.wait()
            return b"prefilled"
        finally:
            self.ended.append("prefill")

    async def other(self, request: bytes, context: Any) -> bytes:
        return b"other"

    def add(self, server: Any) -> None:
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(self.generate),
            "PrefillStream": grpc.unary_stream_rpc_method_handler(self.generate),  # a prefill's first token, then its reply
            "Prefill": grpc.unary_unary_rpc_method_handler(self.prefill),
            "Other": grpc.unary_unary_rpc_method_handler(self.other),
        })
        server.add_generic_rpc_handlers((handler,))


async def _health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return int(reply.status)


async def test_drain_finishes_running_calls_refuses_new_ones_then_stops() -> None:
    work = Work()
    server = await start_server([(SERVICE, work.add)], what="test server")
    pool = ChannelPool()
    try:
        channel = pool.get(server.address)
        stream = channel.unary_stream(f"/{SERVICE}/Generate")(b"", timeout=10)
        assert await stream.read() == b"first"
        unary = channel.unary_unary(f"/{SERVICE}/Prefill")(b"", timeout=10)
        prefill_stream = channel.unary_stream(f"/{SERVICE}/PrefillStream")(b"", timeout=10)
        assert await prefill_stream.read() == b"first"
        while work.started < 3:
            await asyncio.sleep(0.01)
        reply = await drain_pb2_grpc.DrainServiceStub(channel).Drain(drain_pb2.DrainRequest(timeout_seconds=10), timeout=5)
        assert (reply.in_flight, reply.timeout_seconds) == (3, 10.0)
        assert await _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        # A new request is turned away, so a router sends it elsewhere ...
        with pytest.raises(grpc.RpcError) as refused:
            await channel.unary_unary(f"/{SERVICE}/Prefill")(b"", timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        # ... while what the running requests need is still answered.
        assert await channel.unary_unary(f"/{SERVICE}/Other")(b"", timeout=5) == b"other"
        await asyncio.sleep(0.2)
        work.release.set()
        assert await stream.read() == b"second"
        assert await stream.read() is grpc.aio.EOF
        assert await unary == b"prefilled"
        assert await prefill_stream.read() == b"second"  # waited for, as Prefill is
        assert await prefill_stream.read() is grpc.aio.EOF
        await asyncio.wait_for(server.wait_stopped(), 5)
    finally:
        await pool.close()
        await server.stop(0)


async def test_drain_timeout_ends_running_calls_unavailable_naming_the_reason() -> None:
    work = Work()
    server = await start_server([(SERVICE, work.add)], what="test server")
    pool = ChannelPool()
    try:
        channel = pool.get(server.address)
        stream = channel.unary_stream(f"/{SERVICE}/Generate")(b"", timeout=10)
        assert await stream.read() == b"first"
        unary = channel.unary_unary(f"/{SERVICE}/Prefill")(b"", timeout=10)
        while work.started < 2:
            await asyncio.sleep(0.01)
        drained = asyncio.ensure_future(server.drain(timeout=0.3))
        for call in (stream.read(), unary):
            with pytest.raises(grpc.RpcError) as ended:
                await call
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "drain_timeout" in ended.value.details()
        await asyncio.wait_for(drained, 5)
        assert sorted(work.ended) == ["generate", "prefill"]  # their handlers released what they held
    finally:
        await pool.close()
        await server.stop(0)


async def test_client_cancel_during_drain_stays_a_cancellation() -> None:
    work = Work()
    server = await start_server([(SERVICE, work.add)], what="test server")
    pool = ChannelPool()
    try:
        channel = pool.get(server.address)
        stream = channel.unary_stream(f"/{SERVICE}/Generate")(b"", timeout=10)
        assert await stream.read() == b"first"
        drained = asyncio.ensure_future(server.drain(timeout=10))
        await asyncio.sleep(0.1)
        stream.cancel()
        await asyncio.wait_for(drained, 5)  # the cancelled call no longer holds the drain
        assert work.ended == ["generate"]
    finally:
        await pool.close()
        await server.stop(0)


async def test_drain_refuses_a_negative_timeout_naming_the_field() -> None:
    server = await start_server([], what="test server")
    pool = ChannelPool()
    try:
        stub = drain_pb2_grpc.DrainServiceStub(pool.get(server.address))
        with pytest.raises(grpc.RpcError) as bad:
            await stub.Drain(drain_pb2.DrainRequest(timeout_seconds=-1), timeout=5)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "timeout_seconds" in bad.value.details()
        assert await _health(pool.get(server.address)) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await pool.close()
        await server.stop(0)


async def test_a_call_sent_as_the_last_running_one_ends_is_refused_not_cancelled() -> None:
    """Clients that send their next request the moment their running one ends (as a
    router's closed-loop clients do) reach a server whose drain just found no call running:
    each of those calls is refused UNAVAILABLE naming the drain, which a router answers by
    choosing another instance, and none is cancelled by the stopping server. The running
    calls complete."""
    work = Work()
    server = await start_server([(SERVICE, work.add)], what="test server")
    pool = ChannelPool()
    clients = 8
    try:
        channel = pool.get(server.address)
        prefill = channel.unary_unary(f"/{SERVICE}/Prefill")

        async def client() -> tuple[bytes, grpc.StatusCode, str]:
            first = await prefill(b"", timeout=10)
            try:
                await prefill(b"", timeout=10)
            except grpc.RpcError as exc:
                return first, exc.code(), exc.details() or ""
            return first, grpc.StatusCode.OK, ""

        running = [asyncio.ensure_future(client()) for _ in range(clients)]
        while work.started < clients:
            await asyncio.sleep(0.01)
        drained = asyncio.ensure_future(server.drain(timeout=10))
        while not server.gate.draining:
            await asyncio.sleep(0.01)
        work.release.set()
        outcomes = await asyncio.gather(*running)
        assert [first for first, _, _ in outcomes] == [b"prefilled"] * clients
        assert [(code, "draining" in details) for _, code, details in outcomes] == [(grpc.StatusCode.UNAVAILABLE, True)] * clients, outcomes
        await asyncio.wait_for(drained, 5)
        assert work.started == clients  # the calls that came after were never run
    finally:
        await pool.close()
        await server.stop(0)
