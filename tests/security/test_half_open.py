"""Half-open connections to a gRPC server are closed within the handshake timeout.

A real ``python -m pdgrpc.bootstrap`` process under mTLS: 64 sockets that connect and then
send nothing (or only the HTTP/2 preface) are closed by the server within
``HANDSHAKE_TIMEOUT_S`` (grpc's own default keeps them 120 s, so a peer could pile them up
into the process's file descriptors), and the cluster's own calls are served meanwhile.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.cluster.credentials import LAUNCHER, ClusterCredentials
from pdgrpc.rpc.server import HANDSHAKE_TIMEOUT_S
from tests.prefill.procs import BootstrapProc

pytestmark = pytest.mark.timeout(90)
SOCKETS = 64


async def test_silent_connections_are_closed_within_the_handshake_timeout(tmp_path: Path) -> None:
    creds = ClusterCredentials(tmp_path / "security", {"bootstrap": "bootstrap"}, tls=True, token=False)
    bootstrap = BootstrapProc(tmp_path, *creds.flags("bootstrap"))
    socks: list[socket.socket] = []
    try:
        host, port = bootstrap.address.rsplit(":", 1)
        began = time.monotonic()
        for i in range(SOCKETS):
            s = socket.create_connection((host, int(port)))
            if i % 2:
                s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # the preface, then nothing
            s.settimeout(HANDSHAKE_TIMEOUT_S + 10)
            socks.append(s)
        async with creds.security(LAUNCHER).channel(f"{host}:{port}") as ch:  # served meanwhile
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for s in socks:
            while s.recv(4096):
                pass  # the TLS alert, if any; then EOF
        took = time.monotonic() - began
        print(f"{SOCKETS} half-open connections closed {took:.1f} s after they opened")
        assert took < HANDSHAKE_TIMEOUT_S + 5
    finally:
        for s in socks:
            s.close()
        bootstrap.stop()
