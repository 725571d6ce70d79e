"""The topology's ``smg`` role: validation and the ``smg launch`` command line (pure)."""

from __future__ import annotations

import pytest

from pdgrpc.cluster.smg import smg_argv
from pdgrpc.cluster.topology import load_topology, parse_topology
from pdgrpc.errors import ConfigError

BASE = {
    "process": [
        {"name": "p", "role": "prefill"},
        {"name": "d", "role": "decode"},
        {"name": "r", "role": "router", "prefill": ["p"], "decode": ["d"]},
    ]
}


def topo(*extra: dict) -> dict:
    return {"process": BASE["process"] + list(extra)}


def test_an_smg_process_must_name_its_prefills_and_decodes():
    with pytest.raises(ConfigError, match="a smg needs prefill"):
        parse_topology(topo({"name": "g", "role": "smg", "prefill": ["p"]}), "t")
    with pytest.raises(ConfigError, match="'r' is not a decode process"):
        parse_topology(topo({"name": "g", "role": "smg", "prefill": ["p"], "decode": ["r"]}), "t")
    with pytest.raises(ConfigError, match="at most one smg"):
        g = {"role": "smg", "prefill": ["p"], "decode": ["d"]}
        parse_topology(topo({"name": "g1", **g}, {"name": "g2", **g}), "t")


def test_smg_launch_binds_loopback_and_passes_each_prefills_bootstrap_port(tmp_path):
    (tmp_path / "smg").touch()
    t = load_topology("smg-2p2d")
    spec = t.process("smg")
    addresses = {"prefill-a": "127.0.0.1:1001", "prefill-b": "127.0.0.1:1002", "decode-a": "127.0.0.1:2001", "decode-b": "127.0.0.1:2002"}
    argv = smg_argv(spec, "127.0.0.1", 3000, 3001, addresses.__getitem__, addresses.__getitem__, python=str(tmp_path / "python"))
    assert argv[:3] == [str(tmp_path / "smg"), "launch", "--pd-disaggregation"]
    joined = " ".join(argv)
    assert "--host 127.0.0.1 --port 3000 --prometheus-host 127.0.0.1 --prometheus-port 3001" in joined
    assert "--prefill grpc://127.0.0.1:1001 1001 --prefill grpc://127.0.0.1:1002 1002" in joined
    assert "--decode grpc://127.0.0.1:2001 --decode grpc://127.0.0.1:2002" in joined
    assert "--shutdown-grace-period-secs 2" in joined and "--prefill-policy round_robin" in joined


def test_a_secured_smg_gets_its_workers_loopback_listeners_and_must_share_their_host(tmp_path):
    from pdgrpc.cluster import Cluster
    from pdgrpc.cluster.errors import ClusterError

    procs = [{"name": "p", "role": "prefill", "host": "a"}, {"name": "d", "role": "decode", "host": "a"},
             {"name": "r", "role": "router", "prefill": ["p"], "decode": ["d"], "host": "a"},
             {"name": "g", "role": "smg", "prefill": ["p"], "decode": ["d"], "host": "a"}]
    hosts = {"a": {"netns": "ns-a", "address": "10.77.0.1"}, "b": {"netns": "ns-b", "address": "10.77.0.2"}}
    (tmp_path / "smg").touch()
    same = Cluster(parse_topology({"network": {}, "process": procs}, "t"), hosts=hosts, auth_token="auto", log_dir=tmp_path / "1",
                   python=str(tmp_path / "python"))
    gateway = {name: same.procs[name].gateway_address for name in ("p", "d")}
    assert all(a and a.startswith("127.0.0.1:") for a in gateway.values()), gateway
    assert f"--gateway-listen {gateway['d']}" in " ".join(same.procs["d"].argv)
    smg = " ".join(same.procs["g"].argv)
    assert f"--decode grpc://{gateway['d']}" in smg and f"--prefill grpc://{gateway['p']}" in smg
    # The api key reaches smg in-process, from its file: it is on no command line.
    key = (tmp_path / "1" / "security" / "smg-api-key").read_text().strip()
    assert "-m pdgrpc.cluster.smg_launch " in smg and "--api-key" not in smg and key not in smg
    apart = [{**p, "host": "b"} if p["name"] == "d" else p for p in procs]
    with pytest.raises(ClusterError, match="'d' on a loopback listener only"):
        Cluster(parse_topology({"network": {}, "process": apart}, "t"), hosts=hosts, auth_token="auto", log_dir=tmp_path / "2")


def test_smg_launch_hands_smg_a_key_that_begins_with_a_dash(tmp_path, monkeypatch):
    # A random url-safe key begins with "-" one time in 64; smg's parser must still read it as the value.
    launch_router = pytest.importorskip("smg.launch_router", reason="the smg gateway is not installed")
    from pdgrpc.cluster.smg_launch import main

    seen = []
    monkeypatch.setattr(launch_router, "launch_router", seen.append)
    key_file = tmp_path / "smg-api-key"
    key_file.write_text("-Kx2_dash-first\n")
    key_file.chmod(0o600)
    assert main([str(key_file), "launch", "--host", "127.0.0.1"]) == 0
    assert [args.api_key for args in seen] == ["-Kx2_dash-first"]
