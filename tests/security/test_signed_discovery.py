"""Discovery records are signed by their writer's certificate; readers take nothing else.

A real etcd on 127.0.0.1. A decode registers with its certificate (the launcher's, naming
the role ``decode``); a router's view under mTLS lists it. Whoever else writes to etcd --
an unsigned record naming a decode at the attacker's address, one signed by the client's
certificate, one by another CA's, and a flood of junk keys -- is ignored and counted,
and the genuine decode stays the only one listed. A cluster the launcher starts with
``--tls auto`` and etcd routes by its own signed records.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from pdgrpc.cluster import Cluster
from pdgrpc.cluster.client import Completion, generate
from pdgrpc.cluster.credentials import CLIENT, ClusterCredentials
from pdgrpc.cluster.reference import reference_engine
from pdgrpc.cluster.topology import parse_topology
from pdgrpc.discovery.etcd import Registration, Watcher, parse_discovery_url
from pdgrpc.discovery.etcd_client import EtcdClient
from pdgrpc.discovery.record import Instance, MembershipView, cluster_prefix, instance_key
from pdgrpc.discovery.server import ETCD_PACKAGE_HINT, EtcdProcess, find_etcd
from pdgrpc.discovery.signing import RecordSigner, RecordVerifier
from pdgrpc.engine.colocated import generate as colocated_generate
from pdgrpc.rpc.certs import issue, make_ca
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub
from tests.eventually import eventually_async

pytestmark = pytest.mark.timeout(120)
JUNK = 2000


def decode(iid: str, port: int) -> Instance:
    return Instance(role="decode", instance_id=iid, address=f"127.0.0.1:{port}", transport="tcp", compat_hash="ab" * 32, generation=1)


async def test_only_records_signed_for_their_role_are_taken(etcd: EtcdProcess, tmp_path: Path) -> None:
    creds = ClusterCredentials(tmp_path / "security", {"decode": "decode", "router": "router"}, tls=True, token=False)
    assert creds.ca is not None
    endpoints = parse_discovery_url(etcd.url)
    view = MembershipView(cluster_prefix("signed"), RecordVerifier(creds.ca).open)
    watcher = Watcher(endpoints, view, probe_s=0.5)
    watcher.start()
    d = creds.certs["decode"]
    reg = Registration(endpoints, instance_key("signed", "decode", "d1"), decode("d1", 7001), ttl=30, signer=RecordSigner(d.cert, d.key))
    reg.start()
    client = EtcdClient(etcd.host, etcd.client_port, endpoints, 3)
    try:
        await eventually_async(lambda: [i.instance_id for i in view.instances("decode")] == ["d1"], timeout=10, what="never listed")
        rogue_ca = make_ca(tmp_path / "rogue")
        rogue = issue(rogue_ca, tmp_path / "rogue", "decode", role="decode")
        c = creds.certs[CLIENT]
        forged = {
            "unsigned": decode("evil1", 6666).to_json(),
            "client": RecordSigner(c.cert, c.key).seal(decode("evil2", 6666).to_json()),
            "other CA": RecordSigner(rogue.cert, rogue.key).seal(decode("evil3", 6666).to_json()),
            # A genuine signature over another record, pasted under another key.
            "replayed": reg.value,
        }
        for n, value in enumerate(forged.values()):
            key = instance_key("signed", "decode", f"evil{n + 1}") if n < 3 else instance_key("signed", "decode", "evil4")
            await client.put(key.encode(), value)
        await eventually_async(lambda: view.ignored >= len(forged), timeout=10, what=lambda: f"ignored {view.ignored}")
        began = time.monotonic()
        for i in range(JUNK):
            await client.put(f"/pdgrpc/signed/decode/junk{i}".encode(), b"x" * 64)
        await eventually_async(lambda: view.ignored >= len(forged) + JUNK, timeout=30, what=lambda: f"ignored {view.ignored}")
        print(f"{JUNK} junk keys put and ignored in {time.monotonic() - began:.2f} s")
        assert [(i.instance_id, i.address) for i in view.instances("decode")] == [("d1", "127.0.0.1:7001")]
    finally:
        await client.close()
        await reg.close()
        await watcher.close()


async def test_a_discovery_cluster_under_tls_auto_routes_by_signed_records(tmp_path: Path) -> None:
    """The launcher's own processes sign what they register, and the router takes it; etcd
    speaks TLS only and takes only clients with a certificate of the cluster's CA."""
    if find_etcd() is None:
        pytest.skip(f"no etcd binary: {ETCD_PACKAGE_HINT}")
    procs = [{"name": "etcd", "role": "etcd"}, {"name": "prefill", "role": "prefill", "args": {"dp-size": 1}},
             {"name": "decode", "role": "decode", "args": {"num-slots": 8}}, {"name": "router", "role": "router"}]
    engine = {"model-size": "tiny", "model-seed": 0, "page-size": 16, "kv-dtype": "float32"}
    topology = parse_topology({"process": procs, "engine": engine}, "signed", tmp_path / "t.toml")
    async with Cluster(topology, transport="tcp", tls="auto", log_dir=tmp_path / "run", start_timeout=90) as c:
        async with c.client_channel() as ch:
            done = await eventually_async(lambda: _served(ch), timeout=30, interval=0.2, what="the router found no instances")
        (ref,) = colocated_generate(reference_engine(c.topology), ["signed"], 4)
        assert done.token_ids == ref.token_ids
        assert "ignored" not in (tmp_path / "run" / "router.log").read_text()
        etcd = c.procs["etcd"]
        assert "--client-cert-auth" in etcd.argv
        host, port = etcd.address.rsplit(":", 1)
        plain = EtcdClient(host, int(port), parse_discovery_url(f"etcd://{etcd.address}"), 2)
        try:
            with pytest.raises(grpc.aio.AioRpcError):  # plaintext: no way in
                await plain.get_prefix(b"/pdgrpc/")
        finally:
            await plain.close()


