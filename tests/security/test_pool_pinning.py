"""One caller cannot pin a decode's pool against another.

A real ``python -m pdgrpc.decode`` under mTLS with roles, its 256-page pool, and two
callers that may call ``Decode``, each its own identity: a router, and an attacker that
is another router or smg (the gateway's certificate, pinning with smg's decode legs,
``SglangScheduler.Generate``). The attacker opens 9 calls whose prefill accepts the
handshake and never writes (each needs 29 pages: together more than the pool). The
router's request is then served in full and exactly, while the attacker's calls still
wait.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdgrpc.cluster.credentials import ClusterCredentials
from pdgrpc.decode.cli import build_parser
from pdgrpc.decode.shares import DEFAULT_MAX_DECODE_SHARE
from pdgrpc.engine.colocated import generate
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.rpc import security
from pdgrpc.serving.flags import engine_config_from_args
from pdgrpc.v1 import decode_pb2, decode_pb2_grpc
from tests.decode.fake_prefill import FakePrefill
from tests.decode.test_decode_server import DECODE_FLAGS, ENGINE_FLAGS, make_request
from tests.eventually import eventually_async
from tests.prefill.procs import DecodeProc

pytestmark = pytest.mark.timeout(150)
PINS = 9
PIN_MAX_NEW = 448  # with a short prompt: 29 of the pool's 256 pages each


def smg_leg(req: decode_pb2.DecodeRequest) -> Any:
    """smg's decode leg of the request ``req`` describes."""
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    host, _, port = req.prefill_bootstrap_address.rpartition(":")
    return pb.GenerateRequest(
        request_id=req.request_id, tokenized=pb.TokenizedInput(input_ids=list(req.input_ids)),
        sampling_params=pb.SamplingParams(max_new_tokens=PIN_MAX_NEW),
        disaggregated_params=pb.DisaggregatedParams(bootstrap_host=host, bootstrap_port=int(port), bootstrap_room=req.bootstrap_room),
    )


@pytest.mark.parametrize("attacker", ["router", "smg"], ids=["direct", "smg-legs"])
async def test_nine_pinning_calls_do_not_starve_another_caller(tmp_path: Path, attacker: str) -> None:
    if attacker == "smg":
        pytest.importorskip("smg_grpc_proto", reason="smg's decode legs need the pdgrpc[gateway] extra")
    engine = ReferenceEngine(engine_config_from_args(build_parser().parse_args(ENGINE_FLAGS)))
    creds = ClusterCredentials(
        tmp_path / "security", {"decode": "decode", "prefill": "prefill", "attacker": attacker, "router": "router"},
        tls=True, token=False,
    )
    before = security.current()
    security.install(creds.security("prefill"))  # the fake prefills serve mTLS as a prefill
    flags = [*DECODE_FLAGS, "--max-decodes-per-client", "64", "--max-decode-share", str(DEFAULT_MAX_DECODE_SHARE),
             "--waiting-timeout", "60", *creds.flags("decode")]
    decode = DecodeProc(flags, tmp_path)
    holding = await FakePrefill(engine).start()
    holding.mode = "hold"  # accepts every handshake, never writes
    serving = await FakePrefill(engine).start()
    pins: list[asyncio.Task[object]] = []
    try:
        address = decode.address
        async with creds.security("attacker").channel(address) as bad, creds.security("router").channel(address) as good:
            async def pin() -> object:
                req = make_request(holding, "pin", PIN_MAX_NEW)
                if attacker == "router":
                    return [m async for m in decode_pb2_grpc.DecodeServiceStub(bad).Decode(req, timeout=90)]
                from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

                return [m async for m in pb_grpc.SglangSchedulerStub(bad).Generate(smg_leg(req), timeout=90)]

            pins = [asyncio.ensure_future(pin()) for _ in range(PINS)]
            await asyncio.sleep(0)
            await eventually_async(lambda: len(holding.workers[0].handshakes) >= 4, 20.0, what="the attacker's handshakes")
            await asyncio.sleep(1.0)  # what the attacker can pin, it has pinned
            req = make_request(serving, "a user's request", 8)
            got = [m async for m in decode_pb2_grpc.DecodeServiceStub(good).Decode(req, timeout=20)]
            assert [t for m in got for t in m.token_ids] == list(generate(engine, [tuple(req.input_ids)], 8)[0].token_ids)
            assert not any(p.done() for p in pins), "the attacker's calls should still wait for their prefill"
    finally:
        for p in pins:
            p.cancel()
        await asyncio.gather(*pins, return_exceptions=True)
        await holding.stop()
        await serving.stop()
        security.install(before)
        decode.stop()
