"""Shared pieces of the multi-host tests: hosts (network namespaces), a real etcd on one of
them, servers started on chosen hosts with ``--discovery``, and an agent on the router's
host that sends requests (nothing outside the namespaces can reach their addresses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from pdgrpc.cluster.netns import DEVICE, NetworkHosts, netns_unavailable_reason
from pdgrpc.discovery.server import ETCD_PACKAGE_HINT, EtcdProcess, find_etcd

ENGINE = ["--model-size", "tiny", "--page-size", "16", "--kv-dtype", "float32", "--max-prompt-tokens", "1024"]
CLUSTER = "mh"
TTL = 2  # seconds: short, so lease expiry fits the test budget
ETCD_PORT = 2379
SERVER_PORT = 7000  # each host has its own port space


def skip_unless_multihost() -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    if find_etcd() is None:
        pytest.skip(f"multi-host tests need a real etcd: {ETCD_PACKAGE_HINT}")


class Agent:
    """``python -m pdgrpc.cluster.agent`` on one host, driven over its pipes."""

    def __init__(self, hosts: NetworkHosts | str, host: str = "") -> None:
        """On ``host`` of ``hosts``, or in the network namespace named ``hosts``."""
        prefix = ["ip", "netns", "exec", hosts] if isinstance(hosts, str) else hosts.exec_prefix(host)
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "pdgrpc.cluster.agent"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )

    def ask(self, **order: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(order) + "\n")
        line = self.proc.stdout.readline()
        assert line, f"the agent exited (code {self.proc.poll()})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Server:
    """One pdgrpc server process on one host."""

    def __init__(
        self, hosts: NetworkHosts, host: str, role: str, log_dir: Path, name: str, transport: str, *extra: str,
        cluster: str = CLUSTER, wildcard: bool = False,
    ) -> None:
        """``wildcard``: listen on 0.0.0.0 and advertise the host's address (--advertise-host)."""
        ip = hosts.address(host)
        self.name = name
        self.host = host
        self.address = f"{ip}:{SERVER_PORT}"
        listen = ["--host", "0.0.0.0", "--advertise-host", ip] if wildcard else ["--host", ip]
        # The hosts are namespaces on a bridge this test made; --insecure acknowledges listening
        # there in plaintext (docs/security.md covers the secured setup).
        argv = [*hosts.exec_prefix(host), sys.executable, "-m", f"pdgrpc.{role}", *listen, "--port", str(SERVER_PORT),
                "--insecure"]
        if role in ("prefill", "decode"):
            argv += ["--transport", transport, "--transport-host", ip, *ENGINE]
        argv += ["--discovery", f"etcd://{hosts.address('h1')}:{ETCD_PORT}", "--cluster-name", cluster]
        if role != "router":
            argv += ["--discovery-ttl", str(TTL), "--instance-id", name]
        argv += list(extra)
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               # Hosts share one kernel: keep UCX off shared memory and on the hosts' own link.
               "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": DEVICE}
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of its group (a prefill's workers)
        except ProcessLookupError:
            pass
        self.proc.wait()


def wait_serving(agent: Agent, server: Server, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, f"{server.name} exited with code {server.proc.returncode}:\n{server.log()[-3000:]}"
        if agent.ask(op="health", address=server.address).get("serving"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{server.name} not serving within {timeout:.0f} s:\n{server.log()[-3000:]}")


def hosts_with_etcd(n: int, tmp: Path) -> Iterator[tuple[NetworkHosts, EtcdProcess]]:
    """``n`` hosts h1..hn, and etcd running on h1; both removed afterwards, whatever happened."""
    skip_unless_multihost()
    hosts = NetworkHosts([f"h{i}" for i in range(1, n + 1)]).create()
    etcd = None
    try:
        etcd = EtcdProcess(hosts.address("h1"), ETCD_PORT, ETCD_PORT + 1, data_dir=tmp / "etcd",
                           prefix=hosts.exec_prefix("h1"), log_path=tmp / "etcd.log")
        etcd.start()
        yield hosts, etcd
    finally:
        if etcd is not None:
            etcd.close()
        hosts.close()
