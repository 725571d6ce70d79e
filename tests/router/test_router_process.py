"""``python -m pdgrpc.router`` as a process: flags, health, and graceful SIGTERM.

The upstreams are the scripted servers of ``test_router.py``, in this process; the router
is a real subprocess on a real port.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.rpc.server import start_server
from pdgrpc.v1 import decode_pb2_grpc, generate_pb2, generate_pb2_grpc, prefill_pb2_grpc

from tests.router.test_router import ScriptedDecode, ScriptedPrefill

pytestmark = pytest.mark.timeout(90)


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "pdgrpc.router", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--prefill", "--decode", "--host", "--port", "--request-timeout", "--grace", "--log-level"):
        assert flag in out.stdout
    assert "bootstrap=HOST:PORT" in out.stdout


def test_missing_backends_are_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "pdgrpc.router", "--decode", "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "at least one --prefill" in out.stderr


async def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0():
    prefill, decode = ScriptedPrefill(), ScriptedDecode()
    decode.messages = [[104 + i] for i in range(10)]
    decode.gap = 0.1
    p_srv = await start_server([("p", lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(prefill, s))])
    d_srv = await start_server([("d", lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode, s))])
    router = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdgrpc.router", "--port", "0", "--prefill", p_srv.address, "--decode", d_srv.address,
        "--grace", "10", stderr=asyncio.subprocess.PIPE,
    )
    try:
        address = await _listening_address(router)
        async with grpc.aio.insecure_channel(address) as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            call = stub.Generate(generate_pb2.GenerateRequest(prompt="x"))
            first = await call.read()
            router.send_signal(signal.SIGTERM)
            rest = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                rest.append(msg)
            assert [list(m.token_ids) for m in [first, *rest]] == [[104 + i] for i in range(10)]
            assert rest[-1].finish_reason == "length"
            assert await asyncio.wait_for(router.wait(), 15) == 0
        assert not prefill.cancelled_at and not decode.cancelled_at  # finished, not cut off
    finally:
        if router.returncode is None:
            router.kill()
            await router.wait()
        await p_srv.stop(0)
        await d_srv.stop(0)


async def test_health_is_serving_while_up():
    p_srv = await start_server([("p", lambda s: None)])
    router = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdgrpc.router", "--port", "0", "--prefill", p_srv.address, "--decode", p_srv.address,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        address = await _listening_address(router)
        async with grpc.aio.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "pdgrpc.v1.GenerateService"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        router.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(router.wait(), 15) == 0
        await p_srv.stop(0)


async def _listening_address(proc: asyncio.subprocess.Process, timeout: float = 60) -> str:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = (await asyncio.wait_for(proc.stderr.readline(), max(0.1, deadline - time.monotonic()))).decode()
        if not line:
            break
        m = re.search(r"listening on (\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError("the router never logged its address")
