#!/usr/bin/env python3
"""CPU time and run-queue wait per request of every process of 1p1d and of the colocated server.

Usage: python scripts/cpu_per_request.py [--transports tcp,rdma] [--requests N] [--idle-s S]
                                         [--no-prefix-cache-arm]

Starts the colocated server and one 1p1d cluster per transport (the topologies `bench e2e`
uses), sends each the same 512-token prompts one at a time, in turn, each generating one
token, and prints every process's CPU time (all its threads, from ``/proc``) per request,
less what it burns idle (measured over ``--idle-s`` first, with no request in flight).
CPU time, unlike TTFT, barely moves with the host's load: on a busy 2-core host a
request's wall time is roughly its CPU time over the share of the cores it gets, so this
shows where a disaggregated request costs more than a colocated one. Beside it, the time
the process's threads were runnable but waited for a core: on the compute, that is what
the other processes' work costs a prompt; on the others, what they cost each other.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdgrpc.bench.e2e import NO_CACHE, without_prefix_cache  # noqa: E402
from pdgrpc.bench.procstat import children, module_of, process_tree, schedstat  # noqa: E402
from pdgrpc.cluster.client import generate  # noqa: E402
from pdgrpc.cluster.launcher import Cluster  # noqa: E402
from pdgrpc.cluster.topology import load_topology  # noqa: E402
from pdgrpc.rpc.server import run  # noqa: E402
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub  # noqa: E402


async def _main(ns: argparse.Namespace) -> None:
    systems = {"colocated": Cluster(load_topology("colocated"))}
    for t in ns.transports.split(","):
        systems[f"1p1d-{t}"] = Cluster(load_topology("1p1d"), transport=t)
        if ns.no_prefix_cache_arm:
            systems[f"1p1d-{t}{NO_CACHE}"] = Cluster(without_prefix_cache(load_topology("1p1d")), transport=t)
    rng = random.Random(0)
    prompts = [[256] + [rng.randrange(32, 127) for _ in range(511)] for _ in range(ns.requests + ns.warmup)]
    async with contextlib.AsyncExitStack() as stack:
        await asyncio.gather(*(stack.enter_async_context(c) for c in systems.values()))
        stubs = {k: GenerateServiceStub(await stack.enter_async_context(c.client_channel())) for k, c in systems.items()}
        kids = children()
        pids = {k: [q for p in c.procs.values() if p.pid for q in process_tree(p.pid, kids)] for k, c in systems.items()}
        roles = {p: module_of(p) for ps in pids.values() for p in ps}
        for ids in prompts[: ns.warmup]:
            for stub in stubs.values():
                await generate(stub, input_ids=ids, max_new_tokens=1)
        idle0 = {p: schedstat(p) for ps in pids.values() for p in ps}
        await asyncio.sleep(ns.idle_s)
        idle = {p: _less(schedstat(p), idle0[p], 1 / ns.idle_s) for p in idle0}  # ns per second
        start, t0 = {p: schedstat(p) for p in idle0}, time.perf_counter()
        for ids in prompts[ns.warmup :]:
            for stub in stubs.values():
                await generate(stub, input_ids=ids, max_new_tokens=1)
        wall = time.perf_counter() - t0
        used = {p: _less(schedstat(p), start[p]) for p in start}
    print(f"{ns.requests} requests per system, {wall / ns.requests:.2f} s per round; ms per request of CPU "
          "(idle ms/s) and of run-queue wait")
    for k, ps in pids.items():
        total = [0.0, 0.0]
        for p in ps:
            ms = [(used[p][i] - idle[p][i] * wall) / ns.requests / 1e6 for i in (0, 1)]
            total = [a + b for a, b in zip(total, ms)]
            print(f"  {k:<16} {roles[p]:<34} {ms[0]:7.2f}  ({idle[p][0] / 1e6:.2f})  {ms[1]:7.2f}")
        print(f"  {k:<16} {'total':<34} {total[0]:7.2f}          {total[1]:7.2f}")


def _less(now: tuple[int, int], then: tuple[int, int], scale: float = 1.0) -> tuple[float, float]:
    return (now[0] - then[0]) * scale, (now[1] - then[1]) * scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", default="tcp,rdma", help="comma-separated 1p1d transports (default: %(default)s)")
    p.add_argument("--requests", type=int, default=20, help="measured requests per system (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="requests per system before measuring (default: %(default)s)")
    p.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle CPU measured first (default: %(default)s)")
    p.add_argument("--no-prefix-cache-arm", action="store_true",
                   help="also run each transport's 1p1d with --no-prefix-cache on its prefill, side by side")
    run(_main(p.parse_args()))


if __name__ == "__main__":
    main()
