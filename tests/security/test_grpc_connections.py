"""A flood of gRPC connections cannot use up a server's file descriptors.

A real ``python -m pdgrpc.bootstrap`` allowed 256 descriptors: 400 connections that
finish the HTTP/2 preface and then sit idle leave it under its descriptor limit (gRPC
closes the ones past its cap at once), a client connected before the flood is still
served, and a new client connects once the flood ends. grpc python has no cap per
address, so the cap is per server: it keeps the process working (its data plane, its
files, the cluster's established channels), not new connections during a flood.
"""

from __future__ import annotations

import os
import resource
import socket
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.prefill.procs import BootstrapProc

pytestmark = pytest.mark.timeout(90)
FD_LIMIT = 256
FLOOD = 400
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # and an empty SETTINGS


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


async def _serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_connection_flood_leaves_the_server_its_descriptors(tmp_path: Path) -> None:
    bootstrap = BootstrapProc(tmp_path, preexec_fn=_limit_fds)
    flood: list[socket.socket] = []
    try:
        address = bootstrap.address
        host, port = address.rsplit(":", 1)
        async with grpc.aio.insecure_channel(address) as established:
            stub = health_pb2_grpc.HealthStub(established)
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == health_pb2.HealthCheckResponse.SERVING
            most = 0
            for _ in range(FLOOD):
                s = socket.create_connection((host, int(port)), timeout=10)
                flood.append(s)
                s.sendall(PREFACE)
                most = max(most, len(os.listdir(f"/proc/{bootstrap.pid}/fd")))
            most = max(most, len(os.listdir(f"/proc/{bootstrap.pid}/fd")))
            print(f"{FLOOD} connections: the bootstrap held at most {most} descriptors (limit {FD_LIMIT})")
            assert most < FD_LIMIT - 16, most
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)  # served meanwhile
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for s in flood:
            s.close()
        flood.clear()
        assert await _serving(address)  # a new client, once the flood ended
        assert bootstrap.proc.poll() is None
    finally:
        for s in flood:
            s.close()
        bootstrap.stop()
