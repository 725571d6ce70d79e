"""Operator metrics for pdgrpc's servers (Prometheus text over HTTP).

Three pieces, each in its own module:

* :mod:`~pdgrpc.metrics.catalog` -- every metric as data (name, type, help with unit,
  labels, which roles record it). ``python -m pdgrpc.metrics`` prints it as the
  table in docs/metrics.md.
* :mod:`~pdgrpc.metrics.roles` -- the facade a server records through:
  :class:`DecodeMetrics`, :class:`PrefillMetrics`, :class:`BootstrapMetrics`,
  :class:`RouterMetrics`. Events (``on_abort(reason)``, ``on_transfer(bytes, seconds)``,
  ``on_dp_rank_query(batch_size)``...) are counters and histograms; live state (slots,
  pages, table size) is read at scrape time from the server's own objects through
  ``bind(snapshot_callable)`` and so cannot drift.
* :mod:`~pdgrpc.metrics.endpoint` -- ``--metrics-port`` (:func:`add_metrics_arguments`) and
  the endpoint (:func:`start_metrics_server`, :func:`start_metrics_from_args`).

The abort vocabulary is :mod:`pdgrpc.reasons` (torch-free, at the bottom of the package).
No facade imports torch, so the router and the bootstrap start without it.

Each server owns a :class:`prometheus_client.CollectorRegistry` (the facade creates
one); nothing here touches prometheus-client's process-global registry.
"""

from pdgrpc.metrics.catalog import CATALOG, Role, markdown_table
from pdgrpc.metrics.endpoint import (
    add_metrics_arguments,
    derived_metrics_port,
    start_metrics_from_args,
    start_metrics_server,
)
from pdgrpc.metrics.roles import BootstrapMetrics, DecodeMetrics, PrefillMetrics, RouterMetrics
from pdgrpc.reasons import ServerAbortReason

__all__ = [
    "BootstrapMetrics",
    "CATALOG",
    "DecodeMetrics",
    "PrefillMetrics",
    "Role",
    "RouterMetrics",
    "ServerAbortReason",
    "add_metrics_arguments",
    "derived_metrics_port",
    "markdown_table",
    "start_metrics_from_args",
    "start_metrics_server",
]

