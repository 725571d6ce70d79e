"""``python -m pdgrpc.prefill`` as a process: health while its workers start, and the
metrics endpoints of the controller and of each dp worker (scraped over HTTP).

The prefill uses an external bootstrap that is started only once the controller answers
health checks: until then its workers cannot register, so the controller must report
NOT_SERVING (deterministically, not by racing the workers' start-up); once they have
registered it must report SERVING and print its ready line.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.cluster.launcher import free_port, free_port_block
from tests.scrape import scrape

from tests.eventually import eventually_async
from tests.prefill.procs import ENGINE_FLAGS, STARTUP_S, Proc, pid_alive

pytestmark = pytest.mark.timeout(180)

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


async def _status(address: str, service: str = "") -> int | None:
    """The health status, or None while the server does not answer yet."""
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError:
            return None
        return int(reply.status)


async def _wait_status(address: str, want: int, service: str = "") -> None:
    async def reached() -> bool:
        return await _status(address, service) == want

    await eventually_async(reached, STARTUP_S, what=f"health of {service or 'the server'} is {want}", interval=0.1)


async def test_not_serving_until_every_worker_is_ready_then_serving_with_metrics_per_process(tmp_path) -> None:
    port, bootstrap_port = free_port(), free_port()
    metrics_base = free_port_block(3)  # controller, dp0, dp1
    prefill = Proc(
        [
            sys.executable, "-m", "pdgrpc.prefill", "--host", "127.0.0.1", "--port", str(port),
            "--bootstrap", f"127.0.0.1:{bootstrap_port}", "--metrics-port", str(metrics_base),
            *ENGINE_FLAGS, "--transport", "fake", "--dp-size", "2",
        ],
        tmp_path, "prefill",
    )
    bootstrap: Proc | None = None
    worker_pids: list[int] = []
    try:
        address = f"127.0.0.1:{port}"
        # The controller answers at once, but its workers cannot register yet.
        await _wait_status(address, NOT_SERVING)
        assert await _status(address, "pdgrpc.v1.PrefillService") == NOT_SERVING
        assert "PDGRPC_READY" not in prefill.out_path.read_text()
        # Its own endpoint serves already: controller metrics, no live prefill gauges.
        s = scrape(f"127.0.0.1:{metrics_base}")
        assert s.value("pdgrpc_requests_total", role="prefill", state="finished") == 0
        assert not s.has("pdgrpc_kv_pages_in_use")

        bootstrap = Proc(
            [sys.executable, "-m", "pdgrpc.bootstrap", "--host", "127.0.0.1", "--port", str(bootstrap_port)], tmp_path, "bootstrap"
        )
        info = json.loads(prefill.wait_for(r"PDGRPC_READY (\{.*\})").group(1))
        worker_pids = info["worker_pids"]
        assert await _status(address) == SERVING
        assert await _status(address, "pdgrpc.v1.PrefillService") == SERVING

        # Each dp worker serves its own pages on base + 1 + rank.
        for rank in range(2):
            w = scrape(f"127.0.0.1:{metrics_base + 1 + rank}")
            assert w.value("pdgrpc_kv_pages_capacity", role="prefill") == 64  # --num-pages
            assert w.value("pdgrpc_kv_pages_in_use", role="prefill") == 0
            assert w.value("pdgrpc_server_info", role="prefill") == 1
            assert w.has("pdgrpc_server_info", role="prefill", dp_rank=str(rank), dp_size="2", transport="fake")
    finally:
        code = prefill.stop()
        for pid in worker_pids:  # the controller stops them; never leave one behind
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if bootstrap is not None:
            bootstrap.stop()
    assert code == 0, prefill.log()[-3000:]
