"""``python -m pdgrpc.bench chaos``: a 2p2d cluster at a fixed request rate loses one
decode (SIGKILL) halfway; what that costs with the router's migration and without.

Each arm starts ``servers/2p2d.toml`` afresh, sends requests at ``--rate`` per second
(open loop: arrivals do not wait for completions) for ``--duration`` seconds, and
SIGKILLs ``decode-a`` at half time. The baseline arm runs the router with
``--migration-limit 0`` (today's behaviour before migration: a stream whose decode dies
fails); the other with the default limit. Reported per arm:

* failed requests (the target with migration: 0), and streams migrated (the router's
  ``pdgrpc_router_migrations_total``);
* TTFT p50/p99 of the requests that arrived after the kill, and its extra over those
  that arrived before (a request may first try the dead decode: one retry);
* tokens/s per stream (first token to last) of the streams the router migrated (the
  rooms its log names ``migrating``; their first room comes back on their first message),
  and of the requests in flight at the kill, each against the median of the others.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import re
import statistics
import time
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdgrpc.bench.report import Result, percentile
from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.rpc.server import run as run_loop
from pdgrpc.v1 import common_pb2, generate_pb2
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub

DESCRIPTION = "2p2d at a fixed rate, one decode SIGKILLed halfway: failed requests, extra TTFT, tokens/s, with and without migration"

VICTIM = "decode-a"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", default="tcp", choices=("tcp", "rdma"), help="KV transport (default: %(default)s)")
    p.add_argument("--rate", type=float, default=10.0, help="requests per second, open loop (default: %(default)s)")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals; the decode dies at half (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: %(default)s)")


@dataclasses.dataclass
class _Outcome:
    sent: float
    ok: bool = False
    ttft: float = 0.0
    first: float = 0.0
    done: float = 0.0
    tokens: int = 0
    room: int = 0  # the room of its first attempt

    @property
    def tokens_per_s(self) -> float:
        return (self.tokens - 1) / (self.done - self.first) if self.tokens > 1 and self.done > self.first else 0.0


async def _one(stub: GenerateServiceStub, ids: list[int], max_new: int, seed: int, out: _Outcome) -> None:
    request = generate_pb2.GenerateRequest(
        input_ids=ids, sampling=common_pb2.SamplingParams(temperature=0.8, seed=seed, max_new_tokens=max_new, ignore_eos=True),
    )
    try:
        async for m in stub.Generate(request, timeout=120):
            if not out.tokens:
                out.first, out.ttft, out.room = time.perf_counter(), m.ttft_seconds, m.bootstrap_room
            out.tokens += len(m.token_ids)
        out.ok, out.done = True, time.perf_counter()
    except grpc.RpcError:
        out.done = time.perf_counter()


async def _arm(args: argparse.Namespace, migration_limit: int) -> tuple[list[_Outcome], float, float, set[int]]:
    topology = load_topology("2p2d")
    procs = tuple(
        dataclasses.replace(p, args={**p.args, "migration-limit": migration_limit}) if p.role == "router" else p
        for p in topology.processes
    )
    topology = dataclasses.replace(topology, processes=procs)
    rng = random.Random(args.seed)
    async with Cluster(topology, transport=args.transport, metrics=True) as cluster:
        async with cluster.client_channel() as channel:
            stub = GenerateServiceStub(channel)
            outcomes: list[_Outcome] = []
            tasks = []
            start = time.perf_counter()
            killed_at = 0.0
            n = int(args.rate * args.duration)
            for i in range(n):
                at = start + i / args.rate
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                if not killed_at and time.perf_counter() - start >= args.duration / 2:
                    victim = cluster.procs[VICTIM].process
                    assert victim is not None
                    victim.kill()
                    killed_at = time.perf_counter()
                ids = [256] + [rng.randrange(32, 127) for _ in range(args.prompt_tokens - 1)]
                outcomes.append(_Outcome(sent=time.perf_counter()))
                tasks.append(asyncio.ensure_future(_one(stub, ids, args.max_new_tokens, i, outcomes[-1])))
            await asyncio.gather(*tasks)
            (endpoint,) = cluster.metrics_endpoints("router").values()
            migrated = await asyncio.to_thread(_migrations, endpoint)
            rooms = migrated_rooms(cluster.procs["router"].log_path.read_text(errors="replace"))
    return outcomes, killed_at, migrated, rooms


_MIGRATING = re.compile(r"room=(\d+) migrating after")


def migrated_rooms(router_log: str) -> set[int]:
    """The rooms whose stream the router migrated: it logs ``room=<room> migrating after
    <n> token(s) ...`` under the stream's room before the move (the first room, the first time)."""
    return {int(m) for m in _MIGRATING.findall(router_log)}


def _migrations(endpoint: str) -> float:
    """pdgrpc_router_migrations_total summed over its reasons, read from the router's endpoint."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "pdgrpc_router_migrations_total"
    )


async def _run(args: argparse.Namespace) -> list[Result]:
    results: list[Result] = []
    failed: dict[str, float] = {}
    for arm, limit in (("no-migration", 0), ("migration", 1)):
        print(f"{arm}: 2p2d over {args.transport}, {args.rate:g} req/s for {args.duration:g} s, {VICTIM} SIGKILLed at half ...", flush=True)
        outcomes, killed_at, migrated, rooms = await _arm(args, limit)
        case = f"{args.transport}/{arm}"
        failed[arm] = sum(not o.ok for o in outcomes)
        before = [o.ttft for o in outcomes if o.ok and o.sent < killed_at]
        after = [o.ttft for o in outcomes if o.ok and o.sent >= killed_at]
        hit = [o.tokens_per_s for o in outcomes if o.ok and o.sent < killed_at < o.done]
        rest = [o.tokens_per_s for o in outcomes if o.ok and not o.sent < killed_at < o.done]
        results += [
            Result(case, "requests", len(outcomes), "count"),
            Result(case, "failed", failed[arm], "count", failed.get("no-migration") if arm == "migration" else None),
            Result(case, "migrated_streams", migrated, "count"),
        ]
        if before and after:
            b50, a50, a99 = percentile(before, 0.5) * 1e3, percentile(after, 0.5) * 1e3, percentile(after, 0.99) * 1e3
            results += [
                Result(case, "ttft_p50_after_kill", a50, "ms", b50, a50 / b50),
                Result(case, "ttft_p99_after_kill", a99, "ms"),
                Result(case, "extra_ttft_p50_after_kill", a50 - b50, "ms"),
            ]
        if hit and rest:
            h, r = statistics.median(hit), statistics.median(rest)
            results.append(Result(case, "tokens_per_s_in_flight_at_kill", h, "tok/s", r, h / r))
        moved = [o.tokens_per_s for o in outcomes if o.ok and o.room in rooms]
        stayed = [o.tokens_per_s for o in outcomes if o.ok and o.room not in rooms]
        if moved and stayed:
            m, r = statistics.median(moved), statistics.median(stayed)
            results.append(Result(case, "tokens_per_s_migrated", m, "tok/s", r, m / r))
    return results


def run(args: argparse.Namespace) -> list[Result]:
    return run_loop(_run(args))
