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
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry

from pdgrpc.metrics.catalog import Outcome, RequestState, Role
from pdgrpc.metrics.families import Families, families_of
from pdgrpc.metrics.live import SnapshotFn

if TYPE_CHECKING:  # the bootstrap facade must not import pdgrpc.state
    from pdgrpc.metrics.reasons import AnyAbortReason

__all__ = ["BootstrapMetrics", "DecodeMetrics", "PrefillMetrics", "RoleMetrics", "RouterMetrics"]

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

    # ---- live state ---------------------------------------------------------------------
    def bind(self, snapshot: SnapshotFn) -> None:
        """Serve this role's live gauges from ``snapshot()``, called at every scrape (on
        the metrics thread). The snapshot is a mapping or an object with attributes; see
        the catalog's ``field`` of each live metric for the names read."""
        self._fam.resources.bind(self.role, snapshot)

    def unbind(self) -> None:
        """Stop reading the bound snapshot (call before the objects it reads go away)."""
        self._fam.resources.unbind(self.role)

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


class _RequestsMixin(RoleMetrics):
    """Servers that see requests end: terminal states and aborts by reason."""

    def _init_requests(self) -> None:
        from pdgrpc.metrics import reasons  # pdgrpc.state.outcomes (torch-free): only servers that record aborts

        role = self.role.value
        requests = self._fam.counter("pdgrpc_requests_total")
        self._finished = requests.labels(role, RequestState.FINISHED.value)
        self._aborted = requests.labels(role, RequestState.ABORTED.value)
        self._refused = requests.labels(role, RequestState.REFUSED.value)
        aborts = self._fam.counter("pdgrpc_aborts_total")
        self._aborts = {label: aborts.labels(role, label) for label in reasons.ABORT_REASON_LABELS}
        self._abort_label: Callable[[AnyAbortReason], str] = reasons.abort_label

    def on_finished(self) -> None:
        """An admitted request completed normally on this server."""
        self._finished.inc()

    def on_refused(self) -> None:
        """A request was turned away at admission, before it took any resource (invalid
        argument, duplicate room, incompatible peer, shutting down)."""
        self._refused.inc()

    def on_abort(self, reason: AnyAbortReason) -> None:
        """An admitted request ended without completing. Counts it as ``aborted`` and
        under ``reason``; call it exactly once per request (where the request's end is
        decided, not in every layer that sees the failure)."""
        self._aborts[self._abort_label(reason)].inc()
        self._aborted.inc()


class _TransferMixin(_RequestsMixin):
    def _init_transfer(self, transport: str) -> None:
        if not isinstance(transport, str) or not _TRANSPORT.fullmatch(transport):
            raise ValueError(f"transport must be the backend's short name (e.g. 'tcp'), got {transport!r}")
        self.transport = transport
        self._bytes = self._fam.counter("pdgrpc_transfer_bytes_total").labels(self.role.value, transport)
        self._latency = self._fam.histogram("pdgrpc_transfer_seconds").labels(self.role.value, transport)
        self.set_info(transport=transport)

    def on_transfer(self, nbytes: int, seconds: float) -> None:
        """One request's KV transfer completed: ``nbytes`` over the data plane (pages and
        metadata row) in ``seconds``. A fake transfer moved no bytes: pass 0 bytes and it
        still counts its latency."""
        self._bytes.inc(_count("nbytes", nbytes))
        self._latency.observe(_seconds("seconds", seconds))


class _DpQueryMixin(RoleMetrics):
    def _init_dp_queries(self) -> None:
        role = self.role.value
        queries = self._fam.counter("pdgrpc_dp_rank_queries_total")
        self._query_ok = queries.labels(role, Outcome.OK.value)
        self._query_error = queries.labels(role, Outcome.ERROR.value)
        self._query_batch = self._fam.histogram("pdgrpc_dp_rank_query_batch_size").labels(role)
        self._query_missing = self._fam.counter("pdgrpc_dp_rank_query_rooms_missing_total").labels(role)

    def on_dp_rank_query(self, batch_size: int, *, missing: int = 0) -> None:
        """A QueryDpRanks call for ``batch_size`` rooms succeeded; ``missing`` of them had
        no entry yet."""
        _count("batch_size", batch_size)
        if not 0 <= _count("missing", missing) <= batch_size:
            raise ValueError(f"missing ({missing}) must be within [0, batch_size={batch_size}]")
        self._query_ok.inc()
        self._query_batch.observe(batch_size)
        if missing:
            self._query_missing.inc(missing)

    def on_dp_rank_query_failed(self, batch_size: int) -> None:
        """A QueryDpRanks call for ``batch_size`` rooms failed (RPC error, invalid batch)."""
        self._query_error.inc()
        self._query_batch.observe(_count("batch_size", batch_size))


