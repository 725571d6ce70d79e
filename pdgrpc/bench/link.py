"""``python -m pdgrpc.bench link``: the controller -> worker hop, link vs gRPC.

A child process stands in for a prefill worker whose ``prefill`` answers at once. It
serves the same ``Prefill`` two ways: as ``PrefillService`` on a grpc.aio server (how the
controller reached its workers before :mod:`pdgrpc.prefill.link`) and on the link, over a
socketpair the parent hands it, as the controller does. The parent sends the same
``--prompt-tokens`` request over each in turn (interleaved) and reports the round trip's
p50 and p99 per way, with the link as a ratio of gRPC (the baseline). Both processes run
on uvloop with pdgrpc's gRPC settings, as the servers do (``python -m pdgrpc.bench``
applies them here, the peer applies its own).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from typing import AsyncIterator

from pdgrpc.bench.report import Result, percentile

DESCRIPTION = "controller -> worker Prefill round trip: the socketpair link vs a grpc.aio unary call (baseline), same process pair"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=2000, help="round trips per way (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=200, help="round trips per way before measuring (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="input_ids in each request (default: %(default)s)")


async def _measure(args: argparse.Namespace, grpc_address: str, sock: socket.socket) -> dict[str, list[float]]:
    import grpc

    from pdgrpc.prefill.link import ControllerLink
    from pdgrpc.v1 import prefill_pb2, prefill_pb2_grpc

    link = await ControllerLink.open(sock, "bench")
    req = prefill_pb2.PrefillRequest(bootstrap_room=1, request_id="bench", input_ids=[256] + [65] * (args.prompt_tokens - 1))
    async with grpc.aio.insecure_channel(grpc_address) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        ways = {"grpc": lambda: stub.Prefill(req, timeout=10), "link": lambda: link.prefill(req)}
        out: dict[str, list[float]] = {name: [] for name in ways}
        for i in range(args.warmup + args.iterations):
            for name, call in ways.items():
                t = time.perf_counter()
                await call()
                if i >= args.warmup:
                    out[name].append(time.perf_counter() - t)
    link.close_socket()
    return out


def run(args: argparse.Namespace) -> list[Result]:
    from pdgrpc.rpc.server import run as run_loop

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen(
        [sys.executable, "-m", "pdgrpc.bench.link", "--serve", str(theirs.fileno())],
        pass_fds=(theirs.fileno(),), stdout=subprocess.PIPE, text=True,
    )
    theirs.close()
    try:
        assert child.stdout is not None
        address = child.stdout.readline().strip()
        if not address:
            raise RuntimeError(f"the bench peer exited with code {child.wait()} before it served")
        samples = run_loop(_measure(args, address, ours))
    finally:
        child.terminate()
        child.wait(10)
    base50, base99 = percentile(samples["grpc"], 0.5) * 1e6, percentile(samples["grpc"], 0.99) * 1e6
    p50, p99 = percentile(samples["link"], 0.5) * 1e6, percentile(samples["link"], 0.99) * 1e6
    case = f"prefill/{args.prompt_tokens}tok"
    return [
        Result(f"{case}/grpc", "round_trip_p50", base50, "us"),
        Result(f"{case}/grpc", "round_trip_p99", base99, "us"),
        Result(f"{case}/link", "round_trip_p50", p50, "us", base50, p50 / base50),
        Result(f"{case}/link", "round_trip_p99", p99, "us", base99, p99 / base99),
    ]


async def _serve(fd: int) -> None:
    from pdgrpc.prefill.link import WorkerLinkServer
    from pdgrpc.rpc.server import start_server
    from pdgrpc.v1 import prefill_pb2, prefill_pb2_grpc

    async def prefill(req: prefill_pb2.PrefillRequest, first_token: object = None) -> prefill_pb2.PrefillResponse:
        return prefill_pb2.PrefillResponse(dp_rank=0, prompt_tokens=len(req.input_ids))

    class Servicer(prefill_pb2_grpc.PrefillServiceServicer):
        async def Prefill(self, request: prefill_pb2.PrefillRequest, context: object) -> prefill_pb2.PrefillResponse:
            return await prefill(request)

        async def PrefillStream(self, request: prefill_pb2.PrefillRequest, context: object) -> AsyncIterator[prefill_pb2.PrefillUpdate]:
            yield prefill_pb2.PrefillUpdate(reply=await prefill(request))

        async def GetStats(self, request: prefill_pb2.GetStatsRequest, context: object) -> prefill_pb2.GetStatsResponse:
            return prefill_pb2.GetStatsResponse()

        async def SubscribeKvEvents(self, request: prefill_pb2.SubscribeKvEventsRequest, context: object) -> AsyncIterator[prefill_pb2.KvEventBatch]:
            none: list[prefill_pb2.KvEventBatch] = []  # no cache here: the stream ends at once
            for b in none:
                yield b

    done = asyncio.Event()
    await WorkerLinkServer.open(socket.socket(fileno=fd), "bench", prefill, on_lost=done.set)
    server = await start_server(
        [("pdgrpc.v1.PrefillService", lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(Servicer(), s))],
        what="bench peer",
    )
    print(server.address, flush=True)
    await done.wait()  # the parent closed its end
    await server.stop(0)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"] or len(sys.argv) != 3:
        sys.exit("usage: python -m pdgrpc.bench.link --serve FD (started by python -m pdgrpc.bench link)")
    from pdgrpc.serving.launch import prepare_environment

    prepare_environment()  # as the worker it stands in for; before grpc is imported
    from pdgrpc.rpc.server import run as _run_loop

    _run_loop(_serve(int(sys.argv[2])))
