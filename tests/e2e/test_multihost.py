"""Across hosts: etcd on h1, a prefill on h2, a decode on h3, the router and the client on
h1 -- each host a network namespace with its own address -- for tcp and rdma (UCX over its
tcp transport between the namespaces). The router finds every instance through etcd.

One test per transport walks the whole story on one set of processes (starting them is
the expensive part): outputs equal colocated generation; the decode's log names a writer
on another host; the decode is SIGKILLed while a second decode starts on h4, the router
drops the first once its lease ends and sends traffic to the second without a restart.
The tcp run also stops etcd under load and starts it again, and SIGSTOPs the prefill past
its lease (it re-registers after SIGCONT; nothing is routed to it meanwhile).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from pdgrpc.cluster.netns import NetworkHosts
from pdgrpc.discovery.server import EtcdProcess
from pdgrpc.engine.colocated import generate as colocated_generate
from pdgrpc.engine.config import EngineConfig, ModelConfig
from pdgrpc.engine.reference import ReferenceEngine
from pdgrpc.serving.flags import MODEL_SIZES
from tests.e2e.harness import skip_unless_transport
from tests.e2e.multihost import TTL, Agent, Server, hosts_with_etcd, skip_unless_multihost, wait_serving
from tests.eventually import eventually

pytestmark = pytest.mark.timeout(240)

PROMPTS = [list(range(1, 6)), list(range(10, 40)), list(range(50, 120))]  # below a page, two pages, over four
MAX_NEW = 6
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NetworkHosts, EtcdProcess, Path]]:
    tmp = tmp_path_factory.mktemp("multihost")
    for hosts, etcd in hosts_with_etcd(4, tmp):
        yield hosts, etcd, tmp


def _reference() -> list[list[int]]:
    engine = ReferenceEngine(EngineConfig(model=ModelConfig(**MODEL_SIZES["tiny"]), page_size=16, kv_dtype="float32"))
    return [list(g.token_ids) for g in colocated_generate(engine, [tuple(p) for p in PROMPTS], MAX_NEW)]


def _routed_decodes(router: Server) -> list[str]:
    return [line.split("decode=")[1].split()[0] for line in router.log().splitlines() if " admitted" in line and "decode=" in line]


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_across_hosts_with_discovery(net: tuple[NetworkHosts, EtcdProcess, Path], transport: str) -> None:
    skip_unless_transport(transport)
    hosts, etcd, tmp = net
    logs = tmp / transport
    logs.mkdir()
    cluster = f"mh-{transport}"
    servers: list[Server] = []

    def start(host: str, role: str, name: str, wildcard: bool = False) -> Server:
        s = Server(hosts, host, role, logs, name, transport, cluster=cluster, wildcard=wildcard)
        servers.append(s)
        return s

    agent = Agent(hosts, "h1")
    try:
        # Over tcp the prefill listens on every interface and advertises its host's address.
        prefill = start("h2", "prefill", "prefill1", wildcard=transport == "tcp")
        decode = start("h3", "decode", "decode1")
        router = start("h1", "router", "router")
        expected = _reference()
        for s in (prefill, decode, router):
            wait_serving(agent, s)

        # The router takes both from etcd; until it has seen them it answers UNAVAILABLE.
        def answers() -> bool:
            r = agent.ask(op="generate", address=router.address, input_ids=PROMPTS[0], max_new_tokens=MAX_NEW)
            return bool(r["ok"])

        eventually(answers, timeout=30, interval=0.2, what=lambda: f"the router never answered:\n{router.log()[-2000:]}")
        for ids, want in zip(PROMPTS, expected):
            r = agent.ask(op="generate", address=router.address, input_ids=ids, max_new_tokens=MAX_NEW)
            assert r["ok"], r
            assert r["token_ids"] == want, f"prompt of {len(ids)} tokens differs from colocated generation"
        assert set(_routed_decodes(router)) == {decode.address}
        # The KV came from the prefill host's worker, not from the decode's own address.
        writers = [line.split("writers=")[1].split()[0] for line in decode.log().splitlines() if "handshake accepted" in line]
        prefill_ip = hosts.address("h2")
        assert writers and all(w.startswith(prefill_ip + ":") for w in writers), writers
        assert not any(w.startswith(hosts.address("h3") + ":") for w in writers)

        # SIGKILL the decode (no revoke: only the lease's end tells etcd) and start another on h4.
        decode.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        decode2 = start("h4", "decode", "decode2")

        eventually(lambda: "decode decode1 left" in router.log(), timeout=TTL + 10, interval=0.05,
                   what="the router never dropped the killed decode")
        dropped_after = time.monotonic() - killed_at
        wait_serving(agent, decode2)

        eventually(answers, timeout=30, interval=0.2, what="the second decode never took a request")
        before = len(_routed_decodes(router))
        for ids, want in zip(PROMPTS, expected):
            r = agent.ask(op="generate", address=router.address, input_ids=ids, max_new_tokens=MAX_NEW)
            assert r["ok"] and r["token_ids"] == want, r
        assert set(_routed_decodes(router)[before:]) == {decode2.address}
        print(f"{transport}: router dropped the killed decode {dropped_after:.2f} s after SIGKILL (lease ttl {TTL} s)")

        if transport == "tcp":
            # etcd stops under load: known instances keep serving, nothing crashes, each
            # process logs the outage once, and the view is the same once etcd is back.
            left = router.log().count(" left ")
            etcd.stop()
            for ids, want in zip(PROMPTS, expected):
                r = agent.ask(op="generate", address=router.address, input_ids=ids, max_new_tokens=MAX_NEW)
                assert r["ok"] and r["token_ids"] == want, r
            eventually(lambda: all("unreachable" in x.log() for x in (prefill, decode2, router)), timeout=15, interval=0.1,
                       what="a server never noticed etcd was gone")
            for ids, want in zip(PROMPTS, expected):
                r = agent.ask(op="generate", address=router.address, input_ids=ids, max_new_tokens=MAX_NEW)
                assert r["ok"] and r["token_ids"] == want, r
            etcd.start()
            eventually(lambda: all("reachable again" in x.log() for x in (prefill, decode2, router)), timeout=20,
                       interval=0.1, what="a server never reconnected to etcd")
            for s in (prefill, decode2, router):
                assert s.proc.poll() is None, f"{s.name} exited during the etcd outage:\n{s.log()[-2000:]}"
                assert s.log().count("unreachable") == 1, f"{s.name}: the outage is logged once"
            assert router.log().count(" left ") == left, "nobody left the router's view"
            r = agent.ask(op="generate", address=router.address, input_ids=PROMPTS[2], max_new_tokens=MAX_NEW)
            assert r["ok"] and r["token_ids"] == expected[2], r

            # SIGSTOP the prefill (controller and workers) past its TTL: its lease lapses, the
            # router drops it and routes nothing there; after SIGCONT it registers again.
            routed = router.log().count(" admitted")
            prefill.signal(signal.SIGSTOP)
            try:
                eventually(lambda: "prefill prefill1 left" in router.log(), timeout=TTL + 10, interval=0.05,
                           what="the router never dropped the stopped prefill")
                r = agent.ask(op="generate", address=router.address, input_ids=PROMPTS[0], max_new_tokens=MAX_NEW)
                assert not r["ok"] and r["code"] == "UNAVAILABLE" and "no live prefill" in r["details"], r
                assert router.log().count(" admitted") == routed, "nothing was routed to the stopped prefill"
            finally:
                prefill.signal(signal.SIGCONT)
            eventually(lambda: router.log().count("prefill prefill1 joined") == 2, timeout=15, interval=0.05,
                       what="the prefill never registered again")
            assert "lapsed" in prefill.log()
            r = agent.ask(op="generate", address=router.address, input_ids=PROMPTS[2], max_new_tokens=MAX_NEW)
            assert r["ok"] and r["token_ids"] == expected[2], r
    finally:
        agent.close()
        for s in reversed(servers):
            s.stop()


def test_the_launcher_places_a_topology_on_hosts(tmp_path: Path) -> None:
    """``python -m pdgrpc.cluster servers/multihost.toml`` makes the hosts, runs etcd and
    the servers on them, routes over both decodes, and removes the hosts on SIGINT."""
    skip_unless_multihost()
    cli = subprocess.Popen(
        [sys.executable, "-m", "pdgrpc.cluster", "servers/multihost.toml", "--transport", "tcp", "--log-dir", str(tmp_path), "--insecure"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    agent = None
    hosts: dict[str, dict[str, str]] = {}
    try:
        assert cli.stdout is not None
        router = ""
        for line in cli.stdout:
            if line.startswith("hosts: "):
                hosts = json.loads(line[len("hosts: "):])
            if line.startswith("router (GenerateService) listening on "):
                router = line.split()[-1]
                break
        assert router.startswith(hosts["h1"]["address"] + ":"), (router, hosts, cli.stderr.read() if cli.poll() is not None else "")
        agent = Agent(hosts["h1"]["netns"])
        both = {hosts["h3"]["address"], hosts["h4"]["address"]}

        def chosen() -> set[str]:
            return {line.split("decode=")[1].split()[0].rpartition(":")[0]
                    for line in (tmp_path / "router.log").read_text().splitlines() if " admitted" in line}

        def one_more() -> bool:  # healthy comes a moment before registered: ask until both took one
            r = agent.ask(op="generate", address=router, prompt="hello there", max_new_tokens=4)  # type: ignore[union-attr]
            assert r["ok"] or r["code"] == "UNAVAILABLE", r
            return chosen() == both

        eventually(one_more, timeout=30, interval=0.1, what=lambda: f"decodes chosen: {chosen()} of {both}")
        agent.close()
        agent = None
        cli.send_signal(signal.SIGINT)
        out, err = cli.communicate(timeout=60)
        assert cli.returncode == 0, err
        assert "cluster stopped" in out
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(h["netns"] in listed for h in hosts.values()), listed
    finally:
        if agent is not None:
            agent.close()
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()
        for h in hosts.values():  # whatever the launcher left after a failure
            subprocess.run(["ip", "netns", "del", h["netns"]], capture_output=True)
