"""The room table's default bounds, in a module that imports nothing: the flags of
``python -m pdgrpc.bootstrap`` and :class:`~pdgrpc.bootstrap.service.BootstrapConfig`
take them as defaults without loading the table, whose numpy a command that only parses
its flags (``--help``) has no use for."""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_BATCH", "DEFAULT_MAX_ROOMS", "DEFAULT_TTL_S", "MAX_ROOMS_LIMIT"]

DEFAULT_TTL_S = 120.0  # seconds a room -> rank entry lives after its last registration
DEFAULT_MAX_ROOMS = 1 << 20  # rooms held at most
MAX_ROOMS_LIMIT = 1 << 30  # the largest max_rooms a table takes: its slots are indexed in 32 bits
DEFAULT_MAX_BATCH = 65536  # rooms per RegisterDpRanks / QueryDpRanks call
