"""A cluster started with ``--tls auto --auth-token auto`` serves, and refuses outsiders
(issue 16, "How it is checked: TLS").

Real processes on real ports: bootstrap (embedded), prefill controller and its worker,
decode and router, all over mTLS with the bearer token. The legitimate client (the
cluster's client certificate and the token) gets the same tokens as colocated
generation; a plaintext client, a client whose certificate comes from another CA and a
client without the token are refused at the router, and so are direct Prefill (to the
controller and to the worker), Decode and AbortRoom calls without the token. The router
calls its prefill and decode on their local sockets (pdgrpc.rpc.local) all the same.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.client import generate
from pdgrpc.cluster.reference import reference_engine
from pdgrpc.engine.colocated import generate as colocated_generate
from pdgrpc.rpc.certs import issue, make_ca
from pdgrpc.rpc.security import Security
from pdgrpc.v1 import bootstrap_pb2 as bpb
from pdgrpc.v1 import bootstrap_pb2_grpc as bpb_grpc
from pdgrpc.v1 import common_pb2, decode_pb2, decode_pb2_grpc, handshake_pb2, handshake_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub
from tests.scrape import scrape

pytestmark = pytest.mark.timeout(180)


async def refused(channel: grpc.aio.Channel, rpc: str = "generate", target: str = "") -> grpc.StatusCode:
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            if rpc == "generate":
                await generate(GenerateServiceStub(channel), prompt="hi", max_new_tokens=2, timeout=10)
            elif rpc == "prefill":
                await prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(
                    prefill_pb2.PrefillRequest(bootstrap_room=7, input_ids=[256, 65]), timeout=10
                )
            elif rpc == "decode":
                call = decode_pb2_grpc.DecodeServiceStub(channel).Decode(
                    decode_pb2.DecodeRequest(
                        bootstrap_room=7, input_ids=[256, 65], sampling=common_pb2.SamplingParams(max_new_tokens=2),
                        prefill_bootstrap_address="127.0.0.1:1",
                    ),
                    timeout=10,
                )
                async for _ in call:
                    pass
            else:
                await handshake_pb2_grpc.HandshakeServiceStub(channel).AbortRoom(
                    handshake_pb2.AbortRoomRequest(bootstrap_room=7), timeout=10
                )
    return ei.value.code()


async def test_tls_auto_cluster_serves_and_refuses_outsiders(tmp_path: Path) -> None:
    async with Cluster("1p1d", transport="tcp", tls="auto", auth_token="auto", log_dir=tmp_path / "run", start_timeout=60,
                       metrics=True) as c:
        engine = reference_engine(c.topology)
        async with c.client_channel() as ch:
            done = await generate(GenerateServiceStub(ch), prompt="Secure hello", max_new_tokens=8, timeout=60)
            workers = await bpb_grpc.BootstrapServiceStub(c.channel("prefill", present="decode")).GetWorkers(
                bpb.GetWorkersRequest(dp_rank=0), timeout=10
            )
        (ref,) = colocated_generate(engine, ["Secure hello"], 8)
        assert done.token_ids == ref.token_ids and done.bytes_transferred > 0
        log = (tmp_path / "run" / "router.log").read_text()
        assert "mTLS, bearer token" in log
        # The router called its prefill and decode on their local sockets, as the router role.
        (router_metrics,) = c.metrics_endpoints("router").values()
        calls = scrape(router_metrics)
        assert {(m, p): calls.value("pdgrpc_router_calls_total", method=m, path=p) for m in ("prefill", "decode") for p in ("local", "grpc")} == {
            ("prefill", "local"): 1, ("decode", "local"): 1, ("prefill", "grpc"): 0, ("decode", "grpc"): 0}

        sec = c.client_security
        no_token = Security(cert=sec.cert, key=sec.key, ca=sec.ca)
        other = make_ca(tmp_path / "other")
        rogue = issue(other, tmp_path / "other", "client")
        foreign = Security(cert=rogue.cert, key=rogue.key, ca=sec.ca, token_file=sec.token_file)
        router = c.router_address
        assert await refused(grpc.aio.insecure_channel(router)) is grpc.StatusCode.UNAVAILABLE
        assert await refused(foreign.channel(router)) is grpc.StatusCode.UNAVAILABLE
        assert await refused(no_token.channel(router)) is grpc.StatusCode.UNAUTHENTICATED
        # Straight to the servers behind the router: nothing without the token.
        assert await refused(no_token.channel(c.address("prefill")), "prefill") is grpc.StatusCode.UNAUTHENTICATED
        worker = workers.workers[0].transfer_address
        assert await refused(no_token.channel(worker), "prefill") is grpc.StatusCode.UNAUTHENTICATED
        assert await refused(no_token.channel(worker), "abort") is grpc.StatusCode.UNAUTHENTICATED
        assert await refused(no_token.channel(c.address("decode")), "decode") is grpc.StatusCode.UNAUTHENTICATED
        # The client's own credentials call Generate only (docs/security.md, "Roles").
        assert await refused(sec.channel(c.address("decode")), "decode") is grpc.StatusCode.PERMISSION_DENIED
        assert await refused(sec.channel(worker), "abort") is grpc.StatusCode.PERMISSION_DENIED
        # ... and the legitimate path still works afterwards.
        async with c.client_channel() as ch:
            again = await generate(GenerateServiceStub(ch), prompt="Secure hello", max_new_tokens=8, timeout=60)
        assert again.token_ids == ref.token_ids
        c.check()


async def test_router_public_port_serves_server_only_tls(tmp_path: Path) -> None:
    """The router's GenerateService with --public-tls-cert: a client presenting nothing but
    trust in the router's certificate is served, while inside the cluster the router's
    calls still need the cluster's certificates and token (mTLS everywhere else)."""
    public_ca = make_ca(tmp_path / "public")
    public = issue(public_ca, tmp_path / "public", "router.example")
    topology = load_topology("1p1d")
    procs = tuple(
        dataclasses.replace(p, args={**p.args, "public-tls-cert": str(public.cert), "public-tls-key": str(public.key)})
        if p.role == "router" else p
        for p in topology.processes
    )
    topology = dataclasses.replace(topology, processes=procs)
    async with Cluster(
        topology, transport="tcp", tls="auto", auth_token="auto", log_dir=tmp_path / "run", public_ca=public_ca.cert, start_timeout=60
    ) as c:
        anonymous = Security(ca=public_ca.cert)  # no client certificate, no token
        async with anonymous.channel(c.router_address) as ch:
            done = await generate(GenerateServiceStub(ch), prompt="public", max_new_tokens=4, timeout=60)
        (ref,) = colocated_generate(reference_engine(c.topology), ["public"], 4)
        assert done.token_ids == ref.token_ids
        assert await refused(grpc.aio.insecure_channel(c.router_address)) is grpc.StatusCode.UNAVAILABLE
        # The decode behind it is not public: the same anonymous client is refused there.
        assert await refused(Security(ca=c.client_security.ca).channel(c.address("decode")), "decode") is grpc.StatusCode.UNAVAILABLE


def test_cluster_cli_tls_auto_flag_is_documented() -> None:
    out = subprocess.run([sys.executable, "-m", "pdgrpc.cluster", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "--tls {off,auto}" in out and "--auth-token {off,auto}" in out
