"""The colocated baseline server (``servers/colocated.toml``) that ``bench e2e`` compares
with: it must produce exactly the colocated reference, batching requests in flight, and
keep serving after a client walks away mid-stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdgrpc.cluster import Cluster
from pdgrpc.cluster.client import generate
from pdgrpc.v1 import common_pb2, generate_pb2
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub

from tests.e2e.harness import prompt_cases, reference_outputs

pytestmark = pytest.mark.timeout(180)


async def test_colocated_server_equals_the_reference_and_survives_a_cancel():
    cases = prompt_cases(page_size=16, chunk_size=64, n=16, rng_seed=11)
    expected = reference_outputs("colocated", cases)
    async with Cluster("colocated") as cluster:
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = GenerateServiceStub(ch)
            call = stub.Generate(
                generate_pb2.GenerateRequest(prompt="walk away", sampling=common_pb2.SamplingParams(max_new_tokens=1500, ignore_eos=True))
            )
            await call.read()
            call.cancel()
            got = await asyncio.gather(
                *(
                    generate(stub, input_ids=c.input_ids, max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                             seed=c.seed, top_k=c.top_k, top_p=c.top_p)
                    for c in cases
                )
            )
        assert [(g.token_ids, g.finish_reason) for g in got] == expected
        assert all(g.bytes_transferred == 0 for g in got)  # nothing moves: one engine
        cluster.check()
