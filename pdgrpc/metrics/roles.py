"""One facade per server kind: the only way servers record metrics.

The facades turn "what happened" into the right series, so a server's code reads
``metrics.on_abort(AbortReason.TRANSFER_TIMEOUT)`` rather than a metric name and label
strings, and a typo is an ``AttributeError`` at the call site instead of a silently new
series. Children are resolved once in ``__init__``: recording an event is one locked
integer add, cheap enough for the decode loop.

Each facade creates its own :class:`~prometheus_client.CollectorRegistry` unless given one
(never the process-global default: several servers live in one test process). Pass an
existing registry to put two roles behind one endpoint, e.g. a prefill controller with an
embedded bootstrap::

    prefill = PrefillMetrics(transport="tcp")
    bootstrap = BootstrapMetrics(prefill.registry)

Every series a facade can record exists from its construction (at 0), so ``rate()`` and
alerts work before the first event.
"""

from __future__ import annotations

import importlib.metadata
import re

from prometheus_client import CollectorRegistry

from pdgrpc.metrics.catalog import Outcome, RequestState, Role
from pdgrpc.metrics.families import Families, families_of
from pdgrpc.metrics.live import SnapshotFn
from pdgrpc.reasons import ABORT_REASON_LABELS, AnyAbortReason, ServerAbortReason, abort_label

__all__ = ["BootstrapMetrics", "DecodeMetrics", "MIGRATION_REASONS", "PrefillMetrics", "RoleMetrics", "RouterMetrics"]

# Why the router migrates a running stream: the ``reason`` label of pdgrpc_router_migrations_total.
MIGRATION_REASONS = (ServerAbortReason.PEER_FAILURE, ServerAbortReason.DRAIN_TIMEOUT)

# A transport label value is a backend's short name ("tcp", "rdma", a plugin's name or
# "module:Class"), never something per request.
_TRANSPORT = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _version() -> str:
    try:
        return importlib.metadata.version("pdgrpc")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _seconds(name: str, value: float) -> float:
    if not value >= 0:  # also rejects NaN
        raise ValueError(f"{name} must be >= 0 seconds, got {value!r}")
    return float(value)


