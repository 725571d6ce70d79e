"""``python -m pdgrpc.cluster.demo``: disaggregated generation end to end, in one command.

Starts ``servers/1p1d.toml`` (one prefill, one decode, one router; real processes on
127.0.0.1) with the ``rdma`` transport -- or ``tcp``, saying why, only when the rdma
backend cannot be loaded here -- sends a handful of prompts through the router, and prints
each generated text with its time to first token, the KV bytes moved from prefill to
decode, the data-plane time (the first KV byte's arrival at the decode to its commit) and
rate, and the handshake-to-commit time (which includes the prefill's compute). Each output is also checked against colocated generation
(the same engine run in this process): they must be equal token for token. Stops the
cluster and exits 0; any failure exits non-zero with the reason.
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from pdgrpc.cluster.client import Completion, generate
from pdgrpc.cluster.launcher import Cluster, ClusterError
from pdgrpc.cluster.reference import reference_engine
from pdgrpc.cluster.topology import load_topology
from pdgrpc.engine.colocated import generate as colocated_generate
from pdgrpc.errors import PdgrpcError, TransportUnavailable
from pdgrpc.rpc.server import run
from pdgrpc.transport import registry
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub

PROMPTS = (
    "Hello! My name is",
    "The capital of France is",
    "Disaggregated serving splits an LLM request into",
    "Once upon a time, " * 12,  # a longer prompt: several KV pages, two prefill chunks
    "pdgrpc moves KV caches over gRPC-negotiated transports. " * 6,
)
MAX_NEW_TOKENS = 24


def pick_transport(wanted: str) -> str:
    if wanted != "rdma":
        return wanted
    try:
        registry.load("rdma")
    except TransportUnavailable as exc:
        print(f"note: the rdma transport cannot load here ({exc}); using tcp instead", flush=True)
        return "tcp"
    return "rdma"


def show(i: int, prompt: str, c: Completion, exact: bool) -> None:
    shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
    print(f"[{i}] prompt: {shown!r}  ({len(prompt.encode()) + 1} tokens)")
    print(f"    output: {c.text!r}")
    print(
        f"    TTFT {c.ttft_seconds * 1e3:.1f} ms | KV {c.bytes_transferred:,} bytes"
        f" | data plane {c.data_plane_seconds * 1e3:.3f} ms = {c.gbps:.3f} GB/s"
        f" | handshake to commit (incl. prefill compute) {c.transfer_seconds * 1e3:.2f} ms"
        f" | {len(c.token_ids)} tokens ({c.finish_reason})"
        f" | room {c.bootstrap_room:#x} | equals colocated: {'yes' if exact else 'NO'}",
        flush=True,
    )


async def main_async(args: argparse.Namespace) -> int:
    topology = load_topology(args.topology)
    transport = pick_transport(args.transport or topology.transport)
    engine = reference_engine(topology)
    print(f"starting {topology.name} with transport {transport} ...", flush=True)
    t0 = time.perf_counter()
    async with Cluster(topology, transport=transport) as cluster:
        print(f"{cluster.describe()}\nall healthy after {time.perf_counter() - t0:.1f} s; router at {cluster.router_address}\n", flush=True)
        failures = 0
        async with cluster.client_channel() as channel:
            stub = GenerateServiceStub(channel)
            for i, prompt in enumerate(PROMPTS, 1):
                c = await generate(stub, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, timeout=60)
                (ref,) = colocated_generate(engine, [prompt], MAX_NEW_TOKENS)
                exact = c.token_ids == ref.token_ids
                failures += not exact
                show(i, prompt, c, exact)
        cluster.check()
        print("\nstopping the cluster ...", flush=True)
    if failures:
        print(f"FAILED: {failures} output(s) differ from colocated generation", file=sys.stderr)
        return 1
    print(f"done: {len(PROMPTS)} prompts, every output equal to colocated generation", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.cluster.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default="1p1d", help="topology file or name (default: %(default)s)")
    p.add_argument("--transport", choices=["rdma", "tcp", "fake"], help="KV transport (default: the topology's, rdma)")
    args = p.parse_args(argv)
    try:
        return run(main_async(args))
    except (ClusterError, PdgrpcError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as exc:
        print(f"demo failed: a request failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
