"""Per-room transfer status, shared by transports (which report it) and the state
machines (which gate and reduce it).

It lives outside both packages because imports flow one way: ``pdgrpc.transport``
must not depend on ``pdgrpc.state``, yet both speak this enum.

The numeric order is load-bearing: per-rank states are combined with MIN (an all-reduce
across tensor-parallel ranks), so the least advanced rank decides, and FAILED (0) beats
everything.
"""

from __future__ import annotations

import enum


class KVPoll(enum.IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def is_terminal(self) -> bool:
        return self in (KVPoll.FAILED, KVPoll.SUCCESS)
