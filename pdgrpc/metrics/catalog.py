"""Every pdgrpc metric, as data: name, type, help text (what, in which unit), labels, and
which server roles record it.

This table is the single source of truth. :mod:`pdgrpc.metrics.families` builds the
prometheus-client objects from it, the table in docs/metrics.md is generated from it
(``python -m pdgrpc.metrics``), and the lint test checks its names against the Prometheus
conventions, so a metric cannot be added in one place and forgotten in another.

Two kinds of metric live here:

* **live** metrics (``field`` is set) are read at scrape time from a snapshot of the
  server's own objects (see :class:`pdgrpc.metrics.live.ResourceGauges`): slots, pages,
  table size. They can never drift from the truth, because nothing counts them twice.
* **event** metrics (``field`` is None) are counters and histograms the server bumps
  through its role facade (:mod:`pdgrpc.metrics.roles`) as things happen.

This module imports nothing heavy (no torch): the bootstrap server stays light.

Labels are low-cardinality by construction: ``role`` (4 values), ``state`` (3),
``reason`` (the abort vocabulary, ~16), ``transport`` (backend name), ``outcome`` (2),
``method`` (2: a router's prefill and decode calls), ``path`` (2: local socket or gRPC).
Never a room id, request id or address.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

from pdgrpc.reasons import ServerAbortReason

__all__ = [
    "BATCH_BUCKETS",
    "CATALOG",
    "LABEL_NAMES",
    "LATENCY_BUCKETS",
    "MetricSpec",
    "Outcome",
    "RequestState",
    "Role",
    "STEP_BUCKETS",
    "ServerAbortReason",
    "TTFT_BUCKETS",
    "markdown_table",
]


class Role(str, enum.Enum):
    """Which server kind records a metric; the value is the ``role`` label."""

    BOOTSTRAP = "bootstrap"
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


class RequestState(str, enum.Enum):
    """How a request ended on one server; the value is the ``state`` label.

    Every request a server admitted ends exactly once as ``finished`` or ``aborted`` (an
    abort always also counts one ``pdgrpc_aborts_total{reason}``, so the two agree);
    ``refused`` requests were turned away at admission, before taking any resource."""

    FINISHED = "finished"
    ABORTED = "aborted"
    REFUSED = "refused"


class Outcome(str, enum.Enum):
    """Result of a bootstrap RPC (QueryDpRanks, RegisterDpRanks); the ``outcome`` label."""

    OK = "ok"
    ERROR = "error"


# Transfer latency spans a few pages over shared memory up to a long prompt over a slow tcp
# link or a stalled prefill, so the buckets reach the default transfer deadline (60 s).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
)
# Time to first token at the router: never sub-millisecond (two RPCs and a prefill).
TTFT_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Rooms per batched bootstrap call: 1 at low load, up to the bootstrap's max batch (65536).
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)

# Requests in one decode step: 1 at low load, hundreds on a large decode.
STEP_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

Kind = Literal["counter", "gauge", "histogram", "info"]

# The only label names a metric may carry (the lint test enforces it).
LABEL_NAMES = frozenset({"role", "state", "reason", "transport", "outcome", "method", "path"})


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """One metric. ``name`` is the exposed name (counters with ``_total``; an info
    metric's name ends in ``_info``)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    roles: tuple[Role, ...]
    unit: str = ""  # "seconds" | "bytes" | "" (a count)
    field: str | None = None  # live metrics: the snapshot field read at scrape time
    buckets: tuple[float, ...] = ()

    @property
    def live(self) -> bool:
        return self.field is not None


_ALL = (Role.BOOTSTRAP, Role.PREFILL, Role.DECODE, Role.ROUTER)
_R = ("role",)
_D, _P, _B, _X = Role.DECODE, Role.PREFILL, Role.BOOTSTRAP, Role.ROUTER

CATALOG: tuple[MetricSpec, ...] = (
    # ---- live: read from the server's objects at scrape time ------------------------
    MetricSpec(
        "pdgrpc_active_requests", "gauge",
        "Requests admitted by this server and not yet finished (count), read from the server at scrape time.",
        _R, (_D, _P, _X), field="active_requests",
    ),
    MetricSpec(
        "pdgrpc_metadata_slots_in_use", "gauge",
        "Metadata slots allocated to requests, quarantined ones included (count); bounds the transfers in flight.",
        _R, (_D,), field="slots_in_use",
    ),
    MetricSpec(
        "pdgrpc_metadata_slots_capacity", "gauge",
        "Metadata slots in the pool (count): the most transfers this decode rank runs at once.",
        _R, (_D,), field="slots_total",
    ),
    MetricSpec(
        "pdgrpc_kv_pages_in_use", "gauge",
        "KV pages allocated to live requests, quarantined pages excluded (count).",
        _R, (_D, _P), field="pages_in_use",
    ),
    MetricSpec(
        "pdgrpc_kv_pages_quarantined", "gauge",
        "KV pages of aborted requests held back from reuse until the prefill acknowledged the abort or its lease expired (count).",
        _R, (_D,), field="pages_quarantined",
    ),
    MetricSpec(
        "pdgrpc_kv_pages_capacity", "gauge",
        "KV pages in this rank's pool (count).",
        _R, (_D, _P), field="pages_total",
    ),
    MetricSpec(
        "pdgrpc_transport_rooms", "gauge",
        "Rooms the data-plane transport still tracks (count); stays above active requests only while releases lag.",
        _R, (_D, _P), field="transport_rooms",
    ),
    MetricSpec(
        "pdgrpc_transport_foreign_writes_total", "counter",
        "Data-plane writes refused because their proven writer is not the one the room's handshake named (count); "
        "each is answered as for a room that does not exist and changes nothing.",
        _R, (_D,), field="transport_foreign_writes",
    ),
    MetricSpec(
        "pdgrpc_bootstrap_rooms", "gauge",
        "Room -> dp rank entries held by the bootstrap table, expired but not yet swept ones included (count).",
        _R, (_B,), field="size",
    ),
    MetricSpec(
        "pdgrpc_bootstrap_rooms_capacity", "gauge",
        "Most live room entries the bootstrap table holds; past it the oldest unqueried rooms are evicted (count, --max-rooms).",
        _R, (_B,), field="max_rooms",
    ),
    MetricSpec(
        "pdgrpc_bootstrap_rooms_expired_total", "counter",
        "Room entries removed from the bootstrap table because their TTL passed (count).",
        _R, (_B,), field="expired",
    ),
    MetricSpec(
        "pdgrpc_bootstrap_rooms_evicted_total", "counter",
        "Live room entries no decode had queried, evicted from the bootstrap table oldest first, to make space for new "
        "rooms or because renewals filled its record ring (count); a queried room is never evicted.",
        _R, (_B,), field="evicted",
    ),
    MetricSpec(
        "pdgrpc_bootstrap_rooms_evicted_full_total", "counter",
        "Of pdgrpc_bootstrap_rooms_evicted_total, the rooms evicted because the bootstrap table was full (count): "
        "rooms registered faster than decodes query them, or a registrant flooding the table.",
        _R, (_B,), field="evicted_full",
    ),
    MetricSpec(
        "pdgrpc_prefix_cache_pages", "gauge",
        "KV pages the prefix cache holds for reuse, in use by requests or not (count); unused ones are evicted "
        "when the pool runs short.",
        _R, (_P,), field="prefix_cache_pages",
    ),
    MetricSpec(
        "pdgrpc_discovery_identity_mismatches_total", "counter",
        "Signed discovery records the router never dials (count): the server at the record's address shows another "
        "certificate than the record's signer (under mTLS).",
        _R, (_X,), field="identity_mismatches",
    ),
    MetricSpec(
        "pdgrpc_prefix_cache_evictions_total", "counter",
        "Cached KV pages evicted, least recently used first, to make room for new prompts (count).",
        _R, (_P,), field="prefix_cache_evictions",
    ),
    # ---- events: recorded through the role facades ------------------------------------
    MetricSpec(
        "pdgrpc_prefill_prompt_tokens_total", "counter",
        "Prompt tokens of the requests a prefill worker started (count); each is a cache hit or computed.",
        _R, (_P,),
    ),
    MetricSpec(
        "pdgrpc_prefix_cache_hit_tokens_total", "counter",
        "Prompt tokens whose KV came from the prefix cache instead of being computed (count).",
        _R, (_P,),
    ),
    MetricSpec(
        "pdgrpc_prefill_computed_tokens_total", "counter",
        "Prompt tokens a prefill worker computed: prompt tokens less prefix cache hits (count).",
        _R, (_P,),
    ),
    MetricSpec(
        "pdgrpc_decode_reused_tokens_total", "counter",
        "Prompt tokens whose KV the decode's prefix cache held already, so the prefill did not send them (count).",
        _R, (_D,),
    ),
    MetricSpec(
        "pdgrpc_decode_batch_size", "histogram",
        "Requests in one decode step (count of requests); its _count is the steps, its _sum the tokens they "
        "generated. Small batches under load mean requests wait elsewhere (for a prefill), and each token "
        "costs more.",
        _R, (_D,), buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "pdgrpc_local_prefill_requests_total", "counter",
        "Requests whose prompt the decode computed itself (DecodeRequest.local_prefill), with no prefill and no "
        "transfer (count).",
        _R, (_D,),
    ),
    MetricSpec(
        "pdgrpc_local_prefill_computed_tokens_total", "counter",
        "Prompt tokens the decode computed itself in local prefills: their prompts less what its prefix cache held "
        "(count).",
        _R, (_D,),
    ),
    MetricSpec(
        "pdgrpc_requests_total", "counter",
        "Requests that reached a terminal state on this server (count), by state: finished, aborted "
        "(see pdgrpc_aborts_total for why), refused (turned away at admission).",
        ("role", "state"), (_P, _D, _X),
    ),
    MetricSpec(
        "pdgrpc_aborts_total", "counter",
        "Requests aborted on this server (count), by reason: the decode state machine's AbortReason "
        "(metadata_corruption, peer_failure, transfer_failed, tp_desync, cancelled, one *_timeout per state) or a "
        "server-side cause (peer_failure, rejected_write, dp_rank_conflict, prefill_error, decode_error, bad_request, "
        "internal_error, shutdown, drain_timeout).",
        ("role", "reason"), (_P, _D, _X),
    ),
    MetricSpec(
        "pdgrpc_transfer_bytes_total", "counter",
        "KV and metadata bytes moved over the data plane, in bytes: sent (prefill) or received and committed (decode).",
        ("role", "transport"), (_P, _D), unit="bytes",
    ),
    MetricSpec(
        "pdgrpc_transfer_seconds", "histogram",
        "KV transfer latency of one request, in seconds: on prefill from the first write to the decode's "
        "acknowledgement of the metadata row; on decode from the handshake to the commit (includes the "
        "prefill's compute).",
        ("role", "transport"), (_P, _D), unit="seconds", buckets=LATENCY_BUCKETS,
    ),
    MetricSpec(
        "pdgrpc_dp_rank_queries_total", "counter",
        "Batched QueryDpRanks calls (count), by outcome (ok, error): sent (decode) or served (bootstrap).",
        ("role", "outcome"), (_D, _B),
    ),
    MetricSpec(
        "pdgrpc_dp_rank_query_batch_size", "histogram",
        "Rooms per QueryDpRanks call (count of rooms); its _sum is the rooms asked about.",
        _R, (_D, _B), buckets=BATCH_BUCKETS,
    ),
    MetricSpec(
        "pdgrpc_dp_rank_query_rooms_missing_total", "counter",
        "Rooms a successful QueryDpRanks asked about that had no entry yet (count); decode asks again next interval.",
        _R, (_D, _B),
    ),
    MetricSpec(
        "pdgrpc_dp_rank_registrations_total", "counter",
        "Batched RegisterDpRanks calls (count), by outcome (ok, error): sent (prefill) or served (bootstrap).",
        ("role", "outcome"), (_P, _B),
    ),
    MetricSpec(
        "pdgrpc_dp_rank_registration_batch_size", "histogram",
        "Rooms per RegisterDpRanks call (count of rooms); its _sum is the rooms registered.",
        _R, (_P, _B), buckets=BATCH_BUCKETS,
    ),
    MetricSpec(
        "pdgrpc_time_to_first_token_seconds", "histogram",
        "Time from a Generate call's arrival at the router to its first token sent to the client, in seconds.",
        _R, (_X,), unit="seconds", buckets=TTFT_BUCKETS,
    ),
    MetricSpec(
        "pdgrpc_output_tokens_total", "counter",
        "Generated tokens streamed to clients (count).",
        _R, (_X,),
    ),
    MetricSpec(
        "pdgrpc_retries_total", "counter",
        "Requests sent again, with a fresh room, to another prefill or decode because the call to one failed "
        "UNAVAILABLE (gone, unreachable, a worker died) before the first token (count); each request ends once "
        "in pdgrpc_requests_total however often it went again.",
        _R, (_X,),
    ),
    MetricSpec(
        "pdgrpc_router_calls_total", "counter",
        "Prefill and Decode calls the router made (count), by method (prefill, decode) and path: local (the "
        "server's --local-socket on this host) or grpc.",
        ("role", "method", "path"), (_X,),
    ),
    MetricSpec(
        "pdgrpc_router_migrations_total", "counter",
        "Running streams the router moved to another prefill and decode after the first token, because the decode "
        "failed (count), by reason: peer_failure (gone, unreachable, stream reset) or drain_timeout (it drained "
        "for its --drain-timeout); the stream goes on with prompt + generated tokens and the same seed.",
        ("role", "reason"), (_X,),
    ),
    MetricSpec(
        "pdgrpc_ejections_total", "counter",
        "Times a prefill or decode instance was ejected: passed over by new requests and retries for the "
        "router's --eject-s seconds because a call to it failed UNAVAILABLE (count).",
        _R, (_X,),
    ),
    MetricSpec(
        "pdgrpc_kv_event_resubscriptions_total", "counter",
        "Times the router subscribed again to a prefill's KV events (count), by reason: the stream ended, failed, "
        "or skipped a sequence number (gap); the prefill is dropped from cache_aware routing until its new "
        "subscription's snapshot arrives.",
        ("role", "reason"), (_X,),
    ),
    MetricSpec(
        "pdgrpc_kv_event_streams", "gauge",
        "SubscribeKvEvents streams a prefill controller or a decode serves now (count): pdgrpc routers under "
        "--policy cache_aware keep one open per prefill and per decode (with --decode-prefix-cache), smg one per "
        "prefill.",
        _R, (_D, _P),
    ),
    MetricSpec(
        "pdgrpc_draining", "gauge",
        "Whether this server drains (a count: 1 after SIGTERM or a DrainService.Drain call, while new requests "
        "are refused and those in flight finish, up to --drain-timeout; else 0).",
        _R, _ALL,
    ),
    MetricSpec(
        "pdgrpc_server_info", "info",
        "Constant 1; labels describe this server process (role, transport, dp/tp rank and size, pdgrpc version).",
        _R, _ALL,
    ),
)

def markdown_table() -> str:
    """The metric table of docs/metrics.md, generated from :data:`CATALOG`."""
    lines = [
        "| metric | type | labels | recorded by | meaning |",
        "|---|---|---|---|---|",
    ]
    for m in CATALOG:
        kind = m.kind + (" (live)" if m.live else "")
        roles = ", ".join(r.value for r in m.roles)
        labels = ", ".join(m.labels)
        lines.append(f"| `{m.name}` | {kind} | {labels} | {roles} | {m.help} |")
    return "\n".join(lines) + "\n"
