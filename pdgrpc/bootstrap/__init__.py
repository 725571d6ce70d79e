"""The bootstrap service: prefill workers' registry and the room → prefill dp-rank table.

* :mod:`~pdgrpc.bootstrap.table` — :class:`RoomTable`, pure: TTL, hard cap (new rooms
  refused past it), incremental expiry, bounded memory; its slots (the hash table) are
  :mod:`~pdgrpc.bootstrap.room_slots`.
* :mod:`~pdgrpc.bootstrap.registry` — :class:`WorkerRegistry`, pure: topology fixed by
  the first complete registration, pending workers bounded per caller identity,
  generations on re-registration.
* :mod:`~pdgrpc.bootstrap.failures` — :class:`RoomFailures`, pure: rooms whose prefill
  failed in the prefill's controller, found only by a tag under the room's secret.
* :mod:`~pdgrpc.bootstrap.service` — the grpc.aio servicer and
  :func:`start_bootstrap_server`.
* :mod:`~pdgrpc.bootstrap.client` — :class:`BootstrapClient` (pooled channel, deadlines,
  retried registration).
* :mod:`~pdgrpc.bootstrap.server` — the service as a process (``python -m pdgrpc.bootstrap --help``).

The package itself imports nothing: ``python -m pdgrpc.bootstrap`` loads it before
:func:`~pdgrpc.serving.launch.launch` has set the environment gRPC reads on import.
"""
