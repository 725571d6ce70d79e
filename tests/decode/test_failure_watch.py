"""A decode whose KV is late holds one QueryRoomFailures call on its prefill's bootstrap;
the call ends as soon as the room commits, so a landed room never keeps one of the
bootstrap's bounded places for held calls."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

import grpc

from pdgrpc.decode.job import SchedulerConfig
from pdgrpc.decode.scheduler import DecodeScheduler
from pdgrpc.decode.service import start_decode_server
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.transport.tcp import TcpTransport
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import decode_pb2_grpc
from tests.decode.fake_prefill import FakePrefill, RecordingBootstrap
from tests.decode.test_deadlines import CFG, wait_idle
from tests.decode.test_decode_server import collect, make_request
from tests.eventually import eventually_async


class _CountingBootstrap(RecordingBootstrap):
    """Counts the QueryRoomFailures calls held right now."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0
        self.calls = 0

    async def QueryRoomFailures(self, request: bpb.QueryRoomFailuresRequest, context: grpc.aio.ServicerContext) -> bpb.QueryRoomFailuresResponse:  # noqa: N802
        self.held += 1
        self.calls += 1
        try:
            return await super().QueryRoomFailures(request, context)
        finally:
            self.held -= 1


@contextlib.asynccontextmanager
async def _watched(config: SchedulerConfig) -> AsyncIterator[tuple[Any, FakePrefill, _CountingBootstrap]]:
    """A decode server with ``config`` and a fake prefill whose bootstrap counts the
    watches: (server, prefill, counting)."""
    server = await start_decode_server(DecodeScheduler(ReferenceEngine(CFG), TcpTransport(), 4, config))
    prefill = FakePrefill(ReferenceEngine(CFG))
    counting = _CountingBootstrap()
    prefill.recorder_factory = lambda: counting
    await prefill.start()
    try:
        yield server, prefill, counting
        await eventually_async(lambda: counting.held == 0, 3, 0.02, lambda: f"{counting.held} watch(es) still held after the commit")
        await wait_idle(server)
    finally:
        await prefill.stop()
        await server.stop(grace=0)


async def test_a_committed_room_ends_its_held_failure_watch() -> None:
    # The watch starts 50 ms after the handshake and would be held for 30 s.
    async with _watched(SchedulerConfig(watch_after_s=0.05, watch_wait_s=30.0)) as (server, prefill, counting):
        prefill.send_delay_s = 0.5  # the KV lands well after the watch started
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            msgs = await asyncio.wait_for(collect(stub, make_request(prefill, "late kv", 2)), 20)
        assert [len(m.token_ids) for m in msgs] == [1, 1]
        assert counting.calls >= 1, "the late room was never watched"


async def test_rooms_as_fast_as_the_usual_ones_never_watch_and_a_late_one_does() -> None:
    # Every room waits for its prefill's compute, so a fixed watch delay shorter than the
    # model's compute made every room hold a call on the bootstrap: the watch starts once a
    # room waited twice as long as recent rooms took to land.
    config = SchedulerConfig(watch_after_s=0.05, watch_after_max_s=1.0, watch_wait_s=30.0)
    async with _watched(config) as (server, prefill, counting):
        prefill.send_delay_s = 0.15  # every room's KV lands about 150 ms after its handshake
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            for i in range(3):  # the first has no history: it watches after 50 ms
                msgs = await asyncio.wait_for(collect(stub, make_request(prefill, f"usual {i}", 2)), 20)
                assert [len(m.token_ids) for m in msgs] == [1, 1]
            usual = counting.calls
            for i in range(4):
                await asyncio.wait_for(collect(stub, make_request(prefill, f"as usual {i}", 2)), 20)
            assert counting.calls == usual, f"{counting.calls - usual} of 4 rooms as fast as usual watched"
            prefill.send_delay_s = 0.8  # late: past twice the usual wait
            await asyncio.wait_for(collect(stub, make_request(prefill, "late", 2)), 20)
            assert counting.calls == usual + 1, "the late room was never watched"
