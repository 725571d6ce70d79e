"""The router dials only instances whose TLS identity matches their signed record.

A real etcd and real TLS servers on 127.0.0.1. Decode B serves with its own certificate;
decode A, holding another certificate of the cluster's CA for the same role, signs a
record that names B's address. The router's view lists B's own record, never A's: the
server at that address presents B's key, not the signer's. The refusal is counted, and
a record whose address answers with the signer's key after all is listed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdgrpc.discovery.etcd import Watcher, parse_discovery_url
from pdgrpc.discovery.etcd_client import EtcdClient
from pdgrpc.discovery.identity import DialIdentity
from pdgrpc.discovery.record import Instance, MembershipView, cluster_prefix, instance_key
from pdgrpc.discovery.server import EtcdProcess
from pdgrpc.discovery.signing import RecordSigner, RecordVerifier
from pdgrpc.rpc.certs import issue, make_ca
from pdgrpc.rpc.roles import DECODE, ROUTER
from pdgrpc.rpc.security import Security
from pdgrpc.rpc.server import start_server
from tests.eventually import eventually_async

pytestmark = pytest.mark.timeout(60)


def decode(iid: str, address: str) -> Instance:
    return Instance(role="decode", instance_id=iid, address=address, transport="tcp", compat_hash="ab" * 32, generation=1)


async def test_a_record_naming_another_instances_address_is_not_dialed(etcd: EtcdProcess, tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    a, b, router = (issue(ca, tmp_path, n, role=r) for n, r in (("decode-a", DECODE), ("decode-b", DECODE), ("router", ROUTER)))
    server_b = await start_server([], security=Security(cert=b.cert, key=b.key, ca=ca.cert))
    server_a = None
    endpoints = parse_discovery_url(etcd.url)
    view = MembershipView(cluster_prefix("dial"), RecordVerifier(ca.cert).open, prove=True)
    watcher = Watcher(endpoints, view, probe_s=0.5, identity=DialIdentity(ca.cert, router.cert, router.key))
    watcher.start()
    client = EtcdClient(etcd.host, etcd.client_port, endpoints, 3)
    listed = lambda: sorted(i.instance_id for i in view.instances("decode"))  # noqa: E731
    try:
        for iid, signer in (("a", a), ("b", b)):
            record = RecordSigner(signer.cert, signer.key).seal(decode(iid, server_b.address).to_json())
            await client.put(instance_key("dial", "decode", iid).encode(), record)
        await eventually_async(lambda: view.identity_mismatches == 1 and listed() == ["b"], timeout=10,
                               what=lambda: f"listed {listed()}, mismatches {view.identity_mismatches}")
        assert view.snapshot()[instance_key("dial", "decode", "a")].address == server_b.address  # taken, not dialed

        # A's record moved to A's own server: listed once A answers there.
        server_a = await start_server([], security=Security(cert=a.cert, key=a.key, ca=ca.cert))
        record = RecordSigner(a.cert, a.key).seal(decode("a", server_a.address).to_json())
        await client.put(instance_key("dial", "decode", "a").encode(), record)
        await eventually_async(lambda: listed() == ["a", "b"], timeout=10, what=lambda: f"listed {listed()}")
        assert view.identity_mismatches == 1
    finally:
        await client.close()
        await watcher.close()
        await server_b.stop(0)
        if server_a is not None:
            await server_a.stop(0)
