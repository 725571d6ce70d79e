"""The launcher's client certificate is a client certificate only: whoever holds
``client.pem`` can call the cluster, but cannot serve as one of its processes (a decode,
a router or a client dialing it refuses the TLS handshake), while a process's own
certificate serves as before. Real gRPC servers and channels on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.cluster.credentials import CLIENT, ClusterCredentials
from pdgrpc.rpc.security import Security
from pdgrpc.rpc.server import start_server


async def _health(server_security: Security, caller: Security) -> grpc.StatusCode:
    server = await start_server([], security=server_security)
    try:
        async with caller.channel(server.address) as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK
    finally:
        await server.stop(0)


async def test_client_pem_cannot_serve_but_a_process_certificate_can(tmp_path: Path) -> None:
    creds = ClusterCredentials(tmp_path, {"decode": "decode"}, tls=True, token=False)
    as_process = Security(cert=creds.certs["decode"].cert, key=creds.certs["decode"].key, ca=creds.ca)
    as_client = creds.client
    assert creds.client.cert == creds.certs[CLIENT].cert
    assert await _health(as_process, as_client) is grpc.StatusCode.OK  # the client calls a real process
    # A server presenting client.pem: whoever dials it refuses the TLS handshake.
    posing = Security(cert=as_client.cert, key=as_client.key, ca=creds.ca)
    assert await _health(posing, as_process) is grpc.StatusCode.UNAVAILABLE
