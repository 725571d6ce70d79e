"""What splitting a transfer into messages costs over UCX, with nothing of pdgrpc's
protocol around it: the same bytes as 1, 8 or 48 contiguous tag messages between two
processes, receives posted before the sends start.

    .venv/bin/python scripts/rdma_messages.py [--mib 96] [--iterations 12]

Two spawned processes, each with a :class:`pdgrpc.transport.ucx.UcxWorker`; each
message has its own huge-page buffer on both sides (like a KV pool's per-layer
regions). One iteration: the receiver posts one batch of receives, then the sender
posts one batch of sends and times until the batch completes (every message's
rendezvous acknowledged: the receiver has the bytes). The layouts alternate iteration
by iteration, so load from other processes falls on all of them alike. Printed: median,
min and max per layout (the first two iterations are warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import statistics
import time
from typing import Any

MIB = 1 << 20
WARMUP = 2


def _child(role: str, conn: multiprocessing.connection.Connection, layouts: dict[str, tuple[int, int]]) -> None:
    import torch

    from pdgrpc.transport.ucx import UcxWorker
    from pdgrpc.host_memory import host_zeros

    async def main() -> None:
        worker = UcxWorker()
        worker.start()
        conn.send(worker.address)
        peer = conn.recv()
        ep = worker.endpoint(peer) if role == "send" else None
        bufs = {name: [host_zeros((each,), torch.uint8).fill_(7 if role == "send" else 0) for _ in range(n)]
                for name, (n, each) in layouts.items()}
        loop = asyncio.get_running_loop()
        while (cmd := conn.recv()) is not None:
            name, first_tag = cmd
            runs = [(t.data_ptr(), t.numel()) for t in bufs[name]]
            tags = [first_tag + i for i in range(len(runs))]
            done: asyncio.Future[Any] = loop.create_future()
            if role == "recv":
                worker.recv_batch(runs, tags, done.set_result, bufs[name])
                conn.send("posted")
                results = await done
                conn.send(all(status == 0 and length == n for (status, length), (_, n) in zip(results, runs)))
            else:
                assert ep is not None
                t0 = time.perf_counter()
                worker.send_batch(ep, runs, tags, done.set_result, bufs[name])
                await done
                conn.send(time.perf_counter() - t0)
        await worker.close()

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=96, help="bytes per transfer, MiB (a multiple of 48)")
    parser.add_argument("--iterations", type=int, default=12, help="iterations per layout, the first 2 untimed")
    args = parser.parse_args()
    layouts = {f"{n} x {args.mib // n} MiB": (n, args.mib * MIB // n) for n in (1, 8, 48)}
    ctx = multiprocessing.get_context("spawn")
    pipes: dict[str, multiprocessing.connection.Connection] = {}
    procs = []
    for role in ("send", "recv"):
        parent, child = ctx.Pipe()
        pipes[role] = parent
        proc = ctx.Process(target=_child, args=(role, child, layouts), daemon=True)
        proc.start()
        procs.append(proc)
    send_addr, recv_addr = pipes["send"].recv(), pipes["recv"].recv()
    pipes["send"].send(recv_addr)
    pipes["recv"].send(send_addr)
    times: dict[str, list[float]] = {name: [] for name in layouts}
    tag = 1
    for i in range(args.iterations):
        for name in layouts:
            tag += 64
            pipes["recv"].send((name, tag))
            assert pipes["recv"].recv() == "posted"
            pipes["send"].send((name, tag))
            latency = pipes["send"].recv()
            if pipes["recv"].recv() is not True:
                raise SystemExit(f"{name}: a message did not arrive intact")
            if i >= WARMUP:
                times[name].append(latency * 1e3)
    for name, ms in times.items():
        print(f"{name:>12}: median {statistics.median(ms):6.2f} ms  min {min(ms):6.2f}  max {max(ms):6.2f}")
    for conn in pipes.values():
        conn.send(None)
    for proc in procs:
        proc.join(10)


if __name__ == "__main__":
    main()
