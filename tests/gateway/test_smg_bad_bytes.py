"""Every method of smg's ``SglangScheduler`` answers junk with a status, not a crash.

A colocated server serves the facade in-process (the methods other than ``Generate``
are the same on every leg). Bytes that do not parse are INVALID_ARGUMENT naming the
message; the methods pdgrpc does not serve (embeddings, LoRA, profiling, ``FlushCache``,
KV events off a prefill) are UNIMPLEMENTED naming the method, whatever the caller sends;
no call ends UNKNOWN or INTERNAL, none logs a traceback at ERROR, and the server serves on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import AsyncIterator

import grpc
import pytest

pytest.importorskip("smg_grpc_proto", reason="the gateway extra (pdgrpc[gateway]) is not installed")

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb  # noqa: E402

from pdgrpc.cluster import load_topology  # noqa: E402
from pdgrpc.cluster.reference import reference_engine  # noqa: E402
from pdgrpc.colocated.server import ColocatedServer  # noqa: E402
from pdgrpc.gateway import colocated_service  # noqa: E402
from pdgrpc.rpc.drain import Drain  # noqa: E402
from pdgrpc.rpc.server import start_server  # noqa: E402
from tests import fuzz_messages  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SERVICE = pb.DESCRIPTOR.services_by_name["SglangScheduler"]
SERVED = {"Generate", "HealthCheck", "Abort", "GetModelInfo", "GetServerInfo", "GetLoads", "GetTokenizer"}


@pytest.fixture
async def address() -> AsyncIterator[str]:
    impl = ColocatedServer(reference_engine(load_topology("colocated")), chunk_tokens=64)
    server = await start_server([colocated_service(impl, argparse.Namespace(served_model_name="m"), Drain())], what="test colocated")
    try:
        yield server.address
    finally:
        await server.stop(0)
        await impl.close()


def statuses(address: str, body: bytes) -> dict[str, tuple[grpc.StatusCode, str]]:
    """Each method's status and details for ``body``."""
    out = {}
    with grpc.insecure_channel(address) as channel:
        for m in SERVICE.methods:
            path = f"/{SERVICE.full_name}/{m.name}"
            try:
                if m.server_streaming:
                    for _ in channel.unary_stream(path)(body, timeout=10):
                        pass
                else:
                    channel.unary_unary(path)(body, timeout=10)
                out[m.name] = (grpc.StatusCode.OK, "")
            except grpc.RpcError as exc:
                out[m.name] = (exc.code(), exc.details() or "")
    return out


async def test_undecodable_requests_are_invalid_argument_naming_the_message(address: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    got = await asyncio.to_thread(statuses, address, b"\x00")
    for m in SERVICE.methods:
        code, details = got[m.name]
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (m.name, code, details)
        assert m.input_type.full_name in details, (m.name, details)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


async def test_methods_pdgrpc_does_not_serve_are_unimplemented_naming_the_method(address: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    got = await asyncio.to_thread(statuses, address, b"")
    for m in SERVICE.methods:
        if m.name in SERVED:
            continue
        code, details = got[m.name]
        assert code is grpc.StatusCode.UNIMPLEMENTED, (m.name, code, details)
        assert m.name in details, (m.name, details)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


async def test_fuzzed_requests_never_crash_the_facade(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(fuzz_messages.SERVICES, SERVICE.full_name, SERVICE)

    def run() -> None:
        with grpc.insecure_channel(address) as channel:
            fuzz_messages.fuzz(channel, [SERVICE.full_name], max_examples=60)

    await asyncio.to_thread(run)
