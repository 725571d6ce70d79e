"""``python -m pdgrpc.router`` as a process: flags, health, and graceful SIGTERM.

The upstreams are the scripted servers of ``test_router.py``, in this process; the router
is a real subprocess on a real port.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.scrape import scrape
from pdgrpc.rpc.server import start_server
from pdgrpc.v1 import generate_pb2, generate_pb2_grpc

from tests.router.test_router import ScriptedDecode, ScriptedPrefill, serve_decode, serve_prefill

pytestmark = pytest.mark.timeout(90)


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "pdgrpc.router", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--prefill", "--decode", "--host", "--port", "--request-timeout", "--grace", "--log-level", "--metrics-port", "--metrics-host",
                 "--retries", "--eject-s"):
        assert flag in out.stdout
    assert "bootstrap=HOST:PORT" in out.stdout


def test_missing_backends_are_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "pdgrpc.router", "--decode", "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "at least one --prefill" in out.stderr
    out = subprocess.run([sys.executable, "-m", "pdgrpc.router", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2",
                          "--eject-s", "-5"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--eject-s must be between 0 and 3600 seconds, got -5.0" in out.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be >= 1, got 0"),
        (["--max-prompt-tokens", "-3"], "--max-prompt-tokens must be >= 1, got -3"),
        (["--retries", "-1"], "argument --retries: must be >= 0, got -1"),
        (["--cache-aware-margin", "-1"], "--cache-aware-margin must be >= 0, got -1"),
        (["--local-prefill-tokens", "-1"], "--local-prefill-tokens must be >= 0, got -1"),
        (["--local-prefill-queue", "-1"], "--local-prefill-queue must be >= 0, got -1"),
        (["--migration-limit", "-1"], "--migration-limit must be >= 0, got -1"),
        (["--migration-max-seq-len", "-1"], "--migration-max-seq-len must be >= 0, got -1"),
        (["--request-timeout", "0"], "argument --request-timeout: must be a finite number of seconds > 0, got 0"),
        # Taken, a deadline of inf fails every call at once with DEADLINE_EXCEEDED.
        (["--request-timeout", "inf"], "argument --request-timeout: must be a finite number of seconds > 0, got inf"),
        (["--request-timeout", "nan"], "argument --request-timeout: must be a finite number of seconds > 0, got nan"),
    ],
)
def test_a_count_below_its_least_is_a_usage_error_naming_the_flag(flags: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "pdgrpc.router", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--port", "0", *flags]
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"python -m pdgrpc.router: error: {message}" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


# A bare IPv6 address reads as HOST:PORT at its last colon: taken, "::1" is port 1 of "::".
BARE_IPV6 = [
    (["--prefill", "::1", "--decode", "127.0.0.1:2"], "--prefill: '::1' is not HOST:PORT (an IPv6 host goes in brackets: [::1]:PORT)"),
    (["--prefill", "127.0.0.1:1", "--decode", "::1:8000"], "--decode: '::1:8000' is not HOST:PORT (an IPv6 host goes in brackets: [::1]:PORT)"),
    (["--prefill", "127.0.0.1:1,bootstrap=fe80::1", "--decode", "127.0.0.1:2"],
     "--prefill bootstrap=: 'fe80::1' is not HOST:PORT (an IPv6 host goes in brackets: [::1]:PORT)"),
]


@pytest.mark.parametrize("flags, message", BARE_IPV6, ids=[" ".join(f) for f, _ in BARE_IPV6])
def test_an_ipv6_address_without_brackets_is_refused(flags: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "pdgrpc.router", "--port", "0", *flags]
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"python -m pdgrpc.router: error: {message}" in out.stderr, out.stderr[-3000:]


def test_a_metrics_port_in_use_names_the_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "pdgrpc.router", "--insecure", "--port", "0", "--prefill", "127.0.0.1:1",
               "--decode", "127.0.0.1:2", "--metrics-port", str(port)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr[-2000:]  # as a taken --port: the flags are right, the port is not free
    assert f"--metrics-port {port} --metrics-host 127.0.0.1: cannot listen on http://127.0.0.1:{port}: Address already in use" in out.stderr
    assert "Traceback" not in out.stderr


async def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0():
    prefill, decode = ScriptedPrefill(), ScriptedDecode()
    decode.messages = [[104 + i] for i in range(10)]
    decode.gap = 0.1
    p_srv, d_srv = await serve_prefill(prefill), await serve_decode(decode)
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


def test_the_router_does_not_import_torch():
    # A fresh interpreter runs the entry point as `python -m` does and builds everything
    # the router holds (servicer, metrics with the abort vocabulary): torch stays out, so
    # the router starts in well under a second instead of the seconds torch takes.
    code = (
        "import runpy, sys\n"
        "sys.argv = ['pdgrpc.router', '--help']\n"
        "try:\n    runpy.run_module('pdgrpc.router', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "from pdgrpc.router.service import GenerateServicer, RouterConfig, PrefillBackend\n"
        "from pdgrpc.metrics import RouterMetrics\n"
        "m = RouterMetrics()\n"
        "GenerateServicer(RouterConfig((PrefillBackend('127.0.0.1:1', '127.0.0.1:1'),), ('127.0.0.1:2',)), metrics=m)\n"
        "import os\n"
        "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.')))\n"
        "print(os.environ.get('GRPC_EXPERIMENTS'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    torch_modules, experiments = out.stdout.strip().splitlines()[-2:]
    assert torch_modules == "[]"
    # apply_grpc_defaults ran before grpc was imported (it gives up once grpc is loaded).
    assert experiments == "-event_engine_client,-event_engine_listener"


async def test_metrics_endpoint_of_the_router_process():
    prefill, decode = ScriptedPrefill(), ScriptedDecode()
    p_srv, d_srv = await serve_prefill(prefill), await serve_decode(decode)
    router = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdgrpc.router", "--port", "0", "--prefill", p_srv.address, "--decode", d_srv.address,
        "--metrics-port", "0", stderr=asyncio.subprocess.PIPE,
    )
    try:
        address = await _listening_address(router)
        metrics = await _listening_address(router, pattern=r"pdgrpc router metrics on http://(\S+:\d+)/metrics")
        async with grpc.aio.insecure_channel(address) as ch:
            stub = generate_pb2_grpc.GenerateServiceStub(ch)
            for _ in range(2):
                assert [m async for m in stub.Generate(generate_pb2.GenerateRequest(prompt="x"))]
        s = await asyncio.to_thread(scrape, metrics)
        assert s.value("pdgrpc_time_to_first_token_seconds_count", role="router") == 2
        assert s.value("pdgrpc_requests_total", role="router", state="finished") == 2
        assert s.value("pdgrpc_output_tokens_total", role="router") == 4  # ScriptedDecode: 2 tokens each
        assert s.value("pdgrpc_active_requests", role="router") == 0
        # The running router never loaded torch's library either.
        with open(f"/proc/{router.pid}/maps") as f:
            assert "libtorch" not in f.read()
    finally:
        if router.returncode is None:
            router.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(router.wait(), 15) == 0
        await p_srv.stop(0)
        await d_srv.stop(0)


async def _listening_address(proc: asyncio.subprocess.Process, timeout: float = 60, pattern: str = r"listening on (\S+)") -> str:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = (await asyncio.wait_for(proc.stderr.readline(), max(0.1, deadline - time.monotonic()))).decode()
        if not line:
            break
        m = re.search(pattern, line)
        if m:
            return m.group(1)
    raise AssertionError(f"the router never logged {pattern!r}")
