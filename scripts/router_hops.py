"""Where the router -> server hop's time goes: the router's call pattern, arm by arm.

Two server processes stand in for a prefill controller and a decode: each serves
``PrefillService.Prefill`` (answered at once) and ``DecodeService.Decode`` (one message)
and stamps the wall clock when its handler starts. The parent sends the router's
requests (512-token prompt) in each arm in turn, interleaved, and prints per arm the p50
and p99 of the one-way time (call made -> handler started, in the server) and the round
trip. Run: ``PYTHONPATH=. python scripts/router_hops.py [--iterations N] [--burn]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import sys
import time
from typing import TYPE_CHECKING, AsyncIterator

if TYPE_CHECKING:
    import socket

from pdgrpc.rpc.tuning import apply_grpc_defaults

apply_grpc_defaults()

import grpc  # noqa: E402

from pdgrpc.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc  # noqa: E402


class _Prefill(prefill_pb2_grpc.PrefillServiceServicer):
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        return prefill_pb2.PrefillResponse(bytes_transferred=time.time_ns())


class _Decode(decode_pb2_grpc.DecodeServiceServicer):
    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.DecodeResponse]:
        yield decode_pb2.DecodeResponse(token_ids=[1], bytes_transferred=time.time_ns(), finish_reason="length")


async def _serve(port_file: str, wrapped: bool, link_fd: int) -> None:
    from pdgrpc.rpc.server import start_server

    if link_fd >= 0:
        import socket

        from pdgrpc.prefill.link import WorkerLinkServer

        async def answer(request: prefill_pb2.PrefillRequest, first_token: object = None) -> prefill_pb2.PrefillResponse:
            return prefill_pb2.PrefillResponse(bytes_transferred=time.time_ns())

        await WorkerLinkServer.open(socket.socket(fileno=link_fd), "probe", answer)

    specs = [
        (prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name, lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(_Prefill(), s)),
        (decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name, lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(_Decode(), s)),
    ]
    if wrapped:
        server = await start_server(specs, port=0, local_socket=port_file + ".sock")
        port = server.port
    else:
        raw = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(_Prefill(), raw)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(_Decode(), raw)
        port = raw.add_insecure_port("127.0.0.1:0")
        await raw.start()
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.rename(port_file + ".tmp", port_file)
    await asyncio.Event().wait()


_DIR = ""  # the parent's private directory: the servers' port files and local sockets


def _start(tag: str, wrapped: bool, link: "socket.socket | None" = None) -> tuple[subprocess.Popen[bytes], str]:
    path = f"{_DIR}/{tag}"
    extra = [] if link is None else ["--link-fd", str(link.fileno())]
    proc = subprocess.Popen([sys.executable, __file__, "--serve", path] + ([] if wrapped else ["--raw"]) + extra,
                            pass_fds=() if link is None else (link.fileno(),))
    while not os.path.exists(path):
        time.sleep(0.05)
    with open(path) as f:
        port = f.read()
    os.unlink(path)
    return proc, f"127.0.0.1:{port}"


async def _measure(args: argparse.Namespace, ctrl: str, dec: str, raw_ctrl: str, sock: "socket.socket") -> dict[str, dict[str, list[float]]]:
    from pdgrpc.prefill.link import ControllerLink
    from pdgrpc.rpc.channels import ChannelPool
    from pdgrpc.rpc.local import LocalChannel

    locals_ = {ctrl: LocalChannel(f"{_DIR}/c.sock"), dec: LocalChannel(f"{_DIR}/d.sock")}

    link = await ControllerLink.open(sock, "probe")

    pool = ChannelPool()
    bare = grpc.aio.insecure_channel(raw_ctrl)
    ids = [256] + [65] * 511
    sampling = common_pb2.SamplingParams(max_new_tokens=1, seed=1)
    pre = prefill_pb2.PrefillRequest(bootstrap_room=5, request_id="r", input_ids=ids, sampling=sampling, room_secret=b"s" * 32)
    dreq = decode_pb2.DecodeRequest(bootstrap_room=5, request_id="r", input_ids=ids, sampling=sampling, room_secret=b"s" * 32,
                                    prefill_bootstrap_address=ctrl)
    meta = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)

    async def prefill_only(stub_ch: grpc.aio.Channel, timeout: float | None, metadata: object) -> tuple[float, float]:
        stub = prefill_pb2_grpc.PrefillServiceStub(stub_ch)
        t = time.time_ns()
        r = await stub.Prefill(pre, timeout=timeout, metadata=metadata)
        return (r.bytes_transferred - t) / 1e6, (time.time_ns() - t) / 1e6

    async def pair(timeout: float | None, metadata: object, local: bool = False) -> tuple[float, float]:
        p = prefill_pb2_grpc.PrefillServiceStub(locals_[ctrl] if local else pool.get(ctrl))
        d = decode_pb2_grpc.DecodeServiceStub(locals_[dec] if local else pool.get(dec))
        t = time.time_ns()
        pc = p.Prefill(pre, timeout=timeout, metadata=metadata)
        dc = d.Decode(dreq, timeout=timeout, metadata=metadata)
        fut = asyncio.ensure_future(pc)  # what the router does
        m = await dc.read()
        r = await fut
        await dc.read()
        return (r.bytes_transferred - t) / 1e6, (m.bytes_transferred - t) / 1e6

    async def link_only() -> tuple[float, float]:
        t = time.time_ns()
        r = await link.prefill(pre)
        return (r.bytes_transferred - t) / 1e6, (time.time_ns() - t) / 1e6

    async def link_pair() -> tuple[float, float]:
        d = decode_pb2_grpc.DecodeServiceStub(pool.get(dec))
        t = time.time_ns()
        fut = asyncio.ensure_future(link.prefill(pre))
        dc = d.Decode(dreq, timeout=300.0)
        m = await dc.read()
        r = await fut
        await dc.read()
        return (r.bytes_transferred - t) / 1e6, (m.bytes_transferred - t) / 1e6

    arms = {
        "link (socketpair), Prefill alone": link_only,
        "link Prefill + gRPC Decode": link_pair,
        "bare server+channel, Prefill alone": lambda: prefill_only(bare, None, None),
        "pdgrpc server+pool, Prefill alone": lambda: prefill_only(pool.get(ctrl), None, None),
        "pdgrpc, Prefill alone, timeout+traceparent": lambda: prefill_only(pool.get(ctrl), 300.0, meta),
        "pdgrpc, Prefill+Decode (router pattern)": lambda: pair(300.0, None),
        "local sockets, Prefill+Decode (router pattern)": lambda: pair(300.0, None, True),
    }
    out: dict[str, dict[str, list[float]]] = {k: {"a": [], "b": []} for k in arms}
    for i in range(args.warmup + args.iterations):
        for name, fn in arms.items():
            a, b = await fn()
            if args.idle:
                await asyncio.sleep(args.idle)  # the servers go idle between requests, as in bench e2e
            if i >= args.warmup:
                out[name]["a"].append(a)
                out[name]["b"].append(b)
    await pool.close()
    await bare.close()
    for channel in locals_.values():
        await channel.close()
    return out


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve")
    ap.add_argument("--raw", action="store_true")
    ap.add_argument("--link-fd", type=int, default=-1)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--idle", type=float, default=0.002, help="seconds between requests")
    ap.add_argument("--burn", type=int, default=0, help="CPU-bound processes running meanwhile")
    args = ap.parse_args()
    from pdgrpc.rpc.server import run

    if args.serve:
        run(_serve(args.serve, not args.raw, args.link_fd))
        return
    import socket

    global _DIR
    _DIR = tempfile.mkdtemp(prefix="router-hops-")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    procs = [_start("c", True, theirs), _start("d", True), _start("r", False)]
    theirs.close()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burn)]
    try:
        out = run(_measure(args, procs[0][1], procs[1][1], procs[2][1], ours))
    finally:
        for p in [*(p for p, _ in procs), *burners]:
            p.kill()
            p.wait()
        shutil.rmtree(_DIR, ignore_errors=True)
    for name, cols in out.items():
        pair = "Decode" in name
        la, lb = ("prefill one-way", "decode one-way") if pair else ("one-way", "round trip")
        print(f"{name:45s} {la} p50 {statistics.median(cols['a']):.3f} p99 {_p(cols['a'], .99):.3f} | "
              f"{lb} p50 {statistics.median(cols['b']):.3f} p99 {_p(cols['b'], .99):.3f} ms")


if __name__ == "__main__":
    main()
