"""The colocated server's GenerateService refuses a request it can never serve as the
client's mistake, naming the field, and goes on serving."""

from __future__ import annotations

import grpc
import pytest

from pdgrpc.cluster import load_topology
from pdgrpc.cluster.reference import reference_engine
from pdgrpc.colocated.server import ColocatedServer
from pdgrpc.rpc.server import start_server
from pdgrpc.v1 import common_pb2, generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.timeout(60)


def request(max_new_tokens: int) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        input_ids=[256, 65], sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


async def test_a_prompt_over_the_limit_is_refused_naming_the_field_it_came_in() -> None:
    """The engine's check names its own parameter (token_ids); the client sent input_ids or prompt."""
    engine = reference_engine(load_topology("colocated"))
    impl = ColocatedServer(engine, chunk_tokens=64)
    name = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
    server = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(impl, s))], what="test colocated")
    limit = engine.max_prompt_tokens
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            for req, field, n in [
                (generate_pb2.GenerateRequest(input_ids=[65] * (limit + 1)), "input_ids", limit + 1),
                (generate_pb2.GenerateRequest(prompt="a" * limit), "prompt", limit + 1),  # and BOS
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [m async for m in stub.Generate(req)]
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details() == f"{field}: prompt has {n} tokens, over max_prompt_tokens={limit}"
    finally:
        await server.stop(0)
        await impl.close()


async def test_a_request_longer_than_the_kv_pool_is_refused_naming_max_new_tokens() -> None:
    """Within max_seq_len but over --num-pages: no wait could ever admit it."""
    engine = reference_engine(load_topology("colocated"), **{"num-pages": 4})  # 64 tokens of KV at 16 per page
    impl = ColocatedServer(engine, chunk_tokens=64)
    name = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
    server = await start_server([(name, lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(impl, s))], what="test colocated")
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(request(100))]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "max_new_tokens: prompt (2) + max_new_tokens (100) needs 7 KV pages, the pool has 4"
            fits = [m async for m in stub.Generate(request(60))]
            assert sum(len(m.token_ids) for m in fits) == 60
            assert impl.active_requests() == 0 and engine.num_free_pages == 4
    finally:
        await server.stop(0)
        await impl.close()
