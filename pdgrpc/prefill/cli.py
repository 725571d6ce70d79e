"""Command-line flags of ``python -m pdgrpc.prefill`` (and of the worker processes it starts).

The controller parses everything; each worker gets the engine, transport, logging and
per-request flags passed through unchanged (:func:`worker_argv`), plus its dp rank and
the bootstrap address, so every worker builds the same engine.
"""

from __future__ import annotations

import argparse
import os

from pdgrpc.argtypes import milliseconds, port, positive_seconds, rank_count, seconds, whole_number
from pdgrpc.discovery.cli import add_discovery_arguments
from pdgrpc.gateway import add_gateway_arguments
from pdgrpc.metrics import add_metrics_arguments
from pdgrpc.prefill.dispatch import CACHE_AWARE_MARGIN, METHODS
from pdgrpc.rpc.open_calls import DEFAULT_PER_CLIENT, limit_arg
from pdgrpc.rpc.drain import add_drain_arguments
from pdgrpc.rpc.local import add_local_socket_argument
from pdgrpc.rpc.security import add_security_arguments
from pdgrpc.rpc.tracing import add_tracing_arguments
from pdgrpc.serving.flags import MAX_CHUNK_TOKENS, add_engine_arguments, add_transport_arguments, chunk_tokens
from pdgrpc.serving.logs import add_logging_arguments

__all__ = ["build_parser", "add_worker_arguments", "worker_argv"]


