"""Live metrics: read at scrape time from the server's own objects, so they cannot drift.

A server does not *count* slots or pages in use -- counting twice (once in the allocator,
once in a gauge) is how gauges drift after an abort path forgets a ``dec()``. Instead it
binds a callable that returns a snapshot of its state, and :class:`ResourceGauges` calls
it on every scrape::

    metrics.bind(scheduler.stats)          # decode: {"slots_in_use": ..., "pages_total": ...}
    metrics.bind(worker.stats)             # prefill worker: a ResourceStats proto
    metrics.bind(lambda: server.table.stats)   # bootstrap: TableStats

A snapshot is a mapping or any object with attributes; the catalog's ``field`` of each
live metric (``slots_in_use``, ``pages_total``, ``size``, ``expired``...) is looked up in
it. A field the snapshot lacks is simply not exposed. The callable is called once per
scrape and role, so all gauges of one scrape come from the same snapshot, and never
before the first scrape (binding before the server is fully up is fine).

**Threading.** The callable runs on the metrics HTTP thread, not on the server's event
loop. It must be cheap and must not await or lock the loop; reading integer counters of
pure-Python allocators is safe under the GIL (a snapshot taken mid-update may be off by
one request for one scrape, never cumulatively). A callable that raises is logged and its
metrics are left out of that scrape; the other roles' metrics are still served.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdgrpc.metrics.catalog import CATALOG, MetricSpec, Role

__all__ = ["ResourceGauges", "SnapshotFn"]

log = logging.getLogger("pdgrpc.metrics")

SnapshotFn = Callable[[], object]

_LIVE: tuple[MetricSpec, ...] = tuple(m for m in CATALOG if m.live)


def _family(spec: MetricSpec) -> GaugeMetricFamily | CounterMetricFamily:
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels))
    return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))


def _read(snapshot: object, field: str) -> float | None:
    if isinstance(snapshot, Mapping):
        value = snapshot.get(field)
    else:
        value = getattr(snapshot, field, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"snapshot field {field!r} is {value!r}, not a number")
    return float(value)


class ResourceGauges(Collector):
    """The live metrics of one registry; one snapshot source per role.

    Use the role facades' ``bind`` rather than this class directly; it exists on its
    own so the scrape-time contract is in one place."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        self._sources: dict[Role, SnapshotFn] = {}
        registry.register(self)

    def bind(self, role: Role, snapshot: SnapshotFn) -> None:
        """Serve every live metric the catalog lists for ``role`` from ``snapshot()``,
        called on every scrape. One source per role and registry: a second one would
        expose every gauge twice."""
        if not callable(snapshot):
            raise TypeError(f"bind() needs a callable returning a snapshot, got {snapshot!r}")
        with self._lock:
            if role in self._sources:
                raise ValueError(f"a snapshot source for role {role.value!r} is already bound to this registry")
            self._sources[role] = snapshot

    def unbind(self, role: Role) -> None:
        """Stop serving ``role``'s live metrics (e.g. once the server object is closed)."""
        with self._lock:
            self._sources.pop(role, None)

    def describe(self) -> Iterator[Metric]:
        # Names only: lets the registry detect clashes without calling any snapshot (the
        # server may not be ready when its facade is created).
        for spec in _LIVE:
            yield _family(spec)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = list(self._sources.items())
        snapshots: list[tuple[Role, object]] = []
        for role, fn in sources:
            try:
                snapshots.append((role, fn()))
            except Exception:  # one broken source must not take the whole scrape down
                log.warning("metrics: the %s snapshot callable failed; its live metrics are left out of this scrape", role.value, exc_info=True)
        for spec in _LIVE:
            fam = _family(spec)
            assert spec.field is not None
            for role, snap in snapshots:
                if role not in spec.roles:
                    continue
                try:
                    value = _read(snap, spec.field)
                except TypeError:
                    log.warning("metrics: %s snapshot: bad value for %s", role.value, spec.name, exc_info=True)
                    continue
                if value is not None:
                    fam.add_metric([role.value], value)
            if fam.samples:
                yield fam
