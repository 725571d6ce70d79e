"""``python -m pdgrpc.bench bootstrap``: BootstrapService latency, throughput, memory.

The server runs as its own process (``python -m pdgrpc.bootstrap`` on 127.0.0.1, a
free port), so client and server never share an event loop or a GIL; the client is
one :class:`BootstrapClient` on uvloop over one pooled channel. Cases:

* ``ping``: ``grpc.health.v1.Health/Check`` on the same server and channel: a plain
  grpc.aio unary ping-pong, the floor every other call stands on (the *baseline*).
* ``register 1 room`` / ``query 1 room``: p50 and p99 of single-room calls (fresh
  rooms for register; registered rooms for query).
* ``query N rooms`` for N = 1, 32, 1024: p50 and p99, every room found.
* ``register batches of B``: rooms registered per second, batches sent back to back.
* ``memory``: server RSS holding ``--memory-rooms`` rooms, and its growth from empty.
* ``expiry``: the same rooms expire (short TTL) while the client pings; the worst
  ping during the expiry wave shows the longest pause the server took.

Targets (issue 2, set by SGLang's HTTP bootstrap measured on the same 2-core machine):
single-room p50 < 0.45 ms, 1024-room query p50 < 1 ms, >= 200k rooms/s in batches,
1M rooms well under 200 MB RSS, no expiry pause over 10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import time
from typing import Awaitable, Callable

from pdgrpc.bench.report import Result
from pdgrpc.rpc.tuning import apply_grpc_defaults

# Like every pdgrpc entry point, run gRPC with pdgrpc's settings (client here, and the
# server subprocess, which inherits the environment). PDGRPC_GRPC_DEFAULTS=0 measures
# grpc's own defaults instead. Must happen before grpc is imported.
GRPC_DEFAULTS = apply_grpc_defaults()

DESCRIPTION = "BootstrapService: single-room and batched latency, rooms/s, RSS of 1M rooms, pause while they expire"

_LISTEN = re.compile(r"listening on ([\w.:\[\]-]+):(\d+)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=2000, help="calls per latency case (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=300, help="untimed calls before each latency case (default: %(default)s)")
    p.add_argument("--batch", type=int, default=65536, help="rooms per RegisterDpRanks call in the throughput case (default: %(default)s)")
    p.add_argument("--throughput-rooms", type=int, default=1 << 20, help="rooms registered in the throughput case (default: %(default)s)")
    p.add_argument("--memory-rooms", type=int, default=1_000_000, help="rooms for the memory and expiry cases; 0 skips them (default: %(default)s)")
    p.add_argument("--expiry-ttl", type=float, default=5.0, help="TTL (s) of the server in the memory and expiry cases (default: %(default)s)")


class ServerProcess:
    """``python -m pdgrpc.bootstrap`` on 127.0.0.1, a free port; ``address``, ``rss_mb()``."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "pdgrpc.bootstrap", "--host", "127.0.0.1", "--port", "0", "--log-level", "INFO", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 30
        lines = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = _LISTEN.search(line)
            if m:
                self.address = f"127.0.0.1:{m.group(2)}"
                return
        self.proc.kill()
        raise RuntimeError("bootstrap server did not start:\n" + "".join(lines))

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _interleaved(calls: dict[str, Callable[[int], Awaitable[object]]], iterations: int, warmup: int) -> dict[str, list[float]]:
    """Time every case once per round, round after round, so that load from other
    processes on the machine falls on all cases alike."""
    for i in range(warmup):
        for call in calls.values():
            await call(i)
    out: dict[str, list[float]] = {name: [] for name in calls}
    clock = time.perf_counter
    for i in range(warmup, warmup + iterations):
        for name, call in calls.items():
            t0 = clock()
            await call(i)
            out[name].append(clock() - t0)
    return out


def _rooms(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(63) | 1 for _ in range(n)]


