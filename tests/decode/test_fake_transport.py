"""The decode scheduler in-process with the ``fake`` transport: no bytes move, so decode
computes the prompt's KV itself after the handshake, and output still equals colocated
generation (fake topologies exercise the whole control plane with correct text)."""

from __future__ import annotations

import asyncio

import grpc

from pdgrpc.decode.scheduler import DecodeScheduler
from pdgrpc.decode.service import start_decode_server
from pdgrpc.decode.cli import build_parser
from pdgrpc.engine.base import SamplingParams
from pdgrpc.engine.colocated import generate
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.serving.flags import engine_config_from_args
from pdgrpc.transport.fake import FakeTransport
from pdgrpc.v1 import decode_pb2_grpc, prefill_pb2
from tests.decode.fake_prefill import FakePrefill
from tests.decode.test_decode_server import ENGINE_FLAGS, collect, make_request


async def test_fake_transport_generates_colocated_tokens() -> None:
    cfg = engine_config_from_args(build_parser().parse_args(ENGINE_FLAGS))
    prefill = await FakePrefill(ReferenceEngine(cfg), transport="fake").start()
    server = await start_decode_server(DecodeScheduler(ReferenceEngine(cfg), FakeTransport(), num_slots=4))
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            cases = [("a", 5, SamplingParams()), ("b" * 40, 9, SamplingParams(temperature=0.7, seed=3))]
            reqs = [make_request(prefill, text, n, s) for text, n, s in cases]
            results = await asyncio.gather(*(collect(stub, r) for r in reqs))
            for req, msgs, (_, n, s) in zip(reqs, results, cases):
                want = generate(prefill.engine, [tuple(req.input_ids)], n, s)[0]
                assert [t for m in msgs for t in m.token_ids] == list(want.token_ids)
                assert msgs[0].bytes_transferred == 0  # nothing moved
            assert sorted(h.bootstrap_room for h in prefill.workers[0].handshakes) == sorted(r.bootstrap_room for r in reqs)
            stats = (await stub.GetStats(prefill_pb2.GetStatsRequest(), timeout=5)).stats
            assert (stats.active_requests, stats.slots_in_use, stats.pages_in_use, stats.transport_rooms) == (0, 0, 0, 0)
    finally:
        await server.stop(grace=1)
        await prefill.stop()
