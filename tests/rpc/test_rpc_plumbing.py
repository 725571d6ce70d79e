"""pdgrpc.rpc: server start/stop with health and reflection, signals, channel pool,
error mapping, gRPC settings."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.errors import PdgrpcError
from pdgrpc.rpc import errors as rpc_errors
from pdgrpc.rpc.channels import ROUTER_CLIENT_OPTIONS, ChannelPool
from pdgrpc.rpc.server import StopSignal, loop_name, run, serve_until_signal, start_server
from tests.eventually import eventually_async

SLOW = "test.v1.SlowService"


def slow_service(started: asyncio.Event) -> Any:
    async def sleep(request: bytes, context: Any) -> bytes:
        started.set()
        await asyncio.sleep(0.5)
        return b"done"

    handler = grpc.method_handlers_generic_handler(SLOW, {"Sleep": grpc.unary_unary_rpc_method_handler(sleep)})
    return lambda server: server.add_generic_rpc_handlers((handler,))


async def test_a_serving_process_never_scans_what_start_up_built_again() -> None:
    # A full collection over the modules' objects (torch's alone are about 200k) stalls
    # the loop for a long time; frozen, a collection scans only what requests made.
    gc.unfreeze()
    server = await start_server([], host="127.0.0.1", port=0)
    serving = asyncio.ensure_future(serve_until_signal(server, stop=StopSignal()))
    try:
        await asyncio.sleep(0)
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
        await server.stop(grace=0)
        await serving


async def test_server_serves_health_logs_address_and_stops_gracefully(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdgrpc.rpc")
    started = asyncio.Event()
    server = await start_server([(SLOW, slow_service(started))], host="127.0.0.1", port=0, what="test server")
    assert re.search(rf"test server listening on 127\.0\.0\.1:{server.port} \(grpc\.aio on \w+", caplog.text)
    pool = ChannelPool()
    try:
        channel = pool.get(server.address)
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SLOW):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        call = channel.unary_unary(f"/{SLOW}/Sleep")(b"", timeout=5)
        await started.wait()
        await server.stop(grace=5.0)  # the call in flight finishes within the grace period
        assert await call == b"done"
        with pytest.raises(grpc.RpcError) as e:
            await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await pool.close()


async def test_a_second_server_on_a_taken_port_fails_to_bind_instead_of_sharing_it() -> None:
    # With gRPC's default SO_REUSEPORT both would bind and the kernel would split new
    # connections between them: clients of one would get UNIMPLEMENTED from the other.
    first = await start_server([(SLOW, slow_service(asyncio.Event()))], host="127.0.0.1", port=0, what="first")
    try:
        with pytest.raises(OSError, match=rf"second: cannot bind 127\.0\.0\.1:{first.port}"):
            await start_server([], host="127.0.0.1", port=first.port, what="second")
    finally:
        await first.stop(grace=0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_process_stops_gracefully_on_signal(signum: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdgrpc.bootstrap", "--host", "127.0.0.1", "--port", "0", "--grace", "2"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert re.search(r"pdgrpc bootstrap listening on 127\.0\.0\.1:\d+ \(grpc\.aio on uvloop", line), line
        t0 = time.monotonic()
        proc.send_signal(signum)
        rest = proc.stderr.read()
        assert proc.wait(10) == 0
        assert time.monotonic() - t0 < 5
        assert f"{signal.Signals(signum).name} received, stopping" in rest and "stopped:" in rest
    finally:
        proc.kill()


def test_run_uses_uvloop() -> None:
    async def which() -> str:
        return loop_name()

    assert run(which()) == "uvloop"


async def test_channel_pool_reuses_and_discards() -> None:
    pool = ChannelPool()
    a = pool.get("127.0.0.1:1")
    assert pool.get("127.0.0.1:1") is a and "127.0.0.1:1" in pool
    b = pool.get("127.0.0.1:2")
    assert b is not a and len(pool) == 2 and pool.created == 2
    await pool.discard("127.0.0.1:1")
    assert "127.0.0.1:1" not in pool and pool.get("127.0.0.1:1") is not a
    await pool.close()
    assert len(pool) == 0


async def test_channel_pool_keeps_at_most_max_channels_closing_the_least_recently_used() -> None:
    """A decode dials the addresses its callers name (prefill_bootstrap_address) and those
    their bootstraps list; each distinct one used to keep a channel for good, so a caller
    cycling through addresses grew the process without bound."""
    pool = ChannelPool(max_channels=3)
    kept = pool.get("127.0.0.1:1")
    evicted = pool.get("127.0.0.1:2")
    for port in range(3, 50):
        pool.get(f"127.0.0.1:{port}")
        assert pool.get("127.0.0.1:1") is kept  # used all along: never the one closed
    assert len(pool) == 3 and "127.0.0.1:2" not in pool and "127.0.0.1:49" in pool
    await eventually_async(
        lambda: evicted.get_state() == grpc.ChannelConnectivity.SHUTDOWN or None, 5.0, 0.01, "the evicted channel was never closed"
    )
    assert kept.get_state() != grpc.ChannelConnectivity.SHUTDOWN
    assert pool.get("127.0.0.1:2") is not evicted and pool.created == 50
    await pool.close()
    assert kept.get_state() == grpc.ChannelConnectivity.SHUTDOWN and len(pool) == 0
    with pytest.raises(ValueError, match="max_channels"):
        ChannelPool(max_channels=0)


def gated_service(release: asyncio.Event, started: asyncio.Event) -> Any:
    async def wait(request: bytes, context: Any) -> bytes:
        started.set()
        await release.wait()
        return b"done"

    handler = grpc.method_handlers_generic_handler(SLOW, {"Wait": grpc.unary_unary_rpc_method_handler(wait)})
    return lambda server: server.add_generic_rpc_handlers((handler,))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_server_back_on_its_port_is_reached_by_the_very_next_call() -> None:
    """A channel whose connection failed waits out a reconnect backoff (up to 2 s) and
    fails calls meanwhile, even once its server is back: a process restarted on its port
    (a rolling restart) would fail its first requests. The pool hands out a fresh channel
    instead of one in TRANSIENT_FAILURE."""
    address = f"127.0.0.1:{free_port()}"
    pool = ChannelPool()
    try:
        for _ in range(3):  # down: each call fails, and the channel's backoff grows
            with pytest.raises(grpc.RpcError) as err:
                await pool.get(address).unary_unary(f"/{SLOW}/Sleep")(b"", timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await asyncio.sleep(1.0)
        server = await start_server([(SLOW, slow_service(asyncio.Event()))], host="127.0.0.1", port=int(address.split(":")[1]))
        try:
            assert await pool.get(address).unary_unary(f"/{SLOW}/Sleep")(b"", timeout=5) == b"done"
        finally:
            await server.stop(grace=0)
    finally:
        await pool.close()


async def test_a_host_that_drops_connection_attempts_fails_calls_fast() -> None:
    """The pool replaces a channel whose connection failed, so each call to a host that is
    down makes a fresh connection attempt: its timeout (grpc.min_reconnect_backoff_ms),
    not gRPC's default 20 s, is what a router's request waits before it goes elsewhere.
    A listener whose accept queue is full drops connection attempts as such a host does."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = [socket.socket() for _ in range(4)]
        try:
            for f in fillers:
                f.setblocking(False)
                try:
                    f.connect(("127.0.0.1", port))
                except BlockingIOError:
                    pass
            pool = ChannelPool()
            try:
                for _ in range(3):
                    t0 = time.monotonic()
                    with pytest.raises(grpc.RpcError) as err:
                        await pool.get(f"127.0.0.1:{port}").unary_unary(f"/{SLOW}/Sleep")(b"", timeout=30)
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() - t0 < 2.0
            finally:
                await pool.close()
        finally:
            for f in fillers:
                f.close()

