"""The decode server's command line: flags, the scheduler config they make, the test-fault
hook. Shared by rank 0 (``python -m pdgrpc.decode``) and the other TP ranks
(``python -m pdgrpc.decode.follower``), which take the same flags."""

from __future__ import annotations

import argparse

from pdgrpc.argtypes import port, positive_seconds, rank_count, whole_number
from pdgrpc.decode.job import SchedulerConfig
from pdgrpc.decode.shares import DEFAULT_MAX_DECODE_SHARE, share_arg
from pdgrpc.discovery.cli import add_discovery_arguments
from pdgrpc.metrics import add_metrics_arguments
from pdgrpc.gateway import add_gateway_arguments
from pdgrpc.serving.flags import MAX_CHUNK_TOKENS, add_engine_arguments, add_transport_arguments, chunk_tokens
from pdgrpc.serving.logs import add_logging_arguments
from pdgrpc.rpc.open_calls import DEFAULT_PER_CLIENT, limit_arg
from pdgrpc.rpc.drain import add_drain_arguments
from pdgrpc.rpc.local import add_local_socket_argument
from pdgrpc.rpc.security import add_security_arguments
from pdgrpc.rpc.tracing import add_tracing_arguments
from pdgrpc.state import DecodeDeadlines

__all__ = ["DESCRIPTION", "MAX_SLOTS", "build_parser", "scheduler_config_from_args"]

# The most metadata slots a decode takes: each is one transfer in flight, and a million is
# past any decode's load; more only allocate rows no request uses, until memory runs out.
MAX_SLOTS = 1 << 20

DESCRIPTION = """\
A pdgrpc decode server (gRPC, pdgrpc.v1.DecodeService).

For each Decode call (sent by the router together with the prefill request) it finds the
prefill dp rank that holds the request (routed rank, room % dp_size, or a batched
QueryDpRanks to the prefill's bootstrap), allocates KV pages and a metadata slot,
handshakes with that prefill worker, waits for the KV and the metadata row to land over
the transport, checks the row's bootstrap_room, then continues generation and streams
the tokens. Every phase has a deadline. GetStats reports what the server holds.
Also serves grpc.health.v1 and server reflection. Logs "pdgrpc decode listening on
HOST:PORT" once it accepts calls, and one line per request event (grep room=<room>).

Tensor parallelism: --tp-size N starts N-1 more processes (python -m pdgrpc.decode.follower),
one per TP rank, joined in a gloo group. Each rank holds its share of the KV heads, its own
transport endpoint and metadata rows; this process (rank 0) serves gRPC and drives the
others, which replay its scheduling so that all ranks commit the same requests in the same
order. Rank r's metrics are on --metrics-port + r. If a rank dies, the instance exits 1."""

