"""Every phase has a deadline: a request stuck in one ends DEADLINE_EXCEEDED naming that
phase, its resources come back, and the prefill is told when it may still write.

In-process decode servers (short deadlines) against the fake prefill; the unanswered
handshake (bootstrap phase) is covered against the real process in test_decode_server.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
import pytest

from pdgrpc.decode.job import SchedulerConfig
from pdgrpc.decode.scheduler import DecodeScheduler
from pdgrpc.decode.service import DecodeServer, start_decode_server
from pdgrpc.decode.cli import build_parser
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.metrics import start_metrics_server
from tests.scrape import Scrape, scrape
from pdgrpc.serving.flags import engine_config_from_args
from pdgrpc.state import DecodeDeadlines
from pdgrpc.transport.tcp import TcpTransport
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import decode_pb2_grpc
from tests.decode.fake_prefill import FakePrefill
from tests.decode.test_decode_server import ENGINE_FLAGS, collect, make_request
from tests.eventually import eventually_async

SHORT = 0.5  # seconds: the deadline under test
CFG = engine_config_from_args(build_parser().parse_args(ENGINE_FLAGS))


@pytest.fixture
async def server(request: pytest.FixtureRequest) -> AsyncIterator[DecodeServer]:
    deadlines = DecodeDeadlines(**request.param)
    server = await start_decode_server(DecodeScheduler(ReferenceEngine(CFG), TcpTransport(), 4, SchedulerConfig(deadlines=deadlines)))
    try:
        yield server
    finally:
        await server.stop(grace=0)


async def expect_deadline(server: DecodeServer, prefill: FakePrefill, phase_words: tuple[str, ...]) -> int:
    async with grpc.aio.insecure_channel(server.address) as channel:
        req = make_request(prefill, "stuck", 4)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(decode_pb2_grpc.DecodeServiceStub(channel), req)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for word in phase_words:
        assert word in err.value.details()
    return req.bootstrap_room


async def wait_idle(server: DecodeServer) -> None:
    def idle() -> bool:
        s = server.scheduler.stats()
        return not (s["active_requests"] or s["slots_in_use"] or s["pages_in_use"] or s["pages_quarantined"] or s["transport_rooms"])

    await eventually_async(idle, 10, 0.05, lambda: f"decode still holds {server.scheduler.stats()}")


async def scrape_decode(server: DecodeServer) -> Scrape:
    """The decode's metrics over HTTP, live gauges bound to its scheduler as in __main__."""
    m = server.scheduler.metrics
    m.bind(server.scheduler.stats)
    port, stop = start_metrics_server(m.registry, "127.0.0.1", 0)
    try:
        return await asyncio.to_thread(scrape, f"127.0.0.1:{port}")
    finally:
        stop()
        m.unbind()


def assert_one_abort(s: Scrape, reason: str) -> None:
    """Exactly one request, aborted for ``reason``, and nothing left held."""
    d = {"role": "decode"}
    assert s.value("pdgrpc_requests_total", state="aborted", **d) == 1
    assert s.value("pdgrpc_requests_total", state="finished", **d) == 0
    assert s.value("pdgrpc_aborts_total", reason=reason, **d) == 1
    for gauge in ("pdgrpc_active_requests", "pdgrpc_metadata_slots_in_use", "pdgrpc_kv_pages_in_use", "pdgrpc_kv_pages_quarantined"):
        assert s.value(gauge, **d) == 0, gauge


@pytest.mark.parametrize("server", [dict(waiting_for_input_s=SHORT)], indirect=True)
async def test_prefill_that_never_sends(server: DecodeServer) -> None:
    prefill = await FakePrefill(ReferenceEngine(CFG)).start()
    try:
        prefill.mode = "hold"
        room = await expect_deadline(server, prefill, ("WAITING_FOR_INPUT", "waiting for the prefill to send KV"))
        # Pages were promised to the prefill: they come back once it acknowledged the abort.
        await asyncio.wait_for(prefill.workers[0].got_abort.wait(), 10)
        assert prefill.workers[0].aborts[0].bootstrap_room == room
        await wait_idle(server)
        s = await scrape_decode(server)
        assert_one_abort(s, "waiting_for_input_timeout")
        assert s.value("pdgrpc_transfer_seconds_count", role="decode", transport="tcp") == 0  # nothing committed
    finally:
        await prefill.stop()


@pytest.mark.parametrize("server", [dict(resolve_dp_rank_s=SHORT)], indirect=True)
async def test_dp_rank_never_registered(server: DecodeServer) -> None:
    prefill = await FakePrefill(ReferenceEngine(CFG), dp_size=2, method=bpb.LOAD_BALANCE_METHOD_SHORTEST_QUEUE).start()
    try:
        await expect_deadline(server, prefill, ("RESOLVING_DP_RANK", "QueryDpRanks"))
        assert prefill.recorder.queries, "decode never asked bootstrap"
        # Nothing was allocated and no prefill worker heard of the room.
        assert not prefill.workers[0].handshakes and not prefill.workers[1].handshakes
        await wait_idle(server)
        s = await scrape_decode(server)
        assert_one_abort(s, "resolve_dp_rank_timeout")
        # Queries were sent and answered, every time without the room.
        ok = s.value("pdgrpc_dp_rank_queries_total", role="decode", outcome="ok")
        assert ok >= 1 and s.value("pdgrpc_dp_rank_query_rooms_missing_total", role="decode") == ok
    finally:
        await prefill.stop()