class _DpRegisterMixin(RoleMetrics):
    def _init_dp_registrations(self) -> None:
        role = self.role.value
        regs = self._fam.counter("pdgrpc_dp_rank_registrations_total")
        self._reg_ok = regs.labels(role, Outcome.OK.value)
        self._reg_error = regs.labels(role, Outcome.ERROR.value)
        self._reg_batch = self._fam.histogram("pdgrpc_dp_rank_registration_batch_size").labels(role)

    def on_dp_rank_registration(self, batch_size: int) -> None:
        """A RegisterDpRanks call for ``batch_size`` rooms succeeded."""
        self._reg_ok.inc()
        self._reg_batch.observe(_count("batch_size", batch_size))

    def on_dp_rank_registration_failed(self, batch_size: int) -> None:
        """A RegisterDpRanks call for ``batch_size`` rooms failed (RPC error, conflict)."""
        self._reg_error.inc()
        self._reg_batch.observe(_count("batch_size", batch_size))


class DecodeMetrics(_TransferMixin, _DpQueryMixin):
    """Decode server (one per TP rank process). Live: active requests, metadata slots,
    KV pages in use / quarantined / total, transport rooms (``bind(scheduler.stats)``)."""

    role = Role.DECODE

    def __init__(self, registry: CollectorRegistry | None = None, *, transport: str) -> None:
        super().__init__(registry)
        self._init_requests()
        self._init_transfer(transport)
        self._init_dp_queries()


class PrefillMetrics(_TransferMixin, _DpRegisterMixin):
    """Prefill: the DP controller (dispatch, registrations, requests that end in the
    controller) and each worker process (pages, transfers, requests it ran), each with
    its own endpoint. Live (workers): active requests, KV pages, transport rooms
    (``bind(worker.stats)``)."""

    role = Role.PREFILL

    def __init__(self, registry: CollectorRegistry | None = None, *, transport: str) -> None:
        super().__init__(registry)
        self._init_requests()
        self._init_transfer(transport)
        self._init_dp_registrations()


class BootstrapMetrics(_DpQueryMixin, _DpRegisterMixin):
    """Bootstrap service (standalone, or embedded in a prefill controller's registry).
    Live: table size, capacity, expired and evicted rooms (``bind_table``)."""

    role = Role.BOOTSTRAP

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self._init_dp_queries()
        self._init_dp_registrations()

    def bind_table(self, stats: SnapshotFn) -> None:
        """``stats`` returns the room table's :class:`~pdgrpc.bootstrap.table.TableStats`
        (``lambda: table.stats``); its expired/evicted totals become counters."""
        self.bind(stats)


class RouterMetrics(_RequestsMixin):
    """Router. Live: active requests (``bind(lambda: {"active_requests": servicer.active})``)."""

    role = Role.ROUTER

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self._init_requests()
        self._ttft = self._fam.histogram("pdgrpc_time_to_first_token_seconds").labels(self.role.value)
        self._tokens = self._fam.counter("pdgrpc_output_tokens_total").labels(self.role.value)
        self._retries = self._fam.counter("pdgrpc_retries_total").labels(self.role.value)
        self._ejections = self._fam.counter("pdgrpc_ejections_total").labels(self.role.value)

    def on_retry(self) -> None:
        """A request went again to another prefill or decode after its call to one failed
        UNAVAILABLE before its first token."""
        self._retries.inc()

    def on_eject(self) -> None:
        """A prefill or decode instance is passed over for a while: a call to it failed
        UNAVAILABLE."""
        self._ejections.inc()

    def on_first_token(self, seconds: float) -> None:
        """The first token of a request reached the client ``seconds`` after it arrived."""
        self._ttft.observe(_seconds("seconds", seconds))

    def on_tokens(self, n: int) -> None:
        """``n`` generated tokens were streamed to a client."""
        self._tokens.inc(_count("n", n))
