"""The colocated server's GenerateService holds at most ``--max-requests-per-client``
open calls per client: one client's queue cannot grow the process without bound, nor
crowd out the others' requests."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdgrpc.cluster import load_topology
from pdgrpc.cluster.reference import reference_engine
from pdgrpc.colocated.server import ColocatedServer
from pdgrpc.rpc.server import start_server
from pdgrpc.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.eventually import eventually_async

pytestmark = pytest.mark.timeout(60)


def long_request(rid: str) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        input_ids=[256, 65], request_id=rid, sampling=common_pb2.SamplingParams(max_new_tokens=1500, ignore_eos=True),
    )


async def test_one_client_holds_at_most_its_limit_of_open_requests() -> None:
    impl = ColocatedServer(reference_engine(load_topology("colocated")), chunk_tokens=64, max_requests_per_client=2)
    name = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
    server = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(impl, s))], what="test colocated")
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            held = [stub.Generate(long_request(f"h{i}")) for i in range(2)]
            for call in held:
                await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(long_request("third"))]
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "already has 2 Generate calls open (limit 2 per client, --max-requests-per-client)" in err.value.details()
            held[0].cancel()
            await eventually_async(lambda: impl.active_requests() == 1, 10, 0.05, lambda: "the cancelled request is still held")
            short = generate_pb2.GenerateRequest(input_ids=[256, 65], sampling=common_pb2.SamplingParams(max_new_tokens=3))
            assert sum(len(m.token_ids) for m in [m async for m in stub.Generate(short)]) == 3
            held[1].cancel()
            await asyncio.sleep(0)
    finally:
        await server.stop(0)
        await impl.close()
