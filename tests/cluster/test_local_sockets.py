"""Which router -> server pairs the launcher puts on a local socket (pdgrpc.rpc.local):
every pair on one host, in every security mode; a router on another host keeps gRPC.
(Flags only: no process starts here.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdgrpc.cluster.launcher import Cluster
from pdgrpc.cluster.topology import parse_topology

HOSTS = {"a": {"netns": "ns-a", "address": "10.77.0.1"}, "b": {"netns": "ns-b", "address": "10.77.0.2"}}


def _flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]


@pytest.mark.parametrize("tls, token", [("off", "off"), ("auto", "off"), ("auto", "auto")])
async def test_same_host_pairs_use_local_sockets_whatever_the_security(tmp_path: Path, tls: str, token: str) -> None:
    procs: list[dict[str, Any]] = [{"name": "p", "role": "prefill", "host": "a"}, {"name": "d", "role": "decode", "host": "a"},
             {"name": "far", "role": "decode", "host": "b"},
             {"name": "r", "role": "router", "prefill": ["p"], "decode": ["d", "far"], "host": "a"}]
    cluster = Cluster(parse_topology({"network": {}, "process": procs}, "t"), hosts=HOSTS, tls=tls, auth_token=token,
                      log_dir=tmp_path, python="python")
    try:
        sockets = {name: _flag(cluster.procs[name].argv, "--local-socket") for name in ("p", "d", "far")}
        assert sockets["far"] == [] and all(len(sockets[n]) == 1 for n in ("p", "d")), sockets
        router = cluster.procs["r"].argv
        assert _flag(router, "--prefill") == [f"{cluster.address('p')},local={sockets['p'][0]}"]
        assert _flag(router, "--decode") == [f"{cluster.address('d')},local={sockets['d'][0]}", cluster.address("far")]
        assert (tls == "auto") == ("--tls-cert" in cluster.procs["p"].argv)
        assert not Path(sockets["p"][0]).parent.exists()  # made as the cluster starts: none leaks from one never started
        # A router on another host than its servers calls them over gRPC, and they serve no socket.
        apart = Cluster(parse_topology({"network": {}, "process": [{**p, "host": "b"} if p["name"] == "r" else p for p in procs]}, "t"),
                        hosts=HOSTS, tls=tls, auth_token=token, log_dir=tmp_path / "apart", python="python")
        try:
            router = apart.procs["r"].argv
            (far,) = _flag(apart.procs["far"].argv, "--local-socket")  # far shares the router's host now
            assert _flag(router, "--prefill") == [apart.address("p")] and _flag(apart.procs["p"].argv, "--local-socket") == []
            assert _flag(router, "--decode") == [apart.address("d"), f"{apart.address('far')},local={far}"]
        finally:
            await apart.stop()
    finally:
        await cluster.stop()
