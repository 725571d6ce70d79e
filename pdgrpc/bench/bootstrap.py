"""``python -m pdgrpc.bench bootstrap``: BootstrapService latency, throughput, memory.

The server runs as its own process (``python -m pdgrpc.bootstrap`` on 127.0.0.1, a
free port), so client and server never share an event loop or a GIL, as in a real
deployment; the client is one :class:`BootstrapClient` on uvloop over one pooled
channel. Cases:

* ``ping``: ``grpc.health.v1.Health/Check`` on the same server and channel: a plain
  grpc.aio unary ping-pong, the floor every other call stands on (the *baseline*).
* ``register 1 room`` / ``query 1 room`` / ``query 32 rooms`` / ``query 1024 rooms``:
  p50 and p99, measured round-robin (one call of each case per round) so that load
  from other processes falls on every case alike; then the CPU time each call costs
  the client and the server process (all threads, from ``/proc``), which, unlike
  wall time, does not grow when other processes share the cores.
* ``register batches of B``: rooms/s, batches sent back to back (prebuilt requests
  through the generated stub; then through ``BootstrapClient``, encoding included).
* ``--wire-forms``: the same calls (and 32-room renewals) in the same rounds, then
  renewal batches of B, in each wire form of ``pdgrpc.v1`` through the generated stub:
  a ``DpRankEntry`` per room (``entries``) and parallel repeated fields (``arrays``,
  the form ``BootstrapClient`` sends).
* ``memory``: server RSS holding ``--memory-rooms`` rooms, and its growth from empty.
* ``--peer-python PATH``: SGLang's Python and Rust bootstrap servers and an aiohttp
  client run under PATH (:mod:`pdgrpc.bench.bootstrap_peer`); the latency cases then run
  in ``--rounds`` rounds, pdgrpc and each SGLang server in turn, and the p50 rows are
  medians of the rounds' p50s. Extra rows compare each case with each SGLang server:
  p50, p50 above the system's own empty call (``GET /health`` there), CPU per call.
* ``expiry``: the same rooms expire (short TTL) while the client keeps calling; the
  worst and p99 call during the wave and, for comparison, before it; and the server's
  own report of its longest expiry step (the longest the event loop was kept from
  serving calls by expiry: worst calls beyond it are other processes' doing).

Targets (set by SGLang's HTTP bootstrap measured on the same 2-core machine):
single-room p50 < 0.45 ms, 1024-room query p50 < 1 ms, >= 200k rooms/s in batches,
1M rooms well under 200 MB RSS, no expiry pause over 10 ms.

What limits a single-room call is gRPC itself: the CPU of a unary ``grpc.aio`` round
trip on both sides (this bench's CPU/call rows) dwarfs the room table's share. A sync
stub costs less client CPU than the aio one, but would block the caller's event loop.
At 1,024 rooms the server's remaining cost is mostly cache misses in the room table.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import os
import random
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Awaitable, Callable

from pdgrpc.bench.bootstrap_peer import SYSTEMS, PeerError, Peers, rounds_order
from pdgrpc.bench.procstat import cpu_ns
from pdgrpc.bench.report import Result, percentile

DESCRIPTION = "BootstrapService: single-room and batched latency, rooms/s, RSS of 1M rooms, pause while they expire"
PLOT = "QueryDpRanks latency by batch size (1, 32, 1024 rooms), beside the health-check floor"

_LISTEN = re.compile(r"listening on ([\w.:\[\]-]+):(\d+)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=2000, help="calls per latency case (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=300, help="untimed calls before each latency case (default: %(default)s)")
    p.add_argument("--batch", type=int, default=65536, help="rooms per RegisterDpRanks call in the throughput case (default: %(default)s)")
    p.add_argument(
        "--throughput-rooms", type=int, default=14 * 65536,
        help="rooms registered in the throughput case; with the latency cases' rooms they fit the server's default "
        "cap of 1,048,576 live rooms, which is raised when they do not (default: %(default)s)",
    )
    p.add_argument("--memory-rooms", type=int, default=1_000_000, help="rooms for the memory and expiry cases; 0 skips them (default: %(default)s)")
    p.add_argument("--expiry-ttl", type=float, default=8.0, help="TTL (s) of the server in the memory and expiry cases (default: %(default)s)")
    p.add_argument(
        "--peer-python", metavar="PATH",
        help="also run SGLang's Python and Rust bootstrap servers, with an aiohttp client, under this Python "
        "(one that has sglang, aiohttp and uvloop importable), and report pdgrpc's ratios to them",
    )
    p.add_argument("--rounds", type=int, default=5, help="with --peer-python: rounds, each system in turn; medians of the rounds' p50s (default: %(default)s)")
    p.add_argument(
        "--wire-forms", action="store_true",
        help="also make each call in both wire forms of pdgrpc.v1 through the generated stub, in the same rounds: "
        "a DpRankEntry per room ('entries') and parallel repeated fields ('arrays'), each building its request and "
        "reading its answer; and register renewal batches in each form (not with --peer-python)",
    )


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

    def cpu_ns(self) -> int:
        return cpu_ns(self.proc.pid)

    def stop(self) -> str:
        """SIGTERM, wait, and return the rest of the server's log."""
        self.proc.terminate()
        try:
            rest = self.proc.communicate(timeout=15)[1] or ""
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rest = self.proc.communicate()[1] or ""
        return rest


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