async def _served(ch: grpc.aio.Channel) -> Completion | None:
    try:
        return await generate(GenerateServiceStub(ch), prompt="signed", max_new_tokens=4, timeout=10)
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.UNAVAILABLE:  # no instance listed yet
            return None
        raise


async def test_a_key_deleted_or_overwritten_while_its_lease_lives_is_put_back(etcd: EtcdProcess) -> None:
    endpoints = parse_discovery_url(etcd.url)
    view = MembershipView(cluster_prefix("kept"))
    watcher = Watcher(endpoints, view, probe_s=0.5)
    watcher.start()
    key = instance_key("kept", "decode", "d1")
    reg = Registration(endpoints, key, decode("d1", 7001), ttl=30)
    reg.start()
    client = EtcdClient(etcd.host, etcd.client_port, endpoints, 3)
    listed = lambda: [i.instance_id for i in view.instances("decode")] == ["d1"]  # noqa: E731
    try:
        await eventually_async(listed, timeout=10, what="never listed")
        await client.delete(key.encode())
        # Back long before the 30 s lease would end; the router may see it go for a moment.
        await eventually_async(lambda: reg.restored == 1 and listed(), timeout=3, what=lambda: f"restored {reg.restored}")
        await client.put(key.encode(), decode("d1", 6666).to_json())  # pointed at the attacker
        await eventually_async(lambda: reg.restored == 2, timeout=3, what=lambda: f"restored {reg.restored}")
        await eventually_async(lambda: [i.address for i in view.instances("decode")] == ["127.0.0.1:7001"], timeout=3)
        assert reg.leases_granted == 1
        await reg.close()  # its own revoke is not undone
        await eventually_async(lambda: view.instances("decode") == [], timeout=5, what="still listed after close()")
    finally:
        await client.close()
        await reg.close()
        await watcher.close()
