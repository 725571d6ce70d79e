"""The router's channel to a signed record's address accepts only the signer's server,
on every connection it makes, not just at the check before the first.

A real etcd and real TLS servers on 127.0.0.1. Decode A signs its record and serves at
its address; the router's view lists it once A showed its key there. Then A stops and
decode B, holding another certificate of the cluster's CA for the same role, serves on
A's port while A's record still names it. A channel that trusts any certificate of the
CA (what the router used to dial with) reaches B; the router's channels, pinned to the
name only the signer's certificate carries (:func:`pdgrpc.rpc.certs.key_name`), refuse
B's handshake.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.discovery.etcd import Watcher, parse_discovery_url
from pdgrpc.discovery.etcd_client import EtcdClient
from pdgrpc.discovery.identity import DialIdentity
from pdgrpc.discovery.record import Instance, MembershipView, cluster_prefix, instance_key
from pdgrpc.discovery.server import EtcdProcess
from pdgrpc.discovery.signing import RecordSigner, RecordVerifier
from pdgrpc.rpc.certs import issue, make_ca
from pdgrpc.rpc.channels import ChannelPool
from pdgrpc.rpc.roles import DECODE, ROUTER
from pdgrpc.rpc.security import Security
from pdgrpc.rpc.server import start_server
from tests.eventually import eventually_async

pytestmark = pytest.mark.timeout(60)


async def check(pool: ChannelPool, address: str) -> grpc.StatusCode:
    try:
        await health_pb2_grpc.HealthStub(pool.get(address)).Check(health_pb2.HealthCheckRequest(), timeout=3)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_the_routers_channel_takes_only_the_signers_server(etcd: EtcdProcess, tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    a, b, router = (issue(ca, tmp_path, n, role=r) for n, r in (("decode-a", DECODE), ("decode-b", DECODE), ("router", ROUTER)))
    server = await start_server([], security=Security(cert=a.cert, key=a.key, ca=ca.cert))
    address, port = server.address, server.port
    endpoints = parse_discovery_url(etcd.url)
    view = MembershipView(cluster_prefix("pin"), RecordVerifier(ca.cert).open, prove=True)
    watcher = Watcher(endpoints, view, probe_s=0.5, identity=DialIdentity(ca.cert, router.cert, router.key))
    watcher.start()
    client = EtcdClient(etcd.host, etcd.client_port, endpoints, 3)
    as_router = Security(cert=router.cert, key=router.key, ca=ca.cert)
    pinned, any_of_the_ca = ChannelPool(security=as_router, server_names=view.server_name), ChannelPool(security=as_router)
    try:
        record = Instance(role="decode", instance_id="a", address=address, transport="tcp", compat_hash="ab" * 32, generation=1)
        await client.put(instance_key("pin", "decode", "a").encode(), RecordSigner(a.cert, a.key).seal(record.to_json()))
        await eventually_async(lambda: [i.instance_id for i in view.instances("decode")] == ["a"], timeout=10, what="A listed")
        assert view.server_name(address) is not None
        assert await check(pinned, address) is grpc.StatusCode.OK

        await server.stop(0)
        server = await start_server([], port=port, security=Security(cert=b.cert, key=b.key, ca=ca.cert))
        assert [i.instance_id for i in view.instances("decode")] == ["a"]  # A's lease lives on
        assert await check(any_of_the_ca, address) is grpc.StatusCode.OK  # B answers for A there
        for _ in range(3):  # each a fresh connection attempt: B's handshake fails every time
            assert await check(pinned, address) is grpc.StatusCode.UNAVAILABLE
    finally:
        await pinned.close()
        await any_of_the_ca.close()
        await client.close()
        await watcher.close()
        await server.stop(0)