async def test_a_call_in_flight_on_a_replaced_channel_still_finishes() -> None:
    """A server stopping gracefully (a drain) finishes the calls it runs while refusing
    new connections: the client's channel then reads TRANSIENT_FAILURE with those calls
    still running on it. The pool replaces that channel, and the calls still finish."""
    release, started = asyncio.Event(), asyncio.Event()
    server = await start_server([(SLOW, gated_service(release, started))], host="127.0.0.1", port=0)
    pool = ChannelPool()
    try:
        old = pool.get(server.address)
        call = old.unary_unary(f"/{SLOW}/Wait")(b"", timeout=30)
        await started.wait()
        stopping = asyncio.ensure_future(server.stop(grace=30))
        # New calls find the listener closed: the channel goes to TRANSIENT_FAILURE.
        await eventually_async(
            lambda: old.get_state(try_to_connect=True) == grpc.ChannelConnectivity.TRANSIENT_FAILURE or None,
            10.0, 0.05, "the channel never saw its connection refused",
        )
        new = pool.get(server.address)
        assert new is not old and pool.get(server.address) is new
        await asyncio.sleep(0.2)
        release.set()
        assert await call == b"done"
        await stopping
    finally:
        release.set()
        await pool.close()


async def test_a_router_client_rides_through_refusals_and_a_restart() -> None:
    """ROUTER_CLIENT_OPTIONS: a Generate the router refuses UNAVAILABLE before any reply
    (it drains) goes again, and one sent while nothing listens on the router's port waits
    for the new process, within the call's deadline; a plain channel fails both."""
    from pdgrpc.v1 import generate_pb2, generate_pb2_grpc

    class Router(generate_pb2_grpc.GenerateServiceServicer):
        def __init__(self, refuse: int) -> None:
            self.refuse = refuse
            self.calls = 0

        async def Generate(self, request: Any, context: Any) -> Any:
            self.calls += 1
            if self.calls <= self.refuse:  # draining, then stopping under a call it took in
                code = grpc.StatusCode.UNAVAILABLE if self.calls < self.refuse else grpc.StatusCode.CANCELLED
                await context.abort(code, "Generate: this server is draining")
            yield generate_pb2.GenerateResponse(token_ids=[7], finish_reason="length")

    def serve(router: Router, port: int = 0) -> Any:
        return start_server(
            [("pdgrpc.v1.GenerateService", lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(router, s))],
            host="127.0.0.1", port=port,
        )

    draining = Router(refuse=2)
    server = await serve(draining)
    address = server.address
    plain, riding = grpc.aio.insecure_channel(address), grpc.aio.insecure_channel(address, options=ROUTER_CLIENT_OPTIONS)
    try:
        with pytest.raises(grpc.RpcError) as err:
            [m async for m in generate_pb2_grpc.GenerateServiceStub(plain).Generate(generate_pb2.GenerateRequest(), timeout=10)]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        draining.calls = 0
        out = [m async for m in generate_pb2_grpc.GenerateServiceStub(riding).Generate(generate_pb2.GenerateRequest(), timeout=10)]
        assert [list(m.token_ids) for m in out] == [[7]] and draining.calls == 3
        await server.stop(0)  # restarting: nothing listens for a while
        call = generate_pb2_grpc.GenerateServiceStub(riding).Generate(generate_pb2.GenerateRequest(), timeout=10)
        got = asyncio.ensure_future(call.read())
        await asyncio.sleep(1.0)
        assert not got.done()
        server = await serve(Router(refuse=0), port=int(address.rsplit(":", 1)[1]))
        assert list((await got).token_ids) == [7]
    finally:
        await plain.close()
        await riding.close()
        await server.stop(0)

