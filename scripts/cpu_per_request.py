#!/usr/bin/env python3
"""CPU time and run-queue wait per request of every process of 1p1d and of the colocated server.

Usage: python scripts/cpu_per_request.py [--transports tcp,rdma] [--requests N] [--idle-s S]
                                         [--no-prefix-cache-arm] [--baseline-tree PATH]
                                         [--concurrency C --prompt-tokens P --max-new-tokens N]

Starts the colocated server and one 1p1d cluster per transport (the topologies `bench e2e`
uses), sends each the same 512-token prompts one at a time, in turn, each generating one
token, and prints every process's CPU time (all its threads, from ``/proc``) per request,
less what it burns idle (measured over ``--idle-s`` first, with no request in flight).
CPU time, unlike TTFT, barely moves with the host's load: on a busy 2-core host a
request's wall time is roughly its CPU time over the share of the cores it gets, so this
shows where a disaggregated request costs more than a colocated one. Beside it, the time
the process's threads were runnable but waited for a core: on the compute, that is what
the other processes' work costs a prompt; on the others, what they cost each other; and
the write system calls the process made per request (``syscw``).

With ``--concurrency`` above 1 it loads each system as `bench e2e`'s tokens/s phase does
(``--prompt-tokens``, ``--max-new-tokens``, that many requests in flight), the systems
taking turns in 4 rounds, and prints each one's tokens/s too. ``--baseline-tree PATH``
also starts each 1p1d cluster from another checkout, as ``NAME@baseline``.
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

from pdgrpc.bench.e2e import NO_CACHE, has_local_sockets, run_load, tree_env, turns, without_prefix_cache  # noqa: E402
from pdgrpc.bench.procstat import children, module_of, process_tree, schedstat  # noqa: E402
from pdgrpc.cluster.client import generate  # noqa: E402
from pdgrpc.cluster.launcher import Cluster  # noqa: E402
from pdgrpc.cluster.topology import load_topology  # noqa: E402
from pdgrpc.rpc.server import run  # noqa: E402
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub  # noqa: E402

_ROUNDS = 4  # under --concurrency: the systems take turns this many times, as bench e2e's do


async def _main(ns: argparse.Namespace) -> None:
    systems = {"colocated": Cluster(load_topology("colocated"))}
    for t in ns.transports.split(","):
        systems[f"1p1d-{t}"] = Cluster(load_topology("1p1d"), transport=t)
        if ns.no_prefix_cache_arm:
            systems[f"1p1d-{t}{NO_CACHE}"] = Cluster(without_prefix_cache(load_topology("1p1d")), transport=t)
        if ns.baseline_tree:
            systems[f"1p1d-{t}@baseline"] = Cluster(load_topology("1p1d"), transport=t, extra_env=tree_env(ns.baseline_tree),
                                                     local_sockets=has_local_sockets(ns.baseline_tree))
    rng = random.Random(0)
    prompts = [[256] + [rng.randrange(32, 127) for _ in range(ns.prompt_tokens - 1)] for _ in range(ns.requests + ns.warmup)]
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
        measured = prompts[ns.warmup :]
        if ns.concurrency > 1:
            used, writes, walls, tokens = await _load(ns, stubs, pids, measured, rng)
        else:
            start, w0, t0 = {p: schedstat(p) for p in idle0}, {p: _writes(p) for p in idle0}, time.perf_counter()
            for ids in measured:
                for stub in stubs.values():
                    await generate(stub, input_ids=ids, max_new_tokens=1)
            wall = time.perf_counter() - t0
            used = {p: _less(schedstat(p), start[p]) for p in start}
            writes = {p: _writes(p) - w0[p] for p in start}
            walls = {k: wall for k in systems}
            tokens = {k: ns.requests for k in systems}  # one token each
    print(f"{ns.requests} requests per system; ms per request of CPU (idle ms/s) and of run-queue wait; writes per request")
    for k, ps in pids.items():
        total = [0.0, 0.0]
        if ns.concurrency > 1:
            print(f"  {k:<16} {tokens[k] / walls[k]:,.0f} tokens/s")
        for p in ps:
            ms = [(used[p][i] - idle[p][i] * walls[k]) / ns.requests / 1e6 for i in (0, 1)]
            total = [a + b for a, b in zip(total, ms)]
            print(f"  {k:<16} {roles[p]:<34} {ms[0]:7.2f}  ({idle[p][0] / 1e6:.2f})  {ms[1]:7.2f}  {writes[p] / ns.requests:6.1f}")
        print(f"  {k:<16} {'total':<34} {total[0]:7.2f}          {total[1]:7.2f}")


async def _load(
    ns: argparse.Namespace, stubs: dict[str, GenerateServiceStub], pids: dict[str, list[int]], prompts: list[list[int]],
    rng: random.Random,
) -> tuple[dict[int, tuple[float, float]], dict[int, int], dict[str, float], dict[str, int]]:
    """Each system's share of ``prompts`` with ``--concurrency`` in flight, the systems
    taking turns in rounds (bench e2e's): the CPU and writes of each process, each
    system's wall time and tokens, counted only while its own system is loaded."""
    used = {p: (0.0, 0.0) for ps in pids.values() for p in ps}
    writes = {p: 0 for p in used}
    walls = {k: 0.0 for k in stubs}
    tokens = {k: 0 for k in stubs}
    for r, k in turns(list(stubs), _ROUNDS, rng):
        start, w0 = {p: schedstat(p) for p in pids[k]}, {p: _writes(p) for p in pids[k]}
        load = await run_load(stubs[k], prompts[r::_ROUNDS], ns.max_new_tokens, ns.concurrency)
        walls[k] += load.seconds
        tokens[k] += load.tokens
        for p in pids[k]:
            cpu, wait = _less(schedstat(p), start[p])
            used[p] = (used[p][0] + cpu, used[p][1] + wait)
            writes[p] += _writes(p) - w0[p]
    return used, writes, walls, tokens


def _writes(pid: int) -> int:
    """Write system calls process ``pid`` has made (``/proc/PID/io``, ``syscw``)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscw"))


def _less(now: tuple[int, int], then: tuple[int, int], scale: float = 1.0) -> tuple[float, float]:
    return (now[0] - then[0]) * scale, (now[1] - then[1]) * scale


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", default="tcp,rdma", help="comma-separated 1p1d transports (default: %(default)s)")
    p.add_argument("--requests", type=int, default=20, help="measured requests per system (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="requests per system before measuring (default: %(default)s)")
    p.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle CPU measured first (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight; above 1, each system in turn, in rounds, as bench e2e's tokens/s (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens per request under --concurrency (default: %(default)s)")
    p.add_argument("--baseline-tree", metavar="PATH", default=None,
                   help="also start each 1p1d cluster from this checkout (NAME@baseline), side by side")
    p.add_argument("--no-prefix-cache-arm", action="store_true",
                   help="also run each transport's 1p1d with --no-prefix-cache on its prefill, side by side")
    run(_main(p.parse_args()))


if __name__ == "__main__":
    main()