async def _main_cases(server: ServerProcess, args: argparse.Namespace, peers: Peers | None = None) -> list[Result]:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdgrpc.bootstrap.client import BootstrapClient
    from pdgrpc.rpc.channels import ChannelPool

    pool = ChannelPool()
    client = BootstrapClient(server.address, pool=pool, timeout=30.0)
    rng = random.Random(1)
    results: list[Result] = []
    it, wu = args.iterations, args.warmup

    health = health_pb2_grpc.HealthStub(client.channel)
    ping_req = health_pb2.HealthCheckRequest()
    known = _rooms(rng, 65536)
    for i in range(0, len(known), 16384):
        await client.register_dp_ranks({r: r % 8 for r in known[i : i + 16384]})
    fresh = _rooms(rng, it + wu * max(1, args.rounds))
    sets = {n: [rng.sample(known, n) for _ in range(64)] for n in (32, 1024)}

    async def query(i: int, n: int) -> None:
        res = await client.query_dp_ranks(sets[n][i % 64])
        assert len(res.rooms) == n, (len(res.rooms), n)

    cases: dict[str, Callable[[int], Awaitable[object]]] = {
        "ping (health Check)": lambda i: health.Check(ping_req, timeout=5),
        "register 1 room": lambda i: client.register_dp_ranks({fresh[i]: 1}),
        "query 1 room": lambda i: client.query_dp_ranks([known[i % len(known)]]),
        "query 32 rooms": lambda i: query(i, 32),
        "query 1024 rooms": lambda i: query(i, 1024),
    }
    forms = _wire_forms(client.stub) if args.wire_forms else {}
    cases.update(_form_cases(forms, known, sets))
    if peers is None:
        samples = await _interleaved(cases, it, wu)
        p50 = {case: percentile(xs, 0.5) for case, xs in samples.items()}
    else:  # rounds, each system in turn (rotated), so that machine load falls on all alike
        samples, per_round = await _peer_rounds(cases, peers, args)
        p50 = {case: statistics.median(x["pdgrpc"] for x in per_round[case]) for case in cases}
    # CPU per call, client and server processes (all threads): what each call costs,
    # whatever else runs on the machine. Fresh rooms for register: offset past the above.
    cpu: dict[str, tuple[float, float]] = {}
    n_cpu = max(200, it // 4)
    start = len(fresh)
    fresh += _rooms(rng, n_cpu)
    for name, call in cases.items():
        c0, s0 = cpu_ns(os.getpid()), server.cpu_ns()
        for i in range(start, start + n_cpu):
            await call(i)
        cpu[name] = ((cpu_ns(os.getpid()) - c0) / n_cpu / 1e3, (server.cpu_ns() - s0) / n_cpu / 1e3)
    base50 = p50["ping (health Check)"] * 1e3
    if getattr(args, "plot", None) is not None:
        from pdgrpc.bench.plot import bootstrap_figure

        ms = {case: (percentile(xs, 0.5) * 1e3, percentile(xs, 0.99) * 1e3) for case, xs in samples.items()}
        bootstrap_figure(args.plot, {n: ms[f"query {n} room" + ("s" if n > 1 else "")] for n in (1, 32, 1024)}, ms["ping (health Check)"])
    base_cpu = cpu["ping (health Check)"]
    for case, xs in samples.items():
        p50_ms = p50[case] * 1e3
        ping = case.startswith("ping")
        results.append(Result(case, "p50", p50_ms, "ms", None if ping else base50, None if ping else p50_ms / base50))
        results.append(Result(case, "p99", percentile(xs, 0.99) * 1e3, "ms"))
        for side, value, base in (("client", cpu[case][0], base_cpu[0]), ("server", cpu[case][1], base_cpu[1])):
            results.append(Result(case, f"CPU/call {side}", value, "us", None if ping else base, None if ping else value / base))
    if peers is not None:
        results += _peer_results(peers, per_round, cpu, n_cpu)

    total, batch = args.throughput_rooms, args.batch
    rooms = _rooms(rng, total)
    chunks = [{r: r & 7 for r in rooms[i : i + batch]} for i in range(0, total, batch)]
    from pdgrpc.v1 import bootstrap_pb2 as pb

    requests = [pb.RegisterDpRanksRequest(bootstrap_rooms=list(c), dp_ranks=list(c.values())) for c in chunks]
    t0 = time.perf_counter()
    for req in requests:
        await client.stub.RegisterDpRanks(req, timeout=30)
    dt = time.perf_counter() - t0
    results.append(Result(f"register batches of {batch}", "rooms/s", total / dt, "rooms/s"))
    s0 = server.cpu_ns()
    t0 = time.perf_counter()
    for c in chunks:
        await client.register_dp_ranks(c)  # renewals; includes building the request
    dt = time.perf_counter() - t0
    label = f"register batches of {batch} via BootstrapClient"
    results.append(Result(label, "rooms/s", total / dt, "rooms/s"))
    results.append(Result(label, "server CPU/room", (server.cpu_ns() - s0) / total / 1e3, "us"))
    for form, (register, _) in forms.items():
        c0, s0, t0 = cpu_ns(os.getpid()), server.cpu_ns(), time.perf_counter()
        for c in chunks:
            await register(list(c))  # renewals again; includes building the request
        dt = time.perf_counter() - t0
        label = f"register batches of {batch}, {form}"
        results.append(Result(label, "rooms/s", total / dt, "rooms/s"))
        results.append(Result(label, "client CPU/room", (cpu_ns(os.getpid()) - c0) / total / 1e3, "us"))
        results.append(Result(label, "server CPU/room", (server.cpu_ns() - s0) / total / 1e3, "us"))
    await pool.close()
    return results


Call = Callable[[list[int]], Awaitable[object]]


def _wire_forms(stub: Any) -> dict[str, tuple[Call, Call]]:
    """(register, query) of rooms in each wire form of ``RegisterDpRanks`` and
    ``QueryDpRanks``, each call building its request and reading its answer to a dict as
    a client must. The rank of room ``r`` is ``r % 8``, as the main cases register it."""
    from pdgrpc.v1 import bootstrap_pb2 as pb

    async def register_entries(rooms: list[int]) -> object:
        request = pb.RegisterDpRanksRequest(entries=[pb.DpRankEntry(bootstrap_room=r, dp_rank=r % 8) for r in rooms])
        return await stub.RegisterDpRanks(request, timeout=30)

    async def query_entries(rooms: list[int]) -> dict[int, int]:
        reply = await stub.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=rooms), timeout=30)
        return {e.bootstrap_room: e.dp_rank for e in reply.entries}

    async def register_arrays(rooms: list[int]) -> object:
        return await stub.RegisterDpRanks(pb.RegisterDpRanksRequest(bootstrap_rooms=rooms, dp_ranks=[r % 8 for r in rooms]), timeout=30)

    async def query_arrays(rooms: list[int]) -> dict[int, int]:
        reply = await stub.QueryDpRanks(pb.QueryDpRanksRequest(bootstrap_rooms=rooms, found_ranks_only=True), timeout=30)
        gone = set(reply.missing_rooms)
        return dict(zip([r for r in rooms if r not in gone], reply.found_dp_ranks))

    return {"entries": (register_entries, query_entries), "arrays": (register_arrays, query_arrays)}


