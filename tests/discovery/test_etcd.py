"""Registration and watch against a real etcd (``etcd-server``) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdgrpc.discovery.etcd import Registration, Watcher, parse_discovery_url
from pdgrpc.discovery.record import Instance, MembershipView, cluster_prefix, instance_key
from pdgrpc.discovery.server import EtcdProcess
from pdgrpc.errors import ConfigError
from tests.eventually import eventually_async

pytestmark = pytest.mark.timeout(120)


def _decode(iid: str, port: int = 7000) -> Instance:
    return Instance(role="decode", instance_id=iid, address=f"127.0.0.1:{port}", transport="tcp", compat_hash="ab" * 32, generation=1)


def _watch(etcd: EtcdProcess, cluster: str) -> Watcher:
    w = Watcher(parse_discovery_url(etcd.url), MembershipView(cluster_prefix(cluster)), probe_s=0.5)
    w.start()
    return w


def _live(w: Watcher) -> list[str]:
    return [i.instance_id for i in w.view.instances("decode")]


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:2379", "etcd://", "etcd://host", "etcd://h:0", "etcd://h:1,h"],
)
def test_bad_discovery_urls_name_the_flag(url: str) -> None:
    with pytest.raises(ConfigError, match="--discovery"):
        parse_discovery_url(url)


def test_the_etcd_client_coexists_with_pdgrpc_protos() -> None:
    # Two etcd clients were seen to clash in one process (a duplicate mvccpb.KeyValue).
    code = "import aetcd, pdgrpc.v1.bootstrap_pb2, pdgrpc.v1.generate_pb2, pdgrpc.v1.decode_pb2, pdgrpc.v1.prefill_pb2, pdgrpc.v1.handshake_pb2, pdgrpc.v1.common_pb2"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


async def test_clean_shutdown_revokes_the_lease_at_once(etcd: EtcdProcess) -> None:
    w = _watch(etcd, "revoke")
    reg = Registration(parse_discovery_url(etcd.url), instance_key("revoke", "decode", "d1"), _decode("d1"), ttl=30)
    reg.start()
    try:
        await eventually_async(lambda: _live(w) == ["d1"], timeout=10, what="never registered")
        await reg.close()
        # Gone long before the 30 s lease would have run out.
        await eventually_async(lambda: _live(w) == [], timeout=5, what="still listed after close()")
    finally:
        await reg.close()
        await w.close()


async def test_close_revokes_even_while_the_registering_put_is_in_flight(etcd: EtcdProcess) -> None:
    # The key is visible to watchers before the put's reply reaches the registrant; a
    # close() at that moment must still revoke (found by bench multihost: 10 s leftovers).
    w = _watch(etcd, "race")
    try:
        for i in range(5):
            reg = Registration(parse_discovery_url(etcd.url), instance_key("race", "decode", f"d{i}"), _decode(f"d{i}"), ttl=30)
            reg.start()
            version = w.view.version
            while f"d{i}" not in _live(w):
                assert await w.wait_changed(version, 10)
                version = w.view.version
            await reg.close()
            await eventually_async(lambda: _live(w) == [], timeout=5, what=f"d{i} still listed after close()")
    finally:
        await w.close()


async def test_keepalive_outlives_the_ttl_and_bad_values_are_ignored(etcd: EtcdProcess, caplog: pytest.LogCaptureFixture) -> None:
    import aetcd

    caplog.set_level(logging.INFO, "pdgrpc.discovery")
    w = _watch(etcd, "bad")
    reg = Registration(parse_discovery_url(etcd.url), instance_key("bad", "decode", "d1"), _decode("d1"), ttl=2)
    reg.start()
    client = aetcd.Client(host="127.0.0.1", port=etcd.client_port)
    try:
        await eventually_async(lambda: _live(w) == ["d1"], timeout=10)
        for _ in range(3):
            await client.put(b"/pdgrpc/bad/decode/junk", b"{not json")
            await client.put(b"/pdgrpc/bad/decode/d2", _decode("d2").to_json().replace(b'"format":1', b'"format":9'))
        await asyncio.sleep(3)  # longer than the TTL: keep-alive holds the lease
        assert _live(w) == ["d1"]
        assert reg.leases_granted == 1
        skipped = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
        assert len(skipped) == 2, skipped  # each bad value once, however often it is written
    finally:
        await client.close()
        await reg.close()
        await w.close()


async def test_a_stopped_instance_lapses_and_comes_back_with_a_new_lease(etcd: EtcdProcess, tmp_path: Path) -> None:
    """SIGSTOP for longer than the TTL: the lease ends and the router's view drops it (so
    nothing is routed there); SIGCONT: it registers again under a new lease."""
    script = tmp_path / "reg.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, logging, sys
        from pdgrpc.discovery.etcd import Registration, parse_discovery_url
        from pdgrpc.discovery.record import Instance, instance_key
        logging.basicConfig(level=logging.INFO, stream=sys.stdout)
        async def main():
            inst = Instance(role="decode", instance_id="d1", address="127.0.0.1:7000", transport="tcp", compat_hash="ab" * 32)
            reg = Registration(parse_discovery_url({etcd.url!r}), instance_key("stop", "decode", "d1"), inst, ttl=2)
            reg.start()
            await asyncio.sleep(3600)
        asyncio.run(main())
    """))
    log_path = tmp_path / "reg.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    w = _watch(etcd, "stop")
    try:
        await eventually_async(lambda: _live(w) == ["d1"], timeout=20, what=lambda: log_path.read_text())
        proc.send_signal(signal.SIGSTOP)
        await eventually_async(lambda: _live(w) == [], timeout=10, what="the stopped instance's lease never ended")
        proc.send_signal(signal.SIGCONT)
        await eventually_async(lambda: _live(w) == ["d1"], timeout=10, what=lambda: log_path.read_text())
        text = log_path.read_text()
        assert "lapsed" in text and text.count("registered /pdgrpc/stop/decode/d1") == 2, text
    finally:
        proc.kill()
        proc.wait()
        await w.close()


