"""``bench transport --device cuda``: the KV regions of both sides in GPU memory, and the
raw baseline for that case -- torch's CUDA IPC ``copy_`` of the same bytes between two
processes.

Baseline: a child process allocates the destination buffer on the GPU and shares it
with this process through CUDA IPC (``torch.multiprocessing`` sends the tensor's IPC
handle); each iteration is ``dst[:n].copy_(src[:n])`` on the device, then a
synchronize of the copying stream: what a transport cannot beat between two processes on
one GPU (a device-to-device copy, ``cudaMemcpy`` over the IPC mapping). After the
timed iterations the child digests what it received, so the baseline moved real bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import torch

from pdgrpc.errors import ConfigError
from pdgrpc.transport.testing.peer import Layout, digest

__all__ = ["BASELINE_NAME", "add_device_argument", "ipc_copy_baseline", "placed", "resolve_bench_device"]

BASELINE_NAME = "raw torch CUDA IPC copy_"


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="cpu",
        help="where both sides' KV regions live: cpu, or cuda[:N] (GPU memory; the baseline becomes a CUDA IPC "
        "copy_ between two processes). Default: %(default)s")


def resolve_bench_device(args: argparse.Namespace, bench: str = "transport") -> str:
    """``args.device`` checked against this machine; exits 2 with one line naming the flag
    where it cannot be used (e.g. ``--device cuda`` without torch.cuda)."""
    from pdgrpc.device import resolve_device

    spec = getattr(args, "device", "cpu")
    try:
        return str(resolve_device(spec))
    except ConfigError as exc:
        print(f"python -m pdgrpc.bench {bench}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def placed(layout: Layout, device: str) -> Layout:
    """``layout`` with its KV regions on ``device`` (metadata rows stay in host memory)."""
    return layout if device == "cpu" else dataclasses.replace(layout, device=device, huge_pages=False)


def _receiver(conn: Any, queue: Any, max_bytes: int, device: str) -> None:
    """Child: the destination buffer, shared through CUDA IPC; digests it when told."""
    dst = torch.zeros(max_bytes, dtype=torch.uint8, device=device)
    queue.put(dst)
    n = conn.recv()  # the bytes of the last copy, once the parent is done
    conn.send(digest(dst[:n]))
    conn.recv()  # the parent closed its mapping: the memory may go


def ipc_copy_baseline(sizes: list[int], iterations: int, warmup: int, device: str) -> dict[int, list[float]]:
    """Seconds of each timed CUDA IPC ``copy_`` of each size, between this process and a
    child on ``device``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(child, queue, max(sizes), device), daemon=True)
    proc.start()
    try:
        dst = queue.get(timeout=120)
        src = (torch.arange(max(sizes), dtype=torch.int64, device=device) % 251).to(torch.uint8)
        stream = torch.cuda.current_stream(src.device)
        out: dict[int, list[float]] = {}
        for n in sizes:
            lat = []
            for i in range(warmup + iterations):
                stream.synchronize()
                t0 = time.perf_counter()
                dst[:n].copy_(src[:n])
                stream.synchronize()
                if i >= warmup:
                    lat.append(time.perf_counter() - t0)
            out[n] = lat
        last = sizes[-1]
        parent.send(last)
        if not parent.poll(120) or parent.recv() != digest(src[:last]):
            raise RuntimeError("CUDA IPC baseline: the child's buffer differs from the bytes copied")
        del dst
        parent.send(None)
        return out
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
