"""The cluster launcher as a user runs it: ``python -m pdgrpc.cluster TOPOLOGY``, and the
topology files it reads.

Real processes: the CLI is started as a subprocess, driven through the router address
it prints, then stopped with SIGINT -- or one of its children is killed, which must stop
the whole cluster with a non-zero exit and that child's log tail. Afterwards no process
of the cluster (prefill DP workers included) may be left.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from pdgrpc.cluster import Cluster, ClusterError, load_topology
from pdgrpc.cluster.client import generate
from pdgrpc.cluster.topology import parse_topology, servers_dir
from pdgrpc.errors import ConfigError
from tests.scrape import scrape
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub
from tests.eventually import eventually

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]


def test_every_shipped_topology_loads():
    names = sorted(p.stem for p in servers_dir().glob("*.toml"))
    assert {"1p1d", "prefill-dp2-round-robin", "prefill-dp2-follow-room"} <= set(names)
    for name in names:
        assert load_topology(name).router.role in ("router", "colocated")
    engines = {tuple(sorted(load_topology(n).engine.items())) for n in names}
    # Every topology runs the same engine, so one colocated reference serves them all.
    assert len(engines) == 1


@pytest.mark.parametrize(
    "change, message",
    [
        ({"transport": "carrier-pigeon"}, "transport must be one of"),
        ({"process": [{"name": "r", "role": "router", "prefill": ["p"], "decode": ["d"]}]}, "'p' is not a prefill process"),
        ({"process": [{"name": "x", "role": "gpu"}]}, "role must be one of"),
        ({"process": [{"name": "d", "role": "decode", "args": {"port": 5}}]}, "--port is set by the launcher"),
        ({"process": [{"name": "d", "role": "decode"}, {"name": "d", "role": "decode"}]}, "unique"),
        ({"process": [{"name": "p", "role": "prefill", "bootstrap": "nowhere"}]}, "not a bootstrap process"),
        ({"process": [{"name": "d", "role": "decode"}]}, "exactly one router"),
        ({"unknown": 1}, "unknown top-level keys"),
        ({"metrics": "yes"}, "metrics must be true or false"),
        ({"process": [{"name": "d", "role": "decode", "restart": "no"}]}, "restart must be true or false"),
        ({"process": [{"name": "d", "role": "decode", "args": {"metrics-port": 5}}]}, "--metrics-port is set by the launcher"),
    ],
)
def test_bad_topologies_are_refused_naming_the_problem(change, message):
    data = {"transport": "tcp", "process": []}
    data.update(change)
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_topology(data, "bad")


def test_metrics_ports_for_every_server_and_each_prefill_worker(tmp_path):
    # Nothing is started: this checks the ports and flags the launcher hands out.
    assert Cluster("prefill-dp2-round-robin", transport="tcp", log_dir=tmp_path).metrics_endpoints() == {}
    c = Cluster("prefill-dp2-round-robin", transport="tcp", log_dir=tmp_path, metrics=True)
    endpoints = c.metrics_endpoints()
    assert set(endpoints) == {"bootstrap", "prefill", "prefill/dp0", "prefill/dp1", "decode", "router"}
    ports = {name: int(addr.rpartition(":")[2]) for name, addr in endpoints.items()}
    assert len(set(ports.values()) | {p.port for p in c.procs.values()}) == len(ports) + len(c.procs)
    # The prefill's workers listen on its --metrics-port + 1 + rank (derived_metrics_port).
    assert (ports["prefill/dp0"], ports["prefill/dp1"]) == (ports["prefill"] + 1, ports["prefill"] + 2)
    for name in ("bootstrap", "prefill", "decode", "router"):
        argv = c.procs[name].argv
        assert argv[argv.index("--metrics-port") + 1] == str(ports[name])
    assert c.metrics_endpoints("decode") == {"decode": endpoints["decode"]}
    assert "metrics dp1: http://" in c.describe()


def test_missing_topology_names_the_directory():
    with pytest.raises(ConfigError, match="no such file"):
        load_topology("no-such-topology")


def _start_cli(topology: str, log_dir: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pdgrpc.cluster", topology, "--transport", "tcp", "--log-dir", str(log_dir), "--grace", "5", "--insecure", *flags],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def _wait_router(cli: subprocess.Popen, timeout: float = 150, metrics: dict[str, str] | None = None) -> tuple[str, dict[str, int]]:
    """Read the CLI's stdout until it prints the router address; returns it and the pids
    (and fills ``metrics``: the metrics endpoints listed, by process name or name/dp<r>)."""
    assert cli.stdout is not None
    deadline = time.monotonic() + timeout
    pids: dict[str, int] = {}
    name = ""
    for line in cli.stdout:
        m = re.match(r"\s+(\S+)\s+\S+\s+\S+\s+pid (\d+)", line)
        if m:
            name = m.group(1)
            pids[name] = int(m.group(2))
        m = re.search(r"metrics( dp\d+)?: http://(\S+)/metrics", line)
        if m and metrics is not None and name:
            metrics[name + (f"/{m.group(1).strip()}" if m.group(1) else "")] = m.group(2)
        m = re.search(r"listening on (\S+)", line)
        if m:
            return m.group(1), pids
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"the cluster never printed its router address; stderr: {cli.stderr.read() if cli.stderr else ''}")


def _cluster_pids(pids: dict[str, int], log_dir: Path) -> list[int]:
    """The children the CLI printed plus the prefill's DP workers (from its ready line)."""
    out = list(pids.values())
    for line in (log_dir / "prefill.log").read_text().splitlines():
        if line.startswith("PDGRPC_READY "):
            out += json.loads(line.split(" ", 1)[1]).get("worker_pids", [])
    return out


