"""Topologies that place processes on hosts: what the launcher refuses, and the flags it
gives each process (no namespaces are made here)."""

from __future__ import annotations

import re
import subprocess

import pytest

from pdgrpc.cluster.hosts import HOSTS_ENV, discovery_flags
from pdgrpc.cluster.launcher import Cluster
from pdgrpc.cluster.netns import NetworkHosts
from pdgrpc.cluster.topology import load_topology, parse_topology
from pdgrpc.errors import ConfigError

HOSTS = {h: {"netns": f"x-{h}", "address": f"10.77.0.{i}"} for i, h in enumerate(["h1", "h2", "h3", "h4"], start=1)}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"process": [{"name": "r", "role": "router", "host": "h1", "prefill": ["p"], "decode": ["d"]}]}, "needs a [network] table"),
        ({"network": {}, "process": [{"name": "e", "role": "etcd", "host": "h1"}, {"name": "r", "role": "router"}]}, "every process needs host"),
        ({"network": {"subnet": 5}, "process": []}, "subnet must be a string"),
        ({"network": {"mask": "x"}, "process": []}, "[network] takes subnet"),
        ({"network": {}, "process": [{"name": "r", "role": "router", "host": "H-1"}]}, "host must be 1-8 lower-case"),
        ({"process": [{"name": "r", "role": "router"}]}, "(or an etcd process to discover them)"),
        ({"process": [{"name": "e", "role": "etcd", "args": {"x": 1}}]}, "an etcd process takes no args"),
        ({"network": {}, "process": [{"name": "e", "role": "etcd", "host": "h1"}, {"name": "f", "role": "etcd", "host": "h1"},
                                      {"name": "r", "role": "router", "host": "h1"}]}, "at most one etcd process"),
    ],
)
def test_bad_host_placements_are_refused_naming_the_problem(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_topology({"transport": "tcp", **data}, "bad")


@pytest.mark.parametrize("subnet", ["10.77.0.0/16", "8.8.8.0/24", "fd00::/64", "nonsense"])
def test_hosts_need_a_private_ipv4_slash_24(subnet: str) -> None:
    with pytest.raises(ConfigError, match="subnet"):
        NetworkHosts(["h1"], subnet)


def test_a_multihost_topology_needs_its_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HOSTS_ENV, raising=False)
    with pytest.raises(ConfigError, match="python -m pdgrpc.cluster"):
        Cluster("multihost")


def test_each_process_runs_on_its_host_with_discovery_flags(tmp_path) -> None:
    from pdgrpc.discovery.server import ETCD_PACKAGE_HINT, find_etcd

    if find_etcd() is None:  # the etcd process's argv names the binary
        pytest.skip(f"no etcd binary: {ETCD_PACKAGE_HINT}")
    cluster = Cluster("multihost", transport="tcp", hosts=HOSTS, log_dir=tmp_path)
    etcd = cluster.procs["etcd"]
    assert etcd.address.startswith("10.77.0.1:") and etcd.argv[:4] == ["ip", "netns", "exec", "x-h1"]
    decode = cluster.procs["decode-b"]
    argv = decode.argv
    assert argv[:4] == ["ip", "netns", "exec", "x-h4"]
    flag = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flag["--host"] == flag["--transport-host"] == "10.77.0.4"
    assert flag["--discovery"] == f"etcd://{etcd.address}" and flag["--instance-id"] == "decode-b"
    router = cluster.procs["router"].argv
    assert "--prefill" not in router and "--decode" not in router and "--instance-id" not in router
    assert router[router.index("--discovery") + 1] == f"etcd://{etcd.address}"
    # A router with static lists keeps them, even with an etcd in the topology.
    spec = load_topology("1p1d").router
    assert discovery_flags(load_topology("multihost"), spec, "10.77.0.1:2379") == []


def test_hosts_made_half_way_are_removed_when_making_the_rest_fails() -> None:
    from pdgrpc.cluster.netns import NetnsUnavailable, netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    hosts = NetworkHosts(["h1", "h2", "h3"])
    subprocess.run(["ip", "netns", "add", hosts.netns("h2")], check=True)  # h2's name is taken
    try:
        with pytest.raises(NetnsUnavailable, match=hosts.netns("h2")):
            hosts.create()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert hosts.bridge_netns not in listed and hosts.netns("h1") not in listed
    finally:
        subprocess.run(["ip", "netns", "del", hosts.netns("h2")])
