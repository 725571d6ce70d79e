"""TLS, mTLS and the bearer token on real gRPC servers on real ports (issue 16).

The legitimate client gets through; a plaintext client, a client whose certificate comes
from another CA, and a client without the token are refused (the TLS handshake fails:
UNAVAILABLE; or UNAUTHENTICATED), and a registration cannot take over a worker slot.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.bootstrap.registry import WorkerRegistry
from pdgrpc.bootstrap.service import SERVICE_NAME, BootstrapServicer, add_bootstrap_servicer
from pdgrpc.bootstrap.table import RoomTable
from pdgrpc.errors import ConfigError
from pdgrpc.rpc.certs import CertFiles, issue, make_ca, write_token
from pdgrpc.rpc.security import Security
from pdgrpc.rpc.server import RpcServer, start_server
from pdgrpc.v1 import bootstrap_pb2 as pb
from pdgrpc.v1 import bootstrap_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)


class Pki:
    def __init__(self, root: Path) -> None:
        self.ca = make_ca(root / "ca")
        self.server = issue(self.ca, root / "ca", "bootstrap")
        self.worker = issue(self.ca, root / "ca", "prefill")
        self.other = issue(self.ca, root / "ca", "intruder")  # same CA, another identity
        self.rogue = issue(make_ca(root / "rogue"), root / "rogue", "prefill")  # another CA
        self.token = write_token(root / "token")
        self.wrong_token = write_token(root / "wrong-token")

    def client(self, cert: CertFiles | None, token: Path | None = None) -> Security:
        return Security(cert=None if cert is None else cert.cert, key=None if cert is None else cert.key, ca=self.ca.cert, token_file=token)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


async def bootstrap(security: Security) -> RpcServer:
    servicer = BootstrapServicer(RoomTable(), WorkerRegistry(), owners=security.authenticated)
    return await start_server(
        [(SERVICE_NAME, lambda s: add_bootstrap_servicer(servicer, s))], host="127.0.0.1", port=0, security=security
    )


INFO = pb.ParallelInfo(tp_size=1, dp_size=1, pp_size=1, page_size=16, load_balance_method=pb.LOAD_BALANCE_METHOD_ROUND_ROBIN)


def register(address: str) -> pb.RegisterWorkerRequest:
    return pb.RegisterWorkerRequest(worker=pb.WorkerInfo(transfer_address=address, transport="tcp"), parallel_info=INFO)


async def call(security: Security | None, target: str, address: str = "127.0.0.1:1") -> pb.RegisterWorkerResponse:
    channel = grpc.aio.insecure_channel(target) if security is None else security.channel(target)
    async with channel:
        return await pb_grpc.BootstrapServiceStub(channel).RegisterWorker(register(address), timeout=5)


async def code_of(security: Security | None, target: str, address: str = "127.0.0.1:1") -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await call(security, target, address)
    return ei.value.code()


async def test_mtls_with_token_lets_in_only_the_cluster(pki: Pki) -> None:
    server = await bootstrap(Security(cert=pki.server.cert, key=pki.server.key, ca=pki.ca.cert, token_file=pki.token))
    try:
        target = server.address
        assert await code_of(None, target) is grpc.StatusCode.UNAVAILABLE  # plaintext: no TLS handshake
        assert await code_of(pki.client(pki.rogue, pki.token), target) is grpc.StatusCode.UNAVAILABLE  # another CA
        assert await code_of(pki.client(None, pki.token), target) is grpc.StatusCode.UNAVAILABLE  # no client certificate
        assert await code_of(pki.client(pki.worker), target) is grpc.StatusCode.UNAUTHENTICATED  # no token
        assert await code_of(pki.client(pki.worker, pki.wrong_token), target) is grpc.StatusCode.UNAUTHENTICATED
        ok = await call(pki.client(pki.worker, pki.token), target)
        assert (ok.generation, ok.registered_workers) == (1, 1)
        # Health stays open to probes that carry no token (still over mTLS).
        async with pki.client(pki.worker).channel(target) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


async def test_token_without_tls(pki: Pki) -> None:
    server = await bootstrap(Security(token_file=pki.token))
    try:
        target = server.address
        assert await code_of(None, target) is grpc.StatusCode.UNAUTHENTICATED
        assert await code_of(Security(token_file=pki.wrong_token), target) is grpc.StatusCode.UNAUTHENTICATED
        async with grpc.aio.insecure_channel(target) as ch:  # GetWorkers too: nothing is open without it
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await pb_grpc.BootstrapServiceStub(ch).GetWorkers(pb.GetWorkersRequest(), timeout=5)
        assert ei.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert (await call(Security(token_file=pki.token), target)).generation == 1
    finally:
        await server.stop(0)


async def test_register_worker_cannot_take_over_a_slot(pki: Pki) -> None:
    """Audit: RegisterWorker with the same topology and another address was accepted as a
    new generation, and requests then went to the attacker's prefill."""
    server = await bootstrap(Security(cert=pki.server.cert, key=pki.server.key, ca=pki.ca.cert))
    try:
        target, real, fake = server.address, "127.0.0.1:5001", "127.0.0.1:6666"
        assert (await call(pki.client(pki.worker), target, real)).generation == 1
        assert await code_of(pki.client(pki.other), target, fake) is grpc.StatusCode.PERMISSION_DENIED
        assert await code_of(None, target, fake) is grpc.StatusCode.UNAVAILABLE
        async with pki.client(pki.worker).channel(target) as ch:
            reply = await pb_grpc.BootstrapServiceStub(ch).GetWorkers(pb.GetWorkersRequest(dp_rank=0), timeout=5)
        assert [w.transfer_address for w in reply.workers] == [real]
        # The identity that registered the slot may register it again (a restart).
        assert (await call(pki.client(pki.worker), target, "127.0.0.1:5002")).generation == 2
    finally:
        await server.stop(0)