DESCRIPTION = """\
pdgrpc prefill instance: a DP controller serving pdgrpc.v1.PrefillService (plus an embedded
BootstrapService unless --bootstrap is given, gRPC health and reflection) that starts
--dp-size worker processes. Each worker runs the reference engine, computes prompts in
chunks and writes their KV pages and metadata row straight into the decode's memory over
--transport, after the decode's Handshake (pdgrpc.v1.HandshakeService, served by each
worker). SIGTERM/SIGINT stop the controller and its workers gracefully. Its gRPC health
reports NOT_SERVING until every worker registered and is ready, then SERVING; at that
moment one line 'PDGRPC_READY {"address": "HOST:PORT", ...}' is printed to stdout.
With --tp-size N each dp rank is N worker processes (tp ranks), each handshaking and writing
its own KV heads; a request goes to all N of its dp rank. With --metrics-port P the
controller serves its metrics on P and worker (dp r, tp t) on P+1+r*N+t."""


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Per-request behaviour of every worker (passed through to the worker processes)."""
    g = parser.add_argument_group("per-request limits (each worker)")
    g.add_argument(
        "--chunk-size", type=chunk_tokens, default=512,
        help="prompt tokens computed per prefill chunk; a chunk's completed pages are sent while the next "
        f"chunk computes. At most {MAX_CHUNK_TOKENS}. Default: %(default)s",
    )
    g.add_argument(
        "--min-write-bytes", type=whole_number(0, "bytes"), default=1 << 20, metavar="BYTES",
        help="hold completed pages back until this many KV bytes are pending (or the prompt is done), then "
        "write them at once: each write has a fixed cost (messages, waking the decode) that outweighs "
        "overlapping small pieces with compute (and the compute thread wakes the server only when a write "
        "is due). 0 writes after every chunk. Default: %(default)s",
    )
    g.add_argument(
        "--max-prefills-per-client", type=limit_arg, default=DEFAULT_PER_CLIENT, metavar="N",
        help="most Prefill calls one client (its mTLS certificate's name, else its host) may have open at once, "
        "at the controller and at each worker; more are refused with RESOURCE_EXHAUSTED (a router is one client: "
        "keep it above the router's requests in flight). Default: %(default)s",
    )
    g.add_argument(
        "--handshake-timeout", type=positive_seconds, default=30.0,
        help="seconds a request waits for the decode's Handshake before failing with DEADLINE_EXCEEDED. "
        "Default: %(default)s",
    )
    g.add_argument(
        "--transfer-timeout", type=positive_seconds, default=60.0,
        help="seconds from writing the metadata row to the decode's acknowledgement before the request "
        "fails with DEADLINE_EXCEEDED. Default: %(default)s",
    )
    g.add_argument(
        "--page-wait-timeout", type=seconds, default=30.0,
        help="seconds a request waits for free KV pages when the pool is full before failing with "
        "RESOURCE_EXHAUSTED. Default: %(default)s",
    )
    g.add_argument(
        "--dist-timeout", type=positive_seconds, default=120.0,
        help="with --tp-size > 1: seconds a torch.distributed (gloo) collective of a dp group's workers may wait "
        "for the other ranks before it fails. Default: %(default)s",
    )
    g.add_argument(
        "--compute-in", choices=("process", "thread"), default="process",
        help="where a worker runs the engine's forward pass: 'process' (a child process over a KV pool in shared "
        "memory, so the worker's gRPC and transport work never waits on the compute for the interpreter) or "
        "'thread' (a thread of the worker). With --tp-size > 1 always 'thread' (the TP group lives in the "
        "worker). Default: %(default)s",
    )
    g.add_argument(
        "--no-prefix-cache", action="store_true",
        help="compute every prompt in full. By default a worker keeps the KV of the full pages of prompts it "
        "computed in its pool, and a prompt that starts with the same tokens reuses them and computes only the "
        "rest (same output token for token); unused cached pages are evicted, least recently used first, when "
        "the pool runs short. A TP group computes each prompt from the cached prefix every rank holds.",
    )
    g.add_argument(
        # At most the host's CPUs: more only contend, and past the thread limit the worker crashes starting them.
        "--compute-threads", type=whole_number(1, "threads", maximum=os.cpu_count() or 1), default=1,
        help="torch intra-op threads per worker, at most the host's CPUs (results do not depend on it). Default: %(default)s",
    )
    add_engine_arguments(parser)
    add_transport_arguments(parser)
    add_logging_arguments(parser)
    add_tracing_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdgrpc.prefill", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = p.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1", help="address the controller and its workers listen on. Default: %(default)s")
    g.add_argument(
        "--port", type=port, default=0,
        help="controller port (PrefillService, and BootstrapService when embedded); 0 picks a free one. Default: %(default)s",
    )
    g.add_argument(
        "--bootstrap", metavar="HOST:PORT", default="",
        help="use this external BootstrapService instead of embedding one in the controller. Default: embedded",
    )
    g.add_argument(
        "--bootstrap-ttl", type=positive_seconds, default=120.0,
        help="embedded bootstrap: seconds a room -> dp rank entry lives. Default: %(default)s",
    )
    g.add_argument("--grace", type=seconds, default=5.0, help="seconds in-flight requests get to finish on SIGTERM. Default: %(default)s")
    g.add_argument(
        "--worker-start-timeout", type=positive_seconds, default=120.0,
        help="seconds to wait for every worker to start and register. Default: %(default)s",
    )
    g.add_argument(
        "--worker-respawn-max-backoff", type=seconds, default=30.0, metavar="SECONDS",
        help="a worker that dies is started again with the rest of its dp rank's tp group (a gloo group cannot take "
        "one rank back), the delay between tries doubling from 0.5 s up to this; 0: never (the controller exits once "
        "no dp rank is left). Default: %(default)s",
    )
    d = p.add_argument_group("data parallelism")
    d.add_argument(
        "--dp-size", type=rank_count, default=1, metavar="N",
        help="number of worker processes (dp ranks). Default: %(default)s",
    )
    d.add_argument(
        "--tp-size", type=rank_count, default=1, metavar="N",
        help="tensor-parallel ranks per dp rank: each dp rank runs this many worker processes, one per tp rank, "
        "each holding 1/N of the KV heads (N must divide the model's query heads, KV heads and MLP size); they "
        "compute in lock step over gloo. Default: %(default)s",
    )
    d.add_argument(
        "--load-balance-method", choices=METHODS, default="round_robin",
        help="dp rank for requests without routed_dp_rank: 'round_robin' (in turn), 'follow_bootstrap_room' "
        "(room %% dp_size; decode computes the rank without asking bootstrap), 'shortest_queue' (fewest "
        "requests in flight), 'cache_aware' (the rank whose prefix cache holds the longest prefix of the prompt, "
        f"unless it has more than {CACHE_AWARE_MARGIN} requests in flight beyond the least busy rank; else the least "
        "busy). Except under follow_bootstrap_room, every room's rank is registered with bootstrap (batched) for "
        "decode to query. Default: %(default)s",
    )
    d.add_argument(
        "--force-dp-rank-query", action="store_true",
        help="register every room's rank and make decode always query, even under follow_bootstrap_room; "
        "then a routed_dp_rank that differs from room %% dp_size is allowed (otherwise it is refused with "
        "FAILED_PRECONDITION)",
    )
    d.add_argument(
        "--dp-register-window-ms", type=milliseconds, default=2.0,
        help="room -> rank registrations arriving within this window go to bootstrap as one RegisterDpRanks. "
        "Default: %(default)s",
    )
    k = p.add_argument_group("KV events (SubscribeKvEvents serves them always)")
    k.add_argument(
        "--kv-events-zmq", metavar="ENDPOINT", default="",
        help="also publish the instance's prefix cache events in vLLM's ZMQ format (msgpack KVEventBatch on a PUB "
        "socket bound here, e.g. tcp://127.0.0.1:5557), as Dynamo, llm-d and AIBrix read them. Needs "
        "pdgrpc[zmq]. Default: off",
    )
    k.add_argument(
        "--no-smg-kv-events", action="store_true",
        help="answer smg's SubscribeKvEvents with UNIMPLEMENTED, so smg's cache_aware policy routes by its own "
        "approximate tree of what it sent where, not by the prefix cache's events (PrefillService.SubscribeKvEvents "
        "still serves them)",
    )
    k.add_argument(
        "--kv-events-zmq-replay", metavar="ENDPOINT", default="",
        help="with --kv-events-zmq: a ROUTER socket bound here answers a replay request (the first sequence "
        "wanted, 8 bytes big-endian) with the messages still held. Default: off",
    )
    add_worker_arguments(p)
    add_gateway_arguments(p, rooms=True)  # controller only: the workers do not serve smg
    # Controller only (not in add_worker_arguments): each worker gets its own port.
    add_metrics_arguments(p)
    add_discovery_arguments(p, "prefill")
    add_drain_arguments(p)
    add_local_socket_argument(p)
    add_security_arguments(p)  # passed to the workers by security_argv
    return p


def worker_argv(ns: argparse.Namespace) -> list[str]:
    """The pass-through flags for a worker process (everything :func:`add_worker_arguments`
    adds). Every worker flag is spelled ``--`` + its dest with dashes, and a flag whose
    default is a bool is a switch, present when true."""
    probe = argparse.ArgumentParser(add_help=False)
    add_worker_arguments(probe)
    out: list[str] = []
    for dest, default in vars(probe.parse_args([])).items():
        flag, value = "--" + dest.replace("_", "-"), getattr(ns, dest)
        if isinstance(default, bool):
            if value:
                out.append(flag)
        elif value is not None:  # unset stays unset
            out += [flag, str(value)]
    return out
