"""The prometheus-client objects of one :class:`CollectorRegistry`, built from the catalog.

Each server owns a registry (several servers can share one test process, and a prefill
controller that embeds the bootstrap puts two roles in one registry). The objects of a
registry are created once, on first use, and shared by every role facade on it: two
facades registering ``pdgrpc_requests_total`` separately would clash, one family with a
``role`` label does not.
"""

from __future__ import annotations

import threading
import weakref

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from pdgrpc.metrics.catalog import CATALOG, MetricSpec
from pdgrpc.metrics.live import ResourceGauges

__all__ = ["Families", "families_of"]


class Families:
    """Counters, histograms, set gauges and the info metric of one registry, by catalog name, plus
    the registry's :class:`ResourceGauges` (the live metrics)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # No reference back to the registry: this object is the value of a weak-keyed
        # map, and a value that holds its key keeps it alive forever.
        self.counters: dict[str, Counter] = {}
        self.histograms: dict[str, Histogram] = {}
        self.gauges: dict[str, Gauge] = {}
        self.info: Info | None = None
        for spec in CATALOG:
            if spec.live:
                continue  # served by ResourceGauges
            self._create(spec, registry)
        self.resources = ResourceGauges(registry)

    def _create(self, spec: MetricSpec, r: CollectorRegistry) -> None:
        if spec.kind == "counter":
            # prometheus-client appends "_total" itself; the catalog spells the exposed name.
            self.counters[spec.name] = Counter(spec.name.removesuffix("_total"), spec.help, spec.labels, registry=r)
        elif spec.kind == "histogram":
            self.histograms[spec.name] = Histogram(spec.name, spec.help, spec.labels, registry=r, buckets=spec.buckets)
        elif spec.kind == "info":
            self.info = Info(spec.name.removesuffix("_info"), spec.help, spec.labels, registry=r)
        else:  # a gauge the server sets as its state changes
            self.gauges[spec.name] = Gauge(spec.name, spec.help, spec.labels, registry=r)

    def counter(self, name: str) -> Counter:
        return self.counters[name]

    def histogram(self, name: str) -> Histogram:
        return self.histograms[name]


_lock = threading.Lock()
# Weak keys: a test's registry and its metrics go away with the test.
_by_registry: "weakref.WeakKeyDictionary[CollectorRegistry, Families]" = weakref.WeakKeyDictionary()


def families_of(registry: CollectorRegistry) -> Families:
    """The (shared) metric objects of ``registry``, created on first use."""
    with _lock:
        fam = _by_registry.get(registry)
        if fam is None:
            fam = Families(registry)
            _by_registry[registry] = fam
        return fam
