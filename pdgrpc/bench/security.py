"""``python -m pdgrpc.bench security``: what mTLS and the bearer token cost one gRPC call.

Four in-process servers on 127.0.0.1, one per mode (plaintext, token, mTLS, mTLS +
token), each called through a channel presenting that mode's credentials
(:mod:`pdgrpc.rpc.security`, certificates from :mod:`pdgrpc.rpc.certs`). Per round, in a
new random order, every mode gets ``--calls`` unary calls (``grpc.health.v1`` Check) and
``--streams`` streams opened up to their first message (Watch): the call kinds of
``Prefill`` and ``Decode``. Reports the p50 over rounds of each mode's mean, and its ratio
to plaintext measured in the same rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdgrpc.bench.report import Result
from pdgrpc.rpc.certs import issue, make_ca, write_token
from pdgrpc.rpc.security import Security
from pdgrpc.rpc.server import run as run_loop
from pdgrpc.rpc.server import start_server

DESCRIPTION = "per-call cost of mTLS and the bearer token (unary call; stream open + first message), vs plaintext, interleaved"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=40, help="measured rounds (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="rounds before measuring (default: %(default)s)")
    p.add_argument("--calls", type=int, default=50, help="unary calls per mode per round (default: %(default)s)")
    p.add_argument("--streams", type=int, default=20, help="streams per mode per round (default: %(default)s)")


async def _run(args: argparse.Namespace) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="pdgrpc-bench-security-") as tmp:
        d = Path(tmp)
        ca = make_ca(d)
        cert = issue(ca, d, "server")
        token = write_token(d / "token")
        modes = {
            "plain": Security(),
            "token": Security(token_file=token),
            "mtls": Security(cert=cert.cert, key=cert.key, ca=ca.cert),
            "mtls+token": Security(cert=cert.cert, key=cert.key, ca=ca.cert, token_file=token),
        }
        servers = [await start_server([], host="127.0.0.1", port=0, security=s, what=f"bench {n}") for n, s in modes.items()]
        channels = [s.channel(srv.address) for s, srv in zip(modes.values(), servers)]
        stubs = {n: health_pb2_grpc.HealthStub(ch) for n, ch in zip(modes, channels)}
        req = health_pb2.HealthCheckRequest(service="")
        unary: dict[str, list[float]] = {n: [] for n in modes}
        stream: dict[str, list[float]] = {n: [] for n in modes}
        order = list(modes)
        rng = random.Random(0)
        try:
            for r in range(args.warmup + args.rounds):
                rng.shuffle(order)
                for n in order:
                    stub = stubs[n]
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        await stub.Check(req, timeout=10)
                    u = (time.perf_counter() - t) / args.calls
                    t = time.perf_counter()
                    for _ in range(args.streams):
                        call = stub.Watch(req, timeout=10)
                        await call.read()
                        call.cancel()
                    s = (time.perf_counter() - t) / args.streams
                    if r >= args.warmup:
                        unary[n].append(u * 1e6)
                        stream[n].append(s * 1e6)
        finally:
            for ch in channels:
                await ch.close()
            for srv in servers:
                await srv.stop(0)
    out: list[Result] = []
    base_u, base_s = statistics.median(unary["plain"]), statistics.median(stream["plain"])
    for n in modes:
        u, s = statistics.median(unary[n]), statistics.median(stream[n])
        out += [
            Result(f"security/{n}", "unary_call_p50", u, "us", base_u, u / base_u),
            Result(f"security/{n}", "stream_open_first_message_p50", s, "us", base_s, s / base_s),
        ]
    return out


def run(args: argparse.Namespace) -> list[Result]:
    return run_loop(_run(args))
