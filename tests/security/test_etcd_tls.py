"""Discovery over an etcd that speaks TLS only and takes only clients with a certificate of
its CA (etcd's ``--client-cert-auth``), or a user and password.

A real etcd on 127.0.0.1. Whoever reaches its port without a certificate -- plaintext, or
TLS without a client certificate -- gets nothing in or out; a real bootstrap server given
``--discovery etcds://`` and its certificate registers, and a watcher over TLS lists it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest

from pdgrpc.discovery.cli import add_discovery_arguments, check_discovery_args
from pdgrpc.discovery.etcd import Watcher
from pdgrpc.discovery.etcd_client import EtcdClient, EtcdTarget, parse_discovery_url, rpc
from pdgrpc.discovery.record import MembershipView, cluster_prefix
from pdgrpc.discovery.server import EtcdProcess
from pdgrpc.errors import ConfigError
from pdgrpc.rpc.certs import CertFiles
from tests.eventually import eventually_async
from tests.prefill.procs import BootstrapProc

pytestmark = pytest.mark.timeout(120)
EtcdWithTls = tuple[EtcdProcess, Path, CertFiles]


async def _refused(client: EtcdClient) -> None:
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.put(b"/pdgrpc/tls/decode/evil", b"x")
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE, info.value
    finally:
        await client.close()


async def test_a_client_without_a_certificate_is_refused(etcd_tls: EtcdWithTls) -> None:
    etcd, ca, cert = etcd_tls
    target = parse_discovery_url(etcd.url)
    await _refused(EtcdClient(etcd.host, etcd.client_port, EtcdTarget(target.endpoints), 2))  # plaintext
    await _refused(EtcdClient(etcd.host, etcd.client_port, target.with_files(ca), 2))  # TLS, no certificate
    client = EtcdClient(etcd.host, etcd.client_port, target.with_files(ca, cert.cert, cert.key), 2)
    try:
        listing = await client.get_prefix(b"/pdgrpc/tls/")
        assert [kv.key for kv in listing.kvs] == []  # nothing the refused ones tried went in
    finally:
        await client.close()


async def test_a_server_registers_over_tls_and_a_watcher_lists_it(etcd_tls: EtcdWithTls, tmp_path: Path) -> None:
    etcd, ca, cert = etcd_tls
    w = Watcher(parse_discovery_url(etcd.url).with_files(ca, cert.cert, cert.key), MembershipView(cluster_prefix("tls")), probe_s=0.5)
    w.start()
    try:
        with BootstrapProc(
            tmp_path, "--discovery", etcd.url, "--discovery-ca", str(ca), "--discovery-cert", str(cert.cert),
            "--discovery-key", str(cert.key), "--cluster-name", "tls", "--instance-id", "b1",
        ) as bootstrap:
            await eventually_async(lambda: [i.instance_id for i in w.view.instances("bootstrap")] == ["b1"], timeout=30,
                                   what=bootstrap.tail)
    finally:
        await w.close()


async def test_a_user_and_password(tmp_path: Path, etcd_tls: EtcdWithTls) -> None:
    """etcd with users on: the right password reads and writes, a wrong one is refused."""
    shared, ca, cert = etcd_tls
    with EtcdProcess.start_on("127.0.0.1", tls=shared.tls) as etcd:
        stubs = rpc()
        ch = grpc.aio.secure_channel(f"{etcd.host}:{etcd.client_port}", grpc.ssl_channel_credentials(
            ca.read_bytes(), cert.key.read_bytes(), cert.cert.read_bytes()))
        try:  # root with the root role, then users on: what etcd asks for before auth
            auth = stubs.AuthStub(ch)
            await auth.UserAdd(stubs.AuthUserAddRequest(name="root", password="s3cret"))
            await auth.UserGrantRole(stubs.AuthUserGrantRoleRequest(user="root", role="root"))
            await auth.AuthEnable(stubs.AuthEnableRequest())
        finally:
            await ch.close()
        good, bad = tmp_path / "good", tmp_path / "bad"
        for path, text in ((good, "s3cret\n"), (bad, "guess\n")):
            path.write_text(text)
            path.chmod(0o600)
        target = parse_discovery_url(etcd.url)
        with_user = target.with_files(ca, cert.cert, cert.key, "root", good)
        assert "s3cret" not in repr(with_user) and "PRIVATE KEY" not in repr(with_user)
        client = EtcdClient(etcd.host, etcd.client_port, with_user, 3)
        try:
            await client.put(b"/pdgrpc/users/k", b"v")
            assert [kv.value for kv in (await client.get_prefix(b"/pdgrpc/users/")).kvs] == [b"v"]
        finally:
            await client.close()
        client = EtcdClient(etcd.host, etcd.client_port, target.with_files(ca, cert.cert, cert.key, "root", bad), 3)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.put(b"/pdgrpc/users/k", b"forged")
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value
        finally:
            await client.close()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--discovery", "etcds://127.0.0.1:2379"], "--discovery-ca"),
        (["--discovery", "etcd://127.0.0.1:2379", "--discovery-ca", "/dev/null"], "etcds://"),
        (["--discovery", "etcds://127.0.0.1:2379", "--discovery-ca", "/nonexistent"], "--discovery-ca"),
        (["--discovery", "etcds://127.0.0.1:2379", "--discovery-ca", "/dev/null", "--discovery-cert", "/dev/null"], "--discovery-key"),
        (["--discovery", "etcds://127.0.0.1:2379", "--discovery-ca", "/dev/null", "--discovery-user", "u"], "--discovery-password-file"),
        (["--discovery", "etcd://127.0.0.1:2379", "--discovery-user", "u", "--discovery-password-file", "/dev/null"], "etcds://"),
    ],
)
def test_etcd_flags_are_checked(argv: list[str], message: str) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    add_discovery_arguments(parser, "bootstrap")
    with pytest.raises(ConfigError, match=message):
        check_discovery_args(parser.parse_args(argv))