async def _main_cases(address: str, args: argparse.Namespace) -> list[Result]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdgrpc.bootstrap.client import BootstrapClient
    from pdgrpc.rpc.channels import ChannelPool

    pool = ChannelPool()
    client = BootstrapClient(address, pool=pool, timeout=30.0)
    rng = random.Random(1)
    results: list[Result] = []
    it, wu = args.iterations, args.warmup

    health = health_pb2_grpc.HealthStub(client.channel)
    ping_req = health_pb2.HealthCheckRequest()
    known = _rooms(rng, 65536)
    for i in range(0, len(known), 16384):
        await client.register_dp_ranks({r: r % 8 for r in known[i : i + 16384]})
    fresh = _rooms(rng, it + wu)
    sets = {n: [rng.sample(known, n) for _ in range(64)] for n in (32, 1024)}

    async def query(i: int, n: int) -> None:
        res = await client.query_dp_ranks(sets[n][i % 64])
        assert len(res.rooms) == n, (len(res.rooms), n)

    samples = await _interleaved(
        {
            "ping (health Check)": lambda i: health.Check(ping_req, timeout=5),
            "register 1 room": lambda i: client.register_dp_ranks({fresh[i]: 1}),
            "query 1 room": lambda i: client.query_dp_ranks([known[i % len(known)]]),
            "query 32 rooms": lambda i: query(i, 32),
            "query 1024 rooms": lambda i: query(i, 1024),
        },
        it,
        wu,
    )
    base50 = _pct(samples["ping (health Check)"], 0.5) * 1e3
    for case, xs in samples.items():
        p50 = _pct(xs, 0.5) * 1e3
        baseline = None if case.startswith("ping") else base50
        results.append(Result(case, "p50", p50, "ms", baseline, None if baseline is None else p50 / baseline))
        results.append(Result(case, "p99", _pct(xs, 0.99) * 1e3, "ms"))

    total, batch = args.throughput_rooms, args.batch
    rooms = _rooms(rng, total)
    chunks = [{r: r & 7 for r in rooms[i : i + batch]} for i in range(0, total, batch)]
    from pdgrpc.v1 import bootstrap_pb2 as pb

    requests = [pb.RegisterDpRanksRequest(entries=[pb.DpRankEntry(bootstrap_room=r, dp_rank=k) for r, k in c.items()]) for c in chunks]
    t0 = time.perf_counter()
    for req in requests:
        await client.stub.RegisterDpRanks(req, timeout=30)
    dt = time.perf_counter() - t0
    results.append(Result(f"register batches of {batch}", "rooms/s", total / dt, "rooms/s"))
    t0 = time.perf_counter()
    for c in chunks:
        await client.register_dp_ranks(c)  # renewals; includes building the request
    dt = time.perf_counter() - t0
    results.append(Result(f"register batches of {batch} via BootstrapClient", "rooms/s", total / dt, "rooms/s"))
    await pool.close()
    return results


async def _memory_cases(server: ServerProcess, args: argparse.Namespace) -> list[Result]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdgrpc.bootstrap.client import BootstrapClient
    from pdgrpc.rpc.channels import ChannelPool

    pool = ChannelPool()
    client = BootstrapClient(server.address, pool=pool, timeout=30.0)
    health = health_pb2_grpc.HealthStub(client.channel)
    await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    n = args.memory_rooms
    rng = random.Random(2)
    rooms = _rooms(rng, n)
    rss0 = server.rss_mb()
    t_first = time.monotonic()
    for i in range(0, n, 65536):
        await client.register_dp_ranks({r: r & 7 for r in rooms[i : i + 65536]})
    t_last = time.monotonic()
    rss1 = server.rss_mb()
    label = f"memory {n:,} rooms"
    results = [Result(label, "server RSS", rss1, "MB"), Result(label, "RSS growth", rss1 - rss0, "MB")]
    # Expiry: rooms registered in [t_first, t_last] expire in [t_first + ttl, t_last + ttl]
    # (plus up to one sweep interval). Ping all through it and keep the worst.
    end = t_last + args.expiry_ttl + 2.5
    worst, samples = 0.0, []
    req = health_pb2.HealthCheckRequest()
    probe = rooms[-1]
    while time.monotonic() < end:
        t0 = time.perf_counter()
        await client.query_dp_ranks([probe])
        dt = time.perf_counter() - t0
        samples.append(dt)
        worst = max(worst, dt)
        await asyncio.sleep(0.0005)
    await health.Check(req, timeout=5)
    left = await client.query_dp_ranks(rng.sample(rooms, 1024))
    if left.ranks:
        raise RuntimeError(f"{len(left.ranks)} of 1024 sampled rooms survived their TTL")
    label = f"expiry of {n:,} rooms"
    results += [
        Result(label, "worst call", worst * 1e3, "ms"),
        Result(label, "p99 call", _pct(samples, 0.99) * 1e3, "ms"),
        Result(label, "RSS after", server.rss_mb(), "MB"),
    ]
    await pool.close()
    return results


def run(args: argparse.Namespace) -> list[Result]:
    from pdgrpc.rpc.server import run as run_loop

    print(
        f"bootstrap bench: server = python -m pdgrpc.bootstrap in its own process; client = BootstrapClient on uvloop, "
        f"one pooled channel; GRPC_EXPERIMENTS={os.environ.get('GRPC_EXPERIMENTS', '(unset)')}; {os.cpu_count()} CPUs",
        flush=True,
    )

    results: list[Result] = []
    server = ServerProcess()
    try:
        results += run_loop(_main_cases(server.address, args))
    finally:
        server.stop()
    if args.memory_rooms:
        max_rooms = max(1 << 20, args.memory_rooms)
        server = ServerProcess("--dp-rank-ttl", str(args.expiry_ttl), "--max-rooms", str(max_rooms), "--sweep-interval", "0.5")
        try:
            results += run_loop(_memory_cases(server, args))
        finally:
            server.stop()
    return results