def test_a_bootstrap_server_registers_and_revokes_on_sigterm(etcd: EtcdProcess, tmp_path: Path) -> None:
    async def scenario() -> None:
        w = _watch(etcd, "boot")
        log_path = tmp_path / "bootstrap.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdgrpc.bootstrap", "--host", "127.0.0.1", "--port", "0", "--discovery", etcd.url,
                 "--cluster-name", "boot", "--instance-id", "b1", "--discovery-ttl", "30"],
                stdout=log, stderr=log,
            )
        try:
            await eventually_async(lambda: [i.instance_id for i in w.view.instances("bootstrap")] == ["b1"], timeout=30,
                                   what=lambda: log_path.read_text())
            proc.send_signal(signal.SIGTERM)
            await eventually_async(lambda: w.view.instances("bootstrap") == [], timeout=5, what=lambda: log_path.read_text())
            assert proc.wait(10) == 0
        finally:
            proc.kill()
            proc.wait()
            await w.close()

    asyncio.run(scenario())


def test_a_restarted_instance_reappears_with_a_new_generation(etcd: EtcdProcess, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "pdgrpc.bootstrap", "--host", "127.0.0.1", "--port", "0", "--discovery", etcd.url,
            "--cluster-name", "restart", "--instance-id", "b1", "--discovery-ttl", "30"]

    async def scenario() -> None:
        w = _watch(etcd, "restart")
        procs = []
        try:
            generations = []
            for run in range(2):
                with open(tmp_path / f"bootstrap{run}.log", "wb") as log:
                    procs.append(subprocess.Popen(argv, stdout=log, stderr=log))

                def registered() -> bool:
                    live = w.view.instances("bootstrap")
                    return len(live) == 1 and live[0].generation not in generations

                await eventually_async(registered, timeout=30, what=lambda: (tmp_path / f"bootstrap{run}.log").read_text())
                generations.append(w.view.instances("bootstrap")[0].generation)
                procs[-1].kill()  # no revoke: the restart replaces the key under its own lease
                procs[-1].wait()
            assert generations[1] > generations[0]
        finally:
            for p in procs:
                p.kill()
                p.wait()
            await w.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--discovery", "etcd://127.0.0.1"], "--discovery"),
        (["--discovery", "etcd://127.0.0.1:2379", "--cluster-name", "a/b"], "--cluster-name"),
        (["--discovery", "etcd://127.0.0.1:2379", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"], "leave out --prefill"),
    ],
)
def test_router_flags_are_checked(argv: list[str], message: str) -> None:
    res = subprocess.run([sys.executable, "-m", "pdgrpc.router", *argv], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_a_wildcard_host_needs_advertise_host() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "pdgrpc.bootstrap", "--host", "0.0.0.0", "--discovery", "etcd://127.0.0.1:2379"],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 2 and "--advertise-host" in res.stderr, res.stderr
