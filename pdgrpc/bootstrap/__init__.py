"""The bootstrap service: prefill workers' registry and the room → prefill dp-rank table.

* :mod:`~pdgrpc.bootstrap.table` — :class:`RoomTable`, pure: TTL, hard cap (new rooms
  refused past it), incremental expiry, bounded memory; its slots (the hash table) are
  :mod:`~pdgrpc.bootstrap.room_slots`.
* :mod:`~pdgrpc.bootstrap.registry` — :class:`WorkerRegistry`, pure: topology fixed by
  the first worker, generations on re-registration.
* :mod:`~pdgrpc.bootstrap.failures` — :class:`RoomFailures`, pure: rooms whose prefill
  failed in the prefill's controller, found only by a tag under the room's secret.
* :mod:`~pdgrpc.bootstrap.service` — the grpc.aio servicer and
  :func:`start_bootstrap_server`.
* :mod:`~pdgrpc.bootstrap.client` — :class:`BootstrapClient` (pooled channel, deadlines,
  retried registration).
* ``python -m pdgrpc.bootstrap --help`` — the server as a process.

Names are imported lazily, so ``python -m pdgrpc.bootstrap`` can configure gRPC before
grpc is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "BootstrapClient": "pdgrpc.bootstrap.client",
    "BootstrapUnavailable": "pdgrpc.bootstrap.client",
    "QueryResult": "pdgrpc.bootstrap.client",
    "WorkerRegistry": "pdgrpc.bootstrap.registry",
    "BootstrapConfig": "pdgrpc.bootstrap.service",
    "BootstrapServer": "pdgrpc.bootstrap.service",
    "BootstrapServicer": "pdgrpc.bootstrap.service",
    "start_bootstrap_server": "pdgrpc.bootstrap.service",
    "RegisterResult": "pdgrpc.bootstrap.table",
    "RoomTable": "pdgrpc.bootstrap.table",
    "TableStats": "pdgrpc.bootstrap.table",
}

if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load on first use
    from pdgrpc.bootstrap.client import BootstrapClient, BootstrapUnavailable, QueryResult
    from pdgrpc.bootstrap.registry import WorkerRegistry
    from pdgrpc.bootstrap.service import BootstrapConfig, BootstrapServer, BootstrapServicer, start_bootstrap_server
    from pdgrpc.bootstrap.table import RegisterResult, RoomTable, TableStats

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdgrpc.bootstrap' has no attribute {name!r}")