_D = DecodeDeadlines()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdgrpc.decode", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC server listens on (default: %(default)s)")
    p.add_argument("--port", type=port, default=0, help="TCP port of the gRPC server; 0 picks a free one, printed in the log line (default: %(default)s)")
    add_engine_arguments(p)
    add_transport_arguments(p)
    add_security_arguments(p)
    add_drain_arguments(p)
    add_local_socket_argument(p)
    add_gateway_arguments(p, rooms=True)
    g = p.add_argument_group("scheduling")
    g.add_argument(
        "--tp-size", type=rank_count, default=1, metavar="N",
        help="tensor-parallel ranks (processes); must divide the model's heads and MLP width (default: %(default)s)",
    )
    g.add_argument(
        "--dist-timeout", type=positive_seconds, default=120.0, metavar="SECONDS",
        help="TP > 1: how long a rank waits in a collective for the others before giving up (default: %(default)s)",
    )
    g.add_argument("--dist-init", default="", help=argparse.SUPPRESS)  # set by rank 0 for the other ranks
    g.add_argument(
        "--num-slots", type=whole_number(1, "slots", maximum=MAX_SLOTS), default=256, metavar="N",
        help="metadata slots: at most this many transfers in flight; more requests wait for a slot (default: %(default)s)",
    )
    g.add_argument(
        "--max-decodes-per-client", type=limit_arg, default=DEFAULT_PER_CLIENT, metavar="N",
        help="most Decode calls one client (its mTLS certificate's name, else its host) may have open at once; more are refused with RESOURCE_EXHAUSTED "
        "(a router is one client: keep it above the router's requests in flight) (default: %(default)s)",
    )
    g.add_argument(
        "--max-decode-share", type=share_arg, default=DEFAULT_MAX_DECODE_SHARE, metavar="FRACTION",
        help="most of the KV pages and of the metadata slots that one client's Decode calls (its mTLS certificate's name, else its "
        "host; smg's legs are smg's) may hold before their first token, as a fraction of the pool; a call past it waits, holding "
        "nothing, until that client's earlier calls got their first token, so no caller whose prefill never writes can starve the "
        "others (a router is one client) (default: %(default)s)",
    )
    g.add_argument(
        "--dp-rank-query-interval", type=positive_seconds, default=0.05, metavar="SECONDS",
        help="at most one batched QueryDpRanks per prefill instance per interval (default: %(default)s)",
    )
    g.add_argument(
        "--decode-prefix-cache", action=argparse.BooleanOptionalAction, default=SchedulerConfig.prefix_cache,
        help="keep the pages of received prompts and generated tokens in a prefix cache and ask each prefill only for "
        "the pages a prompt's cached prefix lacks (delta transfer), and let the router send this decode short "
        "suffixes of what it holds to compute itself (local prefill); --no-decode-prefix-cache moves every page and "
        "frees it when its request ends; a transport that moves bytes (not fake) only (default: on)",
    )
    g.add_argument(
        "--local-prefill-chunk", type=chunk_tokens, default=SchedulerConfig.local_prefill_chunk, metavar="TOKENS",
        help="most prompt tokens of local prefills (a router's Decode with local_prefill: this decode computes the "
        "prompt itself) computed between two decode steps; smaller keeps running streams' inter-token latency "
        f"lower while a prompt is computed; at most {MAX_CHUNK_TOKENS} (default: %(default)s)",
    )
    g.add_argument(
        "--rpc-timeout", type=positive_seconds, default=5.0, metavar="SECONDS",
        help="deadline of each bootstrap call and AbortRoom (default: %(default)s)",
    )
    d = p.add_argument_group("deadlines (seconds a request may spend in each phase; DEADLINE_EXCEEDED names the phase)")
    d.add_argument("--resolve-timeout", type=positive_seconds, default=_D.resolve_dp_rank_s, metavar="S", help="until the prefill dp rank is known (default: %(default)s)")
    d.add_argument("--allocate-timeout", type=positive_seconds, default=_D.allocate_s, metavar="S", help="waiting for free KV pages and a metadata slot (default: %(default)s)")
    d.add_argument("--bootstrap-timeout", type=positive_seconds, default=_D.bootstrap_s, metavar="S", help="until every prefill worker accepted the handshake (default: %(default)s)")
    d.add_argument(
        "--waiting-timeout", type=positive_seconds, default=_D.waiting_for_input_s, metavar="S",
        help="handshake accepted, no KV byte arrived yet (prefill queueing and computing) (default: %(default)s)",
    )
    d.add_argument(
        "--claim-timeout", type=positive_seconds, default=_D.claim_s, metavar="S",
        help="handshake accepted, but no Prefill RPC claimed the room on the prefill worker: a request whose prefill "
        "never shows frees its pages after this, not after --waiting-timeout (a prefill worker that cannot tell, "
        "an older one, leaves it to --waiting-timeout) (default: %(default)s)",
    )
    d.add_argument("--transfer-timeout", type=positive_seconds, default=_D.transferring_s, metavar="S", help="KV arriving until the metadata row landed (default: %(default)s)")
    d.add_argument(
        "--abort-lease", type=positive_seconds, default=_D.abort_lease_s, metavar="S",
        help="an aborted request's pages and slot are reused once the prefill acknowledged AbortRoom, or after this long (default: %(default)s)",
    )
    add_metrics_arguments(p)
    add_logging_arguments(p)
    add_tracing_arguments(p)
    add_discovery_arguments(p, "decode")
    return p


def scheduler_config_from_args(ns: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        deadlines=DecodeDeadlines(
            resolve_dp_rank_s=ns.resolve_timeout,
            allocate_s=ns.allocate_timeout,
            bootstrap_s=ns.bootstrap_timeout,
            waiting_for_input_s=ns.waiting_timeout,
            claim_s=ns.claim_timeout,
            transferring_s=ns.transfer_timeout,
            abort_lease_s=ns.abort_lease,
        ),
        query_interval_s=ns.dp_rank_query_interval,
        rpc_timeout_s=ns.rpc_timeout,
        compute_nice=ns.compute_nice,
        prefix_cache=ns.decode_prefix_cache,
        local_prefill_chunk=ns.local_prefill_chunk,
    )
