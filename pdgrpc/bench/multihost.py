"""``python -m pdgrpc.bench multihost``: discovery convergence and TTFT across hosts.

Needs root and ``etcd``: it makes four hosts (network namespaces h1..h4 on a private /24,
:mod:`pdgrpc.cluster.netns`), then runs the measurements on h1 (everything it dials lives
there or on the other hosts):

* **view convergence**: a real etcd on h1 and a :class:`~pdgrpc.discovery.etcd.Watcher`
  (what the router runs). ``join``: a :class:`~pdgrpc.discovery.etcd.Registration` starts
  -> the watcher lists it. ``leave (revoke)``: the registration closes (a clean shutdown)
  -> gone from the view. ``leave (SIGKILL)``: a process on h3 that registered with
  ``--lease-ttl`` is killed -> gone from the view (bounded by the TTL: the number to
  compare with it). p50 and p99 of each.
* **TTFT over hosts vs loopback**: ``servers/multihost.toml`` (prefill on h2, decodes on h3
  and h4, router on h1, found through etcd) against ``servers/1p1d.toml`` on h1's loopback,
  same transport, requests alternating between the two; client-measured TTFT p50/p99 and
  the ratio to loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import grpc

from pdgrpc.bench.report import Result, percentile

if TYPE_CHECKING:
    from pdgrpc.discovery.server import EtcdProcess

DESCRIPTION = (
    "etcd discovery across hosts (network namespaces): the router view's convergence after a join or leave "
    "(p50/p99), and TTFT over hosts vs loopback"
)
_INNER = "PDGRPC_BENCH_MULTIHOST_INNER"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", default="tcp", choices=("tcp", "rdma"), help="data plane for the TTFT part (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=20, help="joins and revokes measured (default: %(default)s)")
    p.add_argument("--kills", type=int, default=3, help="SIGKILLed registrations measured (each waits out the TTL) (default: %(default)s)")
    p.add_argument("--lease-ttl", type=int, default=2, help="lease TTL of the killed registrations, seconds (default: %(default)s)")
    p.add_argument("--requests", type=int, default=40, help="TTFT requests per system (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length of the TTFT requests (default: %(default)s)")


def run(args: argparse.Namespace) -> list[Result]:
    if os.environ.get(_INNER):
        from pdgrpc.rpc.server import run as run_loop

        return run_loop(_inner(args))
    from pdgrpc.cluster.hosts import HOSTS_ENV
    from pdgrpc.cluster.netns import NetworkHosts, remove_stale

    remove_stale()
    with NetworkHosts(["h1", "h2", "h3", "h4"]) as hosts, tempfile.TemporaryDirectory(prefix="pdgrpc-bench-mh-") as tmp:
        out = Path(tmp) / "results.json"
        argv = [sys.executable, "-m", "pdgrpc.bench", "multihost", "--json", str(out), "--transport", args.transport,
                "--rounds", str(args.rounds), "--kills", str(args.kills), "--lease-ttl", str(args.lease_ttl),
                "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens)]
        env = {**os.environ, _INNER: "1", HOSTS_ENV: json.dumps(hosts.describe())}
        subprocess.run([*hosts.exec_prefix("h1"), *argv], env=env, check=True, stdout=subprocess.DEVNULL)
        data = json.loads(out.read_text())
    return [Result(**r) for r in data["results"]]


async def _inner(args: argparse.Namespace) -> list[Result]:
    from pdgrpc.discovery.server import EtcdProcess

    hosts = json.loads(os.environ["PDGRPC_HOSTS"])
    with EtcdProcess.start_on(hosts["h1"]["address"]) as etcd:
        results = await _convergence(args, etcd, hosts)
    results += await _ttft(args)
    return results


async def _convergence(args: argparse.Namespace, etcd: EtcdProcess, hosts: dict[str, dict[str, str]]) -> list[Result]:
    from pdgrpc.discovery.etcd import Registration, Watcher, parse_discovery_url
    from pdgrpc.discovery.record import Instance, MembershipView, cluster_prefix, instance_key

    endpoints = parse_discovery_url(etcd.url)
    watcher = Watcher(endpoints, MembershipView(cluster_prefix("bench")))
    watcher.start()
    await asyncio.wait_for(watcher.synced.wait(), 10)

    def live() -> set[str]:
        return {i.instance_id for i in watcher.view.instances("decode")}

    async def until(cond: Callable[[], bool], timeout: float) -> float:
        t0 = time.perf_counter()
        while not cond():
            version = watcher.view.version
            if not await watcher.wait_changed(version, timeout):
                raise TimeoutError("the view did not change")
        return time.perf_counter() - t0

    joins: list[float] = []
    revokes: list[float] = []
    kills: list[float] = []
    try:
        for i in range(args.rounds):
            iid = f"d{i}"
            inst = Instance(role="decode", instance_id=iid, address=f"{hosts['h3']['address']}:7000", transport="tcp", compat_hash="ab" * 32)
            reg = Registration(endpoints, instance_key("bench", "decode", iid), inst, ttl=10)
            t0 = time.perf_counter()
            reg.start()
            await until(lambda: iid in live(), 10)
            joins.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await reg.close()
            await until(lambda: iid not in live(), 10)
            revokes.append(time.perf_counter() - t0)
        for i in range(args.kills):
            iid = f"k{i}"
            script = textwrap.dedent(f"""
                import asyncio, sys
                from pdgrpc.discovery.etcd import Registration, parse_discovery_url
                from pdgrpc.discovery.record import Instance, instance_key
                async def main():
                    inst = Instance(role="decode", instance_id={iid!r}, address="{hosts['h3']['address']}:7000", transport="tcp", compat_hash="ab" * 32)
                    reg = Registration(parse_discovery_url({etcd.url!r}), instance_key("bench", "decode", {iid!r}), inst, ttl={args.lease_ttl})
                    reg.start()
                    await asyncio.sleep(3600)
                asyncio.run(main())
            """)
            proc = subprocess.Popen(["ip", "netns", "exec", hosts["h3"]["netns"], sys.executable, "-c", script])
            try:
                await until(lambda: iid in live(), 30)
                await asyncio.sleep(args.lease_ttl / 2)  # mid-lease, as a crash would be
                t0 = time.perf_counter()
                proc.send_signal(signal.SIGKILL)
                await until(lambda: iid not in live(), args.lease_ttl + 10)
                kills.append(time.perf_counter() - t0)
            finally:
                proc.kill()
                proc.wait()
    finally:
        await watcher.close()
    out = []
    for case, xs in (("view: join", joins), ("view: leave (revoke)", revokes), (f"view: leave (SIGKILL, ttl {args.lease_ttl} s)", kills)):
        if xs:
            out += [Result(case, "p50", percentile(xs, 0.5) * 1e3, "ms"), Result(case, "p99", percentile(xs, 0.99) * 1e3, "ms")]
    return out


async def _ttft(args: argparse.Namespace) -> list[Result]:
    from pdgrpc.cluster.client import generate
    from pdgrpc.cluster.launcher import Cluster
    from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub

    ids = [1 + (i * 7) % 250 for i in range(args.prompt_tokens)]
    samples: dict[str, list[float]] = {"hosts": [], "loopback": []}
    async with Cluster("multihost", transport=args.transport) as remote, Cluster("1p1d", transport=args.transport) as local:
        chans = {"hosts": grpc.aio.insecure_channel(remote.router_address), "loopback": grpc.aio.insecure_channel(local.router_address)}
        try:
            stubs = {k: GenerateServiceStub(c) for k, c in chans.items()}
            for name, stub in stubs.items():  # warm-up; the hosts' router may need a moment to see both sides
                for _ in range(50):
                    try:
                        await generate(stub, input_ids=ids, max_new_tokens=1, timeout=30)
                        break
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() != grpc.StatusCode.UNAVAILABLE:
                            raise
                        await asyncio.sleep(0.2)
                for _ in range(3):
                    await generate(stub, input_ids=ids, max_new_tokens=1, timeout=30)
            for i in range(args.requests):
                order = ["hosts", "loopback"] if i % 2 == 0 else ["loopback", "hosts"]
                for name in order:
                    done = await generate(stubs[name], input_ids=ids, max_new_tokens=1, timeout=30)
                    samples[name].append(done.client_ttft_seconds)
        finally:
            for c in chans.values():
                await c.close()
    base = statistics.median(samples["loopback"])
    out = []
    for name in ("loopback", "hosts"):
        p50 = statistics.median(samples[name])
        case = f"TTFT {args.transport} {args.prompt_tokens} tokens, {name}"
        out.append(Result(case, "p50", p50 * 1e3, "ms", None if name == "loopback" else base * 1e3,
                          None if name == "loopback" else p50 / base))
        out.append(Result(case, "p99", percentile(samples[name], 0.99) * 1e3, "ms"))
    return out