def _role(endpoint: str) -> str:
    return endpoint.split("/")[0]  # the process names of these topologies are their roles


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but not yet reaped by its parent: it holds nothing.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    eventually(lambda: not any(_alive(p) for p in pids), timeout, 0.1, lambda: f"left behind: {[p for p in pids if _alive(p)]}")


def test_cli_serves_then_stops_everything_on_sigint(tmp_path):
    cli = _start_cli("prefill-dp2-round-robin", tmp_path, "--metrics")
    try:
        metrics: dict[str, str] = {}
        router, pids = _wait_router(cli, metrics=metrics)
        assert set(pids) == {"bootstrap", "prefill", "decode", "router"}
        all_pids = _cluster_pids(pids, tmp_path)
        assert len(all_pids) == 6  # 4 processes + 2 prefill DP workers

        async def one() -> str:
            async with grpc.aio.insecure_channel(router) as ch:
                return (await generate(GenerateServiceStub(ch), prompt="hello", max_new_tokens=4)).finish_reason

        assert asyncio.run(one()) == "length"
        # --metrics: every server's endpoint is listed and answers; the request is counted
        # once by the router, the decode, and the prefill worker that ran it.
        assert set(metrics) == {"bootstrap", "prefill", "prefill/dp0", "prefill/dp1", "decode", "router"}
        scrapes = {k: scrape(v) for k, v in metrics.items()}
        finished = {
            k: s.value("pdgrpc_requests_total", role=_role(k), state="finished")
            for k, s in scrapes.items() if k != "bootstrap"
        }
        assert finished["router"] == finished["decode"] == 1
        assert finished["prefill"] == 0 and finished["prefill/dp0"] + finished["prefill/dp1"] == 1
        cli.send_signal(signal.SIGINT)
        out, err = cli.communicate(timeout=60)
        assert cli.returncode == 0, err
        assert "cluster stopped" in out
        _wait_gone(all_pids)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()


def test_a_dying_child_comes_back_and_serves_restart_drains_one_and_one_with_restart_false_stops_all(tmp_path):
    """The decode comes back after a SIGKILL and after ``restart``; the router (``restart =
    false``) SIGKILLed stops the whole cluster, exit 1 with the router's log tail."""
    topology = tmp_path / "1p1d-router-no-restart.toml"
    text = (servers_dir() / "1p1d.toml").read_text()
    topology.write_text(text.replace('role = "router"\n', 'role = "router"\nrestart = false\n', 1))
    cli = _start_cli(str(topology), tmp_path)
    try:
        router, pids = _wait_router(cli)

        async def one() -> tuple[int, ...]:
            async with grpc.aio.insecure_channel(router) as ch:
                return (await generate(GenerateServiceStub(ch), prompt="hello", max_new_tokens=4, timeout=10)).token_ids

        before = asyncio.run(one())
        os.kill(pids["decode"], signal.SIGKILL)
        # The launcher logs why and starts it again on the same port; it serves again.
        eventually(lambda: "[cluster] exited with code -9" in (tmp_path / "decode.log").read_text(), 30, 0.2, "no restart logged")

        def serves() -> bool:
            try:
                return asyncio.run(one()) == before
            except grpc.RpcError:
                return False

        eventually(serves, 90, 0.5, "the restarted decode never served")
        assert cli.poll() is None
        state = json.loads((tmp_path / "cluster.json").read_text())["processes"]
        assert state["decode"]["pid"] != pids["decode"]
        # A planned restart: the decode drains, exits 0 and comes back.
        done = subprocess.run(
            [sys.executable, "-m", "pdgrpc.cluster", "restart", "decode", "--log-dir", str(tmp_path)],
            cwd=REPO, capture_output=True, text=True, timeout=150,
        )
        assert done.returncode == 0, done.stderr
        assert re.search(r"decode: drained \(pid \d+\), restarted \(pid \d+\), serving", done.stdout)
        assert "[cluster] exited with code 0" in (tmp_path / "decode.log").read_text()
        assert asyncio.run(one()) == before
        state = json.loads((tmp_path / "cluster.json").read_text())["processes"]
        all_pids = _cluster_pids({n: p["pid"] for n, p in state.items()}, tmp_path)
        os.kill(pids["router"], signal.SIGKILL)
        out, err = cli.communicate(timeout=60)
        assert cli.returncode == 1
        assert f"router process 'router' (pid {pids['router']}) exited with code -9" in err
        assert "finished request_id=" in err  # the tail of the router's own log: its last requests
        _wait_gone(all_pids)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()


def test_restart_names_what_is_wrong(tmp_path):
    run = [sys.executable, "-m", "pdgrpc.cluster", "restart", "decode", "--log-dir", str(tmp_path)]
    done = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no running cluster's state here" in done.stderr
    (tmp_path / "cluster.json").write_text(json.dumps({"processes": {"router": {"role": "router", "address": "x", "pid": 1}}, "client": {}}))
    done = subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no process 'decode'" in done.stderr and "router" in done.stderr


async def test_a_process_that_cannot_start_fails_the_start_with_its_log(tmp_path):
    topology = parse_topology(
        {
            "transport": "tcp",
            "process": [
                {"name": "prefill", "role": "prefill"},
                {"name": "decode", "role": "decode", "args": {"num-slots": "many"}},
                {"name": "router", "role": "router", "prefill": ["prefill"], "decode": ["decode"]},
            ],
        },
        "broken",
    )
    cluster = Cluster(topology, log_dir=tmp_path, start_timeout=120)
    with pytest.raises(ClusterError) as err:
        await cluster.start()
    assert "'decode'" in str(err.value) and "argument --num-slots: expected whole slots, got 'many'" in str(err.value)
    pids = [p.pid for p in cluster.procs.values() if p.pid is not None]
    assert len(pids) == 3
    _wait_gone(pids)
