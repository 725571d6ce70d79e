"""smg's SubscribeKvEvents on a prefill: its streams count against the feed's limit of
open streams per client, like pdgrpc's own SubscribeKvEvents (in this process)."""

from __future__ import annotations

import grpc
import pytest

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")

from smg_grpc_proto.generated import common_pb2 as smg_common_pb2  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc  # noqa: E402

from pdgrpc.engine.tokenizer import ByteTokenizer  # noqa: E402
from pdgrpc.gateway.servicer import SERVICE_NAME, PrefillLeg, WorkerInfo, add_to_server  # noqa: E402
from pdgrpc.rpc.server import start_server  # noqa: E402
from pdgrpc.serving.kv_events import KvEventFeed  # noqa: E402
from tests.eventually import eventually_async  # noqa: E402

pytestmark = pytest.mark.timeout(60)

LIMIT = 3  # the feed's streams per client (pdgrpc.serving.kv_events.MAX_STREAMS_PER_CLIENT in servers)


def worker() -> WorkerInfo:
    return WorkerInfo(
        mode="prefill", served_model_name="m", transport="tcp", max_seq_len=2048, max_prompt_tokens=1024,
        max_running_requests=8, bootstrap_port=1, tokenizer=ByteTokenizer(),
    )


async def test_one_client_holds_at_most_the_feeds_limit_of_smg_streams_open():
    """Each open stream costs the prefill a snapshot and a stream: smg's streams count
    against the same per-client limit as pdgrpc's, and one closing makes room."""
    feed = KvEventFeed(max_streams_per_client=LIMIT)
    leg = PrefillLeg(None, worker, active=lambda: 0, healthy=lambda: True, kv_events=feed)
    server = await start_server([(SERVICE_NAME, lambda s: add_to_server(leg, s))], what="test smg prefill")
    request = smg_common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True)  # a load record at once
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = pb_grpc.SglangSchedulerStub(ch)

            async def opened() -> grpc.aio.UnaryStreamCall:
                call = stub.SubscribeKvEvents(request, timeout=30)
                await call.read()  # the first record: the stream is open
                return call

            calls = [await opened() for _ in range(LIMIT)]
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await opened()
            assert ei.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, (ei.value.code(), ei.value.details())
            assert f"{LIMIT} SubscribeKvEvents calls open (limit {LIMIT} per client" in (ei.value.details() or "")
            calls.pop().cancel()

            async def one_more() -> bool:
                try:
                    calls.append(await opened())
                except grpc.aio.AioRpcError:
                    return False
                return True

            await eventually_async(one_more, what="a stream once another closed")
            for call in calls:
                call.cancel()
        await eventually_async(lambda: not feed.streams.open, what="every stream released")
    finally:
        await server.stop(0)
        await feed.close()