class RoleMetrics:
    """What every server has: a registry, ``pdgrpc_server_info``, live resources."""

    role: Role

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._fam: Families = families_of(self.registry)
        self._info_fields: dict[str, str] = {"version": _version()}
        assert self._fam.info is not None
        self._fam.info.labels(self.role.value).info(self._info_fields)
        self._draining = self._fam.gauges["pdgrpc_draining"].labels(self.role.value)
        self._draining.set(0)

    # ---- live state ---------------------------------------------------------------------
    def bind(self, snapshot: SnapshotFn) -> None:
        """Serve this role's live gauges from ``snapshot()``, called at every scrape (on
        the metrics thread). The snapshot is a mapping or an object with attributes; see
        the catalog's ``field`` of each live metric for the names read."""
        self._fam.resources.bind(self.role, snapshot)

    def unbind(self) -> None:
        """Stop reading the bound snapshot (call before the objects it reads go away)."""
        self._fam.resources.unbind(self.role)

    def on_draining(self) -> None:
        """The server started to drain (``pdgrpc_draining`` reads 1 from now on)."""
        self._draining.set(1)

    def set_info(
        self,
        *,
        transport: str | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        """Set ``pdgrpc_server_info``'s labels: which process of a topology this is (tells
        the TP ranks of one decode apart on a dashboard)."""
        for key, value in (("transport", transport), ("dp_rank", dp_rank), ("dp_size", dp_size), ("tp_rank", tp_rank), ("tp_size", tp_size)):
            if value is not None:
                self._info_fields[key] = str(value)
        assert self._fam.info is not None
        self._fam.info.labels(self.role.value).info(dict(self._info_fields))


class RequestCounters:
    """Terminal states and aborts by reason, for a role that sees requests end."""

    def __init__(self, fam: Families, role: Role) -> None:
        requests = fam.counter("pdgrpc_requests_total")
        self._finished = requests.labels(role.value, RequestState.FINISHED.value)
        self._aborted = requests.labels(role.value, RequestState.ABORTED.value)
        self._refused = requests.labels(role.value, RequestState.REFUSED.value)
        aborts = fam.counter("pdgrpc_aborts_total")
        self._aborts = {label: aborts.labels(role.value, label) for label in ABORT_REASON_LABELS}

    def on_finished(self) -> None:
        self._finished.inc()

    def on_refused(self) -> None:
        self._refused.inc()

    def on_abort(self, reason: AnyAbortReason) -> None:
        self._aborts[abort_label(reason)].inc()
        self._aborted.inc()


class TransferCounters:
    """Bytes and latency of completed KV transfers over one transport backend."""

    def __init__(self, fam: Families, role: Role, transport: str) -> None:
        if not isinstance(transport, str) or not _TRANSPORT.fullmatch(transport):
            raise ValueError(f"transport must be the backend's short name (e.g. 'tcp'), got {transport!r}")
        self._bytes = fam.counter("pdgrpc_transfer_bytes_total").labels(role.value, transport)
        self._latency = fam.histogram("pdgrpc_transfer_seconds").labels(role.value, transport)

    def on_transfer(self, nbytes: int, seconds: float) -> None:
        self._bytes.inc(_count("nbytes", nbytes))
        self._latency.observe(_seconds("seconds", seconds))


class BatchCalls:
    """One batched bootstrap call kind (QueryDpRanks or RegisterDpRanks): calls by
    outcome and batch sizes."""

    def __init__(self, fam: Families, role: Role, calls: str, batch_size: str) -> None:
        counter = fam.counter(calls)
        self._ok = counter.labels(role.value, Outcome.OK.value)
        self._error = counter.labels(role.value, Outcome.ERROR.value)
        self._batch = fam.histogram(batch_size).labels(role.value)

    def on_ok(self, batch_size: int) -> None:
        self._ok.inc()
        self._batch.observe(_count("batch_size", batch_size))

    def on_failed(self, batch_size: int) -> None:
        self._error.inc()
        self._batch.observe(_count("batch_size", batch_size))


class DpQueryCounters:
    """QueryDpRanks calls, their batch sizes, and rooms that had no entry yet."""

    def __init__(self, fam: Families, role: Role) -> None:
        self._calls = BatchCalls(fam, role, "pdgrpc_dp_rank_queries_total", "pdgrpc_dp_rank_query_batch_size")
        self._missing = fam.counter("pdgrpc_dp_rank_query_rooms_missing_total").labels(role.value)

    def on_query(self, batch_size: int, missing: int) -> None:
        _count("batch_size", batch_size)
        if not 0 <= _count("missing", missing) <= batch_size:
            raise ValueError(f"missing ({missing}) must be within [0, batch_size={batch_size}]")
        self._calls.on_ok(batch_size)
        if missing:
            self._missing.inc(missing)

    def on_failed(self, batch_size: int) -> None:
        self._calls.on_failed(batch_size)


def _registrations(fam: Families, role: Role) -> BatchCalls:
    return BatchCalls(fam, role, "pdgrpc_dp_rank_registrations_total", "pdgrpc_dp_rank_registration_batch_size")


class DecodeMetrics(RoleMetrics):
    """Decode server (one per TP rank process). Live: active requests, metadata slots,
    KV pages in use / quarantined / total, transport rooms (``bind(scheduler.stats)``)."""

    role = Role.DECODE

    def __init__(self, registry: CollectorRegistry | None = None, *, transport: str) -> None:
        super().__init__(registry)
        self._requests = RequestCounters(self._fam, self.role)
        self._transfers = TransferCounters(self._fam, self.role, transport)
        self._queries = DpQueryCounters(self._fam, self.role)
        self._reused_tokens = self._fam.counter("pdgrpc_decode_reused_tokens_total").labels(self.role.value)
        self._local_prefills = self._fam.counter("pdgrpc_local_prefill_requests_total").labels(self.role.value)
        self._local_computed = self._fam.counter("pdgrpc_local_prefill_computed_tokens_total").labels(self.role.value)
        self._kv_event_streams = self._fam.gauges["pdgrpc_kv_event_streams"].labels(self.role.value)
        self._kv_event_streams.set(0)
        self._batch = self._fam.histogram("pdgrpc_decode_batch_size").labels(self.role.value)
        self.transport = transport
        self.set_info(transport=transport)

    def on_finished(self) -> None:
        """An admitted request completed normally on this server."""
        self._requests.on_finished()

    def on_step(self, batch: int) -> None:
        """A decode step generated a token for each of ``batch`` requests."""
        self._batch.observe(_count("batch", batch))

    def on_reused(self, tokens: int) -> None:
        """A request committed with ``tokens`` prompt tokens from the decode's prefix cache."""
        self._reused_tokens.inc(_count("tokens", tokens))

    def on_kv_event_streams(self, n: int) -> None:
        """The decode serves ``n`` SubscribeKvEvents streams now."""
        self._kv_event_streams.set(_count("streams", n))

    def on_local_prefill(self, computed: int) -> None:
        """A request's prompt was computed here (local prefill), ``computed`` of its tokens
        (the rest its prefix cache held), and its first token sent."""
        self._local_prefills.inc()
        self._local_computed.inc(_count("computed", computed))

    def on_refused(self) -> None:
        """A request was turned away at admission, before it took any resource (invalid
        argument, duplicate room, incompatible peer, shutting down)."""
        self._requests.on_refused()

    def on_abort(self, reason: AnyAbortReason) -> None:
        """An admitted request ended without completing. Counts it as ``aborted`` and
        under ``reason``; call it exactly once per request (where the request's end is
        decided, not in every layer that sees the failure)."""
        self._requests.on_abort(reason)

    def on_transfer(self, nbytes: int, seconds: float) -> None:
        """One request's KV transfer completed: ``nbytes`` over the data plane (pages and
        metadata row) in ``seconds``. A fake transfer moved no bytes: pass 0 bytes and it
        still counts its latency."""
        self._transfers.on_transfer(nbytes, seconds)

    def on_dp_rank_query(self, batch_size: int, *, missing: int = 0) -> None:
        """A QueryDpRanks call for ``batch_size`` rooms succeeded; ``missing`` of them had
        no entry yet."""
        self._queries.on_query(batch_size, missing)

    def on_dp_rank_query_failed(self, batch_size: int) -> None:
        """A QueryDpRanks call for ``batch_size`` rooms failed (RPC error, invalid batch)."""
        self._queries.on_failed(batch_size)


class PrefillMetrics(RoleMetrics):
    """Prefill: the DP controller (dispatch, registrations, requests that end in the
    controller) and each worker process (pages, transfers, requests it ran), each with
    its own endpoint. Live (workers): active requests, KV pages, transport rooms
    (``bind(worker.stats)``)."""

    role = Role.PREFILL

    def __init__(self, registry: CollectorRegistry | None = None, *, transport: str) -> None:
        super().__init__(registry)
        self._requests = RequestCounters(self._fam, self.role)
        self._transfers = TransferCounters(self._fam, self.role, transport)
        self._registrations = _registrations(self._fam, self.role)
        label = self.role.value
        self._prompt_tokens = self._fam.counter("pdgrpc_prefill_prompt_tokens_total").labels(label)
        self._hit_tokens = self._fam.counter("pdgrpc_prefix_cache_hit_tokens_total").labels(label)
        self._computed_tokens = self._fam.counter("pdgrpc_prefill_computed_tokens_total").labels(label)
        self._kv_event_streams = self._fam.gauges["pdgrpc_kv_event_streams"].labels(label)
        self._kv_event_streams.set(0)
        self.transport = transport
        self.set_info(transport=transport)

    def on_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A worker starts a prompt of ``prompt_tokens``, ``cached_tokens`` of them from
        the prefix cache."""
        _count("prompt_tokens", prompt_tokens)
        if not 0 <= _count("cached_tokens", cached_tokens) <= prompt_tokens:
            raise ValueError(f"cached_tokens must be <= prompt_tokens={prompt_tokens}, got {cached_tokens}")
        self._prompt_tokens.inc(prompt_tokens)
        self._hit_tokens.inc(cached_tokens)
        self._computed_tokens.inc(prompt_tokens - cached_tokens)

    def on_finished(self) -> None:
        """An admitted request completed normally on this server."""
        self._requests.on_finished()

    def on_refused(self) -> None:
        """A request was turned away at admission, before it took any resource."""
        self._requests.on_refused()

    def on_kv_event_streams(self, n: int) -> None:
        """The controller serves ``n`` SubscribeKvEvents streams now."""
        self._kv_event_streams.set(_count("streams", n))

    def on_abort(self, reason: AnyAbortReason) -> None:
        """An admitted request ended without completing (see :meth:`DecodeMetrics.on_abort`)."""
        self._requests.on_abort(reason)

    def on_transfer(self, nbytes: int, seconds: float) -> None:
        """One request's KV transfer completed: ``nbytes`` in ``seconds``."""
        self._transfers.on_transfer(nbytes, seconds)

    def on_dp_rank_registration(self, batch_size: int) -> None:
        """A RegisterDpRanks call for ``batch_size`` rooms succeeded."""
        self._registrations.on_ok(batch_size)

    def on_dp_rank_registration_failed(self, batch_size: int) -> None:
        """A RegisterDpRanks call for ``batch_size`` rooms failed (RPC error, conflict)."""
        self._registrations.on_failed(batch_size)


class BootstrapMetrics(RoleMetrics):
    """Bootstrap service (standalone, or embedded in a prefill controller's registry).
    Live: table size, capacity, expired and evicted rooms (``bind_table``)."""

    role = Role.BOOTSTRAP

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self._queries = DpQueryCounters(self._fam, self.role)
        self._registrations = _registrations(self._fam, self.role)

    def on_dp_rank_query(self, batch_size: int, *, missing: int = 0) -> None:
        """A QueryDpRanks call for ``batch_size`` rooms was answered; ``missing`` of them
        had no entry yet."""
        self._queries.on_query(batch_size, missing)

    def on_dp_rank_query_failed(self, batch_size: int) -> None:
        """A QueryDpRanks call for ``batch_size`` rooms failed (invalid batch)."""
        self._queries.on_failed(batch_size)

    def on_dp_rank_registration(self, batch_size: int) -> None:
        """A RegisterDpRanks call for ``batch_size`` rooms succeeded."""
        self._registrations.on_ok(batch_size)

    def on_dp_rank_registration_failed(self, batch_size: int) -> None:
        """A RegisterDpRanks call for ``batch_size`` rooms failed (conflict)."""
        self._registrations.on_failed(batch_size)

    def bind_table(self, stats: SnapshotFn) -> None:
        """``stats`` returns the room table's :class:`~pdgrpc.bootstrap.table.TableStats`
        (``lambda: table.stats``); its expired/evicted totals become counters."""
        self.bind(stats)


class RouterMetrics(RoleMetrics):
    """Router. Live: active requests and discovery records never dialed
    (``bind(lambda: {"active_requests": servicer.active, "identity_mismatches": view.identity_mismatches})``)."""

    role = Role.ROUTER

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self._requests = RequestCounters(self._fam, self.role)
        self._ttft = self._fam.histogram("pdgrpc_time_to_first_token_seconds").labels(self.role.value)
        self._tokens = self._fam.counter("pdgrpc_output_tokens_total").labels(self.role.value)
        self._retries = self._fam.counter("pdgrpc_retries_total").labels(self.role.value)
        self._ejections = self._fam.counter("pdgrpc_ejections_total").labels(self.role.value)
        resubscriptions = self._fam.counter("pdgrpc_kv_event_resubscriptions_total")
        self._resubscriptions = {r: resubscriptions.labels(self.role.value, r) for r in ("ended", "failed", "gap")}
        migrations = self._fam.counter("pdgrpc_router_migrations_total")
        self._migrations = {r: migrations.labels(self.role.value, r.value) for r in MIGRATION_REASONS}
        calls = self._fam.counter("pdgrpc_router_calls_total")
        self._calls = {(m, local): calls.labels(self.role.value, m, "local" if local else "grpc")
                       for m in ("prefill", "decode") for local in (True, False)}

    def on_finished(self) -> None:
        """A request completed normally."""
        self._requests.on_finished()

    def on_refused(self) -> None:
        """A request was turned away at admission."""
        self._requests.on_refused()

    def on_abort(self, reason: AnyAbortReason) -> None:
        """A request ended without completing (see :meth:`DecodeMetrics.on_abort`)."""
        self._requests.on_abort(reason)

    def on_retry(self) -> None:
        """A request went again to another prefill or decode after its call to one failed
        UNAVAILABLE before its first token."""
        self._retries.inc()

    def on_migration(self, reason: ServerAbortReason) -> None:
        """A running stream went on on another prefill and decode after its decode failed
        (``reason``: one of :data:`MIGRATION_REASONS`)."""
        self._migrations[reason].inc()

    def on_call(self, method: str, local: bool) -> None:
        """A ``method`` (prefill or decode) call went out, over the server's local socket or gRPC."""
        self._calls[method, local].inc()

    def on_eject(self) -> None:
        """A prefill or decode instance is passed over for a while: a call to it failed
        UNAVAILABLE."""
        self._ejections.inc()

    def on_kv_events_resubscribe(self, reason: str) -> None:
        """The router subscribes again to a prefill's KV events: the last subscription
        ``ended``, ``failed`` or showed a ``gap``."""
        self._resubscriptions[reason].inc()

    def on_first_token(self, seconds: float) -> None:
        """The first token of a request reached the client ``seconds`` after it arrived."""
        self._ttft.observe(_seconds("seconds", seconds))

    def on_tokens(self, n: int) -> None:
        """``n`` generated tokens were streamed to a client."""
        self._tokens.inc(_count("n", n))
