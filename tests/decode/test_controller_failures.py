"""Issue 17: a decode learns from the prefill's bootstrap that the prefill's controller
refused its room (pdgrpc.prefill.notices), only under the room's secret.

In-process decode against the fake prefill, whose real bootstrap holds the records.
"""

from __future__ import annotations

import grpc
import pytest

from pdgrpc.decode.job import SchedulerConfig
from pdgrpc.decode.scheduler import DecodeScheduler
from pdgrpc.decode.service import DecodeServer, start_decode_server
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.serving.room_proof import draw_secret, failure_tag
from pdgrpc.state import DecodeDeadlines
from pdgrpc.transport.tcp import TcpTransport
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import decode_pb2, decode_pb2_grpc
from tests.decode.fake_prefill import FakePrefill
from tests.decode.test_deadlines import CFG, assert_one_abort, scrape_decode, wait_idle
from tests.decode.test_decode_server import collect, make_request

LONG = 30.0  # seconds: deadlines the prompt answer must not wait for
SHORT = 0.5


def record(prefill: FakePrefill, req: decode_pb2.DecodeRequest, secret: bytes) -> None:
    key = bpb.RoomFailureKey(bootstrap_room=req.bootstrap_room, tag=failure_tag(secret, req.bootstrap_room))
    failure = bpb.RoomFailure(key=key, code=grpc.StatusCode.UNAVAILABLE.value[0], reason="no live prefill worker", never_forwarded=True)
    prefill.recorder.failures.record([failure], prefill.recorder.clock())


async def start(deadlines: DecodeDeadlines) -> DecodeServer:
    return await start_decode_server(DecodeScheduler(ReferenceEngine(CFG), TcpTransport(), 4, SchedulerConfig(deadlines=deadlines)))


async def run(server: DecodeServer, req: decode_pb2.DecodeRequest) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(decode_pb2_grpc.DecodeServiceStub(channel), req)
    return err.value


@pytest.mark.parametrize("genuine", [True, False], ids=["genuine", "forged"])
async def test_a_room_whose_dp_rank_never_comes(genuine: bool) -> None:
    """Query mode: the room is never registered; its failure record ends it at once."""
    server = await start(DecodeDeadlines(resolve_dp_rank_s=LONG if genuine else SHORT))
    prefill = await FakePrefill(ReferenceEngine(CFG), dp_size=2, method=bpb.LOAD_BALANCE_METHOD_SHORTEST_QUEUE).start()
    try:
        req = make_request(prefill, "refused", 4)
        record(prefill, req, bytes(req.room_secret) if genuine else draw_secret())
        err = await run(server, req)
        if genuine:
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "no live prefill worker" in err.details(), err.details()
        else:  # a record made without the room's secret changes nothing: the deadline ends it
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
        await wait_idle(server)
        assert_one_abort(await scrape_decode(server), "prefill_error" if genuine else "resolve_dp_rank_timeout")
    finally:
        await prefill.stop()
        await server.stop(grace=0)


async def test_a_room_whose_worker_is_gone_frees_its_pages_at_once() -> None:
    """dp 1: the handshake finds no worker (it died); the record ends the request, and
    its pages come back without an AbortRoom acknowledgement nobody can give."""
    server = await start(DecodeDeadlines(bootstrap_s=LONG, abort_lease_s=LONG))
    prefill = await FakePrefill(ReferenceEngine(CFG)).start()
    try:
        await prefill.workers.pop(0).stop()  # still registered; its port refuses connections now
        req = make_request(prefill, "no worker", 4)
        record(prefill, req, bytes(req.room_secret))
        err = await run(server, req)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "no live prefill worker" in err.details(), err.details()
        await wait_idle(server)
        assert_one_abort(await scrape_decode(server), "prefill_error")
    finally:
        await prefill.stop()
        await server.stop(grace=0)
