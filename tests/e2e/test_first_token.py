"""The prefill's first token sent ahead, in a real cluster: ``PrefillStream`` on a real
prefill (its controller, a worker process, its compute child) sends the first token as
soon as it is sampled, before any decode asked for the KV, and it is the token the whole
path generates. (The router's side, with scripted upstreams: tests/router.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdgrpc.cluster import Cluster
from pdgrpc.cluster.client import generate
from pdgrpc.router.service import draw_room
from pdgrpc.serving.room_proof import draw_secret
from pdgrpc.v1 import common_pb2, prefill_pb2
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub
from pdgrpc.v1.prefill_pb2_grpc import PrefillServiceStub

pytestmark = pytest.mark.timeout(180)

PROMPT = [256, *b"the token goes ahead of its pages, " * 3]


async def test_prefill_stream_sends_the_first_token_before_any_decode_handshakes():
    async with Cluster("1p1d", transport="tcp", start_timeout=120) as cluster:
        whole = await generate(GenerateServiceStub(cluster.channel("router")), input_ids=PROMPT, max_new_tokens=3, ignore_eos=True)
        # No decode is told of this room: the KV has nowhere to go, the token still comes.
        request = prefill_pb2.PrefillRequest(
            bootstrap_room=draw_room(), input_ids=PROMPT, room_secret=draw_secret(),
            sampling=common_pb2.SamplingParams(max_new_tokens=3, ignore_eos=True),
        )
        call = PrefillServiceStub(cluster.channel("prefill")).PrefillStream(request, timeout=60)
        first = await call.read()
        assert list(first.token_ids) == [whole.token_ids[0]] and not first.HasField("reply")
        call.cancel()
        assert await _released(cluster)


async def _released(cluster: Cluster) -> bool:
    """The cancelled call's room is released (its pages back) within a few seconds."""
    for _ in range(100):
        if (await cluster.stats("prefill")).active_requests == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_the_wire_checks_of_prefill_apply_to_prefill_stream():
    async with Cluster("1p1d", transport="fake", start_timeout=120) as cluster:
        call = PrefillServiceStub(cluster.channel("prefill")).PrefillStream(
            prefill_pb2.PrefillRequest(bootstrap_room=draw_room(), input_ids=PROMPT), timeout=30
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "room_secret" in err.value.details()