def _form_cases(
    forms: dict[str, tuple[Call, Call]], known: list[int], sets: dict[int, list[list[int]]]
) -> dict[str, Callable[[int], Awaitable[object]]]:
    """The main cases' calls in each wire form, the forms of one call side by side.
    Single registrations take fresh rooms of their own, ``(salt << 48) + i + 1``;
    32-room ones renew known rooms."""
    cases: dict[str, Callable[[int], Awaitable[object]]] = {}
    calls: dict[str, Callable[[Call, Call, int, int], Awaitable[object]]] = {
        "register 1 room": lambda register, lookup, salt, i: register([(salt << 48) + i + 1]),
        "register 32 rooms": lambda register, lookup, salt, i: register(sets[32][i % 64]),
        "query 1 room": lambda register, lookup, salt, i: lookup([known[i % len(known)]]),
        "query 32 rooms": lambda register, lookup, salt, i: lookup(sets[32][i % 64]),
        "query 1024 rooms": lambda register, lookup, salt, i: lookup(sets[1024][i % 64]),
    }
    for name, call in calls.items():
        for salt, (form, (register, lookup)) in enumerate(forms.items(), 1):
            cases[f"{name}, {form}"] = functools.partial(call, register, lookup, salt)
    return cases


async def _peer_rounds(
    cases: dict[str, Callable[[int], Awaitable[object]]], peers: Peers, args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """``--rounds`` rounds; in each, pdgrpc and both SGLang servers in turn (rotated)
    run ``iterations / rounds`` calls of every case. Returns pdgrpc's samples (for p99)
    and, per case, each round's p50 (s) by system."""
    per = max(1, args.iterations // args.rounds)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    per_round: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    done = 0
    for r in range(args.rounds):
        got: dict[str, dict[str, list[float]]] = {}
        warm = args.warmup if r == 0 else max(1, args.warmup // 10)
        for system in rounds_order(["pdgrpc", *SYSTEMS], r):
            if system == "pdgrpc":
                shifted: dict[str, Callable[[int], Awaitable[object]]] = {n: _shift(c, done) for n, c in cases.items()}
                got[system] = await _interleaved(shifted, per, warm)
                done += per + warm
            else:
                got[system] = peers.run(system, per, warm)
        for name in cases:
            samples[name] += got["pdgrpc"][name]
            per_round[name].append({system: percentile(xs[name], 0.5) for system, xs in got.items()})
    return samples, per_round


def _shift(call: Callable[[int], Awaitable[object]], by: int) -> Callable[[int], Awaitable[object]]:
    """``call`` with its index moved past the calls made so far (fresh rooms stay fresh)."""
    return lambda i: call(by + i)


def _peer_results(
    peers: Peers, per_round: dict[str, list[dict[str, float]]], cpu: dict[str, tuple[float, float]], n_cpu: int
) -> list[Result]:
    """pdgrpc against each SGLang server: p50 (median of the rounds' p50s), p50 above
    each system's own empty call (what the call adds to its transport's floor), and CPU
    per call on each side. ``value`` is pdgrpc's, ``baseline`` SGLang's."""
    out: list[Result] = []
    for system in SYSTEMS:
        peer_cpu = peers.cpu(system, n_cpu)
        med = {name: {s: statistics.median(x[s] for x in rounds) * 1e3 for s in ("pdgrpc", system)} for name, rounds in per_round.items()}
        floor = med["ping (health Check)"]
        for name in per_round:
            ours, theirs = med[name]["pdgrpc"], med[name][system]
            out.append(Result(name, f"p50 vs {system}", ours, "ms", theirs, ours / theirs))
            if not name.startswith("ping"):
                ours_up, theirs_up = ours - floor["pdgrpc"], theirs - floor[system]
                ratio = ours_up / theirs_up if theirs_up > 0 else None
                out.append(Result(name, f"p50 above empty call vs {system}", ours_up, "ms", theirs_up, ratio))
            for side, k in (("client", 0), ("server", 1)):
                out.append(Result(name, f"CPU/call {side} vs {system}", cpu[name][k], "us", peer_cpu[name][k], cpu[name][k] / peer_cpu[name][k]))
    return out


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
    batches = [{r: r & 7 for r in rooms[i : i + 65536]} for i in range(0, n, 65536)]
    gc.collect()
    gc.freeze()  # the client's own garbage collections must not pass for server stalls
    rss0 = server.rss_mb()
    t_first = time.monotonic()
    for batch in batches:
        await client.register_dp_ranks(batch)
    t_last = time.monotonic()
    rss1 = server.rss_mb()
    label = f"memory {n:,} rooms"
    results = [Result(label, "server RSS", rss1, "MB"), Result(label, "RSS growth", rss1 - rss0, "MB")]
    # Expiry: rooms registered in [t_first, t_last] expire in [t_first + ttl, t_last + ttl]
    # (plus up to one sweep interval). Call the server all through it; and, for
    # comparison, for as long before it starts (same rooms held, nothing expiring), so
    # that stalls from other processes on the machine show up on both sides.
    probe = rooms[-1]

    async def calls(until: float) -> list[float]:
        out = []
        while time.monotonic() < until:
            t0 = time.perf_counter()
            await client.query_dp_ranks([probe])
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.0005)
        return out

    quiet_for = min(2.0, t_first + args.expiry_ttl - 0.2 - time.monotonic())
    quiet = await calls(time.monotonic() + quiet_for) if quiet_for > 0.2 else []
    await asyncio.sleep(max(0.0, t_first + args.expiry_ttl - time.monotonic()))
    samples = await calls(t_last + args.expiry_ttl + 2.5)
    worst = max(samples)
    await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    left = await client.query_dp_ranks(rng.sample(rooms, min(1024, len(rooms))))
    if left.ranks:
        raise RuntimeError(f"{len(left.ranks)} of 1024 sampled rooms survived their TTL")
    label = f"expiry of {n:,} rooms"
    if quiet:
        results.append(Result(label, "worst call before", max(quiet) * 1e3, "ms"))
        results.append(Result(label, "p99 call before", percentile(quiet, 0.99) * 1e3, "ms"))
    results += [
        Result(label, "worst call during", worst * 1e3, "ms"),
        Result(label, "p99 call during", percentile(samples, 0.99) * 1e3, "ms"),
        Result(label, "RSS after", server.rss_mb(), "MB"),
    ]
    await pool.close()
    gc.unfreeze()
    return results


def run(args: argparse.Namespace) -> list[Result]:
    from pdgrpc.rpc.server import run as run_loop

    print(
        f"bootstrap bench: server = python -m pdgrpc.bootstrap in its own process; client = BootstrapClient on uvloop, "
        f"one pooled channel; GRPC_EXPERIMENTS={os.environ.get('GRPC_EXPERIMENTS', '(unset)')}; {os.cpu_count()} CPUs",
        flush=True,
    )

    results: list[Result] = []
    peers = None
    if args.peer_python and args.wire_forms:
        raise SystemExit("python -m pdgrpc.bench bootstrap: --wire-forms and --peer-python are separate runs")
    if args.peer_python:
        try:
            peers = Peers(args.peer_python, fresh_rooms=(args.iterations + args.warmup) * (args.rounds + 1) + max(200, args.iterations // 4) * 2)
        except PeerError as exc:
            raise SystemExit(f"python -m pdgrpc.bench bootstrap: {exc}") from exc
        print(f"beside SGLang {peers.version}: CommonKVBootstrapServer (aiohttp, uvloop) and the Rust server's registry, "
              "one aiohttp client on uvloop (keep-alive)", flush=True)
    # Every room of the main cases stays live, however long the run takes: the latency
    # cases' 65,536 known rooms and fresh single rooms (of each wire form too), and the
    # throughput case's. The table's ring (2 records per room of its cap) holds every
    # registration, renewals included, so that none evicts a live room.
    forms = 3 if args.wire_forms else 1
    calls = (args.iterations + args.warmup) * (args.rounds + 2) + max(200, args.iterations // 4)
    records = 65536 + calls * forms + args.throughput_rooms * (forms + 1) + (32 * 2 * calls if args.wire_forms else 0)
    max_rooms = (records + 1) // 2
    server = ServerProcess("--dp-rank-ttl", "86400", *(["--max-rooms", str(max_rooms)] if max_rooms > 1 << 20 else []))
    try:
        results += run_loop(_main_cases(server, args, peers))
    finally:
        server.stop()
        if peers is not None:
            peers.close()
    if args.memory_rooms:
        max_rooms = max(1 << 20, args.memory_rooms)
        server = ServerProcess("--dp-rank-ttl", str(args.expiry_ttl), "--max-rooms", str(max_rooms), "--sweep-interval", "0.5")
        try:
            results += run_loop(_memory_cases(server, args))
        finally:
            log = server.stop()
        m = re.search(r"(\d+) expired.*?(\d+) expiry steps, longest ([\d.]+) ms \(([\d.]+) ms CPU\)", log)
        if m:
            label = f"expiry of {args.memory_rooms:,} rooms"
            results += [
                Result(label, "expired (server)", float(m.group(1)), "rooms"),
                Result(label, "sweep steps", float(m.group(2)), "steps"),
                Result(label, "longest step", float(m.group(3)), "ms"),
                Result(label, "longest step CPU", float(m.group(4)), "ms"),
            ]
    return results
