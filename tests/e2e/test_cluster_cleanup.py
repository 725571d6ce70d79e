"""What a cluster leaves on disk: a run in the launcher's own temporary directory
leaves nothing behind when it ends cleanly (no logs, no throwaway CA key), and keeps
its logs when it fails or when asked to, so that the paths its errors name still
exist. An etcd the tests start the same way leaves neither its data nor its log."""

from __future__ import annotations

import logging
import socket
import tempfile
from pathlib import Path

import pytest

from pdgrpc.cluster import Cluster
from pdgrpc.cluster.client import generate
from pdgrpc.discovery.server import ETCD_PACKAGE_HINT, EtcdProcess, find_etcd
from pdgrpc.errors import PdgrpcError
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The directory where ``tempfile`` makes its directories for this test."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


async def test_a_clean_run_leaves_no_logs_and_no_keys_behind(own_tmp: Path) -> None:
    async with Cluster("colocated", tls="auto", start_timeout=120) as cluster:
        log_dir = cluster.log_dir
        assert log_dir.parent == own_tmp
        assert (log_dir / "colocated.log").exists()
        # The throwaway CA key is gone once the certificates are issued: kept run
        # directories (the CLI's, a failed run's) hold no key that could mint a certificate
        # the cluster trusts, only the certificates and each holder's own key.
        security = log_dir / "security"
        assert not (security / "ca.key").exists() and (security / "ca.pem").exists()
        assert {p.name for p in security.glob("*.key")} == {"colocated.key", "client.key", "launcher.key"}
    assert list(own_tmp.iterdir()) == []


async def test_a_failed_run_keeps_its_logs_and_says_where(own_tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdgrpc.cluster.launcher")
    with pytest.raises(RuntimeError, match="the client failed"):
        async with Cluster("colocated", start_timeout=120) as cluster:
            raise RuntimeError("the client failed")
    assert (cluster.log_dir / "colocated.log").read_text().startswith("$ ")
    assert f"logs kept in {cluster.log_dir}" in caplog.text


async def test_keep_logs_keeps_a_clean_run_s_logs(own_tmp: Path) -> None:
    async with Cluster("colocated", keep_logs=True, start_timeout=120) as cluster:
        pass
    assert (cluster.log_dir / "colocated.log").exists()


async def test_a_given_log_dir_is_never_removed(tmp_path: Path) -> None:
    async with Cluster("colocated", log_dir=tmp_path / "run", start_timeout=120):
        pass
    assert (tmp_path / "run" / "colocated.log").exists()


def test_an_etcd_in_its_own_directory_leaves_nothing_and_a_failed_one_keeps_its_log(own_tmp: Path) -> None:
    if find_etcd() is None:
        pytest.skip(f"no etcd binary: {ETCD_PACKAGE_HINT}")
    with EtcdProcess.start_on("127.0.0.1") as etcd:
        assert etcd.log_path.exists() and etcd.data_dir.exists()
    assert list(own_tmp.iterdir()) == []

    with socket.socket() as taken:  # its peer port is taken: etcd exits at once
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        clash = EtcdProcess("127.0.0.1", _free_port(), taken.getsockname()[1])
        with pytest.raises(PdgrpcError, match="etcd exited") as err:
            clash.start(ready_timeout=20)
        clash.close()
    assert clash.log_path.exists() and str(clash.log_path) in str(err.value)


async def test_a_port_taken_between_picking_and_binding_restarts_the_cluster_on_fresh_ports(own_tmp: Path) -> None:
    """The start recovers on fresh ports, serves, and leaves nothing behind either."""
    cluster = Cluster("1p1d", transport="tcp", start_timeout=120)
    taken = cluster.procs["decode"].port
    with socket.socket() as squatter:  # another program took the port it picked
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        async with cluster:
            assert cluster.procs["decode"].port != taken
            reply = await generate(GenerateServiceStub(cluster.channel("router")), prompt="a port race", max_new_tokens=4, ignore_eos=True)
            assert len(reply.token_ids) == 4 and reply.bytes_transferred > 0
            assert f"cannot bind 127.0.0.1:{taken}" in (cluster.log_dir / "decode.attempt1.log").read_text()
    assert list(own_tmp.iterdir()) == []


def test_the_throwaway_ca_key_is_gone_when_issuing_a_certificate_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A run that fails while issuing keeps its directory for the logs: no CA key in it.
    import pdgrpc.cluster.credentials as credentials
    from pdgrpc.errors import ConfigError

    real_issue = credentials.issue

    def issue(ca, directory, name, *args, **kw):  # the second certificate fails
        if name != "a":
            raise ConfigError(f"cannot issue {name}")
        return real_issue(ca, directory, name, *args, **kw)

    monkeypatch.setattr(credentials, "issue", issue)
    with pytest.raises(ConfigError, match="cannot issue b"):
        credentials.ClusterCredentials(tmp_path, {"a": "prefill", "b": "decode"}, tls=True, token=False)
    assert (tmp_path / "ca.pem").exists() and not list(tmp_path.glob("ca*.key"))
