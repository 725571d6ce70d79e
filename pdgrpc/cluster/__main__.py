"""``python -m pdgrpc.cluster TOPOLOGY``: run a topology locally until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from pdgrpc.argtypes import positive_seconds, seconds
from pdgrpc.cluster.hosts import HOSTS_ENV
from pdgrpc.cluster.launcher import Cluster, ClusterError, restart_running
from pdgrpc.cluster.netns import NetnsUnavailable, NetworkHosts, remove_stale
from pdgrpc.cluster.topology import SECURITY_MODES, TRANSPORTS, Topology, load_topology, servers_dir
from pdgrpc.errors import ConfigError
from pdgrpc.rpc.server import run

DESCRIPTION = f"""\
Start a topology (a file in {servers_dir()}, or its name: 1p1d,
prefill-dp2-round-robin, prefill-dp2-follow-room) as a local cluster on 127.0.0.1 with
free ports; wait until every process answers its gRPC health check; print the router's
address; run until SIGINT/SIGTERM, then stop every process (SIGTERM, SIGKILL after the
grace period). A process that dies is started again on the same port (at once, then with
an exponential backoff while it keeps dying), unless its topology entry says
restart = false: then the cluster stops, its log tail is printed and the exit code is 1,
as for any failure at start-up. Each process logs to LOG_DIR/<name>.log.

