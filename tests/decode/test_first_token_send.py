"""A decode step that serves only new requests waits for their first token to be sent.

The step's Python holds the GIL that gRPC needs to send, so a step started right after a
commit delays the first token (TTFT). Its own tokens cannot reach those clients first
anyway. A batch with a request already streaming never waits (its next token would be
late), and the wait is bounded.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from pdgrpc.decode.job import SchedulerConfig
from pdgrpc.decode.scheduler import DecodeScheduler
from pdgrpc.decode.service import start_decode_server
from pdgrpc.decode.job import Job
from pdgrpc.decode.prefills import PrefillInfo
from pdgrpc.engine.base import SamplingParams
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.state import DpConfig
from pdgrpc.transport import registry
from pdgrpc.transport.tcp import TcpTransport
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import decode_pb2_grpc
from tests.decode.fake_prefill import FakePrefill
from tests.decode.test_deadlines import CFG, wait_idle
from tests.decode.test_decode_server import collect, make_request


def _scheduler(wait_s: float) -> DecodeScheduler:
    return DecodeScheduler(ReferenceEngine(CFG), registry.create("fake"), 4, SchedulerConfig(first_token_wait_s=wait_s))


def _job(room: int) -> Job:
    prefill = PrefillInfo("127.0.0.1:1", bpb.ParallelInfo(dp_size=1), DpConfig(dp_size=1))
    return Job(room, f"r{room}", (256, 65), SamplingParams(), 4, prefill, 1, asyncio.Queue(), 0.0)


async def _timed(coro: object) -> float:
    start = time.monotonic()
    await coro  # type: ignore[misc]
    return time.monotonic() - start


async def test_a_batch_of_new_requests_waits_until_every_first_token_is_sent() -> None:
    s = _scheduler(5.0)
    a, b = _job(1), _job(2)
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, a.first_sent.set)
    loop.call_later(0.15, b.first_sent.set)
    took = await _timed(s.generation.await_first_tokens_sent([a, b]))
    assert 0.14 <= took < 2.0


async def test_a_batch_with_a_streaming_request_does_not_wait() -> None:
    s = _scheduler(5.0)
    new, streaming = _job(1), _job(2)
    streaming.first_sent.set()
    assert await _timed(s.generation.await_first_tokens_sent([new, streaming])) < 0.05


async def test_the_wait_is_bounded_and_can_be_turned_off() -> None:
    stuck = _job(1)  # a stream that never sends (a client that stopped reading)
    assert 0.09 <= await _timed(_scheduler(0.1).generation.await_first_tokens_sent([stuck])) < 2.0
    assert await _timed(_scheduler(0.0).generation.await_first_tokens_sent([stuck])) < 0.05


async def test_a_new_requests_second_token_is_computed_after_its_first_was_sent() -> None:
    # A generous bound, so that only the send itself decides when the step starts.
    engine = ReferenceEngine(CFG)
    scheduler = DecodeScheduler(engine, TcpTransport(), 4, SchedulerConfig(first_token_wait_s=30.0))
    seen: list[tuple[int, bool]] = []  # (tokens generated so far, first token sent) at each step
    real = engine.decode_step

    def step(reqs):  # type: ignore[no-untyped-def]
        seen.extend((j.generated, j.first_sent.is_set()) for j in scheduler.generation.running)
        return real(reqs)

    engine.decode_step = step  # type: ignore[method-assign]
    server = await start_decode_server(scheduler)
    prefill = await FakePrefill(ReferenceEngine(CFG)).start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            msgs = await asyncio.wait_for(collect(stub, make_request(prefill, "hello there", 3)), 20)
        assert [len(m.token_ids) for m in msgs] == [1, 1, 1]
        assert seen[0] == (1, True), seen  # the step for token 2 began after token 1 was sent
        await wait_idle(server)
    finally:
        await prefill.stop()
        await server.stop(grace=0)
