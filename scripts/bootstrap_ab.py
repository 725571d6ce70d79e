"""A/B of two pdgrpc source trees' bootstrap calls, client and server alike, side by side.

    .venv/bin/python scripts/bootstrap_ab.py --rounds 8 --iterations 300 \
        before=/tmp/before-tree now=$PWD [--token]

Each ``NAME=TREE`` runs ``python -m pdgrpc.bootstrap`` from ``TREE`` (through
``PYTHONPATH``, so this venv's packages with that tree's ``pdgrpc``), in its own
process; every round starts one client process per tree, from the same tree, and the
trees take turns (rotated each round) so that load from other processes falls on all
alike. A client times the cases round-robin (empty call = health ``Check``, register 1
room, query 1 and 32 rooms), then the CPU time 200 more calls of each cost its own
process and the server's. ``--token``: servers and clients run with
``--auth-token-file`` (a fresh token). ``--alternate``: servers only: one client, from
this tree, calls the servers in turn call by call (order flipped every call), and
reads each server's CPU time around each call. Printed: per case and tree, the median over
rounds of p50 / client CPU / server CPU per call, and p50 above the empty call.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _cpu_ns(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total


async def _client(address: str, server_pid: int, iterations: int, warmup: int, seed: int, token_file: str | None) -> dict[str, list[float]]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdgrpc.bootstrap.client import BootstrapClient
    from pdgrpc.rpc.channels import ChannelPool
    from pdgrpc.rpc.security import Security, install

    if token_file:
        install(Security(token_file=Path(token_file)))
    pool = ChannelPool()
    client = BootstrapClient(address, pool=pool, timeout=30)
    rng = random.Random(1)
    known = [rng.getrandbits(63) | 1 for _ in range(4096)]
    if seed == 0:
        await client.register_dp_ranks({r: r % 8 for r in known})
    sets = [rng.sample(known, 32) for _ in range(64)]
    fresh_rng = random.Random(1000 + seed)
    fresh = [fresh_rng.getrandbits(63) | 1 for _ in range(iterations + warmup + 200)]
    health = health_pb2_grpc.HealthStub(client.channel)
    ping = health_pb2.HealthCheckRequest()
    cases = {
        "empty call": lambda i: health.Check(ping, timeout=5),
        "register 1 room": lambda i: client.register_dp_ranks({fresh[i]: 1}),
        "query 1 room": lambda i: client.query_dp_ranks([known[i % len(known)]]),
        "query 32 rooms": lambda i: client.query_dp_ranks(sets[i % 64]),
    }
    for i in range(warmup):
        for call in cases.values():
            await call(i)
    times: dict[str, list[float]] = {k: [] for k in cases}
    clock = time.perf_counter
    for i in range(warmup, warmup + iterations):
        for name, call in cases.items():
            t0 = clock()
            await call(i)
            times[name].append(clock() - t0)
    out = {}
    for name, call in cases.items():
        c0, s0 = _cpu_ns(os.getpid()), _cpu_ns(server_pid)
        for i in range(warmup + iterations, warmup + iterations + 200):
            await call(i)
        xs = sorted(times[name])
        out[name] = [xs[len(xs) // 2] * 1e6, (_cpu_ns(os.getpid()) - c0) / 200e3, (_cpu_ns(server_pid) - s0) / 200e3]
    await pool.close()
    return out


async def _alternate(servers: dict[str, tuple[subprocess.Popen[str], str]], rounds: int, iterations: int, token_file: str | None) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdgrpc.bootstrap.client import BootstrapClient
    from pdgrpc.rpc.channels import ChannelPool
    from pdgrpc.rpc.security import Security, install

    if token_file:
        install(Security(token_file=Path(token_file)))
    rng = random.Random(1)
    known = [rng.getrandbits(63) | 1 for _ in range(4096)]
    sets = [rng.sample(known, 32) for _ in range(64)]
    fresh = [rng.getrandbits(63) | 1 for _ in range(iterations * (rounds + 1) * 4 + 10)]
    clients = {}
    for name, (proc, address) in servers.items():
        client = BootstrapClient(address, pool=ChannelPool(), timeout=30)
        await client.register_dp_ranks({r: r % 8 for r in known})
        clients[name] = (client, health_pb2_grpc.HealthStub(client.channel), proc.pid)
    ping = health_pb2.HealthCheckRequest()
    cases = {
        "empty call": lambda c, h, i: h.Check(ping, timeout=5),
        "register 1 room": lambda c, h, i: c.register_dp_ranks({fresh[i]: 1}),
        "query 1 room": lambda c, h, i: c.query_dp_ranks([known[i % len(known)]]),
        "query 32 rooms": lambda c, h, i: c.query_dp_ranks(sets[i % 64]),
    }
    names = list(clients)
    p50s: dict[str, dict[str, list[float]]] = {k: {n: [] for n in names} for k in cases}
    cpu: dict[str, dict[str, list[float]]] = {k: {n: [] for n in names} for k in cases}
    clock, j = time.perf_counter, 0
    for r in range(rounds + 1):  # round 0 warms up
        for case, call in cases.items():
            xs: dict[str, list[float]] = {n: [] for n in names}
            for i in range(iterations):
                j += 1
                for n in names if i % 2 else names[::-1]:
                    client, health, pid = clients[n]
                    s0 = _cpu_ns(pid)
                    t0 = clock()
                    await call(client, health, j)
                    xs[n].append(clock() - t0)
                    if r:
                        cpu[case][n].append((_cpu_ns(pid) - s0) / 1e3)
            if r:
                for n in names:
                    p50s[case][n].append(sorted(xs[n])[iterations // 2] * 1e6)
    print(f"{rounds} rounds x {iterations} calls per case, servers called in turn call by call"
          f"{' (token on)' if token_file else ''}: p50 (median of rounds) / server CPU per call (mean; median), µs")
    print("| case | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for case in cases:
        print(f"| {case} | " + " | ".join(f"{statistics.median(p50s[case][n]):.0f} / {statistics.mean(cpu[case][n]):.0f}; {statistics.median(cpu[case][n]):.0f}" for n in names) + " |")
    for n in names:
        print(n, "empty call p50 per round:", [round(x) for x in p50s["empty call"][n]])


def _start_server(tree: str, token_file: str | None) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "pdgrpc.bootstrap", "--host", "127.0.0.1", "--port", "0", "--log-level", "INFO"]
    if token_file:
        cmd += ["--auth-token-file", token_file]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": tree}, cwd=tempfile.gettempdir())
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.search(r"listening on [\d.]+:(\d+)", line)
        if m:
            return proc, f"127.0.0.1:{m.group(1)}"
    raise SystemExit(f"the server of {tree} did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trees", nargs="*", metavar="NAME=TREE")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--token", action="store_true", help="servers and clients with --auth-token-file")
    p.add_argument("--alternate", action="store_true", help="servers only: one client from this tree calls them in turn, call by call")
    p.add_argument("--client", nargs=5, metavar=("ADDRESS", "PID", "ITERATIONS", "WARMUP", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--token-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        import uvloop

        address, pid, iterations, warmup, seed = args.client
        print(json.dumps(uvloop.run(_client(address, int(pid), int(iterations), int(warmup), int(seed), args.token_file))))
        return
    trees = dict(t.split("=", 1) for t in args.trees)
    token_file = None
    if args.token:
        fd, token_file = tempfile.mkstemp(prefix="pdgrpc-ab-token-")
        os.write(fd, secrets.token_hex(16).encode())
        os.close(fd)
    servers = {name: _start_server(tree, token_file) for name, tree in trees.items()}
    rounds: dict[str, list[dict[str, list[float]]]] = {name: [] for name in trees}
    names = list(trees)
    if args.alternate:
        import uvloop

        try:
            uvloop.run(_alternate(servers, args.rounds, args.iterations, token_file))
        finally:
            for proc, _ in servers.values():
                proc.terminate()
            if token_file:
                os.unlink(token_file)
        return
    try:
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                proc, address = servers[name]
                cmd = [sys.executable, os.path.abspath(__file__), "--client", address, str(proc.pid), str(args.iterations), str(args.warmup), str(r)]
                if token_file:
                    cmd += ["--token-file", token_file]
                out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": trees[name]}, capture_output=True, text=True, cwd=tempfile.gettempdir())
                if out.returncode:
                    raise SystemExit(out.stderr)
                rounds[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        if token_file:
            os.unlink(token_file)
    print(f"{args.rounds} rounds x {args.iterations} calls per case{' (token on)' if args.token else ''}: "
          "p50 / client CPU / server CPU per call, µs (median of rounds); (above: p50 - empty call's, median of rounds)")
    print("| case | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for case in rounds[names[0]][0]:
        cells = []
        for name in names:
            med = [statistics.median(x[case][k] for x in rounds[name]) for k in range(3)]
            above = statistics.median(x[case][0] - x["empty call"][0] for x in rounds[name])
            cells.append(f"{med[0]:.0f} / {med[1]:.0f} / {med[2]:.0f}" + ("" if case == "empty call" else f" (above {above:.0f})"))
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    from pdgrpc.rpc.tuning import apply_grpc_defaults

    apply_grpc_defaults()  # as pdgrpc's entry points do, before grpc is imported
    main()