async def test_non_loopback_listener_needs_tls_or_a_token(pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="--insecure"):
        await start_server([], host="0.0.0.0", port=0, security=Security())
    with caplog.at_level(logging.WARNING, logger="pdgrpc.rpc.security"):
        server = await start_server([], host="0.0.0.0", port=0, security=Security(insecure=True))
    await server.stop(0)
    assert "--insecure" in caplog.text and "anyone who can reach it" in caplog.text
    server = await start_server([], host="0.0.0.0", port=0, security=Security(token_file=pki.token))
    await server.stop(0)


def test_bootstrap_cli_refuses_an_open_non_loopback_port() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdgrpc.bootstrap", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "refusing to listen on '0.0.0.0' without TLS or a token" in proc.stderr


def test_bad_security_flags_are_named(tmp_path: Path) -> None:
    import argparse

    from pdgrpc.cluster.topology import parse_topology
    from pdgrpc.rpc.security import add_security_arguments, security_from_args

    p = argparse.ArgumentParser()
    add_security_arguments(p)
    with pytest.raises(ConfigError, match="--tls-cert and --tls-key go together"):
        security_from_args(p.parse_args(["--tls-cert", str(tmp_path / "c.pem")]))
    with pytest.raises(ConfigError, match="--tls-ca needs --tls-cert and --tls-key"):
        security_from_args(p.parse_args(["--tls-ca", str(tmp_path / "ca.pem")]))
    missing = tmp_path / "nope.pem"
    with pytest.raises(ConfigError, match=f"--tls-cert: cannot read '{missing}'"):
        security_from_args(p.parse_args(["--tls-cert", str(missing), "--tls-key", str(missing)]))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="--auth-token-file .* is empty"):
        security_from_args(p.parse_args(["--auth-token-file", str(tmp_path / "empty")]))
    process = [{"name": "r", "role": "colocated"}]
    with pytest.raises(ConfigError, match=r"\[security\] tls must be one of \('off', 'auto'\), got 'yes'"):
        parse_topology({"process": process, "security": {"tls": "yes"}}, "t")
    assert parse_topology({"process": process, "security": {"tls": "auto", "auth-token": "auto"}}, "t").tls == "auto"


