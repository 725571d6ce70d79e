"""What smg 1.13 presents to its gRPC workers: nothing (why secured workers serve it on a
loopback gateway listener, ``--gateway-listen``).

A real ``smg launch`` given every worker credential it has flags for -- a client
certificate, its key and the workers' CA (``--client-cert-path``, ``--client-key-path``,
``--ca-cert-paths``) and ``--api-key`` -- in front of two stand-in workers on 127.0.0.1
that record each call: one plaintext, one mTLS (``grpcs://``). smg probes the plaintext
one with no ``authorization`` metadata, and never completes a call to the mTLS one.
When this test fails, smg has learnt to present a credential: the launcher should pass
it one instead of the gateway listener (docs/gateway.md, "Security").
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from pdgrpc.cluster.ports import free_port
from pdgrpc.cluster.smg import smg_executable
from pdgrpc.rpc.certs import issue, make_ca
from pdgrpc.rpc.roles import DECODE, GATEWAY
from tests.prefill.procs import Proc

pytestmark = pytest.mark.timeout(90)


class _Recorder(grpc.GenericRpcHandler):
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str | bytes]]] = []

    def service(self, details: grpc.HandlerCallDetails) -> None:
        self.calls.append((details.method, dict(details.invocation_metadata)))
        return None  # UNIMPLEMENTED: smg keeps probing


async def test_smg_presents_no_certificate_and_no_token_to_its_workers(tmp_path: Path) -> None:
    try:
        smg = smg_executable()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    ca = make_ca(tmp_path)
    worker, gateway = issue(ca, tmp_path, "decode", role=DECODE), issue(ca, tmp_path, "smg", role=GATEWAY)
    plain, tls = _Recorder(), _Recorder()
    servers = []
    ports = {}
    for name, recorder in (("plain", plain), ("tls", tls)):
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([recorder])
        ports[name] = free_port(set(ports.values()))
        if name == "plain":
            server.add_insecure_port(f"127.0.0.1:{ports[name]}")
        else:
            creds = grpc.ssl_server_credentials(
                [(worker.key.read_bytes(), worker.cert.read_bytes())], ca.cert.read_bytes(), require_client_auth=True,
            )
            server.add_secure_port(f"127.0.0.1:{ports[name]}", creds)
        await server.start()
        servers.append(server)
    taken = set(ports.values())
    http = free_port(taken)
    metrics = free_port(taken | {http})
    argv = [smg, "launch", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(http), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics),
            "--prefill", f"grpc://127.0.0.1:{ports['plain']}", str(ports["plain"]), "--decode", f"grpcs://127.0.0.1:{ports['tls']}",
            "--client-cert-path", str(gateway.cert), "--client-key-path", str(gateway.key), "--ca-cert-paths", str(ca.cert),
            "--api-key", "the-gateway-token", "--log-level", "warn"]
    smg_proc = Proc(argv, tmp_path, "smg")
    try:
        for _ in range(300):
            if plain.calls:
                break
            assert smg_proc.proc.poll() is None, smg_proc.tail(3000)
            await asyncio.sleep(0.1)
        assert plain.calls, "smg never probed its plaintext worker"
        await asyncio.sleep(3)  # as long again for the mTLS one: smg probes both at once
        assert all("authorization" not in md for _, md in plain.calls), plain.calls
        assert tls.calls == [], tls.calls
        print(f"plaintext worker: {len(plain.calls)} calls, metadata {sorted(plain.calls[0][1])}; mTLS worker: none")
    finally:
        smg_proc.stop()
        for server in servers:
            await server.stop(0)