class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.UNAVAILABLE, rpc_errors.Unavailable),
        (grpc.StatusCode.INVALID_ARGUMENT, rpc_errors.RpcError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, rpc_errors.RpcError),
        (grpc.StatusCode.INTERNAL, rpc_errors.RpcError),
    ],
)
def test_grpc_errors_map_into_the_pdgrpc_tree(code: grpc.StatusCode, cls: type) -> None:
    err = rpc_errors.map_rpc_error(FakeRpcError(code, "why"), method="M", target="h:1")
    assert type(err) is cls and isinstance(err, PdgrpcError)
    assert (err.code, err.details, err.method, err.target) == (code, "why", "M", "h:1")
    assert str(err) == f"M on h:1: {code.name}: why"


@pytest.mark.parametrize(
    "env, preimport, expect",
    [
        ({}, False, "True -event_engine_client,-event_engine_listener"),
        ({"GRPC_EXPERIMENTS": "custom"}, False, "False custom"),
        ({"GRPC_EXPERIMENTS": ""}, False, "False "),
        ({"PDGRPC_GRPC_DEFAULTS": "0"}, False, "False None"),
        ({}, True, "False None"),  # grpc already imported: too late, leave it alone
    ],
)
def test_grpc_defaults_apply_only_when_the_user_has_not_chosen(env: dict[str, str], preimport: bool, expect: str) -> None:
    code = (
        ("import grpc; " if preimport else "")
        + "import os; from pdgrpc.rpc.tuning import apply_grpc_defaults as a; "
        + "r = a(); print(r, os.environ.get('GRPC_EXPERIMENTS'))"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("GRPC_EXPERIMENTS", "PDGRPC_GRPC_DEFAULTS")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expect.strip()


def test_importing_pdgrpc_rpc_and_bootstrap_does_not_import_grpc() -> None:
    code = "import sys, pdgrpc.rpc, pdgrpc.bootstrap, pdgrpc.rpc.tuning; print('grpc' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_router_client_outlasts_20_s_of_refusals() -> None:
    """A router refuses new calls for as long as its longest stream runs while it drains
    (many seconds on a loaded host): a ROUTER_CLIENT_OPTIONS client's five attempts, each
    retry at 80 % of its backoff at the earliest (gRPC's jitter), span 20 s at least."""
    config = json.loads(dict(ROUTER_CLIENT_OPTIONS)["grpc.service_config"])
    (method,) = config["methodConfig"]
    policy = method["retryPolicy"]
    backoff, total = float(policy["initialBackoff"].rstrip("s")), 0.0
    for _ in range(policy["maxAttempts"] - 1):
        total += 0.8 * min(backoff, float(policy["maxBackoff"].rstrip("s")))
        backoff *= policy["backoffMultiplier"]
    assert total >= 20.0, total
    assert method["waitForReady"] is True and "UNAVAILABLE" in policy["retryableStatusCodes"]
