"""Resident memory of the engine processes serving a checkpoint, against weights + KV pool.

Starts ``servers/1p1d.toml`` over tcp with ``--model`` (default: SmolLM2-135M-Instruct,
fetched once) and ``--dtype`` and no size flags (so the sizes come from the checkpoint),
sends a few prompts, then prints for the prefill worker and the decode process their
RSS now and at peak (``VmRSS``, ``VmHWM``) and the ratio to the weights + KV pool their
log's ``sizing:`` line states.

    python scripts/rss_checkpoint.py [--model PATH] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
from pathlib import Path

from pdgrpc.cluster import Cluster, load_topology
from pdgrpc.cluster.client import generate
from pdgrpc.cluster.models import smollm2
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _status(pid: int) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def _engine_pid(pid: int) -> int:
    """The process holding the engine: the largest of ``pid`` and its descendants."""
    family, todo = [], [pid]
    while todo:
        p = todo.pop()
        family.append(p)
        todo += _children(p)
    return max(family, key=lambda p: _status(p)["VmRSS"])


async def main(args: argparse.Namespace) -> None:
    model = args.model or str(smollm2())
    t = load_topology("1p1d")
    topology = dataclasses.replace(t, name="1p1d-rss", engine={"model": model, "dtype": args.dtype})
    async with Cluster(topology, transport="tcp", start_timeout=300) as cluster:
        async with cluster.client_channel() as channel:
            stub = GenerateServiceStub(channel)
            for prompt in ("The capital of France is", "Once upon a time, " * 60):
                await generate(stub, prompt=prompt, max_new_tokens=32, timeout=120)
        for name in ("prefill", "decode"):
            pid = _engine_pid(cluster.procs[name].pid)
            log = (cluster.log_dir / f"{name}.log").read_text()
            m = re.findall(r"sizing: weights ([\d.]+) GB \+ KV pool ([\d.]+) GB", log)
            weights, kv = (float(x) * 1e9 for x in m[-1])
            st = _status(pid)
            print(
                f"{name}: pid {pid} RSS {st['VmRSS'] / 1e9:.2f} GB, peak {st['VmHWM'] / 1e9:.2f} GB; "
                f"weights {weights / 1e9:.2f} + KV pool {kv / 1e9:.2f} = {(weights + kv) / 1e9:.2f} GB; "
                f"RSS / (weights + KV) = {st['VmRSS'] / (weights + kv):.2f}, peak {st['VmHWM'] / (weights + kv):.2f}",
                flush=True,
            )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    asyncio.run(main(p.parse_args()))
