"""``python -m pdgrpc.bench gateway``: smg in front of pdgrpc vs pdgrpc's own router.

Starts ``servers/smg-1p1d.toml``: one prefill and one decode, fronted at once by smg
(SGLang's model gateway, Rust, OpenAI-compatible HTTP) and by pdgrpc's router (Python,
gRPC ``GenerateService``). Both send every request to the same two servers, so the
difference is the front door: smg's HTTP server, its PD pipeline and the
``SglangScheduler`` adapter on the servers (:mod:`pdgrpc.gateway`), against the router's
gRPC hop. Then, in ``--repeats`` rounds (the front door that goes first alternates):

* **TTFT**: ``--ttft-requests`` prompts of ``--prompt-tokens`` token ids, one request at
  a time, each prompt sent through both front doors in a new (seeded) order. The client
  measures from sending the request to the first token: smg's ``/generate`` with
  ``input_ids`` and ``stream`` (server-sent events over a kept-alive HTTP/1.1 connection),
  the router's streamed ``Generate``.
* **tokens/s**: ``--throughput-requests`` requests, ``--concurrency`` in flight, each
  generating exactly ``--max-new-tokens`` tokens (``ignore_eos``); tokens / wall time.

Results: per front door the p50/p99 TTFT and tokens/s of all rounds together, smg's
ratios to the router's, and each round's TTFT p50 ratio (how much the ratio moves
between rounds on this host). Both front doors must return the same token ids for every
TTFT prompt, or the benchmark stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from typing import Any

import grpc

from pdgrpc.bench.report import Result, percentile
from pdgrpc.cluster.client import generate
from pdgrpc.cluster.launcher import Cluster
from pdgrpc.cluster.topology import load_topology
from pdgrpc.errors import PdgrpcError
from pdgrpc.gateway import DEFAULT_SERVED_MODEL_NAME
from pdgrpc.rpc.server import run as run_loop
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub

DESCRIPTION = "TTFT p50/p99 and tokens/s through smg vs through pdgrpc's router, same servers and prompts, same run"

ROUTER, SMG = "router", "smg"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", default="tcp", help="KV transport of the prefill and decode (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of the TTFT requests (default: %(default)s)")
    p.add_argument("--ttft-requests", type=int, default=40, help="sequential requests per front door per round (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="requests per front door before measuring (default: %(default)s)")
    p.add_argument("--throughput-requests", type=int, default=48, help="requests per front door per round for tokens/s (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight for tokens/s (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per tokens/s request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="rounds, the first front door alternating (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")


class SmgClient:
    """``/generate`` over one kept-alive HTTP/1.1 connection (one request at a time)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None

    async def generate(self, ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> tuple[list[int], float]:
        """Token ids and seconds from sending to the first token."""
        if self._conn is None:
            self._conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._conn
        body = json.dumps({
            "model": DEFAULT_SERVED_MODEL_NAME, "input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": ignore_eos},
        }).encode()
        start = time.perf_counter()
        writer.write(
            f"POST /generate HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        status = await reader.readline()
        if b" 200 " not in status:
            raise PdgrpcError(f"smg /generate answered {status.decode().strip()}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers (chunked transfer, kept alive)
        out: list[int] = []
        first = 0.0
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return out, first
            chunk = await reader.readexactly(size + 2)
            for line in chunk.decode().splitlines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                event: dict[str, Any] = json.loads(line[5:])
                if event["meta_info"].get("finish_reason") is None:  # the last event repeats the last ids
                    if not out:
                        first = time.perf_counter() - start
                    out += event["output_ids"]


async def _ttft(router: GenerateServiceStub, smg: SmgClient, prompts: list[list[int]], warmup: int, rng: random.Random) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {ROUTER: [], SMG: []}
    for i, ids in enumerate(prompts):
        order = [ROUTER, SMG]
        rng.shuffle(order)
        got: dict[str, list[int]] = {}
        for name in order:
            if name == ROUTER:
                c = await generate(router, input_ids=ids, max_new_tokens=2, timeout=60)
                got[name], ttft = list(c.token_ids), c.client_ttft_seconds
            else:
                got[name], ttft = await smg.generate(ids, 2)
            if i >= warmup:
                out[name].append(ttft)
        if got[ROUTER] != got[SMG]:
            raise PdgrpcError(f"prompt {i}: smg returned {got[SMG]}, the router {got[ROUTER]}; not reporting numbers")
    return out


async def _throughput(name: str, router: GenerateServiceStub, cluster: Cluster, prompts: list[list[int]], max_new: int, concurrency: int) -> float:
    host, _, port = cluster.openai_base_url.removeprefix("http://").removesuffix("/v1").rpartition(":")
    clients = [SmgClient(host, int(port)) for _ in range(concurrency)]
    queue = list(prompts)

    async def worker(k: int) -> int:
        n = 0
        while queue:
            ids = queue.pop()
            if name == ROUTER:
                n += len((await generate(router, input_ids=ids, max_new_tokens=max_new, ignore_eos=True, timeout=300)).token_ids)
            else:
                n += len((await clients[k].generate(ids, max_new, ignore_eos=True))[0])
        return n

    start = time.perf_counter()
    try:
        total = sum(await asyncio.gather(*(worker(k) for k in range(concurrency))))
    finally:
        for c in clients:
            await c.close()
    return total / (time.perf_counter() - start)


async def _run(args: argparse.Namespace) -> list[Result]:
    rng = random.Random(args.seed)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[256] + [rng.randrange(32, 127) for _ in range(length - 1)] for _ in range(n)]

    cluster = Cluster(load_topology("smg-1p1d"), transport=args.transport)
    ttft: dict[str, list[float]] = {ROUTER: [], SMG: []}
    tps: dict[str, list[float]] = {ROUTER: [], SMG: []}
    round_ratios: list[float] = []
    async with contextlib.AsyncExitStack() as stack:
        print(f"starting smg-1p1d over {args.transport} ...", flush=True)
        await stack.enter_async_context(cluster)
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(cluster.router_address))
        router = GenerateServiceStub(channel)
        host, _, port = cluster.openai_base_url.removeprefix("http://").removesuffix("/v1").rpartition(":")
        smg = SmgClient(host, int(port))
        stack.push_async_callback(smg.close)
        for r in range(args.repeats):
            print(f"round {r + 1}/{args.repeats}: TTFT ({args.ttft_requests} x {args.prompt_tokens} tokens), tokens/s ...", flush=True)
            got = await _ttft(router, smg, prompts(args.warmup + args.ttft_requests, args.prompt_tokens), args.warmup, rng)
            round_ratios.append(percentile(got[SMG], 0.5) / percentile(got[ROUTER], 0.5))
            for name in (ROUTER, SMG):
                ttft[name] += got[name]
            order = [ROUTER, SMG] if r % 2 == 0 else [SMG, ROUTER]
            batch = prompts(args.throughput_requests, args.prompt_tokens)
            for name in order:
                tps[name].append(await _throughput(name, router, cluster, batch, args.max_new_tokens, args.concurrency))
        cluster.check()

    case = f"{args.transport}/{args.prompt_tokens}tok"
    r50, r99 = percentile(ttft[ROUTER], 0.5) * 1e3, percentile(ttft[ROUTER], 0.99) * 1e3
    s50, s99 = percentile(ttft[SMG], 0.5) * 1e3, percentile(ttft[SMG], 0.99) * 1e3
    rt, st = statistics.median(tps[ROUTER]), statistics.median(tps[SMG])
    results = [
        Result(f"ttft/{case}/{ROUTER}", "ttft_p50", r50, "ms"),
        Result(f"ttft/{case}/{ROUTER}", "ttft_p99", r99, "ms"),
        Result(f"ttft/{case}/{SMG}", "ttft_p50", s50, "ms", r50, s50 / r50),
        Result(f"ttft/{case}/{SMG}", "ttft_p99", s99, "ms", r99, s99 / r99),
        Result(f"ttft/{case}/{SMG}", "ttft_p50_overhead", s50 - r50, "ms"),
        Result(f"throughput/{case}/{ROUTER}", "tokens_per_s", rt, "tok/s"),
        Result(f"throughput/{case}/{SMG}", "tokens_per_s", st, "tok/s", rt, st / rt),
    ]
    results += [Result(f"ttft/{case}/{SMG}/round{i + 1}", "ttft_p50_ratio", x, "x") for i, x in enumerate(round_ratios)]
    return results


def run(args: argparse.Namespace) -> list[Result]:
    return run_loop(_run(args))