`python -m pdgrpc.cluster restart NAME --log-dir LOG_DIR` restarts one process of the
cluster running with LOG_DIR gently: it drains (new requests go to other instances, the
running ones finish), exits, and its launcher starts it again; the command returns once
it serves. One process at a time, that is a rolling restart."""

RESTART_DESCRIPTION = """Restart process NAME of the cluster that `python -m pdgrpc.cluster` runs with LOG_DIR:
SIGTERM makes it drain (health NOT_SERVING, new requests refused and sent elsewhere by the
router, the running ones finish, up to its --drain-timeout) and exit; the launcher starts
it again on the same port. Returns once it answers SERVING (exit 0), else exit 1."""


def build_restart_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.cluster restart", description=RESTART_DESCRIPTION)
    p.add_argument("name", help="the process to restart (its name in the topology)")
    p.add_argument("--log-dir", required=True, help="the LOG_DIR of the running cluster (it holds cluster.json)")
    p.add_argument("--timeout", type=positive_seconds, default=120.0, metavar="SECONDS", help="how long to wait until it serves again (default: %(default)s)")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.cluster", description=DESCRIPTION)
    p.add_argument("topology", help="topology file (servers/1p1d.toml) or name (1p1d)")
    p.add_argument("--transport", choices=TRANSPORTS, help="KV transport for every prefill and decode (default: the topology's)")
    p.add_argument("--log-dir", help="directory for the processes' logs (default: a fresh temporary directory, kept after the cluster stops)")
    p.add_argument("--start-timeout", type=positive_seconds, default=180.0, metavar="SECONDS", help="how long to wait for every process to be healthy (default: %(default)s)")
    p.add_argument(
        "--metrics", action="store_true",
        help="every server serves Prometheus metrics on a free port (listed once the cluster runs); "
        "also on when the topology says metrics = true",
    )
    p.add_argument(
        "--tls", choices=SECURITY_MODES,
        help="'auto': a throwaway CA (its key deleted once it has signed) and one certificate per process in "
        "LOG_DIR/security, naming its role; every process serves mTLS and presents its certificate "
        "(clients use security/client.pem, client.key, ca.pem). "
        "Behind smg, each worker also serves smg on a loopback listener that grants the gateway role alone, and "
        "smg's HTTP side takes only LOG_DIR/security/smg-api-key as its bearer token. "
        "Default: the topology's [security], else auto (off with --insecure)",
    )
    p.add_argument(
        "--auth-token", choices=SECURITY_MODES,
        help="'auto': one random bearer token per role in LOG_DIR/security/tokens (clients present tokens/client); "
        "every process sends its role's and requires one. Default: the topology's [security] auth-token, else off",
    )
    p.add_argument(
        "--insecure", action="store_true",
        help="plain mode: without --tls or a [security] table, every process serves plaintext without a token, so "
        "any local process can call every RPC (a warning says so)",
    )
    p.add_argument("--grace", type=seconds, default=10.0, metavar="SECONDS", help="how long processes may take to exit after SIGTERM before SIGKILL (default: %(default)s)")
    return p


def tls_mode(args: argparse.Namespace, topology: Topology) -> str | None:
    """The launcher's ``tls``: what --tls or the topology's [security] says, else mTLS with
    roles; plain mode (logged) with --insecure."""
    if args.insecure and args.tls == "auto":
        raise ConfigError("--insecure runs the cluster in plaintext: drop it, or --tls auto")
    if args.tls or topology.tls or topology.security_files:
        return str(args.tls) if args.tls else None
    if args.insecure:
        print("plain mode (--insecure): no TLS; without --auth-token any local process can call every RPC of the cluster",
              file=sys.stderr, flush=True)
        return "off"
    return "auto"


async def _main(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology)
    cluster = Cluster(topology, transport=args.transport, log_dir=args.log_dir, keep_logs=True,
                      start_timeout=args.start_timeout, grace=args.grace, metrics=True if args.metrics else None,
                      tls=tls_mode(args, topology), auth_token=args.auth_token, supervise=True)
    loop = asyncio.get_running_loop()
    stop: asyncio.Future[int] = loop.create_future()

    def on_signal(signum: int) -> None:
        if not stop.done():
            stop.set_result(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, on_signal, s)
    print(f"starting {cluster.describe()}", flush=True)
    start = asyncio.ensure_future(cluster.start())
    starting: list[asyncio.Future[Any]] = [start, stop]  # a start and a signal: no common result type
    await asyncio.wait(starting, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # interrupted while starting
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await cluster.stop()
        return 130
    try:
        start.result()
    except ClusterError as exc:
        print(f"cluster failed to start: {exc}", file=sys.stderr)
        return 1
    print(f"{cluster.describe()}\nrouter (GenerateService) listening on {cluster.router_address}", flush=True)
    if cluster.topology.by_role("smg"):
        print(f"smg (OpenAI API) base URL: {cluster.openai_base_url}", flush=True)
    print("Ctrl-C to stop", flush=True)
    died = asyncio.ensure_future(cluster.wait_failure())
    running: list[asyncio.Future[Any]] = [died, stop]
    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if died.done():
        print(f"cluster stopping: {died.result()}", file=sys.stderr)
        code = 1
    else:
        died.cancel()
        print(f"{signal.Signals(stop.result()).name}: stopping the cluster", flush=True)
    await cluster.stop()
    print(f"cluster stopped; logs in {cluster.log_dir}", flush=True)
    return code


def _on_hosts(args: argparse.Namespace, argv: list[str]) -> int:
    """Make the topology's hosts (network namespaces), run this command again on the front
    door's host with the host map in the environment, and remove the hosts afterwards
    (also after a failure or a signal)."""

    topology = load_topology(args.topology)
    remove_stale()
    with NetworkHosts(topology.hosts, topology.subnet) as hosts:
        print(f"hosts: {json.dumps(hosts.describe())}", flush=True)
        env = {**os.environ, HOSTS_ENV: json.dumps(hosts.describe())}
        child = subprocess.Popen([*hosts.exec_prefix(topology.router.host), sys.executable, "-m", "pdgrpc.cluster", *argv], env=env)
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, lambda signum, _frame: child.send_signal(signum))
        return child.wait()


def _restart(argv: list[str]) -> int:
    args = build_restart_parser().parse_args(argv)
    try:
        print(run(restart_running(args.log_dir, args.name, args.timeout)), flush=True)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _make_log_dir(path: str) -> None:
    """Make --log-dir, or raise ConfigError naming the flag: a path the launcher cannot
    make a directory (a file, a directory without write access) fails before any process
    starts, as one line."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--log-dir {path!r} cannot be made a directory: {exc.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["restart"]:
        return _restart(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.log_dir is not None:
            _make_log_dir(args.log_dir)
        if load_topology(args.topology).subnet and HOSTS_ENV not in os.environ:
            return _on_hosts(args, argv)
        return run(_main(args))
    except (ConfigError, ClusterError, NetnsUnavailable) as exc:  # ClusterError: a cluster refused before it starts (no etcd here)
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
