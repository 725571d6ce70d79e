"""Stopping a decode server with a request in flight: the client gets UNAVAILABLE (not a
hang), and the prefill is told to stop writing for the room (AbortRoom)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdgrpc.decode.scheduler import DecodeScheduler
from pdgrpc.decode.service import start_decode_server
from pdgrpc.decode.cli import build_parser
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.serving.flags import engine_config_from_args
from pdgrpc.transport.tcp import TcpTransport
from pdgrpc.v1 import decode_pb2_grpc
from tests.decode.fake_prefill import FakePrefill
from tests.decode.test_decode_server import ENGINE_FLAGS, collect, make_request


async def test_stop_fails_in_flight_requests_and_aborts_their_rooms() -> None:
    cfg = engine_config_from_args(build_parser().parse_args(ENGINE_FLAGS))
    prefill = await FakePrefill(ReferenceEngine(cfg)).start()
    prefill.mode = "hold"  # the handshake is accepted, the KV never comes
    server = await start_decode_server(DecodeScheduler(ReferenceEngine(cfg), TcpTransport(), num_slots=4))
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            req = make_request(prefill, "in flight at shutdown", 4)
            call = asyncio.ensure_future(collect(decode_pb2_grpc.DecodeServiceStub(channel), req))
            await asyncio.wait_for(prefill.workers[0].got_handshake.wait(), 10)
            await server.stop(grace=2)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call, 10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
            assert [a.bootstrap_room for a in prefill.workers[0].aborts] == [req.bootstrap_room]
    finally:
        await server.stop(grace=0)
        await prefill.stop()