def test_topology_security_files_go_to_every_process(pki: Pki, tmp_path: Path) -> None:
    from pdgrpc.cluster import Cluster
    from pdgrpc.cluster.topology import parse_topology
    from pdgrpc.errors import ConfigError as Bad

    table = {
        "tls-cert": str(pki.worker.cert), "tls-key": str(pki.worker.key), "tls-ca": str(pki.ca.cert),
        "auth-token-file": str(pki.token),
    }
    procs = [{"name": "d", "role": "decode"}, {"name": "p", "role": "prefill"},
             {"name": "r", "role": "router", "prefill": ["p"], "decode": ["d"]}]
    topology = parse_topology({"process": procs, "security": table}, "t", tmp_path / "t.toml")
    cluster = Cluster(topology, transport="fake", log_dir=tmp_path / "run")
    for proc in cluster.procs.values():
        argv = " ".join(proc.argv)
        assert f"--tls-cert {pki.worker.cert} --tls-key {pki.worker.key} --tls-ca {pki.ca.cert} --auth-token-file {pki.token}" in argv
    c = cluster.client_security
    assert (c.cert, c.key, c.ca, c.token_file) == (pki.worker.cert, pki.worker.key, pki.ca.cert, pki.token)
    with pytest.raises(Bad, match="tls-cert and tls-key go together"):
        parse_topology({"process": procs, "security": {"tls-cert": "a.pem"}}, "t")
    with pytest.raises(Bad, match='tls = "auto" makes its own certificates'):
        parse_topology({"process": procs, "security": {"tls": "auto", "tls-ca": "ca.pem"}}, "t")


async def test_token_is_checked_on_every_kind_of_call_before_its_request_is_read(pki: Pki) -> None:
    """The token check wraps each handler (issue 19: no per-call interceptor): unary,
    streaming, synchronous and reflection calls without the token end UNAUTHENTICATED
    without running the handler, even when their bytes do not parse; health stays open."""
    ran: list[str] = []

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        ran.append("unary")
        return request

    async def server_stream(request: bytes, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        ran.append("server stream")
        yield request

    async def bidi(requests, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        ran.append("bidi")
        async for r in requests:
            yield r

    def sync_unary(request: pb.GetWorkersRequest, context: grpc.ServicerContext) -> pb.GetWorkersRequest:
        ran.append("sync")
        return request

    parse, out = pb.GetWorkersRequest.FromString, pb.GetWorkersRequest.SerializeToString
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, parse, out),
        "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream, parse, out),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi, parse, out),
        "Sync": grpc.unary_unary_rpc_method_handler(sync_unary, parse, out),
    }
    add = lambda s: s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Kinds", handlers),))  # noqa: E731
    server = await start_server([("test.Kinds", add)], host="127.0.0.1", port=0, security=Security(token_file=pki.token))
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def codes(security: Security | None, payload: bytes) -> dict[str, grpc.StatusCode]:
        got = {}
        channel = grpc.aio.insecure_channel(server.address) if security is None else security.channel(server.address)
        async with channel:
            calls = {
                "Unary": lambda: channel.unary_unary("/test.Kinds/Unary")(payload, timeout=5),
                "Sync": lambda: channel.unary_unary("/test.Kinds/Sync")(payload, timeout=5),
                "ServerStream": lambda: _drain(channel.unary_stream("/test.Kinds/ServerStream")(payload, timeout=5)),
                "Bidi": lambda: _drain(channel.stream_stream("/test.Kinds/Bidi")(iter([payload]), timeout=5)),
                "reflection": lambda: _drain(
                    reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
                ),
            }
            for name, start in calls.items():
                try:
                    await start()
                    got[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    got[name] = exc.code()
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        return got

    try:
        garbage = b"\xff\xff\xff"  # not a GetWorkersRequest
        valid = pb.GetWorkersRequest(dp_rank=1).SerializeToString()
        for security in (None, Security(token_file=pki.wrong_token)):
            for payload in (valid, garbage):
                assert set((await codes(security, payload)).values()) == {grpc.StatusCode.UNAUTHENTICATED}
        assert ran == []
        assert set((await codes(Security(token_file=pki.token), valid)).values()) == {grpc.StatusCode.OK}
        assert sorted(ran) == ["bidi", "server stream", "sync", "unary"]
        got = await codes(Security(token_file=pki.token), garbage)
        assert got["Unary"] is got["ServerStream"] is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop(0)


async def _drain(call: object) -> None:
    async for _ in call:  # type: ignore[attr-defined]
        pass
